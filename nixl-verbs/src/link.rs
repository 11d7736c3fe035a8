//! The initiator's side: a link to one peer (its control connection and queue
//! pairs), and on each queue pair the send queue: posting work requests within its
//! capacity, signalling selectively, and matching completions to transfers.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use nixl::kit::{Outcome, StripeGate};
use nixl::{Completer, Error, ErrorKind, Result};
use tokio_util::sync::CancellationToken;

use crate::api::{Completion, SendOp, SendWr, Sge, WcStatus};
use crate::ffi::device::{QueuePair, RegisteredBuf};
use crate::plan::{signaled, WrPlan};

/// One transfer (or standalone notification) for a send queue.
pub(crate) struct Job {
    /// The data work requests (none for a standalone notification), and which of
    /// them this queue pair posts.
    pub(crate) plan: Option<(Arc<WrPlan>, std::ops::Range<usize>)>,
    /// Sent (a SEND into the peer's receive buffers, fenced after READs) after the
    /// data.
    pub(crate) notif: Option<Bytes>,
    /// Reports the outcome once the last work request completed.
    pub(crate) done: Option<Completer>,
    /// Nothing after this job is posted before the gate opens (a transfer split
    /// across queue pairs: see [`StripeGate`]).
    pub(crate) gate: Option<Arc<StripeGate>>,
    /// Work requests posted so far.
    next: usize,
}

impl Job {
    pub(crate) fn transfer(
        plan: Arc<WrPlan>,
        range: std::ops::Range<usize>,
        notif: Option<Bytes>,
        done: Completer,
    ) -> Self {
        Self {
            plan: Some((plan, range)),
            notif,
            done: Some(done),
            gate: None,
            next: 0,
        }
    }

    pub(crate) fn notify(msg: Bytes, done: Completer) -> Self {
        Self {
            plan: None,
            notif: Some(msg),
            done: Some(done),
            gate: None,
            next: 0,
        }
    }

    pub(crate) fn gate(gate: Arc<StripeGate>) -> Self {
        Self {
            plan: None,
            notif: None,
            done: None,
            gate: Some(gate),
            next: 0,
        }
    }

    fn data_wrs(&self) -> usize {
        self.plan.as_ref().map_or(0, |(_, r)| r.len())
    }

    fn total_wrs(&self) -> usize {
        self.data_wrs() + usize::from(self.notif.is_some())
    }

    fn fail(self, e: &Error) {
        if let Some(d) = self.done {
            d.complete(Err(e.cloned()));
        }
        if let Some(g) = self.gate {
            g.close(e.cloned());
        }
    }
}

/// Work-request ids, unique in the process: a completion that reaches a lane that
/// did not post it (a stale one of a destroyed queue pair whose number was reused)
/// matches nothing there.
static NEXT_WR: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// What a signaled work request finishes.
struct Signal {
    /// Send-queue entries its completion frees (itself and the unsignaled ones
    /// before it).
    retires: u32,
    done: Option<Completer>,
    /// The notification buffer it used.
    slot: Option<usize>,
}

/// Registered buffers for notifications too long to send inline. The device reads
/// them, so they are reached through copies only.
pub(crate) struct Slots {
    pub(crate) buf: RegisteredBuf,
    pub(crate) size: usize,
    free: Vec<usize>,
}

impl Slots {
    pub(crate) fn new(buf: RegisteredBuf, size: usize) -> Self {
        let n = buf.len() / size.max(1);
        Self {
            buf,
            size,
            free: (0..n).rev().collect(),
        }
    }
}

/// One queue pair to the peer and its send queue.
pub(crate) struct Lane {
    pub(crate) qp_num: u32,
    pub(crate) peer: String,
    /// The link it belongs to ([`Link::id`]).
    pub(crate) link_id: u64,
    sq: Mutex<Sq>,
}

struct Sq {
    /// `None` once the lane failed (the queue pair is destroyed then).
    qp: Option<QueuePair>,
    dead: Option<Error>,
    capacity: u32,
    window: usize,
    outstanding: u32,
    signals: HashMap<u64, Signal>,
    backlog: VecDeque<Job>,
    wrs: Vec<SendWr>,
    sges: Vec<Sge>,
    inline_max: u32,
    slots: Option<Slots>,
}

/// What to finish after the lane's lock is released (completers may run code:
/// wakers, and a split transfer's last part posting on another lane).
#[derive(Default)]
pub(crate) struct Finish(Vec<(Completer, Result<()>)>, Vec<(Arc<StripeGate>, Error)>);

impl Finish {
    fn absorb(&mut self, other: Self) {
        self.0.extend(other.0);
        self.1.extend(other.1);
    }

    pub(crate) fn run(self) {
        for (c, r) in self.0 {
            c.complete(r);
        }
        for (g, e) in self.1 {
            g.close(e);
        }
    }
}

/// The error a failed work request means for its transfer.
pub(crate) fn completion_error(peer: &str, c: &Completion, text: &str) -> Error {
    let (kind, what) = match c.status {
        WcStatus::RETRY_EXC_ERR | WcStatus::RNR_RETRY_EXC_ERR | WcStatus::WR_FLUSH_ERR => (
            ErrorKind::RemoteDisconnected,
            "the peer stopped answering (it is gone, or the link is down)",
        ),
        WcStatus::REM_ACCESS_ERR => (
            ErrorKind::NotAllowed,
            "the peer's NIC refused the key or range (the memory was deregistered, or the metadata is stale)",
        ),
        _ => (ErrorKind::Backend, "a work request failed"),
    };
    Error::new(
        kind,
        "verbs transfer",
        format!(
            "peer {peer:?}: {what}: {text} (status {}, vendor error {:#x})",
            c.status.0, c.vendor_err
        ),
    )
}

impl Lane {
    pub(crate) fn new(peer: &str, link_id: u64, qp: QueuePair, slots: Option<Slots>) -> Self {
        let caps = qp.qp.caps;
        let capacity = caps.max_send_wr.max(1);
        Self {
            qp_num: qp.qp.qp_num,
            peer: peer.to_owned(),
            link_id,
            sq: Mutex::new(Sq {
                capacity,
                window: (capacity as usize / 2).max(1),
                outstanding: 0,
                signals: HashMap::new(),
                backlog: VecDeque::new(),
                wrs: Vec::new(),
                sges: Vec::new(),
                inline_max: caps.max_inline_data,
                slots,
                qp: Some(qp),
                dead: None,
            }),
        }
    }

    /// Queue `job` behind what is queued, and post what fits.
    pub(crate) fn submit(&self, job: Job) {
        let mut fin = Finish::default();
        {
            let mut sq = self.sq.lock().unwrap();
            if let Some(e) = &sq.dead {
                let e = e.cloned();
                drop(sq);
                job.fail(&e);
                return;
            }
            sq.backlog.push_back(job);
            if let Err(e) = sq.advance(&mut fin) {
                fin.absorb(sq.fail(e));
            }
        }
        fin.run();
    }

    /// Post what a gate or freed capacity let through.
    pub(crate) fn kick(&self) {
        let fin = {
            let mut sq = self.sq.lock().unwrap();
            if sq.dead.is_some() {
                return;
            }
            let mut fin = Finish::default();
            if let Err(e) = sq.advance(&mut fin) {
                fin.absorb(sq.fail(e));
            }
            fin
        };
        fin.run();
    }

    /// A completion of this queue pair (`text` is the status's description).
    pub(crate) fn on_completion(&self, c: &Completion, text: &str) {
        let fin = {
            let mut sq = self.sq.lock().unwrap();
            if sq.dead.is_some() {
                // Flushes after the failure: everything was failed already.
                return;
            }
            if !c.status.is_ok() {
                let e = completion_error(&self.peer, c, text);
                sq.fail(e)
            } else {
                let mut fin = Finish::default();
                match sq.signals.remove(&c.wr_id) {
                    Some(s) => {
                        sq.outstanding = sq.outstanding.saturating_sub(s.retires);
                        if let (Some(slot), Some(slots)) = (s.slot, sq.slots.as_mut()) {
                            slots.free.push(slot);
                        }
                        if let Some(d) = s.done {
                            fin.0.push((d, Ok(())));
                        }
                    }
                    None => {
                        tracing::debug!(peer = %self.peer, wr_id = c.wr_id, "verbs: completion for no pending work request; ignored");
                    }
                }
                if let Err(e) = sq.advance(&mut fin) {
                    fin.absorb(sq.fail(e));
                }
                fin
            }
        };
        fin.run();
    }

    /// Fail everything on this lane and destroy its queue pair (first reason wins).
    pub(crate) fn fail(&self, e: Error) {
        let fin = self.sq.lock().unwrap().fail(e);
        fin.run();
    }

    /// Whether the lane failed.
    pub(crate) fn is_dead(&self) -> bool {
        self.sq.lock().unwrap().dead.is_some()
    }
}

impl Sq {
    /// Destroy the queue pair (the device stops touching the memory of its work
    /// requests), then hand back every transfer to fail.
    ///
    /// Should the device refuse to destroy it, everything its posted work requests
    /// name is leaked instead (those transfers never complete): memory the device may
    /// still write is never handed back.
    fn fail(&mut self, e: Error) -> Finish {
        if self.dead.is_none() {
            self.dead = Some(e.cloned());
        }
        let e = self.dead.as_ref().map(Error::cloned).expect("set above");
        let mut fin = Finish::default();
        if let Some(mut qp) = self.qp.take() {
            if let Err(d) = qp.destroy() {
                tracing::error!(peer = %self.dead_peer(), error = %d, "verbs: a queue pair could not be destroyed; the memory of its {} posted transfers is leaked and they never complete", self.signals.len());
                std::mem::forget(qp);
                for (_, s) in self.signals.drain() {
                    std::mem::forget(s.done);
                }
                std::mem::forget(self.slots.take());
                // The head job may be partly posted: its memory stays too.
                if self.backlog.front().is_some_and(|j| j.next > 0) {
                    std::mem::forget(self.backlog.pop_front());
                }
            }
        }
        for (_, s) in self.signals.drain() {
            if let Some(d) = s.done {
                fin.0.push((d, Err(e.cloned())));
            }
        }
        for job in self.backlog.drain(..) {
            if let Some(d) = job.done {
                fin.0.push((d, Err(e.cloned())));
            }
            if let Some(g) = job.gate {
                fin.1.push((g, e.cloned()));
            }
        }
        self.outstanding = 0;
        fin
    }

    fn dead_peer(&self) -> String {
        self.dead
            .as_ref()
            .map(|e| e.context().to_owned())
            .unwrap_or_default()
    }

    /// Post from the head of the backlog while the send queue has room. Transfers it
    /// finishes (dropped before posting, a gate's outcome) go to `fin`, run once the
    /// lane's lock is released.
    fn advance(&mut self, fin: &mut Finish) -> Result<()> {
        loop {
            let Some(job) = self.backlog.front_mut() else {
                return Ok(());
            };
            if let Some(g) = &job.gate {
                // Nothing behind the gate goes before every share completed.
                let Some(Outcome {
                    done,
                    result,
                    notif,
                }) = g.take()
                else {
                    return Ok(());
                };
                self.backlog.pop_front();
                match (result, notif) {
                    (Ok(()), Some(n)) => {
                        self.backlog.push_front(Job::notify(n, done));
                    }
                    (r, _) => fin.0.push((done, r)),
                }
                continue;
            }
            if job.done.as_ref().is_some_and(Completer::is_canceled) && job.next == 0 {
                let job = self.backlog.pop_front().expect("front");
                if let Some(d) = job.done {
                    fin.0.push((
                        d,
                        Err(Error::new(
                            ErrorKind::Canceled,
                            "verbs transfer",
                            "dropped before it was posted",
                        )),
                    ));
                }
                continue;
            }
            let total = job.total_wrs();
            while self.backlog.front().expect("front").next < total {
                let free = self.capacity.saturating_sub(self.outstanding) as usize;
                if free == 0 {
                    return Ok(());
                }
                if !self.post_chunk(free)? {
                    // No notification buffer free: wait for a SEND to complete.
                    return Ok(());
                }
            }
            self.backlog.pop_front();
        }
    }

    /// Post the next chunk of the head job: at most `free` work requests and one
    /// signaling window, the last signaled. Returns false when the chunk is the
    /// notification and no buffer is free for it.
    fn post_chunk(&mut self, free: usize) -> Result<bool> {
        let window = self.window;
        self.qp
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::Backend, "verbs post", "queue pair gone"))?;
        self.wrs.clear();
        self.sges.clear();
        let job = self.backlog.front_mut().expect("caller checked");
        let data = job.data_wrs();
        let total = job.total_wrs();
        let mut slot = None;
        let n = if job.next < data {
            // Data only in this chunk; the notification goes in a chunk of its own.
            let (plan, range) = job.plan.as_ref().expect("data_wrs > 0");
            let n = free.min(window).min(data - job.next);
            for (k, sig) in (job.next..job.next + n).zip(signaled(n, window)) {
                let mut w = plan.wrs[range.start + k];
                let sges = &plan.sges[w.first_sge as usize..(w.first_sge + w.num_sge) as usize];
                w.first_sge = self.sges.len() as u32;
                self.sges.extend_from_slice(sges);
                w.signaled = sig;
                self.wrs.push(w);
            }
            n
        } else {
            let msg = job.notif.as_ref().expect("total > data");
            let inline = msg.len() as u32 <= self.inline_max;
            let sge = if msg.is_empty() {
                None
            } else if inline {
                Some(Sge {
                    addr: msg.as_ptr() as u64,
                    len: msg.len() as u32,
                    lkey: 0,
                })
            } else {
                let slots = self.slots.as_mut().ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidArgument,
                        "verbs notify",
                        "notification longer than the inline limit, and no buffers",
                    )
                })?;
                let Some(s) = slots.free.pop() else {
                    return Ok(false);
                };
                slot = Some(s);
                let at = s * slots.size;
                // Slot `s` is free (no work request names it); the notification is at
                // most `size` bytes (checked at post).
                slots.buf.write(at, &msg[..msg.len().min(slots.size)]);
                Some(Sge {
                    addr: slots.buf.addr(at),
                    len: msg.len() as u32,
                    lkey: slots.buf.lkey(),
                })
            };
            if let Some(s) = sge {
                self.sges.push(s);
            }
            self.wrs.push(SendWr {
                wr_id: 0,
                op: SendOp::Send,
                first_sge: 0,
                num_sge: u32::from(sge.is_some()),
                signaled: true,
                // After any READ still in flight on this queue pair (of this
                // transfer or an earlier one): the peer learns of nothing before its
                // memory was read.
                fence: true,
                inline: inline && sge.is_some(),
            });
            1
        };
        // Ids: signaled requests get a fresh id and a record of what they retire.
        let mut since = 0u32;
        let last_of_job = job.next + n == total;
        let mut done = if last_of_job { job.done.take() } else { None };
        let count = self.wrs.len();
        for (i, w) in self.wrs.iter_mut().enumerate() {
            since += 1;
            if w.signaled {
                let id = NEXT_WR.fetch_add(1, Ordering::Relaxed);
                w.wr_id = id;
                let is_last = i + 1 == count;
                self.signals.insert(
                    id,
                    Signal {
                        retires: since,
                        done: if is_last { done.take() } else { None },
                        slot: if is_last { slot } else { None },
                    },
                );
                since = 0;
            }
        }
        // Every entry lies in memory the job's completer keeps alive (its
        // registrations), in a notification buffer this lane owns, or (inline) in
        // the job's notification bytes, read by the device during the call; all stay
        // valid until the work request completes or the queue pair is destroyed.
        let inline = self
            .backlog
            .front()
            .and_then(|j| j.notif.as_deref())
            .unwrap_or_default();
        let posted = self
            .qp
            .as_ref()
            .expect("checked above")
            .post_send(&self.wrs, &self.sges, inline);
        match posted {
            Ok(()) => {
                self.outstanding += n as u32;
                self.backlog.front_mut().expect("front").next += n;
                Ok(true)
            }
            Err(p) => {
                // The lane fails as a whole: its queue pair is destroyed before any
                // transfer is failed (the job's completer is in a signal record), so
                // no memory is let go while the device may still use it.
                Err(p.error)
            }
        }
    }
}

/// A link's state.
pub(crate) enum LinkState {
    /// Connecting; requests wait here, in posting order.
    Connecting(Vec<Pending>),
    /// Up: its lanes, and the longest notification the peer receives.
    Up(Vec<Arc<Lane>>, usize),
    /// Failed or closed.
    Dead(Error),
}

/// A request made while the link was connecting.
pub(crate) enum Pending {
    Transfer {
        plan: Arc<WrPlan>,
        notif: Option<Bytes>,
        done: Completer,
    },
    Notify(Bytes, Completer),
}

impl Pending {
    pub(crate) fn fail(self, e: &Error) {
        match self {
            Self::Transfer { done, .. } | Self::Notify(_, done) => done.complete(Err(e.cloned())),
        }
    }
}

static NEXT_LINK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh link id.
pub(crate) fn next_link_id() -> u64 {
    NEXT_LINK.fetch_add(1, Ordering::Relaxed)
}

/// The connection to one peer.
pub(crate) struct Link {
    /// Unique in the process (lanes name their link by it).
    pub(crate) id: u64,
    pub(crate) peer: String,
    pub(crate) state: Mutex<LinkState>,
    /// Signalled when the state leaves `Connecting`.
    pub(crate) settled: tokio::sync::Notify,
    /// Ends the control connection's watcher.
    pub(crate) cancel: CancellationToken,
}

impl Link {
    /// Wait until connected (or failed).
    pub(crate) async fn ready(&self) -> Result<()> {
        loop {
            let settled = self.settled.notified();
            match &*self.state.lock().unwrap() {
                LinkState::Up(..) => return Ok(()),
                LinkState::Dead(e) => return Err(e.cloned()),
                LinkState::Connecting(_) => {}
            }
            settled.await;
        }
    }

    /// Whether the link failed, or any of its lanes did (a post the device refused
    /// destroys that lane's queue pair): the next use connects anew.
    pub(crate) fn is_dead(&self) -> bool {
        if self.cancel.is_cancelled() {
            return true;
        }
        match &*self.state.lock().unwrap() {
            LinkState::Dead(_) => true,
            LinkState::Up(lanes, _) => lanes.iter().any(|l| l.is_dead()),
            LinkState::Connecting(_) => false,
        }
    }

    /// Fail the link: every lane, everything waiting; the control connection closes.
    /// A link fails once: the first reason stands (closing a link cancels its
    /// connect, which must not turn "closed" into "canceled").
    pub(crate) fn fail(&self, e: Error) -> Vec<Arc<Lane>> {
        let old = {
            let mut st = self.state.lock().unwrap();
            if matches!(*st, LinkState::Dead(_)) {
                return Vec::new();
            }
            std::mem::replace(&mut *st, LinkState::Dead(e.cloned()))
        };
        self.cancel.cancel();
        self.settled.notify_waiters();
        match old {
            LinkState::Connecting(pending) => {
                for p in pending {
                    p.fail(&e);
                }
                Vec::new()
            }
            LinkState::Up(lanes, _) => {
                for l in &lanes {
                    l.fail(e.cloned());
                }
                lanes
            }
            LinkState::Dead(_) => Vec::new(),
        }
    }

    /// Post a transfer: on one lane whole, or split across lanes with a gate on the
    /// first (see [`StripeGate`]).
    pub(crate) fn post(&self, p: Pending) {
        let (lanes, max_notif) = {
            let mut st = self.state.lock().unwrap();
            match &mut *st {
                LinkState::Connecting(q) => {
                    q.push(p);
                    return;
                }
                LinkState::Dead(e) => {
                    let e = e.cloned();
                    drop(st);
                    p.fail(&e);
                    return;
                }
                LinkState::Up(lanes, max) => (lanes.clone(), *max),
            }
        };
        post_on(&lanes, max_notif, &self.peer, p);
    }
}

/// Post `p` on `lanes` (an up link's).
pub(crate) fn post_on(lanes: &[Arc<Lane>], max_notif: usize, peer: &str, p: Pending) {
    let too_long = |n: &Bytes| {
        Error::new(
            ErrorKind::InvalidArgument,
            "verbs notify",
            format!(
                "peer {peer:?} receives notifications of at most {max_notif} bytes; this one has {}",
                n.len()
            ),
        )
    };
    match p {
        Pending::Notify(msg, done) => {
            if msg.len() > max_notif {
                return done.complete(Err(too_long(&msg)));
            }
            lanes[0].submit(Job::notify(msg, done));
        }
        Pending::Transfer { plan, notif, done } => {
            if let Some(n) = notif.as_ref().filter(|n| n.len() > max_notif) {
                return done.complete(Err(too_long(n)));
            }
            let wrs = plan.wrs.len();
            let parts = lanes.len().min(wrs).max(1);
            if parts == 1 {
                return lanes[0].submit(Job::transfer(plan.clone(), 0..wrs, notif, done));
            }
            // Shares of whole work requests, in order; the first lane holds the gate.
            let gate = Arc::new(StripeGate::new("verbs transfer", peer));
            let (g, first) = (gate.clone(), lanes[0].clone());
            let completers = done.split_then(parts, move |done, result| {
                g.open(Outcome {
                    done,
                    result,
                    notif,
                });
                first.kick();
            });
            let mut completers = completers.into_iter();
            for (i, lane) in lanes.iter().take(parts).enumerate() {
                let range = (wrs * i / parts)..(wrs * (i + 1) / parts);
                let c = completers.next().expect("one per part");
                lane.submit(Job::transfer(plan.clone(), range, None, c));
                if i == 0 {
                    lane.submit(Job::gate(gate.clone()));
                }
            }
        }
    }
}

#[cfg(all(test, feature = "test-double"))]
mod tests {
    use super::*;
    use crate::api::{Completion, WcOpcode};
    use crate::ffi::device::Device;
    use crate::VerbsOptions;

    /// Completions nothing waits for (an unknown id, a repeat, flushes after a
    /// failure) change nothing and never panic; an error completion fails the lane
    /// once.
    #[test]
    fn stray_completions_are_ignored_and_errors_fail_the_lane_once() {
        let o = VerbsOptions::default();
        let dev = Arc::new(Device::open(crate::test_double::api(), &o).unwrap());
        let qp = QueuePair::create(&dev, dev.caps(&o), crate::ffi::device::QpUse::Send).unwrap();
        let lane = Lane::new("peer", 1, qp, None);
        let ok = Completion {
            wr_id: 12345,
            opcode: WcOpcode::Write,
            qp_num: lane.qp_num,
            ..Completion::EMPTY
        };
        lane.on_completion(&ok, "");
        lane.on_completion(&ok, "");
        assert!(!lane.is_dead(), "unknown ids are ignored");
        let failed = Completion {
            status: WcStatus::RETRY_EXC_ERR,
            ..ok
        };
        lane.on_completion(&failed, "transport retry counter exceeded");
        assert!(lane.is_dead());
        let e = lane
            .sq
            .lock()
            .unwrap()
            .dead
            .as_ref()
            .map(Error::cloned)
            .unwrap();
        assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
        assert!(e.to_string().contains("retry counter"), "{e}");
        // Flushes after the failure, and a second failure, change nothing.
        let flush = Completion {
            status: WcStatus::WR_FLUSH_ERR,
            ..ok
        };
        lane.on_completion(&flush, "flush");
        lane.fail(Error::new(ErrorKind::Backend, "test", "second"));
        let again = lane
            .sq
            .lock()
            .unwrap()
            .dead
            .as_ref()
            .map(Error::cloned)
            .unwrap();
        assert_eq!(
            again.kind(),
            ErrorKind::RemoteDisconnected,
            "the first reason stays"
        );
        assert!(
            lane.sq.lock().unwrap().qp.is_none(),
            "the queue pair is destroyed"
        );
        // A refused key reads as such.
        let refused = completion_error(
            "p",
            &Completion {
                status: WcStatus::REM_ACCESS_ERR,
                ..ok
            },
            "remote access error",
        );
        assert_eq!(refused.kind(), ErrorKind::NotAllowed);
        drop(lane);
        assert_eq!(
            crate::test_double::violations_of(dev.ctx),
            Vec::<String>::new()
        );
    }
}
