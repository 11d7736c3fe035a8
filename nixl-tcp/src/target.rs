//! Target side: the listener and one task per incoming connection.
//!
//! Every request is checked whole before any byte of registered memory is touched:
//! each segment's key must name a live registration and the segment must lie inside
//! it. A refused WRITE's payload is read and discarded, so the connection stays usable.

use std::net::SocketAddr;
use std::sync::Arc;

use nixl::control::{Incoming, Ticket};
use nixl::NotificationSink;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

use crate::io::{recv_slices, send_slices, IO_BUF};
use crate::options::Started;
use crate::protocol::target::{Action, Refusal, Registry, Target};
use crate::runs::{blocks, range, LocalRun};
use crate::same_host::{self, ConnTable, SameHost};
use crate::shm;
use crate::state::Inner;
use crate::wire::{self, Offer, ResponseHeader, SegEntry};

/// Accept connections until cancelled, each served by a task of its own within the
/// limits of [`Admission`] and the listener options' handshake timeout.
pub(crate) fn spawn_listener(inner: Arc<Inner>, listener: TcpListener, started: &Started) {
    let cancel = started.cancel.clone();
    let sink = started.ctx.notifications.clone();
    let secret = started.secret.clone();
    let me: Arc<str> = started.ctx.agent_name.as_str().into();
    let admission = inner.options.listener.admission();
    let handshake_timeout = inner.options.listener.handshake_timeout;
    nixl::control::spawn_accept_loop(
        "tcp",
        listener,
        admission,
        &started.ctx.tracker,
        cancel,
        move |c: Incoming| {
            let (inner, sink, secret) = (inner.clone(), sink.clone(), secret.clone());
            let me = me.clone();
            let deadline = tokio::time::Instant::now() + handshake_timeout;
            let from = c.from;
            nixl::control::until_closed(c.close, async move {
                if let Err(e) = serve(inner, c.stream, sink, (secret, me), c.ticket, deadline).await
                {
                    tracing::debug!(%from, error = %e, "tcp: closed incoming connection");
                }
            })
        },
    );
}

fn proto(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

/// The runs a request was checked into, and room to cut a piece from them.
#[derive(Default)]
pub(crate) struct Checked {
    pub(crate) runs: Vec<LocalRun>,
    piece: Vec<LocalRun>,
}

impl Registry for Inner {
    type Runs = Checked;

    fn check(&self, table: &[u8], runs: &mut Checked) -> Result<(), Refusal> {
        check(self, table, &mut runs.runs)
    }

    fn restrict(runs: &mut Checked, from: u64, len: u64) {
        range(&runs.runs, from, len, &mut runs.piece);
        std::mem::swap(&mut runs.runs, &mut runs.piece);
        runs.piece.clear();
    }

    fn clear(runs: &mut Checked) {
        runs.runs.clear();
    }
}

/// Serve one incoming connection: the protocol is [`crate::protocol::target`]'s; this
/// only moves bytes between the socket, registered memory and the agent. The
/// handshake (authenticated with `secret`, if any, as agent `me`) must end by
/// `deadline`; then `ticket` moves to the established set.
async fn serve(
    inner: Arc<Inner>,
    stream: TcpStream,
    sink: NotificationSink,
    (secret, me): (Option<nixl::SharedSecret>, Arc<str>),
    mut ticket: Ticket,
    deadline: tokio::time::Instant,
) -> std::io::Result<()> {
    nixl::control::tune(&stream, inner.options.listener.dead_peer_timeout);
    // Both ends, for deciding whether the peer may see a same-host offer.
    let ends = stream
        .local_addr()
        .and_then(|l| Ok((l, stream.peer_addr()?)));
    let (rd, wr) = stream.into_split();
    let mut r = BufReader::with_capacity(IO_BUF, rd);
    let mut w = BufWriter::with_capacity(IO_BUF, wr);
    let nonce = nixl::control::nonce();
    // A connection that proved the agent's secret is a member's: never closed to
    // make room for another.
    let authenticated = secret.is_some();
    let mut m = Target::<Inner>::new(
        secret,
        &me,
        inner.listener,
        inner.options.max_notification,
        nonce,
    )
    .with_max_request(inner.options.max_request_bytes);
    let mut _grants = None;
    let mut scratch = Vec::new();
    loop {
        // At work while it moves bytes or waits to deliver (a connection at work
        // never gives its place to a newcomer; one idle between requests may).
        let working = ticket.working();
        while let Some(action) = m.poll() {
            match action {
                Action::Reply(bytes) => {
                    w.write_all(&bytes).await?;
                    w.flush().await?;
                }
                Action::Ack { id, status, .. }
                    if status == wire::ST_BAD_KEY && inner.stopping() =>
                {
                    // The registrations went with the shutdown, not because the
                    // request named a bad key: the peer sees the connection end.
                    return Err(proto(format!("request {id} arrived while shutting down")));
                }
                Action::Ack { id, status, msg } => ack(&mut w, id, status, &msg).await?,
                Action::Offer => {
                    let offered = offer(&inner, ends.as_ref().ok().copied());
                    m.offered(offered.as_ref().map(|(_, o)| o));
                    if let Some((t, _)) = offered {
                        tracing::debug!(peer = %m.peer(), "tcp: same-host path offered");
                        _grants = Some(Detach {
                            inner: inner.clone(),
                            table: t,
                        });
                    }
                }
                // Waits while this peer has its bound of notifications unread, so
                // a flooding peer's own connection stops being read (back-pressure
                // on that peer alone), saying so first: the peer must not take the
                // zero window for a dead target. The ACK follows delivery; one the
                // agent stopped before delivering closes the connection
                // unacknowledged.
                Action::Deliver(n) => {
                    let mut delivery = std::pin::pin!(sink.deliver_async(m.peer(), n));
                    let now = std::future::poll_fn(|cx| {
                        std::task::Poll::Ready(std::future::Future::poll(delivery.as_mut(), cx))
                    })
                    .await;
                    let delivered = match now {
                        std::task::Poll::Ready(r) => r,
                        std::task::Poll::Pending => {
                            hold_back(&mut w, true).await?;
                            let r = delivery.await;
                            hold_back(&mut w, false).await?;
                            r
                        }
                    };
                    delivered.map_err(std::io::Error::other)?;
                }
                Action::Receive { .. } => {
                    recv_slices(&mut r, blocks(&m.runs().runs)).await?;
                    m.moved();
                }
                Action::Skip(len) => {
                    let mut skip = (&mut r).take(len);
                    tokio::io::copy(&mut skip, &mut tokio::io::sink()).await?;
                    if skip.limit() != 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    m.moved();
                }
                Action::SendData(head) => {
                    w.write_all(&head).await?;
                    send_slices(&mut w, blocks(&m.runs().runs), &mut scratch).await?;
                    m.moved();
                }
                Action::Close(why) => return Err(proto(why)),
            }
        }
        drop(working);
        let handshaking = m.handshaking();
        if !handshaking && !ticket.establish_with(authenticated) {
            return Err(proto(
                "too many incoming connections (TcpOptions::listener.max_incoming_connections)",
            ));
        }
        let Some(buf) = m.need() else {
            return Err(proto("the protocol stalled"));
        };
        let read = if handshaking {
            tokio::time::timeout_at(deadline, r.read_exact(buf))
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        } else {
            r.read_exact(buf).await
        };
        match read {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && m.at_boundary() => {
                return Ok(())
            }
            Err(e) => return Err(e),
        }
        if !handshaking {
            ticket.touch();
        }
        m.received(&inner);
    }
}

/// A grant table for a new same-host connection between `ends` (ours, the peer's),
/// unless the path is off here or the peer is not proven to be on this host as our
/// user ([`same_host::may_offer`]): nothing of the table, nor this process's pid,
/// is revealed to any other peer. Runs only after the handshake authenticated the
/// peer, where a secret is set.
fn offer(inner: &Inner, ends: Option<(SocketAddr, SocketAddr)>) -> Option<(Arc<ConnTable>, Offer)> {
    if inner.options.same_host == SameHost::Off {
        return None;
    }
    let (local, peer) = ends?;
    if let Err(why) = same_host::offer_allowed(local, peer) {
        tracing::debug!(%peer, reason = %why, "tcp: no same-host offer for this connection");
        return None;
    }
    let mut nonce = [0u8; shm::NONCE_LEN];
    nonce.copy_from_slice(&nixl::control::nonce()[..shm::NONCE_LEN]);
    match inner.grants.attach(&nonce) {
        Ok(t) => {
            let o = Offer {
                pid: std::process::id(),
                table_fd: t.table.raw_fd().expect("the target's own table"),
                table_addr: t.table.addr(),
                nonce,
            };
            Some((t, o))
        }
        Err(e) => {
            tracing::info!(error = %e, "tcp: cannot create a same-host grant table; the peer uses TCP");
            None
        }
    }
}

/// Withdraws a connection's grants when the connection ends, however it ends.
struct Detach {
    inner: Arc<Inner>,
    table: Arc<ConnTable>,
}

impl Drop for Detach {
    fn drop(&mut self) {
        self.inner.grants.detach(&self.table);
    }
}

/// Check every run of a request; fill `segs` only if all pass (each keeps its
/// registration alive until the request is served). A run is checked by its first
/// and last block: blocks ascend, so every block between lies inside too.
pub(crate) fn check(inner: &Inner, table: &[u8], segs: &mut Vec<LocalRun>) -> Result<(), Refusal> {
    segs.clear();
    let regions = inner.regions.read().unwrap();
    for (i, e) in SegEntry::decode_all(table).enumerate() {
        let Some(region) = regions.get(&e.key) else {
            return Err(Refusal {
                status: wire::ST_BAD_KEY,
                msg: format!("run {i}: unknown or forged key"),
            });
        };
        let first = region.slice_at(e.addr, e.len).filter(|s| !s.is_empty());
        let last = e.last().and_then(|a| region.slice_at(a, e.len));
        let stride = usize::try_from(e.stride).ok();
        let count = usize::try_from(e.blocks).ok();
        let (Some(first), Some(_), Some(stride), Some(count)) = (first, last, stride, count) else {
            let whole = region.segment();
            return Err(Refusal {
                status: wire::ST_OUT_OF_RANGE,
                msg: format!(
                    "run {i}: {} blocks of {:#x}+{} every {} bytes are not all inside registration {:#x}+{}",
                    e.blocks,
                    e.addr,
                    e.len,
                    e.stride,
                    whole.addr(),
                    whole.len()
                ),
            });
        };
        segs.push(LocalRun {
            first,
            stride,
            count,
        });
    }
    Ok(())
}

/// Tell the initiator this connection stops being read for a while (`true`), or is
/// read again.
async fn hold_back(
    w: &mut BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    paused: bool,
) -> std::io::Result<()> {
    let h = ResponseHeader {
        kind: if paused {
            wire::RESP_PAUSE
        } else {
            wire::RESP_RESUME
        },
        status: 0,
        msg_len: 0,
        id: 0,
        data_len: 0,
    };
    w.write_all(&h.encode()).await?;
    w.flush().await
}

async fn ack(
    w: &mut BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    id: u64,
    status: u8,
    msg: &str,
) -> std::io::Result<()> {
    let msg = &msg.as_bytes()[..msg.len().min(wire::MAX_ERROR_MSG as usize)];
    let h = ResponseHeader {
        kind: wire::RESP_ACK,
        status,
        msg_len: msg.len() as u32,
        id,
        data_len: 0,
    };
    w.write_all(&h.encode()).await?;
    w.write_all(msg).await?;
    w.flush().await
}
