//! A peer floods an agent that reads nothing with many more notifications than its
//! per-peer bound, over nixl-verbs and nixl-uccl (their test doubles). Both deliver
//! from tasks, so neither drops: verbs holds the receive buffers of what found no
//! room (the flooder's further sends wait in its NIC, receiver not ready); uccl stops
//! reading the flooder's control connection, with keep-alive PONGs so the flooder
//! does not take the silence for a dead peer. Meanwhile another peer's notifications
//! get in; once the agent reads, every flooded notification arrives, in order, and
//! every post completes.

use std::time::Duration;

use nixl::{Agent, AgentOptions, Backend, Bytes, NotificationLimits};
use nixl_conformance::support::{bounded, figure};

const BOUND: usize = 4;

/// The flooder's `i`th notification: its index, padded to `size` bytes.
fn flooded(i: usize, size: usize) -> Bytes {
    let mut v = format!("f{i}.").into_bytes();
    v.resize(size.max(v.len()), b'.');
    Bytes::from(v)
}

async fn agent(name: &str, b: impl Backend, limits: NotificationLimits) -> Agent {
    Agent::builder(name)
        .backend(b)
        .notification_limits(limits)
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap()
}

fn know_each_other(a: &Agent, b: &Agent) {
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    b.load_metadata(&a.metadata().unwrap()).unwrap();
}

/// `make` builds each agent's backend; the flooder posts `flood` notifications of
/// `size` bytes (more than the transport buffers); `hold` is how long the receiver
/// reads nothing once the flooder's queue is full (a few times the backend's
/// dead-peer bound).
async fn flood_is_held_back_and_loses_nothing<B: Backend>(
    what: &str,
    make: impl Fn() -> B,
    (flood_len, size): (usize, usize),
    hold: Duration,
) {
    let limits = NotificationLimits {
        messages: BOUND,
        ..NotificationLimits::default()
    };
    let receiver = agent("receiver", make(), limits).await;
    let flooder = agent("flooder", make(), NotificationLimits::default()).await;
    let calm = agent("calm", make(), NotificationLimits::default()).await;
    // Registered memory: some backends accept connections only once they have some.
    let _regs: Vec<_> = [&receiver, &flooder, &calm]
        .iter()
        .map(|a| a.register(vec![0u8; 4096]).unwrap())
        .collect();
    know_each_other(&receiver, &flooder);
    know_each_other(&receiver, &calm);
    bounded("connect", flooder.connect("receiver"))
        .await
        .unwrap();
    bounded("connect", calm.connect("receiver")).await.unwrap();

    let flood: Vec<_> = (0..flood_len)
        .map(|i| {
            let f = flooder.notify("receiver", flooded(i, size)).unwrap();
            tokio::spawn(f)
        })
        .collect();
    bounded("the flooder's queue to fill", async {
        while receiver
            .notification_stats()
            .peers
            .get("flooder")
            .map_or(0, |q| q.messages)
            < BOUND
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // The application is busy elsewhere for a while.
    tokio::time::sleep(hold).await;
    // Another peer is not held back.
    bounded(
        "another peer's notification",
        calm.notify("receiver", "calm").unwrap(),
    )
    .await
    .unwrap();
    // Some backends complete a notification once sent, before it is queued.
    bounded("another peer's notification queued", async {
        while !receiver.notification_stats().peers.contains_key("calm") {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let s = receiver.notification_stats();
    assert_eq!(s.dropped, 0, "{what}: dropped with back-pressure available");
    assert_eq!(s.peers["flooder"].messages, BOUND, "{s:?}");
    assert_eq!(s.peers["calm"].messages, 1, "{s:?}");
    let done = flood.iter().filter(|t| t.is_finished()).count();
    assert!(
        done < flood_len,
        "{what}: every flooded notification completed although the receiver read none"
    );

    let mut notes = receiver.notifications().unwrap();
    let mut next = 0;
    let mut calm_seen = false;
    while next < flood_len || !calm_seen {
        let n = bounded("the next notification", notes.recv())
            .await
            .expect("the agent is alive");
        match n.peer.as_str() {
            "flooder" => {
                assert!(
                    n.msg == flooded(next, size),
                    "{what}: {next} out of order or lost"
                );
                next += 1;
            }
            "calm" => calm_seen = true,
            other => panic!("a notification from {other:?}"),
        }
    }
    for (i, t) in flood.into_iter().enumerate() {
        let r = bounded("a flooded notification", t).await.unwrap();
        assert!(r.is_ok(), "{what}: notification {i}: {r:?}");
    }
    let s = receiver.notification_stats();
    assert_eq!(s.dropped, 0);
    assert!(s.peaks.queued.messages <= BOUND + 1, "{s:?}");
    figure(
        &format!("hostile: notification flood over {what} (receiver not reading)"),
        format!(
            "{flood_len} notifications of {size} bytes to a bound of {BOUND}, receiver not reading for {hold:?}: at most {} queued, {done} posts completed meanwhile, 0 dropped, all delivered in order once read; another peer's notification queued meanwhile",
            s.peaks.queued.messages
        ),
    );
    for a in [flooder, calm, receiver] {
        let report = bounded("shutdown", a.shutdown()).await;
        assert!(report.is_clean(), "{report:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_flood_is_held_back_and_loses_nothing() {
    flood_is_held_back_and_loses_nothing(
        "nixl-verbs (test double)",
        || nixl_verbs::VerbsBackend::with_test_double(nixl_verbs::VerbsOptions::default()).unwrap(),
        (200, 64),
        Duration::from_millis(500),
    )
    .await;
    if nixl_conformance::support::own_thread_count("verbs misuse check").is_some() {
        assert_eq!(nixl_verbs::test_double::violations(), Vec::<String>::new());
        assert_eq!(nixl_verbs::test_double::live_objects(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uccl_flood_is_held_back_and_loses_nothing() {
    let liveness = Duration::from_millis(600);
    flood_is_held_back_and_loses_nothing(
        "nixl-uccl (test double)",
        || {
            nixl_uccl::UcclBackend::with_api(
                nixl_uccl::test_double::TestDouble::api(),
                nixl_uccl::UcclOptions {
                    listener: nixl::control::ListenerOptions {
                        dead_peer_timeout: liveness,
                        ..nixl::control::ListenerOptions::default()
                    },
                    ..nixl_uccl::UcclOptions::default()
                },
            )
        },
        // More than the sockets' buffers hold.
        (64, nixl_uccl::MAX_NOTIFICATION),
        liveness * 4,
    )
    .await;
}

/// The receiver shuts down while the flood is held back (notifications waiting for
/// room that will never come): the shutdown is clean and bounded, and every post of
/// the flooder ends (delivered or failed), none hangs.
async fn shutdown_with_notifications_held<B: Backend>(
    what: &str,
    make: impl Fn() -> B,
    (flood_len, size): (usize, usize),
) {
    let limits = NotificationLimits {
        messages: BOUND,
        ..NotificationLimits::default()
    };
    let receiver = agent("receiver", make(), limits).await;
    let flooder = agent("flooder", make(), NotificationLimits::default()).await;
    let _regs: Vec<_> = [&receiver, &flooder]
        .iter()
        .map(|a| a.register(vec![0u8; 4096]).unwrap())
        .collect();
    know_each_other(&receiver, &flooder);
    bounded("connect", flooder.connect("receiver"))
        .await
        .unwrap();
    let flood: Vec<_> = (0..flood_len)
        .map(|i| tokio::spawn(flooder.notify("receiver", flooded(i, size)).unwrap()))
        .collect();
    bounded("the flooder's queue to fill", async {
        while receiver
            .notification_stats()
            .peers
            .get("flooder")
            .map_or(0, |q| q.messages)
            < BOUND
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let report = bounded("the receiver's shutdown", receiver.shutdown()).await;
    assert!(report.is_clean(), "{what}: {report:?}");
    let mut failed = 0;
    for t in flood {
        if bounded("a flooded notification", t).await.unwrap().is_err() {
            failed += 1;
        }
    }
    assert!(
        failed > 0,
        "{what}: every notification of the flood delivered unread"
    );
    let report = bounded("the flooder's shutdown", flooder.shutdown()).await;
    assert!(report.is_clean(), "{what}: {report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_shutdown_with_notifications_held_is_clean() {
    shutdown_with_notifications_held(
        "nixl-verbs (test double)",
        || nixl_verbs::VerbsBackend::with_test_double(nixl_verbs::VerbsOptions::default()).unwrap(),
        (200, 64),
    )
    .await;
    // Nothing misused the verbs API (a buffer freed under a queue pair, ...). The
    // double's world is process-wide: meaningful where this case has the process.
    if nixl_conformance::support::own_thread_count("verbs misuse check").is_some() {
        assert_eq!(nixl_verbs::test_double::violations(), Vec::<String>::new());
        assert_eq!(nixl_verbs::test_double::live_objects(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uccl_shutdown_with_notifications_held_is_clean() {
    shutdown_with_notifications_held(
        "nixl-uccl (test double)",
        || {
            nixl_uccl::UcclBackend::with_api(
                nixl_uccl::test_double::TestDouble::api(),
                nixl_uccl::UcclOptions::default(),
            )
        },
        (64, nixl_uccl::MAX_NOTIFICATION),
    )
    .await;
}
