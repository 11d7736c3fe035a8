//! Transfers as futures: requests, their completion state, and the [`Transfer`] future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use bytes::Bytes;

use crate::backend::PreparedTransfer;
use crate::completion::{
    Completer, CompletionState, InFlight, InflightCounter, Keepalive, Observer, Op, Status,
};
use crate::error::{err, ErrorKind, Result};
use crate::notification::check_notification;
use crate::region::RegionInner;
use crate::telemetry::{Probe, RequestTelemetry, TransferTelemetry};

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
    /// The post's record, with telemetry on.
    probe: Option<Arc<Probe>>,
}

impl Transfer {
    pub(crate) fn new(state: Arc<CompletionState>, probe: Option<Arc<Probe>>) -> Self {
        Self { state, probe }
    }

    /// Status without awaiting.
    pub fn status(&self) -> Status {
        self.state.status()
    }

    /// Await the outcome for at most `timeout`: past it, the transfer is canceled (as
    /// dropping it does) and this returns [`ErrorKind::TimedOut`]. For a peer that
    /// stalls without disconnecting (a target that stops answering), whose transfers
    /// would otherwise wait for as long as the connection lives.
    ///
    /// As with a dropped transfer, its memory stays counted in flight until the
    /// backend reports the transfer finished or aborted.
    ///
    /// # Errors
    /// The transfer's own error, or [`ErrorKind::TimedOut`].
    pub async fn timeout(mut self, timeout: std::time::Duration) -> Result<()> {
        match tokio::time::timeout(timeout, &mut self).await {
            Ok(r) => r,
            Err(_) => {
                drop(self);
                err(
                    ErrorKind::TimedOut,
                    "transfer",
                    format!("not finished within {timeout:?}; canceled"),
                )
            }
        }
    }

    /// This post's record, when the agent records transfers
    /// ([`TelemetryOptions::transfers`](crate::TelemetryOptions::transfers)); `None`
    /// otherwise, and for standalone notifications. Await `&mut transfer` to read it
    /// after completion.
    pub fn telemetry(&self) -> Option<TransferTelemetry> {
        self.probe.as_deref().and_then(Probe::telemetry)
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
        self.state.cancel_if_pending();
    }
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("status", &self.status())
            .finish()
    }
}

/// One post of a request: its completion state and, with telemetry on, its record.
pub(crate) type Posted = (Arc<CompletionState>, Option<Arc<Probe>>);

/// Which generation of a peer's metadata is current, read by posts without any
/// agent-wide lock. One per loaded peer, kept across the loads that extend or replace
/// its metadata; a forgotten peer's is retired for good (0).
#[derive(Debug)]
pub(crate) struct PeerSlot {
    current: AtomicU64,
}

impl PeerSlot {
    pub(crate) fn new(generation: u64) -> Arc<Self> {
        Arc::new(Self {
            current: AtomicU64::new(generation),
        })
    }

    /// Newer metadata of the same peer is in place.
    pub(crate) fn set(&self, generation: u64) {
        self.current.store(generation, Ordering::Release);
    }

    /// The peer was forgotten: requests prepared for it are refused from now on,
    /// even if it is loaded again.
    pub(crate) fn retire(&self) {
        self.current.store(0, Ordering::Release);
    }

    /// Whether a request prepared against `generation` may still be posted.
    pub(crate) fn check(&self, peer: &str, generation: u64, op: &'static str) -> Result<()> {
        match self.current.load(Ordering::Acquire) {
            0 => err(
                ErrorKind::UnknownPeer,
                op,
                format!("peer {peer:?} was forgotten since the request was made; make it again"),
            ),
            current if current != generation => err(
                ErrorKind::StaleGeneration,
                op,
                format!(
                    "request was prepared against generation {generation} of peer {peer:?}, current is {current}; prepare it again"
                ),
            ),
            _ => Ok(()),
        }
    }
}

/// What a request needs from its agent at post time.
pub(crate) trait RequestOwner: Send + Sync {
    /// Refuse new work once shutdown started.
    fn check_running(&self, op: &'static str) -> Result<()>;
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
    /// The peer's slot and the generation the request was prepared against.
    pub(crate) generation: Option<(Arc<PeerSlot>, u64)>,
    pub(crate) backend: String,
    pub(crate) prepared: Box<dyn PreparedTransfer>,
    pub(crate) regions: Vec<Arc<RegionInner>>,
    pub(crate) bytes: u64,
    pub(crate) segments: usize,
    pub(crate) runs: usize,
    /// The serving backend's [`Capabilities::max_notification`](crate::Capabilities).
    pub(crate) max_notification: usize,
    /// The latest post: its state and, with telemetry on, its record.
    pub(crate) last: Mutex<Option<Posted>>,
    /// What each post records (`None`: telemetry off).
    pub(crate) telemetry: Option<RequestTelemetry>,
}

impl XferRequest {
    /// Post the transfer; `notif`, when set, reaches the target after the data.
    ///
    /// # Errors
    /// [`ErrorKind::ShutDown`] once the agent is shutting down or gone;
    /// [`ErrorKind::StaleGeneration`] if the peer's full metadata was reloaded since
    /// preparing ([`ErrorKind::UnknownPeer`] if it was forgotten since, even if loaded
    /// again);
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
            check_notification(n, self.max_notification, &self.backend, OP)?;
        }
        if let (Some(peer), Some((slot, generation))) = (&self.peer, &self.generation) {
            slot.check(peer, *generation, OP)?;
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
            .is_some_and(|(s, _)| s.status() == Status::InFlight)
        {
            return err(
                ErrorKind::NotAllowed,
                OP,
                "the previous post of this request is still in flight",
            );
        }
        let memory = self.regions.iter().map(|r| r.clone() as Arc<dyn InFlight>);
        let keepalive = Keepalive::new(memory.collect(), &owner.inflight());
        // Counted in flight first, then through each region's gate: a deregistration
        // deciding at the same time either sees this count (and refuses) or closed the
        // gate first (and this post refuses). The `registered` check above alone
        // leaves a window between it and the count.
        if let Some(r) = self.regions.iter().find(|r| r.gate.enter().is_none()) {
            drop(keepalive);
            return err(
                ErrorKind::NotFound,
                OP,
                format!("registration {} was deregistered", r.id),
            );
        }
        if notif.is_some() {
            owner.notification_sent();
        }
        let probe = self.telemetry.as_ref().map(|t| Arc::new(Probe::start(t)));
        let state = CompletionState::new(
            Some(keepalive),
            probe.clone().map(|p| p as Arc<dyn Observer>),
        );
        *last = Some((state.clone(), probe.clone()));
        drop(last);
        self.prepared.post(notif, Completer::new(state.clone()));
        if let Some(p) = &probe {
            p.posted();
        }
        Ok(Transfer::new(state, probe))
    }

    /// The latest post's record, when the agent records transfers
    /// ([`TelemetryOptions::transfers`](crate::TelemetryOptions::transfers)); `None`
    /// otherwise or before the first post.
    pub fn telemetry(&self) -> Option<TransferTelemetry> {
        self.last
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|(_, p)| p.as_deref())
            .and_then(Probe::telemetry)
    }

    /// Status of the latest post, without awaiting.
    pub fn status(&self) -> Status {
        self.last
            .lock()
            .unwrap()
            .as_ref()
            .map_or(Status::Idle, |(s, _)| s.status())
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
