//! The same-host path: which path a connection gets and why, correctness of both
//! direct mechanisms (shared memory, cross-memory attach) and of the copy thread,
//! revocation on deregistration, and the fallback and `Require` errors.

use std::time::Duration;

use futures_util::StreamExt;
use nixl::{Agent, AgentOptions, Backend, DescList, ErrorKind, MemKind, Op, Registration};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};
use nixl_testkit::skip;

async fn agent(name: &str, same_host: SameHost) -> (Agent, TcpBackend) {
    agent_with(
        name,
        TcpOptions {
            same_host,
            ..TcpOptions::default()
        },
    )
    .await
}

async fn agent_with(name: &str, options: TcpOptions) -> (Agent, TcpBackend) {
    let b = TcpBackend::with_options(options);
    let a = Agent::builder(name)
        .backend(b.clone())
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    (a, b)
}

fn one(d: nixl::Desc) -> DescList {
    dram([d])
}

fn dram(descs: impl IntoIterator<Item = nixl::Desc>) -> DescList {
    DescList::from_descs(MemKind::Dram, descs)
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn fill(r: &Registration, seed: u8) {
    r.write_at(0, &pattern(seed, r.len())).unwrap();
}

/// The whole of a remote region as one descriptor.
fn whole(r: &nixl::RemoteRegionInfo) -> nixl::Desc {
    r.desc(0, r.len)
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 20 s"))
}

/// Whether cross-memory attach works between two processes of this test's kind;
/// the CMA cases skip visibly where the kernel refuses it.
fn cma_path(b: &TcpBackend, peer: &str, case: &str) -> bool {
    let path = b.data_path(peer).unwrap();
    if path.contains("cross-memory attach for other host memory") {
        return true;
    }
    skip(case, format!("cross-memory attach is refused here: {path}"));
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_and_cross_memory_attach_move_the_bytes() {
    let (a, ab) = agent("a", SameHost::Require).await;
    let (b, _) = agent("b", SameHost::Require).await;
    // Shared memory on both sides (Agent::alloc), and ordinary memory.
    const N: usize = 1 << 20;
    let src_shm = a.register(a.alloc(N).unwrap()).unwrap();
    let src_vec = a.register(vec![0u8; N]).unwrap();
    let dst_shm = b.register(b.alloc(N).unwrap()).unwrap();
    let dst_vec = b.register(vec![0u8; N]).unwrap();
    fill(&src_shm, 1);
    fill(&src_vec, 2);
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.connect(&peer).await.unwrap();
    let path = ab.data_path(&peer).unwrap();
    assert!(path.starts_with("same-host: shared memory"), "{path}");
    let cma = cma_path(&ab, &peer, "same_host cross-memory attach");
    let regions = a.remote_regions(&peer).unwrap();
    let remote = |r: &Registration| regions.iter().find(|x| x.id == r.id()).unwrap().clone();
    let mut cases = vec![(&src_shm, &dst_shm)];
    if cma {
        // Ordinary memory on either side goes by cross-memory attach.
        cases.extend([
            (&src_vec, &dst_shm),
            (&src_shm, &dst_vec),
            (&src_vec, &dst_vec),
        ]);
    }
    for (src, dst) in cases {
        let rd = remote(dst);
        // Scattered pieces, one descriptor each: WRITE them, READ them back elsewhere.
        let pieces: Vec<(u64, u64)> = (0..64).map(|i| (i * 16384 + 7, 4096 + i)).collect();
        let locals = dram(pieces.iter().map(|&(o, l)| src.desc(o, l)));
        let remotes = dram(pieces.iter().map(|&(o, l)| rd.desc(o + 100, l)));
        bounded("write", a.write(&locals, &peer, &remotes, None))
            .await
            .unwrap();
        let (s, d) = (src.to_vec().unwrap(), dst.to_vec().unwrap());
        for &(o, l) in &pieces {
            let (o, l) = (o as usize, l as usize);
            assert_eq!(
                &d[o + 100..o + 100 + l],
                &s[o..o + l],
                "written piece at {o}"
            );
        }
        // READ the whole target region back into the source's region.
        src.write_at(0, &vec![0u8; N]).unwrap();
        bounded(
            "read",
            a.read(&one(src.whole()), &peer, &one(whole(&rd)), None),
        )
        .await
        .unwrap();
        assert_eq!(src.to_vec().unwrap(), d, "read back");
        fill(src, 3);
    }
    assert!(a.shutdown().await.is_clean());
    assert!(b.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_follow_direct_data() {
    let (a, _) = agent("a", SameHost::Require).await;
    let (b, _) = agent("b", SameHost::Require).await;
    let src = a.register(a.alloc(1 << 16).unwrap()).unwrap();
    let dst = b.register(b.alloc(1 << 16).unwrap()).unwrap();
    let mut notes = b.notifications().unwrap();
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = a.remote_regions(&peer).unwrap()[0].clone();
    for i in 0..20u8 {
        fill(&src, i);
        let msg = bytes::Bytes::from(vec![i; 3]);
        bounded(
            "write",
            a.write(&one(src.whole()), &peer, &one(whole(&rd)), Some(msg)),
        )
        .await
        .unwrap();
        // The notification arrives after the data, in posting order.
        let n = bounded("notification", notes.next()).await.unwrap();
        assert_eq!(&n.msg[..], &[i; 3]);
        assert_eq!(
            dst.to_vec().unwrap(),
            src.to_vec().unwrap(),
            "data before notification {i}"
        );
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfers_use_the_copy_thread_which_is_joined() {
    let (a, ab) = agent("a", SameHost::Require).await;
    let (b, _) = agent("b", SameHost::Require).await;
    const N: usize = 12 << 20; // above the 4 MiB inline bound
    let src = a.register(a.alloc(N).unwrap()).unwrap();
    let dst = b.register(b.alloc(N).unwrap()).unwrap();
    fill(&src, 9);
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = a.remote_regions(&peer).unwrap()[0].clone();
    let ts: Vec<_> = (0..4)
        .map(|_| {
            a.transfer(Op::Write, &one(src.whole()), &peer, &one(whole(&rd)), None)
                .unwrap()
        })
        .collect();
    for t in ts {
        bounded("large write", t).await.unwrap();
    }
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
    assert!(ab.data_path(&peer).unwrap().starts_with("same-host"));
    let r = a.shutdown().await;
    assert!(r.is_clean(), "{r:?}");
    assert!(
        r.threads_left.is_empty(),
        "the copy thread was joined: {r:?}"
    );
    let _ = b.shutdown().await;
}

/// A large cross-memory-attach copy is cut into parts that several threads copy at
/// once (here from 1 MiB, in up to three parts, cut inside descriptors): every byte
/// arrives, both ways, in every layout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_split_across_threads_arrive_whole() {
    let split = TcpOptions {
        same_host: SameHost::Require,
        copy_threads: 3,
        split_copy_min: 1 << 20,
        ..TcpOptions::default()
    };
    let (a, ab) = agent_with("a", split.clone()).await;
    let (b, _) = agent_with("b", split).await;
    const N: usize = 8 << 20;
    let src = a.register(vec![0u8; N]).unwrap();
    let dst = b.register(vec![0u8; N]).unwrap();
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.connect(&peer).await.unwrap();
    if !cma_path(&ab, &peer, "copies_split_across_threads_arrive_whole") {
        return;
    }
    let rd = a.remote_regions(&peer).unwrap()[0].clone();
    // One block; blocks of odd sizes with gaps; both above the split minimum.
    let layouts: [Vec<(u64, u64)>; 2] = [
        vec![(0, N as u64)],
        (0..37).map(|i| (i * 200_000 + 11, 150_001 + i)).collect(),
    ];
    for (seed, pieces) in layouts.iter().enumerate() {
        fill(&src, seed as u8 + 3);
        let locals = dram(pieces.iter().map(|&(o, l)| src.desc(o, l)));
        let remotes = dram(pieces.iter().map(|&(o, l)| rd.desc(o, l)));
        // Bytes outside the blocks must not move.
        let mut inside = vec![false; N];
        for &(o, l) in pieces {
            inside[o as usize..(o + l) as usize].fill(true);
        }
        let untouched = |now: &[u8], before: &[u8], what: &str| {
            let moved = (0..N).find(|&i| !inside[i] && now[i] != before[i]);
            assert_eq!(moved, None, "{what}: a byte outside the blocks changed");
        };
        let dst_before = dst.to_vec().unwrap();
        bounded("write", a.write(&locals, &peer, &remotes, None))
            .await
            .unwrap();
        let (s, d) = (src.to_vec().unwrap(), dst.to_vec().unwrap());
        for &(o, l) in pieces {
            let r = o as usize..(o + l) as usize;
            assert!(d[r.clone()] == s[r], "written block at {o}");
        }
        untouched(&d, &dst_before, "write");
        // READ back into a cleared source.
        src.write_at(0, &vec![0u8; N]).unwrap();
        bounded("read", a.read(&locals, &peer, &remotes, None))
            .await
            .unwrap();
        let s = src.to_vec().unwrap();
        for &(o, l) in pieces {
            let r = o as usize..(o + l) as usize;
            assert!(s[r.clone()] == d[r], "read block at {o}");
        }
        untouched(&s, &vec![0u8; N], "read");
    }
    let r = a.shutdown().await;
    assert!(r.is_clean(), "{r:?}");
    let _ = b.shutdown().await;
}

/// The kernel moves at most 2 GiB - 4 KiB per cross-memory-attach call and reports a
/// short count beyond it: a larger copy is several calls, and every byte arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_memory_copy_over_2_gib_arrives_whole() {
    const CASE: &str = "a_cross_memory_copy_over_2_gib_arrives_whole";
    // Both buffers are touched whole by the copy: 4 GiB, plus room for the rest.
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0)
        << 10;
    if available < 8 << 30 {
        return skip(
            CASE,
            format!(
                "needs 8 GiB of available memory, {} MiB here",
                available >> 20
            ),
        );
    }
    // One copy thread: split across threads, no part would reach the kernel's limit.
    let one_thread = || TcpOptions {
        same_host: SameHost::Require,
        copy_threads: 1,
        ..TcpOptions::default()
    };
    let (a, ab) = agent_with("a", one_thread()).await;
    let (b, _) = agent_with("b", one_thread()).await;
    const N: usize = (2 << 30) + (12 << 10);
    // Ordinary (lazily zeroed) memory, so the copy goes by cross-memory attach (on
    // huge pages where the kernel gives them, to fault 4 GiB in quickly); only the
    // pages around the places where calls may be cut are written.
    let src = a.register(nixl::AlignedBuf::with_huge_pages(N)).unwrap();
    let dst = b.register(nixl::AlignedBuf::with_huge_pages(N)).unwrap();
    let marks = [0, (1 << 30) - 4096, (2 << 30) - 8192, N - 8192];
    for (i, &at) in marks.iter().enumerate() {
        src.write_at(at, &pattern(i as u8 + 1, 8192)).unwrap();
    }
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.connect(&peer).await.unwrap();
    if !cma_path(&ab, &peer, CASE) {
        return;
    }
    let rd = a.remote_regions(&peer).unwrap()[0].clone();
    let check = |r: &Registration, seed: u8| {
        for (i, &at) in marks.iter().enumerate() {
            let mut got = vec![0u8; 8192];
            r.read_at(at, &mut got).unwrap();
            assert_eq!(got, pattern(i as u8 + seed, 8192), "bytes at {at}");
        }
    };
    bounded(
        "write",
        a.write(&one(src.whole()), &peer, &one(whole(&rd)), None),
    )
    .await
    .unwrap();
    check(&dst, 1);
    for (i, &at) in marks.iter().enumerate() {
        dst.write_at(at, &pattern(i as u8 + 50, 8192)).unwrap();
    }
    bounded(
        "read",
        a.read(&one(src.whole()), &peer, &one(whole(&rd)), None),
    )
    .await
    .unwrap();
    check(&src, 50);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistration_revokes_direct_access() {
    let (a, _) = agent("a", SameHost::Require).await;
    let (b, _) = agent("b", SameHost::Require).await;
    let src = a.register(a.alloc(4096).unwrap()).unwrap();
    let dst = b.register(b.alloc(4096).unwrap()).unwrap();
    let keep = b.register(b.alloc(4096).unwrap()).unwrap();
    fill(&src, 5);
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    let regions = a.remote_regions(&peer).unwrap();
    let rd = regions.iter().find(|r| r.id == dst.id()).unwrap().clone();
    bounded(
        "write",
        a.write(&one(src.whole()), &peer, &one(whole(&rd)), None),
    )
    .await
    .unwrap();
    b.deregister(&dst).unwrap();
    // The initiator still has the old metadata: the grant table refuses it.
    let e = bounded(
        "write after deregister",
        a.write(&one(src.whole()), &peer, &one(whole(&rd)), None),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    // Other registrations still work, and a new one reuses the freed slot safely.
    let rk = regions.iter().find(|r| r.id == keep.id()).unwrap().clone();
    bounded(
        "write keep",
        a.write(&one(src.whole()), &peer, &one(whole(&rk)), None),
    )
    .await
    .unwrap();
    assert_eq!(keep.to_vec().unwrap(), src.to_vec().unwrap());
    let again = b.register(b.alloc(4096).unwrap()).unwrap();
    let e = bounded(
        "write with a stale key",
        a.write(&one(src.whole()), &peer, &one(whole(&rd)), None),
    )
    .await
    .unwrap_err();
    assert_eq!(
        e.kind(),
        ErrorKind::NotAllowed,
        "the old key does not open the reused slot: {e}"
    );
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    let ra = a
        .remote_regions(&peer)
        .unwrap()
        .into_iter()
        .find(|r| r.id == again.id())
        .unwrap();
    bounded(
        "write to the new registration",
        a.write(&one(src.whole()), &peer, &one(whole(&ra)), None),
    )
    .await
    .unwrap();
    assert_eq!(again.to_vec().unwrap(), src.to_vec().unwrap());
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_without_the_path_falls_back_or_is_refused() {
    let (b, _) = agent("b", SameHost::Off).await;
    let dst = b.register(vec![0u8; 4096]).unwrap();
    let md = b.metadata().unwrap();
    // Auto: TCP, and the data path says why.
    let (a, ab) = agent("a", SameHost::Auto).await;
    let src = a.register(pattern(4, 4096)).unwrap();
    let peer = a.load_metadata(&md).unwrap();
    a.connect(&peer).await.unwrap();
    let path = ab.data_path(&peer).unwrap();
    assert!(
        path.starts_with("TCP") && path.contains("the peer offers no same-host path"),
        "{path}"
    );
    let rd = a.remote_regions(&peer).unwrap()[0].clone();
    bounded(
        "write over tcp",
        a.write(&one(src.whole()), &peer, &one(whole(&rd)), None),
    )
    .await
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
    let _ = a.shutdown().await;
    // Require: connecting fails with the reason.
    let (r, _) = agent("r", SameHost::Require).await;
    let peer = r.load_metadata(&md).unwrap();
    let e = r.connect(&peer).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}");
    assert!(e.to_string().contains("required"), "{e}");
    let _ = r.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_target_refusing_the_offer_is_a_fallback_too() {
    // The target listens with the path on, but the initiator has it off: TCP.
    let (b, _) = agent("b", SameHost::Auto).await;
    let dst = b.register(b.alloc(4096).unwrap()).unwrap();
    let (a, ab) = agent("a", SameHost::Off).await;
    let src = a.register(pattern(6, 4096)).unwrap();
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = a.remote_regions(&peer).unwrap()[0].clone();
    bounded(
        "write",
        a.write(&one(src.whole()), &peer, &one(whole(&rd)), None),
    )
    .await
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
    let path = ab.data_path(&peer).unwrap();
    assert!(path.contains("turned off in the options"), "{path}");
    // Agent::alloc without the path is ordinary memory.
    assert!(ab.alloc(4096).is_none());
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
