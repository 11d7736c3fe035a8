//! nixl-rs agents working with real NIXL agents (the `nixl-cu12` 1.5.1 wheel's Python
//! API, in a child process: `tests/nixl_peer.py`), over nixl-ucx bound to the wheel's
//! own libucp (both sides must bind the same UCX build).
//!
//! Needs `NIXL_TEST_NIXL_WHEEL_DIR`: a directory the wheel was installed into with
//! `pip install --no-deps --target DIR nixl-cu12==1.5.1 numpy` (`.ci/run` does it).
//! Without it every case prints a SKIP line. Transports: UCX's defaults, or
//! `UCX_TLS` as set (the test script runs both the defaults and `tcp,self`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Once;
use std::time::{Duration, Instant};

use nixl::{Agent, AgentOptions, ErrorKind, Registration};
use nixl_conformance::support::{figure, skip, HANG};
use nixl_ucx::{UcxBackend, UcxOptions};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use nixl_testkit::nixl_wheel as wheel;

/// The wheel's UCX crashes at exit on hosts without RDMA unless its ib module is off;
/// both sides use loopback only.
fn ucx_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY-free in edition 2021; set before UCX is first loaded in this process.
        std::env::set_var("UCX_NET_DEVICES", "lo");
        std::env::set_var("UCX_MODULES", "^ib");
    });
}

/// A NIXL agent in a Python child process.
struct NixlPeer {
    name: String,
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    /// The registered buffer in the child.
    addr: u64,
    len: u64,
}

impl NixlPeer {
    async fn start(wheel: &Path, name: &str, len: usize, listen: Option<u16>) -> Self {
        Self::start_with(wheel, name, len, listen, &[]).await
    }

    async fn start_with(
        wheel: &Path,
        name: &str,
        len: usize,
        listen: Option<u16>,
        env: &[(&str, String)],
    ) -> Self {
        let mut cmd = Command::new("python3");
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("nixl_peer.py"))
            .arg(name)
            .arg(len.to_string());
        if let Some(p) = listen {
            cmd.arg(p.to_string());
        }
        let mut child = cmd
            .env("PYTHONPATH", wheel)
            .env("UCX_NET_DEVICES", "lo")
            .env("UCX_MODULES", "^ib")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs");
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut peer = Self {
            name: name.to_owned(),
            child,
            stdin,
            lines,
            addr: 0,
            len: 0,
        };
        let ready = peer.answer().await.expect("the NIXL agent starts");
        let mut w = ready.split_whitespace().skip(1);
        peer.addr = w.next().unwrap().parse().unwrap();
        peer.len = w.next().unwrap().parse().unwrap();
        peer
    }

    /// The next answer line: `Ok(rest)` for "@@ OK rest", `Err(rest)` for "@@ ERR".
    async fn answer(&mut self) -> Result<String, String> {
        let read = async {
            loop {
                let Some(line) = self.lines.next_line().await.expect("child stdout") else {
                    return Err("the NIXL agent exited".to_owned());
                };
                if let Some(rest) = line.strip_prefix("@@ OK") {
                    return Ok(rest.trim().to_owned());
                }
                if let Some(rest) = line.strip_prefix("@@ ERR") {
                    return Err(rest.trim().to_owned());
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .unwrap_or_else(|_| Err("no answer from the NIXL agent within 60 s".into()))
    }

    async fn cmd(&mut self, line: &str) -> Result<String, String> {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| format!("writing to the NIXL agent: {e}"))?;
        self.answer().await
    }

    async fn ok(&mut self, line: &str) -> String {
        match self.cmd(line).await {
            Ok(v) => v,
            Err(e) => panic!("NIXL agent {:?}: {line:?} failed: {e}", self.name),
        }
    }

    async fn metadata(&mut self) -> Vec<u8> {
        hex_decode(&self.ok("MD").await)
    }

    async fn load(&mut self, md: &[u8]) -> String {
        self.ok(&format!("LOAD {}", hex(md))).await
    }

    async fn fill(&mut self, off: u64, len: u64, byte: u8) {
        self.ok(&format!("FILL {off} {len} {byte}")).await;
    }

    async fn dump(&mut self, off: u64, len: u64) -> Vec<u8> {
        hex_decode(&self.ok(&format!("DUMP {off} {len}")).await)
    }

    /// Wait for `count` notifications: (sender, message).
    async fn notifs(&mut self, count: usize) -> Vec<(String, Vec<u8>)> {
        let got = self.ok(&format!("NOTIFS {count} 20")).await;
        got.split_whitespace()
            .skip(1)
            .map(|w| {
                let (p, m) = w.rsplit_once(':').unwrap();
                (p.to_owned(), hex_decode(m))
            })
            .collect()
    }

    async fn exit(mut self) {
        let _ = self.cmd("EXIT").await;
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

/// Hex for the NIXL peer's commands, `-` for empty.
fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "-".into();
    }
    nixl_conformance::support::hex(b)
}

fn hex_decode(s: &str) -> Vec<u8> {
    if s == "-" || s.is_empty() {
        return Vec::new();
    }
    nixl_conformance::support::unhex(s).expect("the NIXL peer answers hex")
}

/// A nixl-rs agent on nixl-ucx bound to the wheel's libucp.
async fn rust_agent(name: &str, ucp: &Path) -> Agent {
    ucx_env();
    let backend = UcxBackend::with_options(UcxOptions {
        library: Some(ucp.to_owned()),
        max_notification: 8 << 20,
        dead_peer_timeout: Some(Duration::from_secs(5)),
        ..UcxOptions::default()
    })
    .expect("nixl-ucx binds the wheel's libucp");
    Agent::builder(name)
        .backend(backend)
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(10),
        })
        .build()
        .await
        .expect("agent builds")
}

fn read(reg: &Registration, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    reg.read_at(off, &mut v).unwrap();
    v
}

/// Both agents, knowing each other, and our registered buffer.
async fn pair(case: &str, len: usize) -> Option<(Agent, Registration, NixlPeer, PathBuf)> {
    let (dir, ucp) = wheel(case)?;
    let ours = rust_agent("rust-agent", &ucp).await;
    let reg = ours.register(vec![0u8; len]).unwrap();
    let mut nixl = NixlPeer::start(&dir, "nixl-agent", len, None).await;
    let name = ours.load_metadata(&nixl.metadata().await).unwrap();
    assert_eq!(name, "nixl-agent");
    assert!(ours.is_nixl_peer("nixl-agent").unwrap());
    let loaded = nixl.load(&ours.nixl_metadata().unwrap()).await;
    assert_eq!(loaded, "rust-agent");
    Some((ours, reg, nixl, dir))
}

async fn recv_notif(notes: &mut nixl::Notifications) -> nixl::Notification {
    use futures_util::StreamExt;
    tokio::time::timeout(HANG, notes.next())
        .await
        .expect("a notification within the bound")
        .expect("the stream stays open")
}

const CASE_LEN: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn we_write_and_read_nixl_memory() {
    let Some((ours, reg, mut nixl, _)) = pair("we_write_and_read_nixl_memory", CASE_LEN).await
    else {
        return;
    };
    let remote = ours.remote_regions("nixl-agent").unwrap();
    assert_eq!(remote.len(), 1);
    assert_eq!((remote[0].addr, remote[0].len), (nixl.addr, nixl.len));

    // WRITE 64 KiB of a pattern at offset 4096, with a notification after the data.
    let data = nixl_conformance::support::pattern(7, 65536);
    reg.write_at(0, &data).unwrap();
    let local = one(reg.desc(0, 65536));
    let target = one(remote[0].desc(4096, 65536));
    tokio::time::timeout(
        HANG,
        ours.write(&local, "nixl-agent", &target, Some("written".into())),
    )
    .await
    .unwrap()
    .unwrap();
    let notes = nixl.notifs(1).await;
    assert_eq!(notes, vec![("rust-agent".to_owned(), b"written".to_vec())]);
    // NIXL delivers the notification after the data: the bytes are there.
    assert!(
        nixl.dump(4096, 65536).await == data,
        "NIXL's memory holds what we wrote"
    );
    assert_eq!(
        nixl.dump(0, 16).await,
        vec![0u8; 16],
        "bytes before untouched"
    );

    // READ: NIXL fills a range, we read it.
    nixl.fill(200_000, 3000, 0xab).await;
    let local = one(reg.desc(100_000, 3000));
    let source = one(remote[0].desc(200_000, 3000));
    tokio::time::timeout(HANG, ours.read(&local, "nixl-agent", &source, None))
        .await
        .unwrap()
        .unwrap();
    assert!(
        read(&reg, 100_000, 3000) == vec![0xab; 3000],
        "we read NIXL's bytes"
    );
    drop(reg);
    nixl.exit().await;
    assert!(ours.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_writes_and_reads_our_memory() {
    let Some((ours, reg, mut nixl, _)) = pair("nixl_writes_and_reads_our_memory", CASE_LEN).await
    else {
        return;
    };
    let mut notes = ours.notifications().unwrap();
    let ours_addr = reg.addr();

    nixl.fill(0, 65536, 0x5c).await;
    let r = nixl
        .ok(&format!(
            "XFER WRITE rust-agent 0 65536 {} {}",
            ours_addr + 8192,
            hex(b"from nixl")
        ))
        .await;
    assert_eq!(r, "DONE");
    let n = recv_notif(&mut notes).await;
    assert_eq!(
        (n.peer.as_str(), &n.msg[..]),
        ("nixl-agent", &b"from nixl"[..])
    );
    assert!(
        read(&reg, 8192, 65536) == vec![0x5c; 65536],
        "NIXL wrote our memory"
    );
    assert!(
        read(&reg, 0, 8192) == vec![0; 8192],
        "bytes before untouched"
    );

    let data = nixl_conformance::support::pattern(3, 4096);
    reg.write_at(500_000, &data).unwrap();
    let r = nixl
        .ok(&format!(
            "XFER READ rust-agent 300000 4096 {} {}",
            ours_addr + 500_000,
            hex(b"read done")
        ))
        .await;
    assert_eq!(r, "DONE");
    assert!(
        nixl.dump(300_000, 4096).await == data,
        "NIXL read our bytes"
    );
    let n = recv_notif(&mut notes).await;
    assert_eq!(&n.msg[..], b"read done");
    drop(reg);
    nixl.exit().await;
    assert!(ours.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_notifications_both_ways() {
    let Some((ours, reg, mut nixl, _)) = pair("standalone_notifications_both_ways", 4096).await
    else {
        return;
    };
    let mut notes = ours.notifications().unwrap();
    for i in 0..5u8 {
        tokio::time::timeout(HANG, ours.notify("nixl-agent", vec![i; 3]).unwrap())
            .await
            .unwrap()
            .unwrap();
    }
    let mut got: Vec<Vec<u8>> = nixl.notifs(5).await.into_iter().map(|(_, m)| m).collect();
    got.sort();
    assert_eq!(got, (0..5u8).map(|i| vec![i; 3]).collect::<Vec<_>>());
    nixl.ok(&format!("NOTIF rust-agent {}", hex(b"hello rust")))
        .await;
    let n = recv_notif(&mut notes).await;
    assert_eq!(
        (n.peer.as_str(), &n.msg[..]),
        ("nixl-agent", &b"hello rust"[..])
    );

    // 4 MiB both ways.
    let big = nixl_conformance::support::pattern(11, 4 << 20);
    tokio::time::timeout(HANG, ours.notify("nixl-agent", big.clone()).unwrap())
        .await
        .unwrap()
        .unwrap();
    let got = nixl.notifs(1).await;
    assert_eq!(got[0].1.len(), big.len());
    assert!(got[0].1 == big, "the 4 MiB notification arrived intact");
    nixl.ok(&format!("NOTIF rust-agent {}", hex(&big))).await;
    let n = recv_notif(&mut notes).await;
    assert!(
        n.msg[..] == big[..],
        "NIXL's 4 MiB notification arrived intact"
    );
    drop(reg);
    nixl.exit().await;
    assert!(ours.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_nixl_agent_fails_our_transfers() {
    let Some((ours, reg, nixl, _)) = pair("killed_nixl_agent_fails_our_transfers", 64 << 20).await
    else {
        return;
    };
    let remote = ours.remote_regions("nixl-agent").unwrap()[0].clone();
    let local = one(reg.whole());
    let target = one(remote.desc(0, remote.len));
    // One round to be sure the connection works.
    tokio::time::timeout(HANG, ours.write(&local, "nixl-agent", &target, None))
        .await
        .unwrap()
        .unwrap();
    let NixlPeer { mut child, .. } = nixl;
    let req = ours.prep_remote("nixl-agent", &target).unwrap();
    let loc = ours.prep_local(&local).unwrap();
    let xfer = ours
        .make_request(
            nixl::Op::Write,
            &loc,
            nixl::Indices::All,
            &req,
            nixl::Indices::All,
            &nixl::RequestOptions::default(),
        )
        .unwrap();
    let started = Instant::now();
    let mut failed = None;
    child.start_kill().unwrap();
    // Keep posting until one fails: the first may finish before the kill lands.
    while started.elapsed() < HANG {
        match tokio::time::timeout(HANG, xfer.post(None).unwrap()).await {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => {
                failed = Some(e);
                break;
            }
            Err(_) => panic!("a transfer to a killed NIXL agent hung"),
        }
    }
    let e = failed.expect("transfers to a killed NIXL agent fail");
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    figure(
        "killed NIXL agent noticed",
        format!("after {:?}: {e}", started.elapsed()),
    );
    let _ = child.wait().await;
    drop(xfer);
    drop(reg);
    assert!(ours.shutdown().await.is_clean());
}

use nixl_testkit::double::one;
use nixl_testkit::free_port;

/// One WRITE each way with byte checks: proves both sides hold working metadata.
async fn both_ways_work(ours: &Agent, reg: &Registration, nixl: &mut NixlPeer) {
    let remote = ours.remote_regions(&nixl.name).unwrap()[0].clone();
    reg.write_at(0, &[0x11; 512]).unwrap();
    tokio::time::timeout(
        HANG,
        ours.write(
            &one(reg.desc(0, 512)),
            &nixl.name.clone(),
            &one(remote.desc(0, 512)),
            None,
        ),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(nixl.dump(0, 512).await, vec![0x11; 512]);
    nixl.fill(1024, 512, 0x22).await;
    let r = nixl
        .ok(&format!(
            "XFER WRITE rust-agent 1024 512 {} -",
            reg.addr() + 2048
        ))
        .await;
    assert_eq!(r, "DONE");
    assert_eq!(read(reg, 2048, 512), vec![0x22; 512]);
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < HANG, "{what} within the bound");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_through_nixls_listener_both_ways() {
    let case = "metadata_through_nixls_listener_both_ways";
    let Some((dir, ucp)) = wheel(case) else {
        return;
    };
    let opts = nixl::NixlListenerOptions::default();
    let ours = rust_agent("rust-agent", &ucp).await;
    let reg = ours.register(vec![0u8; 65536]).unwrap();
    let port = free_port();
    let mut nixl = NixlPeer::start(&dir, "nixl-agent", 65536, Some(port)).await;
    let at: std::net::SocketAddr = ([127, 0, 0, 1], port).into();

    // Asked by name for another agent, what NIXL's listener serves is refused.
    let e = tokio::time::timeout(
        HANG,
        ours.fetch_nixl_peer_metadata(at, "another-agent", &opts),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(e.kind(), nixl::ErrorKind::Mismatch, "{e}");
    assert!(ours.peers().is_empty(), "nothing was loaded");

    // We fetch from NIXL's listener, and send ours to it.
    let name = tokio::time::timeout(HANG, ours.fetch_nixl_metadata(at, &opts))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(name, "nixl-agent");
    assert!(ours.is_nixl_peer("nixl-agent").unwrap());
    ours.send_nixl_metadata(at, &opts).await.unwrap();
    nixl.ok("CHECK rust-agent 20").await;
    both_ways_work(&ours, &reg, &mut nixl).await;

    // We tell NIXL to forget us: it does.
    ours.invalidate_nixl_at(at, &opts).await.unwrap();
    nixl.ok("GONE rust-agent 20").await;

    // NIXL fetches from our listener and sends its metadata to it.
    ours.forget_peer("nixl-agent").unwrap();
    let ours_at = ours
        .listen_nixl(([127, 0, 0, 1], 0).into(), &opts)
        .await
        .unwrap();
    nixl.ok(&format!("FETCH rust-agent 127.0.0.1 {}", ours_at.port()))
        .await;
    nixl.ok(&format!("SENDMD 127.0.0.1 {}", ours_at.port()))
        .await;
    wait_until("NIXL's metadata arrives", || {
        ours.is_nixl_peer("nixl-agent").unwrap_or(false)
    })
    .await;
    both_ways_work(&ours, &reg, &mut nixl).await;

    // NIXL tells us to forget it: we do.
    nixl.ok(&format!("INVAL 127.0.0.1 {}", ours_at.port()))
        .await;
    wait_until("the NIXL agent is forgotten", || ours.peers().is_empty()).await;
    drop(reg);
    nixl.exit().await;
    assert!(ours.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_removes_and_reloads_our_agent() {
    let Some((ours, reg, mut nixl, _)) = pair("nixl_removes_and_reloads_our_agent", 65536).await
    else {
        return;
    };
    both_ways_work(&ours, &reg, &mut nixl).await;
    nixl.ok("REMOVE rust-agent").await;
    // Our metadata again, now with a second registration.
    let extra = ours.register(vec![0u8; 4096]).unwrap();
    assert_eq!(
        nixl.load(&ours.nixl_metadata().unwrap()).await,
        "rust-agent"
    );
    both_ways_work(&ours, &reg, &mut nixl).await;
    nixl.fill(0, 4096, 0x33).await;
    let r = nixl
        .ok(&format!("XFER WRITE rust-agent 0 4096 {} -", extra.addr()))
        .await;
    assert_eq!(r, "DONE", "the new registration is reachable");
    assert_eq!(read(&extra, 0, 4096), vec![0x33; 4096]);
    // The same metadata again is a no-op for NIXL; different connection info under a
    // known name (another agent called "rust-agent": a restart) is refused until
    // NIXL removes the name (NIXL's reload rule, in the README).
    assert_eq!(
        nixl.load(&ours.nixl_metadata().unwrap()).await,
        "rust-agent"
    );
    let (_, ucp) = wheel("nixl_removes_and_reloads_our_agent").unwrap();
    let impostor = rust_agent("rust-agent", &ucp).await;
    let e = nixl
        .cmd(&format!("LOAD {}", hex(&impostor.nixl_metadata().unwrap())))
        .await
        .unwrap_err();
    assert!(e.contains("NotAllowed"), "{e}");
    assert!(impostor.shutdown().await.is_clean());
    drop((reg, extra));
    nixl.exit().await;
    assert!(ours.shutdown().await.is_clean());
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_through_etcd_in_nixls_layout_both_ways() {
    use nixl::exchange::{EtcdExchange, EtcdOptions};
    let case = "metadata_through_etcd_in_nixls_layout_both_ways";
    let Some((dir, ucp)) = wheel(case) else {
        return;
    };
    let Some(etcd) = nixl_testkit::etcd::EtcdServer::start(case).await else {
        return;
    };
    let ours = rust_agent("rust-agent", &ucp).await;
    let reg = ours.register(vec![0u8; 65536]).unwrap();
    let ex = EtcdExchange::connect(
        &ours,
        EtcdOptions {
            endpoints: vec![etcd.endpoint()],
            ..EtcdOptions::default()
        }
        .nixl_layout(),
    )
    .await
    .unwrap();
    let mut nixl = NixlPeer::start_with(
        &dir,
        "nixl-agent",
        65536,
        None,
        &[("NIXL_ETCD_ENDPOINTS", etcd.endpoint())],
    )
    .await;
    assert_eq!(
        ex.key("nixl-agent", nixl::exchange::NIXL_FULL_LABEL),
        "/nixl/agents//nixl-agent/metadata",
        "NIXL's key, double slash and all"
    );
    nixl.ok("EPUB").await;
    ex.fetch("nixl-agent", HANG).await.unwrap();
    assert!(ours.is_nixl_peer("nixl-agent").unwrap());
    ex.publish().await.unwrap();
    nixl.ok("EFETCH rust-agent").await;
    both_ways_work(&ours, &reg, &mut nixl).await;

    // NIXL invalidates: its keys go and we forget it.
    nixl.ok("EINVAL").await;
    wait_until("the NIXL agent is forgotten", || ours.peers().is_empty()).await;
    // We invalidate: NIXL forgets us.
    ex.invalidate().await.unwrap();
    nixl.ok("GONE rust-agent 20").await;
    drop(reg);
    nixl.exit().await;
    assert!(ours.shutdown().await.is_clean());
}

/// Debian 12's UCX 1.13 cannot talk to the wheel's UCX 1.23: our transfers to the
/// NIXL agent (over tcp) fail with an error that says which UCX to bind, and nothing
/// aborts.
/// (The NIXL agent is not given our metadata: its connection attempts would reach
/// UCX 1.13, which then aborts the process on an assertion; see the README.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_ucx_build_fails_clearly() {
    let case = "another_ucx_build_fails_clearly";
    // It binds the host's UCX; the other cases bind the wheel's (one per process).
    if nixl_testkit::in_own_process(case) {
        return;
    }
    let Some((dir, _)) = wheel(case) else { return };
    ucx_env();
    // Over tcp; on shared memory (with UCX_POSIX_ERROR_HANDLING=y) UCX 1.13 does
    // reach UCX 1.23 for some operations, which proves nothing either way.
    let options = UcxOptions {
        library: Some("libucp.so.0".into()),
        ucx_config: vec![("TLS".into(), "tcp,self".into())],
        ..UcxOptions::default()
    };
    let backend = match UcxBackend::with_options(options) {
        Ok(b) => b,
        Err(e) if e.kind() == ErrorKind::UnavailableLibrary || e.kind() == ErrorKind::Mismatch => {
            return skip(
                case,
                &format!("the host's libucp.so.0 cannot be bound here: {e}"),
            );
        }
        Err(e) => panic!("{e}"),
    };
    let version = backend.library_report().version.clone().unwrap_or_default();
    if !version.starts_with("1.13") {
        return skip(case, &format!("the host's UCX is {version}, not 1.13"));
    }
    let ours = Agent::builder("rust-agent")
        .backend(backend)
        .build()
        .await
        .unwrap();
    let reg = ours.register(vec![0u8; 4096]).unwrap();
    let mut nixl = NixlPeer::start(&dir, "nixl-agent", 4096, None).await;
    ours.load_metadata(&nixl.metadata().await).unwrap();
    let remote = ours.remote_regions("nixl-agent").unwrap()[0].clone();
    let e = tokio::time::timeout(
        HANG,
        ours.write(
            &one(reg.desc(0, 64)),
            "nixl-agent",
            &one(remote.desc(0, 64)),
            None,
        ),
    )
    .await
    .expect("no hang")
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("UCX 1.13") && msg.contains("NIXL_UCX_LIB"),
        "{msg}"
    );
    drop(reg);
    nixl.exit().await;
    assert!(ours.shutdown().await.is_clean());
}
