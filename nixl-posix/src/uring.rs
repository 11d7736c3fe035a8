//! The io_uring engine: one ring per backend.
//!
//! `post` pushes a whole transfer's operations onto the ring and submits them in the
//! same call (in chunks of the submission queue's size when longer); the kernel runs
//! what it can at once (page-cache reads and writes) and queues the rest to the
//! device or its own workers. `post` then takes whatever already completed, so a
//! transfer the kernel finished inline is complete before `post` returns: no thread
//! hand-off. One reaper thread (owned by the agent's thread service) waits in
//! `io_uring_enter` for the rest and reports them; nothing polls.
//!
//! Audited `unsafe`: the submission and completion queues are shared between the
//! posting threads and the reaper under one mutex, and every read or write names
//! host memory the transfer's [`nixl::Completer`] keeps registered until its last
//! operation completed (a transfer reports only after every submitted operation
//! finished, see [`crate::batch`]).
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use io_uring::{opcode, types, IoUring};

use crate::batch::{Batch, Next};
use crate::plan::{judge, Outcome};
use crate::Durability;

/// Submission queue entries.
const SQ_ENTRIES: u32 = 1024;
/// Completion queue entries: also the most operations in flight at once (more wait
/// in a queue of ours, so the completion queue can never overflow).
const CQ_ENTRIES: u32 = 4096;
/// `user_data` of the no-op that wakes the reaper.
const WAKE: u64 = u64::MAX;
/// Most of our operations in flight: the completion queue keeps room for the
/// reaper's wake-up no-ops, so it never overflows.
const IN_FLIGHT_MAX: usize = CQ_ENTRIES as usize - 64;
/// The reaper's longest sleep in the kernel: a bound, not a poll, for the rare case
/// where its wake-up went to another thread's reap or a submission was deferred (the
/// kernel was short of room) while nothing of ours was in flight to wake it.
const REAPER_NAP: std::time::Duration = std::time::Duration::from_millis(250);

/// What an in-flight entry is.
#[derive(Debug)]
enum Work {
    /// Operation `op` of the batch, `done` of its bytes already moved.
    Data { op: u32, done: u32 },
    /// Flush file `file` of the batch.
    Flush { file: u32 },
}

#[derive(Debug)]
struct Entry {
    batch: Arc<Batch>,
    work: Work,
}

#[derive(Debug, Default)]
struct Queues {
    /// In flight, by `user_data`.
    slab: Vec<Option<Entry>>,
    free: Vec<u32>,
    in_flight: usize,
    /// Waiting for room in the completion queue.
    waiting: VecDeque<Entry>,
    /// Submitted to the ring's queue, not yet to the kernel.
    unsubmitted: usize,
    stopping: bool,
}

/// The ring and the state its queues share.
pub(crate) struct Uring {
    ring: IoUring,
    queues: Mutex<Queues>,
}

impl std::fmt::Debug for Uring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uring").finish_non_exhaustive()
    }
}

impl Uring {
    /// A ring, or the reason the kernel refuses one (seccomp filters of container
    /// runtimes answer EPERM; `kernel.io_uring_disabled` too; old kernels ENOSYS).
    pub(crate) fn new() -> std::io::Result<Self> {
        let ring = IoUring::builder()
            .setup_cqsize(CQ_ENTRIES)
            .build(SQ_ENTRIES)?;
        // A no-op round trip: a ring that sets up but cannot run (a filter on
        // io_uring_enter) is refused here rather than at the first transfer.
        let probe = opcode::Nop::new().build().user_data(0);
        // SAFETY: no other queue handle exists yet (the ring is ours alone); a no-op
        // names no memory.
        unsafe {
            let mut sq = ring.submission_shared();
            sq.push(&probe)
                .map_err(|_| std::io::Error::other("submission queue full"))?;
            sq.sync();
        }
        ring.submit_and_wait(1)?;
        // The operations we use (reads and writes at an offset: 5.6; fsync: 5.1).
        let mut probe = io_uring::Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        for (code, name) in [
            (opcode::Read::CODE, "READ"),
            (opcode::Write::CODE, "WRITE"),
            (opcode::Fsync::CODE, "FSYNC"),
        ] {
            if !probe.is_supported(code) {
                return Err(std::io::Error::other(format!(
                    "this kernel's io_uring has no {name} operation"
                )));
            }
        }
        // SAFETY: as above.
        unsafe {
            let mut cq = ring.completion_shared();
            cq.sync();
            for c in &mut cq {
                let c: io_uring::cqueue::Entry = c;
                if c.result() < 0 {
                    return Err(std::io::Error::from_raw_os_error(-c.result()));
                }
            }
        }
        Ok(Self {
            ring,
            queues: Mutex::new(Queues::default()),
        })
    }

    /// Submit operations `ops` (index, bytes already moved) of `batch` now, and
    /// report what completed inline.
    pub(crate) fn submit(&self, batch: &Arc<Batch>, ops: impl Iterator<Item = (u32, u32)>) {
        self.queue_all(batch, ops.map(|(op, done)| Work::Data { op, done }));
    }

    /// Flush `batch`'s `n` files.
    pub(crate) fn flush(&self, batch: &Arc<Batch>, n: usize) {
        self.queue_all(batch, (0..n as u32).map(|file| Work::Flush { file }));
    }

    fn queue_all(&self, batch: &Arc<Batch>, work: impl Iterator<Item = Work>) {
        let mut report = Vec::new();
        {
            let mut q = self.queues.lock().unwrap();
            if q.stopping {
                drop(q);
                return batch.refuse(crate::shut_down());
            }
            for w in work {
                let e = Entry {
                    batch: batch.clone(),
                    work: w,
                };
                self.queue(&mut q, e);
            }
            self.submit_queued(&mut q);
            self.reap(&mut q, &mut report);
        }
        for b in report {
            b.report();
        }
    }

    /// Put an entry on the ring, or in the waiting queue (at its end, or at its front
    /// with `front` for one that came out of it) when the ring is full; returns
    /// whether it is on the ring.
    fn queue_at(&self, q: &mut Queues, e: Entry, front: bool) -> bool {
        if q.in_flight >= IN_FLIGHT_MAX {
            if front {
                q.waiting.push_front(e);
            } else {
                q.waiting.push_back(e);
            }
            return false;
        }
        let sqe = self.sqe(&e);
        let slot = match q.free.pop() {
            Some(s) => s,
            None => {
                q.slab.push(None);
                (q.slab.len() - 1) as u32
            }
        };
        let sqe = sqe.user_data(u64::from(slot));
        // SAFETY: the queues' mutex is held (`q`), so no other submission queue
        // handle exists. The entry's memory (a read's destination, a write's source)
        // is host memory of a registration the batch's completer keeps registered
        // until the batch reports, which happens only after this entry completed
        // (the slab holds the batch meanwhile); its file descriptor is the
        // registration's own, kept open by the plan's file handles.
        unsafe {
            let mut sq = self.ring.submission_shared();
            if sq.is_full() {
                sq.sync();
                drop(sq);
                if self.ring.submit().is_ok() {
                    q.unsubmitted = 0;
                }
                sq = self.ring.submission_shared();
            }
            if sq.push(&sqe).is_err() {
                // Still full (the kernel took nothing): wait for the next round.
                drop(sq);
                q.free.push(slot);
                if front {
                    q.waiting.push_front(e);
                } else {
                    q.waiting.push_back(e);
                }
                return false;
            }
            sq.sync();
        }
        q.slab[slot as usize] = Some(e);
        q.in_flight += 1;
        q.unsubmitted += 1;
        true
    }

    fn queue(&self, q: &mut Queues, e: Entry) {
        self.queue_at(q, e, false);
    }

    fn sqe(&self, e: &Entry) -> io_uring::squeue::Entry {
        let plan = &e.batch.plan;
        match e.work {
            Work::Data { op, done } => {
                let o = &plan.ops[op as usize];
                let fd = types::Fd(plan.files[o.file as usize].as_fd().as_raw_fd());
                let (addr, len, off) = (
                    (o.addr + u64::from(done)) as usize,
                    o.len - done,
                    o.offset + u64::from(done),
                );
                match plan.op {
                    nixl::Op::Write => opcode::Write::new(fd, addr as *const u8, len)
                        .offset(off)
                        .build(),
                    nixl::Op::Read => opcode::Read::new(fd, addr as *mut u8, len)
                        .offset(off)
                        .build(),
                }
            }
            Work::Flush { file } => {
                let fd = types::Fd(plan.files[file as usize].as_fd().as_raw_fd());
                let flags = match e.batch.durability {
                    Durability::Data => types::FsyncFlags::DATASYNC,
                    _ => types::FsyncFlags::empty(),
                };
                opcode::Fsync::new(fd).flags(flags).build()
            }
        }
    }

    fn submit_queued(&self, q: &mut Queues) {
        if q.unsubmitted == 0 {
            return;
        }
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EAGAIN/EBUSY: the kernel is short of room now; the reaper submits
                // again after the next completions.
                Err(e) => {
                    tracing::debug!(error = %e, "io_uring submit deferred");
                    return;
                }
            }
        }
        q.unsubmitted = 0;
    }

    /// Take every completion there is; batches that ended go to `report`.
    fn reap(&self, q: &mut Queues, report: &mut Vec<Arc<Batch>>) {
        loop {
            let mut cqes = Vec::new();
            // SAFETY: the queues' mutex is held, so no other completion queue handle
            // exists.
            unsafe {
                let mut cq = self.ring.completion_shared();
                cq.sync();
                cqes.extend((&mut cq).map(|c| (c.user_data(), c.result())));
                cq.sync();
            }
            if cqes.is_empty() {
                break;
            }
            for (slot, res) in cqes {
                if slot == WAKE {
                    continue;
                }
                let Some(e) = q.slab.get_mut(slot as usize).and_then(Option::take) else {
                    continue;
                };
                q.free.push(slot as u32);
                q.in_flight -= 1;
                self.completed(q, e, res, report);
            }
            // Room freed: what waited goes on (until the ring is full again).
            while q.in_flight < IN_FLIGHT_MAX {
                let Some(e) = q.waiting.pop_front() else {
                    break;
                };
                if matches!(e.work, Work::Data { done: 0, .. }) && e.batch.canceled() {
                    e.batch.skipped();
                    if e.batch.finished(1) {
                        self.ended(q, e.batch, report);
                    }
                    continue;
                }
                if !self.queue_at(q, e, true) {
                    break;
                }
            }
            self.submit_queued(q);
        }
    }

    fn completed(&self, q: &mut Queues, e: Entry, res: i32, report: &mut Vec<Arc<Batch>>) {
        let batch = e.batch;
        match e.work {
            Work::Data { op, done } => {
                let o = batch.plan.ops[op as usize];
                match judge(
                    batch.plan.op,
                    &o,
                    done,
                    i64::from(res),
                    batch.plan.align(&o),
                ) {
                    Outcome::Done => batch.moved(u64::from(o.len - done)),
                    Outcome::Short(n) => {
                        // The rest goes again from where it stopped.
                        batch.moved(u64::from(n));
                        let again = Entry {
                            batch,
                            work: Work::Data { op, done: done + n },
                        };
                        self.queue(q, again);
                        return;
                    }
                    Outcome::Failed(why, source) => batch.failed(&o, done, &why, source),
                }
            }
            Work::Flush { file } => {
                if res < 0 {
                    // Counted here, in completion order: a flush that completed after
                    // this failed one sees it when its own completion is processed.
                    batch.plan.files[file as usize].flush_failed();
                    batch.flush_failed(file as usize, std::io::Error::from_raw_os_error(-res));
                }
            }
        }
        if batch.finished(1) {
            self.ended(q, batch, report);
        }
    }

    fn ended(&self, q: &mut Queues, batch: Arc<Batch>, report: &mut Vec<Arc<Batch>>) {
        match batch.end() {
            Next::Flush(n) => {
                for file in 0..n {
                    let e = Entry {
                        batch: batch.clone(),
                        work: Work::Flush { file: file as u32 },
                    };
                    self.queue(q, e);
                }
            }
            Next::Report => report.push(batch),
        }
    }

    /// The reaper: wait for completions and report them, until `stop` and nothing
    /// is in flight any more (the kernel may still use the memory of what is).
    pub(crate) fn run(&self, stop: &dyn Fn() -> bool) {
        loop {
            let mut report = Vec::new();
            let done = {
                let mut q = self.queues.lock().unwrap();
                self.reap(&mut q, &mut report);
                if stop() {
                    q.stopping = true;
                    // Nothing new starts; what waited for room is given up.
                    while let Some(e) = q.waiting.pop_front() {
                        e.batch.stopped();
                        if e.batch.finished(1) {
                            // A skip is a failure: no flush follows, only the report.
                            report.push(e.batch);
                        }
                    }
                }
                q.stopping && q.in_flight == 0
            };
            for b in report {
                b.report();
            }
            if done {
                return;
            }
            // Submit what a deferred submission left, and wait (bounded).
            let nap = types::Timespec::from(REAPER_NAP);
            let args = types::SubmitArgs::new().timespec(&nap);
            let waited = self.ring.submitter().submit_with_args(1, &args);
            match waited {
                Ok(_) => self.queues.lock().unwrap().unsubmitted = 0,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::ETIME)) => {}
                // Kernels before 5.11 take no timeout: wait without one.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    let _ = self.ring.submit_and_wait(1);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring wait failed");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    /// Wake the reaper (a no-op completion).
    pub(crate) fn wake(&self) {
        let _q = self.queues.lock().unwrap();
        let nop = opcode::Nop::new().build().user_data(WAKE);
        // SAFETY: the queues' mutex is held; a no-op names no memory.
        unsafe {
            let mut sq = self.ring.submission_shared();
            if sq.push(&nop).is_ok() {
                sq.sync();
            }
        }
        let _ = self.ring.submit();
    }
}
