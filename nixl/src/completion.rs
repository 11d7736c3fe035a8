//! The completion of one posted transfer: its direction and status, the state its
//! future and its backend share, the [`Completer`] a backend reports through, and the
//! agent's count of transfers in flight.
//!
//! This is the floor under backends, transfers and telemetry: it knows nothing of
//! regions, requests or agents. What a transfer keeps alive is handed in as an opaque
//! value and released before completion becomes observable.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tokio::sync::Notify;

use crate::error::{Error, ErrorKind, Result};

/// Direction of a transfer, from the initiator's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Pull remote memory into local memory.
    Read,
    /// Push local memory into remote memory.
    Write,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Read => "READ",
            Self::Write => "WRITE",
        })
    }
}

/// State of a request's latest post, queried without awaiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Never posted.
    Idle,
    /// Posted, not finished.
    InFlight,
    /// Finished successfully.
    Done,
    /// Finished with an error of this kind.
    Failed(ErrorKind),
}

/// Counts transfers in flight across an agent, so shutdown can drain them.
#[derive(Debug, Default)]
pub(crate) struct InflightCounter {
    count: AtomicUsize,
    pub(crate) zero: Notify,
}

impl InflightCounter {
    pub(crate) fn get(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

impl InflightCounter {
    /// Count one more transfer in flight until the returned guard drops.
    pub(crate) fn enter(self: &Arc<Self>) -> InflightGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        InflightGuard(self.clone())
    }
}

/// One transfer counted in flight; dropping it wakes shutdown at zero.
#[derive(Debug)]
pub(crate) struct InflightGuard(Arc<InflightCounter>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.zero.notify_waiters();
        }
    }
}

/// Memory a posted transfer uses: counted in flight from post to completion, so it is
/// neither deregistered nor freed meanwhile (a registration implements it).
pub(crate) trait InFlight: Send + Sync {
    fn enter(&self);
    fn leave(&self);
}

/// What a posted transfer keeps alive and counted until its backend reports: its
/// memory, and its place in the agent's count.
pub(crate) struct Keepalive {
    memory: Vec<Arc<dyn InFlight>>,
    _counted: InflightGuard,
}

impl Keepalive {
    pub(crate) fn new(memory: Vec<Arc<dyn InFlight>>, counter: &Arc<InflightCounter>) -> Self {
        for m in &memory {
            m.enter();
        }
        Self {
            memory,
            _counted: counter.enter(),
        }
    }
}

impl Drop for Keepalive {
    fn drop(&mut self) {
        for m in &self.memory {
            m.leave();
        }
    }
}

/// Told the outcome of a transfer before anyone can observe it (telemetry).
pub(crate) trait Observer: Send + Sync {
    fn finished(&self, result: &Result<()>);
}

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

/// Shared between a [`Transfer`](crate::Transfer) future and the backend's [`Completer`].
pub(crate) struct CompletionState {
    state: AtomicU8,
    error_kind: Mutex<Option<ErrorKind>>,
    error: Mutex<Option<Error>>,
    waker: Mutex<Option<Waker>>,
    canceled: AtomicBool,
    /// What the transfer keeps alive (its memory, its place in the agent's count),
    /// released before completion is observable.
    keepalive: Mutex<Option<Keepalive>>,
    /// Told the outcome first (the post's telemetry record).
    observer: Option<Arc<dyn Observer>>,
}

impl CompletionState {
    pub(crate) fn new(
        keepalive: Option<Keepalive>,
        observer: Option<Arc<dyn Observer>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            state: AtomicU8::new(PENDING),
            error_kind: Mutex::new(None),
            error: Mutex::new(None),
            waker: Mutex::new(None),
            canceled: AtomicBool::new(false),
            keepalive: Mutex::new(keepalive),
            observer,
        })
    }

    pub(crate) fn standalone() -> Arc<Self> {
        Self::new(None, None)
    }

    pub(crate) fn finish(&self, result: Result<()>) {
        // Release memory (and counters) before anyone can observe completion, so
        // deregistering right after `.await` works.
        drop(self.keepalive.lock().unwrap().take());
        if let Some(o) = &self.observer {
            o.finished(&result);
        }
        let state = match result {
            Ok(()) => OK,
            Err(e) => {
                *self.error_kind.lock().unwrap() = Some(e.kind());
                *self.error.lock().unwrap() = Some(e);
                FAILED
            }
        };
        self.state.store(state, Ordering::Release);
        if let Some(w) = self.waker.lock().unwrap().take() {
            w.wake();
        }
    }

    pub(crate) fn is_canceled(&self) -> bool {
        self.canceled.load(Ordering::Acquire)
    }

    /// Mark a transfer whose future was dropped unfinished as canceled.
    pub(crate) fn cancel_if_pending(&self) {
        if self.state.load(Ordering::Acquire) == PENDING {
            self.canceled.store(true, Ordering::Release);
        }
    }

    pub(crate) fn status(&self) -> Status {
        match self.state.load(Ordering::Acquire) {
            PENDING => Status::InFlight,
            OK => Status::Done,
            _ => Status::Failed(
                self.error_kind
                    .lock()
                    .unwrap()
                    .unwrap_or(ErrorKind::Backend),
            ),
        }
    }

    pub(crate) fn poll_done(&self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(r) = self.take_result() {
            return Poll::Ready(r);
        }
        *self.waker.lock().unwrap() = Some(cx.waker().clone());
        // Re-check: the backend may have finished between the first check and storing
        // the waker.
        match self.take_result() {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }

    fn take_result(&self) -> Option<Result<()>> {
        match self.state.load(Ordering::Acquire) {
            PENDING => None,
            OK => Some(Ok(())),
            _ => Some(Err(self.error.lock().unwrap().take().unwrap_or_else(
                || {
                    let kind = self
                        .error_kind
                        .lock()
                        .unwrap()
                        .unwrap_or(ErrorKind::Backend);
                    Error::new(
                        kind,
                        "transfer",
                        "the transfer failed (error already taken)",
                    )
                },
            ))),
        }
    }
}

/// How a backend reports the end of one posted transfer.
///
/// Holding it keeps the transfer's memory alive. Dropping it without calling
/// [`Completer::complete`] fails the transfer with [`ErrorKind::Canceled`], so a
/// backend that loses a request can never leave its future hanging.
pub struct Completer {
    sink: Option<Sink>,
}

/// Where a completer reports.
enum Sink {
    /// The transfer's own state.
    Whole(Arc<CompletionState>),
    /// One part of a split transfer.
    Part(Arc<Join>),
}

/// What the parts of a split completer share.
struct Join {
    /// Parts not yet completed.
    left: AtomicUsize,
    /// The first error a part reported.
    error: Mutex<Option<Error>>,
    /// The completer that was split, and what to do with it once every part is done.
    parent: Mutex<Option<(Completer, JoinThen)>>,
    /// Whether the transfer was canceled, read without the lock.
    canceled: Box<dyn Fn() -> bool + Send + Sync>,
}

type JoinThen = Box<dyn FnOnce(Completer, Result<()>) + Send>;

impl Join {
    fn part_done(&self, result: Result<()>) {
        if let Err(e) = result {
            let mut first = self.error.lock().unwrap();
            if first.is_none() {
                *first = Some(e);
            }
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last part: every other part's memory use is over.
            let result = match self.error.lock().unwrap().take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
            let parent = self.parent.lock().unwrap().take();
            if let Some((parent, then)) = parent {
                then(parent, result);
            }
        }
    }
}

impl Completer {
    pub(crate) fn new(state: Arc<CompletionState>) -> Self {
        Self {
            sink: Some(Sink::Whole(state)),
        }
    }

    /// Report the outcome. Memory is released before the awaiting task wakes.
    pub fn complete(mut self, result: Result<()>) {
        match self.sink.take() {
            Some(Sink::Whole(s)) => s.finish(result),
            Some(Sink::Part(j)) => j.part_done(result),
            None => {}
        }
    }

    /// Whether the application dropped the transfer's future; work not yet started may
    /// be skipped (then complete with [`ErrorKind::Canceled`]).
    pub fn is_canceled(&self) -> bool {
        match &self.sink {
            Some(Sink::Whole(s)) => s.is_canceled(),
            Some(Sink::Part(j)) => (j.canceled)(),
            None => false,
        }
    }

    /// Split this completer into one per part of the transfer (a backend that sends
    /// pieces over several connections or queue pairs). The transfer completes when
    /// every part has completed, with the first error a part reported, so its memory
    /// stays alive until the last part lets go. Each part follows the rules of a
    /// whole completer: dropping one unreported fails it with
    /// [`ErrorKind::Canceled`], and [`Completer::is_canceled`] reports the
    /// transfer's cancellation.
    ///
    /// `parts` of 0 completes the transfer at once (nothing to wait for).
    pub fn split(self, parts: usize) -> Vec<Self> {
        self.split_then(parts, |c, r| c.complete(r))
    }

    /// [`Completer::split`], with `then` called once every part has completed,
    /// with this completer and the combined result, on the thread that completed the
    /// last part. A backend uses it to send a notification only after every part's
    /// data has arrived, then complete. `then` must not block.
    pub fn split_then(
        self,
        parts: usize,
        then: impl FnOnce(Self, Result<()>) + Send + 'static,
    ) -> Vec<Self> {
        if parts == 0 {
            then(self, Ok(()));
            return Vec::new();
        }
        let canceled: Box<dyn Fn() -> bool + Send + Sync> = match &self.sink {
            Some(Sink::Whole(s)) => {
                let s = s.clone();
                Box::new(move || s.is_canceled())
            }
            Some(Sink::Part(j)) => {
                let j = j.clone();
                Box::new(move || (j.canceled)())
            }
            None => Box::new(|| false),
        };
        let join = Arc::new(Join {
            left: AtomicUsize::new(parts),
            error: Mutex::new(None),
            parent: Mutex::new(Some((self, Box::new(then)))),
            canceled,
        });
        (0..parts)
            .map(|_| Self {
                sink: Some(Sink::Part(join.clone())),
            })
            .collect()
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if self.sink.is_some() {
            let sink = Self {
                sink: self.sink.take(),
            };
            sink.complete(Err(Error::new(
                ErrorKind::Canceled,
                "transfer",
                "the backend dropped the request without completing it",
            )));
        }
    }
}

impl fmt::Debug for Completer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("pending", &self.sink.is_some())
            .field("part", &matches!(self.sink, Some(Sink::Part(_))))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transfer's side (here its state, which `Transfer` wraps) and the backend's.
    fn pair() -> (Arc<CompletionState>, Completer) {
        let state = CompletionState::standalone();
        (state.clone(), Completer::new(state))
    }

    fn failed(kind: ErrorKind) -> Result<()> {
        Err(Error::new(kind, "test", "a part failed"))
    }

    #[test]
    fn split_completes_after_the_last_part_with_the_first_error() {
        let (t, c) = pair();
        let mut parts = c.split(3);
        assert_eq!(parts.len(), 3);
        parts.pop().unwrap().complete(Ok(()));
        parts
            .pop()
            .unwrap()
            .complete(failed(ErrorKind::RemoteDisconnected));
        assert_eq!(t.status(), Status::InFlight, "one part is still out");
        // A part dropped unreported counts as canceled, after the first error.
        drop(parts.pop());
        assert_eq!(t.status(), Status::Failed(ErrorKind::RemoteDisconnected));

        let (t, c) = pair();
        for p in c.split(2) {
            p.complete(Ok(()));
        }
        assert_eq!(t.status(), Status::Done);

        let (t, c) = pair();
        assert!(c.split(0).is_empty());
        assert_eq!(t.status(), Status::Done, "nothing to wait for");
    }

    #[test]
    fn split_then_runs_once_with_the_parent_and_parts_see_cancellation() {
        let (t, c) = pair();
        let (tx, rx) = std::sync::mpsc::channel();
        let parts = c.split_then(2, move |parent, r| {
            tx.send(r.is_ok()).unwrap();
            parent.complete(failed(ErrorKind::Backend));
        });
        let mut nested = parts.into_iter();
        let first = nested.next().unwrap();
        let inner = nested.next().unwrap().split(2);
        assert!(!first.is_canceled() && !inner[0].is_canceled());
        t.cancel_if_pending(); // what dropping the `Transfer` does
        assert!(
            first.is_canceled() && inner[1].is_canceled(),
            "parts see the drop"
        );
        first.complete(Ok(()));
        for p in inner {
            p.complete(Ok(()));
        }
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![true]);
    }
}
