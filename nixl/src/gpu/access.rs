//! Which driver this process's GPU calls go to (the CUDA driver, or the host stand-in
//! in tests), and the public calls that only need the driver.

use std::sync::{Arc, OnceLock};

use super::cuda::cuda;
use super::driver::{GpuDriver, GpuInfo};
#[cfg(feature = "gpu-test-double")]
use super::stand_in::HostStandIn;
#[cfg(doc)]
use crate::error::ErrorKind;
use crate::error::Result;

pub(super) static STAND_IN: OnceLock<Arc<dyn GpuDriver>> = OnceLock::new();

/// The process's GPU driver, checked once.
pub(crate) fn driver() -> Result<Arc<dyn GpuDriver>> {
    if let Some(s) = STAND_IN.get() {
        return Ok(s.clone());
    }
    cuda().map(|c| c as Arc<dyn GpuDriver>)
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
