//! GPU memory (VRAM): owned device buffers, and the copies between device and host
//! memory the agent and host-staging backends make.
//!
//! **This module has not run on a GPU yet** (the machines it was built on have none);
//! the paths without a driver, and everything above the device copies (on a host
//! stand-in, see below), are tested.
//!
//! # Driver
//! CUDA's driver (`libcuda.so.1`, from the NVIDIA driver package) is loaded at run
//! time; nothing CUDA is needed to build. cudarc, which makes the calls, panics when
//! it cannot load the driver, so the driver is checked first through the core's own
//! loader: the library opens, its version is at least CUDA 12.0 (what the bindings
//! are made for), `cuInit` succeeds and a device exists. Any of these missing is an
//! error value naming it ([`ErrorKind::UnavailableLibrary`] without the library,
//! [`ErrorKind::NotSupported`] otherwise), checked once per process; no VRAM call
//! reaches cudarc before it passed. `NIXL_CUDA_LIB` names another driver library.
//!
//! # Contexts
//! Every call binds the device's **primary** context (the one CUDA runtime users such
//! as PyTorch share) to the calling thread first, so copies are correct from any
//! thread, including tokio workers a task moves between. Threads that call a
//! GPU-aware library themselves (a backend's progress thread driving UCX before 1.19)
//! call [`bind_thread`] once.
//!
//! # Owned buffers
//! [`Memory::vram`](crate::Memory::vram) allocates with `cuMemAlloc` (not from the
//! stream-ordered pool, whose memory NICs cannot always reach) and frees when the
//! last registration and in-flight transfer let go, like host buffers.
//!
//! # Host stand-in (tests)
//! With the cargo feature `gpu-test-double`, `use_host_stand_in()` makes this process
//! treat ordinary host allocations as "device memory": every device copy is a plain
//! `memcpy`. It exists so the logic above the copies (registration, staging in
//! backends, notification ordering) runs in CI; it proves nothing about CUDA.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

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

static STAND_IN: OnceLock<Arc<dyn GpuDriver>> = OnceLock::new();
static CUDA: OnceLock<std::result::Result<Arc<Cuda>, Error>> = OnceLock::new();

/// The process's GPU driver, checked once.
pub(crate) fn driver() -> Result<Arc<dyn GpuDriver>> {
    if let Some(s) = STAND_IN.get() {
        return Ok(s.clone());
    }
    match CUDA.get_or_init(|| Cuda::probe().map(Arc::new)) {
        Ok(c) => Ok(c.clone() as Arc<dyn GpuDriver>),
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
/// call).
///
/// # Errors
/// As [`status`]; [`ErrorKind::Backend`] from the driver.
pub fn bind_thread(device: u32) -> Result<()> {
    driver()?.bind(device)
}

/// From now on, this process's "device memory" is host memory and device copies are
/// `memcpy`: a **test double** for running VRAM code paths without a GPU. Calls made
/// before it (or by another process) are not affected; it cannot be undone.
#[cfg(feature = "gpu-test-double")]
pub fn use_host_stand_in() {
    let _ = STAND_IN.set(Arc::new(HostStandIn));
}

fn driver_error(op: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::new(ErrorKind::Backend, op, format!("CUDA: {e:?}"))
}

/// The CUDA driver, through cudarc, after the pre-check.
struct Cuda {
    driver: String,
    devices: u32,
    contexts: Mutex<HashMap<u32, Arc<cudarc::driver::CudaContext>>>,
}

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
    /// Check the driver without cudarc (which panics where it cannot load it), then
    /// hand over to cudarc.
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
        Ok(Self {
            driver: format!(
                "CUDA driver {}.{} ({path})",
                version / 1000,
                version % 1000 / 10
            ),
            devices: n as u32,
            contexts: Mutex::new(HashMap::new()),
        })
    }

    /// The primary context of `device`, retained once per process.
    fn context(&self, device: u32) -> Result<Arc<cudarc::driver::CudaContext>> {
        const OP: &str = "CUDA context";
        if device >= self.devices {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                format!("GPU {device} does not exist ({} visible)", self.devices),
            );
        }
        let mut ctxs = self.contexts.lock().unwrap();
        if let Some(c) = ctxs.get(&device) {
            return Ok(c.clone());
        }
        let c =
            cudarc::driver::CudaContext::new(device as usize).map_err(|e| driver_error(OP, e))?;
        ctxs.insert(device, c.clone());
        Ok(c)
    }
}

/// Device memory from `cuMemAlloc`, freed on drop (its context bound first).
struct CudaAlloc {
    ctx: Arc<cudarc::driver::CudaContext>,
    ptr: u64,
}

impl Drop for CudaAlloc {
    fn drop(&mut self) {
        let freed = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: `ptr` came from cuMemAlloc in this context and nothing uses it
            // any more (the memory's last holder lets go).
            unsafe { cudarc::driver::result::free_sync(self.ptr) }
        });
        if let Err(e) = freed {
            tracing::warn!(error = ?e, "freeing GPU memory failed");
        }
    }
}

impl GpuDriver for Cuda {
    fn info(&self) -> GpuInfo {
        GpuInfo {
            driver: self.driver.clone(),
            devices: self.devices,
        }
    }

    fn bind(&self, device: u32) -> Result<()> {
        self.context(device)?
            .bind_to_thread()
            .map_err(|e| driver_error("bind a CUDA context", e))
    }

    fn alloc(
        &self,
        device: u32,
        len: usize,
    ) -> Result<(u64, Box<dyn std::any::Any + Send + Sync>)> {
        const OP: &str = "allocate GPU memory";
        let ctx = self.context(device)?;
        ctx.bind_to_thread().map_err(|e| driver_error(OP, e))?;
        // SAFETY: a plain cuMemAlloc of `len` bytes in the bound context; the pointer
        // is owned by the CudaAlloc returned, which frees it.
        let ptr =
            unsafe { cudarc::driver::result::malloc_sync(len) }.map_err(|e| driver_error(OP, e))?;
        Ok((ptr, Box::new(CudaAlloc { ctx, ptr })))
    }

    unsafe fn copy_to_host(&self, device: u32, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        self.bind(device)?;
        // SAFETY: the caller's contract: device memory at `src`, host memory at `dst`,
        // `len` bytes each, alive for the (synchronous) copy.
        unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(dst.cast(), src, len) }
            .result()
            .map_err(|e| driver_error("copy GPU memory to the host", e))
    }

    unsafe fn copy_from_host(
        &self,
        device: u32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        self.bind(device)?;
        // SAFETY: as in `copy_to_host`, the other way round.
        unsafe { cudarc::driver::sys::cuMemcpyHtoD_v2(dst, src.cast(), len) }
            .result()
            .map_err(|e| driver_error("copy host memory to the GPU", e))
    }

    unsafe fn device_to_device(
        &self,
        dst_device: u32,
        dst: u64,
        src_device: u32,
        src: u64,
        len: usize,
    ) -> Result<()> {
        self.bind(dst_device)?;
        if src_device != dst_device {
            // The source's context must exist (retained) for a peer copy.
            self.context(src_device)?;
        }
        // SAFETY: both ranges are device memory alive for the call (the caller's
        // contract); with unified addressing cuMemcpy finds their devices itself.
        unsafe { cudarc::driver::sys::cuMemcpy(dst, src, len) }
            .result()
            .map_err(|e| driver_error("copy between GPU buffers", e))
    }
}

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

    fn alloc(
        &self,
        device: u32,
        len: usize,
    ) -> Result<(u64, Box<dyn std::any::Any + Send + Sync>)> {
        self.bind(device)?;
        let buf = crate::memory::AlignedBuf::new(len);
        Ok((buf.as_mut_ptr() as u64, Box::new(buf)))
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
        let e = super::status().unwrap_err();
        assert!(
            matches!(
                e.kind(),
                crate::ErrorKind::UnavailableLibrary | crate::ErrorKind::NotSupported
            ),
            "{e}"
        );
        assert!(e.to_string().contains("libcuda.so.1"), "{e}");
        // Asking again gives the same answer (checked once), still without a panic.
        assert_eq!(super::status().unwrap_err().to_string(), e.to_string());
        assert!(super::bind_thread(0).is_err());
    }
}
