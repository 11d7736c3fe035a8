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
    pub(crate) fn submit(&self, batch: &Arc<Batch>, ops: &[(u32, u32)]) {
        let mut q = self.queue.lock().unwrap();
        if q.stopping {
            drop(q);
            return batch.refuse(crate::shut_down());
        }
        q.work.extend(ops.iter().map(|&(op, done)| Work::Data {
            batch: batch.clone(),
            op,
            done,
        }));
        drop(q);
        if ops.len() == 1 {
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
                    data(&batch, op, done);
                }
                batch
            }
            Work::Flush { batch, file } => {
                let f = &batch.plan.files[file as usize];
                let r = sys::flush(f.as_fd().as_raw_fd(), batch.durability == Durability::Data);
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

/// Run operation `op` of `batch` to its end (from `done` bytes in): all bytes, or a
/// failure.
pub(crate) fn data(batch: &Batch, op: u32, mut done: u32) {
    let o = batch.plan.ops[op as usize];
    let fd = batch.plan.files[o.file as usize].as_fd().as_raw_fd();
    loop {
        let res = sys::transfer(
            batch.plan.op,
            fd,
            o.addr + u64::from(done),
            o.len - done,
            o.offset + u64::from(done),
            false,
        );
        match judge(batch.plan.op, &o, done, res, batch.plan.align(&o)) {
            Outcome::Done => {
                batch.moved(u64::from(o.len - done));
                return;
            }
            Outcome::Short(n) => {
                batch.moved(u64::from(n));
                done += n;
            }
            Outcome::Failed(why, source) => return batch.failed(&o, done, &why, source),
        }
    }
}
