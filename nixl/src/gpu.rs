//! GPU memory (VRAM): owned device buffers, and the copies between device and host
//! memory the agent and host-staging backends make.
//!
//! **This module has not run on a GPU yet** (the machines it was built on have none).
//! Tested: the paths without a driver; every driver call this module makes, against a
//! test double of the CUDA driver library loaded through `NIXL_CUDA_LIB`
//! (`nixl-testkit`'s `fake_cuda`: host memory, copies and callbacks on threads of its
//! own, aborting on misuse); and everything above the device copies on a host
//! stand-in (see below).
//!
//! # Driver
//! CUDA's driver (`libcuda.so.1`, from the NVIDIA driver package) is loaded at run
//! time; nothing CUDA is needed to build. The driver is checked first through the
//! core's own loader: the library opens, its version is at least CUDA 12.0 (what the
//! bindings are made for), `cuInit` succeeds and a device exists. Any of these
//! missing is an error value naming it ([`ErrorKind::UnavailableLibrary`] without the
//! library, [`ErrorKind::NotSupported`] otherwise), checked once per process. Only
//! then are cudarc's declarations of the driver API bound, to that same library
//! (`NIXL_CUDA_LIB` names another one, and it is the one used): cudarc's own loader,
//! which searches its own list of names and panics on a miss, is never used.
//!
//! # Contexts
//! Every device call makes the device's **primary** context (the one CUDA runtime
//! users such as PyTorch share) current on the calling thread for the call and then
//! restores the thread's own (push and pop), so copies are correct from any thread,
//! including tokio workers a task moves between, and an application thread keeps the
//! context it had. Threads that call a GPU-aware library themselves (a backend's
//! progress thread driving UCX before 1.19) call [`bind_thread`], which does set it.
//!
//! # Ordering
//! Synchronous copies (`read_at`/`write_at`, same-agent transfers) have finished when
//! they return, so later staging copies see their bytes. Staging copies that are
//! cancelled (their transfer's task dropped) keep their memory alive and count as
//! in flight on its registration until the driver reports them done; a reaper thread
//! frees them then.
//!
//! # Owned buffers
//! [`Memory::vram`](crate::Memory::vram) allocates with `cuMemAlloc` (not from the
//! stream-ordered pool, whose memory NICs cannot always reach) and frees when the
//! last registration and in-flight transfer let go, like host buffers.
//!
//! # Staging through pinned host memory
//! Backends that move GPU memory over a host path (nixl-tcp) stage it through
//! [`PinnedBuf`]s: page-locked host memory from a process-wide pool, which the GPU's
//! copy engines reach directly. [`RegionSlice::copy_to_pinned`] and
//! [`RegionSlice::copy_from_pinned`] start an asynchronous copy on a non-blocking
//! stream (one per device and direction) and return a [`GpuCopy`] future: no thread
//! waits on the GPU, and the copies do not wait for the application's kernels on the
//! default stream either (the application makes sure data is ready before it posts a
//! transfer, as with any transfer). The driver reports completion through a stream
//! callback, which only wakes the future. Dropping a [`GpuCopy`] does not stop its
//! copy: the buffer and the memory it copies stay alive until the copy has finished.
//!
//! [`RegionSlice::copy_to_pinned`]: crate::RegionSlice::copy_to_pinned
//! [`RegionSlice::copy_from_pinned`]: crate::RegionSlice::copy_from_pinned
//!
//! # Host stand-in (tests)
//! With the cargo feature `gpu-test-double`, `use_host_stand_in()` makes this process
//! treat ordinary host allocations as "device memory": every device copy is a plain
//! `memcpy`; asynchronous copies run on a thread of their own and complete later
//! (host-to-device copies from 1 MiB a few milliseconds later). It exists so the
//! logic above the copies (registration, staging in backends, notification ordering,
//! copies outliving their futures) runs in CI; it proves nothing about CUDA.

#![allow(unsafe_code)]

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};

use cudarc::driver::sys;

use crate::error::{err, Error, ErrorKind, Result};
use crate::native::NativeLibrary;

/// Environment variable naming the CUDA driver library to load.
pub const ENV_LIB: &str = "NIXL_CUDA_LIB";
/// The driver's soname.
pub const DEFAULT_SONAME: &str = "libcuda.so.1";
/// Oldest driver (CUDA version times 1000 plus minor times 10) the bindings work with.
pub const MIN_DRIVER: i32 = 12000;

/// What the process's GPU access is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// One line: the driver library and version, or the host stand-in.
    pub driver: String,
    /// Devices visible.
    pub devices: u32,
}

/// The device operations the rest of the crate uses.
pub(crate) trait GpuDriver: Send + Sync + fmt::Debug {
    fn info(&self) -> GpuInfo;

    /// Make `device`'s primary context current on this thread.
    fn bind(&self, device: u32) -> Result<()>;

    /// Run `f` with `device`'s primary context current on this thread, then make the
    /// thread's own context current again.
    fn scoped(&self, device: u32, f: &mut dyn FnMut() -> Result<()>) -> Result<()>;

    /// `len` bytes of device memory on `device`: its address and the owner that frees
    /// it when dropped.
    fn alloc(&self, device: u32, len: usize)
        -> Result<(u64, Box<dyn std::any::Any + Send + Sync>)>;

    /// Copy `len` bytes from device memory at `src` to host memory at `dst`.
    ///
    /// # Safety
    /// `src..src+len` is device memory of `device`, `dst..dst+len` writable host
    /// memory, both alive for the call.
    unsafe fn copy_to_host(&self, device: u32, src: u64, dst: *mut u8, len: usize) -> Result<()>;

    /// Copy `len` bytes from host memory at `src` to device memory at `dst`.
    ///
    /// # Safety
    /// As [`GpuDriver::copy_to_host`], the other way round.
    unsafe fn copy_from_host(
        &self,
        device: u32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()>;

    /// `len` bytes of page-locked host memory that asynchronous copies with every
    /// device can use: its address and the owner that frees it when dropped.
    fn alloc_pinned(&self, len: usize) -> Result<(usize, Box<dyn Any + Send + Sync>)>;

    /// Start copying `len` bytes between device memory at `dev` on `device` and
    /// page-locked host memory at `host`, `dir` saying which way, on this process's
    /// stream for that device and direction (copies one way on one device run in the
    /// order started). Returns at once. On `Ok`, `done` is called exactly once, after
    /// the copy finished, with the driver's status (0: success), from a driver thread
    /// where it must not call CUDA. On `Err` no copy is in flight and `done` is not
    /// called.
    ///
    /// # Safety
    /// `dev..dev+len` is device memory of `device`, `host..host+len` page-locked
    /// memory from [`GpuDriver::alloc_pinned`]; both stay alive, and nobody else
    /// touches them, until `done` has been called.
    unsafe fn copy_async(
        &self,
        device: u32,
        dir: Direction,
        dev: u64,
        host: *mut u8,
        len: usize,
        done: Box<dyn FnOnce(i32) + Send>,
    ) -> Result<()>;

    /// A dma-buf file descriptor for `start..start+len` of `device`'s memory (both
    /// aligned to the host page size by the caller).
    fn dma_buf(&self, device: u32, start: u64, len: usize) -> Result<std::os::fd::OwnedFd>;

    /// Copy `len` bytes between device memories (the same device or two).
    ///
    /// # Safety
    /// Both ranges are device memory of their devices, alive for the call; they may
    /// overlap only on one device (the copy then behaves like `memmove` only if the
    /// driver's does: callers avoid overlap).
    unsafe fn device_to_device(
        &self,
        dst_device: u32,
        dst: u64,
        src_device: u32,
        src: u64,
        len: usize,
    ) -> Result<()>;
}

/// Which way an asynchronous copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Direction {
    /// Device memory to host memory.
    ToHost,
    /// Host memory to device memory.
    ToDevice,
}

static STAND_IN: OnceLock<Arc<dyn GpuDriver>> = OnceLock::new();
static CUDA: OnceLock<std::result::Result<Arc<Cuda>, Error>> = OnceLock::new();

/// The process's GPU driver, checked once.
pub(crate) fn driver() -> Result<Arc<dyn GpuDriver>> {
    if let Some(s) = STAND_IN.get() {
        return Ok(s.clone());
    }
    cuda().map(|c| c as Arc<dyn GpuDriver>)
}

/// The CUDA driver, checked once (whatever the stand-in).
fn cuda() -> Result<Arc<Cuda>> {
    match CUDA.get_or_init(|| Cuda::probe().map(Arc::new)) {
        Ok(c) => Ok(c.clone()),
        Err(e) => Err(e.cloned()),
    }
}

/// Whether this process can use GPU memory, and through what.
///
/// # Errors
/// [`ErrorKind::UnavailableLibrary`] when the CUDA driver library is not there;
/// [`ErrorKind::NotSupported`] when it is too old, fails to initialise, or sees no
/// device. The message says which.
pub fn status() -> Result<GpuInfo> {
    driver().map(|d| d.info())
}

/// Make `device`'s primary context current on the calling thread, for threads that
/// call a GPU-aware library themselves (nixl's own device copies bind it on every
/// call). It stays current; for one call on a thread the application owns, use
/// [`with_context`].
///
/// # Errors
/// As [`status`]; [`ErrorKind::Backend`] from the driver.
pub fn bind_thread(device: u32) -> Result<()> {
    driver()?.bind(device)
}

/// Run `f` with `device`'s primary context current on the calling thread, then make
/// the thread's own context current again: for a GPU-aware library call made on a
/// thread the application owns (a backend registering GPU memory).
///
/// # Errors
/// As [`status`]; [`ErrorKind::Backend`] from the driver; `f`'s.
pub fn with_context<R>(device: u32, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let mut f = Some(f);
    let mut out = None;
    driver()?.scoped(device, &mut || {
        out = Some(f.take().expect("called once")()?);
        Ok(())
    })?;
    Ok(out.expect("`scoped` ran `f`"))
}

/// From now on, this process's "device memory" is host memory and device copies are
/// `memcpy`: a **test double** for running VRAM code paths without a GPU. Calls made
/// before it (or by another process) are not affected; it cannot be undone.
#[cfg(feature = "gpu-test-double")]
pub fn use_host_stand_in() {
    let _ = STAND_IN.set(Arc::new(HostStandIn));
}

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
        bury();
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

    fn ptr(&self) -> *mut u8 {
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

/// A range of device memory exported as a dma-buf, for registering it with an RDMA
/// NIC (`ibv_reg_dmabuf_mr`: GPUDirect RDMA without the peer-memory kernel module).
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf (closed when dropped; a NIC registration keeps its own reference).
    pub fd: std::os::fd::OwnedFd,
    /// Where the requested range starts in the dma-buf: the export covers whole host
    /// pages around it, as the driver requires.
    pub offset: u64,
    /// The dma-buf's length.
    pub len: usize,
}

/// Export `addr..addr + len` of `device`'s memory (memory nixl or a framework
/// allocated) as a dma-buf.
///
/// # Errors
/// As [`status`] without a GPU; [`ErrorKind::OutOfRange`] for an empty range or one
/// past the address space; [`ErrorKind::NotSupported`] when the driver cannot export
/// it (CUDA older than 11.7, or a GPU, driver or kernel without dma-buf support), with
/// the driver's reason.
pub fn dma_buf(device: u32, addr: u64, len: usize) -> Result<DmaBuf> {
    const OP: &str = "export GPU memory as a dma-buf";
    let page = crate::PAGE_SIZE as u64;
    let start = addr - addr % page;
    let end = addr
        .checked_add(len as u64)
        .and_then(|e| e.checked_next_multiple_of(page))
        .filter(|_| len > 0)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::OutOfRange,
                OP,
                format!("{addr:#x}+{len} is empty or past the address space"),
            )
        })?;
    let span = usize::try_from(end - start).map_err(|_| {
        Error::new(
            ErrorKind::OutOfRange,
            OP,
            format!("{addr:#x}+{len} is too large"),
        )
    })?;
    let fd = driver()?.dma_buf(device, start, span)?;
    Ok(DmaBuf {
        fd,
        offset: addr - start,
        len: span,
    })
}

/// What a copy's completion callback and its future share.
#[derive(Default)]
struct CopyState {
    /// The driver's status once the copy finished.
    status: Option<i32>,
    waker: Option<Waker>,
}

/// What an in-flight copy keeps alive: its buffer and the memory it copies.
struct CopyHold {
    buf: PinnedBuf,
    _memory: Box<dyn Any + Send + Sync>,
}

/// Copies whose futures were dropped before they finished, with what they hold; freed
/// by [`bury`] once finished. (Nothing is freed in the driver's callback, where CUDA
/// calls, such as freeing memory, are not allowed.)
static ORPHANS: Mutex<Vec<(Arc<Mutex<CopyState>>, CopyHold)>> = Mutex::new(Vec::new());

/// Whether the reaper thread runs.
static REAPER: Mutex<bool> = Mutex::new(false);

/// Keep what a copy whose future was dropped holds until the copy has finished; a
/// reaper thread frees it soon after (memory a registration may be waiting on).
fn orphan(state: Arc<Mutex<CopyState>>, hold: CopyHold) {
    ORPHANS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((state, hold));
    let mut running = REAPER.lock().unwrap_or_else(PoisonError::into_inner);
    if !*running {
        let spawned = std::thread::Builder::new()
            .name("nixl-gpu-reaper".into())
            .spawn(reap);
        // Without the thread, the next staging call frees them.
        *running = spawned.is_ok();
    }
}

/// The reaper: frees finished orphans every millisecond while there are any.
fn reap() {
    loop {
        std::thread::sleep(std::time::Duration::from_millis(1));
        bury();
        let mut running = REAPER.lock().unwrap_or_else(PoisonError::into_inner);
        if ORPHANS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
        {
            *running = false;
            return;
        }
    }
}

/// Free what finished orphaned copies held.
fn bury() {
    let finished: Vec<_> = {
        let mut orphans = ORPHANS.lock().unwrap_or_else(PoisonError::into_inner);
        let (done, running) = std::mem::take(&mut *orphans)
            .into_iter()
            .partition(|(s, _)| {
                s.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .status
                    .is_some()
            });
        *orphans = running;
        done
    };
    drop(finished);
}

/// An asynchronous copy between registered memory and a [`PinnedBuf`], started by
/// [`RegionSlice::copy_to_pinned`](crate::RegionSlice::copy_to_pinned) or
/// [`RegionSlice::copy_from_pinned`](crate::RegionSlice::copy_from_pinned). It
/// resolves to the buffer once the copy has finished. Dropping it does not stop the
/// copy; the buffer and memory stay alive until the copy is over.
#[must_use = "the copy's result and buffer come from awaiting it"]
pub struct GpuCopy {
    state: Arc<Mutex<CopyState>>,
    hold: Option<CopyHold>,
}

impl GpuCopy {
    /// A copy already made (host memory).
    pub(crate) fn finished(buf: PinnedBuf, memory: Box<dyn Any + Send + Sync>) -> Self {
        Self {
            state: Arc::new(Mutex::new(CopyState {
                status: Some(0),
                waker: None,
            })),
            hold: Some(CopyHold {
                buf,
                _memory: memory,
            }),
        }
    }
}

impl Future for GpuCopy {
    type Output = Result<PinnedBuf>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let status = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match st.status {
                Some(s) => s,
                None => {
                    st.waker = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
        };
        let hold = self.hold.take().expect("GpuCopy polled after it completed");
        Poll::Ready(if status == 0 {
            Ok(hold.buf)
        } else {
            err(
                ErrorKind::Backend,
                "copy GPU memory",
                format!("the asynchronous copy failed: {}", cu_name(status as u32)),
            )
        })
    }
}

impl Drop for GpuCopy {
    fn drop(&mut self) {
        if let Some(hold) = self.hold.take() {
            let running = self
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .status
                .is_none();
            if running {
                orphan(self.state.clone(), hold);
            }
        }
    }
}

impl fmt::Debug for GpuCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .status;
        f.debug_struct("GpuCopy").field("status", &status).finish()
    }
}

/// Start copying `n` bytes between device memory at `dev` on `device` and the start
/// of `buf`; `memory` keeps the device memory alive until the copy has finished.
///
/// # Safety
/// `dev..dev+n` is device memory of `device`, kept alive by `memory`; `n <= buf.len()`.
pub(crate) unsafe fn start_copy(
    device: u32,
    dir: Direction,
    dev: u64,
    buf: PinnedBuf,
    n: usize,
    memory: Box<dyn Any + Send + Sync>,
) -> Result<GpuCopy> {
    debug_assert!(n <= buf.len());
    bury();
    let gpu = driver()?;
    let state = Arc::new(Mutex::new(CopyState::default()));
    let host = buf.ptr();
    let signal = state.clone();
    let done = Box::new(move |status: i32| {
        let waker = {
            let mut st = signal.lock().unwrap_or_else(PoisonError::into_inner);
            st.status = Some(status);
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    });
    // SAFETY: the caller's contract for the device side; `host..host+n` lies in
    // `buf`'s page-locked block. Both stay alive until `done` ran: the GpuCopy
    // returned holds them, and if dropped first hands them to ORPHANS, which frees
    // them only after the status is set.
    unsafe { gpu.copy_async(device, dir, dev, host, n, done)? };
    Ok(GpuCopy {
        state,
        hold: Some(CopyHold {
            buf,
            _memory: memory,
        }),
    })
}

/// A driver call's result as an error (the result's name only: formatting it makes no
/// driver call).
fn cu(op: &'static str, r: std::ffi::c_uint) -> Result<()> {
    if r == 0 {
        Ok(())
    } else {
        err(ErrorKind::Backend, op, format!("CUDA: {}", cu_name(r)))
    }
}

/// A driver result's name, for the codes worth naming (the number otherwise).
fn cu_name(r: std::ffi::c_uint) -> String {
    let name = match r {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUresult {r}"),
    };
    format!("{name} ({r})")
}

/// Narrow a driver call bound by cudarc to one whose result is the plain integer it
/// is in C. cudarc declares results as its `CUresult` enum, and a code a newer driver
/// adds must never become a value of that enum. The assignment checks the parameters
/// are exactly cudarc's.
macro_rules! narrow {
    ($lib:expr, $name:ident, ($($arg:ty),*)) => {{
        let declared: unsafe extern "C" fn($($arg),*) -> sys::CUresult = $lib.$name;
        // SAFETY: the same parameters (checked just above); the result is a C enum
        // returned as a 32-bit unsigned integer either way (`CUresult` is
        // `repr(u32)`).
        unsafe {
            std::mem::transmute::<
                unsafe extern "C" fn($($arg),*) -> sys::CUresult,
                unsafe extern "C" fn($($arg),*) -> std::ffi::c_uint,
            >(declared)
        }
    }};
}

/// The driver calls nixl makes, results as plain integers (see [`narrow!`]).
#[allow(non_snake_case)]
struct Calls {
    cuDeviceGet: unsafe extern "C" fn(*mut sys::CUdevice, std::ffi::c_int) -> std::ffi::c_uint,
    cuDevicePrimaryCtxRetain:
        unsafe extern "C" fn(*mut sys::CUcontext, sys::CUdevice) -> std::ffi::c_uint,
    cuCtxGetCurrent: unsafe extern "C" fn(*mut sys::CUcontext) -> std::ffi::c_uint,
    cuCtxSetCurrent: unsafe extern "C" fn(sys::CUcontext) -> std::ffi::c_uint,
    cuCtxPushCurrent_v2: unsafe extern "C" fn(sys::CUcontext) -> std::ffi::c_uint,
    cuCtxPopCurrent_v2: unsafe extern "C" fn(*mut sys::CUcontext) -> std::ffi::c_uint,
    cuMemAlloc_v2: unsafe extern "C" fn(*mut sys::CUdeviceptr, usize) -> std::ffi::c_uint,
    cuMemFree_v2: unsafe extern "C" fn(sys::CUdeviceptr) -> std::ffi::c_uint,
    cuMemHostAlloc: unsafe extern "C" fn(
        *mut *mut std::ffi::c_void,
        usize,
        std::ffi::c_uint,
    ) -> std::ffi::c_uint,
    cuMemFreeHost: unsafe extern "C" fn(*mut std::ffi::c_void) -> std::ffi::c_uint,
    cuMemcpyDtoH_v2:
        unsafe extern "C" fn(*mut std::ffi::c_void, sys::CUdeviceptr, usize) -> std::ffi::c_uint,
    cuMemcpyHtoD_v2:
        unsafe extern "C" fn(sys::CUdeviceptr, *const std::ffi::c_void, usize) -> std::ffi::c_uint,
    cuMemcpy: unsafe extern "C" fn(sys::CUdeviceptr, sys::CUdeviceptr, usize) -> std::ffi::c_uint,
    cuStreamCreate: unsafe extern "C" fn(*mut sys::CUstream, std::ffi::c_uint) -> std::ffi::c_uint,
    cuStreamSynchronize: unsafe extern "C" fn(sys::CUstream) -> std::ffi::c_uint,
    cuMemcpyDtoHAsync_v2: unsafe extern "C" fn(
        *mut std::ffi::c_void,
        sys::CUdeviceptr,
        usize,
        sys::CUstream,
    ) -> std::ffi::c_uint,
    cuMemcpyHtoDAsync_v2: unsafe extern "C" fn(
        sys::CUdeviceptr,
        *const std::ffi::c_void,
        usize,
        sys::CUstream,
    ) -> std::ffi::c_uint,
    cuStreamAddCallback: unsafe extern "C" fn(
        sys::CUstream,
        sys::CUstreamCallback,
        *mut std::ffi::c_void,
        std::ffi::c_uint,
    ) -> std::ffi::c_uint,
    cuMemGetHandleForAddressRange: unsafe extern "C" fn(
        *mut std::ffi::c_void,
        sys::CUdeviceptr,
        usize,
        sys::CUmemRangeHandleType,
        std::ffi::c_ulonglong,
    ) -> std::ffi::c_uint,
}

impl Calls {
    fn from(lib: &sys::Lib) -> Self {
        use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
        use sys::{CUcontext, CUdevice, CUdeviceptr, CUstream};
        Self {
            cuDeviceGet: narrow!(lib, cuDeviceGet, (*mut CUdevice, c_int)),
            cuDevicePrimaryCtxRetain: narrow!(
                lib,
                cuDevicePrimaryCtxRetain,
                (*mut CUcontext, CUdevice)
            ),
            cuCtxGetCurrent: narrow!(lib, cuCtxGetCurrent, (*mut CUcontext)),
            cuCtxSetCurrent: narrow!(lib, cuCtxSetCurrent, (CUcontext)),
            cuCtxPushCurrent_v2: narrow!(lib, cuCtxPushCurrent_v2, (CUcontext)),
            cuCtxPopCurrent_v2: narrow!(lib, cuCtxPopCurrent_v2, (*mut CUcontext)),
            cuMemAlloc_v2: narrow!(lib, cuMemAlloc_v2, (*mut CUdeviceptr, usize)),
            cuMemFree_v2: narrow!(lib, cuMemFree_v2, (CUdeviceptr)),
            cuMemHostAlloc: narrow!(lib, cuMemHostAlloc, (*mut *mut c_void, usize, c_uint)),
            cuMemFreeHost: narrow!(lib, cuMemFreeHost, (*mut c_void)),
            cuMemcpyDtoH_v2: narrow!(lib, cuMemcpyDtoH_v2, (*mut c_void, CUdeviceptr, usize)),
            cuMemcpyHtoD_v2: narrow!(lib, cuMemcpyHtoD_v2, (CUdeviceptr, *const c_void, usize)),
            cuMemcpy: narrow!(lib, cuMemcpy, (CUdeviceptr, CUdeviceptr, usize)),
            cuStreamCreate: narrow!(lib, cuStreamCreate, (*mut CUstream, c_uint)),
            cuStreamSynchronize: narrow!(lib, cuStreamSynchronize, (CUstream)),
            cuMemcpyDtoHAsync_v2: narrow!(
                lib,
                cuMemcpyDtoHAsync_v2,
                (*mut c_void, CUdeviceptr, usize, CUstream)
            ),
            cuMemcpyHtoDAsync_v2: narrow!(
                lib,
                cuMemcpyHtoDAsync_v2,
                (CUdeviceptr, *const c_void, usize, CUstream)
            ),
            cuStreamAddCallback: narrow!(
                lib,
                cuStreamAddCallback,
                (CUstream, sys::CUstreamCallback, *mut c_void, c_uint)
            ),
            cuMemGetHandleForAddressRange: narrow!(
                lib,
                cuMemGetHandleForAddressRange,
                (
                    *mut c_void,
                    CUdeviceptr,
                    usize,
                    sys::CUmemRangeHandleType,
                    c_ulonglong
                )
            ),
        }
    }
}

/// The CUDA driver after the pre-check, called through cudarc's declarations bound to
/// the library the check opened (never through cudarc's own loader, which searches
/// its own list of names and panics on a miss).
struct Cuda {
    /// cudarc's binding: it holds the library, and [`Calls`] come from it.
    _lib: sys::Lib,
    calls: Calls,
    driver: String,
    devices: u32,
    /// Each device's primary context, retained once and kept for the process.
    contexts: Mutex<HashMap<u32, PrimaryCtx>>,
    /// The staging copies' streams, created on first use and kept for the process.
    streams: Mutex<HashMap<(u32, Direction), Stream>>,
}

/// A CUDA stream handle.
#[derive(Clone, Copy)]
struct Stream(sys::CUstream);

// SAFETY: a CUstream is an opaque driver handle; the driver API is thread-safe and a
// stream may be used from any thread that has its context current.
unsafe impl Send for Stream {}

/// A primary context handle.
#[derive(Clone, Copy)]
struct PrimaryCtx(sys::CUcontext);

// SAFETY: a CUcontext is an opaque driver handle, current on any thread that sets it.
unsafe impl Send for PrimaryCtx {}

impl fmt::Debug for Cuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cuda")
            .field("driver", &self.driver)
            .field("devices", &self.devices)
            .finish()
    }
}

type CuDriverGetVersion = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
type CuInit = unsafe extern "C" fn(std::ffi::c_uint) -> std::ffi::c_int;
type CuDeviceGetCount = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;

impl Cuda {
    /// Check the driver through the core's loader, then bind cudarc's declarations to
    /// the same library.
    fn probe() -> Result<Self> {
        const OP: &str = "open the CUDA driver";
        let (name, from_env) = match std::env::var(ENV_LIB) {
            Ok(v) if !v.is_empty() => (v, true),
            _ => (DEFAULT_SONAME.to_owned(), false),
        };
        let lib = NativeLibrary::open(&name).map_err(|e| {
            Error::new(
                ErrorKind::UnavailableLibrary,
                OP,
                if from_env {
                    format!("{name} ({ENV_LIB}) does not load: {e}")
                } else {
                    format!(
                        "{name} (the NVIDIA driver's CUDA library) not found: {e}; GPU memory needs an NVIDIA GPU and its driver (set {ENV_LIB} to use another library)"
                    )
                },
            )
        })?;
        let sym = |s: &str| {
            Error::new(
                ErrorKind::UnavailableLibrary,
                OP,
                format!("{name} lacks {s}: not a CUDA driver library"),
            )
        };
        // SAFETY: these are the driver API's C signatures (cuda.h): CUresult is an
        // int-sized enum, the out-parameters point to ints.
        let (get_version, init, count) = unsafe {
            (
                lib.symbol::<CuDriverGetVersion>("cuDriverGetVersion")
                    .map_err(|_| sym("cuDriverGetVersion"))?,
                lib.symbol::<CuInit>("cuInit").map_err(|_| sym("cuInit"))?,
                lib.symbol::<CuDeviceGetCount>("cuDeviceGetCount")
                    .map_err(|_| sym("cuDeviceGetCount"))?,
            )
        };
        let path = lib
            .path_of_symbol(&["cuInit"])
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| name.clone());
        let mut version = 0;
        // SAFETY: `version` is a valid place for the result; the driver is loaded.
        let r = unsafe { get_version(&mut version) };
        if r != 0 || version < MIN_DRIVER {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "{path}: CUDA driver {}.{} (result {r}); GPU memory needs CUDA 12.0 or newer (driver R525+)",
                    version / 1000,
                    version % 1000 / 10
                ),
            );
        }
        // SAFETY: cuInit takes flags 0; the library is loaded.
        let r = unsafe { init(0) };
        if r != 0 {
            let why = match r {
                100 => "no CUDA device is visible (CUDA_VISIBLE_DEVICES, or no GPU)".to_owned(),
                34 => "this is the CUDA toolkit's stub library, not a driver".to_owned(),
                3 => "the driver is not initialised (a process forked after CUDA started?)"
                    .to_owned(),
                r => format!("cuInit failed with CUresult {r}"),
            };
            return err(ErrorKind::NotSupported, OP, format!("{path}: {why}"));
        }
        let mut n = 0;
        // SAFETY: `n` is a valid place for the count; the driver is initialised.
        let r = unsafe { count(&mut n) };
        if r != 0 || n <= 0 {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!("{path}: no CUDA device (cuDeviceGetCount: {n}, result {r})"),
            );
        }
        // cudarc's binding resolves every call of the CUDA 12.0 driver API and panics
        // on a missing one; a 12.0+ driver (checked above) has them all.
        let bound = std::panic::catch_unwind(|| {
            // SAFETY: the library is the CUDA driver checked above; `from_library`
            // only resolves symbols, with the declarations of cuda.h.
            unsafe { libloading::Library::new(&name).and_then(|l| sys::Lib::from_library(l)) }
        });
        let lib = match bound {
            Ok(Ok(lib)) => lib,
            Ok(Err(e)) => return err(ErrorKind::UnavailableLibrary, OP, format!("{path}: {e}")),
            Err(_) => {
                return err(
                    ErrorKind::NotSupported,
                    OP,
                    format!("{path} lacks calls of the CUDA 12.0 driver API"),
                )
            }
        };
        Ok(Self {
            calls: Calls::from(&lib),
            _lib: lib,
            driver: format!(
                "CUDA driver {}.{} ({path})",
                version / 1000,
                version % 1000 / 10
            ),
            devices: n as u32,
            contexts: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
        })
    }

    /// The primary context of `device` (the one the CUDA runtime and frameworks
    /// use), retained once per process.
    fn context(&self, device: u32) -> Result<PrimaryCtx> {
        const OP: &str = "CUDA context";
        if device >= self.devices {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                format!("GPU {device} does not exist ({} visible)", self.devices),
            );
        }
        let mut ctxs = self.contexts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = ctxs.get(&device) {
            return Ok(*c);
        }
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-parameters of the declared types; the driver is initialised.
        unsafe {
            cu(
                OP,
                (self.calls.cuDeviceGet)(&mut dev, device as std::ffi::c_int),
            )?;
            cu(OP, (self.calls.cuDevicePrimaryCtxRetain)(&mut ctx, dev))?;
        }
        ctxs.insert(device, PrimaryCtx(ctx));
        Ok(PrimaryCtx(ctx))
    }

    /// The stream of `device`'s staging copies going `dir` (the device's context must
    /// be current). Non-blocking: it does not wait for work on the default stream.
    fn stream(&self, device: u32, dir: Direction) -> Result<Stream> {
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = streams.get(&(device, dir)) {
            return Ok(*s);
        }
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: an out-parameter of the declared type; the context is current.
        cu("create a CUDA stream", unsafe {
            (self.calls.cuStreamCreate)(
                &mut s,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as std::ffi::c_uint,
            )
        })?;
        streams.insert((device, dir), Stream(s));
        Ok(Stream(s))
    }

    /// Run `f` with `ctx` current on this thread, and make the thread's own context
    /// current again afterwards: nixl's calls never change which context the
    /// application's threads have current.
    fn in_ctx<R>(&self, PrimaryCtx(ctx): PrimaryCtx, f: impl FnOnce() -> Result<R>) -> Result<R> {
        const OP: &str = "make a CUDA context current";
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-parameters of the declared types; `ctx` is a retained primary
        // context, pushed and popped in pairs on this thread.
        unsafe {
            cu(OP, (self.calls.cuCtxGetCurrent)(&mut current))?;
            if current == ctx {
                return f();
            }
            cu(OP, (self.calls.cuCtxPushCurrent_v2)(ctx))?;
            let r = f();
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            let p = cu(OP, (self.calls.cuCtxPopCurrent_v2)(&mut popped));
            r.and_then(|v| p.map(|()| v))
        }
    }

    /// Run `f` in `device`'s primary context (see [`Cuda::in_ctx`]).
    fn on<R>(&self, device: u32, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let ctx = self.context(device)?;
        self.in_ctx(ctx, f)
    }

    /// A context for calls that need one but no particular device (page-locked host
    /// memory is usable from every context): one already retained, so that no other
    /// GPU gets a context (and its memory) just for this; device 0's otherwise.
    fn any_ctx(&self) -> Result<PrimaryCtx> {
        let first = self
            .contexts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .next()
            .copied();
        match first {
            Some(c) => Ok(c),
            None => self.context(0),
        }
    }

    /// The process's CUDA driver, for freeing (it lives as long as the process).
    fn get() -> Option<Arc<Self>> {
        CUDA.get().and_then(|c| c.as_ref().ok()).cloned()
    }
}

/// Device memory from `cuMemAlloc`, freed on drop (its context bound first).
struct CudaAlloc {
    device: u32,
    ptr: u64,
}

impl Drop for CudaAlloc {
    fn drop(&mut self) {
        let Some(cuda) = Cuda::get() else { return };
        let freed = cuda.on(self.device, || {
            // SAFETY: `ptr` came from cuMemAlloc in this context and nothing uses it
            // any more (the memory's last holder lets go).
            cu("free GPU memory", unsafe {
                (cuda.calls.cuMemFree_v2)(self.ptr)
            })
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "freeing GPU memory failed");
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
struct CudaPinned {
    ptr: usize,
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        let Some(cuda) = Cuda::get() else { return };
        let freed = cuda.any_ctx().and_then(|ctx| {
            cuda.in_ctx(ctx, || {
                // SAFETY: `ptr` came from cuMemHostAlloc and nothing uses it any more
                // (its PinnedBuf let go, with no copy in flight).
                cu("free page-locked memory", unsafe {
                    (cuda.calls.cuMemFreeHost)(self.ptr as *mut std::ffi::c_void)
                })
            })
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "freeing page-locked memory failed");
        }
    }
}

/// The stream callback of [`GpuDriver::copy_async`]: hands the status to `done`.
/// The status is taken as the plain integer it is in C: a newer driver may report a
/// code cudarc's `CUresult` enum does not list, which must never become that enum.
unsafe extern "C" fn copy_done(
    _stream: sys::CUstream,
    status: std::ffi::c_uint,
    data: *mut std::ffi::c_void,
) {
    // SAFETY: `data` is the box `copy_async` leaked for exactly this one callback.
    let done = unsafe { Box::from_raw(data.cast::<Box<dyn FnOnce(i32) + Send>>()) };
    done(status as i32);
}

/// [`copy_done`] as the callback type cudarc declares.
fn copy_done_callback() -> sys::CUstreamCallback {
    type Plain = unsafe extern "C" fn(sys::CUstream, std::ffi::c_uint, *mut std::ffi::c_void);
    type Declared = unsafe extern "C" fn(sys::CUstream, sys::CUresult, *mut std::ffi::c_void);
    // SAFETY: the two types differ only in the status parameter, a C enum passed as a
    // 32-bit unsigned integer either way (`CUresult` is `repr(u32)`).
    Some(unsafe { std::mem::transmute::<Plain, Declared>(copy_done) })
}

impl GpuDriver for Cuda {
    fn info(&self) -> GpuInfo {
        GpuInfo {
            driver: self.driver.clone(),
            devices: self.devices,
        }
    }

    fn bind(&self, device: u32) -> Result<()> {
        const OP: &str = "bind a CUDA context";
        let PrimaryCtx(ctx) = self.context(device)?;
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: an out-parameter of the declared type; `ctx` is a retained primary
        // context.
        unsafe {
            cu(OP, (self.calls.cuCtxGetCurrent)(&mut current))?;
            if current != ctx {
                cu(OP, (self.calls.cuCtxSetCurrent)(ctx))?;
            }
        }
        Ok(())
    }

    fn scoped(&self, device: u32, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.on(device, f)
    }

    fn alloc(&self, device: u32, len: usize) -> Result<(u64, Box<dyn Any + Send + Sync>)> {
        const OP: &str = "allocate GPU memory";
        let mut ptr: sys::CUdeviceptr = 0;
        self.on(device, || {
            // SAFETY: a plain cuMemAlloc of `len` bytes in the device's context; the
            // pointer is owned by the CudaAlloc returned, which frees it.
            cu(OP, unsafe {
                (self.calls.cuMemAlloc_v2)(&mut ptr, len.max(1))
            })
        })?;
        Ok((ptr, Box::new(CudaAlloc { device, ptr })))
    }

    fn alloc_pinned(&self, len: usize) -> Result<(usize, Box<dyn Any + Send + Sync>)> {
        const OP: &str = "allocate page-locked memory";
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // Any context will do: portable memory is pinned for every context.
        self.in_ctx(self.any_ctx()?, || {
            // SAFETY: a plain cuMemHostAlloc of `len` bytes; the CudaPinned returned
            // owns and frees it.
            cu(OP, unsafe {
                (self.calls.cuMemHostAlloc)(&mut ptr, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
            })
        })?;
        let ptr = ptr as usize;
        Ok((ptr, Box::new(CudaPinned { ptr })))
    }

    fn dma_buf(&self, device: u32, start: u64, len: usize) -> Result<std::os::fd::OwnedFd> {
        const OP: &str = "export GPU memory as a dma-buf";
        let mut fd: std::ffi::c_int = -1;
        let r = self.on(device, || {
            // SAFETY: `fd` is the int the driver writes the descriptor to; the range
            // is only read by the driver (it checks it is device memory).
            Ok(unsafe {
                (self.calls.cuMemGetHandleForAddressRange)(
                    (&mut fd as *mut std::ffi::c_int).cast(),
                    start,
                    len,
                    sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                    0,
                )
            })
        })?;
        if r != 0 {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "{start:#x}+{len} on GPU {device}: cuMemGetHandleForAddressRange: {} (dma-buf export needs CUDA 11.7+, a driver and kernel with dma-buf support, and memory from cuMemAlloc or cuMemCreate)",
                    cu_name(r)
                ),
            );
        }
        if fd < 0 {
            return err(
                ErrorKind::Backend,
                OP,
                format!("the driver returned descriptor {fd}"),
            );
        }
        // SAFETY: the driver opened `fd` for us; nothing else owns it.
        Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }

    unsafe fn copy_async(
        &self,
        device: u32,
        dir: Direction,
        dev: u64,
        host: *mut u8,
        len: usize,
        done: Box<dyn FnOnce(i32) + Send>,
    ) -> Result<()> {
        const OP: &str = "start a GPU copy";
        self.on(device, || {
            let Stream(stream) = self.stream(device, dir)?;
            // SAFETY: the caller's contract: device memory at `dev`, page-locked host
            // memory at `host`, `len` bytes each, alive until `done` runs.
            cu(OP, unsafe {
                match dir {
                    Direction::ToHost => {
                        (self.calls.cuMemcpyDtoHAsync_v2)(host.cast(), dev, len, stream)
                    }
                    Direction::ToDevice => {
                        (self.calls.cuMemcpyHtoDAsync_v2)(dev, host.cast(), len, stream)
                    }
                }
            })?;
            let data: *mut Box<dyn FnOnce(i32) + Send> = Box::into_raw(Box::new(done));
            // SAFETY: `copy_done` has the callback's signature and takes back `data`,
            // which the driver passes to it exactly once.
            let added = cu(OP, unsafe {
                (self.calls.cuStreamAddCallback)(stream, copy_done_callback(), data.cast(), 0)
            });
            if let Err(e) = added {
                // Nothing will report the queued copy: wait for it here, so the memory
                // the caller holds may go when this returns.
                // SAFETY: the callback was not added, so `data` is still ours; the
                // stream is live (never destroyed).
                unsafe {
                    drop(Box::from_raw(data));
                    let _ = (self.calls.cuStreamSynchronize)(stream);
                }
                return Err(e);
            }
            Ok(())
        })
    }

    unsafe fn copy_to_host(&self, device: u32, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        self.on(device, || {
            // SAFETY: the caller's contract: device memory at `src`, host memory at
            // `dst`, `len` bytes each, alive for the (synchronous) copy.
            cu("copy GPU memory to the host", unsafe {
                (self.calls.cuMemcpyDtoH_v2)(dst.cast(), src, len)
            })
        })
    }

    unsafe fn copy_from_host(
        &self,
        device: u32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "copy host memory to the GPU";
        self.on(device, || {
            // SAFETY: as in `copy_to_host`, the other way round. From pageable memory
            // the call may return before the DMA lands; synchronising the legacy
            // stream it ran on makes the bytes visible to every later copy, including
            // the staging streams, which do not wait for the legacy stream.
            unsafe {
                cu(OP, (self.calls.cuMemcpyHtoD_v2)(dst, src.cast(), len))?;
                cu(OP, (self.calls.cuStreamSynchronize)(std::ptr::null_mut()))
            }
        })
    }

    unsafe fn device_to_device(
        &self,
        dst_device: u32,
        dst: u64,
        src_device: u32,
        src: u64,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "copy between GPU buffers";
        if src_device != dst_device {
            // The source's context must exist (retained) for a peer copy.
            self.context(src_device)?;
        }
        self.on(dst_device, || {
            // SAFETY: both ranges are device memory alive for the call (the caller's
            // contract); with unified addressing cuMemcpy finds their devices itself.
            // A device-to-device cuMemcpy does not wait for its copy: synchronising
            // the legacy stream does, as above.
            unsafe {
                cu(OP, (self.calls.cuMemcpy)(dst, src, len))?;
                cu(OP, (self.calls.cuStreamSynchronize)(std::ptr::null_mut()))
            }
        })
    }
}

/// Held for writing, it pauses the host stand-in's asynchronous copies (tests).
#[cfg(feature = "gpu-test-double")]
static STAND_IN_COPIES: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Host memory posing as device memory: copies are `memcpy`. Tests only.
#[cfg(feature = "gpu-test-double")]
#[derive(Debug)]
struct HostStandIn;

#[cfg(feature = "gpu-test-double")]
impl GpuDriver for HostStandIn {
    fn info(&self) -> GpuInfo {
        GpuInfo {
            driver: "host stand-in (test double: device memory is host memory)".to_owned(),
            devices: 2,
        }
    }

    fn bind(&self, device: u32) -> Result<()> {
        if device >= 2 {
            return err(
                ErrorKind::InvalidArgument,
                "bind a CUDA context",
                format!("GPU {device} does not exist (2 visible)"),
            );
        }
        Ok(())
    }

    fn scoped(&self, device: u32, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.bind(device)?;
        f()
    }

    fn alloc(
        &self,
        device: u32,
        len: usize,
    ) -> Result<(u64, Box<dyn std::any::Any + Send + Sync>)> {
        self.bind(device)?;
        let buf = crate::memory::AlignedBuf::new(len);
        Ok((buf.as_mut_ptr() as u64, Box::new(buf)))
    }

    fn alloc_pinned(&self, len: usize) -> Result<(usize, Box<dyn Any + Send + Sync>)> {
        let buf = crate::memory::AlignedBuf::new(len.max(1));
        Ok((buf.as_mut_ptr() as usize, Box::new(buf)))
    }

    unsafe fn copy_async(
        &self,
        device: u32,
        dir: Direction,
        dev: u64,
        host: *mut u8,
        len: usize,
        done: Box<dyn FnOnce(i32) + Send>,
    ) -> Result<()> {
        self.bind(device)?;
        let host = host as usize;
        // The copy runs later, on a thread of its own, as a GPU's copy engine would.
        std::thread::Builder::new()
            .name("gpu-stand-in-copy".into())
            .spawn(move || {
                let (src, dst) = match dir {
                    Direction::ToHost => (dev as usize, host),
                    Direction::ToDevice => (host, dev as usize),
                };
                if dir == Direction::ToDevice && len >= 1 << 20 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                let _running = STAND_IN_COPIES
                    .read()
                    .unwrap_or_else(PoisonError::into_inner);
                // SAFETY: the caller's contract keeps both ranges alive and untouched
                // until `done`; the "device" memory is host memory here.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                done(0);
            })
            .map_err(|e| Error::new(ErrorKind::Backend, "start a GPU copy", e.to_string()))?;
        Ok(())
    }

    fn dma_buf(&self, device: u32, _start: u64, _len: usize) -> Result<std::os::fd::OwnedFd> {
        self.bind(device)?;
        // Host memory has no dma-buf: a descriptor of /dev/null stands in for one (the
        // verbs test double registers the range by address and only checks the
        // descriptor is open).
        std::fs::File::open("/dev/null")
            .map(std::os::fd::OwnedFd::from)
            .map_err(|e| {
                Error::new(
                    ErrorKind::Backend,
                    "export GPU memory as a dma-buf",
                    e.to_string(),
                )
            })
    }

    unsafe fn copy_to_host(&self, _device: u32, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller's contract; the "device" memory is host memory here.
        unsafe { std::ptr::copy(src as usize as *const u8, dst, len) };
        Ok(())
    }

    unsafe fn copy_from_host(
        &self,
        _device: u32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        // A device copy takes time: large ones land late, so code that reports data
        // before its copy finished is caught (a real copy of 1 MiB over PCIe takes
        // tens of microseconds).
        if len >= 1 << 20 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        // SAFETY: as above.
        unsafe { std::ptr::copy(src, dst as usize as *mut u8, len) };
        Ok(())
    }

    unsafe fn device_to_device(
        &self,
        _dst_device: u32,
        dst: u64,
        _src_device: u32,
        src: u64,
        len: usize,
    ) -> Result<()> {
        // SAFETY: as above.
        unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, len) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    /// Without a driver (the CI machines), asking for the GPU is an error value that
    /// names what is missing, never a panic; nothing else is affected.
    #[test]
    fn no_driver_is_an_error_naming_it() {
        if std::path::Path::new("/dev/nvidiactl").exists() {
            nixl_testkit::skip(
                "no_driver_is_an_error_naming_it",
                "this machine has an NVIDIA driver",
            );
            return;
        }
        // The public path, unless a stand-in test in this process has replaced the
        // driver (`cargo test` runs them in one process): then the CUDA check itself.
        let status = || match super::STAND_IN.get() {
            None => super::status(),
            Some(_) => super::cuda().map(|c| super::GpuDriver::info(&*c)),
        };
        let e = status().unwrap_err();
        assert!(
            matches!(
                e.kind(),
                crate::ErrorKind::UnavailableLibrary | crate::ErrorKind::NotSupported
            ),
            "{e}"
        );
        assert!(e.to_string().contains("libcuda.so.1"), "{e}");
        // Asking again gives the same answer (checked once), still without a panic.
        assert_eq!(status().unwrap_err().to_string(), e.to_string());
        if super::STAND_IN.get().is_none() {
            assert!(super::bind_thread(0).is_err());
            assert!(super::PinnedBuf::new(4096).is_err());
        }
    }

    /// Staging through pinned buffers, on the host stand-in (a test double for the
    /// device copies: this tests the bookkeeping around them, not CUDA).
    #[cfg(feature = "gpu-test-double")]
    mod stand_in {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        use std::time::{Duration, Instant};

        use super::super::{bury, use_host_stand_in, PinnedBuf, ORPHANS, STAND_IN_COPIES};
        use crate::region::{RegionInner, RegionRef};
        use crate::{ErrorKind, MemKind, Memory};

        fn region(mem: Memory) -> RegionRef {
            RegionRef {
                inner: Arc::new(RegionInner {
                    id: 1,
                    mem,
                    inflight: AtomicUsize::new(0),
                    registered: AtomicBool::new(true),
                    backends: Mutex::new(Vec::new()),
                }),
            }
        }

        fn pattern(len: usize, seed: u8) -> Vec<u8> {
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                .collect()
        }

        #[tokio::test]
        async fn copies_move_the_bytes_both_ways() {
            use_host_stand_in();
            let len = (5 << 20) + 123;
            let r = region(Memory::vram(1, len).unwrap());
            let whole = r.slice(0, len).unwrap();
            let data = pattern(len, 9);
            whole.write_from(0, &data).unwrap();

            // Device to host, from an offset, into a larger buffer.
            let s = r.slice(4096, 3 << 20).unwrap();
            let buf = PinnedBuf::new(4 << 20).unwrap();
            assert_eq!(buf.len(), 4 << 20);
            let buf = s.copy_to_pinned(100, buf, 2 << 20).unwrap().await.unwrap();
            assert_eq!(&buf[..2 << 20], &data[4096 + 100..4096 + 100 + (2 << 20)]);

            // Host to device (1 MiB and more land late on the stand-in: the future
            // resolves only after).
            let mut buf = buf;
            buf[..2 << 20].copy_from_slice(&pattern(2 << 20, 77));
            let _buf = s.copy_from_pinned(7, buf, 2 << 20).unwrap().await.unwrap();
            let mut got = vec![0u8; 2 << 20];
            s.read_into(7, &mut got).unwrap();
            assert_eq!(got, pattern(2 << 20, 77));
            // The bytes around it are untouched.
            let mut edge = [0u8; 7];
            s.read_into(0, &mut edge).unwrap();
            assert_eq!(&edge[..], &data[4096..4096 + 7]);

            // Host memory is copied at once, through the same calls.
            let host = region(Memory::from(pattern(8192, 3)));
            let hs = host.slice(0, 8192).unwrap();
            let b = hs
                .copy_to_pinned(0, PinnedBuf::new(8192).unwrap(), 8192)
                .unwrap();
            assert_eq!(&b.await.unwrap()[..], &pattern(8192, 3)[..]);
        }

        /// The export covers whole host pages around the range; the offset says where
        /// the range starts in it.
        #[test]
        fn dma_buf_covers_whole_pages() {
            use_host_stand_in();
            let d = super::super::dma_buf(0, 0x10_0000 + 100, 5000).unwrap();
            assert_eq!((d.offset, d.len), (100, 8192));
            let d = super::super::dma_buf(1, 0x10_0000, 4096).unwrap();
            assert_eq!((d.offset, d.len), (0, 4096));
            for (addr, len) in [(0x1000, 0), (u64::MAX - 10, 100)] {
                let e = super::super::dma_buf(0, addr, len).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
            }
            assert!(
                super::super::dma_buf(2, 0x1000, 1).is_err(),
                "GPU 2 does not exist"
            );
        }

        #[tokio::test]
        async fn out_of_range_copies_are_refused() {
            use_host_stand_in();
            let r = region(Memory::vram(0, 1 << 20).unwrap());
            let s = r.slice(4096, 8192).unwrap();
            let e = s
                .copy_to_pinned(4096, PinnedBuf::new(8192).unwrap(), 8192)
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
            let e = s
                .copy_from_pinned(0, PinnedBuf::new(100).unwrap(), 101)
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
        }

        /// Owns the stand-in "device memory" of a test and records, when freed,
        /// whether the copy into it had finished by then.
        struct Watch {
            mem: crate::AlignedBuf,
            expect: Vec<u8>,
            freed: Arc<AtomicBool>,
            complete: Arc<AtomicBool>,
        }

        impl Drop for Watch {
            fn drop(&mut self) {
                let mut now = vec![0u8; self.expect.len()];
                // SAFETY: the buffer is alive (we own it) and nothing else uses it
                // once its last holder let go.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.mem.as_mut_ptr(),
                        now.as_mut_ptr(),
                        now.len(),
                    )
                };
                self.complete.store(now == self.expect, Ordering::SeqCst);
                self.freed.store(true, Ordering::SeqCst);
            }
        }

        /// A copy whose future and memory handles are all dropped before it ran keeps
        /// the memory and its buffer alive until it has finished.
        #[test]
        fn a_dropped_copy_keeps_its_memory_until_it_finished() {
            use_host_stand_in();
            let len = 64 << 10;
            let expect = pattern(len, 5);
            let (freed, complete) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicBool::new(false)),
            );
            let mem = crate::AlignedBuf::new(len);
            let ptr = mem.as_mut_ptr();
            let watch = Watch {
                mem,
                expect: expect.clone(),
                freed: freed.clone(),
                complete: complete.clone(),
            };
            // SAFETY: `ptr..ptr+len` is the Watch's buffer, which the Memory owns (as
            // its owner) and keeps alive; on the stand-in, device memory is host
            // memory.
            let mem = unsafe {
                Memory::from_raw_parts_with_owner(
                    ptr,
                    len,
                    MemKind::Vram { device: 0 },
                    Some(watch),
                )
            }
            .unwrap();
            let r = region(mem);
            let mut buf = PinnedBuf::new(len).unwrap();
            buf.copy_from_slice(&expect);
            {
                // Copies wait while this is held.
                let _paused = STAND_IN_COPIES.write().unwrap();
                let copy = r
                    .slice(0, len)
                    .unwrap()
                    .copy_from_pinned(0, buf, len)
                    .unwrap();
                drop(copy);
                drop(r);
                bury();
                assert!(
                    !freed.load(Ordering::SeqCst),
                    "memory freed under a running copy"
                );
                assert!(!ORPHANS.lock().unwrap().is_empty());
            }
            // The copy runs now; the next bury after it finished frees the memory.
            let start = Instant::now();
            while !freed.load(Ordering::SeqCst) {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "the copy never finished"
                );
                std::thread::sleep(Duration::from_millis(1));
                bury();
            }
            assert!(
                complete.load(Ordering::SeqCst),
                "memory freed before the copy landed"
            );
        }
    }
}
