//! A peer floods an agent that does not read its notifications with far more 1 MiB
//! notifications than the agent's per-peer bound. Over nixl-tcp the agent stops
//! reading the flooder's connection once its queue is full: the queued bytes stay
//! under the bound, another peer's transfers and notifications still arrive, and
//! once the agent reads, every flooded notification arrives, in order, none dropped.
//! A receiver that reads nothing for several times its peers' dead-peer timeout
//! does not get them cut for it: the connection it stopped reading says so, and the
//! flooder does not count the zero window it sees as a dead peer.

use std::time::Duration;

use nixl::{Agent, AgentOptions, Bytes, NotificationLimits};
use nixl_testkit::double::one;
use nixl_testkit::{bounded, checksum, figure, remote};

const MIB: usize = 1 << 20;
/// The receiver's per-peer bound: four of the flooder's notifications.
const BOUND: usize = 4 * MIB;
/// Notifications the flooder posts at once.
const FLOOD: usize = 16;

async fn agent(name: &str, limits: NotificationLimits) -> Agent {
    agent_with(name, limits, nixl_tcp::TcpOptions::default()).await
}

async fn agent_with(name: &str, limits: NotificationLimits, o: nixl_tcp::TcpOptions) -> Agent {
    Agent::builder(name)
        .backend(nixl_tcp::TcpBackend::with_options(o))
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

/// The flooder's `i`th notification: 1 MiB of byte `i`, its index in the first 8.
fn flooded(i: usize) -> Bytes {
    let mut v = vec![i as u8; MIB];
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    Bytes::from(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_peer_is_held_back_and_loses_nothing() {
    let limits = NotificationLimits {
        messages: 4096,
        bytes: BOUND,
        ..NotificationLimits::default()
    };
    let receiver = agent("receiver", limits).await;
    let flooder = agent("flooder", NotificationLimits::default()).await;
    let legit = agent("legit", NotificationLimits::default()).await;
    let dst = receiver.register(vec![0u8; 64 << 10]).unwrap();
    let src = legit
        .register((0..64 << 10).map(|i| (i % 251) as u8).collect::<Vec<u8>>())
        .unwrap();
    know_each_other(&receiver, &flooder);
    know_each_other(&receiver, &legit);

    // Every notification posted at once; each completes once the receiver queued it.
    let flood: Vec<_> = (0..FLOOD)
        .map(|i| tokio::spawn(flooder.notify("receiver", flooded(i)).unwrap()))
        .collect();
    let mut most = 0;
    let queued_bytes = |most: &mut usize| {
        let s = receiver.notification_stats();
        assert_eq!(s.dropped, 0, "dropped with back-pressure available");
        let b = s.peers.get("flooder").map_or(0, |q| q.bytes);
        *most = (*most).max(b);
        b
    };
    bounded("the flooder's queue to fill", async {
        while queued_bytes(&mut most) < BOUND {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;

    // Meanwhile another peer's WRITE with a notification, and a standalone one.
    let rd = remote(&legit, "receiver", dst.id());
    bounded(
        "the legitimate peer's write",
        legit.write(
            &one(src.desc(0, 64 << 10)),
            "receiver",
            &one(rd.desc(0, 64 << 10)),
            Some(Bytes::from_static(b"kv ready")),
        ),
    )
    .await
    .unwrap();
    bounded(
        "the legitimate peer's notification",
        legit.notify("receiver", &b"second"[..]).unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(checksum(&dst), checksum(&src));
    let stats = receiver.notification_stats();
    assert_eq!(stats.peers["legit"].messages, 2);
    queued_bytes(&mut most);
    assert!(
        most <= BOUND,
        "{most} bytes of the flooder's queued, over {BOUND}"
    );
    // Each flooded notification completes only once queued: at most the bound's worth.
    let done = flood.iter().filter(|t| t.is_finished()).count();
    assert!(
        done <= BOUND / MIB,
        "{done} flooded notifications completed unread"
    );

    // Now the receiver reads: all of it arrives, the flooder's in order.
    let mut notes = receiver.notifications().unwrap();
    let (mut from_flooder, mut from_legit) = (Vec::new(), Vec::new());
    while from_flooder.len() < FLOOD || from_legit.len() < 2 {
        let n = bounded("the rest of the notifications", notes.recv())
            .await
            .expect("the agent is alive");
        match n.peer.as_str() {
            "flooder" => from_flooder.push(n.msg),
            "legit" => from_legit.push(n.msg),
            other => panic!("a notification from {other:?}"),
        }
    }
    for (i, m) in from_flooder.iter().enumerate() {
        assert!(
            *m == flooded(i),
            "flooded notification {i} out of order or damaged"
        );
    }
    assert_eq!(from_legit, [&b"kv ready"[..], &b"second"[..]]);
    for t in flood {
        bounded("a flooded notification", t).await.unwrap().unwrap();
    }
    let stats = receiver.notification_stats();
    assert!(stats.peers.is_empty(), "{stats:?}");
    assert_eq!(stats.dropped, 0);
    figure(
        "hostile: notification flood over nixl-tcp (receiver not reading)",
        format!(
            "{FLOOD} × 1 MiB sent, at most {} MiB queued (bound {} MiB), 0 dropped, all delivered in order once read; another peer's WRITE and notifications served meanwhile",
            most / MIB,
            BOUND / MIB
        ),
    );
    for a in [flooder, legit, receiver] {
        let report = bounded("shutdown", a.shutdown()).await;
        assert!(report.is_clean(), "{report:?}");
    }
}

/// The receiver stops reading the flooder's connection and then reads nothing for
/// four times the flooder's `dead_peer_timeout`, with enough queued behind the bound
/// to fill both sockets' buffers (a zero window, which `TCP_USER_TIMEOUT` would count
/// against a dead peer). Nothing is cut: every notification completes, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_reads_late_does_not_get_its_peer_cut() {
    const MANY: usize = 40;
    let dead = Duration::from_secs(1);
    let o = || nixl_tcp::TcpOptions {
        listener: nixl::control::ListenerOptions {
            dead_peer_timeout: dead,
            ..nixl::control::ListenerOptions::default()
        },
        ..nixl_tcp::TcpOptions::default()
    };
    let limits = NotificationLimits {
        messages: 4096,
        bytes: BOUND,
        ..NotificationLimits::default()
    };
    let receiver = agent_with("receiver", limits, o()).await;
    let flooder = agent_with("flooder", NotificationLimits::default(), o()).await;
    know_each_other(&receiver, &flooder);
    let flood: Vec<_> = (0..MANY)
        .map(|i| tokio::spawn(flooder.notify("receiver", flooded(i)).unwrap()))
        .collect();
    bounded("the flooder's queue to fill", async {
        loop {
            let s = receiver.notification_stats();
            if s.peers.get("flooder").map_or(0, |q| q.bytes) >= BOUND {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // The consumer is busy elsewhere for a while.
    tokio::time::sleep(dead * 4).await;
    let failed: Vec<_> = flood
        .iter()
        .enumerate()
        .filter(|(_, t)| t.is_finished())
        .map(|(i, _)| i)
        .collect();
    assert!(
        failed.len() <= BOUND / MIB,
        "notifications {failed:?} ended while the receiver was not reading"
    );
    let mut notes = receiver.notifications().unwrap();
    for i in 0..MANY {
        let n = bounded("the flooded notifications", notes.recv())
            .await
            .expect("the agent is alive");
        assert_eq!(n.peer, "flooder");
        assert!(
            n.msg == flooded(i),
            "notification {i} out of order or damaged"
        );
    }
    for (i, t) in flood.into_iter().enumerate() {
        let r = bounded("a flooded notification", t).await.unwrap();
        assert!(r.is_ok(), "notification {i}: {r:?}");
    }
    for a in [flooder, receiver] {
        let report = bounded("shutdown", a.shutdown()).await;
        assert!(report.is_clean(), "{report:?}");
    }
}
