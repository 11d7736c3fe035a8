//! Runs of regularly spaced blocks: a prepared transfer keeps the agent's
//! [`Segments`] as they are and the target keeps the runs it checked, so a strided
//! request is kept, and sent as a table, in O(runs); blocks are made one at a time
//! while data moves.

use nixl::{RegionSlice, SegmentRun, Segments};

/// Every local block of `segs`, in order.
pub(crate) fn local_blocks(segs: &Segments) -> impl Iterator<Item = RegionSlice> + '_ {
    segs.runs().iter().flat_map(move |r| {
        let region = &segs.locals()[r.local as usize];
        (0..r.count).map(move |i| {
            region
                .slice(r.local_at(i) as usize, r.len as usize)
                .expect("the agent checked every segment")
        })
    })
}

/// `count` blocks shaped like `first`, each `stride` bytes after the previous, in
/// the same registration (a run the target checked).
#[derive(Clone, Debug)]
pub(crate) struct LocalRun {
    pub(crate) first: RegionSlice,
    pub(crate) stride: usize,
    pub(crate) count: usize,
}

impl LocalRun {
    /// Block `i` (`i < count`).
    pub(crate) fn block(&self, i: usize) -> RegionSlice {
        self.first
            .region()
            .slice(self.first.offset() + i * self.stride, self.first.len())
            .expect("the agent checked every block of the run")
    }

    /// Every block, in order.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = RegionSlice> + '_ {
        (0..self.count).map(|i| self.block(i))
    }
}

/// Every block of `runs`, in order.
pub(crate) fn blocks(runs: &[LocalRun]) -> impl Iterator<Item = RegionSlice> + '_ {
    runs.iter().flat_map(LocalRun::blocks)
}

/// Bytes `from..from + len` of `runs` (counted over their blocks, in order) as runs,
/// into `out`: the piece of a request a connection moves when a transfer is split
/// across several. `from + len` is at most the runs' bytes (the caller checked).
pub(crate) fn range(runs: &[LocalRun], from: u64, len: u64, out: &mut Vec<LocalRun>) {
    let end = from + len;
    let mut pos = 0u64;
    for run in runs {
        if pos >= end {
            break;
        }
        let block = run.first.len() as u64;
        let bytes = block * run.count as u64;
        if pos + bytes > from {
            // The run as plain data (its local side only), cut, and back.
            let shape = SegmentRun {
                local: 0,
                target: 0,
                local_offset: run.first.offset() as u64,
                target_offset: 0,
                local_stride: run.stride as u64,
                target_stride: 0,
                len: block,
                count: run.count,
            };
            let lo = from.saturating_sub(pos);
            let hi = (end - pos).min(bytes);
            out.extend(shape.cut(lo, hi).map(|r| {
                LocalRun {
                    first: run
                        .first
                        .region()
                        .slice(r.local_offset as usize, r.len as usize)
                        .expect("a cut of a checked run lies inside it"),
                    stride: run.stride,
                    count: r.count,
                }
            }));
        }
        pos += bytes;
    }
}
