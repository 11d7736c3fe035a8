//! Host memory posing as device memory, for tests (cargo feature `gpu-test-double`):
//! device copies are `memcpy`, asynchronous copies run later on a thread of their own.
//! It proves the logic above the device copies, nothing about CUDA.
#![allow(unsafe_code)]

use std::any::Any;
use std::sync::PoisonError;

use super::driver::{Direction, GpuDriver, GpuInfo, IpcExport, IPC_HANDLE_LEN};
use crate::error::{err, Error, ErrorKind, Result};

/// Held for writing, it pauses the host stand-in's asynchronous copies (tests).
#[cfg(feature = "gpu-test-double")]
pub(crate) static STAND_IN_COPIES: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Host memory posing as device memory: copies are `memcpy`. Tests only.
/// Device-to-device batches of the stand-in run in submission order, as on one
/// stream: (next turn to hand out, turn now running), and its wake-up.
#[cfg(feature = "gpu-test-double")]
static STAND_IN_ORDER: (std::sync::Mutex<(u64, u64)>, std::sync::Condvar) =
    (std::sync::Mutex::new((0, 0)), std::sync::Condvar::new());

#[cfg(feature = "gpu-test-double")]
#[derive(Debug)]
pub(super) struct HostStandIn;

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
        let buf = crate::aligned::AlignedBuf::new(len);
        Ok((buf.as_mut_ptr() as u64, Box::new(buf)))
    }

    fn alloc_pinned(&self, len: usize) -> Result<(usize, Box<dyn Any + Send + Sync>)> {
        let buf = crate::aligned::AlignedBuf::new(len.max(1));
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

    fn ipc_export(&self, device: u32, _addr: u64) -> Result<IpcExport> {
        self.bind(device)?;
        err(
            ErrorKind::NotSupported,
            "export GPU memory to another process",
            "the host stand-in has no inter-process handles",
        )
    }

    fn ipc_open(
        &self,
        device: u32,
        _handle: &[u8; IPC_HANDLE_LEN],
    ) -> Result<(u64, u64, Box<dyn Any + Send + Sync>)> {
        self.bind(device)?;
        err(
            ErrorKind::NotSupported,
            "open another process's GPU memory",
            "the host stand-in has no inter-process handles",
        )
    }

    unsafe fn copy_device_async(
        &self,
        device: u32,
        copies: &[(u64, u64, usize)],
        _one_kernel: bool,
        done: Box<dyn FnOnce(i32) + Send>,
    ) -> Result<()> {
        self.bind(device)?;
        let copies = copies.to_vec();
        // In submission order, as on one stream: each batch waits for its turn.
        let turn = {
            let mut o = STAND_IN_ORDER
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            o.0 += 1;
            o.0 - 1
        };
        let spawned = std::thread::Builder::new()
            .name("gpu-stand-in-copy".into())
            .spawn(move || {
                let (order, wake) = &STAND_IN_ORDER;
                let mut o = order.lock().unwrap_or_else(PoisonError::into_inner);
                while o.1 != turn {
                    o = wake.wait(o).unwrap_or_else(PoisonError::into_inner);
                }
                drop(o);
                // Later, as a device would finish them.
                if copies.iter().map(|c| c.2).sum::<usize>() >= 1 << 20 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                let _running = STAND_IN_COPIES
                    .read()
                    .unwrap_or_else(PoisonError::into_inner);
                for (dst, src, len) in copies {
                    // SAFETY: the caller's contract: both ranges are live "device"
                    // (host) memory until `done` runs.
                    unsafe {
                        std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, len)
                    };
                }
                done(0);
                order.lock().unwrap_or_else(PoisonError::into_inner).1 += 1;
                wake.notify_all();
            });
        if let Err(e) = spawned {
            // Give up the turn (in order) so later batches still run.
            let (order, wake) = &STAND_IN_ORDER;
            let mut o = order.lock().unwrap_or_else(PoisonError::into_inner);
            while o.1 != turn {
                o = wake.wait(o).unwrap_or_else(PoisonError::into_inner);
            }
            o.1 += 1;
            wake.notify_all();
            return err(ErrorKind::Backend, "start a GPU copy", e.to_string());
        }
        Ok(())
    }
}
