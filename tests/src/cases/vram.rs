//! GPU memory (VRAM) cases; each skips visibly without a GPU.

use super::*;

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
