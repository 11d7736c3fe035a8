//! Network faults between real separate hosts: two network namespaces joined by a veth
//! pair, an agent process in each. The link is cut mid-transfer: in-flight transfers
//! fail within the dead-peer bound (no hang); after the link returns, new transfers
//! succeed. Needs root and `ip` (iproute2); skips visibly otherwise.

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nixl_conformance::support::skip;

struct Net {
    a: String,
    b: String,
    veth_b: String,
    addr_a: String,
    addr_b: String,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Net {
    fn create() -> Result<Self, String> {
        let id = std::process::id() % 10_000;
        let subnet = 200 + std::process::id() % 50;
        let n = Self {
            a: format!("nixl-fa-{id}"),
            b: format!("nixl-fb-{id}"),
            veth_b: format!("nxfb{id}"),
            addr_a: format!("10.{subnet}.{}.1", id % 250),
            addr_b: format!("10.{subnet}.{}.2", id % 250),
        };
        let veth_a = format!("nxfa{id}");
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), n.a.clone()],
            vec!["netns".into(), "add".into(), n.b.clone()],
            vec![
                "link".into(),
                "add".into(),
                veth_a.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                n.veth_b.clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                veth_a.clone(),
                "netns".into(),
                n.a.clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                n.veth_b.clone(),
                "netns".into(),
                n.b.clone(),
            ],
            vec![
                "-n".into(),
                n.a.clone(),
                "addr".into(),
                "add".into(),
                format!("{}/24", n.addr_a),
                "dev".into(),
                veth_a.clone(),
            ],
            vec![
                "-n".into(),
                n.b.clone(),
                "addr".into(),
                "add".into(),
                format!("{}/24", n.addr_b),
                "dev".into(),
                n.veth_b.clone(),
            ],
            vec![
                "-n".into(),
                n.a.clone(),
                "link".into(),
                "set".into(),
                veth_a.clone(),
                "up".into(),
            ],
            vec![
                "-n".into(),
                n.b.clone(),
                "link".into(),
                "set".into(),
                n.veth_b.clone(),
                "up".into(),
            ],
            vec![
                "-n".into(),
                n.a.clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ],
            vec![
                "-n".into(),
                n.b.clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ],
        ];
        for s in steps {
            let args: Vec<&str> = s.iter().map(String::as_str).collect();
            if !ip(&args) {
                return Err(format!(
                    "`ip {}` failed (needs root and iproute2)",
                    args.join(" ")
                ));
            }
        }
        Ok(n)
    }

    fn link(&self, up: bool) {
        assert!(ip(&[
            "-n",
            &self.b,
            "link",
            "set",
            &self.veth_b,
            if up { "up" } else { "down" }
        ]));
    }

    fn spawn(&self, ns: &str, listen: &str, bin: &str, args: &[&str]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", ns, bin])
            .args(args)
            .env("NIXL_TCP_LISTEN", format!("{listen}:0"))
            .env("NIXL_TCP_DEAD_PEER_MS", "2000")
            // The namespaces stand for two hosts: keep data on the link being cut.
            .env("NIXL_TCP_SAME_HOST", "off")
            .env("NIXL_TCP_CONNECT_MS", "1000")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn in namespace")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        ip(&["netns", "del", &self.a]);
        ip(&["netns", "del", &self.b]);
    }
}

/// Lines of a child's stdout, read on a thread, with timeouts.
struct Out(mpsc::Receiver<String>);

impl Out {
    fn new(lines: Lines<BufReader<ChildStdout>>) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Self(rx)
    }

    fn next(&self, within: Duration, what: &str) -> String {
        self.0
            .recv_timeout(within)
            .unwrap_or_else(|_| panic!("no {what} within {within:?} (hang?)"))
    }
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn link_cut_mid_transfer_then_restored() {
    let net = match Net::create() {
        Ok(n) => n,
        Err(why) => {
            skip("link_cut_mid_transfer_then_restored", &why);
            return;
        }
    };
    let mut target = Kill(net.spawn(
        &net.b,
        &net.addr_b,
        env!("CARGO_BIN_EXE_nixl-peer"),
        &[&(4usize << 20).to_string()],
    ));
    let tout = Out::new(BufReader::new(target.0.stdout.take().unwrap()).lines());
    let md = tout.next(Duration::from_secs(10), "target metadata");
    let md = md
        .strip_prefix("METADATA ")
        .expect("metadata line")
        .to_owned();
    let mut init = Kill(net.spawn(
        &net.a,
        &net.addr_a,
        env!("CARGO_BIN_EXE_nixl-fault-initiator"),
        &[],
    ));
    let mut stdin = init.0.stdin.take().unwrap();
    writeln!(stdin, "{md}").unwrap();
    let out = Out::new(BufReader::new(init.0.stdout.take().unwrap()).lines());
    // The link cut only bites on TCP: namespaces share one kernel, so the
    // same-host path (turned off for these children) would bypass the veth pair.
    let path = out.next(Duration::from_secs(10), "the data path");
    assert!(path.starts_with("PATH TCP"), "the data path: {path}");
    // Transfers flow across the veth pair.
    for _ in 0..5 {
        let l = out.next(Duration::from_secs(10), "a transfer result");
        assert!(l.starts_with("OK"), "before the cut: {l}");
    }
    // Cut the link mid-transfer.
    net.link(false);
    let cut = Instant::now();
    let first_err = loop {
        let l = out.next(Duration::from_secs(15), "a failure after the cut");
        if l.starts_with("ERR") {
            break l;
        }
    };
    let noticed = cut.elapsed();
    println!("link cut: first failure after {noticed:?}: {first_err}");
    assert!(
        first_err.starts_with("ERR RemoteDisconnected") || first_err.starts_with("ERR TimedOut"),
        "{first_err}"
    );
    assert!(
        noticed < Duration::from_secs(10),
        "dead-peer bound is 2 s; noticed after {noticed:?}"
    );
    // Failures keep coming, each bounded (connects time out), no hang.
    for _ in 0..2 {
        let l = out.next(Duration::from_secs(10), "a bounded failure while cut");
        println!("while cut: {l}");
    }
    // Restore: new transfers succeed.
    net.link(true);
    let restored = Instant::now();
    loop {
        let l = out.next(Duration::from_secs(20), "success after the link returned");
        if l.starts_with("OK") {
            break;
        }
    }
    println!(
        "link restored: transfers succeed again after {:?}",
        restored.elapsed()
    );
    nixl_conformance::support::figure(
        "network link cut mid-transfer (namespaces)",
        format!("1 injected, failure noticed after {noticed:?} (bound 2 s), transfers resumed {:?} after restore", restored.elapsed()),
    );
    writeln!(stdin, "stop").unwrap();
    let l = loop {
        let l = out.next(Duration::from_secs(20), "initiator shutdown");
        if l.starts_with("STOPPED") {
            break l;
        }
    };
    assert!(l.contains("clean=true"), "{l}");
    assert!(init.0.wait().unwrap().success());
    drop(target);
}
