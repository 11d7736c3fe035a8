//! The per-peer bound on queued notifications, through a backend double that hands
//! the test its `NotificationSink`: the non-waiting delivery drops and counts what
//! finds its peer's queue full and spares other peers; the waiting delivery holds back
//! only its own peer and ends when the agent stops; reading makes room.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use nixl::{
    Agent, BackendContext, Capabilities, ErrorKind, Notification, NotificationLimits,
    NotificationSink, PreparedTransfer, QueuedNotifications, Result, TransferPlan,
};
use nixl_testkit::double::{backend, Double};

/// Test double: keeps the sink the agent gave it, does nothing else.
#[derive(Debug, Default)]
struct SinkDouble {
    sink: Arc<Mutex<Option<NotificationSink>>>,
}

#[async_trait]
impl Double for SinkDouble {
    fn name(&self) -> &str {
        "sink"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notifications: true,
            ..Capabilities::default()
        }
    }
    async fn start(&self, ctx: BackendContext) -> Result<()> {
        *self.sink.lock().unwrap() = Some(ctx.notifications);
        Ok(())
    }
    fn prepare(&self, _plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        unreachable!("no transfers in this test")
    }
}

/// Hang bound (never a speed assertion).
const HANG: Duration = Duration::from_secs(10);

/// The process's metrics, recorded from the first agent built with metrics on.
fn metrics() -> &'static Snapshotter {
    static SNAP: OnceLock<Snapshotter> = OnceLock::new();
    SNAP.get_or_init(|| {
        let rec = DebuggingRecorder::new();
        let snap = rec.snapshotter();
        rec.install()
            .expect("no other recorder in this test binary");
        snap
    })
}

/// An agent with these limits and metrics on, and the sink its backend got.
async fn agent(name: &str, limits: NotificationLimits) -> (Agent, NotificationSink) {
    metrics();
    let double = SinkDouble::default();
    let sink = double.sink.clone();
    let agent = Agent::builder(name)
        .notification_limits(limits)
        .telemetry(nixl::TelemetryOptions {
            metrics: true,
            ..Default::default()
        })
        .backend(backend(double))
        .build()
        .await
        .unwrap();
    let sink = sink.lock().unwrap().clone().expect("the backend started");
    (agent, sink)
}

fn note(peer: &str, msg: &'static [u8]) -> Notification {
    Notification {
        peer: peer.into(),
        msg: Bytes::from_static(msg),
    }
}

fn queued(messages: usize, bytes: usize) -> QueuedNotifications {
    QueuedNotifications { messages, bytes }
}

/// The counters `(received, dropped)` of `agent`. Taking a snapshot resets every
/// counter, so only one test reads them.
fn counters(agent: &str) -> (u64, u64) {
    let mut c = (0, 0);
    for (k, _, _, v) in metrics().snapshot().into_vec() {
        if !k.key().labels().any(|l| l.value() == agent) {
            continue;
        }
        let DebugValue::Counter(n) = v else { continue };
        match k.key().name() {
            "nixl_notifications_received_total" => c.0 = n,
            "nixl_notifications_dropped_total" => c.1 = n,
            _ => {}
        }
    }
    c
}

#[tokio::test]
async fn a_full_queue_drops_and_counts_that_peers_notifications_only() {
    let limits = NotificationLimits {
        messages: 3,
        bytes: 1 << 20,
        ..NotificationLimits::default()
    };
    let (a, sink) = agent("drops", limits).await;
    for m in [&b"f0"[..], b"f1", b"f2", b"f3", b"f4"] {
        sink.deliver("flood", Bytes::from_static(m));
    }
    sink.deliver("calm", Bytes::from_static(b"c0"));

    let stats = a.notification_stats();
    assert_eq!(stats.dropped, 2);
    assert_eq!(stats.peers["flood"], queued(3, 6));
    assert_eq!(stats.peers["calm"], queued(1, 2));
    assert_eq!(stats.queued(), queued(4, 8));
    assert_eq!(counters("drops"), (4, 2));

    // What was queued comes out in arrival order; reading makes room again.
    let mut notes = a.notifications().unwrap();
    let got: Vec<_> = std::iter::from_fn(|| notes.try_recv()).collect();
    assert_eq!(
        got,
        [
            note("flood", b"f0"),
            note("flood", b"f1"),
            note("flood", b"f2"),
            note("calm", b"c0")
        ]
    );
    assert!(a.notification_stats().peers.is_empty());
    sink.deliver("flood", Bytes::from_static(b"f5"));
    assert_eq!(notes.try_recv(), Some(note("flood", b"f5")));
    assert_eq!(a.notification_stats().dropped, 2);
}

#[tokio::test]
async fn the_byte_bound_holds_but_one_long_notification_passes_alone() {
    let limits = NotificationLimits {
        messages: 100,
        bytes: 10,
        ..NotificationLimits::default()
    };
    let (a, sink) = agent("bytes", limits).await;
    sink.deliver("p", Bytes::from_static(b"1234"));
    sink.deliver("p", Bytes::from_static(b"5678"));
    sink.deliver("p", Bytes::from_static(b"9abc")); // 12 > 10
    let stats = a.notification_stats();
    assert_eq!((stats.peers["p"], stats.dropped), (queued(2, 8), 1));

    let mut notes = a.notifications().unwrap();
    while notes.try_recv().is_some() {}
    // Longer than the bound: queued because nothing else of "p" is.
    sink.deliver("p", Bytes::from(vec![7u8; 50]));
    sink.deliver("p", Bytes::from_static(b"x"));
    let stats = a.notification_stats();
    assert_eq!((stats.peers["p"], stats.dropped), (queued(1, 50), 2));
    assert_eq!(notes.try_recv().unwrap().msg.len(), 50);
    assert_eq!(notes.try_recv(), None);
}

#[tokio::test]
async fn a_waiting_delivery_holds_back_its_own_peer_only() {
    let limits = NotificationLimits {
        messages: 1,
        bytes: 1 << 20,
        ..NotificationLimits::default()
    };
    let (a, sink) = agent("waits", limits).await;
    sink.deliver_async("flood", Bytes::from_static(b"f0"))
        .await
        .unwrap();
    let blocked = tokio::spawn({
        let sink = sink.clone();
        async move { sink.deliver_async("flood", Bytes::from_static(b"f1")).await }
    });
    // Another peer is not held back by the full queue.
    tokio::time::timeout(HANG, sink.deliver_async("calm", Bytes::from_static(b"c0")))
        .await
        .expect("another peer's delivery waited for the full queue")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!blocked.is_finished(), "delivered past the bound");
    assert_eq!(a.notification_stats().peers["flood"], queued(1, 2));

    let mut notes = a.notifications().unwrap();
    assert_eq!(notes.recv().await, Some(note("flood", b"f0")));
    tokio::time::timeout(HANG, blocked)
        .await
        .expect("reading did not make room")
        .unwrap()
        .unwrap();
    assert_eq!(notes.recv().await, Some(note("calm", b"c0")));
    assert_eq!(notes.recv().await, Some(note("flood", b"f1")));
    let stats = a.notification_stats();
    assert!(stats.peers.is_empty(), "{stats:?}");
    assert_eq!(stats.dropped, 0);
}

#[tokio::test]
async fn waiting_for_room_ends_when_the_agent_stops_or_is_dropped() {
    let limits = NotificationLimits {
        messages: 1,
        bytes: 1 << 20,
        ..NotificationLimits::default()
    };
    for drop_it in [false, true] {
        let (a, sink) = agent("stops", limits).await;
        sink.deliver("p", Bytes::from_static(b"0"));
        let blocked = tokio::spawn({
            let sink = sink.clone();
            async move { sink.deliver_async("p", Bytes::from_static(b"1")).await }
        });
        tokio::task::yield_now().await;
        if drop_it {
            drop(a);
        } else {
            let report = a.shutdown().await;
            assert!(report.is_clean(), "{report:?}");
        }
        let e = tokio::time::timeout(HANG, blocked)
            .await
            .expect("a waiting delivery outlived its agent")
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ShutDown);
    }
}

#[tokio::test]
async fn zero_limits_are_refused() {
    for limits in [
        NotificationLimits {
            messages: 0,
            bytes: 1,
            ..NotificationLimits::default()
        },
        NotificationLimits {
            messages: 1,
            bytes: 0,
            ..NotificationLimits::default()
        },
    ] {
        let e = Agent::builder("zero")
            .notification_limits(limits)
            .build()
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
    assert_eq!(
        NotificationLimits::default(),
        NotificationLimits {
            messages: 4096,
            bytes: 64 << 20,
            total_messages: 65_536,
            total_bytes: 256 << 20,
            unknown_peers: 256,
            unknown_messages: 4096,
            unknown_bytes: 16 << 20,
        }
    );
    // An unknown names' pool as large as the total would leave known peers no room.
    let e = Agent::builder("pool")
        .notification_limits(NotificationLimits {
            total_messages: 4096,
            ..NotificationLimits::default()
        })
        .build()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

/// Limits with a small pool for unknown names: 2 names, 3 notifications.
fn small_pool() -> NotificationLimits {
    NotificationLimits {
        messages: 2,
        unknown_peers: 2,
        unknown_messages: 3,
        total_messages: 5,
        ..NotificationLimits::default()
    }
}

/// A peer `receiver` knows: an agent whose metadata it loaded.
async fn known_peer(receiver: &Agent, name: &str) -> Agent {
    let (peer, _) = agent(name, NotificationLimits::default()).await;
    receiver.load_metadata(&peer.metadata().unwrap()).unwrap();
    peer
}

#[tokio::test]
async fn unknown_names_share_a_capped_pool_and_a_known_peer_keeps_its_room() {
    let (a, sink) = agent("pool", small_pool()).await;
    let _good = known_peer(&a, "good").await;
    // Distinct unknown names: two get in, the third is refused (name cap).
    assert!(sink.deliver("u0", Bytes::from_static(b"0")));
    assert!(sink.deliver("u1", Bytes::from_static(b"1")));
    assert!(!sink.deliver("u2", Bytes::from_static(b"2")));
    // A name holding a place may add, up to the pool's 3 messages.
    assert!(sink.deliver("u0", Bytes::from_static(b"00")));
    assert!(!sink.deliver("u1", Bytes::from_static(b"11")));
    // try_deliver hands back what does not fit, uncounted.
    let back = sink
        .try_deliver("u3", Bytes::from_static(b"3"))
        .unwrap_err();
    assert_eq!(&back[..], b"3");
    // The known peer gets in: the total less the unknown pool is its.
    assert!(sink.deliver("good", Bytes::from_static(b"g0")));
    sink.deliver_async("good", Bytes::from_static(b"g1"))
        .await
        .unwrap();
    // Now its own bound (2) is full.
    assert!(sink.try_deliver("good", Bytes::from_static(b"g2")).is_err());
    let s = a.notification_stats();
    assert_eq!(s.dropped, 2, "{s:?}");
    assert_eq!((s.unknown, s.unknown_peers), (queued(3, 4), 2));
    assert_eq!(s.peers["good"], queued(2, 4));
    assert_eq!(s.peers.len(), 3);
    assert_eq!(s.peaks.queued, queued(5, 8));

    // A waiting unknown name gets in once the application reads an unknown one.
    let blocked = tokio::spawn({
        let sink = sink.clone();
        async move { sink.deliver_async("u9", Bytes::from_static(b"9")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !blocked.is_finished(),
        "an unknown name past the cap got in"
    );
    let mut notes = a.notifications().unwrap();
    assert_eq!(notes.recv().await, Some(note("u0", b"0")));
    // u0 still holds its place (one more queued): u9 waits on.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!blocked.is_finished(), "a third unknown name got in");
    assert_eq!(notes.recv().await, Some(note("u1", b"1")));
    tokio::time::timeout(HANG, blocked)
        .await
        .expect("reading did not make room in the unknown pool")
        .unwrap()
        .unwrap();
    let rest: Vec<_> = std::iter::from_fn(|| notes.try_recv()).collect();
    assert_eq!(
        rest,
        [
            note("u0", b"00"),
            note("good", b"g0"),
            note("good", b"g1"),
            note("u9", b"9")
        ]
    );
    let s = a.notification_stats();
    assert!(s.peers.is_empty(), "{s:?}");
    assert_eq!((s.unknown, s.unknown_peers), (queued(0, 0), 0));
}

#[tokio::test]
async fn deliveries_waiting_on_the_unknown_pool_all_get_in_as_the_application_reads() {
    // Many waiters on the shared pool (each a connection held back), woken one at a
    // time as room comes: every one gets in, none twice, and the bounds hold.
    let (a, sink) = agent("many", small_pool()).await;
    let waiters: Vec<_> = (0..200)
        .map(|i| {
            let sink = sink.clone();
            tokio::spawn(async move {
                sink.deliver_async(&format!("u{i}"), Bytes::from(format!("{i}")))
                    .await
            })
        })
        .collect();
    let mut notes = a.notifications().unwrap();
    let mut got = std::collections::BTreeSet::new();
    while got.len() < 200 {
        let n = tokio::time::timeout(HANG, notes.recv())
            .await
            .expect("a waiter was never woken")
            .unwrap();
        assert!(got.insert(n.peer.clone()), "{} twice", n.peer);
        let s = a.notification_stats();
        assert!(s.unknown_peers <= 2 && s.unknown.messages <= 3, "{s:?}");
    }
    for w in waiters {
        w.await.unwrap().unwrap();
    }
    let s = a.notification_stats();
    assert_eq!((s.dropped, s.peaks.unknown_peers), (0, 2));
    assert!(s.peaks.unknown.messages <= 2, "{s:?}");
}

/// A backend that holds notifications it had no room for is told each time the
/// application reads one (`on_room`), and a notification it holds no longer is
/// dropped and counted like one the queue refused (`drop_unqueued`).
#[tokio::test]
async fn reads_call_on_room_and_a_held_drop_is_counted() {
    let limits = NotificationLimits {
        messages: 2,
        ..NotificationLimits::default()
    };
    let (a, sink) = agent("on-room", limits).await;
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let reads = reads.clone();
        sink.on_room(move || {
            reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
    }
    for m in [&b"h0"[..], b"h1"] {
        sink.try_deliver("held", Bytes::from_static(m)).unwrap();
    }
    assert!(sink.try_deliver("held", Bytes::from_static(b"h2")).is_err());
    assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 0);
    let mut notes = a.notifications().unwrap();
    assert_eq!(notes.try_recv(), Some(note("held", b"h0")));
    assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Room again: the held one goes in.
    sink.try_deliver("held", Bytes::from_static(b"h2")).unwrap();
    sink.drop_unqueued("held", 2);
    assert_eq!(a.notification_stats().dropped, 1);
    assert_eq!(notes.try_recv(), Some(note("held", b"h1")));
    assert_eq!(notes.try_recv(), Some(note("held", b"h2")));
    assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 3);
}
