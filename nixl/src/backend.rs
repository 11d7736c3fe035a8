//! The object-safe [`Backend`] trait and what the agent hands to backends.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemKind, MemSegment, Memory};
use crate::notification::Notification;
use crate::region::RegionRef;
use crate::transfer::{CompletionState, Op};

/// What a backend can do, as plain data. The agent and the conformance suite choose
/// backends by capabilities, never by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Transfers between two regions of the same agent.
    pub local: bool,
    /// Transfers to and from other agents.
    pub remote: bool,
    /// Notifications (with transfers and standalone).
    pub notifications: bool,
    /// Host memory.
    pub dram: bool,
    /// GPU memory.
    pub vram: bool,
    /// The target itself checks every incoming request against its registrations and
    /// refuses forged keys and out-of-range access (two-sided transports such as TCP).
    /// One-sided RDMA transports cannot: there, only the initiator's checks and the
    /// NIC's key and bounds checks stand between a peer and registered memory.
    pub target_checks: bool,
}

impl Capabilities {
    /// Whether memory of `kind` is supported.
    pub fn supports(&self, kind: MemKind) -> bool {
        match kind {
            MemKind::Dram => self.dram,
            MemKind::Vram { .. } => self.vram,
        }
    }
}

/// Where incoming notifications go. Backends call [`NotificationSink::deliver`] once the
/// data of the transfer that carried the notification is visible in local memory.
#[derive(Clone, Debug)]
pub struct NotificationSink {
    pub(crate) tx: mpsc::UnboundedSender<Notification>,
}

impl NotificationSink {
    /// Deliver a notification from `peer`. Dropped silently once the agent is gone.
    pub fn deliver(&self, peer: &str, msg: Bytes) {
        let _ = self.tx.send(Notification {
            peer: peer.to_owned(),
            msg,
        });
    }
}

/// What the agent gives a backend when attaching it.
#[derive(Clone, Debug)]
pub struct BackendContext {
    /// The agent's name (backends announce it to peers).
    pub agent_name: String,
    /// Cancelled when the agent shuts down or is dropped; every task the backend starts
    /// must end soon after.
    pub cancel: CancellationToken,
    /// Start every task through this tracker, so shutdown can wait for it.
    pub tracker: TaskTracker,
    /// Incoming notifications.
    pub notifications: NotificationSink,
}

impl BackendContext {
    /// Spawn a task through the tracker that ends when `cancel` fires.
    pub fn spawn<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let token = self.cancel.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                _ = token.cancelled() => {}
                _ = fut => {}
            }
        });
    }
}

/// The remote (or second local) side of one transfer segment.
#[derive(Clone, Debug)]
pub enum Target {
    /// Another region of this agent (local transfers).
    Local(MemSegment),
    /// A region of a peer.
    Remote {
        /// Start address in the peer's address space.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// The peer's registration id.
        region: u64,
        /// The peer's public blob for this backend (e.g. a key).
        blob: Bytes,
    },
}

/// One contiguous piece of a transfer: `local.len()` bytes between `local` and `target`.
#[derive(Clone, Debug)]
pub struct Segment {
    /// Local memory (source of a WRITE, destination of a READ).
    pub local: MemSegment,
    /// The other side.
    pub target: Target,
}

/// A fully checked transfer, handed to [`Backend::prepare`].
#[derive(Debug)]
pub struct TransferPlan {
    /// READ or WRITE.
    pub op: Op,
    /// The peer, or `None` for a local transfer.
    pub peer: Option<String>,
    /// Segments, already merged where contiguous.
    pub segments: Vec<Segment>,
}

/// A backend's prepared transfer: everything resolved, ready to post many times.
pub trait PreparedTransfer: Send + Sync + fmt::Debug {
    /// Start the transfer. The backend reports the outcome through `done` (dropping it
    /// unreported fails the transfer with [`ErrorKind::Canceled`]). If `notif` is set,
    /// the target receives it only after the data is visible there.
    ///
    /// Must not block, and should not allocate per segment.
    fn post(&self, notif: Option<Bytes>, done: Completer);
}

/// A backend: one transport.
///
/// Object-safe; held as `Arc<dyn Backend>`. Setup calls may be async; the hot path is
/// [`Backend::prepare`] once, then [`PreparedTransfer::post`] many times.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Short name, published in metadata; peers match backends by it (`"tcp"`).
    fn name(&self) -> &str;

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Called once when attached to an agent: start listeners and progress tasks here,
    /// through the context's tracker.
    async fn start(&self, ctx: BackendContext) -> Result<()>;

    /// Connection info for metadata (what a peer's instance of this backend needs).
    fn connection_info(&self) -> Bytes;

    /// Register a region; returns the public blob peers need to reach it.
    fn register(&self, region: &RegionRef) -> Result<Bytes>;

    /// Forget a region: incoming requests for it are refused from now on.
    fn deregister(&self, region_id: u64);

    /// Allocate host memory this backend reaches faster than ordinary memory (for
    /// example shared memory a peer on the same host maps directly), for
    /// [`Agent::alloc`](crate::Agent::alloc). `None` (the default): no such memory.
    fn alloc(&self, len: usize) -> Option<Result<Memory>> {
        let _ = len;
        None
    }

    /// Learn (or update) a peer's connection info. Connecting may be lazy.
    fn add_peer(&self, peer: &str, conn_info: &[u8]) -> Result<()>;

    /// Connect to a known peer now, rather than at the first transfer.
    async fn connect(&self, peer: &str) -> Result<()>;

    /// Forget a peer: close its connections; its in-flight transfers fail.
    fn remove_peer(&self, peer: &str);

    /// Resolve a checked transfer once, for posting many times.
    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>>;

    /// Send a standalone notification; report through `done`.
    fn notify(&self, peer: &str, msg: Bytes, done: Completer);

    /// Stop: fail in-flight work, stop listeners, close connections, drop registrations.
    /// Must return within `timeout`.
    async fn shutdown(&self, timeout: Duration) -> Result<()>;
}

/// How a backend reports the end of one posted transfer.
///
/// Holding it keeps the transfer's memory alive. Dropping it without calling
/// [`Completer::complete`] fails the transfer with [`ErrorKind::Canceled`], so a
/// backend that loses a request can never leave its future hanging.
pub struct Completer {
    state: Option<Arc<CompletionState>>,
}

impl Completer {
    pub(crate) fn new(state: Arc<CompletionState>) -> Self {
        Self { state: Some(state) }
    }

    /// Report the outcome. Memory is released before the awaiting task wakes.
    pub fn complete(mut self, result: Result<()>) {
        if let Some(s) = self.state.take() {
            s.finish(result);
        }
    }

    /// Whether the application dropped the transfer's future; work not yet started may
    /// be skipped (then complete with [`ErrorKind::Canceled`]).
    pub fn is_canceled(&self) -> bool {
        self.state.as_ref().is_some_and(|s| s.is_canceled())
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if let Some(s) = self.state.take() {
            s.finish(Err(Error::new(
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
            .field("pending", &self.state.is_some())
            .finish()
    }
}
