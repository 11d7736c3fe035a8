//! # nixl-uccl
//!
//! A [`nixl`] backend over UCCL's p2p engine (`libuccl_p2p.so`, from the PyPI wheel
//! `uccl`), loaded at run time: the default build needs neither CUDA nor UCCL.
//!
//! - **Binding.** The engine's `uccl_engine_*` API has C++ linkage. This crate declares
//!   the functions it uses itself and resolves them by mangled name
//!   ([`library::SYMBOLS`]), so a library whose signatures changed fails to load instead
//!   of being called wrongly; a test checks every symbol against the real wheel. The
//!   library needs the CUDA driver (`libcuda.so.1`) and runtime (`libcudart.so.12`):
//!   where they are missing, [`UcclBackend::new`] returns
//!   [`ErrorKind::UnavailableLibrary`] naming them. What was bound is in
//!   [`UcclBackend::library_report`] (the core's shared [`LibraryReport`]).
//! - **Lifecycle** (the part NIXL's UCCL backend got wrong; see `DESIGN.md`).
//!   - The accept loop is one thread the agent owns
//!     ([`nixl::BackendContext::spawn_thread`]); shutdown cancels it, wakes it with
//!     UCCL's stop-accept and joins it within the agent's bound; an overrun is named in
//!     the shutdown report, never waited on forever. UCCL's accept does not return
//!     before the engine's first registration, whatever stop-accept says, so the loop
//!     does not enter it until this agent has registered memory: it waits on a
//!     condition that registration and shutdown both signal. An agent that never
//!     registers shuts down as fast as any other.
//!   - Every engine handle belongs to one owner whose `Drop` closes the connections
//!     still open, then destroys the memory regions still registered, then the engine.
//!     Every thread and connection that can call into the engine holds that owner, so
//!     the engine is never destroyed while a call (a stuck connect, the accept loop) is
//!     still running in it: [`nixl::Backend::destroy`] releases the backend's hold and
//!     reports when another holder keeps the engine alive.
//!   - Peers are keyed by agent name, learned in this crate's own handshake on a
//!     control connection, never by IP address: two agents on one host, and several in
//!     one process, do not collide. Inbound engine connections are kept in a list (to
//!     close them at teardown), not in a map keyed by address.
//!   - An initiator calls UCCL's (blocking, uncancellable) connect only after the
//!     target said, on the control connection, that its engine accepts (it has
//!     registered memory); the call runs on an agent-owned thread and is waited on
//!     for at most [`ListenerOptions::connect_timeout`].
//! - **Data path.** A registration is `uccl_engine_reg` plus `uccl_engine_prepare_fifo`;
//!   the 64-byte `FifoItem` (address, length, remote key) is the registration's public
//!   blob. A transfer is one `uccl_engine_write`/`uccl_engine_read` per piece (segments
//!   split at [`UcclOptions::max_piece`]; UCCL's lengths are 32-bit), at most
//!   [`UcclOptions::window`] pieces outstanding per transfer, issued and polled by one
//!   progress thread the agent owns. The thread sleeps on a condition variable when
//!   nothing is in flight (no busy polling when idle) and polls
//!   `uccl_engine_xfer_status` while something is, backing off to short sleeps.
//! - **Failures.** UCCL's status says only "done or not". A peer's liveness comes from
//!   the control connection: it is pinged, and a connection that closes, errs or stays
//!   silent for [`ListenerOptions::dead_peer_timeout`] marks the peer dead, which fails its
//!   in-flight transfers with [`ErrorKind::RemoteDisconnected`] within that bound
//!   (plus one poll interval). A transfer not done after [`UcclOptions::stall_timeout`]
//!   fails with [`ErrorKind::TimedOut`]. UCCL cannot cancel an operation it accepted:
//!   after such a failure the NIC may still complete it (see abandoned operations).
//!   UCCL 0.1.1 also reports an operation that failed inside the engine as done, so
//!   every transfer is **confirmed end to end** before it resolves `Ok` and before
//!   its notification goes ([`UcclOptions::confirm`], on by default): the initiator
//!   digests its side of the bytes while the target digests its side (a `Verify`
//!   request on the control connection), and a difference fails the transfer with
//!   [`ErrorKind::Backend`]. The cost is one read of the data on each side (GPU
//!   memory copied to the host for it) and one control round trip per transfer.
//! - **Notifications.** UCCL's own go over a separate TCP channel, unordered with the
//!   data, into one process-wide list, truncated to 256 bytes. This crate does not use
//!   them. A notification is sent on the control connection by the initiator once every
//!   piece of its transfer is done and confirmed (so the data is in the target's
//!   memory first),
//!   delivered only to the agent it is for, only when asked for, and never truncated:
//!   up to [`MAX_NOTIFICATION`] bytes, longer ones are refused when posted. Order
//!   holds per control connection: after a reconnect, frames still in flight on the
//!   old one may arrive after new ones. A notification that finds the agent's queue
//!   full ([`nixl::NotificationLimits`]) waits for room and the connection is not
//!   read meanwhile (back-pressure on that peer; nothing is dropped); the target
//!   sends PONGs while it waits so the initiator does not count it dead.
//! - **The control connection** is authenticated with the agent's shared secret
//!   where one is set ([`nixl::AgentBuilder::secret`], or this backend's own,
//!   the listener options' [`secret`](nixl::control::ListenerOptions::secret),
//!   through [`nixl::control`]),
//!   and its hello must name the agent proven, so notifications carry a proven name;
//!   without a secret the name in the hello is taken as given (NIXL-compatible).
//!   UCCL's own engine channel is never authenticated: run UCCL on a trusted fabric.
//!   What a target holds for one connection is bounded whatever the peer sends: one
//!   `Pong` owed however many pings arrive unread, at most 1024 confirmations
//!   accepted and unwritten (past that the connection is not read until one is
//!   written: the peer's own sends stall); each answer must be written within
//!   [`ListenerOptions::dead_peer_timeout`], and the socket's `TCP_USER_TIMEOUT` is the
//!   same bound, so a peer that never reads is cut ([`UcclBackend::control_stats`]
//!   counts both).
//! - **Serialization.** UCCL keeps its registration table in one unguarded
//!   process-wide map: registering and deregistering (and creating or destroying
//!   engines and connections) hold one process-wide lock exclusively, read and write
//!   share it, and the status poll takes none (a post spinning on a full queue must
//!   not keep completions from being polled). Accept, stop-accept and connect, which
//!   block or must run while accept blocks, run outside it.
//! - **Abandoned operations.** An operation UCCL accepted cannot be cancelled: when
//!   its transfer fails first (dead peer, stall), the progress thread keeps polling it,
//!   and its registrations stay counted in flight until it is done
//!   ([`nixl::RegionRef::hold_in_flight`]): the transfer resolves with its error at
//!   once, but [`nixl::Agent::deregister`] refuses that memory
//!   ([`ErrorKind::NotAllowed`], nothing changes) until the engine has let go
//!   ([`nixl::Registration::inflight`] drops to zero then), and when it returns `Ok`
//!   the memory region is destroyed: the engine touches that memory no more. At
//!   shutdown it gets a short grace; one never reported done leaves the engine, its
//!   regions and their memory alive for the rest of the process rather than
//!   destroying them under the NIC (the shutdown report names each such region).
//! - **C++ exceptions.** UCCL 0.1.1 throws from some calls (a write on a connection
//!   whose setup failed). Every call goes through a C++ shim of ours (default
//!   feature `exception-shim`) that turns an exception into an error; a build
//!   without it loads the library but creates no engine.
//! - **Hosts UCCL would crash on.** The wheel's library references three Python
//!   functions, supplied inert where the process has no Python ([`host`]); its RDMA
//!   transport crashes at the first registration on a host with no RDMA device, so
//!   the backend refuses such a host with [`ErrorKind::NotSupported`] (see
//!   [`host::transport_ready`]; `UCCL_P2P_TRANSPORT=tcp` needs NCCL instead).
//! - **CUDA context.** Every thread of ours that calls into UCCL binds
//!   [`UcclOptions::device`]'s context first.
//! - **One-sided.** The target does not see requests: [`Capabilities::target_checks`]
//!   is `false`; the initiating agent checks every descriptor and the NIC checks keys.
//! - **GPU memory** ([`nixl::MemKind::Vram`], [`nixl::gpu`]) is handed to the engine
//!   as it is: UCCL's registration recognises device pointers itself (it asks the CUDA
//!   runtime) and registers them for GPUDirect RDMA by dma-buf, and towards peers on
//!   the same host it moves GPU memory by CUDA IPC. Registration binds the device's
//!   primary context on the calling thread first, and without a GPU fails naming the
//!   missing driver. Tested on the engine test double, with a test double of the
//!   CUDA driver and with the core's host stand-in for device memory; **not yet run
//!   on a GPU**.
//! - **Not yet run on hardware.** The data path has not run against a real UCCL engine
//!   (that needs an NVIDIA GPU and an RDMA NIC). What runs in CI: the symbol check
//!   against the real wheel, the missing-driver error, the codecs, and the whole
//!   lifecycle and conformance suite against `test_double` (feature `test-double`),
//!   an in-process stand-in that reproduces UCCL's blocking behaviour. It proves this
//!   crate's structure, not UCCL's data path. Known UCCL 0.1.1 behaviour to check on
//!   hardware: towards a peer on the same host UCCL takes its IPC path, which handles
//!   GPU memory only (`UCCL_P2P_DISABLE_IPC=1` forces the network path); UCCL keeps
//!   registrations in one process-wide map keyed by address, so two agents of one
//!   process must not register the same buffer.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

#[allow(unsafe_code)]
pub mod api;
mod catch;
mod confirm;
mod control;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod host;
pub mod library;
mod reply;
#[cfg(feature = "test-double")]
#[allow(unsafe_code)]
pub mod test_double;
mod verify;
mod wire;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use nixl::control::ListenerOptions;
use nixl::native::{LibraryReport, LibrarySource};
use nixl::{
    Attachment, Backend, BackendContext, Capabilities, Completer, Error, ErrorKind, MemKind, Op,
    PeerLink, PreparedTransfer, RegionRef, RegionSlice, Result, Target, TransferPlan,
};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use api::{ConnHandle, Deregistered, EngineApi, EngineOwner, FifoItem, NewEngine, OwnedConn};
use confirm::{Confirmer, Regs, Work};
use control::{AtInitiator, AtTarget};
use wire::{ConnInfo, Frame};

/// Longest notification this backend carries, in bytes (UCCL's own stop at 256).
pub const MAX_NOTIFICATION: usize = 1 << 20;

/// Most segments one transfer may carry: nixl-uccl makes one UCCL call per segment
/// (and per piece of a large one), so it expands runs of segments when it prepares
/// and refuses more than this with [`ErrorKind::NotSupported`].
pub const MAX_SEGMENTS: usize = 1 << 24;

/// Options of [`UcclBackend`].
#[derive(Clone, Debug)]
pub struct UcclOptions {
    /// `libuccl_p2p.so` to load; else `NIXL_UCCL_LIB`, else the soname.
    pub library: Option<PathBuf>,
    /// The control listener and connections ([`ListenerOptions`], as every
    /// backend's). By default the listener binds, and publishes, the address UCCL's
    /// engine announces (so peers that reach the engine reach the control listener).
    /// [`ListenerOptions::connect_timeout`] bounds the control handshake and then the
    /// engine's connect together. [`ListenerOptions::dead_peer_timeout`] is the
    /// liveness bound: a peer silent this long on the control connection is dead
    /// (pinged at a third of it); it is also a target's bound on writing one answer,
    /// and the socket's `TCP_USER_TIMEOUT`, so an initiator that does not read for
    /// this long is cut (an initiator waits up to [`UcclOptions::hold_timeout`] for a
    /// live target). One more incoming connection past
    /// [`ListenerOptions::max_incoming_connections`] is closed, unless a connection
    /// whose peer went quiet for a minute (not one that proved the shared secret)
    /// gives its place.
    pub listener: ListenerOptions,
    /// Longest a target may keep this agent's control connection unread while it
    /// shows it is alive (it answers pings): a target whose application does not
    /// read notifications holds its initiators back this way (see
    /// [`nixl::NotificationLimits`]), and so does a hostile one that never reads.
    /// Past it, a frame still not written cuts the link (default 60 s; the
    /// silence bound is [`ListenerOptions::dead_peer_timeout`]).
    pub hold_timeout: Duration,
    /// A transfer not done after this long fails with [`ErrorKind::TimedOut`].
    pub stall_timeout: Duration,
    /// Largest piece of one engine operation (UCCL's lengths are 32-bit).
    pub max_piece: usize,
    /// Most pieces of one transfer outstanding in the engine at once.
    pub window: usize,
    /// Most operations outstanding in the engine at once, across all transfers of
    /// this agent (UCCL's queues are finite, and a full one makes its post call spin).
    pub max_outstanding: usize,
    /// The GPU whose CUDA context every thread that calls into UCCL binds first (UCCL
    /// expects a current context; without one the driver reports
    /// `CUDA_ERROR_INVALID_CONTEXT` inside the engine).
    pub device: u32,
    /// Confirm every transfer end to end before it resolves `Ok` (default on):
    /// UCCL 0.1.1 reports a failed operation as done, so without this a transfer can
    /// succeed without its data. Both sides digest the transfer's bytes (CRC-32) and
    /// compare over the control connection; the cost is one read of the data on each
    /// side (GPU memory is copied to the host for it) and one round trip per
    /// transfer. Turn it off only where the fabric is known not to lose operations.
    pub confirm: bool,
}

impl Default for UcclOptions {
    fn default() -> Self {
        Self {
            library: None,
            listener: ListenerOptions::default(),
            hold_timeout: Duration::from_secs(60),
            stall_timeout: Duration::from_secs(60),
            max_piece: 1 << 30,
            window: 64,
            max_outstanding: 256,
            device: 0,
            confirm: true,
        }
    }
}

impl UcclOptions {
    fn request(&self) -> (String, LibrarySource) {
        if let Some(p) = &self.library {
            return (p.display().to_string(), LibrarySource::Option);
        }
        match std::env::var(library::ENV_LIB) {
            Ok(v) if !v.is_empty() => (v, LibrarySource::Env),
            _ => (library::DEFAULT_SONAME.to_owned(), LibrarySource::Default),
        }
    }
}

/// Load the UCCL library `options` name (without creating an engine) and report what
/// was bound.
///
/// # Errors
/// [`ErrorKind::UnavailableLibrary`] naming what is missing (the library, the CUDA
/// driver or runtime, a symbol).
pub fn probe(options: &UcclOptions) -> Result<LibraryReport> {
    let (req, src) = options.request();
    library::bind(&req, src).map(|(_, r)| r)
}

fn err<T>(kind: ErrorKind, op: &'static str, msg: impl Into<String>) -> Result<T> {
    Err(Error::new(kind, op, msg))
}

/// Liveness and the control writer of one outbound peer link. Tasks hold this, never
/// the engine connection.
#[derive(Debug)]
struct LinkState {
    dead: CancellationToken,
    why: Mutex<Option<String>>,
    out: mpsc::UnboundedSender<Out>,
    /// The target said its engine accepts connections.
    ready: watch::Sender<bool>,
    /// Confirmations asked for and not yet answered, by request id.
    verifies: confirm::Pending,
    next_verify: std::sync::atomic::AtomicU64,
}

impl LinkState {
    fn kill(&self, why: String) {
        let mut w = self.why.lock().unwrap();
        if w.is_none() {
            tracing::debug!(%why, "UCCL peer link down");
            *w = Some(why);
        }
        drop(w);
        self.dead.cancel();
        // Their transfers fail (the answers will not come).
        self.verifies.lock().unwrap().clear();
    }

    fn why(&self) -> String {
        self.why
            .lock()
            .unwrap()
            .clone()
            .unwrap_or_else(|| "the peer link is closed".into())
    }
}

/// What the control writer sends.
#[derive(Debug)]
enum Out {
    Notif(Bytes, Completer),
    /// A frame that completes nothing when written (a `Verify`).
    Frame(Bytes),
}

/// One connected peer: the control link, and the engine connection once a transfer
/// needed it (closed when the last transfer using it and the peer table let go).
#[derive(Debug)]
struct Link {
    peer: String,
    conn: std::sync::OnceLock<OwnedConn>,
    /// A UCCL connect still running after its caller gave up.
    pending: Mutex<Option<oneshot::Receiver<Result<OwnedConn>>>>,
    state: Arc<LinkState>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.state.kill("the peer link was closed".into());
    }
}

/// A known peer: its connection info, its link once made, and its notification
/// order. A prepared transfer holds its peer's entry, so posting takes only that
/// peer's lock, never the table's.
#[derive(Debug)]
struct PeerEntry {
    name: String,
    info: ConnInfo,
    /// One connect at a time.
    gate: tokio::sync::Mutex<()>,
    /// Notifications go in posting order, whatever order their transfers finish in.
    seq: Arc<nixl::kit::Sequencer<Ready>>,
    slot: Mutex<LinkSlot>,
    /// Cancelled when the entry is closed: a connect in progress stops then.
    closing: CancellationToken,
}

#[derive(Debug, Default)]
struct LinkSlot {
    link: Option<Arc<Link>>,
    /// Why the entry was closed (the peer removed or moved, the agent stopping): no
    /// link is made any more, and uses fail with it.
    closed: Option<String>,
}

impl PeerEntry {
    fn new(name: &str, info: ConnInfo) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            info,
            gate: tokio::sync::Mutex::default(),
            seq: nixl::kit::Sequencer::new(release),
            slot: Mutex::default(),
            closing: CancellationToken::new(),
        })
    }

    /// `f`, unless the entry is closed first: then it fails with why it was closed
    /// (dropping `f` ends what it started).
    async fn unless_closed<T>(
        &self,
        op: &'static str,
        f: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::select! {
            r = f => r,
            () = self.closing.cancelled() => {
                let why = self.slot.lock().unwrap().closed.clone().unwrap_or_default();
                err(ErrorKind::RemoteDisconnected, op, format!("{why} while connecting"))
            }
        }
    }

    /// The link, if it is live; refused once the entry is closed.
    fn live_link(&self, op: &'static str) -> Result<Option<Arc<Link>>> {
        let slot = self.slot.lock().unwrap();
        if let Some(why) = &slot.closed {
            return err(ErrorKind::RemoteDisconnected, op, why.clone());
        }
        Ok(slot
            .link
            .as_ref()
            .filter(|l| !l.state.dead.is_cancelled())
            .cloned())
    }

    /// Close for good: the link's transfers and queued notifications fail now (not
    /// at the stall bound) and its control tasks end; the engine connection closes
    /// when the last operation UCCL accepted lets go.
    fn close(&self, why: String) {
        let link = {
            let mut slot = self.slot.lock().unwrap();
            slot.closed.get_or_insert_with(|| why.clone());
            slot.link.take()
        };
        self.closing.cancel();
        if let Some(l) = link {
            l.state.kill(why);
        }
    }
}

/// A notification ready to go: the message, what completes once it is queued, and
/// the control link it goes on.
type Ready = (Bytes, Completer, Arc<LinkState>);

/// A notification's place in its peer's posting order.
type Ticket = nixl::kit::Ticket<Ready>;

fn release((msg, done, st): Ready) {
    send_notif(&st, msg, done);
}

fn send_notif(st: &LinkState, msg: Bytes, done: Completer) {
    if let Err(mpsc::error::SendError(Out::Notif(_, done))) = st.out.send(Out::Notif(msg, done)) {
        done.complete(Err(Error::new(
            ErrorKind::RemoteDisconnected,
            "uccl notify",
            st.why(),
        )));
    }
}

/// One piece of a transfer, resolved.
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// The local registration and its memory region.
    region: u64,
    mr: u64,
    addr: usize,
    len: usize,
    remote: FifoItem,
    /// The confirmation key of the target's registration it lands in (target ranges
    /// of one registration may be merged for the confirmation; of two, never).
    target_key: u64,
}

/// A posted transfer in the progress thread.
#[derive(Debug)]
struct Job {
    op: Op,
    pieces: Arc<[Piece]>,
    /// Each piece's local memory, for the confirmation.
    locals: Arc<[RegionSlice]>,
    /// Confirm before completing: the worker, where to wait, and for how long.
    confirm: Option<(Confirmer, BackendContext, Duration)>,
    link: Arc<Link>,
    conn: ConnHandle,
    notif: Option<(Bytes, Ticket)>,
    done: Completer,
    issued: usize,
    /// Transfer ids in flight, oldest first, with the piece index.
    inflight: std::collections::VecDeque<u64>,
    started: Instant,
}

#[derive(Debug, Default)]
struct Queue {
    new: Vec<Job>,
    /// The progress thread stopped: nothing reads `new` any more.
    closed: bool,
}

#[derive(Debug, Default)]
struct Progress {
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Progress {
    /// Hand a job to the progress thread; once it stopped, the job fails here (a
    /// post that passed the agent's running check just before shutdown).
    fn push(&self, j: Job) {
        let mut q = self.q.lock().unwrap();
        if q.closed {
            drop(q);
            return j.done.complete(Err(Error::new(
                ErrorKind::ShutDown,
                "uccl transfer",
                "the agent stopped",
            )));
        }
        q.new.push(j);
        drop(q);
        self.cv.notify_one();
    }
}

/// Waits the accept loop does before the engine's first registration.
#[derive(Debug, Default)]
struct AcceptGate {
    registered: Mutex<bool>,
    cv: Condvar,
}

#[derive(Debug)]
struct Started {
    ctx: BackendContext,
    /// The engine; `None` once destroyed (the rest of the state outlives it).
    engine: Mutex<Option<Arc<EngineOwner>>>,
    info: Bytes,
    engine_meta: String,
    progress: Arc<Progress>,
    confirmer: Confirmer,
}

impl Started {
    /// The engine, unless it was destroyed.
    fn owner(&self) -> Result<Arc<EngineOwner>> {
        self.engine.lock().unwrap().clone().ok_or_else(|| {
            Error::new(
                ErrorKind::ShutDown,
                "uccl",
                "the engine was destroyed (the agent shut down)",
            )
        })
    }
}

#[derive(Debug)]
struct Inner {
    options: UcclOptions,
    api: Arc<dyn EngineApi>,
    report: Option<LibraryReport>,
    started: Attachment<Started>,
    /// Registered regions: id to (memory region, the region kept alive).
    regs: Regs,
    /// The entries of the links this backend made and the agent still holds.
    peers: nixl::kit::LinkSet<PeerEntry>,
    gate: Arc<AcceptGate>,
    registered: watch::Sender<bool>,
    /// What the control listener has held for its peers.
    control: Arc<reply::Stats>,
}

/// What nixl-uccl's control listener has held for its peers, since the backend was
/// made ([`UcclBackend::control_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ControlStats {
    /// Most answers owed to one inbound control connection at once: one `Pong`
    /// (however many pings arrived before it was written) and the confirmations
    /// accepted and not yet written (at most 1024; past that the connection is not
    /// read until one is written). A peer that never reads cannot raise it further.
    pub most_answers_owed: usize,
    /// Inbound control connections cut because an answer could not be written
    /// within [`ListenerOptions::dead_peer_timeout`], or stayed unacknowledged that long
    /// (the socket's `TCP_USER_TIMEOUT`): the peer was not reading.
    pub cut_not_reading: u64,
}

/// The UCCL backend. See the [crate docs](crate).
#[derive(Clone, Debug)]
pub struct UcclBackend {
    inner: Arc<Inner>,
}

impl UcclBackend {
    /// Load UCCL (see [`UcclOptions::library`]) with default options.
    ///
    /// # Errors
    /// [`ErrorKind::UnavailableLibrary`] naming what is missing.
    pub fn new() -> Result<Self> {
        Self::with_options(UcclOptions::default())
    }

    /// Load UCCL with `options`.
    ///
    /// # Errors
    /// As [`UcclBackend::new`]; [`ErrorKind::NotSupported`] when the host lacks what
    /// UCCL's transport needs (an RDMA device; NCCL for `UCCL_P2P_TRANSPORT=tcp`),
    /// see [`host::transport_ready`].
    pub fn with_options(options: UcclOptions) -> Result<Self> {
        let (req, src) = options.request();
        let (lib, report) = library::bind(&req, src)?;
        // What would take the process down later is refused now (and again right
        // before each engine is created).
        host::transport_ready(host::Transport::from_env())?;
        Ok(Self::build(lib, Some(report), options))
    }

    /// A backend over another implementation of the engine API: the
    /// `test_double` (feature `test-double`), or an alternative binding.
    pub fn with_api(api: Arc<dyn EngineApi>, options: UcclOptions) -> Self {
        Self::build(api, None, options)
    }

    fn build(api: Arc<dyn EngineApi>, report: Option<LibraryReport>, options: UcclOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                options,
                api,
                report,
                started: Attachment::new("uccl"),
                regs: Regs::default(),
                peers: nixl::kit::LinkSet::default(),
                gate: Arc::default(),
                registered: watch::channel(false).0,
                control: Arc::default(),
            }),
        }
    }

    /// What was loaded, and from where (`None` over [`UcclBackend::with_api`]).
    pub fn library_report(&self) -> Option<&LibraryReport> {
        self.inner.report.as_ref()
    }

    /// What the control listener has held for its peers: the most answers owed to
    /// one connection at once, and connections cut for not reading.
    pub fn control_stats(&self) -> ControlStats {
        use std::sync::atomic::Ordering::Relaxed;
        ControlStats {
            most_answers_owed: self.inner.control.most_owed.load(Relaxed),
            cut_not_reading: self.inner.control.cut_not_reading.load(Relaxed),
        }
    }

    /// The engine's own connection string (`ip:port?gpu`), once started.
    pub fn engine_metadata(&self) -> Option<String> {
        self.inner.started().ok().map(|s| s.engine_meta.clone())
    }
}

impl Inner {
    fn started(&self) -> Result<&Started> {
        self.started.get("uccl")
    }

    fn mark_registered(&self) {
        *self.gate.registered.lock().unwrap() = true;
        self.gate.cv.notify_all();
        self.registered.send_replace(true);
    }

    /// A live link to `e`'s peer, connecting first if needed.
    async fn link(self: &Arc<Self>, e: &PeerEntry) -> Result<Arc<Link>> {
        const OP: &str = "uccl connect";
        if let Some(l) = e.live_link(OP)? {
            return Ok(l);
        }
        let _g = e.gate.lock().await;
        if let Some(l) = e.live_link(OP)? {
            return Ok(l);
        }
        let st = self.started()?;
        let dial = async {
            tokio::time::timeout(
                self.options.listener.connect_timeout,
                self.dial(st, &e.name, &e.info),
            )
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::TimedOut,
                    OP,
                    format!(
                        "connecting to {:?} took longer than {:?}",
                        e.name, self.options.listener.connect_timeout
                    ),
                )
            })?
        };
        let link = e.unless_closed(OP, dial).await?;
        let mut slot = e.slot.lock().unwrap();
        if let Some(why) = &slot.closed {
            // Dropping the new link closes it.
            return err(
                ErrorKind::RemoteDisconnected,
                OP,
                format!("{why} while connecting"),
            );
        }
        slot.link = Some(link.clone());
        Ok(link)
    }

    /// A live link to `e`'s peer with its engine connection, connecting both if
    /// needed.
    async fn data_link(self: &Arc<Self>, e: &PeerEntry) -> Result<Arc<Link>> {
        const OP: &str = "uccl connect";
        let link = self.link(e).await?;
        if link.conn.get().is_some() {
            return Ok(link);
        }
        let (peer, info) = (e.name.as_str(), &e.info);
        let _g = e.gate.lock().await;
        if link.conn.get().is_some() {
            return Ok(link);
        }
        let st = self.started()?;
        let t = self.options.listener.connect_timeout;
        let timed_out = || {
            Error::new(
                ErrorKind::TimedOut,
                OP,
                format!("the engine connection to {peer:?} took longer than {t:?}"),
            )
        };
        let deadline = tokio::time::Instant::now() + t;
        // At most one UCCL connect per link: a connect that outlived an earlier
        // caller's timeout is waited for again, never started twice.
        let pending = link.pending.lock().unwrap().take();
        let mut rx = match pending {
            Some(rx) => rx,
            None => {
                let connect = async {
                    tokio::time::timeout_at(deadline, self.engine_connect(st, &link, peer, info))
                        .await
                        .map_err(|_| timed_out())?
                };
                e.unless_closed(OP, connect).await?
            }
        };
        // Closed meanwhile: the link is dead, so the connection UCCL makes is closed
        // by the thread that makes it (its answer goes nowhere).
        let waited = e.unless_closed(OP, async {
            Ok(tokio::time::timeout_at(deadline, &mut rx).await)
        });
        let conn = match waited.await? {
            Ok(r) => r.map_err(|_| {
                Error::new(ErrorKind::ShutDown, OP, "the agent stopped during connect")
            })??,
            Err(_) => {
                *link.pending.lock().unwrap() = Some(rx);
                return Err(timed_out());
            }
        };
        // Only one connect runs per peer (the gate), so this sets it; were it set
        // already, the new connection would just be closed again.
        let _ = link.conn.set(conn);
        Ok(link)
    }

    /// Wait for the target's Ready, then start UCCL's connect on an agent-owned thread.
    async fn engine_connect(
        &self,
        st: &Started,
        link: &Link,
        peer: &str,
        info: &ConnInfo,
    ) -> Result<oneshot::Receiver<Result<OwnedConn>>> {
        const OP: &str = "uccl connect";
        let (ip, port, gpu) = info.engine_endpoint().ok_or_else(|| {
            Error::new(
                ErrorKind::Corrupt,
                OP,
                format!(
                    "{peer:?}'s engine address {:?} is not ip:port?gpu",
                    info.engine
                ),
            )
        })?;
        // The target says Ready once its engine accepts (after its first
        // registration): UCCL's connect would block until then, uncancellably.
        let mut ready = link.state.ready.subscribe();
        tokio::select! {
            r = ready.wait_for(|r| *r) => { r.map_err(|_| Error::new(ErrorKind::RemoteDisconnected, OP, link.state.why()))?; }
            _ = link.state.dead.cancelled() => return err(ErrorKind::RemoteDisconnected, OP, link.state.why()),
        }
        let (tx, rx) = oneshot::channel::<Result<OwnedConn>>();
        let owner = st.owner()?;
        st.ctx.spawn_thread(
            "uccl-connect",
            move |_stop| {
                let r = owner.connect(&ip, &gpu, port);
                // Nobody waiting any more (timed out, shut down) drops it: closed.
                let _ = tx.send(r);
            },
            || {},
        )?;
        Ok(rx)
    }

    /// The control handshake.
    async fn dial(&self, st: &Started, peer: &str, info: &ConnInfo) -> Result<Arc<Link>> {
        const OP: &str = "uccl connect";
        let gone = |e: std::io::Error| {
            Error::new(
                ErrorKind::RemoteDisconnected,
                OP,
                format!("control connection to {peer:?} ({}): {e}", info.control),
            )
        };
        let ends = nixl::control::Ends {
            protocol: CONTROL_PROTOCOL,
            secret: st.ctx.secret.as_ref(),
            me: &st.ctx.agent_name,
        };
        // A live target may hold this connection back up to the hold bound; a dead
        // one shows by its silence (the reader's liveness bound).
        let o = &self.options;
        let dead = o.hold_timeout.max(o.listener.dead_peer_timeout);
        let mut stream = nixl::control::dial(
            OP,
            ends,
            peer,
            &info.control,
            dead,
            o.listener.connect_timeout,
        )
        .await?;
        stream
            .write_all(&Frame::Hello(st.ctx.agent_name.clone()).encode())
            .await
            .map_err(gone)?;
        let answer = wire::read_frame(&mut stream).await.map_err(gone)?;
        control::on_hello_ack(peer, &info.control, answer)?;
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let state = Arc::new(LinkState {
            dead: st.ctx.cancel.child_token(),
            why: Mutex::new(None),
            out: out_tx,
            ready: watch::channel(false).0,
            verifies: confirm::Pending::default(),
            next_verify: std::sync::atomic::AtomicU64::new(0),
        });
        let (rd, wr) = stream.into_split();
        st.ctx.spawn(control_reader(
            rd,
            state.clone(),
            self.options.listener.dead_peer_timeout,
            peer.to_owned(),
        ));
        // Not `ctx.spawn`: cancelling the agent must not drop the writer before it
        // fails what is queued with the link's reason (it ends on `state.dead`, a
        // child of the agent's token).
        st.ctx.tracker.spawn(control_writer(
            wr,
            state.clone(),
            out_rx,
            self.options.listener.dead_peer_timeout,
            self.options
                .hold_timeout
                .max(self.options.listener.dead_peer_timeout),
        ));
        Ok(Arc::new(Link {
            peer: peer.to_owned(),
            conn: std::sync::OnceLock::new(),
            pending: Mutex::new(None),
            state,
        }))
    }

    fn post_job(
        self: &Arc<Self>,
        peer: Arc<PeerEntry>,
        op: Op,
        (pieces, locals): (Arc<[Piece]>, Arc<[RegionSlice]>),
        notif: Option<Bytes>,
        done: Completer,
    ) {
        let st = match self.started() {
            Ok(s) => s,
            Err(e) => return done.complete(Err(e)),
        };
        let confirm = self.options.confirm.then(|| {
            (
                st.confirmer.clone(),
                st.ctx.clone(),
                self.options.stall_timeout,
            )
        });
        let notif = notif.map(|m| (m, peer.seq.ticket()));
        let live = match peer.live_link("uccl post") {
            Ok(l) => l,
            Err(e) => return done.complete(Err(e)),
        };
        if let Some(link) = live.filter(|l| l.conn.get().is_some()) {
            st.progress
                .push(Job::new(op, (pieces, locals), confirm, link, notif, done));
            return;
        }
        let inner = self.clone();
        let progress = st.progress.clone();
        // Dropped (and `done` with it: Canceled) if the agent stops first.
        st.ctx.spawn(async move {
            match inner.data_link(&peer).await {
                Ok(link) => {
                    progress.push(Job::new(op, (pieces, locals), confirm, link, notif, done))
                }
                Err(e) => done.complete(Err(e)),
            }
        });
    }
}

impl Job {
    fn new(
        op: Op,
        (pieces, locals): (Arc<[Piece]>, Arc<[RegionSlice]>),
        confirm: Option<(Confirmer, BackendContext, Duration)>,
        link: Arc<Link>,
        notif: Option<(Bytes, Ticket)>,
        done: Completer,
    ) -> Self {
        let conn = link
            .conn
            .get()
            .expect("a data link has its engine connection")
            .conn;
        Self {
            op,
            pieces,
            locals,
            confirm,
            link,
            conn,
            notif,
            done,
            issued: 0,
            inflight: Default::default(),
            started: Instant::now(),
        }
    }
}

/// Initiator side: reads Pongs; a silent, closed or broken connection kills the link.
async fn control_reader(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    state: Arc<LinkState>,
    liveness: Duration,
    peer: String,
) {
    loop {
        tokio::select! {
            _ = state.dead.cancelled() => return,
            r = tokio::time::timeout(liveness, wire::read_frame(&mut rd)) => match r {
                Err(_) => return state.kill(format!("{peer:?} was silent for {liveness:?} on the control connection")),
                Ok(Ok(read)) => match control::at_initiator(&peer, read) {
                    AtInitiator::Ready => {
                        state.ready.send_replace(true);
                    }
                    AtInitiator::Verified { id, digest } => {
                        if let Some(tx) = state.verifies.lock().unwrap().remove(&id) {
                            let _ = tx.send(digest);
                        }
                    }
                    AtInitiator::Nothing => {}
                    AtInitiator::Dead(why) => return state.kill(why),
                },
                Ok(Err(e)) => return state.kill(format!("control connection to {peer:?}: {e}")),
            },
        }
    }
}

/// Initiator side: notifications in completion order, and pings (at a third of the
/// liveness bound). Each frame is written within `hold` (the target, alive as the
/// reader sees, may hold this connection back that long), or the link is dead.
async fn control_writer(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<LinkState>,
    mut rx: mpsc::UnboundedReceiver<Out>,
    liveness: Duration,
    hold: Duration,
) {
    let mut tick = tokio::time::interval((liveness / 3).max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = state.dead.cancelled() => break,
            _ = tick.tick() => {
                if let Err(e) = write_unless_dead(&mut wr, &Frame::Ping.encode(), hold, &state).await {
                    state.kill(format!("control connection: {e}"));
                    break;
                }
            }
            m = rx.recv() => match m {
                None => break,
                Some(Out::Frame(f)) => {
                    if let Err(e) = write_unless_dead(&mut wr, &f, hold, &state).await {
                        state.kill(format!("control connection: {e}"));
                        break;
                    }
                }
                Some(Out::Notif(msg, done)) => {
                    let r = write_unless_dead(&mut wr, &Frame::Notif(msg).encode(), hold, &state).await;
                    match r {
                        Ok(()) => done.complete(Ok(())),
                        Err(e) => {
                            state.kill(format!("control connection: {e}"));
                            done.complete(Err(Error::new(ErrorKind::RemoteDisconnected, "uccl notify", state.why())));
                            break;
                        }
                    }
                }
            },
        }
    }
    // Fail what is still queued. `recv` after `close` returns `None` only once every
    // message a sender counted is taken; `try_recv` would miss one whose send raced
    // the close (counted, not yet written), leaving its notification waiting until the
    // link is dropped.
    rx.close();
    while let Some(o) = rx.recv().await {
        if let Out::Notif(_, done) = o {
            done.complete(Err(Error::new(
                ErrorKind::RemoteDisconnected,
                "uccl notify",
                state.why(),
            )));
        }
    }
}

/// [`write_within`], ending early when the link dies: a write the peer holds back (it
/// does not read) must not keep a removed or moved peer's queued notifications from
/// failing until `deadline`.
async fn write_unless_dead(
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    b: &[u8],
    deadline: Duration,
    state: &LinkState,
) -> std::io::Result<()> {
    tokio::select! {
        _ = state.dead.cancelled() => Err(std::io::Error::other("the link is down")),
        r = write_within(w, b, deadline) => r,
    }
}

/// Write all of `b` within `deadline`; past it, an error of kind `TimedOut` (the
/// peer is not reading: its window stayed closed).
async fn write_within<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    b: &[u8],
    deadline: Duration,
) -> std::io::Result<()> {
    match tokio::time::timeout(deadline, w.write_all(b)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("a control frame could not be written within {deadline:?}"),
        )),
    }
}

/// Send buffer of an inbound control connection, in bytes (the kernel doubles it):
/// what the target writes there is small answers only.
const CONTROL_SEND_BUFFER: usize = 16 * 1024;

/// The control connection's name in the authentication ([`nixl::control`]).
const CONTROL_PROTOCOL: &str = "nixl-uccl control";

/// Target side: one inbound control connection. Its caller drops this future when
/// the connection is closed (to admit a newer one, or as the agent stops).
async fn serve_control(
    incoming: nixl::control::Incoming,
    ctx: BackendContext,
    mut registered: watch::Receiver<bool>,
    listener: ListenerOptions,
    confirmer: Confirmer,
    stats: Arc<reply::Stats>,
) {
    let nixl::control::Incoming {
        mut stream,
        from,
        mut ticket,
        ..
    } = incoming;
    let liveness = listener.dead_peer_timeout;
    // Only small answers go this way (hello, Ready, Pong, Verified): a small send
    // buffer bounds the kernel memory a peer that never reads can pin, and fills
    // after kilobytes of answers, not megabytes, so the write deadline cuts it soon.
    let _ = socket2::SockRef::from(&stream).set_send_buffer_size(CONTROL_SEND_BUFFER);
    let (me, sink, secret) = (
        ctx.agent_name.clone(),
        ctx.notifications.clone(),
        ctx.secret.clone(),
    );
    // The agent's secret first, where set: nothing is answered or kept for a peer
    // that does not prove it.
    let peer = format!("UCCL control connection from {from}");
    let ends = nixl::control::Ends {
        protocol: CONTROL_PROTOCOL,
        secret: secret.as_ref(),
        me: &me,
    };
    // One bound for the whole handshake: authentication and hello.
    let deadline = tokio::time::Instant::now() + listener.handshake_timeout;
    // A peer whose host dies, or that stops reading (a zero window), is cut within
    // the liveness bound by the kernel too, not only by the write deadline below.
    let auth = nixl::control::answer(
        &mut stream,
        ends,
        from,
        liveness,
        listener.handshake_timeout,
    )
    .await;
    let auth = match auth {
        Ok(nixl::control::Authenticated::Missing) => {
            tracing::info!(%from, "UCCL control: refused a connection that did not prove the shared secret");
            return;
        }
        Err(e) => {
            tracing::info!(%from, error = %e, "UCCL control: authentication failed");
            return;
        }
        Ok(a) => a,
    };
    let (rd, mut wr) = stream.into_split();
    // Small frames (pings) are read many at a time, not one system call each.
    let mut rd = tokio::io::BufReader::new(rd);
    // Before the hello, only a hello-sized frame is read.
    let hello =
        tokio::time::timeout_at(deadline, wire::read_frame_max(&mut rd, control::MAX_HELLO)).await;
    let Some(name) = hello
        .ok()
        .and_then(Result::ok)
        .and_then(control::hello_name)
    else {
        tracing::debug!(%from, "UCCL control: no hello");
        return;
    };
    if let Err(e) = auth.check_hello(&name, "uccl accept", &peer) {
        // Its notifications would carry a name it did not prove.
        tracing::info!(%from, error = %e, "UCCL control: refused");
        return;
    }
    if !ticket.establish_with(matches!(auth, nixl::control::Authenticated::As(_))) {
        tracing::info!(%from, "UCCL control: too many peers connected (UcclOptions::listener.max_incoming_connections)");
        return;
    }
    if write_within(&mut wr, &Frame::HelloAck(me).encode(), liveness)
        .await
        .is_err()
    {
        return;
    }
    // What is owed to the peer, bounded however it behaves (see `reply`): one Pong
    // however many Pings, a bounded number of confirmations.
    let replies = reply::Replies::new(confirm::MAX_QUEUED, stats.clone());
    let owed = replies.clone();
    let (cut_by_writer, cut_by_reader) = (replies.clone(), replies.clone());
    // Pongs from the start; Ready once this agent has registered memory (its engine
    // accepts only then), whenever that is. Each frame is written within the
    // liveness bound, or the peer (which is not reading) is cut.
    let writer = async move {
        let mut ready_sent = false;
        loop {
            let frame = tokio::select! {
                r = registered.wait_for(|r| *r), if !ready_sent => match r {
                    Ok(_) => {
                        ready_sent = true;
                        Frame::Ready
                    }
                    Err(_) => return,
                },
                f = owed.next() => f,
            };
            if let Err(e) = write_within(&mut wr, &frame.encode(), liveness).await {
                cut_by_writer.cut_if_not_reading(&e, from);
                return;
            }
        }
    };
    // The initiator pings only once connected, which may take up to its connect
    // timeout after the hello; allow for that.
    let silence = liveness + listener.connect_timeout;
    let reader = async move {
        loop {
            // Each frame counts against the task's budget: a flood of small frames
            // (read many per system call) still yields to the other tasks.
            tokio::task::consume_budget().await;
            let frame = tokio::time::timeout(silence, wire::read_frame(&mut rd)).await;
            // Every frame is activity: a live peer pings, so only a connection whose
            // peer went quiet may give its place to a newcomer.
            ticket.touch();
            let frame = match frame {
                Ok(Ok(Some(f))) => control::at_target(f),
                // The kernel's user timeout (our answers unacknowledged, a zero
                // window) shows here when the reader notices first.
                Ok(Err(e)) => return cut_by_reader.cut_if_not_reading(&e, from),
                _ => return,
            };
            match frame {
                // Waits for room in the agent's queue, not reading this connection
                // meanwhile (back-pressure on this peer alone), nothing dropped.
                AtTarget::Deliver(m) => {
                    let _working = ticket.working();
                    if held_back(&sink, &name, m, &replies, liveness)
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                AtTarget::Pong => replies.ping(),
                AtTarget::Verify { id, ranges } => {
                    // Back-pressure: nothing more is read until there is room.
                    replies.accept_verify().await;
                    let w = Work::Remote {
                        id,
                        ranges,
                        reply: replies.clone(),
                    };
                    if confirmer.submit(w).is_err() {
                        return;
                    }
                }
                AtTarget::Close => {
                    tracing::debug!(peer = %name, "UCCL control: unexpected frame");
                    return;
                }
            }
        }
    };
    // The writer is a task of its own, so a reader kept busy (a flood of frames)
    // never starves it: answers go out as they are owed, and a peer that does not
    // read them fills its window and is cut by the write deadline. Either ending
    // ends the other (and the connection with both halves).
    let done = ctx.cancel.child_token();
    let writer_done = done.clone();
    ctx.spawn(async move {
        let _end = writer_done.clone().drop_guard();
        tokio::select! {
            _ = writer_done.cancelled() => {}
            _ = writer => {}
        }
    });
    let _end = done.clone().drop_guard();
    tokio::select! {
        _ = done.cancelled() => {}
        _ = reader => {}
    }
}

/// Deliver a notification, waiting for room in the agent's queue (so the connection
/// it came on is not read meanwhile), with a PONG every third of `liveness` while it
/// waits: the initiator, whose PINGs go unread, must not take the silence for a dead
/// peer. Fails only when the agent stopped.
async fn held_back(
    sink: &nixl::NotificationSink,
    name: &str,
    msg: Bytes,
    replies: &reply::Replies,
    liveness: Duration,
) -> Result<()> {
    let every = (liveness / 3).max(Duration::from_millis(10));
    let mut delivery = std::pin::pin!(sink.deliver_async(name, msg));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            r = &mut delivery => return r,
            // A Pong owed, as if pinged: the initiator's pings stop while its
            // writer is held back, and it must not count this target dead.
            _ = tick.tick() => replies.ping(),
        }
    }
}

/// Operations of a failed transfer that the engine accepted and never reported done.
/// UCCL cannot cancel them, so the progress thread keeps polling them, keeping their
/// connection open and their registrations' memory regions (and memory) alive until
/// they are done, and their registrations counted in flight: the agent refuses to
/// deregister memory the engine may still write or read.
#[derive(Debug)]
struct Zombie {
    link: Arc<Link>,
    conn: ConnHandle,
    ids: std::collections::VecDeque<u64>,
    regions: Vec<u64>,
    /// Dropped after `regions` are released (the zombie with it), so a deregistration
    /// that sees the count at zero finds the memory regions free to destroy.
    _holds: Vec<nixl::InFlightHold>,
}

impl Zombie {
    fn owner(&self) -> &EngineOwner {
        &self
            .link
            .conn
            .get()
            .expect("a zombie had a connection")
            .owner
    }
}

/// The progress thread: issues pieces, polls the engine, finishes transfers.
fn progress_loop(
    p: Arc<Progress>,
    stop: CancellationToken,
    api: Arc<dyn EngineApi>,
    opts: UcclOptions,
) {
    if let Err(e) = api.bind_thread(opts.device) {
        tracing::warn!(%e, "uccl-progress: no CUDA context on this thread");
    }
    let mut active: Vec<Job> = Vec::new();
    let mut zombies: Vec<Zombie> = Vec::new();
    // Operations in the engine, across all transfers: UCCL's queues are finite and a
    // full one makes its post spin (with completions only collected by our polls).
    let mut outstanding = 0usize;
    let mut idle_rounds = 0u32;
    loop {
        {
            let mut q = p.q.lock().unwrap();
            if active.is_empty() && zombies.is_empty() {
                while q.new.is_empty() && !stop.is_cancelled() {
                    q = p.cv.wait(q).unwrap();
                }
            } else if q.new.is_empty() && (idle_rounds > 64 || active.is_empty()) {
                // In flight but nothing moved for a while (or only abandoned
                // operations left): back off, still waking at once for new work.
                let pause = if active.is_empty() {
                    Duration::from_millis(10)
                } else if idle_rounds > 4096 {
                    Duration::from_millis(1)
                } else {
                    Duration::from_micros(50)
                };
                q = p.cv.wait_timeout(q, pause).unwrap().0;
            }
            active.append(&mut q.new);
            if stop.is_cancelled() {
                // Under the queue's lock: a push after this fails by itself.
                q.closed = true;
                break;
            }
        }
        let mut moved = false;
        let mut i = 0;
        while i < active.len() {
            match step(&mut active[i], api.as_ref(), &opts, &mut outstanding) {
                Step::Pending(m) => {
                    moved |= m;
                    i += 1;
                }
                Step::Finished(r) => {
                    moved = true;
                    let mut j = active.swap_remove(i);
                    if !j.inflight.is_empty() {
                        zombies.push(zombie(&mut j));
                    }
                    finish(j, r);
                }
            }
        }
        zombies.retain_mut(|z| {
            while let Some(&id) = z.ids.front() {
                // An engine that cannot answer keeps the operation (and its memory).
                if !api.done(z.conn, id).unwrap_or(false) {
                    return true;
                }
                z.ids.pop_front();
                outstanding -= 1;
            }
            z.owner().release(&z.regions);
            false
        });
        idle_rounds = if moved {
            0
        } else {
            idle_rounds.saturating_add(1)
        };
        if !moved && idle_rounds <= 64 && !active.is_empty() {
            std::thread::yield_now();
        }
    }
    for mut j in active {
        if !j.inflight.is_empty() {
            zombies.push(zombie(&mut j));
        }
        j.done.complete(Err(Error::new(
            ErrorKind::ShutDown,
            "uccl transfer",
            "the agent stopped",
        )));
    }
    // Give operations still in the engine a moment to be reported done (a flush
    // after the peer went away), then give up on them.
    let until = Instant::now() + ABANDON_GRACE;
    while !zombies.is_empty() && Instant::now() < until {
        zombies.retain_mut(|z| {
            while let Some(&id) = z.ids.front() {
                if !api.done(z.conn, id).unwrap_or(false) {
                    return true;
                }
                z.ids.pop_front();
            }
            z.owner().release(&z.regions);
            false
        });
        if !zombies.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for z in zombies {
        // Never seen done: the engine may still use that memory.
        tracing::warn!(
            peer = %z.link.peer,
            operations = z.ids.len(),
            "UCCL operations never reported done; the engine and their memory are left alive"
        );
        z.owner()
            .poisoned
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

/// How long a stopping progress thread still polls operations of failed transfers.
const ABANDON_GRACE: Duration = Duration::from_millis(500);

/// Take a failed job's operations still in the engine, and hold their registrations:
/// their memory regions in the engine, and their count in flight in the agent (taken
/// before the job completes, so the count never lapses while the engine may still
/// touch the memory).
fn zombie(j: &mut Job) -> Zombie {
    let mut regions: Vec<u64> = j.pieces.iter().map(|p| p.region).collect();
    regions.sort_unstable();
    regions.dedup();
    let mut holds: Vec<nixl::InFlightHold> = Vec::with_capacity(regions.len());
    let mut held: Vec<u64> = Vec::with_capacity(regions.len());
    for l in j.locals.iter() {
        if let Err(at) = held.binary_search(&l.id()) {
            held.insert(at, l.id());
            holds.push(l.region().hold_in_flight());
        }
    }
    let z = Zombie {
        link: j.link.clone(),
        conn: j.conn,
        ids: std::mem::take(&mut j.inflight),
        regions,
        _holds: holds,
    };
    z.owner().hold(&z.regions);
    z
}

enum Step {
    Pending(bool),
    Finished(Result<()>),
}

/// Advance one job: retire done pieces in order, issue more up to the window (and the
/// global bound), check liveness and the stall bound.
fn step(j: &mut Job, api: &dyn EngineApi, opts: &UcclOptions, outstanding: &mut usize) -> Step {
    const OP: &str = "uccl transfer";
    let mut moved = false;
    if j.issued == 0 && j.done.is_canceled() {
        return Step::Finished(Err(Error::new(
            ErrorKind::Canceled,
            OP,
            "dropped before it started",
        )));
    }
    if j.link.state.dead.is_cancelled() {
        return Step::Finished(Err(Error::new(
            ErrorKind::RemoteDisconnected,
            OP,
            j.link.state.why(),
        )));
    }
    while let Some(&id) = j.inflight.front() {
        match api.done(j.conn, id) {
            Ok(true) => {}
            Ok(false) => break,
            // The operation stays in flight (a zombie now): never assumed done.
            Err(e) => return Step::Finished(Err(e)),
        }
        j.inflight.pop_front();
        *outstanding -= 1;
        moved = true;
    }
    while j.issued < j.pieces.len()
        && j.inflight.len() < opts.window.max(1)
        && *outstanding < opts.max_outstanding.max(1)
    {
        let pc = j.pieces[j.issued];
        // The piece lies in registration `mr` (checked by the agent and at prepare).
        let r = j
            .link
            .conn
            .get()
            .expect("a data link has its engine connection")
            .start(j.op, pc.mr, pc.addr, pc.len, pc.remote);
        match r {
            Ok(id) => {
                j.inflight.push_back(id);
                j.issued += 1;
                *outstanding += 1;
                moved = true;
            }
            Err(e) => return Step::Finished(Err(e)),
        }
    }
    if j.issued == j.pieces.len() && j.inflight.is_empty() {
        return Step::Finished(Ok(()));
    }
    if j.started.elapsed() > opts.stall_timeout {
        return Step::Finished(Err(Error::new(
            ErrorKind::TimedOut,
            OP,
            format!(
                "not done after {:?} (peer {:?})",
                opts.stall_timeout, j.link.peer
            ),
        )));
    }
    Step::Pending(moved)
}

fn finish(mut j: Job, r: Result<()>) {
    match (r, j.confirm.take()) {
        (Ok(()), Some(c)) => confirm_then_complete(j, c),
        (r, _) => complete(j, r),
    }
}

/// Ask the target to confirm `j` (see `verify`) and hand its own side's digests to
/// the worker, which completes `j` once the answers agree, or fails it.
fn confirm_then_complete(j: Job, (confirmer, ctx, timeout): (Confirmer, BackendContext, Duration)) {
    use std::sync::atomic::Ordering;
    // Only what completing needs is kept, not the link: its engine connection must
    // be free to close (an agent stopping meanwhile destroys its engine).
    let Job {
        pieces,
        locals,
        link,
        notif,
        done,
        ..
    } = j;
    let st = link.state.clone();
    drop(link);
    let spans = pieces
        .iter()
        .zip(locals.iter())
        .map(|(p, l)| (l.clone(), (p.target_key, p.remote.addr), p.len as u64));
    let mut groups = Vec::new();
    for g in verify::groups(spans) {
        let id = st.next_verify.fetch_add(1, Ordering::Relaxed);
        let answer = confirm::Answer::expect(&st.verifies, id);
        let frame = Frame::Verify {
            id,
            ranges: g.remote,
        }
        .encode();
        // A link killed before the insertion cleared the table already.
        if st.dead.is_cancelled() || st.out.send(Out::Frame(frame)).is_err() {
            let e = Error::new(ErrorKind::RemoteDisconnected, "uccl transfer", st.why());
            return settle(notif, done, &st, Err(e));
        }
        groups.push((g.local, answer));
    }
    let state = st.clone();
    let w = Work::Local {
        groups,
        ctx,
        timeout,
        then: Box::new(move |r| settle(notif, done, &state, r)),
    };
    if let Err(w) = confirmer.submit(w) {
        let Work::Local { then, .. } = *w else {
            unreachable!("given back what was sent")
        };
        then(Err(Error::new(
            ErrorKind::ShutDown,
            "uccl transfer",
            "the agent stopped before the transfer was confirmed",
        )));
    }
}

fn complete(j: Job, r: Result<()>) {
    settle(j.notif, j.done, &j.link.state, r);
}

/// A finished transfer: its notification goes in its turn (after success), then it
/// completes; a failed one gives its notification's place up (the ticket drops).
fn settle(notif: Option<(Bytes, Ticket)>, done: Completer, state: &Arc<LinkState>, r: Result<()>) {
    match (r, notif) {
        (Ok(()), Some((msg, t))) => t.release((msg, done, state.clone())),
        (r, _) => done.complete(r),
    }
}

/// A registration's metadata blob: UCCL's `FifoItem`, then the registration's
/// confirmation key (`u64`, little-endian; see `verify`).
const BLOB_LEN: usize = api::FIFO_ITEM_LEN + 8;

fn decode_blob(blob: &[u8]) -> Option<(FifoItem, u64)> {
    if blob.len() != BLOB_LEN {
        return None;
    }
    let (fifo, key) = blob.split_at(api::FIFO_ITEM_LEN);
    Some((
        FifoItem::decode(fifo)?,
        u64::from_le_bytes(key.try_into().ok()?),
    ))
}

/// nixl-uccl's link to a peer: the peer's entry (connection info, control link,
/// notification order), with the backend that connects it.
#[derive(Debug)]
struct UcclLink {
    inner: Arc<Inner>,
    entry: Arc<PeerEntry>,
}

#[async_trait]
impl PeerLink for UcclLink {
    async fn connect(&self) -> Result<()> {
        self.inner.link(&self.entry).await.map(|_| ())
    }

    fn notify(&self, msg: Bytes, done: Completer) {
        const OP: &str = "uccl notify";
        let st = match self.inner.started() {
            Ok(s) => s,
            Err(e) => return done.complete(Err(e)),
        };
        let live = match self.entry.live_link(OP) {
            Ok(l) => l,
            Err(e) => return done.complete(Err(e)),
        };
        let t = self.entry.seq.ticket();
        if let Some(l) = live {
            return t.release((msg, done, l.state.clone()));
        }
        let (inner, peer) = (self.inner.clone(), self.entry.clone());
        st.ctx.spawn(async move {
            match inner.link(&peer).await {
                Ok(l) => t.release((msg, done, l.state.clone())),
                Err(e) => done.complete(Err(e)),
            }
        });
    }

    fn failed(&self) -> bool {
        // A dead control link is dialled again at the next use.
        false
    }

    fn close(&self, why: &str) {
        // In-flight transfers fail at their next poll; the engine connection closes
        // when the last of them lets go.
        self.entry.close(format!("{:?}: {why}", self.entry.name));
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// A prepared transfer.
#[derive(Debug)]
struct Prepared {
    inner: Arc<Inner>,
    peer: Arc<PeerEntry>,
    op: Op,
    pieces: Arc<[Piece]>,
    locals: Arc<[RegionSlice]>,
    /// Keeps the plan's regions alive (the agent does too, per post).
    _plan: TransferPlan,
}

impl PreparedTransfer for Prepared {
    fn post(&self, notif: Option<Bytes>, done: Completer) {
        self.inner.post_job(
            self.peer.clone(),
            self.op,
            (self.pieces.clone(), self.locals.clone()),
            notif,
            done,
        );
    }
}

impl UcclBackend {
    /// Create the engine and start its threads and control listener: the state
    /// [`Backend::start`] keeps.
    async fn start_engine(&self, ctx: BackendContext) -> Result<Started> {
        let ctx = ctx.with_own_secret(self.inner.options.listener.secret.as_ref());
        const OP: &str = "start uccl";
        let inner = &self.inner;
        // Creating an engine initialises the NIC and GPU and may take a while: on an
        // agent-owned thread that ends right after (not tokio's blocking pool, whose
        // idle threads would outlive the agent).
        let (api, device) = (inner.api.clone(), inner.options.device);
        let (tx, rx) = oneshot::channel::<Result<NewEngine>>();
        ctx.spawn_thread(
            "uccl-create",
            move |_stop| {
                // Nobody waiting any more (the agent stopped) drops it: destroyed.
                let _ = tx.send(NewEngine::create(api, device));
            },
            || {},
        )?;
        let engine = rx.await.map_err(|_| {
            Error::new(
                ErrorKind::Backend,
                OP,
                "engine creation ended without a result",
            )
        })??;
        let owner = Arc::new(EngineOwner::new(engine));
        let engine_meta = owner.api.metadata(owner.engine)?;
        let engine_ip = engine_meta
            .split_once('?')
            .and_then(|(a, _)| a.rsplit_once(':'))
            .map(|(ip, _)| ip.trim_start_matches('[').trim_end_matches(']').to_owned());
        let at = match (inner.options.listener.listen, engine_ip.as_deref().map(str::parse::<IpAddr>)) {
            (Some(at), _) => at,
            (None, Some(Ok(ip))) => SocketAddr::new(ip, 0),
            _ => {
                return err(ErrorKind::Backend, OP, format!("cannot tell the engine's address from {engine_meta:?}; set UcclOptions::listener.listen"))
            }
        };
        let bound = inner.options.listener.bind(at, OP).await?;
        let (listener, control) = (bound.listener, bound.advertised);
        let info = ConnInfo {
            control: control.to_string(),
            engine: engine_meta.clone(),
        }
        .encode();

        // The accept loop: never enters UCCL's accept before the first registration.
        let gate = inner.gate.clone();
        let wake_gate = gate.clone();
        let acc_owner = owner.clone();
        // The wake holds the engine only while something else does (a wake may be
        // dropped on any thread once its loop ended).
        let wake_owner = Arc::downgrade(&owner);
        ctx.spawn_thread(
            "uccl-accept",
            move |stop| accept_loop(&acc_owner, &gate, &stop),
            move || {
                // Take the lock so a loop between its check and its wait sees the wake.
                drop(wake_gate.registered.lock().unwrap());
                wake_gate.cv.notify_all();
                if let Some(o) = wake_owner.upgrade() {
                    o.api.stop_accept(o.engine);
                }
            },
        )?;

        let progress = Arc::new(Progress::default());
        let (p, papi, popts) = (progress.clone(), inner.api.clone(), inner.options.clone());
        let wake_p = progress.clone();
        ctx.spawn_thread(
            "uccl-progress",
            move |stop| progress_loop(p, stop, papi, popts),
            move || {
                drop(wake_p.q.lock().unwrap());
                wake_p.cv.notify_all();
            },
        )?;

        let confirmer = Confirmer::start(&ctx, inner.regs.clone())?;
        let started_confirmer = confirmer.clone();

        // The control listener.
        let listener_options = inner.options.listener.clone();
        let registered = inner.registered.subscribe();
        let stats = inner.control.clone();
        let spawn_ctx = ctx.clone();
        let admission = inner.options.listener.admission();
        nixl::control::spawn_accept_loop(
            "uccl",
            listener,
            admission,
            &ctx.tracker,
            ctx.cancel.clone(),
            move |c| {
                // Dropped at once when the agent stops or the admission closes it.
                let close = c.close.clone();
                let serve = serve_control(
                    c,
                    spawn_ctx.clone(),
                    registered.clone(),
                    listener_options.clone(),
                    confirmer.clone(),
                    stats.clone(),
                );
                nixl::control::until_closed(close, serve)
            },
        );

        Ok(Started {
            ctx,
            engine: Mutex::new(Some(owner)),
            info,
            engine_meta,
            progress,
            confirmer: started_confirmer,
        })
    }
}

#[async_trait]
impl Backend for UcclBackend {
    fn name(&self) -> &str {
        "uccl"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::between_agents(MAX_NOTIFICATION)
    }

    fn unsupported_reason(&self, _kind: MemKind) -> Option<String> {
        // Host and GPU memory both register (the engine's errors say why not).
        None
    }

    fn alloc(&self, _len: usize) -> Option<Result<nixl::Memory>> {
        // UCCL reaches ordinary registered memory as fast as any.
        None
    }

    fn nixl(&self) -> Option<&dyn nixl::NixlDialect> {
        // NIXL's UCCL plugin speaks UCCL's own connection setup, not this crate's
        // control protocol.
        None
    }

    async fn start(&self, ctx: BackendContext) -> Result<()> {
        const OP: &str = "start uccl";
        let inner = &self.inner;
        inner.started.attach(OP, self.start_engine(ctx)).await?;
        // Memory registered before start (not possible through the agent, but cheap to
        // honour) already counts.
        if !inner.regs.lock().unwrap().is_empty() {
            inner.mark_registered();
        }
        Ok(())
    }

    fn connection_info(&self) -> Bytes {
        self.inner
            .started()
            .map(|s| s.info.clone())
            .unwrap_or_default()
    }

    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        const OP: &str = "uccl register";
        if region.kind() != MemKind::Dram {
            nixl::gpu::status()
                .map_err(|e| Error::new(e.kind(), OP, format!("{} memory: {e}", region.kind())))?;
        }
        let st = self.inner.started()?;
        let o = st.owner()?;
        // The owner keeps `region` until it destroyed the memory region.
        let register = || o.register(region);
        let (mr, fifo) = match region.kind() {
            // The engine's CUDA calls (pointer attributes, dma-buf export) run on this
            // thread, in the device's primary context; the thread's own comes back.
            MemKind::Vram { device } => nixl::gpu::with_context(device, register)?,
            MemKind::Dram => register()?,
            MemKind::File { .. } => {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    "register memory",
                    "uccl does not take files",
                ))
            }
        };
        let key = self.inner.regs.lock().unwrap().insert(mr, region.clone());
        self.inner.mark_registered();
        let mut blob = Vec::with_capacity(BLOB_LEN);
        blob.extend_from_slice(&fifo.encode());
        blob.extend_from_slice(&key.to_le_bytes());
        Ok(Bytes::from(blob))
    }

    fn deregister(&self, region_id: u64) -> Result<()> {
        let removed = self.inner.regs.lock().unwrap().remove(region_id);
        let Some((_mr, _region)) = removed else {
            return err(
                ErrorKind::NotFound,
                "uccl deregister",
                format!("region {region_id} is not registered"),
            );
        };
        // The owner keeps the memory until its region is destroyed: now, since the
        // agent refuses to deregister while operations of a failed transfer are
        // still in the engine (they hold the registration in flight); later only
        // for operations given up on at shutdown, said here, never hidden.
        let Ok(owner) = self.inner.started().and_then(Started::owner) else {
            return Ok(());
        };
        match owner.deregister(region_id) {
            Deregistered::Destroyed | Deregistered::Unknown => Ok(()),
            Deregistered::Deferred => err(
                ErrorKind::Backend,
                "uccl deregister",
                format!("registration {region_id}: operations of a failed transfer that the engine never reported done still use it; its memory region stays registered, and its memory allocated, until they are"),
            ),
        }
    }

    fn data_path(&self, peer: &str) -> Option<String> {
        // The newest open link to it (one a request still holds may be closed).
        let connected = (self.inner.peers)
            .newest(|e| {
                (e.name == peer)
                    .then(|| e.live_link("uccl data path").ok())
                    .flatten()
            })
            .flatten()
            .is_some();
        Some(format!(
            "UCCL p2p engine ({}), one-sided write/read per piece{}; notifications on nixl-uccl's control connection",
            self.inner.api.describe(),
            if connected { "" } else { " (not connected yet)" }
        ))
    }

    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        let info = ConnInfo::decode(conn_info).ok_or_else(|| {
            Error::new(
                ErrorKind::Corrupt,
                "uccl link",
                format!(
                    "{peer:?}: connection info is not nixl-uccl's (version {})",
                    wire::INFO_VERSION
                ),
            )
        })?;
        let entry = PeerEntry::new(peer, info);
        self.inner.peers.add(&entry);
        Ok(Arc::new(UcclLink {
            inner: self.inner.clone(),
            entry,
        }))
    }

    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        const OP: &str = "uccl prepare";
        let Some(peer) = plan.peer.clone() else {
            return err(
                ErrorKind::NotSupported,
                OP,
                "nixl-uccl moves data between agents only",
            );
        };
        // Posting uses the link's entry, never a table.
        let peer = nixl::kit::link_of::<UcclLink>(&peer.link, OP)?
            .entry
            .clone();
        // One UCCL call per piece: runs are expanded here, so bound what they expand
        // to before allocating for it.
        if plan.segments.len() > MAX_SEGMENTS {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "{} segments, more than nixl-uccl posts in one transfer ({MAX_SEGMENTS})",
                    plan.segments.len()
                ),
            );
        }
        let max = self.inner.options.max_piece.clamp(1, u32::MAX as usize);
        let regs = self.inner.regs.lock().unwrap();
        let mut pieces = Vec::with_capacity(plan.segments.len());
        let mut locals = Vec::with_capacity(plan.segments.len());
        for s in plan.segments.iter() {
            let Some(mr) = regs.mr(s.local.id()) else {
                return err(
                    ErrorKind::NotFound,
                    OP,
                    format!("local region {} is not registered with uccl", s.local.id()),
                );
            };
            let Target::Remote {
                addr: raddr, blob, ..
            } = &s.target
            else {
                return err(
                    ErrorKind::NotSupported,
                    OP,
                    "a local target on a remote transfer",
                );
            };
            let (fifo, key) = decode_blob(blob).ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    OP,
                    format!(
                        "{peer:?}'s registration blob is {} bytes, not a {BLOB_LEN}-byte FifoItem and confirmation key",
                        blob.len()
                    ),
                )
            })?;
            let base = s.local.segment().addr() as usize;
            let mut off = 0usize;
            while off < s.local.len() {
                let n = (s.local.len() - off).min(max);
                locals.push(s.local.sub(off, n).expect("a piece lies in its segment"));
                pieces.push(Piece {
                    region: s.local.id(),
                    mr,
                    addr: base + off,
                    len: n,
                    remote: fifo.at(raddr + off as u64, n as u32),
                    target_key: key,
                });
                off += n;
            }
        }
        drop(regs);
        Ok(Box::new(Prepared {
            inner: self.inner.clone(),
            peer,
            op: plan.op,
            pieces: pieces.into(),
            locals: locals.into(),
            _plan: plan,
        }))
    }

    async fn shutdown(&self, _timeout: Duration) -> Result<()> {
        // Threads (accept loop, progress, connects) were stopped and joined by the
        // agent before this. Close connections: outbound links, then inbound ones.
        let entries = self.inner.peers.take();
        for e in &entries {
            e.close("the agent is shutting down".into());
        }
        drop(entries);
        if let Ok(owner) = self.inner.started().and_then(Started::owner) {
            owner.close_inbound();
        }
        Ok(())
    }

    fn destroy(&self) -> Result<()> {
        let Some(owner) = self
            .inner
            .started
            .try_get()
            .and_then(|st| st.engine.lock().unwrap().take())
        else {
            return Ok(());
        };
        // Tasks mid-connect may hold the owner a moment longer.
        let holders = Arc::strong_count(&owner);
        drop(owner);
        // `Started` held one reference; the rest are threads or links still alive.
        if holders > 1 {
            return err(
                ErrorKind::TimedOut,
                "uccl destroy",
                format!("the engine is still in use by {} holder(s) (a thread still inside a UCCL call, or a connection still open); it is destroyed when the last lets go", holders - 1),
            );
        }
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // When the agent was dropped without shutdown: the peers' links went before
        // this (they hold this backend); the engine owner (regions, then the engine)
        // goes once its last holder lets go.
        if let Some(s) = self.started.try_get() {
            s.engine.lock().unwrap().take();
        }
    }
}

fn accept_loop(owner: &EngineOwner, gate: &AcceptGate, stop: &CancellationToken) {
    if let Err(e) = owner.bind_thread() {
        tracing::warn!(%e, "uccl-accept: no CUDA context on this thread");
    }
    {
        let mut r = gate.registered.lock().unwrap();
        while !*r && !stop.is_cancelled() {
            r = gate.cv.wait(r).unwrap();
        }
    }
    loop {
        if stop.is_cancelled() {
            return;
        }
        match owner.accept() {
            Some(ip) => {
                tracing::debug!(%ip, "UCCL engine accepted a connection");
                if stop.is_cancelled() {
                    return;
                }
            }
            None => {
                if stop.is_cancelled() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
