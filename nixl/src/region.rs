//! Registrations: the user's handle, the backends' handle, and remote regions.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::completion::InFlight;
use crate::descriptor::{Desc, Ranged};
use crate::error::{err, ErrorKind, Result};
use crate::gate::{Access, Gate};
use crate::memory::{MemKind, MemSegment, Memory};

pub(crate) struct RegionInner {
    pub(crate) id: u64,
    pub(crate) mem: Memory,
    /// Transfers posted and not yet reported finished by their backend.
    pub(crate) inflight: AtomicUsize,
    pub(crate) registered: AtomicBool,
    /// (backend index, public blob) for each backend that registered this region.
    pub(crate) backends: Mutex<Vec<(usize, Bytes)>>,
    /// Every backend access through a [`RegionSlice`] passes it; deregistration closes it.
    pub(crate) gate: Gate,
    /// Woken each time `inflight` falls to zero (a deregistration waiting for it).
    pub(crate) idle: tokio::sync::Notify,
}

impl InFlight for RegionInner {
    fn enter(&self) {
        self.inflight.fetch_add(1, Ordering::AcqRel);
    }

    fn leave(&self) {
        self.uncount();
    }
}

impl RegionInner {
    /// One in-flight use ended; the last one wakes deregistrations waiting for it.
    pub(crate) fn uncount(&self) {
        if self.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Enter the gate for one access, or refuse: the registration was withdrawn.
    fn access(&self, op: &'static str) -> Result<Access<'_>> {
        match self.gate.enter() {
            Some(a) => Ok(a),
            None => err(
                ErrorKind::NotFound,
                op,
                format!("registration {} was deregistered", self.id),
            ),
        }
    }

    pub(crate) fn registered_with(&self, backend: usize) -> bool {
        self.backends
            .lock()
            .unwrap()
            .iter()
            .any(|(b, _)| *b == backend)
    }
}

impl Ranged for Arc<RegionInner> {
    fn id(&self) -> u64 {
        self.id
    }
    fn start(&self) -> u64 {
        self.mem.addr()
    }
    fn len(&self) -> u64 {
        self.mem.len() as u64
    }
    fn kind(&self) -> MemKind {
        self.mem.kind()
    }
}

/// The application's handle to memory registered with an agent.
///
/// Cloning is cheap. The memory stays registered until
/// [`Agent::deregister`](crate::Agent::deregister) or agent shutdown; dropping handles
/// does not deregister it (peers may still be using it). The memory itself is freed
/// when it is deregistered, no handle is left and no transfer uses it.
#[derive(Clone)]
pub struct Registration {
    pub(crate) inner: Arc<RegionInner>,
}

impl Registration {
    /// Registration id, unique within the agent (and advertised in metadata).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.inner.mem.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.mem.len()
    }

    /// Whether the region is empty (never true for a registration).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.inner.mem.kind()
    }

    /// Whether it is still registered.
    pub fn is_registered(&self) -> bool {
        self.inner.registered.load(Ordering::Acquire)
    }

    /// The file, for a registered file ([`MemKind::File`]).
    pub fn file(&self) -> Option<&Arc<crate::file::FileHandle>> {
        self.inner.mem.file_handle()
    }

    /// Number of posted transfers that use this memory and have not finished.
    pub fn inflight(&self) -> usize {
        self.inner.inflight.load(Ordering::Acquire)
    }

    /// A descriptor for `offset..offset+len` of this region.
    ///
    /// It is not checked here; the agent checks every descriptor when a transfer is
    /// prepared.
    pub fn desc(&self, offset: u64, len: u64) -> Desc {
        Desc::new(self.addr().wrapping_add(offset), len, self.kind().device())
    }

    /// A descriptor for the whole region.
    pub fn whole(&self) -> Desc {
        self.desc(0, self.len() as u64)
    }

    /// Copy bytes out of the region, starting at `offset`.
    ///
    /// Peers may be writing the same bytes concurrently; order such access with your
    /// protocol (for example, read after the transfer's notification arrived).
    ///
    /// # Errors
    /// [`ErrorKind::OutOfRange`]; for GPU memory, errors of the device copy (see
    /// [`crate::gpu`]).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.inner.mem.copy_out(offset, dst)
    }

    /// Copy bytes into the region, starting at `offset`.
    ///
    /// # Errors
    /// [`ErrorKind::OutOfRange`]; for GPU memory, errors of the device copy (see
    /// [`crate::gpu`]).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.inner.mem.copy_in(offset, src)
    }

    /// A copy of the whole region.
    ///
    /// # Errors
    /// As [`Registration::read_at`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id())
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("kind", &self.kind())
            .field("registered", &self.is_registered())
            .finish()
    }
}

/// A backend's handle to a registered region. Holding it keeps the memory alive.
#[derive(Clone)]
pub struct RegionRef {
    pub(crate) inner: Arc<RegionInner>,
}

impl RegionRef {
    /// Registration id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.inner.mem.kind()
    }

    /// The whole region as a segment (valid while this handle lives).
    pub fn segment(&self) -> MemSegment {
        self.inner.mem.segment()
    }

    /// The file, for a registered file ([`MemKind::File`]); open while this handle
    /// lives.
    pub fn file(&self) -> Option<&Arc<crate::file::FileHandle>> {
        self.inner.mem.file_handle()
    }

    /// Whether the agent still has it registered.
    pub fn is_registered(&self) -> bool {
        self.inner.registered.load(Ordering::Acquire)
    }

    /// Count this registration in flight until the returned hold is dropped:
    /// [`Agent::deregister`](crate::Agent::deregister) refuses meanwhile
    /// ([`ErrorKind::NotAllowed`], nothing changes), as it does for a posted transfer.
    ///
    /// For a backend whose transport still uses the memory after the transfer that
    /// used it has completed: an operation a native engine accepted and cannot cancel
    /// outlives its failed transfer. Take the hold before completing that transfer
    /// (its own count then never lapses) and drop it once the transport has let go.
    /// It does not keep a deregistration that already happened from happening (nor
    /// does it count at agent shutdown, which deregisters everything).
    pub fn hold_in_flight(&self) -> InFlightHold {
        self.inner.inflight.fetch_add(1, Ordering::AcqRel);
        InFlightHold {
            inner: self.inner.clone(),
        }
    }
}

/// A registration counted in flight by a backend; see [`RegionRef::hold_in_flight`].
#[must_use = "the registration counts in flight only while the hold lives"]
pub struct InFlightHold {
    inner: Arc<RegionInner>,
}

impl Drop for InFlightHold {
    fn drop(&mut self) {
        self.inner.uncount();
    }
}

impl fmt::Debug for InFlightHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InFlightHold(registration {})", self.inner.id)
    }
}

impl RegionRef {
    /// `offset..offset+len` of this registration, or `None` when it does not fit.
    pub fn slice(&self, offset: usize, len: usize) -> Option<RegionSlice> {
        let end = offset.checked_add(len)?;
        (end <= self.inner.mem.len()).then(|| RegionSlice {
            region: self.clone(),
            offset,
            len,
        })
    }

    /// `addr..addr+len` (addresses in this process) of this registration, or `None`
    /// when it does not lie inside.
    pub fn slice_at(&self, addr: u64, len: u64) -> Option<RegionSlice> {
        let offset = addr.checked_sub(self.inner.mem.addr())?;
        self.slice(usize::try_from(offset).ok()?, usize::try_from(len).ok()?)
    }
}

impl fmt::Debug for RegionRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegionRef(id {}, {:?})", self.id(), self.segment())
    }
}

/// A checked range of one local registration: the registration (kept alive by this
/// value) and `offset..offset+len` inside it.
///
/// Transfer segments carry one for their local side, so a backend finds its handle for
/// the registration ([`RegionSlice::id`]) and the raw range ([`RegionSlice::segment`])
/// for native calls. The copy methods are the safe way to touch host memory that peers
/// and other transfers may write at the same time: they copy through raw pointers and
/// system calls and never make a Rust reference into registered memory.
#[derive(Clone)]
pub struct RegionSlice {
    region: RegionRef,
    offset: usize,
    len: usize,
}

impl RegionSlice {
    /// The registration it lies in.
    pub fn region(&self) -> &RegionRef {
        &self.region
    }

    /// The registration's id (the one [`Backend::register`](crate::Backend::register)
    /// was called for).
    pub fn id(&self) -> u64 {
        self.region.id()
    }

    /// Offset into the registration.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.region.inner.mem.addr() + self.offset as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.region.kind()
    }

    /// The raw range, for native calls. It stays valid while this value lives.
    /// A slice of a file has no memory: its segment is empty.
    pub fn segment(&self) -> MemSegment {
        let whole = self.region.inner.mem.segment();
        if self.kind().is_file() {
            return whole;
        }
        whole
            .slice(self.offset, self.len)
            .expect("a RegionSlice lies inside its registration")
    }

    /// The sub-range `offset..offset+len` of this slice, or `None` when it does not fit.
    pub fn sub(&self, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| Self {
            region: self.region.clone(),
            offset: self.offset + offset,
            len,
        })
    }

    /// `at..at+n` of the slice as an offset into its registration, for copies (host
    /// or device memory).
    fn range(&self, at: usize, n: usize, op: &'static str) -> Result<usize> {
        match at.checked_add(n) {
            Some(end) if end <= self.len => Ok(self.offset + at),
            _ => err(
                ErrorKind::OutOfRange,
                op,
                format!("{at}+{n} is outside the {}-byte slice", self.len),
            ),
        }
    }

    /// As [`RegionSlice::range`], for host memory only (the socket calls).
    fn io_range(&self, at: usize, n: usize, op: &'static str) -> Result<usize> {
        if self.kind() != MemKind::Dram {
            return err(
                ErrorKind::NotSupported,
                op,
                format!(
                    "{} memory is not host-accessible: stage it through host memory",
                    self.kind()
                ),
            );
        }
        match at.checked_add(n) {
            Some(end) if end <= self.len => Ok(self.offset + at),
            _ => err(
                ErrorKind::OutOfRange,
                op,
                format!("{at}+{n} is outside the {}-byte slice", self.len),
            ),
        }
    }

    /// [`RegionSlice::io_range`] as an I/O error, for the socket calls.
    #[cfg(unix)]
    fn socket_range(&self, at: usize, n: usize, op: &'static str) -> std::io::Result<usize> {
        self.io_range(at, n, op).map_err(io_invalid)
    }

    /// Copy `dst.len()` bytes starting `at` bytes into the slice out into `dst`.
    ///
    /// # Errors
    /// [`ErrorKind::OutOfRange`]; for GPU memory, errors of the device copy.
    pub fn read_into(&self, at: usize, dst: &mut [u8]) -> Result<()> {
        const OP: &str = "read registered memory";
        let off = self.range(at, dst.len(), OP)?;
        let _access = self.region.inner.access(OP)?;
        self.region.inner.mem.copy_out(off, dst)
    }

    /// Copy `src` into the slice, `at` bytes in.
    ///
    /// # Errors
    /// As [`RegionSlice::read_into`].
    pub fn write_from(&self, at: usize, src: &[u8]) -> Result<()> {
        const OP: &str = "write registered memory";
        let off = self.range(at, src.len(), OP)?;
        let _access = self.region.inner.access(OP)?;
        self.region.inner.mem.copy_in(off, src)
    }

    /// Start copying `n` bytes of the slice, from `at`, into the start of `buf`: for
    /// GPU memory an asynchronous device-to-host copy on a non-blocking stream (see
    /// [`gpu`](crate::gpu)), for host memory a copy made at once. The
    /// [`GpuCopy`](crate::gpu::GpuCopy) returned gives the buffer back once the bytes
    /// are in it; this slice's memory stays alive until then, even if it is dropped.
    ///
    /// # Errors
    /// [`ErrorKind::OutOfRange`] when `at..at+n` is outside the slice or `n` exceeds
    /// the buffer; the driver's when the copy cannot start.
    pub fn copy_to_pinned(
        &self,
        at: usize,
        buf: crate::gpu::PinnedBuf,
        n: usize,
    ) -> Result<crate::gpu::GpuCopy> {
        self.stage(crate::gpu::Direction::ToHost, at, buf, n)
    }

    /// Start copying the first `n` bytes of `buf` into the slice at `at`: the other
    /// way round from [`RegionSlice::copy_to_pinned`]. The bytes are in this memory
    /// when the [`GpuCopy`](crate::gpu::GpuCopy) resolves.
    ///
    /// # Errors
    /// As [`RegionSlice::copy_to_pinned`].
    pub fn copy_from_pinned(
        &self,
        at: usize,
        buf: crate::gpu::PinnedBuf,
        n: usize,
    ) -> Result<crate::gpu::GpuCopy> {
        self.stage(crate::gpu::Direction::ToDevice, at, buf, n)
    }

    /// Start a staging copy of `at..at+n` of the slice; the copy holds a reference to
    /// this slice, keeping its memory alive until it has finished.
    fn stage(
        &self,
        dir: crate::gpu::Direction,
        at: usize,
        buf: crate::gpu::PinnedBuf,
        n: usize,
    ) -> Result<crate::gpu::GpuCopy> {
        const OP: &str = "stage registered memory";
        let off = self.range(at, n, OP)?;
        // Counted in flight inside the gate: a deregistration that closed the gate
        // sees the count and refuses while the device copy runs.
        let _access = self.region.inner.access(OP)?;
        let counted = self.region.inner.clone();
        counted.inflight.fetch_add(1, Ordering::AcqRel);
        // Uncounted when the device is done with the memory, not when the copy's
        // future is next polled: a peer that stalls mid-request does not hold the
        // registration in flight.
        let ended = Box::new(move || {
            counted.uncount();
        });
        self.region
            .inner
            .mem
            .stage(off, dir, buf, n, Box::new(self.clone()), ended)
    }

    /// Copy all of `src` into this slice (`memmove`: the two may overlap).
    ///
    /// # Errors
    /// [`ErrorKind::LengthMismatch`] for slices of different lengths; for GPU memory,
    /// errors of the device copy.
    pub fn copy_from(&self, src: &Self) -> Result<()> {
        const OP: &str = "copy registered memory";
        if src.len != self.len {
            return err(
                ErrorKind::LengthMismatch,
                OP,
                format!("{} bytes into {}", src.len, self.len),
            );
        }
        let (d, s) = (self.range(0, self.len, OP)?, src.range(0, src.len, OP)?);
        // One access through both gates (they may be the same registration's).
        let _access =
            match crate::gate::Gate::enter_both(&self.region.inner.gate, &src.region.inner.gate) {
                Some(both) => both,
                None => {
                    return err(
                        ErrorKind::NotFound,
                        OP,
                        format!(
                            "registration {} or {} was deregistered",
                            self.region.id(),
                            src.region.id()
                        ),
                    )
                }
            };
        self.region
            .inner
            .mem
            .copy_from_memory(d, &src.region.inner.mem, s, self.len)
    }

    /// One non-blocking `recv(2)` from the socket `fd` into `at..at+n` of the slice:
    /// the kernel writes registered memory directly. Returns the bytes received (0 at
    /// end of stream).
    ///
    /// # Errors
    /// The system call's error (`WouldBlock` when nothing is ready; use it with
    /// tokio's `try_io`); `InvalidInput` when out of range or not host memory.
    #[cfg(unix)]
    pub fn recv(
        &self,
        at: usize,
        n: usize,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> std::io::Result<usize> {
        const OP: &str = "receive into registered memory";
        let off = self.socket_range(at, n, OP)?;
        let _access = self.region.inner.access(OP).map_err(io_invalid)?;
        self.region.inner.mem.recv_at(off, n, fd)
    }

    /// One non-blocking `send(2)` of `at..at+n` of the slice to the socket `fd`: the
    /// kernel reads registered memory directly. Returns the bytes sent.
    ///
    /// # Errors
    /// As [`RegionSlice::recv`].
    #[cfg(unix)]
    pub fn send(
        &self,
        at: usize,
        n: usize,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> std::io::Result<usize> {
        const OP: &str = "send from registered memory";
        let off = self.socket_range(at, n, OP)?;
        let _access = self.region.inner.access(OP).map_err(io_invalid)?;
        self.region.inner.mem.send_at(off, n, fd)
    }
}

/// A refusal as an I/O error, for the socket calls.
#[cfg(unix)]
fn io_invalid(e: crate::Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
}

impl fmt::Debug for RegionSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RegionSlice(region {}, {:#x}+{})",
            self.id(),
            self.addr(),
            self.len
        )
    }
}

/// A region a peer advertised in its metadata.
#[derive(Debug)]
pub(crate) struct RemoteRegion {
    pub(crate) id: u64,
    pub(crate) kind: MemKind,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// (backend name, public blob).
    pub(crate) blobs: Vec<(String, Bytes)>,
}

impl RemoteRegion {
    pub(crate) fn blob(&self, backend: &str) -> Option<&Bytes> {
        self.blobs
            .iter()
            .find(|(n, _)| n == backend)
            .map(|(_, b)| b)
    }
}

impl Ranged for Arc<RemoteRegion> {
    fn id(&self) -> u64 {
        self.id
    }
    fn start(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn kind(&self) -> MemKind {
        self.kind
    }
}

/// Public description of a region a peer advertised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteRegionInfo {
    /// The peer's registration id.
    pub id: u64,
    /// Memory kind.
    pub kind: MemKind,
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteRegionInfo {
    /// A descriptor for `offset..offset+len` of this remote region.
    pub fn desc(&self, offset: u64, len: u64) -> Desc {
        Desc::new(self.addr.wrapping_add(offset), len, self.kind.device())
    }
}
