//! Encoding and decoding agent metadata with 10 and 100,000 registrations (synthetic:
//! one tcp backend, an 8-byte key per region).
//!
//! Run: `cargo bench -p nixl-bench --bench metadata`

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nixl::metadata::{AgentMetadata, BackendMeta, RegionBlob, RegionMeta};
use nixl::MemKind;

fn metadata(regions: u64) -> AgentMetadata {
    AgentMetadata {
        name: "target".into(),
        instance: 0x1234_5678_9abc_def0,
        partial: false,
        backends: vec![BackendMeta {
            name: "tcp".into(),
            conn_info: Some(b"127.0.0.1:45678".to_vec()),
        }],
        regions: (0..regions)
            .map(|i| RegionMeta {
                id: i + 1,
                kind: MemKind::Dram,
                addr: 0x7f00_0000_0000 + i * 0x10_0000,
                len: 0x10_0000,
                blobs: vec![RegionBlob {
                    backend: 0,
                    blob: (i ^ 0x5a5a_5a5a).to_le_bytes().to_vec(),
                }],
            })
            .collect(),
    }
}

fn bench_metadata(c: &mut Criterion) {
    let mut g = c.benchmark_group("metadata");
    for n in [10u64, 100_000] {
        let md = metadata(n);
        let bytes = md.encode().expect("encode");
        assert_eq!(AgentMetadata::decode(&bytes).expect("decode"), md);
        g.throughput(Throughput::Elements(n));
        g.bench_with_input(BenchmarkId::new("encode", n), &md, |b, md| {
            b.iter(|| black_box(md).encode().expect("encode"));
        });
        g.bench_with_input(BenchmarkId::new("decode", n), &bytes, |b, bytes| {
            b.iter(|| AgentMetadata::decode(black_box(bytes)).expect("decode"));
        });
    }
    g.finish();
}

criterion_group!(benches, bench_metadata);
criterion_main!(benches);
