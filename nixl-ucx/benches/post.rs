//! Post-to-completion time of one 4 KiB WRITE over UCX between two agents of this
//! process, as the awaiting code sees it (criterion, so runs can be compared with
//! `--save-baseline` / `--baseline`).
//!
//! - `alloc`: both sides in memory from [`UcxBackend::alloc`] (shared memory the
//!   peer maps; UCX finishes the WRITE inside `post`).
//! - `host`: both sides in ordinary memory (CMA on UCX 1.14+, active messages served
//!   by the target's driver on 1.13).
//!
//! Run: `UCX_TLS=shm,self UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y
//! cargo bench -p nixl-ucx --bench post`. Prints a SKIP line without libucp.

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use nixl::{Agent, DescList, MemKind, Op, RequestOptions};
use nixl_ucx::UcxBackend;

const LEN: u64 = 4096;

fn bench_post(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (Ok(ib), Ok(tb)) = (UcxBackend::new(), UcxBackend::new()) else {
        println!("SKIP nixl-ucx post bench: libucp cannot be loaded");
        return;
    };
    let (init, target) = rt.block_on(async {
        let a = Agent::builder("initiator")
            .backend(ib.clone())
            .build()
            .await
            .expect("initiator");
        let b = Agent::builder("target")
            .backend(tb.clone())
            .build()
            .await
            .expect("target");
        (a, b)
    });
    let src = [
        init.register(ib.alloc(1 << 20).expect("alloc"))
            .expect("register"),
        init.register(vec![7u8; 1 << 20]).expect("register"),
    ];
    let _dst = [
        target
            .register(tb.alloc(1 << 20).expect("alloc"))
            .expect("register"),
        target.register(vec![0u8; 1 << 20]).expect("register"),
    ];
    init.load_metadata(&target.metadata().expect("metadata"))
        .expect("load");
    rt.block_on(init.connect("target")).expect("connect");
    let remote = init.remote_regions("target").expect("regions");
    let list = |d| DescList::from_descs(MemKind::Dram, [d]);
    let mut g = c.benchmark_group("ucx_write_4KiB");
    for (i, name) in ["alloc", "host"].into_iter().enumerate() {
        let req = init
            .create_request(
                Op::Write,
                &list(src[i].desc(0, LEN)),
                "target",
                &list(remote[i].desc(0, LEN)),
                &RequestOptions::default(),
            )
            .expect("request");
        g.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(async { req.post(black_box(None)).expect("post").await })
                    .expect("transfer")
            });
        });
    }
    g.finish();
    rt.block_on(async {
        let _ = init.shutdown().await;
        let _ = target.shutdown().await;
    });
}

criterion_group!(benches, bench_post);
criterion_main!(benches);
