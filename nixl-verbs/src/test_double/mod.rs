//! A **test double** of the verbs API: an in-process "software RDMA NIC" (device
//! `dbl0`) on which this crate's backend runs, on any machine, with two or more agents
//! of one process talking to each other through it.
//!
//! It proves the crate's structure and its use of verbs semantics (connection setup,
//! posting, completions, completion events, errors, teardown order), **not a NIC's
//! data path**: a "transfer" is a memory copy between registrations of this process,
//! made by one worker thread under a process-wide lock. Nothing here says anything
//! about speed, ordering across queue pairs, PCIe, or the wire protocol.
//!
//! # What it reproduces
//! - One RoCE device `dbl0` ([`DEVICE_GUID`]), one port: ACTIVE, Ethernet, MTU 4096,
//!   LID 0, a GID table of two entries ([`GIDS`]: RoCE v1 link-local, RoCE v2
//!   IPv4-mapped); `query_gid` beyond it gives `Ok(None)`.
//!   Small limits ([`Limits::DEFAULT`]: 128 work requests, 4 entries, 64 KiB messages,
//!   64 inline bytes) so that the backend's splitting logic is exercised.
//! - Memory regions with distinct random non-zero keys (lkey ≠ rkey); `REMOTE_WRITE`
//!   without `LOCAL_WRITE` is refused as libibverbs refuses it.
//! - Completion channels whose descriptor is a real non-blocking eventfd. A queue is
//!   armed by `req_notify_cq` for the **next** completion
//!   added after arming (ones already queued do not fire it); that completion disarms
//!   it, queues one event and makes the descriptor readable. The descriptor stays
//!   readable until `get_cq_event` has taken every event.
//! - Completion queues of exactly the size asked; an overflow is a violation and the
//!   completion is lost.
//! - RC queue pairs: RESET → INIT → RTR → RTS in that order (else
//!   `ErrorKind::InvalidArgument`, like `EINVAL`), ERROR from any state. RTR checks
//!   that the path MTU fits the port and, Ethernet being the link layer, that a global
//!   route names one of the device's GIDs; like a NIC, it does not check that the
//!   destination QP exists (the first request to a missing one fails). A peer
//!   only accepts packets from the QP its own RTR named (as RC does).
//! - Asynchronous execution on one worker thread (see *Thread*), in order per queue
//!   pair: WRITE (gather), READ (scatter), SEND into the peer's oldest receive, inline
//!   sends copied at post time. Local keys and ranges are checked against regions of
//!   the queue pair's PD (`LOC_PROT_ERR`), remote keys against the peer's PD, its
//!   access flags and its queue pair's INIT access flags (`REM_ACCESS_ERR`); a
//!   message over the port's `max_msg_sz` completes with `LOC_LEN_ERR`; a SEND larger
//!   than the receive buffer completes `LOC_LEN_ERR` on the receiver and
//!   `REM_INV_REQ_ERR` on the sender. A SEND towards a queue pair with no receive
//!   posted waits (receiver not ready) without holding up other queue pairs: forever
//!   with `rnr_retry` 7, else it fails with `RNR_RETRY_EXC_ERR` after
//!   `(rnr_retry + 1) × 10 ms`.
//! - A peer queue pair that is destroyed, not in RTR/RTS, or on a [killed](kill) or
//!   closed device: work towards it completes with `RETRY_EXC_ERR` (at once, not after
//!   a retry timeout).
//! - Completions only for signaled work requests or errors. Any error completion puts
//!   the queue pair in ERROR (the receiver's too, for a receive-side error).
//! - **Flushes**: in ERROR, every send work request still queued or posted later is
//!   flushed with `WR_FLUSH_ERR`, **but only signaled ones produce a completion**
//!   (the spec leaves unsignaled flushes to the device; the backend must not rely on
//!   them); every posted receive produces a flush completion.
//! - Queue capacity: a send queue holds `max_send_wr` outstanding work requests; one
//!   is retired when `poll_cq` has taken its completion or that
//!   of a later signaled work request of the same queue pair (so a chain of
//!   unsignaled requests is freed by its last, signaled, one). Posting past capacity
//!   accepts what fits and returns [`PostError`] with `posted` and
//!   `ErrorKind::Backend` (libibverbs' `ENOMEM`). Receive queues likewise.
//! - Destroying a queue pair drops its outstanding work without completions and
//!   removes its completions still in the queue (as libmlx5 does).
//!
//! # What it does not
//! No wire, no packet sequence numbers, timeouts or retry counters (beyond the RNR
//! rule above), no atomics, no immediate data, no SRQ, no fences (execution is in
//! order anyway), no solicited events, no asynchronous events, no InfiniBand
//! addressing, no memory windows. Remote access errors do not move the responder's
//! queue pair to ERROR. Data is copied under one lock: no torn reads, unlike a NIC.
//!
//! # Violations
//! Misuse that would crash, hang or corrupt the real library is recorded (see
//! [`violations`], [`violations_of`]) and the call returns an error (or, where the
//! real call cannot fail, does what the kernel would) — it never panics: a handle that
//! was destroyed, never made, or of the wrong kind; entries outside the list posted
//! with a work request; mixing objects of two device contexts; destroying a
//! completion queue that a live queue pair uses (`EBUSY`: kept) or with events taken
//! and not acknowledged (the real call would wait forever: destroyed anyway);
//! acknowledging more events than taken; closing a channel with live queues or
//! deallocating a PD with live regions or queue pairs (`EBUSY`: kept); closing a
//! device with live children (the kernel's clean-up is mimicked: they are destroyed);
//! a completion queue overflow.
//!
//! The world is process-wide, so the unit tests of this module (which cause
//! violations on purpose) share it with whatever runs in the same test binary: a test
//! that asserts "no violations" should use [`violations_of`] for its own device
//! contexts, or run in a binary of its own.
//!
//! # Thread
//! One worker thread (`nixl-verbs-double`), started by the first post that needs it,
//! executes all work; it parks while there is none and ends on its own
//! [`IDLE_EXIT`] after the last work is done ([`worker_running`] tells), so it never
//! keeps a test process alive or outlives the work. Destroying the last queue pair
//! ends it at once and waits for it, so agents that shut down leave no thread of the
//! double behind (the conformance suite counts the process's threads).
//!
//! # Controls
//! [`kill`] (a device dies), [`live_objects`] / [`live_objects_of`] /
//! [`live_details`] (leak checks), [`set_limits`] (limits of devices opened later),
//! [`wait_until`].
//!
//! It implements the crate's `VerbsApi` (whose calls are unsafe) and copies between
//! registrations through raw pointers, as a NIC's DMA would: the crate's other
//! module allowed `unsafe`, besides `ffi`.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nixl::{Error, ErrorKind, Result};

use crate::api::{
    access, Channel, Completion, DeviceInfo, DeviceLimits, GidEntry, GidType, Handle, LinkLayer,
    Mr, Mtu, PortInfo, PostError, Qp, QpCaps, QpTransition, RecvWr, SendOp, SendWr, Sge, WcOpcode,
    WcStatus, PORT_ACTIVE,
};
use crate::ffi::VerbsApi;

/// The double's only device.
pub const DEVICE_NAME: &str = "dbl0";
/// Its node GUID.
pub const DEVICE_GUID: u64 = 0x0002_c9ff_fed0_0b1e;
/// Its port's GID table: index 0 RoCE v1 (link-local), index 1 RoCE v2 (IPv4-mapped
/// `::ffff:10.0.0.1`).
pub const GIDS: [[u8; 16]; 2] = [
    [
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x02, 0xc9, 0xff, 0xfe, 0xd0, 0x0b, 0x1e,
    ],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1],
];
/// The port's active MTU (4096 bytes).
pub const PORT_MTU: Mtu = Mtu(5);
/// How long the worker thread waits idle before it ends.
pub const IDLE_EXIT: Duration = Duration::from_millis(100);
/// One receiver-not-ready retry (`rnr_retry` below 7 gives up after `rnr_retry + 1`).
const RNR_STEP: Duration = Duration::from_millis(10);
/// How often the worker looks again at work that waits (receiver not ready).
const RNR_POLL: Duration = Duration::from_millis(2);

const LOC_LEN_ERR: WcStatus = WcStatus(1);
const REM_INV_REQ_ERR: WcStatus = WcStatus(9);
const REM_OP_ERR: WcStatus = WcStatus(11);

const CTX: &str = "device context";
const PD: &str = "protection domain";
const MR: &str = "memory region";
const CHAN: &str = "completion channel";
const CQ: &str = "completion queue";
const QP: &str = "queue pair";

/// Limits of the double's device; [`set_limits`] changes them for devices opened later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// What `VerbsApi::query_device` reports and `create_qp`/`create_cq`/`reg_mr`
    /// enforce (`phys_port_cnt` is reported only: the device has port 1).
    pub device: DeviceLimits,
    /// The port's largest message.
    pub max_msg_sz: u32,
    /// Largest inline send a queue pair is granted.
    pub max_inline_data: u32,
}

impl Limits {
    /// The defaults: small, so that splitting is exercised.
    pub const DEFAULT: Self = Self {
        device: DeviceLimits {
            max_mr_size: 1 << 40,
            max_qp_wr: 128,
            max_sge: 4,
            max_sge_rd: 2,
            max_cqe: 4096,
            max_qp_rd_atom: 16,
            max_qp_init_rd_atom: 16,
            phys_port_cnt: 1,
        },
        max_msg_sz: 64 << 10,
        max_inline_data: 64,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[derive(Debug)]
struct Ctx {
    limits: Limits,
    dead: bool,
}

#[derive(Debug)]
struct Pd {
    ctx: usize,
}

#[derive(Debug)]
struct MrObj {
    pd: usize,
    addr: u64,
    len: u64,
    access: u32,
    lkey: u32,
    rkey: u32,
}

#[derive(Debug)]
struct Chan {
    ctx: usize,
    fd: RawFd,
    /// Events not yet taken, by completion queue.
    events: VecDeque<usize>,
}

#[derive(Clone, Copy, Debug)]
enum Origin {
    /// A send work request, by its sequence number in its queue pair.
    Send(u64),
    /// A receive, likewise.
    Recv(u64),
}

#[derive(Clone, Copy, Debug)]
struct Cqe {
    wc: Completion,
    qp: usize,
    origin: Origin,
}

#[derive(Debug)]
struct Cq {
    ctx: usize,
    channel: usize,
    cap: usize,
    entries: VecDeque<Cqe>,
    armed: bool,
    /// Events taken by `get_cq_event`, and acknowledged.
    taken: u64,
    acked: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Error,
}

impl QpState {
    fn name(self) -> &'static str {
        match self {
            Self::Reset => "RESET",
            Self::Init => "INIT",
            Self::Rtr => "RTR",
            Self::Rts => "RTS",
            Self::Error => "ERROR",
        }
    }
}

#[derive(Debug)]
struct SendJob {
    seq: u64,
    wr: SendWr,
    sges: Vec<Sge>,
    /// The payload of an inline send, copied at post time.
    inline: Option<Vec<u8>>,
    /// When it first found no receive posted at the peer.
    rnr_since: Option<Instant>,
}

#[derive(Debug)]
struct RecvJob {
    seq: u64,
    wr: RecvWr,
}

#[derive(Debug)]
struct QpObj {
    ctx: usize,
    pd: usize,
    cq: usize,
    num: u32,
    caps: QpCaps,
    state: QpState,
    access: u32,
    dest: Option<u32>,
    rnr_retry: u8,
    /// Posted and not yet executed.
    sq: VecDeque<SendJob>,
    rq: VecDeque<RecvJob>,
    send_posted: u64,
    send_retired: u64,
    recv_posted: u64,
    recv_retired: u64,
}

#[derive(Debug)]
struct World {
    next: usize,
    /// Every handle ever made, to its device context (for messages about stale ones).
    owner: HashMap<usize, usize>,
    ctxs: BTreeMap<usize, Ctx>,
    pds: BTreeMap<usize, Pd>,
    mrs: BTreeMap<usize, MrObj>,
    chans: BTreeMap<usize, Chan>,
    cqs: BTreeMap<usize, Cq>,
    qps: BTreeMap<usize, QpObj>,
    /// Memory keys: region, and whether it is the rkey.
    keys: HashMap<u32, (usize, bool)>,
    qp_nums: HashMap<u32, usize>,
    next_qp_num: u32,
    rng: u64,
    limits: Limits,
    /// Whether `reg_dmabuf_mr` works (see [`set_dmabuf`]).
    dmabuf: bool,
    /// Memory regions registered through `reg_dmabuf_mr`, ever.
    dmabuf_mrs: usize,
    /// `ibv_post_send` calls still to refuse (see [`refuse_sends`]).
    refuse_sends: usize,
    /// Whether the next poll of a receive completion fails (see [`fail_receive_poll`]).
    fail_receive_poll: bool,
    violations: Vec<(Option<usize>, String)>,
    /// The worker thread, while one runs.
    worker: Option<std::thread::JoinHandle<()>>,
}

static WORLD: Mutex<Option<World>> = Mutex::new(None);
/// Wakes the worker: work was posted, or something it waits on changed.
static WORK: Condvar = Condvar::new();

fn lock() -> MutexGuard<'static, Option<World>> {
    WORLD.lock().unwrap_or_else(|e| e.into_inner())
}

fn with<R>(f: impl FnOnce(&mut World) -> R) -> R {
    let mut g = lock();
    f(g.get_or_insert_with(World::new))
}

fn post_err(posted: usize, kind: ErrorKind, op: &'static str, msg: String) -> PostError {
    PostError {
        posted,
        error: Error::new(kind, op, msg),
    }
}

fn opcode(op: SendOp) -> WcOpcode {
    match op {
        SendOp::Write { .. } => WcOpcode::Write,
        SendOp::Read { .. } => WcOpcode::Read,
        SendOp::Send => WcOpcode::Send,
    }
}

/// Make the eventfd readable (add 1 to its counter).
fn signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: `fd` is the eventfd of a live channel (closed only when the channel is
    // removed, under the world lock that the caller holds); the buffer is the 8
    // readable bytes an eventfd write takes.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Reset the eventfd's counter (not readable any more).
fn drain(fd: RawFd) {
    let mut v: u64 = 0;
    // SAFETY: as in `signal`; the buffer is 8 writable bytes. The descriptor is
    // non-blocking, so an empty counter gives EAGAIN, which is ignored.
    let _ = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

/// Copy the job's payload to `dst`, entries in order.
///
/// # Safety
/// `dst..dst + payload` and every entry of a non-inline job lie in live registrations
/// of this process (checked under the world lock by the caller).
unsafe fn gather(job: &SendJob, dst: u64) {
    match &job.inline {
        Some(data) if !data.is_empty() => {
            // SAFETY: `data` is the double's own copy and cannot overlap registered
            // memory; the destination is registered (this function's contract).
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), dst as usize as *mut u8, data.len())
            };
        }
        Some(_) => {}
        None => {
            let mut at = dst;
            for s in job.sges.iter().filter(|s| s.len > 0) {
                // SAFETY: both ranges lie in live registrations (this function's
                // contract), which `reg_mr`'s caller keeps mapped; `copy` allows them
                // to overlap (a queue pair may be connected to itself).
                unsafe {
                    std::ptr::copy(
                        s.addr as usize as *const u8,
                        at as usize as *mut u8,
                        s.len as usize,
                    )
                };
                at += u64::from(s.len);
            }
        }
    }
}

/// Copy from `src` into the entries, in order.
///
/// # Safety
/// `src..src + total` and every entry lie in live registrations of this process.
unsafe fn scatter(sges: &[Sge], src: u64) {
    let mut at = src;
    for s in sges.iter().filter(|s| s.len > 0) {
        // SAFETY: both ranges lie in live registrations (this function's contract);
        // `copy` allows overlap.
        unsafe {
            std::ptr::copy(
                at as usize as *const u8,
                s.addr as usize as *mut u8,
                s.len as usize,
            )
        };
        at += u64::from(s.len);
    }
}

enum Exec {
    /// Waits for a receive at the peer.
    Blocked,
    Done {
        status: WcStatus,
        byte_len: u32,
    },
}

fn done(status: WcStatus) -> Exec {
    Exec::Done {
        status,
        byte_len: 0,
    }
}

mod api;
mod world;

/// The test double. Stateless: every object lives in one process-wide world.
#[derive(Debug, Default, Clone, Copy)]
pub struct TestDouble;

impl TestDouble {
    /// The double as the verbs API of the backend.
    pub(crate) fn api() -> Arc<dyn VerbsApi> {
        Arc::new(Self)
    }
}

/// The double as the verbs API of the backend (same as [`TestDouble::api`]).
pub(crate) fn api() -> Arc<dyn VerbsApi> {
    TestDouble::api()
}

/// Misuse recorded so far, process-wide (see the module docs), each prefixed with the
/// device context it concerns where known.
pub fn violations() -> Vec<String> {
    with(|w| {
        w.violations
            .iter()
            .map(|(ctx, v)| match ctx {
                Some(c) => format!("ctx {c}: {v}"),
                None => v.clone(),
            })
            .collect()
    })
}

/// Misuse recorded about objects of device context `ctx` (the handle
/// `VerbsApi::open` returned), for tests that share the process with others.
pub fn violations_of(ctx: Handle) -> Vec<String> {
    with(|w| {
        w.violations
            .iter()
            .filter(|(c, _)| *c == Some(ctx.0))
            .map(|(_, v)| v.clone())
            .collect()
    })
}

/// Make the device context `ctx` die (a NIC or its host gone): its queue pairs stop
/// answering, so work of peers towards them completes with `RETRY_EXC_ERR`; its own
/// outstanding and later work is dropped without completions. Its objects can still
/// be destroyed as usual. Unknown handles are ignored.
pub fn kill(ctx: Handle) {
    with(|w| {
        let Some(c) = w.ctxs.get_mut(&ctx.0) else {
            return;
        };
        c.dead = true;
        for q in w.qps.values_mut().filter(|q| q.ctx == ctx.0) {
            q.sq.clear();
            q.rq.clear();
        }
        // Peers waiting on it look again.
        WORK.notify_all();
    });
}

/// Objects (contexts, PDs, regions, channels, queues, queue pairs) not destroyed,
/// process-wide.
pub fn live_objects() -> usize {
    with(|w| w.ctxs.len() + w.pds.len() + w.mrs.len() + w.chans.len() + w.cqs.len() + w.qps.len())
}

/// Objects of device context `ctx` not destroyed, the context included.
pub fn live_objects_of(ctx: Handle) -> usize {
    with(|w| w.owner_count(ctx.0))
}

/// The objects not destroyed, described (for failure messages).
pub fn live_details() -> Vec<String> {
    with(|w| {
        let mut out = Vec::new();
        let ctx = |id: &usize| w.owner.get(id).copied().unwrap_or(0);
        for (id, c) in &w.ctxs {
            out.push(format!("{CTX} {id} (dead: {})", c.dead));
        }
        for id in w.pds.keys() {
            out.push(format!("{PD} {id} of ctx {}", ctx(id)));
        }
        for (id, m) in &w.mrs {
            out.push(format!(
                "{MR} {id} of ctx {} ({:#x}+{})",
                ctx(id),
                m.addr,
                m.len
            ));
        }
        for id in w.chans.keys() {
            out.push(format!("{CHAN} {id} of ctx {}", ctx(id)));
        }
        for (id, c) in &w.cqs {
            out.push(format!(
                "{CQ} {id} of ctx {} ({} completions queued, {} events unacknowledged)",
                ctx(id),
                c.entries.len(),
                c.taken.saturating_sub(c.acked)
            ));
        }
        for (id, q) in &w.qps {
            out.push(format!(
                "{QP} {id} (qp {}) of ctx {} in {}",
                q.num,
                ctx(id),
                q.state.name()
            ));
        }
        out
    })
}

/// Set the limits of devices opened from now on (process-wide: a test that changes
/// them should restore [`Limits::DEFAULT`] and not run beside tests that rely on them).
pub fn set_limits(limits: Limits) {
    with(|w| w.limits = limits);
}

/// Whether `reg_dmabuf_mr` succeeds from now on (it does unless set otherwise; off,
/// it fails as on a NIC without dma-buf support, `EOPNOTSUPP`). Process-wide, as
/// [`set_limits`].
pub fn set_dmabuf(supported: bool) {
    with(|w| w.dmabuf = supported);
}

/// Refuse the next `n` `ibv_post_send` calls of any queue pair (`ENOMEM`, posting
/// nothing), as a device out of resources does. Process-wide, as [`set_limits`].
pub fn refuse_sends(n: usize) {
    with(|w| w.refuse_sends = n);
}

/// Make the next `ibv_poll_cq` that would return a receive completion fail (a
/// device error), as a dying NIC's does: the receiving agent's completion loop stops
/// for good. Process-wide, as [`set_limits`]; only the receiving side's poll fails.
pub fn fail_receive_poll() {
    with(|w| w.fail_receive_poll = true);
}

/// How many memory regions `reg_dmabuf_mr` registered in this process.
pub fn dmabuf_registrations() -> usize {
    with(|w| w.dmabuf_mrs)
}

/// The limits devices opened now get.
pub fn limits() -> Limits {
    with(|w| w.limits)
}

/// Whether the worker thread runs (it ends [`IDLE_EXIT`] after the last work).
pub fn worker_running() -> bool {
    with(|w| w.worker.as_ref().is_some_and(|h| !h.is_finished()))
}

/// Wait (bounded) until `f` holds; whether it did. For tests.
pub fn wait_until(timeout: Duration, f: impl Fn() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    f()
}

fn transition_name(t: &QpTransition) -> &'static str {
    match t {
        QpTransition::Init { .. } => "INIT",
        QpTransition::Rtr { .. } => "RTR",
        QpTransition::Rts { .. } => "RTS",
        QpTransition::Error => "ERROR",
    }
}

#[cfg(test)]
mod tests;
