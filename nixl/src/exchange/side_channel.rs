//! The direct side channel: an agent listens on a TCP port; peers fetch its metadata
//! (full or labelled partial), send theirs, or tell it to forget them.
//!
//! The server speaks first: a hello with its flags (bit 0: authentication required)
//! and its agent name. With a [`SharedSecret`], both ends then run the core's
//! authentication ([`crate::control`], each of its messages in one frame) before
//! anything else is read or served: both prove the secret and their agent names (the
//! secret never crosses the wire). A client with a secret also refuses a server that
//! does not authenticate, and one that proves another name than the one asked for.
//!
//! What a client may do to the peers the serving agent knows depends on whether it is
//! trusted, and as whom: see [`SideChannelOptions::accept_peer_updates`].

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

use super::frame::{read_frame, write_frame, FrameError, Kind};
use super::FULL_LABEL;
use crate::agent::WeakAgent;
use crate::agent::{Agent, Trust};
use crate::control::{nonce, ClientAuth, Refusal, ServerAuth, Ticket, AUTH_MAGIC, MAX_NAME};
use crate::error::{err, Error, ErrorKind, Result};
use crate::region::Registration;
pub use crate::secret::SharedSecret;

/// This protocol's name in the authentication ([`crate::control`]).
const AUTH_PROTOCOL: &str = "nixl side channel";
const FRAME_CONTEXT: &str = "nixl side channel v2 frame";
const MAC_LEN: usize = 32;

/// After an authenticated handshake, every frame carries a MAC under the session's
/// key over its direction, sequence number, kind and payload: a relay that passed
/// the handshake through cannot add, change, reorder or replay frames.
struct Session {
    key: SharedSecret,
    client: bool,
    sent: u64,
    received: u64,
}

impl Session {
    fn new(key: SharedSecret, client: bool) -> Self {
        Self {
            key,
            client,
            sent: 0,
            received: 0,
        }
    }

    fn mac(&self, from_client: bool, seq: u64, kind: Kind, payload: &[u8]) -> [u8; MAC_LEN] {
        self.key.sign(
            FRAME_CONTEXT,
            &[
                &[u8::from(from_client), kind as u8],
                &seq.to_le_bytes(),
                payload,
            ],
        )
    }

    /// The payload to send, with its MAC.
    fn seal(&mut self, kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mac = self.mac(self.client, self.sent, kind, payload);
        self.sent += 1;
        let mut v = Vec::with_capacity(payload.len() + MAC_LEN);
        v.extend_from_slice(payload);
        v.extend_from_slice(&mac);
        v
    }

    /// The payload of a received frame, if its MAC holds.
    fn open(&mut self, kind: Kind, mut framed: Vec<u8>) -> Option<Vec<u8>> {
        let at = framed.len().checked_sub(MAC_LEN)?;
        let (payload, mac) = framed.split_at(at);
        let parts: [&[u8]; 3] = [
            &[u8::from(!self.client), kind as u8],
            &self.received.to_le_bytes(),
            payload,
        ];
        if !self.key.verify(FRAME_CONTEXT, &parts, mac) {
            return None;
        }
        self.received += 1;
        framed.truncate(at);
        Some(framed)
    }
}

/// Options for both ends of the side channel.
#[derive(Clone, Debug)]
pub struct SideChannelOptions {
    /// Require (server) and prove (client) knowledge of this secret; when `None`,
    /// the agent's ([`AgentBuilder::secret`](crate::AgentBuilder::secret)), if set.
    pub secret: Option<SharedSecret>,
    /// Bound for a client operation (connect, handshake, request); for a server, the
    /// bound on a new connection's handshake and first request, and on every reply
    /// (a client that does not read its reply within it is cut).
    pub timeout: Duration,
    /// A server closes connections idle for this long (after the first request).
    pub idle_timeout: Duration,
    /// Largest frame payload accepted.
    pub max_frame: usize,
    /// Most connections a listener serves at once past their first request (default
    /// 1024), and a quarter of that in their handshake, by the one admission policy
    /// of [`crate::control::Admission`]: a newcomer closes the oldest connection
    /// still in its handshake, never one serving a request; a client idle for a
    /// minute may give its place; both bounds are clamped to the process's
    /// open-files limit.
    pub max_connections: usize,
    /// Server: let clients that did not authenticate replace a known peer (a
    /// restarted agent's [`Agent::send_metadata`]: a new instance, other connection
    /// info) or make this agent forget a known peer ([`Agent::invalidate_at`]).
    /// Default `false`.
    ///
    /// Without it and without [`SideChannelOptions::secret`], a client may introduce
    /// a peer this agent does not know yet (within
    /// [`PeerLimits`](crate::PeerLimits)), and add registrations to a known peer's
    /// instance; a send that would change, add or remove a known peer's connection
    /// info, replace its instance, or change or drop a region already known, and an
    /// invalidate of a known peer, are refused: the client
    /// gets [`ErrorKind::NotAllowed`], the refusal is logged with the peer's name and
    /// the client's address, and nothing changes. Nothing in metadata proves who sent
    /// it (a new instance id can be forged), so a restart elsewhere is recognised
    /// where the application vouches for it: its own [`Agent::load_metadata`],
    /// [`Agent::fetch_metadata`] or [`Agent::fetch_peer_metadata`] (and etcd, whose
    /// keys it watches) replace a known peer whatever it was.
    ///
    /// With a secret, a client proves it and its agent name: it may move or forget
    /// the peer of that name (its own restart, its own departure), and is treated as
    /// unauthenticated for every other peer. The secret proves membership: every
    /// holder can prove any name, so this keeps out whoever lacks it and keeps one
    /// connection to one name, but members are trusted not to pose as each other.
    /// Set this option only where everyone who reaches the port is trusted with every
    /// peer (as NIXL's listener trusts everyone).
    pub accept_peer_updates: bool,
}

impl Default for SideChannelOptions {
    fn default() -> Self {
        Self {
            secret: None,
            timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_frame: crate::metadata::Limits::default().max_total,
            max_connections: 1024,
            accept_peer_updates: false,
        }
    }
}

impl Agent {
    /// Serve this agent's metadata on `addr` (IPv4 or IPv6; port 0 picks one). Returns
    /// the bound address. The listener runs until shutdown or drop, through the agent's
    /// task tracker; a malformed, oversized or truncated frame closes only that
    /// connection.
    ///
    /// # Errors
    /// [`ErrorKind::Backend`] when the address cannot be bound; [`ErrorKind::ShutDown`].
    pub async fn listen(
        &self,
        addr: SocketAddr,
        options: &SideChannelOptions,
    ) -> Result<SocketAddr> {
        let options = &*self.with_agent_secret(options);
        let bound =
            super::serve_connections(
                self,
                addr,
                "listen",
                "side channel",
                options.max_connections,
                options.clone(),
                |agent, stream, options, ticket| async move {
                    serve(agent, stream, &options, ticket).await
                },
            )
            .await?;
        tracing::info!(agent = %self.name(), %bound, auth = options.secret.is_some(), "side channel listening");
        Ok(bound)
    }

    /// Store partial metadata (only `registrations`) under `label`, for peers to fetch
    /// through the side channel (and etcd, where published). Replaces an earlier one.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for an empty label, one with `/`, or the reserved
    /// label `full`; as [`Agent::partial_metadata`].
    pub fn publish_partial(
        &self,
        label: &str,
        registrations: &[Registration],
        with_conn_info: bool,
    ) -> Result<()> {
        check_label(label, "publish partial metadata")?;
        let bytes = self.partial_metadata(registrations, with_conn_info)?;
        self.labels()
            .lock()
            .unwrap()
            .insert(label.to_owned(), bytes);
        Ok(())
    }

    /// Fetch the full metadata of the agent serving at `addr` and load it. Resolves once
    /// it is loaded; returns the peer's name.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`], [`ErrorKind::NotAllowed`] (authentication refused),
    /// [`ErrorKind::RemoteDisconnected`], and as [`Agent::load_metadata`].
    pub async fn fetch_metadata(
        &self,
        addr: SocketAddr,
        options: &SideChannelOptions,
    ) -> Result<String> {
        self.fetch_label(addr, "", None, options).await
    }

    /// Fetch the full metadata of `peer`, served at `addr`, and load it: as
    /// [`Agent::fetch_metadata`], except that metadata naming another agent is
    /// refused and nothing is loaded (a server at `addr` cannot pass itself off as,
    /// or replace, another peer).
    ///
    /// # Errors
    /// [`ErrorKind::Mismatch`] when the metadata served names another agent; as
    /// [`Agent::fetch_metadata`].
    pub async fn fetch_peer_metadata(
        &self,
        addr: SocketAddr,
        peer: &str,
        options: &SideChannelOptions,
    ) -> Result<()> {
        self.fetch_label(addr, "", Some(peer), options)
            .await
            .map(drop)
    }

    /// Fetch partial metadata published under `label` at `addr` and load it.
    ///
    /// # Errors
    /// As [`Agent::fetch_metadata`]; [`ErrorKind::NotFound`] for an unknown label.
    pub async fn fetch_partial_metadata(
        &self,
        addr: SocketAddr,
        label: &str,
        options: &SideChannelOptions,
    ) -> Result<String> {
        check_label(label, "fetch partial metadata")?;
        self.fetch_label(addr, label, None, options).await
    }

    /// Fetch `peer`'s partial metadata published under `label` at `addr` and load it:
    /// as [`Agent::fetch_partial_metadata`], except that metadata naming another agent
    /// is refused and nothing is loaded.
    ///
    /// # Errors
    /// [`ErrorKind::Mismatch`] when the metadata served names another agent; as
    /// [`Agent::fetch_partial_metadata`].
    pub async fn fetch_peer_partial_metadata(
        &self,
        addr: SocketAddr,
        peer: &str,
        label: &str,
        options: &SideChannelOptions,
    ) -> Result<()> {
        check_label(label, "fetch partial metadata")?;
        self.fetch_label(addr, label, Some(peer), options)
            .await
            .map(drop)
    }

    /// The application asked for what `addr` serves: it may replace a known peer.
    async fn fetch_label(
        &self,
        addr: SocketAddr,
        label: &str,
        expect: Option<&str>,
        options: &SideChannelOptions,
    ) -> Result<String> {
        const OP: &str = "fetch metadata";
        let options = &*self.with_agent_secret(options);
        let who = Who {
            me: self.name(),
            server: expect,
        };
        let (md, proven) = request(addr, options, who, OP, Kind::Fetch, label.as_bytes()).await?;
        // A server that proved its name vouches for its own metadata only.
        let expect = expect.or(proven.as_deref());
        self.load_metadata_from(&md, expect, Trust::Full)
    }

    /// Send this agent's full metadata to the agent serving at `addr`, which loads it.
    /// A server that knows this agent with other connection info (this agent
    /// restarted elsewhere) loads it only from a trusted client (see
    /// [`SideChannelOptions::accept_peer_updates`]).
    ///
    /// # Errors
    /// As [`Agent::fetch_metadata`]; [`ErrorKind::NotAllowed`] when the server refuses
    /// to move the peer it knows by this name; the remote's other load errors as
    /// [`ErrorKind::Backend`].
    pub async fn send_metadata(
        &self,
        addr: SocketAddr,
        options: &SideChannelOptions,
    ) -> Result<()> {
        let md = self.metadata()?;
        self.send_metadata_bytes(addr, options, &md).await
    }

    /// Send `md` (this agent's metadata, whole or part) for the server to load.
    async fn send_metadata_bytes(
        &self,
        addr: SocketAddr,
        options: &SideChannelOptions,
        md: &[u8],
    ) -> Result<()> {
        let options = &*self.with_agent_secret(options);
        let who = Who {
            me: self.name(),
            server: None,
        };
        request(addr, options, who, "send metadata", Kind::Send, md)
            .await
            .map(drop)
    }

    /// Send part of this agent's metadata (see [`Agent::partial_metadata`]) to the
    /// agent serving at `addr`, which loads it, as [`Agent::send_metadata`] does.
    ///
    /// # Errors
    /// As [`Agent::partial_metadata`] and [`Agent::send_metadata`].
    pub async fn send_partial_metadata(
        &self,
        addr: SocketAddr,
        registrations: &[crate::Registration],
        with_conn_info: bool,
        options: &SideChannelOptions,
    ) -> Result<()> {
        let md = self.partial_metadata(registrations, with_conn_info)?;
        self.send_metadata_bytes(addr, options, &md).await
    }

    /// Tell the agent serving at `addr` to forget this agent. A server forgets a
    /// known peer only for a trusted client (see
    /// [`SideChannelOptions::accept_peer_updates`]).
    ///
    /// # Errors
    /// As [`Agent::send_metadata`]; [`ErrorKind::NotAllowed`] when the server refuses.
    pub async fn invalidate_at(
        &self,
        addr: SocketAddr,
        options: &SideChannelOptions,
    ) -> Result<()> {
        let who = Who {
            me: self.name(),
            server: None,
        };
        request(
            addr,
            &self.with_agent_secret(options),
            who,
            "invalidate metadata",
            Kind::Invalidate,
            self.name().as_bytes(),
        )
        .await
        .map(drop)
    }
}

impl Agent {
    /// `options`, with the agent's secret ([`AgentBuilder::secret`](crate::AgentBuilder::secret))
    /// where they name none.
    fn with_agent_secret<'a>(
        &self,
        options: &'a SideChannelOptions,
    ) -> std::borrow::Cow<'a, SideChannelOptions> {
        match (&options.secret, self.secret()) {
            (None, Some(s)) => std::borrow::Cow::Owned(SideChannelOptions {
                secret: Some(s),
                ..options.clone()
            }),
            _ => std::borrow::Cow::Borrowed(options),
        }
    }
}

pub(crate) fn check_label(label: &str, op: &'static str) -> Result<()> {
    if label.is_empty() || label.contains('/') || label == FULL_LABEL || label.len() > 128 {
        return err(
            ErrorKind::InvalidArgument,
            op,
            format!("label {label:?} must be 1-128 bytes without '/' and not {FULL_LABEL:?}"),
        );
    }
    Ok(())
}

/// Who a client is (the name it proves with a secret), and whom it expects to reach
/// (`None`: whoever the server proves to be).
#[derive(Clone, Copy, Debug)]
struct Who<'a> {
    me: &'a str,
    server: Option<&'a str>,
}

/// One client request on a fresh connection, bounded by `options.timeout`: the
/// reply, and the server's name where it proved it (with a secret).
async fn request(
    addr: SocketAddr,
    options: &SideChannelOptions,
    who: Who<'_>,
    op: &'static str,
    kind: Kind,
    payload: &[u8],
) -> Result<(Vec<u8>, Option<String>)> {
    match tokio::time::timeout(
        options.timeout,
        request_inner(addr, options, who, op, kind, payload),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => err(
            ErrorKind::TimedOut,
            op,
            format!("{addr} did not answer within {:?}", options.timeout),
        ),
    }
}

/// The server's hello: flags (bit 0: authentication required), then its agent name.
fn hello(auth_required: bool, name: &str) -> Vec<u8> {
    let mut h = vec![u8::from(auth_required)];
    h.extend_from_slice(name.as_bytes());
    h
}

async fn request_inner(
    addr: SocketAddr,
    options: &SideChannelOptions,
    who: Who<'_>,
    op: &'static str,
    kind: Kind,
    payload: &[u8],
) -> Result<(Vec<u8>, Option<String>)> {
    let io = |what: &str, e: std::io::Error| {
        Error::new(ErrorKind::RemoteDisconnected, op, format!("{addr}: {what}")).with_source(e)
    };
    let frame_err =
        |e: FrameError| Error::new(ErrorKind::RemoteDisconnected, op, format!("{addr}: {e}"));
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| io("connect", e))?;
    let _ = s.set_nodelay(true);
    let (k, hello) = read_frame(&mut s, 1 + MAX_NAME).await.map_err(frame_err)?;
    let server = match (k, hello.split_first()) {
        (Kind::Hello, Some((flags, name))) if *flags <= 1 => std::str::from_utf8(name).ok(),
        _ => None,
    };
    let Some(server) = server.filter(|n| !n.is_empty()) else {
        return err(
            ErrorKind::Mismatch,
            op,
            format!("{addr} is not a nixl side channel"),
        );
    };
    let auth_required = hello[0] == 1;
    let mut session = None;
    match (&options.secret, auth_required) {
        (None, true) => return err(ErrorKind::NotAllowed, op, format!("{addr} requires a shared secret; none is configured")),
        (Some(_), false) => {
            return err(ErrorKind::NotAllowed, op, format!("{addr} does not authenticate, but a shared secret is configured; refusing an unauthenticated server"))
        }
        (None, false) => {}
        (Some(secret), true) => {
            if let Some(expected) = who.server.filter(|e| *e != server) {
                return err(ErrorKind::Mismatch, op, format!("{addr} serves agent {server:?}, not {expected:?}"));
            }
            let (mut auth, first) =
                ClientAuth::start(AUTH_PROTOCOL, secret.clone(), who.me, server, nonce())
                    .or_else(|r| err(ErrorKind::NotAllowed, op, format!("{addr}: {}", r.why)))?;
            write_frame(&mut s, Kind::Auth, &first).await.map_err(|e| io("auth", e))?;
            while !auth.is_done() {
                let (k, reply) = read_frame(&mut s, 4096).await.map_err(frame_err)?;
                let next = match k {
                    Kind::AuthOk => auth.received_message(&reply),
                    Kind::Error => return err(ErrorKind::NotAllowed, op, format!("{addr} refused: {}", String::from_utf8_lossy(&reply))),
                    _ => return err(ErrorKind::Mismatch, op, format!("{addr} broke the handshake")),
                };
                let next = next.or_else(|r| err(ErrorKind::NotAllowed, op, format!("{addr}: {}", r.why)))?;
                if !next.is_empty() {
                    write_frame(&mut s, Kind::Auth, &next).await.map_err(|e| io("auth", e))?;
                }
            }
            session = auth.session_key().map(|k| Session::new(k, true));
        }
    }
    let proven = session.as_ref().map(|_| server.to_owned());
    let sealed;
    let payload = match session.as_mut() {
        Some(sn) => {
            sealed = sn.seal(kind, payload);
            &sealed[..]
        }
        None => payload,
    };
    write_frame(&mut s, kind, payload)
        .await
        .map_err(|e| io("request", e))?;
    let extra = if session.is_some() { MAC_LEN } else { 0 };
    let (k, reply) = read_frame(&mut s, options.max_frame + extra)
        .await
        .map_err(frame_err)?;
    let reply = match session.as_mut() {
        Some(sn) => sn.open(k, reply).ok_or_else(|| {
            Error::new(
                ErrorKind::NotAllowed,
                op,
                format!("{addr}: the reply failed authentication"),
            )
        })?,
        None => reply,
    };
    match k {
        Kind::Metadata | Kind::Ok => Ok((reply, proven)),
        Kind::Error => {
            let msg = String::from_utf8_lossy(&reply).into_owned();
            let kind = if msg.starts_with("not found") {
                ErrorKind::NotFound
            } else if msg.starts_with(NOT_ALLOWED) {
                ErrorKind::NotAllowed
            } else {
                ErrorKind::Backend
            };
            err(kind, op, format!("{addr}: {msg}"))
        }
        _ => err(
            ErrorKind::Mismatch,
            op,
            format!("{addr} answered with an unexpected frame"),
        ),
    }
}

/// How a server's error answer starts when it refused a request it understood (the
/// client reports [`ErrorKind::NotAllowed`]).
const NOT_ALLOWED: &str = "not allowed: ";

/// Serve one connection. Errors are the reason it was closed.
async fn serve(
    agent: WeakAgent,
    mut s: TcpStream,
    options: &SideChannelOptions,
    mut ticket: Ticket,
) -> std::result::Result<(), String> {
    let _ = s.set_nodelay(true);
    let from = s
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_owned(), |a| a.to_string());
    let me = agent
        .upgrade()
        .map(|a| a.name().to_owned())
        .ok_or_else(|| "agent gone".to_owned())?;
    send(
        &mut s,
        options,
        None,
        Kind::Hello,
        &hello(options.secret.is_some(), &me),
    )
    .await?;
    // The name a client with a secret proved: it may move or forget that peer.
    let (mut proven, mut session) = (None, None);
    if let Some(secret) = &options.secret {
        // One bound for the whole exchange, however its messages are paced.
        let deadline = tokio::time::Instant::now() + options.timeout;
        let mut auth = ServerAuth::new(AUTH_PROTOCOL, secret.clone(), &me, nonce());
        let mut first = true;
        while auth.need() > 0 {
            let frame = tokio::time::timeout_at(deadline, read_frame(&mut s, 4096))
                .await
                .map_err(|_| "handshake timed out".to_owned())?
                .map_err(|e| e.to_string())?;
            let step = match frame {
                (Kind::Auth, p) if first && p.len() > 4 && p[..4] == AUTH_MAGIC => {
                    auth.received_message(&p[4..])
                }
                (Kind::Auth, p) if !first => auth.received_message(&p),
                _ => Err(Refusal {
                    reply: None,
                    why: "the client did not authenticate, but a shared secret is configured here"
                        .into(),
                }),
            };
            first = false;
            match step {
                Ok(reply) => send(&mut s, options, None, Kind::AuthOk, &reply).await?,
                Err(r) => {
                    let _ =
                        send(&mut s, options, None, Kind::Error, b"authentication failed").await;
                    return Err(format!("authentication failed: {}", r.why));
                }
            }
        }
        proven = auth.proven().map(str::to_owned);
        session = auth.session_key().map(|k| Session::new(k, false));
    }
    let trust = match (&proven, options.accept_peer_updates) {
        (_, true) => Trust::Full,
        (Some(name), false) => Trust::Proven(name.clone()),
        (None, false) => Trust::Unverified,
    };
    // The first request comes within the handshake's bound; later ones within the
    // idle timeout.
    let mut wait = options.timeout;
    let extra = if session.is_some() { MAC_LEN } else { 0 };
    loop {
        let read = read_frame(&mut s, options.max_frame + extra);
        let frame = match tokio::time::timeout(wait, read).await {
            Err(_) => return Err("idle timeout".into()),
            Ok(Err(FrameError::Closed)) => return Ok(()),
            Ok(Err(e)) => {
                if let FrameError::Malformed(m) = &e {
                    let _ =
                        send(&mut s, options, session.as_mut(), Kind::Error, m.as_bytes()).await;
                }
                return Err(e.to_string());
            }
            Ok(Ok(f)) => f,
        };
        let frame = match session.as_mut() {
            None => frame,
            Some(sn) => match sn.open(frame.0, frame.1) {
                Some(p) => (frame.0, p),
                None => return Err("a frame failed authentication".into()),
            },
        };
        // Established once the client made its first request (after its
        // authentication, where a secret is set); every request after is activity.
        if !ticket.establish_with(proven.is_some()) {
            let _ = send(
                &mut s,
                options,
                session.as_mut(),
                Kind::Error,
                b"too many connections (SideChannelOptions::max_connections)",
            )
            .await;
            return Err("too many connections (SideChannelOptions::max_connections)".into());
        }
        ticket.touch();
        wait = options.idle_timeout;
        let Some(agent) = agent.upgrade() else {
            let _ = send(
                &mut s,
                options,
                session.as_mut(),
                Kind::Error,
                b"the agent is gone",
            )
            .await;
            return Err("agent gone".into());
        };
        let reply = match frame {
            (Kind::Fetch, label) if label.is_empty() => {
                agent.metadata().map(|m| (Kind::Metadata, m.to_vec()))
            }
            (Kind::Fetch, label) => {
                let label = String::from_utf8_lossy(&label).into_owned();
                match agent.labels().lock().unwrap().get(&label) {
                    Some(m) => Ok((Kind::Metadata, m.to_vec())),
                    None => err(
                        ErrorKind::NotFound,
                        "serve metadata",
                        format!("not found: no partial metadata labelled {label:?}"),
                    ),
                }
            }
            (Kind::Send, md) => match agent.load_metadata_from(&md, None, trust.clone()) {
                Ok(_) => Ok((Kind::Ok, Vec::new())),
                Err(e) => {
                    if e.kind() == ErrorKind::NotAllowed {
                        tracing::warn!(%from, error = %e, "side channel: refused metadata that would move a known peer, from a client not authenticated as it");
                    }
                    Err(e)
                }
            },
            (Kind::Invalidate, name) => {
                let peer = String::from_utf8_lossy(&name).into_owned();
                // Checked and forgotten under the agent's loading lock: a trusted load
                // between the two is never forgotten on an unvouched request.
                let vouched = trust.vouches_for(&peer);
                let refused = |_nixl: bool| {
                    (!vouched).then(|| {
                        Error::new(
                            ErrorKind::NotAllowed,
                            "invalidate metadata",
                            format!("a client not authenticated as {peer:?} may not make this agent forget it"),
                        )
                    })
                };
                match agent.forget_peer_unless(&peer, refused) {
                    Ok(()) => Ok((Kind::Ok, Vec::new())),
                    Err(e) if e.kind() == ErrorKind::UnknownPeer => Ok((Kind::Ok, Vec::new())),
                    Err(e) => {
                        if e.kind() == ErrorKind::NotAllowed {
                            tracing::warn!(%peer, %from, "side channel: refused to forget a known peer for a client not authenticated as that peer");
                        }
                        Err(e)
                    }
                }
            }
            (k, _) => {
                let _ = send(
                    &mut s,
                    options,
                    session.as_mut(),
                    Kind::Error,
                    b"unexpected frame",
                )
                .await;
                return Err(format!("unexpected {k:?} frame"));
            }
        };
        drop(agent);
        match reply {
            Ok((k, p)) => send(&mut s, options, session.as_mut(), k, &p).await?,
            Err(e) => {
                let msg = match e.kind() {
                    ErrorKind::NotFound => e.context().to_owned(),
                    ErrorKind::NotAllowed => format!("{NOT_ALLOWED}{e}"),
                    _ => e.to_string(),
                };
                send(
                    &mut s,
                    options,
                    session.as_mut(),
                    Kind::Error,
                    msg.as_bytes(),
                )
                .await?
            }
        }
    }
}

/// Write one frame within `options.timeout` (sealed, past an authenticated
/// handshake): a client that stops reading is cut.
async fn send(
    s: &mut TcpStream,
    options: &SideChannelOptions,
    session: Option<&mut Session>,
    kind: Kind,
    payload: &[u8],
) -> std::result::Result<(), String> {
    let sealed;
    let payload = match session {
        Some(sn) => {
            sealed = sn.seal(kind, payload);
            &sealed[..]
        }
        None => payload,
    };
    match tokio::time::timeout(options.timeout, write_frame(s, kind, payload)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "the client did not read the reply within {:?}",
            options.timeout
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{AgentMetadata, BackendMeta};

    fn md(name: &str, instance: u64, conn: &[u8]) -> Vec<u8> {
        AgentMetadata {
            name: name.into(),
            instance,
            partial: false,
            backends: vec![BackendMeta {
                name: "tcp".into(),
                conn_info: Some(conn.to_vec()),
            }],
            regions: vec![],
        }
        .encode()
        .unwrap()
    }

    /// Agent "a", knowing peer "b", serving a side channel with `options`.
    async fn serving_a_that_knows_b(options: &SideChannelOptions) -> (Agent, SocketAddr) {
        let a = Agent::builder("a").build().await.unwrap();
        a.load_metadata(&md("b", 1, b"b at 1")).unwrap();
        let addr = a
            .listen("127.0.0.1:0".parse().unwrap(), options)
            .await
            .unwrap();
        (a, addr)
    }

    /// A client that proved the secret as one agent may move or forget that peer
    /// only; for any other it is an unauthenticated client.
    #[tokio::test]
    async fn a_member_moves_or_forgets_only_the_peer_it_proved() {
        let options = SideChannelOptions {
            secret: Some(SharedSecret::new("k").unwrap()),
            timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let (a, addr) = serving_a_that_knows_b(&options).await;
        let call = |me: &'static str, kind: Kind, payload: Vec<u8>| {
            let options = options.clone();
            async move {
                let who = Who { me, server: None };
                request(addr, &options, who, "test", kind, &payload)
                    .await
                    .map(drop)
            }
        };
        // "mallory" holds the secret: it cannot move or forget "b".
        let e = call("mallory", Kind::Send, md("b", 2, b"mallory's"))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
        let e = call("mallory", Kind::Invalidate, b"b".to_vec())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
        assert_eq!(a.peers(), ["b"]);
        // It may still introduce itself.
        call("mallory", Kind::Send, md("mallory", 3, b"m"))
            .await
            .unwrap();
        // Proven as "b", it may: a restart elsewhere, then its departure.
        call("b", Kind::Send, md("b", 4, b"b at 2")).await.unwrap();
        call("b", Kind::Invalidate, b"b".to_vec()).await.unwrap();
        assert_eq!(a.peers(), ["mallory"]);
        // A client expecting another agent at this address refuses it.
        let who = Who {
            me: "b",
            server: Some("not-a"),
        };
        let e = request(addr, &options, who, "test", Kind::Fetch, b"")
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        let _ = a.shutdown().await;
    }

    /// What a relay that passed an honest member's handshake through can do next:
    /// frames it writes itself lack the session's MAC, and the server closes.
    #[tokio::test]
    async fn frames_after_the_handshake_must_carry_the_sessions_mac() {
        let secret = SharedSecret::new("k").unwrap();
        let options = SideChannelOptions {
            secret: Some(secret.clone()),
            timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let (a, addr) = serving_a_that_knows_b(&options).await;
        for forged in [None, Some(SharedSecret::new("a guessed key").unwrap())] {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let (k, hello) = read_frame(&mut s, 4096).await.unwrap();
            assert_eq!((k, &hello[..]), (Kind::Hello, &b"\x01a"[..]));
            let (mut auth, first) =
                ClientAuth::start(AUTH_PROTOCOL, secret.clone(), "b", "a", nonce()).unwrap();
            write_frame(&mut s, Kind::Auth, &first).await.unwrap();
            while !auth.is_done() {
                let (_, p) = read_frame(&mut s, 4096).await.unwrap();
                let next = auth.received_message(&p).unwrap();
                if !next.is_empty() {
                    write_frame(&mut s, Kind::Auth, &next).await.unwrap();
                }
            }
            // Proven as "b": a sealed send would move "b". Unsealed or sealed
            // under another key, it is not read as a request.
            let payload = md("b", 2, b"the relay's");
            let framed = match &forged {
                None => payload,
                Some(k) => Session::new(k.clone(), true).seal(Kind::Send, &payload),
            };
            write_frame(&mut s, Kind::Send, &framed).await.unwrap();
            assert!(
                matches!(
                    read_frame(&mut s, 4096).await,
                    Err(FrameError::Closed | FrameError::Io(_))
                ),
                "the server closes"
            );
        }
        let peers = a.peers();
        assert_eq!(peers, ["b"]);
        // The honest client, sealing with the session key, still moves "b".
        let who = Who {
            me: "b",
            server: None,
        };
        request(
            addr,
            &options,
            who,
            "test",
            Kind::Send,
            &md("b", 3, b"b at 2"),
        )
        .await
        .unwrap();
        let _ = a.shutdown().await;
    }

    #[tokio::test]
    async fn a_handshake_paced_out_is_cut_at_its_deadline() {
        let options = SideChannelOptions {
            secret: Some(SharedSecret::new("k").unwrap()),
            timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let a = Agent::builder("a").build().await.unwrap();
        let addr = a
            .listen("127.0.0.1:0".parse().unwrap(), &options)
            .await
            .unwrap();
        let mut s = TcpStream::connect(addr).await.unwrap();
        read_frame(&mut s, 4096).await.unwrap();
        let (_, first) = ClientAuth::start(
            AUTH_PROTOCOL,
            SharedSecret::new("k").unwrap(),
            "b",
            "a",
            nonce(),
        )
        .unwrap();
        write_frame(&mut s, Kind::Auth, &first).await.unwrap();
        assert_eq!(read_frame(&mut s, 4096).await.unwrap().0, Kind::AuthOk);
        let start = std::time::Instant::now();
        // Empty authentication messages, one every 100 ms: never an answer, and
        // the connection ends within the handshake's bound.
        let ended = loop {
            if write_frame(&mut s, Kind::Auth, b"").await.is_err() {
                break true;
            }
            match tokio::time::timeout(Duration::from_millis(100), read_frame(&mut s, 4096)).await {
                Ok(Ok((Kind::AuthOk, _))) => panic!("an empty message was answered"),
                Ok(_) => break true,
                Err(_) if start.elapsed() > Duration::from_secs(5) => break false,
                Err(_) => {}
            }
        };
        assert!(ended, "the handshake outlived its bound");
        let _ = a.shutdown().await;
    }
}
