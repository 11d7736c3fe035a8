//! The local side of a prepared transfer as runs of regularly spaced blocks, as the
//! agent hands them over ([`nixl::SegmentRun`]): a strided request is kept, and sent
//! as a table, in O(runs); blocks are made one at a time while data moves.

use nixl::RegionSlice;

/// `count` blocks shaped like `first`, each `stride` bytes after the previous, in
/// the same registration.
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
