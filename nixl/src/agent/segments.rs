//! Turning checked runs of descriptor pairs into backend segments, merging neighbours.

use std::sync::Arc;

use bytes::Bytes;

use super::request::{PrepRun, RegionTable};
use crate::backend::{SegmentRun, Segments, Target};
use crate::region::{RegionInner, RegionRef, RegionSlice};

/// `l.count` pairs of blocks: local blocks `l`, target blocks `r` (same count, same
/// length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PairRun {
    pub(super) l: PrepRun,
    pub(super) r: PrepRun,
}

impl PairRun {
    /// Offsets of block `i` on both sides.
    fn at(&self, i: usize) -> (u64, u64) {
        (
            self.l.offset + i as u64 * self.l.stride,
            self.r.offset + i as u64 * self.r.stride,
        )
    }

    /// The single pair `i`, `len` bytes long.
    fn single(&self, i: usize, len: u64) -> Self {
        let (lo, ro) = self.at(i);
        let one = |p: PrepRun, offset| PrepRun {
            offset,
            len,
            count: 1,
            stride: 0,
            ..p
        };
        Self {
            l: one(self.l, lo),
            r: one(self.r, ro),
        }
    }
}

/// Collects pair runs in order. With `merge`, joins pairs that continue each other
/// in the same registrations on both sides, exactly as joining them one pair at a
/// time would: a run contiguous on both sides becomes one pair, and a pair that
/// continues the previous run's last pair extends it. Without, keeps the runs as
/// they come.
#[derive(Debug)]
pub(super) struct Merger {
    pub(super) out: Vec<PairRun>,
    merge: bool,
}

impl Merger {
    /// `capacity`: the runs expected (an upper bound saves regrowing a vector of
    /// millions).
    pub(super) fn new(merge: bool, capacity: usize) -> Self {
        Self {
            out: Vec::with_capacity(capacity),
            merge,
        }
    }

    pub(super) fn push(&mut self, mut p: PairRun) {
        let out = &mut self.out;
        if !self.merge {
            out.push(p);
            return;
        }
        if p.l.count > 1 && p.l.stride == p.l.len && p.r.stride == p.r.len {
            // Contiguous on both sides: within one registration, so the product
            // fits.
            p = p.single(0, p.l.len * p.l.count as u64);
        }
        if let Some(last) = out.last_mut() {
            let (lo, ro) = last.at(last.l.count - 1);
            if last.l.region == p.l.region
                && last.r.region == p.r.region
                && lo + last.l.len == p.l.offset
                && ro + last.r.len == p.r.offset
            {
                let joined = last.single(last.l.count - 1, last.l.len + p.l.len);
                if last.l.count == 1 {
                    *last = joined;
                } else {
                    last.l.count -= 1;
                    last.r.count -= 1;
                    out.push(joined);
                }
                if p.l.count == 1 {
                    return;
                }
                // The rest of `p` cannot continue the joined pair: `p` is not
                // contiguous on both sides.
                p = PairRun {
                    l: PrepRun {
                        offset: p.l.offset + p.l.stride,
                        count: p.l.count - 1,
                        ..p.l
                    },
                    r: PrepRun {
                        offset: p.r.offset + p.r.stride,
                        count: p.r.count - 1,
                        ..p.r
                    },
                };
            }
        }
        out.push(p);
    }
}

/// [`Merger`] over a list of runs.
#[cfg(test)]
fn merge_runs(pairs: &[PairRun], merge: bool) -> Vec<PairRun> {
    let mut m = Merger::new(merge, 0);
    for p in pairs {
        m.push(*p);
    }
    m.out
}

/// The two registration tables the pairs refer to.
pub(super) struct Sides<'a> {
    pub(super) local: &'a RegionTable,
    pub(super) remote: &'a RegionTable,
}

fn slice(region: &Arc<RegionInner>, offset: u64, len: u64) -> RegionSlice {
    RegionRef {
        inner: region.clone(),
    }
    .slice(offset as usize, len as usize)
    .expect("descriptors were checked against the region")
}

/// Segment runs for `backend` (the blob of a remote target is that backend's).
pub(super) fn build_segments(pairs: &[PairRun], sides: &Sides<'_>, backend: &str) -> Segments {
    let RegionTable::Local(locals) = sides.local else {
        unreachable!("the local side is always local")
    };
    // Each remote registration's blob for this backend, looked up once.
    let blobs: Vec<Bytes> = match sides.remote {
        RegionTable::Local(_) => Vec::new(),
        RegionTable::Remote(v) => v
            .iter()
            .map(|r| r.blob(backend).cloned().unwrap_or_default())
            .collect(),
    };
    Segments::from_runs(pairs.iter().map(|p| {
        let target = match sides.remote {
            RegionTable::Local(v) => {
                Target::Local(slice(&v[p.r.region as usize], p.r.offset, p.r.len))
            }
            RegionTable::Remote(v) => {
                let region = &v[p.r.region as usize];
                Target::Remote {
                    addr: region.addr + p.r.offset,
                    len: p.r.len,
                    region: region.id,
                    blob: blobs[p.r.region as usize].clone(),
                }
            }
        };
        SegmentRun {
            local: slice(&locals[p.l.region as usize], p.l.offset, p.l.len),
            local_stride: p.l.stride as usize,
            target,
            target_stride: p.r.stride,
            count: p.l.count,
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One pair of blocks: (local region, local offset, target region, target
    /// offset, length).
    type Block = (u32, u64, u32, u64, u64);

    fn blocks(runs: &[PairRun]) -> Vec<Block> {
        runs.iter()
            .flat_map(|p| {
                (0..p.l.count).map(move |i| {
                    let (lo, ro) = p.at(i);
                    (p.l.region, lo, p.r.region, ro, p.l.len)
                })
            })
            .collect()
    }

    /// The reference: join one pair at a time into the previous one when it continues
    /// it on both sides.
    fn greedy(pairs: &[Block]) -> Vec<Block> {
        let mut out: Vec<Block> = Vec::new();
        for &(a, lo, b, ro, len) in pairs {
            if let Some(last) = out.last_mut() {
                if last.0 == a && last.1 + last.4 == lo && last.2 == b && last.3 + last.4 == ro {
                    last.4 += len;
                    continue;
                }
            }
            out.push((a, lo, b, ro, len));
        }
        out
    }

    fn run(
        region: (u32, u32),
        offsets: (u64, u64),
        len: u64,
        strides: (u64, u64),
        count: usize,
    ) -> PairRun {
        let side = |region, offset, stride| PrepRun {
            region,
            offset,
            len,
            stride,
            count,
        };
        PairRun {
            l: side(region.0, offsets.0, strides.0),
            r: side(region.1, offsets.1, strides.1),
        }
    }

    #[test]
    fn contiguous_runs_merge_and_strided_ones_stay() {
        let runs = [
            // Contiguous on both sides: one pair.
            run((0, 0), (0, 0), 64, (64, 64), 10),
            // Continues it, then strides on the target side only.
            run((0, 0), (640, 640), 64, (64, 128), 5),
            // Another target region: never joins.
            run((0, 1), (960, 0), 64, (64, 64), 2),
        ];
        let merged = merge_runs(&runs, true);
        assert_eq!(
            blocks(&merged),
            vec![
                (0, 0, 0, 0, 704),
                (0, 704, 0, 768, 64),
                (0, 768, 0, 896, 64),
                (0, 832, 0, 1024, 64),
                (0, 896, 0, 1152, 64),
                (0, 960, 1, 0, 128),
            ]
        );
        assert_eq!(merged.len(), 3, "runs stay runs: {merged:?}");
        assert_eq!(merge_runs(&runs, false), runs.to_vec());
    }

    fn arb_run() -> impl Strategy<Value = PairRun> {
        (
            (0u32..2, 0u32..2),
            (0u64..8, 0u64..8),
            1u64..4,
            (0u64..6, 0u64..6),
            1usize..6,
        )
            .prop_map(|(r, (lo, ro), len, (ls, rs), count)| {
                // Offsets and strides in units of the length make joins likely.
                run(r, (lo * len, ro * len), len, (ls * len, rs * len), count)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        /// Merging runs gives exactly what merging their pairs one by one gives, and
        /// without merging every pair stays.
        #[test]
        fn merging_runs_matches_merging_pairs(runs in prop::collection::vec(arb_run(), 1..8)) {
            let merged = merge_runs(&runs, true);
            prop_assert_eq!(greedy(&blocks(&merged)), blocks(&merged));
            prop_assert_eq!(blocks(&merged), greedy(&blocks(&runs)));
            prop_assert!(merged.len() <= runs.len() * 2);
            prop_assert_eq!(blocks(&merge_runs(&runs, false)), blocks(&runs));
        }
    }
}
