//! Memory UCX allocates ([`UcxBackend::alloc`], or [`nixl::Agent::alloc`] with UCX
//! attached) and posting on the caller's thread
//! ([`UcxOptions::post_inline`]).
//!
//! Needs libucp at run time; without it each test prints a SKIP line. With UCX
//! 1.13-1.22 and shared memory, export `UCX_POSIX_ERROR_HANDLING=y
//! UCX_SYSV_ERROR_HANDLING=y` (scripts/test does).

use std::time::Duration;

use bytes::Bytes;
use nixl::{ErrorKind, Op, RequestOptions, Status};
use nixl_ucx::UcxOptions;

mod common;

use common::agent;
use nixl_testkit::double::one;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 30 s"))
}

/// WRITE and READ between every pairing of UCX-allocated and ordinary memory, with
/// the data checked byte for byte and the notification arriving after its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocated_memory_moves_data_both_ways() {
    const TEST: &str = "allocated_memory_moves_data_both_ways";
    const LEN: usize = 1 << 20;
    let Some((a, ab)) = agent(TEST, "initiator", UcxOptions::default()).await else {
        return;
    };
    let (b, bb) = agent(TEST, "target", UcxOptions::default()).await.unwrap();
    let local = [
        a.register(ab.alloc(LEN).unwrap()).unwrap(),
        a.register(vec![0u8; LEN]).unwrap(),
    ];
    let remote = [
        b.register(bb.alloc(LEN).unwrap()).unwrap(),
        b.register(vec![0u8; LEN]).unwrap(),
    ];
    // Fresh allocations are zero-filled.
    assert!(local[0].to_vec().unwrap().iter().all(|&x| x == 0));
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.connect("target").await.unwrap();
    let rr = a.remote_regions("target").unwrap();
    let mut notes = b.notifications().unwrap();
    let mut seed = 1;
    for (li, l) in local.iter().enumerate() {
        for (ri, r) in remote.iter().enumerate() {
            let rd = rr.iter().find(|x| x.id == r.id()).unwrap();
            // Odd offsets and lengths: nothing relies on alignment.
            let (off, len) = (4097u64, LEN - 8191);
            seed += 1;
            l.write_at(off as usize, &pattern(seed, len)).unwrap();
            let tag = Bytes::from(format!("{li}->{ri}"));
            bounded(
                "write",
                a.write(
                    &one(l.desc(off, len as u64)),
                    "target",
                    &one(rd.desc(off, len as u64)),
                    Some(tag.clone()),
                ),
            )
            .await
            .unwrap();
            let n = bounded("notification", notes.recv()).await.unwrap();
            assert_eq!(n.msg, tag);
            let mut got = vec![0u8; len];
            r.read_at(off as usize, &mut got).unwrap();
            assert!(got == pattern(seed, len), "WRITE {tag:?}: data differs");
            // And back: the target's bytes change, the initiator reads them.
            seed += 1;
            r.write_at(0, &pattern(seed, 4096)).unwrap();
            bounded(
                "read",
                a.read(
                    &one(l.desc(0, 4096)),
                    "target",
                    &one(rd.desc(0, 4096)),
                    None,
                ),
            )
            .await
            .unwrap();
            let mut got = vec![0u8; 4096];
            l.read_at(0, &mut got).unwrap();
            assert!(got == pattern(seed, 4096), "READ {tag:?}: data differs");
        }
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Allocated memory stays valid after its backend and agent are gone (the UCX context
/// lives until the last allocation is freed), and freeing it then is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_outlives_its_backend() {
    const TEST: &str = "allocation_outlives_its_backend";
    let Some((a, b)) = agent(TEST, "owner", UcxOptions::default()).await else {
        return;
    };
    let reg = a.register(b.alloc(1 << 20).unwrap()).unwrap();
    let unregistered = b.alloc(4096).unwrap();
    reg.write_at(100, b"before").unwrap();
    let report = a.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(
        b.alloc(4096).unwrap_err().kind(),
        ErrorKind::ShutDown,
        "allocating after shutdown"
    );
    drop(a);
    drop(b);
    // The memory is still mapped and ours.
    let mut got = [0u8; 6];
    reg.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"before");
    reg.write_at(0, &vec![0xa5; 1 << 20]).unwrap();
    assert!(reg.to_vec().unwrap().iter().all(|&x| x == 0xa5));
    drop(unregistered);
    drop(reg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_length_allocation_is_refused() {
    const TEST: &str = "zero_length_allocation_is_refused";
    let Some((a, b)) = agent(TEST, "z", UcxOptions::default()).await else {
        return;
    };
    assert_eq!(b.alloc(0).unwrap_err().kind(), ErrorKind::ZeroLength);
    let _ = a.shutdown().await;
}

/// With `post_inline`, a small WRITE into UCX-allocated memory over shared memory is
/// done by the time `post` returns (no other thread involved); without it, the
/// driver task completes it. Both must move the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_post_completes_before_post_returns() {
    const TEST: &str = "inline_post_completes_before_post_returns";
    for inline in [true, false] {
        let o = UcxOptions {
            post_inline: inline,
            ucx_config: vec![("TLS".into(), "shm,self".into())],
            ..UcxOptions::default()
        };
        let Some((a, ab)) = agent(TEST, "initiator", o.clone()).await else {
            return;
        };
        let (b, _) = agent(TEST, "target", o).await.unwrap();
        let src = a.register(ab.alloc(1 << 16).unwrap()).unwrap();
        // Through the agent: its UCX backend provides the memory.
        let dst = b.register(b.alloc(1 << 16).unwrap()).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        a.connect("target").await.unwrap();
        let rd = a.remote_regions("target").unwrap().remove(0);
        let req = a
            .create_request(
                Op::Write,
                &one(src.desc(0, 4096)),
                "target",
                &one(rd.desc(0, 4096)),
                &RequestOptions::default(),
            )
            .unwrap();
        let mut done_at_return = 0;
        for i in 0..100u64 {
            src.write_at(0, &pattern(i, 4096)).unwrap();
            let t = req.post(None).unwrap();
            if req.status() == Status::Done {
                done_at_return += 1;
            }
            bounded("transfer", t).await.unwrap();
            let mut got = vec![0u8; 4096];
            dst.read_at(0, &mut got).unwrap();
            assert!(got == pattern(i, 4096), "post {i} (inline {inline})");
        }
        eprintln!("inline={inline}: {done_at_return}/100 posts done when post returned");
        if inline {
            // Only a driver round running at that instant defers a post to the driver.
            assert!(
                done_at_return >= 50,
                "only {done_at_return}/100 inline posts completed before returning"
            );
        }
        let _ = a.shutdown().await;
        let _ = b.shutdown().await;
    }
}
