//! The same-host path for GPU memory, initiator side: the target's GPU registrations
//! opened through the driver's inter-process handles (cached per grant and device),
//! and each transfer's copies queued on the device as one batch with one completion.
//!
//! Safety is the host path's contract (see `same_host`): only granted registrations
//! are reached, every run is checked against its grant before any copy is queued,
//! and each transfer counts as an access in every grant it uses until the device has
//! finished its copies (the counts come down in the driver's completion callback).
//! On top of that, each mapping kept open counts as an access too: CUDA leaves
//! freeing exported memory that another process still has open undefined, so a
//! target's deregistration waits for this process to close its mappings. A watcher
//! thread sleeps on the table's withdrawal futex while mappings are open and closes
//! those of withdrawn grants at once; it ends with the connection or the agent (an
//! agent-owned thread, joined at shutdown). Without a watcher nothing is opened: the
//! transfer is staged over TCP instead.
//!
//! An initiator in the target's own process needs no handle: it copies between the
//! target's device addresses directly, with the same counting.
#![allow(unsafe_code)] // queues device copies between ranges the grants vouch for

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl::gpu::IpcMapping;
use nixl::{Error, ErrorKind, MemKind, Op, Result, Segments};

use crate::direct::{not_granted, Direct, Unsuitable};
use crate::shm::{OwnedAccess, Table};

const OP: &str = "tcp same-host GPU transfer";

/// How long the watcher sleeps before looking again without a wake-up (a safety net:
/// every withdrawal wakes it).
const WATCH_NAP: Duration = Duration::from_secs(5);

/// How long a handle the driver refused is not asked for again (a refusal may be
/// passing: out of memory or mappings).
const REFUSAL_KEPT: Duration = Duration::from_secs(5);

/// A target's GPU allocation opened in this process. Fields drop in order: the
/// mapping is closed before the access it counts as ends.
struct Open {
    key: u64,
    mapping: IpcMapping,
    /// The target's allocation start (the handle names the whole allocation).
    base: u64,
    _count: OwnedAccess,
}

type Cache = Arc<Mutex<HashMap<(u32, u32), Arc<Open>>>>;

/// The GPU side of one same-host connection: mappings of the target's grants.
pub(crate) struct GpuPeer {
    table: Arc<Table>,
    /// The target runs in this process: its device addresses are ours.
    in_process: bool,
    open: Cache,
    /// Handles the driver refused to open, (slot, key, device), and when: their
    /// transfers are staged without asking the driver again for [`REFUSAL_KEPT`].
    refused: Mutex<HashMap<(u32, u64, u32), Instant>>,
    /// Starts the watcher on a thread the agent owns.
    threads: nixl::ThreadSpawner,
    /// The running watcher's stop flag (its thread ends soon after it is set; the
    /// agent joins it at shutdown).
    watcher: Mutex<Option<Arc<AtomicBool>>>,
}

impl std::fmt::Debug for GpuPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPeer")
            .field("in_process", &self.in_process)
            .field("open", &self.open.lock().unwrap().len())
            .finish()
    }
}

/// Why a grant's mapping is not available.
enum Unopened {
    /// The grant went between the transfer's check and the opening.
    Withdrawn,
    /// It cannot be opened here; the transfer goes another way.
    Unsuitable(Unsuitable),
}

/// One transfer's device copies, checked and ready to start; what they need stays
/// alive (and counted in the target's grants) until the device has finished.
pub(crate) struct Batch {
    device: u32,
    copies: Vec<(u64, u64, usize)>,
    /// Every target range is reachable from `device`'s kernels.
    one_kernel: bool,
    hold: Hold,
}

struct Hold {
    _accesses: Vec<OwnedAccess>,
    _opens: Vec<Arc<Open>>,
    _local: Arc<Segments>,
}

impl GpuPeer {
    pub(crate) fn new(table: Arc<Table>, pid: u32, threads: nixl::ThreadSpawner) -> Self {
        Self {
            table,
            in_process: pid == std::process::id(),
            open: Arc::default(),
            refused: Mutex::default(),
            threads,
            watcher: Mutex::new(None),
        }
    }

    /// Check a transfer between this process's GPU memory and the target's and build
    /// its copies. `Err(Unsuitable)`: nothing was touched, it goes another way.
    pub(crate) fn batch(
        &self,
        op: Op,
        segs: &Arc<Segments>,
        direct: &Direct,
    ) -> std::result::Result<Result<Batch>, Unsuitable> {
        let mut device = None;
        for r in segs.locals() {
            match (r.kind(), device) {
                (MemKind::Vram { device: d }, None) => device = Some(d),
                (MemKind::Vram { device: d }, Some(e)) if d == e => {}
                (MemKind::Vram { .. }, Some(_)) => {
                    return Err(Unsuitable::new(
                        "the local GPU memory is on several devices",
                    ))
                }
                (MemKind::Dram, _) => {
                    return Err(Unsuitable::mixed_kinds("the local memory is host memory"))
                }
                (MemKind::File { .. }, _) => {
                    return Err(Unsuitable::new("the local side is a file"))
                }
            }
        }
        let Some(device) = device else {
            return Err(Unsuitable::new("the transfer has no local memory"));
        };
        // Every target registration's grant, counted until the copies are done, and
        // where it starts in this process.
        let mut accesses = Vec::with_capacity(direct.targets.len());
        let mut one_kernel = true;
        let mut opens = Vec::new();
        let mut here = Vec::with_capacity(direct.targets.len());
        for (t, &(slot, key, _)) in segs.targets().iter().zip(&direct.targets) {
            let Some((access, g)) = self.table.acquire_owned(slot).filter(|(_, g)| g.key == key)
            else {
                return Ok(Err(not_granted(&self.table, OP, t)));
            };
            let Some(gpu) = g.gpu else {
                return Err(Unsuitable::mixed_kinds(
                    "the target's memory is host memory",
                ));
            };
            // The target's range [g.addr, g.addr + g.len), and the offset that turns
            // its addresses into this process's.
            let shift = if self.in_process {
                // Another GPU's memory of this process may lack peer access.
                one_kernel &= gpu.device == device;
                0
            } else {
                let Some((handle, base)) = gpu.export else {
                    return Err(Unsuitable::new(
                        "the target's GPU memory has no inter-process handle",
                    ));
                };
                let open = match self.mapping(slot, key, device, &handle, base) {
                    Ok(o) => o,
                    Err(Unopened::Withdrawn) => return Ok(Err(not_granted(&self.table, OP, t))),
                    Err(Unopened::Unsuitable(u)) => return Err(u),
                };
                // The runs are checked against the grant below; the grant must lie
                // inside what the driver mapped (the table is the target's word).
                let inside = g.addr >= open.base
                    && g.addr
                        .checked_add(g.len)
                        .zip(open.base.checked_add(open.mapping.len()))
                        .is_some_and(|(end, mapped)| end <= mapped);
                if !inside {
                    return Ok(Err(Error::new(
                        ErrorKind::NotAllowed,
                        OP,
                        format!(
                            "the target's grant {:#x}+{} lies outside the {} bytes its handle maps from {:#x}",
                            g.addr, g.len, open.mapping.len(), open.base
                        ),
                    )));
                }
                let shift = open.mapping.base().wrapping_sub(open.base);
                opens.push(open);
                shift
            };
            here.push((g.addr, g.len, shift));
            accesses.push(access);
        }
        let write = op == Op::Write;
        let mut copies = Vec::new();
        for (i, r) in segs.runs().iter().enumerate() {
            let e = direct.entry(r);
            let (addr, len, shift) = here[r.target as usize];
            // Blocks ascend: the run lies inside the grant when its first block
            // starts and its last block ends inside.
            let inside = e.addr >= addr
                && e.last()
                    .and_then(|last| last.checked_add(e.len))
                    .zip(addr.checked_add(len))
                    .is_some_and(|(end, limit)| end <= limit);
            let local = segs.locals()[r.local as usize].segment();
            let local_end = r.local_at(r.count.saturating_sub(1)).checked_add(r.len);
            if !inside || e.len == 0 || local_end.is_none_or(|end| end > local.len() as u64) {
                return Ok(Err(Error::new(
                    ErrorKind::OutOfRange,
                    OP,
                    format!(
                        "run {i}: {} blocks of {:#x}+{} every {} bytes are not all inside registration {addr:#x}+{len}",
                        e.blocks, e.addr, e.len, e.stride
                    ),
                )));
            }
            for j in 0..r.count {
                let mine = local.addr() + r.local_at(j);
                let theirs = (e.addr + j as u64 * e.stride).wrapping_add(shift);
                let n = r.len as usize;
                copies.push(if write {
                    (theirs, mine, n)
                } else {
                    (mine, theirs, n)
                });
            }
        }
        Ok(Ok(Batch {
            device,
            copies,
            one_kernel,
            hold: Hold {
                _accesses: accesses,
                _opens: opens,
                _local: segs.clone(),
            },
        }))
    }

    /// The target's allocation behind `slot`, opened on `device` (cached; opening
    /// counts as an access of the grant until the mapping is closed).
    fn mapping(
        &self,
        slot: u32,
        key: u64,
        device: u32,
        handle: &[u8; nixl::gpu::IPC_HANDLE_LEN],
        base: u64,
    ) -> std::result::Result<Arc<Open>, Unopened> {
        let refused = || {
            Err(Unopened::Unsuitable(Unsuitable::new(
                "the driver refused the target's GPU memory handle",
            )))
        };
        // Nothing stays open that nobody would close on withdrawal. Started before the
        // cache is locked (a spawn may run other threads' leftovers).
        let stop = match self.watch() {
            Ok(stop) => stop,
            Err(e) => {
                tracing::info!(error = %e, "tcp: no thread to close the peer's GPU mappings; staging over TCP");
                return Err(Unopened::Unsuitable(Unsuitable::new(
                    "no thread to close GPU mappings could be started",
                )));
            }
        };
        let mut open = self.open.lock().unwrap();
        if let Some(o) = open.get(&(slot, device)) {
            if o.key == key && o.base == base {
                return Ok(o.clone());
            }
        }
        // The watcher's last sweep takes this lock after it saw its stop: a mapping
        // inserted while it is unset is closed by that sweep; none is opened after.
        if stop.load(Ordering::Acquire) {
            return Err(Unopened::Unsuitable(Unsuitable::new(
                "the agent is stopping: no GPU mapping is opened",
            )));
        }
        if self
            .refused
            .lock()
            .unwrap()
            .get(&(slot, key, device))
            .is_some_and(|at| at.elapsed() < REFUSAL_KEPT)
        {
            return refused();
        }
        let Some((count, g)) = self.table.acquire_owned(slot).filter(|(_, g)| g.key == key) else {
            return Err(Unopened::Withdrawn);
        };
        debug_assert!(g.gpu.is_some());
        let mapping = match nixl::gpu::ipc_open(device, handle) {
            Ok(m) => m,
            Err(e) => {
                // A refusal is remembered for a while, so its transfers are staged
                // without asking (and logging) each time; a new registration in the
                // slot has another key and is asked at once.
                tracing::info!(error = %e, slot, device, "tcp: the driver cannot open the peer's GPU memory; staging it over TCP");
                let mut r = self.refused.lock().unwrap();
                r.retain(|&(s, k, _), at| {
                    at.elapsed() < REFUSAL_KEPT && self.table.still_granted(s, k)
                });
                r.insert((slot, key, device), Instant::now());
                return refused();
            }
        };
        let o = Arc::new(Open {
            key,
            mapping,
            base,
            _count: count,
        });
        // A stale mapping of the slot (another key) goes; copies still using it
        // hold it until they finish.
        open.insert((slot, device), o.clone());
        Ok(o)
    }

    /// Start the watcher that closes mappings of withdrawn grants, if not running;
    /// returns its stop flag (set once it is stopping). Fails when the agent is
    /// stopping or the OS refuses a thread.
    fn watch(&self) -> Result<Arc<AtomicBool>> {
        let mut w = self.watcher.lock().unwrap();
        if let Some(stop) = &*w {
            return Ok(stop.clone());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (table, open, flag) = (self.table.clone(), self.open.clone(), stop.clone());
        // The wake only needs the table while the watcher runs.
        let (woken, wake_flag) = (Arc::downgrade(&self.table), stop.clone());
        self.threads.spawn(
            "nixl-tcp-gpu-watch",
            move |agent_stops| loop {
                let seen = table.epoch();
                if agent_stops.is_cancelled() {
                    // Set before the last sweep, which `mapping` relies on.
                    flag.store(true, Ordering::Release);
                }
                let stopping = flag.load(Ordering::Acquire);
                let closed = table.is_closed();
                let gone: Vec<Arc<Open>> = {
                    let mut m = open.lock().unwrap();
                    let stale: Vec<_> = m
                        .iter()
                        .filter(|(&(slot, _), o)| {
                            stopping || closed || !table.still_granted(slot, o.key)
                        })
                        .map(|(k, _)| *k)
                        .collect();
                    stale.iter().filter_map(|k| m.remove(k)).collect()
                };
                // Closed here, outside the lock (copies still running hold theirs).
                drop(gone);
                if stopping {
                    return;
                }
                table.wait_epoch(seen, WATCH_NAP);
            },
            move || {
                wake_flag.store(true, Ordering::Release);
                if let Some(t) = woken.upgrade() {
                    t.wake_watchers();
                }
            },
        )?;
        *w = Some(stop.clone());
        Ok(stop)
    }
}

impl Drop for GpuPeer {
    fn drop(&mut self) {
        // The watcher closes what is left and ends: closing is a driver call, and
        // the last holder of a connection may be a copy's completion callback, where
        // none may be made (nor may it wait for a thread that makes one). Copies
        // still running hold their own references.
        if let Some(stop) = self.watcher.get_mut().unwrap().take() {
            stop.store(true, Ordering::Release);
            self.table.wake_watchers();
        }
    }
}

impl Batch {
    /// Queue the copies on the device; `done` runs once they have all finished, on
    /// the driver's callback thread (it must make no CUDA call). On `Err` nothing
    /// was queued and `done` is not called.
    pub(crate) fn start(self, done: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        let Self {
            device,
            copies,
            one_kernel,
            hold,
        } = self;
        // SAFETY: every range was checked inside a grant the target made (or inside
        // this process's registration); `hold` keeps the grants counted (the target
        // neither frees nor deregisters them meanwhile), the mappings open and the
        // local registrations alive until the device finished and `done` ran.
        unsafe { nixl::gpu::copy_device_batch(device, &copies, one_kernel, Box::new(hold), done) }
    }
}
