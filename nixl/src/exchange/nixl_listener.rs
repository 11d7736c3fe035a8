//! NIXL's own metadata listener protocol (its `send_local_metadata`,
//! `fetch_remote_metadata` and `invalidate_local_metadata` with an address), so NIXL
//! agents and this crate's agents exchange metadata directly.
//!
//! See [`NixlListenerOptions`] for the protocol.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::agent::WeakAgent;
use crate::agent::{Agent, Trust};
use crate::error::{err, Error, ErrorKind, Result};

/// The marker every command starts with.
const MARK: &[u8] = b"NIXLCOMM:";
/// NIXL's default listener port (`default_comm_port`).
pub const NIXL_DEFAULT_PORT: u16 = 8888;

/// Options for NIXL's listener protocol, server and client.
///
/// # Protocol (NIXL 1.3 to 1.5.x)
/// TCP, IPv4 in NIXL. Every message is a frame: a u64 little-endian length, then that
/// many bytes, which start with `NIXLCOMM:` and a four-letter command:
/// - `NIXLCOMM:LOAD<metadata>`: load the sender's metadata (no answer);
/// - `NIXLCOMM:SEND`: answer on the same connection with `NIXLCOMM:LOAD<metadata>`,
///   the answering agent's full metadata;
/// - `NIXLCOMM:INVL<name>`: forget the agent `name` (no answer).
///
/// There is no authentication, as with NIXL's listener: anyone who reaches the port
/// can introduce a NIXL agent or make the agent forget one. The listener follows
/// NIXL's own loader rules to limit that: it loads NIXL's format only, never over a
/// peer of this crate, never new connection info for a NIXL agent it knows (NIXL's
/// reload rule), and `INVL` forgets NIXL agents only. As in NIXL, `INVL` then `LOAD`
/// moves a known NIXL agent to other connection info in two steps (NIXL agents
/// restart that way). Bind it to an interface only trusted peers reach (use the side channel with a
/// [`SharedSecret`](crate::SharedSecret) between agents of this crate). Connections stay
/// open for more frames, as NIXL keeps them; a frame over
/// [`NixlListenerOptions::max_frame`], a malformed one or a connection idle for
/// [`NixlListenerOptions::idle_timeout`] closes only that connection.
#[derive(Clone, Debug)]
pub struct NixlListenerOptions {
    /// Bound for a client operation (connect, send, the answer to a fetch).
    pub timeout: Duration,
    /// A server closes connections idle for this long.
    pub idle_timeout: Duration,
    /// Largest frame accepted, in bytes.
    pub max_frame: usize,
    /// Most connections a listener serves at once past their first command (default
    /// 1024), and a quarter of that before it, by the one admission policy of
    /// [`crate::control::Admission`] (a newcomer closes the oldest connection that
    /// has sent nothing yet; a client idle for a minute may give its place; both
    /// bounds are clamped to the process's open-files limit).
    pub max_connections: usize,
}

impl Default for NixlListenerOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            max_frame: crate::metadata::Limits::default().max_total + MARK.len() + 4,
            max_connections: 1024,
        }
    }
}

/// One command of a frame.
#[derive(Debug, PartialEq, Eq)]
enum Command<'a> {
    Load(&'a [u8]),
    Send,
    Invalidate(&'a str),
}

/// Parse a frame's commands. NIXL sends one command per frame; a `SEND` or `INVL`
/// may be followed by further commands (NIXL's reader splits on the marker), while
/// `LOAD` takes the rest of the frame (metadata may contain any bytes).
fn parse(mut body: &[u8]) -> std::result::Result<Vec<Command<'_>>, String> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let Some(rest) = body.strip_prefix(MARK) else {
            return Err(format!(
                "a frame that does not start with NIXLCOMM: ({:?})",
                String::from_utf8_lossy(&body[..body.len().min(16)])
            ));
        };
        let Some((head, rest)) = rest.split_first_chunk::<4>() else {
            return Err("a command shorter than four letters".into());
        };
        let next = |r: &[u8]| {
            r.windows(MARK.len())
                .position(|w| w == MARK)
                .unwrap_or(r.len())
        };
        match head {
            b"LOAD" => {
                out.push(Command::Load(rest));
                body = &[];
            }
            b"SEND" => {
                out.push(Command::Send);
                body = &rest[next(rest)..];
            }
            b"INVL" => {
                let n = next(rest);
                let name = std::str::from_utf8(&rest[..n])
                    .map_err(|_| "an INVL name that is not UTF-8".to_owned())?;
                out.push(Command::Invalidate(name));
                body = &rest[n..];
            }
            other => {
                return Err(format!(
                    "unknown command {:?}",
                    String::from_utf8_lossy(other)
                ))
            }
        }
    }
    Ok(out)
}

async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len).await?;
    let len = u64::from_le_bytes(len);
    let len = usize::try_from(len)
        .ok()
        .filter(|&n| n <= max)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a frame of {len} bytes exceeds the {max}-byte limit"),
            )
        })?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(body)
}

async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, parts: &[&[u8]]) -> std::io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut frame = Vec::with_capacity(8 + len);
    frame.extend_from_slice(&(len as u64).to_le_bytes());
    for p in parts {
        frame.extend_from_slice(p);
    }
    w.write_all(&frame).await?;
    w.flush().await
}

impl Agent {
    /// Serve NIXL's listener protocol on `addr` (port 0 picks one; NIXL's default is
    /// [`NIXL_DEFAULT_PORT`]): NIXL agents fetch this agent's metadata in NIXL's format
    /// ([`Agent::nixl_metadata`]), send theirs (loaded as by
    /// [`Agent::load_metadata`], under NIXL's rules: see [`NixlListenerOptions`]) and
    /// tell it to forget them. Returns the bound
    /// address. The listener runs until shutdown or drop, through the agent's task
    /// tracker. See [`NixlListenerOptions`] for the protocol and its (absent)
    /// security.
    ///
    /// # Errors
    /// [`ErrorKind::Backend`] when the address cannot be bound; [`ErrorKind::ShutDown`].
    pub async fn listen_nixl(
        &self,
        addr: SocketAddr,
        options: &NixlListenerOptions,
    ) -> Result<SocketAddr> {
        let bound =
            super::serve_connections(
                self,
                addr,
                "listen for NIXL agents",
                "NIXL listener",
                options.max_connections,
                options.clone(),
                |agent, stream, options, ticket| async move {
                    serve(agent, stream, &options, ticket).await
                },
            )
            .await?;
        tracing::info!(agent = %self.name(), %bound, "NIXL listener listening");
        Ok(bound)
    }

    /// Fetch the full metadata of the agent whose NIXL listener is at `addr` (a NIXL
    /// agent with `enable_listen_thread`, or an agent of this crate with
    /// [`Agent::listen_nixl`]) and load it. Returns the peer's name.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] when there is no answer within the options' timeout;
    /// [`ErrorKind::RemoteDisconnected`] when the connection fails or closes; as
    /// [`Agent::load_metadata`].
    pub async fn fetch_nixl_metadata(
        &self,
        addr: SocketAddr,
        options: &NixlListenerOptions,
    ) -> Result<String> {
        self.fetch_nixl(addr, None, options).await
    }

    /// Fetch the full metadata of `peer` from the NIXL listener at `addr` and load it:
    /// as [`Agent::fetch_nixl_metadata`], except that metadata naming another agent is
    /// refused and nothing is loaded (a listener at `addr` cannot pass itself off as,
    /// or replace, another peer).
    ///
    /// # Errors
    /// [`ErrorKind::Mismatch`] when the metadata served names another agent; as
    /// [`Agent::fetch_nixl_metadata`].
    pub async fn fetch_nixl_peer_metadata(
        &self,
        addr: SocketAddr,
        peer: &str,
        options: &NixlListenerOptions,
    ) -> Result<()> {
        self.fetch_nixl(addr, Some(peer), options).await.map(drop)
    }

    async fn fetch_nixl(
        &self,
        addr: SocketAddr,
        expect: Option<&str>,
        options: &NixlListenerOptions,
    ) -> Result<String> {
        const OP: &str = "fetch NIXL metadata";
        let md = timed(options.timeout, OP, addr, async {
            let mut s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            write_frame(&mut s, &[MARK, b"SEND"]).await?;
            loop {
                let frame = read_frame(&mut s, options.max_frame).await?;
                match parse(&frame) {
                    Ok(cmds) => {
                        if let Some(Command::Load(md)) =
                            cmds.into_iter().find(|c| matches!(c, Command::Load(_)))
                        {
                            return Ok(md.to_vec());
                        }
                    }
                    Err(why) => {
                        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why))
                    }
                }
            }
        })
        .await?;
        self.load_metadata_from(&md, expect, Trust::Full)
    }

    /// Send this agent's metadata, in NIXL's format ([`Agent::nixl_metadata`]), to the
    /// NIXL listener at `addr`, which loads it. NIXL does not answer: a load it
    /// refuses is only in its log.
    ///
    /// # Errors
    /// As [`Agent::nixl_metadata`]; [`ErrorKind::TimedOut`] or
    /// [`ErrorKind::RemoteDisconnected`] when it cannot be sent.
    pub async fn send_nixl_metadata(
        &self,
        addr: SocketAddr,
        options: &NixlListenerOptions,
    ) -> Result<()> {
        let md = self.nixl_metadata()?;
        send(addr, options, "send NIXL metadata", &[MARK, b"LOAD", &md]).await
    }

    /// Send part of this agent's metadata (NIXL's format, see
    /// [`Agent::nixl_partial_metadata`]) to the NIXL listener at `addr`, which loads
    /// it (NIXL's `send_local_partial_metadata` with an address).
    ///
    /// # Errors
    /// As [`Agent::nixl_partial_metadata`] and [`Agent::send_nixl_metadata`].
    pub async fn send_nixl_partial_metadata(
        &self,
        addr: SocketAddr,
        registrations: &[crate::Registration],
        with_conn_info: bool,
        options: &NixlListenerOptions,
    ) -> Result<()> {
        let md = self.nixl_partial_metadata(registrations, with_conn_info)?;
        send(addr, options, "send NIXL metadata", &[MARK, b"LOAD", &md]).await
    }

    /// Tell the agent whose NIXL listener is at `addr` to forget this agent (NIXL's
    /// `invalidate_local_metadata` with an address).
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] or [`ErrorKind::RemoteDisconnected`] when it cannot be
    /// sent.
    pub async fn invalidate_nixl_at(
        &self,
        addr: SocketAddr,
        options: &NixlListenerOptions,
    ) -> Result<()> {
        let name = self.name().as_bytes().to_vec();
        send(
            addr,
            options,
            "invalidate at a NIXL listener",
            &[MARK, b"INVL", &name],
        )
        .await
    }
}

async fn send(
    addr: SocketAddr,
    options: &NixlListenerOptions,
    op: &'static str,
    parts: &[&[u8]],
) -> Result<()> {
    timed(options.timeout, op, addr, async {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        write_frame(&mut s, parts).await?;
        s.shutdown().await
    })
    .await
}

async fn timed<T>(
    bound: Duration,
    op: &'static str,
    addr: SocketAddr,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(bound, f).await {
        Err(_) => err(
            ErrorKind::TimedOut,
            op,
            format!("no answer from {addr} within {bound:?}"),
        ),
        Ok(Err(e)) => Err(Error::new(
            ErrorKind::RemoteDisconnected,
            op,
            format!("NIXL listener at {addr}"),
        )
        .with_source(e)),
        Ok(Ok(v)) => Ok(v),
    }
}

async fn serve(
    agent: WeakAgent,
    mut stream: TcpStream,
    options: &NixlListenerOptions,
    mut ticket: crate::control::Ticket,
) -> std::result::Result<(), String> {
    let _ = stream.set_nodelay(true);
    loop {
        let frame = match tokio::time::timeout(
            options.idle_timeout,
            read_frame(&mut stream, options.max_frame),
        )
        .await
        {
            Err(_) => return Err("idle".into()),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e.to_string()),
            Ok(Ok(f)) => f,
        };
        let cmds = parse(&frame)?;
        // NIXL's protocol has no authentication: established at its first command.
        if !ticket.establish() {
            return Err("too many connections (NixlListenerOptions::max_connections)".into());
        }
        ticket.touch();
        for cmd in cmds {
            // Held only while a command runs, never across a write: a client that
            // stops reading must not keep the agent alive.
            let Some(agent) = agent.upgrade() else {
                return Ok(());
            };
            match cmd {
                Command::Load(md) => match agent.load_nixl_untrusted(md) {
                    Ok(peer) => tracing::debug!(%peer, "NIXL listener: loaded metadata"),
                    Err(e) => tracing::warn!(error = %e, "NIXL listener: refused metadata"),
                },
                Command::Send => {
                    let md = agent.nixl_metadata().map_err(|e| e.to_string())?;
                    drop(agent);
                    tokio::time::timeout(
                        options.timeout,
                        write_frame(&mut stream, &[MARK, b"LOAD", &md]),
                    )
                    .await
                    .map_err(|_| "the client did not read the metadata in time".to_owned())?
                    .map_err(|e| e.to_string())?;
                }
                // Only NIXL agents: peers of this crate are not NIXL's to invalidate.
                // Only NIXL agents, checked and forgotten under the agent's loading
                // lock (a peer of this crate loaded in between is never forgotten).
                Command::Invalidate(peer) => {
                    let not_nixl = |nixl: bool| {
                        (!nixl).then(|| {
                            Error::new(ErrorKind::NotAllowed, "invalidate", "not a NIXL agent")
                        })
                    };
                    match agent.forget_peer_unless(peer, not_nixl) {
                        Ok(()) => tracing::debug!(%peer, "NIXL listener: forgot peer"),
                        Err(e) if e.kind() == ErrorKind::NotAllowed => {
                            tracing::warn!(%peer, "NIXL listener: refused to invalidate a peer that is not a NIXL agent")
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "NIXL listener: invalidation of an unknown peer")
                        }
                    }
                }
            }
        }
    }
}

/// The listener's frame reader and command parser on `data` as a connection's
/// bytes, frame after frame until one is refused or the bytes end (for fuzzing,
/// through [`crate::fuzzing`]). Panics when an invariant breaks: a frame over the
/// limit, bytes lost or invented between frames, a parse that re-encodes to
/// different commands, a `LOAD` that is not the frame's last command.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_frames(data: &[u8]) {
    const MAX: usize = 64 << 10;
    let mut r = data;
    loop {
        let before = r.len();
        let Ok(frame) = crate::fuzzing::ready(read_frame(&mut r, MAX)) else {
            return;
        };
        assert!(frame.len() <= MAX, "a frame of {} bytes", frame.len());
        assert_eq!(
            before - r.len(),
            8 + frame.len(),
            "bytes lost between frames"
        );
        let Ok(cmds) = parse(&frame) else {
            return;
        };
        assert!(
            cmds.len() <= frame.len() / (MARK.len() + 4),
            "more commands than room"
        );
        let mut again = Vec::with_capacity(frame.len());
        for (i, c) in cmds.iter().enumerate() {
            again.extend_from_slice(MARK);
            match c {
                Command::Load(md) => {
                    assert_eq!(i + 1, cmds.len(), "LOAD takes the rest of the frame");
                    again.extend_from_slice(b"LOAD");
                    again.extend_from_slice(md);
                }
                Command::Send => again.extend_from_slice(b"SEND"),
                Command::Invalidate(name) => {
                    again.extend_from_slice(b"INVL");
                    again.extend_from_slice(name.as_bytes());
                }
            }
        }
        assert_eq!(
            parse(&again).as_ref(),
            Ok(&cmds),
            "commands re-encode as they parsed"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_as_nixl_sends_them() {
        assert_eq!(parse(b"NIXLCOMM:SEND").unwrap(), vec![Command::Send]);
        assert_eq!(
            parse(b"NIXLCOMM:INVLprefill-0").unwrap(),
            vec![Command::Invalidate("prefill-0")]
        );
        // LOAD takes the rest of the frame, marker bytes included.
        assert_eq!(
            parse(b"NIXLCOMM:LOADnixlSerDes|NIXLCOMM:SEND").unwrap(),
            vec![Command::Load(b"nixlSerDes|NIXLCOMM:SEND")]
        );
        assert_eq!(
            parse(b"NIXLCOMM:SENDNIXLCOMM:INVLaNIXLCOMM:LOADx").unwrap(),
            vec![Command::Send, Command::Invalidate("a"), Command::Load(b"x")]
        );
        assert!(parse(b"").unwrap().is_empty());
    }

    #[test]
    fn malformed_frames_are_refused() {
        for bad in [
            &b"NIXLCOMM:"[..],
            b"NIXLCOMM:SEN",
            b"hello",
            b"NIXLCOMM:WHAT",
            b"NIXLCOMM:INVL\xff",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn oversized_frames_are_refused_before_reading_them() {
        let mut frame = (u64::MAX).to_le_bytes().to_vec();
        frame.extend_from_slice(b"NIXLCOMM:SEND");
        let e = read_frame(&mut &frame[..], 1 << 20).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        let mut ok = 13u64.to_le_bytes().to_vec();
        ok.extend_from_slice(b"NIXLCOMM:SEND");
        assert_eq!(
            read_frame(&mut &ok[..], 1 << 20).await.unwrap(),
            b"NIXLCOMM:SEND"
        );
    }
}
