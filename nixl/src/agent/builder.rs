//! Agent options and the builder.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{random_u64, Agent, Regions, Shared};
use crate::backend::{Backend, BackendContext, NotificationSink};
use crate::completion::InflightCounter;
use crate::error::{err, ErrorKind, Result};
use crate::notification::{NotificationLimits, PeerQueues};
use crate::secret::SharedSecret;
use crate::telemetry::{AgentMetrics, TelemetryOptions};
use crate::thread::{ThreadSet, ThreadSpawner};

/// Agent-wide options.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// How long [`Agent::shutdown`] waits for in-flight transfers to finish before
    /// cancelling them.
    pub drain_timeout: Duration,
    /// One bound on the rest of [`Agent::shutdown`] after draining: exchange hooks,
    /// backends (which stop concurrently), threads, deregistration and the agent's
    /// tasks all finish within it, or are named in the report. Dropping an agent
    /// waits this long at most for its backends' threads.
    pub shutdown_timeout: Duration,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        }
    }
}

/// Options for one registration.
#[derive(Clone, Debug, Default)]
pub struct RegisterOptions {
    /// Register only with these backends (by name). Default: every attached backend
    /// that supports the memory kind.
    pub backends: Option<Vec<String>>,
}

/// Options for building a transfer request.
#[derive(Clone, Debug)]
pub struct RequestOptions {
    /// Candidate backends by name, in order of preference. Default: attach order.
    pub backends: Option<Vec<String>>,
    /// Merge descriptors that are contiguous on both sides (default `true`).
    pub merge: bool,
}

impl Default for RequestOptions {
    fn default() -> Self {
        Self {
            backends: None,
            merge: true,
        }
    }
}

/// Builds an [`Agent`].
#[derive(Debug)]
pub struct AgentBuilder {
    name: String,
    backends: Vec<Arc<dyn Backend>>,
    options: AgentOptions,
    telemetry: TelemetryOptions,
    huge_pages: bool,
    notification_limits: NotificationLimits,
    peer_limits: super::PeerLimits,
    secret: Option<SharedSecret>,
}

impl AgentBuilder {
    pub(super) fn new(name: String) -> Self {
        Self {
            name,
            backends: Vec::new(),
            options: AgentOptions::default(),
            telemetry: TelemetryOptions::default(),
            huge_pages: true,
            notification_limits: NotificationLimits::default(),
            peer_limits: super::PeerLimits::default(),
            secret: None,
        }
    }

    /// Authenticate every channel with this shared secret: the backends'
    /// connections (nixl-tcp, nixl-verbs' and nixl-uccl's control connections,
    /// nixl-ucx's messages) and the side channel use it unless their own options name
    /// one. Peers without it reach nothing; peers with it prove their agent name too,
    /// and each connection is bound to that name. Every holder can prove any name:
    /// the secret keeps out whoever lacks it, and members are trusted not to pose as
    /// each other. Unset (the default), connections are not authenticated, as in
    /// NIXL; see the README's security section for what that allows.
    #[must_use]
    pub fn secret(mut self, secret: SharedSecret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// How many notifications, and bytes of them, may be queued unread: per sender
    /// name (default 4096 and 64 MiB), in all (65,536 and 256 MiB), and from senders
    /// that are not known peers together (4096 and 16 MiB, from at most 256 names);
    /// see [`NotificationLimits`].
    #[must_use]
    pub fn notification_limits(mut self, limits: NotificationLimits) -> Self {
        self.notification_limits = limits;
        self
    }

    /// How many peers, and regions of theirs, the agent keeps (default 16,384 peers,
    /// 4,000,000 regions; fewer from unauthenticated sources); see
    /// [`PeerLimits`](super::PeerLimits).
    #[must_use]
    pub fn peer_limits(mut self, limits: super::PeerLimits) -> Self {
        self.peer_limits = limits;
        self
    }

    /// Record per-transfer telemetry and metrics (all off by default); see
    /// [`telemetry`](crate::telemetry).
    #[must_use]
    pub fn telemetry(mut self, telemetry: TelemetryOptions) -> Self {
        self.telemetry = telemetry;
        self
    }

    /// Whether [`Agent::alloc`](crate::Agent::alloc) memory that no backend provides
    /// asks for transparent huge pages ([`AlignedBuf::with_huge_pages`](crate::AlignedBuf::with_huge_pages));
    /// on by default.
    #[must_use]
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// Attach a backend. Backends are tried in attach order.
    #[must_use]
    pub fn backend(mut self, backend: impl Backend) -> Self {
        self.backends.push(Arc::new(backend));
        self
    }

    /// Attach a shared backend.
    #[must_use]
    pub fn backend_arc(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backends.push(backend);
        self
    }

    /// Set options.
    #[must_use]
    pub fn options(mut self, options: AgentOptions) -> Self {
        self.options = options;
        self
    }

    /// Start the backends and make the agent. Needs a tokio runtime.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for an empty or over-long name, two backends with
    /// one name, a notification limit of zero or an unknown names' notification pool
    /// not smaller than the total; any error a backend's start returns
    /// (the agent made so far is then dropped, which stops what the earlier backends
    /// started).
    pub async fn build(self) -> Result<Agent> {
        const OP: &str = "build agent";
        if self.name.is_empty() || self.name.len() > 256 {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                "agent name must be 1 to 256 bytes",
            );
        }
        for (i, b) in self.backends.iter().enumerate() {
            if self.backends[..i].iter().any(|o| o.name() == b.name()) {
                return err(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("backend {:?} attached twice", b.name()),
                );
            }
        }
        let limits = self.notification_limits;
        if let Some(why) = limits.invalid() {
            return err(ErrorKind::InvalidArgument, OP, why);
        }
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let metrics = self
            .telemetry
            .metrics
            .then(|| Arc::new(AgentMetrics::new(&self.name, &self.telemetry)));
        // Known peers (for the notification bounds) are the names in the peer table.
        let peers: Arc<RwLock<HashMap<String, Arc<super::Peer>>>> = Arc::default();
        let table = Arc::downgrade(&peers);
        let known = Box::new(move |name: &str| {
            table
                .upgrade()
                .is_some_and(|t| t.read().unwrap().contains_key(name))
        });
        let queues = Arc::new(PeerQueues::new(&self.name, limits, known));
        let sink = NotificationSink {
            tx,
            queues: queues.clone(),
            cancel: cancel.clone(),
            received: metrics.as_ref().map(|m| m.notifications_received.clone()),
            dropped: metrics.as_ref().map(|m| m.notifications_dropped.clone()),
        };
        let shared = Arc::new(Shared {
            name: self.name,
            instance: random_u64(),
            secret: self.secret,
            options: self.options,
            caps: self.backends.iter().map(|b| b.capabilities()).collect(),
            backends: self.backends,
            regions: RwLock::new(Regions::default()),
            next_region_id: AtomicU64::new(1),
            peer_limits: self.peer_limits,
            peers,
            loading: Mutex::new(()),
            next_generation: AtomicU64::new(1),
            running: AtomicBool::new(true),
            live: super::shutdown::LiveAgent::new(),
            shut_down: tokio::sync::watch::channel(false).0,
            cancel,
            tracker,
            threads: Arc::new(ThreadSet::default()),
            inflight: Arc::new(InflightCounter::default()),
            notifications: Arc::new(Mutex::new(Some(rx))),
            queues,
            sink,
            labels: Mutex::new(HashMap::new()),
            shutdown_hooks: Mutex::new(Vec::new()),
            telemetry: self.telemetry,
            huge_pages: self.huge_pages,
            metrics,
        });
        let agent = Agent { shared };
        for b in &agent.shared.backends {
            let cancel = agent.shared.cancel.child_token();
            let ctx = BackendContext {
                agent_name: agent.shared.name.clone(),
                secret: agent.shared.secret.clone(),
                threads: ThreadSpawner {
                    set: agent.shared.threads.clone(),
                    cancel: cancel.clone(),
                },
                cancel,
                tracker: agent.shared.tracker.clone(),
                notifications: agent.shared.sink.clone(),
            };
            b.start(ctx).await?;
            tracing::debug!(agent = %agent.shared.name, backend = b.name(), "backend started");
        }
        Ok(agent)
    }
}
