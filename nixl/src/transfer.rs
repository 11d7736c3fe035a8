//! Transfers as futures: requests, their completion state, and the [`Transfer`] future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use tokio::sync::Notify;

use crate::backend::{Completer, PreparedTransfer};
use crate::error::{err, Error, ErrorKind, Result};
use crate::region::RegionInner;
use crate::telemetry::{Probe, RequestTelemetry, TransferTelemetry};

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

/// Keeps a posted transfer's memory alive and counted until its backend reports.
struct Keepalive {
    regions: Vec<Arc<RegionInner>>,
    counter: Arc<InflightCounter>,
}

impl Keepalive {
    fn new(regions: Vec<Arc<RegionInner>>, counter: Arc<InflightCounter>) -> Self {
        for r in &regions {
            r.inflight.fetch_add(1, Ordering::AcqRel);
        }
        counter.count.fetch_add(1, Ordering::AcqRel);
        Self { regions, counter }
    }
}

impl Drop for Keepalive {
    fn drop(&mut self) {
        for r in &self.regions {
            r.inflight.fetch_sub(1, Ordering::AcqRel);
        }
        if self.counter.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.counter.zero.notify_waiters();
        }
    }
}

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

/// Shared between a [`Transfer`] future and the backend's [`Completer`].
pub(crate) struct CompletionState {
    state: AtomicU8,
    error_kind: Mutex<Option<ErrorKind>>,
    error: Mutex<Option<Error>>,
    waker: Mutex<Option<Waker>>,
    canceled: AtomicBool,
    keepalive: Mutex<Option<Keepalive>>,
    /// The post's record, with telemetry on.
    probe: Option<Probe>,
}

impl CompletionState {
    fn new(keepalive: Option<Keepalive>, probe: Option<Probe>) -> Arc<Self> {
        Arc::new(Self {
            state: AtomicU8::new(PENDING),
            error_kind: Mutex::new(None),
            error: Mutex::new(None),
            waker: Mutex::new(None),
            canceled: AtomicBool::new(false),
            keepalive: Mutex::new(keepalive),
            probe,
        })
    }

    pub(crate) fn standalone() -> Arc<Self> {
        Self::new(None, None)
    }

    pub(crate) fn finish(&self, result: Result<()>) {
        // Release memory (and counters) before anyone can observe completion, so
        // deregistering right after `.await` works.
        drop(self.keepalive.lock().unwrap().take());
        if let Some(p) = &self.probe {
            p.finish(&result);
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

    fn status(&self) -> Status {
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

    fn poll_done(&self, cx: &mut Context<'_>) -> Poll<Result<()>> {
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

/// A posted transfer (or standalone notification): await it for the outcome.
///
/// # Cancel safety
/// Dropping an unfinished `Transfer` cancels it: the backend may skip work it has not
/// started. The memory it uses stays alive (and counted as in flight) until the backend
/// reports the transfer finished or aborted, so nothing is freed while a peer or a NIC
/// may still touch it.
#[must_use = "a Transfer reports its outcome only when awaited; dropping it cancels it"]
pub struct Transfer {
    state: Arc<CompletionState>,
}

impl Transfer {
    pub(crate) fn new(state: Arc<CompletionState>) -> Self {
        Self { state }
    }

    /// Status without awaiting.
    pub fn status(&self) -> Status {
        self.state.status()
    }

    /// This post's record, when the agent records transfers
    /// ([`TelemetryOptions::transfers`](crate::TelemetryOptions::transfers)); `None`
    /// otherwise, and for standalone notifications. Await `&mut transfer` to read it
    /// after completion.
    pub fn telemetry(&self) -> Option<TransferTelemetry> {
        self.state.probe.as_ref().and_then(Probe::telemetry)
    }
}

impl Future for Transfer {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.state.poll_done(cx)
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.state.state.load(Ordering::Acquire) == PENDING {
            self.state.canceled.store(true, Ordering::Release);
        }
    }
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("status", &self.status())
            .finish()
    }
}

/// What a request needs from its agent at post time.
pub(crate) trait RequestOwner: Send + Sync {
    /// Refuse new work once shutdown started.
    fn check_running(&self, op: &'static str) -> Result<()>;
    /// The peer's current generation, or an UnknownPeer error.
    fn peer_generation(&self, peer: &str, op: &'static str) -> Result<u64>;
    fn inflight(&self) -> Arc<InflightCounter>;
    /// A post carries a notification (for the metrics).
    fn notification_sent(&self);
}

/// A transfer request: checked, prepared by one backend, ready to post (and repost).
///
/// Made by [`Agent::make_request`](crate::Agent::make_request) from prepared descriptor
/// lists, or by [`Agent::create_request`](crate::Agent::create_request) from plain lists.
/// One post may be in flight at a time; a finished request can be posted again.
pub struct XferRequest {
    pub(crate) owner: Weak<dyn RequestOwner>,
    pub(crate) op: Op,
    pub(crate) peer: Option<String>,
    pub(crate) generation: u64,
    pub(crate) backend: String,
    pub(crate) prepared: Box<dyn PreparedTransfer>,
    pub(crate) regions: Vec<Arc<RegionInner>>,
    pub(crate) bytes: u64,
    pub(crate) segments: usize,
    pub(crate) runs: usize,
    /// The serving backend's [`Capabilities::max_notification`](crate::Capabilities).
    pub(crate) max_notification: usize,
    pub(crate) last: Mutex<Option<Arc<CompletionState>>>,
    /// What each post records (`None`: telemetry off).
    pub(crate) telemetry: Option<RequestTelemetry>,
}

impl XferRequest {
    /// Post the transfer; `notif`, when set, reaches the target after the data.
    ///
    /// # Errors
    /// [`ErrorKind::ShutDown`] once the agent is shutting down or gone;
    /// [`ErrorKind::StaleGeneration`] if the peer's metadata was reloaded or forgotten
    /// since preparing ([`ErrorKind::UnknownPeer`] if it is gone);
    /// [`ErrorKind::NotFound`] if a region was deregistered;
    /// [`ErrorKind::NotAllowed`] if the previous post has not finished;
    /// [`ErrorKind::InvalidArgument`] if `notif` is longer than the backend carries
    /// ([`Capabilities::max_notification`](crate::Capabilities::max_notification)).
    pub fn post(&self, notif: Option<Bytes>) -> Result<Transfer> {
        const OP: &str = "post transfer";
        let Some(owner) = self.owner.upgrade() else {
            return err(ErrorKind::ShutDown, OP, "the agent is gone");
        };
        owner.check_running(OP)?;
        if let Some(n) = &notif {
            crate::agent::check_notification(n, self.max_notification, &self.backend, OP)?;
        }
        if let Some(peer) = &self.peer {
            let current = owner.peer_generation(peer, OP)?;
            if current != self.generation {
                return err(
                    ErrorKind::StaleGeneration,
                    OP,
                    format!(
                        "request was prepared against generation {} of peer {peer:?}, current is {current}; prepare it again",
                        self.generation
                    ),
                );
            }
        }
        if let Some(r) = self
            .regions
            .iter()
            .find(|r| !r.registered.load(Ordering::Acquire))
        {
            return err(
                ErrorKind::NotFound,
                OP,
                format!("registration {} was deregistered", r.id),
            );
        }
        let mut last = self.last.lock().unwrap();
        if last
            .as_ref()
            .is_some_and(|s| s.status() == Status::InFlight)
        {
            return err(
                ErrorKind::NotAllowed,
                OP,
                "the previous post of this request is still in flight",
            );
        }
        if notif.is_some() {
            owner.notification_sent();
        }
        let probe = self.telemetry.as_ref().map(Probe::start);
        let state = CompletionState::new(
            Some(Keepalive::new(self.regions.clone(), owner.inflight())),
            probe,
        );
        *last = Some(state.clone());
        drop(last);
        self.prepared.post(notif, Completer::new(state.clone()));
        if let Some(p) = &state.probe {
            p.posted();
        }
        Ok(Transfer::new(state))
    }

    /// The latest post's record, when the agent records transfers
    /// ([`TelemetryOptions::transfers`](crate::TelemetryOptions::transfers)); `None`
    /// otherwise or before the first post.
    pub fn telemetry(&self) -> Option<TransferTelemetry> {
        self.last
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|s| s.probe.as_ref())
            .and_then(Probe::telemetry)
    }

    /// Status of the latest post, without awaiting.
    pub fn status(&self) -> Status {
        self.last
            .lock()
            .unwrap()
            .as_ref()
            .map_or(Status::Idle, |s| s.status())
    }

    /// READ or WRITE.
    pub fn op(&self) -> Op {
        self.op
    }

    /// The peer (`None` for a local transfer).
    pub fn peer(&self) -> Option<&str> {
        self.peer.as_deref()
    }

    /// Name of the backend that serves this request.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Total bytes moved per post.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of segments after merging.
    pub fn segments(&self) -> usize {
        self.segments
    }

    /// Number of segment runs the backend got ([`Segments::runs`](crate::Segments::runs)):
    /// regularly spaced segments of a strided list count once.
    pub fn segment_runs(&self) -> usize {
        self.runs
    }
}

impl fmt::Debug for XferRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("XferRequest")
            .field("op", &self.op)
            .field("peer", &self.peer)
            .field("backend", &self.backend)
            .field("bytes", &self.bytes)
            .field("segments", &self.segments)
            .field("runs", &self.runs)
            .field("status", &self.status())
            .finish()
    }
}
