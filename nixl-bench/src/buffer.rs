//! The registered buffers: where each request's descriptors lie, and the byte pattern
//! the consistency check writes and verifies.
//!
//! Each side registers one buffer and uses a page-aligned window of it. Both sides lay
//! descriptors out identically in their windows (offset `o` locally pairs with offset
//! `o` at the peer), so a pattern written at the source can be checked at the same
//! offsets at the destination. The pattern depends on the seed and on each byte's
//! offset, so misplaced, stale or missing data is caught, not just wrong bytes.

use nixl::{Agent, Desc, Registration, RemoteRegionInfo};
use serde::{Deserialize, Serialize};

use crate::cli::{MemSource, SegType};
use crate::error::{fail, BenchError, Context, Result};

const PAGE: u64 = nixl::PAGE_SIZE as u64;

/// Bytes from `addr` to the next page boundary.
fn to_page(addr: u64) -> u64 {
    (PAGE - addr % PAGE) % PAGE
}

/// A page-aligned window of `len` bytes in a registration of this agent.
///
/// Host memory is an [`nixl::AlignedBuf`] (one page longer than the window), which the
/// OS maps lazily: only the bytes a sweep touches take up memory, even with
/// nixlbench's 8 GiB buffers. It asks for transparent huge pages unless told not to.
#[derive(Clone, Debug)]
pub(crate) struct Buffer {
    reg: Registration,
    base: u64,
    len: u64,
}

impl Buffer {
    /// Register a window of `len` bytes with `agent`: host memory from `source`, or
    /// GPU memory on `device` (zeroed here, as host buffers are).
    ///
    /// # Errors
    /// The size does not fit this machine, allocation or registration fails (no GPU
    /// for VRAM).
    pub(crate) fn register(
        agent: &Agent,
        len: u64,
        source: MemSource,
        huge_pages: bool,
        seg: SegType,
        device: u32,
    ) -> Result<Self> {
        let bytes = len
            .checked_add(PAGE)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| BenchError::new(format!("a {len}-byte buffer does not fit")))?;
        let memory = match (seg, source) {
            (SegType::Vram, _) => nixl::Memory::vram(device, bytes).with_context(|| {
                format!("allocate {bytes} bytes of GPU memory on device {device}")
            })?,
            (SegType::Dram, MemSource::Host) if huge_pages => {
                nixl::AlignedBuf::with_huge_pages(bytes).into()
            }
            (SegType::Dram, MemSource::Host) => nixl::AlignedBuf::new(bytes).into(),
            (SegType::Dram, MemSource::Backend) => agent
                .alloc(bytes)
                .with_context(|| format!("allocate {bytes} bytes from the backend"))?,
        };
        let vram = seg == SegType::Vram;
        let reg = agent
            .register(memory)
            .with_context(|| format!("register {bytes} bytes"))?;
        if vram {
            // Device memory is not zeroed by its allocator.
            let zero = vec![0u8; bytes.min(64 << 20)];
            let mut at = 0;
            while at < bytes {
                let n = zero.len().min(bytes - at);
                reg.write_at(at, &zero[..n])
                    .context("zero the GPU buffer")?;
                at += n;
            }
        }
        Ok(Self {
            base: to_page(reg.addr()),
            reg,
            len,
        })
    }

    /// The memory kind, for descriptor lists.
    pub(crate) fn kind(&self) -> nixl::MemKind {
        self.reg.kind()
    }

    /// A descriptor for `off..off + len` of the window.
    pub(crate) fn desc(&self, off: u64, len: u64) -> Desc {
        self.reg.desc(self.base + off, len)
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => fail(format!(
                "range {offset}+{len} is outside the {}-byte buffer",
                self.len
            )),
        }
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        self.reg
            .write_at((self.base + offset) as usize, bytes)
            .context("write the check pattern")
    }

    fn read_at(&self, offset: u64, bytes: &mut [u8]) -> Result<()> {
        self.reg
            .read_at((self.base + offset) as usize, bytes)
            .context("read back the check pattern")
    }
}

/// The same window in a peer's registration: it starts at the peer's first page
/// boundary, which both sides compute from the region's address.
#[derive(Clone, Debug)]
pub(crate) struct RemoteBuffer {
    region: RemoteRegionInfo,
    base: u64,
}

impl RemoteBuffer {
    /// The window of `len` bytes in `region`.
    ///
    /// # Errors
    /// The region is too small for it.
    pub(crate) fn new(region: RemoteRegionInfo, len: u64) -> Result<Self> {
        let base = to_page(region.addr);
        if base.checked_add(len).is_none_or(|end| end > region.len) {
            return fail(format!(
                "the peer's {}-byte region has no room for a {len}-byte page-aligned buffer",
                region.len
            ));
        }
        Ok(Self { region, base })
    }

    /// A descriptor for `off..off + len` of the window.
    pub(crate) fn desc(&self, off: u64, len: u64) -> Desc {
        self.region.desc(self.base + off, len)
    }

    /// The memory kind, for descriptor lists.
    pub(crate) fn kind(&self) -> nixl::MemKind {
        self.region.kind
    }
}

/// Where the descriptors of one sweep point lie in the registered buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) block_size: u64,
    pub(crate) batch_size: usize,
    /// Requests per thread.
    pub(crate) depth: usize,
    pub(crate) threads: usize,
    /// Bytes each thread owns; thread `t` starts at `t * thread_stride`.
    pub(crate) thread_stride: u64,
    /// Distance between the starts of consecutive blocks (`block_size`: consecutive;
    /// more: scattered).
    pub(crate) spacing: u64,
}

impl Layout {
    /// Descriptors per thread.
    pub(crate) fn descs_per_thread(&self) -> usize {
        self.depth * self.batch_size
    }

    /// Offset of descriptor `k` (request `k / batch_size`) of thread `t`. Requests and
    /// threads never overlap: the configuration guarantees
    /// `depth * batch_size * spacing <= thread_stride`.
    pub(crate) fn offset(&self, thread: usize, k: usize) -> u64 {
        debug_assert!(k < self.descs_per_thread());
        thread as u64 * self.thread_stride + k as u64 * self.spacing
    }

    /// The bytes a point touches: one range per thread, or per block when scattered.
    pub(crate) fn ranges(&self) -> Vec<(u64, u64)> {
        let n = self.descs_per_thread();
        if self.spacing == self.block_size {
            let len = n as u64 * self.block_size;
            return (0..self.threads)
                .map(|t| (self.offset(t, 0), len))
                .collect();
        }
        (0..self.threads)
            .flat_map(|t| (0..n).map(move |k| (t, k)))
            .map(|(t, k)| (self.offset(t, k), self.block_size))
            .collect()
    }
}

/// A seeded byte pattern over ranges `(offset, len)` of a registered buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Pattern {
    pub(crate) seed: u64,
    pub(crate) ranges: Vec<(u64, u64)>,
}

/// What [`verify`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct VerifyReport {
    /// Bytes compared.
    pub(crate) checked: u64,
    /// Bytes that differ from the pattern.
    pub(crate) wrong: u64,
    /// Offset of the first wrong byte.
    pub(crate) first_wrong: Option<u64>,
}

impl VerifyReport {
    /// Every byte matched.
    pub(crate) fn is_ok(&self) -> bool {
        self.wrong == 0
    }
}

/// Work in pieces this large, so checking a large buffer needs little extra memory.
const CHUNK: usize = 1 << 20;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The pattern's bytes for offsets `start..start + out.len()`.
pub(crate) fn pattern_bytes(seed: u64, start: u64, out: &mut [u8]) {
    let mut at = start;
    let mut k = 0;
    while k < out.len() {
        let word = splitmix64(seed ^ splitmix64(at / 8)).to_le_bytes();
        let from = (at % 8) as usize;
        let n = (8 - from).min(out.len() - k);
        out[k..k + n].copy_from_slice(&word[from..from + n]);
        k += n;
        at += n as u64;
    }
}

/// Write `pattern` into `buf`. Blocking: run it off the async threads.
///
/// # Errors
/// A range outside the buffer, or memory the host cannot write.
pub(crate) fn fill(buf: &Buffer, pattern: &Pattern) -> Result<()> {
    let mut chunk = vec![0u8; CHUNK];
    for &(offset, len) in &pattern.ranges {
        buf.check(offset, len)?;
        let mut done = 0u64;
        while done < len {
            let n = CHUNK.min((len - done) as usize);
            let at = offset + done;
            pattern_bytes(pattern.seed, at, &mut chunk[..n]);
            buf.write_at(at, &chunk[..n])?;
            done += n as u64;
        }
    }
    Ok(())
}

/// Compare `buf` with `pattern`. Blocking: run it off the async threads.
///
/// # Errors
/// A range outside the buffer, or memory the host cannot read.
pub(crate) fn verify(buf: &Buffer, pattern: &Pattern) -> Result<VerifyReport> {
    let mut want = vec![0u8; CHUNK];
    let mut got = vec![0u8; CHUNK];
    let mut report = VerifyReport::default();
    for &(offset, len) in &pattern.ranges {
        buf.check(offset, len)?;
        let mut done = 0u64;
        while done < len {
            let n = CHUNK.min((len - done) as usize);
            let at = offset + done;
            pattern_bytes(pattern.seed, at, &mut want[..n]);
            buf.read_at(at, &mut got[..n])?;
            if want[..n] != got[..n] {
                for (i, (w, g)) in want[..n].iter().zip(&got[..n]).enumerate() {
                    if w != g {
                        report.wrong += 1;
                        report.first_wrong.get_or_insert(at + i as u64);
                    }
                }
            }
            report.checked += n as u64;
            done += n as u64;
        }
    }
    Ok(report)
}

/// Run [`fill`] or [`verify`] on a blocking thread, off the async workers.
pub(crate) async fn off_thread<T: Send + 'static>(
    buf: &Buffer,
    pattern: Pattern,
    f: fn(&Buffer, &Pattern) -> Result<T>,
) -> Result<T> {
    let buf = buf.clone();
    tokio::task::spawn_blocking(move || f(&buf, &pattern))
        .await
        .map_err(|e| BenchError::new(format!("pattern task failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_keeps_threads_and_requests_apart() {
        let l = Layout {
            block_size: 4096,
            batch_size: 2,
            depth: 3,
            threads: 2,
            thread_stride: 1 << 20,
            spacing: 4096,
        };
        assert_eq!(l.descs_per_thread(), 6);
        assert_eq!(l.offset(0, 0), 0);
        assert_eq!(l.offset(0, 5), 5 * 4096);
        assert_eq!(l.offset(1, 0), 1 << 20);
        assert_eq!(l.ranges(), vec![(0, 6 * 4096), (1 << 20, 6 * 4096)]);
        let s = Layout { spacing: 8192, ..l };
        assert_eq!(s.offset(0, 5), 5 * 8192);
        assert_eq!(s.offset(1, 1), (1 << 20) + 8192);
        let r = s.ranges();
        assert_eq!(r.len(), 12);
        assert_eq!(&r[..2], &[(0, 4096), (8192, 4096)]);
        assert_eq!(r[6], (1 << 20, 4096));
    }

    #[test]
    fn pattern_depends_on_seed_and_offset_and_is_consistent_across_splits() {
        let mut whole = [0u8; 64];
        pattern_bytes(7, 3, &mut whole);
        let mut a = [0u8; 10];
        let mut b = [0u8; 54];
        pattern_bytes(7, 3, &mut a);
        pattern_bytes(7, 13, &mut b);
        assert_eq!(&whole[..10], &a);
        assert_eq!(&whole[10..], &b);
        let mut other = [0u8; 64];
        pattern_bytes(8, 3, &mut other);
        assert_ne!(whole, other);
        let mut shifted = [0u8; 64];
        pattern_bytes(7, 11, &mut shifted);
        assert_ne!(whole, shifted);
    }

    /// Flip every bit of the byte at `at`.
    #[cfg(feature = "tcp")]
    fn corrupt(buf: &Buffer, at: u64) {
        let mut b = [0u8; 1];
        buf.read_at(at, &mut b).unwrap();
        buf.write_at(at, &[!b[0]]).unwrap();
    }

    #[cfg(feature = "tcp")]
    #[tokio::test]
    async fn verify_finds_every_wrong_byte() {
        let agent = nixl::Agent::builder("check")
            .backend(nixl_tcp::TcpBackend::new())
            .build()
            .await
            .unwrap();
        let c = CHUNK as u64;
        let buf = Buffer::register(&agent, 3 * c, MemSource::Host, true, SegType::Dram, 0).unwrap();
        assert_eq!(
            (buf.reg.addr() + buf.base) % PAGE,
            0,
            "window is page-aligned"
        );
        assert_eq!(buf.desc(0, 1).addr % PAGE, 0);
        let p = Pattern {
            seed: 42,
            ranges: vec![(10, c + 5), (2 * c, 100)],
        };
        assert!(!verify(&buf, &p).unwrap().is_ok());
        fill(&buf, &p).unwrap();
        let ok = verify(&buf, &p).unwrap();
        assert!(ok.is_ok());
        assert_eq!(ok.checked, c + 105);
        // Bytes outside the ranges stay untouched.
        let mut b = [1u8; 10];
        buf.read_at(0, &mut b).unwrap();
        assert_eq!(b, [0u8; 10]);
        corrupt(&buf, c + 7);
        corrupt(&buf, 2 * c + 99);
        let bad = verify(&buf, &p).unwrap();
        assert_eq!((bad.wrong, bad.first_wrong), (2, Some(c + 7)));
        let other_seed = Pattern {
            seed: 43,
            ..p.clone()
        };
        assert!(!verify(&buf, &other_seed).unwrap().is_ok());
        let outside = Pattern {
            seed: 1,
            ranges: vec![(3 * c, 1)],
        };
        assert!(fill(&buf, &outside).is_err());
        let _ = agent.shutdown().await;
    }

    #[test]
    fn remote_window_starts_on_the_peer_page_boundary() {
        let region = RemoteRegionInfo {
            id: 1,
            kind: nixl::MemKind::Dram,
            addr: 0x7f00_0000_0010,
            len: 3 * PAGE,
        };
        let w = RemoteBuffer::new(region.clone(), 2 * PAGE).unwrap();
        assert_eq!(w.desc(0, 8).addr, 0x7f00_0000_1000);
        assert!(RemoteBuffer::new(region, 3 * PAGE).is_err());
        assert_eq!(to_page(0x1000), 0);
        assert_eq!(to_page(0x1001), PAGE - 1);
    }
}
