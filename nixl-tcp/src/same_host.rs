//! The same-host data path: the target's grants and the initiator's direct copies
//! (the crate docs describe the design; the primitives are in `shm`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl::{
    Error, ErrorKind, Op, RegionRef, RegionSlice, Result, SegmentRun, Segments, TargetRegion,
};

use crate::shm::{self, Access, Grant, Mapping, Table};
use crate::wire::{Offer, SegEntry};

/// Whether nixl-tcp moves data between agents on one host without the socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SameHost {
    /// Use the same-host path where it is proven to work, else TCP (one logged reason).
    #[default]
    Auto,
    /// Always TCP.
    Off,
    /// Same-host or nothing: connecting fails (with the reason) where the path cannot
    /// be set up, and a transfer that cannot go direct fails instead of using TCP.
    /// For tests and benchmarks that must measure the direct path.
    Require,
}

impl std::str::FromStr for SameHost {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            "require" | "on" => Ok(Self::Require),
            _ => Err(format!("{s:?}: expected auto, off or require")),
        }
    }
}

/// Longest wait for initiators to leave a revoked grant. An access is one copy or one
/// system call, so this is only reached by a peer stopped mid-copy (a debugger).
pub(crate) const REVOKE_BOUND: Duration = Duration::from_secs(10);

/// Target side: what this agent grants, and the tables of its same-host connections.
#[derive(Debug, Default)]
pub(crate) struct Grants {
    state: Mutex<GrantState>,
    /// Memfd allocations by address: (descriptor, length).
    allocs: Arc<Mutex<HashMap<u64, (i32, usize)>>>,
}

#[derive(Debug, Default)]
struct GrantState {
    /// Slot -> grant, for every registration granted.
    granted: HashMap<u32, Grant>,
    free: Vec<u32>,
    next: u32,
    tables: Vec<Arc<ConnTable>>,
}

/// One incoming same-host connection's table.
#[derive(Debug)]
pub(crate) struct ConnTable {
    pub(crate) table: Table,
    /// Registrations a peer did not leave in time: kept alive until the connection ends.
    held: Mutex<Vec<RegionRef>>,
}

impl Grants {
    /// Allocate shared memory for [`Agent::alloc`](nixl::Agent::alloc).
    pub(crate) fn alloc(&self, len: usize) -> Result<nixl::Memory> {
        const OP: &str = "tcp alloc";
        let m = shm::Memfd::new(c"nixl-tcp", len).map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                OP,
                format!("cannot create {len} bytes of shared memory"),
            )
            .with_source(e)
        })?;
        let (addr, fd) = (m.mapping().addr(), m.raw_fd());
        let allocs = self.allocs.clone();
        allocs.lock().unwrap().insert(addr, (fd, m.mapping().len()));
        m.into_memory(len, move || {
            allocs.lock().unwrap().remove(&addr);
        })
    }

    /// Grant a new registration to every same-host connection; returns its slot, or
    /// `None` when the table is full (the registration is reached over TCP only).
    pub(crate) fn grant(&self, key: u64, region: &RegionRef) -> Option<u32> {
        let seg = region.segment();
        let (addr, len) = (seg.addr(), seg.len());
        let memfd = self
            .allocs
            .lock()
            .unwrap()
            .get(&addr)
            .filter(|(_, l)| *l >= len)
            .map(|(fd, _)| *fd);
        let g = Grant {
            key,
            addr,
            len: len as u64,
            memfd,
        };
        let mut st = self.state.lock().unwrap();
        let slot = match st.free.pop() {
            Some(s) => s,
            None if st.next < shm::SLOTS => {
                st.next += 1;
                st.next - 1
            }
            None => {
                tracing::warn!(
                    slots = shm::SLOTS,
                    "tcp: same-host grant table full; this registration goes over TCP"
                );
                return None;
            }
        };
        for t in &st.tables {
            t.table.grant(slot, g, REVOKE_BOUND);
        }
        st.granted.insert(slot, g);
        Some(slot)
    }

    /// Withdraw a registration from every same-host connection; returns once no peer
    /// touches it. A peer still inside at the bound keeps `region` alive until its
    /// connection ends (and the deregistration reports it).
    pub(crate) fn revoke(&self, slot: u32, region: &RegionRef) -> Result<()> {
        let mut st = self.state.lock().unwrap();
        if st.granted.remove(&slot).is_none() {
            return Ok(());
        }
        let mut stuck = 0;
        for t in &st.tables {
            if !t.table.revoke(slot, REVOKE_BOUND) {
                stuck += 1;
                t.held.lock().unwrap().push(region.clone());
            }
        }
        // A slot a stuck peer still counts in is never reused while that table lives.
        if stuck == 0 {
            st.free.push(slot);
        }
        drop(st);
        if stuck > 0 {
            return Err(Error::new(
                ErrorKind::TimedOut,
                "tcp deregister",
                format!("{stuck} same-host peer(s) still copying after {REVOKE_BOUND:?}; the memory stays alive until they disconnect"),
            ));
        }
        Ok(())
    }

    /// A table for a new same-host connection, holding every current grant.
    pub(crate) fn attach(&self, nonce: &[u8; shm::NONCE_LEN]) -> std::io::Result<Arc<ConnTable>> {
        let t = Arc::new(ConnTable {
            table: Table::create(nonce)?,
            held: Mutex::default(),
        });
        let mut st = self.state.lock().unwrap();
        for (&slot, &g) in &st.granted {
            t.table.grant(slot, g, REVOKE_BOUND);
        }
        st.tables.push(t.clone());
        Ok(t)
    }

    /// The connection of `t` ended: its peer can no longer be inside a grant... unless
    /// it is still alive and copying, so first revoke everything in it.
    pub(crate) fn detach(&self, t: &Arc<ConnTable>) {
        let mut st = self.state.lock().unwrap();
        st.tables.retain(|x| !Arc::ptr_eq(x, t));
        drop(st);
        if !t.table.revoke_all(REVOKE_BOUND) {
            tracing::warn!("tcp: a same-host peer kept copying after its connection ended");
        }
    }

    /// Revoke every grant in every table (shutdown, drop): no peer touches this agent's
    /// memory afterwards.
    pub(crate) fn revoke_everything(&self) {
        let tables = std::mem::take(&mut self.state.lock().unwrap().tables);
        for t in tables {
            if !t.table.revoke_all(REVOKE_BOUND) {
                tracing::warn!("tcp: a same-host peer kept copying past the revoke bound");
            }
        }
    }
}

impl Drop for Grants {
    fn drop(&mut self) {
        self.revoke_everything();
    }
}

/// Initiator side: a connected same-host peer.
#[derive(Debug)]
pub(crate) struct Peer {
    pid: u32,
    table: Table,
    /// Why cross-memory attach is off, if it is.
    cma_refused: Option<String>,
    /// The peer's memfds we mapped, by slot: (key, mapping).
    maps: Mutex<HashMap<u32, (u64, Arc<Mapping>)>>,
}

/// The target side of a prepared transfer: for each target registration
/// ([`Segments::targets`]), the target's same-host slot (0 where it offered none: then
/// only the wire entries are used), the registration's key and its start address.
#[derive(Clone, Debug)]
pub(crate) struct Direct {
    pub(crate) targets: Vec<(u32, u64, u64)>,
}

impl Direct {
    /// The wire entry of `run`: key, first block's address, length, stride, blocks.
    pub(crate) fn entry(&self, run: &SegmentRun) -> SegEntry {
        let (_, key, base) = self.targets[run.target as usize];
        SegEntry {
            key,
            addr: base + run.target_offset,
            len: run.len,
            stride: run.target_stride,
            blocks: run.count as u64,
        }
    }
}

/// Why a transfer cannot go direct (it goes over TCP, or fails under `Require`).
#[derive(Debug)]
pub(crate) struct Unsuitable(pub(crate) &'static str);

impl Peer {
    /// Map the target's table and probe cross-memory attach.
    pub(crate) fn open(offer: &Offer) -> std::io::Result<Self> {
        let table = Table::open(offer.pid, offer.table_fd, &offer.nonce)?;
        let cma_refused = match shm::cma_peek::<{ shm::NONCE_LEN }>(offer.pid, offer.table_addr) {
            Ok(n) if n == offer.nonce => None,
            Ok(_) => Some("the cross-memory probe read the wrong bytes".to_owned()),
            Err(e) => Some(format!("the kernel refused cross-memory attach ({e}); ptrace restrictions such as Yama's ptrace_scope")),
        };
        Ok(Self {
            pid: offer.pid,
            table,
            cma_refused,
            maps: Mutex::default(),
        })
    }

    /// Why cross-memory attach is off, if it is.
    pub(crate) fn cma_refused(&self) -> Option<&str> {
        self.cma_refused.as_deref()
    }

    /// Move the data of one transfer directly. `Err(Unsuitable)`: nothing was touched,
    /// send it over TCP instead. `Ok(result)`: the transfer's outcome.
    pub(crate) fn transfer(
        &self,
        op: Op,
        segs: &Segments,
        direct: &Direct,
    ) -> std::result::Result<Result<()>, Unsuitable> {
        const OP: &str = "tcp same-host transfer";
        // Every target registration's grant, held while the data moves.
        let mut held: Vec<(Access<'_>, Grant)> = Vec::with_capacity(direct.targets.len());
        for (t, &(slot, key, _)) in segs.targets().iter().zip(&direct.targets) {
            let Some((access, g)) = self.table.acquire(slot).filter(|(_, g)| g.key == key) else {
                if self.table.is_closed() {
                    return Ok(Err(Error::new(
                        ErrorKind::RemoteDisconnected,
                        OP,
                        "the peer is shutting down or closed the connection",
                    )));
                }
                return Ok(Err(Error::new(
                    ErrorKind::NotAllowed,
                    OP,
                    format!(
                        "registration {}: unknown or forged key (not granted by the target)",
                        match t {
                            TargetRegion::Remote { region, .. } => *region,
                            TargetRegion::Local(r) => r.id(),
                        }
                    ),
                )));
            };
            if g.memfd.is_none() && self.cma_refused.is_some() {
                return Err(Unsuitable(
                    "cross-memory attach is refused and the memory is not shared",
                ));
            }
            held.push((access, g));
        }
        for (i, r) in segs.runs().iter().enumerate() {
            let e = direct.entry(r);
            let g = &held[r.target as usize].1;
            // Blocks ascend: the run lies inside the grant when its first block starts
            // and its last block ends inside.
            let inside = e.addr >= g.addr
                && e.last()
                    .and_then(|last| last.checked_add(e.len))
                    .zip(g.addr.checked_add(g.len))
                    .is_some_and(|(end, limit)| end <= limit);
            if !inside || e.len == 0 {
                return Ok(Err(Error::new(
                    ErrorKind::OutOfRange,
                    OP,
                    format!(
                        "run {i}: {} blocks of {:#x}+{} every {} bytes are not all inside registration {:#x}+{}",
                        e.blocks, e.addr, e.len, e.stride, g.addr, g.len
                    ),
                )));
            }
        }
        let write = op == Op::Write;
        // Shared memory first, then the rest by cross-memory attach in batches.
        let mut maps = Vec::with_capacity(held.len());
        for (&(slot, ..), (_, g)) in direct.targets.iter().zip(&held) {
            maps.push(match g.memfd {
                Some(fd) => match self.mapping(slot, g, fd) {
                    Ok(m) => Some(m),
                    Err(e) => return Ok(Err(e)),
                },
                None => None,
            });
        }
        let mut batch_l: Vec<RegionSlice> = Vec::new();
        let mut batch_r: Vec<(u64, u64)> = Vec::new();
        for r in segs.runs() {
            let e = direct.entry(r);
            let g = &held[r.target as usize].1;
            let region = &segs.locals()[r.local as usize];
            for j in 0..r.count {
                let block = region
                    .slice(r.local_at(j) as usize, r.len as usize)
                    .expect("the agent checked every segment");
                // Inside the grant (checked above for the whole run).
                let addr = e.addr + j as u64 * e.stride;
                match &maps[r.target as usize] {
                    Some(map) => {
                        if let Err(e) =
                            shm::copy_mapped(&block, map, (addr - g.addr) as usize, write)
                        {
                            return Ok(Err(Error::new(
                                ErrorKind::Backend,
                                OP,
                                "copy through shared memory failed",
                            )
                            .with_source(e)));
                        }
                    }
                    None => {
                        batch_l.push(block);
                        batch_r.push((addr, e.len));
                        if batch_l.len() == shm::IOV_MAX {
                            if let Err(e) = self.cma(write, &batch_l, &batch_r) {
                                return Ok(Err(e));
                            }
                            batch_l.clear();
                            batch_r.clear();
                        }
                    }
                }
            }
        }
        if !batch_l.is_empty() {
            if let Err(e) = self.cma(write, &batch_l, &batch_r) {
                return Ok(Err(e));
            }
        }
        drop(held);
        Ok(Ok(()))
    }

    fn cma(&self, write: bool, local: &[RegionSlice], remote: &[(u64, u64)]) -> Result<()> {
        const OP: &str = "tcp same-host transfer";
        let want: u64 = remote.iter().map(|r| r.1).sum();
        match shm::cma(self.pid, write, local, remote) {
            Ok(n) if n as u64 == want => Ok(()),
            Ok(n) => Err(Error::new(
                ErrorKind::Backend,
                OP,
                format!("cross-memory attach moved {n} of {want} bytes (the peer's memory is not mapped)"),
            )),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(Error::new(
                ErrorKind::RemoteDisconnected,
                OP,
                "the peer process is gone",
            )
            .with_source(e)),
            Err(e) => Err(Error::new(ErrorKind::Backend, OP, "cross-memory attach failed").with_source(e)),
        }
    }

    /// The peer's memfd for `slot` (called while the slot's access is held, so the
    /// descriptor is the granted one and still open).
    fn mapping(&self, slot: u32, g: &Grant, fd: i32) -> Result<Arc<Mapping>> {
        let mut maps = self.maps.lock().unwrap();
        if let Some((key, m)) = maps.get(&slot) {
            if *key == g.key && m.len() as u64 >= g.len {
                return Ok(m.clone());
            }
        }
        let m = shm::map_peer(self.pid, fd, g.len as usize)
            .map(Arc::new)
            .map_err(|e| {
                let kind = if e.kind() == std::io::ErrorKind::NotFound {
                    ErrorKind::RemoteDisconnected
                } else {
                    ErrorKind::Backend
                };
                Error::new(
                    kind,
                    "tcp same-host transfer",
                    "cannot map the peer's shared memory",
                )
                .with_source(e)
            })?;
        maps.insert(slot, (g.key, m.clone()));
        Ok(m)
    }
}
