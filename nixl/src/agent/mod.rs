//! The [`Agent`]: backends, registrations, peers, transfers, notifications, teardown.
//!
//! One type, split by concern:
//! - [`builder`]: options and [`AgentBuilder`];
//! - [`registry`]: memory registration and the agent's own metadata;
//! - [`peers`]: peers' metadata, generations, connections;
//! - [`request`]: descriptor preparation and request building;
//! - [`choice`]: which backend serves a request (pure);
//! - [`segments`]: pairing and merging descriptors into backend segments (pure);
//! - [`local`]: same-agent DRAM copies, done by the agent for every backend;
//! - [`shutdown`]: teardown and its report.

mod builder;
mod choice;
mod links;
mod local;
mod peers;
mod registry;
mod request;
mod segments;
mod shutdown;

pub(crate) use peers::Trust;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{Backend, Capabilities, NotificationSink};
use crate::completion::{Completer, CompletionState, InflightCounter};
use crate::descriptor::RangeIndex;
use crate::error::{err, Error, ErrorKind, Result};
use crate::notification::{check_notification, NotificationStats, Notifications, PeerQueues, Slot};
use crate::region::{RegionInner, RemoteRegion};
use crate::telemetry::{AgentMetrics, TelemetryOptions};
use crate::thread::ThreadSet;
use crate::transfer::{PeerSlot, RequestOwner, Transfer};

pub use builder::{AgentBuilder, AgentOptions, RegisterOptions, RequestOptions};
pub use peers::PeerLimits;
pub use request::{Indices, PreparedDescs};
pub use shutdown::ShutdownReport;

/// A reference to an agent that does not keep it alive.
#[derive(Clone)]
pub(crate) struct WeakAgent(std::sync::Weak<Shared>);

impl WeakAgent {
    pub(crate) fn upgrade(&self) -> Option<Agent> {
        self.0.upgrade().map(|shared| Agent { shared })
    }
}

/// Watches an agent's tasks and threads; see [`Agent::task_monitor`].
#[derive(Clone, Debug)]
pub struct TaskMonitor {
    tracker: TaskTracker,
    threads: Arc<ThreadSet>,
}

impl TaskMonitor {
    /// Tasks still running.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    /// Whether no task is running.
    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Names of the backend OS threads still running
    /// ([`BackendContext::spawn_thread`](crate::BackendContext::spawn_thread)).
    pub fn threads(&self) -> Vec<String> {
        self.threads.names()
    }

    /// Wait until the agent is shut down or dropped and all its tasks have ended.
    pub async fn wait(&self) {
        self.tracker.wait().await
    }
}

#[derive(Default)]
struct Regions {
    index: RangeIndex<Arc<RegionInner>>,
    by_id: HashMap<u64, Arc<RegionInner>>,
}

struct Peer {
    /// Loaded from NIXL-format metadata: a NIXL agent, spoken to in NIXL's dialect.
    nixl: bool,
    /// Loaded or confirmed by a trusted source (not only by unauthenticated ones);
    /// see [`PeerLimits`].
    verified: bool,
    /// Of its regions, how many unauthenticated sources put in (all of an unverified
    /// peer's); counted against [`PeerLimits::unverified_regions`].
    charged: usize,
    instance: u64,
    generation: u64,
    /// Where posts read which generation is current.
    slot: Arc<PeerSlot>,
    /// (backend name, connection info if known).
    backends: Vec<(String, Option<Bytes>)>,
    /// The backends' links to it, by backend index.
    links: links::PeerLinks,
    regions: RangeIndex<Arc<RemoteRegion>>,
    by_id: HashMap<u64, Arc<RemoteRegion>>,
}

impl Peer {
    fn offers(&self, backend: &str) -> bool {
        self.backends
            .iter()
            .any(|(n, c)| n == backend && c.is_some())
    }
}

struct Shared {
    name: String,
    instance: u64,
    /// Authenticates every channel, where set (`AgentBuilder::secret`).
    secret: Option<crate::secret::SharedSecret>,
    options: AgentOptions,
    backends: Vec<Arc<dyn Backend>>,
    caps: Vec<Capabilities>,
    regions: RwLock<Regions>,
    next_region_id: AtomicU64,
    /// How many peers and regions of theirs are kept.
    peer_limits: PeerLimits,
    /// Known peers. Loads build the new state without this lock and swap it in;
    /// posts never take it.
    /// Shared with the notification queue, which asks whether a sender is known.
    peers: Arc<RwLock<HashMap<String, Arc<Peer>>>>,
    /// Serialises loading and forgetting peers (never taken by transfers).
    loading: Mutex<()>,
    next_generation: AtomicU64,
    running: AtomicBool,
    /// Counted among the process's live agents (see `shutdown::LiveAgent`).
    live: shutdown::LiveAgent,
    /// Set when the first `shutdown()` has finished; later calls wait for it.
    shut_down: tokio::sync::watch::Sender<bool>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    threads: Arc<ThreadSet>,
    inflight: Arc<InflightCounter>,
    notifications: Slot,
    /// Per-peer accounting of the notifications in `notifications`.
    queues: Arc<PeerQueues>,
    /// Where the agent's own (same-agent) notifications go.
    sink: NotificationSink,
    /// Labelled partial metadata served by the exchanges.
    pub(crate) labels: Mutex<HashMap<String, Bytes>>,
    /// Run by shutdown after draining, before tasks are cancelled (e.g. revoke an etcd
    /// lease while the connection still works).
    pub(crate) shutdown_hooks: Mutex<Vec<ShutdownHook>>,
    telemetry: TelemetryOptions,
    /// `Agent::alloc` memory asks for transparent huge pages.
    huge_pages: bool,
    /// Metric handles, with [`TelemetryOptions::metrics`].
    metrics: Option<Arc<AgentMetrics>>,
}

pub(crate) type ShutdownHook =
    Box<dyn FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send>;

impl Drop for Shared {
    fn drop(&mut self) {
        // Dropping the agent cancels everything it started, and joins its backends'
        // threads (bounded), whether or not a runtime is still there.
        self.running.store(false, Ordering::Release);
        self.cancel.cancel();
        self.tracker.close();
        let deadline = std::time::Instant::now() + self.options.shutdown_timeout;
        let mut left = self.threads.join_blocking(deadline);
        if let Some(reaper) = self.live.leave() {
            left.extend(reaper.join_blocking(deadline));
        }
        if !left.is_empty() {
            tracing::error!(agent = %self.name, threads = ?left, "backend threads still running after the agent was dropped");
        }
        // Without a shutdown, the rest is each backend's own Drop; destroy lets go of
        // native contexts now rather than when the last request handle goes.
        for b in &self.backends {
            if let Err(e) = b.destroy() {
                tracing::warn!(agent = %self.name, backend = b.name(), error = %e, "destroying the backend after the agent was dropped");
            }
        }
    }
}

impl RequestOwner for Shared {
    fn check_running(&self, op: &'static str) -> Result<()> {
        if self.running.load(Ordering::Acquire) {
            Ok(())
        } else {
            err(
                ErrorKind::ShutDown,
                op,
                format!("agent {:?} is shutting down", self.name),
            )
        }
    }

    fn inflight(&self) -> Arc<InflightCounter> {
        self.inflight.clone()
    }

    fn notification_sent(&self) {
        if let Some(m) = &self.metrics {
            m.notifications_sent.increment(1);
        }
    }
}

/// A named endpoint that owns backends, registrations, known peers, the notification
/// stream and every background task it starts.
///
/// Cheap to clone: clones are handles to one agent (an `Arc`), to share it between
/// tasks. [`Agent::shutdown`] through any handle stops it for all.
///
/// Dropping the last handle cancels all of its tasks and joins its backends' threads
/// (within [`AgentOptions::shutdown_timeout`]); prefer [`Agent::shutdown`], which also
/// drains in-flight transfers, releases everything in order and reports what did not
/// stop in time.
#[derive(Clone)]
pub struct Agent {
    shared: Arc<Shared>,
}

impl fmt::Debug for RegionInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Region(id {}, {:?})", self.id, self.mem)
    }
}

impl Agent {
    /// Start building an agent called `name`.
    pub fn builder(name: impl Into<String>) -> AgentBuilder {
        AgentBuilder::new(name.into())
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The secret every channel authenticates with, if set.
    pub(crate) fn secret(&self) -> Option<crate::secret::SharedSecret> {
        self.shared.secret.clone()
    }

    /// Random id of this agent instance (published in metadata; a restarted agent of
    /// the same name has another).
    pub fn instance(&self) -> u64 {
        self.shared.instance
    }

    /// Names of the attached backends, in attach order.
    pub fn backends(&self) -> Vec<String> {
        self.shared
            .backends
            .iter()
            .map(|b| b.name().to_owned())
            .collect()
    }

    /// Number of tasks the agent and its backends are running (listeners, connections).
    pub fn task_count(&self) -> usize {
        self.shared.tracker.len()
    }

    /// A child of the agent's root cancellation token, for tasks the crate starts
    /// outside backends (metadata exchange listeners, lease keepers).
    pub(crate) fn child_token(&self) -> CancellationToken {
        self.shared.cancel.child_token()
    }

    /// The agent's task tracker (every task the agent starts goes through it).
    pub(crate) fn tracker(&self) -> &TaskTracker {
        &self.shared.tracker
    }

    /// A handle that does not keep the agent alive (for the agent's own tasks).
    pub(crate) fn downgrade(&self) -> WeakAgent {
        WeakAgent(Arc::downgrade(&self.shared))
    }

    pub(crate) fn labels(&self) -> &Mutex<HashMap<String, Bytes>> {
        &self.shared.labels
    }

    /// Run `hook` during shutdown, after in-flight transfers drained and before the
    /// agent's tasks are cancelled.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn on_shutdown(&self, hook: ShutdownHook) {
        self.shared.shutdown_hooks.lock().unwrap().push(hook);
    }

    /// A handle that watches the agent's tasks and backend threads and outlives the
    /// agent: use it to check that everything the agent started has ended after
    /// shutdown or drop.
    pub fn task_monitor(&self) -> TaskMonitor {
        TaskMonitor {
            tracker: self.shared.tracker.clone(),
            threads: self.shared.threads.clone(),
        }
    }

    fn backend_index(&self, name: &str, op: &'static str) -> Result<usize> {
        self.shared
            .backends
            .iter()
            .position(|b| b.name() == name)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    op,
                    format!("no backend named {name:?} is attached"),
                )
            })
    }

    /// Backend indices in preference order: `names` resolved, or attach order.
    fn backend_order(&self, names: Option<&[String]>, op: &'static str) -> Result<Vec<usize>> {
        match names {
            Some(names) => names.iter().map(|n| self.backend_index(n, op)).collect(),
            None => Ok((0..self.shared.backends.len()).collect()),
        }
    }

    /// Send a standalone notification to a peer through the first backend both sides
    /// have that supports notifications. Await the result for delivery.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`], [`ErrorKind::NotSupported`], [`ErrorKind::ShutDown`];
    /// [`ErrorKind::InvalidArgument`] when `msg` is longer than the backend's
    /// [`Capabilities::max_notification`].
    pub fn notify(&self, peer: &str, msg: impl Into<Bytes>) -> Result<Transfer> {
        const OP: &str = "send notification";
        self.shared.check_running(OP)?;
        let p = self.peer(peer, OP)?;
        let Some((i, link)) = p
            .links
            .iter()
            .find(|&(i, _)| self.shared.caps[i].notifications)
        else {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!("no backend with notifications is shared with {peer:?}"),
            );
        };
        let msg = msg.into();
        check_notification(
            &msg,
            self.shared.caps[i].max_notification,
            self.shared.backends[i].name(),
            OP,
        )?;
        self.shared.notification_sent();
        let state = CompletionState::standalone();
        link.notify(msg, Completer::new(state.clone()));
        Ok(Transfer::new(state, None))
    }

    /// The incoming notifications. One handle at a time; dropping it hands the queue
    /// back (nothing is lost).
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] while another handle is alive.
    pub fn notifications(&self) -> Result<Notifications> {
        let rx = self.shared.notifications.lock().unwrap().take();
        match rx {
            Some(rx) => Ok(Notifications::new(
                rx,
                self.shared.notifications.clone(),
                self.shared.queues.clone(),
            )),
            None => err(
                ErrorKind::NotAllowed,
                "take notifications",
                "another Notifications handle is alive",
            ),
        }
    }

    /// What each peer has queued in the notification stream, unread, and how many
    /// notifications were dropped because their peer's queue was full; see
    /// [`NotificationLimits`](crate::NotificationLimits).
    pub fn notification_stats(&self) -> NotificationStats {
        self.shared.queues.stats()
    }

    /// Whether the agent accepts new work (false once shutdown started).
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::Acquire)
    }
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.shared.name)
            .field("backends", &self.backends())
            .field("running", &self.is_running())
            .finish_non_exhaustive()
    }
}

/// A random `u64` from the OS (agent instances, keys, nonces).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("the OS random source works");
    u64::from_le_bytes(b)
}
