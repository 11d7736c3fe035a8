//! What a backend refuses: invalid inputs, stale generations, forged keys, out-of-range access, deregistration in flight.

use super::*;

/// Every invalid input gets its own error kind and nothing is transferred.
pub async fn invalid_inputs_rejected(but: &BackendUnderTest) {
    let caps = need!(but, "invalid_inputs_rejected", remote, dram);
    let (a, b) = but.pair().await;
    let src = a.register(pattern(1, 16384)).unwrap();
    // Two adjacent target regions carved out of one buffer (the raw registration path).
    let buf = std::sync::Arc::new(AlignedBuf::new(8192));
    let base = buf.as_mut_ptr();
    #[allow(unsafe_code)] // The case tests the core's raw registration path.
    // SAFETY: both halves lie inside `buf`, which each Memory keeps alive as its owner;
    // nothing else references the buffer's bytes.
    let (h1, h2) = unsafe {
        (
            Memory::from_raw_parts_with_owner(base, 4096, MemKind::Dram, Some(buf.clone()))
                .unwrap(),
            Memory::from_raw_parts_with_owner(
                base.add(4096),
                4096,
                MemKind::Dram,
                Some(buf.clone()),
            )
            .unwrap(),
        )
    };
    let r1 = b.register(h1).unwrap();
    let r2 = b.register(h2).unwrap();
    assert_eq!(r1.addr() + 4096, r2.addr());
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rr1 = remote(&a, "target", r1.id());
    let before = (checksum(&r1), checksum(&r2));
    let w = |l: DescList, p: &str, r: DescList| a.transfer(Op::Write, &l, p, &r, None).map(|_| ());
    assert_eq!(
        kind(w(one(src.desc(0, 100)), "target", one(rr1.desc(4090, 100)))),
        ErrorKind::SpansRegions
    );
    assert_eq!(
        kind(w(one(src.desc(0, 100)), "target", one(rr1.desc(8190, 100)))),
        ErrorKind::OutOfRange
    );
    assert_eq!(
        kind(w(
            one(src.desc(0, 100)),
            "target",
            one(nixl::Desc::new(16, 100, 0))
        )),
        ErrorKind::OutOfRange
    );
    assert_eq!(
        kind(w(
            one(src.desc(16380, 100)),
            "target",
            one(rr1.desc(0, 100))
        )),
        ErrorKind::OutOfRange
    );
    assert_eq!(
        kind(w(one(src.desc(0, 0)), "target", one(rr1.desc(0, 0)))),
        ErrorKind::ZeroLength
    );
    let two = DescList::from_descs(MemKind::Dram, [src.desc(0, 10), src.desc(10, 10)]);
    assert_eq!(
        kind(w(two, "target", one(rr1.desc(0, 10)))),
        ErrorKind::LengthMismatch
    );
    assert_eq!(
        kind(w(one(src.desc(0, 10)), "target", one(rr1.desc(0, 11)))),
        ErrorKind::LengthMismatch
    );
    assert_eq!(
        kind(w(one(src.desc(0, 10)), "nobody", one(rr1.desc(0, 10)))),
        ErrorKind::UnknownPeer
    );
    // Bad indices on prepared lists.
    let l = a.prep_local(&one(src.desc(0, 10))).unwrap();
    let r = a.prep_remote("target", &one(rr1.desc(0, 10))).unwrap();
    assert_eq!(
        kind(a.make_request(Op::Write, &l, &[1], &r, &[0], &RequestOptions::default())),
        ErrorKind::NotFound
    );
    assert_eq!(
        kind(a.make_request(Op::Write, &l, &[0], &r, &[0, 0], &RequestOptions::default())),
        ErrorKind::LengthMismatch
    );
    assert_eq!(
        kind(a.make_request(Op::Write, &l, &[], &r, &[], &RequestOptions::default())),
        ErrorKind::InvalidArgument
    );
    // Zero-length registration.
    assert_eq!(kind(a.register(Vec::new())), ErrorKind::ZeroLength);
    // GPU memory on a backend without VRAM support: a clear NotSupported. The
    // pointer is never dereferenced: registration is refused first.
    if !caps.vram {
        #[allow(unsafe_code)] // A device pointer can only be made this way.
        // SAFETY: the region is refused before anything could touch it.
        let vram = unsafe {
            Memory::from_raw_parts(
                0x7000_0000_0000 as *mut u8,
                4096,
                MemKind::Vram { device: 0 },
            )
        }
        .unwrap();
        assert_eq!(kind(a.register(vram)), ErrorKind::NotSupported);
    }
    assert_eq!(
        (checksum(&r1), checksum(&r2)),
        before,
        "target memory unchanged"
    );
    // A valid transfer still works afterwards.
    a.write(
        &one(src.desc(0, 100)),
        "target",
        &one(rr1.desc(0, 100)),
        None,
    )
    .await
    .unwrap();
    assert_ne!(checksum(&r1), before.0);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// A request prepared against an older copy of a peer's metadata is refused.
pub async fn stale_generation_refused(but: &BackendUnderTest) {
    need!(but, "stale_generation_refused", remote, dram);
    let (a, b) = but.pair().await;
    let src = a.register(vec![5u8; 64]).unwrap();
    let dst = b.register(vec![0u8; 64]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    let req = a
        .create_request(
            Op::Write,
            &one(src.desc(0, 64)),
            "target",
            &one(rd.desc(0, 64)),
            &RequestOptions::default(),
        )
        .unwrap();
    let prepared_remote = a.prep_remote("target", &one(rd.desc(0, 64))).unwrap();
    bounded("post", req.post(None).unwrap()).await.unwrap();
    // Reloading full metadata starts a new generation.
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    assert_eq!(kind(req.post(None)), ErrorKind::StaleGeneration);
    let l = a.prep_local(&one(src.desc(0, 64))).unwrap();
    assert_eq!(
        kind(a.make_request(
            Op::Write,
            &l,
            &[0],
            &prepared_remote,
            &[0],
            &RequestOptions::default()
        )),
        ErrorKind::StaleGeneration
    );
    // Forgotten peer.
    a.forget_peer("target").unwrap();
    assert_eq!(kind(req.post(None)), ErrorKind::UnknownPeer);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// One-shot transfers prepare their own lists, so a full metadata reload racing them
/// (a peer republishing, an exchange refreshing) is not the caller's staleness: they
/// prepare again and succeed, and the data arrives. Reloads come every millisecond,
/// far more often than any exchange refreshes.
pub async fn one_shot_survives_reloads(but: &BackendUnderTest) {
    need!(but, "one_shot_survives_reloads", remote, dram);
    let (a, b) = but.pair().await;
    let a = std::sync::Arc::new(a);
    let dst = b.register(vec![0u8; 4096]).unwrap();
    let md = b.metadata().unwrap();
    a.load_metadata(&md).unwrap();
    let rd = remote(&a, "target", dst.id());
    const RELOADS: usize = 300;
    let reloader = tokio::spawn({
        let a = a.clone();
        async move {
            for _ in 0..RELOADS {
                a.load_metadata(&md).unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    });
    let mut rounds = 0u32;
    let mut failures = Vec::new();
    while !reloader.is_finished() || rounds == 0 {
        rounds += 1;
        let fill = (rounds % 251) as u8;
        let src = a.register(vec![fill; 4096]).unwrap();
        let desc = one(rd.desc(0, 4096));
        match bounded(
            "one-shot write",
            a.write(&one(src.whole()), "target", &desc, None),
        )
        .await
        {
            Ok(()) => assert!(
                dst.to_vec().unwrap().iter().all(|&x| x == fill),
                "write {rounds} returned Ok but its data did not arrive"
            ),
            Err(e) => failures.push(e.to_string()),
        }
    }
    bounded("reloader", reloader).await.unwrap();
    assert!(
        failures.is_empty(),
        "{} of {rounds} one-shot writes failed while metadata was reloaded {RELOADS} times; first: {}",
        failures.len(),
        failures[0]
    );
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Metadata with a forged key gets the transfer refused by the target; nothing changes.
pub async fn forged_key_refused(but: &BackendUnderTest) {
    need!(but, "forged_key_refused", remote, dram, target_checks);
    let (a, b) = but.pair().await;
    let src = a.register(pattern(2, 4096)).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    let before = checksum(&dst);
    let mut md = AgentMetadata::decode(&b.metadata().unwrap()).unwrap();
    for region in &mut md.regions {
        for blob in &mut region.blobs {
            for x in blob.blob.iter_mut() {
                *x ^= 0x5A;
            }
        }
    }
    a.load_metadata(&md.encode().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    let e = bounded(
        "forged write",
        a.write(
            &one(src.desc(0, 4096)),
            "target",
            &one(rd.desc(0, 4096)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    let e = bounded(
        "forged read",
        a.read(
            &one(src.desc(0, 4096)),
            "target",
            &one(rd.desc(0, 4096)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    assert_eq!(checksum(&dst), before, "target memory unchanged");
    // The connection is still usable with the real metadata.
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.write(
        &one(src.desc(0, 4096)),
        "target",
        &one(rd.desc(0, 4096)),
        None,
    )
    .await
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Metadata that lies about a region's size: the target itself refuses the overrun.
pub async fn wire_out_of_range_refused(but: &BackendUnderTest) {
    need!(
        but,
        "wire_out_of_range_refused",
        remote,
        dram,
        target_checks
    );
    let (a, b) = but.pair().await;
    let src = a.register(pattern(4, 8192)).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    let guard = b.register(vec![0u8; 4096]).unwrap();
    let before = (checksum(&dst), checksum(&guard));
    let mut md = AgentMetadata::decode(&b.metadata().unwrap()).unwrap();
    for r in &mut md.regions {
        if r.id == dst.id() {
            r.len *= 2;
        }
    }
    md.regions.retain(|r| r.id == dst.id());
    a.load_metadata(&md.encode().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    let e = bounded(
        "overrun",
        a.write(
            &one(src.desc(0, 8192)),
            "target",
            &one(rd.desc(0, 8192)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    let e = bounded(
        "overrun read",
        a.read(
            &one(src.desc(0, 5000)),
            "target",
            &one(rd.desc(100, 5000)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    assert_eq!(
        (checksum(&dst), checksum(&guard)),
        before,
        "target memory unchanged"
    );
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Memory used by an in-flight transfer cannot be deregistered; afterwards it can.
pub async fn deregister_in_flight_refused(but: &BackendUnderTest) {
    let caps = need!(but, "deregister_in_flight_refused", remote, dram);
    let (a, b) = but.pair().await;
    let src = a.register(vec![1u8; 32 << 20]).unwrap();
    let dst = b.register(vec![0u8; 32 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    let t = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "target",
            &one(rd.whole_desc()),
            None,
        )
        .unwrap();
    // The transfer may finish between the count's check and the call: then the call
    // succeeds, and only then.
    let mut gone = false;
    if src.inflight() > 0 {
        match a.deregister(&src) {
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
                assert!(src.is_registered());
            }
            Ok(()) => {
                assert_eq!(src.inflight(), 0, "deregistered under a transfer");
                gone = true;
            }
        }
    }
    bounded("transfer", t).await.unwrap();
    assert_eq!(src.inflight(), 0);
    if !gone {
        a.deregister(&src).unwrap();
    }
    assert!(!src.is_registered());
    assert_eq!(kind(a.deregister(&src)), ErrorKind::NotFound);
    // A deregistered region can no longer be named in transfers (either side).
    assert_eq!(
        kind(a.transfer(
            Op::Write,
            &one(src.whole()),
            "target",
            &one(rd.whole_desc()),
            None
        )),
        ErrorKind::OutOfRange
    );
    b.deregister(&dst).unwrap();
    if caps.target_checks {
        // The target refuses requests for memory it deregistered.
        let keep = a.register(vec![0u8; 64]).unwrap();
        let e = bounded(
            "write to deregistered",
            a.write(&one(keep.desc(0, 64)), "target", &one(rd.desc(0, 64)), None),
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    } else {
        skip(
            "deregister_in_flight_refused (target side)",
            &format!(
                "backend {} is one-sided: the target cannot refuse",
                but.name
            ),
        );
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
