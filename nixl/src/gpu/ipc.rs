//! GPU memory shared between processes of one host (CUDA's inter-process handles),
//! and batches of device-to-device copies with one completion: what a backend needs
//! to move GPU memory between agents on one host at device speed, without staging.
//!
//! # What CUDA guarantees, and what this module asks of its users
//! A handle (`cuIpcGetMemHandle`) names a whole `cuMemAlloc` allocation, so the
//! exporter sends the allocation's base with it and the importer adds the offset of
//! the registration. Opening one (`cuIpcOpenMemHandle`) maps the allocation into the
//! importer's address space, on the importer's device (with peer access where the
//! exporter's GPU is another one). CUDA documents freeing exported memory while
//! another process still has it open as **undefined behaviour**: an exporter must
//! not free (or deregister, for memory it does not own) before every importer has
//! closed its mapping ([`IpcMapping`] closes on drop). Backends using this module
//! therefore count open mappings, not only copies in flight, before a deregistration
//! returns. Memory from `cuMemCreate` (virtual memory management, e.g. PyTorch's
//! expandable segments) and from stream-ordered pools has no such handle: export fails
//! with [`ErrorKind::NotSupported`] and the caller uses another path.
//!
//! # Completion
//! [`copy_device_batch`] queues every copy of a request on one stream of the
//! importer's device and adds one host callback after them: no thread waits on the
//! GPU, and the callback runs once the device has finished every copy. What the
//! copies need alive (mappings, registrations) is handed in as `hold` and freed on
//! the reaper's thread afterwards, since the callback may make no CUDA call.

#![allow(unsafe_code)] // starts driver copies on memory the caller vouches for

use std::any::Any;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use super::access::driver;
use super::driver::cu_name;
pub use super::driver::{IpcExport, IPC_HANDLE_LEN};
use super::reaper;
#[cfg(doc)]
use crate::error::ErrorKind;
use crate::error::{Error, Result};

/// Export the GPU allocation holding `addr` on `device` for other processes.
///
/// # Errors
/// [`ErrorKind::NotSupported`] where the memory has no inter-process handle (not from
/// `cuMemAlloc`, or the host stand-in); as [`status`](super::status) without a driver.
pub fn ipc_export(device: u32, addr: u64) -> Result<IpcExport> {
    driver()?.ipc_export(device, addr)
}

/// Another process's GPU allocation, mapped into this one on `device`; closed when
/// dropped. Drop it only once no copy uses it (the copies' `hold` keeps it alive).
pub struct IpcMapping {
    device: u32,
    base: u64,
    len: u64,
    _owner: Box<dyn Any + Send + Sync>,
}

impl IpcMapping {
    /// Where the allocation starts in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// How many bytes the driver mapped from [`IpcMapping::base`]: copies through
    /// the mapping must stay inside them, whatever the exporter said its allocation
    /// was.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing is mapped (never, for a mapping the driver made).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device whose context it was opened in.
    pub fn device(&self) -> u32 {
        self.device
    }
}

impl fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMapping")
            .field("device", &self.device)
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish()
    }
}

/// Open a handle another process exported, in `device`'s context.
///
/// # Errors
/// [`ErrorKind::NotSupported`] when the driver refuses the handle (made by this
/// process, its memory freed, the exporter gone, no peer access between the GPUs);
/// as [`status`](super::status) without a driver.
pub fn ipc_open(device: u32, handle: &[u8; IPC_HANDLE_LEN]) -> Result<IpcMapping> {
    let (base, len, owner) = driver()?.ipc_open(device, handle)?;
    Ok(IpcMapping {
        device,
        base,
        len,
        _owner: owner,
    })
}

/// Start copying between device memories, `copies` being (destination, source,
/// length), in order on `device`'s device-to-device stream: as one kernel launch
/// (a gather kernel nixl ships as PTX, loaded once per device) when `one_kernel` and
/// there are several, else one copy-engine copy each. `done` runs once, after
/// the device finished them all, with their outcome, on a driver thread: it must
/// make no CUDA call and free nothing that needs one (it may complete futures and
/// queue messages). `hold` lives until then and is dropped afterwards on the GPU
/// reaper's thread. On `Err` nothing is in flight, `done` is not called and `hold`
/// is dropped before this returns.
///
/// # Safety
/// Every range is device memory (this process's, or inside an [`IpcMapping`]) that
/// `hold` or its owners keep alive until `done` has run; no range is written by
/// anyone else meanwhile, and no destination overlaps a source. With `one_kernel`,
/// every range is `device`'s own memory or inside an [`IpcMapping`] opened on
/// `device` (which has peer access to it): memory of another GPU of this process
/// may not be reachable from `device`'s kernels.
pub unsafe fn copy_device_batch(
    device: u32,
    copies: &[(u64, u64, usize)],
    one_kernel: bool,
    hold: Box<dyn Any + Send>,
    done: Box<dyn FnOnce(Result<()>) + Send>,
) -> Result<()> {
    let gpu = driver()?;
    let Some(grave) = reaper::adopt() else {
        return Err(Error::new(
            crate::error::ErrorKind::Backend,
            "start a GPU copy",
            "cannot start the GPU reaper thread",
        ));
    };
    // Shared with the callback, so that a failed start gets `hold` back.
    let held = std::sync::Arc::new(Mutex::new(Some(hold)));
    let kept = held.clone();
    let finished = Box::new(move |status: i32| {
        done(if status == 0 {
            Ok(())
        } else {
            Err(Error::new(
                crate::error::ErrorKind::Backend,
                "copy GPU memory",
                format!("a device-to-device copy failed: {}", cu_name(status as u32)),
            ))
        });
        let hold = kept.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(h) = hold {
            grave.bury(h);
        }
    });
    // SAFETY: the caller's contract; `hold` stays alive until the callback ran.
    let started = unsafe { gpu.copy_device_async(device, copies, one_kernel, finished) };
    if started.is_err() {
        // The callback will not run: nothing is in flight, drop here.
        drop(held.lock().unwrap_or_else(PoisonError::into_inner).take());
    }
    started
}
