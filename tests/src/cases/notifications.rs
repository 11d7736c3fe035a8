//! Notifications after their data, standalone notifications, prepared reposts.

use super::*;

/// A transfer's notification arrives after its data, in posting order.
pub async fn notifications_after_data_in_order(but: &BackendUnderTest) {
    need!(
        but,
        "notifications_after_data_in_order",
        remote,
        notifications,
        dram
    );
    let (a, b) = but.pair().await;
    const N: usize = 50;
    const LEN: usize = 256 * 1024;
    let src = a.register(vec![0u8; N * LEN]).unwrap();
    let dst = b.register(vec![0u8; N * LEN]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rdst = remote(&a, "target", dst.id());
    for i in 0..N {
        src.write_at(i * LEN, &pattern(i as u64 + 100, LEN))
            .unwrap();
    }
    let mut notes = b.notifications().unwrap();
    let mut transfers = Vec::new();
    for i in 0..N {
        let off = (i * LEN) as u64;
        transfers.push(
            a.transfer(
                Op::Write,
                &one(src.desc(off, LEN as u64)),
                "target",
                &one(rdst.desc(off, LEN as u64)),
                Some(Bytes::from(format!("{i}"))),
            )
            .unwrap(),
        );
    }
    for i in 0..N {
        let n = bounded("notification", notes.recv())
            .await
            .expect("notification stream open");
        assert_eq!(n.peer, "initiator");
        assert_eq!(
            n.msg,
            Bytes::from(format!("{i}")),
            "notifications in posting order"
        );
        // The data of transfer i is already visible when its notification arrives.
        let mut got = vec![0u8; LEN];
        dst.read_at(i * LEN, &mut got).unwrap();
        assert!(
            got == pattern(i as u64 + 100, LEN),
            "data of transfer {i} visible at its notification"
        );
    }
    for t in transfers {
        bounded("transfer", t).await.unwrap();
    }
    // READs can carry notifications too.
    a.read(
        &one(src.desc(0, 10)),
        "target",
        &one(rdst.desc(0, 10)),
        Some(Bytes::from_static(b"read-done")),
    )
    .await
    .unwrap();
    let n = bounded("read notification", notes.recv()).await.unwrap();
    assert_eq!(&n.msg[..], b"read-done");
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Standalone notifications, both ways, in order; the stream handle is exclusive.
pub async fn standalone_notifications(but: &BackendUnderTest) {
    need!(but, "standalone_notifications", remote, notifications);
    let (a, b) = but.pair().await;
    let mut nb = b.notifications().unwrap();
    assert_eq!(kind(b.notifications()), ErrorKind::NotAllowed);
    for i in 0..20 {
        bounded("notify", a.notify("target", format!("n{i}")).unwrap())
            .await
            .unwrap();
    }
    for i in 0..20 {
        let n = bounded("recv", nb.recv()).await.unwrap();
        assert_eq!(
            (n.peer.as_str(), n.msg),
            ("initiator", Bytes::from(format!("n{i}")))
        );
    }
    drop(nb);
    // The queue is handed back: a new handle gets later notifications.
    bounded("notify back", b.notify("initiator", "pong").unwrap())
        .await
        .unwrap();
    let mut na = a.notifications().unwrap();
    assert_eq!(&bounded("recv", na.recv()).await.unwrap().msg[..], b"pong");
    assert_eq!(kind(a.notify("nobody", "x")), ErrorKind::UnknownPeer);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// One prepared request posted 1,000 times; status is queryable without awaiting.
pub async fn prepared_reposts(but: &BackendUnderTest) {
    need!(but, "prepared_reposts", remote, dram);
    let (a, b) = but.pair().await;
    let src = a.register(vec![0u8; 4096]).unwrap();
    let dst = b.register(vec![0u8; 4096 * 4]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rdst = remote(&a, "target", dst.id());
    let local = a
        .prep_local(&DescList::from_descs(
            MemKind::Dram,
            [src.desc(0, 2048), src.desc(2048, 2048)],
        ))
        .unwrap();
    let remote_side = a
        .prep_remote(
            "target",
            &DescList::from_descs(MemKind::Dram, [rdst.desc(0, 2048), rdst.desc(8192, 2048)]),
        )
        .unwrap();
    let req = a
        .make_request(
            Op::Write,
            &local,
            &[0, 1],
            &remote_side,
            &[0, 1],
            &RequestOptions::default(),
        )
        .unwrap();
    assert_eq!(req.status(), Status::Idle);
    assert_eq!(req.segments(), 2);
    for i in 0..1000u32 {
        let v = pattern(i as u64, 4096);
        src.write_at(0, &v).unwrap();
        let t = req.post(None).unwrap();
        if i == 0 {
            assert!(matches!(t.status(), Status::InFlight | Status::Done));
        }
        bounded("repost", t).await.unwrap();
        assert_eq!(req.status(), Status::Done);
        if i % 97 == 0 || i == 999 {
            let d = dst.to_vec().unwrap();
            assert_eq!(&d[..2048], &v[..2048], "post {i}");
            assert_eq!(&d[8192..10240], &v[2048..], "post {i}");
        }
    }
    // A post while the previous one is in flight is refused.
    let big_src = a.register(vec![1u8; 32 << 20]).unwrap();
    let big_dst = b.register(vec![0u8; 32 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rb = remote(&a, "target", big_dst.id());
    let big = a
        .create_request(
            Op::Write,
            &one(big_src.whole()),
            "target",
            &one(rb.whole_desc()),
            &RequestOptions::default(),
        )
        .unwrap();
    let t = big.post(None).unwrap();
    if t.status() == Status::InFlight {
        match big.post(None) {
            Err(e) => assert_eq!(e.kind(), ErrorKind::NotAllowed),
            Ok(_) => assert_ne!(
                t.status(),
                Status::InFlight,
                "second post accepted while the first was in flight"
            ),
        }
    }
    bounded("big", t).await.unwrap();
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
