//! Sender names are the sender's to choose: without a shared secret, each nixl-tcp
//! connection's hello names whoever it likes. 10,000 raw connections, each under a
//! fresh name, each send one notification to an agent that at first reads nothing:
//! at most `unknown_peers` names (and the unknown pool's messages) are ever queued,
//! the rest of those connections are held back (their notification is not
//! acknowledged until there is room, nothing is dropped), and a known peer's
//! notifications go in at once meanwhile. Once the agent reads, every notification
//! arrives, once, and the bounds held throughout.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nixl::{Agent, AgentOptions, NotificationLimits};
use nixl_conformance::support::{bounded, figure, tcp_options_from_env};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// The documented wire format (nixl-tcp/src/wire.rs), written independently here.
const REQ_NOTIFY: u8 = 3;
const RESP_ACK: u8 = 0x80;
const RESP_PAUSE: u8 = 0x82;
const RESP_RESUME: u8 = 0x83;
const ST_OK: u8 = 0;

const NAMES: usize = 10_000;
/// Hostile connections open at once.
const AT_ONCE: usize = 128;
const GOOD: usize = 50;

const LIMITS: NotificationLimits = NotificationLimits {
    messages: 64,
    bytes: 1 << 20,
    total_messages: 512,
    total_bytes: 256 << 10,
    unknown_peers: 32,
    unknown_messages: 128,
    unknown_bytes: 16 << 10,
};

/// One raw connection: a hello as `name`, one notification, then its ACK (skipping
/// PAUSE and RESUME, which a held-back connection gets first).
async fn notify_as(addr: SocketAddr, name: &str) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&nixl_tcp::wire_hello(name)).await.unwrap();
    let mut reply = [0u8; 7];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(reply[6], ST_OK);
    // No same-host path.
    s.write_all(&[0]).await.unwrap();
    let msg = format!("from {name}");
    let mut h = [0u8; 24];
    h[0] = REQ_NOTIFY;
    h[1] = 1;
    h[8..16].copy_from_slice(&1u64.to_le_bytes());
    h[16..20].copy_from_slice(&(msg.len() as u32).to_le_bytes());
    s.write_all(&h).await.unwrap();
    s.write_all(msg.as_bytes()).await.unwrap();
    loop {
        let mut r = [0u8; 24];
        s.read_exact(&mut r).await.unwrap();
        match r[0] {
            RESP_PAUSE | RESP_RESUME => continue,
            RESP_ACK => {
                assert_eq!(r[1], ST_OK, "{name}'s notification refused");
                return;
            }
            k => panic!("unexpected response kind {k:#x}"),
        }
    }
}

async fn agent(name: &str, limits: NotificationLimits) -> (Agent, nixl_tcp::TcpBackend) {
    let b = nixl_tcp::TcpBackend::with_options(tcp_options_from_env());
    let a = Agent::builder(name)
        .backend(b.clone())
        .notification_limits(limits)
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_connection_names_fill_only_their_pool_and_a_known_peer_goes_on() {
    let (receiver, rb) = agent("receiver", LIMITS).await;
    let (good, _gb) = agent("good", NotificationLimits::default()).await;
    receiver.load_metadata(&good.metadata().unwrap()).unwrap();
    good.load_metadata(&receiver.metadata().unwrap()).unwrap();
    bounded("the good peer connects", good.connect("receiver"))
        .await
        .unwrap();
    let addr = rb.local_addr().unwrap();

    // The hostile side: 10,000 names, AT_ONCE connections at a time, each ending at
    // its ACK.
    let acked = Arc::new(AtomicUsize::new(0));
    let flood = tokio::spawn({
        let acked = acked.clone();
        async move {
            let gate = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..NAMES {
                let permit = gate.clone().acquire_owned().await.unwrap();
                let acked = acked.clone();
                tasks.spawn(async move {
                    notify_as(addr, &format!("evil-{i}")).await;
                    acked.fetch_add(1, Ordering::Relaxed);
                    drop(permit);
                });
            }
            while let Some(r) = tasks.join_next().await {
                r.unwrap();
            }
        }
    });

    // Nobody reads yet: the unknown names' pool fills (one notification per name, so
    // the name cap binds) and the other connections wait unacknowledged.
    bounded("the unknown pool to fill", async {
        while receiver.notification_stats().unknown_peers < LIMITS.unknown_peers
            || acked.load(Ordering::Relaxed) < LIMITS.unknown_peers
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // The known peer is not held back by it.
    for i in 0..GOOD {
        bounded(
            "the known peer's notification while unknown names flood",
            good.notify("receiver", format!("good-{i}")).unwrap(),
        )
        .await
        .unwrap();
    }
    let s = receiver.notification_stats();
    assert_eq!(s.peers["good"].messages, GOOD, "{s:?}");
    assert_eq!(s.unknown_peers, LIMITS.unknown_peers, "{s:?}");
    assert_eq!(
        acked.load(Ordering::Relaxed),
        LIMITS.unknown_peers,
        "hostile connections acknowledged past the unknown names' cap"
    );

    // The receiver reads, checking the bounds as it goes.
    let mut notes = receiver.notifications().unwrap();
    let (mut next_good, mut names) = (0, std::collections::HashSet::new());
    while names.len() < NAMES || next_good < GOOD {
        let n = bounded("the next notification", notes.recv())
            .await
            .expect("the agent is alive");
        if n.peer == "good" {
            assert_eq!(n.msg, format!("good-{next_good}"));
            next_good += 1;
        } else {
            assert_eq!(n.msg, format!("from {}", n.peer));
            assert!(names.insert(n.peer.clone()), "{} delivered twice", n.peer);
        }
        let s = receiver.notification_stats();
        assert!(s.unknown_peers <= LIMITS.unknown_peers, "{s:?}");
        assert!(s.unknown.messages <= LIMITS.unknown_messages, "{s:?}");
        assert!(s.queued().messages <= LIMITS.total_messages, "{s:?}");
    }
    bounded("the flood to finish", flood).await.unwrap();
    let s = receiver.notification_stats();
    assert_eq!(s.dropped, 0, "dropped with back-pressure available");
    assert!(s.peers.is_empty(), "{s:?}");
    assert!(s.peaks.unknown_peers <= LIMITS.unknown_peers, "{s:?}");
    assert!(s.peaks.unknown.messages <= LIMITS.unknown_messages, "{s:?}");
    assert!(s.peaks.unknown.bytes <= LIMITS.unknown_bytes, "{s:?}");
    assert!(s.peaks.queued.messages <= LIMITS.total_messages, "{s:?}");
    assert!(s.peaks.queued.bytes <= LIMITS.total_bytes, "{s:?}");
    figure(
        "hostile: 10,000 sender names over nixl-tcp connections (receiver not reading, then reading)",
        format!(
            "{NAMES} connections, one fresh name each, {AT_ONCE} at a time: at most {} unknown names ({} notifications, {} bytes) queued at once (cap {}), the rest held back unacknowledged, 0 dropped, all {NAMES} delivered once read; a known peer's {GOOD} notifications queued at once meanwhile, in order",
            s.peaks.unknown_peers, s.peaks.unknown.messages, s.peaks.unknown.bytes, LIMITS.unknown_peers
        ),
    );
    for a in [good, receiver] {
        let report = bounded("shutdown", a.shutdown()).await;
        assert!(report.is_clean(), "{report:?}");
    }
}
