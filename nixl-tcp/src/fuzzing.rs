//! Entry points for fuzzing (`fuzz/`) and the stable fuzz smoke test: each takes
//! arbitrary bytes as what a hostile peer sends, drives the real protocol state
//! machines (`crate::protocol`) with them, and panics when an invariant breaks. Not
//! a public API: hidden, and free to change with the protocol.
//!
//! - `initiator_responses`: the initiator's handshake, then its response parser and
//!   request table, as a target (or anything listening at its address) answers.
//! - `PlantedTarget::requests`: the target after a valid hello (or, for inputs whose
//!   first byte has its top bit set, from the hello on), with one registration under
//!   a known key (`PLANTED_KEY`, at `PLANTED_BASE` as far as requests can tell),
//!   so requests pass the key check and the accepted path runs: the real checks,
//!   piece cutting, payload moves, notifications and ACKs. Every outcome is compared
//!   with a model of the protocol computed from the input alone, and every byte moved
//!   with a model of the registration.

use std::collections::HashSet;

use bytes::Bytes;
use nixl::control::{ServerAuth, NONCE_LEN};
use nixl::{Agent, Registration, SharedSecret};

use crate::protocol::initiator::{
    Answer, Frame, Handshake, HandshakeAction, Requests, Responses, Want,
};
use crate::protocol::target::{Action, Refusal, Registry, Target};
use crate::runs::{blocks, LocalRun};
use crate::state::Inner;
use crate::target::Checked;
use crate::wire::{self, Offer, RequestHeader, ResponseHeader, SegEntry};
use crate::{SameHost, TcpBackend, TcpOptions};

/// The agent the fuzzed initiator connects to (which the target proves, with a secret).
const FUZZ_PEER: &str = "the fuzz peer";
/// The fuzzed targets' listener id.
const FUZZ_LISTENER: u64 = 0xf022;

/// The key the planted registration answers to.
pub const PLANTED_KEY: u64 = 0x706c_616e_7465_6421;
/// Where requests see the planted registration: they name addresses from here, the
/// harness moves them to the registration's real address.
pub const PLANTED_BASE: u64 = 0x1000_0000;
/// The planted registration's length.
pub const PLANTED_LEN: usize = 4096;
/// The target's per-request byte cap in the harness (small, so models stay cheap).
const MAX_REQUEST: u64 = 64 << 10;
/// The target's notification cap in the harness.
const MAX_NOTIFICATION: usize = 1024;

/// A nixl-tcp target with one registration planted under `PLANTED_KEY`: an agent
/// (its listener is never connected to) whose registration the harness re-keys.
#[derive(Debug)]
pub struct PlantedTarget {
    rt: tokio::runtime::Runtime,
    agent: Option<Agent>,
    reg: Option<Registration>,
    backend: TcpBackend,
}

/// `Registry` over the backend's real registrations, with addresses of
/// `PLANTED_KEY` entries moved from `PLANTED_BASE` to the registration's
/// address first; the check and the piece cutting are the target's own.
struct Planted<'a> {
    inner: &'a Inner,
    shift: u64,
}

impl Registry for Planted<'_> {
    type Runs = Checked;

    fn check(&self, table: &[u8], runs: &mut Checked) -> Result<(), Refusal> {
        let mut t = table.to_vec();
        for e in t.chunks_exact_mut(wire::SEG_LEN) {
            if e[..8] == PLANTED_KEY.to_le_bytes() {
                let addr = u64::from_le_bytes(e[8..16].try_into().unwrap());
                e[8..16].copy_from_slice(&addr.wrapping_add(self.shift).to_le_bytes());
            }
        }
        crate::target::check(self.inner, &t, &mut runs.runs)
    }

    fn restrict(runs: &mut Checked, from: u64, len: u64) {
        <Inner as Registry>::restrict(runs, from, len);
    }

    fn clear(runs: &mut Checked) {
        <Inner as Registry>::clear(runs);
    }
}

impl PlantedTarget {
    /// Start the agent and plant the registration.
    ///
    /// # Panics
    /// When the agent cannot start (no loopback socket) or register.
    pub fn new() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let options = TcpOptions {
            same_host: SameHost::Off,
            ..TcpOptions::default()
        };
        let backend = TcpBackend::with_options(options);
        let agent = rt
            .block_on(
                Agent::builder("fuzz-target")
                    .backend(backend.clone())
                    .build(),
            )
            .expect("the fuzz target's agent starts");
        let reg = agent
            .register(vec![0u8; PLANTED_LEN])
            .expect("the planted registration");
        let inner = &backend.inner;
        let mut keys = inner.keys.lock().unwrap();
        let entry = keys.get_mut(&reg.id()).expect("registered with nixl-tcp");
        let mut regions = inner.regions.write().unwrap();
        let region = regions.remove(&entry.0).expect("registered with nixl-tcp");
        regions.insert(PLANTED_KEY, region);
        entry.0 = PLANTED_KEY;
        drop((regions, keys));
        Self {
            rt,
            agent: Some(agent),
            reg: Some(reg),
            backend,
        }
    }

    /// Serve `data` as one connection's incoming bytes; see the module docs.
    ///
    /// # Panics
    /// When the target breaks an invariant: an outcome other than the model's, a
    /// byte moved outside the planted registration or to the wrong place, a stall.
    pub fn requests(&self, data: &[u8]) {
        let Some((&mode, rest)) = data.split_first() else {
            return;
        };
        let mut input = Vec::with_capacity(rest.len() + 16);
        if mode & 0x80 == 0 {
            input.extend_from_slice(&wire::hello("fuzz", wire::ANY_LISTENER));
            input.push(0);
        }
        input.extend_from_slice(rest);
        let reg = self.reg.as_ref().expect("live until drop");
        let registry = Planted {
            inner: &self.backend.inner,
            shift: reg.addr().wrapping_sub(PLANTED_BASE),
        };
        let mut model = reg.to_vec().expect("host memory reads");
        let mut m = Target::<Planted<'_>>::new(
            None,
            "fuzz target",
            FUZZ_LISTENER,
            MAX_NOTIFICATION,
            [7; NONCE_LEN],
        )
        .with_max_request(MAX_REQUEST);
        let mut pos = 0;
        let mut expected: Vec<Ev> = Vec::new();
        let mut actual: Vec<Ev> = Vec::new();
        // The current request's model (None in the handshake, or when it cannot be
        // read whole from the input).
        let mut current: Option<Model> = None;
        let mut served = false;
        'conn: loop {
            while let Some(a) = m.poll() {
                let ev = match a {
                    Action::Reply(_) if !served => continue,
                    Action::Offer if !served => {
                        let offer = (mode & 0x40 != 0).then_some(Offer {
                            pid: 1,
                            table_fd: -1,
                            table_addr: 0,
                            nonce: [1; crate::shm::NONCE_LEN],
                        });
                        m.offered(offer.as_ref());
                        continue;
                    }
                    Action::Close(_) if !served => break 'conn,
                    Action::Reply(_) | Action::Offer => {
                        panic!("a handshake action while serving requests")
                    }
                    Action::Ack { id, status, msg } => {
                        assert!(
                            msg.len() <= 4 * wire::MAX_ERROR_MSG as usize,
                            "ACK message of {} bytes",
                            msg.len()
                        );
                        Ev::Ack { id, status }
                    }
                    Action::Deliver(n) => {
                        assert!(n.len() <= MAX_NOTIFICATION);
                        Ev::Deliver(n)
                    }
                    Action::Close(_) => Ev::Close,
                    Action::Receive { len } => {
                        assert!(m.need().is_none(), "reads while a payload moves");
                        let model_now = current
                            .as_ref()
                            .expect("a Receive for a request read whole");
                        let got = coalesce(local_pieces(&m.runs().runs, reg));
                        assert_eq!(
                            got,
                            coalesce(model_now.pieces.clone()),
                            "the runs a WRITE lands in"
                        );
                        assert_eq!(got.iter().map(|p| p.1).sum::<u64>(), len);
                        let Some(payload) = input.get(pos..pos + len as usize) else {
                            actual.push(Ev::Receive(len));
                            break 'conn;
                        };
                        pos += len as usize;
                        // The pieces are the model's (compared above): write through
                        // the target's runs, and the same bytes into the model.
                        let mut at = 0;
                        for run in blocks(&m.runs().runs) {
                            let chunk = &payload[at..at + run.len()];
                            run.write_from(0, chunk).unwrap();
                            model[run.offset()..run.offset() + run.len()].copy_from_slice(chunk);
                            at += run.len();
                        }
                        m.moved();
                        Ev::Receive(len)
                    }
                    Action::Skip(len) => {
                        assert!(m.need().is_none(), "reads while a payload is skipped");
                        assert!(m.runs().runs.is_empty(), "a refused request keeps runs");
                        if input.len() - pos < len as usize {
                            actual.push(Ev::Skip(len));
                            break 'conn;
                        }
                        pos += len as usize;
                        m.moved();
                        Ev::Skip(len)
                    }
                    Action::SendData(head) => {
                        assert!(m.need().is_none(), "reads while data is sent");
                        let model_now = current
                            .as_ref()
                            .expect("a SendData for a request read whole");
                        let h = ResponseHeader::decode(&head);
                        let got = coalesce(local_pieces(&m.runs().runs, reg));
                        assert_eq!(
                            got,
                            coalesce(model_now.pieces.clone()),
                            "the runs a READ sends"
                        );
                        assert_eq!(got.iter().map(|p| p.1).sum::<u64>(), h.data_len);
                        let mut buf = Vec::new();
                        for run in blocks(&m.runs().runs) {
                            let at = buf.len();
                            buf.resize(at + run.len(), 0);
                            run.read_into(0, &mut buf[at..]).unwrap();
                        }
                        let want: Vec<u8> = model_now
                            .pieces
                            .iter()
                            .flat_map(|&(o, l)| model[o as usize..(o + l) as usize].iter().copied())
                            .collect();
                        assert!(
                            buf == want,
                            "a READ sends other bytes than the registration holds"
                        );
                        m.moved();
                        Ev::SendData(h)
                    }
                };
                let closed = ev == Ev::Close;
                actual.push(ev);
                if closed {
                    break 'conn;
                }
            }
            if m.at_boundary() {
                served = true;
                current = Model::of(&input[pos..]);
                match &current {
                    Some(c) => expected.extend(c.events.iter().cloned()),
                    None => {
                        // The request is cut short: the model covers what its
                        // header alone decides.
                        expected.extend(Model::header_only(&input[pos..]));
                    }
                }
            }
            let Some(buf) = m.need() else {
                panic!("the target stalls: nothing to do and nothing to read");
            };
            let n = buf.len();
            let Some(bytes) = input.get(pos..pos + n) else {
                break;
            };
            buf.copy_from_slice(bytes);
            pos += n;
            m.received(&registry);
        }
        assert!(
            expected.starts_with(&actual),
            "the target did {actual:?}, the model says {expected:?}"
        );
        assert!(
            reg.to_vec().unwrap() == model,
            "the registration holds other bytes than the WRITEs put there"
        );
    }
}

impl Default for PlantedTarget {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PlantedTarget {
    fn drop(&mut self) {
        let (reg, agent) = (self.reg.take(), self.agent.take());
        self.rt.block_on(async move {
            drop(reg);
            if let Some(agent) = agent {
                let _ = agent.shutdown().await;
            }
        });
    }
}

/// What the target does, as the model and the harness compare it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    Ack { id: u64, status: u8 },
    Deliver(Bytes),
    Receive(u64),
    Skip(u64),
    SendData(ResponseHeader),
    Close,
}

/// One request, read whole from the input, and what the target must do with it.
struct Model {
    events: Vec<Ev>,
    /// For an accepted request: the (offset, length) pieces of the registration its
    /// payload moves through, in order.
    pieces: Vec<(u64, u64)>,
}

impl Model {
    /// What the header at the start of `b` alone decides (a refusal that closes).
    fn header_only(b: &[u8]) -> Vec<Ev> {
        let Some(h) = b.first_chunk::<{ wire::HEADER_LEN }>() else {
            return Vec::new();
        };
        let h = RequestHeader::decode(h);
        let too_large = Ev::Ack {
            id: h.id,
            status: wire::ST_TOO_LARGE,
        };
        if h.notif_len as usize > MAX_NOTIFICATION {
            return vec![too_large, Ev::Close];
        }
        match h.kind {
            wire::REQ_WRITE | wire::REQ_READ if h.segments > wire::MAX_ENTRIES => {
                vec![too_large, Ev::Close]
            }
            wire::REQ_WRITE | wire::REQ_READ | wire::REQ_NOTIFY => Vec::new(),
            _ => vec![Ev::Close],
        }
    }

    /// The request at the start of `b`, if `b` holds it whole (not a WRITE's payload).
    fn of(b: &[u8]) -> Option<Self> {
        let early = Self::header_only(b);
        let h = RequestHeader::decode(b.first_chunk::<{ wire::HEADER_LEN }>()?);
        if !early.is_empty() {
            return Some(Self {
                events: early,
                pieces: Vec::new(),
            });
        }
        let mut at = wire::HEADER_LEN;
        let ok = |id| Ev::Ack {
            id,
            status: wire::ST_OK,
        };
        if h.kind == wire::REQ_NOTIFY {
            let n = b.get(at..at + h.notif_len as usize)?;
            return Some(Self {
                events: vec![Ev::Deliver(Bytes::copy_from_slice(n)), ok(h.id)],
                pieces: Vec::new(),
            });
        }
        let part = if h.part {
            let p = b.get(at..at + wire::PART_LEN)?;
            at += wire::PART_LEN;
            Some(wire::decode_part(p.try_into().unwrap()))
        } else {
            None
        };
        let table = b.get(at..at + h.segments as usize * wire::SEG_LEN)?;
        at += table.len();
        let note = if h.has_notif {
            Some(Bytes::copy_from_slice(
                b.get(at..at + h.notif_len as usize)?,
            ))
        } else {
            None
        };
        let entries: Vec<SegEntry> = SegEntry::decode_all(table).collect();
        let close = || {
            Some(Self {
                events: vec![Ev::Close],
                pieces: Vec::new(),
            })
        };
        let Some(total) = entries
            .iter()
            .try_fold(0u64, |t, e| t.checked_add(e.len.checked_mul(e.blocks)?))
        else {
            return close();
        };
        let (from, len) = part.unwrap_or((0, total));
        if from.checked_add(len).is_none_or(|end| end > total) {
            return close();
        }
        let write = h.kind == wire::REQ_WRITE;
        let refuse = |status| {
            let ack = Ev::Ack { id: h.id, status };
            Some(Self {
                events: if write {
                    vec![Ev::Skip(len), ack]
                } else {
                    vec![ack]
                },
                pieces: Vec::new(),
            })
        };
        if total > MAX_REQUEST {
            return refuse(wire::ST_TOO_LARGE);
        }
        for e in &entries {
            if e.key != PLANTED_KEY {
                return refuse(wire::ST_BAD_KEY);
            }
            if !fits(e) {
                return refuse(wire::ST_OUT_OF_RANGE);
            }
        }
        // Every block of every run, in order, then the piece's bytes of them.
        let mut pieces = Vec::new();
        let (mut pos, end) = (0u64, from + len);
        for e in &entries {
            let off = e.addr - PLANTED_BASE;
            for i in 0..e.blocks {
                let (lo, hi) = (pos.max(from), (pos + e.len).min(end));
                if lo < hi {
                    pieces.push((off + i * e.stride + (lo - pos), hi - lo));
                }
                pos += e.len;
            }
        }
        let mut events = vec![if write {
            Ev::Receive(len)
        } else {
            Ev::SendData(ResponseHeader {
                kind: wire::RESP_DATA,
                status: wire::ST_OK,
                msg_len: 0,
                id: h.id,
                data_len: len,
            })
        }];
        events.extend(note.map(Ev::Deliver));
        events.push(ok(h.id));
        Some(Self { events, pieces })
    }
}

/// Whether every block of `e` lies inside the planted registration (as
/// `PLANTED_BASE` places it), none empty.
fn fits(e: &SegEntry) -> bool {
    let size = PLANTED_LEN as u64;
    let off = e.addr.wrapping_sub(PLANTED_BASE);
    let Some(span) = e
        .blocks
        .checked_sub(1)
        .and_then(|n| e.stride.checked_mul(n))
    else {
        return false;
    };
    e.len > 0
        && off <= size
        && e.len <= size - off
        && off
            .checked_add(span)
            .is_some_and(|last| last <= size - e.len)
}

/// The (offset, length) of every block of `runs`, after checking each lies in the
/// planted registration.
fn local_pieces(runs: &[LocalRun], reg: &Registration) -> Vec<(u64, u64)> {
    blocks(runs)
        .map(|b| {
            assert_eq!(b.id(), reg.id(), "a block outside the planted registration");
            assert!(
                b.offset() + b.len() <= PLANTED_LEN,
                "a block past the registration"
            );
            (b.offset() as u64, b.len() as u64)
        })
        .collect()
}

/// Adjacent pieces joined, empty ones dropped: the bytes they cover, in order.
fn coalesce(pieces: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(pieces.len());
    for (o, l) in pieces {
        match out.last_mut() {
            _ if l == 0 => {}
            Some(last) if last.0 + last.1 == o => last.1 += l,
            _ => out.push((o, l)),
        }
    }
    out
}

/// Drive an initiator's connection with `data` as everything the target sends: the
/// handshake (mode from the first byte: a shared secret, whether the same-host path
/// is asked for or required, whether opening the offer works), then responses to
/// a few requests in flight (READs of 0, 16 and 4096 bytes, WRITEs whose payload
/// is sent as frames arrive).
///
/// # Panics
/// When an invariant breaks: a request completed twice or never accounted for, READ
/// data of the wrong length accepted, a buffer beyond the protocol's limits, a
/// failed handshake that goes on.
pub fn initiator_responses(data: &[u8]) {
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let secret = (mode & 1 != 0)
        .then(|| SharedSecret::new(b"fuzz secret 0123456789abcdef").expect("a valid secret"));
    let want = match (mode >> 1) & 3 {
        0 => Want::Yes,
        1 => Want::No("fuzz".into()),
        _ => Want::Extra,
    };
    let mut hs = Handshake::new(
        "fuzz",
        FUZZ_PEER,
        FUZZ_LISTENER,
        "the fuzz target".into(),
        secret,
        [3; NONCE_LEN],
        want,
        mode & 8 != 0,
    );
    let take = |rest: &mut &[u8], n: usize| -> Option<Vec<u8>> {
        let b = rest.get(..n)?.to_vec();
        *rest = &rest[n..];
        Some(b)
    };
    // The handshake.
    'hs: loop {
        while let Some(a) = hs.poll() {
            match a {
                HandshakeAction::Send { .. } => {}
                HandshakeAction::Open(_) => {
                    hs.opened(if mode & 16 != 0 {
                        Ok(())
                    } else {
                        Err("fuzz".into())
                    });
                }
                HandshakeAction::Up(_) => break 'hs,
                HandshakeAction::Fail(_) => {
                    assert!(hs.need().is_none(), "a failed handshake reads on");
                    return;
                }
            }
        }
        let Some(buf) = hs.need() else {
            panic!("the handshake stalls");
        };
        assert!(buf.len() <= wire::OFFER_LEN + NONCE_LEN);
        let n = buf.len();
        let Some(b) = take(&mut rest, n) else { return };
        hs.need().unwrap().copy_from_slice(&b);
        hs.received();
    }
    // Requests in flight: ids 1..=3 are READs, 4..=6 WRITEs sent one per frame.
    let reads = [0u64, 16, 4096];
    let mut req: Requests<u64> = Requests::new("the fuzz target");
    let ids: Vec<u64> = (0..6).map(|_| req.issue()).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5, 6]);
    for (id, len) in ids.iter().zip(reads) {
        req.park(*id, *id, Some(len)).unwrap();
    }
    let mut unsent = vec![6u64, 5, 4];
    let mut done: HashSet<u64> = HashSet::new();
    let mut resp = Responses::default();
    loop {
        let n = resp.need().len();
        assert!(
            n <= wire::MAX_ERROR_MSG as usize && n > 0,
            "a read of {n} bytes"
        );
        let Some(b) = take(&mut rest, n) else { break };
        resp.need().copy_from_slice(&b);
        let frame = match resp.received() {
            Ok(None) => continue,
            Ok(Some(f)) => f,
            Err(_) => break,
        };
        if let Frame::Ack { msg, .. } = &frame {
            assert!(msg.len() <= 3 * wire::MAX_ERROR_MSG as usize);
        }
        let data_len = match frame {
            Frame::Data { len, .. } => Some(len),
            Frame::Ack { .. } | Frame::Paused(_) => None,
        };
        match req.on_frame(frame) {
            Answer::Complete(id, _) => finish(id, &mut done),
            Answer::Kept => {}
            Answer::Receive(id) => {
                let len = data_len.expect("data answers a Data frame");
                assert_eq!(
                    Some(len),
                    reads.get(id as usize - 1).copied(),
                    "READ {id} takes {len} bytes"
                );
                if take(&mut rest, len as usize).is_none() {
                    // The stream ended inside the data: the connection dies.
                    finish(id, &mut done);
                    break;
                }
                if let Some((id, _)) = req.landed(id, id, len) {
                    finish(id, &mut done);
                }
            }
            Answer::Broke(_, p) => {
                if let Some(id) = p {
                    finish(id, &mut done);
                }
                break;
            }
        }
        if let Some(id) = unsent.pop() {
            if let Some((id, _)) = req.sent(id, id) {
                finish(id, &mut done);
            }
        }
    }
    let (failed, _) = req.fail(nixl::Error::new(
        nixl::ErrorKind::RemoteDisconnected,
        "fuzz",
        "end of input",
    ));
    for id in failed {
        finish(id, &mut done);
    }
    // Every request handed over is accounted for exactly once; the unsent ones
    // fail as they are handed over to a dead connection.
    for id in unsent {
        let (id, r) = req
            .sent(id, id)
            .expect("a dead connection fails what is handed over");
        assert!(r.is_err(), "request {id} succeeded on a dead connection");
        finish(id, &mut done);
    }
    assert_eq!(done.len(), 6, "requests accounted for: {done:?}");
}

fn finish(id: u64, done: &mut HashSet<u64>) {
    assert!(done.insert(id), "request {id} completed twice");
}

/// One run-table entry over the planted registration (`off` bytes in).
fn planted(off: u64, len: u64, stride: u64, blocks: u64) -> SegEntry {
    SegEntry {
        key: PLANTED_KEY,
        addr: PLANTED_BASE + off,
        len,
        stride,
        blocks,
    }
}

/// A request as the initiator encodes it: head, run table, notification.
fn request(
    kind: u8,
    entries: &[SegEntry],
    part: Option<(u64, u64)>,
    notif: Option<&[u8]>,
    id: u64,
) -> Vec<u8> {
    let notif_len = notif.map(|n| n.len() as u32);
    let (head, n) =
        crate::protocol::initiator::request_head(kind, entries.len() as u32, part, notif_len, id);
    let mut v = head[..n].to_vec();
    for e in entries {
        e.encode_into(&mut v);
    }
    v.extend_from_slice(notif.unwrap_or_default());
    v
}

/// Seeds for `PlantedTarget::requests`, from the protocol's own encoders: each
/// kind of request, whole and in pieces, accepted and refused each way, and the
/// handshake with and without the same-host offer.
pub fn target_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let strided = [planted(16, 32, 64, 3), planted(1024, 100, 0, 1)];
    let payload = |n: usize| (0..n).map(|i| i as u8 ^ 0x5a).collect::<Vec<u8>>();
    let with = |mut v: Vec<u8>, tail: &[u8]| {
        v.extend_from_slice(tail);
        v
    };
    let after_hello = |reqs: &[&Vec<u8>]| {
        let mut v = vec![0u8];
        for r in reqs {
            v.extend_from_slice(r);
        }
        v
    };
    let write = with(
        request(wire::REQ_WRITE, &strided, None, None, 1),
        &payload(196),
    );
    let read = request(wire::REQ_READ, &strided, None, Some(b"read done"), 2);
    let write_piece = with(
        request(wire::REQ_WRITE, &strided, Some((20, 150)), Some(b""), 3),
        &payload(150),
    );
    let read_piece = request(wire::REQ_READ, &strided, Some((0, 40)), None, 4);
    let notify = request(wire::REQ_NOTIFY, &[], None, Some(b"hello"), 5);
    let bad_key = SegEntry {
        key: 1,
        ..planted(0, 8, 8, 1)
    };
    let refused_write = with(
        request(wire::REQ_WRITE, &[bad_key], None, None, 6),
        &payload(8),
    );
    let out_of_range = request(wire::REQ_READ, &[planted(4090, 8, 8, 1)], None, None, 7);
    let too_large = request(wire::REQ_READ, &[planted(0, 4096, 0, 17)], None, None, 8);
    let mut handshake = vec![0x80u8];
    handshake.extend_from_slice(&wire::hello("fuzz", wire::ANY_LISTENER));
    handshake.push(1);
    handshake.extend_from_slice(&read_piece);
    let mut offered = handshake.clone();
    offered[0] = 0xc0;
    vec![
        ("write", after_hello(&[&write])),
        ("read-notified", after_hello(&[&read])),
        ("write-piece", after_hello(&[&write_piece])),
        ("read-piece", after_hello(&[&read_piece])),
        ("notify", after_hello(&[&notify])),
        ("refused-write", after_hello(&[&refused_write])),
        ("out-of-range", after_hello(&[&out_of_range])),
        ("too-large", after_hello(&[&too_large])),
        ("write-read-notify", after_hello(&[&write, &read, &notify])),
        ("handshake", handshake),
        ("handshake-offered", offered),
    ]
}

/// Seeds for `initiator_responses`, from the protocol's own encoders: the
/// handshake each way (authenticated with the harness's secret, the same-host offer
/// taken or not) and answers to the requests in flight.
pub fn initiator_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let reply = |status: u8| {
        let mut v = wire::MAGIC.to_vec();
        v.extend_from_slice(&wire::VERSION.to_le_bytes());
        v.push(status);
        v
    };
    let ack = |id: u64, status: u8, msg: &str| {
        let mut v = ResponseHeader {
            kind: wire::RESP_ACK,
            status,
            msg_len: msg.len() as u32,
            id,
            data_len: 0,
        }
        .encode()
        .to_vec();
        v.extend_from_slice(msg.as_bytes());
        v
    };
    let data = |id: u64, len: u64| {
        let mut v = ResponseHeader {
            kind: wire::RESP_DATA,
            status: wire::ST_OK,
            msg_len: 0,
            id,
            data_len: len,
        }
        .encode()
        .to_vec();
        v.resize(v.len() + len as usize, 0xab);
        v
    };
    let hold = |kind: u8| {
        ResponseHeader {
            kind,
            status: 0,
            msg_len: 0,
            id: 0,
            data_len: 0,
        }
        .encode()
        .to_vec()
    };
    let answers = [
        hold(wire::RESP_PAUSE),
        ack(4, wire::ST_OK, ""),
        hold(wire::RESP_RESUME),
        data(2, 16),
        ack(2, wire::ST_OK, ""),
        data(1, 0),
        ack(1, wire::ST_OK, ""),
        ack(5, wire::ST_BAD_KEY, "run 0: unknown or forged key"),
        ack(3, wire::ST_OUT_OF_RANGE, "out of range"),
        ack(6, wire::ST_OK, ""),
    ]
    .concat();
    // Mode bits: 1 secret, 2..3 want (0 yes, 1 no, 2 extra), 8 require, 16 open ok.
    let plain = [&[2u8][..], &reply(wire::ST_OK), &answers].concat();
    let offer = wire::encode_offer(&Offer {
        pid: 4321,
        table_fd: 7,
        table_addr: 0x7f00_0000_0000,
        nonce: [9; crate::shm::NONCE_LEN],
    });
    let same_host = [&[16u8][..], &reply(wire::ST_OK), &[1], &offer, &answers].concat();
    let no_offer = [&[8u8][..], &reply(wire::ST_OK), &[0]].concat();
    let secret = SharedSecret::new(b"fuzz secret 0123456789abcdef").expect("a valid secret");
    // The target's side of the authentication, as the core computes it for the
    // initiator's nonce.
    let proof = ServerAuth::new(wire::AUTH_PROTOCOL, secret, FUZZ_PEER, [5u8; NONCE_LEN])
        .received(&[3u8; NONCE_LEN])
        .expect("the first step answers");
    let authed = [
        &[1u8 | 4][..],
        &proof,
        &[wire::ST_OK],
        &reply(wire::ST_OK),
        &answers,
    ]
    .concat();
    let broken = [&[2u8][..], &reply(wire::ST_OK), &data(4, 8), &ack(9, 0, "")].concat();
    vec![
        ("plain", plain),
        ("same-host", same_host),
        ("no-offer-required", no_offer),
        ("authenticated", authed),
        ("data-for-a-write", broken),
    ]
}
