//! The agent's notification bounds on the real UCX, against senders that choose their
//! names: a bare UCX worker (no agent) sends 10,000 notifications, each under a fresh
//! sender name, to an agent that reads nothing meanwhile, while a known peer keeps
//! sending. The unknown names fill their capped pool and no more; the known peer
//! loses nothing. A known peer over its own bound waits for the receiver's credit
//! and loses nothing; a sender that ignores it is held up to the backlog's bound,
//! then dropped, told so, and its next operation fails saying so; forged grants and
//! reports change nothing.
//!
//! Needs libucp at run time; without it the tests print a SKIP line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Agent, AgentOptions, ErrorKind, NotificationLimits, NotificationStats, SharedSecret};

use crate::driver::Work;
use crate::ffi::{EpId, FlightId, Ucx, UcxInit};
use crate::wire::{self, Kind};
use crate::{library, UcxBackend, UcxOptions};

/// Hang bound (never a speed assertion).
const HANG: Duration = Duration::from_secs(30);

fn backend(test: &str) -> Option<UcxBackend> {
    match UcxBackend::with_options(UcxOptions::default()) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == ErrorKind::UnavailableLibrary => {
            println!("SKIP {test}: {e}");
            None
        }
        Err(e) => panic!("ucx backend: {e}"),
    }
}

async fn agent(name: &str, b: &UcxBackend, limits: NotificationLimits) -> Agent {
    agent_with(name, b, limits, None).await
}

async fn agent_with(
    name: &str,
    b: &UcxBackend,
    limits: NotificationLimits,
    secret: Option<&SharedSecret>,
) -> Agent {
    let mut builder = Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .notification_limits(limits)
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        });
    if let Some(s) = secret {
        builder = builder.secret(s.clone());
    }
    builder.build().await.unwrap()
}

/// A bare UCX worker of this crate's binding, with an endpoint to `addr`.
fn bare_worker(addr: &[u8]) -> (Ucx<Work>, EpId) {
    let o = UcxOptions::default();
    let (req, src) = o.request();
    let (lib, _) = library::bind(&req, src, &o.expectations()).unwrap();
    let init = UcxInit {
        config: vec![("RNDV_THRESH".into(), "inf".into())],
        optional: Vec::new(),
    };
    let mut ucx = Ucx::<Work>::new(lib, &init).unwrap();
    let addr = crate::packed::Padded::address(addr).unwrap();
    let ep = ucx
        .ep_create(&addr, true)
        .or_else(|_| ucx.ep_create(&addr, false))
        .unwrap();
    (ucx, ep)
}

fn send(ucx: &mut Ucx<Work>, ep: EpId, kind: Kind, name: &str, stream: u64, seq: u64) -> FlightId {
    let h = wire::encode_header(kind, stream, seq, name);
    let data = if kind == Kind::Notif {
        Bytes::from(vec![b'e'; 64])
    } else {
        Bytes::new()
    };
    ucx.am_send(ep, wire::AM_ID, h, data, false, Work::Internal)
}

/// Progress `ucx` until every flight finished (bounded).
fn settle(ucx: &mut Ucx<Work>, mut flights: Vec<FlightId>) {
    let deadline = Instant::now() + HANG;
    while !flights.is_empty() {
        assert!(Instant::now() < deadline, "hostile sends did not finish");
        ucx.progress();
        flights.retain(|f| ucx.poll(*f).is_none());
    }
}

/// Wait (bounded) until `agent`'s notification stats satisfy `done`.
async fn stats_until(agent: &Agent, what: &str, done: impl Fn(&NotificationStats) -> bool) {
    let deadline = Instant::now() + HANG;
    loop {
        let s = agent.notification_stats();
        if done(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_sender_names_fill_only_their_pool_and_a_known_peer_loses_nothing() {
    const TEST: &str =
        "ten_thousand_sender_names_fill_only_their_pool_and_a_known_peer_loses_nothing";
    const NAMES: u64 = 10_000;
    const GOOD: usize = 100;
    let Some(tb) = backend(TEST) else { return };
    let gb = UcxBackend::with_options(UcxOptions::default()).unwrap();
    let limits = NotificationLimits {
        messages: 128,
        bytes: 1 << 20,
        total_messages: 1024,
        total_bytes: 256 << 10,
        unknown_peers: 32,
        unknown_messages: 256,
        unknown_bytes: 16 << 10,
    };
    let target = agent("target", &tb, limits).await;
    let good = agent("good", &gb, NotificationLimits::default()).await;
    good.load_metadata(&target.metadata().unwrap()).unwrap();
    target.load_metadata(&good.metadata().unwrap()).unwrap();
    good.connect("target").await.unwrap();

    // The flood, in batches, the known peer's notifications between them. Nobody
    // reads at the target meanwhile.
    let (mut evil, ep) = bare_worker(&tb.inner.address);
    let mut most = NotificationStats::default();
    let mut good_sent = 0;
    for batch in 0..NAMES / 500 {
        let flights = (batch * 500..(batch + 1) * 500)
            .map(|i| send(&mut evil, ep, Kind::Notif, &format!("evil-{i}"), i, 0))
            .collect();
        settle(&mut evil, flights);
        for _ in 0..GOOD / 20 {
            good.notify("target", format!("good-{good_sent}"))
                .unwrap()
                .await
                .unwrap();
            good_sent += 1;
        }
        let s = target.notification_stats();
        assert!(s.unknown_peers <= 32, "{s:?}");
        assert!(s.queued().messages <= 1024, "{s:?}");
        most.unknown_peers = most.unknown_peers.max(s.unknown_peers);
    }
    // Every evil notification was taken in: queued (one per name while the cap has
    // room) or dropped and counted.
    stats_until(&target, "the flood taken in", |s| {
        s.unknown.messages as u64 + s.dropped == NAMES
            && s.peers.get("good").map(|q| q.messages) == Some(GOOD)
    })
    .await;
    let s = target.notification_stats();
    assert_eq!((s.unknown_peers, s.unknown.messages), (32, 32), "{s:?}");
    assert_eq!(s.dropped, NAMES - 32);
    assert_eq!(s.peers.len(), 33, "32 unknown names and the known peer");
    // The bounds held all along (the agent's own high-water marks).
    assert!(s.peaks.unknown_peers <= 32, "{s:?}");
    assert!(s.peaks.unknown.messages <= 256, "{s:?}");
    assert!(s.peaks.unknown.bytes <= 16 << 10, "{s:?}");
    assert!(s.peaks.queued.messages <= 1024, "{s:?}");
    assert!(s.peaks.queued.bytes <= 256 << 10, "{s:?}");

    // Reading: every one of the known peer's notifications, in order, none dropped.
    let mut notes = target.notifications().unwrap();
    let (mut next_good, mut evil_read) = (0, 0);
    while next_good < GOOD || evil_read < 32 {
        let n = tokio::time::timeout(HANG, notes.recv())
            .await
            .expect("queued notifications are read")
            .unwrap();
        if n.peer == "good" {
            assert_eq!(n.msg, format!("good-{next_good}"));
            next_good += 1;
        } else {
            assert!(n.peer.starts_with("evil-"), "{}", n.peer);
            evil_read += 1;
        }
    }
    assert!(notes.try_recv().is_none());
    println!(
        "FIGURE ucx notification names: {NAMES} notifications under {NAMES} fresh names + {GOOD} from a known peer, receiver not reading; queued at most {} messages / {} bytes ({} unknown names, cap 32); {} dropped (all unknown), the known peer's {GOOD} all delivered in order",
        s.peaks.queued.messages, s.peaks.queued.bytes, s.peaks.unknown_peers, s.dropped
    );
    assert!(target.shutdown().await.is_clean());
    assert!(good.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_peer_over_its_bound_waits_and_loses_nothing() {
    known_peer_over_its_bound(
        "a_known_peer_over_its_bound_waits_and_loses_nothing",
        None,
        false,
    )
    .await;
}

/// The same between agents of this crate that exchanged NIXL's format (what the
/// Python package does with UCX): the nixl-rs marker in it makes them speak this
/// crate's protocol to each other, flow control included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_exchanging_nixls_format_get_flow_control_too() {
    known_peer_over_its_bound(
        "agents_exchanging_nixls_format_get_flow_control_too",
        None,
        true,
    )
    .await;
}

/// The same between agents with a shared secret: grants are MAC'd for their
/// receiver like every message of ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_peer_over_its_bound_waits_with_a_secret() {
    let s = SharedSecret::new("credit grants").unwrap();
    known_peer_over_its_bound(
        "a_known_peer_over_its_bound_waits_with_a_secret",
        Some(&s),
        false,
    )
    .await;
}

/// Notifications waiting at the sender (for credit) and held at the receiver.
fn held(sender: &UcxBackend, receiver: &UcxBackend, peer: &str) -> (usize, usize) {
    let g = sender.inner.shared.core.lock().unwrap();
    let s = g
        .as_ref()
        .unwrap()
        .peers
        .get(peer)
        .map_or(0, |p| p.held_len());
    drop(g);
    let g = receiver.inner.shared.core.lock().unwrap();
    (s, g.as_ref().unwrap().backlogs.len())
}

/// A known peer sends far more than its bound while the target reads nothing: the
/// target holds at most its credit window, and the sender holds the rest (its sends
/// stay pending) until the target grants more. Once the target reads, every
/// notification arrives, in order, none dropped, and every send completes.
async fn known_peer_over_its_bound(test: &str, secret: Option<&SharedSecret>, nixl_format: bool) {
    const BOUND: usize = 8;
    const WINDOW: usize = crate::driver::CREDIT_WINDOW as usize;
    const SENT: usize = 3000;
    let Some(tb) = backend(test) else { return };
    let gb = UcxBackend::with_options(UcxOptions::default()).unwrap();
    let limits = NotificationLimits {
        messages: BOUND,
        ..NotificationLimits::default()
    };
    let target = agent_with("target", &tb, limits, secret).await;
    let good = agent_with("good", &gb, NotificationLimits::default(), secret).await;
    if nixl_format {
        good.load_metadata(&target.nixl_metadata().unwrap())
            .unwrap();
        target
            .load_metadata(&good.nixl_metadata().unwrap())
            .unwrap();
        assert!(good.is_nixl_peer("target").unwrap());
    } else {
        good.load_metadata(&target.metadata().unwrap()).unwrap();
        target.load_metadata(&good.metadata().unwrap()).unwrap();
    }
    good.connect("target").await.unwrap();
    target.connect("good").await.unwrap();
    good.notify("target", "n0").unwrap().await.unwrap();
    // Far more than the bound, nobody reading: the queue takes the bound, the
    // target holds a window beyond it, the sender holds the rest (its sends pending).
    let mut sends = Vec::new();
    for i in 1..SENT {
        sends.push(good.notify("target", format!("n{i}")).unwrap());
    }
    // The target answers the sender's asks with a window beyond what its queue took
    // in: it holds that window, and the sender the rest.
    let want = (SENT - BOUND - WINDOW, WINDOW);
    let deadline = Instant::now() + HANG;
    while held(&gb, &tb, "target") != want {
        assert!(
            Instant::now() < deadline,
            "held (sender, receiver): {:?}, want {want:?}",
            held(&gb, &tb, "target")
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // It got there by the target's answers to its asks.
    let granted = {
        let g = gb.inner.shared.core.lock().unwrap();
        g.as_ref()
            .unwrap()
            .peers
            .get("target")
            .unwrap()
            .is_granted()
    };
    assert!(granted, "the sender never got an answer");
    // A forged grant (not on the sender's stream) changes nothing.
    let (mut evil, ep) = bare_worker(&gb.inner.address);
    let f = send(&mut evil, ep, Kind::Credit, "target", 12_345, u64::MAX);
    settle(&mut evil, vec![f]);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(held(&gb, &tb, "target"), want, "a forged CREDIT was taken");
    let s = target.notification_stats();
    assert_eq!(s.dropped, 0, "{s:?}");
    assert_eq!(s.peers.get("good").map(|q| q.messages), Some(BOUND));

    // The target reads: everything arrives in order and every send completes.
    let mut notes = target.notifications().unwrap();
    for i in 0..SENT {
        let n = tokio::time::timeout(HANG, notes.recv())
            .await
            .expect("held notifications arrive as the target reads")
            .unwrap();
        assert_eq!(
            (n.peer.as_str(), n.msg),
            ("good", Bytes::from(format!("n{i}")))
        );
    }
    for t in sends {
        tokio::time::timeout(HANG, t).await.unwrap().unwrap();
    }
    assert_eq!(target.notification_stats().dropped, 0);
    assert_eq!(held(&gb, &tb, "target"), (0, 0));
    good.notify("target", "after").unwrap().await.unwrap();
    let n = tokio::time::timeout(HANG, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&n.msg[..], b"after");
    println!(
        "FIGURE ucx notification flow control (secret: {}, NIXL's format: {nixl_format}): {SENT} sent to a bound of {BOUND} unread; none dropped; {} held at the receiver (the credit window), {} waiting at the sender (its sends pending); all delivered in order once read",
        secret.is_some(),
        want.1,
        want.0
    );
    assert!(target.shutdown().await.is_clean());
    assert!(good.shutdown().await.is_clean());
}

/// A sender that ignores its grant (a bare worker writing on a peer's stream) has its
/// notifications held up to the backlog's bound, then dropped; the drops are
/// reported on the peer's connection and its next operation fails, naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_ignores_its_grant_is_dropped_past_the_backlog_and_told() {
    const TEST: &str = "a_sender_that_ignores_its_grant_is_dropped_past_the_backlog_and_told";
    const BOUND: usize = 8;
    const EXCESS: usize = 50;
    let Some(tb) = backend(TEST) else { return };
    let gb = UcxBackend::with_options(UcxOptions::default()).unwrap();
    let limits = NotificationLimits {
        messages: BOUND,
        ..NotificationLimits::default()
    };
    let target = agent("target", &tb, limits).await;
    let good = agent("good", &gb, NotificationLimits::default()).await;
    good.load_metadata(&target.metadata().unwrap()).unwrap();
    target.load_metadata(&good.metadata().unwrap()).unwrap();
    good.connect("target").await.unwrap();
    good.notify("target", "first").unwrap().await.unwrap();
    let stream = {
        let g = gb.inner.shared.core.lock().unwrap();
        g.as_ref().unwrap().peers.get("target").unwrap().epoch
    };
    let (mut evil, ep) = bare_worker(&tb.inner.address);
    let total = BOUND - 1 + crate::driver::BACKLOG_PEER_MESSAGES + EXCESS;
    for chunk in (1..=total as u64).collect::<Vec<_>>().chunks(500) {
        let flights = chunk
            .iter()
            .map(|&seq| send(&mut evil, ep, Kind::Notif, "good", stream, seq))
            .collect();
        settle(&mut evil, flights);
    }
    stats_until(&target, "the excess dropped", |s| {
        s.dropped == EXCESS as u64
    })
    .await;
    let deadline = Instant::now() + HANG;
    let reported = || {
        let g = gb.inner.shared.core.lock().unwrap();
        g.as_ref().unwrap().dropped_reported("target")
    };
    while reported() < EXCESS as u64 {
        assert!(Instant::now() < deadline, "the drops were not reported");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let e = good.notify("target", "next").unwrap().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    assert!(e.context().contains(&format!("dropped {EXCESS} ")), "{e}");
    // What was held arrives, in order, after what was queued.
    let mut notes = target.notifications().unwrap();
    let first = tokio::time::timeout(HANG, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&first.msg[..], b"first");
    for _ in 1..BOUND + crate::driver::BACKLOG_PEER_MESSAGES {
        tokio::time::timeout(HANG, notes.recv())
            .await
            .unwrap()
            .unwrap();
    }
    assert!(target.shutdown().await.is_clean());
    assert!(good.shutdown().await.is_clean());
}
