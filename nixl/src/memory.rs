//! Memory the agent can register: owned buffers (the safe path) and caller-managed
//! memory (the `unsafe` path).
//!
//! One of the crate's audited modules with `unsafe` code (with `aligned`, `native` and
//! the GPU driver's parts). Everything here upholds one
//! invariant: a [`Memory`] value's `(ptr, len)` stays valid for reads and writes for as
//! long as the value lives, because the value owns the buffer (or the caller promised
//! so through [`Memory::from_raw_parts`]).
#![allow(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::BytesMut;

use crate::error::{err, Error, ErrorKind, Result};
use crate::file::{FileHandle, FileOptions};

pub use crate::aligned::{AlignedBuf, HUGE_PAGE_SIZE, PAGE_SIZE};

/// Kind of memory a registration or descriptor refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Host memory.
    Dram,
    /// GPU memory on the given device.
    Vram {
        /// CUDA device ordinal.
        device: u32,
    },
    /// A file registered with the agent ([`Memory::file`], [`Memory::open_file`]):
    /// descriptors are offsets into it. Storage transfers move between the agent's
    /// own memory and its files. A descriptor list of files may name many files:
    /// each descriptor names its file by its device id, whatever `fd` the list's kind
    /// carries (as NIXL's FILE lists do).
    File {
        /// The file's device id: by NIXL's convention, the number of the file
        /// descriptor it was registered with.
        fd: u32,
    },
}

impl MemKind {
    /// The device id descriptors carry for this kind (0 for DRAM).
    pub fn device(self) -> u32 {
        match self {
            Self::Dram => 0,
            Self::Vram { device } => device,
            Self::File { fd } => fd,
        }
    }

    /// Whether this is a file ([`MemKind::File`]) rather than memory.
    pub fn is_file(self) -> bool {
        matches!(self, Self::File { .. })
    }
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Dram => f.write_str("DRAM"),
            Self::Vram { device } => write!(f, "VRAM(device {device})"),
            Self::File { fd } => write!(f, "FILE(fd {fd})"),
        }
    }
}

enum Owner {
    Vec(#[allow(dead_code)] Vec<u8>),
    BytesMut(#[allow(dead_code)] BytesMut),
    Aligned(#[allow(dead_code)] AlignedBuf),
    Raw(#[allow(dead_code)] Option<Box<dyn Any + Send + Sync>>),
    File(Arc<FileHandle>),
}

/// Memory handed to an agent for registration.
///
/// Built from an owned buffer (`Vec<u8>`, `Box<[u8]>`, [`BytesMut`], [`AlignedBuf`]),
/// which the agent keeps alive for as long as any registration handle or in-flight
/// transfer uses it; or, unsafely, from memory the caller manages
/// ([`Memory::from_raw_parts`]).
pub struct Memory {
    ptr: NonNull<u8>,
    len: usize,
    kind: MemKind,
    // Never read: it exists to keep the buffer alive, and the buffer is never touched
    // through it again (all access goes through `ptr`).
    _owner: Owner,
}

// SAFETY: the owner types are all Send + Sync; the raw pointer only refers to memory
// the owner keeps alive, and concurrent access is governed by the transfer protocol
// (see `MemSegment`).
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    fn from_owner(ptr: *mut u8, len: usize, owner: Owner) -> Self {
        Self {
            ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
            len,
            kind: MemKind::Dram,
            _owner: owner,
        }
    }

    /// Wrap memory the caller manages.
    ///
    /// `kind` says what the pointer refers to: for [`MemKind::Vram`] it is a CUDA
    /// device pointer on that device (from `cudaMalloc`, a framework's allocator,
    /// `cuMemAlloc`), which nixl touches only through device copies (see
    /// [`crate::gpu`]); only backends that declare VRAM support register it.
    ///
    /// # Safety
    /// For as long as the returned value and every registration made from it live (until
    /// the agent has deregistered it and no transfer uses it, or the agent is gone),
    /// `ptr..ptr+len` must stay allocated: for DRAM valid for reads and writes, for
    /// VRAM device memory of that device.
    /// While registered, peers may read and write it at any time the application's
    /// protocol allows; the caller must not hold Rust references into it across such
    /// transfers.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize, kind: MemKind) -> Result<Self> {
        // SAFETY: forwarded contract.
        unsafe { Self::from_raw_parts_with_owner(ptr, len, kind, None::<()>) }
    }

    /// Like [`Memory::from_raw_parts`], and keeps `owner` alive alongside (dropped
    /// once the agent lets go of the memory).
    ///
    /// # Safety
    /// As for [`Memory::from_raw_parts`].
    pub unsafe fn from_raw_parts_with_owner<O: Any + Send + Sync>(
        ptr: *mut u8,
        len: usize,
        kind: MemKind,
        owner: Option<O>,
    ) -> Result<Self> {
        let Some(ptr) = NonNull::new(ptr) else {
            return err(
                ErrorKind::InvalidArgument,
                "wrap raw memory",
                "null pointer",
            );
        };
        if (ptr.as_ptr() as u64).checked_add(len as u64).is_none() {
            return err(
                ErrorKind::InvalidArgument,
                "wrap raw memory",
                "address + length overflows",
            );
        }
        if kind.is_file() {
            return err(
                ErrorKind::InvalidArgument,
                "wrap raw memory",
                "a file is registered with Memory::file or Memory::open_file, not by address",
            );
        }
        Ok(Self {
            ptr,
            len,
            kind,
            _owner: Owner::Raw(owner.map(|o| Box::new(o) as Box<dyn Any + Send + Sync>)),
        })
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// A file to register (NIXL's FILE memory), by a descriptor the caller opened:
    /// the registration keeps its own duplicate of `fd`, so closing `fd` afterwards
    /// changes nothing, and its descriptors carry `fd`'s number as their device id
    /// ([`MemKind::File`]). `len` bytes from offset 0 are registered; the file grows
    /// to `len` when shorter (it must be open for writing then), so every registered
    /// byte exists and a READ of a block never written reads zeros. `len` 0: the
    /// file's current length. A file opened with `O_DIRECT` keeps it: every transfer
    /// must then be aligned ([`crate::file::DirectAlignment`]).
    ///
    /// # Errors
    /// [`ErrorKind::ZeroLength`] for an empty file and `len` 0;
    /// [`ErrorKind::InvalidArgument`] for something other than a regular file or
    /// block device, or a file that is too short and cannot grow; the OS error of
    /// duplicating, inspecting or growing it ([`ErrorKind::Io`]).
    pub fn file(fd: impl std::os::fd::AsFd, len: u64) -> Result<Self> {
        Ok(Self::from_file(FileHandle::from_fd(fd.as_fd(), len)?))
    }

    /// A file to register, opened from `path` as `options` say; its descriptors carry
    /// `options.device`, else the number of the descriptor opened here
    /// ([`Memory::kind`] says it). See
    /// [`Memory::file`].
    ///
    /// # Errors
    /// As [`Memory::file`]; [`ErrorKind::NotFound`] when `path` does not exist (and
    /// `options.create` is off), [`ErrorKind::NotAllowed`] when it may not be opened.
    pub fn open_file(path: impl AsRef<std::path::Path>, options: &FileOptions) -> Result<Self> {
        Ok(Self::from_file(FileHandle::open(path.as_ref(), options)?))
    }

    fn from_file(h: FileHandle) -> Self {
        Self {
            ptr: NonNull::dangling(),
            len: h.len() as usize,
            kind: MemKind::File { fd: h.device() },
            _owner: Owner::File(Arc::new(h)),
        }
    }

    /// The file, for [`MemKind::File`] memory.
    pub fn file_handle(&self) -> Option<&Arc<FileHandle>> {
        match &self._owner {
            Owner::File(h) => Some(h),
            _ => None,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the memory is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address (0 for a file: its descriptors are offsets).
    pub fn addr(&self) -> u64 {
        if self.kind.is_file() {
            return 0;
        }
        self.ptr.as_ptr() as u64
    }

    /// `offset..offset+len` inside this memory, or `OutOfRange`.
    fn range(&self, offset: usize, len: usize, op: &'static str) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr() + offset as u64),
            _ => err(
                ErrorKind::OutOfRange,
                op,
                format!("{offset}+{len} is outside {} bytes", self.len),
            ),
        }
    }

    /// Copy `dst.len()` bytes starting at `offset` out of this memory (host memory by
    /// `memcpy`, device memory by a device-to-host copy).
    pub(crate) fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        const OP: &str = "read registered memory";
        let at = self.range(offset, dst.len(), OP)?;
        match self.kind {
            MemKind::Dram => {
                let seg = self.host_segment(offset, dst.len()).expect("range checked");
                // SAFETY: live host memory (our invariant), range checked.
                unsafe { seg.read_into(dst) };
                Ok(())
            }
            // SAFETY: live device memory of `device` (our invariant), range checked;
            // `dst` is a host buffer of that length.
            MemKind::Vram { device } => unsafe {
                crate::gpu::driver()?.copy_to_host(device, at, dst.as_mut_ptr(), dst.len())
            },
            MemKind::File { .. } => not_memory(OP),
        }
    }

    /// Copy `src` into this memory at `offset`.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) -> Result<()> {
        const OP: &str = "write registered memory";
        let at = self.range(offset, src.len(), OP)?;
        match self.kind {
            MemKind::Dram => {
                let seg = self.host_segment(offset, src.len()).expect("range checked");
                // SAFETY: live host memory (our invariant), range checked.
                unsafe { seg.write_from(src) };
                Ok(())
            }
            // SAFETY: as in `copy_out`, the other way round.
            MemKind::Vram { device } => unsafe {
                crate::gpu::driver()?.copy_from_host(device, at, src.as_ptr(), src.len())
            },
            MemKind::File { .. } => not_memory(OP),
        }
    }

    /// Start copying `n` bytes at `offset` of this memory into the start of `buf`
    /// (`dir` [`ToHost`](crate::gpu::Direction::ToHost)) or the other way round:
    /// device memory asynchronously, host memory at once. `hold` keeps this memory
    /// alive until the copy has finished; `ended` runs once nothing touches the memory
    /// any more (see [`crate::gpu::start_copy`]), on error too.
    pub(crate) fn stage(
        &self,
        offset: usize,
        dir: crate::gpu::Direction,
        mut buf: crate::gpu::PinnedBuf,
        n: usize,
        hold: Box<dyn Any + Send + Sync>,
        ended: Box<dyn FnOnce() + Send>,
    ) -> Result<crate::gpu::GpuCopy> {
        const OP: &str = "stage registered memory";
        if n > buf.len() {
            ended();
            return err(
                ErrorKind::OutOfRange,
                OP,
                format!("{n} bytes do not fit a {}-byte pinned buffer", buf.len()),
            );
        }
        let at = match self.range(offset, n, OP) {
            Ok(at) => at,
            Err(e) => {
                ended();
                return Err(e);
            }
        };
        match (self.kind, dir) {
            (MemKind::Dram, crate::gpu::Direction::ToHost) => {
                let copied = self.copy_out(offset, &mut buf[..n]);
                ended();
                copied.map(|()| crate::gpu::GpuCopy::finished(buf, hold))
            }
            (MemKind::Dram, crate::gpu::Direction::ToDevice) => {
                let copied = self.copy_in(offset, &buf[..n]);
                ended();
                copied.map(|()| crate::gpu::GpuCopy::finished(buf, hold))
            }
            // SAFETY: live device memory of `device` (our invariant), range checked,
            // kept alive by `hold` (a reference to this memory's registration); `n`
            // fits `buf`.
            (MemKind::Vram { device }, dir) => unsafe {
                crate::gpu::start_copy(device, dir, at, buf, n, hold, ended)
            },
            (MemKind::File { .. }, _) => {
                ended();
                not_memory(OP)
            }
        }
    }

    /// `memmove` of `len` bytes from `src` at `src_offset` into this memory at
    /// `offset` (the two may be the same memory and overlap), between host and
    /// device memory in any combination.
    pub(crate) fn copy_from_memory(
        &self,
        offset: usize,
        src: &Self,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "copy registered memory";
        let d = self.range(offset, len, OP)?;
        let s = src.range(src_offset, len, OP)?;
        match (self.kind, src.kind) {
            (MemKind::File { .. }, _) | (_, MemKind::File { .. }) => not_memory(OP),
            (MemKind::Dram, MemKind::Dram) => {
                // SAFETY: both are live host memory (our invariant, `&self` and `&src`
                // keep them alive), ranges checked; ptr::copy allows overlap and makes
                // no reference to either range.
                unsafe { std::ptr::copy(s as usize as *const u8, d as usize as *mut u8, len) };
                Ok(())
            }
            (MemKind::Dram, MemKind::Vram { device }) => {
                let gpu = crate::gpu::driver()?;
                // SAFETY: live memory of the kinds matched (our invariant), ranges
                // checked.
                unsafe { gpu.copy_to_host(device, s, d as usize as *mut u8, len) }
            }
            (MemKind::Vram { device }, MemKind::Dram) => {
                let gpu = crate::gpu::driver()?;
                // SAFETY: as above.
                unsafe { gpu.copy_from_host(device, d, s as usize as *const u8, len) }
            }
            (MemKind::Vram { device: dd }, MemKind::Vram { device: sd }) => {
                let gpu = crate::gpu::driver()?;
                if dd == sd && d < s + len as u64 && s < d + len as u64 {
                    // Overlapping ranges of one device: through the host, since a
                    // device copy's result is undefined there.
                    let mut tmp = vec![0u8; len];
                    src.copy_out(src_offset, &mut tmp)?;
                    return self.copy_in(offset, &tmp);
                }
                // SAFETY: as above; the ranges do not overlap.
                unsafe { gpu.device_to_device(dd, d, sd, s, len) }
            }
        }
    }

    /// `len` bytes of GPU memory on `device`, owned: freed once every registration
    /// and in-flight transfer let go of it. Allocated with `cuMemAlloc` (memory NICs
    /// can reach), not initialised.
    ///
    /// # Errors
    /// As [`crate::gpu::status`] when the process has no usable GPU;
    /// [`ErrorKind::InvalidArgument`] for a device that does not exist or zero bytes;
    /// the driver's error (out of memory).
    pub fn vram(device: u32, len: usize) -> Result<Self> {
        if len == 0 {
            return err(
                ErrorKind::InvalidArgument,
                "allocate GPU memory",
                "zero bytes",
            );
        }
        let (ptr, owner) = crate::gpu::driver()?.alloc(device, len)?;
        Ok(Self {
            ptr: NonNull::new(ptr as usize as *mut u8).ok_or_else(|| {
                Error::new(
                    ErrorKind::Backend,
                    "allocate GPU memory",
                    "the driver returned a null pointer",
                )
            })?,
            len,
            kind: MemKind::Vram { device },
            _owner: Owner::Raw(Some(owner)),
        })
    }

    /// One `recv(2)` from the socket `fd` into host memory at `offset..offset+len`,
    /// without waiting (`MSG_DONTWAIT`): the kernel writes the memory directly, and no
    /// Rust reference to it is made. Returns the bytes received (0 at end of stream).
    ///
    /// # Errors
    /// The system call's error (`WouldBlock` when nothing is ready); `InvalidInput`
    /// when out of range or not host memory.
    #[cfg(unix)]
    pub(crate) fn recv_at(
        &self,
        offset: usize,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> std::io::Result<usize> {
        self.socket_io(offset, len, fd, Direction::Recv)
    }

    /// One `send(2)` of host memory at `offset..offset+len` to the socket `fd`,
    /// without waiting (`MSG_DONTWAIT | MSG_NOSIGNAL`): the kernel reads the memory
    /// directly, and no Rust reference to it is made. Returns the bytes sent.
    ///
    /// # Errors
    /// As [`Memory::recv_at`].
    #[cfg(unix)]
    pub(crate) fn send_at(
        &self,
        offset: usize,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> std::io::Result<usize> {
        self.socket_io(offset, len, fd, Direction::Send)
    }

    #[cfg(unix)]
    fn socket_io(
        &self,
        offset: usize,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        dir: Direction,
    ) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        let Some(seg) = self.host_segment(offset, len) else {
            return Err(std::io::ErrorKind::InvalidInput.into());
        };
        let (fd, ptr) = (fd.as_raw_fd(), seg.ptr.as_ptr());
        let n = match dir {
            // SAFETY: `seg` is live host memory valid for `len` bytes of reads and
            // writes (our invariant; `&self` keeps it alive for the call); `fd` is an
            // open descriptor for the call's duration (BorrowedFd). recv writes the
            // range, send only reads it.
            Direction::Recv => unsafe { libc::recv(fd, ptr.cast(), len, libc::MSG_DONTWAIT) },
            // SAFETY: as above.
            Direction::Send => unsafe {
                libc::send(
                    fd,
                    ptr.cast_const().cast(),
                    len,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            },
        };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    fn host_segment(&self, offset: usize, len: usize) -> Option<MemSegment> {
        (self.kind == MemKind::Dram).then(|| self.segment().slice(offset, len))?
    }

    /// The memory as a segment; empty for a file (it has no memory to point at).
    pub(crate) fn segment(&self) -> MemSegment {
        MemSegment {
            ptr: self.ptr,
            len: if self.kind.is_file() { 0 } else { self.len },
        }
    }
}

/// A file is not memory: only a storage backend moves its bytes.
fn not_memory<T>(op: &'static str) -> Result<T> {
    err(
        ErrorKind::NotSupported,
        op,
        "a registered file is read and written by a storage backend, not copied as memory",
    )
}

impl From<Vec<u8>> for Memory {
    fn from(mut v: Vec<u8>) -> Self {
        // Moving a Vec does not move its heap buffer, so the pointer stays valid.
        let (ptr, len) = (v.as_mut_ptr(), v.len());
        Self::from_owner(ptr, len, Owner::Vec(v))
    }
}

impl From<Box<[u8]>> for Memory {
    fn from(b: Box<[u8]>) -> Self {
        // Through Vec (no copy): a Box asserts uniqueness when moved, a Vec does not.
        Self::from(b.into_vec())
    }
}

impl From<BytesMut> for Memory {
    fn from(mut b: BytesMut) -> Self {
        let (ptr, len) = (b.as_mut_ptr(), b.len());
        Self::from_owner(ptr, len, Owner::BytesMut(b))
    }
}

impl From<AlignedBuf> for Memory {
    fn from(b: AlignedBuf) -> Self {
        let (ptr, len) = (b.as_mut_ptr(), b.len());
        Self::from_owner(ptr, len, Owner::Aligned(b))
    }
}

impl fmt::Debug for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Memory")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

/// Which way [`Memory::socket_io`] moves bytes.
#[cfg(unix)]
#[derive(Clone, Copy)]
enum Direction {
    Recv,
    Send,
}

/// A validated `(pointer, length)` inside registered memory, handed to backends.
///
/// The agent builds segments only from descriptors it has checked against its
/// registrations. A segment is plain data: it does not keep the memory alive by itself.
/// The memory stays alive while the [`Completer`](crate::Completer) of the transfer
/// that carries the segment (or the [`RegionRef`](crate::RegionRef) it came from) lives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct MemSegment {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a segment is an address range; access is governed by the unsafe accessors.
unsafe impl Send for MemSegment {}
// SAFETY: as above.
unsafe impl Sync for MemSegment {}

impl MemSegment {
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-range `offset..offset+len`, or `None` when it does not fit.
    pub fn slice(&self, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: offset <= self.len, so the result stays inside (or one past) the range.
        let ptr = unsafe { self.ptr.add(offset) };
        Some(Self { ptr, len })
    }

    /// Copy out of the segment into `dst` (which must not be longer).
    ///
    /// # Safety
    /// The segment must be live DRAM.
    pub(crate) unsafe fn read_into(&self, dst: &mut [u8]) {
        let n = dst.len().min(self.len);
        // SAFETY: forwarded contract; dst is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), dst.as_mut_ptr(), n) }
    }

    /// Copy `src` into the segment (which must not be shorter).
    ///
    /// # Safety
    /// The segment must be live DRAM.
    pub(crate) unsafe fn write_from(&self, src: &[u8]) {
        let n = src.len().min(self.len);
        // SAFETY: forwarded contract; src is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr(), n) }
    }
}

impl fmt::Debug for MemSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemSegment({:#x}+{})", self.addr(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_keeps_owned_pointer() {
        let v = vec![7u8; 100];
        let p = v.as_ptr() as u64;
        let m = Memory::from(v);
        assert_eq!(m.addr(), p);
        let seg = m.segment().slice(10, 20).unwrap();
        let mut out = [0u8; 20];
        // SAFETY: m is alive DRAM.
        unsafe { seg.read_into(&mut out) };
        assert_eq!(out, [7u8; 20]);
        assert!(m.segment().slice(90, 11).is_none());
        let b = Memory::from(BytesMut::from(&b"abc"[..]));
        assert_eq!(b.len(), 3);
        let bx = Memory::from(vec![1u8; 4].into_boxed_slice());
        assert_eq!(bx.len(), 4);
    }
}
