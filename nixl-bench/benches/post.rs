//! Posting a prepared 64-byte request: a local transfer (post overhead plus a 64-byte
//! copy; it completes inside `post`), and a remote one over loopback tcp, both the
//! `post` call alone and the full round trip.
//!
//! Run: `cargo bench -p nixl-bench --bench post`

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use futures_util::FutureExt;
use nixl::{Agent, DescList, MemKind, Op, RequestOptions};
use nixl_tcp::TcpBackend;

const LEN: u64 = 64;

fn bench_post(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (init, target) = rt.block_on(async {
        let a = Agent::builder("initiator")
            .backend(TcpBackend::new())
            .build()
            .await
            .expect("initiator");
        let b = Agent::builder("target")
            .backend(TcpBackend::new())
            .build()
            .await
            .expect("target");
        (a, b)
    });
    let src = init.register(vec![7u8; 4096]).expect("register");
    let dst = init.register(vec![0u8; 4096]).expect("register");
    let _remote_mem = target.register(vec![0u8; 4096]).expect("register");
    init.load_metadata(&target.metadata().expect("metadata"))
        .expect("load");
    let remote = init.remote_regions("target").expect("regions")[0].clone();
    let list = |d| DescList::from_descs(MemKind::Dram, [d]);
    let options = RequestOptions::default();

    let local = init
        .create_request(
            Op::Write,
            &list(src.desc(0, LEN)),
            "initiator",
            &list(dst.desc(0, LEN)),
            &options,
        )
        .expect("local request");
    let remote_req = init
        .create_request(
            Op::Write,
            &list(src.desc(0, LEN)),
            "target",
            &list(remote.desc(0, LEN)),
            &options,
        )
        .expect("remote request");
    rt.block_on(init.connect("target")).expect("connect");

    let mut g = c.benchmark_group("post_64B");
    g.bench_function("local_post_and_complete", |b| {
        b.iter(|| {
            let t = local.post(black_box(None)).expect("post");
            // A local transfer is done by the time post returns.
            t.now_or_never().expect("already complete").expect("ok");
        });
    });
    g.bench_function("remote_post_only", |b| {
        b.iter_custom(|iters| {
            let mut posting = Duration::ZERO;
            for _ in 0..iters {
                let t0 = Instant::now();
                let t = remote_req.post(black_box(None)).expect("post");
                posting += t0.elapsed();
                rt.block_on(t).expect("transfer");
            }
            posting
        });
    });
    g.bench_function("remote_round_trip", |b| {
        b.iter(|| {
            rt.block_on(async { remote_req.post(None).expect("post").await })
                .expect("transfer")
        });
    });
    g.finish();
    drop((local, remote_req));
    rt.block_on(async {
        let _ = init.shutdown().await;
        let _ = target.shutdown().await;
    });
}

criterion_group!(benches, bench_post);
criterion_main!(benches);
