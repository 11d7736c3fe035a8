//! The [`Agent`]: backends, registrations, peers, transfers, notifications, teardown.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{
    Backend, BackendContext, Capabilities, Completer, NotificationSink, Segment, Target,
    TransferPlan,
};
use crate::descriptor::{DescList, RangeIndex};
use crate::error::{err, Error, ErrorKind, Result};
use crate::memory::{AlignedBuf, MemKind, Memory};
use crate::metadata::{AgentMetadata, BackendMeta, RegionBlob, RegionMeta};
use crate::notification::{Notifications, Slot};
use crate::region::{RegionInner, RegionRef, Registration, RemoteRegion, RemoteRegionInfo};
use crate::transfer::{CompletionState, InflightCounter, Op, RequestOwner, Transfer, XferRequest};

/// Agent-wide options.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// How long [`Agent::shutdown`] waits for in-flight transfers to finish before
    /// cancelling them.
    pub drain_timeout: Duration,
    /// How long [`Agent::shutdown`] waits for each backend and for the agent's tasks.
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

/// What [`Agent::shutdown`] could not stop cleanly.
#[derive(Debug, Default)]
pub struct ShutdownReport {
    /// Transfers still in flight when the drain timeout passed (then cancelled).
    pub canceled_transfers: usize,
    /// Backends whose shutdown failed or overran, with the error.
    pub backend_errors: Vec<(String, Error)>,
    /// Agent tasks (listeners, connections, ...) still running at the deadline.
    pub tasks_left: usize,
    /// Whether this call found the agent already shut down.
    pub already_shut_down: bool,
}

impl ShutdownReport {
    /// Nothing was cancelled, failed or left running.
    pub fn is_clean(&self) -> bool {
        self.canceled_transfers == 0 && self.backend_errors.is_empty() && self.tasks_left == 0
    }
}

/// A reference to an agent that does not keep it alive.
#[derive(Clone)]
pub(crate) struct WeakAgent(std::sync::Weak<Shared>);

impl WeakAgent {
    pub(crate) fn upgrade(&self) -> Option<Agent> {
        self.0.upgrade().map(|shared| Agent { shared })
    }
}

/// Watches an agent's tasks; see [`Agent::task_monitor`].
#[derive(Clone, Debug)]
pub struct TaskMonitor(TaskTracker);

impl TaskMonitor {
    /// Tasks still running.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is running.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Wait until the agent is shut down or dropped and all its tasks have ended.
    pub async fn wait(&self) {
        self.0.wait().await
    }
}

/// Builds an [`Agent`].
#[derive(Debug)]
pub struct AgentBuilder {
    name: String,
    backends: Vec<Arc<dyn Backend>>,
    options: AgentOptions,
}

impl AgentBuilder {
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
    /// [`ErrorKind::InvalidArgument`] for an empty or over-long name or two backends with
    /// one name; any error a backend's start returns.
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
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            name: self.name,
            instance: random_u64(),
            options: self.options,
            caps: self.backends.iter().map(|b| b.capabilities()).collect(),
            backends: self.backends,
            regions: RwLock::new(Regions::default()),
            next_region_id: AtomicU64::new(1),
            peers: RwLock::new(HashMap::new()),
            next_generation: AtomicU64::new(1),
            running: AtomicBool::new(true),
            cancel,
            tracker,
            inflight: Arc::new(InflightCounter::default()),
            notifications: Arc::new(Mutex::new(Some(rx))),
            labels: Mutex::new(HashMap::new()),
            shutdown_hooks: Mutex::new(Vec::new()),
        });
        let agent = Agent { shared };
        for b in &agent.shared.backends {
            let ctx = BackendContext {
                agent_name: agent.shared.name.clone(),
                cancel: agent.shared.cancel.child_token(),
                tracker: agent.shared.tracker.clone(),
                notifications: NotificationSink { tx: tx.clone() },
            };
            b.start(ctx).await?;
            tracing::debug!(agent = %agent.shared.name, backend = b.name(), "backend started");
        }
        Ok(agent)
    }
}

#[derive(Default)]
struct Regions {
    index: RangeIndex<Arc<RegionInner>>,
    by_id: HashMap<u64, Arc<RegionInner>>,
}

struct Peer {
    instance: u64,
    generation: u64,
    /// (backend name, connection info if known).
    backends: Vec<(String, Option<Bytes>)>,
    regions: RangeIndex<Arc<RemoteRegion>>,
    by_id: HashMap<u64, Arc<RemoteRegion>>,
}

struct Shared {
    name: String,
    instance: u64,
    options: AgentOptions,
    backends: Vec<Arc<dyn Backend>>,
    caps: Vec<Capabilities>,
    regions: RwLock<Regions>,
    next_region_id: AtomicU64,
    peers: RwLock<HashMap<String, Arc<Peer>>>,
    next_generation: AtomicU64,
    running: AtomicBool,
    cancel: CancellationToken,
    tracker: TaskTracker,
    inflight: Arc<InflightCounter>,
    notifications: Slot,
    /// Labelled partial metadata served by the exchanges.
    pub(crate) labels: Mutex<HashMap<String, Bytes>>,
    /// Run by shutdown after draining, before tasks are cancelled (e.g. revoke an etcd
    /// lease while the connection still works).
    pub(crate) shutdown_hooks: Mutex<Vec<ShutdownHook>>,
}

pub(crate) type ShutdownHook =
    Box<dyn FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send>;

impl Drop for Shared {
    fn drop(&mut self) {
        // Dropping the agent cancels everything it started.
        self.running.store(false, Ordering::Release);
        self.cancel.cancel();
        self.tracker.close();
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

    fn peer_generation(&self, peer: &str, op: &'static str) -> Result<u64> {
        match self.peers.read().unwrap().get(peer) {
            Some(p) => Ok(p.generation),
            None => err(
                ErrorKind::UnknownPeer,
                op,
                format!("peer {peer:?} is not loaded (forgotten?)"),
            ),
        }
    }

    fn inflight(&self) -> Arc<InflightCounter> {
        self.inflight.clone()
    }
}

/// A named endpoint that owns backends, registrations, known peers, the notification
/// stream and every background task it starts.
///
/// Dropping the agent cancels all of its tasks; prefer [`Agent::shutdown`], which also
/// drains in-flight transfers and reports what did not stop in time.
pub struct Agent {
    shared: Arc<Shared>,
}

/// Descriptor lists checked once, to build many requests from by index.
#[derive(Debug)]
pub struct PreparedDescs {
    side: Side,
    kind: MemKind,
    entries: Vec<Resolved>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Side {
    Local,
    Remote { peer: String, generation: u64 },
}

#[derive(Debug, Clone)]
enum Resolved {
    Local {
        region: Arc<RegionInner>,
        offset: u64,
        len: u64,
    },
    Remote {
        region: Arc<RemoteRegion>,
        offset: u64,
        len: u64,
    },
}

impl fmt::Debug for RegionInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Region(id {}, {:?})", self.id, self.mem)
    }
}

impl Resolved {
    fn len(&self) -> u64 {
        match self {
            Self::Local { len, .. } | Self::Remote { len, .. } => *len,
        }
    }
}

impl PreparedDescs {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The peer these descriptors belong to (`None` for local memory).
    pub fn peer(&self) -> Option<&str> {
        match &self.side {
            Side::Local => None,
            Side::Remote { peer, .. } => Some(peer),
        }
    }
}

impl Agent {
    /// Start building an agent called `name`.
    pub fn builder(name: impl Into<String>) -> AgentBuilder {
        AgentBuilder {
            name: name.into(),
            backends: Vec::new(),
            options: AgentOptions::default(),
        }
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
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

    /// A handle that watches the agent's tasks and outlives the agent: use it to check
    /// that everything the agent started has ended after shutdown or drop.
    pub fn task_monitor(&self) -> TaskMonitor {
        TaskMonitor(self.shared.tracker.clone())
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

    /// Zero-filled host memory of `len` bytes, from the first attached backend (in
    /// attach order) that offers memory it reaches faster than ordinary memory
    /// ([`Backend::alloc`]; nixl-ucx's shared memory, for example), else an
    /// [`AlignedBuf`]. Register it as usual; it works with every backend.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroLength`] for `len == 0`; the backend's error when its
    /// allocation fails (no silent fallback: the caller asked for the fast path).
    pub fn alloc(&self, len: usize) -> Result<Memory> {
        const OP: &str = "allocate memory";
        self.shared.check_running(OP)?;
        if len == 0 {
            return err(ErrorKind::ZeroLength, OP, "cannot allocate zero bytes");
        }
        for b in &self.shared.backends {
            if let Some(m) = b.alloc(len) {
                return m;
            }
        }
        Ok(AlignedBuf::new(len).into())
    }

    /// Register memory with every attached backend that supports its kind.
    ///
    /// The agent takes ownership of the memory and keeps it alive while any
    /// [`Registration`] handle or in-flight transfer uses it.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroLength`] for empty memory; [`ErrorKind::NotSupported`] when no
    /// backend supports the memory kind; [`ErrorKind::InvalidArgument`] when it overlaps
    /// an existing registration; backend errors.
    pub fn register(&self, memory: impl Into<Memory>) -> Result<Registration> {
        self.register_with(memory, &RegisterOptions::default())
    }

    /// Register memory with options (for example, only some backends).
    ///
    /// # Errors
    /// As [`Agent::register`], and [`ErrorKind::NotFound`] for an unknown backend name.
    pub fn register_with(
        &self,
        memory: impl Into<Memory>,
        options: &RegisterOptions,
    ) -> Result<Registration> {
        const OP: &str = "register memory";
        self.shared.check_running(OP)?;
        let mem = memory.into();
        if mem.is_empty() {
            return err(ErrorKind::ZeroLength, OP, "cannot register zero bytes");
        }
        let kind = mem.kind();
        let chosen: Vec<usize> = match &options.backends {
            Some(names) => names
                .iter()
                .map(|n| self.backend_index(n, OP))
                .collect::<Result<_>>()?,
            None => (0..self.shared.backends.len()).collect(),
        };
        let chosen: Vec<usize> = chosen
            .into_iter()
            .filter(|&i| self.shared.caps[i].supports(kind))
            .collect();
        if chosen.is_empty() {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "no attached backend supports {kind} memory (backends: {:?})",
                    self.backends()
                ),
            );
        }
        let region = Arc::new(RegionInner {
            id: self.shared.next_region_id.fetch_add(1, Ordering::Relaxed),
            mem,
            inflight: Default::default(),
            registered: AtomicBool::new(true),
            backends: Mutex::new(Vec::new()),
        });
        {
            let mut regions = self.shared.regions.write().unwrap();
            regions.index.insert(region.clone(), OP)?;
            regions.by_id.insert(region.id, region.clone());
        }
        let rref = RegionRef {
            inner: region.clone(),
        };
        for i in chosen {
            match self.shared.backends[i].register(&rref) {
                Ok(blob) => region.backends.lock().unwrap().push((i, blob)),
                Err(e) => {
                    self.unregister_region(&region);
                    return Err(e);
                }
            }
        }
        tracing::debug!(agent = %self.shared.name, id = region.id, len = region.mem.len(), %kind, "registered memory");
        Ok(Registration { inner: region })
    }

    fn unregister_region(&self, region: &Arc<RegionInner>) {
        region.registered.store(false, Ordering::Release);
        {
            let mut regions = self.shared.regions.write().unwrap();
            regions.index.remove(region.mem.kind(), region.mem.addr());
            regions.by_id.remove(&region.id);
        }
        let bs = std::mem::take(&mut *region.backends.lock().unwrap());
        for (i, _) in bs {
            self.shared.backends[i].deregister(region.id);
        }
    }

    /// Deregister memory. Peers can no longer reach it; the memory is freed once no
    /// handle is left.
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] (and nothing changes) while posted transfers that use it
    /// have not finished, including dropped ones the backend has not yet aborted: await
    /// them, then retry. [`ErrorKind::NotFound`] if it is not registered with this agent.
    pub fn deregister(&self, registration: &Registration) -> Result<()> {
        const OP: &str = "deregister memory";
        let region = &registration.inner;
        let known = self
            .shared
            .regions
            .read()
            .unwrap()
            .by_id
            .get(&region.id)
            .is_some_and(|r| Arc::ptr_eq(r, region));
        if !known {
            return err(
                ErrorKind::NotFound,
                OP,
                format!(
                    "registration {} is not registered with agent {:?}",
                    region.id, self.shared.name
                ),
            );
        }
        let n = region.inflight.load(Ordering::Acquire);
        if n > 0 {
            return err(
                ErrorKind::NotAllowed,
                OP,
                format!(
                    "registration {} is used by {n} transfer(s) in flight; await them and retry",
                    region.id
                ),
            );
        }
        self.unregister_region(region);
        Ok(())
    }

    fn build_metadata(
        &self,
        regions: Vec<Arc<RegionInner>>,
        partial: bool,
        with_conn: bool,
    ) -> Result<Bytes> {
        let backends = self
            .shared
            .backends
            .iter()
            .map(|b| BackendMeta {
                name: b.name().to_owned(),
                conn_info: with_conn.then(|| b.connection_info().to_vec()),
            })
            .collect();
        let regions = regions
            .iter()
            .map(|r| RegionMeta {
                id: r.id,
                kind: r.mem.kind(),
                addr: r.mem.addr(),
                len: r.mem.len() as u64,
                blobs: r
                    .backends
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(i, blob)| RegionBlob {
                        backend: *i as u16,
                        blob: blob.to_vec(),
                    })
                    .collect(),
            })
            .collect();
        let md = AgentMetadata {
            name: self.shared.name.clone(),
            instance: self.shared.instance,
            partial,
            backends,
            regions,
        };
        Ok(Bytes::from(md.encode()?))
    }

    /// This agent's full metadata: connection info of every backend and every
    /// registration. Give it to peers ([`Agent::load_metadata`]).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] if it would exceed the format's limits.
    pub fn metadata(&self) -> Result<Bytes> {
        let mut regions: Vec<_> = self
            .shared
            .regions
            .read()
            .unwrap()
            .by_id
            .values()
            .cloned()
            .collect();
        regions.sort_by_key(|r| r.id);
        self.build_metadata(regions, false, true)
    }

    /// Partial metadata: only `registrations`, with or without connection info.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] if one of them is not registered here.
    pub fn partial_metadata(
        &self,
        registrations: &[Registration],
        with_conn_info: bool,
    ) -> Result<Bytes> {
        let regions = self.shared.regions.read().unwrap();
        let mut picked = Vec::with_capacity(registrations.len());
        for r in registrations {
            match regions.by_id.get(&r.id()) {
                Some(x) if Arc::ptr_eq(x, &r.inner) => picked.push(x.clone()),
                _ => {
                    return err(
                        ErrorKind::NotFound,
                        "partial metadata",
                        format!("registration {} is not registered here", r.id()),
                    )
                }
            }
        }
        drop(regions);
        self.build_metadata(picked, true, with_conn_info)
    }

    /// Load a peer's metadata (full or partial); returns the peer's name.
    ///
    /// Full metadata replaces what was known and starts a new generation: requests
    /// prepared against the older copy are refused from then on. Partial metadata adds
    /// or replaces regions of a known peer (same instance) and keeps the generation.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`]/[`ErrorKind::NotSupported`] for bad bytes;
    /// [`ErrorKind::InvalidArgument`] for this agent's own metadata;
    /// [`ErrorKind::UnknownPeer`] for partial metadata of a peer never loaded (without
    /// connection info); [`ErrorKind::Mismatch`] for partial metadata of another instance.
    pub fn load_metadata(&self, bytes: &[u8]) -> Result<String> {
        const OP: &str = "load metadata";
        self.shared.check_running(OP)?;
        let md = AgentMetadata::decode(bytes)?;
        if md.name == self.shared.name {
            return err(ErrorKind::InvalidArgument, OP, "this is the agent's own metadata; use the agent's own name as peer for local transfers");
        }
        let mut peers = self.shared.peers.write().unwrap();
        let old = peers.get(&md.name).cloned();
        let base = match (&old, md.partial) {
            (Some(p), true) if p.instance == md.instance => Some(p.clone()),
            (Some(_), true) => {
                return err(ErrorKind::Mismatch, OP, format!("partial metadata of peer {:?} comes from another instance; load its full metadata first", md.name));
            }
            (None, true) if md.backends.iter().all(|b| b.conn_info.is_none()) => {
                return err(
                    ErrorKind::UnknownPeer,
                    OP,
                    format!(
                        "partial metadata without connection info for unknown peer {:?}",
                        md.name
                    ),
                );
            }
            _ => None,
        };
        let mut regions = RangeIndex::default();
        let mut by_id = HashMap::new();
        let mut backends: Vec<(String, Option<Bytes>)> = Vec::new();
        if let Some(b) = &base {
            for r in b.by_id.values() {
                if !md.regions.iter().any(|n| n.id == r.id) {
                    regions.insert(r.clone(), OP)?;
                    by_id.insert(r.id, r.clone());
                }
            }
            backends = b.backends.clone();
        }
        for bm in &md.backends {
            let conn = bm.conn_info.clone().map(Bytes::from);
            match backends.iter_mut().find(|(n, _)| *n == bm.name) {
                Some(slot) => {
                    if conn.is_some() {
                        slot.1 = conn;
                    }
                }
                None => backends.push((bm.name.clone(), conn)),
            }
        }
        for rm in &md.regions {
            let region = Arc::new(RemoteRegion {
                id: rm.id,
                kind: rm.kind,
                addr: rm.addr,
                len: rm.len,
                blobs: rm
                    .blobs
                    .iter()
                    .map(|b| {
                        (
                            md.backends[b.backend as usize].name.clone(),
                            Bytes::from(b.blob.clone()),
                        )
                    })
                    .collect(),
            });
            regions.insert(region.clone(), OP).map_err(|e| {
                Error::new(
                    ErrorKind::Corrupt,
                    OP,
                    format!("peer {:?}: {}", md.name, e.context()),
                )
            })?;
            by_id.insert(rm.id, region);
        }
        // A peer restarted under the same name: drop connections to the old instance.
        if let Some(o) = &old {
            if o.instance != md.instance {
                for b in &self.shared.backends {
                    b.remove_peer(&md.name);
                }
            }
        }
        for bm in md.backends.iter().filter(|b| b.conn_info.is_some()) {
            if let Some(b) = self.shared.backends.iter().find(|b| b.name() == bm.name) {
                b.add_peer(&md.name, bm.conn_info.as_deref().unwrap_or_default())?;
            }
        }
        let generation = match &base {
            Some(b) => b.generation,
            None => self.shared.next_generation.fetch_add(1, Ordering::Relaxed),
        };
        peers.insert(
            md.name.clone(),
            Arc::new(Peer {
                instance: md.instance,
                generation,
                backends,
                regions,
                by_id,
            }),
        );
        tracing::debug!(agent = %self.shared.name, peer = %md.name, generation, partial = md.partial, regions = md.regions.len(), "loaded peer metadata");
        Ok(md.name)
    }

    /// Forget a peer: its connections close, its in-flight transfers fail, and requests
    /// prepared for it are refused.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`] if it is not known.
    pub fn forget_peer(&self, peer: &str) -> Result<()> {
        if self.shared.peers.write().unwrap().remove(peer).is_none() {
            return err(
                ErrorKind::UnknownPeer,
                "forget peer",
                format!("peer {peer:?} is not known"),
            );
        }
        for b in &self.shared.backends {
            b.remove_peer(peer);
        }
        Ok(())
    }

    /// Names of known peers.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<_> = self.shared.peers.read().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

    /// Regions a peer advertised, sorted by id.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`].
    pub fn remote_regions(&self, peer: &str) -> Result<Vec<RemoteRegionInfo>> {
        let p = self.peer(peer, "list remote regions")?;
        let mut v: Vec<_> = p
            .by_id
            .values()
            .map(|r| RemoteRegionInfo {
                id: r.id,
                kind: r.kind,
                addr: r.addr,
                len: r.len,
            })
            .collect();
        v.sort_by_key(|r| r.id);
        Ok(v)
    }

    fn peer(&self, peer: &str, op: &'static str) -> Result<Arc<Peer>> {
        self.shared
            .peers
            .read()
            .unwrap()
            .get(peer)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::UnknownPeer,
                    op,
                    format!("peer {peer:?} is not loaded"),
                )
            })
    }

    /// Connect to a loaded peer now with every backend both sides have, instead of at
    /// the first transfer.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`]; the first backend's connection error.
    pub async fn connect(&self, peer: &str) -> Result<()> {
        let p = self.peer(peer, "connect")?;
        for b in &self.shared.backends {
            if p.backends.iter().any(|(n, c)| n == b.name() && c.is_some()) {
                b.connect(peer).await?;
            }
        }
        Ok(())
    }

    /// Check a local descriptor list once.
    ///
    /// # Errors
    /// Per descriptor: [`ErrorKind::ZeroLength`], [`ErrorKind::OutOfRange`],
    /// [`ErrorKind::SpansRegions`], [`ErrorKind::Mismatch`].
    pub fn prep_local(&self, descs: &DescList) -> Result<PreparedDescs> {
        const OP: &str = "prepare local descriptors";
        self.shared.check_running(OP)?;
        let regions = self.shared.regions.read().unwrap();
        let entries = descs
            .descs()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let (region, offset) = regions
                    .index
                    .lookup(descs.kind(), d, OP, || format!("local descriptor {i}"))?;
                Ok(Resolved::Local {
                    region,
                    offset,
                    len: d.len,
                })
            })
            .collect::<Result<_>>()?;
        Ok(PreparedDescs {
            side: Side::Local,
            kind: descs.kind(),
            entries,
        })
    }

    /// Check a peer's descriptor list once against what the peer advertised. Using this
    /// agent's own name checks against local registrations (for local transfers).
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`], and per descriptor as [`Agent::prep_local`].
    pub fn prep_remote(&self, peer: &str, descs: &DescList) -> Result<PreparedDescs> {
        const OP: &str = "prepare remote descriptors";
        if peer == self.shared.name {
            return self.prep_local(descs);
        }
        self.shared.check_running(OP)?;
        let p = self.peer(peer, OP)?;
        let entries = descs
            .descs()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let (region, offset) = p.regions.lookup(descs.kind(), d, OP, || {
                    format!("remote descriptor {i} of {peer:?}")
                })?;
                Ok(Resolved::Remote {
                    region,
                    offset,
                    len: d.len,
                })
            })
            .collect::<Result<_>>()?;
        Ok(PreparedDescs {
            side: Side::Remote {
                peer: peer.to_owned(),
                generation: p.generation,
            },
            kind: descs.kind(),
            entries,
        })
    }

    /// Build a request from prepared lists, pairing `local_idx[i]` with `remote_idx[i]`.
    ///
    /// # Errors
    /// [`ErrorKind::LengthMismatch`] (index lists differ in length, or paired descriptors
    /// in size); [`ErrorKind::NotFound`] (index out of bounds, deregistered region);
    /// [`ErrorKind::InvalidArgument`] (empty, or `local` is not a local list);
    /// [`ErrorKind::StaleGeneration`]; [`ErrorKind::NotSupported`] (no backend can serve
    /// it); backend errors.
    pub fn make_request(
        &self,
        op: Op,
        local: &PreparedDescs,
        local_idx: &[usize],
        remote: &PreparedDescs,
        remote_idx: &[usize],
        options: &RequestOptions,
    ) -> Result<XferRequest> {
        const OP: &str = "make transfer request";
        self.shared.check_running(OP)?;
        if local.side != Side::Local {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                "the local list was prepared for a peer",
            );
        }
        if local_idx.len() != remote_idx.len() {
            return err(
                ErrorKind::LengthMismatch,
                OP,
                format!(
                    "{} local vs {} remote descriptors",
                    local_idx.len(),
                    remote_idx.len()
                ),
            );
        }
        if local_idx.is_empty() {
            return err(ErrorKind::InvalidArgument, OP, "no descriptors");
        }
        let peer = match &remote.side {
            Side::Local => None,
            Side::Remote { peer, generation } => {
                let current = self.shared.peer_generation(peer, OP)?;
                if current != *generation {
                    return err(ErrorKind::StaleGeneration, OP, format!("remote descriptors were prepared against generation {generation} of {peer:?}, current is {current}"));
                }
                Some(self.peer(peer, OP)?)
            }
        };
        fn pick<'a>(list: &'a PreparedDescs, idx: usize, which: &str) -> Result<&'a Resolved> {
            list.entries.get(idx).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    OP,
                    format!(
                        "{which} index {idx} out of bounds ({} descriptors)",
                        list.entries.len()
                    ),
                )
            })
        }
        let mut pairs = Vec::with_capacity(local_idx.len());
        for (&li, &ri) in local_idx.iter().zip(remote_idx) {
            let l = pick(local, li, "local")?;
            let r = pick(remote, ri, "remote")?;
            if l.len() != r.len() {
                return err(
                    ErrorKind::LengthMismatch,
                    OP,
                    format!(
                        "local descriptor {li} has {} bytes, remote descriptor {ri} has {}",
                        l.len(),
                        r.len()
                    ),
                );
            }
            pairs.push((l, r));
        }
        // Regions this request keeps alive while in flight.
        let mut keep: Vec<Arc<RegionInner>> = Vec::new();
        for (l, r) in &pairs {
            for x in [l, r] {
                if let Resolved::Local { region, .. } = x {
                    if !region.registered.load(Ordering::Acquire) {
                        return err(
                            ErrorKind::NotFound,
                            OP,
                            format!("registration {} was deregistered", region.id),
                        );
                    }
                    if !keep.iter().any(|k| Arc::ptr_eq(k, region)) {
                        keep.push(region.clone());
                    }
                }
            }
        }
        let backend = self.choose_backend(
            peer.as_deref(),
            remote.kind,
            local.kind,
            &pairs,
            &keep,
            options,
        )?;
        let bname = self.shared.backends[backend].name().to_owned();
        let segments = build_segments(&pairs, &bname, options.merge);
        let bytes = segments.iter().map(|s| s.local.len() as u64).sum();
        let nseg = segments.len();
        let peer_name = match &remote.side {
            Side::Local => None,
            Side::Remote { peer, .. } => Some(peer.clone()),
        };
        let generation = peer.as_ref().map_or(0, |p| p.generation);
        let prepared = self.shared.backends[backend].prepare(TransferPlan {
            op,
            peer: peer_name.clone(),
            segments,
        })?;
        let owner: Arc<dyn RequestOwner> = self.shared.clone();
        Ok(XferRequest {
            owner: Arc::downgrade(&owner),
            op,
            peer: peer_name,
            generation,
            backend: bname,
            prepared,
            regions: keep,
            bytes,
            segments: nseg,
            last: Mutex::new(None),
        })
    }

    fn choose_backend(
        &self,
        peer: Option<&Peer>,
        remote_kind: MemKind,
        local_kind: MemKind,
        pairs: &[(&Resolved, &Resolved)],
        local_regions: &[Arc<RegionInner>],
        options: &RequestOptions,
    ) -> Result<usize> {
        const OP: &str = "choose backend";
        let order: Vec<usize> = match &options.backends {
            Some(names) => names
                .iter()
                .map(|n| self.backend_index(n, OP))
                .collect::<Result<_>>()?,
            None => (0..self.shared.backends.len()).collect(),
        };
        let mut reasons = Vec::new();
        for i in order {
            let caps = self.shared.caps[i];
            let name = self.shared.backends[i].name();
            let why = if peer.is_none() && !caps.local {
                Some("no local transfers")
            } else if peer.is_some() && !caps.remote {
                Some("no remote transfers")
            } else if !caps.supports(local_kind) || !caps.supports(remote_kind) {
                Some("memory kind not supported")
            } else if !local_regions.iter().all(|r| r.registered_with(i)) {
                Some("a local region is not registered with it")
            } else if let Some(p) = peer {
                if !p.backends.iter().any(|(n, c)| n == name && c.is_some()) {
                    Some("the peer does not offer it")
                } else if !pairs.iter().all(|(_, r)| match r {
                    Resolved::Remote { region, .. } => region.blob(name).is_some(),
                    Resolved::Local { .. } => true,
                }) {
                    Some("a remote region is not registered with it at the peer")
                } else {
                    None
                }
            } else {
                None
            };
            match why {
                None => return Ok(i),
                Some(w) => reasons.push(format!("{name}: {w}")),
            }
        }
        err(
            ErrorKind::NotSupported,
            OP,
            format!(
                "no backend can serve this transfer ({})",
                reasons.join("; ")
            ),
        )
    }

    /// Build a request from plain descriptor lists (checks them, then prepares). `peer`
    /// may be this agent's own name for a local transfer.
    ///
    /// # Errors
    /// As [`Agent::prep_local`], [`Agent::prep_remote`] and [`Agent::make_request`];
    /// [`ErrorKind::LengthMismatch`] when the lists differ in length.
    pub fn create_request(
        &self,
        op: Op,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        options: &RequestOptions,
    ) -> Result<XferRequest> {
        if local.len() != remote.len() {
            return err(
                ErrorKind::LengthMismatch,
                "create transfer request",
                format!(
                    "{} local vs {} remote descriptors",
                    local.len(),
                    remote.len()
                ),
            );
        }
        let l = self.prep_local(local)?;
        let r = self.prep_remote(peer, remote)?;
        let idx: Vec<usize> = (0..local.len()).collect();
        self.make_request(op, &l, &idx, &r, &idx, options)
    }

    /// One-shot transfer: check, prepare and post. Await the returned future.
    ///
    /// # Errors
    /// As [`Agent::create_request`] and [`XferRequest::post`].
    pub fn transfer(
        &self,
        op: Op,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<Bytes>,
    ) -> Result<Transfer> {
        self.create_request(op, local, peer, remote, &RequestOptions::default())?
            .post(notif)
    }

    /// One-shot WRITE of `local` into the peer's `remote`; awaits completion.
    ///
    /// # Errors
    /// As [`Agent::transfer`], and the transfer's outcome.
    pub async fn write(
        &self,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<Bytes>,
    ) -> Result<()> {
        self.transfer(Op::Write, local, peer, remote, notif)?.await
    }

    /// One-shot READ of the peer's `remote` into `local`; awaits completion.
    ///
    /// # Errors
    /// As [`Agent::transfer`], and the transfer's outcome.
    pub async fn read(
        &self,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<Bytes>,
    ) -> Result<()> {
        self.transfer(Op::Read, local, peer, remote, notif)?.await
    }

    /// Send a standalone notification to a peer through the first backend both sides
    /// have that supports notifications. Await the result for delivery.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`], [`ErrorKind::NotSupported`], [`ErrorKind::ShutDown`].
    pub fn notify(&self, peer: &str, msg: impl Into<Bytes>) -> Result<Transfer> {
        const OP: &str = "send notification";
        self.shared.check_running(OP)?;
        let p = self.peer(peer, OP)?;
        let Some(b) = self.shared.backends.iter().enumerate().find(|(i, b)| {
            self.shared.caps[*i].notifications
                && p.backends.iter().any(|(n, c)| n == b.name() && c.is_some())
        }) else {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!("no backend with notifications is shared with {peer:?}"),
            );
        };
        let state = CompletionState::standalone();
        b.1.notify(peer, msg.into(), Completer::new(state.clone()));
        Ok(Transfer::new(state))
    }

    /// The incoming notifications. One handle at a time; dropping it hands the queue
    /// back (nothing is lost).
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] while another handle is alive.
    pub fn notifications(&self) -> Result<Notifications> {
        let rx = self.shared.notifications.lock().unwrap().take();
        match rx {
            Some(rx) => Ok(Notifications::new(rx, self.shared.notifications.clone())),
            None => err(
                ErrorKind::NotAllowed,
                "take notifications",
                "another Notifications handle is alive",
            ),
        }
    }

    /// Whether the agent accepts new work (false once shutdown started).
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::Acquire)
    }

    /// Stop, in order: refuse new work; drain in-flight transfers (up to the drain
    /// timeout, then cancel them); stop listeners and close connections; deregister all
    /// memory; wait for every task (up to the shutdown timeout). Returns what did not
    /// stop cleanly. Calling it again is harmless.
    pub async fn shutdown(&self) -> ShutdownReport {
        let s = &self.shared;
        let mut report = ShutdownReport::default();
        if !s.running.swap(false, Ordering::AcqRel) {
            report.already_shut_down = true;
            return report;
        }
        // Drain.
        let drain = async {
            loop {
                let notified = s.inflight.zero.notified();
                if s.inflight.get() == 0 {
                    break;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(s.options.drain_timeout, drain)
            .await
            .is_err()
        {
            report.canceled_transfers = s.inflight.get();
            tracing::warn!(agent = %s.name, n = report.canceled_transfers, "transfers still in flight after the drain timeout; cancelling");
        }
        // Exchange hooks (revoke leases, ...) while connections still work.
        let hooks = std::mem::take(&mut *s.shutdown_hooks.lock().unwrap());
        for hook in hooks {
            if tokio::time::timeout(s.options.shutdown_timeout, hook())
                .await
                .is_err()
            {
                report.backend_errors.push((
                    "exchange".to_owned(),
                    Error::new(
                        ErrorKind::TimedOut,
                        "shutdown exchange",
                        "a shutdown hook overran",
                    ),
                ));
            }
        }
        // Stop listeners and tasks, close connections, drop backend state.
        s.cancel.cancel();
        for b in &s.backends {
            match tokio::time::timeout(
                s.options.shutdown_timeout,
                b.shutdown(s.options.shutdown_timeout),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => report.backend_errors.push((b.name().to_owned(), e)),
                Err(_) => report.backend_errors.push((
                    b.name().to_owned(),
                    Error::new(
                        ErrorKind::TimedOut,
                        "shutdown backend",
                        format!("did not stop within {:?}", s.options.shutdown_timeout),
                    ),
                )),
            }
        }
        s.peers.write().unwrap().clear();
        // Deregister memory.
        let regions: Vec<_> = s.regions.read().unwrap().by_id.values().cloned().collect();
        for r in &regions {
            self.unregister_region(r);
        }
        s.tracker.close();
        if tokio::time::timeout(s.options.shutdown_timeout, s.tracker.wait())
            .await
            .is_err()
        {
            report.tasks_left = s.tracker.len();
            tracing::warn!(agent = %s.name, tasks = report.tasks_left, "tasks still running after the shutdown timeout");
        }
        report
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

/// Turn checked pairs into backend segments, merging neighbours that are contiguous in
/// the same region on both sides.
fn build_segments(pairs: &[(&Resolved, &Resolved)], backend: &str, merge: bool) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::with_capacity(pairs.len());
    // (local region id, local end offset, target region id, target end offset) of the last segment.
    let mut last: Option<(u64, u64, u64, u64)> = None;
    for (l, r) in pairs {
        let Resolved::Local {
            region: lr,
            offset: lo,
            len,
        } = l
        else {
            unreachable!("local side is always local")
        };
        let (rid, ro) = match r {
            Resolved::Local { region, offset, .. } => (region.id, *offset),
            Resolved::Remote { region, offset, .. } => (region.id, *offset),
        };
        if merge {
            if let (Some((a, ae, b, be)), Some(seg)) = (last, out.last_mut()) {
                if a == lr.id && ae == *lo && b == rid && be == ro {
                    let new_len = seg.local.len() + *len as usize;
                    let start = seg.local.addr() - lr.mem.addr();
                    seg.local = lr
                        .mem
                        .segment()
                        .slice(start as usize, new_len)
                        .expect("checked range");
                    seg.target = match (&seg.target, r) {
                        (Target::Local(t), Resolved::Local { region, .. }) => {
                            let ts = t.addr() - region.mem.addr();
                            Target::Local(
                                region
                                    .mem
                                    .segment()
                                    .slice(ts as usize, new_len)
                                    .expect("checked range"),
                            )
                        }
                        (
                            Target::Remote {
                                addr, region, blob, ..
                            },
                            _,
                        ) => Target::Remote {
                            addr: *addr,
                            len: new_len as u64,
                            region: *region,
                            blob: blob.clone(),
                        },
                        (t, _) => t.clone(),
                    };
                    last = Some((a, ae + len, b, be + len));
                    continue;
                }
            }
        }
        let local = lr
            .mem
            .segment()
            .slice(*lo as usize, *len as usize)
            .expect("checked range");
        let target = match r {
            Resolved::Local {
                region,
                offset,
                len,
            } => Target::Local(
                region
                    .mem
                    .segment()
                    .slice(*offset as usize, *len as usize)
                    .expect("checked range"),
            ),
            Resolved::Remote {
                region,
                offset,
                len,
            } => Target::Remote {
                addr: region.addr + offset,
                len: *len,
                region: region.id,
                blob: region.blob(backend).cloned().unwrap_or_default(),
            },
        };
        out.push(Segment { local, target });
        last = Some((lr.id, lo + len, rid, ro + len));
    }
    out
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("the OS random source works");
    u64::from_le_bytes(b)
}
