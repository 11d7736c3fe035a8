//! End-to-end confirmation of transfers (`UcclOptions::confirm`).
//!
//! UCCL 0.1.1 reports a failed operation as done (a queue pair flushed in error
//! completes, and its status says only "done or not"), so a transfer the engine calls
//! done may have moved nothing. Before such a transfer resolves `Ok` (and before its
//! notification goes), the initiator asks the target over the control connection for
//! a digest of the target's side of it (`Verify`), digests its own side meanwhile,
//! and fails the transfer when they differ. Both digests run over the transfer's
//! bytes in posting order. This holds under the transfer contract that neither
//! side's memory changes until the transfer resolves: a target that consumes or
//! rewrites a WRITE's destination before then (or a READ's source that keeps
//! changing) fails confirmation, and a destination that already held the same
//! bytes hides a lost operation, harmlessly. Overlapping destinations within one
//! transfer are the caller's error and may fail it too.
//!
//! The digest is CRC-32 (IEEE, `crc32fast`, vectorised where the CPU allows) with the
//! byte count: it catches lost or partial operations (the
//! destination keeps stale bytes), not an adversary, who could forge either side's
//! answer anyway. Its cost is one read of the data on each side (for GPU memory a
//! copy to the host first) and one control round trip per transfer.
//!
//! Each range asked for names its registration's confirmation key, a random 64-bit
//! value published only in the registration's metadata (beside the engine's remote
//! key): the target digests only ranges inside the registration holding that key, so
//! `Verify` reads nothing for a client that could not also reach the memory by RDMA
//! (without the agent's secret the control port is open to anyone who reaches it).

use nixl::{RegionSlice, Result};

use crate::wire::MAX_VERIFY_RANGES;

/// Bytes read at a time.
const CHUNK: usize = 1 << 20;

/// One `Verify` request's share of a transfer: its local slices and the target
/// ranges (address, length, registration's confirmation key) they correspond to, in
/// order.
#[derive(Debug)]
pub(crate) struct Group<L> {
    pub(crate) local: Vec<L>,
    pub(crate) remote: Vec<(u64, u64, u64)>,
}

/// A transfer's pieces (local slice, (target registration's confirmation key, target
/// address), length) in requests of at most [`MAX_VERIFY_RANGES`] target ranges, adjacent
/// target ranges of one registration merged (the digest runs over the bytes in order
/// either way; the target digests each range inside one registration). Empty pieces
/// are left out.
pub(crate) fn groups<L: Clone>(
    pieces: impl IntoIterator<Item = (L, (u64, u64), u64)>,
) -> Vec<Group<L>> {
    let mut out: Vec<Group<L>> = Vec::new();
    let mut last_region = None;
    for (local, (region, remote), len) in pieces {
        if len == 0 {
            continue;
        }
        let adjacent = last_region == Some(region)
            && out
                .last()
                .and_then(|g| g.remote.last())
                .is_some_and(|last| last.0.checked_add(last.1) == Some(remote));
        last_region = Some(region);
        if !adjacent
            && out
                .last()
                .is_none_or(|g| g.remote.len() >= MAX_VERIFY_RANGES)
        {
            out.push(Group {
                local: Vec::new(),
                remote: Vec::new(),
            });
        }
        let g = out.last_mut().expect("a group");
        match g.remote.last_mut() {
            Some(last) if adjacent => last.1 += len,
            _ => g.remote.push((remote, len, region)),
        }
        g.local.push(local);
    }
    out
}

/// A running digest.
#[derive(Default)]
pub(crate) struct Digest {
    crc: crc32fast::Hasher,
    len: u64,
}

impl Digest {
    pub(crate) fn update(&mut self, b: &[u8]) {
        self.crc.update(b);
        self.len += b.len() as u64;
    }

    pub(crate) fn finish(self) -> u64 {
        (u64::from(self.crc.finalize()) << 32) ^ (self.len & 0xffff_ffff) ^ (self.len >> 32)
    }
}

/// The digest of `slices`' bytes in order, read through the registrations (so that a
/// deregistration meanwhile is seen, and GPU memory is copied to the host first).
///
/// # Errors
/// The first read's error (a registration gone, a device copy that failed).
pub(crate) fn digest(slices: &[RegionSlice]) -> Result<u64> {
    let mut d = Digest::default();
    let mut buf = vec![0u8; CHUNK.min(slices.iter().map(RegionSlice::len).sum())];
    for s in slices {
        let mut at = 0;
        while at < s.len() {
            let n = (s.len() - at).min(buf.len());
            s.read_into(at, &mut buf[..n])?;
            d.update(&buf[..n]);
            at += n;
        }
    }
    Ok(d.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of(chunks: &[&[u8]]) -> u64 {
        let mut d = Digest::default();
        for c in chunks {
            d.update(c);
        }
        d.finish()
    }

    #[test]
    fn the_digest_sees_bytes_not_chunking() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let whole = digest_of(&[&data]);
        assert_eq!(
            whole,
            digest_of(&[&data[..1], &data[1..4097], &data[4097..]])
        );
        // One flipped bit, a missing tail, stale zeros in place of a piece.
        let mut flipped = data.clone();
        flipped[5000] ^= 1;
        assert_ne!(whole, digest_of(&[&flipped]));
        assert_ne!(whole, digest_of(&[&data[..9999]]));
        let mut stale = data.clone();
        stale[4096..8192].fill(0);
        assert_ne!(whole, digest_of(&[&stale]));
        // Zero bytes of different counts differ.
        assert_ne!(digest_of(&[&[0; 4]]), digest_of(&[&[0; 8]]));
    }

    #[test]
    fn groups_merge_adjacent_target_ranges_and_split_at_the_limit() {
        // Adjacent remotes of one registration merge (whatever the local side), gaps
        // do not, nor do ranges that meet across two registrations.
        let g = groups([
            ("a", (1, 100), 10),
            ("b", (1, 110), 5),
            ("c", (1, 200), 1),
            ("d", (1, 300), 0),
            ("e", (2, 201), 4),
        ]);
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].remote, vec![(100, 15, 1), (200, 1, 1), (201, 4, 2)]);
        assert_eq!(g[0].local, vec!["a", "b", "c", "e"]);
        // Scattered ranges split into requests of at most the frame's limit.
        let many = (0..MAX_VERIFY_RANGES as u64 + 3).map(|i| (i, (1, 1000 + 2 * i), 1));
        let g = groups(many);
        assert_eq!(
            g.iter().map(|g| g.remote.len()).collect::<Vec<_>>(),
            vec![MAX_VERIFY_RANGES, 3]
        );
        assert_eq!(g[1].local, vec![4096, 4097, 4098]);
        // A merged range that reaches the limit still merges.
        let g = groups((0..MAX_VERIFY_RANGES as u64 * 2).map(|i| (i, (1, 10 * i), 10)));
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].remote, vec![(0, 10 * MAX_VERIFY_RANGES as u64 * 2, 1)]);
    }
}
