//! nixl-tcp's same-host offer (the target's pid, its grant table's descriptor and
//! address) goes only to peers on the target's host. A client on "another host" (a
//! network namespace joined to this one by a veth pair) that asks for the same-host
//! path gets a plain no, and none of those; a client on this host asking at the
//! same routable address still gets the offer. Needs root and `ip` (iproute2);
//! skips visibly otherwise.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::Duration;

use nixl::Agent;
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};
use nixl_testkit::{figure, skip};

const CASE: &str = "nixl-tcp same-host offer to a client on another host";
/// The offer after its one-byte flag: pid, descriptor, address, nonce.
const OFFER_LEN: usize = 4 + 4 + 8 + 16;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A network namespace ("another host") joined to this one by a veth pair: this
/// side `here`, the namespace's side `there`. Removed on drop.
struct OtherHost {
    ns: String,
    veth: String,
    here: String,
    there: String,
}

impl OtherHost {
    fn create() -> Result<Self, String> {
        let id = std::process::id() % 10_000;
        let subnet = 150 + std::process::id() % 50;
        let h = Self {
            ns: format!("nixl-so-{id}"),
            veth: format!("nxso{id}"),
            here: format!("10.{subnet}.{}.1", id % 250),
            there: format!("10.{subnet}.{}.2", id % 250),
        };
        let peer = format!("nxsp{id}");
        ip(&["netns", "add", &h.ns])?;
        ip(&[
            "link", "add", &h.veth, "type", "veth", "peer", "name", &peer,
        ])?;
        ip(&["link", "set", &peer, "netns", &h.ns])?;
        ip(&["addr", "add", &format!("{}/24", h.here), "dev", &h.veth])?;
        ip(&["link", "set", &h.veth, "up"])?;
        let there = format!("{}/24", h.there);
        ip(&["-n", &h.ns, "addr", "add", &there, "dev", &peer])?;
        ip(&["-n", &h.ns, "link", "set", &peer, "up"])?;
        ip(&["-n", &h.ns, "link", "set", "lo", "up"])?;
        Ok(h)
    }

    /// Run `f` on a thread of its own inside the other host's network namespace
    /// (sockets it opens live there).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.ns);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).expect("the namespace");
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .expect("setns into the other host");
            f()
        })
        .join()
        .expect("the other host's thread")
    }
}

impl Drop for OtherHost {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.veth]);
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

/// What a client asking for the same-host path was told.
#[derive(Debug)]
struct Told {
    /// The hello reply's status.
    status: u8,
    /// The offer flag (1: an offer follows).
    offered: u8,
    /// Every byte that followed the flag within a short wait.
    after: Vec<u8>,
}

/// Say hello to the nixl-tcp target at `addr`, ask for the same-host path, and
/// read what comes back (blocking; on the calling thread's network namespace).
fn ask_for_the_offer(addr: SocketAddr) -> Told {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = nixl_tcp::wire_hello("mallory");
    hello.push(1); // the same-host request: yes
    s.write_all(&hello).unwrap();
    let mut reply = [0u8; 8];
    s.read_exact(&mut reply)
        .expect("the hello reply and the offer flag");
    // Whatever follows the flag: the offer, if any (it follows at once).
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut after = Vec::new();
    let mut b = [0u8; 256];
    while let Ok(n @ 1..) = s.read(&mut b) {
        after.extend_from_slice(&b[..n]);
        if after.len() >= OFFER_LEN {
            break;
        }
    }
    Told {
        status: reply[6],
        offered: reply[7],
        after,
    }
}

/// Hole 9 of issue 39: the grant table was offered to any client that asked,
/// leaking the target's pid and the table's address to other hosts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_another_host_gets_no_same_host_offer() {
    let other = match OtherHost::create() {
        Ok(h) => h,
        Err(e) => return skip(CASE, format!("cannot make a network namespace: {e}")),
    };
    let b = TcpBackend::with_options(TcpOptions {
        listener: nixl::control::ListenerOptions {
            listen: Some(format!("{}:0", other.here).parse().unwrap()),
            ..nixl::control::ListenerOptions::default()
        },
        same_host: SameHost::Auto,
        ..TcpOptions::default()
    });
    let target = Agent::builder("target")
        .backend(b.clone())
        .build()
        .await
        .unwrap();
    let _mem = target.register(target.alloc(4096).unwrap()).unwrap();
    let addr = b.local_addr().unwrap();
    let pid = std::process::id().to_le_bytes();

    let remote = other.run(move || ask_for_the_offer(addr));
    assert_eq!(remote.status, 0, "the hello is served: {remote:?}");
    assert_eq!(
        (remote.offered, remote.after.len()),
        (0, 0),
        "no offer, nothing after the flag, for a client on another host: {remote:?}"
    );
    assert!(
        !remote.after.windows(4).any(|w| w == pid),
        "the target's pid reached another host: {remote:?}"
    );

    // From this host, at the same routable address: the path is offered.
    let local = tokio::task::spawn_blocking(move || ask_for_the_offer(addr))
        .await
        .unwrap();
    assert_eq!((local.status, local.offered), (0, 1), "{local:?}");
    assert_eq!(local.after.len(), OFFER_LEN, "{local:?}");
    assert_eq!(&local.after[..4], &pid, "the offer names this process");
    figure(
        "hostile: nixl-tcp same-host offer asked from another host (veth + network namespace)",
        format!(
            "remote client: offer flag {}, {} bytes of offer (pid, table fd and address withheld); a client on this host at the same address: offered",
            remote.offered,
            remote.after.len()
        ),
    );
    let report = target.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
}
