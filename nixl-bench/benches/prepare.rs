//! Preparing N descriptors of 64 bytes (1 thousand, 1 million, 10 million) between
//! two tcp agents: checking the local and remote lists (`prep_local`,
//! `prep_remote`) and building a request from them (`make_request`, which includes
//! the backend's prepare), for two layouts:
//!
//! - `regular`: consecutive blocks, built one descriptor at a time (recognized as one
//!   run), requests by index range (`make_request`) and by an explicit list of
//!   indices (`make_request_listed`);
//! - `shuffled`: the same blocks in a random order (one run per descriptor).
//!
//! Descriptors are kept apart (no merging) to measure per-descriptor cost.
//! `PREP_SIZES=1000,1000000` picks the sizes.
//!
//! Run: `cargo bench -p nixl-bench --bench prepare`

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nixl::{Agent, DescList, Indices, MemKind, Op, RequestOptions};
use nixl_tcp::TcpBackend;

/// Bytes per descriptor: small, so ten million fit in 640 MiB per side.
const DESC: u64 = 64;

/// A fixed permutation (xorshift-driven Fisher-Yates), the same in every run.
fn shuffle(v: &mut [u64]) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

fn bench_prepare(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let sizes: Vec<usize> = std::env::var("PREP_SIZES")
        .map(|s| {
            s.split(',')
                .map(|x| x.parse().expect("PREP_SIZES"))
                .collect()
        })
        .unwrap_or_else(|_| vec![1_000, 1_000_000, 10_000_000]);
    for n in sizes {
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
        for layout in ["regular", "shuffled"] {
            let mut offs: Vec<u64> = (0..n as u64).map(|i| i * DESC).collect();
            if layout == "shuffled" {
                shuffle(&mut offs);
            }
            let local_list =
                DescList::from_descs(MemKind::Dram, offs.iter().map(|&o| local.desc(o, DESC)));
            let remote_list =
                DescList::from_descs(MemKind::Dram, offs.iter().map(|&o| remote.desc(o, DESC)));
            drop(offs);
            let options = RequestOptions {
                merge: false,
                ..RequestOptions::default()
            };

            let mut g = c.benchmark_group(format!("prepare_{n}_{layout}"));
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
            // nixl-tcp carries at most 2^20 runs per request: a shuffled list of ten
            // million blocks is refused when the request is made.
            if let Err(e) =
                init.make_request(Op::Write, &lp, Indices::All, &rp, Indices::All, &options)
            {
                eprintln!("prepare_{n}_{layout}: no request benches ({e})");
                g.finish();
                continue;
            }
            g.bench_function(BenchmarkId::from_parameter("make_request"), |b| {
                b.iter(|| {
                    init.make_request(Op::Write, &lp, black_box(0..n), &rp, Indices::All, &options)
                        .expect("make_request")
                });
            });
            if layout == "regular" {
                let idx: Vec<usize> = (0..n).collect();
                g.bench_function(BenchmarkId::from_parameter("make_request_listed"), |b| {
                    b.iter(|| {
                        init.make_request(Op::Write, &lp, black_box(&idx), &rp, &idx, &options)
                            .expect("make_request")
                    });
                });
            }
            g.bench_function(BenchmarkId::from_parameter("prepare_and_make"), |b| {
                b.iter(|| {
                    let lp = init.prep_local(black_box(&local_list)).expect("prep_local");
                    let rp = init
                        .prep_remote("target", &remote_list)
                        .expect("prep_remote");
                    init.make_request(Op::Write, &lp, Indices::All, &rp, Indices::All, &options)
                        .expect("make_request")
                });
            });
            g.finish();
        }
        rt.block_on(async {
            let _ = init.shutdown().await;
            let _ = target.shutdown().await;
        });
    }
}

criterion_group!(benches, bench_prepare);
criterion_main!(benches);
