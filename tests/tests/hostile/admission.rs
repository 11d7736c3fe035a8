//! Admission at the default open-files limit (1,024): another address opens 2,000
//! connections that complete their hello (nixl-tcp) or their first request (the
//! side channel) and then sit idle. The listener keeps at most its per-address share
//! of them, never runs the process out of descriptors, and a legitimate peer from
//! another address is served meanwhile.
//!
//! The idle connections come from a child process (this test binary again, the
//! ignored `idle_client_child`) bound to 127.0.0.2, so that their descriptors do not
//! count against the listener's process, whose soft limit the test lowers to the
//! usual default. The test itself runs in a process of its own (the limit is the
//! process's).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use nixl::{Agent, SideChannelOptions};
use nixl_conformance::support::{bounded, figure, one, pattern, remote, skip, tcp_agent};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};

const IDLE: usize = 2000;
const DEFAULT_FILES: u64 = 1024;
const CHILD: &str = "NIXL_TEST_IDLE_CLIENT";

/// Lower this process's soft open-files limit to the usual default.
fn default_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if l.current.is_none_or(|c| c > DEFAULT_FILES) {
        l.current = Some(DEFAULT_FILES);
        setrlimit(Resource::Nofile, l).expect("lowering the soft limit is always allowed");
    }
}

/// What the idle clients send once connected.
#[derive(Clone, Copy)]
enum Opening {
    /// nixl-tcp's hello, then "no same-host path" after the target's reply.
    TcpHello,
    /// A side-channel fetch of the full metadata (the reply is never read).
    SideChannelFetch,
}

/// The child: `IDLE` connections to the address in `CHILD`, from 127.0.0.2, each
/// opened as `NIXL_TEST_IDLE_OPENING` says; prints how many were accepted and still
/// open after a while, then holds them until stdin closes.
#[test]
#[ignore = "the child of the admission tests; run through them"]
fn idle_client_child() {
    use std::io::Read;
    use std::net::TcpStream;
    let Ok(addr) = std::env::var(CHILD) else {
        return;
    };
    let addr: SocketAddr = addr.parse().unwrap();
    {
        use rustix::process::{getrlimit, setrlimit, Resource};
        let mut l = getrlimit(Resource::Nofile);
        l.current = l.maximum;
        let _ = setrlimit(Resource::Nofile, l);
    }
    let opening = std::env::var("NIXL_TEST_IDLE_OPENING").unwrap();
    let mut socks = Vec::new();
    for _ in 0..IDLE {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&SocketAddr::from(([127, 0, 0, 2], 0)).into())
            .unwrap();
        if s.connect(&addr.into()).is_err() {
            continue;
        }
        let mut s: TcpStream = s.into();
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let ok = match opening.as_str() {
            "tcp" => {
                let mut reply = [0u8; 7];
                s.write_all(&nixl_tcp::wire_hello("idle")).is_ok()
                    && s.read_exact(&mut reply).is_ok()
                    && s.write_all(&[0]).is_ok()
            }
            _ => s.write_all(&fetch_frame()).is_ok(),
        };
        if ok {
            socks.push(s);
        }
    }
    // Give the listener time to settle, then count who is still open: a read that
    // times out (nothing more to read, not closed) means open.
    std::thread::sleep(Duration::from_millis(1500));
    let mut open = 0;
    let mut buf = [0u8; 4096];
    for s in &mut socks {
        s.set_read_timeout(Some(Duration::from_millis(2))).unwrap();
        let alive = loop {
            match s.read(&mut buf) {
                Ok(0) => break false,
                Ok(_) => continue,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    break true
                }
                Err(_) => break false,
            }
        };
        open += usize::from(alive);
    }
    println!("IDLE-CLIENTS {} {open}", socks.len());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// A side-channel frame: magic, version 2, kind Fetch (4), two zero bytes, no payload.
fn fetch_frame() -> Vec<u8> {
    let mut f = b"NXSC".to_vec();
    f.extend_from_slice(&[2, 4, 0, 0]);
    f.extend_from_slice(&0u32.to_le_bytes());
    f
}

/// Start the idle clients against `addr`; returns the child and (connections
/// opened, still open after settling).
fn idle_clients(addr: SocketAddr, opening: Opening) -> (Child, usize, usize) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "hostile_admission::idle_client_child",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD, addr.to_string())
        .env(
            "NIXL_TEST_IDLE_OPENING",
            match opening {
                Opening::TcpHello => "tcp",
                Opening::SideChannelFetch => "side channel",
            },
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    for line in out.lines() {
        let Ok(line) = line else { break };
        if let Some(rest) = line.strip_prefix("IDLE-CLIENTS ") {
            let mut n = rest.split(' ').map(|x| x.parse::<usize>().unwrap());
            return (child, n.next().unwrap(), n.next().unwrap());
        }
    }
    let status = child.wait();
    panic!("the idle-client child printed no count ({status:?})");
}

/// Whether 127.0.0.2 can be bound (Linux routes all of 127/8 to loopback).
fn second_loopback(case: &str) -> bool {
    match std::net::TcpListener::bind("127.0.0.2:0") {
        Ok(_) => true,
        Err(e) => {
            skip(case, &format!("cannot bind 127.0.0.2: {e}"));
            false
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_tcp_at_the_default_file_limit_keeps_serving_past_idle_hellos() {
    const CASE: &str = "nixl_tcp_at_the_default_file_limit_keeps_serving_past_idle_hellos";
    if nixl_testkit::in_own_process(&format!("hostile_admission::{CASE}")) || !second_loopback(CASE)
    {
        return;
    }
    default_file_limit();
    let b = TcpBackend::with_options(TcpOptions {
        same_host: SameHost::Off,
        ..TcpOptions::default()
    });
    let target = Agent::builder("target")
        .backend(b.clone())
        .build()
        .await
        .unwrap();
    let addr = b.local_addr().unwrap();
    let dst = target.register(vec![0u8; 4096]).unwrap();
    let (mut child, opened, open) =
        tokio::task::spawn_blocking(move || idle_clients(addr, Opening::TcpHello))
            .await
            .unwrap();

    // A legitimate peer from 127.0.0.1: WRITE with a notification, READ.
    let a = Agent::builder("initiator")
        .backend(TcpBackend::with_options(TcpOptions {
            same_host: SameHost::Off,
            ..TcpOptions::default()
        }))
        .build()
        .await
        .unwrap();
    a.load_metadata(&target.metadata().unwrap()).unwrap();
    let mut notes = target.notifications().unwrap();
    let rd = remote(&a, "target", dst.id());
    let src = a.register(pattern(11, 4096)).unwrap();
    bounded(
        "write",
        a.write(
            &one(src.whole()),
            "target",
            &one(rd.desc(0, 4096)),
            Some(Bytes::from_static(b"served")),
        ),
    )
    .await
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
    let n = bounded("notification", notes.recv()).await.unwrap();
    assert_eq!(&n.msg[..], b"served");
    let back = a.register(vec![0u8; 4096]).unwrap();
    bounded(
        "read",
        a.read(&one(back.whole()), "target", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap();
    assert_eq!(back.to_vec().unwrap(), src.to_vec().unwrap());

    // The idle address kept at most its share of the established set, as clamped
    // to the open-files limit (a quarter of it per listener, half of that per
    // address), plus at most the handshakes still waiting.
    let share = (DEFAULT_FILES / 4 / 2) as usize;
    assert!(
        open <= share,
        "{open} of {opened} idle hellos kept open; the per-address share at {DEFAULT_FILES} files is {share}"
    );
    figure(
        "hostile: nixl-tcp listener at 1,024 open files, idle hellos from another address",
        format!("{opened} hellos from 127.0.0.2 then idle: {open} kept (per-address share {share}); a peer's WRITE with notification and READ served meanwhile"),
    );
    drop(child.stdin.take());
    let _ = child.wait();
    let _ = a.shutdown().await;
    let _ = target.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_channel_at_the_default_file_limit_keeps_serving_past_idle_clients() {
    const CASE: &str = "side_channel_at_the_default_file_limit_keeps_serving_past_idle_clients";
    if nixl_testkit::in_own_process(&format!("hostile_admission::{CASE}")) || !second_loopback(CASE)
    {
        return;
    }
    default_file_limit();
    let b = tcp_agent("b").await;
    let options = SideChannelOptions {
        timeout: Duration::from_secs(5),
        ..SideChannelOptions::default()
    };
    let addr = b
        .listen("127.0.0.1:0".parse().unwrap(), &options)
        .await
        .unwrap();
    let (mut child, opened, open) =
        tokio::task::spawn_blocking(move || idle_clients(addr, Opening::SideChannelFetch))
            .await
            .unwrap();
    let a = tcp_agent("a").await;
    let peer = bounded("fetch", a.fetch_metadata(addr, &options))
        .await
        .unwrap();
    assert_eq!(peer, "b");
    let share = (DEFAULT_FILES / 4 / 2) as usize;
    assert!(
        open <= share,
        "{open} of {opened} idle clients kept open; the per-address share at {DEFAULT_FILES} files is {share}"
    );
    figure(
        "hostile: side-channel listener at 1,024 open files, idle clients from another address",
        format!("{opened} fetches from 127.0.0.2 then idle: {open} kept (per-address share {share}); a peer's metadata fetch served meanwhile"),
    );
    drop(child.stdin.take());
    let _ = child.wait();
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
