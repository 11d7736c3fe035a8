//! Listeners under hostile connections: nixl-tcp's target and the side channel keep
//! serving a legitimate peer while 2,000 idle sockets and a slowloris are connected,
//! close a connection whose handshake does not end in time, and refuse a stride-0
//! READ that asks for more than the per-request byte cap.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use nixl::metadata::AgentMetadata;
use nixl::{Agent, SideChannelOptions};
use nixl_conformance::support::{bounded, figure, one, pattern, remote, skip, tcp_agent};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

const IDLE: usize = 2000;

/// Raise the soft open-files limit to the hard one; `false` (after a SKIP line) when
/// even the hard limit leaves too few for `IDLE` sockets on both ends.
fn enough_files(case: &str) -> bool {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    let want = (2 * IDLE + 512) as u64;
    if l.current.is_some_and(|c| c < want) {
        l.current = l.maximum;
        let _ = setrlimit(Resource::Nofile, l);
    }
    let now = getrlimit(Resource::Nofile).current;
    if now.is_some_and(|c| c < want) {
        skip(
            case,
            &format!("the open-files limit ({now:?}) is below the {want} this test needs"),
        );
        return false;
    }
    true
}

/// `IDLE` connections that never send a byte.
async fn idle_sockets(addr: SocketAddr) -> Vec<TcpStream> {
    let mut v = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        v.push(TcpStream::connect(addr).await.unwrap());
    }
    v
}

/// Connections that send `bytes` one byte every 200 ms, as long as they stay open.
fn slowloris(addr: SocketAddr, bytes: Vec<u8>) -> Vec<JoinHandle<()>> {
    (0..8)
        .map(|_| {
            let bytes = bytes.clone();
            tokio::spawn(async move {
                let Ok(mut s) = TcpStream::connect(addr).await else {
                    return;
                };
                for b in bytes.iter().cycle() {
                    if s.write_all(&[*b]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        })
        .collect()
}

/// How many of `socks` the server closed: reading what it sent reaches end of file
/// or an error within a short wait.
async fn closed(socks: &mut [TcpStream]) -> usize {
    let checks = socks
        .iter_mut()
        .map(|s| closed_within(s, Duration::from_millis(100)));
    futures_util::future::join_all(checks)
        .await
        .into_iter()
        .filter(|&c| c)
        .count()
}

async fn tcp_target(options: TcpOptions) -> (Agent, SocketAddr) {
    let b = TcpBackend::with_options(options);
    let agent = Agent::builder("target")
        .backend(b.clone())
        .build()
        .await
        .unwrap();
    (agent, b.local_addr().unwrap())
}

/// An initiator whose data crosses TCP (not the same-host path).
async fn tcp_initiator() -> Agent {
    let b = TcpBackend::with_options(TcpOptions {
        same_host: SameHost::Off,
        ..TcpOptions::default()
    });
    Agent::builder("initiator")
        .backend(b)
        .build()
        .await
        .unwrap()
}

/// The target's process in these listener tests may hold this many descriptors: the
/// usual default soft limit, below the idle sockets sent at it. A listener that kept
/// every idle socket would run out of descriptors and stop accepting, the
/// legitimate peer's connection with the rest.
const TARGET_FILES: usize = 1024;
const _: () = assert!(
    IDLE > TARGET_FILES,
    "more idle sockets than the target may hold"
);

/// A nixl-tcp target in a process of its own (`nixl-peer`, 1 MiB registered, data
/// over TCP) whose soft open-files limit is [`TARGET_FILES`]: its address and
/// metadata.
struct FileBoundTarget {
    _child: Kill,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    addr: SocketAddr,
    md: Vec<u8>,
}

/// Kills the child however the test ends.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl FileBoundTarget {
    fn spawn() -> Self {
        use std::io::BufRead;
        let mut child = Kill(
            std::process::Command::new("bash")
                .arg("-c")
                .arg(format!("ulimit -Sn {TARGET_FILES} && exec \"$0\" \"$@\""))
                .arg(env!("CARGO_BIN_EXE_nixl-peer"))
                .arg((1usize << 20).to_string())
                .env("NIXL_TCP_SAME_HOST", "off")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn nixl-peer"),
        );
        let mut lines = std::io::BufReader::new(child.0.stdout.take().unwrap()).lines();
        let first = lines
            .next()
            .expect("the target printed its metadata")
            .unwrap();
        let md =
            nixl_conformance::support::unhex(first.strip_prefix("METADATA ").expect("METADATA"))
                .expect("hex metadata");
        let info = AgentMetadata::decode(&md).unwrap().backends[0]
            .conn_info
            .clone()
            .expect("the tcp backend's address");
        let info = String::from_utf8(info).unwrap();
        let addr = info.split(';').next().unwrap().parse().unwrap();
        Self {
            _child: child,
            lines,
            addr,
            md,
        }
    }

    /// The rest of the line the target prints that starts with `prefix`.
    fn line(&mut self, prefix: &str) -> String {
        loop {
            let l = self.lines.next().expect("target output").unwrap();
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }
}

/// Idle sockets and a slowloris against a nixl-tcp target allowed [`TARGET_FILES`]
/// descriptors, more idle sockets than that: the target closes the oldest in their
/// handshake to admit newer ones, so a legitimate peer still connects and its WRITE,
/// READ and notifications are served, its data checked in the target's memory. (A
/// listener that kept them all could not accept it: with admission's eviction and
/// the handshake timeout taken out, the WRITE fails.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_tcp_serves_a_peer_past_idle_sockets_and_a_slowloris() {
    if !enough_files("nixl_tcp_serves_a_peer_past_idle_sockets_and_a_slowloris") {
        return;
    }
    let mut target = tokio::task::spawn_blocking(FileBoundTarget::spawn)
        .await
        .unwrap();
    let addr = target.addr;
    // Connected one after the other; a connect that does not complete means the
    // listener stopped accepting (its backlog is full): the peer below meets the
    // same, so go on with what connected.
    let mut idle = Vec::with_capacity(IDLE);
    while idle.len() < IDLE {
        match tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await {
            Ok(Ok(s)) => idle.push(s),
            _ => break,
        }
    }
    let slow = slowloris(addr, nixl_tcp::wire_hello(&"s".repeat(200)));
    tokio::time::sleep(Duration::from_millis(300)).await;

    let a = tcp_initiator().await;
    a.load_metadata(&target.md).unwrap();
    let rd = a.remote_regions("target").unwrap()[0].clone();
    const LEN: usize = 1 << 20;
    let src = a.register(pattern(7, LEN)).unwrap();
    bounded(
        "write",
        a.write(
            &one(src.whole()),
            "target",
            &one(rd.desc(0, LEN as u64)),
            Some(Bytes::from_static(b"wrote")),
        ),
    )
    .await
    .expect("the legitimate peer's WRITE is served");
    let back = a.register(vec![0u8; LEN]).unwrap();
    bounded(
        "read",
        a.read(
            &one(back.whole()),
            "target",
            &one(rd.desc(0, LEN as u64)),
            None,
        ),
    )
    .await
    .expect("the legitimate peer's READ is served");
    assert_eq!(back.to_vec().unwrap(), src.to_vec().unwrap());
    // The target did not keep the idle sockets: all but the newest of those in
    // their handshake were closed to admit newer connections (counted while it
    // runs: the notification `done` ends it).
    let max = TcpOptions::default().listener.max_incoming_handshakes;
    let shut = closed(&mut idle).await;
    assert!(
        idle.len() == IDLE && shut >= IDLE - max,
        "{shut} of {} idle sockets closed ({IDLE} sent); at most {max} may wait in their handshake",
        idle.len()
    );
    bounded("notify", a.notify("target", "done").unwrap())
        .await
        .expect("the legitimate peer's notification is served");
    // The target saw both notifications, the WRITE's first, and its memory holds
    // what was written.
    let (notes, sum) = tokio::task::spawn_blocking(move || {
        let notes = [target.line("NOTIF "), target.line("NOTIF ")];
        (notes, target.line("CHECKSUM "))
    })
    .await
    .unwrap();
    assert_eq!(notes, ["wrote", "done"]);
    assert_eq!(sum, nixl_conformance::support::checksum(&src).to_string());
    figure(
        "hostile: nixl-tcp listener, idle sockets and a slowloris",
        format!("{IDLE} idle sockets at a target allowed {TARGET_FILES} descriptors: {shut} closed by the target (at most {max} wait in a handshake); a peer's WRITE, READ and notifications served meanwhile, its data checked in the target's memory"),
    );
    for s in slow {
        s.abort();
    }
    let _ = a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_channel_serves_a_peer_past_idle_sockets_and_a_slowloris() {
    if !enough_files("side_channel_serves_a_peer_past_idle_sockets_and_a_slowloris") {
        return;
    }
    let b = tcp_agent("b").await;
    let options = SideChannelOptions {
        timeout: Duration::from_secs(5),
        ..SideChannelOptions::default()
    };
    let addr = b
        .listen("127.0.0.1:0".parse().unwrap(), &options)
        .await
        .unwrap();
    // A listener that stops accepting holds the idle sockets' connects back (and the
    // fetch's after them): give them a while, then fetch regardless.
    let mut connecting = tokio::spawn(idle_sockets(addr));
    let connected = tokio::time::timeout(Duration::from_secs(3), &mut connecting)
        .await
        .ok();
    // A fetch frame's header, forever a byte at a time.
    let slow = slowloris(addr, vec![0xff; 64]);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let a = tcp_agent("a").await;
    let peer = bounded("fetch", a.fetch_metadata(addr, &options))
        .await
        .unwrap();
    let mut idle = match connected {
        Some(done) => done.unwrap(),
        None => bounded("idle sockets", connecting).await.unwrap(),
    };
    assert_eq!(peer, "b");
    assert_eq!(a.peers(), vec!["b".to_string()]);
    let max = options.max_connections;
    let shut = closed(&mut idle).await;
    assert!(
        shut >= IDLE - max,
        "{shut} of {IDLE} idle sockets closed; at most {max} may be served"
    );
    figure(
        "hostile: side-channel listener, idle sockets and a slowloris",
        format!("{IDLE} idle sockets: {shut} closed (at most {max} served); a peer's metadata fetch served meanwhile"),
    );
    for s in slow {
        s.abort();
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Whether the server closes `s` within `within`, skipping what it sends.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 256];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_tcp_closes_a_handshake_that_does_not_end_in_time() {
    let (b, addr) = tcp_target(TcpOptions {
        listener: nixl::control::ListenerOptions {
            handshake_timeout: Duration::from_millis(300),
            ..nixl::control::ListenerOptions::default()
        },
        ..TcpOptions::default()
    })
    .await;
    // Silent.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    // A hello a byte at a time: each read is quick, the handshake is not.
    let hello = nixl_tcp::wire_hello("slow");
    let mut slow = TcpStream::connect(addr).await.unwrap();
    let dribble = async {
        for b in &hello {
            if slow.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        closed_within(&mut slow, Duration::from_secs(5)).await
    };
    let (silent_closed, slow_closed) =
        tokio::join!(closed_within(&mut silent, Duration::from_secs(5)), dribble);
    assert!(silent_closed, "a silent connection is closed");
    assert!(slow_closed, "a slow handshake is closed");
    // A handshake in time is served.
    let mut ok = TcpStream::connect(addr).await.unwrap();
    ok.write_all(&nixl_tcp::wire_hello("quick")).await.unwrap();
    let mut reply = [0u8; 7];
    ok.read_exact(&mut reply).await.unwrap();
    ok.write_all(&[0]).await.unwrap();
    assert!(
        !closed_within(&mut ok, Duration::from_millis(600)).await,
        "an established connection outlives the handshake timeout"
    );
    let _ = b.shutdown().await;
}

fn key_of(md: &[u8], region: u64) -> u64 {
    let md = AgentMetadata::decode(md).unwrap();
    let r = md.regions.iter().find(|r| r.id == region).unwrap();
    u64::from_le_bytes(r.blobs[0].blob[..8].try_into().unwrap())
}

/// Send a READ of one run (key, address, length, stride, blocks) over `s`; returns
/// the kind and status of the first response.
async fn read_run(s: &mut TcpStream, id: u64, run: [u64; 5]) -> (u8, u8) {
    let mut f = [0u8; 24].to_vec();
    f[0] = 2; // READ
    f[4..8].copy_from_slice(&1u32.to_le_bytes());
    f[8..16].copy_from_slice(&id.to_le_bytes());
    for x in run {
        f.extend_from_slice(&x.to_le_bytes());
    }
    s.write_all(&f).await.unwrap();
    let mut h = [0u8; 24];
    bounded("response", s.read_exact(&mut h)).await.unwrap();
    if h[0] == 0x80 {
        // An ACK's message follows it.
        let mut msg = vec![0u8; u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize];
        s.read_exact(&mut msg).await.unwrap();
    }
    (h[0], h[1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_tcp_refuses_a_stride_zero_read_over_the_byte_cap() {
    let (b, addr) = tcp_target(TcpOptions {
        max_request_bytes: 1 << 20,
        ..TcpOptions::default()
    })
    .await;
    let r = b.register(pattern(3, 4096)).unwrap();
    let key = key_of(&b.metadata().unwrap(), r.id());
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&nixl_tcp::wire_hello("mallory")).await.unwrap();
    let mut reply = [0u8; 7];
    s.read_exact(&mut reply).await.unwrap();
    s.write_all(&[0]).await.unwrap();
    // One 4 KiB block, read 2^40 times: 4 PiB from a 4 KiB registration.
    let (kind, status) = read_run(&mut s, 1, [key, r.addr(), 4096, 0, 1 << 40]).await;
    assert_eq!(
        (kind, status),
        (0x80, 3),
        "an ACK saying too large, no DATA"
    );
    // The connection still serves a READ under the cap.
    let mut f = vec![0u8; 16];
    let (kind, status) = read_run(&mut s, 2, [key, r.addr(), 16, 0, 1]).await;
    assert_eq!((kind, status), (0x81, 0), "DATA");
    s.read_exact(&mut f).await.unwrap();
    assert_eq!(f, r.to_vec().unwrap()[..16]);
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_tcp_cuts_a_reader_that_stops_reading() {
    let (b, addr) = tcp_target(TcpOptions {
        listener: nixl::control::ListenerOptions {
            dead_peer_timeout: Duration::from_secs(1),
            ..nixl::control::ListenerOptions::default()
        },
        ..TcpOptions::default()
    })
    .await;
    const BIG: u64 = 64 << 20;
    let r = b.register(vec![0u8; BIG as usize]).unwrap();
    let key = key_of(&b.metadata().unwrap(), r.id());
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&nixl_tcp::wire_hello("mallory")).await.unwrap();
    let mut reply = [0u8; 7];
    s.read_exact(&mut reply).await.unwrap();
    s.write_all(&[0]).await.unwrap();
    // A READ of 64 MiB (far more than socket buffers hold), never read.
    let mut f = [0u8; 24].to_vec();
    f[0] = 2;
    f[4..8].copy_from_slice(&1u32.to_le_bytes());
    f[8..16].copy_from_slice(&1u64.to_le_bytes());
    for x in [key, r.addr(), BIG, BIG, 1] {
        f.extend_from_slice(&x.to_le_bytes());
    }
    s.write_all(&f).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Cut: what remains readable ends in an error or end of file. Still served, the
    // whole READ and its ACK arrive and then the connection waits for more.
    assert!(
        closed_within(&mut s, Duration::from_secs(10)).await,
        "the target cut a peer that stopped reading"
    );
    // Others are still served.
    let a = tcp_initiator().await;
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    bounded("notify", a.notify("target", "still here").unwrap())
        .await
        .unwrap();
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// nixl-verbs' control listener (on its verbs test double) under the same load: a
/// peer still connects and transfers, and the idle sockets do not stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_serves_a_peer_past_idle_sockets_and_a_slowloris() {
    use nixl_verbs::{VerbsBackend, VerbsOptions};
    if !enough_files("verbs_serves_a_peer_past_idle_sockets_and_a_slowloris") {
        return;
    }
    let verbs = || VerbsBackend::with_test_double(VerbsOptions::default()).unwrap();
    let tb = verbs();
    let b = Agent::builder("target")
        .backend(tb.clone())
        .build()
        .await
        .unwrap();
    let addr = tb.control_addr().unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    let mut idle = idle_sockets(addr).await;
    // A hello's length prefix and magic, a byte at a time.
    let slow = slowloris(addr, b"\x40\x00\x00\x00NXVH".to_vec());
    tokio::time::sleep(Duration::from_millis(300)).await;

    let a = Agent::builder("initiator")
        .backend(verbs())
        .build()
        .await
        .unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let src = a.register(pattern(7, 4096)).unwrap();
    let rd = remote(&a, "target", dst.id());
    bounded(
        "write",
        a.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
    let max = VerbsOptions::default().listener.max_incoming_handshakes;
    let shut = closed(&mut idle).await;
    assert!(
        shut >= IDLE - max,
        "{shut} of {IDLE} idle sockets closed; at most {max} may wait in their handshake"
    );
    figure(
        "hostile: nixl-verbs control listener (test double), idle sockets and a slowloris",
        format!("{IDLE} idle sockets: {shut} closed (at most {max} wait in a handshake); a peer connected and its WRITE landed meanwhile"),
    );
    for s in slow {
        s.abort();
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
