//! # nixl-tcp
//!
//! The embedded default backend for [`nixl`]: pure Rust over TCP, no system packages.
//!
//! - Remote transfers: one TCP connection per peer (made at the first transfer, or by
//!   [`nixl::Agent::connect`]), many requests in flight on it. WRITE payloads go from
//!   registered memory straight to the socket and from the socket straight into the
//!   target's registered memory; READ data likewise. No bounce buffers.
//! - Local transfers (same agent) are the agent's own copies; this backend serves
//!   transfers between agents.
//! - The target checks every incoming segment against its own registrations and the
//!   per-registration random key only its metadata carries; a forged key or an
//!   out-of-range segment refuses the whole request before any byte is touched.
//! - Notifications ride on the same connection, after the data, so a peer sees them in
//!   posting order and only once the data is in its memory.
//! - A peer that dies or disconnects fails every in-flight transfer to it with
//!   [`ErrorKind::RemoteDisconnected`]; TCP keepalive and `TCP_USER_TIMEOUT` bound how
//!   long a silent network failure can take to notice ([`TcpOptions::dead_peer_timeout`]).
//!
//! ## Wire security
//! Keys stop stale or mistaken requests and peers that never saw the metadata; they
//! are not encryption: anyone who can read the traffic or the metadata can reuse them.
//! With [`TcpOptions::secret`], every connection is authenticated first, so only
//! agents that know the secret can reach registered memory at all. Traffic is still
//! not encrypted: run it on a trusted network.
//!
//! ## Memory safety
//! The crate has no `unsafe` code (`forbid(unsafe_code)`): registered memory is read
//! and written only through [`nixl::RegionSlice`]'s raw copies and system calls, never
//! through a Rust reference, since peers and other transfers may touch the same bytes.
#![forbid(unsafe_code)]

mod conn;
mod io;
mod target;
mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nixl::{
    random_u64, Backend, BackendContext, Capabilities, Completer, Error, ErrorKind, Op,
    PreparedTransfer, RegionRef, RegionSlice, Result, Target, TransferPlan,
};
use tokio_util::sync::CancellationToken;

use conn::{Conn, Job};

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Options for [`TcpBackend`].
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// Address to listen on for peers (default `127.0.0.1:0`: loopback, any port). Use
    /// a routable address for peers on other hosts.
    pub listen: SocketAddr,
    /// Address to publish in metadata, when peers must use another one than the bound
    /// address (NAT, `0.0.0.0` listeners). Default: the bound address.
    pub advertise: Option<SocketAddr>,
    /// Limit for connecting and for the connection handshake.
    pub connect_timeout: Duration,
    /// Bound on noticing a peer that went silent (host crash, cut link): TCP keepalive
    /// probes and `TCP_USER_TIMEOUT` are set from it. A peer process that dies is
    /// noticed at once (its kernel closes the connection).
    pub dead_peer_timeout: Duration,
    /// Longest notification accepted.
    pub max_notification: usize,
    /// When set, both ends of every connection prove they know this secret
    /// (HMAC-SHA256 challenge-response) before any request is read: a client without
    /// it reaches no registered memory, whatever keys it has. Set the same secret on
    /// every agent of a deployment.
    pub secret: Option<nixl::SharedSecret>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            connect_timeout: Duration::from_secs(5),
            dead_peer_timeout: Duration::from_secs(10),
            max_notification: 1 << 20,
            secret: None,
        }
    }
}

/// The TCP backend. Attach it to an agent with
/// [`AgentBuilder::backend`](nixl::AgentBuilder::backend).
#[derive(Debug, Clone)]
pub struct TcpBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Started {
    pub(crate) ctx: BackendContext,
    pub(crate) addr: SocketAddr,
    pub(crate) cancel: CancellationToken,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) options: TcpOptions,
    pub(crate) started: OnceLock<Started>,
    /// Registrations by key, for incoming requests.
    pub(crate) regions: RwLock<HashMap<u64, RegionRef>>,
    /// Region id -> key.
    keys: Mutex<HashMap<u64, u64>>,
    peers: Mutex<HashMap<String, PeerEntry>>,
}

#[derive(Debug)]
struct PeerEntry {
    addr: SocketAddr,
    conn: Option<Arc<Conn>>,
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
        Self {
            inner: Arc::new(Inner {
                options,
                started: OnceLock::new(),
                regions: RwLock::new(HashMap::new()),
                keys: Mutex::new(HashMap::new()),
                peers: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The address it listens on, once started.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.started.get().map(|s| s.addr)
    }

    fn started(&self, op: &'static str) -> Result<&Started> {
        self.inner.started.get().ok_or_else(|| {
            Error::new(
                ErrorKind::NotAllowed,
                op,
                "the tcp backend is not attached to an agent",
            )
        })
    }

    /// The live connection to `peer`, made if needed.
    fn conn(&self, peer: &str, op: &'static str) -> Result<Arc<Conn>> {
        let started = self.started(op)?;
        let mut peers = self.inner.peers.lock().unwrap();
        let Some(entry) = peers.get_mut(peer) else {
            return Err(Error::new(
                ErrorKind::UnknownPeer,
                op,
                format!("tcp: no connection info for peer {peer:?}"),
            ));
        };
        if let Some(c) = &entry.conn {
            if !c.is_dead() {
                return Ok(c.clone());
            }
        }
        let c = Conn::open(peer.to_owned(), entry.addr, &self.inner.options, started);
        entry.conn = Some(c.clone());
        Ok(c)
    }
}

#[async_trait]
impl Backend for TcpBackend {
    fn name(&self) -> &str {
        "tcp"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: false,
            remote: true,
            notifications: true,
            dram: true,
            vram: false,
            target_checks: true,
            max_segments: wire::MAX_SEGMENTS as usize,
            max_notification: self.inner.options.max_notification,
        }
    }

    async fn start(&self, ctx: BackendContext) -> Result<()> {
        const OP: &str = "start tcp backend";
        let listener = tokio::net::TcpListener::bind(self.inner.options.listen)
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Backend,
                    OP,
                    format!("cannot listen on {}", self.inner.options.listen),
                )
                .with_source(e)
            })?;
        let bound = listener.local_addr().map_err(|e| {
            Error::new(ErrorKind::Backend, OP, "listener has no address").with_source(e)
        })?;
        let addr = self.inner.options.advertise.unwrap_or(bound);
        let cancel = ctx.cancel.child_token();
        let started = Started { ctx, addr, cancel };
        target::spawn_listener(self.inner.clone(), listener, &started);
        self.inner.started.set(started).map_err(|_| {
            Error::new(
                ErrorKind::NotAllowed,
                OP,
                "the tcp backend is already attached to an agent",
            )
        })?;
        tracing::debug!(%bound, advertised = %addr, "tcp backend listening");
        Ok(())
    }

    fn connection_info(&self) -> Bytes {
        self.local_addr()
            .map(|a| Bytes::from(a.to_string()))
            .unwrap_or_default()
    }

    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        if region.kind() != nixl::MemKind::Dram {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "tcp register",
                "the tcp backend moves host memory only",
            ));
        }
        let mut regions = self.inner.regions.write().unwrap();
        let key = loop {
            let k = random_u64();
            if k != 0 && !regions.contains_key(&k) {
                break k;
            }
        };
        regions.insert(key, region.clone());
        self.inner.keys.lock().unwrap().insert(region.id(), key);
        Ok(Bytes::copy_from_slice(&key.to_le_bytes()))
    }

    fn deregister(&self, region_id: u64) -> Result<()> {
        if let Some(key) = self.inner.keys.lock().unwrap().remove(&region_id) {
            self.inner.regions.write().unwrap().remove(&key);
        }
        Ok(())
    }

    fn add_peer(&self, peer: &str, conn_info: &[u8]) -> Result<()> {
        let addr: SocketAddr = std::str::from_utf8(conn_info)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    "tcp add peer",
                    format!("peer {peer:?}: connection info is not an address"),
                )
            })?;
        let mut peers = self.inner.peers.lock().unwrap();
        let old = peers.insert(peer.to_owned(), PeerEntry { addr, conn: None });
        if let Some(PeerEntry {
            addr: old_addr,
            conn: Some(c),
        }) = old
        {
            if old_addr == addr {
                // Same peer, same address: keep the connection.
                peers.get_mut(peer).expect("just inserted").conn = Some(c);
            } else {
                c.close(
                    ErrorKind::RemoteDisconnected,
                    "the peer moved to another address",
                );
            }
        }
        Ok(())
    }

    async fn connect(&self, peer: &str) -> Result<()> {
        self.conn(peer, "tcp connect")?.ready().await
    }

    fn remove_peer(&self, peer: &str) -> Result<()> {
        let entry = self.inner.peers.lock().unwrap().remove(peer);
        if let Some(PeerEntry { conn: Some(c), .. }) = entry {
            c.close(ErrorKind::RemoteDisconnected, "the peer was forgotten");
        }
        Ok(())
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
        let mut table = Vec::with_capacity(plan.segments.len() * wire::SEG_LEN);
        let mut local = Vec::with_capacity(plan.segments.len());
        let mut total = 0u64;
        for s in plan.segments {
            let Target::Remote {
                addr, len, blob, ..
            } = s.target
            else {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    "remote transfer with a local target",
                ));
            };
            let key = <[u8; 8]>::try_from(&blob[..])
                .map(u64::from_le_bytes)
                .map_err(|_| {
                    Error::new(
                        ErrorKind::Corrupt,
                        OP,
                        format!(
                            "peer {peer:?}: tcp region key is {} bytes, not 8",
                            blob.len()
                        ),
                    )
                })?;
            wire::SegEntry { key, addr, len }.encode_into(&mut table);
            total += len;
            local.push(s.local);
        }
        Ok(Box::new(RemotePrepared {
            backend: self.clone(),
            peer,
            op: plan.op,
            table: table.into(),
            local: local.into(),
            total,
        }))
    }

    fn notify(&self, peer: &str, msg: Bytes, done: Completer) {
        // The agent refused anything longer than `max_notification` already.
        match self.conn(peer, "tcp notify") {
            Ok(c) => c.submit(Job::notify(msg, done)),
            Err(e) => done.complete(Err(e)),
        }
    }

    async fn shutdown(&self, _timeout: Duration) -> Result<()> {
        if let Some(s) = self.inner.started.get() {
            s.cancel.cancel();
        }
        let peers = std::mem::take(&mut *self.inner.peers.lock().unwrap());
        for (_, p) in peers {
            if let Some(c) = p.conn {
                c.close(ErrorKind::ShutDown, "the agent is shutting down");
            }
        }
        self.inner.regions.write().unwrap().clear();
        self.inner.keys.lock().unwrap().clear();
        Ok(())
    }
}

/// A transfer to a peer: the segment table is encoded once, at prepare time.
#[derive(Debug)]
struct RemotePrepared {
    backend: TcpBackend,
    peer: String,
    op: Op,
    table: Arc<[u8]>,
    local: Arc<[RegionSlice]>,
    total: u64,
}

impl PreparedTransfer for RemotePrepared {
    fn post(&self, notif: Option<Bytes>, done: Completer) {
        // The agent refused notifications over `max_notification` already.
        match self.backend.conn(&self.peer, "tcp post") {
            Ok(c) => c.submit(Job::transfer(
                self.op,
                self.table.clone(),
                self.local.clone(),
                self.total,
                notif,
                done,
            )),
            Err(e) => done.complete(Err(e)),
        }
    }
}
