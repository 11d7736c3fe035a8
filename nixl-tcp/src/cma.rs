//! How one transfer's cross-memory-attach copies are cut into system calls and, when
//! large, shared between threads (plain arithmetic; the calls are in `shm`).
//!
//! The kernel takes at most [`crate::shm::IOV_MAX`] ranges a call and moves at most
//! `MAX_RW_COUNT` bytes (2 GiB - 4 KiB) a call, returning a short count beyond: a copy
//! of 2 GiB or more must be several calls. Pieces adjacent on both sides are joined
//! into one range, so unmerged descriptors cost no more ranges than merged ones.

use std::ops::Range;

/// One contiguous copy: `len` bytes at `offset` of local registration `local` (an index
/// into the transfer's local registrations) and at `remote` in the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) local: u32,
    pub(crate) offset: usize,
    pub(crate) remote: u64,
    pub(crate) len: usize,
}

impl Piece {
    /// Bytes `from..to` of this piece (`from < to <= len`).
    fn part(&self, from: usize, to: usize) -> Self {
        Self {
            local: self.local,
            offset: self.offset + from,
            remote: self.remote + from as u64,
            len: to - from,
        }
    }
}

/// Most ranges and bytes one system call is given.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallLimits {
    pub(crate) ranges: usize,
    pub(crate) bytes: usize,
}

/// When and how far a transfer's copies are shared between threads
/// ([`crate::TcpOptions::copy_threads`], [`crate::TcpOptions::split_copy_min`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Split {
    pub(crate) threads: usize,
    pub(crate) min: u64,
}

impl Split {
    /// Threads for `bytes`: 1 below `min`, else as many as give each at least `min / 2`
    /// bytes, at most `threads`.
    pub(crate) fn threads_for(&self, bytes: u64) -> usize {
        if self.threads <= 1 || bytes < self.min.max(2) {
            return 1;
        }
        let each = (self.min / 2).max(1);
        (bytes / each).clamp(1, self.threads as u64) as usize
    }
}

/// The cross-memory-attach copies of one transfer, in order.
#[derive(Debug, Default)]
pub(crate) struct Copies {
    pieces: Vec<Piece>,
    /// Bytes before each piece (same length as `pieces`), for cutting by byte ranges.
    starts: Vec<u64>,
    bytes: u64,
}

impl Copies {
    /// Add a copy after the others; joined to the previous one when it continues it
    /// on both sides.
    pub(crate) fn push(&mut self, p: Piece) {
        if p.len == 0 {
            return;
        }
        match self.pieces.last_mut() {
            Some(last)
                if last.local == p.local
                    && last.offset + last.len == p.offset
                    && last.remote + last.len as u64 == p.remote =>
            {
                last.len += p.len;
            }
            _ => {
                self.pieces.push(p);
                self.starts.push(self.bytes);
            }
        }
        self.bytes += p.len as u64;
    }

    /// Total bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// `n` consecutive byte ranges covering everything, of about equal size, cut at
    /// multiples of `align` (fewer when there are not enough bytes for `n`).
    pub(crate) fn split(&self, n: usize, align: u64) -> Vec<Range<u64>> {
        let n = n.max(1) as u64;
        let align = align.max(1);
        let mut out = Vec::with_capacity(n as usize);
        let mut lo = 0;
        for i in 1..=n {
            let hi = if i == n {
                self.bytes
            } else {
                (self.bytes / n * i) / align * align
            };
            if hi > lo {
                out.push(lo..hi);
                lo = hi;
            }
        }
        out
    }

    /// The bytes `range` of the copies as system calls within `limits`: `call` gets
    /// each call's pieces, in order; the first error ends it.
    pub(crate) fn each_call<E>(
        &self,
        range: Range<u64>,
        limits: CallLimits,
        mut call: impl FnMut(&[Piece]) -> Result<(), E>,
    ) -> Result<(), E> {
        let (max_ranges, max_bytes) = (limits.ranges.max(1), limits.bytes.max(1));
        let end = range.end.min(self.bytes);
        let mut at = range.start;
        // The piece holding byte `at`.
        let mut i = self.starts.partition_point(|&s| s <= at).saturating_sub(1);
        let mut batch: Vec<Piece> = Vec::with_capacity(max_ranges.min(self.pieces.len()));
        let mut batch_bytes = 0usize;
        while at < end {
            let p = &self.pieces[i];
            let from = (at - self.starts[i]) as usize;
            let to = p.len.min((end - self.starts[i]) as usize);
            let n = (to - from).min(max_bytes - batch_bytes);
            batch.push(p.part(from, from + n));
            batch_bytes += n;
            at += n as u64;
            if from + n == p.len {
                i += 1;
            }
            if batch.len() == max_ranges || batch_bytes == max_bytes || at == end {
                call(&batch)?;
                batch.clear();
                batch_bytes = 0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn piece(local: u32, offset: usize, remote: u64, len: usize) -> Piece {
        Piece {
            local,
            offset,
            remote,
            len,
        }
    }

    /// The pieces of each call `c.each_call` makes over `range` within `limits`.
    fn calls(c: &Copies, range: std::ops::Range<u64>, limits: CallLimits) -> Vec<Vec<Piece>> {
        let mut calls = Vec::new();
        c.each_call::<()>(range, limits, |b| {
            calls.push(b.to_vec());
            Ok(())
        })
        .unwrap();
        calls
    }

    /// Every call's pieces, flattened into (local, offset, remote) per byte.
    fn bytes_of(calls: &[Vec<Piece>]) -> Vec<(u32, usize, u64)> {
        calls
            .iter()
            .flatten()
            .flat_map(|p| (0..p.len).map(move |k| (p.local, p.offset + k, p.remote + k as u64)))
            .collect()
    }

    #[test]
    fn adjacent_pieces_join_and_others_do_not() {
        let mut c = Copies::default();
        c.push(piece(0, 0, 100, 4));
        c.push(piece(0, 4, 104, 4)); // continues both sides
        c.push(piece(0, 8, 200, 4)); // remote jumps
        c.push(piece(1, 12, 204, 4)); // another registration
        c.push(piece(1, 16, 208, 0)); // empty: ignored
        assert_eq!(c.bytes(), 16);
        assert_eq!(
            calls(
                &c,
                0..16,
                CallLimits {
                    ranges: 8,
                    bytes: 64,
                },
            ),
            vec![vec![
                piece(0, 0, 100, 8),
                piece(0, 8, 200, 4),
                piece(1, 12, 204, 4)
            ]]
        );
    }

    /// A copy larger than a call may move is cut into calls of at most that many bytes
    /// (the kernel's 2 GiB - 4 KiB per call, scaled down).
    #[test]
    fn a_large_copy_becomes_several_calls() {
        let mut c = Copies::default();
        c.push(piece(0, 0, 1 << 20, 10_000));
        assert_eq!(
            calls(
                &c,
                0..10_000,
                CallLimits {
                    ranges: 4,
                    bytes: 4096,
                },
            ),
            vec![
                vec![piece(0, 0, 1 << 20, 4096)],
                vec![piece(0, 4096, (1 << 20) + 4096, 4096)],
                vec![piece(0, 8192, (1 << 20) + 8192, 1808)],
            ]
        );
    }

    #[test]
    fn only_large_copies_are_split_and_each_thread_gets_half_the_minimum() {
        let s = Split {
            threads: 4,
            min: 16 << 20,
        };
        assert_eq!(s.threads_for(0), 1);
        assert_eq!(s.threads_for((16 << 20) - 1), 1);
        assert_eq!(s.threads_for(16 << 20), 2);
        assert_eq!(s.threads_for(24 << 20), 3);
        assert_eq!(s.threads_for(1 << 30), 4);
        let off = Split { threads: 1, ..s };
        assert_eq!(off.threads_for(1 << 30), 1);
    }

    #[test]
    fn an_error_ends_the_calls() {
        let mut c = Copies::default();
        for k in 0..10 {
            c.push(piece(0, k * 8, k as u64 * 16, 4));
        }
        let mut n = 0;
        let r = c.each_call(
            0..40,
            CallLimits {
                ranges: 2,
                bytes: 1 << 20,
            },
            |_| {
                n += 1;
                if n == 2 {
                    Err("refused")
                } else {
                    Ok(())
                }
            },
        );
        assert_eq!((r, n), (Err("refused"), 2));
    }

    proptest! {
        /// Whatever the pieces, limits and split: the calls of all parts together move
        /// each byte exactly once, in order, and no call exceeds the limits.
        #[test]
        fn calls_cover_every_byte_once_within_the_limits(
            lens in prop::collection::vec((1usize..5000, 0u64..3, 0u32..2), 1..40),
            ranges in 1usize..6,
            bytes in 1usize..9000,
            parts in 1usize..5,
            align in prop::sample::select(vec![1u64, 7, 4096]),
        ) {
            let mut c = Copies::default();
            let (mut off, mut remote) = (0usize, 1u64 << 30);
            for &(len, gap, local) in &lens {
                remote += gap * 4096;
                c.push(piece(local, off, remote, len));
                off += len;
                remote += len as u64;
            }
            let total: usize = lens.iter().map(|l| l.0).sum();
            prop_assert_eq!(c.bytes(), total as u64);
            let expect = calls(&c, 0..c.bytes(), CallLimits { ranges: usize::MAX, bytes: usize::MAX });
            let split = c.split(parts, align);
            prop_assert!(split.len() <= parts);
            prop_assert_eq!(split.first().map_or(0, |r| r.start), 0);
            prop_assert_eq!(split.last().map_or(0, |r| r.end), c.bytes());
            let cut: Vec<Vec<Piece>> = split
                .into_iter()
                .flat_map(|r| calls(&c, r, CallLimits { ranges, bytes }))
                .collect();
            for call in &cut {
                prop_assert!(!call.is_empty() && call.len() <= ranges);
                prop_assert!(call.iter().map(|p| p.len).sum::<usize>() <= bytes);
            }
            prop_assert_eq!(bytes_of(&cut), bytes_of(&expect));
        }
    }
}
