//! The CUDA driver binding: the pre-check of `libcuda.so.1` through the core's loader,
//! cudarc's declarations bound to that same library (results narrowed to plain
//! integers), primary contexts, streams, and the driver operations on top.
#![allow(unsafe_code)]

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys;

use super::driver::{
    cu_name, Direction, GpuDriver, GpuInfo, IpcExport, DEFAULT_SONAME, ENV_LIB, IPC_HANDLE_LEN,
    MIN_DRIVER,
};
use super::gather;
use crate::error::{err, Error, ErrorKind, Result};
use crate::native::NativeLibrary;

static CUDA: OnceLock<std::result::Result<Arc<Cuda>, Error>> = OnceLock::new();

/// The CUDA driver, checked once (whatever the stand-in).
pub(super) fn cuda() -> Result<Arc<Cuda>> {
    match CUDA.get_or_init(|| Cuda::probe().map(Arc::new)) {
        Ok(c) => Ok(c.clone()),
        Err(e) => Err(e.cloned()),
    }
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
    cuMemGetAddressRange_v2: unsafe extern "C" fn(
        *mut sys::CUdeviceptr,
        *mut usize,
        sys::CUdeviceptr,
    ) -> std::ffi::c_uint,
    cuIpcGetMemHandle:
        unsafe extern "C" fn(*mut sys::CUipcMemHandle, sys::CUdeviceptr) -> std::ffi::c_uint,
    cuIpcOpenMemHandle_v2: unsafe extern "C" fn(
        *mut sys::CUdeviceptr,
        sys::CUipcMemHandle,
        std::ffi::c_uint,
    ) -> std::ffi::c_uint,
    cuIpcCloseMemHandle: unsafe extern "C" fn(sys::CUdeviceptr) -> std::ffi::c_uint,
    cuMemcpyDtoDAsync_v2: unsafe extern "C" fn(
        sys::CUdeviceptr,
        sys::CUdeviceptr,
        usize,
        sys::CUstream,
    ) -> std::ffi::c_uint,
    cuModuleLoadData:
        unsafe extern "C" fn(*mut sys::CUmodule, *const std::ffi::c_void) -> std::ffi::c_uint,
    cuModuleGetFunction: unsafe extern "C" fn(
        *mut sys::CUfunction,
        sys::CUmodule,
        *const std::ffi::c_char,
    ) -> std::ffi::c_uint,
    #[allow(clippy::type_complexity)]
    cuLaunchKernel: unsafe extern "C" fn(
        sys::CUfunction,
        std::ffi::c_uint,
        std::ffi::c_uint,
        std::ffi::c_uint,
        std::ffi::c_uint,
        std::ffi::c_uint,
        std::ffi::c_uint,
        std::ffi::c_uint,
        sys::CUstream,
        *mut *mut std::ffi::c_void,
        *mut *mut std::ffi::c_void,
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
            cuMemGetAddressRange_v2: narrow!(
                lib,
                cuMemGetAddressRange_v2,
                (*mut CUdeviceptr, *mut usize, CUdeviceptr)
            ),
            cuIpcGetMemHandle: narrow!(
                lib,
                cuIpcGetMemHandle,
                (*mut sys::CUipcMemHandle, CUdeviceptr)
            ),
            cuIpcOpenMemHandle_v2: narrow!(
                lib,
                cuIpcOpenMemHandle_v2,
                (*mut CUdeviceptr, sys::CUipcMemHandle, c_uint)
            ),
            cuIpcCloseMemHandle: narrow!(lib, cuIpcCloseMemHandle, (CUdeviceptr)),
            cuMemcpyDtoDAsync_v2: narrow!(
                lib,
                cuMemcpyDtoDAsync_v2,
                (CUdeviceptr, CUdeviceptr, usize, CUstream)
            ),
            cuModuleLoadData: narrow!(lib, cuModuleLoadData, (*mut sys::CUmodule, *const c_void)),
            cuModuleGetFunction: narrow!(
                lib,
                cuModuleGetFunction,
                (*mut sys::CUfunction, sys::CUmodule, *const std::ffi::c_char)
            ),
            cuLaunchKernel: narrow!(
                lib,
                cuLaunchKernel,
                (
                    sys::CUfunction,
                    c_uint,
                    c_uint,
                    c_uint,
                    c_uint,
                    c_uint,
                    c_uint,
                    c_uint,
                    CUstream,
                    *mut *mut c_void,
                    *mut *mut c_void
                )
            ),
        }
    }
}

/// The CUDA driver after the pre-check, called through cudarc's declarations bound to
/// the library the check opened (never through cudarc's own loader, which searches
/// its own list of names and panics on a miss).
pub(super) struct Cuda {
    /// cudarc's binding: it holds the library, and [`Calls`] come from it.
    _lib: sys::Lib,
    calls: Calls,
    driver: String,
    devices: u32,
    /// Each device's primary context, retained once and kept for the process.
    contexts: Mutex<HashMap<u32, PrimaryCtx>>,
    /// The asynchronous copies' streams, created on first use and kept for the
    /// process: staging one way, staging the other, device to device.
    streams: Mutex<HashMap<(u32, Lane), Stream>>,
    /// Each device's gather kernel, loaded on first use and kept for the process;
    /// `None` where the driver would not load it (copies go one by one there).
    gathers: Mutex<HashMap<u32, Option<Kernel>>>,
}

/// A loaded kernel's function handle.
#[derive(Clone, Copy)]
struct Kernel(sys::CUfunction);

// SAFETY: a CUfunction is an opaque driver handle of a module that is never
// unloaded; it may be launched from any thread with its context current.
unsafe impl Send for Kernel {}

/// What a stream carries: staging copies one way, or device-to-device copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Lane {
    Staging(Direction),
    Device,
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
            gathers: Mutex::new(HashMap::new()),
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

    /// The stream of `device`'s copies of one lane (the device's context must be
    /// current). Non-blocking: it does not wait for work on the default stream.
    fn stream(&self, device: u32, lane: Lane) -> Result<Stream> {
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = streams.get(&(device, lane)) {
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
        streams.insert((device, lane), Stream(s));
        Ok(Stream(s))
    }

    /// The gather kernel on `device` (its context current), loaded on first use;
    /// `None`, with the reason logged once, where the driver refuses it.
    fn gather(&self, device: u32) -> Option<Kernel> {
        let mut gathers = self.gathers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = gathers.get(&device) {
            return *k;
        }
        if std::env::var(super::driver::ENV_GATHER).is_ok_and(|v| v == "off") {
            tracing::info!(
                device,
                "gpu: NIXL_GPU_GATHER=off: device copies go one by one on the copy engine"
            );
            gathers.insert(device, None);
            return None;
        }
        let mut module: sys::CUmodule = std::ptr::null_mut();
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: out-parameters of the declared types; the image is NUL-terminated
        // PTX text and the name a C string, both static. The module is kept for the
        // process (never unloaded), so the function stays valid.
        let r = unsafe {
            match (self.calls.cuModuleLoadData)(&mut module, gather::PTX.as_ptr().cast()) {
                0 => (self.calls.cuModuleGetFunction)(&mut f, module, gather::ENTRY.as_ptr()),
                r => r,
            }
        };
        let k = if r == 0 {
            Some(Kernel(f))
        } else {
            tracing::warn!(
                device,
                error = cu_name(r),
                "gpu: cannot load the gather kernel; device copies go one by one on this GPU"
            );
            None
        };
        gathers.insert(device, k);
        k
    }

    /// Launch `launches` on `stream` in order. `Err(Some(status))`: the first
    /// failed, nothing was launched; `Err(None)`: a later one failed.
    ///
    /// # Safety
    /// As [`GpuDriver::copy_device_async`] with `one_kernel`.
    unsafe fn launch_gather(
        &self,
        Kernel(f): Kernel,
        stream: sys::CUstream,
        launches: Vec<gather::Launch>,
    ) -> std::result::Result<(), Option<std::ffi::c_uint>> {
        for (i, mut l) in launches.into_iter().enumerate() {
            let mut params = [std::ptr::addr_of_mut!(l.table).cast::<std::ffi::c_void>()];
            // SAFETY: the kernel's one parameter is the table, which the driver
            // copies during the call; the grid and block fit the kernel (see
            // `gather`); the ranges are the caller's contract.
            let r = unsafe {
                (self.calls.cuLaunchKernel)(
                    f,
                    l.grid_x,
                    l.grid_y,
                    1,
                    gather::THREADS,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            if r != 0 {
                return Err((i == 0).then_some(r));
            }
        }
        Ok(())
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

    /// Call `done` once the work queued on `stream` so far has finished (a stream
    /// callback). If that cannot be arranged, wait for the queued work here, so the
    /// memory the caller holds may go when this returns, and fail.
    fn then(&self, stream: sys::CUstream, done: Box<dyn FnOnce(i32) + Send>) -> Result<()> {
        let data: *mut Box<dyn FnOnce(i32) + Send> = Box::into_raw(Box::new(done));
        // SAFETY: `copy_done` has the callback's signature and takes back `data`,
        // which the driver passes to it exactly once.
        let added = cu("start a GPU copy", unsafe {
            (self.calls.cuStreamAddCallback)(stream, copy_done_callback(), data.cast(), 0)
        });
        if let Err(e) = added {
            // SAFETY: the callback was not added, so `data` is still ours; the stream
            // is live (never destroyed).
            unsafe {
                drop(Box::from_raw(data));
                let _ = (self.calls.cuStreamSynchronize)(stream);
            }
            return Err(e);
        }
        Ok(())
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

/// Another process's allocation opened with `cuIpcOpenMemHandle`, closed on drop (its
/// context bound first).
struct CudaIpc {
    device: u32,
    ptr: u64,
}

impl Drop for CudaIpc {
    fn drop(&mut self) {
        let Some(cuda) = Cuda::get() else { return };
        let closed = cuda.on(self.device, || {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and no copy
            // uses it any more (its last holder lets go after the copies finished).
            cu("close another process's GPU memory", unsafe {
                (cuda.calls.cuIpcCloseMemHandle)(self.ptr)
            })
        });
        if let Err(e) = closed {
            tracing::warn!(error = %e, "closing an inter-process GPU mapping failed");
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
            let Stream(stream) = self.stream(device, Lane::Staging(dir))?;
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
            self.then(stream, done)
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

    fn ipc_export(&self, device: u32, addr: u64) -> Result<IpcExport> {
        const OP: &str = "export GPU memory to another process";
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: zero bytes are a valid CUipcMemHandle (64 plain bytes).
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        let (r1, r2) = self.on(device, || {
            // SAFETY: out-parameters of the declared types; the driver only reads
            // `addr` (it checks it is device memory it allocated).
            let r1 = unsafe { (self.calls.cuMemGetAddressRange_v2)(&mut base, &mut len, addr) };
            if r1 != 0 {
                return Ok((r1, 0));
            }
            // SAFETY: as above; `base` starts an allocation of this process.
            Ok((r1, unsafe {
                (self.calls.cuIpcGetMemHandle)(&mut handle, base)
            }))
        })?;
        if r1 != 0 || r2 != 0 {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "{addr:#x} on GPU {device}: {} (inter-process handles need memory from cuMemAlloc/cudaMalloc; memory from cuMemCreate or a stream-ordered pool has none)",
                    if r1 != 0 {
                        format!("cuMemGetAddressRange: {}", cu_name(r1))
                    } else {
                        format!("cuIpcGetMemHandle: {}", cu_name(r2))
                    }
                ),
            );
        }
        let mut out = [0u8; IPC_HANDLE_LEN];
        for (o, b) in out.iter_mut().zip(handle.reserved.iter()) {
            *o = *b as u8;
        }
        Ok(IpcExport {
            handle: out,
            base,
            len: len as u64,
        })
    }

    fn ipc_open(
        &self,
        device: u32,
        handle: &[u8; IPC_HANDLE_LEN],
    ) -> Result<(u64, u64, Box<dyn Any + Send + Sync>)> {
        const OP: &str = "open another process's GPU memory";
        // SAFETY: zero bytes are a valid CUipcMemHandle (64 plain bytes).
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (o, b) in h.reserved.iter_mut().zip(handle) {
            *o = *b as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        let r = self.on(device, || {
            // SAFETY: an out-parameter of the declared type and a handle by value; the
            // driver checks the handle. Lazy peer access: the exporter's GPU may be
            // another one of this host.
            Ok(unsafe {
                (self.calls.cuIpcOpenMemHandle_v2)(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
                )
            })
        })?;
        if r != 0 {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!("cuIpcOpenMemHandle on GPU {device}: {}", cu_name(r)),
            );
        }
        // Closed on drop from here on, whatever follows.
        let owner = Box::new(CudaIpc { device, ptr });
        // How much the driver mapped: the one bound copies through it may trust (the
        // exporter's own word on its allocation is not enough).
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        let r = self.on(device, || {
            // SAFETY: out-parameters of the declared types; `ptr` was just mapped.
            Ok(unsafe { (self.calls.cuMemGetAddressRange_v2)(&mut base, &mut len, ptr) })
        })?;
        if r != 0 || base != ptr {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "cuMemGetAddressRange of the mapping at {ptr:#x} on GPU {device}: {} (base {base:#x})",
                    cu_name(r)
                ),
            );
        }
        Ok((ptr, len as u64, owner))
    }

    unsafe fn copy_device_async(
        &self,
        device: u32,
        copies: &[(u64, u64, usize)],
        one_kernel: bool,
        done: Box<dyn FnOnce(i32) + Send>,
    ) -> Result<()> {
        const OP: &str = "start a GPU copy";
        self.on(device, || {
            let Stream(stream) = self.stream(device, Lane::Device)?;
            let launches = if one_kernel { gather::plan(copies) } else { None };
            let kernel = launches.as_ref().and_then(|_| self.gather(device));
            if let (Some(launches), Some(k)) = (launches, kernel) {
                // SAFETY: the caller's contract, and every range reachable from this
                // device's kernels (`one_kernel`).
                match unsafe { self.launch_gather(k, stream, launches) } {
                    Ok(()) => return self.then(stream, done),
                    // Nothing was launched: the copy engine takes them.
                    Err(Some(r)) => {
                        tracing::warn!(device, error = cu_name(r), "gpu: the gather kernel did not launch; device copies go one by one on this GPU");
                        self.gathers
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(device, None);
                    }
                    Err(None) => {
                        // SAFETY: a live stream of this context.
                        unsafe {
                            let _ = (self.calls.cuStreamSynchronize)(stream);
                        }
                        return err(
                            crate::error::ErrorKind::Backend,
                            OP,
                            "a gather kernel launch failed after others were queued",
                        );
                    }
                }
            }
            for &(dst, src, len) in copies {
                // SAFETY: the caller's contract: both ranges are live device memory
                // until `done` runs. With unified addressing the driver finds each
                // pointer's device (peer copies included).
                let r = unsafe { (self.calls.cuMemcpyDtoDAsync_v2)(dst, src, len, stream) };
                if r != 0 {
                    // Those queued already must finish before the memory may go.
                    // SAFETY: a live stream of this context.
                    unsafe {
                        let _ = (self.calls.cuStreamSynchronize)(stream);
                    }
                    return cu(OP, r);
                }
            }
            self.then(stream, done)
        })
    }
}
