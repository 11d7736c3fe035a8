//! Strided descriptor lists end to end: preparing them and building requests from
//! them gives exactly what the same descriptors, one run each, give (the same errors,
//! the same segments reaching the backend, the same bytes copied), while staying
//! compressed: a regular list reaches the backend as one run.
#![allow(unsafe_code)] // registrations over parts of one buffer (Memory::from_raw_parts)

mod common;

use std::sync::Arc;

use common::{Recorder, Seen};
use nixl::{
    Agent, AlignedBuf, Desc, DescList, ErrorKind, Indices, MemKind, Memory, Op, Registration,
    RequestOptions, Strided,
};
use nixl_testkit::double::{backend, shared};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Region size; each agent has three adjacent regions in one buffer, then a gap.
const PART: usize = 512;

/// An agent with a recorder and three adjacent registrations of `PART` bytes.
async fn agent(name: &str) -> (Agent, Arc<Recorder>, Vec<Registration>) {
    let rec = Arc::new(Recorder {
        expand: true,
        ..Recorder::default()
    });
    let a = Agent::builder(name)
        .backend(shared(rec.clone()))
        .build()
        .await
        .unwrap();
    let buf = Arc::new(AlignedBuf::new(PART * 4));
    let regs = (0..3)
        .map(|i| {
            // SAFETY: each part lies inside `buf`, which the memory keeps alive as its
            // owner; nothing else references the buffer.
            let m = unsafe {
                Memory::from_raw_parts_with_owner(
                    buf.as_mut_ptr().add(i * PART),
                    PART,
                    MemKind::Dram,
                    Some(buf.clone()),
                )
            }
            .unwrap();
            a.register(m).unwrap()
        })
        .collect();
    (a, rec, regs)
}

/// The same descriptors as `l`, one run each (nothing recognized or compressed).
fn expanded(l: &DescList) -> DescList {
    let mut out = DescList::new(l.kind());
    for d in l.iter() {
        out.push_strided(Strided::new(d, 0, 1));
    }
    out
}

#[derive(Clone, Debug)]
enum Pick {
    All,
    Range(usize, usize),
    List(Vec<usize>),
}

impl Pick {
    fn indices(&self) -> Indices<'_> {
        match self {
            Self::All => Indices::All,
            Self::Range(a, b) => Indices::Range(*a..*b),
            Self::List(v) => Indices::List(v),
        }
    }

    /// The same choice as an explicit list.
    fn listed(&self, len: usize) -> Vec<usize> {
        match self {
            Self::All => (0..len).collect(),
            Self::Range(a, b) => (*a..*b).collect(),
            Self::List(v) => v.clone(),
        }
    }
}

/// One side of a run: offset from the base, stride, and whether it is built one
/// descriptor at a time.
fn arb_side() -> impl Strategy<Value = (i64, u64, bool)> {
    (
        // Mostly aligned, so blocks rarely straddle a boundary.
        prop_oneof![
            8 => (0i64..(PART as i64 / 8)).prop_map(|o| o * 16),
            1 => -16i64..(PART as i64 * 3)
        ],
        prop_oneof![4 => Just(16u64), 4 => Just(32), 4 => Just(64), 1 => Just(0), 1 => 1u64..100],
        any::<bool>(),
    )
}

fn build(base: u64, shape: &[(u64, usize)], sides: &[(i64, u64, bool)]) -> DescList {
    let mut l = DescList::new(MemKind::Dram);
    for (&(len, count), &(off, stride, by_push)) in shape.iter().zip(sides) {
        let run = Strided::new(
            Desc::new(base.wrapping_add_signed(off), len, 0),
            stride,
            count,
        );
        if by_push {
            for d in run.blocks() {
                l.push(d);
            }
        } else {
            l.push_strided(run);
        }
    }
    l
}

/// Two lists of runs around `a` and `b` with the same shape (block lengths and
/// counts), each side placed on its own: mostly inside the three regions, sometimes
/// past them or across their boundaries; now and then one block length differs.
fn arb_lists(a: u64, b: u64) -> impl Strategy<Value = (DescList, DescList)> {
    let shape = prop::collection::vec(
        (
            prop_oneof![8 => Just(16u64), 8 => Just(32), 1 => Just(0), 1 => 1u64..64],
            1usize..12,
        ),
        1..5,
    );
    (shape, any::<u8>()).prop_flat_map(move |(shape, odd)| {
        let n = shape.len();
        (
            prop::collection::vec(arb_side(), n),
            prop::collection::vec(arb_side(), n),
        )
            .prop_map(move |(x, y)| {
                let mut other = shape.clone();
                if odd < 16 {
                    other[odd as usize % n].0 += 1;
                }
                (build(a, &shape, &x), build(b, &other, &y))
            })
    })
}

fn arb_pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        2 => Just(Pick::All),
        1 => (0usize..8, 0usize..24).prop_map(|(a, n)| Pick::Range(a, a + n)),
        1 => prop::collection::vec(
            prop_oneof![20 => 0usize..24, 1 => Just(usize::MAX)],
            0..40
        )
        .prop_map(|mut v| {
            // Mostly ascending, so consecutive indices form spans.
            if v.len() % 3 != 0 {
                v.sort_unstable();
            }
            Pick::List(v)
        }),
    ]
}

type Outcome = std::result::Result<(u64, usize, Seen), (ErrorKind, String)>;

#[allow(clippy::too_many_arguments)]
fn request(
    a: &Agent,
    rec: &Recorder,
    peer: &str,
    local: &DescList,
    lpick: &Indices<'_>,
    remote: &DescList,
    rpick: &Indices<'_>,
    merge: bool,
) -> Outcome {
    let fail = |e: nixl::Error| (e.kind(), e.to_string());
    let lp = a.prep_local(local).map_err(fail)?;
    let rp = a.prep_remote(peer, remote).map_err(fail)?;
    let options = RequestOptions {
        merge,
        ..RequestOptions::default()
    };
    *rec.last.lock().unwrap() = Seen::default();
    let r = a
        .make_request(Op::Write, &lp, lpick.clone(), &rp, rpick.clone(), &options)
        .map_err(fail)?;
    Ok((r.bytes(), r.segments(), rec.last.lock().unwrap().clone()))
}

#[test]
fn strided_requests_match_their_expanded_form() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ((a, rec, la), (b, _, lb)) = rt.block_on(async { (agent("a").await, agent("b").await) });
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let (abase, bbase) = (la[0].addr(), lb[0].addr());
    let mut runner = TestRunner::new(Config {
        cases: 3000,
        ..Config::default()
    });
    let strategy = (arb_lists(abase, bbase), arb_pick(), arb_pick(), any::<u8>());
    let compared = [std::cell::Cell::new(0usize), std::cell::Cell::new(0)];
    runner
        .run(&strategy, |((local, remote), lpick, rpick, mode)| {
            // Mostly the same choice on both sides, as applications make them.
            let rpick = if mode % 4 == 0 { rpick } else { lpick.clone() };
            let merge = mode & 4 != 0;
            let (ll, rl) = (lpick.listed(local.len()), rpick.listed(remote.len()));
            let got = request(
                &a,
                &rec,
                "b",
                &local,
                &lpick.indices(),
                &remote,
                &rpick.indices(),
                merge,
            );
            let want = request(
                &a,
                &rec,
                "b",
                &expanded(&local),
                &Indices::List(&ll),
                &expanded(&remote),
                &Indices::List(&rl),
                merge,
            );
            match (&got, &want) {
                (Ok((bytes, n, seen)), Ok((wbytes, wn, wseen))) => {
                    // Independent of the reference: every index was in bounds and
                    // every pair reached the backend.
                    prop_assert!(ll.iter().all(|&i| i < local.len()));
                    prop_assert!(rl.iter().all(|&i| i < remote.len()));
                    if !merge {
                        prop_assert_eq!(*n, ll.len());
                    }
                    prop_assert_eq!((bytes, n, &seen.segments), (wbytes, wn, &wseen.segments));
                    prop_assert!(seen.runs <= wseen.runs);
                    compared[0].set(compared[0].get() + 1);
                }
                _ => {
                    prop_assert_eq!(&got, &want);
                    compared[1].set(compared[1].get() + 1);
                }
            }
            Ok(())
        })
        .unwrap();
    // Both outcomes were exercised often enough to mean something.
    let compared = compared.map(|c| c.get());
    assert!(compared[0] > 500 && compared[1] > 500, "{compared:?}");
    rt.block_on(async {
        let _ = a.shutdown().await;
        let _ = b.shutdown().await;
    });
}

#[test]
fn same_agent_strided_copies_move_the_same_bytes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (a, _rec, regs) = rt.block_on(agent("a"));
    let base = regs[0].addr();
    let fill = |regs: &[Registration]| {
        for (i, r) in regs.iter().enumerate() {
            let bytes: Vec<u8> = (0..PART).map(|k| (k * 7 + i * 31) as u8).collect();
            r.write_at(0, &bytes).unwrap();
        }
    };
    let snapshot =
        |regs: &[Registration]| regs.iter().map(|r| r.to_vec().unwrap()).collect::<Vec<_>>();
    let mut runner = TestRunner::new(Config {
        cases: 500,
        ..Config::default()
    });
    let moved = std::cell::Cell::new(0);
    runner
        .run(
            &(arb_lists(base, base), any::<bool>()),
            |((src, dst), merge)| {
                let options = RequestOptions {
                    merge,
                    ..RequestOptions::default()
                };
                let mut after = Vec::new();
                for (s, d) in [(src.clone(), dst.clone()), (expanded(&src), expanded(&dst))] {
                    fill(&regs);
                    let r = (s.len() == d.len())
                        .then(|| a.create_request(Op::Write, &s, "a", &d, &options))
                        .map(|r| r.map_err(|e| e.kind()));
                    if let Some(Ok(req)) = &r {
                        rt.block_on(req.post(None).unwrap()).unwrap();
                        moved.set(moved.get() + 1);
                    }
                    after.push((r.map(|r| r.map(|req| req.segments())), snapshot(&regs)));
                }
                prop_assert_eq!(&after[0], &after[1]);
                Ok(())
            },
        )
        .unwrap();
    assert!(moved.get() > 50, "only {} copies ran", moved.get());
}

#[tokio::test]
async fn a_regular_list_stays_one_run_up_to_the_backend() {
    let rec = Arc::new(Recorder::default());
    let a = Agent::builder("a")
        .backend(shared(rec.clone()))
        .build()
        .await
        .unwrap();
    let b = Agent::builder("b")
        .backend(backend(Recorder::default()))
        .build()
        .await
        .unwrap();
    const N: usize = 1_000_000;
    let la = a.register(vec![0u8; N * 128]).unwrap();
    let lb = b.register(vec![0u8; N * 128]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rb = a.remote_regions("b").unwrap()[0].clone();
    // Built one descriptor at a time: recognized as one run.
    let local = DescList::from_descs(MemKind::Dram, (0..N as u64).map(|i| la.desc(i * 128, 64)));
    assert_eq!(local.runs().len(), 1);
    let remote = DescList::strided(MemKind::Dram, rb.desc(64, 64), 128, N);
    let lp = a.prep_local(&local).unwrap();
    let rp = a.prep_remote("b", &remote).unwrap();
    assert_eq!((lp.len(), lp.runs(), rp.runs()), (N, 1, 1));
    let req = a
        .make_request(
            Op::Write,
            &lp,
            Indices::All,
            &rp,
            0..N,
            &RequestOptions::default(),
        )
        .unwrap();
    assert_eq!((req.segments(), req.bytes()), (N, N as u64 * 64));
    assert_eq!(rec.last.lock().unwrap().runs, 1);
    // A selection of blocks: consecutive indices stay runs.
    let pick: Vec<usize> = (10..20).chain(500..600).chain([7]).collect();
    let req = a
        .make_request(Op::Read, &lp, &pick, &rp, &pick, &RequestOptions::default())
        .unwrap();
    assert_eq!(req.segments(), 111);
    assert_eq!(rec.last.lock().unwrap().runs, 3);
    // Contiguous on both sides: one merged segment.
    let whole = DescList::strided(MemKind::Dram, la.desc(0, 64), 64, 2 * N);
    let whole_r = DescList::strided(MemKind::Dram, rb.desc(0, 64), 64, 2 * N);
    let req = a
        .create_request(Op::Write, &whole, "b", &whole_r, &RequestOptions::default())
        .unwrap();
    assert_eq!((req.segments(), req.bytes()), (1, 2 * N as u64 * 64));
    drop(lb);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test]
async fn runs_split_at_registration_boundaries_and_fail_at_the_first_bad_block() {
    let (a, rec, regs) = agent("a").await;
    let base = regs[0].addr();
    // 48 blocks of 16 bytes every 32 bytes: 16 in each of the three adjacent regions.
    let ok = DescList::strided(MemKind::Dram, Desc::new(base, 16, 0), 32, 48);
    let p = a.prep_local(&ok).unwrap();
    assert_eq!((p.len(), p.runs()), (48, 3));
    // Block 15 of this run straddles the first boundary.
    let straddle = DescList::strided(MemKind::Dram, Desc::new(base + 20, 16, 0), 32, 48);
    let e = a.prep_local(&straddle).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::SpansRegions, "{e}");
    assert!(e.to_string().contains("local descriptor 15"), "{e}");
    // Runs off the end of the third region into nothing at block 48.
    let mut past = DescList::new(MemKind::Dram);
    past.push(Desc::new(base, 1, 0));
    past.push_strided(Strided::new(Desc::new(base, 16, 0), 32, 60));
    let e = a.prep_local(&past).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    assert!(e.to_string().contains("local descriptor 49"), "{e}");
    // Index out of bounds names the index.
    let e = a
        .make_request(Op::Write, &p, 40..50, &p, 0..10, &RequestOptions::default())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(
        e.to_string().contains("local index 48 out of bounds"),
        "{e}"
    );
    // Also the largest index there is, in a list (not taken for the end of it).
    let opts = RequestOptions::default();
    let e = a
        .make_request(Op::Write, &p, &[0, usize::MAX], &p, &[1, 2], &opts)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    let want = format!("local index {} out of bounds", usize::MAX);
    assert!(e.to_string().contains(&want), "{e}");
    let e = a
        .make_request(Op::Write, &p, &[usize::MAX], &p, &[usize::MAX], &opts)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    let e = a
        .make_request(Op::Write, &p, &[0, 1], &p, &[2, usize::MAX], &opts)
        .unwrap_err();
    assert!(e.to_string().contains("remote index"), "{e}");
    // One block named 2^60 times: checked in O(1), refused for its byte count.
    let many = DescList::strided(MemKind::Dram, Desc::new(base, 512, 0), 0, 1 << 60);
    let e = a
        .create_request(Op::Write, &many, "a", &many, &opts)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let _ = rec;
    let _ = a.shutdown().await;
}
