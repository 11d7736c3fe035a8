//! One posted storage transfer: its operations' outcomes counted to the end, then
//! (for a durable WRITE) the flushes, then the one report to its [`Completer`].
//!
//! The transfer completes only once every operation that was submitted has finished,
//! failed ones included: until then the kernel may still read or write its memory,
//! which the completer keeps registered.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nixl::{Completer, Error, ErrorKind, Op};

use crate::plan::{IoOp, Plan};
use crate::Durability;

const OP: &str = "storage transfer";

/// The state of one posted storage transfer, shared by the engine's completions.
#[derive(Debug)]
pub(crate) struct Batch {
    pub(crate) plan: Arc<Plan>,
    pub(crate) durability: Durability,
    done: Mutex<Option<Completer>>,
    /// Operations (then flushes) not yet finished.
    remaining: AtomicUsize,
    moved: AtomicU64,
    /// The first failure: its segment and what it says.
    failure: Mutex<Option<(u32, Error)>>,
    /// The flushes were started (what finishes now are flushes).
    flushing: std::sync::atomic::AtomicBool,
    /// Each file's count of failed flushes before this transfer wrote to it (see
    /// [`nixl::file::FileHandle::flush_failures`]).
    failures_before: Vec<u64>,
}

/// What comes after the last operation finished.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Flush these files (indices into the plan's files), then call
    /// [`Batch::flushed`] once per file.
    Flush(usize),
    /// Report it ([`Batch::report`]), outside any lock of the engine's.
    Report,
}

impl Batch {
    pub(crate) fn new(plan: Arc<Plan>, durability: Durability, done: Completer) -> Arc<Self> {
        Arc::new(Self {
            remaining: AtomicUsize::new(plan.ops.len()),
            failures_before: plan.files.iter().map(|f| f.flush_failures()).collect(),
            plan,
            durability,
            done: Mutex::new(Some(done)),
            moved: AtomicU64::new(0),
            failure: Mutex::new(None),
            flushing: Default::default(),
        })
    }

    /// Whether the application dropped the transfer (operations not yet submitted
    /// may be skipped with [`Batch::skipped`]).
    pub(crate) fn canceled(&self) -> bool {
        self.done
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(Completer::is_canceled)
    }

    /// `n` more bytes are in place.
    pub(crate) fn moved(&self, n: u64) {
        self.moved.fetch_add(n, Ordering::Relaxed);
    }

    /// Operation `op` failed after `done` of its bytes moved.
    pub(crate) fn failed(&self, op: &IoOp, done: u32, why: &str, source: Option<std::io::Error>) {
        let f = &self.plan.files[op.file as usize];
        let dir = match self.plan.op {
            Op::Read => "READ from",
            Op::Write => "WRITE to",
        };
        let mut e = Error::new(
            ErrorKind::Io,
            OP,
            format!(
                "segment {} ({dir} {} at offset {}, {} bytes): {why}",
                op.segment,
                f.describe(),
                op.offset + u64::from(done),
                op.len - done
            ),
        );
        if let Some(s) = source {
            e = e.with_source(s);
        }
        self.record(op.segment, e);
    }

    /// Flushing file `file` failed.
    pub(crate) fn flush_failed(&self, file: usize, source: std::io::Error) {
        let f = &self.plan.files[file];
        let e = Error::new(
            ErrorKind::Io,
            OP,
            format!("flushing {} to its device: {source}", f.describe()),
        )
        .with_source(source);
        self.record(u32::MAX, e);
    }

    /// An operation was never submitted: the transfer was canceled first.
    pub(crate) fn skipped(&self) {
        self.record(
            u32::MAX,
            Error::new(
                ErrorKind::Canceled,
                OP,
                "the transfer was dropped before all of it was submitted",
            ),
        );
    }

    /// An operation (or flush) was never submitted: the backend is stopping.
    pub(crate) fn stopped(&self) {
        self.record(u32::MAX, crate::shut_down());
    }

    fn record(&self, segment: u32, e: Error) {
        let mut f = self.failure.lock().unwrap();
        // Keep the failure of the earliest segment: the one a reader looks for first.
        if f.as_ref().is_none_or(|(s, _)| segment < *s) {
            *f = Some((segment, e));
        }
    }

    /// `n` operations (or flushes) finished, however they ended; `true` when they
    /// were the last: the caller then calls [`Batch::end`].
    pub(crate) fn finished(&self, n: usize) -> bool {
        self.remaining.fetch_sub(n, Ordering::AcqRel) == n
    }

    /// After the last operation: flush (a durable WRITE that fully succeeded) or
    /// report.
    pub(crate) fn end(&self) -> Next {
        let ok = self.failure.lock().unwrap().is_none();
        if ok
            && self.plan.op == Op::Write
            && self.durability != Durability::None
            && !self.flushing.swap(true, Ordering::AcqRel)
        {
            let n = self.plan.files.len();
            self.remaining.store(n, Ordering::Release);
            return Next::Flush(n);
        }
        Next::Report
    }

    /// Fail the transfer: nothing of it is with the kernel or a worker (what ran
    /// inline finished, the rest was never handed out). Keeps an earlier failure
    /// and the count of bytes moved.
    pub(crate) fn refuse(&self, e: Error) {
        self.record(u32::MAX, e);
        self.report();
    }

    /// Report the outcome to the completer (once).
    pub(crate) fn report(&self) {
        let Some(done) = self.done.lock().unwrap().take() else {
            return;
        };
        if self.flushing.load(Ordering::Acquire) && self.failure.lock().unwrap().is_none() {
            // Our flushes succeeded, but another one of the same file failed since
            // our data was written: Linux told that flush, not ours, and our pages
            // may be among those lost.
            let moved = (self.plan.files.iter().zip(&self.failures_before))
                .find(|(f, before)| f.flush_failures() > **before);
            if let Some((f, _)) = moved {
                self.record(
                    u32::MAX,
                    Error::new(
                        ErrorKind::Io,
                        OP,
                        format!(
                            "another flush of {} failed after this transfer's data was written (Linux reports a lost write to one flush only): this data may not be on the device; write it again",
                            f.describe()
                        ),
                    ),
                );
            }
        }
        let result = match self.failure.lock().unwrap().take() {
            None => Ok(()),
            Some((_, e)) if e.kind() == ErrorKind::Canceled => Err(e),
            Some((_, e)) => {
                let moved = self.moved.load(Ordering::Acquire);
                let context = format!(
                    "{}; {moved} of the transfer's {} bytes moved",
                    e.context(),
                    self.plan.bytes
                );
                let mut out = Error::new(e.kind(), e.operation(), context);
                if let Some(s) = std::error::Error::source(&e) {
                    if let Some(io) = s.downcast_ref::<std::io::Error>() {
                        out = out.with_source(clone_io(io));
                    }
                }
                Err(out)
            }
        };
        done.complete(result);
    }
}

fn clone_io(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}
