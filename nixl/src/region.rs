//! Registrations: the user's handle, the backends' handle, and remote regions.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::descriptor::{Desc, Ranged};
use crate::error::{err, ErrorKind, Result};
use crate::memory::{MemKind, MemSegment, Memory};

pub(crate) struct RegionInner {
    pub(crate) id: u64,
    pub(crate) mem: Memory,
    /// Transfers posted and not yet reported finished by their backend.
    pub(crate) inflight: AtomicUsize,
    pub(crate) registered: AtomicBool,
    /// (backend index, public blob) for each backend that registered this region.
    pub(crate) backends: Mutex<Vec<(usize, Bytes)>>,
}

impl RegionInner {
    pub(crate) fn registered_with(&self, backend: usize) -> bool {
        self.backends
            .lock()
            .unwrap()
            .iter()
            .any(|(b, _)| *b == backend)
    }
}

impl Ranged for Arc<RegionInner> {
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

    fn check_host(&self, offset: usize, len: usize, op: &'static str) -> Result<()> {
        if self.kind() != MemKind::Dram {
            return err(
                ErrorKind::NotSupported,
                op,
                format!("{} memory is not host-accessible", self.kind()),
            );
        }
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return err(
                ErrorKind::OutOfRange,
                op,
                format!("{offset}+{len} is outside the {}-byte region", self.len()),
            );
        }
        Ok(())
    }

    /// Copy bytes out of the region, starting at `offset`.
    ///
    /// Peers may be writing the same bytes concurrently; order such access with your
    /// protocol (for example, read after the transfer's notification arrived).
    ///
    /// # Errors
    /// [`ErrorKind::OutOfRange`], or [`ErrorKind::NotSupported`] for device memory.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_host(offset, dst.len(), "read registered memory")?;
        self.inner.mem.copy_out(offset, dst);
        Ok(())
    }

    /// Copy bytes into the region, starting at `offset`.
    ///
    /// # Errors
    /// [`ErrorKind::OutOfRange`], or [`ErrorKind::NotSupported`] for device memory.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_host(offset, src.len(), "write registered memory")?;
        self.inner.mem.copy_in(offset, src);
        Ok(())
    }

    /// A copy of the whole region.
    ///
    /// # Errors
    /// [`ErrorKind::NotSupported`] for device memory.
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

    /// Whether the agent still has it registered.
    pub fn is_registered(&self) -> bool {
        self.inner.registered.load(Ordering::Acquire)
    }
}

impl fmt::Debug for RegionRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegionRef(id {}, {:?})", self.id(), self.segment())
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
