//! # nixl-verbs
//!
//! A [`nixl`] backend on raw ibverbs: reliable-connected queue pairs, RDMA WRITE and
//! READ, on the host's rdma-core, loaded at run time.
//!
//! **This data path has not run on RDMA hardware yet.** The machines it was built on
//! have no RDMA device (and no kernel support for soft-RoCE). What runs in CI: the
//! codecs and plans (unit and property tests), the binding against the real
//! `libibverbs.so.1` of the host (it loads, lists no devices, and creating the backend
//! fails with [`ErrorKind::NotSupported`] naming why), every declared struct's layout
//! against the host's `<infiniband/verbs.h>`, the ELF checks (no link-time dependency
//! on rdma-core), and the whole conformance suite against an in-process **test
//! double** of the verbs API (`test_double`, feature `test-double`), which proves this
//! crate's structure, not a NIC's behaviour. On a host with a device (a NIC, or
//! `scripts/soft-roce.sh`), `tests/verbs.rs` runs the conformance suite on it.
//!
//! ## Binding
//! rdma-core comes from the host: `libibverbs.so.1` is opened at run time through the
//! core's loader ([`nixl::native`]; `NIXL_VERBS_LIB` names another), so the host's
//! providers (mlx5, efa, erdma, bnxt_re, rxe, ...) serve it and a process that also
//! runs NCCL holds one libibverbs. Nothing is linked at build time and no symbol of
//! libibverbs is defined here (a test reads the ELF of the built binaries). The
//! structures and calls this crate uses are declared in `ffi/sys.rs`; the data-path calls
//! that `verbs.h` makes inline go through the context's operation table as it does.
//! [`VerbsBackend::library_report`] says which libibverbs was bound, from where, and
//! which providers sit beside it.
//!
//! The `sideway` crate was considered and not used: its `rdma-mummy-sys` loads
//! libibverbs in a constructor before `main`, by a fixed soname, silently when absent,
//! which contradicts the loader every native backend here shares (explicit path,
//! report, error values); it needs cmake and libclang to build; and it links a C shim
//! under GPL-2.0 into every binary.
//!
//! ## Connections
//! A peer's metadata carries the static half of RC setup ([`wire::ConnInfo`]: port,
//! MTU, LID, GID, control address). The dynamic half (queue pair numbers and packet
//! sequence numbers) is exchanged on a small TCP control connection of this backend:
//! the initiator connects at its first transfer (or [`nixl::Agent::connect`]) and
//! sends its queue pairs; the target makes its own, posts receive buffers, brings
//! them to ready-to-send and answers; the initiator brings its own up. The control
//! connection stays open for the connection's life: its end is how each side learns
//! the other is gone. Its listener is an accept loop on the agent's tracker and
//! token. (`rdma_cm` would do the same exchange, but it brings librdmacm and its own
//! event channel; the control connection also carries the agent's name, so peers are
//! keyed by name, never by address.)
//!
//! ## Admission
//! Nothing is made for an incoming control connection until it is admitted:
//! - **Authentication.** Where the agent has a secret ([`nixl::AgentBuilder::secret`],
//!   or this backend's own, the listener options'
//!   [`secret`](nixl::control::ListenerOptions::secret)),
//!   the connection first proves it and the agent name it speaks for (the core's
//!   challenge-response, [`nixl::control`]), and its hello must carry that name; one
//!   that does not is refused and closed. Without a secret (NIXL's behaviour), the
//!   hello's name is the peer's own claim.
//! - **Connection limits.** At most [`ListenerOptions::max_incoming_handshakes`]
//!   connections wait in their handshake (a newer one closes the oldest) and
//!   [`ListenerOptions::max_incoming_connections`] are served past it.
//! - **Queue-pair budget.** Every incoming queue pair reserves room in the agent's one
//!   completion queue, and a full queue would refuse every queue pair, incoming and
//!   outgoing. So peers' queue pairs together use at most the queue less
//!   [`VerbsOptions::outgoing_cq_reserve`] (half of it by default: 512 queue pairs
//!   with the default depths), and the connections of one source hold at most
//!   [`VerbsOptions::max_qps_per_source`] (32) of them; the source is the proven
//!   agent name with a secret, the connection's IP address without one. A hello
//!   past either is refused with the reason, before any queue pair is made for it,
//!   and the place comes free when the connection's queue pairs are destroyed.
//!   Without a secret, clients on enough addresses can still fill the peers' share
//!   (new peers are then refused until they leave); this agent's own connections
//!   keep their reserve whatever peers do. Set a secret where the control listener
//!   is reachable by untrusted hosts.
//!
//! ## Data path
//! - One protection domain, one completion queue and one completion channel per
//!   agent; one memory region per registration. GPU memory ([`nixl::MemKind::Vram`])
//!   is registered by dma-buf (`ibv_reg_dmabuf_mr` on the CUDA driver's export,
//!   [`nixl::gpu::dma_buf`]), else as a device pointer through the peer-memory module
//!   (`nvidia-peermem`); the NIC then reads and writes it directly (GPUDirect RDMA).
//!   Where neither works, registration is [`ErrorKind::NotSupported`] naming both
//!   failures. **Not yet run on a GPU**: tested on the verbs test double, with a test
//!   double of the CUDA driver and with the core's host stand-in for device memory.
//! - [`VerbsOptions::qps_per_peer`] RC queue pairs per peer (default 1). A transfer is
//!   prepared once into work requests: segments that follow each other at the peer
//!   share a request (a gather list on WRITE, a scatter list on READ) up to the queue
//!   pair's entries and the port's largest message; longer segments are cut.
//! - Posting chains up to half the send queue per `ibv_post_send`, signals only the
//!   last request of each chain (a signaled completion retires every request before
//!   it on the queue pair), and never has more requests posted than the queue holds;
//!   the rest waits in order and goes out as completions free room.
//! - Completions arrive on the completion channel, whose descriptor tokio watches (no
//!   polling while idle); after a batch, the queue is polled again for up to
//!   [`VerbsOptions::spin`] before the loop sleeps. Every queue pair reserves room
//!   in the completion queue for its whole queue, so it never overflows (fatal to a
//!   device): one that would not fit is refused ([`VerbsOptions::cq_depth`]).
//!
//! Not done yet: asynchronous device events (port down and fatal device errors
//! show only as failed work requests), `ibv_fork_init`, iWARP devices (RC there
//! needs rdma_cm).
//!
//! ## Notifications
//! A notification is a SEND on the same queue pair, after the transfer's RDMA WRITEs,
//! into receive buffers the target posted ([`VerbsOptions::recv_queue_depth`] of
//! [`VerbsOptions::max_notification`] bytes each, posted again as soon as delivered).
//! A notification that finds the agent's queue full ([`nixl::NotificationLimits`]) is
//! not dropped: its buffer stays unposted, it and those after it on the queue pair
//! wait in a task that delivers them in order as the application reads, and the
//! peer's further SENDs on that queue pair wait in its NIC (receiver not ready,
//! retried without limit) until buffers are posted again: back-pressure on that peer.
//! On a reliable connection the responder executes requests in order, so the WRITEs'
//! data is in the target's memory before the SEND's receive completes; after RDMA
//! READs the SEND carries a fence, so it waits until the reads are done. Standalone
//! notifications are SENDs too; all of them keep posting order. When transfers are
//! split across several queue pairs, the first queue pair holds everything after the
//! transfer until every share is done, so the same holds. A peer with no buffer
//! posted makes the SEND wait (receiver-not-ready retries without limit) rather than
//! fail.
//!
//! ## Failures
//! A completion with an error (a peer that stopped answering: retries exhausted
//! within [`plan::Reliability::give_up_after`], about 0.5 s by default; a key the
//! peer's NIC refused), or the control connection ending (the peer process exited:
//! at once; a silent host: within [`ListenerOptions::dead_peer_timeout`] through TCP
//! keepalive), fails every transfer in flight to that peer: with
//! [`ErrorKind::RemoteDisconnected`] when the peer is gone, [`ErrorKind::NotAllowed`]
//! when its NIC refused a key. The queue pair is destroyed **before** any of those
//! transfers is failed, so the device never touches memory the application got back;
//! the next transfer connects anew with fresh queue pairs.
//!
//! ## Teardown
//! [`nixl::Backend::shutdown`] stops the accept loop and the completion loop (waiting
//! for the latter), fails what is in flight and destroys every queue pair; the agent
//! then deregisters the memory regions; [`nixl::Backend::destroy`] lets go of the
//! device. Every region and queue pair holds the device, and the device's `Drop`
//! destroys the completion queue (after acknowledging its events), the channel and
//! the protection domain and closes the device, so nothing is released while
//! something made from it is alive, whoever lets go last.
//!
//! ## Unsafe code
//! Only in the `ffi` module (the declarations, the libibverbs binding, and the
//! owners whose safe methods the rest of the crate calls) and in the test double.
#![deny(unsafe_code)]

pub mod api;
mod budget;
mod ffi;
mod handshake;
mod inbound;
mod link;
pub mod plan;
#[cfg(feature = "test-double")]
pub mod test_double;
pub mod wire;

pub use ffi::library;
#[cfg(feature = "abi-layout")]
#[doc(hidden)]
pub use ffi::sys::{layout as ffi_layout, signatures as ffi_signatures};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use nixl::control::ListenerOptions;
use nixl::native::LibraryReport;
use nixl::{
    Attachment, Backend, BackendContext, Capabilities, Completer, Error, ErrorKind, Op, PeerLink,
    PreparedTransfer, RegionRef, Result, TargetRegion, TransferPlan,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::api::Completion;
use crate::ffi::device::{Device, MemoryRegion, QpUse, QueuePair, RegisteredBuf};
use crate::ffi::VerbsApi;
use crate::inbound::{Delivery, Inbound};
use crate::link::{Lane, Link, LinkState, Pending, Slots};
use crate::plan::{Piece, Reliability, WrLimits, WrPlan};
use crate::wire::{ConnInfo, Hello, QpHalf, Reply};

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Options for [`VerbsBackend`].
#[derive(Clone, Debug)]
pub struct VerbsOptions {
    /// The libibverbs to load (a path or soname); default: `NIXL_VERBS_LIB`, else
    /// `libibverbs.so.1` from the host's library path.
    pub library: Option<String>,
    /// Device by name (`mlx5_0`); default: the first with an active port.
    pub device: Option<String>,
    /// Port (from 1); default: the device's first active port.
    pub port: Option<u8>,
    /// GID index; default: on Ethernet the first RoCE v2 GID (an IPv4-mapped one
    /// first), on InfiniBand the first non-zero one.
    pub gid_index: Option<u32>,
    /// Largest path MTU in bytes (256 to 4096; the ports' active MTUs may lower it).
    pub mtu: u32,
    /// Send-queue depth per queue pair (the device may lower it).
    pub send_queue_depth: u32,
    /// Notification buffers posted per inbound queue pair.
    pub recv_queue_depth: u32,
    /// Entries of the agent's completion queue (the device may lower it). Every
    /// queue pair reserves room in it for its whole queue (send queue depth per
    /// outgoing queue pair, receive queue depth per incoming one); one that does not
    /// fit is refused with [`ErrorKind::NotSupported`], since an overflow is fatal to
    /// a device.
    pub cq_depth: u32,
    /// Entries of the completion queue that only this agent's own (outgoing) queue
    /// pairs may use; peers' (incoming) queue pairs share the rest, so no number of
    /// peers keeps this agent from connecting out. Default (`None`): half the queue
    /// (with the default depths, 512 incoming queue pairs fit beside it). A value
    /// of the whole queue or more admits no incoming queue pair at all.
    pub outgoing_cq_reserve: Option<u32>,
    /// Incoming queue pairs that the connections of one source may hold at once
    /// (default 32: two connections of the most queue pairs a hello may ask for,
    /// 16). The source is the agent name a connection proved where the agent has a
    /// secret ([`nixl::AgentBuilder::secret`]); without one, a hello's name proves
    /// nothing and the source is the connection's IP address, so agents sharing a
    /// host share this budget. A hello past it is refused before any queue pair is
    /// made for it.
    pub max_qps_per_source: usize,
    /// RC queue pairs per peer; transfers are spread over them in shares of whole
    /// work requests.
    pub qps_per_peer: usize,
    /// Longest notification (the size of each receive buffer).
    pub max_notification: usize,
    /// The control listener and connections ([`ListenerOptions`], as every
    /// backend's): where to listen (default `127.0.0.1:0`; use an address peers on
    /// other hosts reach) and what to publish, the connect and handshake bounds, the
    /// admission limits, and the bound on noticing a silent peer host (TCP keepalive
    /// and `TCP_USER_TIMEOUT` on the control connection). Incoming control
    /// connections past [`ListenerOptions::max_incoming_connections`] are refused;
    /// those served are never closed to make room (their traffic goes over queue
    /// pairs).
    pub listener: ListenerOptions,
    /// Retry settings of the queue pairs.
    pub reliability: Reliability,
    /// How long the completion loop keeps polling after a batch before it sleeps on
    /// the completion channel (lower latency under load; zero: never spin).
    pub spin: Duration,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        Self {
            library: None,
            device: None,
            port: None,
            gid_index: None,
            mtu: 4096,
            send_queue_depth: 512,
            recv_queue_depth: 64,
            cq_depth: 65536,
            outgoing_cq_reserve: None,
            max_qps_per_source: 2 * wire::MAX_QPS,
            qps_per_peer: 1,
            max_notification: 4096,
            listener: ListenerOptions::default(),
            reliability: Reliability::default(),
            spin: Duration::from_micros(20),
        }
    }
}

/// The verbs backend. Attach it to an agent with
/// [`AgentBuilder::backend`](nixl::AgentBuilder::backend).
#[derive(Debug, Clone)]
pub struct VerbsBackend {
    inner: Arc<Inner>,
}

struct Started {
    ctx: BackendContext,
    control: SocketAddr,
    cancel: CancellationToken,
}

/// What a queue pair number belongs to, for completions.
#[derive(Clone)]
enum Role {
    Lane(Arc<Lane>),
    Inbound(Arc<Inbound>),
}

/// A known peer: its connection info and its link, once made. A prepared transfer
/// holds its peer's entry, so posting takes only that peer's lock, never the table's.
struct PeerEntry {
    name: String,
    info: ConnInfo,
    slot: Mutex<LinkSlot>,
}

#[derive(Default)]
struct LinkSlot {
    link: Option<Arc<Link>>,
    /// Why the entry was closed (the peer forgotten or moved): no link is made any
    /// more, and uses fail with it.
    closed: Option<String>,
}

impl std::fmt::Debug for PeerEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerEntry")
            .field("name", &self.name)
            .field("control", &self.info.control)
            .finish_non_exhaustive()
    }
}

impl PeerEntry {
    fn new(name: &str, info: ConnInfo) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            info,
            slot: Mutex::new(LinkSlot::default()),
        })
    }

    fn refuse_closed(&self, slot: &LinkSlot, op: &'static str) -> Result<()> {
        match &slot.closed {
            Some(why) => Err(Error::new(
                ErrorKind::RemoteDisconnected,
                op,
                format!("peer {:?}: {why}", self.name),
            )),
            None => Ok(()),
        }
    }
}

struct Inner {
    options: VerbsOptions,
    /// Incoming queue pairs admitted, in all and per source.
    budget: Arc<budget::Budget>,
    report: Option<LibraryReport>,
    /// `None` after [`Backend::destroy`].
    dev: Mutex<Option<Arc<Device>>>,
    started: Attachment<Started>,
    regions: Mutex<HashMap<u64, (Arc<MemoryRegion>, RegionRef)>>,
    /// The entries of the links this backend made and the agent still holds.
    peers: nixl::kit::LinkSet<PeerEntry>,
    qps: Mutex<HashMap<u32, Role>>,
    inbound: Mutex<Vec<Arc<Inbound>>>,
    completion_loop: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Set when the completion loop failed for good: nothing would complete, so
    /// new transfers are refused with it.
    broken: Mutex<Option<Error>>,
}

impl Drop for Inner {
    /// An agent dropped without shutdown: queue pairs go before the memory regions,
    /// as at shutdown, so peers see the connection end (retries exhausted), never a
    /// refused key, and no device touches memory that is gone.
    ///
    /// The links went before this (the agent and prepared transfers hold them, and
    /// they hold this backend), and with them their pending work; their queue pairs
    /// are still in `qps`, destroyed here.
    fn drop(&mut self) {
        for i in self.inbound.get_mut().unwrap().drain(..) {
            i.close();
        }
        self.qps.get_mut().unwrap().clear();
        self.regions.get_mut().unwrap().clear();
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsBackend")
            .field("device", &self.dev.lock().unwrap())
            .finish_non_exhaustive()
    }
}

impl VerbsBackend {
    /// Open the host's libibverbs ([`VerbsOptions::library`], `NIXL_VERBS_LIB` or
    /// `libibverbs.so.1`) and the device the default options pick.
    ///
    /// # Errors
    /// [`ErrorKind::UnavailableLibrary`] when libibverbs cannot be loaded;
    /// [`ErrorKind::NotSupported`] when it has no device with an active port (naming
    /// what it found); [`ErrorKind::NotFound`] for a device name that is not there.
    pub fn new() -> Result<Self> {
        Self::with_options(VerbsOptions::default())
    }

    /// As [`VerbsBackend::new`], with options.
    ///
    /// # Errors
    /// As [`VerbsBackend::new`].
    pub fn with_options(options: VerbsOptions) -> Result<Self> {
        let lib = match &options.library {
            Some(l) => library::Libibverbs::load_from(l)?,
            None => library::Libibverbs::load()?,
        };
        let report = lib.report().clone();
        Self::build(lib, Some(report), options)
    }

    /// On another implementation of the verbs calls.
    #[cfg_attr(not(feature = "test-double"), allow(dead_code))]
    pub(crate) fn with_api(api: Arc<dyn VerbsApi>, options: VerbsOptions) -> Result<Self> {
        Self::build(api, None, options)
    }

    /// On the in-process **test double** of the verbs API (`test_double`), for tests:
    /// no NIC, no data path of one.
    ///
    /// # Errors
    /// As [`VerbsBackend::new`], from the double.
    #[cfg(feature = "test-double")]
    pub fn with_test_double(options: VerbsOptions) -> Result<Self> {
        Self::with_api(test_double::api(), options)
    }

    fn build(
        api: Arc<dyn VerbsApi>,
        report: Option<LibraryReport>,
        options: VerbsOptions,
    ) -> Result<Self> {
        if api::Mtu::from_bytes(options.mtu).is_none() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "verbs options",
                format!("MTU {} is not 256, 512, 1024, 2048 or 4096", options.mtu),
            ));
        }
        let mut options = options;
        options.reliability.max_mtu = options
            .reliability
            .max_mtu
            .min(api::Mtu::from_bytes(options.mtu).expect("checked above"));
        options.reliability.check()?;
        if options.qps_per_peer == 0 || options.qps_per_peer > wire::MAX_QPS {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "verbs options",
                format!("qps_per_peer must be 1 to {}", wire::MAX_QPS),
            ));
        }
        if options.max_qps_per_source == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "verbs options",
                "max_qps_per_source must be at least 1 (no peer could connect)",
            ));
        }
        let dev = Device::open(api, &options)?;
        let inbound = dev.inbound_qps(&options);
        tracing::info!(device = %dev.name, port = dev.endpoint.port, link_layer = ?dev.endpoint.link_layer, gid_index = dev.endpoint.gid_index, inbound_qps = inbound, "verbs: device opened");
        Ok(Self {
            inner: Arc::new(Inner {
                budget: budget::Budget::new(inbound, options.max_qps_per_source),
                options,
                report,
                dev: Mutex::new(Some(Arc::new(dev))),
                started: Attachment::new("verbs"),
                regions: Mutex::new(HashMap::new()),
                peers: nixl::kit::LinkSet::default(),
                qps: Mutex::new(HashMap::new()),
                inbound: Mutex::new(Vec::new()),
                completion_loop: Mutex::new(None),
                broken: Mutex::new(None),
            }),
        })
    }

    /// The libibverbs bound and the providers beside it (`None` on the test
    /// double).
    pub fn library_report(&self) -> Option<&LibraryReport> {
        self.inner.report.as_ref()
    }

    /// The device, port and GID in use, in one line.
    pub fn device_summary(&self) -> String {
        match &*self.inner.dev.lock().unwrap() {
            Some(d) => format!(
                "{} port {} ({:?}, MTU {}, GID index {})",
                d.name,
                d.endpoint.port,
                d.endpoint.link_layer,
                d.endpoint.mtu.bytes(),
                d.endpoint.gid_index
            ),
            None => "closed".to_owned(),
        }
    }

    /// The control listener's address, once started.
    pub fn control_addr(&self) -> Option<SocketAddr> {
        self.inner.started.try_get().map(|s| s.control)
    }

    fn dev(&self, op: &'static str) -> Result<Arc<Device>> {
        self.inner
            .dev
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| Error::new(ErrorKind::ShutDown, op, "the verbs device is closed"))
    }

    fn started(&self, op: &'static str) -> Result<&Started> {
        self.inner.started.get(op)
    }

    /// Start listening and the completion loop: the state [`Backend::start`] keeps.
    async fn start_attached(&self, ctx: BackendContext) -> Result<Started> {
        const OP: &str = "start verbs backend";
        let ctx = ctx.with_own_secret(self.inner.options.listener.secret.as_ref());
        let dev = self.dev(OP)?;
        let o = &self.inner.options;
        let bound = o
            .listener
            .bind(nixl::control::LOOPBACK_ANY_PORT, OP)
            .await?;
        let control = bound.advertised;
        let cancel = ctx.cancel.child_token();
        // The accept loop.
        let (me, c) = (self.clone(), cancel.clone());
        let secret = ctx.secret.clone();
        let admission = o.listener.admission();
        nixl::control::spawn_accept_loop(
            "verbs",
            bound.listener,
            admission,
            &ctx.tracker,
            c,
            move |conn| {
                let (me, secret) = (me.clone(), secret.clone());
                async move {
                    let from = conn.from;
                    if let Err(e) = me
                        .serve(conn.stream, from, secret, conn.ticket, conn.close)
                        .await
                    {
                        tracing::debug!(%from, error = %e, "verbs: control connection ended");
                    }
                }
            },
        );
        let handle = ctx.tracker.spawn(completion_loop(
            self.inner.clone(),
            dev,
            Delivery::new(ctx.notifications.clone(), ctx.tracker.clone()),
            cancel.clone(),
        ));
        *self.inner.completion_loop.lock().unwrap() = Some(handle);
        Ok(Started {
            ctx,
            control,
            cancel,
        })
    }

    /// The live link to `entry`'s peer, connecting if needed.
    fn rc_link(&self, entry: &PeerEntry, op: &'static str) -> Result<Arc<Link>> {
        let started = self.started(op)?;
        let mut slot = entry.slot.lock().unwrap();
        entry.refuse_closed(&slot, op)?;
        if let Some(l) = slot.link.take() {
            if !l.is_dead() {
                slot.link = Some(l.clone());
                return Ok(l);
            }
            // A queue pair of it failed (a post the device refused): the rest of it
            // goes too, and the next transfer connects anew.
            drop(slot);
            self.close_link(&l, "a queue pair of the connection failed");
            slot = entry.slot.lock().unwrap();
            entry.refuse_closed(&slot, op)?;
            // Another post may have connected anew meanwhile.
            if let Some(l) = slot.link.as_ref().filter(|l| !l.is_dead()) {
                return Ok(l.clone());
            }
        }
        if let Some(e) = self.inner.broken.lock().unwrap().as_ref() {
            return Err(e.cloned());
        }
        let link = Arc::new(Link {
            id: link::next_link_id(),
            peer: entry.name.clone(),
            state: Mutex::new(LinkState::Connecting(Vec::new())),
            settled: tokio::sync::Notify::new(),
            cancel: started.cancel.child_token(),
        });
        slot.link = Some(link.clone());
        let (me, info, l) = (self.clone(), entry.info, link.clone());
        started
            .ctx
            .tracker
            .spawn(async move { me.run_link(l, info).await });
        Ok(link)
    }

    /// Connect `link`, then watch its control connection until it ends.
    async fn run_link(self, link: Arc<Link>, info: ConnInfo) {
        let o = &self.inner.options;
        let connected = tokio::select! {
            // The link's token fires when it failed or was closed (that reason stands:
            // a link fails once), or when the agent stops.
            _ = link.cancel.cancelled() => Err(Error::new(ErrorKind::ShutDown, "verbs connect", "the agent is stopping")),
            r = tokio::time::timeout(o.listener.connect_timeout, self.connect_link(&link, &info)) => r.unwrap_or_else(|_| Err(Error::new(
                ErrorKind::TimedOut,
                "verbs connect",
                format!("peer {:?} at {} did not complete the handshake within {:?}", link.peer, info.control, o.listener.connect_timeout),
            ))),
        };
        let (mut stream, lanes, max_notif) = match connected {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(peer = %link.peer, error = %e, "verbs: connect failed");
                link.fail(e);
                return;
            }
        };
        {
            let mut qps = self.inner.qps.lock().unwrap();
            for l in &lanes {
                qps.insert(l.qp_num, Role::Lane(l.clone()));
            }
        }
        // Post what waited, in order; what is posted meanwhile keeps queueing behind
        // it until the queue is empty, and only then is the link up.
        loop {
            let batch = {
                let mut st = link.state.lock().unwrap();
                match &mut *st {
                    LinkState::Connecting(q) if q.is_empty() => {
                        *st = LinkState::Up(lanes.clone(), max_notif);
                        break;
                    }
                    LinkState::Connecting(q) => std::mem::take(q),
                    // Failed while we connected: keep that.
                    _ => break,
                }
            };
            for p in batch {
                link::post_on(&lanes, max_notif, &link.peer, p);
            }
        }
        link.settled.notify_waiters();
        let failed = match &*link.state.lock().unwrap() {
            LinkState::Dead(e) => Some(e.cloned()),
            _ => None,
        };
        if let Some(e) = failed {
            // Closed while connecting: these lanes never became the link's.
            for l in &lanes {
                self.inner.forget_lane(l);
                l.fail(e.cloned());
            }
            return;
        }
        tracing::debug!(peer = %link.peer, qps = lanes.len(), "verbs: connected");
        // The control connection stays open; its end means the peer is gone.
        let mut buf = [0u8; 64];
        let why = tokio::select! {
            _ = link.cancel.cancelled() => None,
            r = stream.read(&mut buf) => Some(match r {
                Ok(0) => "the peer closed its control connection".to_owned(),
                Ok(_) => "the peer broke the control protocol".to_owned(),
                Err(e) => format!("the control connection failed: {e}"),
            }),
        };
        let stopping = self
            .inner
            .started
            .try_get()
            .is_some_and(|s| s.cancel.is_cancelled());
        let e = match why {
            Some(why) => Error::new(
                ErrorKind::RemoteDisconnected,
                "verbs transfer",
                format!("peer {:?}: {why}", link.peer),
            ),
            None if stopping => Error::new(
                ErrorKind::ShutDown,
                "verbs transfer",
                format!("peer {:?}: the agent is shutting down", link.peer),
            ),
            None => Error::new(
                ErrorKind::RemoteDisconnected,
                "verbs transfer",
                format!("peer {:?}: the connection was closed here", link.peer),
            ),
        };
        self.inner.fail_link(&link, e);
        let _ = stream.shutdown().await;
    }

    /// The handshake of a new link: queue pairs up on both sides.
    async fn connect_link(
        &self,
        link: &Link,
        info: &ConnInfo,
    ) -> Result<(TcpStream, Vec<Arc<Lane>>, usize)> {
        const OP: &str = "verbs connect";
        let dev = self.dev(OP)?;
        let o = &self.inner.options;
        let io = |what: &str, e: std::io::Error| {
            Error::new(
                ErrorKind::RemoteDisconnected,
                OP,
                format!("peer {:?} at {}: {what}", link.peer, info.control),
            )
            .with_source(e)
        };
        let ctx = &self.started(OP)?.ctx;
        let ends = nixl::control::Ends {
            protocol: CONTROL_PROTOCOL,
            secret: ctx.secret.as_ref(),
            me: &ctx.agent_name,
        };
        let (dead, t) = (o.listener.dead_peer_timeout, o.listener.connect_timeout);
        let mut s = nixl::control::dial(OP, ends, &link.peer, info.control, dead, t).await?;
        let caps = dev.caps(o);
        let mut qps = Vec::new();
        let mut halves = Vec::new();
        for _ in 0..o.qps_per_peer {
            let qp = QueuePair::create(&dev, caps, QpUse::Send)?;
            qp.modify(&[plan::connect(
                &dev.endpoint,
                0,
                &info.endpoint,
                0,
                0,
                &o.reliability,
                dev.limits.max_qp_rd_atom,
                dev.limits.max_qp_init_rd_atom,
            )[0]])?;
            halves.push(QpHalf {
                qp_num: qp.qp.qp_num,
                psn: plan::random_psn(),
            });
            qps.push(qp);
        }
        let agent = self.started(OP)?.ctx.agent_name.clone();
        let hello = Hello {
            agent,
            endpoint: dev.endpoint,
            qps: halves.clone(),
        };
        write_frame(&mut s, &hello.encode())
            .await
            .map_err(|e| io("hello", e))?;
        let reply = read_frame(&mut s)
            .await
            .map_err(|e| io("handshake reply", e))?;
        let handshake::Accepted {
            max_notification: max_notif,
            theirs,
        } = handshake::on_reply(
            &link.peer,
            Reply::decode(&reply)?,
            halves.len(),
            o.max_notification,
        )?;
        let mut lanes = Vec::new();
        for ((qp, mine), theirs) in qps.into_iter().zip(&halves).zip(&theirs) {
            let [_, rtr, rts] = plan::connect(
                &dev.endpoint,
                mine.psn,
                &info.endpoint,
                theirs.qp_num,
                theirs.psn,
                &o.reliability,
                dev.limits.max_qp_rd_atom,
                dev.limits.max_qp_init_rd_atom,
            );
            qp.modify(&[rtr, rts])?;
            let slots = if o.max_notification as u32 > qp.qp.caps.max_inline_data {
                Some(notification_slots(&dev, o.max_notification, 16)?)
            } else {
                None
            };
            lanes.push(Arc::new(Lane::new(&link.peer, link.id, qp, slots)));
        }
        Ok((s, lanes, max_notif))
    }

    /// Serve one incoming control connection: authenticate it (with the agent's
    /// secret), make queue pairs for the peer's, then keep them until the connection
    /// ends.
    async fn serve(
        self,
        mut s: TcpStream,
        from: std::net::SocketAddr,
        secret: Option<nixl::SharedSecret>,
        mut ticket: nixl::control::Ticket,
        close: CancellationToken,
    ) -> Result<()> {
        const OP: &str = "verbs accept";
        let o = &self.inner.options;
        let io = |what: &str, e: std::io::Error| {
            Error::new(ErrorKind::RemoteDisconnected, OP, what.to_owned()).with_source(e)
        };
        let evicted = || {
            Error::new(
                ErrorKind::NotAllowed,
                OP,
                "closed in its handshake: to admit a newer connection (VerbsOptions::listener.max_incoming_handshakes), or the agent stops",
            )
        };
        let peer = format!("control connection from {from}");
        let me = self.started(OP)?.ctx.agent_name.clone();
        let ends = nixl::control::Ends {
            protocol: CONTROL_PROTOCOL,
            secret: secret.as_ref(),
            me: &me,
        };
        // One bound for the whole handshake: authentication and hello.
        let (dead, t) = (o.listener.dead_peer_timeout, o.listener.handshake_timeout);
        let deadline = tokio::time::Instant::now() + t;
        let authenticated = tokio::select! {
            _ = close.cancelled() => return Err(evicted()),
            r = nixl::control::answer(&mut s, ends, from, dead, t) => r?,
        };
        // Nothing is made for a peer refused here, before or after its hello.
        if let Err(r) = handshake::on_authenticated(&authenticated) {
            return Err(refuse(&mut s, r, &peer, None).await);
        }
        let frame = tokio::select! {
            _ = close.cancelled() => return Err(evicted()),
            r = tokio::time::timeout_at(deadline, read_frame(&mut s)) => r,
        }
        .map_err(|_| Error::new(ErrorKind::TimedOut, OP, "no hello in time"))?
        .map_err(|e| io("hello", e))?;
        let hello = Hello::decode(&frame)?;
        if let Err(r) = handshake::on_hello(&hello, &authenticated, &peer) {
            // Connected as one agent, introduced as another.
            return Err(refuse(&mut s, r, &peer, None).await);
        }
        // Never closed to make room: the peer's traffic goes over its queue pairs,
        // so an idle control socket says nothing of whether it works (and its queue
        // pairs are bounded by the budget below).
        if !ticket.establish_with(true) {
            return Err(refuse(&mut s, handshake::Refusal::TooManyPeers, &peer, None).await);
        }
        // Admitted only within its source's budget and the completion queue's
        // share for peers; nothing is made for it before.
        let proven = match &authenticated {
            nixl::control::Authenticated::As(name) => Some(name.as_str()),
            _ => None,
        };
        let source = budget::Source::of(proven, from.ip());
        let grant = match self.inner.budget.admit(source, hello.qps.len()) {
            Ok(g) => g,
            Err(why) => {
                let r = handshake::Refusal::Budget(why.to_string());
                return Err(refuse(&mut s, r, &peer, Some(&hello.agent)).await);
            }
        };
        let made = self.accept_qps(&hello);
        if let Err(e) = &made {
            if matches!(e.kind(), ErrorKind::ShutDown | ErrorKind::Canceled) {
                // Going away: the initiator sees the connection end, as from a peer
                // that is gone, not a refusal.
                return Err(e.cloned());
            }
        }
        let (mut inbound, mut reply) = match made {
            Ok((inb, halves)) => (
                inb,
                Reply::Accepted {
                    max_notification: o.max_notification as u32,
                    qps: halves,
                },
            ),
            Err(e) => (Vec::new(), Reply::Refused(e.to_string())),
        };
        {
            let mut qps = self.inner.qps.lock().unwrap();
            let mut list = self.inner.inbound.lock().unwrap();
            // Checked under the list's lock: a shutdown or drop that already emptied
            // the list (its token is cancelled first) would miss these queue pairs,
            // and deregister memory they reach; so would a completion loop that
            // failed for good (it sets `broken` before it empties the list).
            if close.is_cancelled() {
                for i in &inbound {
                    i.close();
                }
                return Err(Error::new(ErrorKind::Canceled, OP, "the agent is stopping"));
            }
            if let Some(e) = self.inner.broken.lock().unwrap().as_ref() {
                for i in inbound.drain(..) {
                    i.close();
                }
                reply = Reply::Refused(e.to_string());
            }
            for i in &inbound {
                qps.insert(i.qp_num, Role::Inbound(i.clone()));
            }
            list.extend(inbound.iter().cloned());
        }
        let sent = write_frame(&mut s, &reply.encode()).await;
        if sent.is_ok() && !inbound.is_empty() {
            tracing::debug!(peer = %hello.agent, qps = inbound.len(), "verbs: peer connected");
            let mut buf = [0u8; 64];
            tokio::select! {
                _ = close.cancelled() => {}
                _ = s.read(&mut buf) => {}
            }
        }
        // The peer is gone (or we stop): destroy its queue pairs; their buffers go
        // with the last reference.
        for i in &inbound {
            self.inner.forget_inbound(i);
            i.close();
        }
        self.inner
            .inbound
            .lock()
            .unwrap()
            .retain(|x| !inbound.iter().any(|i| Arc::ptr_eq(i, x)));
        // Their place in the budget goes once they are destroyed (`close` returns
        // only then), so the next peer admitted finds the completion queue's room.
        drop(grant);
        sent.map_err(|e| io("reply", e))
    }

    fn accept_qps(&self, hello: &Hello) -> Result<(Vec<Arc<Inbound>>, Vec<QpHalf>)> {
        // Nothing polls the completion queue any more: a peer's sends would land
        // unread and its lane would stall once the buffers are used.
        if let Some(e) = self.inner.broken.lock().unwrap().as_ref() {
            return Err(e.cloned());
        }
        let dev = self.dev("verbs accept")?;
        let o = &self.inner.options;
        let caps = dev.caps(o);
        let mut made = Vec::new();
        let mut halves = Vec::new();
        for theirs in &hello.qps {
            let qp = QueuePair::create(&dev, caps, QpUse::Recv)?;
            let psn = plan::random_psn();
            let [init, rtr, rts] = plan::connect(
                &dev.endpoint,
                psn,
                &hello.endpoint,
                theirs.qp_num,
                theirs.psn,
                &o.reliability,
                dev.limits.max_qp_rd_atom,
                dev.limits.max_qp_init_rd_atom,
            );
            qp.modify(&[init])?;
            let inb = Inbound::new(&hello.agent, &dev, qp, o.max_notification)?;
            inb.with_qp(|qp| qp.modify(&[rtr, rts]))
                .expect("just made")?;
            halves.push(QpHalf {
                qp_num: inb.qp_num,
                psn,
            });
            made.push(Arc::new(inb));
        }
        Ok((made, halves))
    }
}

/// Registered buffers for `count` notifications of `size` bytes.
fn notification_slots(dev: &Arc<Device>, size: usize, count: usize) -> Result<Slots> {
    Ok(Slots::new(RegisteredBuf::new(dev, size * count)?, size))
}

/// Most bytes in one control frame.
const MAX_FRAME: usize = 64 * 1024;

/// Answer `r` to the initiator (best effort: it may be gone) and give the error the
/// connection's task ends with.
async fn refuse(
    s: &mut TcpStream,
    r: handshake::Refusal,
    peer: &str,
    hello: Option<&str>,
) -> Error {
    let _ = write_frame(s, &Reply::Refused(r.why()).encode()).await;
    r.into_error(peer, hello)
}

/// The control connection's name in the authentication ([`nixl::control`]).
const CONTROL_PROTOCOL: &str = "nixl-verbs control";

use nixl::control::write_frame;

/// One control frame; the stream ending is an error here (every read expects one).
async fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    nixl::control::read_frame(s, MAX_FRAME)
        .await?
        .ok_or_else(|| std::io::ErrorKind::UnexpectedEof.into())
}

impl Inner {
    /// Deliver one completion to whoever owns its queue pair.
    fn dispatch(&self, dev: &Device, c: &Completion, sink: &Delivery) {
        let role = self.qps.lock().unwrap().get(&c.qp_num).cloned();
        match role {
            Some(Role::Lane(l)) => {
                let text = if c.status.is_ok() {
                    String::new()
                } else {
                    dev.api.status_str(c.status)
                };
                l.on_completion(c, &text);
                if l.is_dead() {
                    self.forget_lane(&l);
                    // The link's other lanes and its control connection go too (if
                    // the peer's link is still the one this lane belongs to).
                    let link = (self.peers.alive().iter())
                        .filter_map(|p| p.slot.lock().unwrap().link.clone())
                        .find(|k| k.id == l.link_id);
                    if let Some(link) = link {
                        let e = Error::new(
                            ErrorKind::RemoteDisconnected,
                            "verbs transfer",
                            format!(
                                "peer {:?}: another queue pair of the connection failed",
                                l.peer
                            ),
                        );
                        self.fail_link(&link, e);
                    }
                }
            }
            Some(Role::Inbound(i)) => i.on_completion(c, sink),
            None => {
                tracing::trace!(
                    qp = c.qp_num,
                    wr_id = c.wr_id,
                    "verbs: completion of a queue pair already gone; ignored"
                );
            }
        }
    }
}

/// The completion loop: sleeps on the completion channel, drains the queue, and
/// spins for `spin` after a batch. Should it fail for good (the channel or the queue
/// errs), nothing would ever complete again: every transfer in flight fails, and the
/// backend refuses new ones.
async fn completion_loop(
    inner: Arc<Inner>,
    dev: Arc<Device>,
    sink: Delivery,
    cancel: CancellationToken,
) {
    if let Err(e) = completions(&inner, &dev, &sink, &cancel).await {
        tracing::error!(error = %e, "verbs: the completion loop failed; every transfer fails from now on");
        *inner.broken.lock().unwrap() = Some(e.cloned());
        inner.close_everything(e.kind(), &e.to_string());
    }
}

async fn completions(
    inner: &Inner,
    dev: &Device,
    sink: &Delivery,
    cancel: &CancellationToken,
) -> Result<()> {
    let fatal = |what: &str, e: &dyn std::fmt::Display| {
        Error::new(
            ErrorKind::Backend,
            "verbs completions",
            format!("{what}: {e}"),
        )
    };
    let afd = dev
        .watch_channel()
        .map_err(|e| fatal("cannot watch the completion channel", &e))?;
    let api = &dev.api;
    let spin = inner.options.spin;
    let mut wcs = [Completion::EMPTY; 64];
    api.req_notify_cq(dev.cq)?;
    loop {
        // Drain, then spin briefly while completions keep coming; yield between
        // batches so a busy queue does not starve other tasks.
        let mut last = Instant::now();
        loop {
            let n = api.poll_cq(dev.cq, &mut wcs)?;
            for c in &wcs[..n] {
                inner.dispatch(dev, c, sink);
            }
            if n > 0 {
                last = Instant::now();
            } else if last.elapsed() >= spin {
                break;
            }
            tokio::task::yield_now().await;
        }
        let mut guard = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            g = afd.readable() => g.map_err(|e| fatal("the completion channel failed", &e))?,
        };
        // Take every pending event, acknowledge them, then arm again before the next
        // drain: a completion after the drain raises a new event.
        let mut events = 0;
        let taken = loop {
            match api.get_cq_event(dev.channel.handle) {
                Ok(Some(_)) => events += 1,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        guard.clear_ready();
        if events > 0 {
            api.ack_cq_events(dev.cq, events);
        }
        taken?;
        api.req_notify_cq(dev.cq)?;
    }
}

#[async_trait]
impl Backend for VerbsBackend {
    fn name(&self) -> &str {
        "verbs"
    }

    fn capabilities(&self) -> Capabilities {
        // The peer's NIC checks keys and bounds, but a refusal fails the whole queue
        // pair; requests are checked by the initiator only (no target checks).
        Capabilities {
            max_segments: 1 << 24,
            ..Capabilities::between_agents(self.inner.options.max_notification)
        }
    }

    fn unsupported_reason(&self, _kind: nixl::MemKind) -> Option<String> {
        // Host and GPU memory both register (GPU memory's own errors say why not).
        None
    }

    fn alloc(&self, _len: usize) -> Option<Result<nixl::Memory>> {
        // A NIC reaches ordinary registered memory as fast as any.
        None
    }

    fn nixl(&self) -> Option<&dyn nixl::NixlDialect> {
        // NIXL has no raw-verbs backend to speak to.
        None
    }

    async fn start(&self, ctx: BackendContext) -> Result<()> {
        const OP: &str = "start verbs backend";
        self.inner
            .started
            .attach(OP, self.start_attached(ctx))
            .await?;
        Ok(())
    }

    fn connection_info(&self) -> Bytes {
        let (Some(s), Some(dev)) = (
            self.inner.started.try_get(),
            self.inner.dev.lock().unwrap().clone(),
        ) else {
            return Bytes::new();
        };
        Bytes::from(
            ConnInfo {
                endpoint: dev.endpoint,
                control: s.control,
            }
            .encode(),
        )
    }

    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        const OP: &str = "verbs register";
        let dev = self.dev(OP)?;
        let seg = region.segment();
        if seg.len() as u64 > dev.limits.max_mr_size {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                OP,
                format!(
                    "{} bytes is over the device's largest memory region ({} bytes)",
                    seg.len(),
                    dev.limits.max_mr_size
                ),
            ));
        }
        let mr = match region.kind() {
            nixl::MemKind::Dram => {
                // The registration holds `region`, which keeps the memory alive.
                MemoryRegion::register(&dev, region)?
            }
            nixl::MemKind::Vram { device } => {
                // As above, for device memory.
                let (mr, how) = MemoryRegion::register_gpu(&dev, device, region)?;
                tracing::debug!(
                    device,
                    len = seg.len(),
                    ?how,
                    "verbs: registered GPU memory"
                );
                mr
            }
            nixl::MemKind::File { .. } => {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    "register memory",
                    "verbs does not take files",
                ))
            }
        };
        let rkey = mr.mr.rkey;
        self.inner
            .regions
            .lock()
            .unwrap()
            .insert(region.id(), (Arc::new(mr), region.clone()));
        Ok(Bytes::copy_from_slice(&wire::encode_blob(rkey)))
    }

    fn deregister(&self, region_id: u64) -> Result<()> {
        // An agent going away (dropped, not shut down) deregisters as it stops:
        // connections end first, so peers see the peer gone rather than a refused
        // key, and no queue pair of ours still reaches the memory.
        if self
            .inner
            .started
            .try_get()
            .is_some_and(|s| s.cancel.is_cancelled())
        {
            self.close_everything(ErrorKind::Canceled, "the agent is going away");
        }
        // Dropping the region deregisters it; the registration's memory is released
        // after that.
        self.inner.regions.lock().unwrap().remove(&region_id);
        Ok(())
    }

    fn data_path(&self, peer: &str) -> Option<String> {
        // The newest open link to it (one a request still holds may be closed).
        let link = self.inner.peers.newest(|e| {
            let slot = e.slot.lock().unwrap();
            (e.name == peer && slot.closed.is_none())
                .then(|| slot.link.clone())
                .flatten()
        })?;
        let st = link.state.lock().unwrap();
        let LinkState::Up(lanes, _) = &*st else {
            return None;
        };
        Some(format!(
            "RDMA RC over {}, {} queue pair(s) to this peer",
            self.device_summary(),
            lanes.len()
        ))
    }

    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        let entry = PeerEntry::new(peer, ConnInfo::decode(conn_info)?);
        self.inner.peers.add(&entry);
        Ok(Arc::new(VerbsLink {
            backend: self.clone(),
            entry,
        }))
    }

    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        const OP: &str = "verbs prepare";
        let Some(peer) = plan.peer.clone() else {
            return Err(Error::new(
                ErrorKind::NotSupported,
                OP,
                "the verbs backend serves transfers between agents only",
            ));
        };
        // Posting uses the link's entry, never a table.
        let peer = nixl::kit::link_of::<VerbsLink>(&peer.link, OP)?
            .entry
            .clone();
        let dev = self.dev(OP)?;
        let segs = &plan.segments;
        let lkeys = {
            let regions = self.inner.regions.lock().unwrap();
            segs.locals()
                .iter()
                .map(|r| {
                    regions
                        .get(&r.id())
                        .map(|(mr, _)| (r.segment().addr(), mr.mr.lkey))
                        .ok_or_else(|| {
                            Error::new(
                                ErrorKind::NotFound,
                                OP,
                                "a local region is not registered with the verbs backend",
                            )
                        })
                })
                .collect::<Result<Vec<_>>>()?
        };
        let targets = segs
            .targets()
            .iter()
            .map(|t| match t {
                TargetRegion::Remote { addr, blob, .. } => Ok((*addr, wire::decode_blob(blob)?)),
                TargetRegion::Local(_) => Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    "remote transfer with a local target",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let pieces = segs.runs().iter().flat_map(|r| {
            let (base, lkey) = lkeys[r.local as usize];
            let (tbase, rkey) = targets[r.target as usize];
            (0..r.count).map(move |i| Piece {
                addr: base + r.local_at(i),
                len: r.len,
                lkey,
                remote_addr: tbase + r.target_at(i),
                rkey,
            })
        });
        let peer_max_msg = peer.info.endpoint.max_msg_sz;
        let max_sge = dev.caps(&self.inner.options).max_send_sge;
        let limits = WrLimits {
            max_msg: u64::from(dev.port.max_msg_sz.min(peer_max_msg).max(1)),
            // An RDMA READ scatters into at most `max_sge_rd` entries.
            max_sge: if plan.op == Op::Read {
                max_sge.min(dev.limits.max_sge_rd.max(1))
            } else {
                max_sge
            },
        };
        let wrs = plan::work_requests(plan.op == Op::Read, pieces, limits);
        Ok(Box::new(Prepared {
            backend: self.clone(),
            peer,
            plan: Arc::new(wrs),
        }))
    }

    async fn shutdown(&self, timeout: Duration) -> Result<()> {
        if let Some(s) = self.inner.started.try_get() {
            s.cancel.cancel();
        }
        self.close_everything(ErrorKind::ShutDown, "the agent is shutting down");
        // The completion loop stops at its next wait; it holds the device, so
        // nothing is released under it even if this bound runs out.
        let handle = self.inner.completion_loop.lock().unwrap().take();
        if let Some(h) = handle {
            if tokio::time::timeout(timeout, h).await.is_err() {
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    "verbs shutdown",
                    "the completion loop did not stop in time",
                ));
            }
        }
        Ok(())
    }

    fn destroy(&self) -> Result<()> {
        // After a shutdown this finds nothing to close; after a drop without one,
        // queue pairs go before the memory regions (peers see the connection end,
        // never a refused key).
        self.close_everything(ErrorKind::Canceled, "the agent was dropped");
        self.inner.regions.lock().unwrap().clear();
        if let Some(dev) = self.inner.dev.lock().unwrap().take() {
            let others = Arc::strong_count(&dev) - 1;
            if others > 0 {
                tracing::debug!(
                    holders = others,
                    "verbs: the device stays open until its last queue pair or region goes"
                );
            }
        }
        Ok(())
    }
}

impl VerbsBackend {
    fn close_everything(&self, kind: ErrorKind, why: &str) {
        self.inner.close_everything(kind, why);
    }

    /// Close `entry` for good: its link fails, and so does every later use.
    fn close_entry(&self, entry: &PeerEntry, why: &str) {
        let link = {
            let mut slot = entry.slot.lock().unwrap();
            slot.closed.get_or_insert_with(|| why.to_owned());
            slot.link.take()
        };
        if let Some(l) = link {
            self.close_link(&l, why);
        }
    }

    fn close_link(&self, l: &Link, why: &str) {
        let e = Error::new(
            ErrorKind::RemoteDisconnected,
            "verbs transfer",
            format!("peer {:?}: {why}", l.peer),
        );
        self.inner.fail_link(l, e);
    }
}

impl Inner {
    /// Fail every link (peers keep their connection info) and destroy every inbound
    /// queue pair.
    fn close_everything(&self, kind: ErrorKind, why: &str) {
        let links: Vec<Arc<Link>> = (self.peers.alive().iter())
            .filter_map(|p| p.slot.lock().unwrap().link.take())
            .collect();
        for l in links {
            let e = Error::new(kind, "verbs transfer", format!("peer {:?}: {why}", l.peer));
            self.fail_link(&l, e);
        }
        // Taken out first: the inbound list is never locked while `qps` is wanted.
        let inbound = std::mem::take(&mut *self.inbound.lock().unwrap());
        for i in inbound {
            self.forget_inbound(&i);
            i.close();
        }
    }

    /// Fail a link and forget its lanes.
    fn fail_link(&self, l: &Link, e: Error) {
        for lane in l.fail(e) {
            self.forget_lane(&lane);
        }
    }

    /// Stop routing completions to `l` (only if its number still names it: a new
    /// queue pair may have the number already).
    fn forget_lane(&self, l: &Arc<Lane>) {
        let mut qps = self.qps.lock().unwrap();
        if matches!(qps.get(&l.qp_num), Some(Role::Lane(x)) if Arc::ptr_eq(x, l)) {
            qps.remove(&l.qp_num);
        }
    }

    /// As [`Inner::forget_lane`], for a target's queue pair.
    fn forget_inbound(&self, i: &Arc<Inbound>) {
        let mut qps = self.qps.lock().unwrap();
        if matches!(qps.get(&i.qp_num), Some(Role::Inbound(x)) if Arc::ptr_eq(x, i)) {
            qps.remove(&i.qp_num);
        }
    }
}

/// nixl-verbs' link to a peer: the peer's entry (connection info and RC link), with
/// the backend that connects it.
#[derive(Debug)]
struct VerbsLink {
    backend: VerbsBackend,
    entry: Arc<PeerEntry>,
}

#[async_trait]
impl PeerLink for VerbsLink {
    async fn connect(&self) -> Result<()> {
        self.backend
            .rc_link(&self.entry, "verbs connect")?
            .ready()
            .await
    }

    fn notify(&self, msg: Bytes, done: Completer) {
        match self.backend.rc_link(&self.entry, "verbs notify") {
            Ok(l) => l.post(Pending::Notify(msg, done)),
            Err(e) => done.complete(Err(e)),
        }
    }

    fn failed(&self) -> bool {
        // A link whose queue pair failed connects anew at the next use.
        false
    }

    fn close(&self, why: &str) {
        self.backend.close_entry(&self.entry, why);
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// A transfer prepared into work requests.
#[derive(Debug)]
struct Prepared {
    backend: VerbsBackend,
    peer: Arc<PeerEntry>,
    plan: Arc<WrPlan>,
}

impl PreparedTransfer for Prepared {
    fn post(&self, notif: Option<Bytes>, done: Completer) {
        match self.backend.rc_link(&self.peer, "verbs post") {
            Ok(l) => l.post(Pending::Transfer {
                plan: self.plan.clone(),
                notif,
                done,
            }),
            Err(e) => done.complete(Err(e)),
        }
    }
}
