//! Property test: random batches of READs and WRITEs between two tcp agents, checked
//! against a simple model of both memories.

use std::sync::LazyLock;

use nixl::{Agent, DescList, MemKind, Op, Registration, RemoteRegionInfo, RequestOptions};
use proptest::prelude::*;
use tokio::runtime::Runtime;

const SIZE: usize = 64 * 1024;

struct World {
    rt: Runtime,
    a: Agent,
    _b: Agent,
    la: Registration,
    lb: Registration,
    rb: RemoteRegionInfo,
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (a, b, la, lb, rb) = rt.block_on(async {
        let a = Agent::builder("a")
            .backend(nixl_tcp::TcpBackend::with_options(
                nixl_conformance::support::tcp_options_from_env(),
            ))
            .build()
            .await
            .unwrap();
        let b = Agent::builder("b")
            .backend(nixl_tcp::TcpBackend::with_options(
                nixl_conformance::support::tcp_options_from_env(),
            ))
            .build()
            .await
            .unwrap();
        let la = a.register(vec![0u8; SIZE]).unwrap();
        let lb = b.register(vec![0u8; SIZE]).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        let rb = a.remote_regions("b").unwrap()[0].clone();
        (a, b, la, lb, rb)
    });
    World {
        rt,
        a,
        _b: b,
        la,
        lb,
        rb,
    }
});

#[derive(Clone, Debug)]
struct Xfer {
    op: Op,
    /// (local offset, remote offset, len) per descriptor.
    descs: Vec<(usize, usize, usize)>,
    merge: bool,
}

fn xfer() -> impl Strategy<Value = Xfer> {
    let desc = (0..SIZE, 0..SIZE, 1usize..4096).prop_map(|(l, r, n)| {
        let n = n.min(SIZE - l).min(SIZE - r).max(1);
        (l.min(SIZE - n), r.min(SIZE - n), n)
    });
    (
        prop_oneof![Just(Op::Read), Just(Op::Write)],
        prop::collection::vec(desc, 1..12),
        any::<bool>(),
    )
        .prop_map(|(op, descs, merge)| Xfer { op, descs, merge })
}

/// Apply to the model in descriptor order (what the backend must match when the
/// descriptors of one transfer do not overlap each other's destinations).
fn apply(model_a: &mut [u8], model_b: &mut [u8], x: &Xfer) {
    for &(l, r, n) in &x.descs {
        match x.op {
            Op::Write => model_b[r..r + n].copy_from_slice(&model_a[l..l + n]),
            Op::Read => model_a[l..l + n].copy_from_slice(&model_b[r..r + n]),
        }
    }
}

/// Destinations of one transfer must not overlap, and for a transfer, its destinations
/// must not overlap its sources on the same side (local transfers only): keep them
/// disjoint so the outcome is order-independent.
fn disjoint_destinations(x: &Xfer) -> bool {
    let mut ranges: Vec<(usize, usize)> = x
        .descs
        .iter()
        .map(|&(l, r, n)| match x.op {
            Op::Write => (r, r + n),
            Op::Read => (l, l + n),
        })
        .collect();
    ranges.sort();
    ranges.windows(2).all(|w| w[0].1 <= w[1].0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_batches_match_model(seed in any::<u8>(), batches in prop::collection::vec(xfer(), 1..8)) {
        let w = &*WORLD;
        let mut model_a: Vec<u8> = (0..SIZE).map(|i| (i as u8) ^ seed).collect();
        let mut model_b: Vec<u8> = (0..SIZE).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect();
        w.la.write_at(0, &model_a).unwrap();
        w.lb.write_at(0, &model_b).unwrap();
        for x in batches.iter().filter(|x| disjoint_destinations(x)) {
            let local = DescList::from_descs(MemKind::Dram, x.descs.iter().map(|&(l, _, n)| w.la.desc(l as u64, n as u64)));
            let remote = DescList::from_descs(MemKind::Dram, x.descs.iter().map(|&(_, r, n)| w.rb.desc(r as u64, n as u64)));
            let opts = RequestOptions { merge: x.merge, ..Default::default() };
            let req = w.a.create_request(x.op, &local, "b", &remote, &opts).unwrap();
            w.rt.block_on(async { tokio::time::timeout(std::time::Duration::from_secs(30), req.post(None).unwrap()).await })
                .expect("transfer hung")
                .unwrap();
            apply(&mut model_a, &mut model_b, x);
            prop_assert!(w.la.to_vec().unwrap() == model_a, "initiator memory differs from the model after {:?}", x);
            prop_assert!(w.lb.to_vec().unwrap() == model_b, "target memory differs from the model after {:?}", x);
        }
    }
}
