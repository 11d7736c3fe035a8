//! A **test double** of UCCL's engine API: in-process engines that reproduce the
//! behaviour of `libuccl_p2p.so` that bit NIXL's UCCL backend, so this crate's
//! lifecycle can be tested on any machine.
//!
//! It proves this crate's structure (who calls what, when, from which thread, in which
//! order), not UCCL's data path: a "transfer" is a `memcpy` between two registrations
//! of this process. What it reproduces:
//! - `accept` does not return before the engine's first registration, and ignores
//!   stop-accept while it waits for it (UCCL's `Endpoint::accept` spins on
//!   `engine_initialized_`); after that it blocks until a peer connects or
//!   stop-accept (sticky, as a flag) is called;
//! - `connect` blocks until the peer's engine accepts it (or that engine is
//!   destroyed);
//! - a transfer towards a [frozen](freeze) engine is never done (UCCL's status says
//!   only "done or not"); one towards an engine that was destroyed is reported done
//!   without moving data (a queue pair whose peer died is flushed, and UCCL reports
//!   a failed operation as done), at once or after a [delay](set_flush_delay);
//! - an operation that fails is reported done without moving data ([`lose_data`]);
//! - an operation towards a [delaying](delay_operations) engine is not done, and
//!   moves its bytes only when [released](finish_delayed) (a NIC still working on
//!   it), and only if both memory regions are still registered then;
//! - a process-wide notification list (UCCL's `notify_list`), which this crate must
//!   never use: [`notifications_sent`] counts what went into it.
//!
//! Misuse that would crash or hang the real library is recorded as a
//! [violation](violations) instead: a call on a destroyed engine or connection, an
//! engine call (create, connect, accept, read, write, status) from a thread that did
//! not bind its CUDA context first ([`EngineApi::bind_thread`]),
//! destroying an engine with connections or registrations still open, entering accept
//! before any registration, destroying a memory region that an operation not yet
//! done still uses.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use nixl::{Error, ErrorKind, Result};

use crate::api::{Accepted, ConnHandle, EngineApi, EngineHandle, FifoItem};

#[derive(Debug, Default)]
struct Engine {
    port: u16,
    regs: HashMap<u64, (usize, usize, u32)>,
    registered_once: bool,
    pending: VecDeque<usize>,
    stop_accept: bool,
    frozen: bool,
    /// Operations towards it are reported done without moving data.
    losing: bool,
    /// Operations towards it wait for [`finish_delayed`], which moves their bytes.
    delaying: bool,
    holding: bool,
    /// How long after this engine's destruction operations towards it are flushed.
    flush_delay: Duration,
    /// Connections made from or accepted by this engine and not destroyed.
    conns: usize,
}

/// One operation in the engine.
#[derive(Debug, Clone, Copy)]
struct Xfer {
    done: bool,
    /// The engine it goes to.
    peer: usize,
    /// The engine that posted it, and its local memory region.
    engine: usize,
    mr: u64,
    /// A delayed operation's copy: (source, destination, length), and the remote
    /// key it needs, moved by [`finish_delayed`].
    delayed: Option<(usize, usize, usize, u32)>,
}

impl Xfer {
    /// Whether the engine is done with it: reported done, or flushed (the peer
    /// engine is gone, its flush delay passed; an RC queue pair whose peer died
    /// completes its work in error, and UCCL reports that as done).
    fn finished(&self, w: &World) -> bool {
        self.done
            || (!w.engines.contains_key(&self.peer)
                && w.gone
                    .get(&self.peer)
                    .is_none_or(|(at, d)| at.elapsed() >= *d))
    }
}

#[derive(Debug)]
struct Conn {
    /// The engine this handle belongs to.
    engine: usize,
    /// The other side's engine.
    peer: usize,
    accepted: bool,
}

#[derive(Debug, Default)]
struct World {
    next: usize,
    engines: HashMap<usize, Engine>,
    by_port: HashMap<u16, usize>,
    conns: HashMap<usize, Conn>,
    /// Operations by transfer id.
    xfers: HashMap<u64, Xfer>,
    violations: Vec<String>,
    notifications: usize,
    live_engines: usize,
    next_port: u16,
    /// Destroyed engines: when, and their flush delay.
    gone: HashMap<usize, (std::time::Instant, Duration)>,
}

static WORLD: Mutex<Option<World>> = Mutex::new(None);
static CHANGED: Condvar = Condvar::new();

fn world() -> MutexGuard<'static, Option<World>> {
    WORLD.lock().unwrap_or_else(|e| e.into_inner())
}

fn with<R>(f: impl FnOnce(&mut World) -> R) -> R {
    let mut g = world();
    f(g.get_or_insert_with(World::default))
}

impl World {
    fn id(&mut self) -> usize {
        self.next += 1;
        self.next
    }

    fn violation(&mut self, v: String) {
        tracing::error!(violation = %v, "UCCL test double: misuse");
        self.violations.push(v);
    }
}

fn fail(op: &'static str, msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, op, msg)
}

/// The test double. Stateless: every engine lives in one process-wide world.
#[derive(Debug, Default, Clone, Copy)]
pub struct TestDouble;

impl TestDouble {
    /// The double as an engine API for [`crate::UcclBackend::with_api`].
    pub fn api() -> Arc<dyn EngineApi> {
        Arc::new(Self)
    }
}

/// Misuse recorded so far (see the module docs), process-wide.
pub fn violations() -> Vec<String> {
    with(|w| w.violations.clone())
}

/// Notifications sent through the double's process-wide list (UCCL's own channel).
/// nixl-uccl never uses it.
pub fn notifications_sent() -> usize {
    with(|w| w.notifications)
}

/// Engines created and not yet destroyed, process-wide.
pub fn live_engines() -> usize {
    with(|w| w.live_engines)
}

/// Connections not yet destroyed, process-wide.
pub fn live_connections() -> usize {
    with(|w| w.conns.len())
}

fn engine_mut(w: &mut World, engine_metadata: &str) -> Option<usize> {
    let port = engine_metadata
        .split_once('?')
        .and_then(|(a, _)| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())?;
    w.by_port.get(&port).copied()
}

/// The connections not yet destroyed, described (for failure messages).
pub fn connection_details() -> Vec<String> {
    with(|w| {
        w.conns
            .iter()
            .map(|(id, c)| {
                format!(
                    "conn {id} of engine {} (engine live: {}), to {}, accepted {}",
                    c.engine,
                    w.engines.contains_key(&c.engine),
                    c.peer,
                    c.accepted
                )
            })
            .collect()
    })
}

/// Make transfers towards the engine announced as `engine_metadata` never complete
/// (a peer whose NIC went away while its process lives on).
pub fn freeze(engine_metadata: &str) {
    with(|w| {
        if let Some(e) = engine_mut(w, engine_metadata) {
            w.engines.get_mut(&e).unwrap().frozen = true;
        }
    });
}

/// Make operations towards the engine announced as `engine_metadata` report done
/// without moving any data (`lose = true`) while the peer stays healthy otherwise:
/// what UCCL 0.1.1 does with an operation that failed (a queue pair flushed in error
/// completes, and its status says only "done or not").
pub fn lose_data(engine_metadata: &str, lose: bool) {
    with(|w| {
        if let Some(e) = engine_mut(w, engine_metadata) {
            w.engines.get_mut(&e).unwrap().losing = lose;
        }
    });
}

/// Operations towards the engine announced as `engine_metadata` that are in flight
/// when it is destroyed are flushed (reported done) `delay` later, not at once: an RC
/// queue pair notices a dead peer only after its retry timeout.
pub fn set_flush_delay(engine_metadata: &str, delay: Duration) {
    with(|w| {
        if let Some(e) = engine_mut(w, engine_metadata) {
            w.engines.get_mut(&e).unwrap().flush_delay = delay;
        }
    });
}

/// Undo [`freeze`]: operations towards that engine that were never done are reported
/// done from now on (late completions; their data is not moved).
pub fn thaw(engine_metadata: &str) {
    with(|w| {
        if let Some(e) = engine_mut(w, engine_metadata) {
            w.engines.get_mut(&e).unwrap().frozen = false;
            for x in w.xfers.values_mut() {
                if x.peer == e && x.delayed.is_none() {
                    x.done = true;
                }
            }
        }
    });
}

/// Make operations towards the engine announced as `engine_metadata` wait
/// (`delay = true`): they are not done, and move no bytes, until
/// [`finish_delayed`]; a NIC still working on them.
pub fn delay_operations(engine_metadata: &str, delay: bool) {
    with(|w| {
        if let Some(e) = engine_mut(w, engine_metadata) {
            w.engines.get_mut(&e).unwrap().delaying = delay;
        }
    });
}

/// Finish the delayed operations towards the engine announced as `engine_metadata`
/// (see [`delay_operations`]): each moves its bytes now, if its local memory region
/// and the peer's (by key) are both still registered (a NIC fails an operation
/// whose memory region is gone, and moves nothing), and is reported done. Returns
/// how many moved bytes.
pub fn finish_delayed(engine_metadata: &str) -> usize {
    with(|w| {
        let Some(e) = engine_mut(w, engine_metadata) else {
            return 0;
        };
        let ids: Vec<u64> = w
            .xfers
            .iter()
            .filter(|(_, x)| x.peer == e && !x.done && x.delayed.is_some())
            .map(|(id, _)| *id)
            .collect();
        let mut moved = 0;
        for id in ids {
            let x = w.xfers[&id];
            let (src, dst, len, rkey) = x.delayed.expect("filtered");
            let local = w.engines.get(&x.engine).and_then(|g| g.regs.get(&x.mr));
            let remote = w.engines[&e].regs.values().any(|&(_, _, k)| k == rkey);
            if local.is_some() && remote {
                // SAFETY: both ranges were checked against live registrations when
                // posted, and both regions are registered still (their owners keep
                // the memory alive until they destroy the regions).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
                moved += 1;
            }
            w.xfers.get_mut(&id).unwrap().done = true;
        }
        moved
    })
}

/// Operations posted by the engine announced as `engine_metadata` that it is not
/// done with (see [`finish_delayed`], [`freeze`]).
pub fn operations_in_flight(engine_metadata: &str) -> usize {
    with(|w| {
        let Some(e) = engine_mut(w, engine_metadata) else {
            return 0;
        };
        w.xfers
            .values()
            .filter(|x| x.engine == e && !x.finished(w))
            .count()
    })
}

/// Connections of the engine announced as `engine_metadata` (made or accepted by
/// it) not yet destroyed.
pub fn engine_connections(engine_metadata: &str) -> usize {
    with(|w| {
        engine_mut(w, engine_metadata)
            .and_then(|e| w.engines.get(&e))
            .map_or(0, |e| e.conns)
    })
}

/// Whether the engine announced as `engine_metadata` still exists.
pub fn engine_alive(engine_metadata: &str) -> bool {
    with(|w| engine_mut(w, engine_metadata).is_some())
}

/// Memory regions registered in the engine announced as `engine_metadata`.
pub fn registrations(engine_metadata: &str) -> usize {
    with(|w| {
        engine_mut(w, engine_metadata)
            .and_then(|e| w.engines.get(&e))
            .map_or(0, |e| e.regs.len())
    })
}

/// Make the engine announced as `engine_metadata` leave inbound connections pending
/// (`hold = true`: connects to it block) or take them again.
pub fn hold_accepts(engine_metadata: &str, hold: bool) {
    with(|w| {
        if let Some(e) = engine_mut(w, engine_metadata) {
            w.engines.get_mut(&e).unwrap().holding = hold;
        }
    });
    CHANGED.notify_all();
}

/// The double's version of UCCL's notification call, counted in
/// [`notifications_sent`]; present so tests can show this crate never calls it.
pub fn send_notif_through_engine() {
    with(|w| w.notifications += 1);
}

thread_local! {
    /// Whether this thread called [`EngineApi::bind_thread`].
    static BOUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Record a violation unless the calling thread bound its CUDA context.
fn check_bound(w: &mut World, call: &str) {
    if !BOUND.with(std::cell::Cell::get) {
        let t = std::thread::current();
        w.violation(format!(
            "{call} on thread {:?} with no CUDA context bound (bind_thread not called)",
            t.name().unwrap_or("?")
        ));
    }
}

impl EngineApi for TestDouble {
    fn describe(&self) -> String {
        "UCCL engine test double (in-process; not UCCL's data path)".into()
    }

    fn bind_thread(&self, _device: u32) -> Result<()> {
        BOUND.with(|b| b.set(true));
        Ok(())
    }

    fn create(&self) -> Result<EngineHandle> {
        Ok(EngineHandle(with(|w| {
            check_bound(w, "create");
            let id = w.id();
            // A port no live engine has (ports are the double's addresses).
            let port = loop {
                w.next_port = w.next_port.wrapping_add(1).max(1024);
                if !w.by_port.contains_key(&w.next_port) {
                    break w.next_port;
                }
            };
            w.engines.insert(
                id,
                Engine {
                    port,
                    ..Default::default()
                },
            );
            w.by_port.insert(port, id);
            w.live_engines += 1;
            id
        })))
    }

    unsafe fn destroy(&self, e: EngineHandle) {
        with(|w| match w.engines.remove(&e.0) {
            None => w.violation(format!("destroy of engine {} twice or never created", e.0)),
            Some(eng) => {
                w.by_port.remove(&eng.port);
                w.live_engines -= 1;
                w.gone
                    .insert(e.0, (std::time::Instant::now(), eng.flush_delay));
                if eng.conns > 0 {
                    w.violation(format!(
                        "engine {} destroyed with {} connection(s) open",
                        e.0, eng.conns
                    ));
                }
                if !eng.regs.is_empty() {
                    w.violation(format!(
                        "engine {} destroyed with {} registration(s)",
                        e.0,
                        eng.regs.len()
                    ));
                }
            }
        });
        CHANGED.notify_all();
    }

    fn metadata(&self, e: EngineHandle) -> Result<String> {
        with(|w| match w.engines.get(&e.0) {
            Some(eng) => Ok(format!("127.0.0.1:{}?double", eng.port)),
            None => {
                w.violation(format!("metadata of destroyed engine {}", e.0));
                Err(fail("UCCL metadata", "no such engine"))
            }
        })
    }

    fn connect(&self, e: EngineHandle, _ip: &str, _gpu: &str, port: u16) -> Result<ConnHandle> {
        const OP: &str = "UCCL connect";
        let mut g = world();
        let w = g.get_or_insert_with(World::default);
        check_bound(w, "connect");
        if !w.engines.contains_key(&e.0) {
            w.violation(format!("connect on destroyed engine {}", e.0));
            return Err(fail(OP, "no such engine"));
        }
        let Some(&peer) = w.by_port.get(&port) else {
            return Err(Error::new(
                ErrorKind::RemoteDisconnected,
                OP,
                format!("nothing listens on {port}"),
            ));
        };
        let id = w.id();
        w.conns.insert(
            id,
            Conn {
                engine: e.0,
                peer,
                accepted: false,
            },
        );
        w.engines.get_mut(&e.0).unwrap().conns += 1;
        w.engines.get_mut(&peer).unwrap().pending.push_back(id);
        CHANGED.notify_all();
        // Blocks until accepted, like UCCL's; only the peer engine's end stops it.
        loop {
            let w = g.as_mut().unwrap();
            if w.conns.get(&id).is_some_and(|c| c.accepted) {
                return Ok(ConnHandle(id));
            }
            if !w.engines.contains_key(&peer) {
                w.conns.remove(&id);
                if let Some(eng) = w.engines.get_mut(&e.0) {
                    eng.conns -= 1;
                }
                return Err(Error::new(
                    ErrorKind::RemoteDisconnected,
                    OP,
                    "the peer engine went away",
                ));
            }
            g = CHANGED.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn accept(&self, e: EngineHandle) -> Option<Accepted> {
        let mut g = world();
        {
            let w = g.get_or_insert_with(World::default);
            check_bound(w, "accept");
            match w.engines.get(&e.0) {
                None => {
                    w.violation(format!("accept on destroyed engine {}", e.0));
                    return None;
                }
                Some(eng) if !eng.registered_once => {
                    w.violation(format!("accept entered on engine {} before its first registration (UCCL would ignore stop-accept here)", e.0));
                }
                Some(_) => {}
            }
        }
        // UCCL: wait for the first registration, deaf to stop-accept.
        loop {
            let w = g.as_mut().unwrap();
            match w.engines.get(&e.0) {
                Some(eng) if eng.registered_once => break,
                Some(_) => {}
                None => return None,
            }
            g = CHANGED.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        loop {
            let w = g.as_mut().unwrap();
            let eng = w.engines.get_mut(&e.0)?;
            if eng.stop_accept {
                return None;
            }
            if let Some(c) = (!eng.holding).then(|| eng.pending.pop_front()).flatten() {
                eng.conns += 1;
                let id = w.id();
                w.conns.insert(
                    id,
                    Conn {
                        engine: e.0,
                        peer: usize::MAX,
                        accepted: true,
                    },
                );
                if let Some(out) = w.conns.get_mut(&c) {
                    out.accepted = true;
                }
                CHANGED.notify_all();
                return Some(Accepted {
                    conn: ConnHandle(id),
                    ip: "127.0.0.1".into(),
                });
            }
            g = CHANGED.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn stop_accept(&self, e: EngineHandle) {
        with(|w| match w.engines.get_mut(&e.0) {
            Some(eng) => eng.stop_accept = true,
            None => w.violation(format!("stop_accept on destroyed engine {}", e.0)),
        });
        CHANGED.notify_all();
    }

    unsafe fn reg(&self, e: EngineHandle, addr: usize, len: usize) -> Result<u64> {
        let r = with(|w| {
            let id = w.id() as u64;
            match w.engines.get_mut(&e.0) {
                Some(eng) => {
                    eng.regs.insert(id, (addr, len, (id as u32) ^ 0x5a5a_0000));
                    eng.registered_once = true;
                    Ok(id)
                }
                None => {
                    w.violation(format!("reg on destroyed engine {}", e.0));
                    Err(fail("UCCL register", "no such engine"))
                }
            }
        });
        CHANGED.notify_all();
        r
    }

    fn mr_destroy(&self, e: EngineHandle, mr: u64) {
        with(|w| {
            let using = w
                .xfers
                .values()
                .filter(|x| x.engine == e.0 && x.mr == mr && !x.finished(w))
                .count();
            if using > 0 {
                w.violation(format!(
                    "mr_destroy of region {mr} of engine {} while {using} operation(s) on it are not done",
                    e.0
                ));
            }
            match w.engines.get_mut(&e.0) {
                Some(eng) => {
                    eng.regs.remove(&mr);
                }
                None => w.violation(format!("mr_destroy on destroyed engine {}", e.0)),
            }
        });
    }

    fn prepare_fifo(&self, e: EngineHandle, mr: u64, addr: usize, len: usize) -> Result<FifoItem> {
        with(|w| {
            let Some(&(_, _, rkey)) = w.engines.get(&e.0).and_then(|eng| eng.regs.get(&mr)) else {
                return Err(fail("UCCL register", "no such region"));
            };
            Ok(FifoItem {
                addr: addr as u64,
                size: len.min(u32::MAX as usize) as u32,
                rkey,
                nmsgs: 0,
                rid: 0,
                idx: mr,
                padding: [0; 32],
            })
        })
    }

    unsafe fn write(
        &self,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { self.xfer(c, mr, addr, len, remote, true) }
    }

    unsafe fn read(
        &self,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { self.xfer(c, mr, addr, len, remote, false) }
    }

    fn done(&self, c: ConnHandle, id: u64) -> Result<bool> {
        Ok(with(|w| {
            check_bound(w, "status");
            if !w.conns.contains_key(&c.0) {
                w.violation(format!("status on destroyed connection {}", c.0));
                return false;
            }
            match w.xfers.get(&id).copied() {
                // Done, or flushed.
                Some(x) if x.finished(w) => {
                    w.xfers.remove(&id);
                    true
                }
                Some(_) => false,
                None => {
                    w.violation(format!("status of unknown or finished transfer {id}"));
                    false
                }
            }
        }))
    }

    unsafe fn conn_destroy(&self, c: ConnHandle) {
        with(|w| match w.conns.remove(&c.0) {
            Some(conn) => {
                if let Some(eng) = w.engines.get_mut(&conn.engine) {
                    eng.conns -= 1;
                } else {
                    w.violation(format!("connection {} destroyed after its engine", c.0));
                }
            }
            None => w.violation(format!("destroy of connection {} twice or never made", c.0)),
        });
        CHANGED.notify_all();
    }
}

impl TestDouble {
    /// # Safety
    /// As [`EngineApi::write`].
    unsafe fn xfer(
        &self,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
        write: bool,
    ) -> Result<u64> {
        const OP: &str = "UCCL transfer";
        with(|w| {
            check_bound(w, if write { "write" } else { "read" });
            let Some(conn) = w.conns.get(&c.0) else {
                w.violation(format!("transfer on destroyed connection {}", c.0));
                return Err(fail(OP, "no such connection"));
            };
            let (local_engine, peer) = (conn.engine, conn.peer);
            let local_ok = w
                .engines
                .get(&local_engine)
                .and_then(|e| e.regs.get(&mr))
                .is_some_and(|&(a, l, _)| addr >= a && addr + len <= a + l);
            if !local_ok {
                return Err(fail(
                    OP,
                    format!("local range {addr:#x}+{len} is not in region {mr}"),
                ));
            }
            let id = w.id() as u64;
            let mut x = Xfer {
                done: false,
                peer,
                engine: local_engine,
                mr,
                delayed: None,
            };
            let Some(target) = w.engines.get(&peer) else {
                // The peer engine is gone: completes (flushed) without moving data.
                w.xfers.insert(id, x);
                return Ok(id);
            };
            if target.frozen {
                w.xfers.insert(id, x);
                return Ok(id);
            }
            let hit = target
                .regs
                .values()
                .find(|&&(_, _, k)| k == remote.rkey)
                .copied();
            let Some((ra, rl, _)) = hit else {
                return Err(fail(
                    OP,
                    format!("remote key {:#x} unknown to the peer", remote.rkey),
                ));
            };
            let raddr = remote.addr as usize;
            if len > remote.size as usize || raddr < ra || raddr + len > ra + rl {
                return Err(fail(
                    OP,
                    format!("remote range {raddr:#x}+{len} outside the peer's region"),
                ));
            }
            x.done = true;
            if target.losing {
                w.xfers.insert(id, x);
                return Ok(id);
            }
            let (src, dst) = if write { (addr, raddr) } else { (raddr, addr) };
            if target.delaying {
                x.done = false;
                x.delayed = Some((src, dst, len, remote.rkey));
                w.xfers.insert(id, x);
                return Ok(id);
            }
            // SAFETY: both ranges lie in live registrations of this process (checked
            // above against the two engines' tables; the caller keeps the local one
            // alive, the peer's owner keeps its regions registered while its engine
            // lives); registered memory is only ever accessed through raw pointers.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
            w.xfers.insert(id, x);
            Ok(id)
        })
    }
}

/// Wait (bounded) until `f` holds on the world; for tests.
pub fn wait_until(timeout: Duration, f: impl Fn() -> bool) -> bool {
    let end = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}

/// The engine owner's teardown (`crate::api`) against the double: here rather than
/// beside the owner, so that the API never imports its double.
#[cfg(test)]
mod owner_tests {
    use std::sync::Arc;

    use super::TestDouble;
    use crate::api::{EngineOwner, NewEngine, OwnedConn};
    use crate::test_double;

    /// Two threads close an engine's inbound connections at once (a shutdown and
    /// another closer): when either `close_inbound` returns, every inbound
    /// connection is destroyed. Before the destroys ran under the list's lock, the
    /// loser found the list empty and returned while the winner was still
    /// destroying, and a shutdown then went on to deregister memory.
    #[test]
    fn close_inbound_returns_only_once_every_connection_is_destroyed() {
        const CONNS: usize = 64;
        let api = TestDouble::api();
        api.bind_thread(0).unwrap();
        let owner = || Arc::new(EngineOwner::new(NewEngine::create(api.clone(), 0).unwrap()));
        let (a, b) = (owner(), owner());
        let b_meta = api.metadata(b.engine).unwrap();
        let port: u16 = b_meta
            .split_once('?')
            .and_then(|(x, _)| x.rsplit_once(':'))
            .and_then(|(_, p)| p.parse().ok())
            .unwrap();
        // B's accept waits for its first registration.
        let mem = [0u8; 64];
        // SAFETY: `mem` outlives the region, destroyed below before it drops.
        let mr = unsafe { api.reg(b.engine, mem.as_ptr() as usize, mem.len()) }.unwrap();
        for round in 0..50 {
            let acceptor = {
                let b = b.clone();
                std::thread::spawn(move || {
                    b.bind_thread().unwrap();
                    for _ in 0..CONNS {
                        b.accept().expect("accepted");
                    }
                })
            };
            let outbound: Vec<OwnedConn> = (0..CONNS)
                .map(|_| a.connect("127.0.0.1", "double", port).unwrap())
                .collect();
            acceptor.join().unwrap();
            assert_eq!(test_double::engine_connections(&b_meta), CONNS);
            let start = Arc::new(std::sync::Barrier::new(2));
            let closers: Vec<_> = (0..2)
                .map(|_| {
                    let (b, start, b_meta) = (b.clone(), start.clone(), b_meta.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        b.close_inbound();
                        test_double::engine_connections(&b_meta)
                    })
                })
                .collect();
            for c in closers {
                let left = c.join().unwrap();
                assert_eq!(
                    left, 0,
                    "round {round}: close_inbound returned with {left} inbound connection(s) not yet destroyed"
                );
            }
            drop(outbound);
        }
        api.mr_destroy(b.engine, mr);
        drop((a, b));
        assert_eq!(test_double::violations(), Vec::<String>::new());
    }
}
