//! The UCCL engine API as this crate uses it: one trait, implemented by the real
//! library ([`crate::library`]) and, for tests, by an in-process test double
//! ([`crate::test_double`], feature `test-double`).
//!
//! The backend's lifecycle (who calls what, from which thread, in which order) is
//! written once against [`EngineApi`]; only the binding differs. Handles are opaque
//! addresses; the binding decides what they point to.

use std::fmt;

use nixl::Result;

/// An engine instance (`uccl_engine_t*` in the real library).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineHandle(pub usize);

/// A connection (`uccl_conn_t*` in the real library).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnHandle(pub usize);

/// Size of UCCL's `FifoItem`, and of its serialized form.
pub const FIFO_ITEM_LEN: usize = 64;

/// UCCL's `FifoItem`: what an initiator needs to reach a peer's registered memory with
/// a one-sided operation (address, length, remote key, and engine-private fields).
///
/// The layout is UCCL's (`include/common.h`: `u64 addr; u32 size; u32 rkey; u32 nmsgs;
/// u32 rid; u64 idx; char padding[32]`, static-asserted to 64 bytes there). It is a
/// trivially copyable aggregate, so the C++ ABI passes it by value exactly as the C ABI
/// passes this `#[repr(C)]` struct (in memory, on the stack, for 64 bytes on x86-64).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FifoItem {
    /// Remote address.
    pub addr: u64,
    /// Length (UCCL keeps 32 bits: one operation moves at most `u32::MAX` bytes).
    pub size: u32,
    /// Remote key.
    pub rkey: u32,
    /// Engine-private.
    pub nmsgs: u32,
    /// Engine-private.
    pub rid: u32,
    /// Engine-private.
    pub idx: u64,
    /// Engine-private (further keys on multi-NIC hosts).
    pub padding: [u8; 32],
}

const _: () = assert!(std::mem::size_of::<FifoItem>() == FIFO_ITEM_LEN);

impl fmt::Debug for FifoItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FifoItem")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("size", &self.size)
            .field("rkey", &self.rkey)
            .finish_non_exhaustive()
    }
}

impl FifoItem {
    /// Parse UCCL's serialized form (`serialize_fifo_item`: the fields in order,
    /// little-endian, no gaps). `None` unless `b` is exactly 64 bytes.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != FIFO_ITEM_LEN {
            return None;
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let mut padding = [0u8; 32];
        padding.copy_from_slice(&b[32..64]);
        Some(Self {
            addr: u64_at(0),
            size: u32_at(8),
            rkey: u32_at(12),
            nmsgs: u32_at(16),
            rid: u32_at(20),
            idx: u64_at(24),
            padding,
        })
    }

    /// The serialized form [`FifoItem::decode`] reads.
    pub fn encode(&self) -> [u8; FIFO_ITEM_LEN] {
        let mut b = [0u8; FIFO_ITEM_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b[12..16].copy_from_slice(&self.rkey.to_le_bytes());
        b[16..20].copy_from_slice(&self.nmsgs.to_le_bytes());
        b[20..24].copy_from_slice(&self.rid.to_le_bytes());
        b[24..32].copy_from_slice(&self.idx.to_le_bytes());
        b[32..64].copy_from_slice(&self.padding);
        b
    }

    /// The same key pointed at `addr..addr+size` (what UCCL's `uccl_engine_update_fifo`
    /// does).
    pub fn at(&self, addr: u64, size: u32) -> Self {
        Self {
            addr,
            size,
            ..*self
        }
    }
}

/// What an accept returned.
#[derive(Debug)]
pub struct Accepted {
    /// The new connection.
    pub conn: ConnHandle,
    /// The peer's IP address as the engine saw it (for logs only: several agents may
    /// share one address, so nothing is keyed by it).
    pub ip: String,
}

/// The engine calls the backend makes.
///
/// Thread safety is the binding's business: UCCL keeps some state process-wide (its
/// registration table is one global map), so the real binding serializes every call
/// that touches it under one process-wide lock, and lets only `accept`, `stop_accept`
/// and `connect` (which block, and which UCCL guards itself) run outside it.
///
/// # Safety
/// Handles passed in must come from this same implementation and must not have been
/// destroyed; callers guarantee it (the backend owns every handle through one owner
/// whose `Drop` destroys it last).
pub trait EngineApi: Send + Sync + fmt::Debug + 'static {
    /// One line saying what this is (the library path, or the test double).
    fn describe(&self) -> String;

    /// Create an engine.
    fn create(&self) -> Result<EngineHandle>;

    /// Destroy an engine. Every connection and registration of it must be gone, and no
    /// other call on it may be running.
    ///
    /// # Safety
    /// `e` is live and no other call uses it now or later.
    unsafe fn destroy(&self, e: EngineHandle);

    /// The engine's own connection string (`ip:port?gpu` in UCCL 0.1).
    fn metadata(&self, e: EngineHandle) -> Result<String>;

    /// Connect to a peer's engine; blocks until the peer's engine accepted.
    fn connect(&self, e: EngineHandle, ip: &str, gpu: &str, port: u16) -> Result<ConnHandle>;

    /// Wait for one inbound connection. `None` when stopped by [`EngineApi::stop_accept`]
    /// or on failure.
    ///
    /// UCCL's accept does not return before the engine's first registration, whatever
    /// [`EngineApi::stop_accept`] says: callers must not enter it before registering.
    fn accept(&self, e: EngineHandle) -> Option<Accepted>;

    /// Make a blocked (or the next) [`EngineApi::accept`] return `None`.
    fn stop_accept(&self, e: EngineHandle);

    /// Register `len` bytes at `addr`; returns the memory-region id.
    ///
    /// # Safety
    /// `addr..addr+len` stays valid until [`EngineApi::mr_destroy`].
    unsafe fn reg(&self, e: EngineHandle, addr: usize, len: usize) -> Result<u64>;

    /// Deregister a memory region (no transfer may still use it).
    fn mr_destroy(&self, e: EngineHandle, mr: u64);

    /// The [`FifoItem`] peers need to reach `addr..addr+len` of region `mr`.
    fn prepare_fifo(&self, e: EngineHandle, mr: u64, addr: usize, len: usize) -> Result<FifoItem>;

    /// Start a one-sided WRITE of local `addr..addr+len` (in region `mr`) to `remote`;
    /// returns a transfer id for [`EngineApi::done`].
    ///
    /// # Safety
    /// `addr..addr+len` lies in region `mr` and stays valid until the transfer is done.
    unsafe fn write(
        &self,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64>;

    /// Start a one-sided READ from `remote` into local `addr..addr+len` (region `mr`).
    ///
    /// # Safety
    /// As for [`EngineApi::write`].
    unsafe fn read(
        &self,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64>;

    /// Whether transfer `id` on `c` is done. UCCL says nothing else: not whether it
    /// failed, not whether the peer is alive.
    fn done(&self, c: ConnHandle, id: u64) -> bool;

    /// Close a connection (no transfer may still use it).
    ///
    /// # Safety
    /// `c` is live and unused from now on.
    unsafe fn conn_destroy(&self, c: ConnHandle);
}
