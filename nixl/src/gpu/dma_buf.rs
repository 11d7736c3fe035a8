//! Exporting device memory as a dma-buf, for RDMA NICs (GPUDirect RDMA without the
//! peer-memory module).

use super::access::driver;
#[cfg(doc)]
use super::access::status;
use crate::aligned::PAGE_SIZE;
use crate::error::{Error, ErrorKind, Result};

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
    let page = PAGE_SIZE as u64;
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
