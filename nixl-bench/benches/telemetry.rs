//! What telemetry costs a post: a prepared 64-byte request posted and completed with
//! telemetry off, with per-transfer records (and their spans), with metrics (into a
//! Prometheus recorder), and with both. Local transfers (they complete inside `post`,
//! so the overhead is the largest share there) and round trips over loopback tcp.
//!
//! Run: `cargo bench -p nixl-bench --bench telemetry`

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use futures_util::FutureExt;
use nixl::{Agent, DescList, MemKind, Op, RequestOptions, TelemetryOptions};
use nixl_tcp::TcpBackend;

const LEN: u64 = 64;

const MODES: [(&str, TelemetryOptions); 4] = [
    (
        "off",
        TelemetryOptions {
            transfers: false,
            metrics: false,
            peer_labels: false,
        },
    ),
    (
        "records",
        TelemetryOptions {
            transfers: true,
            metrics: false,
            peer_labels: false,
        },
    ),
    (
        "metrics",
        TelemetryOptions {
            transfers: false,
            metrics: true,
            peer_labels: false,
        },
    ),
    (
        "both",
        TelemetryOptions {
            transfers: true,
            metrics: true,
            peer_labels: false,
        },
    ),
];

fn bench_telemetry(c: &mut Criterion) {
    // A real recorder, as a service exporting to Prometheus has.
    let _handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("recorder");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let target = rt.block_on(async {
        Agent::builder("target")
            .backend(TcpBackend::new())
            .build()
            .await
            .expect("target")
    });
    let _remote_mem = target.register(vec![0u8; 4096]).expect("register");
    let list = |d| DescList::from_descs(MemKind::Dram, [d]);
    let options = RequestOptions::default();
    let mut g = c.benchmark_group("telemetry_64B");
    let mut agents = Vec::new();
    for (name, t) in MODES {
        let init = rt.block_on(async {
            Agent::builder(format!("initiator-{name}"))
                .backend(TcpBackend::new())
                .telemetry(t)
                .build()
                .await
                .expect("initiator")
        });
        let src = init.register(vec![7u8; 4096]).expect("register");
        let dst = init.register(vec![0u8; 4096]).expect("register");
        init.load_metadata(&target.metadata().expect("metadata"))
            .expect("load");
        let remote = init.remote_regions("target").expect("regions")[0].clone();
        let me = init.name().to_owned();
        let local = init
            .create_request(
                Op::Write,
                &list(src.desc(0, LEN)),
                &me,
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
        g.bench_function(format!("local_post_and_complete/{name}"), |b| {
            b.iter(|| {
                let t = local.post(black_box(None)).expect("post");
                t.now_or_never().expect("already complete").expect("ok");
            });
        });
        g.bench_function(format!("remote_round_trip/{name}"), |b| {
            b.iter(|| {
                rt.block_on(async { remote_req.post(None).expect("post").await })
                    .expect("transfer")
            });
        });
        agents.push((init, src, dst, local, remote_req));
    }
    g.finish();
    rt.block_on(async {
        for (a, ..) in agents {
            let _ = a.shutdown().await;
        }
        let _ = target.shutdown().await;
    });
}

criterion_group!(benches, bench_telemetry);
criterion_main!(benches);
