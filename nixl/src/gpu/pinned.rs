//! Page-locked host memory for staging GPU memory, from a process-wide pool.
#![allow(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use super::access::driver;
#[cfg(doc)]
use super::access::status;
use crate::error::{Error, ErrorKind, Result};

/// Page-locked host memory, from a process-wide pool, for staging GPU memory:
/// [`RegionSlice::copy_to_pinned`](crate::RegionSlice::copy_to_pinned) and
/// [`RegionSlice::copy_from_pinned`](crate::RegionSlice::copy_from_pinned) copy
/// between it and registered memory. Dropped, it goes back to the pool (which keeps
/// up to [`PINNED_POOL_BYTES`]); fresh buffers are zeroed.
pub struct PinnedBuf {
    block: Option<PinnedBlock>,
    len: usize,
}

/// One allocation of page-locked memory: address, size class, owner.
struct PinnedBlock {
    ptr: usize,
    cap: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

/// Page-locked memory the pool keeps for reuse, at most.
pub const PINNED_POOL_BYTES: usize = 128 << 20;

/// Free page-locked blocks by size class, and their total size.
struct Pool {
    free: std::collections::BTreeMap<usize, Vec<PinnedBlock>>,
    bytes: usize,
}

static PINNED_POOL: Mutex<Pool> = Mutex::new(Pool {
    free: std::collections::BTreeMap::new(),
    bytes: 0,
});

impl PinnedBuf {
    /// A buffer of `len` bytes.
    ///
    /// # Errors
    /// As [`status`] where there is no GPU; the driver's when allocation fails.
    pub fn new(len: usize) -> Result<Self> {
        let cap = len
            .max(64 << 10)
            .checked_next_power_of_two()
            .filter(|&c| c <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::OutOfRange,
                    "allocate page-locked memory",
                    format!("{len} bytes is too large"),
                )
            })?;
        let pooled = {
            let mut pool = PINNED_POOL.lock().unwrap_or_else(PoisonError::into_inner);
            let b = pool.free.get_mut(&cap).and_then(Vec::pop);
            if b.is_some() {
                pool.bytes -= cap;
            }
            b
        };
        let block = match pooled {
            Some(b) => b,
            None => {
                let (ptr, owner) = driver()?.alloc_pinned(cap)?;
                // SAFETY: `ptr..ptr+cap` was just allocated for us alone; zeroing it
                // makes every byte initialised before any slice of it is made.
                unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, cap) };
                PinnedBlock {
                    ptr,
                    cap,
                    _owner: owner,
                }
            }
        };
        Ok(Self {
            block: Some(block),
            len,
        })
    }

    pub(super) fn ptr(&self) -> *mut u8 {
        self.block
            .as_ref()
            .expect("a live PinnedBuf has its block")
            .ptr as *mut u8
    }
}

impl std::ops::Deref for PinnedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the block holds at least `len` initialised bytes (zeroed when
        // allocated), owned by this value alone: no copy is in flight while a
        // PinnedBuf is reachable (a copy owns it until it has finished).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuf").field("len", &self.len).finish()
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        let mut pool = PINNED_POOL.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.bytes + block.cap <= PINNED_POOL_BYTES {
            pool.bytes += block.cap;
            pool.free.entry(block.cap).or_default().push(block);
        } else {
            drop(pool);
            drop(block);
        }
    }
}
