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
//! With a shared secret, the same kind of worker forges what only a holder of the
//! secret could make (notifications, HELLO, BYE and PING of either header version,
//! MAC'd with another secret or for another agent, NIXL's notifications), and agents
//! with different or one-sided secrets talk to each other: nothing unauthenticated
//! is acted on.
//!
//! Needs libucp at run time; without it the tests print a SKIP line.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Agent, AgentOptions, ErrorKind, SharedSecret};

use crate::driver::Work;
use crate::ffi::{EpId, FlightId, Ucx, UcxInit};
use crate::packed::Padded;
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
    agent_with(name, b, None).await
}

async fn agent_with(name: &str, b: &UcxBackend, secret: Option<&SharedSecret>) -> Agent {
    let mut builder = Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        });
    if let Some(s) = secret {
        builder = builder.secret(s.clone());
    }
    builder.build().await.unwrap()
}

/// A UCX backend, or `None` (after a SKIP line naming `test`) without libucp.
fn backend(test: &str, o: &UcxOptions) -> Option<UcxBackend> {
    match UcxBackend::with_options(o.clone()) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == ErrorKind::UnavailableLibrary => {
            println!("SKIP {test}: {e}");
            None
        }
        Err(e) => panic!("ucx backend: {e}"),
    }
}

/// A bare UCX worker of this crate's binding (no agent), as a hostile sender uses.
fn bare_worker(o: &UcxOptions) -> Ucx<Work> {
    let (req, src) = o.request();
    let (lib, _) = library::bind(&req, src, &o.expectations()).unwrap();
    let init = UcxInit {
        config: vec![("RNDV_THRESH".into(), "inf".into())],
        optional: Vec::new(),
    };
    Ucx::<Work>::new(lib, &init).unwrap()
}

/// An endpoint from `ucx` to the worker at `addr`.
fn dial(ucx: &mut Ucx<Work>, addr: &[u8]) -> EpId {
    let addr = Padded::address(addr).unwrap();
    ucx.ep_create(&addr, true)
        .or_else(|_| ucx.ep_create(&addr, false))
        .unwrap()
}

fn secret(s: &str) -> SharedSecret {
    SharedSecret::new(s).unwrap()
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
    let mut evil = bare_worker(&o);
    let mut bystander = bare_worker(&o);
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
    let ep = dial(&mut evil, &tb.inner.address);

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

/// What a bare worker got on this backend's message id: the headers, decoded.
fn record_headers(ucx: &mut Ucx<Work>) -> Arc<Mutex<Vec<wire::Header>>> {
    let got: Arc<Mutex<Vec<wire::Header>>> = Arc::default();
    let g = got.clone();
    ucx.set_am_handler(
        wire::AM_ID,
        Box::new(move |m| {
            if let Some(h) = wire::decode_header(m.header) {
                g.lock().unwrap().push(h);
            }
            None
        }),
    )
    .unwrap();
    got
}

/// The next notification, within a bound that only catches hangs.
async fn next(notes: &mut nixl::Notifications) -> nixl::Notification {
    tokio::time::timeout(Duration::from_secs(20), notes.recv())
        .await
        .expect("a notification arrives")
        .expect("notifications open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_messages_are_refused_with_a_secret() {
    const TEST: &str = "forged_messages_are_refused_with_a_secret";
    let o = UcxOptions::default();
    let Some(tb) = backend(TEST, &o) else { return };
    let gb = UcxBackend::with_options(o.clone()).unwrap();
    let s = secret("the deployment's secret");
    let target = agent_with("target", &tb, Some(&s)).await;
    let good = agent_with("good", &gb, Some(&s)).await;
    good.load_metadata(&target.metadata().unwrap()).unwrap();
    target.load_metadata(&good.metadata().unwrap()).unwrap();
    good.connect("target").await.unwrap();
    target.connect("good").await.unwrap();
    let mut notes = target.notifications().unwrap();
    let mut good_notes = good.notifications().unwrap();
    good.notify("target", "good-0").unwrap().await.unwrap();
    let n = next(&mut notes).await;
    assert_eq!((n.peer.as_str(), &n.msg[..]), ("good", &b"good-0"[..]));

    let mut evil = bare_worker(&o);
    let answers = record_headers(&mut evil);
    let ep = dial(&mut evil, &tb.inner.address);
    let other = secret("another secret");
    let good_addr = gb.inner.address.clone();
    let forged = Bytes::from_static(b"forged: KV ready");
    let mut sent: Vec<(&str, u32, Vec<u8>, Bytes, bool)> = vec![
        // Notifications in good's name: no MAC; another secret's; the right secret's
        // made for another agent; the right secret's for the target, over other data
        // (the payload changed on the way); a MAC of zeros.
        (
            "v1 notification",
            wire::AM_ID,
            wire::encode_header(Kind::Notif, 1, 0, "good"),
            forged.clone(),
            false,
        ),
        (
            "another secret",
            wire::AM_ID,
            wire::encode_signed_header(&other, "target", Kind::Notif, 1, 1, "good", &forged),
            forged.clone(),
            false,
        ),
        (
            "made for another agent",
            wire::AM_ID,
            wire::encode_signed_header(&s, "decode-1", Kind::Notif, 1, 2, "good", &forged),
            forged.clone(),
            false,
        ),
        (
            "other data",
            wire::AM_ID,
            wire::encode_signed_header(&s, "target", Kind::Notif, 1, 3, "good", b"real"),
            forged.clone(),
            false,
        ),
        (
            "zero MAC",
            wire::AM_ID,
            {
                let mut h =
                    wire::encode_signed_header(&s, "target", Kind::Notif, 1, 4, "good", &forged);
                let n = h.len();
                h[n - wire::MAC_LEN..].fill(0);
                h
            },
            forged.clone(),
            false,
        ),
        // NIXL's notification, which cannot carry a MAC.
        (
            "NIXL notification",
            wire::NIXL_NOTIF_AM_ID,
            Vec::new(),
            Bytes::from(nixl::interop::encode_notification("good", &forged)),
            false,
        ),
        // HELLO and BYE in good's name from good's address: a BYE acted on would end
        // the target's connection to good.
        (
            "v1 HELLO",
            wire::AM_ID,
            wire::encode_header(Kind::Hello, 1, 0, "good"),
            good_addr.clone(),
            false,
        ),
        (
            "v1 BYE",
            wire::AM_ID,
            wire::encode_header(Kind::Bye, 0, 0, "good"),
            good_addr.clone(),
            false,
        ),
        (
            "BYE for another agent",
            wire::AM_ID,
            wire::encode_signed_header(&s, "decode-1", Kind::Bye, 0, 0, "good", &good_addr),
            good_addr.clone(),
            false,
        ),
        // PINGs asking for an answer on the reply endpoint.
        (
            "v1 PING",
            wire::AM_ID,
            wire::encode_header(Kind::Ping, 5, 1, "good"),
            Bytes::new(),
            true,
        ),
        (
            "PING with another secret",
            wire::AM_ID,
            wire::encode_signed_header(&other, "target", Kind::Ping, 5, 2, "good", &[]),
            Bytes::new(),
            true,
        ),
        (
            "PING for another agent",
            wire::AM_ID,
            wire::encode_signed_header(&s, "decode-1", Kind::Ping, 5, 3, "good", &[]),
            Bytes::new(),
            true,
        ),
    ];
    let forgeries = sent.len() as u64;
    // Then what a holder of the secret sends the target (a bare worker can too): once
    // these are answered and delivered, the forgeries before them on this endpoint
    // were taken in.
    sent.push((
        "a holder's PING",
        wire::AM_ID,
        wire::encode_signed_header(&s, "target", Kind::Ping, 5, 100, "holder", &[]),
        Bytes::new(),
        true,
    ));
    sent.push((
        "a holder's notification",
        wire::AM_ID,
        wire::encode_signed_header(&s, "target", Kind::Notif, 9, 0, "holder", b"sync"),
        Bytes::from_static(b"sync"),
        false,
    ));
    let flights = sent
        .into_iter()
        .map(|(_, id, h, data, reply)| evil.am_send(ep, id, h, data, reply, Work::Internal))
        .collect();
    settle(&mut evil, flights);
    let n = next(&mut notes).await;
    assert_eq!(
        (n.peer.as_str(), &n.msg[..]),
        ("holder", &b"sync"[..]),
        "only the holder's notification is delivered"
    );
    // The holder's PING is answered with a PONG MAC'd for it; no forged one is.
    let deadline = Instant::now() + Duration::from_secs(20);
    while answers.lock().unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the holder's PING was not answered"
        );
        evil.progress();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for _ in 0..100 {
        evil.progress();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    {
        let answers = answers.lock().unwrap();
        assert_eq!(answers.len(), 1, "answers: {answers:?}");
        let a = &answers[0];
        assert_eq!(
            (a.kind, a.stream, a.seq, a.name.as_str()),
            (Kind::Pong, 5, 100, "target")
        );
        assert!(a.verify(&s, "holder", &[]), "the PONG proves the secret");
    }
    {
        let g = tb.inner.shared.core.lock().unwrap();
        let r = &g.as_ref().unwrap().refused;
        assert_eq!(r.unauthenticated.load(Ordering::Relaxed), forgeries);
        assert_eq!(r.malformed.load(Ordering::Relaxed), 0);
    }

    // The forged BYE ended nothing: the target still reaches good.
    target.notify("good", "still here").unwrap().await.unwrap();
    let n = next(&mut good_notes).await;
    assert_eq!(
        (n.peer.as_str(), &n.msg[..]),
        ("target", &b"still here"[..])
    );
    // And good's notifications still come through, in order, and nothing forged.
    for i in 1..=20 {
        good.notify("target", format!("good-{i}"))
            .unwrap()
            .await
            .unwrap();
    }
    for i in 1..=20 {
        let n = next(&mut notes).await;
        assert_eq!(n.peer, "good");
        assert_eq!(n.msg, format!("good-{i}"));
    }
    assert!(notes.try_recv().is_none());
    assert!(target.shutdown().await.is_clean());
    assert!(good.shutdown().await.is_clean());
}

/// The receive path's count of unauthenticated messages at `b`.
fn unauthenticated(b: &UcxBackend) -> u64 {
    let g = b.inner.shared.core.lock().unwrap();
    g.as_ref()
        .map_or(0, |c| c.refused.unauthenticated.load(Ordering::Relaxed))
}

/// Two agents with these secrets notify each other; returns whether each side got
/// the other's notification (`a` got b's, `b` got a's). A side that refuses is
/// waited for until it counted the other's HELLO and notification as unauthenticated.
async fn exchange(
    test: &str,
    sa: Option<&SharedSecret>,
    sb: Option<&SharedSecret>,
) -> Option<(bool, bool)> {
    let o = UcxOptions::default();
    let ba = backend(test, &o)?;
    let bb = UcxBackend::with_options(o).unwrap();
    let a = agent_with("a", &ba, sa).await;
    let b = agent_with("b", &bb, sb).await;
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    b.load_metadata(&a.metadata().unwrap()).unwrap();
    let (mut na, mut nb) = (a.notifications().unwrap(), b.notifications().unwrap());
    // The send itself succeeds either way: UCX delivered it; the receiver judges it.
    a.notify("b", "from a").unwrap().await.unwrap();
    b.notify("a", "from b").unwrap().await.unwrap();
    let mut got = Vec::new();
    for (backend, notes, from) in [(&ba, &mut na, "b"), (&bb, &mut nb, "a")] {
        let deadline = Instant::now() + Duration::from_secs(20);
        let delivered = loop {
            if let Some(n) = notes.try_recv() {
                assert_eq!(
                    (n.peer.as_str(), &n.msg[..]),
                    (from, format!("from {from}").as_bytes())
                );
                break true;
            }
            // Its HELLO and its notification, both refused.
            if unauthenticated(backend) >= 2 {
                break false;
            }
            assert!(
                Instant::now() < deadline,
                "{from}'s notification neither delivered nor refused"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        if delivered {
            assert_eq!(unauthenticated(backend), 0);
        } else {
            assert_eq!(unauthenticated(backend), 2);
            assert!(notes.try_recv().is_none(), "delivered although refused");
        }
        got.push(delivered);
    }
    assert!(a.shutdown().await.is_clean());
    assert!(b.shutdown().await.is_clean());
    Some((got[0], got[1]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_need_the_same_secret_on_both_sides() {
    const TEST: &str = "notifications_need_the_same_secret_on_both_sides";
    let (s1, s2) = (secret("secret one"), secret("secret two"));
    let Some(same) = exchange(TEST, Some(&s1), Some(&s1.clone())).await else {
        return;
    };
    assert_eq!(same, (true, true), "the same secret");
    let differ = exchange(TEST, Some(&s1), Some(&s2)).await.unwrap();
    assert_eq!(differ, (false, false), "different secrets");
    // A secret on one side only: the side with it refuses the other's unsigned
    // messages, the side without refuses signed ones (a configuration mismatch).
    let one_sided = exchange(TEST, Some(&s1), None).await.unwrap();
    assert_eq!(one_sided, (false, false), "a secret on a only");
    let other_side = exchange(TEST, None, Some(&s2)).await.unwrap();
    assert_eq!(other_side, (false, false), "a secret on b only");
    // Without secrets, as before.
    assert_eq!(exchange(TEST, None, None).await.unwrap(), (true, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_agents_are_refused_with_a_secret() {
    const TEST: &str = "nixl_agents_are_refused_with_a_secret";
    let o = UcxOptions::default();
    let Some(pb) = backend(TEST, &o) else { return };
    let sb = UcxBackend::with_options(o.clone()).unwrap();
    // `plain` stands in for a NIXL agent: its metadata in NIXL's format.
    let plain = agent("plain", &pb).await;
    let guarded = agent_with("guarded", &sb, Some(&secret("s"))).await;
    let nixl_md = plain.nixl_metadata().unwrap();
    let e = guarded.load_metadata(&nixl_md).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    assert!(e.to_string().contains("shared secret"), "{e}");
    assert!(
        guarded.remote_regions("plain").is_err(),
        "nothing was loaded"
    );
    // Our metadata in NIXL's format (what NIXL agents load) is refused too.
    let _r = guarded.register(vec![0u8; 4096]).unwrap();
    let e = guarded.nixl_metadata().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    // Without a secret, as before.
    let _r = plain.register(vec![0u8; 4096]).unwrap();
    plain.nixl_metadata().unwrap();
    // A secret in the backend's options overrides the agent's (none here).
    let ob = UcxBackend::with_options(UcxOptions {
        secret: Some(secret("s")),
        ..o
    })
    .unwrap();
    let optioned = agent("optioned", &ob).await;
    let e = optioned.load_metadata(&nixl_md).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    for a in [plain, guarded, optioned] {
        assert!(a.shutdown().await.is_clean());
    }
}

/// Liveness probes between agents with a secret: the PING is MAC'd for the peer, the
/// PONG for the prober, and the answer is taken (the probe ends). With different
/// secrets the PING is refused and the probe stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_probes_are_authenticated() {
    const TEST: &str = "liveness_probes_are_authenticated";
    let o = UcxOptions::default();
    if backend(TEST, &o).is_none() {
        return;
    }
    let (s, other) = (secret("probe secret"), secret("another"));
    for (sb, answered) in [(&s, true), (&other, false)] {
        let ba = UcxBackend::with_options(o.clone()).unwrap();
        let bb = UcxBackend::with_options(o.clone()).unwrap();
        let a = agent_with("a", &ba, Some(&s)).await;
        let b = agent_with("b", &bb, Some(sb)).await;
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        a.connect("b").await.unwrap();
        ba.inner
            .shared
            .core
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .probe_now("b");
        let probing = || {
            let g = ba.inner.shared.core.lock().unwrap();
            g.as_ref().unwrap().probing("b")
        };
        assert!(probing());
        let deadline = Instant::now() + Duration::from_secs(20);
        if answered {
            while probing() {
                assert!(Instant::now() < deadline, "the PONG was not taken");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(unauthenticated(&ba), 0);
            assert_eq!(unauthenticated(&bb), 0);
        } else {
            // a's HELLO and its PING, refused at b (an answered PING would not be
            // counted); the probe waits on.
            while unauthenticated(&bb) < 2 {
                assert!(Instant::now() < deadline, "the PING was not refused");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(probing(), "a PING with another secret was answered");
        }
        assert!(a.shutdown().await.is_clean());
        assert!(b.shutdown().await.is_clean());
    }
}

/// Send everything in `msgs` from `ucx` on `ep` by rendezvous, `rounds` times, and
/// progress until every send finished (bounded); returns how many were rejected by
/// the receiver and how many succeeded, per message of `msgs` (any other outcome
/// panics).
fn rendezvous_flood(
    ucx: &mut Ucx<Work>,
    ep: EpId,
    msgs: &[(u32, Vec<u8>, Bytes)],
    rounds: usize,
) -> Vec<(usize, usize)> {
    let mut outcome = vec![(0, 0); msgs.len()];
    let mut flights: Vec<(usize, FlightId)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    // Progress until at most `left` sends are in flight.
    let mut drain = |ucx: &mut Ucx<Work>, flights: &mut Vec<(usize, FlightId)>, left: usize| {
        while flights.len() > left {
            assert!(Instant::now() < deadline, "rendezvous sends did not finish");
            ucx.progress();
            flights.retain(|&(i, f)| {
                let Some((_, r)) = ucx.poll(f) else {
                    return true;
                };
                match r {
                    Err(e) if e.is_rejected() => outcome[i].0 += 1,
                    Err(e) => panic!("message {i}: {e} (expected a rejection)"),
                    Ok(()) => outcome[i].1 += 1,
                }
                false
            });
        }
    };
    for _ in 0..rounds {
        for (i, (id, h, data)) in msgs.iter().enumerate() {
            let f = ucx.am_send_rndv(ep, *id, h.clone(), data.clone(), Work::Internal);
            flights.push((i, f));
        }
        // A few rounds at a time in flight, so the receiver sees them interleaved
        // with the legitimate peer's traffic rather than all at once.
        drain(ucx, &mut flights, 4 * msgs.len());
    }
    drain(ucx, &mut flights, 0);
    outcome
}

/// Rendezvous offers (`UCP_AM_SEND_FLAG_RNDV`, which neither this backend nor NIXL
/// ever sends: both force eager) on every id the backend listens on, with payloads
/// from nothing to 1 MiB, while a legitimate peer keeps notifying: each offer is
/// declined through UCX's own path (the sender's send fails with the declining
/// status, UCX drops the descriptor once), counted, and nothing of it is delivered;
/// the peer's notifications all arrive, in order. Before the fix the handler released
/// the descriptor itself and returned `UCS_OK`, so UCX released it a second time (and
/// acknowledged twice): the sender saw success, and the receiver's heap was corrupted
/// (valgrind's memcheck names the double release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_offers_are_declined_while_traffic_flows() {
    const TEST: &str = "rendezvous_offers_are_declined_while_traffic_flows";
    const ROUNDS: usize = 40;
    const GOOD: usize = 200;
    let o = UcxOptions::default();
    let Some(tb) = backend(TEST, &o) else { return };
    let gb = UcxBackend::with_options(o.clone()).unwrap();
    let target = agent("target", &tb).await;
    let good = agent("good", &gb).await;
    good.load_metadata(&target.metadata().unwrap()).unwrap();
    good.connect("target").await.unwrap();
    let mut notes = target.notifications().unwrap();

    let mut evil = bare_worker(&o);
    let ep = dial(&mut evil, &tb.inner.address);
    let n = |len: usize| Bytes::from(vec![b'r'; len]);
    // Ours (notifications of every size within the limit, a PING asking for an
    // answer, a HELLO), then NIXL's notification. Each is refused for coming by
    // rendezvous alone: the same messages sent eagerly would be delivered.
    let msgs: Vec<(u32, Vec<u8>, Bytes)> = vec![
        (
            wire::AM_ID,
            wire::encode_header(Kind::Notif, 7, 0, "evil"),
            n(0),
        ),
        (
            wire::AM_ID,
            wire::encode_header(Kind::Notif, 7, 0, "evil"),
            n(1),
        ),
        (
            wire::AM_ID,
            wire::encode_header(Kind::Notif, 7, 0, "evil"),
            n(64 << 10),
        ),
        (
            wire::AM_ID,
            wire::encode_header(Kind::Notif, 7, 0, "evil"),
            n(1 << 20),
        ),
        (
            wire::AM_ID,
            wire::encode_header(Kind::Ping, 7, 1, "evil"),
            Bytes::new(),
        ),
        (
            wire::AM_ID,
            wire::encode_header(Kind::Hello, 7, 0, "evil"),
            Bytes::copy_from_slice(evil.address()),
        ),
        (
            wire::NIXL_NOTIF_AM_ID,
            Vec::new(),
            Bytes::from(nixl::interop::encode_notification("evil", &[b'n'; 100_000])),
        ),
    ];
    let offers = (msgs.len() * ROUNDS) as u64;
    let flood = tokio::task::spawn_blocking(move || {
        let out = rendezvous_flood(&mut evil, ep, &msgs, ROUNDS);
        (evil, out)
    });
    // Meanwhile the legitimate peer notifies.
    for i in 0..GOOD {
        good.notify("target", format!("good-{i}"))
            .unwrap()
            .await
            .unwrap();
    }
    let (mut evil, outcome) = flood.await.unwrap();
    for (i, &(failed, succeeded)) in outcome.iter().enumerate() {
        assert_eq!(
            (failed, succeeded),
            (ROUNDS, 0),
            "message {i}: every rendezvous offer fails at its sender"
        );
    }
    let refused = |b: &UcxBackend| {
        let g = b.inner.shared.core.lock().unwrap();
        g.as_ref()
            .unwrap()
            .refused
            .rendezvous
            .load(Ordering::Relaxed)
    };
    assert_eq!(refused(&tb), offers, "every offer counted");
    // The peer's notifications, in order, and nothing else.
    for i in 0..GOOD {
        let n = next(&mut notes).await;
        assert_eq!(
            (n.peer.as_str(), n.msg),
            ("good", format!("good-{i}").into())
        );
    }
    // The same worker's eager notification is delivered: it was the protocol, not
    // the sender, that was refused.
    let f = send(
        &mut evil,
        ep,
        Kind::Notif,
        "evil",
        8,
        0,
        Bytes::from_static(b"eager"),
    );
    settle(&mut evil, vec![f]);
    let n = next(&mut notes).await;
    assert_eq!((n.peer.as_str(), &n.msg[..]), ("evil", &b"eager"[..]));
    assert!(notes.try_recv().is_none());
    drop(evil);
    assert!(target.shutdown().await.is_clean());
    assert!(good.shutdown().await.is_clean());
}

/// A small deterministic generator (xorshift64*), so a failing case can be re-run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `valid` cut short (anywhere), or followed by garbage (up to 300 bytes), or (with
/// `version`) with its first byte's low nibble (a worker address's version) set to
/// 2..=15.
fn damaged(r: &mut Rng, valid: &[u8], version: bool) -> Vec<u8> {
    let mut v = valid.to_vec();
    match r.below(if version { 3 } else { 2 }) {
        0 => v.truncate(r.below(valid.len())),
        1 => v.extend((0..1 + r.below(300)).map(|_| r.next() as u8)),
        _ => v[0] = (v[0] & 0xf0) | (2 + r.below(14) as u8),
    }
    v
}

/// Worker addresses and packed remote keys cut short, followed by garbage, or (an
/// address) of an unknown version, as a peer's metadata may carry them (thousands of
/// each, deterministic): each is refused by the check before UCX, or handed to UCX
/// padded, which fails or succeeds cleanly. The process survives them all (a read
/// past the buffer, or UCX's abort on an unknown address version, would end it), and
/// the worker still connects and unpacks the real ones afterwards.
///
/// Not covered, and not coverable by these checks: bytes changed *inside* a
/// well-formed address or key (UCX then trips its own assertions, e.g. lane
/// selection's `score >= 0.0`, or 1.13's `ucp_rkey_destroy` after a failed
/// transport key): see the `packed` module.
#[test]
fn cut_and_extended_addresses_and_keys_never_crash() {
    const TEST: &str = "cut_and_extended_addresses_and_keys_never_crash";
    const ROUNDS: usize = 3000;
    let o = UcxOptions::default();
    if backend(TEST, &o).is_none() {
        return;
    }
    let mut target = bare_worker(&o);
    let mut ucx = bare_worker(&o);
    let addr = target.address().to_vec();
    let alloc = target.alloc(4096).unwrap();
    let key = target.pack_allocation(&alloc).unwrap();
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut refused, mut failed, mut made) = (0, 0, 0);
    for _ in 0..ROUNDS {
        let a = damaged(&mut r, &addr, true);
        let unknown_version = a.first().is_some_and(|b| b & 0x0f > 1);
        match Padded::address(&a) {
            Err(_) => refused += 1,
            Ok(_) if unknown_version => panic!("an address of an unknown version passed"),
            Ok(p) => match ucx.ep_create(&p, true) {
                Err(_) => failed += 1,
                Ok(ep) => {
                    made += 1;
                    ucx.ep_close(ep);
                }
            },
        }
        ucx.progress();
        target.progress();
        ucx.reap_closed();
    }
    println!("addresses: {refused} refused, {failed} failed in UCX, {made} endpoints");
    assert!(refused > 0 && made > 0, "{refused} refused, {made} made");
    let ep = dial(&mut ucx, &addr);
    let (mut refused, mut failed, mut unpacked) = (0, 0, 0);
    for _ in 0..ROUNDS {
        let k = damaged(&mut r, &key, false);
        match Padded::rkey(&k) {
            Err(_) => refused += 1,
            Ok(p) => match ucx.rkey_unpack(ep, &p) {
                Err(_) => failed += 1,
                Ok(_) => unpacked += 1,
            },
        }
    }
    println!("keys: {refused} refused, {failed} failed in UCX, {unpacked} unpacked");
    assert!(
        refused > 0 && unpacked > 0,
        "{refused} refused, {unpacked} unpacked"
    );
    // The real ones still work.
    let key = Padded::rkey(&key).unwrap();
    ucx.rkey_unpack(ep, &key).unwrap();
    drop(ucx);
    drop(target);
    drop(alloc);
}
