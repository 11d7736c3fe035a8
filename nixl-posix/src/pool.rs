//! The thread-pool engine, for kernels or sandboxes without io_uring: worker threads
//! (owned by the agent's thread service) take operations from one queue and run
//! them as `pread`/`pwrite` (then `fsync`/`fdatasync` for a durable WRITE).
//!
//! Audited `unsafe`: every read or write names host memory the transfer's
//! [`nixl::Completer`] keeps registered until its last operation finished (a batch
//! reports only after every operation it handed out came back).
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};

use crate::batch::{Batch, Next};
use crate::plan::{judge, Outcome};
use crate::Durability;

#[derive(Debug)]
enum Work {
    Data { batch: Arc<Batch>, op: u32 },
    Flush { batch: Arc<Batch>, file: u32 },
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
    /// Queue every operation of `batch`.
    pub(crate) fn post(&self, batch: Arc<Batch>) {
        let mut q = self.queue.lock().unwrap();
        if q.stopping {
            drop(q);
            return batch.refuse(crate::shut_down());
        }
        let n = batch.plan.ops.len();
        q.work.extend((0..n).map(|op| Work::Data {
            batch: batch.clone(),
            op: op as u32,
        }));
        drop(q);
        if n == 1 {
            self.ready.notify_one();
        } else {
            self.ready.notify_all();
        }
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
            Work::Data { batch, op } => {
                if batch.canceled() {
                    batch.skipped();
                } else {
                    data(&batch, op);
                }
                batch
            }
            Work::Flush { batch, file } => {
                let f = &batch.plan.files[file as usize];
                let r = match batch.durability {
                    Durability::Data => rustix_like::fdatasync(f.as_fd().as_raw_fd()),
                    _ => rustix_like::fsync(f.as_fd().as_raw_fd()),
                };
                if let Err(e) = r {
                    batch.flush_failed(file as usize, e);
                }
                batch
            }
        };
        if batch.finished(1) {
            match batch.end() {
                Next::Flush(n) => {
                    let mut q = self.queue.lock().unwrap();
                    q.work.extend((0..n).map(|file| Work::Flush {
                        batch: batch.clone(),
                        file: file as u32,
                    }));
                    drop(q);
                    self.ready.notify_all();
                }
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

/// Run operation `op` of `batch` to its end: all bytes, or a failure.
fn data(batch: &Batch, op: u32) {
    let o = batch.plan.ops[op as usize];
    let fd = batch.plan.files[o.file as usize].as_fd().as_raw_fd();
    let mut done = 0u32;
    loop {
        let (addr, len, off) = (
            (o.addr + u64::from(done)) as usize,
            (o.len - done) as usize,
            (o.offset + u64::from(done)) as libc::off_t,
        );
        let res = match batch.plan.op {
            // SAFETY: `addr..addr+len` is host memory of a registration the batch's
            // completer keeps registered until the batch reports (after this returns);
            // `fd` is the registration's own descriptor, open while the plan lives.
            nixl::Op::Write => unsafe { libc::pwrite(fd, addr as *const libc::c_void, len, off) },
            // SAFETY: as above; the kernel writes the range, no Rust reference to it
            // exists.
            nixl::Op::Read => unsafe { libc::pread(fd, addr as *mut libc::c_void, len, off) },
        };
        let res = if res < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            -i64::from(e.raw_os_error().unwrap_or(libc::EIO))
        } else {
            res as i64
        };
        match judge(batch.plan.op, &o, done, res) {
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

/// `fsync`/`fdatasync`, as `io::Result`.
mod rustix_like {
    pub(super) fn fsync(fd: i32) -> std::io::Result<()> {
        // SAFETY: `fd` is an open descriptor (the registration's own); fsync takes no
        // memory.
        check(unsafe { libc::fsync(fd) })
    }

    pub(super) fn fdatasync(fd: i32) -> std::io::Result<()> {
        // SAFETY: as above.
        check(unsafe { libc::fdatasync(fd) })
    }

    fn check(r: i32) -> std::io::Result<()> {
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}
