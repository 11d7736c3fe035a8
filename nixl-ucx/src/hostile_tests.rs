//! A hostile sender on the real UCX against an agent's receive path.
//!
//! The hostile side is a bare UCX worker of this crate's own binding (no agent), so it
//! can put anything in this backend's active messages: notifications over the limit,
//! gaps that never fill, a fresh stream or sender name per message, a HELLO naming
//! someone else's address. The receiving agent must refuse or bound all of it, keep
//! delivering a legitimate peer's notifications in order, and at shutdown dial no
//! address it learned only from a HELLO. Lives inside the crate (not in the
//! conformance suite) because it needs the raw active-message sender.
//!
//! Needs libucp at run time; without it the test prints a SKIP line.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Agent, AgentOptions, ErrorKind};

use crate::driver::Work;
use crate::ffi::{EpId, FlightId, Ucx, UcxInit};
use crate::wire::{self, Kind};
use crate::{library, UcxBackend, UcxOptions};

const MAX_NOTIFICATION: usize = 4096;

/// Run `ucx`'s progress until every flight finished (bounded).
fn settle(ucx: &mut Ucx<Work>, mut flights: Vec<FlightId>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !flights.is_empty() {
        assert!(Instant::now() < deadline, "hostile sends did not finish");
        ucx.progress();
        flights.retain(|f| ucx.poll(*f).is_none());
    }
}

fn send(
    ucx: &mut Ucx<Work>,
    ep: EpId,
    kind: Kind,
    name: &str,
    stream: u64,
    seq: u64,
    data: Bytes,
) -> FlightId {
    let h = wire::encode_header(kind, stream, seq, name);
    ucx.am_send(ep, wire::AM_ID, h, data, false, Work::Internal)
}

async fn agent(name: &str, b: &UcxBackend) -> Agent {
    Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sender_is_bounded_and_a_good_one_served() {
    let o = UcxOptions {
        max_notification: MAX_NOTIFICATION,
        ..UcxOptions::default()
    };
    let tb = match UcxBackend::with_options(o.clone()) {
        Ok(b) => b,
        Err(e) if e.kind() == ErrorKind::UnavailableLibrary => {
            println!("SKIP hostile_sender_is_bounded_and_a_good_one_served: {e}");
            return;
        }
        Err(e) => panic!("ucx backend: {e}"),
    };
    let gb = UcxBackend::with_options(o.clone()).unwrap();
    let target = agent("target", &tb).await;
    let good = agent("good", &gb).await;
    good.load_metadata(&target.metadata().unwrap()).unwrap();
    good.connect("target").await.unwrap();
    let mut notes = target.notifications().unwrap();

    // The hostile worker, and a bystander whose address the hostile one hands out.
    let (req, src) = o.request();
    let (lib, _) = library::bind(&req, src, &o.expectations()).unwrap();
    let init = UcxInit {
        config: vec![("RNDV_THRESH".into(), "inf".into())],
        optional: Vec::new(),
    };
    let mut evil = Ucx::<Work>::new(lib, &init).unwrap();
    let mut bystander = Ucx::<Work>::new(lib, &init).unwrap();
    let dialled = Arc::new(AtomicUsize::new(0));
    let d = dialled.clone();
    bystander
        .set_am_handler(
            wire::AM_ID,
            Box::new(move |_| {
                d.fetch_add(1, Ordering::Relaxed);
                None
            }),
        )
        .unwrap();
    let addr = tb.inner.address.clone();
    let ep = evil
        .ep_create(&addr, true)
        .or_else(|_| evil.ep_create(&addr, false))
        .unwrap();

    // The good peer's first notification, received before the flood: its stream's
    // state is then the oldest, the first the flood below replaces.
    good.notify("target", "good-0").unwrap().await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((n.peer.as_str(), &n.msg[..]), ("good", &b"good-0"[..]));

    // 1. A HELLO giving the bystander's address as the sender's.
    let by = Bytes::copy_from_slice(bystander.address());
    let mut f = vec![send(&mut evil, ep, Kind::Hello, "evil", 1, 0, by)];
    // 2. Notifications over the limit.
    for i in 0..20 {
        let big = Bytes::from(vec![b'x'; MAX_NOTIFICATION * 16]);
        f.push(send(&mut evil, ep, Kind::Notif, "evil", 1, i, big));
    }
    // 3. A gap that never fills: sequence 0 of stream 2 never comes.
    for seq in 1..=2000 {
        let m = Bytes::from(vec![b'g'; 2048]);
        f.push(send(&mut evil, ep, Kind::Notif, "evil", 2, seq, m));
    }
    settle(&mut evil, std::mem::take(&mut f));
    // 4. A fresh sender name and stream per message, each waiting for its 0.
    for i in 0..1500u64 {
        let m = Bytes::from_static(b"held");
        f.push(send(
            &mut evil,
            ep,
            Kind::Notif,
            &format!("evil-{i}"),
            i,
            1,
            m,
        ));
    }
    // Then one the target delivers at once: once it arrives, so has the flood (one
    // endpoint, in order).
    f.push(send(
        &mut evil,
        ep,
        Kind::Notif,
        "evil-sync",
        0,
        0,
        Bytes::new(),
    ));
    settle(&mut evil, f);
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), notes.recv())
            .await
            .expect("the flood is taken in")
            .expect("notifications open");
        assert!(
            n.msg.len() <= MAX_NOTIFICATION,
            "{} bytes from {}",
            n.msg.len(),
            n.peer
        );
        if n.peer == "evil-sync" {
            break;
        }
    }
    // 5. The good peer goes on. Its stream was replaced by the flood, so its next
    // message (1) starts a stream that waits for a 0 that never comes: the gap
    // timeout, not a full window, lets them through.
    for i in 1..=100 {
        good.notify("target", format!("good-{i}"))
            .unwrap()
            .await
            .unwrap();
    }

    // The good peer's 100 arrive, in order; nothing over the limit reaches the agent.
    let mut next_good = 1;
    let deadline = Instant::now() + Duration::from_secs(20);
    while next_good <= 100 {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(left, notes.recv())
            .await
            .expect("the good peer's notifications arrive")
            .expect("notifications open");
        assert!(
            n.msg.len() <= MAX_NOTIFICATION,
            "{} bytes from {} delivered",
            n.msg.len(),
            n.peer
        );
        if n.peer == "good" {
            assert_eq!(n.msg, format!("good-{next_good}"));
            next_good += 1;
        }
    }
    {
        let g = tb.inner.shared.core.lock().unwrap();
        let core = g.as_ref().unwrap();
        // The documented limits (README): 1024 streams in all, a window of 256.
        assert!(core.refused.oversized.load(Ordering::Relaxed) >= 20);
        assert!(
            core.reorder.streams() <= 1024,
            "{} streams",
            core.reorder.streams()
        );
        // Stream 2 holds at most a window of 2 KiB messages; the rest a few bytes each.
        let bound = 256 * 2048 + 1024 * 4;
        assert!(
            core.reorder.held_bytes() <= bound,
            "{} bytes held (bound {bound})",
            core.reorder.held_bytes()
        );
    }

    // Shutdown dials nobody it heard of only through a HELLO.
    let t0 = Instant::now();
    let shut = tokio::spawn(async move { target.shutdown().await });
    while !shut.is_finished() || t0.elapsed() < Duration::from_millis(1500) {
        bystander.progress();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(shut.await.unwrap().is_clean());
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        dialled.load(Ordering::Relaxed),
        0,
        "the bystander was dialled"
    );
    assert!(good.shutdown().await.is_clean());
}
