//! Turning checked runs of descriptor pairs into backend segments, merging neighbours.

use std::sync::Arc;

use bytes::Bytes;

use crate::backend::{SegmentRun, Segments, TargetRegion};
use crate::region::{RegionInner, RegionRef, RemoteRegion};

/// The registrations a prepared list touches; runs refer to them by position.
#[derive(Debug)]
pub(super) enum RegionTable {
    Local(Vec<Arc<RegionInner>>),
    Remote(Vec<Arc<RemoteRegion>>),
}

impl RegionTable {
    pub(super) fn len(&self) -> usize {
        match self {
            Self::Local(v) => v.len(),
            Self::Remote(v) => v.len(),
        }
    }
}

/// The single pair `i` of `p`, `len` bytes long.
fn single(p: &SegmentRun, i: usize, len: u64) -> SegmentRun {
    SegmentRun {
        local_offset: p.local_at(i),
        target_offset: p.target_at(i),
        local_stride: 0,
        target_stride: 0,
        len,
        count: 1,
        ..*p
    }
}

/// Collects pair runs in order. With `merge`, joins pairs that continue each other
/// in the same registrations on both sides, exactly as joining them one pair at a
/// time would: a run contiguous on both sides becomes one pair, and a pair that
/// continues the previous run's last pair extends it. Without, keeps the runs as
/// they come.
#[derive(Debug)]
pub(super) struct Merger {
    pub(super) out: Vec<SegmentRun>,
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

    pub(super) fn push(&mut self, mut p: SegmentRun) {
        let out = &mut self.out;
        if !self.merge {
            out.push(p);
            return;
        }
        if p.count > 1 && p.local_stride == p.len && p.target_stride == p.len {
            // Contiguous on both sides: within one registration, so the product
            // fits.
            p = single(&p, 0, p.len * p.count as u64);
        }
        if let Some(last) = out.last_mut() {
            let end = last.count - 1;
            if last.local == p.local
                && last.target == p.target
                && last.local_at(end) + last.len == p.local_offset
                && last.target_at(end) + last.len == p.target_offset
            {
                let joined = single(last, end, last.len + p.len);
                if last.count == 1 {
                    *last = joined;
                } else {
                    last.count -= 1;
                    out.push(joined);
                }
                if p.count == 1 {
                    return;
                }
                // The rest of `p` cannot continue the joined pair: `p` is not
                // contiguous on both sides.
                p = SegmentRun {
                    local_offset: p.local_at(1),
                    target_offset: p.target_at(1),
                    count: p.count - 1,
                    ..p
                };
            }
        }
        out.push(p);
    }
}

/// [`Merger`] over a list of runs.
#[cfg(test)]
fn merge_runs(pairs: &[SegmentRun], merge: bool) -> Vec<SegmentRun> {
    let mut m = Merger::new(merge, 0);
    for p in pairs {
        m.push(*p);
    }
    m.out
}

/// The two registration tables the runs refer to, and which entries they use.
pub(super) struct Sides<'a> {
    pub(super) local: &'a RegionTable,
    pub(super) remote: &'a RegionTable,
    pub(super) used_local: &'a [bool],
    pub(super) used_remote: &'a [bool],
}

/// Positions of the used entries in a table of only those (`u32::MAX`: unused).
fn renumber(used: &[bool]) -> Vec<u32> {
    let mut next = 0;
    used.iter()
        .map(|&u| {
            if u {
                next += 1;
                next - 1
            } else {
                u32::MAX
            }
        })
        .collect()
}

/// Segments for `backend` (the blob of a remote target is that backend's): the runs,
/// renumbered onto tables of the registrations they use.
pub(super) fn build_segments(
    mut runs: Vec<SegmentRun>,
    sides: &Sides<'_>,
    backend: &str,
) -> Segments {
    let RegionTable::Local(locals) = sides.local else {
        unreachable!("the local side is always local")
    };
    let (lmap, rmap) = (renumber(sides.used_local), renumber(sides.used_remote));
    for r in &mut runs {
        r.local = lmap[r.local as usize];
        r.target = rmap[r.target as usize];
    }
    let locals = locals
        .iter()
        .zip(sides.used_local)
        .filter(|(_, u)| **u)
        .map(|(r, _)| RegionRef { inner: r.clone() })
        .collect();
    let targets = match sides.remote {
        RegionTable::Local(v) => v
            .iter()
            .zip(sides.used_remote)
            .filter(|(_, u)| **u)
            .map(|(r, _)| TargetRegion::Local(RegionRef { inner: r.clone() }))
            .collect(),
        RegionTable::Remote(v) => v
            .iter()
            .zip(sides.used_remote)
            .filter(|(_, u)| **u)
            .map(|(r, _)| TargetRegion::Remote {
                region: r.id,
                addr: r.addr,
                len: r.len,
                blob: r.blob(backend).cloned().unwrap_or_else(Bytes::new),
            })
            .collect(),
    };
    Segments::checked(locals, targets, runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One pair of blocks: (local region, local offset, target region, target
    /// offset, length).
    type Block = (u32, u64, u32, u64, u64);

    fn blocks(runs: &[SegmentRun]) -> Vec<Block> {
        runs.iter()
            .flat_map(|p| {
                (0..p.count).map(move |i| (p.local, p.local_at(i), p.target, p.target_at(i), p.len))
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
    ) -> SegmentRun {
        SegmentRun {
            local: region.0,
            target: region.1,
            local_offset: offsets.0,
            target_offset: offsets.1,
            local_stride: strides.0,
            target_stride: strides.1,
            len,
            count,
        }
    }

    #[test]
    fn unused_registrations_are_left_out_and_indices_follow() {
        assert_eq!(
            renumber(&[false, true, false, true]),
            vec![u32::MAX, 0, u32::MAX, 1]
        );
        assert_eq!(renumber(&[]), Vec::<u32>::new());
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

    fn arb_run() -> impl Strategy<Value = SegmentRun> {
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
