//! A hostile sender bounded while a good one is served; forged and one-sided
//! secrets on notifications.

use super::*;

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
