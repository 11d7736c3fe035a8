//! What the rest of the crate asks of a GPU driver: the operations, the process's GPU
//! description and the driver's result names. The floor of [`crate::gpu`]; the CUDA
//! binding and the host stand-in implement it.
#![allow(unsafe_code)] // declares the driver's unsafe operations; calls none

use std::any::Any;
use std::fmt;

use crate::error::Result;

/// Environment variable naming the CUDA driver library to load.
pub const ENV_LIB: &str = "NIXL_CUDA_LIB";
/// Environment variable that, set to `off`, keeps a transfer's device-to-device
/// copies on the copy engine instead of the gather kernel (whose blocks need free
/// SMs: an application whose persistent kernels occupy every SM while waiting for
/// the data would otherwise wait for itself).
pub const ENV_GATHER: &str = "NIXL_GPU_GATHER";
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

    /// The allocation holding `addr` on `device` (its base and length) and an
    /// inter-process handle naming it.
    fn ipc_export(&self, device: u32, addr: u64) -> Result<IpcExport>;

    /// Open another process's handle in `device`'s context: the allocation's address
    /// in this process, the length the driver mapped there, and the owner that closes
    /// it when dropped (never from a driver callback).
    fn ipc_open(
        &self,
        device: u32,
        handle: &[u8; IPC_HANDLE_LEN],
    ) -> Result<(u64, u64, Box<dyn Any + Send + Sync>)>;

    /// Start the device-to-device copies `copies` (destination, source, length) in
    /// order on `device`'s stream for such copies, and call `done` exactly once after
    /// the last finished, with the driver's status (0: success), from a driver thread
    /// where it must not call CUDA. With `one_kernel` they may run as one kernel on
    /// `device` (see `gather`). On `Err` no copy is in flight any more and `done` is
    /// not called.
    ///
    /// # Safety
    /// Every range is device memory (of this process, or opened through a handle)
    /// that stays alive, and that nobody else writes, until `done` has been called;
    /// no destination overlaps a source. With `one_kernel`, every range is reachable
    /// by `device`'s kernels: its own memory, or memory opened through a handle
    /// (which enables peer access).
    unsafe fn copy_device_async(
        &self,
        device: u32,
        copies: &[(u64, u64, usize)],
        one_kernel: bool,
        done: Box<dyn FnOnce(i32) + Send>,
    ) -> Result<()>;
}

/// Bytes of an inter-process memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_LEN: usize = 64;

/// A GPU allocation exported for other processes on this host: the handle names the
/// whole allocation, which starts at `base` and is `len` bytes long.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// The driver's handle (opaque bytes).
    pub handle: [u8; IPC_HANDLE_LEN],
    /// Start of the allocation in the exporting process.
    pub base: u64,
    /// Its length.
    pub len: u64,
}

impl fmt::Debug for IpcExport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The handle is a capability: never in logs.
        f.debug_struct("IpcExport")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Which way an asynchronous copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Direction {
    /// Device memory to host memory.
    ToHost,
    /// Host memory to device memory.
    ToDevice,
}

/// A driver result's name, for the codes worth naming (the number otherwise).
pub(crate) fn cu_name(r: std::ffi::c_uint) -> String {
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
