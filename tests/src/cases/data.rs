//! Metadata and data movement: sizes, lists, strided lists, local transfers.

use super::*;

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
