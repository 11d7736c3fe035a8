//! Page-aligned, zero-initialised host buffers: the floor under registered memory
//! (`memory`), GPU staging and the host stand-in for device memory (`gpu`).
#![allow(unsafe_code)]

use std::fmt;
use std::ptr::NonNull;

use crate::error::{err, ErrorKind, Result};

/// Alignment of [`AlignedBuf`]: one page on every platform we run on.
pub const PAGE_SIZE: usize = 4096;

/// A transparent huge page on x86-64 and most aarch64 kernels.
pub const HUGE_PAGE_SIZE: usize = 2 << 20;

/// A zero-initialised heap buffer aligned to [`PAGE_SIZE`], for registrations that
/// want page alignment (some NICs and `O_DIRECT` files do).
///
/// Large buffers are zeroed lazily by the OS (the allocation comes from `calloc`), so
/// an 8 GiB buffer costs no resident memory until it is touched.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
    // Owns the allocation; only reached through `ptr`, which points into it.
    _storage: Vec<u8>,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`, like a Box<[u8]>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `len` zeroed bytes aligned to a page.
    ///
    /// # Panics
    /// When the allocation fails (see [`AlignedBuf::try_new`], which says why instead).
    pub fn new(len: usize) -> Self {
        Self::try_new(len).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Allocate `len` zeroed bytes that ask the kernel for transparent huge pages
    /// (`madvise(MADV_HUGEPAGE)`), aligned to [`HUGE_PAGE_SIZE`] from that size up
    /// (to a page below it, where huge pages cannot apply).
    ///
    /// Huge pages make cross-memory attach and NIC registration pin and walk far
    /// fewer pages (NIXL's users get them from numpy and PyTorch, which ask for
    /// them). Where the kernel offers none (`/sys/kernel/mm/transparent_hugepage/
    /// enabled` is `never`), or refuses the advice, the buffer is ordinary memory.
    ///
    /// # Panics
    /// When the allocation fails (see [`AlignedBuf::try_with_huge_pages`]).
    pub fn with_huge_pages(len: usize) -> Self {
        Self::try_with_huge_pages(len).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Allocate `len` zeroed bytes aligned to a page, or say why not.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `len` is more than this machine's memory
    /// ([`host_memory`](crate::host_memory)) or the allocator refuses it.
    pub fn try_new(len: usize) -> Result<Self> {
        Self::with_alignment(len, PAGE_SIZE)
    }

    /// [`AlignedBuf::with_huge_pages`], or say why not.
    ///
    /// # Errors
    /// As [`AlignedBuf::try_new`].
    pub fn try_with_huge_pages(len: usize) -> Result<Self> {
        if len < HUGE_PAGE_SIZE {
            return Self::try_new(len);
        }
        let b = Self::with_alignment(len, HUGE_PAGE_SIZE)?;
        // Only whole huge pages can be backed by them; the tail stays small pages.
        let span = len - len % HUGE_PAGE_SIZE;
        // SAFETY: `ptr..ptr+span` lies in this buffer's own allocation; MADV_HUGEPAGE
        // only changes how the kernel backs it, never its contents or validity.
        let r = unsafe { libc::madvise(b.ptr.as_ptr().cast(), span, libc::MADV_HUGEPAGE) };
        if r != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "the kernel refused huge pages for a buffer; using small pages"
            );
        }
        Ok(b)
    }

    /// Allocate `len` zeroed bytes aligned to `align` (a power of two).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `align` is not a power of two, the size
    /// overflows, is more than this machine's memory ([`host_memory`](crate::host_memory)) or the
    /// allocator refuses it.
    pub fn with_alignment(len: usize, align: usize) -> Result<Self> {
        let total = len.checked_add(align);
        let (true, Some(total)) = (align.is_power_of_two(), total) else {
            return err(
                ErrorKind::InvalidArgument,
                "allocate aligned buffer",
                format!("alignment {align} is not a power of two or size {len} overflows"),
            );
        };
        // Over-allocate by `align` and start at the first aligned byte: a zeroed
        // byte allocation comes from calloc, which the OS zeroes lazily (an aligned
        // zeroed allocation would memset every page up front).
        let mut storage = zeroed_vec(total)?;
        let base = storage.as_mut_ptr();
        let offset = base.align_offset(align);
        debug_assert!(offset < align);
        // SAFETY: offset < align, so base + offset + len <= base + total.
        let ptr = unsafe { NonNull::new_unchecked(base.add(offset)) };
        Ok(Self {
            ptr,
            len,
            align,
            _storage: storage,
        })
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw pointer to the first byte, derived without creating a reference (for
    /// [`Memory::from_raw_parts`](crate::Memory::from_raw_parts) over parts of one buffer).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

/// `len` zeroed bytes from the global allocator (calloc: zeroed lazily by the OS),
/// or an error where `vec![0; len]` would abort the process.
fn zeroed_vec(len: usize) -> Result<Vec<u8>> {
    const OP: &str = "allocate aligned buffer";
    crate::system::check_host_len(len as u64, "a buffer", OP)?;
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).or_else(|_| {
        err(
            ErrorKind::InvalidArgument,
            OP,
            format!("{len} bytes is more than one allocation can hold"),
        )
    })?;
    // SAFETY: the layout has a non-zero size (len > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return err(
            ErrorKind::InvalidArgument,
            OP,
            format!("the allocator refused {len} bytes (out of memory)"),
        );
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of
    // `[u8; len]`, and all `len` bytes are initialised (zeroed): exactly what
    // Vec::from_raw_parts requires for length and capacity `len`.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref, and &mut self gives unique access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("align", &self.align)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the mapping holding `addr` carries the huge-page advice ("hg" in
    /// smaps' VmFlags); `None` where smaps is not readable.
    fn advised(addr: usize) -> Option<bool> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.split_whitespace().any(|f| f == "hg"));
                }
            }
        }
        None
    }

    #[test]
    fn huge_page_buffers_are_aligned_advised_and_zeroed() {
        let len = 3 * HUGE_PAGE_SIZE + 100;
        let b = AlignedBuf::with_huge_pages(len);
        assert_eq!(b.len(), len);
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE_SIZE, 0);
        assert!(b.iter().all(|&x| x == 0));
        match advised(b.as_ptr() as usize) {
            Some(hg) => assert!(hg, "the buffer's mapping lacks the huge-page advice"),
            None => nixl_testkit::skip(
                "huge_page_buffers_are_aligned_advised_and_zeroed",
                "/proc/self/smaps is not readable",
            ),
        }
        // Small buffers are ordinary page-aligned memory.
        let small = AlignedBuf::with_huge_pages(4096);
        assert_eq!(small.as_ptr() as usize % PAGE_SIZE, 0);
    }

    #[test]
    fn aligned_buf_is_page_aligned_and_zeroed() {
        let b = AlignedBuf::new(10_000);
        assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
        assert!(b.iter().all(|&x| x == 0));
        assert!(AlignedBuf::with_alignment(8, 3).is_err());
    }
}
