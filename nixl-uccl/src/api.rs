//! The UCCL engine API as this crate uses it: one trait, implemented by the real
//! library ([`crate::library`]) and, for tests, by an in-process test double
//! (`test_double`, feature `test-double`).
//!
//! The backend's lifecycle (who calls what, from which thread, in which order) is
//! written once against [`EngineApi`]; only the binding differs. Handles are opaque
//! addresses; the binding decides what they point to.
//!
//! The handles' owners (`EngineOwner`, `OwnedConn`, `NewEngine`) are here too:
//! they make the trait's unsafe calls, so the rest of the crate needs none.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl::{Op, RegionRef, Result};

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
    ///
    /// # Errors
    /// The engine failed to answer (an exception it threw).
    fn done(&self, c: ConnHandle, id: u64) -> Result<bool>;

    /// Make the calling thread ready to call into the engine: the real binding makes
    /// `device`'s CUDA context current (UCCL's engine expects one on every thread
    /// that calls it). Every thread this crate starts calls it first.
    ///
    /// # Errors
    /// The GPU driver's.
    fn bind_thread(&self, device: u32) -> Result<()>;

    /// Close a connection (no transfer may still use it).
    ///
    /// # Safety
    /// `c` is live and unused from now on.
    unsafe fn conn_destroy(&self, c: ConnHandle);
}

/// The engine and everything created in it. Dropped last: connections still open
/// first, then memory regions, then the engine.
#[derive(Debug)]
pub(crate) struct EngineOwner {
    pub(crate) api: Arc<dyn EngineApi>,
    pub(crate) engine: EngineHandle,
    /// The GPU whose context this engine's threads bind ([`EngineApi::bind_thread`]).
    pub(crate) device: u32,
    mrs: Mutex<MrTable>,
    /// Inbound connections, to close at teardown (never keyed by address).
    inbound: Mutex<Vec<ConnHandle>>,
    /// Set when operations were abandoned inside the engine (never seen done): the
    /// engine may still touch their memory, so neither the regions nor the engine are
    /// destroyed, and that memory is never freed.
    pub(crate) poisoned: std::sync::atomic::AtomicBool,
}

/// Memory regions by registration id, each with the memory it covers, which stays
/// alive until the region is destroyed (so a peer's key never reaches freed memory).
#[derive(Debug, Default)]
struct MrTable {
    live: HashMap<u64, (u64, RegionRef)>,
    /// Abandoned operations still using a registration.
    busy: HashMap<u64, usize>,
    /// Deregistered while busy: destroyed when the last operation is seen done.
    doomed: HashMap<u64, (u64, RegionRef)>,
}

impl EngineOwner {
    /// The owner of a new engine.
    pub(crate) fn new(mut engine: NewEngine) -> Self {
        Self {
            api: engine.api.clone(),
            engine: engine.engine.take().expect("an engine is owned once"),
            device: engine.device,
            mrs: Mutex::default(),
            inbound: Mutex::new(Vec::new()),
            poisoned: Default::default(),
        }
    }

    /// Make the calling thread ready to call into this engine (its CUDA context).
    pub(crate) fn bind_thread(&self) -> Result<()> {
        self.api.bind_thread(self.device)
    }

    /// Connect to a peer's engine (blocks until it accepted) from a thread of ours
    /// (bound first); the connection holds this owner.
    pub(crate) fn connect(self: &Arc<Self>, ip: &str, gpu: &str, port: u16) -> Result<OwnedConn> {
        self.bind_thread()?;
        self.api
            .connect(self.engine, ip, gpu, port)
            .map(|conn| OwnedConn {
                conn,
                owner: self.clone(),
            })
    }

    /// Wait for one inbound connection (see [`EngineApi::accept`]), kept until
    /// [`EngineOwner::close_inbound`]; returns the peer's address as the engine saw it.
    pub(crate) fn accept(&self) -> Option<String> {
        let a = self.api.accept(self.engine)?;
        self.inbound.lock().unwrap().push(a.conn);
        Some(a.ip)
    }

    /// Register the agent's `region`, kept until its memory region is destroyed;
    /// returns the memory region and what peers need to reach it.
    pub(crate) fn register(&self, region: &RegionRef) -> Result<(u64, FifoItem)> {
        let seg = region.segment();
        let (addr, len) = (seg.addr() as usize, seg.len());
        // SAFETY: `region` keeps the memory alive while it lives, and the table keeps
        // it (below) until the memory region is destroyed.
        let mr = unsafe { self.api.reg(self.engine, addr, len)? };
        match self.api.prepare_fifo(self.engine, mr, addr, len) {
            Ok(f) => {
                self.insert(region.id(), mr, region.clone());
                Ok((mr, f))
            }
            Err(e) => {
                self.api.mr_destroy(self.engine, mr);
                Err(e)
            }
        }
    }

    /// Close every inbound connection. Returns only once each is destroyed, whoever
    /// closes them: the list's lock is held across the destroys, so a second caller
    /// waits for the first instead of finding the list empty and returning while
    /// connections are still being destroyed (memory is deregistered right after a
    /// shutdown's close returns).
    pub(crate) fn close_inbound(&self) {
        let mut inbound = self.inbound.lock().unwrap();
        for c in inbound.drain(..) {
            // SAFETY: accepted on this engine, and removed from the list so nothing
            // uses it again.
            unsafe { self.api.conn_destroy(c) };
        }
    }

    fn insert(&self, id: u64, mr: u64, region: RegionRef) {
        self.mrs.lock().unwrap().live.insert(id, (mr, region));
    }

    /// Deregister `id` now, or once the abandoned operations using it are done.
    pub(crate) fn deregister(&self, id: u64) -> Deregistered {
        let mut t = self.mrs.lock().unwrap();
        let Some(entry) = t.live.remove(&id) else {
            return Deregistered::Unknown;
        };
        if t.busy.get(&id).is_some_and(|&n| n > 0) {
            t.doomed.insert(id, entry);
            Deregistered::Deferred
        } else {
            drop(t);
            self.api.mr_destroy(self.engine, entry.0);
            Deregistered::Destroyed
        }
    }

    pub(crate) fn hold(&self, ids: &[u64]) {
        let mut t = self.mrs.lock().unwrap();
        for id in ids {
            *t.busy.entry(*id).or_default() += 1;
        }
    }

    pub(crate) fn release(&self, ids: &[u64]) {
        let mut done = Vec::new();
        {
            let mut t = self.mrs.lock().unwrap();
            for id in ids {
                let n = t.busy.entry(*id).or_default();
                *n = n.saturating_sub(1);
                if *n == 0 {
                    t.busy.remove(id);
                    if let Some(e) = t.doomed.remove(id) {
                        done.push(e);
                    }
                }
            }
        }
        for (mr, _region) in done {
            self.api.mr_destroy(self.engine, mr);
        }
    }
}

/// What [`EngineOwner::deregister`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deregistered {
    /// The memory region is destroyed: the engine reaches the memory no more.
    Destroyed,
    /// Operations the engine never reported done still use it: it is destroyed
    /// (and the memory let go) once they are.
    Deferred,
    /// Not registered in this engine.
    Unknown,
}

/// How long dropping the owner waits for `uccl_engine_destroy` (which joins UCCL's
/// own threads) before leaving it to finish alone.
const DESTROY_BOUND: Duration = Duration::from_secs(10);

impl Drop for EngineOwner {
    fn drop(&mut self) {
        self.close_inbound();
        let t = std::mem::take(&mut *self.mrs.lock().unwrap());
        if self.poisoned.load(std::sync::atomic::Ordering::Acquire) {
            tracing::warn!(
                regions = t.live.len() + t.doomed.len(),
                "UCCL engine left alive: operations it never reported done may still use registered memory, which stays allocated"
            );
            for (_, (_, region)) in t.live.into_iter().chain(t.doomed) {
                std::mem::forget(region);
            }
            return;
        }
        for (_, (mr, _region)) in t.live.into_iter().chain(t.doomed) {
            self.api.mr_destroy(self.engine, mr);
        }
        let (api, engine, device) = (self.api.clone(), self.engine, self.device);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let destroy = move || {
            if let Err(e) = api.bind_thread(device) {
                tracing::warn!(%e, "uccl-destroy: no CUDA context on this thread");
            }
            // SAFETY: this owner was the engine's last holder: every thread,
            // connection and registration that could call into it held the owner
            // and is gone.
            unsafe { api.destroy(engine) };
            let _ = tx.send(());
        };
        // UCCL's destroy joins its own threads, which can take a while (its accept
        // polls once a second): bounded, then left to finish on its own thread.
        match std::thread::Builder::new()
            .name("uccl-destroy".into())
            .spawn(destroy)
        {
            Ok(h) => {
                if rx.recv_timeout(DESTROY_BOUND).is_ok() {
                    // Done: reap the thread so it does not outlive the agent.
                    let _ = h.join();
                } else {
                    tracing::warn!(
                        "uccl_engine_destroy did not return within {DESTROY_BOUND:?}; left running"
                    );
                }
            }
            Err(e) => tracing::warn!(%e, "no thread for uccl_engine_destroy; engine leaked"),
        }
    }
}

/// An engine connection; dropping it closes it. It holds the engine's owner, so the
/// engine outlives every connection, wherever one ends up (a link, a channel nobody
/// reads any more).
#[derive(Debug)]
pub(crate) struct OwnedConn {
    pub(crate) conn: ConnHandle,
    pub(crate) owner: Arc<EngineOwner>,
}

impl Drop for OwnedConn {
    fn drop(&mut self) {
        // SAFETY: connected on this engine; this value was its only holder.
        unsafe { self.owner.api.conn_destroy(self.conn) };
    }
}

impl OwnedConn {
    /// Start a one-sided `op` between local `addr..addr + len`, which must lie in
    /// registration `mr` of this engine, and `remote`; returns the transfer id for
    /// [`EngineApi::done`].
    pub(crate) fn start(
        &self,
        op: Op,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64> {
        let api = &self.owner.api;
        // SAFETY: the connection is live while `self` is. The range lies in
        // registration `mr` (the backend's pieces are cut from the registration's
        // segment at prepare, which the agent checked); the engine owner keeps that
        // registration's memory alive until its region is destroyed, which waits for
        // operations abandoned in the engine.
        unsafe {
            match op {
                Op::Write => api.write(self.conn, mr, addr, len, remote),
                Op::Read => api.read(self.conn, mr, addr, len, remote),
            }
        }
    }
}

/// An engine just created and not yet owned: destroyed when dropped, unless an
/// [`EngineOwner`] takes it.
#[derive(Debug)]
pub(crate) struct NewEngine {
    api: Arc<dyn EngineApi>,
    /// Taken by the owner.
    engine: Option<EngineHandle>,
    device: u32,
}

impl NewEngine {
    /// Create an engine on `api` for `device`, on the calling thread (a thread of
    /// ours, bound to the device's context first).
    pub(crate) fn create(api: Arc<dyn EngineApi>, device: u32) -> Result<Self> {
        api.bind_thread(device)?;
        let engine = api.create()?;
        Ok(Self {
            api,
            engine: Some(engine),
            device,
        })
    }
}

impl Drop for NewEngine {
    fn drop(&mut self) {
        if let Some(e) = self.engine.take() {
            // SAFETY: just created, never shared (an owner took it otherwise).
            unsafe { self.api.destroy(e) };
        }
    }
}
