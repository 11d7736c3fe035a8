//! # nixl-tcp
//!
//! The embedded default backend for [`nixl`]: pure Rust over TCP, no system packages.
//!
//! - Remote transfers: a TCP connection per peer (made at the first transfer, or by
//!   [`nixl::Agent::connect`]), many requests in flight on it. WRITE payloads go from
//!   registered memory straight to the socket and from the socket straight into the
//!   target's registered memory; READ data likewise. No bounce buffers. A request
//!   whose frame is at most 64 KiB, posted while the connection is idle, is written
//!   by `post` itself (payload copied into the frame, one non-blocking write); the
//!   connection's writer task takes over only what the socket buffer does not take,
//!   and queues everything after it, so requests reach the peer in posting order.
//!   Nagle is off; socket buffers are left to the kernel's autotuning (fixed sizes
//!   measured no faster, and would cap long links).
//! - Large transfers (from [`TcpOptions::stripe_min`], 1 MiB) are cut into equal
//!   pieces that move over [`TcpOptions::connections`] connections to the peer at
//!   once (one TCP stream is bound by the core copying it). Every piece carries the
//!   whole request's descriptor table and the target checks all of it, so a request
//!   it refuses is refused by every piece and none of its bytes is written. Ordering
//!   is kept as on one connection: the first connection carries the first piece and
//!   then holds everything posted after the transfer until every piece has landed;
//!   the transfer's notification then goes first.
//! - Peers on the same host (proven, not guessed from the address) move data without
//!   the socket: memory from [`nixl::Agent::alloc`] is shared memory the initiator maps
//!   once, other memory goes by cross-memory attach, and the TCP connection carries
//!   notifications and what cannot go direct. See [`SameHost`] and the module
//!   docs of the same-host path below.
//! - Local transfers (same agent) are the agent's own copies; this backend serves
//!   transfers between agents.
//! - GPU memory ([`nixl::MemKind::Vram`], through [`nixl::gpu`]) is registered like
//!   host memory and moves over TCP staged through page-locked host buffers
//!   ([`nixl::gpu::PinnedBuf`]) in chunks of at most 4 MiB, with asynchronous device
//!   copies on a stream of their own: the sender starts the device-to-host copies of
//!   up to 16 chunks (16 MiB) ahead of the socket, and the target keeps up to as many
//!   host-to-device copies running behind it, so a batch of small GPU blocks costs
//!   about one copy latency rather than one per block. No thread blocks on the GPU, and the copies
//!   do not wait for the application's work on the default stream (data must be
//!   ready when the transfer is posted, as always). The target answers (and delivers
//!   the notification) only after its last copy finished, so notifications still
//!   follow the data. The same-host path and the small-write fast path never touch GPU
//!   memory: such transfers go the staged way over TCP, between agents on one host
//!   too. **Not yet run on a GPU**: tested on a host stand-in for device memory.
//! - The target checks every incoming segment against its own registrations and the
//!   per-registration random key only its metadata carries; a forged key or an
//!   out-of-range segment refuses the whole request before any byte is touched.
//! - Notifications ride on the same connection, after the data, so a peer sees them in
//!   posting order and only once the data is in its memory. On the same-host path a
//!   notification is sent when its copy finishes, so a transfer larger than
//!   [`TcpOptions::inline_copy_max`] (copied on the copy thread) can see its
//!   notification overtaken by a smaller one posted after it; await the first
//!   transfer before posting the second where the order matters.
//! - A peer that dies or disconnects fails every in-flight transfer to it with
//!   [`ErrorKind::RemoteDisconnected`]; TCP keepalive and `TCP_USER_TIMEOUT` bound how
//!   long a silent network failure can take to notice (the listener options'
//!   [`dead_peer_timeout`](nixl::control::ListenerOptions::dead_peer_timeout)).
//!
//! ## Wire security
//! Keys stop stale or mistaken requests and peers that never saw the metadata; they
//! are not encryption: anyone who can read the traffic or the metadata can reuse them.
//! With a secret (the listener options'
//! [`secret`](nixl::control::ListenerOptions::secret), or the agent's), every
//! connection is authenticated first (the core's exchange, [`nixl::control`]: both
//! sides prove the secret and their agent names),
//! so only agents that know the secret can reach registered memory at all, and a
//! connection's hello, and so its notifications, carry the name it proved. Traffic
//! is still not encrypted nor MAC'd after the handshake: run it on a trusted network.
//!
//! An address outlives its agent: a restarted agent, or any other, may listen on the
//! port later. Each backend publishes a random listener id in its connection info
//! and the hello names the one it wants; another listener refuses it, and the
//! transfer fails with `RemoteDisconnected` ("another agent listens at its address
//! now"), as a closed port would. A peer holding stale metadata never delivers a
//! WRITE or a notification to whoever listens there now.
//!
//! The listener bounds what peers that are not (yet) trusted can take: a handshake
//! must end within the handshake timeout, at most so many connections wait in theirs
//! (a newcomer closes the oldest) and so many are served past it
//! ([`TcpOptions::listener`]: [`ListenerOptions`](nixl::control::ListenerOptions)); a
//! peer that stops reading is cut after the dead-peer timeout without progress
//! (`TCP_USER_TIMEOUT`); buffers grow only as bytes arrive; and one
//! request moves at most [`TcpOptions::max_request_bytes`]. A target that stops
//! reading a peer on purpose (its agent's queue of that peer's notifications is
//! full) tells the peer first, and the peer lifts its user timeout until the target
//! reads again: a consumer that reads its notifications late does not get its
//! peers cut. The hold-back is bounded: a target that answers no request for
//! [`TcpOptions::pause_timeout`] while it holds back (one that paused and never
//! reads again, or keeps saying PAUSE and RESUME without reading) is cut, and the
//! transfers it stalled fail with `TimedOut` naming the stall; so is, through that
//! bound, a target whose host dies while it holds back. A target process that dies
//! closes the connection at once.
//!
//! ## The same-host path
//! When initiator and target run on one kernel, data moves without the socket; the
//! TCP connection carries the handshake, notifications and whatever cannot go direct.
//! - Memory from [`nixl::Agent::alloc`] is shared memory (a memfd): the initiator maps
//!   the target's once, and a transfer is one copy by the initiator.
//! - Any other registered memory moves by vectored cross-memory attach
//!   (`process_vm_writev` / `process_vm_readv`), up to 1024 ranges and 1 GiB per call
//!   (the kernel moves at most 2 GiB - 4 KiB a call); blocks adjacent on both sides
//!   are joined into one range. Copies from [`TcpOptions::split_copy_min`] (16 MiB)
//!   are cut into up to [`TcpOptions::copy_threads`] parts that as many threads copy
//!   at once (threads started for the transfer and joined before it completes).
//! - Transfers up to [`TcpOptions::inline_copy_max`] (4 MiB) run on the posting thread
//!   and complete before `post` returns; larger ones on the backend's copy thread. A
//!   notification follows over TCP once the data is in place, so it still arrives
//!   only after the data is visible.
//!
//! *Proven, not guessed.* The path is tried only when both sides' connection info
//! carries the same kernel boot id. The target offers its grant table (which names
//! its pid, and the table's descriptor and address) only to a peer proven to be on
//! its host as its user: the connection comes from loopback or from the target's own
//! address, its other end is a socket of the target's network namespace owned by the
//! target's user (asked of the kernel's socket diagnostics, `/proc/net/tcp` where
//! those are missing), and, with a secret, the peer authenticated first; any other
//! peer is told "no offer" and learns none of it. The path is used only after the
//! initiator mapped the target's grant table through `/proc/<pid>/fd` and found in it the nonce the target
//! sent over the TCP connection (authenticated where there is a secret): same
//! host, same process, access allowed. Cross-memory attach is used only after reading
//! that nonce with `process_vm_readv` worked. Where any step fails the connection uses
//! TCP and logs why once; [`nixl::Backend::data_path`] says which path a peer got.
//!
//! *The grant table.* Each incoming same-host connection gets a table in shared
//! memory that only the target writes: one slot per registration (key, address range,
//! memfd). Before any copy or system call the initiator marks every slot of the
//! request in use and checks each descriptor against it (key, bounds), so forged keys
//! and out-of-range descriptors are refused as the TCP target refuses them.
//! Deregistration clears the slot and waits until no initiator is inside it: once
//! [`nixl::Agent::deregister`] returns, no peer touches that memory again (a peer
//! stopped mid-copy, in a debugger say, is waited for 10 s; then the memory is kept
//! alive until it lets go and deregistration reports it). An initiator holds a shared
//! `flock` on the table while it has it mapped, so one that died inside a copy is
//! seen gone at once and never waited for; shutdown waits asynchronously (at most half
//! its bound) and a connection's end not at all. A new registration is published in
//! each table without the lock other registrations take, so a peer that holds a slot
//! busy (it may wait for a live initiator to leave one it looked at while free, 10 s
//! at most in all) holds up only that registration.
//!
//! *Hostile peers.* Every memfd is sealed at its size, so a target cannot truncate one
//! under the initiator's mapping (SIGBUS). The initiator opens `/proc/<pid>/fd/<fd>`
//! only for a process of its own user that holds the other end of its TCP connection,
//! and only a nixl-tcp memfd, checked again once open (name, shrink seal, length).
//!
//! *Security boundary.* The kernel allows both mechanisms only between processes where
//! one may inspect the other: same user (or `CAP_SYS_PTRACE`), and for cross-memory
//! attach also what Yama's `ptrace_scope` allows (1 forbids it between processes that
//! are not parent and child). A process with those rights can read and write the
//! target's memory anyway, with or without nixl; the grant table keeps nixl-tcp itself
//! to the target's registrations, it is not a sandbox against a hostile local process.
//! Use [`SameHost::Off`] where agents of one host must not share memory at all.
//!
//! ## Memory safety
//! Registered memory is read and written only through [`nixl::RegionSlice`]'s raw
//! copies and system calls, never through a Rust reference, since peers and other
//! transfers may touch the same bytes. The only `unsafe` code is the shared-memory,
//! grant-table and cross-memory-attach primitives of the same-host path, in one small
//! module; the rest of the crate denies `unsafe`.
#![deny(unsafe_code)]

mod cma;
mod conn;
mod direct;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod gpu_direct;
mod io;
mod options;
mod protocol;
mod route;
mod runs;
mod same_host;
mod shm;
mod sock_diag;
mod state;
mod target;
mod wire;

pub use options::TcpOptions;
pub use same_host::SameHost;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nixl::{
    Attachment, Backend, BackendContext, Capabilities, Completer, Error, ErrorKind, Op, PeerLink,
    PreparedTransfer, RegionRef, Result, Segments, TargetRegion, TransferPlan,
};

use conn::{Conn, Job, Lane};
use options::Started;
use route::{Route, Socket, Stripe};
use state::{CopyJob, Inner, PeerEntry};

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The wire protocol version this crate speaks (the hello's second field). Public for
/// raw-wire tests and fuzzers, which must follow it to get past the hello.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub const WIRE_VERSION: u16 = wire::VERSION;

/// A hello of agent `name` for whichever listener answers, as this version sends it.
/// Public for raw-wire tests and fuzzers.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub fn wire_hello(name: &str) -> Vec<u8> {
    wire::hello(name, wire::ANY_LISTENER)
}

/// The TCP backend. Attach it to an agent with
/// [`AgentBuilder::backend`](nixl::AgentBuilder::backend).
#[derive(Debug, Clone)]
pub struct TcpBackend {
    inner: Arc<Inner>,
}

impl Default for TcpBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl TcpBackend {
    /// A backend with default options (listens on loopback).
    pub fn new() -> Self {
        Self::with_options(TcpOptions::default())
    }

    /// A backend with options.
    pub fn with_options(options: TcpOptions) -> Self {
        let boot = (options.same_host != SameHost::Off)
            .then(shm::boot_id)
            .flatten();
        Self {
            inner: Arc::new(Inner {
                options,
                started: Attachment::new("tcp"),
                grants: same_host::Grants::default(),
                regions: RwLock::new(HashMap::new()),
                keys: Mutex::new(HashMap::new()),
                peers: nixl::kit::LinkSet::default(),
                boot,
                listener: loop {
                    let id = random_u64();
                    if id != wire::ANY_LISTENER {
                        break id;
                    }
                },
                copier: Mutex::new(None),
            }),
        }
    }

    /// The address it listens on, once started.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.started.try_get().map(|s| s.addr)
    }

    /// Listen and start accepting: the state [`Backend::start`] keeps.
    async fn listen(&self, ctx: BackendContext) -> Result<Started> {
        const OP: &str = "start tcp backend";
        let bound = (self.inner.options.listener)
            .bind(nixl::control::LOOPBACK_ANY_PORT, OP)
            .await?;
        let addr = bound.advertised;
        let cancel = ctx.cancel.child_token();
        let secret = (self.inner.options.listener.secret.clone()).or(ctx.secret.clone());
        let started = Started {
            ctx,
            secret,
            addr,
            cancel,
        };
        target::spawn_listener(self.inner.clone(), bound.listener, &started);
        tracing::debug!(bound = %bound.bound, advertised = %addr, "tcp backend listening");
        Ok(started)
    }

    fn started(&self, op: &'static str) -> Result<&Started> {
        self.inner.started.get(op)
    }

    /// The copy thread's queue, starting the thread (owned by the agent, joined at
    /// its shutdown) at the first call; `None` once the agent stops.
    fn copier(&self) -> Option<std::sync::mpsc::Sender<CopyJob>> {
        let mut g = self.inner.copier.lock().unwrap();
        if let Some(tx) = &*g {
            return Some(tx.clone());
        }
        let started = self.inner.started.try_get()?;
        let (tx, rx) = std::sync::mpsc::channel::<CopyJob>();
        let waker = tx.clone();
        started
            .ctx
            .spawn_thread(
                "nixl-tcp-copy",
                move |token| {
                    // Jobs still queued when the agent stops are dropped with `rx`:
                    // their transfers fail as canceled.
                    while let Ok(job) = rx.recv() {
                        if token.is_cancelled() {
                            break;
                        }
                        job();
                    }
                },
                move || {
                    let _ = waker.send(Box::new(|| {}));
                },
            )
            .ok()?;
        *g = Some(tx.clone());
        Some(tx)
    }

    /// The live first connection to `entry`'s peer, made if needed.
    fn conn(&self, entry: &PeerEntry, op: &'static str) -> Result<Arc<Conn>> {
        let started = self.started(op)?;
        entry.first(op, || {
            Conn::open(
                entry.name.clone(),
                &entry.info,
                Lane::First(self.same_host_for(entry)),
                &self.inner.options,
                started,
            )
        })
    }

    fn same_host_for(&self, entry: &PeerEntry) -> std::result::Result<(), String> {
        match (&self.inner.boot, &entry.info.boot) {
            _ if self.inner.options.same_host == SameHost::Off => {
                Err("turned off in the options".to_owned())
            }
            (None, _) => Err("this kernel has no boot id to compare".to_owned()),
            (Some(_), None) => Err("the peer offers no same-host path".to_owned()),
            (Some(a), Some(b)) if a != b => {
                Err("the peer runs on another host (different kernel boot id)".to_owned())
            }
            _ => Ok(()),
        }
    }

    /// Connections 1 to `n - 1` to `entry`'s peer (the first is
    /// [`TcpBackend::conn`]'s), opened or reopened as needed.
    fn extra_conns(&self, entry: &PeerEntry, n: usize, op: &'static str) -> Result<Vec<Arc<Conn>>> {
        let started = self.started(op)?;
        entry.extra(op, n, || {
            Conn::open(
                entry.name.clone(),
                &entry.info,
                Lane::Extra,
                &self.inner.options,
                started,
            )
        })
    }
}

#[async_trait]
impl Backend for TcpBackend {
    fn name(&self) -> &str {
        "tcp"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            target_checks: true,
            max_segments: wire::MAX_ENTRIES as usize,
            ..Capabilities::between_agents(self.inner.options.max_notification)
        }
    }

    async fn start(&self, ctx: BackendContext) -> Result<()> {
        const OP: &str = "start tcp backend";
        self.inner.started.attach(OP, self.listen(ctx)).await?;
        Ok(())
    }

    fn connection_info(&self) -> Bytes {
        self.local_addr()
            .map(|addr| {
                Bytes::from(wire::encode_conn_info(&wire::ConnInfo {
                    addr,
                    listener: self.inner.listener,
                    boot: self.inner.boot.clone(),
                }))
            })
            .unwrap_or_default()
    }

    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        let host = region.kind() == nixl::MemKind::Dram;
        if !host {
            // GPU memory moves through host buffers; it needs the driver's copies.
            nixl::gpu::status()?;
        }
        let mut regions = self.inner.regions.write().unwrap();
        let key = loop {
            let k = random_u64();
            if k != 0 && !regions.contains_key(&k) {
                break k;
            }
        };
        regions.insert(key, region.clone());
        drop(regions);
        // Peers on this host reach it directly: host memory by shared memory or
        // cross-memory attach, GPU memory through the driver's inter-process handles.
        let slot = self
            .inner
            .boot
            .is_some()
            .then(|| self.inner.grants.grant(key, region))
            .flatten();
        self.inner
            .keys
            .lock()
            .unwrap()
            .insert(region.id(), (key, slot));
        let mut blob = key.to_le_bytes().to_vec();
        if let Some(slot) = slot {
            blob.extend_from_slice(&slot.to_le_bytes());
        }
        Ok(Bytes::from(blob))
    }

    fn deregister(&self, region_id: u64) -> Result<()> {
        let Some((key, slot)) = self.inner.keys.lock().unwrap().remove(&region_id) else {
            return Ok(());
        };
        // TCP requests are refused from here on; same-host peers once the revoke
        // returns (the registration stays alive until then).
        let region = self.inner.regions.write().unwrap().remove(&key);
        match (slot, region) {
            (Some(slot), Some(region)) => self.inner.grants.revoke(slot, &region),
            _ => Ok(()),
        }
    }

    fn unsupported_reason(&self, _kind: nixl::MemKind) -> Option<String> {
        // Host and GPU memory both register; files are the storage backends'.
        None
    }

    fn nixl(&self) -> Option<&dyn nixl::NixlDialect> {
        // NIXL has no TCP backend of this protocol.
        None
    }

    fn alloc(&self, len: usize) -> Option<Result<nixl::Memory>> {
        // Shared memory pays off only where the same-host path can use it.
        self.inner
            .boot
            .is_some()
            .then(|| self.inner.grants.alloc(len))
    }

    fn data_path(&self, peer: &str) -> Option<String> {
        // The newest open link to it (one a request still holds may be closed).
        (self.inner.peers).newest(|e| (e.name == peer).then(|| e.path()).flatten())
    }

    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        let info = std::str::from_utf8(conn_info)
            .ok()
            .and_then(wire::decode_conn_info)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    "tcp link",
                    format!("peer {peer:?}: connection info is not an address"),
                )
            })?;
        let entry = PeerEntry::new(peer, info);
        self.inner.peers.add(&entry);
        Ok(Arc::new(TcpLink {
            backend: self.clone(),
            entry,
        }))
    }

    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        const OP: &str = "tcp prepare";
        self.started(OP)?;
        let Some(peer) = plan.peer else {
            return Err(Error::new(
                ErrorKind::NotSupported,
                OP,
                "the tcp backend serves transfers between agents only",
            ));
        };
        // Posting uses the link's entry, never a table.
        let peer = nixl::kit::link_of::<TcpLink>(&peer.link, OP)?.entry.clone();
        let segs = &plan.segments;
        // Same-host slot, key and start address of each target registration, decoded
        // once; the wire table is written from them, and the plan itself is kept (runs
        // over registration tables: O(runs), however many blocks).
        let mut all_granted = true;
        let targets = segs
            .targets()
            .iter()
            .map(|t| match t {
                TargetRegion::Remote { addr, blob, .. } => decode_blob(blob)
                    .map(|(key, slot)| {
                        all_granted &= slot.is_some();
                        (slot.unwrap_or_default(), key, *addr)
                    })
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::Corrupt,
                            OP,
                            format!(
                                "peer {peer:?}: tcp region blob is {} bytes, not 8 or 12",
                                blob.len()
                            ),
                        )
                    }),
                TargetRegion::Local(_) => Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    "remote transfer with a local target",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let targets = direct::Direct { targets };
        let runs = segs.runs();
        let mut table = Vec::with_capacity(runs.len() * wire::SEG_LEN);
        for r in runs {
            targets.entry(r).encode_into(&mut table);
        }
        let route = Route::choose(
            route::Facts {
                segs,
                table_len: table.len(),
                granted: all_granted.then_some(targets),
                same_host: self.same_host_for(&peer).is_ok(),
            },
            &self.inner.options,
        );
        Ok(Box::new(RemotePrepared {
            backend: self.clone(),
            peer,
            op: plan.op,
            table: Bytes::from(table),
            total: segs.bytes(),
            local: Arc::new(plan.segments),
            route,
        }))
    }

    async fn shutdown(&self, timeout: Duration) -> Result<()> {
        // Same-host peers stop touching our memory first: waits for copies running in
        // live peers, for half the bound at most, leaving the rest for the rest.
        let revoked = self.inner.grants.revoke_everything(timeout / 2).await;
        self.inner.copier.lock().unwrap().take();
        if let Some(s) = self.inner.started.try_get() {
            s.cancel.cancel();
        }
        for p in self.inner.peers.take() {
            p.close(ErrorKind::ShutDown, "the agent is shutting down");
        }
        self.inner.regions.write().unwrap().clear();
        self.inner.keys.lock().unwrap().clear();
        // A peer still copying past the bound is the shutdown report's to name.
        revoked
    }

    fn destroy(&self) -> Result<()> {
        // Sockets, tasks and shared-memory grants all ended in `shutdown`; the
        // registrations' memory belongs to the agent. Nothing is left to release.
        Ok(())
    }
}

/// Key and same-host slot of a region blob (8 bytes: key only; 12: key and slot).
fn decode_blob(blob: &[u8]) -> Option<(u64, Option<u32>)> {
    let key = u64::from_le_bytes(blob.get(..8)?.try_into().ok()?);
    match blob.len() {
        8 => Some((key, None)),
        12 => Some((key, Some(u32::from_le_bytes(blob[8..].try_into().ok()?)))),
        _ => None,
    }
}

/// nixl-tcp's link to a peer: the peer's entry (connection info and connections),
/// with the backend that opens its connections.
#[derive(Debug)]
struct TcpLink {
    backend: TcpBackend,
    entry: Arc<PeerEntry>,
}

#[async_trait]
impl PeerLink for TcpLink {
    async fn connect(&self) -> Result<()> {
        self.backend.conn(&self.entry, "tcp connect")?.ready().await
    }

    fn notify(&self, msg: Bytes, done: Completer) {
        // The agent refused anything longer than `max_notification` already.
        match self.backend.conn(&self.entry, "tcp notify") {
            Ok(c) => c.submit(Job::notify(msg, done)),
            Err(e) => done.complete(Err(e)),
        }
    }

    fn failed(&self) -> bool {
        // A dead connection is opened again at the next use.
        false
    }

    fn close(&self, why: &str) {
        self.entry.close(ErrorKind::RemoteDisconnected, why);
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// A transfer to a peer: the segment table is encoded once, and the route chosen
/// once, at prepare time.
#[derive(Debug)]
struct RemotePrepared {
    backend: TcpBackend,
    peer: Arc<PeerEntry>,
    op: Op,
    table: Bytes,
    local: Arc<Segments>,
    total: u64,
    route: Route,
}

impl RemotePrepared {
    fn job(&self, notif: Option<Bytes>, done: Completer) -> Job {
        Job::transfer(
            self.op,
            self.table.clone(),
            self.local.clone(),
            self.route.direct().cloned(),
            self.total,
            notif,
            done,
        )
    }

    /// Post the pieces, one per connection. The first connection carries the first
    /// piece and then a gate: nothing posted after this transfer goes out on it
    /// until every piece has landed, then the notification (if any) goes first. So a
    /// split transfer keeps the ordering one connection gives: its notification, and
    /// any later one, arrives after all of its data.
    fn post_striped(
        &self,
        stripes: &[Stripe],
        first: Arc<Conn>,
        notif: Option<Bytes>,
        done: Completer,
    ) {
        let extra = match self
            .backend
            .extra_conns(&self.peer, stripes.len(), "tcp post")
        {
            Ok(extra) => extra,
            Err(e) => return done.complete(Err(e)),
        };
        let gate = Arc::new(nixl::kit::StripeGate::new("tcp transfer", &self.peer.name));
        let slot = gate.clone();
        let parts = done.split_then(stripes.len(), move |done, result| {
            slot.open(nixl::kit::Outcome {
                done,
                result,
                notif,
            });
        });
        let piece = |stripe: &Stripe, part| {
            Job::piece(
                self.op,
                self.table.clone(),
                stripe.local.clone(),
                stripe.from,
                part,
            )
        };
        let mut parts = parts.into_iter();
        let mut stripes = stripes.iter();
        let (Some(p0), Some(s0)) = (parts.next(), stripes.next()) else {
            return;
        };
        first.submit(piece(s0, p0));
        first.submit_gate(gate);
        for ((lane, stripe), part) in extra.iter().zip(stripes).zip(parts) {
            lane.submit(piece(stripe, part));
        }
    }

    /// Over the socket, in pieces where the route says so and the first connection is
    /// up and TCP-only; whole otherwise (the connection task sends a job queued while
    /// connecting whole, directly where the same-host path came up).
    fn post_socket(&self, socket: &Socket, c: Arc<Conn>, notif: Option<Bytes>, done: Completer) {
        match socket {
            Socket::Striped(stripes) if c.is_up() && c.same_host().is_none() => {
                self.post_striped(stripes, c, notif, done)
            }
            _ => c.submit(self.job(notif, done)),
        }
    }
}

impl RemotePrepared {
    /// GPU memory to or from a peer on this host: device copies queued here as one
    /// batch; the notification (or the completion) follows once the device finished
    /// them, from the driver's callback. Staged over the socket where the grants do
    /// not suit (see [`Route::SameHostGpu`]).
    fn post_gpu(
        &self,
        direct: &Arc<direct::Direct>,
        otherwise: &Socket,
        c: Arc<Conn>,
        notif: Option<Bytes>,
        done: Completer,
    ) {
        let Some(peer) = c.same_host() else {
            return self.post_socket(otherwise, c, notif, done);
        };
        if c.is_dead() || done.is_canceled() {
            return c.submit(self.job(notif, done));
        }
        let rest = c.direct_gpu(
            &peer,
            self.op,
            self.table.clone(),
            self.local.clone(),
            direct.clone(),
            self.total,
            notif,
            done,
        );
        if let Some(rest) = rest {
            c.submit(rest);
        }
    }
}

impl PreparedTransfer for RemotePrepared {
    fn post(&self, notif: Option<Bytes>, done: Completer) {
        // The agent refused notifications over `max_notification` already.
        let c = match self.backend.conn(&self.peer, "tcp post") {
            Ok(c) => c,
            Err(e) => return done.complete(Err(e)),
        };
        let (direct, inline, otherwise) = match &self.route {
            Route::Socket(socket) => return self.post_socket(socket, c, notif, done),
            Route::SameHostGpu { direct, otherwise } => {
                return self.post_gpu(direct, otherwise, c, notif, done)
            }
            Route::SameHost {
                direct,
                inline,
                otherwise,
            } => (direct, *inline, otherwise),
        };
        let Some(peer) = c.same_host() else {
            return self.post_socket(otherwise, c, notif, done);
        };
        if c.is_dead() || done.is_canceled() {
            return c.submit(self.job(notif, done));
        }
        if inline {
            let r = peer.transfer(self.op, &self.local, direct);
            if let Some(rest) = c.after_direct(r, notif, done, |n, d| self.job(n, d)) {
                c.submit(rest);
            }
            return;
        }
        let (op, table, local, direct, total) = (
            self.op,
            self.table.clone(),
            self.local.clone(),
            direct.clone(),
            self.total,
        );
        let copy: CopyJob = Box::new(move || {
            let r = peer.transfer(op, &local, &direct);
            let whole = |n, d| Job::transfer(op, table, local, Some(direct), total, n, d);
            if let Some(rest) = c.after_direct(r, notif, done, whole) {
                c.submit(rest);
            }
        });
        // On the backend's copy thread; inline only if it cannot run (shutting down).
        match self.backend.copier() {
            Some(tx) => {
                if let Err(std::sync::mpsc::SendError(copy)) = tx.send(copy) {
                    copy();
                }
            }
            None => copy(),
        }
    }
}

/// A random `u64` from the OS (registration keys).
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("the OS random source works");
    u64::from_le_bytes(b)
}
