//! What a peer's WRITE does after the target deregistered the memory, on the bound
//! UCX and `UCX_TLS` (issue 39, hole 5; the crate docs, **Deregistration**).
//!
//! nixl's promise is that nothing touches memory once `deregister` returned. nixl-ucx
//! keeps it only where UCX's transport checks remote keys in hardware (RDMA: the
//! unmapped region's key no longer works). On shared memory (CMA, UCX-allocated
//! shared segments the peer has mapped, UCX 1.13's software RMA) and on tcp, nothing
//! at the target can revoke a peer's access: the WRITE completes and the bytes land,
//! for ordinary and for UCX-allocated memory. This test pins exactly that, so the
//! documentation stays true: where `UCX_TLS` names only such transports it asserts
//! the documented outcome (and fails, asking for the docs to change, if UCX starts
//! refusing); elsewhere it prints what happened.
//!
//! Needs libucp at run time; without it the test prints a SKIP line.

use std::future::Future;
use std::time::Duration;

use nixl::{DescList, MemKind};
use nixl_ucx::UcxOptions;

mod common;

async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// Whether `UCX_TLS` allows only transports without revocable remote keys.
fn no_revocable_keys() -> bool {
    let Ok(tls) = std::env::var("UCX_TLS") else {
        return false;
    };
    !tls.starts_with('^')
        && tls.split(',').all(|t| {
            matches!(
                t.trim().split(':').next().unwrap_or(""),
                "shm" | "sm" | "mm" | "posix" | "sysv" | "cma" | "xpmem" | "knem" | "tcp" | "self"
            )
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_write_after_deregister_lands_without_revocable_keys() {
    const TEST: &str = "a_peers_write_after_deregister_lands_without_revocable_keys";
    let Some((target, tb)) = common::agent(TEST, "target", UcxOptions::default()).await else {
        return;
    };
    let (peer, _) = common::agent(TEST, "peer", UcxOptions::default())
        .await
        .unwrap();
    let one = |d| DescList::from_descs(MemKind::Dram, [d]);
    let src = peer.register(vec![0xabu8; 4096]).unwrap();
    let version = tb.library_report().version_string();
    for allocated in [false, true] {
        let mem = if allocated {
            target.alloc(4096).unwrap()
        } else {
            vec![0u8; 4096].into()
        };
        let r = target.register(mem).unwrap();
        peer.load_metadata(&target.metadata().unwrap()).unwrap();
        peer.connect("target").await.unwrap();
        let rd = peer
            .remote_regions("target")
            .unwrap()
            .into_iter()
            .find(|x| x.id == r.id())
            .unwrap();
        let (local, remote) = (one(src.whole()), one(rd.desc(0, 4096)));
        let write = || peer.write(&local, "target", &remote, None);
        bounded("write", write()).await.unwrap();
        assert!(r.to_vec().unwrap().iter().all(|&b| b == 0xab));
        r.write_at(0, &[0u8; 4096]).unwrap();
        target.deregister(&r).unwrap();
        // The peer still holds the target's old metadata, as it would until told.
        let out = bounded("write after deregister", write()).await;
        let changed = r.to_vec().unwrap().iter().filter(|&&b| b != 0).count();
        println!(
            "UCX {version} UCX_TLS={:?} allocated={allocated}: WRITE after deregister {:?}, {changed} of 4096 bytes changed",
            std::env::var("UCX_TLS").ok(),
            out.as_ref().map_err(|e| e.to_string())
        );
        if no_revocable_keys() {
            assert!(
                out.is_ok() && changed == 4096,
                "UCX {version} now refuses a WRITE after deregistration here: update nixl-ucx's docs (Deregistration) and the README"
            );
        }
    }
    let _ = peer.shutdown().await;
    let _ = target.shutdown().await;
}
