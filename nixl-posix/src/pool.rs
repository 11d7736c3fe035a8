//! The thread-pool engine, for kernels or sandboxes without io_uring: worker threads
//! (owned by the agent's thread service) take operations from one queue and run
//! them as `pread`/`pwrite` (then `fsync`/`fdatasync` for a durable WRITE).
//!

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};

use crate::batch::{Batch, Next};
use crate::plan::{judge, Outcome};
use crate::{sys, Durability};

#[derive(Debug)]
enum Work {
    /// Operation `op`, `done` of its bytes already moved.
    Data {
        batch: Arc<Batch>,
        op: u32,
        done: u32,
    },
    Flush {
        batch: Arc<Batch>,
        file: u32,
    },
}

#[derive(Debug, Default)]
struct Queue {
    work: VecDeque<Work>,
    stopping: bool,
}

/// The queue the workers share.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Pool {
    /// Queue operations `ops` (index, bytes already moved) of `batch`.
    pub(crate) fn submit(&self, batch: &Arc<Batch>, ops: impl Iterator<Item = (u32, u32)>) {
        let mut q = self.queue.lock().unwrap();
        if q.stopping {
            drop(q);
            return batch.refuse(crate::shut_down());
        }
        let before = q.work.len();
        q.work.extend(ops.map(|(op, done)| Work::Data {
            batch: batch.clone(),
            op,
            done,
        }));
        let added = q.work.len() - before;
        drop(q);
        if added == 1 {
            self.ready.notify_one();
        } else {
            self.ready.notify_all();
        }
    }

    /// Queue the flushes of `batch`'s `n` files (every data operation finished).
    pub(crate) fn flush(&self, batch: &Arc<Batch>, n: usize) {
        let mut q = self.queue.lock().unwrap();
        if q.stopping {
            // No worker takes new work: the data is in the files, not flushed.
            drop(q);
            return batch.refuse(crate::shut_down());
        }
        q.work.extend((0..n).map(|file| Work::Flush {
            batch: batch.clone(),
            file: file as u32,
        }));
        drop(q);
        self.ready.notify_all();
    }

    /// A worker: run operations until `stop` and the queue is empty.
    pub(crate) fn run(&self, stop: &dyn Fn() -> bool) {
        loop {
            let work = {
                let mut q = self.queue.lock().unwrap();
                loop {
                    if stop() {
                        q.stopping = true;
                    }
                    if let Some(w) = q.work.pop_front() {
                        break w;
                    }
                    if q.stopping {
                        return;
                    }
                    q = self.ready.wait(q).unwrap();
                }
            };
            self.run_one(work);
        }
    }

    fn run_one(&self, work: Work) {
        let batch = match work {
            Work::Data { batch, op, done } => {
                if batch.canceled() {
                    batch.skipped();
                } else {
                    run_op(&batch, op, done, false);
                }
                batch
            }
            Work::Flush { batch, file } => {
                let f = &batch.plan.files[file as usize];
                let data = batch.durability == Durability::Data;
                let r = f.flush_with(|fd| sys::flush(fd.as_raw_fd(), data));
                if let Err(e) = r {
                    batch.flush_failed(file as usize, e);
                }
                batch
            }
        };
        if batch.finished(1) {
            match batch.end() {
                Next::Flush(n) => self.flush(&batch, n),
                Next::Report => batch.report(),
            }
        }
    }

    /// Wake every worker (to see the stop).
    pub(crate) fn wake(&self) {
        let _q = self.queue.lock().unwrap();
        self.ready.notify_all();
    }
}

/// Run operation `op` of `batch` on this thread from `done` bytes in, until all its
/// bytes moved or it failed (both told to the batch: `None`); with `nowait`
/// (`RWF_NOWAIT`), stop where the page cache would make it wait and return the bytes
/// moved so far, for an engine to go on from there.
pub(crate) fn run_op(batch: &Batch, op: u32, mut done: u32, nowait: bool) -> Option<u32> {
    let o = batch.plan.ops[op as usize];
    let fd = batch.plan.files[o.file as usize].as_fd().as_raw_fd();
    loop {
        let res = sys::transfer(
            batch.plan.op,
            fd,
            o.addr + u64::from(done),
            o.len - done,
            o.offset + u64::from(done),
            nowait,
        );
        if nowait && (res == -i64::from(libc::EAGAIN) || res == -i64::from(libc::EOPNOTSUPP)) {
            // Not in the page cache (or no RWF_NOWAIT here).
            return Some(done);
        }
        match judge(batch.plan.op, &o, done, res, batch.plan.align(&o)) {
            Outcome::Done => {
                batch.moved(u64::from(o.len - done));
                return None;
            }
            Outcome::Short(n) => {
                batch.moved(u64::from(n));
                done += n;
            }
            Outcome::Failed(why, source) => {
                batch.failed(&o, done, &why, source);
                return None;
            }
        }
    }
}
