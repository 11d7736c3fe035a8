//! Clients that speak nixl-uccl's control protocol and never read the answers, against
//! an agent on the engine **test double**: what the target holds for them stays
//! bounded, they are cut, and a legitimate peer is served meanwhile.
//!
//! The frames are written by hand here (the format is documented in `wire.rs`): `len
//! u32` little-endian counting the type byte and payload, `type u8`, payload.

use std::sync::Arc;
use std::time::Duration;

use nixl::{Agent, AgentOptions, Backend, Registration};
use nixl_testkit::double::one;
use nixl_uccl::test_double::{self, TestDouble};
use nixl_uccl::{UcclBackend, UcclOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Catches hangs; never a performance bound.
const HANG: Duration = Duration::from_secs(60);

const HELLO: u8 = 1;
const HELLO_ACK: u8 = 2;
const PING: u8 = 5;
const VERIFY: u8 = 7;

/// Confirmations a target accepts unanswered per connection (`confirm::MAX_QUEUED`).
const MAX_VERIFIES: usize = 1024;

/// The agent under attack cuts a peer that does not read within a second; the
/// legitimate peer keeps the default liveness bound (5 s), so a busy machine does
/// not make it give up on its target.
async fn agent(name: &str) -> (Agent, UcclBackend) {
    agent_with(name, Duration::from_secs(1)).await
}

async fn legit_agent(name: &str) -> (Agent, UcclBackend) {
    agent_with(name, UcclOptions::default().listener.dead_peer_timeout).await
}

async fn agent_with(name: &str, liveness: Duration) -> (Agent, UcclBackend) {
    let o = UcclOptions {
        listener: nixl::control::ListenerOptions {
            dead_peer_timeout: liveness,
            ..nixl::control::ListenerOptions::default()
        },
        hold_timeout: liveness,
        ..Default::default()
    };
    let b = UcclBackend::with_api(TestDouble::api(), o);
    let a = Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(1),
            shutdown_timeout: Duration::from_secs(2),
        })
        .build()
        .await
        .unwrap();
    (a, b)
}

fn frame(t: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(5 + body.len());
    f.extend_from_slice(&(1 + body.len() as u32).to_le_bytes());
    f.push(t);
    f.extend_from_slice(body);
    f
}

/// The control listener's address from the backend's connection info (`version u8`,
/// then length-prefixed strings: the control address first).
fn control_addr(b: &UcclBackend) -> std::net::SocketAddr {
    let info = b.connection_info();
    let n = u16::from_le_bytes([info[1], info[2]]) as usize;
    std::str::from_utf8(&info[3..3 + n])
        .unwrap()
        .parse()
        .unwrap()
}

/// Connect with a small receive buffer (the kernel's window fills sooner; the
/// target's own buffers are its business) and say hello as `name`; read the answer,
/// then never read again.
async fn hostile_client(b: &UcclBackend, name: &str) -> TcpStream {
    let addr = control_addr(b);
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(addr).await.unwrap();
    s.write_all(&frame(HELLO, name.as_bytes())).await.unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).await.unwrap();
    assert_eq!(body[0], HELLO_ACK, "the target did not answer the hello");
    s
}

/// Write `chunk` (whole frames) over and over, never reading, until the target cuts
/// the connection; returns how many chunks went out whole.
async fn flood_until_cut(mut s: TcpStream, chunk: Vec<u8>) -> u64 {
    let mut sent = 0u64;
    let flood = async {
        loop {
            if s.write_all(&chunk).await.is_err() {
                return;
            }
            sent += 1;
        }
    };
    tokio::time::timeout(HANG, flood)
        .await
        .expect("the target never cut a client that does not read");
    sent
}

fn remote(a: &Agent, peer: &str, r: &Registration) -> nixl::Desc {
    let info = a
        .remote_regions(peer)
        .unwrap()
        .into_iter()
        .find(|x| x.id == r.id())
        .unwrap();
    info.desc(0, info.len)
}

/// WRITEs from `a` into `dst` at `peer`, each checked, until `until` has finished
/// and once more after it; returns how many succeeded.
async fn serve_meanwhile<T>(
    a: &Agent,
    peer: &str,
    dst: &Registration,
    until: tokio::task::JoinHandle<T>,
) -> (u32, T) {
    let target = one(remote(a, peer, dst));
    let mut ok = 0u32;
    let mut round = 0u8;
    loop {
        let finished = until.is_finished();
        round = round.wrapping_add(1);
        let src = a.register(vec![round; 4096]).unwrap();
        tokio::time::timeout(HANG, a.write(&one(src.whole()), peer, &target, None))
            .await
            .expect("a legitimate WRITE hung")
            .expect("a legitimate WRITE failed while a hostile client was connected");
        assert_eq!(dst.to_vec().unwrap(), vec![round; 4096]);
        a.deregister(&src).unwrap();
        ok += 1;
        if finished {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (ok, until.await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_pings_and_never_reads_is_owed_one_pong_and_cut() {
    let (b, bb) = agent("b-pinged").await;
    let (a, _) = legit_agent("a-legit").await;
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let s = hostile_client(&bb, "mallory").await;
    // 10,000 pings a chunk.
    const PER_CHUNK: u64 = 10_000;
    let chunk = frame(PING, &[]).repeat(PER_CHUNK as usize);
    let flood = tokio::spawn(flood_until_cut(s, chunk));
    let (served, chunks) = serve_meanwhile(&a, "b-pinged", &dst, flood).await;
    let stats = bb.control_stats();
    println!(
        "FIGURE uccl ping flood: {} pings sent unread before the cut, {served} legitimate WRITEs served meanwhile, most answers owed to one connection: {}",
        chunks * PER_CHUNK,
        stats.most_answers_owed
    );
    assert!(
        chunks * PER_CHUNK >= 10_000,
        "the client was cut before it sent many pings ({chunks} chunks)"
    );
    // The hostile client is owed one Pong however many it sent; the legitimate
    // peer a Pong and a confirmation or two.
    assert!(
        stats.most_answers_owed <= 4,
        "answers queued for one connection: {}",
        stats.most_answers_owed
    );
    assert!(stats.cut_not_reading >= 1, "{stats:?}");
    for x in [a, b] {
        assert!(x.shutdown().await.is_clean());
    }
    assert_eq!(test_double::violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_asks_for_confirmations_and_never_reads_is_bounded_and_cut() {
    let (b, bb) = agent("b-verified").await;
    let (a, _) = legit_agent("a-legit-v").await;
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let s = hostile_client(&bb, "mallory").await;
    // Requests for one range under a key the target does not know: each answered
    // at once (no digest), as cheaply as the target can.
    const PER_CHUNK: u64 = 1_000;
    let mut chunk = Vec::new();
    for id in 0..PER_CHUNK {
        let mut body = id.to_le_bytes().to_vec();
        for w in [0x1000u64, 64, 0xdead_beef] {
            body.extend_from_slice(&w.to_le_bytes());
        }
        chunk.extend_from_slice(&frame(VERIFY, &body));
    }
    let flood = tokio::spawn(flood_until_cut(s, chunk));
    let (served, chunks) = serve_meanwhile(&a, "b-verified", &dst, flood).await;
    let stats = bb.control_stats();
    println!(
        "FIGURE uccl confirmation flood: {} requests sent unread before the cut, {served} legitimate WRITEs served meanwhile, most answers owed to one connection: {}",
        chunks * PER_CHUNK,
        stats.most_answers_owed
    );
    assert!(
        stats.most_answers_owed <= MAX_VERIFIES + 1,
        "answers queued for one connection: {}",
        stats.most_answers_owed
    );
    assert!(stats.cut_not_reading >= 1, "{stats:?}");
    for x in [a, b] {
        assert!(x.shutdown().await.is_clean());
    }
    assert_eq!(test_double::violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_cuts_a_target_that_answers_pings_but_never_reads() {
    // A "target" that says hello, then keeps the link looking alive (a Pong every
    // 50 ms) and never reads: notifications towards it must fail once one cannot be
    // written within the liveness bound, not wait forever.
    const PONG: u8 = 6;
    let (a, _) = agent("a-init").await;
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = sock.listen(4).unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut hello = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut hello).await.unwrap();
        assert_eq!(hello[0], HELLO);
        s.write_all(&frame(HELLO_ACK, b"fake")).await.unwrap();
        while s.write_all(&frame(PONG, &[])).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut info = vec![3u8];
    for part in [addr.to_string(), "127.0.0.1:1?double".to_owned()] {
        info.extend_from_slice(&(part.len() as u16).to_le_bytes());
        info.extend_from_slice(part.as_bytes());
    }
    let md = nixl::metadata::AgentMetadata {
        name: "fake".into(),
        instance: 1,
        partial: false,
        backends: vec![nixl::metadata::BackendMeta {
            name: "uccl".into(),
            conn_info: Some(info),
        }],
        regions: vec![],
    };
    a.load_metadata(&md.encode().unwrap()).unwrap();
    let mut failed = None;
    let mut sent = 0;
    // 64 MiB in all: more than any socket buffer holds.
    for i in 0..64u8 {
        let n = a.notify("fake", vec![i; 1 << 20]).unwrap();
        match tokio::time::timeout(HANG, n)
            .await
            .expect("a notification to a target that does not read hung")
        {
            Ok(()) => sent += 1,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let e = failed.expect("64 MiB of notifications sent to a target that read none");
    println!("FIGURE uccl initiator: {sent} notifications of 1 MiB written before the non-reading target was cut");
    assert_eq!(e.kind(), nixl::ErrorKind::RemoteDisconnected, "{e}");
    fake.abort();
    assert!(a.shutdown().await.is_clean());
}
