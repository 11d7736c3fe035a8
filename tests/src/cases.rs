//! The conformance cases.

use std::time::Duration;

use bytes::Bytes;
use nixl::metadata::AgentMetadata;
use nixl::{AlignedBuf, DescList, ErrorKind, MemKind, Memory, Op, RequestOptions, Status};

use crate::support::{
    bounded, checksum, checksum_bytes, figure, one, own_thread_count, pattern, remote, skip,
    thread_count, BackendUnderTest,
};

macro_rules! need {
    ($but:expr, $case:literal, $($cap:ident),+) => {{
        let Some(caps) = $but.capabilities($case) else { return };
        $(
            if !caps.$cap {
                skip($case, &format!("backend {} lacks capability `{}`", $but.name, stringify!($cap)));
                return;
            }
        )+
        caps
    }};
}

fn kind<T: std::fmt::Debug>(r: nixl::Result<T>) -> ErrorKind {
    r.expect_err("expected an error").kind()
}

/// Full and partial metadata survive encode/decode and loading.
pub async fn metadata_round_trip(but: &BackendUnderTest) {
    need!(but, "metadata_round_trip", remote, dram);
    let a = but.agent("a").await;
    let b = but.agent("b").await;
    let r1 = b.register(vec![1u8; 4096]).unwrap();
    let r2 = b.register(AlignedBuf::new(8192)).unwrap();
    let md = b.metadata().unwrap();
    let decoded = AgentMetadata::decode(&md).unwrap();
    assert_eq!(
        decoded.encode().unwrap(),
        md.to_vec(),
        "re-encoding is byte-identical"
    );
    assert_eq!(decoded.name, "b");
    assert!(!decoded.partial);
    assert_eq!(decoded.regions.len(), 2);
    assert_eq!(a.load_metadata(&md).unwrap(), "b");
    let regions = a.remote_regions("b").unwrap();
    assert_eq!(regions.len(), 2);
    assert_eq!((regions[0].addr, regions[0].len), (r1.addr(), 4096));
    assert_eq!((regions[1].addr, regions[1].len), (r2.addr(), 8192));

    // A request prepared now survives a partial update (same generation).
    let src = a.register(vec![9u8; 16]).unwrap();
    let req = a
        .create_request(
            Op::Write,
            &one(src.desc(0, 16)),
            "b",
            &one(regions[0].desc(0, 16)),
            &RequestOptions::default(),
        )
        .unwrap();
    let r3 = b.register(vec![3u8; 100]).unwrap();
    let partial = b
        .partial_metadata(std::slice::from_ref(&r3), false)
        .unwrap();
    assert!(AgentMetadata::decode(&partial).unwrap().partial);
    a.load_metadata(&partial).unwrap();
    assert_eq!(a.remote_regions("b").unwrap().len(), 3);
    bounded("post after partial load", req.post(None).unwrap())
        .await
        .unwrap();
    assert_eq!(&r1.to_vec().unwrap()[..16], &[9u8; 16]);

    // Partial metadata without connection info cannot introduce an unknown peer...
    let c = but.agent("c").await;
    let rc = c.register(vec![0u8; 64]).unwrap();
    assert_eq!(
        kind(
            a.load_metadata(
                &c.partial_metadata(std::slice::from_ref(&rc), false)
                    .unwrap()
            )
        ),
        ErrorKind::UnknownPeer
    );
    // ...with it, it can.
    a.load_metadata(&c.partial_metadata(std::slice::from_ref(&rc), true).unwrap())
        .unwrap();
    assert_eq!(a.remote_regions("c").unwrap().len(), 1);
    // Own metadata is refused.
    assert_eq!(
        kind(a.load_metadata(&a.metadata().unwrap())),
        ErrorKind::InvalidArgument
    );
    // Forgetting.
    a.forget_peer("b").unwrap();
    assert_eq!(kind(a.remote_regions("b")), ErrorKind::UnknownPeer);
    assert_eq!(kind(a.forget_peer("b")), ErrorKind::UnknownPeer);
    for x in [a, b, c] {
        assert!(x.shutdown().await.is_clean());
    }
}

/// WRITE then READ back, sizes 1 byte to 64 MiB, unaligned offsets on both sides.
pub async fn write_read_sizes(but: &BackendUnderTest) {
    need!(but, "write_read_sizes", remote, dram);
    let (a, b) = but.pair().await;
    const MAX: usize = 64 << 20;
    let src = a.register(vec![0u8; MAX + 64]).unwrap();
    let dst = b.register(vec![0u8; MAX + 64]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rdst = remote(&a, "target", dst.id());
    for (i, &len) in [1usize, 7, 4096, 65_537, 1 << 20, (16 << 20) + 3, MAX]
        .iter()
        .enumerate()
    {
        let (lo, ro) = (3 + i, 5 + 2 * i);
        let data = pattern(i as u64 + 1, len);
        src.write_at(lo, &data).unwrap();
        bounded(
            "write",
            a.write(
                &one(src.desc(lo as u64, len as u64)),
                "target",
                &one(rdst.desc(ro as u64, len as u64)),
                None,
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("WRITE of {len} bytes: {e}"));
        let mut got = vec![0u8; len];
        dst.read_at(ro, &mut got).unwrap();
        assert!(got == data, "WRITE of {len} bytes: target differs");
        // Read back into a cleared local range.
        src.write_at(lo, &vec![0u8; len]).unwrap();
        bounded(
            "read",
            a.read(
                &one(src.desc(lo as u64, len as u64)),
                "target",
                &one(rdst.desc(ro as u64, len as u64)),
                None,
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("READ of {len} bytes: {e}"));
        src.read_at(lo, &mut got).unwrap();
        assert!(got == data, "READ of {len} bytes: local differs");
    }
    assert!(a.shutdown().await.is_clean());
    assert!(b.shutdown().await.is_clean());
}

/// Many descriptors in one request; contiguous ones merge unless told not to.
pub async fn many_descriptors_and_merging(but: &BackendUnderTest) {
    need!(but, "many_descriptors_and_merging", remote, dram);
    let (a, b) = but.pair().await;
    let src = a.register(pattern(7, 1 << 20)).unwrap();
    let dst = b.register(vec![0u8; 1 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rdst = remote(&a, "target", dst.id());
    // 100 scattered descriptors of varied sizes (gaps between them: no merging).
    let mut l = DescList::new(MemKind::Dram);
    let mut r = DescList::new(MemKind::Dram);
    let mut expect = Vec::new();
    for i in 0..100u64 {
        let len = 1 + (i * 37) % 3000;
        let (lo, ro) = (i * 5000 + 1, i * 7000 + 3);
        l.push(src.desc(lo, len));
        r.push(rdst.desc(ro, len));
        expect.push((lo as usize, ro as usize, len as usize));
    }
    let req = a
        .create_request(Op::Write, &l, "target", &r, &RequestOptions::default())
        .unwrap();
    assert_eq!(req.segments(), 100);
    bounded("scattered write", req.post(None).unwrap())
        .await
        .unwrap();
    let s = src.to_vec().unwrap();
    let d = dst.to_vec().unwrap();
    for (lo, ro, len) in expect {
        assert_eq!(
            &s[lo..lo + len],
            &d[ro..ro + len],
            "descriptor at local {lo}"
        );
    }
    // 64 contiguous 1 KiB descriptors merge into one segment.
    let l = DescList::from_descs(
        MemKind::Dram,
        (0..64).map(|i| src.desc(900_000 + i * 1024, 1024)),
    );
    let r = DescList::from_descs(MemKind::Dram, (0..64).map(|i| rdst.desc(i * 1024, 1024)));
    let merged = a
        .create_request(Op::Write, &l, "target", &r, &RequestOptions::default())
        .unwrap();
    assert_eq!(merged.segments(), 1);
    assert_eq!(merged.bytes(), 65536);
    let unmerged = a
        .create_request(
            Op::Write,
            &l,
            "target",
            &r,
            &RequestOptions {
                merge: false,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(unmerged.segments(), 64);
    bounded("merged write", merged.post(None).unwrap())
        .await
        .unwrap();
    assert_eq!(
        &dst.to_vec().unwrap()[..65536],
        &s[900_000..900_000 + 65536]
    );
    dst.write_at(0, &[0u8; 65536]).unwrap();
    bounded("unmerged write", unmerged.post(None).unwrap())
        .await
        .unwrap();
    assert_eq!(
        &dst.to_vec().unwrap()[..65536],
        &s[900_000..900_000 + 65536]
    );
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Strided lists (a KV cache's blocks at a regular stride): WRITE and READ move every
/// block and nothing between them, by whole lists and by index, with a notification
/// after the data; the backend gets the blocks as runs.
pub async fn strided_lists(but: &BackendUnderTest) {
    need!(but, "strided_lists", remote, dram);
    let (a, b) = but.pair().await;
    const BLOCKS: usize = 2000;
    const LEN: u64 = 48;
    let src = a.register(pattern(11, BLOCKS * 128)).unwrap();
    let back = a.register(vec![0u8; BLOCKS * 128]).unwrap();
    let dst = b.register(vec![0u8; BLOCKS * 256]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rdst = remote(&a, "target", dst.id());
    // Local blocks every 128 bytes, remote blocks every 256 bytes from offset 16.
    let local = DescList::strided(MemKind::Dram, src.desc(0, LEN), 128, BLOCKS);
    let far = DescList::strided(MemKind::Dram, rdst.desc(16, LEN), 256, BLOCKS);
    let req = a
        .create_request(
            Op::Write,
            &local,
            "target",
            &far,
            &RequestOptions::default(),
        )
        .unwrap();
    assert_eq!((req.segments(), req.segment_runs()), (BLOCKS, 1));
    let mut n = b.notifications().unwrap();
    bounded(
        "strided write",
        req.post(Some(Bytes::from_static(b"kv"))).unwrap(),
    )
    .await
    .unwrap();
    let got = bounded("strided notification", n.recv()).await.unwrap();
    assert_eq!(&got.msg[..], b"kv");
    let s = src.to_vec().unwrap();
    let d = dst.to_vec().unwrap();
    for i in 0..BLOCKS {
        let (lo, ro) = (i * 128, 16 + i * 256);
        assert_eq!(
            &s[lo..lo + LEN as usize],
            &d[ro..ro + LEN as usize],
            "block {i}"
        );
        assert!(
            d[ro + LEN as usize..(ro + 256).min(d.len())]
                .iter()
                .all(|&x| x == 0),
            "gap after block {i}"
        );
    }
    assert!(d[..16].iter().all(|&x| x == 0));
    // READ back a selection by index (consecutive runs and single blocks).
    let lp = a
        .prep_local(&DescList::strided(
            MemKind::Dram,
            back.desc(0, LEN),
            128,
            BLOCKS,
        ))
        .unwrap();
    let rp = a.prep_remote("target", &far).unwrap();
    let pick: Vec<usize> = (100..400).chain([7, 1999, 3]).chain(1000..1500).collect();
    let req = a
        .make_request(Op::Read, &lp, &pick, &rp, &pick, &RequestOptions::default())
        .unwrap();
    assert_eq!((req.segments(), req.segment_runs()), (pick.len(), 5));
    bounded("strided read", req.post(None).unwrap())
        .await
        .unwrap();
    let r = back.to_vec().unwrap();
    for i in 0..BLOCKS {
        let lo = i * 128;
        let want: &[u8] = if pick.contains(&i) {
            &s[lo..lo + LEN as usize]
        } else {
            &[0u8; LEN as usize]
        };
        assert_eq!(&r[lo..lo + LEN as usize], want, "block {i}");
    }
    assert!((0..BLOCKS).all(|i| r[i * 128 + LEN as usize..(i + 1) * 128]
        .iter()
        .all(|&x| x == 0)));
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Transfers between two regions of one agent, with a notification to itself.
pub async fn local_transfers(but: &BackendUnderTest) {
    // Same-agent DRAM transfers are the agent's own copies, whatever the backend
    // (`Capabilities::local` is about other memory kinds).
    need!(but, "local_transfers", dram);
    let a = but.agent("solo").await;
    let x = a.register(pattern(3, 100_000)).unwrap();
    let y = a.register(vec![0u8; 100_000]).unwrap();
    let mut notes = a.notifications().unwrap();
    a.write(
        &one(x.desc(10, 50_000)),
        "solo",
        &one(y.desc(20, 50_000)),
        Some(Bytes::from_static(b"local")),
    )
    .await
    .unwrap();
    assert_eq!(
        &y.to_vec().unwrap()[20..50_020],
        &x.to_vec().unwrap()[10..50_010]
    );
    let n = bounded("local notification", notes.recv()).await.unwrap();
    assert_eq!((n.peer.as_str(), &n.msg[..]), ("solo", &b"local"[..]));
    y.write_at(0, &[0xAB; 100]).unwrap();
    a.read(&one(x.desc(0, 100)), "solo", &one(y.desc(0, 100)), None)
        .await
        .unwrap();
    assert_eq!(&x.to_vec().unwrap()[..100], &[0xAB; 100]);
    assert_eq!(
        kind(a.transfer(
            Op::Write,
            &one(x.desc(99_990, 20)),
            "solo",
            &one(y.desc(0, 20)),
            None
        )),
        ErrorKind::OutOfRange
    );
    let r = a
        .create_request(
            Op::Write,
            &one(x.desc(0, 8)),
            "solo",
            &one(y.desc(0, 8)),
            &RequestOptions::default(),
        )
        .unwrap();
    assert_eq!(r.backend(), "agent", "same-agent DRAM is the agent's copy");
    let _ = a.shutdown().await;
}

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

trait WholeDesc {
    fn whole_desc(&self) -> nixl::Desc;
}
impl WholeDesc for nixl::RemoteRegionInfo {
    fn whole_desc(&self) -> nixl::Desc {
        self.desc(0, self.len)
    }
}

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

/// Five milliseconds into `transfers`, shut down the target `b` (it must leave no
/// task): each transfer then ends within the hang bound, successfully or with
/// `RemoteDisconnected`/`Canceled`. Returns how many failed.
async fn shut_down_under(b: nixl::Agent, transfers: Vec<nixl::Transfer>, what: &str) -> usize {
    tokio::time::sleep(Duration::from_millis(5)).await;
    let report = bounded("target shutdown", b.shutdown()).await;
    assert_eq!(report.tasks_left, 0, "{report:?}");
    let mut failed = 0;
    for t in transfers {
        let bound = format!("in-flight {what} after peer shutdown");
        if let Err(e) = bounded(&bound, t).await {
            assert!(
                matches!(
                    e.kind(),
                    ErrorKind::RemoteDisconnected | ErrorKind::Canceled
                ),
                "{e}"
            );
            failed += 1;
        }
    }
    failed
}

/// Wait (within the hang bound) until nothing is in flight on `reg`.
async fn drained(reg: &nixl::Registration) {
    bounded("in-flight count to drain", async {
        while reg.inflight() > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

/// The target shuts down while transfers run: every transfer ends, none hangs.
pub async fn peer_shutdown_mid_transfer(but: &BackendUnderTest) {
    need!(but, "peer_shutdown_mid_transfer", remote, dram);
    let (a, b) = but.pair().await;
    let src = a.register(vec![3u8; 16 << 20]).unwrap();
    let dst = b.register(vec![0u8; 16 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    let req = a
        .create_request(
            Op::Write,
            &one(src.whole()),
            "target",
            &one(rd.whole_desc()),
            &RequestOptions::default(),
        )
        .unwrap();
    bounded("warm-up", req.post(None).unwrap()).await.unwrap();
    let mut transfers = Vec::new();
    for _ in 0..8 {
        transfers.push(
            a.transfer(
                Op::Write,
                &one(src.whole()),
                "target",
                &one(rd.whole_desc()),
                None,
            )
            .unwrap(),
        );
    }
    let failed = shut_down_under(b, transfers, "transfer").await;
    println!("{failed} of 8 in-flight transfers failed when the target shut down");
    // New transfers to the dead peer fail fast with an error.
    let e = bounded("post to dead peer", req.post(None).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    assert!(a.shutdown().await.is_clean());
}

/// Dropping in-flight futures, then shutting down, leaks no task or thread.
pub async fn drop_in_flight_then_shutdown(but: &BackendUnderTest) {
    need!(but, "drop_in_flight_then_shutdown", remote, dram);
    let threads_before = own_thread_count("drop_in_flight_then_shutdown");
    let (a, b) = but.pair().await;
    let (ma, mb) = (a.task_monitor(), b.task_monitor());
    let src = a.register(vec![3u8; 8 << 20]).unwrap();
    let dst = b.register(vec![0u8; 8 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    for i in 0..16 {
        let op = if i % 2 == 0 { Op::Write } else { Op::Read };
        drop(
            a.transfer(
                op,
                &one(src.whole()),
                "target",
                &one(rd.whole_desc()),
                Some(Bytes::from_static(b"x")),
            )
            .unwrap(),
        );
    }
    assert!(
        !ma.is_empty() || !ma.threads().is_empty(),
        "the agent runs tasks or threads while connected"
    );
    let ra = bounded("shutdown a", a.shutdown()).await;
    let rb = bounded("shutdown b", b.shutdown()).await;
    assert_eq!((ra.tasks_left, rb.tasks_left), (0, 0), "{ra:?} {rb:?}");
    assert!(ra.backend_errors.is_empty(), "{ra:?}");
    assert_eq!((ma.len(), mb.len()), (0, 0));
    assert!(ma.threads().is_empty() && mb.threads().is_empty());
    assert!(ra.threads_left.is_empty() && rb.threads_left.is_empty());
    assert_eq!(src.inflight(), 0, "dropped transfers released their memory");
    assert!(!src.is_registered() && !dst.is_registered());
    if let Some(before) = threads_before {
        assert!(
            thread_count() <= before,
            "threads {} > {before} before",
            thread_count()
        );
    }
    // Using a shut-down agent is an error, not a hang.
    assert_eq!(kind(a.register(vec![0u8; 8])), ErrorKind::ShutDown);
    assert!(a.shutdown().await.already_shut_down);
}

/// Dropping agents (no shutdown) ends every task they started within the bound.
pub async fn drop_agent_ends_tasks(but: &BackendUnderTest) {
    need!(but, "drop_agent_ends_tasks", remote, dram);
    let threads_before = own_thread_count("drop_agent_ends_tasks");
    let (a, b) = but.pair().await;
    let (ma, mb) = (a.task_monitor(), b.task_monitor());
    let src = a.register(vec![3u8; 4 << 20]).unwrap();
    let dst = b.register(vec![0u8; 4 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    bounded(
        "write",
        a.write(&one(src.whole()), "target", &one(rd.whole_desc()), None),
    )
    .await
    .unwrap();
    let inflight = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "target",
            &one(rd.whole_desc()),
            None,
        )
        .unwrap();
    drop(a);
    drop(b);
    bounded("tasks of dropped agents", async {
        ma.wait().await;
        mb.wait().await;
    })
    .await;
    // The in-flight transfer resolves (it may have finished before the drop).
    let _ = bounded("transfer of dropped agent", inflight).await;
    assert_eq!(src.inflight(), 0);
    if let Some(before) = threads_before {
        assert!(thread_count() <= before);
    }
}

/// One initiator, two targets, concurrent transfers to both.
pub async fn three_agents_one_process(but: &BackendUnderTest) {
    need!(but, "three_agents_one_process", remote, dram);
    let a = but.agent("a").await;
    let b = but.agent("b").await;
    let c = but.agent("c").await;
    let src = a.register(pattern(11, 1 << 20)).unwrap();
    let db = b.register(vec![0u8; 1 << 20]).unwrap();
    let dc = c.register(vec![0u8; 1 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.load_metadata(&c.metadata().unwrap()).unwrap();
    assert_eq!(a.peers(), vec!["b".to_string(), "c".to_string()]);
    let tb = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "b",
            &one(remote(&a, "b", db.id()).whole_desc()),
            None,
        )
        .unwrap();
    let tc = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "c",
            &one(remote(&a, "c", dc.id()).whole_desc()),
            None,
        )
        .unwrap();
    bounded("b", tb).await.unwrap();
    bounded("c", tc).await.unwrap();
    let s = checksum_bytes(&src.to_vec().unwrap());
    assert_eq!((checksum(&db), checksum(&dc)), (s, s));
    for x in [a, b, c] {
        assert!(x.shutdown().await.is_clean());
    }
}

/// Peers dropped without shutdown (so without goodbye), in the ways the lifecycle
/// torture found hanging: before this agent ever used its connection, once the
/// connection had been set up in the background but never used, and while transfers
/// and notifications to it were in flight. Every transfer and notification to them
/// resolves within the bound (an error, or `Ok` where a one-sided transport cannot
/// tell the target is gone), later posts too, and shutdown is clean.
pub async fn dropped_peers_never_hang(but: &BackendUnderTest) {
    need!(but, "dropped_peers_never_hang", remote, dram, notifications);
    // Ending with one of these is fine; hanging, or another error, is not.
    fn gone(what: &str, e: &nixl::Error) {
        assert!(
            matches!(
                e.kind(),
                ErrorKind::RemoteDisconnected | ErrorKind::Canceled
            ),
            "{what}: {e}"
        );
    }
    let a = but.agent("survivor").await;
    let src = a.register(vec![5u8; 1 << 20]).unwrap();
    // The dead peers' memory stays alive here: a one-sided transport may still write
    // into it (in this process) until it notices the peer is gone.
    let mut keep = Vec::new();
    let mut pending = Vec::new();
    let mut requests = Vec::new();
    let mut refused = 0;
    for (name, wait_ms, busy) in [
        ("gone-early", 0, false),
        ("gone-idle", 50, false),
        ("gone-busy", 0, true),
    ] {
        let b = but.agent(name).await;
        let monitor = b.task_monitor();
        let dst = b.register(vec![0u8; 1 << 20]).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        let rd = remote(&a, name, dst.id());
        keep.push(dst);
        let req = a
            .create_request(
                Op::Write,
                &one(src.whole()),
                name,
                &one(rd.whole_desc()),
                &RequestOptions::default(),
            )
            .unwrap();
        let mut post = |what: &'static str, t: nixl::Result<nixl::Transfer>| match t {
            Ok(t) => pending.push((name, what, t)),
            // Refused at once: the backend already knows the peer is gone.
            Err(e) => {
                gone(what, &e);
                refused += 1;
            }
        };
        let desc = |op: Op, notif: &'static [u8]| {
            a.transfer(
                op,
                &one(src.desc(0, 4096)),
                name,
                &one(rd.desc(0, 4096)),
                (!notif.is_empty()).then(|| Bytes::from_static(notif)),
            )
        };
        if busy {
            post("write in flight", req.post(None));
            post("read in flight", desc(Op::Read, b""));
            post("notification in flight", a.notify(name, &b"n"[..]));
        }
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        drop(b);
        bounded("dropped peer's tasks to end", monitor.wait()).await;
        if !busy {
            post("write", req.post(None));
        }
        post("write with notification", desc(Op::Write, b"w"));
        post("read with notification", desc(Op::Read, b"r"));
        post("notification", a.notify(name, &b"x"[..]));
        requests.push((name, req));
    }
    let t0 = std::time::Instant::now();
    let mut failed = 0;
    for (name, what, t) in pending {
        if let Err(e) = bounded(&format!("{what} to dropped peer {name}"), t).await {
            gone(&format!("{what} to {name}"), &e);
            failed += 1;
        }
    }
    println!(
        "transfers to dropped peers resolved within {:?} ({failed} failed, {refused} refused at once)",
        t0.elapsed()
    );
    // Posting again resolves too (typically failing fast now).
    for (name, req) in &requests {
        match req.post(None) {
            Ok(t) => {
                if let Err(e) = bounded(&format!("repost to dropped peer {name}"), t).await {
                    gone(&format!("repost to {name}"), &e);
                }
            }
            Err(e) => gone(&format!("repost to {name}"), &e),
        }
    }
    let report = bounded("survivor shutdown", a.shutdown()).await;
    assert_eq!(report.tasks_left, 0, "{report:?}");
    drop(keep);
}

/// The GPU this process can use, or a SKIP line saying why not.
fn gpu_or_skip(case: &str) -> Option<nixl::gpu::GpuInfo> {
    match nixl::gpu::status() {
        Ok(g) => Some(g),
        Err(e) => {
            skip(case, &format!("no GPU: {e}"));
            None
        }
    }
}

fn in_kind(kind: MemKind, d: nixl::Desc) -> DescList {
    DescList::from_descs(kind, [d])
}

/// GPU memory on either or both sides, WRITE and READ: every combination moves the
/// bytes exactly (checked through the agents' device copies), and a WRITE's
/// notification arrives only once its data is in the target's GPU memory.
pub async fn vram_transfers(but: &BackendUnderTest) {
    need!(but, "vram_transfers", remote, vram, notifications);
    let Some(gpu) = gpu_or_skip("vram_transfers") else {
        return;
    };
    let (a, b) = but.pair().await;
    let mut notes = b.notifications().unwrap();
    const LEN: usize = 9 << 20; // several staging chunks, and a partial one
    let vram = MemKind::Vram { device: 0 };
    let mem = |kind: MemKind| -> Memory {
        match kind {
            MemKind::Vram { device } => Memory::vram(device, LEN).expect("allocate GPU memory"),
            _ => Memory::from(vec![0u8; LEN]),
        }
    };
    let mut round = 0u64;
    for (lk, rk) in [(MemKind::Dram, vram), (vram, MemKind::Dram), (vram, vram)] {
        for op in [Op::Write, Op::Read] {
            round += 1;
            let local = a.register(mem(lk)).unwrap();
            let target = b.register(mem(rk)).unwrap();
            let (src, dst) = match op {
                Op::Write => (&local, &target),
                Op::Read => (&target, &local),
            };
            let data = pattern(round, LEN);
            src.write_at(0, &data).unwrap();
            dst.write_at(0, &vec![0xEE; LEN]).unwrap();
            a.load_metadata(&b.metadata().unwrap()).unwrap();
            let r = remote(&a, "target", target.id());
            assert_eq!(r.kind, rk, "the peer advertises the memory kind");
            // Offsets that are not chunk-aligned, inside both registrations.
            let (off, n) = (4096 + 7, LEN - 8192);
            let note = format!("{round}");
            bounded(
                "vram transfer",
                a.transfer(
                    op,
                    &in_kind(lk, local.desc(off as u64, n as u64)),
                    "target",
                    &in_kind(rk, r.desc(off as u64, n as u64)),
                    Some(Bytes::from(note.clone())),
                )
                .unwrap(),
            )
            .await
            .unwrap_or_else(|e| panic!("{op:?} {lk} -> {rk}: {e}"));
            let got = bounded("notification", notes.recv()).await.unwrap();
            assert_eq!(got.msg, Bytes::from(note), "notification of round {round}");
            let mut back = vec![0u8; LEN];
            dst.read_at(0, &mut back).unwrap();
            assert!(
                back[off..off + n] == data[off..off + n],
                "{op:?} {lk} -> {rk}: the bytes arrived"
            );
            assert!(
                back[..off]
                    .iter()
                    .chain(&back[off + n..])
                    .all(|&x| x == 0xEE),
                "{op:?} {lk} -> {rk}: nothing outside the descriptors"
            );
            a.deregister(&local).unwrap();
            b.deregister(&target).unwrap();
        }
    }
    figure(
        &format!("VRAM transfers ({})", but.name),
        format!(
            "{round} combinations of WRITE/READ and DRAM/VRAM moved exactly, on {}",
            gpu.driver
        ),
    );
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// A WRITE into the target's GPU memory with a notification: when the notification
/// arrives, the data is already in device memory (read through a device copy right
/// then), for a run of transfers in posting order.
pub async fn vram_notifications_after_data(but: &BackendUnderTest) {
    need!(
        but,
        "vram_notifications_after_data",
        remote,
        vram,
        notifications
    );
    if gpu_or_skip("vram_notifications_after_data").is_none() {
        return;
    }
    let (a, b) = but.pair().await;
    const N: usize = 12;
    const LEN: usize = 3 << 20;
    let vram = MemKind::Vram { device: 0 };
    let src = a.register(Memory::vram(0, N * LEN).unwrap()).unwrap();
    let dst = b.register(Memory::vram(0, N * LEN).unwrap()).unwrap();
    for i in 0..N {
        src.write_at(i * LEN, &pattern(i as u64 + 50, LEN)).unwrap();
    }
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let r = remote(&a, "target", dst.id());
    let mut notes = b.notifications().unwrap();
    let transfers: Vec<_> = (0..N)
        .map(|i| {
            let off = (i * LEN) as u64;
            a.transfer(
                Op::Write,
                &in_kind(vram, src.desc(off, LEN as u64)),
                "target",
                &in_kind(vram, r.desc(off, LEN as u64)),
                Some(Bytes::from(format!("{i}"))),
            )
            .unwrap()
        })
        .collect();
    for i in 0..N {
        let n = bounded("notification", notes.recv()).await.unwrap();
        assert_eq!(n.msg, Bytes::from(format!("{i}")), "posting order");
        let mut got = vec![0u8; LEN];
        dst.read_at(i * LEN, &mut got).unwrap();
        assert!(
            got == pattern(i as u64 + 50, LEN),
            "data {i} in GPU memory at its notification"
        );
    }
    for t in transfers {
        bounded("transfer", t).await.unwrap();
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// GPU memory is kept alive by in-flight work like host memory: a dropped transfer
/// does not free it early, deregistering while a transfer uses it is refused, and
/// everything is released after the transfer ends.
pub async fn vram_lifetime(but: &BackendUnderTest) {
    need!(but, "vram_lifetime", remote, vram);
    if gpu_or_skip("vram_lifetime").is_none() {
        return;
    }
    let (a, b) = but.pair().await;
    const LEN: usize = 16 << 20;
    let vram = MemKind::Vram { device: 0 };
    let src = a.register(Memory::vram(0, LEN).unwrap()).unwrap();
    let dst = b.register(Memory::vram(0, LEN).unwrap()).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let r = remote(&a, "target", dst.id());
    let t = a
        .transfer(
            Op::Write,
            &in_kind(vram, src.whole()),
            "target",
            &in_kind(vram, r.desc(0, LEN as u64)),
            None,
        )
        .unwrap();
    if src.inflight() > 0 {
        assert_eq!(kind(a.deregister(&src)), ErrorKind::NotAllowed);
    }
    drop(t);
    // Dropped, not freed under the copy: in flight until the backend lets go.
    drained(&src).await;
    a.deregister(&src).unwrap();
    // Same-agent copies between GPU and host memory are the agent's own.
    let h = a.register(vec![7u8; 4096]).unwrap();
    let g = a.register(Memory::vram(0, 4096).unwrap()).unwrap();
    bounded(
        "local copy into GPU memory",
        a.write(
            &one(h.whole()),
            "initiator",
            &in_kind(vram, g.whole()),
            None,
        ),
    )
    .await
    .unwrap();
    assert_eq!(g.to_vec().unwrap(), vec![7u8; 4096]);
    assert!(a.shutdown().await.is_clean());
    assert!(b.shutdown().await.is_clean());
}

/// A peer that shuts down while GPU memory is being staged to or from it: the
/// in-flight transfers end with an error (never a hang), the staging copies still
/// running finish before their memory goes, and the initiator's GPU memory can be
/// deregistered and its agent shut down cleanly afterwards.
pub async fn vram_peer_gone_mid_transfer(but: &BackendUnderTest) {
    need!(but, "vram_peer_gone_mid_transfer", remote, vram);
    if gpu_or_skip("vram_peer_gone_mid_transfer").is_none() {
        return;
    }
    let (a, b) = but.pair().await;
    const LEN: usize = 16 << 20;
    let vram = MemKind::Vram { device: 0 };
    let src = a.register(Memory::vram(0, LEN).unwrap()).unwrap();
    let dst = b.register(Memory::vram(0, LEN).unwrap()).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let r = remote(&a, "target", dst.id());
    // Several blocks of 1 MiB, so that staging copies (of hosts that stage) are in
    // flight when the peer goes.
    let block = 1u64 << 20;
    let blocks = LEN as u64 / block;
    let local = DescList::from_descs(vram, (0..blocks).map(|i| src.desc(i * block, block)));
    let remote_list = DescList::from_descs(vram, (0..blocks).map(|i| r.desc(i * block, block)));
    bounded(
        "warm-up",
        a.transfer(Op::Write, &local, "target", &remote_list, None)
            .unwrap(),
    )
    .await
    .unwrap();
    let mut transfers = Vec::new();
    for i in 0..8 {
        let op = if i % 2 == 0 { Op::Write } else { Op::Read };
        transfers.push(
            a.transfer(op, &local, "target", &remote_list, None)
                .unwrap(),
        );
    }
    let failed = shut_down_under(b, transfers, "GPU transfer").await;
    println!("{failed} of 8 in-flight GPU transfers failed when the target shut down");
    drained(&src).await;
    a.deregister(&src).unwrap();
    assert!(a.shutdown().await.is_clean());
}
