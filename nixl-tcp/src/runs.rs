//! Runs of regularly spaced blocks: a prepared transfer keeps the agent's
//! [`Segments`] as they are and the target keeps the runs it checked, so a strided
//! request is kept, and sent as a table, in O(runs); blocks are made one at a time
//! while data moves.

use nixl::{RegionSlice, Segments};

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
