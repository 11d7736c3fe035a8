//! Page-aligned, zero-initialised host buffers: the floor under registered memory
//! (`memory`), GPU staging and the host stand-in for device memory (`gpu`).
#![allow(unsafe_code)]

use std::fmt;
use std::ptr::NonNull;

use crate::error::{err, ErrorKind, Result};

/// Alignment of [`AlignedBuf`]: one page on every platform we run on.
pub const PAGE_SIZE: usize = 4096;

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
    /// On allocation failure, like `Vec`.
    pub fn new(len: usize) -> Self {
        Self::with_alignment(len, PAGE_SIZE).expect("page alignment is a valid alignment")
    }

    /// Allocate `len` zeroed bytes aligned to `align` (a power of two).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `align` is not a power of two or the size
    /// overflows.
    pub fn with_alignment(len: usize, align: usize) -> Result<Self> {
        let total = len.checked_add(align);
        let (true, Some(total)) = (align.is_power_of_two(), total) else {
            return err(
                ErrorKind::InvalidArgument,
                "allocate aligned buffer",
                format!("alignment {align} is not a power of two or size {len} overflows"),
            );
        };
        // Over-allocate by `align` and start at the first aligned byte: a plain zeroed
        // Vec comes from calloc, which the OS zeroes lazily (an aligned zeroed
        // allocation would memset every page up front).
        let mut storage = vec![0u8; total];
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

    #[test]
    fn aligned_buf_is_page_aligned_and_zeroed() {
        let b = AlignedBuf::new(10_000);
        assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
        assert!(b.iter().all(|&x| x == 0));
        assert!(AlignedBuf::with_alignment(8, 3).is_err());
    }
}
