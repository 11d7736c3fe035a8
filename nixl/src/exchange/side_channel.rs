//! The direct side channel: an agent listens on a TCP port; peers fetch its metadata
//! (full or labelled partial), send theirs, or tell it to forget them.
//!
//! With a [`SharedSecret`], both ends prove they know it before anything else is read
//! or served (HMAC-SHA256 challenge-response over fresh nonces from both sides; the
//! secret never crosses the wire). A client with a secret also refuses a server that
//! does not authenticate.
//!
//! What a client may do to the peers the serving agent knows depends on whether it is
//! trusted: see [`SideChannelOptions::accept_peer_updates`].

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

use super::frame::{read_frame, write_frame, FrameError, Kind, MAC_LEN, NONCE_LEN};
use super::FULL_LABEL;
use crate::agent::WeakAgent;
use crate::agent::{Agent, Trust};
use crate::error::{err, Error, ErrorKind, Result};
use crate::region::Registration;
pub use crate::secret::SharedSecret;

/// HMAC contexts of the side-channel handshake (each side signs both nonces).
const CLIENT_CONTEXT: &str = "nixl side channel v1 client";
const SERVER_CONTEXT: &str = "nixl side channel v1 server";

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
    /// Most connections a listener serves at once (default 1024); one more closes the
    /// oldest, so idle or slow clients never lock others out.
    pub max_connections: usize,
    /// Server: let clients that did not authenticate move a known peer to other
    /// connection info (a restarted agent's [`Agent::send_metadata`]) or make this
    /// agent forget a known peer ([`Agent::invalidate_at`]). Default `false`.
    ///
    /// Without it and without [`SideChannelOptions::secret`], a client may introduce
    /// a peer this agent does not know yet, and re-send a known peer's metadata
    /// (new registrations, a new instance) as long as every backend's connection
    /// info stays the same; a send that would change, add or remove a known peer's
    /// connection info, and an invalidate of a known peer, are refused: the client
    /// gets [`ErrorKind::NotAllowed`], the refusal is logged with the peer's name and
    /// the client's address, and nothing changes. Nothing in metadata proves who sent
    /// it (a new instance id can be forged), so a restart elsewhere is recognised
    /// where the application vouches for it: its own [`Agent::load_metadata`],
    /// [`Agent::fetch_metadata`] or [`Agent::fetch_peer_metadata`] (and etcd, whose
    /// keys it watches) replace a known peer whatever it was.
    ///
    /// With a secret, every client that proved it is trusted as with this option:
    /// the secret authenticates membership, not identity, so any holder may move or
    /// forget any peer. Set this only where everyone who reaches the port is trusted
    /// (as NIXL's listener trusts everyone).
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

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).expect("the OS random source works");
    n
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
        let bound = super::serve_connections(
            self,
            addr,
            "listen",
            "side channel",
            options.max_connections,
            options.clone(),
            |agent, stream, options| async move { serve(agent, stream, &options).await },
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
        let md = request(addr, options, OP, Kind::Fetch, label.as_bytes()).await?;
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
        let options = &*self.with_agent_secret(options);
        request(addr, options, "send metadata", Kind::Send, &md)
            .await
            .map(drop)
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
        request(
            addr,
            &self.with_agent_secret(options),
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

/// One client request on a fresh connection, bounded by `options.timeout`.
async fn request(
    addr: SocketAddr,
    options: &SideChannelOptions,
    op: &'static str,
    kind: Kind,
    payload: &[u8],
) -> Result<Vec<u8>> {
    match tokio::time::timeout(
        options.timeout,
        request_inner(addr, options, op, kind, payload),
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

async fn request_inner(
    addr: SocketAddr,
    options: &SideChannelOptions,
    op: &'static str,
    kind: Kind,
    payload: &[u8],
) -> Result<Vec<u8>> {
    let io = |what: &str, e: std::io::Error| {
        Error::new(ErrorKind::RemoteDisconnected, op, format!("{addr}: {what}")).with_source(e)
    };
    let frame_err =
        |e: FrameError| Error::new(ErrorKind::RemoteDisconnected, op, format!("{addr}: {e}"));
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| io("connect", e))?;
    let _ = s.set_nodelay(true);
    let (k, hello) = read_frame(&mut s, 1024).await.map_err(frame_err)?;
    if k != Kind::Hello || hello.len() != 1 + NONCE_LEN {
        return err(
            ErrorKind::Mismatch,
            op,
            format!("{addr} is not a nixl side channel"),
        );
    }
    let auth_required = hello[0] & 1 == 1;
    let server_nonce = &hello[1..];
    match (&options.secret, auth_required) {
        (None, true) => return err(ErrorKind::NotAllowed, op, format!("{addr} requires a shared secret; none is configured")),
        (Some(_), false) => {
            return err(ErrorKind::NotAllowed, op, format!("{addr} does not authenticate, but a shared secret is configured; refusing an unauthenticated server"))
        }
        (None, false) => {}
        (Some(secret), true) => {
            let client_nonce = nonce();
            let mac = secret.sign(CLIENT_CONTEXT, &[server_nonce, &client_nonce]);
            let mut auth = Vec::with_capacity(NONCE_LEN + MAC_LEN);
            auth.extend_from_slice(&client_nonce);
            auth.extend_from_slice(&mac);
            write_frame(&mut s, Kind::Auth, &auth).await.map_err(|e| io("auth", e))?;
            let (k, reply) = read_frame(&mut s, 4096).await.map_err(frame_err)?;
            match k {
                Kind::AuthOk if reply.len() == MAC_LEN => {
                    if !secret.verify(SERVER_CONTEXT, &[&client_nonce, server_nonce], &reply) {
                        return err(ErrorKind::NotAllowed, op, format!("{addr} failed to prove it knows the shared secret"));
                    }
                }
                Kind::Error => return err(ErrorKind::NotAllowed, op, format!("{addr} refused: {}", String::from_utf8_lossy(&reply))),
                _ => return err(ErrorKind::Mismatch, op, format!("{addr} broke the handshake")),
            }
        }
    }
    write_frame(&mut s, kind, payload)
        .await
        .map_err(|e| io("request", e))?;
    let (k, reply) = read_frame(&mut s, options.max_frame)
        .await
        .map_err(frame_err)?;
    match k {
        Kind::Metadata | Kind::Ok => Ok(reply),
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
) -> std::result::Result<(), String> {
    let _ = s.set_nodelay(true);
    let from = s
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_owned(), |a| a.to_string());
    // Reached past the handshake, a client with a secret proved it.
    let trusted = options.secret.is_some() || options.accept_peer_updates;
    let trust = if trusted {
        Trust::Full
    } else {
        Trust::Unverified
    };
    let server_nonce = nonce();
    let mut hello = Vec::with_capacity(1 + NONCE_LEN);
    hello.push(u8::from(options.secret.is_some()));
    hello.extend_from_slice(&server_nonce);
    send(&mut s, options, Kind::Hello, &hello).await?;
    if let Some(secret) = &options.secret {
        let frame = tokio::time::timeout(options.timeout, read_frame(&mut s, 4096))
            .await
            .map_err(|_| "handshake timed out".to_owned())?
            .map_err(|e| e.to_string())?;
        let ok = match &frame {
            (Kind::Auth, p) if p.len() == NONCE_LEN + MAC_LEN => {
                let (client_nonce, mac) = p.split_at(NONCE_LEN);
                secret.verify(CLIENT_CONTEXT, &[&server_nonce, client_nonce], mac)
            }
            _ => false,
        };
        if !ok {
            let _ = send(&mut s, options, Kind::Error, b"authentication failed").await;
            return Err("authentication failed".into());
        }
        let client_nonce = &frame.1[..NONCE_LEN];
        let mac = secret.sign(SERVER_CONTEXT, &[client_nonce, &server_nonce]);
        send(&mut s, options, Kind::AuthOk, &mac).await?;
    }
    // The first request comes within the handshake's bound; later ones within the
    // idle timeout.
    let mut wait = options.timeout;
    loop {
        let frame = match tokio::time::timeout(wait, read_frame(&mut s, options.max_frame)).await {
            Err(_) => return Err("idle timeout".into()),
            Ok(Err(FrameError::Closed)) => return Ok(()),
            Ok(Err(e)) => {
                if let FrameError::Malformed(m) = &e {
                    let _ = send(&mut s, options, Kind::Error, m.as_bytes()).await;
                }
                return Err(e.to_string());
            }
            Ok(Ok(f)) => f,
        };
        wait = options.idle_timeout;
        let Some(agent) = agent.upgrade() else {
            let _ = send(&mut s, options, Kind::Error, b"the agent is gone").await;
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
            (Kind::Send, md) => match agent.load_metadata_from(&md, None, trust) {
                Ok(_) => Ok((Kind::Ok, Vec::new())),
                Err(e) => {
                    if !trusted && e.kind() == ErrorKind::NotAllowed {
                        tracing::warn!(%from, error = %e, "side channel: refused metadata from an unauthenticated client");
                    }
                    Err(e)
                }
            },
            (Kind::Invalidate, name) => {
                let peer = String::from_utf8_lossy(&name).into_owned();
                if !trusted && agent.knows_peer(&peer) {
                    tracing::warn!(%peer, %from, "side channel: refused to forget a known peer for an unauthenticated client");
                    err(
                        ErrorKind::NotAllowed,
                        "invalidate metadata",
                        format!("an unauthenticated client may not make this agent forget the known peer {peer:?}"),
                    )
                } else {
                    match agent.forget_peer(&peer) {
                        Ok(()) => Ok((Kind::Ok, Vec::new())),
                        Err(e) if e.kind() == ErrorKind::UnknownPeer => Ok((Kind::Ok, Vec::new())),
                        Err(e) => Err(e),
                    }
                }
            }
            (k, _) => {
                let _ = send(&mut s, options, Kind::Error, b"unexpected frame").await;
                return Err(format!("unexpected {k:?} frame"));
            }
        };
        drop(agent);
        match reply {
            Ok((k, p)) => send(&mut s, options, k, &p).await?,
            Err(e) => {
                let msg = match e.kind() {
                    ErrorKind::NotFound => e.context().to_owned(),
                    ErrorKind::NotAllowed => format!("{NOT_ALLOWED}{e}"),
                    _ => e.to_string(),
                };
                send(&mut s, options, Kind::Error, msg.as_bytes()).await?
            }
        }
    }
}

/// Write one frame within `options.timeout`: a client that stops reading is cut.
async fn send(
    s: &mut TcpStream,
    options: &SideChannelOptions,
    kind: Kind,
    payload: &[u8],
) -> std::result::Result<(), String> {
    match tokio::time::timeout(options.timeout, write_frame(s, kind, payload)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "the client did not read the reply within {:?}",
            options.timeout
        )),
    }
}
