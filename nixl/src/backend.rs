//! The object-safe [`Backend`] trait and what the agent hands to backends.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::completion::{Completer, Op};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemKind, Memory};
use crate::notification::{Notification, PeerQueues, Queued, Short};
#[cfg(doc)]
use crate::notification::{NotificationLimits, NotificationStats};
use crate::peer_link::{LinkedPeer, PeerLink};
use crate::region::{RegionRef, RegionSlice};
use crate::thread::ThreadSpawner;

/// What a backend can do, as plain data. The agent and the conformance suite choose
/// backends by capabilities, never by name.
///
/// The agent enforces the limits before anything reaches the backend: a request with
/// more segment runs than [`Capabilities::max_segments`] (after merging) goes to
/// another backend or is refused when it is made ([`ErrorKind::NotSupported`]), a
/// notification longer than [`Capabilities::max_notification`] when it is posted
/// ([`ErrorKind::InvalidArgument`]). Backends need not re-check.
///
/// `Default` is a backend that can do nothing, with no limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Transfers between two regions of the same agent in memory other than DRAM
    /// (the agent itself copies between DRAM regions, whatever the backend).
    pub local: bool,
    /// Transfers to and from other agents.
    pub remote: bool,
    /// Notifications (with transfers and standalone).
    pub notifications: bool,
    /// Host memory.
    pub dram: bool,
    /// GPU memory.
    pub vram: bool,
    /// Registered files ([`MemKind::File`]): storage transfers between the agent's
    /// memory and its files (a local transfer whose second list is files).
    pub file: bool,
    /// The target itself checks every incoming request against its registrations and
    /// refuses forged keys and out-of-range access (two-sided transports such as TCP).
    /// One-sided RDMA transports cannot: there, only the initiator's checks and the
    /// NIC's key and bounds checks stand between a peer and registered memory.
    pub target_checks: bool,
    /// Most segment runs ([`Segments::runs`]) one request may carry after merging
    /// (`usize::MAX`: no limit). A run of regularly spaced segments counts once: a
    /// backend that expands runs into one entry per segment sets its own limit
    /// accordingly in [`Backend::prepare`].
    pub max_segments: usize,
    /// Longest notification, in bytes, a transfer or a standalone notification may
    /// carry (`usize::MAX`: no limit).
    pub max_notification: usize,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            local: false,
            remote: false,
            notifications: false,
            dram: false,
            vram: false,
            file: false,
            target_checks: false,
            max_segments: usize::MAX,
            max_notification: usize::MAX,
        }
    }
}

impl Capabilities {
    /// A transport between agents: host and GPU memory, with notifications of at
    /// most `max_notification` bytes, no limit on segment runs, no checks at the
    /// target (one-sided). Backends start from this and say where they differ.
    pub const fn between_agents(max_notification: usize) -> Self {
        Self {
            local: false,
            remote: true,
            notifications: true,
            dram: true,
            vram: true,
            file: false,
            target_checks: false,
            max_segments: usize::MAX,
            max_notification,
        }
    }

    /// Whether memory of `kind` is supported.
    pub fn supports(&self, kind: MemKind) -> bool {
        match kind {
            MemKind::Dram => self.dram,
            MemKind::Vram { .. } => self.vram,
            MemKind::File { .. } => self.file,
        }
    }
}

/// Where incoming notifications go. Backends deliver each notification once the data
/// of the transfer that carried it is visible in local memory, under the name its
/// sender gave (the name its connection proved, with a shared secret).
///
/// The agent's queue is bounded per sender name, in all, and for names that are not
/// known peers together ([`NotificationLimits`]). How a backend delivers decides what
/// a notification that finds no room meets:
/// - [`NotificationSink::deliver_async`] (from a task: nixl-tcp, nixl-uccl, and
///   nixl-verbs for a receive that found no room) waits for room; the backend stops
///   reading that sender's connection meanwhile, so the sender is held back and no
///   other. Nothing is dropped.
/// - [`NotificationSink::try_deliver`] queues it if there is room and otherwise hands
///   it back, for a backend that waits elsewhere (nixl-verbs: the receive buffer is
///   not posted again until a task delivered it, so the sender's NIC waits).
/// - [`NotificationSink::deliver`], for threads that cannot wait (nixl-ucx's progress
///   loop), drops it: counted ([`NotificationStats::dropped`], the
///   `nixl_notifications_dropped_total` metric), logged, and reported as `false`, so
///   the backend can tell the sender where its protocol allows.
#[derive(Clone, Debug)]
pub struct NotificationSink {
    pub(crate) tx: mpsc::UnboundedSender<Queued>,
    pub(crate) queues: Arc<PeerQueues>,
    /// The agent's root token: waiting for room ends when the agent stops.
    pub(crate) cancel: CancellationToken,
    /// Counts notifications queued, with metrics on.
    pub(crate) received: Option<metrics::Counter>,
    /// Counts notifications dropped for want of room, with metrics on.
    pub(crate) dropped: Option<metrics::Counter>,
}

impl NotificationSink {
    /// Deliver a notification from `peer` without waiting; returns whether it was
    /// queued. When a bound it counts against is full ([`NotificationLimits`]), the
    /// notification is dropped: counted ([`NotificationStats::dropped`], the
    /// `nixl_notifications_dropped_total` metric), a warning naming the peer is
    /// logged (at most one a second), and `false` returned, so the backend can tell
    /// the sender. Prefer [`NotificationSink::deliver_async`] wherever the caller can
    /// wait. Also dropped (uncounted, `true`) once the agent is gone.
    pub fn deliver(&self, peer: &str, msg: Bytes) -> bool {
        match self.queues.admit(peer, msg.len()) {
            Ok(known) => {
                self.send(peer, msg, known);
                true
            }
            Err(short) => {
                if let Some(c) = &self.dropped {
                    c.increment(1);
                }
                self.queues.dropped(peer, msg.len(), short);
                false
            }
        }
    }

    /// Have `f` called each time the application reads one of this agent's
    /// notifications (room may have freed), from the reading thread: for a backend
    /// that holds notifications for want of room and sleeps where it cannot await
    /// [`NotificationSink::deliver_async`] (a progress loop on an event fd). `f` must
    /// be cheap and must not block (it runs under a lock of the agent's queue).
    pub fn on_room(&self, f: impl Fn() + Send + Sync + 'static) {
        self.queues.on_room.lock().unwrap().push(Box::new(f));
    }

    /// Drop a notification from `peer` that this backend held for want of room and can
    /// hold no longer (its own bound on what it holds is full): counted and logged as
    /// [`NotificationSink::deliver`] counts a drop. For a backend that keeps a
    /// sender's notifications in order behind those it holds, where delivering this
    /// one now would overtake them.
    pub fn drop_unqueued(&self, peer: &str, len: usize) {
        if let Some(c) = &self.dropped {
            c.increment(1);
        }
        self.queues
            .dropped(peer, len, crate::notification::Short::Peer);
    }

    /// Deliver a notification from `peer` if every bound it counts against has room
    /// ([`NotificationLimits`]); otherwise hand it back, uncounted, for the caller to
    /// deliver later with [`NotificationSink::deliver_async`] (keeping its sender
    /// waiting meanwhile).
    ///
    /// # Errors
    /// The notification itself, when there is no room for it now.
    pub fn try_deliver(&self, peer: &str, msg: Bytes) -> std::result::Result<(), Bytes> {
        match self.queues.admit(peer, msg.len()) {
            Ok(known) => {
                self.send(peer, msg, known);
                Ok(())
            }
            Err(_) => Err(msg),
        }
    }

    /// Deliver a notification from `peer`, first waiting until every bound it counts
    /// against has room ([`NotificationLimits`]): its sender's own queue, the
    /// agent's total and, for a sender that is not a known peer, the unknown names'
    /// pool. Others' deliveries do not wait for it unless they share the full bound.
    /// Room comes as the application reads notifications.
    ///
    /// # Errors
    /// [`ErrorKind::ShutDown`] when the agent stopped or went away while this waited:
    /// the notification was not delivered (a backend should not acknowledge it).
    ///
    /// # Cancel safety
    /// Dropping the future before it returns drops the notification, undelivered.
    pub async fn deliver_async(&self, peer: &str, msg: Bytes) -> Result<()> {
        let len = msg.len();
        let mut waited = None;
        loop {
            let short = match self.queues.admit(peer, len) {
                Ok(known) => {
                    self.admitted(peer, msg, known, waited);
                    return Ok(());
                }
                Err(short) => short,
            };
            let waiting = match short {
                Short::Peer => match self.queues.wait(peer) {
                    Some(space) => Some(Waiting {
                        queues: &self.queues,
                        peer,
                        space: Some(space),
                    }),
                    // Its queue emptied meanwhile: look again.
                    None => continue,
                },
                Short::Known | Short::Unknown => None,
            };
            let room: &Notify = match (&waiting, short) {
                (Some(w), _) => w.space.as_deref().expect("set until dropped"),
                (None, Short::Known) => &self.queues.known_room,
                (None, _) => &self.queues.unknown_room,
            };
            let notified = room.notified();
            tokio::pin!(notified);
            // Listen before looking again, so room made in between is not missed.
            notified.as_mut().enable();
            match self.queues.admit(peer, len) {
                Ok(known) => {
                    self.admitted(peer, msg, known, waited);
                    return Ok(());
                }
                // Another bound is full now: wait for that one instead.
                Err(s) if s != short => continue,
                Err(_) => {}
            }
            waited = Some(short);
            tokio::select! {
                () = &mut notified => {}
                () = self.tx.closed() => break,
                () = self.cancel.cancelled() => break,
            }
        }
        Err(Error::new(
            ErrorKind::ShutDown,
            "deliver notification",
            format!("the agent stopped while a notification from {peer:?} waited for room"),
        ))
    }

    /// Queue a notification [`NotificationSink::deliver_async`] admitted; one that
    /// waited for room in a shared pool lets the next waiter look.
    fn admitted(&self, peer: &str, msg: Bytes, known: bool, waited: Option<Short>) {
        self.send(peer, msg, known);
        if let Some(s) = waited {
            self.queues.pass_on(s);
        }
    }

    /// Deliver the agent's own notification (a same-agent transfer's): counted in the
    /// queue, never held back or dropped, since the application posted it itself.
    pub(crate) fn deliver_own(&self, peer: &str, msg: Bytes) {
        self.queues.admit_own(peer, msg.len());
        self.send(peer, msg, true);
    }

    /// Queue a notification already counted against `peer`.
    fn send(&self, peer: &str, msg: Bytes, known: bool) {
        let len = msg.len();
        let sent = self.tx.send(Queued {
            note: Notification {
                peer: peer.to_owned(),
                msg,
            },
            known,
        });
        match sent {
            Ok(()) => {
                if let Some(c) = &self.received {
                    c.increment(1);
                }
            }
            // The agent is gone: nobody will read it.
            Err(_) => self.queues.release(peer, len, known),
        }
    }
}

/// A delivery waiting for room in its peer's queue; stops waiting when dropped.
struct Waiting<'a> {
    queues: &'a PeerQueues,
    peer: &'a str,
    space: Option<Arc<Notify>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(space) = self.space.take() {
            self.queues.unwait(self.peer, space);
        }
    }
}

/// What the agent gives a backend when attaching it.
#[derive(Clone, Debug)]
pub struct BackendContext {
    /// The agent's name (backends announce it to peers).
    pub agent_name: String,
    /// The agent's shared secret ([`AgentBuilder::secret`](crate::AgentBuilder::secret)):
    /// a backend that authenticates its connections uses it unless its own options
    /// name one.
    pub secret: Option<crate::secret::SharedSecret>,
    /// Cancelled when the agent shuts down or is dropped; every task the backend starts
    /// must end soon after.
    pub cancel: CancellationToken,
    /// Start every task through this tracker, so shutdown can wait for it.
    pub tracker: TaskTracker,
    /// Incoming notifications.
    pub notifications: NotificationSink,
    /// Starts OS threads the agent owns; see [`BackendContext::spawn_thread`].
    pub threads: ThreadSpawner,
}

impl BackendContext {
    /// Start an OS thread the agent owns (a progress loop, a blocking accept loop).
    ///
    /// `body` runs on a new thread named `name` and gets a cancellation token; it must
    /// return soon after the token is cancelled. `wake` interrupts whatever the thread
    /// blocks in (write an event fd, call the library's stop-accept): the agent calls
    /// it once, right after cancelling the token, so `body` needs no timeout polling.
    ///
    /// The agent stops, wakes and joins the thread with a bound from
    /// [`Agent::shutdown`](crate::Agent::shutdown) (after the backends' own
    /// [`Backend::shutdown`] returned) and from dropping the agent, even when the tokio
    /// runtime is already gone. A thread still running at the bound is left detached
    /// and named in [`ShutdownReport::threads_left`](crate::ShutdownReport::threads_left).
    ///
    /// # Errors
    /// [`ErrorKind::ShutDown`] once the agent stops; [`ErrorKind::Backend`] when the
    /// OS refuses a thread.
    pub fn spawn_thread<F, W>(&self, name: &str, body: F, wake: W) -> Result<()>
    where
        F: FnOnce(CancellationToken) + Send + 'static,
        W: Fn() + Send + Sync + 'static,
    {
        self.threads.spawn(name, body, wake)
    }

    /// This context with `own` as its secret, where set: a backend whose options name
    /// a secret of its own uses it instead of the agent's.
    pub fn with_own_secret(mut self, own: Option<&crate::secret::SharedSecret>) -> Self {
        if let Some(own) = own {
            self.secret = Some(own.clone());
        }
        self
    }

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

/// What a backend has once attached to an agent (its "started" state: the context,
/// its listener's address, its own tokens), set once by [`Backend::start`].
///
/// Every backend needs the same three things: refuse a second attach, refuse work
/// before the first, and reach the state from every call. Hold one of these and call
/// [`Attachment::attach`] in `start`, [`Attachment::get`] everywhere else.
///
/// ```
/// # use nixl::{Attachment, BackendContext, Result};
/// struct Started { ctx: BackendContext }
/// struct MyBackend { started: Attachment<Started> }
///
/// impl MyBackend {
///     async fn start(&self, ctx: BackendContext) -> Result<()> {
///         self.started.attach("start my backend", async { Ok(Started { ctx }) }).await?;
///         Ok(())
///     }
///     fn work(&self) -> Result<()> {
///         let started = self.started.get("do work")?;
///         let _ = &started.ctx;
///         Ok(())
///     }
/// }
/// ```
pub struct Attachment<S> {
    backend: &'static str,
    claimed: std::sync::atomic::AtomicBool,
    started: std::sync::OnceLock<S>,
}

impl<S> Attachment<S> {
    /// Not attached yet; `backend` names it in errors ("the tcp backend is ...").
    pub const fn new(backend: &'static str) -> Self {
        Self {
            backend,
            claimed: std::sync::atomic::AtomicBool::new(false),
            started: std::sync::OnceLock::new(),
        }
    }

    /// Attach: run `start` (the backend's own start-up) and keep what it returns. A
    /// second attach, even while the first is starting, is refused before its
    /// `start` runs; a `start` that fails leaves the backend attachable again.
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] when already attached; `start`'s error.
    pub async fn attach(
        &self,
        op: &'static str,
        start: impl std::future::Future<Output = Result<S>>,
    ) -> Result<&S> {
        use std::sync::atomic::Ordering;
        if self.claimed.swap(true, Ordering::AcqRel) {
            return Err(crate::error::Error::new(
                crate::error::ErrorKind::NotAllowed,
                op,
                format!(
                    "the {} backend is already attached to an agent",
                    self.backend
                ),
            ));
        }
        match start.await {
            Ok(s) => Ok(self.started.get_or_init(|| s)),
            Err(e) => {
                self.claimed.store(false, Ordering::Release);
                Err(e)
            }
        }
    }

    /// The started state.
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] before the backend is attached.
    pub fn get(&self, op: &'static str) -> Result<&S> {
        self.started.get().ok_or_else(|| {
            crate::error::Error::new(
                crate::error::ErrorKind::NotAllowed,
                op,
                format!("the {} backend is not attached to an agent", self.backend),
            )
        })
    }

    /// The started state, if attached.
    pub fn try_get(&self) -> Option<&S> {
        self.started.get()
    }
}

impl<S: fmt::Debug> fmt::Debug for Attachment<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attachment")
            .field("backend", &self.backend)
            .field("started", &self.started.get())
            .finish()
    }
}

/// The remote (or second local) side of one transfer segment.
#[derive(Clone, Debug)]
pub enum Target {
    /// Another region of this agent (local transfers).
    Local(RegionSlice),
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
    /// Local memory (source of a WRITE, destination of a READ), with the registration
    /// it lies in ([`RegionSlice::region`]): a backend finds its own handle for that
    /// registration (a local key, a memory handle) by [`RegionSlice::id`], without an
    /// address index of its own.
    pub local: RegionSlice,
    /// The other side.
    pub target: Target,
}

/// The target side's registration of some runs of a transfer
/// ([`Segments::targets`]).
#[derive(Clone, Debug)]
pub enum TargetRegion {
    /// A registration of this agent (local transfers).
    Local(RegionRef),
    /// A registration a peer advertised.
    Remote {
        /// The peer's registration id.
        region: u64,
        /// Its start address in the peer's address space.
        addr: u64,
        /// Its length in bytes.
        len: u64,
        /// The peer's public blob for this backend (e.g. a key).
        blob: Bytes,
    },
}

/// `count` segments of `len` bytes at regular strides on both sides: the form in
/// which the agent hands segments to backends, so a request over a strided descriptor
/// list reaches the backend in O(runs), not O(blocks).
///
/// Plain data: the registrations are [`Segments::locals`]`[local]` and
/// [`Segments::targets`]`[target]`, so a backend resolves its handles (keys, memory
/// handles) once per registration, not per run. Segment `i` is `len` bytes at
/// `local_offset + i * local_stride` into the local registration and
/// `target_offset + i * target_stride` into the target one; the agent checked every
/// one of them against its registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentRun {
    /// Index of the local registration in [`Segments::locals`].
    pub local: u32,
    /// Index of the target registration in [`Segments::targets`].
    pub target: u32,
    /// Offset of the first segment into the local registration.
    pub local_offset: u64,
    /// Offset of the first segment into the target registration.
    pub target_offset: u64,
    /// Distance from one segment's local start to the next one's.
    pub local_stride: u64,
    /// Distance from one segment's target start to the next one's.
    pub target_stride: u64,
    /// Bytes in each segment.
    pub len: u64,
    /// Number of segments (at least 1).
    pub count: usize,
}

impl SegmentRun {
    /// Bytes in all segments (saturating; the agent refuses requests over
    /// `u64::MAX` bytes).
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count as u64)
    }

    /// Offset into the local registration of segment `i`.
    pub fn local_at(&self, i: usize) -> u64 {
        self.local_offset + i as u64 * self.local_stride
    }

    /// Offset into the target registration of segment `i`.
    pub fn target_at(&self, i: usize) -> u64 {
        self.target_offset + i as u64 * self.target_stride
    }

    /// Bytes `lo..hi` of this run (counted over its segments in order, `lo <= hi <=
    /// bytes()`) as at most three runs: a partial first segment, the whole segments,
    /// a partial last segment, each where present (none when `lo == hi`). A partial
    /// segment is a run of one; the runs keep this run's strides.
    pub fn cut(&self, lo: u64, hi: u64) -> impl Iterator<Item = Self> {
        let mut out = [None; 3];
        if lo < hi && hi <= self.bytes() {
            let len = self.len;
            let (first, first_from) = ((lo / len) as usize, lo % len);
            let (last, last_to) = (((hi - 1) / len) as usize, (hi - 1) % len + 1);
            let part = |i: usize, from: u64, to: u64| Self {
                local_offset: self.local_at(i) + from,
                target_offset: self.target_at(i) + from,
                len: to - from,
                count: 1,
                ..*self
            };
            if first == last {
                out[0] = Some(part(first, first_from, last_to));
            } else {
                let mut whole = first..last + 1;
                if first_from > 0 {
                    out[0] = Some(part(first, first_from, len));
                    whole.start += 1;
                }
                if last_to < len {
                    out[2] = Some(part(last, 0, last_to));
                    whole.end -= 1;
                }
                if !whole.is_empty() {
                    out[1] = Some(Self {
                        local_offset: self.local_at(whole.start),
                        target_offset: self.target_at(whole.start),
                        count: whole.len(),
                        ..*self
                    });
                }
            }
        }
        out.into_iter().flatten()
    }
}

/// The segments of one transfer, in order, as runs ([`SegmentRun`]) over the
/// registrations they lie in.
///
/// [`Segments::len`] counts segments; [`Segments::runs`] is the compressed form
/// (what [`Capabilities::max_segments`] limits), [`Segments::iter`] the expanded one.
/// Holding it keeps the registrations' memory alive.
#[derive(Clone, Debug, Default)]
pub struct Segments {
    locals: Vec<RegionRef>,
    targets: Vec<TargetRegion>,
    runs: Vec<SegmentRun>,
    count: usize,
    bytes: u64,
}

impl Segments {
    /// Runs the agent checked against these registrations.
    pub(crate) fn checked(
        locals: Vec<RegionRef>,
        targets: Vec<TargetRegion>,
        runs: Vec<SegmentRun>,
    ) -> Self {
        let (mut count, mut bytes) = (0usize, 0u64);
        for r in &runs {
            debug_assert!(r.count > 0 && (r.local as usize) < locals.len());
            debug_assert!((r.target as usize) < targets.len());
            count = count.saturating_add(r.count);
            bytes = bytes.saturating_add(r.bytes());
        }
        Self {
            locals,
            targets,
            runs,
            count,
            bytes,
        }
    }

    /// Number of segments (not runs).
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes in all segments.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The runs, in order.
    pub fn runs(&self) -> &[SegmentRun] {
        &self.runs
    }

    /// The local registrations the runs refer to (by [`SegmentRun::local`]).
    pub fn locals(&self) -> &[RegionRef] {
        &self.locals
    }

    /// The target registrations the runs refer to (by [`SegmentRun::target`]).
    pub fn targets(&self) -> &[TargetRegion] {
        &self.targets
    }

    /// Segment `i` of `run`, as a local slice and a target (`i < run.count`).
    ///
    /// # Panics
    /// When `i >= run.count` or `run` is not one of these runs' shape.
    pub fn segment(&self, run: &SegmentRun, i: usize) -> Segment {
        assert!(i < run.count, "segment {i} of a run of {}", run.count);
        let len = run.len as usize;
        let local = self.locals[run.local as usize]
            .slice(run.local_at(i) as usize, len)
            .expect("the agent checked every segment of the run");
        let target = match &self.targets[run.target as usize] {
            TargetRegion::Local(r) => Target::Local(
                r.slice(run.target_at(i) as usize, len)
                    .expect("the agent checked every segment of the run"),
            ),
            TargetRegion::Remote {
                region, addr, blob, ..
            } => Target::Remote {
                addr: addr + run.target_at(i),
                len: run.len,
                region: *region,
                blob: blob.clone(),
            },
        };
        Segment { local, target }
    }

    /// Every segment, in order (expands the runs).
    pub fn iter(&self) -> impl Iterator<Item = Segment> + '_ {
        self.runs
            .iter()
            .flat_map(move |r| (0..r.count).map(move |i| self.segment(r, i)))
    }

    /// The same transfer cut into at most `parts` consecutive pieces of nearly equal
    /// bytes, in order, for a backend that moves pieces over several connections or
    /// queue pairs at once. Cuts fall on multiples of `align` bytes from the start of
    /// the transfer (so pieces stay page-sized where `align` is a page), inside a
    /// segment where needed: a single 16 MiB segment cut in four gives four 4 MiB
    /// pieces. Fewer pieces come back when the transfer is too small for `parts`
    /// cuts at `align`; one piece (a copy of this) when `parts` is at most 1.
    ///
    /// Each piece shares this transfer's registration tables and is O(runs) to make:
    /// a run is cut into at most a partial first segment, whole segments and a partial
    /// last one.
    pub fn split(&self, parts: usize, align: u64) -> Vec<Self> {
        let pieces = split_runs(&self.runs, self.bytes, parts, align);
        if pieces.len() <= 1 {
            return vec![self.clone()];
        }
        pieces
            .into_iter()
            .map(|runs| Self::checked(self.locals.clone(), self.targets.clone(), runs))
            .collect()
    }
}

/// The runs of each piece of [`Segments::split`].
fn split_runs(runs: &[SegmentRun], bytes: u64, parts: usize, align: u64) -> Vec<Vec<SegmentRun>> {
    let align = align.max(1);
    let mut cuts = vec![0u64];
    for k in 1..parts.max(1) {
        let c = (u128::from(bytes) * k as u128 / parts as u128) as u64 / align * align;
        if c > *cuts.last().expect("starts with 0") {
            cuts.push(c);
        }
    }
    if bytes > *cuts.last().expect("starts with 0") {
        cuts.push(bytes);
    }
    let n = cuts.len().saturating_sub(1);
    let mut pieces = vec![Vec::new(); n];
    let (mut pos, mut piece) = (0u64, 0usize);
    for run in runs {
        let end = pos + run.bytes();
        while piece < n && cuts[piece] < end {
            let lo = cuts[piece].max(pos) - pos;
            let hi = cuts[piece + 1].min(end) - pos;
            pieces[piece].extend(run.cut(lo, hi));
            if cuts[piece + 1] <= end {
                piece += 1;
            } else {
                break;
            }
        }
        pos = end;
    }
    pieces
}

/// A fully checked transfer, handed to [`Backend::prepare`].
#[derive(Debug)]
pub struct TransferPlan {
    /// READ or WRITE.
    pub op: Op,
    /// The peer and the backend's link to it, or `None` for a local transfer.
    pub peer: Option<LinkedPeer>,
    /// Segments, already merged where contiguous, as runs.
    pub segments: Segments,
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

/// How a backend takes part in NIXL's own protocol, so that an agent can work with
/// NIXL agents (see [`crate::interop`]): [`Backend::nixl`] returns it for a backend
/// that speaks NIXL's dialect of its transport (nixl-ucx speaks NIXL's UCX backend).
///
/// The agent translates metadata; the backend translates blobs and speaks to the
/// peers the agent links to through [`NixlDialect::link`] in NIXL's way
/// (NIXL's notification messages, none of its own protocol).
pub trait NixlDialect: Send + Sync + fmt::Debug {
    /// NIXL's name for the backend type this backend speaks (`"UCX"`).
    fn backend_type(&self) -> &str;

    /// The blob NIXL expects for a registration, from this backend's own blob for it
    /// (what [`Backend::register`] returned).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when `blob` is not one of this backend's.
    fn export_blob(&self, blob: &[u8]) -> Result<Vec<u8>>;

    /// This backend's blob for a NIXL peer's descriptor (`addr`, `len`) and NIXL's
    /// blob for it, as [`Target::Remote`] will carry it.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when NIXL's blob cannot be one of this backend type's.
    fn import_blob(&self, addr: u64, len: u64, blob: &[u8]) -> Result<Bytes>;

    /// A link to a NIXL-format peer at `conn_info`, as [`Backend::link`] makes for
    /// agents of this crate: speaking NIXL's dialect to `peer`, or, when `nixl_rs`
    /// (its metadata carries the [`BACKEND_NIXL_RS`](crate::interop::BACKEND_NIXL_RS)
    /// entry: it is an agent of this crate exchanging NIXL's format), this backend's
    /// own protocol.
    fn link(&self, peer: &str, conn_info: &[u8], nixl_rs: bool) -> Result<Arc<dyn PeerLink>>;
}

/// A backend: one transport.
///
/// Object-safe; held as `Arc<dyn Backend>`. Setup calls may be async; the hot path is
/// [`Backend::prepare`] once, then [`PreparedTransfer::post`] many times.
///
/// # Teardown order
/// [`Agent::shutdown`](crate::Agent::shutdown) stops an agent in this order, under one
/// overall bound ([`AgentOptions::shutdown_timeout`](crate::AgentOptions)), with all
/// backends going through each step concurrently:
/// 1. refuse new work (posts, registrations, metadata loads fail with
///    [`ErrorKind::ShutDown`]);
/// 2. drain in-flight transfers up to the drain timeout, then cancel them;
/// 3. run the exchanges' hooks (revoke etcd leases while connections still work);
/// 4. cancel the agent's token (every task started through the context sees it) and
///    stop, wake and join the backends' OS threads ([`BackendContext::spawn_thread`]);
/// 5. [`Backend::shutdown`]: stop listeners and accept loops, fail what is still in
///    flight, close connections. Registrations stay valid;
/// 6. [`Backend::deregister`] for every registration still registered (memory
///    regions go before the protection domain, and after the connections that could
///    still reach them);
/// 7. [`Backend::destroy`]: release contexts, workers, protection domains;
/// 8. wait for the agent's tasks.
///
/// Dropping an agent without shutdown cancels the token and joins the threads the same
/// way (bounded); the rest is left to each backend's `Drop`.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Short name, published in metadata; peers match backends by it (`"tcp"`).
    fn name(&self) -> &str;

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Why this backend does not take `kind` memory, when its capabilities say it
    /// does not and it knows why (a library built without GPU support): the agent
    /// adds it to the error of a registration no backend takes. `None`: no reason
    /// to give.
    fn unsupported_reason(&self, kind: MemKind) -> Option<String>;

    /// Called once when attached to an agent: start listeners and progress tasks here,
    /// through the context's tracker.
    async fn start(&self, ctx: BackendContext) -> Result<()>;

    /// Connection info for metadata (what a peer's instance of this backend needs).
    fn connection_info(&self) -> Bytes;

    /// Register a region; returns the public blob peers need to reach it.
    ///
    /// May be slow (pinning gigabytes for a NIC) and may block: the agent calls it on
    /// the caller's thread from [`Agent::register`](crate::Agent::register), or on
    /// tokio's blocking pool from
    /// [`Agent::register_async`](crate::Agent::register_async), never from a task of
    /// its own.
    fn register(&self, region: &RegionRef) -> Result<Bytes>;

    /// Forget a region: incoming requests for it are refused from now on, and the
    /// backend lets go of its [`RegionRef`].
    ///
    /// # Errors
    /// When the transport failed to release it (the agent forgets it all the same and
    /// reports the error).
    fn deregister(&self, region_id: u64) -> Result<()>;

    /// Allocate host memory this backend reaches faster than ordinary memory (for
    /// example shared memory a peer on the same host maps directly), for
    /// [`Agent::alloc`](crate::Agent::alloc). `None`: no such memory.
    fn alloc(&self, len: usize) -> Option<Result<Memory>>;

    /// How this backend moves data to `peer` right now, in one line (the transport, a
    /// same-host shortcut, and why a faster path is off), for logs and benchmark
    /// headers. `None`: nothing to say, or not connected yet.
    fn data_path(&self, peer: &str) -> Option<String>;

    /// This backend's side of NIXL's protocol, if it speaks one; `None`: it cannot
    /// work with NIXL agents.
    fn nixl(&self) -> Option<&dyn NixlDialect>;

    /// A link to `peer` at `conn_info` (see [`PeerLink`]); connecting may be lazy.
    /// The agent keeps it while the peer's connection info for this backend stays the
    /// same, and closes it when the peer is forgotten, restarts or moves; it asks
    /// again for the same info only after a restart, a change of dialect, or a link
    /// that failed for good ([`PeerLink::failed`]). Making a link must not disturb the peer's
    /// previous one, which the agent closes once the new one is in place.
    ///
    /// # Errors
    /// When `conn_info` is not this backend's ([`ErrorKind::Corrupt`]), or the peer
    /// may not be reached (nothing changes then).
    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>>;

    /// Resolve a checked transfer once, for posting many times. Same-agent transfers
    /// between DRAM regions never get here (the agent copies those itself).
    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>>;

    /// Stop: stop listeners and accept loops, fail in-flight work, close connections
    /// (step 5 of the [teardown order](Backend#teardown-order)). Registrations stay
    /// valid until the agent deregisters them next. Should return within `timeout`;
    /// the agent stops waiting at its overall bound and reports an overrun.
    async fn shutdown(&self, timeout: Duration) -> Result<()>;

    /// Release what remains (contexts, workers, protection domains) after every
    /// registration was deregistered (step 7 of the [teardown order](Backend#teardown-order)).
    /// Required, so that every backend says what it releases here; one whose state
    /// `Drop` releases in any order returns `Ok(())` and says so.
    ///
    /// # Errors
    /// When releasing failed; the agent reports it.
    fn destroy(&self) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test]
    async fn an_attachment_is_set_once_and_a_failed_start_can_be_retried() {
        use crate::error::{Error, ErrorKind};
        let a: Attachment<u32> = Attachment::new("test");
        let e = a.get("use").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed);
        assert!(
            e.to_string().contains("the test backend is not attached"),
            "{e}"
        );
        let failed = a
            .attach("start", async {
                Err(Error::new(ErrorKind::Backend, "start", "no listener"))
            })
            .await;
        assert_eq!(failed.unwrap_err().kind(), ErrorKind::Backend);
        assert!(a.try_get().is_none());
        assert_eq!(*a.attach("start", async { Ok(7) }).await.unwrap(), 7);
        let mut ran = false;
        let again = a
            .attach("start", async {
                ran = true;
                Ok(8)
            })
            .await
            .unwrap_err();
        assert_eq!(again.kind(), ErrorKind::NotAllowed);
        assert!(again.to_string().contains("already attached"), "{again}");
        assert!(!ran, "a second attach never starts");
        assert_eq!(*a.get("use").unwrap(), 7);
    }

    fn run(
        local_offset: u64,
        target_offset: u64,
        len: u64,
        strides: (u64, u64),
        count: usize,
    ) -> SegmentRun {
        SegmentRun {
            local: 0,
            target: 0,
            local_offset,
            target_offset,
            local_stride: strides.0,
            target_stride: strides.1,
            len,
            count,
        }
    }

    /// (local, target, len) byte intervals, merged where both sides continue.
    fn intervals<'a>(runs: impl IntoIterator<Item = &'a SegmentRun>) -> Vec<(u64, u64, u64)> {
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        for r in runs {
            for i in 0..r.count {
                let (l, t) = (r.local_at(i), r.target_at(i));
                match out.last_mut() {
                    Some((pl, pt, n)) if *pl + *n == l && *pt + *n == t => *n += r.len,
                    _ => out.push((l, t, r.len)),
                }
            }
        }
        out
    }

    #[test]
    fn split_cuts_inside_segments_at_the_alignment() {
        // One 16 MiB segment in four.
        let one = [run(0, 4096, 16 << 20, (0, 0), 1)];
        let pieces = split_runs(&one, 16 << 20, 4, 4096);
        assert_eq!(pieces.len(), 4);
        for (k, p) in pieces.iter().enumerate() {
            let k = k as u64;
            assert_eq!(
                p.as_slice(),
                &[run(k << 22, 4096 + (k << 22), 4 << 20, (0, 0), 1)]
            );
        }
        // Ten 1000-byte blocks in three, cut at 8 bytes: 3336 | 3328 | 3336.
        let strided = [run(0, 0, 1000, (1000, 2000), 10)];
        let pieces = split_runs(&strided, 10_000, 3, 8);
        let bytes: Vec<u64> = pieces
            .iter()
            .map(|p| p.iter().map(SegmentRun::bytes).sum())
            .collect();
        assert_eq!(bytes, vec![3328, 3336, 3336]);
        // The middle piece: the rest of block 3, blocks 4 and 5, the start of block 6.
        // Partial blocks keep the run's strides; only their offsets move.
        assert_eq!(
            pieces[1],
            vec![
                run(3328, 6328, 672, (1000, 2000), 1),
                run(4000, 8000, 1000, (1000, 2000), 2),
                run(6000, 12000, 664, (1000, 2000), 1),
            ]
        );
        // Too small for the cuts asked for: fewer pieces.
        assert_eq!(split_runs(&strided, 10_000, 4, 4096).len(), 2);
        assert_eq!(split_runs(&strided, 10_000, 1, 1).len(), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn split_pieces_are_the_transfer_in_order(
            shapes in proptest::collection::vec((1u64..5000, 1usize..6, 0u64..3, 0u64..3), 1..6),
            parts in 1usize..9,
            align in prop_oneof![Just(1u64), Just(8), Just(4096)],
        ) {
            // Runs one after another on both sides, strides at least the length.
            let (mut l, mut t) = (0u64, 1u64 << 40);
            let mut runs = Vec::new();
            for (len, count, ls, ts) in shapes {
                let r = run(l, t, len, (len * (ls + 1), len * (ts + 1)), count);
                l += r.local_stride * count as u64;
                t += r.target_stride * count as u64;
                runs.push(r);
            }
            let bytes: u64 = runs.iter().map(SegmentRun::bytes).sum();
            let pieces = split_runs(&runs, bytes, parts, align);
            prop_assert!(!pieces.is_empty() && pieces.len() <= parts);
            let sizes: Vec<u64> = pieces.iter().map(|p| p.iter().map(SegmentRun::bytes).sum()).collect();
            prop_assert_eq!(sizes.iter().sum::<u64>(), bytes);
            for (k, s) in sizes.iter().enumerate() {
                prop_assert!(*s > 0);
                if k + 1 < sizes.len() {
                    prop_assert_eq!(sizes[..=k].iter().sum::<u64>() % align, 0, "cut off the alignment");
                }
            }
            for p in &pieces {
                for r in p {
                    prop_assert!(r.count > 0 && r.len > 0);
                }
            }
            prop_assert_eq!(intervals(pieces.iter().flatten()), intervals(&runs));
        }
    }
}
