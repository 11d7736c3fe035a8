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

impl World {
    fn new() -> Self {
        use std::hash::BuildHasher;
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64) | 1;
        Self {
            next: 1,
            owner: HashMap::new(),
            ctxs: BTreeMap::new(),
            pds: BTreeMap::new(),
            mrs: BTreeMap::new(),
            chans: BTreeMap::new(),
            cqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            keys: HashMap::new(),
            qp_nums: HashMap::new(),
            next_qp_num: 0x1a0,
            rng: seed,
            limits: Limits::DEFAULT,
            dmabuf: true,
            dmabuf_mrs: 0,
            violations: Vec::new(),
            worker: None,
        }
    }

    /// A fresh handle of device context `ctx` (`None`: the handle is a context).
    fn make(&mut self, ctx: Option<usize>) -> usize {
        let id = self.next;
        self.next += 1;
        self.owner.insert(id, ctx.unwrap_or(id));
        id
    }

    fn rand_u32(&mut self) -> u32 {
        // xorshift64*
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32
    }

    fn fresh_key(&mut self) -> u32 {
        loop {
            let k = self.rand_u32();
            if k != 0 && !self.keys.contains_key(&k) {
                return k;
            }
        }
    }

    fn fresh_qp_num(&mut self) -> u32 {
        loop {
            let n = self.next_qp_num;
            self.next_qp_num = (n + 1) & 0x00ff_ffff;
            if n > 1 && !self.qp_nums.contains_key(&n) {
                return n;
            }
        }
    }

    /// Register `addr..addr + len` (as `reg_mr` does), for `op`.
    fn reg(
        &mut self,
        op: &'static str,
        pd: Handle,
        addr: usize,
        len: usize,
        access: u32,
    ) -> Result<Mr> {
        let w = self;
        let Some(p) = w.pds.get(&pd.0) else {
            return Err(w.bad(op, pd, PD));
        };
        let ctx = p.ctx;
        let max = w.limits_of(ctx).device.max_mr_size;
        if len == 0 || addr == 0 || len as u64 > max || addr.checked_add(len).is_none() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                op,
                format!("cannot register {addr:#x}+{len} (empty, null, or over max_mr_size {max})"),
            ));
        }
        // libibverbs: remote write (or atomic) access needs local write.
        if access & (access::REMOTE_WRITE | 8) != 0 && access & access::LOCAL_WRITE == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                op,
                format!("access {access:#x}: REMOTE_WRITE needs LOCAL_WRITE (EINVAL)"),
            ));
        }
        let id = w.make(Some(ctx));
        let lkey = w.fresh_key();
        w.keys.insert(lkey, (id, false));
        let rkey = w.fresh_key();
        w.keys.insert(rkey, (id, true));
        w.mrs.insert(
            id,
            MrObj {
                pd: pd.0,
                addr: addr as u64,
                len: len as u64,
                access,
                lkey,
                rkey,
            },
        );
        Ok(Mr {
            handle: Handle(id),
            lkey,
            rkey,
        })
    }

    fn limits_of(&self, ctx: usize) -> Limits {
        self.ctxs.get(&ctx).map_or(self.limits, |c| c.limits)
    }

    fn violation(&mut self, ctx: Option<usize>, msg: String) {
        tracing::error!(violation = %msg, "verbs test double: misuse");
        self.violations.push((ctx, msg));
    }

    fn kind_of(&self, id: usize) -> Option<&'static str> {
        if self.ctxs.contains_key(&id) {
            Some(CTX)
        } else if self.pds.contains_key(&id) {
            Some(PD)
        } else if self.mrs.contains_key(&id) {
            Some(MR)
        } else if self.chans.contains_key(&id) {
            Some(CHAN)
        } else if self.cqs.contains_key(&id) {
            Some(CQ)
        } else if self.qps.contains_key(&id) {
            Some(QP)
        } else {
            None
        }
    }

    /// Record a bad handle passed where a `want` was expected; the error to return.
    fn bad(&mut self, op: &'static str, h: Handle, want: &str) -> Error {
        let why = match self.kind_of(h.0) {
            Some(k) => format!("is a {k}, not a {want}"),
            None if self.owner.contains_key(&h.0) => {
                format!("was destroyed (use of a destroyed {want})")
            }
            None => format!("was never made by the test double (expected a {want})"),
        };
        let msg = format!("{op}: handle {} {why}", h.0);
        let ctx = self.owner.get(&h.0).copied();
        self.violation(ctx, msg.clone());
        Error::new(ErrorKind::InvalidArgument, op, msg)
    }

    /// Start the worker if it is not running, and wake it.
    fn kick(&mut self) -> Result<()> {
        if self.worker.as_ref().is_none_or(|h| h.is_finished()) {
            let h = std::thread::Builder::new()
                .name("nixl-verbs-double".into())
                .spawn(worker)
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Backend,
                        "verbs test double",
                        "could not start the double's worker thread",
                    )
                    .with_source(e)
                })?;
            self.worker = Some(h);
        }
        WORK.notify_all();
        Ok(())
    }

    fn covers(&self, key: u32, remote: bool, pd: usize, addr: u64, len: u64, need: u32) -> bool {
        let Some(&(mr, is_rkey)) = self.keys.get(&key) else {
            return false;
        };
        let Some(m) = self.mrs.get(&mr) else {
            return false;
        };
        is_rkey == remote
            && m.pd == pd
            && m.access & need == need
            && addr >= m.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= m.addr + m.len)
    }

    fn dead(&self, ctx: usize) -> bool {
        self.ctxs.get(&ctx).is_none_or(|c| c.dead)
    }

    /// Add a completion to a queue; fire its channel if armed.
    fn complete(&mut self, cq: usize, e: Cqe) {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        if c.entries.len() >= c.cap {
            let (ctx, cap) = (c.ctx, c.cap);
            self.violation(
                Some(ctx),
                format!(
                    "completion queue {cq} overflowed ({cap} entries): completion of wr_id {} \
                     on qp {} lost; poll faster or size the queue for every outstanding request",
                    e.wc.wr_id, e.wc.qp_num
                ),
            );
            return;
        }
        c.entries.push_back(e);
        if c.armed {
            c.armed = false;
            let ch = c.channel;
            if let Some(chan) = self.chans.get_mut(&ch) {
                chan.events.push_back(cq);
                signal(chan.fd);
            }
        }
    }

    fn complete_send(&mut self, qp: usize, job: &SendJob, status: WcStatus, byte_len: u32) {
        let Some(q) = self.qps.get(&qp) else {
            return;
        };
        let (cq, num) = (q.cq, q.num);
        let wc = Completion {
            wr_id: job.wr.wr_id,
            status,
            opcode: opcode(job.wr.op),
            byte_len,
            qp_num: num,
            vendor_err: 0,
        };
        self.complete(
            cq,
            Cqe {
                wc,
                qp,
                origin: Origin::Send(job.seq),
            },
        );
    }

    fn complete_recv(&mut self, qp: usize, r: &RecvJob, status: WcStatus, byte_len: u32) {
        let Some(q) = self.qps.get(&qp) else {
            return;
        };
        let (cq, num) = (q.cq, q.num);
        let wc = Completion {
            wr_id: r.wr.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len,
            qp_num: num,
            vendor_err: 0,
        };
        self.complete(
            cq,
            Cqe {
                wc,
                qp,
                origin: Origin::Recv(r.seq),
            },
        );
    }

    fn set_error(&mut self, qp: usize) {
        if let Some(q) = self.qps.get_mut(&qp) {
            q.state = QpState::Error;
        }
    }

    fn needs_work(&self, q: &QpObj) -> bool {
        !q.sq.is_empty() || (!q.rq.is_empty() && (q.state == QpState::Error || self.dead(q.ctx)))
    }

    fn has_pending(&self) -> bool {
        self.qps.values().any(|q| self.needs_work(q))
    }

    /// Run what can run; whether anything happened.
    fn run_ready(&mut self) -> bool {
        let ids: Vec<usize> = self
            .qps
            .iter()
            .filter(|(_, q)| self.needs_work(q))
            .map(|(&id, _)| id)
            .collect();
        let mut progressed = false;
        for id in ids {
            progressed |= self.run_qp(id);
        }
        progressed
    }

    /// Flush a queue pair in ERROR: signaled sends and all receives complete with
    /// `WR_FLUSH_ERR`.
    fn flush(&mut self, id: usize) -> bool {
        let Some(q) = self.qps.get_mut(&id) else {
            return false;
        };
        let sq = std::mem::take(&mut q.sq);
        let rq = std::mem::take(&mut q.rq);
        let any = !sq.is_empty() || !rq.is_empty();
        for job in sq.iter().filter(|j| j.wr.signaled) {
            self.complete_send(id, job, WcStatus::WR_FLUSH_ERR, 0);
        }
        for r in &rq {
            self.complete_recv(id, r, WcStatus::WR_FLUSH_ERR, 0);
        }
        any
    }

    fn run_qp(&mut self, id: usize) -> bool {
        let mut progressed = false;
        loop {
            let Some(q) = self.qps.get(&id) else {
                return progressed;
            };
            if self.dead(q.ctx) {
                // A dead device: its own work vanishes without completions.
                let Some(q) = self.qps.get_mut(&id) else {
                    return progressed;
                };
                let any = !q.sq.is_empty() || !q.rq.is_empty();
                q.sq.clear();
                q.rq.clear();
                return progressed || any;
            }
            if q.state == QpState::Error {
                return self.flush(id) || progressed;
            }
            let Some(q) = self.qps.get_mut(&id) else {
                return progressed;
            };
            let Some(mut job) = q.sq.pop_front() else {
                return progressed;
            };
            match self.execute(id, &mut job) {
                Exec::Blocked => {
                    if let Some(q) = self.qps.get_mut(&id) {
                        q.sq.push_front(job);
                    }
                    return progressed;
                }
                Exec::Done { status, byte_len } => {
                    progressed = true;
                    if job.wr.signaled || !status.is_ok() {
                        self.complete_send(id, &job, status, byte_len);
                    }
                    if !status.is_ok() {
                        self.set_error(id);
                    }
                }
            }
        }
    }

    /// The queue pair that `num` (connected to `dest`) reaches, if it answers.
    fn live_peer(&self, num: u32, dest: Option<u32>) -> Option<usize> {
        let peer = *self.qp_nums.get(&dest?)?;
        let p = self.qps.get(&peer)?;
        let ready = matches!(p.state, QpState::Rtr | QpState::Rts);
        (ready && !self.dead(p.ctx) && p.dest == Some(num)).then_some(peer)
    }

    /// Execute one send work request of queue pair `id` (in RTS).
    fn execute(&mut self, id: usize, job: &mut SendJob) -> Exec {
        let Some(q) = self.qps.get(&id) else {
            return done(WcStatus::RETRY_EXC_ERR);
        };
        let (pd, ctx, num, dest, rnr_retry) = (q.pd, q.ctx, q.num, q.dest, q.rnr_retry);
        let total: u64 = match &job.inline {
            Some(d) => d.len() as u64,
            None => job.sges.iter().map(|s| u64::from(s.len)).sum(),
        };
        if total > u64::from(self.limits_of(ctx).max_msg_sz) {
            return done(LOC_LEN_ERR);
        }
        if job.inline.is_none() {
            let need = match job.wr.op {
                SendOp::Read { .. } => access::LOCAL_WRITE,
                _ => 0,
            };
            let ok = job.sges.iter().all(|s| {
                s.len == 0 || self.covers(s.lkey, false, pd, s.addr, u64::from(s.len), need)
            });
            if !ok {
                return done(WcStatus::LOC_PROT_ERR);
            }
        }
        let Some(peer) = self.live_peer(num, dest) else {
            return done(WcStatus::RETRY_EXC_ERR);
        };
        let Some(p) = self.qps.get(&peer) else {
            return done(WcStatus::RETRY_EXC_ERR);
        };
        let (peer_pd, peer_access) = (p.pd, p.access);
        match job.wr.op {
            SendOp::Write { remote_addr, rkey } => {
                let need = access::REMOTE_WRITE;
                if total > 0
                    && (peer_access & need == 0
                        || !self.covers(rkey, true, peer_pd, remote_addr, total, need))
                {
                    return done(WcStatus::REM_ACCESS_ERR);
                }
                if total > 0 {
                    // SAFETY: the local entries lie in regions of this queue pair's PD
                    // and the target range in a region of the peer's PD, all live and
                    // checked just above under the world lock.
                    unsafe { gather(job, remote_addr) };
                }
                done(WcStatus::SUCCESS)
            }
            SendOp::Read { remote_addr, rkey } => {
                let need = access::REMOTE_READ;
                if total > 0
                    && (peer_access & need == 0
                        || !self.covers(rkey, true, peer_pd, remote_addr, total, need))
                {
                    return done(WcStatus::REM_ACCESS_ERR);
                }
                if total > 0 {
                    // SAFETY: as for WRITE: all ranges checked above against live
                    // registrations.
                    unsafe { scatter(&job.sges, remote_addr) };
                }
                Exec::Done {
                    status: WcStatus::SUCCESS,
                    byte_len: total as u32,
                }
            }
            SendOp::Send => {
                let Some(p) = self.qps.get_mut(&peer) else {
                    return done(WcStatus::RETRY_EXC_ERR);
                };
                let Some(recv) = p.rq.pop_front() else {
                    if rnr_retry >= 7 {
                        return Exec::Blocked;
                    }
                    let since = *job.rnr_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= RNR_STEP * (u32::from(rnr_retry) + 1) {
                        return done(WcStatus::RNR_RETRY_EXC_ERR);
                    }
                    return Exec::Blocked;
                };
                let s = recv.wr.sge;
                if total > u64::from(s.len) {
                    self.complete_recv(peer, &recv, LOC_LEN_ERR, 0);
                    self.set_error(peer);
                    return done(REM_INV_REQ_ERR);
                }
                if s.len > 0
                    && !self.covers(
                        s.lkey,
                        false,
                        peer_pd,
                        s.addr,
                        u64::from(s.len),
                        access::LOCAL_WRITE,
                    )
                {
                    self.complete_recv(peer, &recv, WcStatus::LOC_PROT_ERR, 0);
                    self.set_error(peer);
                    return done(REM_OP_ERR);
                }
                if total > 0 {
                    // SAFETY: the local entries (or the inline copy) and the receive
                    // buffer, which holds `total` bytes, lie in live registrations
                    // checked above.
                    unsafe { gather(job, s.addr) };
                }
                self.complete_recv(peer, &recv, WcStatus::SUCCESS, total as u32);
                done(WcStatus::SUCCESS)
            }
        }
    }

    /// Remove a queue pair: its work goes without completions, its completions leave
    /// its queue.
    fn drop_qp(&mut self, id: usize) {
        let Some(q) = self.qps.remove(&id) else {
            return;
        };
        if self.qp_nums.get(&q.num) == Some(&id) {
            self.qp_nums.remove(&q.num);
        }
        if let Some(c) = self.cqs.get_mut(&q.cq) {
            c.entries.retain(|e| e.qp != id);
        }
    }

    fn drop_mr(&mut self, id: usize) {
        if let Some(m) = self.mrs.remove(&id) {
            self.keys.remove(&m.lkey);
            self.keys.remove(&m.rkey);
        }
    }

    fn drop_cq(&mut self, id: usize) {
        let Some(c) = self.cqs.remove(&id) else {
            return;
        };
        if let Some(ch) = self.chans.get_mut(&c.channel) {
            ch.events.retain(|&e| e != id);
            if ch.events.is_empty() {
                drain(ch.fd);
            }
        }
    }

    fn drop_chan(&mut self, id: usize) {
        if let Some(ch) = self.chans.remove(&id) {
            // SAFETY: the channel owned this descriptor and nothing else closes it;
            // it is removed from the world first, so it is never used again.
            unsafe { libc::close(ch.fd) };
        }
    }

    fn children(&self, ctx: usize) -> usize {
        self.owner_count(ctx).saturating_sub(1)
    }

    fn owner_count(&self, ctx: usize) -> usize {
        let of = |id: &usize| self.owner.get(id) == Some(&ctx);
        self.ctxs.keys().filter(|id| of(id)).count()
            + self.pds.keys().filter(|id| of(id)).count()
            + self.mrs.keys().filter(|id| of(id)).count()
            + self.chans.keys().filter(|id| of(id)).count()
            + self.cqs.keys().filter(|id| of(id)).count()
            + self.qps.keys().filter(|id| of(id)).count()
    }
}

/// The worker: runs all posted work, parks when there is none, ends after
/// [`IDLE_EXIT`] of idleness.
fn worker() {
    let mut g = lock();
    let mut idle_since = Instant::now();
    loop {
        let w = g.get_or_insert_with(World::new);
        let mut progressed = false;
        while w.run_ready() {
            progressed = true;
        }
        if progressed {
            idle_since = Instant::now();
        }
        let pending = w.has_pending();
        // No queue pair left (a NIC with nothing to serve), or idle for a while.
        if !pending && (w.qps.is_empty() || idle_since.elapsed() >= IDLE_EXIT) {
            // Forget our own handle under the lock, so that work posted from now on
            // starts a new worker (unless destroying the last queue pair took the
            // handle to wait for this thread).
            let me = std::thread::current().id();
            if w.worker.as_ref().is_some_and(|h| h.thread().id() == me) {
                w.worker = None;
            }
            return;
        }
        let wait = if pending { RNR_POLL } else { IDLE_EXIT };
        g = match WORK.wait_timeout(g, wait) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        };
    }
}

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

impl VerbsApi for TestDouble {
    fn describe(&self) -> String {
        format!(
            "verbs test double (in-process software NIC {DEVICE_NAME}: proves structure, \
             not a data path)"
        )
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![DeviceInfo {
            name: DEVICE_NAME.into(),
            guid: DEVICE_GUID,
        }])
    }

    fn open(&self, device: &str) -> Result<Handle> {
        if device != DEVICE_NAME {
            return Err(Error::new(
                ErrorKind::NotFound,
                "ibv_open_device",
                format!("no RDMA device {device:?}; the test double has only {DEVICE_NAME}"),
            ));
        }
        Ok(with(|w| {
            let id = w.make(None);
            let limits = w.limits;
            w.ctxs.insert(
                id,
                Ctx {
                    limits,
                    dead: false,
                },
            );
            Handle(id)
        }))
    }

    fn query_device(&self, ctx: Handle) -> Result<DeviceLimits> {
        with(|w| match w.ctxs.get(&ctx.0) {
            Some(c) => Ok(c.limits.device),
            None => Err(w.bad("ibv_query_device", ctx, CTX)),
        })
    }

    fn query_port(&self, ctx: Handle, port: u8) -> Result<PortInfo> {
        const OP: &str = "ibv_query_port";
        with(|w| {
            let Some(c) = w.ctxs.get(&ctx.0) else {
                return Err(w.bad(OP, ctx, CTX));
            };
            if port != 1 {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{DEVICE_NAME} has port 1 only, not {port}"),
                ));
            }
            Ok(PortInfo {
                state: PORT_ACTIVE,
                lid: 0,
                active_mtu: PORT_MTU,
                link_layer: LinkLayer::Ethernet,
                gid_tbl_len: GIDS.len() as u32,
                max_msg_sz: c.limits.max_msg_sz,
            })
        })
    }

    fn query_gid(&self, ctx: Handle, port: u8, index: u32) -> Result<Option<GidEntry>> {
        const OP: &str = "ibv_query_gid";
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad(OP, ctx, CTX));
            }
            if port != 1 {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{DEVICE_NAME} has port 1 only, not {port}"),
                ));
            }
            Ok(GIDS.get(index as usize).map(|gid| GidEntry {
                gid: *gid,
                index,
                kind: Some(if index == 0 {
                    GidType::RoceV1
                } else {
                    GidType::RoceV2
                }),
            }))
        })
    }

    fn alloc_pd(&self, ctx: Handle) -> Result<Handle> {
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad("ibv_alloc_pd", ctx, CTX));
            }
            let id = w.make(Some(ctx.0));
            w.pds.insert(id, Pd { ctx: ctx.0 });
            Ok(Handle(id))
        })
    }

    unsafe fn reg_mr(&self, pd: Handle, addr: usize, len: usize, access: u32) -> Result<Mr> {
        with(|w| w.reg("ibv_reg_mr", pd, addr, len, access))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Handle,
        _offset: u64,
        len: usize,
        iova: u64,
        fd: BorrowedFd<'_>,
        access: u32,
    ) -> Result<Mr> {
        const OP: &str = "ibv_reg_dmabuf_mr";
        // The double moves bytes by address: `iova` is where the memory is mapped
        // in this process (true of the core's host stand-in for GPU memory, which
        // exports a placeholder descriptor; `BorrowedFd` proves it open).
        let _ = fd;
        with(|w| {
            if !w.dmabuf {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    OP,
                    "the device cannot register dma-bufs (EOPNOTSUPP)",
                ));
            }
            let mr = w.reg(OP, pd, iova as usize, len, access)?;
            w.dmabuf_mrs += 1;
            Ok(mr)
        })
    }

    unsafe fn dereg_mr(&self, mr: Handle) -> Result<()> {
        with(|w| {
            if !w.mrs.contains_key(&mr.0) {
                return Err(w.bad("ibv_dereg_mr", mr, MR));
            }
            w.drop_mr(mr.0);
            Ok(())
        })
    }

    fn create_channel(&self, ctx: Handle) -> Result<Channel> {
        const OP: &str = "ibv_create_comp_channel";
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad(OP, ctx, CTX));
            }
            // SAFETY: eventfd takes no pointers; its result is checked below.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(
                    Error::new(ErrorKind::Backend, OP, "eventfd for the channel failed")
                        .with_source(std::io::Error::last_os_error()),
                );
            }
            let id = w.make(Some(ctx.0));
            w.chans.insert(
                id,
                Chan {
                    ctx: ctx.0,
                    fd,
                    events: VecDeque::new(),
                },
            );
            Ok(Channel {
                handle: Handle(id),
                fd,
            })
        })
    }

    fn create_cq(&self, ctx: Handle, cqe: u32, channel: Handle) -> Result<Handle> {
        const OP: &str = "ibv_create_cq";
        with(|w| {
            let Some(c) = w.ctxs.get(&ctx.0) else {
                return Err(w.bad(OP, ctx, CTX));
            };
            let max = c.limits.device.max_cqe;
            let Some(ch) = w.chans.get(&channel.0) else {
                return Err(w.bad(OP, channel, CHAN));
            };
            if ch.ctx != ctx.0 {
                let msg = format!(
                    "channel {} belongs to ctx {}, not to ctx {}",
                    channel.0, ch.ctx, ctx.0
                );
                w.violation(Some(ctx.0), format!("{OP}: {msg}"));
                return Err(Error::new(ErrorKind::InvalidArgument, OP, msg));
            }
            if cqe == 0 || cqe > max {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{cqe} entries asked; the device allows 1..={max} (EINVAL)"),
                ));
            }
            let id = w.make(Some(ctx.0));
            w.cqs.insert(
                id,
                Cq {
                    ctx: ctx.0,
                    channel: channel.0,
                    cap: cqe as usize,
                    entries: VecDeque::new(),
                    armed: false,
                    taken: 0,
                    acked: 0,
                },
            );
            Ok(Handle(id))
        })
    }

    fn req_notify_cq(&self, cq: Handle) -> Result<()> {
        with(|w| match w.cqs.get_mut(&cq.0) {
            Some(c) => {
                c.armed = true;
                Ok(())
            }
            None => Err(w.bad("ibv_req_notify_cq", cq, CQ)),
        })
    }

    fn get_cq_event(&self, channel: Handle) -> Result<Option<Handle>> {
        with(|w| {
            let Some(ch) = w.chans.get_mut(&channel.0) else {
                return Err(w.bad("ibv_get_cq_event", channel, CHAN));
            };
            let ev = ch.events.pop_front();
            if ch.events.is_empty() {
                drain(ch.fd);
            }
            if let Some(c) = ev.and_then(|cq| w.cqs.get_mut(&cq)) {
                c.taken += 1;
            }
            Ok(ev.map(Handle))
        })
    }

    fn ack_cq_events(&self, cq: Handle, events: u32) {
        const OP: &str = "ibv_ack_cq_events";
        with(|w| {
            let Some(c) = w.cqs.get_mut(&cq.0) else {
                w.bad(OP, cq, CQ);
                return;
            };
            c.acked += u64::from(events);
            if c.acked > c.taken {
                let (ctx, taken, acked) = (c.ctx, c.taken, c.acked);
                c.acked = taken;
                w.violation(
                    Some(ctx),
                    format!(
                        "{OP}(cq {}): {acked} events acknowledged, only {taken} taken",
                        cq.0
                    ),
                );
            }
        });
    }

    fn poll_cq(&self, cq: Handle, out: &mut [Completion]) -> Result<usize> {
        with(|w| {
            let Some(c) = w.cqs.get_mut(&cq.0) else {
                return Err(w.bad("ibv_poll_cq", cq, CQ));
            };
            let n = out.len().min(c.entries.len());
            let taken: Vec<Cqe> = c.entries.drain(..n).collect();
            for (slot, e) in out.iter_mut().zip(&taken) {
                *slot = e.wc;
                if let Some(q) = w.qps.get_mut(&e.qp) {
                    match e.origin {
                        Origin::Send(s) => q.send_retired = q.send_retired.max(s + 1),
                        Origin::Recv(s) => q.recv_retired = q.recv_retired.max(s + 1),
                    }
                }
            }
            Ok(n)
        })
    }

    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> Result<Qp> {
        const OP: &str = "ibv_create_qp";
        with(|w| {
            let Some(p) = w.pds.get(&pd.0) else {
                return Err(w.bad(OP, pd, PD));
            };
            let ctx = p.ctx;
            let Some(c) = w.cqs.get(&cq.0) else {
                return Err(w.bad(OP, cq, CQ));
            };
            if c.ctx != ctx {
                let msg = format!(
                    "completion queue {} belongs to ctx {}, the PD to ctx {ctx}",
                    cq.0, c.ctx
                );
                w.violation(Some(ctx), format!("{OP}: {msg}"));
                return Err(Error::new(ErrorKind::InvalidArgument, OP, msg));
            }
            let lim = w.limits_of(ctx);
            let d = lim.device;
            if caps.max_send_wr > d.max_qp_wr
                || caps.max_recv_wr > d.max_qp_wr
                || caps.max_send_sge > d.max_sge
                || caps.max_recv_sge > d.max_sge
            {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!(
                        "{caps:?} asked; the device allows {} work requests and {} entries \
                         (EINVAL)",
                        d.max_qp_wr, d.max_sge
                    ),
                ));
            }
            let granted = QpCaps {
                max_inline_data: caps.max_inline_data.min(lim.max_inline_data),
                ..caps
            };
            let num = w.fresh_qp_num();
            let id = w.make(Some(ctx));
            w.qp_nums.insert(num, id);
            w.qps.insert(
                id,
                QpObj {
                    ctx,
                    pd: pd.0,
                    cq: cq.0,
                    num,
                    caps: granted,
                    state: QpState::Reset,
                    access: 0,
                    dest: None,
                    rnr_retry: 7,
                    sq: VecDeque::new(),
                    rq: VecDeque::new(),
                    send_posted: 0,
                    send_retired: 0,
                    recv_posted: 0,
                    recv_retired: 0,
                },
            );
            Ok(Qp {
                handle: Handle(id),
                qp_num: num,
                caps: granted,
            })
        })
    }

    fn modify_qp(&self, qp: Handle, to: &QpTransition) -> Result<()> {
        const OP: &str = "ibv_modify_qp";
        with(|w| {
            let Some(q) = w.qps.get(&qp.0) else {
                return Err(w.bad(OP, qp, QP));
            };
            let (state, num, ctx) = (q.state, q.num, q.ctx);
            let lim = w.limits_of(ctx).device;
            let einval = |msg: String| {
                Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num}: {msg} (EINVAL)"),
                ))
            };
            match (state, *to) {
                (_, QpTransition::Error) => {
                    w.set_error(qp.0);
                    // The worker flushes what is outstanding.
                    w.kick()
                }
                (
                    QpState::Reset,
                    QpTransition::Init {
                        port,
                        pkey_index,
                        access,
                    },
                ) => {
                    if port != 1 {
                        return einval(format!("port {port}; the device has port 1"));
                    }
                    if pkey_index != 0 {
                        return einval(format!("pkey index {pkey_index}; the table has 1 entry"));
                    }
                    if let Some(q) = w.qps.get_mut(&qp.0) {
                        q.state = QpState::Init;
                        q.access = access;
                    }
                    Ok(())
                }
                (
                    QpState::Init,
                    QpTransition::Rtr {
                        path_mtu,
                        dest_qp_num,
                        max_dest_rd_atomic,
                        min_rnr_timer,
                        av,
                        ..
                    },
                ) => {
                    if path_mtu.0 == 0 || path_mtu > PORT_MTU {
                        return einval(format!(
                            "path MTU {path_mtu:?} outside 1..={} (the port's)",
                            PORT_MTU.0
                        ));
                    }
                    // A NIC does not check that the destination exists: a missing
                    // one shows as retries exhausted at the first request.
                    let _ = dest_qp_num;
                    if av.port != 1 {
                        return einval(format!("address vector port {}; expected 1", av.port));
                    }
                    let Some(grh) = av.grh else {
                        return einval(
                            "Ethernet link layer: the address vector needs a global route (grh)"
                                .into(),
                        );
                    };
                    if !GIDS.contains(&grh.dgid) {
                        return einval(format!(
                            "dgid {:02x?} is not a GID of {DEVICE_NAME}",
                            grh.dgid
                        ));
                    }
                    if usize::from(grh.sgid_index) >= GIDS.len() {
                        return einval(format!(
                            "sgid index {} beyond the GID table ({})",
                            grh.sgid_index,
                            GIDS.len()
                        ));
                    }
                    if u32::from(max_dest_rd_atomic) > lim.max_qp_rd_atom {
                        return einval(format!(
                            "max_dest_rd_atomic {max_dest_rd_atomic} over the device's {}",
                            lim.max_qp_rd_atom
                        ));
                    }
                    if min_rnr_timer > 31 {
                        return einval(format!("min_rnr_timer {min_rnr_timer} over 31"));
                    }
                    if let Some(q) = w.qps.get_mut(&qp.0) {
                        q.state = QpState::Rtr;
                        q.dest = Some(dest_qp_num);
                    }
                    Ok(())
                }
                (
                    QpState::Rtr,
                    QpTransition::Rts {
                        timeout,
                        retry_cnt,
                        rnr_retry,
                        max_rd_atomic,
                        ..
                    },
                ) => {
                    if retry_cnt > 7 || rnr_retry > 7 || timeout > 31 {
                        return einval(format!(
                            "retry_cnt {retry_cnt} / rnr_retry {rnr_retry} over 7 or timeout \
                             {timeout} over 31"
                        ));
                    }
                    if u32::from(max_rd_atomic) > lim.max_qp_init_rd_atom {
                        return einval(format!(
                            "max_rd_atomic {max_rd_atomic} over the device's {}",
                            lim.max_qp_init_rd_atom
                        ));
                    }
                    if let Some(q) = w.qps.get_mut(&qp.0) {
                        q.state = QpState::Rts;
                        q.rnr_retry = rnr_retry;
                    }
                    Ok(())
                }
                (s, t) => einval(format!(
                    "is in {}, cannot go to {} (order: RESET, INIT, RTR, RTS; ERROR from any)",
                    s.name(),
                    transition_name(&t)
                )),
            }
        })
    }

    unsafe fn post_send(
        &self,
        qp: Handle,
        wrs: &[SendWr],
        sges: &[Sge],
    ) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_send";
        with(|w| {
            let Some(q) = w.qps.get(&qp.0) else {
                return Err(PostError {
                    posted: 0,
                    error: w.bad(OP, qp, QP),
                });
            };
            let (state, caps, num, ctx) = (q.state, q.caps, q.num, q.ctx);
            if !matches!(state, QpState::Rts | QpState::Error) {
                return Err(post_err(
                    0,
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num} is in {}; sends need RTS", state.name()),
                ));
            }
            if wrs.is_empty() {
                return Ok(());
            }
            if let Err(error) = w.kick() {
                return Err(PostError { posted: 0, error });
            }
            for (i, wr) in wrs.iter().enumerate() {
                let first = wr.first_sge as usize;
                let list = first
                    .checked_add(wr.num_sge as usize)
                    .and_then(|end| sges.get(first..end));
                let Some(list) = list else {
                    let msg = format!(
                        "work request {i} (wr_id {}) names entries {first}..+{} of a list of {}",
                        wr.wr_id,
                        wr.num_sge,
                        sges.len()
                    );
                    w.violation(Some(ctx), format!("{OP}: {msg}"));
                    return Err(post_err(i, ErrorKind::InvalidArgument, OP, msg));
                };
                if wr.num_sge > caps.max_send_sge {
                    return Err(post_err(
                        i,
                        ErrorKind::InvalidArgument,
                        OP,
                        format!(
                            "wr_id {}: {} entries; qp {num} takes {} (EINVAL)",
                            wr.wr_id, wr.num_sge, caps.max_send_sge
                        ),
                    ));
                }
                let max_sge_rd = w.limits_of(ctx).device.max_sge_rd;
                if matches!(wr.op, SendOp::Read { .. }) && wr.num_sge > max_sge_rd {
                    return Err(post_err(
                        i,
                        ErrorKind::InvalidArgument,
                        OP,
                        format!(
                            "wr_id {}: an RDMA READ of {} entries; the device takes {max_sge_rd} (EINVAL)",
                            wr.wr_id, wr.num_sge
                        ),
                    ));
                }
                let inline = if wr.inline {
                    if matches!(wr.op, SendOp::Read { .. }) {
                        return Err(post_err(
                            i,
                            ErrorKind::InvalidArgument,
                            OP,
                            format!("wr_id {}: an RDMA READ cannot be inline (EINVAL)", wr.wr_id),
                        ));
                    }
                    let total: u64 = list.iter().map(|s| u64::from(s.len)).sum();
                    if total > u64::from(caps.max_inline_data) {
                        return Err(post_err(
                            i,
                            ErrorKind::InvalidArgument,
                            OP,
                            format!(
                                "wr_id {}: {total} inline bytes; qp {num} was granted {} (EINVAL)",
                                wr.wr_id, caps.max_inline_data
                            ),
                        ));
                    }
                    let mut data = Vec::with_capacity(total as usize);
                    for s in list.iter().filter(|s| s.len > 0) {
                        // SAFETY: post_send's contract: an inline entry's memory is
                        // readable now; it is copied before this call returns.
                        let bytes = unsafe {
                            std::slice::from_raw_parts(s.addr as usize as *const u8, s.len as usize)
                        };
                        data.extend_from_slice(bytes);
                    }
                    Some(data)
                } else {
                    None
                };
                let Some(q) = w.qps.get_mut(&qp.0) else {
                    return Err(post_err(
                        i,
                        ErrorKind::Backend,
                        OP,
                        "queue pair vanished".into(),
                    ));
                };
                if q.send_posted - q.send_retired >= u64::from(q.caps.max_send_wr) {
                    return Err(post_err(
                        i,
                        ErrorKind::Backend,
                        OP,
                        format!(
                            "send queue of qp {num} full: {} work requests outstanding (ENOMEM); \
                             poll completions to retire them",
                            q.caps.max_send_wr
                        ),
                    ));
                }
                let seq = q.send_posted;
                q.send_posted += 1;
                q.sq.push_back(SendJob {
                    seq,
                    wr: *wr,
                    sges: list.to_vec(),
                    inline,
                    rnr_since: None,
                });
            }
            Ok(())
        })
    }

    unsafe fn post_recv(&self, qp: Handle, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_recv";
        with(|w| {
            let Some(q) = w.qps.get(&qp.0) else {
                return Err(PostError {
                    posted: 0,
                    error: w.bad(OP, qp, QP),
                });
            };
            let (state, num, max_sge) = (q.state, q.num, q.caps.max_recv_sge);
            if state == QpState::Reset {
                return Err(post_err(
                    0,
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num} is in RESET; receives need INIT or later"),
                ));
            }
            if max_sge == 0 && !wrs.is_empty() {
                return Err(post_err(
                    0,
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num} was created with max_recv_sge 0 (EINVAL)"),
                ));
            }
            if !wrs.is_empty() {
                if let Err(error) = w.kick() {
                    return Err(PostError { posted: 0, error });
                }
            }
            let Some(q) = w.qps.get_mut(&qp.0) else {
                return Err(post_err(
                    0,
                    ErrorKind::Backend,
                    OP,
                    "queue pair vanished".into(),
                ));
            };
            for (i, wr) in wrs.iter().enumerate() {
                if q.recv_posted - q.recv_retired >= u64::from(q.caps.max_recv_wr) {
                    return Err(post_err(
                        i,
                        ErrorKind::Backend,
                        OP,
                        format!(
                            "receive queue of qp {num} full: {} receives outstanding (ENOMEM)",
                            q.caps.max_recv_wr
                        ),
                    ));
                }
                let seq = q.recv_posted;
                q.recv_posted += 1;
                q.rq.push_back(RecvJob { seq, wr: *wr });
            }
            Ok(())
        })
    }

    unsafe fn destroy_qp(&self, qp: Handle) -> Result<()> {
        let last = with(|w| {
            if !w.qps.contains_key(&qp.0) {
                return Err(w.bad("ibv_destroy_qp", qp, QP));
            }
            w.drop_qp(qp.0);
            // Peers waiting on it look again.
            WORK.notify_all();
            Ok(if w.qps.is_empty() {
                w.worker.take()
            } else {
                None
            })
        })?;
        // The last queue pair is gone: the worker ends now; wait for it, so that a
        // process whose agents shut down has no thread of the double left.
        if let Some(h) = last {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        Ok(())
    }

    unsafe fn destroy_cq(&self, cq: Handle) -> Result<()> {
        const OP: &str = "ibv_destroy_cq";
        with(|w| {
            let Some(c) = w.cqs.get(&cq.0) else {
                return Err(w.bad(OP, cq, CQ));
            };
            let (ctx, unacked) = (c.ctx, c.taken.saturating_sub(c.acked));
            let users = w.qps.values().filter(|q| q.cq == cq.0).count();
            if users > 0 {
                let msg = format!(
                    "{OP}(cq {}): {users} queue pair(s) still use it (EBUSY; destroy them first)",
                    cq.0
                );
                w.violation(Some(ctx), msg.clone());
                return Err(Error::new(ErrorKind::NotAllowed, OP, msg));
            }
            if unacked > 0 {
                w.violation(
                    Some(ctx),
                    format!(
                        "{OP}(cq {}): {unacked} event(s) taken by get_cq_event and not \
                         acknowledged: the real call would wait for them forever",
                        cq.0
                    ),
                );
            }
            w.drop_cq(cq.0);
            Ok(())
        })
    }

    unsafe fn destroy_channel(&self, channel: Handle) -> Result<()> {
        const OP: &str = "ibv_destroy_comp_channel";
        with(|w| {
            let Some(ch) = w.chans.get(&channel.0) else {
                return Err(w.bad(OP, channel, CHAN));
            };
            let ctx = ch.ctx;
            let users = w.cqs.values().filter(|c| c.channel == channel.0).count();
            if users > 0 {
                let msg = format!(
                    "{OP}(channel {}): {users} completion queue(s) still report to it (EBUSY)",
                    channel.0
                );
                w.violation(Some(ctx), msg.clone());
                return Err(Error::new(ErrorKind::NotAllowed, OP, msg));
            }
            w.drop_chan(channel.0);
            Ok(())
        })
    }

    unsafe fn dealloc_pd(&self, pd: Handle) -> Result<()> {
        const OP: &str = "ibv_dealloc_pd";
        with(|w| {
            let Some(p) = w.pds.get(&pd.0) else {
                return Err(w.bad(OP, pd, PD));
            };
            let ctx = p.ctx;
            let mrs = w.mrs.values().filter(|m| m.pd == pd.0).count();
            let qps = w.qps.values().filter(|q| q.pd == pd.0).count();
            if mrs + qps > 0 {
                let msg = format!(
                    "{OP}(pd {}): {mrs} region(s) and {qps} queue pair(s) still in it (EBUSY)",
                    pd.0
                );
                w.violation(Some(ctx), msg.clone());
                return Err(Error::new(ErrorKind::NotAllowed, OP, msg));
            }
            w.pds.remove(&pd.0);
            Ok(())
        })
    }

    unsafe fn close(&self, ctx: Handle) -> Result<()> {
        const OP: &str = "ibv_close_device";
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad(OP, ctx, CTX));
            }
            let children = w.children(ctx.0);
            if children > 0 {
                w.violation(
                    Some(ctx.0),
                    format!(
                        "{OP}(ctx {}): {children} object(s) made from it still live; \
                         destroyed as the kernel would",
                        ctx.0
                    ),
                );
                let mine = |w: &World, id: &usize| w.owner.get(id) == Some(&ctx.0);
                let qps: Vec<usize> = w.qps.keys().filter(|id| mine(w, id)).copied().collect();
                qps.into_iter().for_each(|id| w.drop_qp(id));
                let mrs: Vec<usize> = w.mrs.keys().filter(|id| mine(w, id)).copied().collect();
                mrs.into_iter().for_each(|id| w.drop_mr(id));
                let cqs: Vec<usize> = w.cqs.keys().filter(|id| mine(w, id)).copied().collect();
                cqs.into_iter().for_each(|id| w.drop_cq(id));
                let chans: Vec<usize> = w.chans.keys().filter(|id| mine(w, id)).copied().collect();
                chans.into_iter().for_each(|id| w.drop_chan(id));
                w.pds.retain(|_, p| p.ctx != ctx.0);
                WORK.notify_all();
            }
            w.ctxs.remove(&ctx.0);
            Ok(())
        })
    }

    fn status_str(&self, status: WcStatus) -> String {
        const NAMES: [&str; 24] = [
            "success",
            "local length error",
            "local QP operation error",
            "local EE context operation error",
            "local protection error",
            "Work Request Flushed Error",
            "memory management operation error",
            "bad response error",
            "local access error",
            "remote invalid request error",
            "remote access error",
            "remote operation error",
            "transport retry counter exceeded",
            "RNR retry counter exceeded",
            "local RDD violation error",
            "remote invalid RD request",
            "aborted error",
            "invalid EE context number",
            "invalid EE context state",
            "fatal error",
            "response timeout error",
            "general error",
            "TM error",
            "TM rendezvous pending",
        ];
        NAMES
            .get(status.0 as usize)
            .map_or_else(|| format!("unknown ({})", status.0), |s| (*s).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::access::{LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};
    use crate::api::{AddressVector, GlobalRoute};
    use std::mem::ManuallyDrop;

    const CAPS: QpCaps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    const ALL: u32 = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ;
    const HANG: Duration = Duration::from_secs(10);

    /// One agent: a device, a PD, a channel, a queue, a queue pair and a buffer.
    struct Side {
        api: Arc<dyn VerbsApi>,
        ctx: Handle,
        pd: Handle,
        chan: Channel,
        cq: Handle,
        qp: Qp,
        buf: ManuallyDrop<Vec<u8>>,
        mr: Mr,
    }

    impl Side {
        fn new(len: usize, caps: QpCaps) -> Self {
            let api = api();
            let ctx = api.open(DEVICE_NAME).unwrap();
            let pd = api.alloc_pd(ctx).unwrap();
            let chan = api.create_channel(ctx).unwrap();
            let cq = api.create_cq(ctx, 256, chan.handle).unwrap();
            let qp = api.create_qp(pd, cq, caps).unwrap();
            let mut buf = ManuallyDrop::new(vec![0u8; len]);
            // SAFETY: the buffer is freed only in `teardown`, after `dereg_mr`; a test
            // that panics leaks it, so the worker never writes into freed memory.
            let mr = unsafe { api.reg_mr(pd, buf.as_mut_ptr() as usize, len, ALL) }.unwrap();
            Self {
                api,
                ctx,
                pd,
                chan,
                cq,
                qp,
                buf,
                mr,
            }
        }

        fn addr(&self, off: usize) -> u64 {
            self.buf.as_ptr() as u64 + off as u64
        }

        fn sge(&self, off: usize, len: u32) -> Sge {
            Sge {
                addr: self.addr(off),
                len,
                lkey: self.mr.lkey,
            }
        }

        fn post(&self, wrs: &[SendWr], sges: &[Sge]) -> std::result::Result<(), PostError> {
            // SAFETY: every entry lies in `self.buf`, registered until teardown,
            // which waits for (or flushes) the work first.
            unsafe { self.api.post_send(self.qp.handle, wrs, sges) }
        }

        fn recv(&self, wr_id: u64, off: usize, len: u32) -> std::result::Result<(), PostError> {
            let wr = RecvWr {
                wr_id,
                sge: self.sge(off, len),
            };
            // SAFETY: as in `post`.
            unsafe { self.api.post_recv(self.qp.handle, &[wr]) }
        }

        /// Wait for `n` completions.
        fn wait(&self, n: usize) -> Vec<Completion> {
            let end = Instant::now() + HANG;
            let mut got = Vec::new();
            while got.len() < n {
                let mut out = [Completion::EMPTY; 8];
                let want = (n - got.len()).min(out.len());
                let k = self.api.poll_cq(self.cq, &mut out[..want]).unwrap();
                got.extend_from_slice(&out[..k]);
                if k == 0 {
                    assert!(
                        Instant::now() < end,
                        "hang: {} of {n} completions",
                        got.len()
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            got
        }

        /// Completions queued and not polled.
        fn queued(&self) -> usize {
            with(|w| w.cqs.get(&self.cq.0).map_or(0, |c| c.entries.len()))
        }

        fn teardown(self) {
            let a = &self.api;
            // SAFETY: each object is live and unused from here on, destroyed in order.
            unsafe {
                a.destroy_qp(self.qp.handle).unwrap();
                a.dereg_mr(self.mr.handle).unwrap();
                a.destroy_cq(self.cq).unwrap();
                a.destroy_channel(self.chan.handle).unwrap();
                a.dealloc_pd(self.pd).unwrap();
                a.close(self.ctx).unwrap();
            }
            assert_eq!(violations_of(self.ctx), Vec::<String>::new());
            assert_eq!(live_objects_of(self.ctx), 0, "{:?}", live_details());
            drop(ManuallyDrop::into_inner(self.buf));
        }
    }

    fn bring_up(s: &Side, dest: u32, rnr_retry: u8) {
        let a = &s.api;
        a.modify_qp(
            s.qp.handle,
            &QpTransition::Init {
                port: 1,
                pkey_index: 0,
                access: ALL,
            },
        )
        .unwrap();
        a.modify_qp(s.qp.handle, &rtr(dest, GIDS[1])).unwrap();
        a.modify_qp(
            s.qp.handle,
            &QpTransition::Rts {
                sq_psn: 0,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry,
                max_rd_atomic: 4,
            },
        )
        .unwrap();
    }

    fn rtr(dest: u32, dgid: [u8; 16]) -> QpTransition {
        QpTransition::Rtr {
            path_mtu: Mtu(5),
            dest_qp_num: dest,
            rq_psn: 0,
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            av: AddressVector {
                dlid: 0,
                sl: 0,
                port: 1,
                grh: Some(GlobalRoute {
                    dgid,
                    sgid_index: 1,
                    hop_limit: 64,
                    traffic_class: 0,
                }),
            },
        }
    }

    fn pair(len: usize, caps: QpCaps) -> (Side, Side) {
        let (a, b) = (Side::new(len, caps), Side::new(len, caps));
        bring_up(&a, b.qp.qp_num, 7);
        bring_up(&b, a.qp.qp_num, 7);
        (a, b)
    }

    fn wr(wr_id: u64, op: SendOp, first: u32, num: u32, signaled: bool) -> SendWr {
        SendWr {
            wr_id,
            op,
            first_sge: first,
            num_sge: num,
            signaled,
            fence: false,
            inline: false,
        }
    }

    fn write_to(b: &Side, off: usize) -> SendOp {
        SendOp::Write {
            remote_addr: b.addr(off),
            rkey: b.mr.rkey,
        }
    }

    fn readable(fd: RawFd, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, count 1.
        let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        n == 1 && p.revents & libc::POLLIN != 0
    }

    fn pattern(buf: &mut [u8], seed: u8) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
    }

    #[test]
    fn device_looks_like_a_small_roce_nic() {
        let api = api();
        assert_eq!(api.devices().unwrap()[0].name, DEVICE_NAME);
        assert_eq!(api.open("mlx5_0").unwrap_err().kind(), ErrorKind::NotFound);
        let ctx = api.open(DEVICE_NAME).unwrap();
        let port = api.query_port(ctx, 1).unwrap();
        assert_eq!(port.state, PORT_ACTIVE);
        assert_eq!(port.link_layer, LinkLayer::Ethernet);
        assert_eq!(port.active_mtu, Mtu(5));
        assert_eq!(port.max_msg_sz, 64 << 10);
        assert_eq!(port.gid_tbl_len, 2);
        let g0 = api.query_gid(ctx, 1, 0).unwrap().unwrap();
        assert_eq!(g0.kind, Some(GidType::RoceV1));
        assert_eq!(&g0.gid[..2], &[0xfe, 0x80]);
        let g1 = api.query_gid(ctx, 1, 1).unwrap().unwrap();
        assert_eq!(g1.kind, Some(GidType::RoceV2));
        assert_eq!(&g1.gid[10..], &[0xff, 0xff, 10, 0, 0, 1]);
        assert_eq!(api.query_gid(ctx, 1, 2).unwrap(), None);
        assert!(api.query_port(ctx, 2).is_err());
        let d = api.query_device(ctx).unwrap();
        assert_eq!((d.max_qp_wr, d.max_sge, d.max_cqe), (128, 4, 4096));
        let pd = api.alloc_pd(ctx).unwrap();
        let ch = api.create_channel(ctx).unwrap();
        let cq = api.create_cq(ctx, 16, ch.handle).unwrap();
        let asked = QpCaps {
            max_inline_data: 1024,
            ..CAPS
        };
        let qp = api.create_qp(pd, cq, asked).unwrap();
        assert_eq!(qp.caps.max_inline_data, 64);
        let too_deep = QpCaps {
            max_send_wr: 129,
            ..CAPS
        };
        assert_eq!(
            api.create_qp(pd, cq, too_deep).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let mut m = vec![0u8; 64];
        // SAFETY: `m` outlives the registration (deregistered below).
        let mr = unsafe { api.reg_mr(pd, m.as_mut_ptr() as usize, 64, ALL) }.unwrap();
        assert!(mr.lkey != 0 && mr.rkey != 0 && mr.lkey != mr.rkey);
        // SAFETY: as above; refused anyway (remote write without local write).
        let refused = unsafe { api.reg_mr(pd, m.as_mut_ptr() as usize, 64, REMOTE_WRITE) };
        assert_eq!(refused.unwrap_err().kind(), ErrorKind::InvalidArgument);
        // SAFETY: live objects, destroyed in order.
        unsafe {
            api.dereg_mr(mr.handle).unwrap();
            api.destroy_qp(qp.handle).unwrap();
            api.destroy_cq(cq).unwrap();
            api.destroy_channel(ch.handle).unwrap();
            api.dealloc_pd(pd).unwrap();
            api.close(ctx).unwrap();
        }
        assert!(violations_of(ctx).is_empty(), "{:?}", violations_of(ctx));
        assert_eq!(live_objects_of(ctx), 0);
    }

    #[test]
    fn write_read_and_send_round_trip() {
        let (mut a, mut b) = pair(4096, CAPS);
        pattern(&mut a.buf[..1024], 1);
        pattern(&mut b.buf[3000..3100], 2);

        // WRITE: two local entries gathered into one remote range.
        let sges = [a.sge(0, 512), a.sge(512, 512)];
        a.post(&[wr(1, write_to(&b, 1024), 0, 2, true)], &sges)
            .unwrap();
        let c = a.wait(1);
        assert_eq!(
            (c[0].wr_id, c[0].status, c[0].opcode),
            (1, WcStatus::SUCCESS, WcOpcode::Write)
        );
        assert_eq!(c[0].qp_num, a.qp.qp_num);
        assert_eq!(b.buf[1024..2048], a.buf[..1024]);

        // READ into a local entry.
        let op = SendOp::Read {
            remote_addr: b.addr(3000),
            rkey: b.mr.rkey,
        };
        a.post(&[wr(2, op, 0, 1, true)], &[a.sge(2000, 100)])
            .unwrap();
        let c = a.wait(1);
        assert_eq!(
            (c[0].wr_id, c[0].status, c[0].opcode),
            (2, WcStatus::SUCCESS, WcOpcode::Read)
        );
        assert_eq!(a.buf[2000..2100], b.buf[3000..3100]);

        // SEND into the receiver's posted buffer.
        b.recv(77, 0, 256).unwrap();
        a.post(&[wr(3, SendOp::Send, 0, 1, true)], &[a.sge(100, 200)])
            .unwrap();
        let c = a.wait(1);
        assert_eq!(
            (c[0].wr_id, c[0].status, c[0].opcode),
            (3, WcStatus::SUCCESS, WcOpcode::Send)
        );
        let r = b.wait(1);
        assert_eq!(
            (r[0].wr_id, r[0].status, r[0].opcode),
            (77, WcStatus::SUCCESS, WcOpcode::Recv)
        );
        assert_eq!((r[0].byte_len, r[0].qp_num), (200, b.qp.qp_num));
        assert_eq!(b.buf[..200], a.buf[100..300]);

        // An unsignaled request completes silently; the signaled one after it reports.
        pattern(&mut a.buf[..64], 9);
        let sges = [a.sge(0, 32), a.sge(32, 32)];
        let wrs = [
            wr(4, write_to(&b, 0), 0, 1, false),
            wr(5, write_to(&b, 32), 1, 1, true),
        ];
        a.post(&wrs, &sges).unwrap();
        let c = a.wait(1);
        assert_eq!(c[0].wr_id, 5);
        assert_eq!(b.buf[..64], a.buf[..64]);
        assert_eq!(a.queued(), 0);

        a.teardown();
        b.teardown();
    }

    /// Runs one failing request on a fresh pair; its status, then checks that the
    /// queue pair flushes what follows.
    fn one_error(len: usize, build: impl Fn(&Side, &Side) -> (SendWr, Vec<Sge>)) -> WcStatus {
        let (a, b) = pair(len, CAPS);
        let (bad, sges) = build(&a, &b);
        a.post(&[bad], &sges).unwrap();
        let c = a.wait(1);
        assert_eq!(c[0].wr_id, bad.wr_id);
        // In ERROR now: a later signaled request is flushed.
        a.post(&[wr(99, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
            .unwrap();
        let f = a.wait(1);
        assert_eq!((f[0].wr_id, f[0].status), (99, WcStatus::WR_FLUSH_ERR));
        a.teardown();
        b.teardown();
        c[0].status
    }

    #[test]
    fn key_and_range_errors_complete_in_error_and_flush_what_follows() {
        let (mut a, b) = pair(4096, CAPS);
        pattern(&mut a.buf[..64], 3);
        a.recv(50, 1000, 64).unwrap();
        let bad = SendOp::Write {
            remote_addr: b.addr(0),
            rkey: b.mr.rkey ^ 0x8000_0001,
        };
        let sges = [a.sge(0, 64)];
        let wrs = [
            wr(1, bad, 0, 1, true),
            wr(2, write_to(&b, 0), 0, 1, true),
            wr(3, write_to(&b, 0), 0, 1, false),
            wr(4, write_to(&b, 0), 0, 1, true),
        ];
        a.post(&wrs, &sges).unwrap();
        let c = a.wait(4);
        assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::REM_ACCESS_ERR));
        let flushed: Vec<(u64, WcStatus, WcOpcode)> = c[1..]
            .iter()
            .map(|c| (c.wr_id, c.status, c.opcode))
            .collect();
        assert!(flushed.contains(&(2, WcStatus::WR_FLUSH_ERR, WcOpcode::Write)));
        assert!(flushed.contains(&(4, WcStatus::WR_FLUSH_ERR, WcOpcode::Write)));
        assert!(flushed.contains(&(50, WcStatus::WR_FLUSH_ERR, WcOpcode::Recv)));
        // Unsignaled 3 produced no flush completion, and nothing was written.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(a.queued(), 0);
        assert!(b.buf[..64].iter().all(|&x| x == 0));
        // Posted later: flushed too.
        a.post(&[wr(5, write_to(&b, 0), 0, 1, true)], &sges)
            .unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::WR_FLUSH_ERR);
        a.teardown();
        b.teardown();

        // Remote range past the region's end.
        let s = one_error(4096, |a, b| {
            (wr(1, write_to(b, 4000), 0, 1, true), vec![a.sge(0, 200)])
        });
        assert_eq!(s, WcStatus::REM_ACCESS_ERR);
        // An rkey where an lkey belongs.
        let s = one_error(4096, |a, b| {
            let mut e = a.sge(0, 16);
            e.lkey = a.mr.rkey;
            (wr(1, write_to(b, 0), 0, 1, true), vec![e])
        });
        assert_eq!(s, WcStatus::LOC_PROT_ERR);
        // A local entry past its region.
        let s = one_error(4096, |a, b| {
            (wr(1, write_to(b, 0), 0, 1, true), vec![a.sge(4090, 16)])
        });
        assert_eq!(s, WcStatus::LOC_PROT_ERR);
        // A message over the port's max_msg_sz (4 × 20000 > 64 KiB): never silent.
        let s = one_error(96 << 10, |a, b| {
            let sges = (0..4).map(|i| a.sge(i * 20_000, 20_000)).collect();
            (wr(1, write_to(b, 0), 0, 4, true), sges)
        });
        assert_eq!(s, LOC_LEN_ERR);
    }

    #[test]
    fn remote_access_needs_the_region_and_queue_pair_flags() {
        // A region registered for READ only refuses a WRITE.
        let (a, b) = pair(4096, CAPS);
        let mut ro = vec![0u8; 128];
        // SAFETY: `ro` outlives the registration (deregistered below).
        let ro_mr = unsafe {
            b.api
                .reg_mr(b.pd, ro.as_mut_ptr() as usize, 128, REMOTE_READ)
        }
        .unwrap();
        let op = SendOp::Write {
            remote_addr: ro.as_ptr() as u64,
            rkey: ro_mr.rkey,
        };
        a.post(&[wr(1, op, 0, 1, true)], &[a.sge(0, 16)]).unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::REM_ACCESS_ERR);
        // SAFETY: unused from now on.
        unsafe { b.api.dereg_mr(ro_mr.handle) }.unwrap();
        a.teardown();
        b.teardown();

        // A queue pair brought up without REMOTE_WRITE refuses a WRITE too.
        let (a, b) = (Side::new(4096, CAPS), Side::new(4096, CAPS));
        bring_up(&a, b.qp.qp_num, 7);
        let init = QpTransition::Init {
            port: 1,
            pkey_index: 0,
            access: LOCAL_WRITE | REMOTE_READ,
        };
        b.api.modify_qp(b.qp.handle, &init).unwrap();
        b.api
            .modify_qp(b.qp.handle, &rtr(a.qp.qp_num, GIDS[0]))
            .unwrap();
        a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 16)])
            .unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::REM_ACCESS_ERR);
        a.teardown();
        b.teardown();
    }

    #[test]
    fn send_larger_than_the_receive_fails_on_both_sides() {
        let (a, b) = pair(4096, CAPS);
        b.recv(7, 0, 100).unwrap();
        b.recv(8, 100, 100).unwrap();
        a.post(&[wr(1, SendOp::Send, 0, 1, true)], &[a.sge(0, 101)])
            .unwrap();
        assert_eq!(a.wait(1)[0].status, REM_INV_REQ_ERR);
        let r = b.wait(2);
        assert_eq!((r[0].wr_id, r[0].status), (7, LOC_LEN_ERR));
        // The receiver went to ERROR: its other receive is flushed.
        assert_eq!((r[1].wr_id, r[1].status), (8, WcStatus::WR_FLUSH_ERR));
        a.teardown();
        b.teardown();
    }

    #[test]
    fn inline_sends_copy_at_post_time_and_respect_the_grant() {
        let (mut a, b) = pair(4096, CAPS);
        pattern(&mut a.buf[..64], 5);
        let sent = a.buf[..64].to_vec();
        b.recv(1, 0, 64).unwrap();
        let mut w = wr(2, SendOp::Send, 0, 1, true);
        w.inline = true;
        let mut e = a.sge(0, 64);
        e.lkey = 0; // no key needed inline
        a.post(&[w], &[e]).unwrap();
        a.buf[..64].fill(0xee); // after the post: must not reach the peer
        assert_eq!(a.wait(1)[0].status, WcStatus::SUCCESS);
        assert_eq!(b.wait(1)[0].byte_len, 64);
        assert_eq!(b.buf[..64], sent[..]);
        let over = a.post(&[w], &[a.sge(0, 65)]).unwrap_err();
        assert_eq!(
            (over.posted, over.error.kind()),
            (0, ErrorKind::InvalidArgument)
        );
        a.teardown();
        b.teardown();
    }

    #[test]
    fn channel_fires_only_for_completions_after_arming() {
        let (a, b) = pair(4096, CAPS);
        let api = &a.api;
        let fd = a.chan.fd;
        let one = |id| a.post(&[wr(id, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)]);
        // A completion queued before arming does not fire.
        one(1).unwrap();
        assert!(wait_until(HANG, || a.queued() == 1));
        api.req_notify_cq(a.cq).unwrap();
        assert!(!readable(fd, 20));
        assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), None);
        // The next one does, once.
        one(2).unwrap();
        assert!(readable(fd, 10_000), "no event after arming");
        assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), Some(a.cq));
        assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), None);
        assert!(
            !readable(fd, 0),
            "descriptor still readable with no event left"
        );
        api.ack_cq_events(a.cq, 1);
        // Disarmed by that event: a third completion fires nothing.
        one(3).unwrap();
        assert!(wait_until(HANG, || a.queued() == 3));
        assert!(!readable(fd, 20));
        assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), None);
        let ids: Vec<u64> = a.wait(3).iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [1, 2, 3]);
        a.teardown();
        b.teardown();
    }

    #[test]
    fn send_queue_capacity_and_retirement() {
        let caps = QpCaps {
            max_send_wr: 4,
            max_recv_wr: 2,
            ..CAPS
        };
        let (a, b) = pair(4096, caps);
        let sges = [a.sge(0, 8)];
        let w = |id, sig| wr(id, write_to(&b, 0), 0, 1, sig);
        // Three unsignaled and one signaled fill the queue.
        a.post(&[w(1, false), w(2, false), w(3, false), w(4, true)], &sges)
            .unwrap();
        let full = a.post(&[w(5, true)], &sges).unwrap_err();
        assert_eq!((full.posted, full.error.kind()), (0, ErrorKind::Backend));
        // Completed but not polled: not retired yet.
        assert!(wait_until(HANG, || a.queued() == 1));
        assert_eq!(a.post(&[w(5, true)], &sges).unwrap_err().posted, 0);
        // Polling request 4's completion retires 1..=4.
        assert_eq!(a.wait(1)[0].wr_id, 4);
        let part = a
            .post(
                &[w(6, true), w(7, true), w(8, true), w(9, true), w(10, true)],
                &sges,
            )
            .unwrap_err();
        assert_eq!((part.posted, part.error.kind()), (4, ErrorKind::Backend));
        let ids: Vec<u64> = a.wait(4).iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [6, 7, 8, 9]);
        a.post(&[w(11, true)], &sges).unwrap();
        assert_eq!(a.wait(1)[0].wr_id, 11);
        // The receive queue likewise.
        let recvs: Vec<RecvWr> = (0..3)
            .map(|i| RecvWr {
                wr_id: i,
                sge: b.sge(0, 64),
            })
            .collect();
        // SAFETY: entries in b's registered buffer.
        let err = unsafe { b.api.post_recv(b.qp.handle, &recvs) }.unwrap_err();
        assert_eq!((err.posted, err.error.kind()), (2, ErrorKind::Backend));
        a.teardown();
        b.teardown();
    }

    #[test]
    fn send_waits_for_a_receive_without_holding_up_others() {
        let (mut a, b) = pair(4096, CAPS);
        let (c, d) = pair(4096, CAPS);
        pattern(&mut a.buf[..128], 7);
        a.post(&[wr(1, SendOp::Send, 0, 1, true)], &[a.sge(0, 128)])
            .unwrap();
        // Another pair is not held up by the waiting SEND.
        c.post(&[wr(2, write_to(&d, 0), 0, 1, true)], &[c.sge(0, 8)])
            .unwrap();
        assert_eq!(c.wait(1)[0].status, WcStatus::SUCCESS);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(a.queued(), 0, "a SEND completed with no receive posted");
        b.recv(9, 512, 256).unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::SUCCESS);
        let r = b.wait(1);
        assert_eq!((r[0].wr_id, r[0].byte_len), (9, 128));
        assert_eq!(b.buf[512..640], a.buf[..128]);
        for s in [a, b, c, d] {
            s.teardown();
        }
    }

    #[test]
    fn finite_rnr_retry_gives_up() {
        let (a, b) = (Side::new(4096, CAPS), Side::new(4096, CAPS));
        bring_up(&a, b.qp.qp_num, 1);
        bring_up(&b, a.qp.qp_num, 7);
        a.post(&[wr(1, SendOp::Send, 0, 1, true)], &[a.sge(0, 8)])
            .unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::RNR_RETRY_EXC_ERR);
        a.teardown();
        b.teardown();
    }

    #[test]
    fn killed_or_destroyed_peer_gives_retry_exceeded() {
        let (a, b) = pair(4096, CAPS);
        b.recv(1, 0, 64).unwrap();
        kill(b.ctx);
        a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
            .unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::RETRY_EXC_ERR);
        a.post(&[wr(2, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
            .unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::WR_FLUSH_ERR);
        // The dead side's work vanishes without completions.
        b.recv(2, 0, 64).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(b.queued(), 0);
        a.teardown();
        b.teardown();

        // A SEND waiting for a receive fails once the peer's queue pair is destroyed.
        let (a, b) = pair(4096, CAPS);
        a.post(&[wr(3, SendOp::Send, 0, 1, true)], &[a.sge(0, 8)])
            .unwrap();
        std::thread::sleep(Duration::from_millis(10));
        // SAFETY: b's queue pair is unused from now on.
        unsafe { b.api.destroy_qp(b.qp.handle) }.unwrap();
        assert_eq!(a.wait(1)[0].status, WcStatus::RETRY_EXC_ERR);
        a.teardown();
        // SAFETY: the rest of b, in order.
        unsafe {
            b.api.dereg_mr(b.mr.handle).unwrap();
            b.api.destroy_cq(b.cq).unwrap();
            b.api.destroy_channel(b.chan.handle).unwrap();
            b.api.dealloc_pd(b.pd).unwrap();
            b.api.close(b.ctx).unwrap();
        }
        assert!(violations_of(b.ctx).is_empty());
    }

    #[test]
    fn state_machine_rejects_wrong_order() {
        let (a, b) = (Side::new(4096, CAPS), Side::new(4096, CAPS));
        let api = &a.api;
        let h = a.qp.handle;
        let kind = |r: Result<()>| r.unwrap_err().kind();
        let send = || a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)]);
        assert_eq!(send().unwrap_err().error.kind(), ErrorKind::InvalidArgument);
        assert_eq!(
            a.recv(1, 0, 8).unwrap_err().error.kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(api.modify_qp(h, &rtr(b.qp.qp_num, GIDS[1]))),
            ErrorKind::InvalidArgument
        );
        let init = QpTransition::Init {
            port: 1,
            pkey_index: 0,
            access: ALL,
        };
        api.modify_qp(h, &init).unwrap();
        assert_eq!(kind(api.modify_qp(h, &init)), ErrorKind::InvalidArgument);
        a.recv(1, 0, 8).unwrap(); // receives from INIT on
        let rts = QpTransition::Rts {
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 4,
        };
        assert_eq!(kind(api.modify_qp(h, &rts)), ErrorKind::InvalidArgument);
        // RTR: a GID of the device, an MTU the port has (the destination is not
        // checked, as on a NIC: a missing one fails the first request).
        assert!(api.modify_qp(h, &rtr(b.qp.qp_num, [7; 16])).is_err());
        let QpTransition::Rtr { av, .. } = rtr(b.qp.qp_num, GIDS[1]) else {
            unreachable!()
        };
        let no_grh = QpTransition::Rtr {
            path_mtu: Mtu(5),
            dest_qp_num: b.qp.qp_num,
            rq_psn: 0,
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            av: AddressVector { grh: None, ..av },
        };
        assert!(api.modify_qp(h, &no_grh).is_err());
        let big_mtu = QpTransition::Rtr {
            path_mtu: Mtu(6),
            dest_qp_num: b.qp.qp_num,
            rq_psn: 0,
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            av,
        };
        assert!(api.modify_qp(h, &big_mtu).is_err());
        api.modify_qp(h, &rtr(b.qp.qp_num, GIDS[1])).unwrap();
        assert_eq!(send().unwrap_err().error.kind(), ErrorKind::InvalidArgument);
        api.modify_qp(h, &rts).unwrap();
        api.modify_qp(h, &QpTransition::Error).unwrap();
        assert_eq!(kind(api.modify_qp(h, &init)), ErrorKind::InvalidArgument);
        // ERROR flushes the receive posted in INIT.
        let f = a.wait(1);
        assert_eq!(
            (f[0].status, f[0].opcode),
            (WcStatus::WR_FLUSH_ERR, WcOpcode::Recv)
        );
        a.teardown();
        b.teardown();
    }

    #[test]
    fn destroying_a_cq_with_unacked_events_is_a_violation() {
        let (a, b) = pair(4096, CAPS);
        let api = a.api.clone();
        api.req_notify_cq(a.cq).unwrap();
        a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
            .unwrap();
        assert!(readable(a.chan.fd, 10_000));
        assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), Some(a.cq));
        a.wait(1);
        // Still used by a queue pair: refused, recorded.
        // SAFETY: refused (the queue stays live).
        let busy = unsafe { api.destroy_cq(a.cq) }.unwrap_err();
        assert_eq!(busy.kind(), ErrorKind::NotAllowed);
        // SAFETY: live objects, unused from now on.
        unsafe {
            api.destroy_qp(a.qp.handle).unwrap();
            api.destroy_cq(a.cq).unwrap();
            api.dereg_mr(a.mr.handle).unwrap();
            api.destroy_channel(a.chan.handle).unwrap();
            api.dealloc_pd(a.pd).unwrap();
            api.close(a.ctx).unwrap();
        }
        let v = violations_of(a.ctx);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].contains("still use it"), "{v:?}");
        assert!(v[1].contains("not acknowledged"), "{v:?}");
        assert!(violations().iter().any(|s| s.contains("not acknowledged")));
        b.teardown();
    }

    #[test]
    fn misuse_is_recorded_not_fatal() {
        let api = api();
        let ctx = api.open(DEVICE_NAME).unwrap();
        let pd = api.alloc_pd(ctx).unwrap();
        let ch = api.create_channel(ctx).unwrap();
        let cq = api.create_cq(ctx, 4, ch.handle).unwrap();
        let qp = api.create_qp(pd, cq, CAPS).unwrap();
        let mut m = vec![0u8; 64];
        // SAFETY: `m` outlives the registration (the context's close removes it).
        let mr = unsafe { api.reg_mr(pd, m.as_mut_ptr() as usize, 64, ALL) }.unwrap();
        // Wrong kind, never made.
        assert!(api.poll_cq(pd, &mut [Completion::EMPTY]).is_err());
        assert!(api.query_device(Handle(usize::MAX)).is_err());
        // Entries outside the posted list.
        let init = QpTransition::Init {
            port: 1,
            pkey_index: 0,
            access: ALL,
        };
        api.modify_qp(qp.handle, &init).unwrap();
        api.modify_qp(qp.handle, &rtr(qp.qp_num, GIDS[0])).unwrap();
        let rts = QpTransition::Rts {
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 4,
        };
        api.modify_qp(qp.handle, &rts).unwrap();
        let e = Sge {
            addr: m.as_ptr() as u64,
            len: 8,
            lkey: mr.lkey,
        };
        // SAFETY: refused before any entry is used.
        let r = unsafe { api.post_send(qp.handle, &[wr(1, SendOp::Send, 1, 1, true)], &[e]) };
        assert_eq!(r.unwrap_err().error.kind(), ErrorKind::InvalidArgument);
        // SAFETY: refused (EBUSY): the PD and channel stay live.
        unsafe {
            assert_eq!(
                api.dealloc_pd(pd).unwrap_err().kind(),
                ErrorKind::NotAllowed
            );
            assert_eq!(
                api.destroy_channel(ch.handle).unwrap_err().kind(),
                ErrorKind::NotAllowed
            );
        }
        // Destroy the QP twice, then use it.
        // SAFETY: live, then (wrongly, on purpose) stale: the double only records it.
        unsafe {
            api.destroy_qp(qp.handle).unwrap();
            assert!(api.destroy_qp(qp.handle).is_err());
        }
        api.ack_cq_events(cq, 3); // more than taken
                                  // Close with children: recorded, and the children go with it.
                                  // SAFETY: the context is unused from now on.
        unsafe { api.close(ctx) }.unwrap();
        assert_eq!(live_objects_of(ctx), 0);
        // SAFETY: stale on purpose.
        assert!(unsafe { api.dereg_mr(mr.handle) }.is_err());
        let v = violations_of(ctx).join("\n");
        for needle in [
            "is a protection domain, not a completion queue",
            "entries 1..+1 of a list of 1",
            "region(s) and 1 queue pair(s) still in it",
            "still report to it",
            "was destroyed",
            "acknowledged, only 0 taken",
            "still live",
            "ibv_dereg_mr",
        ] {
            assert!(v.contains(needle), "{needle:?} missing from:\n{v}");
        }
        assert!(violations().iter().any(|s| s.contains("never made")));
        drop(m);
    }

    #[test]
    fn status_strings_match_libibverbs() {
        let api = api();
        assert_eq!(
            api.status_str(WcStatus::WR_FLUSH_ERR),
            "Work Request Flushed Error"
        );
        assert_eq!(
            api.status_str(WcStatus::RETRY_EXC_ERR),
            "transport retry counter exceeded"
        );
        assert!(api.status_str(WcStatus(999)).contains("999"));
        assert!(api.describe().contains("test double"));
    }

    #[test]
    fn worker_thread_ends_when_idle() {
        let (a, b) = pair(4096, CAPS);
        a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
            .unwrap();
        assert!(worker_running());
        a.wait(1);
        a.teardown();
        b.teardown();
        // Other tests of this binary may keep it busy for a while; generous bound.
        assert!(wait_until(Duration::from_secs(60), || !worker_running()));
    }
}
