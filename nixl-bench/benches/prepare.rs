//! Preparing N descriptors (1, 1,000, 1,000,000) between two tcp agents: checking the
//! local and remote lists (`prep_local`, `prep_remote`) and building a request from
//! them (`make_request`, which includes the backend's prepare).
//!
//! Run: `cargo bench -p nixl-bench --bench prepare`

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nixl::{Agent, DescList, MemKind, Op, RequestOptions};
use nixl_tcp::TcpBackend;

/// Bytes per descriptor: small, so a million fit in 64 MiB per side.
const DESC: u64 = 64;

fn bench_prepare(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    for n in [1usize, 1_000, 1_000_000] {
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
        let len = n as u64 * DESC;
        let local = init.register(vec![0u8; len as usize]).expect("register");
        let _remote_mem = target.register(vec![0u8; len as usize]).expect("register");
        init.load_metadata(&target.metadata().expect("metadata"))
            .expect("load");
        let remote = init.remote_regions("target").expect("regions")[0].clone();
        // Contiguous descriptors, kept apart (no merging) to measure per-descriptor cost.
        let local_list = DescList::from_descs(
            MemKind::Dram,
            (0..len).step_by(DESC as usize).map(|o| local.desc(o, DESC)),
        );
        let remote_list = DescList::from_descs(
            MemKind::Dram,
            (0..len)
                .step_by(DESC as usize)
                .map(|o| remote.desc(o, DESC)),
        );
        let idx: Vec<usize> = (0..n).collect();
        let options = RequestOptions {
            merge: false,
            ..RequestOptions::default()
        };

        let mut g = c.benchmark_group(format!("prepare_{n}_descs"));
        g.throughput(Throughput::Elements(n as u64));
        if n >= 100_000 {
            g.sample_size(10);
        }
        g.bench_function(BenchmarkId::from_parameter("prep_local"), |b| {
            b.iter(|| init.prep_local(black_box(&local_list)).expect("prep_local"));
        });
        g.bench_function(BenchmarkId::from_parameter("prep_remote"), |b| {
            b.iter(|| {
                init.prep_remote("target", black_box(&remote_list))
                    .expect("prep_remote")
            });
        });
        let lp = init.prep_local(&local_list).expect("prep_local");
        let rp = init
            .prep_remote("target", &remote_list)
            .expect("prep_remote");
        g.bench_function(BenchmarkId::from_parameter("make_request"), |b| {
            b.iter(|| {
                init.make_request(Op::Write, &lp, black_box(&idx), &rp, &idx, &options)
                    .expect("make_request")
            });
        });
        g.finish();
        rt.block_on(async {
            init.shutdown().await;
            target.shutdown().await;
        });
    }
}

criterion_group!(benches, bench_prepare);
criterion_main!(benches);
