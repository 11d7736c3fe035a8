//! Target side: the listener and one task per incoming connection.
//!
//! Every request is checked whole before any byte of registered memory is touched:
//! each segment's key must name a live registration and the segment must lie inside
//! it. A refused WRITE's payload is read and discarded, so the connection stays usable.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use nixl::NotificationSink;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

use crate::io::{recv_slices, send_slices, IO_BUF};
use crate::options::Started;
use crate::runs::{blocks, range, LocalRun};
use crate::same_host::{ConnTable, SameHost};
use crate::shm;
use crate::wire::{self, Offer, RequestHeader, ResponseHeader, SegEntry};
use crate::Inner;

pub(crate) fn spawn_listener(inner: Arc<Inner>, listener: TcpListener, started: &Started) {
    let cancel = started.cancel.clone();
    let tracker = started.ctx.tracker.clone();
    let sink = started.ctx.notifications.clone();
    started.ctx.tracker.spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = cancel.cancelled() => break,
                r = listener.accept() => r,
            };
            match accepted {
                Ok((stream, from)) => {
                    let conn_cancel = cancel.child_token();
                    let (inner, sink) = (inner.clone(), sink.clone());
                    tracker.spawn(async move {
                        tokio::select! {
                            _ = conn_cancel.cancelled() => {}
                            r = serve(inner, stream, sink) => {
                                if let Err(e) = r {
                                    tracing::debug!(%from, error = %e, "tcp: closed incoming connection");
                                }
                            }
                        }
                    });
                }
                Err(e) => {
                    // Out of descriptors and similar: back off instead of spinning.
                    tracing::warn!(error = %e, "tcp: accept failed");
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    }
                }
            }
        }
        tracing::debug!("tcp listener stopped");
    });
}

#[derive(Debug)]
struct Refusal {
    status: u8,
    msg: String,
}

fn proto(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

async fn serve(
    inner: Arc<Inner>,
    stream: TcpStream,
    sink: NotificationSink,
) -> std::io::Result<()> {
    wire::tune(&stream, inner.options.dead_peer_timeout);
    let (rd, wr) = stream.into_split();
    let mut r = BufReader::with_capacity(IO_BUF, rd);
    let mut w = BufWriter::with_capacity(IO_BUF, wr);

    // Hello.
    let mut hello = [0u8; 8];
    r.read_exact(&mut hello).await?;
    if hello[..4] != wire::MAGIC {
        return Err(proto("not a nixl-tcp hello"));
    }
    let version_ok = hello[4..6] == wire::VERSION.to_le_bytes();
    let name_len = u16::from_le_bytes([hello[6], hello[7]]) as usize;
    if name_len == 0 || name_len > wire::MAX_NAME {
        return Err(proto(format!("peer name of {name_len} bytes")));
    }
    let mut name = vec![0u8; name_len];
    r.read_exact(&mut name).await?;
    let peer = String::from_utf8(name).map_err(|_| proto("peer name is not UTF-8"))?;
    let mut reply = Vec::with_capacity(7 + wire::NONCE_LEN);
    reply.extend_from_slice(&wire::MAGIC);
    reply.extend_from_slice(&wire::VERSION.to_le_bytes());
    let our_nonce = wire::nonce();
    match (&inner.options.secret, version_ok) {
        (_, false) => reply.push(1),
        (None, true) => reply.push(wire::ST_OK),
        (Some(_), true) => {
            reply.push(wire::ST_AUTH);
            reply.extend_from_slice(&our_nonce);
        }
    }
    w.write_all(&reply).await?;
    w.flush().await?;
    if !version_ok {
        return Err(proto("unsupported protocol version"));
    }
    if let Some(secret) = &inner.options.secret {
        // Nothing else is read or served before the peer proves it knows the secret.
        let mut msg = [0u8; wire::NONCE_LEN + 32];
        r.read_exact(&mut msg).await?;
        let (their_nonce, mac) = msg.split_at(wire::NONCE_LEN);
        if !secret.verify(
            wire::CLIENT_CONTEXT,
            &[&our_nonce, their_nonce, peer.as_bytes()],
            mac,
        ) {
            w.write_all(&[wire::ST_REFUSED]).await?;
            w.flush().await?;
            return Err(proto(format!("peer {peer:?} failed authentication")));
        }
        let proof = secret.sign(wire::SERVER_CONTEXT, &[their_nonce, &our_nonce]);
        w.write_all(&[wire::ST_OK]).await?;
        w.write_all(&proof).await?;
        w.flush().await?;
    }
    // Same-host path: the initiator asks (1) or not (0).
    let mut want = [0u8; 1];
    r.read_exact(&mut want).await?;
    let _grants = if want[0] == 1 {
        let offered = offer(&inner);
        match &offered {
            Some((t, o)) => {
                w.write_all(&[1]).await?;
                w.write_all(&wire::encode_offer(o)).await?;
                tracing::debug!(%peer, "tcp: same-host path offered");
                Some(Detach {
                    inner: inner.clone(),
                    table: t.clone(),
                })
            }
            None => {
                w.write_all(&[0]).await?;
                None
            }
        }
    } else {
        None
    };
    w.flush().await?;
    tracing::debug!(%peer, "tcp: peer connected");

    let max_notif = inner.options.max_notification;
    let mut hbuf = [0u8; wire::HEADER_LEN];
    let mut table = Vec::new();
    let mut segs: Vec<LocalRun> = Vec::new();
    let mut piece: Vec<LocalRun> = Vec::new();
    let mut scratch = Vec::new();
    loop {
        match r.read_exact(&mut hbuf).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let h = RequestHeader::decode(&hbuf);
        if h.notif_len as usize > max_notif {
            ack(&mut w, h.id, wire::ST_TOO_LARGE, "notification too large").await?;
            return Err(proto(format!("notification of {} bytes", h.notif_len)));
        }
        match h.kind {
            wire::REQ_NOTIFY => {
                let n = read_bytes(&mut r, h.notif_len as usize).await?;
                sink.deliver(&peer, n);
                ack(&mut w, h.id, wire::ST_OK, "").await?;
            }
            wire::REQ_WRITE | wire::REQ_READ => {
                if h.segments > wire::MAX_ENTRIES {
                    ack(&mut w, h.id, wire::ST_TOO_LARGE, "too many run entries").await?;
                    return Err(proto(format!("{} segments", h.segments)));
                }
                let part = if h.part {
                    let mut b = [0u8; wire::PART_LEN];
                    r.read_exact(&mut b).await?;
                    Some(wire::decode_part(&b))
                } else {
                    None
                };
                table.resize(h.segments as usize * wire::SEG_LEN, 0);
                r.read_exact(&mut table).await?;
                let notif = if h.has_notif {
                    Some(read_bytes(&mut r, h.notif_len as usize).await?)
                } else {
                    None
                };
                let mut total: u64 = 0;
                for e in SegEntry::decode_all(&table) {
                    total = e
                        .bytes()
                        .and_then(|b| total.checked_add(b))
                        .ok_or_else(|| proto("segment lengths overflow"))?;
                }
                // A piece moves its range of the request; the whole request is
                // checked all the same, so every piece of a bad one is refused.
                let (from, len) = part.unwrap_or((0, total));
                if from.checked_add(len).is_none_or(|end| end > total) {
                    return Err(proto(format!(
                        "piece {from}+{len} outside a request of {total} bytes"
                    )));
                }
                let checked = check(&inner, &table, &mut segs);
                if checked.is_ok() && part.is_some() {
                    range(&segs, from, len, &mut piece);
                    std::mem::swap(&mut segs, &mut piece);
                    piece.clear();
                }
                match (h.kind, checked) {
                    (wire::REQ_WRITE, Ok(())) => {
                        recv_slices(&mut r, blocks(&segs)).await?;
                        // Data is in memory: now the notification.
                        if let Some(n) = notif {
                            sink.deliver(&peer, n);
                        }
                        ack(&mut w, h.id, wire::ST_OK, "").await?;
                    }
                    (_, Ok(())) => {
                        let d = ResponseHeader {
                            kind: wire::RESP_DATA,
                            status: wire::ST_OK,
                            msg_len: 0,
                            id: h.id,
                            data_len: len,
                        };
                        w.write_all(&d.encode()).await?;
                        send_slices(&mut w, blocks(&segs), &mut scratch).await?;
                        if let Some(n) = notif {
                            sink.deliver(&peer, n);
                        }
                        ack(&mut w, h.id, wire::ST_OK, "").await?;
                    }
                    (kind, Err(refusal)) => {
                        tracing::debug!(%peer, status = refusal.status, msg = %refusal.msg, "tcp: refused request");
                        if kind == wire::REQ_WRITE {
                            // Skip the payload without touching memory.
                            let mut skip = (&mut r).take(len);
                            tokio::io::copy(&mut skip, &mut tokio::io::sink()).await?;
                            if skip.limit() != 0 {
                                return Err(std::io::ErrorKind::UnexpectedEof.into());
                            }
                        }
                        ack(&mut w, h.id, refusal.status, &refusal.msg).await?;
                    }
                }
                segs.clear();
            }
            other => {
                return Err(proto(format!("unknown request kind {other:#x}")));
            }
        }
    }
}

/// A grant table for a new same-host connection, unless the path is off here.
fn offer(inner: &Inner) -> Option<(Arc<ConnTable>, Offer)> {
    if inner.options.same_host == SameHost::Off {
        return None;
    }
    let mut nonce = [0u8; shm::NONCE_LEN];
    nonce.copy_from_slice(&wire::nonce()[..shm::NONCE_LEN]);
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
fn check(inner: &Inner, table: &[u8], segs: &mut Vec<LocalRun>) -> Result<(), Refusal> {
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

async fn read_bytes(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    n: usize,
) -> std::io::Result<Bytes> {
    let mut v = vec![0u8; n];
    r.read_exact(&mut v).await?;
    Ok(Bytes::from(v))
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
