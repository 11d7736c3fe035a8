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
    Agent, Backend, BackendContext, Capabilities, Completer, ErrorKind, Notification,
    NotificationLimits, NotificationSink, PreparedTransfer, QueuedNotifications, RegionRef, Result,
    TransferPlan,
};

/// Test double: keeps the sink the agent gave it, does nothing else.
#[derive(Debug, Default)]
struct SinkDouble {
    sink: Arc<Mutex<Option<NotificationSink>>>,
}

#[async_trait]
impl Backend for SinkDouble {
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
    fn connection_info(&self) -> Bytes {
        Bytes::new()
    }
    fn register(&self, _region: &RegionRef) -> Result<Bytes> {
        Ok(Bytes::new())
    }
    fn deregister(&self, _region_id: u64) -> Result<()> {
        Ok(())
    }
    fn add_peer(&self, _peer: &str, _conn_info: &[u8]) -> Result<()> {
        Ok(())
    }
    async fn connect(&self, _peer: &str) -> Result<()> {
        Ok(())
    }
    fn remove_peer(&self, _peer: &str) -> Result<()> {
        Ok(())
    }
    fn prepare(&self, _plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        unreachable!("no transfers in this test")
    }
    fn notify(&self, _peer: &str, _msg: Bytes, done: Completer) {
        done.complete(Ok(()));
    }
    async fn shutdown(&self, _timeout: Duration) -> Result<()> {
        Ok(())
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
        .backend(double)
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
        },
        NotificationLimits {
            messages: 1,
            bytes: 0,
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
            bytes: 64 << 20
        }
    );
}
