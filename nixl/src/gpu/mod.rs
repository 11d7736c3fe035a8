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
//! frees them then (woken by the copy's completion, never polling; joined when the
//! process's last agent shuts down).
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
//! [`ErrorKind::UnavailableLibrary`]: crate::ErrorKind::UnavailableLibrary
//! [`ErrorKind::NotSupported`]: crate::ErrorKind::NotSupported
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
//!
//! # Parts
//! `driver` (the operations the crate asks of a driver), `cuda` (the CUDA binding),
//! `stand_in` (the host stand-in), `access` (which one this process uses), `pinned`
//! (the page-locked pool), `copy` and `reaper` (asynchronous staging copies and what
//! outlives their futures), `dma_buf` (export for NICs), `ipc` (memory shared with
//! other processes of the host, and batched device-to-device copies). Each imports only those
//! before it in this list.

mod access;
mod copy;
mod cuda;
mod dma_buf;
mod driver;
mod gather;
mod ipc;
mod pinned;
pub(crate) mod reaper;
#[cfg(feature = "gpu-test-double")]
mod stand_in;
#[cfg(test)]
mod tests;

pub(crate) use access::driver;
#[cfg(feature = "gpu-test-double")]
pub use access::use_host_stand_in;
pub use access::{bind_thread, status, with_context};
pub(crate) use copy::start_copy;
pub use copy::GpuCopy;
pub use dma_buf::{dma_buf, DmaBuf};
pub(crate) use driver::Direction;
pub use driver::{GpuInfo, DEFAULT_SONAME, ENV_GATHER, ENV_LIB, MIN_DRIVER};
pub use ipc::{copy_device_batch, ipc_export, ipc_open, IpcExport, IpcMapping, IPC_HANDLE_LEN};
pub use pinned::{PinnedBuf, PINNED_POOL_BYTES};
