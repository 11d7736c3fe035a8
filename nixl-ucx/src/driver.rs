//! The progress driver: the only code that calls into UCX after setup.
//!
//! [`Core`] holds the [`Ucx`] owner and the backend's connection state behind one mutex.
//! Posting a transfer only enqueues a [`Cmd`] and wakes the driver; the driver (a tokio
//! task waiting on the worker's event fd, or a dedicated thread) drains the queue,
//! issues UCX operations, progresses the worker and completes requests. Setup calls
//! that must answer synchronously (`register`, `link`, `prepare`) take the same
//! mutex briefly, so UCX is never entered by two threads at once.
//!
//! # Dead peers
//! UCX fails an endpoint when its transport notices the peer is gone (a closed socket,
//! a dead process, keepalive). It does not notice a peer *worker* that was destroyed
//! while its process lives on (an agent dropped, or shut down before it knew us, in a
//! process that keeps running; or another agent of the same process): shared-memory
//! keepalive checks only the peer's process, and an endpoint whose wireup the peer
//! never answered is never checked at all. Operations that need the peer (the wireup
//! itself, active-message emulation of RMA, a full shared-memory FIFO) then wait
//! forever. So the driver probes: while a connection has work that has made no
//! progress for a while, it sends a PING, which the peer answers with a PONG from its
//! progress loop; no answer within the bound fails the connection (see [`Liveness`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Completer, Error, ErrorKind, NotificationSink, Result, SharedSecret};
use tokio::sync::{oneshot, Notify};
use tokio_util::sync::CancellationToken;

use crate::ffi::{EpId, FlightId, HoldsMemory, RkeyId, RmaSeg, Ucx, UcxError, WakeFd};
use crate::packed::Padded;
use crate::protocol::{self, Grant, OnHello};
use crate::reorder::{self, Reorder};
use crate::wire::{self, Kind};

/// What a flight keeps until UCX is done with it.
#[derive(Debug)]
pub(crate) enum Work {
    /// A transfer or notification: its completer (which keeps its memory alive).
    Done(Completer),
    /// `connect()` waiting for its flush.
    Connect(oneshot::Sender<Result<()>>),
    /// Internal messages (HELLO, BYE).
    Internal,
}

impl HoldsMemory for Work {
    fn completer(&self) -> Option<&Completer> {
        match self {
            Self::Done(c) => Some(c),
            _ => None,
        }
    }
}

/// A remote transfer, resolved once at prepare time.
#[derive(Debug)]
pub(crate) struct RemoteXfer {
    pub(crate) peer: Arc<str>,
    pub(crate) epoch: u64,
    pub(crate) write: bool,
    pub(crate) segs: Vec<RmaSeg>,
}

/// Work posted to the driver.
#[derive(Debug)]
pub(crate) enum Cmd {
    Transfer {
        xfer: Arc<RemoteXfer>,
        notif: Option<Bytes>,
        done: Completer,
    },
    Notify {
        peer: String,
        /// The link's connection.
        epoch: u64,
        msg: Bytes,
        done: Completer,
    },
    Connect {
        peer: String,
        /// The link's connection.
        epoch: u64,
        tx: oneshot::Sender<Result<()>>,
    },
}

#[derive(Debug)]
struct InFlight {
    flight: FlightId,
    /// Notification to send once the data is in place.
    notif: Option<Bytes>,
}

/// A liveness probe waiting for its PONG.
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// First PING of this round (a PONG to any PING of the round answers it).
    first: u64,
    /// The latest PING.
    seq: u64,
    deadline: Instant,
    /// The latest PING went out on the probe endpoint.
    second: bool,
}

/// When to probe a connection, and how long to wait for the answer.
///
/// Progress is an operation of the connection finishing, or a piece of its oldest
/// one (one-sided transfers are posted in pieces of at most 4 MiB, and some pieces
/// are watched), or the peer answering a probe.
///
/// A connection whose oldest operation has made no progress for `after` gets a PING
/// on its data endpoint, sent with a UCX reply endpoint, on which the peer's progress
/// loop answers a PONG at once (so answering never makes an endpoint). A PONG within
/// `answer` proves the peer alive and restarts the clock: a long transfer to a live
/// peer is probed about once per `after` and not failed.
///
/// The first PING can go unanswered while the peer lives: it waits behind the
/// connection's own traffic (a large WRITE ahead of it, or the data of a large READ
/// ahead of the PONG, where UCX runs RMA over active messages), or the peer dropped
/// its side of the connection (UCX then drops what arrives on it, and UCX's keepalive
/// fails the connection). So the second PING goes out on a separate endpoint, made
/// for this (only when needed: more endpoints between two workers strain UCX's
/// connection matching). No PONG to it within `answer` fails the connection: its
/// transfers end with `RemoteDisconnected`. A peer gone before it answered UCX's
/// handshake fails the same way (both PINGs wait for the handshake).
///
/// So a dead peer is noticed within `after + 2 * answer` (plus a driver tick).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Liveness {
    pub(crate) after: Duration,
    pub(crate) answer: Duration,
}

impl Liveness {
    /// Split a total bound: probe after a fifth of it, wait two fifths per PING.
    pub(crate) fn within(total: Duration) -> Self {
        let after = total / 5;
        Self {
            after,
            answer: (total - after) / 2,
        }
    }
}

#[derive(Debug)]
pub(crate) struct PeerConn {
    /// Unique per connection; also the stream id in our message headers.
    pub(crate) epoch: u64,
    pub(crate) address: Vec<u8>,
    pub(crate) ep: std::result::Result<EpId, String>,
    /// Whether the endpoints use UCX peer-failure handling.
    peer_failure: bool,
    /// A NIXL agent: notifications in NIXL's format, none of our own messages (no
    /// HELLO, BYE or liveness probes), failures from UCX's endpoint errors alone.
    pub(crate) nixl: bool,
    /// Why the connection is dead, once it is.
    pub(crate) failed: Option<String>,
    hello_sent: bool,
    /// The peer said HELLO to us from the address in its metadata (so it gets a BYE
    /// at our shutdown even if we never sent to it).
    heard_hello: bool,
    next_seq: u64,
    /// Remote keys unpacked on this connection, by the peer's region id.
    rkeys: HashMap<u64, (Bytes, RkeyId)>,
    queue: VecDeque<InFlight>,
    /// When an operation of this connection (or a watched piece of its oldest) last
    /// finished, or the queue last became non-empty, or the peer last answered a probe.
    last_progress: Instant,
    /// The separate endpoint for a second PING (made when first needed).
    probe_ep: Option<EpId>,
    probe: Option<Probe>,
    next_probe: u64,
    /// Our notifications the peer reported dropped ([`Kind::Dropped`]) and the
    /// application was not told of yet: the next operation to the peer fails with it.
    dropped: u64,
    /// How many of our notifications the peer lets us send ([`Credit`]).
    credit: Credit,
    /// Bytes of our notifications sent on this connection.
    sent_bytes: u64,
    /// When we last asked for credit and have no answer yet ([`Kind::CreditAsk`]).
    asked: Option<Instant>,
    /// How long to wait for an answer before asking again while notifications wait.
    ask_every: Duration,
    /// Our notifications waiting for the peer's credit, in posting order, with what
    /// completes when each is sent (a transfer's own completion, for a transfer's
    /// notification: the transfer stays in progress while its notification waits).
    held: VecDeque<(Bytes, Completer)>,
}

/// Flow control of our notifications to one peer of ours. The receiver lets a
/// sender stream have [`CREDIT_WINDOW`] notifications and [`CREDIT_WINDOW_KIB`] KiB
/// on the way or held in its backlog beyond what its agent took in; the sender asks
/// ([`Kind::CreditAsk`], answered at once on the UCX reply endpoint, as PING is, so
/// the receiver never dials anyone) when half its window is used and, while
/// notifications wait, again every [`ASK_MIN`] to [`ASK_MAX`] (backing off), so no
/// lost answer stalls it. What is beyond the window waits here: back-pressure on
/// the sender instead of loss at the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Credit {
    /// No answer yet: the first window goes; later notifications wait for one, until
    /// [`LEGACY_WAIT`] after the first ask (`since`): a peer that never answers is an
    /// older nixl-rs, sent to freely.
    Awaiting { since: Option<Instant> },
    /// Limits on the running message and KiB counts, modulo 2^32 ([`Kind::Credit`]).
    Granted { messages: u32, kib: u32 },
    /// A peer that does not grant: no limit.
    Unlimited,
}

/// Notifications a receiver lets one sender stream have on the way or in its
/// backlog beyond what its agent took in.
pub(crate) const CREDIT_WINDOW: u64 = 1024;
/// The same in KiB (4 MiB).
pub(crate) const CREDIT_WINDOW_KIB: u64 = 4096;
/// Asking again for credit while notifications wait: first after this, doubling...
const ASK_MIN: Duration = Duration::from_millis(1);
/// ...up to this.
const ASK_MAX: Duration = Duration::from_millis(64);
/// How long a sender waits for a first answer before treating the peer as one that
/// does not grant (an older nixl-rs).
const LEGACY_WAIT: Duration = Duration::from_secs(1);

impl PeerConn {
    /// Notifications waiting for the peer's credit.
    #[cfg(test)]
    pub(crate) fn held_len(&self) -> usize {
        self.held.len()
    }

    /// Whether the peer granted credit.
    #[cfg(test)]
    pub(crate) fn is_granted(&self) -> bool {
        matches!(self.credit, Credit::Granted { .. })
    }

    /// Whether the next notification may go now.
    fn may_send(&self) -> bool {
        let kib = self.sent_bytes >> 10;
        match self.credit {
            Credit::Awaiting { .. } => self.next_seq < CREDIT_WINDOW && kib < CREDIT_WINDOW_KIB,
            Credit::Granted {
                messages,
                kib: limit,
            } => wire::below(self.next_seq, messages) && wire::below(kib, limit),
            Credit::Unlimited => true,
        }
    }

    /// Put notification `msg` on the wire to this peer, within its grant: its header
    /// carries the next sequence number, and the counts the grant is measured in move
    /// on. Returns the flight and whether to ask for more credit now.
    fn send_granted(
        &mut self,
        me: &Identity,
        ucx: &mut Ucx<Work>,
        peer: &str,
        ep: EpId,
        msg: Bytes,
        done: Completer,
    ) -> (FlightId, bool) {
        let h = me.header(peer, Kind::Notif, self.epoch, self.next_seq, &msg);
        self.next_seq += 1;
        self.sent_bytes += msg.len() as u64;
        let ask = self.wants_credit();
        let flight = ucx.am_send(ep, wire::AM_ID, h, msg, false, Work::Done(done));
        (flight, ask)
    }

    /// Whether to ask for more credit now that a notification went: half the
    /// window is used and no ask is outstanding.
    fn wants_credit(&self) -> bool {
        if self.asked.is_some() {
            return false;
        }
        let kib = self.sent_bytes >> 10;
        let (messages_left, kib_left) = match self.credit {
            Credit::Awaiting { .. } => (
                CREDIT_WINDOW.saturating_sub(self.next_seq),
                CREDIT_WINDOW_KIB.saturating_sub(kib),
            ),
            Credit::Granted {
                messages,
                kib: limit,
            } => (
                u64::from(messages.wrapping_sub(self.next_seq as u32)),
                u64::from(limit.wrapping_sub(kib as u32)),
            ),
            Credit::Unlimited => return false,
        };
        messages_left <= CREDIT_WINDOW / 2 || kib_left <= CREDIT_WINDOW_KIB / 2
    }

    /// Queue a flight; an idle connection starts its progress clock `now`.
    fn push(&mut self, f: InFlight, now: Instant) {
        if self.queue.is_empty() {
            self.last_progress = now;
        }
        self.queue.push_back(f);
    }

    /// Mark the connection dead and force-close its endpoints, which completes what
    /// UCX still holds for it (with an error).
    fn fail<K: HoldsMemory>(&mut self, ucx: &mut Ucx<K>, why: String) {
        for (_, done) in self.held.drain(..) {
            done.complete(Err(Error::new(
                ErrorKind::RemoteDisconnected,
                "ucx notify",
                why.clone(),
            )));
        }
        self.failed = Some(why);
        self.rkeys.clear();
        self.probe = None;
        if let Ok(ep) = self.ep {
            ucx.ep_close(ep);
        }
        if let Some(ep) = self.probe_ep.take() {
            ucx.ep_close(ep);
        }
    }
}

#[derive(Debug)]
enum AmEvent {
    /// One of our messages.
    Ours { header: wire::Header, data: Bytes },
    /// A NIXL agent's notification.
    Nixl { sender: String, msg: Bytes },
}

/// Longest sender name accepted in a notification (ours or NIXL's).
const MAX_NAME: usize = 4096;

/// Longest worker address accepted in a HELLO or BYE (UCX's are a few hundred bytes
/// to a few KiB).
const MAX_ADDRESS: usize = 64 << 10;

/// Most HELLO senders remembered that are not (yet) known peers (a prefill's decode
/// workers, whose metadata it never loads): their notifications are held, in order,
/// when the agent's queue is full.
const MAX_INBOUND: usize = 256;

/// Most DROPPED reports sent per round (one per sender stream that had notifications
/// dropped in the round); drops past it are counted at the agent, not reported.
const MAX_DROP_REPORTS: usize = 1024;

/// Notifications of known peers the agent had no room for in this round, to report
/// to their senders: (name, stream, how many).
#[derive(Debug, Default)]
struct Drops(Vec<(String, u64, u64)>);

/// How often the driver looks for room for held notifications while any are held,
/// besides being woken by the application's reads
/// ([`nixl::NotificationSink::on_room`]): a read that races a notification being
/// held is caught within this.
const BACKLOG_TICK: Duration = Duration::from_millis(100);

/// Most notifications, and bytes, held for one sender while the agent's queue has no
/// room for them: a sender of ours has at most a credit window here
/// ([`CREDIT_WINDOW`], [`CREDIT_WINDOW_KIB`] plus one notification); a NIXL agent,
/// which cannot be held back, may fill it.
pub(crate) const BACKLOG_PEER_MESSAGES: usize = 4096;
const BACKLOG_PEER_BYTES: usize = 64 << 20;
/// Most notifications, and bytes, held for all senders together.
const BACKLOG_MESSAGES: usize = 1 << 20;
const BACKLOG_BYTES: usize = 256 << 20;
/// Most sender streams tracked for credit; past it, new ones are answered without
/// a limit (and are then dropped past the backlog's bounds).
const MAX_GRANTS: usize = 16_384;

/// Notifications the agent's queue had no room for, held in arrival order per
/// sender until it has (see [`Credit`] for how senders of ours are held back so
/// that nothing of theirs is lost). Held for known peers and senders that said
/// HELLO, within [`BACKLOG_PEER_MESSAGES`] /
/// [`BACKLOG_PEER_BYTES`] per sender and [`BACKLOG_MESSAGES`] / [`BACKLOG_BYTES`] in
/// all; past those (a sender ignoring its credit, a NIXL agent) or from a name
/// that is none of those, a notification is dropped, counted, and reported to a
/// sender that can be told.
#[derive(Debug, Default)]
pub(crate) struct Backlogs {
    by_name: HashMap<String, Backlog>,
    messages: usize,
    bytes: usize,
    /// Set while anything is held: the agent's reads then wake the driver
    /// ([`nixl::NotificationSink::on_room`]).
    pub(crate) holding: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
struct Backlog {
    /// (the sender's stream, for ours; the notification), oldest first.
    items: VecDeque<(Option<u64>, Bytes)>,
    bytes: usize,
}

impl Backlogs {
    /// Notifications held.
    pub(crate) fn len(&self) -> usize {
        self.messages
    }

    /// Hold `data` behind `name`'s backlog, if the bounds allow; else hand it back.
    fn hold(
        &mut self,
        name: &str,
        stream: Option<u64>,
        data: Bytes,
    ) -> std::result::Result<(), Bytes> {
        let n = data.len();
        if self.messages >= BACKLOG_MESSAGES || self.bytes.saturating_add(n) > BACKLOG_BYTES {
            return Err(data);
        }
        let b = self.by_name.entry(name.to_owned()).or_default();
        if b.items.len() >= BACKLOG_PEER_MESSAGES || b.bytes.saturating_add(n) > BACKLOG_PEER_BYTES
        {
            if b.items.is_empty() {
                self.by_name.remove(name);
            }
            return Err(data);
        }
        b.items.push_back((stream, data));
        b.bytes += n;
        self.messages += 1;
        self.bytes += n;
        self.holding.store(true, Ordering::Release);
        Ok(())
    }
}

/// What the agent took in (or dropped) of each sender stream of ours, from which
/// its credit is answered ([`Kind::CreditAsk`]); shared with the message handler,
/// which answers. Tracked from a stream's first notification or ask, at most
/// [`MAX_GRANTS`] streams, forgotten at the sender's BYE.
#[derive(Debug, Default)]
pub(crate) struct Grants {
    by_name: HashMap<String, HashMap<u64, Taken>>,
    streams: usize,
}

#[derive(Debug, Default, Clone, Copy)]
struct Taken {
    messages: u64,
    bytes: u64,
}

impl Grants {
    /// Whether `name`'s `stream` is tracked, tracking it if there is room.
    fn track(&mut self, name: &str, stream: u64) -> bool {
        if let Some(s) = self.by_name.get(name) {
            if s.contains_key(&stream) {
                return true;
            }
        }
        if self.streams >= MAX_GRANTS {
            return false;
        }
        self.streams += 1;
        self.by_name
            .entry(name.to_owned())
            .or_default()
            .insert(stream, Taken::default());
        true
    }

    /// One notification of `len` bytes of `name`'s `stream` left the sender's window:
    /// taken in by the agent, or dropped.
    fn taken(&mut self, name: &str, stream: u64, len: usize) {
        if let Some(t) = self.by_name.get_mut(name).and_then(|s| s.get_mut(&stream)) {
            t.messages += 1;
            t.bytes += len as u64;
        }
    }

    /// The credit for `name`'s `stream` ([`Kind::Credit`]'s `seq`): a window beyond
    /// what was taken in; no limit for a stream that cannot be tracked.
    fn answer(&mut self, name: &str, stream: u64) -> u64 {
        if !self.track(name, stream) {
            return wire::credit_seq(u64::from(u32::MAX >> 1), u64::from(u32::MAX >> 1));
        }
        let t = self.by_name[name][&stream];
        wire::credit_seq(
            t.messages + CREDIT_WINDOW,
            (t.bytes >> 10) + CREDIT_WINDOW_KIB,
        )
    }

    /// Forget `name`'s streams (it said goodbye).
    fn forget(&mut self, name: &str) {
        if let Some(s) = self.by_name.remove(name) {
            self.streams -= s.len();
        }
    }
}

/// The receive path's [`Deliver`] over a core's fields, `None` before the agent
/// gave its sink. A macro, not a method: the borrows stay disjoint from the
/// core's `reorder`, which hands `Deliver` the notifications it releases.
macro_rules! deliverer {
    ($core:ident) => {
        $core.sink.as_ref().map(|sink| Deliver {
            sink,
            peers: &$core.peers,
            inbound: &$core.inbound,
            backlogs: &mut $core.backlogs,
            grants: &$core.grants,
            drops: &mut $core.drops,
        })
    };
}

/// Where the receive path delivers notifications (disjoint borrows of the core).
struct Deliver<'a> {
    sink: &'a NotificationSink,
    peers: &'a HashMap<Arc<str>, PeerConn>,
    inbound: &'a HashMap<String, Vec<u8>>,
    backlogs: &'a mut Backlogs,
    grants: &'a Mutex<Grants>,
    drops: &'a mut Drops,
}

impl Deliver<'_> {
    /// Deliver one notification from `name` (`stream`: its sender's, for one of
    /// ours): behind its sender's backlog if it has one, else to the agent's queue if
    /// it has room, else held (see [`Backlogs`]); dropped only past the backlog's
    /// bounds, or from a sender none of ours knows of. A drop is counted, and noted
    /// in `drops` when its sender is a peer of ours we can answer.
    fn deliver(&mut self, name: &str, stream: Option<u64>, data: Bytes) {
        let len = data.len();
        let mut grants = self.grants.lock().unwrap();
        // Counted for credit from a stream's first notification (so answers never
        // lag behind it); held only for known peers and senders that said HELLO.
        if let Some(st) = stream {
            grants.track(name, st);
        }
        let taken = |g: &mut Grants| {
            if let Some(st) = stream {
                g.taken(name, st, len);
            }
        };
        let behind = self
            .backlogs
            .by_name
            .get(name)
            .is_some_and(|b| !b.items.is_empty());
        let data = if behind {
            data
        } else {
            match self.sink.try_deliver(name, data) {
                Ok(()) => return taken(&mut grants),
                Err(data) => data,
            }
        };
        let holdable = self.peers.contains_key(name) || self.inbound.contains_key(name);
        let data = if holdable {
            match self.backlogs.hold(name, stream, data) {
                Ok(()) => return,
                Err(data) => data,
            }
        } else {
            data
        };
        taken(&mut grants);
        drop(grants);
        let dropped = if behind {
            // Never ahead of what is held: dropped.
            self.sink.drop_unqueued(name, len);
            true
        } else {
            !self.sink.deliver(name, data)
        };
        let answerable = self
            .peers
            .get(name)
            .is_some_and(|p| !p.nixl && p.failed.is_none() && p.ep.is_ok());
        let Some(stream) = stream.filter(|_| dropped && answerable) else {
            return;
        };
        let d = &mut self.drops.0;
        if let Some(e) = d.iter_mut().find(|(n, s, _)| *s == stream && n == name) {
            e.2 += 1;
        } else if d.len() < MAX_DROP_REPORTS {
            d.push((name.to_owned(), stream, 1));
        }
    }
}

/// The error the next operation to `peer` fails with after it reported `n` of our
/// notifications dropped.
fn dropped_error(peer: &str, n: u64, op: &'static str) -> Error {
    Error::new(
        ErrorKind::NotAllowed,
        op,
        format!("peer {peer:?} dropped {n} notification(s) this agent sent it since the last operation: its agent's notification queue was full (its application reads notifications too slowly, see NotificationLimits); this operation was not started"),
    )
}

/// Who this backend is to its peers: the agent's name and, where set, the shared
/// secret every message of ours carries a MAC of ([`wire`]'s version 2). Known once
/// the backend is attached to an agent.
#[derive(Debug, Clone, Default)]
pub(crate) struct Identity {
    pub(crate) agent: String,
    pub(crate) secret: Option<SharedSecret>,
}

impl Identity {
    /// Our header for a message to `peer`: version 1 without a secret, else version
    /// 2 with a MAC over it and `data` for `peer`.
    fn header(&self, peer: &str, kind: Kind, stream: u64, seq: u64, data: &[u8]) -> Vec<u8> {
        match &self.secret {
            None => wire::encode_header(kind, stream, seq, &self.agent),
            Some(s) => wire::encode_signed_header(s, peer, kind, stream, seq, &self.agent, data),
        }
    }

    /// The PONG answering `ping` (already checked): with a secret, MAC'd for the
    /// PING's sender and naming us; without, as before version 2 (no name).
    fn pong(&self, ping: &wire::Header) -> Vec<u8> {
        match &self.secret {
            None => wire::encode_header(Kind::Pong, ping.stream, ping.seq, ""),
            Some(s) => wire::encode_signed_header(
                s,
                &ping.name,
                Kind::Pong,
                ping.stream,
                ping.seq,
                &self.agent,
                &[],
            ),
        }
    }

    /// The CREDIT answering `ask` (already checked): `seq` from [`Grants::answer`];
    /// with a secret, MAC'd for the asker and naming us, as a PONG.
    fn credit(&self, ask: &wire::Header, seq: u64) -> Vec<u8> {
        match &self.secret {
            None => wire::encode_header(Kind::Credit, ask.stream, seq, ""),
            Some(s) => wire::encode_signed_header(
                s,
                &ask.name,
                Kind::Credit,
                ask.stream,
                seq,
                &self.agent,
                &[],
            ),
        }
    }

    /// Why a message with `header` and `data` is refused as unauthenticated, if it
    /// is: with a secret, one without a MAC or whose MAC does not prove the secret for
    /// us (another secret, another receiver, altered); without one, one that carries
    /// a MAC (the sender has a secret we lack: a configuration mismatch, never
    /// accepted unchecked).
    fn refuse(&self, header: &wire::Header, data: &[u8]) -> Option<&'static str> {
        match (&self.secret, header.mac.is_some()) {
            (None, false) => None,
            (None, true) => Some(
                "it carries a MAC but this agent has no shared secret (set the same AgentBuilder::secret on both)",
            ),
            (Some(_), false) => Some(
                "no MAC: the sender has no shared secret (this agent requires AgentBuilder::secret)",
            ),
            (Some(s), true) => (!header.verify(s, &self.agent, data))
                .then_some("its MAC does not verify (another secret, or made for another agent)"),
        }
    }
}

/// What the receive path refused, for tests and logs.
#[derive(Debug, Default)]
pub(crate) struct Refused {
    /// Notifications over the limit (ours or NIXL's), dropped unread.
    pub(crate) oversized: AtomicU64,
    /// Messages dropped as malformed (header, name, address, NIXL framing).
    pub(crate) malformed: AtomicU64,
    /// Messages offered by rendezvous, declined.
    pub(crate) rendezvous: AtomicU64,
    /// Messages whose sender did not prove our shared secret (no MAC, a wrong one,
    /// one made for another agent; every NIXL notification when we have a secret), or
    /// that carry a MAC when we have no secret.
    pub(crate) unauthenticated: AtomicU64,
}

/// Logs a refusal at most once a second, saying how many went unlogged.
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    quiet: u64,
}

impl Throttle {
    /// `Some(n)` when this refusal is to be logged (`n` went unlogged before it).
    fn ready(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            self.quiet += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.quiet))
    }
}

/// Connection state and the UCX owner; always behind [`Shared::core`].
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) ucx: Ucx<Work>,
    rx: mpsc::Receiver<Cmd>,
    pub(crate) peers: HashMap<Arc<str>, PeerConn>,
    /// A peer's connection made for a newer link while its current one lives. The
    /// newer link takes over (`peers`, the current one closed) when it is first
    /// used or when the current link is closed (the agent put the newer one in
    /// place); it is dropped when it is closed first (its load was refused). So
    /// making a link never disturbs the peer's current one.
    next: HashMap<Arc<str>, PeerConn>,
    /// Flights of connections that were replaced or forgotten.
    orphans: Vec<(InFlight, String)>,
    events: Arc<Mutex<Vec<AmEvent>>>,
    /// Our notifications put back in posting order (bounded, see [`crate::reorder`]).
    pub(crate) reorder: Reorder,
    /// What the message handlers refused.
    pub(crate) refused: Arc<Refused>,
    /// HELLO senders not known as peers when they said it (at most [`MAX_INBOUND`]):
    /// name -> their worker address. Only ever compared with a peer's address from
    /// its metadata, never dialled (credit is answered on UCX's reply endpoint).
    inbound: HashMap<String, Vec<u8>>,
    /// PINGs and DROPPED reports in flight (outside their connection's queue:
    /// nothing waits for them).
    pings: Vec<FlightId>,
    /// Notifications dropped this round, to report to their senders.
    drops: Drops,
    /// Notifications held until the agent's queue has room ([`Backlogs`]).
    pub(crate) backlogs: Backlogs,
    /// What the agent took in of each sender stream of ours, for credit answers
    /// (shared with the message handler).
    grants: Arc<Mutex<Grants>>,
    /// Set once shutdown began: PINGs are no longer answered.
    closing: Arc<AtomicBool>,
    /// A notification was held for credit since the driver last ran a round: an
    /// inline post that held one wakes the driver, which paces the credit asks.
    held_new: bool,
    /// Our name and secret, for the messages we send.
    pub(crate) me: Identity,
    /// The same, for the message handlers (set once at start; until then they refuse
    /// everything).
    identity: Arc<OnceLock<Identity>>,
    /// The bound UCX's version, for messages.
    pub(crate) ucx_version: String,
    /// Whether endpoints ask for UCX's peer-failure handling
    /// ([`crate::UcxOptions::peer_error_handling`]).
    pub(crate) peer_error_handling: bool,
    pub(crate) sink: Option<NotificationSink>,
    max_notification: usize,
    liveness: Option<Liveness>,
    /// The time, read once per round (at [`Core::drain_inbox`]): progress clocks
    /// need no finer grain, and clock reads are a noticeable part of a small
    /// transfer's cost.
    now: Instant,
    /// Reused by [`Core::reap`].
    scratch: Vec<Arc<str>>,
    /// The GPU whose primary context UCX calls run in, once GPU memory was mapped
    /// (UCX before 1.19 copies CUDA memory in the context current on the calling
    /// thread).
    pub(crate) gpu: Option<u32>,
}

/// UCX between teardown and destroy.
#[derive(Debug, Default)]
pub(crate) struct Parked {
    pub(crate) ucx: Option<Ucx<Work>>,
    /// `destroy` ran (or the backend is gone): a teardown after it drops UCX at once.
    pub(crate) destroyed: bool,
}

/// How the driver is woken when work is posted.
#[derive(Debug)]
pub(crate) enum Wake {
    Task(Notify),
    Thread { fd: WakeFd, sleeping: AtomicBool },
}

/// What the backend and the driver share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) core: Mutex<Option<Core>>,
    /// UCX after the driver stopped: connections closed, memory still mapped, the
    /// worker and context alive until [`nixl::Backend::destroy`] (or drop), so the
    /// agent deregisters memory after the connections and before the context.
    pub(crate) parked: Mutex<Parked>,
    pub(crate) tx: mpsc::Sender<Cmd>,
    pub(crate) wake: Wake,
    /// Set when the driver has torn UCX down.
    pub(crate) stopped: AtomicBool,
    pub(crate) stopped_notify: Notify,
    pub(crate) spin: Duration,
    pub(crate) bye_bound: Duration,
    /// Whether posting may run the driver's round on the caller's thread
    /// ([`crate::UcxOptions::post_inline`]).
    pub(crate) inline: bool,
}

impl Shared {
    /// Hand a command to the driver. Never blocks.
    pub(crate) fn submit(&self, cmd: Cmd) {
        let cmd = if self.inline {
            match self.run_inline(cmd) {
                Ok(true) => return,
                Ok(false) => return self.wake_driver(),
                Err(cmd) => cmd,
            }
        } else {
            cmd
        };
        if let Err(mpsc::SendError(cmd)) = self.tx.send(cmd) {
            fail_cmd(cmd, ErrorKind::ShutDown, "the ucx backend has stopped");
            return;
        }
        self.wake_driver();
    }

    /// Wake the driver (it runs a round).
    pub(crate) fn wake_driver(&self) {
        match &self.wake {
            Wake::Task(n) => n.notify_one(),
            Wake::Thread { fd, sleeping } => {
                if sleeping.swap(false, Ordering::SeqCst) {
                    fd.wake();
                }
            }
        }
    }

    /// Issue `cmd` on the calling thread when nobody else is in UCX: the commands
    /// queued before it first (in order), then it, then progress, failures and
    /// completions ([`Core::step_with`]); on shared memory a small transfer usually completes
    /// before `post` returns, with no thread hop and no queue. Returns whether
    /// nothing is left in flight (the driver need not be woken), or hands `cmd`
    /// back when UCX was not to be had (the driver takes it).
    ///
    /// The driver holds UCX for one round at a time (microseconds), and while
    /// transfers flow it runs round after round: a post that found it busy waits
    /// for it up to [`INLINE_WAIT`] rather than leave its transfer to the driver's
    /// next round (a thread hop, ~1 µs per 4 KiB transfer posted back to back).
    /// Bounded, so a post made from inside a round (none is, today) cannot wait
    /// on itself.
    fn run_inline(&self, cmd: Cmd) -> Result<bool, Cmd> {
        let mut deadline = None;
        let mut g = loop {
            match self.core.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::WouldBlock)
                    if Instant::now()
                        < *deadline.get_or_insert_with(|| Instant::now() + INLINE_WAIT) =>
                {
                    std::hint::spin_loop();
                }
                Err(_) => return Err(cmd),
            }
        };
        let Some(core) = g.as_mut() else {
            return Err(cmd);
        };
        if core.closing.load(Ordering::Acquire) {
            return Err(cmd);
        }
        core.step_with(cmd);
        // Nothing in flight and nothing newly held for credit: the driver's own
        // schedule stands. A notification held here needs the driver's credit pacing
        // (asks, the wait for a peer that never answers), which its sleep computed
        // before the notification was held does not cover.
        let wake = core.busy() || std::mem::take(&mut core.held_new);
        Ok(!wake)
    }

    pub(crate) fn mark_stopped(&self) {
        self.stopped.store(true, Ordering::Release);
        self.stopped_notify.notify_waiters();
    }

    /// Wait until the driver has stopped.
    pub(crate) async fn wait_stopped(&self) {
        loop {
            let n = self.stopped_notify.notified();
            if self.stopped.load(Ordering::Acquire) {
                return;
            }
            n.await;
        }
    }
}

fn fail_cmd(cmd: Cmd, kind: ErrorKind, why: &str) {
    let e = || Error::new(kind, "ucx transfer", why);
    match cmd {
        Cmd::Transfer { done, .. } | Cmd::Notify { done, .. } => done.complete(Err(e())),
        Cmd::Connect { tx, .. } => {
            let _ = tx.send(Err(e()));
        }
    }
}

/// Introduce ourselves on `p`'s connection once (the peer learns our address, to say
/// goodbye to us at its shutdown).
fn say_hello(ucx: &mut Ucx<Work>, me: &Identity, peer: &str, p: &mut PeerConn, now: Instant) {
    let (false, false, Ok(ep)) = (p.nixl, p.hello_sent, p.ep.clone()) else {
        return;
    };
    p.hello_sent = true;
    let data = Bytes::copy_from_slice(ucx.address());
    let h = me.header(peer, Kind::Hello, p.epoch, 0, &data);
    let flight = ucx.am_send(ep, wire::AM_ID, h, data, false, Work::Internal);
    p.push(
        InFlight {
            flight,
            notif: None,
        },
        now,
    );
}

/// The error for work on a link whose connection was closed (the peer forgotten,
/// moved or restarted) or replaced by a newer link's.
fn closed_link(peer: &str, op: &'static str) -> Error {
    Error::new(
        ErrorKind::RemoteDisconnected,
        op,
        format!("peer {peer:?}: the link was closed or replaced by a newer one"),
    )
}

/// Talking to NIXL agents (`what`: which, or what for) while this agent has a
/// shared secret.
pub(crate) fn nixl_refused(what: &str) -> Error {
    Error::new(
        ErrorKind::NotAllowed,
        "ucx NIXL agent",
        format!("{what}: this agent has a shared secret (AgentBuilder::secret or UcxOptions::secret) and NIXL's protocol has no authentication, so nixl-ucx does not talk to NIXL agents; work with NIXL agents from an agent without a secret"),
    )
}

fn disconnected(peer: &str, why: &str) -> Error {
    Error::new(
        ErrorKind::RemoteDisconnected,
        "ucx transfer",
        format!("peer {peer:?}: {why}"),
    )
}

impl Core {
    pub(crate) fn new(
        mut ucx: Ucx<Work>,
        rx: mpsc::Receiver<Cmd>,
        max_notification: usize,
        liveness: Option<Liveness>,
    ) -> std::result::Result<Self, UcxError> {
        let events: Arc<Mutex<Vec<AmEvent>>> = Arc::default();
        let refused: Arc<Refused> = Arc::default();
        let identity: Arc<OnceLock<Identity>> = Arc::default();
        let (ev, ident) = (events.clone(), identity.clone());
        let closing = Arc::new(AtomicBool::new(false));
        let closing2 = closing.clone();
        let (count, mut log) = (refused.clone(), Throttle::default());
        let grants: Arc<Mutex<Grants>> = Arc::default();
        let grants2 = grants.clone();
        // Data arrives eagerly, already in UCX's buffers: it is looked at before it is
        // copied, and copied only when within its limit and (with a secret) once its
        // MAC verifies. Rendezvous (which would fetch a payload of the sender's
        // choosing) is declined unread, and its sender's send fails: this crate and
        // NIXL force eager sends (`UCP_AM_SEND_FLAG_EAGER`, whatever their size), so
        // only a hostile or foreign sender offers one.
        ucx.set_am_handler(
            wire::AM_ID,
            Box::new(move |m| {
                let mut refuse = |c: &AtomicU64, why: &str, name: &str| {
                    c.fetch_add(1, Ordering::Relaxed);
                    if let Some(quiet) = log.ready() {
                        tracing::warn!(
                            from = name,
                            header = m.header.len(),
                            data = m.data.map(<[u8]>::len),
                            unlogged = quiet,
                            "ucx: dropping an active message: {why}"
                        );
                    }
                    None
                };
                let Some(id) = ident.get() else {
                    return refuse(
                        &count.unauthenticated,
                        "not attached to an agent yet (nothing to check it against)",
                        "",
                    );
                };
                let Some(header) = wire::decode_header(m.header) else {
                    return refuse(&count.malformed, "malformed header", "");
                };
                if header.name.len() > MAX_NAME {
                    return refuse(&count.malformed, "sender name too long", "");
                }
                // Before anything else, PINGs included: a declined offer gets no
                // answer (its sender's send fails).
                let Some(data) = m.data else {
                    return refuse(
                        &count.rendezvous,
                        "offered by rendezvous (never requested)",
                        &header.name,
                    );
                };
                // Answered here, on the reply endpoint, while the driver runs.
                let answer =
                    |h: &wire::Header| (!closing2.load(Ordering::Acquire)).then(|| id.pong(h));
                if header.kind == Kind::Ping && id.secret.is_none() && header.mac.is_none() {
                    // As before version 2: whatever comes with it.
                    return answer(&header);
                }
                let limit = match header.kind {
                    Kind::Notif => max_notification,
                    Kind::Hello | Kind::Bye => MAX_ADDRESS,
                    Kind::Ping | Kind::Pong | Kind::Dropped | Kind::Credit | Kind::CreditAsk => 0,
                };
                if data.len() > limit {
                    let (c, why) = match header.kind {
                        Kind::Notif => {
                            // Gone from its sender's window all the same (without a
                            // secret: with one, only proven senders count).
                            if id.secret.is_none() {
                                grants2.lock().unwrap().taken(
                                    &header.name,
                                    header.stream,
                                    data.len(),
                                );
                            }
                            (&count.oversized, "notification over the limit")
                        }
                        _ => (&count.malformed, "data too long for its kind"),
                    };
                    return refuse(c, why, &header.name);
                }
                // Before anything is done with it (HELLO bookkeeping, a PONG, a BYE,
                // delivery): the sender must prove our secret, for us.
                if let Some(why) = id.refuse(&header, data) {
                    return refuse(&count.unauthenticated, why, &header.name);
                }
                if header.kind == Kind::Ping {
                    return answer(&header);
                }
                if header.kind == Kind::CreditAsk {
                    // Answered here too, on the asker's reply endpoint: never a
                    // connection of our own making.
                    let seq = grants2.lock().unwrap().answer(&header.name, header.stream);
                    return (!closing2.load(Ordering::Acquire)).then(|| id.credit(&header, seq));
                }
                ev.lock().unwrap().push(AmEvent::Ours {
                    header,
                    data: Bytes::copy_from_slice(data),
                });
                None
            }),
        )?;
        let (ev, ident) = (events.clone(), identity.clone());
        let (count, mut log) = (refused.clone(), Throttle::default());
        // The serdes framing around the message: prefix, two tags, lengths, bars.
        let max_nixl = max_notification.saturating_add(64 + MAX_NAME);
        ucx.set_am_handler(
            wire::NIXL_NOTIF_AM_ID,
            Box::new(move |m| {
                let mut refuse = |c: &AtomicU64, why: &dyn std::fmt::Display| {
                    c.fetch_add(1, Ordering::Relaxed);
                    if let Some(quiet) = log.ready() {
                        tracing::warn!(
                            data = m.data.map(<[u8]>::len),
                            unlogged = quiet,
                            "ucx: dropping a NIXL notification: {why}"
                        );
                    }
                    None
                };
                match ident.get() {
                    Some(id) if id.secret.is_none() => {}
                    Some(_) => {
                        return refuse(
                            &count.unauthenticated,
                            &"this agent has a shared secret and NIXL's protocol cannot prove one",
                        )
                    }
                    None => {
                        return refuse(
                            &count.unauthenticated,
                            &"not attached to an agent yet (nothing to check it against)",
                        )
                    }
                }
                let Some(data) = m.data else {
                    return refuse(
                        &count.rendezvous,
                        &"offered by rendezvous (never requested)",
                    );
                };
                if data.len() > max_nixl {
                    return refuse(&count.oversized, &"over the notification limit");
                }
                match nixl::interop::decode_notification(data, MAX_NAME) {
                    Ok((_, msg)) if msg.len() > max_notification => {
                        refuse(&count.oversized, &"over the notification limit")
                    }
                    Ok((sender, msg)) => {
                        ev.lock().unwrap().push(AmEvent::Nixl {
                            sender,
                            msg: Bytes::copy_from_slice(msg),
                        });
                        None
                    }
                    Err(e) => refuse(&count.malformed, &format_args!("malformed ({e})")),
                }
            }),
        )?;
        Ok(Self {
            ucx,
            rx,
            peers: HashMap::new(),
            next: HashMap::new(),
            orphans: Vec::new(),
            events,
            reorder: Reorder::new(reorder::Limits::DEFAULT),
            refused,
            inbound: HashMap::new(),
            pings: Vec::new(),
            drops: Drops::default(),
            backlogs: Backlogs::default(),
            grants,
            closing,
            held_new: false,
            me: Identity::default(),
            identity,
            ucx_version: String::new(),
            peer_error_handling: true,
            sink: None,
            max_notification,
            liveness,
            now: Instant::now(),
            scratch: Vec::new(),
            gpu: None,
        })
    }

    /// Take the agent's name and secret (at start): from now on every message of
    /// ours carries them, and the message handlers check incoming ones against them.
    pub(crate) fn attach(&mut self, me: Identity) {
        // Started once (the backend's attachment refuses a second start).
        let _ = self.identity.set(me.clone());
        self.me = me;
    }

    /// A new connection to a peer's worker address, for a new link; returns the
    /// connection's epoch, which names it. Where the peer has a current connection,
    /// the new one waits (see [`Core::next`]). `nixl`: the peer is a NIXL agent
    /// (see [`PeerConn::nixl`]).
    pub(crate) fn add_peer(&mut self, peer: &str, address: &[u8], nixl: bool) -> u64 {
        let mut peer_failure = self.peer_error_handling;
        // Checked (and padded) before UCX parses it; the backend refused a malformed
        // one already, so this only repeats the check.
        let padded = Padded::address(address);
        let ep = match &padded {
            Err(e) => Err(e.to_string()),
            Ok(padded) => match self.ucx.ep_create(padded, peer_failure) {
            // NIXL makes every endpoint with peer-failure handling; a NIXL agent we
            // cannot reach so is one whose UCX build ours cannot talk to (connecting
            // anyway can end in an assertion inside UCX).
            Err(e) if nixl => Err(e),
            Err(e) if Ucx::<Work>::is_unreachable(&e) => {
                // UCX 1.13-1.22 shared-memory transports handle peer failure only
                // with UCX_POSIX_ERROR_HANDLING=y / UCX_SYSV_ERROR_HANDLING=y; without
                // them, peer error handling makes a shm-only peer unreachable.
                tracing::warn!(
                    peer,
                    error = %e,
                    "ucx: no transport to the peer supports peer-failure handling; connecting without it (set UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y for shared memory); a crashed peer is then noticed only by its transfers' errors"
                );
                peer_failure = false;
                self.ucx.ep_create(padded, false)
            }
            r => r,
        }
        .map_err(|e| {
            tracing::warn!(peer, error = %e, "ucx: cannot create an endpoint to the peer");
            if nixl {
                format!(
                    "UCX {} bound here cannot reach this NIXL agent ({e}): bind the UCX build the NIXL agents use (NIXL_UCX_LIB=<its libucp>; for the nixl-cu12 wheel, nixl_cu12.libs/libucp-*.so*)",
                    self.ucx_version
                )
            } else {
                e.to_string()
            }
        }),
        };
        tracing::debug!(peer, ok = ep.is_ok(), peer_failure, "ucx endpoint created");
        let epoch = random_u64();
        let heard_hello = !self.peers.contains_key(peer)
            && self.inbound.remove(peer).is_some_and(|a| a == address);
        let conn = PeerConn {
            epoch,
            address: address.to_vec(),
            ep,
            peer_failure,
            nixl,
            failed: None,
            hello_sent: false,
            heard_hello,
            next_seq: 0,
            rkeys: HashMap::new(),
            queue: VecDeque::new(),
            last_progress: Instant::now(),
            probe_ep: None,
            probe: None,
            next_probe: 0,
            dropped: 0,
            credit: Credit::Awaiting { since: None },
            sent_bytes: 0,
            asked: None,
            ask_every: ASK_MIN,
            held: VecDeque::new(),
        };
        if self.peers.contains_key(peer) {
            if let Some(older) = self.next.insert(Arc::from(peer), conn) {
                self.close_conn(peer, older, "a newer link to the peer was made");
            }
        } else {
            self.peers.insert(Arc::from(peer), conn);
        }
        epoch
    }

    /// Where the link named by `epoch` waits (see [`Core::next`]), its connection
    /// takes over now (the current one closes): the link is in use. Callers then
    /// find the peer's current connection and check that it is the link's (another
    /// epoch, or none: the link was closed). Costs nothing while no link waits.
    fn take_over(&mut self, peer: &str, epoch: u64) {
        if self.next.is_empty() || self.next.get(peer).is_none_or(|p| p.epoch != epoch) {
            return;
        }
        let newer = self.next.remove(peer).expect("checked above");
        if let Some(old) = self.promote(peer, newer) {
            self.close_conn(peer, old, "the peer's connection was replaced");
        }
    }

    /// Make a waiting connection the peer's current one, returning the one it
    /// replaces. A HELLO the peer sent from the new connection's address while it
    /// waited was remembered (it did not match the current address): it counts now.
    fn promote(&mut self, peer: &str, mut newer: PeerConn) -> Option<PeerConn> {
        if self.inbound.get(peer).is_some_and(|a| *a == newer.address) {
            self.inbound.remove(peer);
            newer.heard_hello = true;
        }
        self.peers.insert(Arc::from(peer), newer)
    }

    /// Close the connection of the link named by `epoch`: its endpoints close and
    /// its in-flight work fails. Closing the current connection lets a waiting one
    /// take over (the agent put the newer link in place); closing a waiting one
    /// leaves the current one as it is (its load was refused).
    pub(crate) fn close_link(&mut self, peer: &str, epoch: u64, why: &str) {
        if self.peers.get(peer).is_some_and(|p| p.epoch == epoch) {
            let p = self.peers.remove(peer).expect("checked above");
            self.close_conn(peer, p, why);
            if let Some(newer) = self.next.remove(peer) {
                self.promote(peer, newer);
            }
        } else if self.next.get(peer).is_some_and(|p| p.epoch == epoch) {
            let p = self.next.remove(peer).expect("checked above");
            self.close_conn(peer, p, why);
        }
    }

    /// The state of `peer`'s connection, for [`nixl::Backend::data_path`]: empty
    /// while it works, else what is wrong with it.
    pub(crate) fn connection_state(&self, peer: &str) -> String {
        match self.peers.get(peer) {
            None => " (not linked)".to_owned(),
            Some(p) => match (&p.failed, &p.ep) {
                (Some(why), _) => format!(" (connection failed: {why})"),
                (None, Err(e)) => format!(" (unreachable: {e})"),
                (None, Ok(_)) => String::new(),
            },
        }
    }

    /// Whether the connection of the link named by `epoch` failed for good (or is
    /// gone).
    pub(crate) fn link_failed(&self, peer: &str, epoch: u64) -> bool {
        [self.peers.get(peer), self.next.get(peer)]
            .into_iter()
            .flatten()
            .find(|p| p.epoch == epoch)
            .is_none_or(|p| p.failed.is_some() || p.ep.is_err())
    }

    /// Forget a peer: close its connections; their in-flight work fails.
    pub(crate) fn remove_peer(&mut self, peer: &str, why: &str) {
        for p in [self.peers.remove(peer), self.next.remove(peer)]
            .into_iter()
            .flatten()
        {
            self.close_conn(peer, p, why);
        }
    }

    /// Close one connection: its endpoints close, its in-flight work fails.
    fn close_conn(&mut self, peer: &str, mut p: PeerConn, why: &str) {
        if let Ok(ep) = p.ep {
            self.ucx.ep_close(ep);
        }
        if let Some(ep) = p.probe_ep.take() {
            self.ucx.ep_close(ep);
        }
        for f in p.queue.drain(..) {
            self.orphans.push((f, format!("peer {peer:?}: {why}")));
        }
        // As the queued transfers: their connection is gone (tcp, verbs and uccl
        // fail them the same way).
        for (_, done) in p.held.drain(..) {
            done.complete(Err(Error::new(
                ErrorKind::RemoteDisconnected,
                "ucx notify",
                format!("peer {peer:?}: {why}"),
            )));
        }
    }

    /// Resolve a remote key for `region` of `peer` on the connection of the link
    /// named by `epoch` (made current if it waited), unpacking it once per connection.
    pub(crate) fn rkey(
        &mut self,
        peer: &str,
        epoch: u64,
        region: u64,
        blob: &Bytes,
        packed: &[u8],
    ) -> Result<RkeyId> {
        const OP: &str = "ucx prepare";
        self.take_over(peer, epoch);
        let Some(p) = self.peers.get_mut(peer).filter(|p| p.epoch == epoch) else {
            return Err(closed_link(peer, OP));
        };
        if let Some(why) = &p.failed {
            return Err(disconnected(peer, why));
        }
        let ep = match &p.ep {
            Ok(ep) => *ep,
            Err(e) => {
                return Err(Error::new(
                    ErrorKind::RemoteDisconnected,
                    OP,
                    format!("peer {peer:?} is unreachable over UCX: {e}"),
                ))
            }
        };
        if let Some((b, k)) = p.rkeys.get(&region) {
            if b == blob {
                return Ok(*k);
            }
        }
        // Checked (and padded) before UCX parses it.
        let padded = Padded::rkey(packed).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                OP,
                format!("peer {peer:?} region {region}: malformed remote key: {e}"),
            )
        })?;
        let k = self.ucx.rkey_unpack(ep, &padded).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                OP,
                format!("peer {peer:?} region {region}: the remote key does not unpack"),
            )
            .with_source(e)
        })?;
        p.rkeys.insert(region, (blob.clone(), k));
        Ok(k)
    }

    fn ensure_hello(&mut self, peer: &str) {
        if let Some(p) = self.peers.get_mut(peer) {
            say_hello(&mut self.ucx, &self.me, peer, p, self.now);
        }
    }

    fn exec(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Transfer { xfer, notif, done } => {
                let now = self.now;
                self.take_over(&xfer.peer, xfer.epoch);
                let Some(p) = (self.peers.get_mut(&*xfer.peer)).filter(|p| p.epoch == xfer.epoch)
                else {
                    return done.complete(Err(closed_link(&xfer.peer, "ucx transfer")));
                };
                if let Some(why) = &p.failed {
                    return done.complete(Err(disconnected(&xfer.peer, why)));
                }
                if p.dropped > 0 {
                    let n = std::mem::take(&mut p.dropped);
                    return done.complete(Err(dropped_error(&xfer.peer, n, "ucx transfer")));
                }
                if done.is_canceled() {
                    return done.complete(Err(Error::new(
                        ErrorKind::Canceled,
                        "ucx transfer",
                        "dropped before it started",
                    )));
                }
                let Ok(ep) = p.ep else {
                    return done.complete(Err(disconnected(&xfer.peer, "unreachable")));
                };
                say_hello(&mut self.ucx, &self.me, &xfer.peer, p, now);
                let flight = self.ucx.rma(ep, xfer.write, &xfer.segs, Work::Done(done));
                p.push(InFlight { flight, notif }, now);
            }
            Cmd::Notify {
                peer,
                epoch,
                msg,
                done,
            } => {
                self.take_over(&peer, epoch);
                match self.peers.get(peer.as_str()) {
                    Some(p) if p.epoch == epoch => {}
                    _ => return done.complete(Err(closed_link(&peer, "ucx notify"))),
                }
                if msg.len() > self.max_notification {
                    return done.complete(Err(Error::new(
                        ErrorKind::InvalidArgument,
                        "ucx notify",
                        format!(
                            "notification of {} bytes exceeds the limit of {}",
                            msg.len(),
                            self.max_notification
                        ),
                    )));
                }
                match self.peers.get(peer.as_str()) {
                    None => done.complete(Err(closed_link(&peer, "ucx notify"))),
                    Some(p) if p.failed.is_some() || p.ep.is_err() => {
                        let why = p.failed.clone().unwrap_or_else(|| "unreachable".into());
                        done.complete(Err(disconnected(&peer, &why)))
                    }
                    Some(p) if p.dropped > 0 => {
                        let n = p.dropped;
                        if let Some(p) = self.peers.get_mut(peer.as_str()) {
                            p.dropped = 0;
                        }
                        done.complete(Err(dropped_error(&peer, n, "ucx notify")))
                    }
                    Some(_) => {
                        self.ensure_hello(&peer);
                        let f = self.send_notif(&peer, msg, done);
                        if let (Some(p), Some(f)) = (self.peers.get_mut(peer.as_str()), f) {
                            p.push(
                                InFlight {
                                    flight: f,
                                    notif: None,
                                },
                                self.now,
                            );
                        }
                    }
                }
            }
            Cmd::Connect { peer, epoch, tx } => {
                self.take_over(&peer, epoch);
                self.connect(peer, epoch, tx);
            }
        }
    }

    /// Flush `peer`'s connection of the link named by `epoch` for a connect: `tx`
    /// learns when it is up.
    fn connect(&mut self, peer: String, epoch: u64, tx: oneshot::Sender<Result<()>>) {
        match self.peers.get(peer.as_str()) {
            Some(p) if p.epoch != epoch => {
                let _ = tx.send(Err(closed_link(&peer, "ucx connect")));
            }
            None => {
                let _ = tx.send(Err(closed_link(&peer, "ucx connect")));
            }
            Some(p) if p.failed.is_some() || p.ep.is_err() => {
                let why = p
                    .failed
                    .clone()
                    .unwrap_or_else(|| p.ep.as_ref().err().cloned().unwrap_or_default());
                let _ = tx.send(Err(disconnected(&peer, &why)));
            }
            Some(p) => {
                let ep = p.ep.clone().expect("checked above");
                self.ensure_hello(&peer);
                let flight = self.ucx.flush(ep, Work::Connect(tx));
                if let Some(p) = self.peers.get_mut(peer.as_str()) {
                    p.push(
                        InFlight {
                            flight,
                            notif: None,
                        },
                        self.now,
                    );
                }
            }
        }
    }

    /// Send a notification on `peer`'s connection; `None` if the peer is gone (then
    /// `done` was completed).
    fn send_notif(&mut self, peer: &str, msg: Bytes, done: Completer) -> Option<FlightId> {
        let Some(p) = self.peers.get_mut(peer) else {
            done.complete(Err(disconnected(peer, "forgotten")));
            return None;
        };
        let Ok(ep) = p.ep else {
            done.complete(Err(disconnected(peer, "unreachable")));
            return None;
        };
        if let Some(why) = &p.failed {
            // A transfer that finished in the same round its connection failed: its
            // notification can no longer go (held, it would wait for credit a closed
            // endpoint never brings).
            done.complete(Err(disconnected(peer, why)));
            return None;
        }
        if p.nixl {
            if self.me.secret.is_some() {
                // Refused when the peer was loaded; kept here so no path sends one.
                done.complete(Err(nixl_refused(&format!("NIXL agent {peer:?}"))));
                return None;
            }
            let data = Bytes::from(nixl::interop::encode_notification(&self.me.agent, &msg));
            return Some(self.ucx.am_send(
                ep,
                wire::NIXL_NOTIF_AM_ID,
                Vec::new(),
                data,
                false,
                Work::Done(done),
            ));
        }
        if !p.held.is_empty() || !p.may_send() {
            // Beyond what the peer granted: wait (and the transfer it belongs to)
            // until it grants more.
            p.held.push_back((msg, done));
            self.held_new = true;
            if p.asked.is_none() {
                self.ask_credit(peer);
            }
            return None;
        }
        let (flight, ask) = p.send_granted(&self.me, &mut self.ucx, peer, ep, msg, done);
        if ask {
            self.ask_credit(peer);
        }
        Some(flight)
    }

    /// Ask `peer` for credit ([`Kind::CreditAsk`], answered on the reply endpoint).
    fn ask_credit(&mut self, peer: &str) {
        let now = self.now;
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        let (Ok(ep), None, false) = (&p.ep, &p.failed, p.nixl) else {
            return;
        };
        let ep = *ep;
        p.asked = Some(now);
        if let Credit::Awaiting {
            since: since @ None,
        } = &mut p.credit
        {
            *since = Some(now);
        }
        let h = self.me.header(peer, Kind::CreditAsk, p.epoch, 0, &[]);
        let flight = self
            .ucx
            .am_send(ep, wire::AM_ID, h, Bytes::new(), true, Work::Internal);
        self.pings.push(flight);
    }

    /// Send what waits for `peer`'s grant, in order, as far as the grant goes.
    fn send_held(&mut self, peer: &str) {
        loop {
            let Some(p) = self.peers.get_mut(peer) else {
                return;
            };
            if !p.may_send() {
                return;
            }
            let Some((msg, done)) = p.held.pop_front() else {
                return;
            };
            let Ok(ep) = p.ep else {
                done.complete(Err(disconnected(peer, "unreachable")));
                continue;
            };
            let (flight, ask) = p.send_granted(&self.me, &mut self.ucx, peer, ep, msg, done);
            let now = self.now;
            if let Some(p) = self.peers.get_mut(peer) {
                p.push(
                    InFlight {
                        flight,
                        notif: None,
                    },
                    now,
                );
            }
            if ask {
                self.ask_credit(peer);
            }
        }
    }

    /// For peers whose notifications wait for credit: drop those whose transfer was
    /// dropped (cancelled: never sent), ask again when an ask went unanswered (backing
    /// off), and give a peer that never answered within [`LEGACY_WAIT`] (an older
    /// nixl-rs) no limit.
    fn pace_credit(&mut self) {
        let now = self.now;
        let mut ask = Vec::new();
        let mut free = Vec::new();
        for (name, p) in self.peers.iter_mut() {
            if p.held.is_empty() || p.credit == Credit::Unlimited {
                continue;
            }
            if p.held.iter().any(|(_, d)| d.is_canceled()) {
                let mut kept = VecDeque::with_capacity(p.held.len());
                for (msg, done) in p.held.drain(..) {
                    if done.is_canceled() {
                        done.complete(Err(Error::new(
                            ErrorKind::Canceled,
                            "ucx notify",
                            "dropped while waiting for the peer's credit; not sent",
                        )));
                    } else {
                        kept.push_back((msg, done));
                    }
                }
                p.held = kept;
            }
            if let Credit::Awaiting { since: Some(t) } = p.credit {
                if now.duration_since(t) >= LEGACY_WAIT {
                    tracing::debug!(peer = %name, "ucx: the peer grants no credit (an older nixl-rs); sending without a limit");
                    p.credit = Credit::Unlimited;
                    free.push(name.clone());
                    continue;
                }
            }
            if p.asked.is_none_or(|t| now.duration_since(t) >= p.ask_every) {
                p.ask_every = (p.ask_every * 2).min(ASK_MAX);
                ask.push(name.clone());
            }
        }
        for name in free {
            self.send_held(&name);
        }
        for name in ask {
            self.ask_credit(&name);
        }
    }

    /// When the next [`Core::pace_credit`] is due, if notifications wait for credit.
    fn credit_deadline(&self) -> Option<Instant> {
        self.peers
            .values()
            .filter(|p| !p.held.is_empty() && p.credit != Credit::Unlimited)
            .map(|p| {
                let ask = p.asked.map_or(self.now, |t| t + p.ask_every);
                match p.credit {
                    Credit::Awaiting { since: Some(t) } => ask.min(t + LEGACY_WAIT),
                    _ => ask,
                }
            })
            .min()
    }

    /// One round: commands, progress, incoming messages, failures, completions.
    /// Returns the number of commands executed.
    pub(crate) fn step(&mut self) -> usize {
        self.bind_gpu();
        let mut n = self.drain_inbox();
        n += self.progress();
        self.handle_events();
        if let Some(mut to) = deliverer!(self) {
            self.reorder
                .expire(self.now, &mut |n, st, d| to.deliver(n, Some(st), d));
        }
        self.drain_backlogs();
        self.pace_credit();
        self.report_drops();
        self.check_failures();
        self.reap();
        self.ucx.reap_closed();
        // The driver's own wait, computed after this round, covers what is held now.
        self.held_new = false;
        n
    }

    /// A posting caller's round ([`Shared::run_inline`]): the commands queued
    /// before `cmd`, `cmd`, progress, incoming messages, failures, completions. The
    /// driver keeps the rest (held notifications, credit, drop reports, closing
    /// endpoints), which its timers and wake-ups drive.
    pub(crate) fn step_with(&mut self, cmd: Cmd) {
        self.bind_gpu();
        self.drain_inbox();
        self.exec(cmd);
        self.progress();
        self.handle_events();
        self.check_failures();
        self.reap();
    }

    /// Whichever thread runs a round (the driver, or a caller posting inline), UCX
    /// finds the GPU's context current.
    fn bind_gpu(&self) {
        if let Some(d) = self.gpu {
            if let Err(e) = nixl::gpu::bind_thread(d) {
                tracing::warn!(error = %e, "ucx: binding the GPU context failed");
            }
        }
    }

    /// Progress UCX until it has nothing more to do (at most 64 calls).
    fn progress(&mut self) -> usize {
        let mut n = 0;
        for _ in 0..64 {
            let p = self.ucx.progress() as usize;
            n += p;
            if p == 0 {
                break;
            }
        }
        n
    }

    /// The longest the driver may sleep when idle: until a held notification's gap
    /// times out (see [`crate::reorder`]), else long.
    pub(crate) fn idle_wait(&self) -> Duration {
        let wait = self
            .reorder
            .deadline()
            .map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now()) + TICK
            });
        // Held notifications move as the application reads, which wakes the driver
        // (`on_room`); look again now and then all the same.
        let wait = if self.backlogs.len() > 0 {
            wait.min(BACKLOG_TICK)
        } else {
            wait
        };
        // Notifications waiting for credit: ask again (or give up on a grant) then.
        match self.credit_deadline() {
            Some(d) => wait.min(d.saturating_duration_since(Instant::now()) + TICK),
            None => wait,
        }
    }

    /// Run every queued command; returns how many.
    pub(crate) fn drain_inbox(&mut self) -> usize {
        self.now = Instant::now();
        let mut n = 0;
        while let Ok(cmd) = self.rx.try_recv() {
            self.exec(cmd);
            n += 1;
        }
        n
    }

    /// Operations in flight (the driver keeps progressing while this holds).
    pub(crate) fn busy(&self) -> bool {
        self.ucx.busy()
    }

    fn handle_events(&mut self) {
        let events = std::mem::take(&mut *self.events.lock().unwrap());
        for ev in events {
            let (h, data) = match ev {
                AmEvent::Ours { header, data } => (header, data),
                AmEvent::Nixl { sender, msg } => {
                    // NIXL does not order notifications; neither can we. One the
                    // queue has no room for is held (NIXL's protocol cannot be told
                    // to wait), then dropped and counted past the backlog's bound.
                    if let Some(mut to) = deliverer!(self) {
                        to.deliver(&sender, None, msg);
                    }
                    continue;
                }
            };
            let ev_data = data;
            match h.kind {
                Kind::Notif => self.deliver(h.name, h.stream, h.seq, ev_data),
                Kind::Hello => {
                    tracing::debug!(peer = %h.name, "ucx: peer connected");
                    let known = self.peers.get(h.name.as_str()).map(|p| &p.address[..]);
                    let remembered = (
                        self.inbound.len(),
                        MAX_INBOUND,
                        self.inbound.contains_key(&h.name),
                    );
                    match protocol::on_hello(known, &ev_data, remembered) {
                        OnHello::Heard => {
                            if let Some(p) = self.peers.get_mut(h.name.as_str()) {
                                p.heard_hello = true;
                            }
                        }
                        OnHello::Remember => {
                            self.inbound.insert(h.name, ev_data.to_vec());
                        }
                        OnHello::Ignore => {}
                    }
                }
                // Answered by the message handler.
                Kind::Ping => {}
                Kind::Dropped => {
                    // Only for our own connection to the reporter (its stream echoes
                    // our endpoint's): nobody else can make us fail our operations.
                    let p = self
                        .peers
                        .get_mut(h.name.as_str())
                        .filter(|p| protocol::ours(p.epoch, p.nixl, h.stream));
                    if let Some(p) = p {
                        tracing::warn!(peer = %h.name, dropped = h.seq, "ucx: the peer dropped notifications this agent sent it (its notification queue was full); the next operation to it fails");
                        p.dropped = p.dropped.saturating_add(h.seq);
                    }
                }
                Kind::Credit => {
                    // The answer to our ask, on our connection: found by its stream
                    // (our endpoint's epoch), as a PONG.
                    let found = self
                        .peers
                        .iter_mut()
                        .find(|(_, p)| protocol::ours(p.epoch, p.nixl, h.stream));
                    let Some((name, p)) = found else { continue };
                    let (messages, kib) = (h.seq as u32, (h.seq >> 32) as u32);
                    let held = match p.credit {
                        Credit::Granted { messages, kib } => Some(Grant { messages, kib }),
                        _ => None,
                    };
                    let Grant { messages, kib } = protocol::merge_grant(held, messages, kib);
                    p.credit = Credit::Granted { messages, kib };
                    p.asked = None;
                    p.ask_every = ASK_MIN;
                    let name = name.clone();
                    self.send_held(&name);
                }
                // Answered by the message handler.
                Kind::CreditAsk => {}
                Kind::Pong => {
                    let p = self.peers.values_mut().find(|p| p.epoch == h.stream);
                    if let Some(p) = p {
                        if p.probe
                            .is_some_and(|pr| protocol::answers_probe(pr.first, pr.seq, h.seq))
                        {
                            p.probe = None;
                            p.last_progress = self.now;
                        }
                    }
                }
                Kind::Bye => {
                    tracing::debug!(peer = %h.name, "ucx: peer said goodbye");
                    let loaded = self.peers.get(h.name.as_str()).map(|p| protocol::Loaded {
                        address: &p.address,
                        failed: p.failed.is_some(),
                        nixl: p.nixl,
                    });
                    let heard = self.inbound.get(&h.name).map(|a| &a[..]);
                    let bye = protocol::on_bye(&ev_data, loaded, heard);
                    if bye.end_streams {
                        // Only a goodbye from the address we know the sender by ends
                        // its streams early; others' streams age out (bounded). What
                        // it sent before is delivered (or held) first.
                        if let Some(mut to) = deliverer!(self) {
                            self.reorder
                                .forget(&h.name, &mut |n, st, d| to.deliver(n, Some(st), d));
                        }
                        self.inbound.remove(&h.name);
                        // It sends no more: nothing more to answer credit for.
                        self.grants.lock().unwrap().forget(&h.name);
                    }
                    if bye.fail_peer {
                        if let Some(p) = self.peers.get_mut(h.name.as_str()) {
                            p.fail(&mut self.ucx, "the peer shut down".into());
                        }
                    }
                }
            }
        }
    }

    fn deliver(&mut self, name: String, stream: u64, seq: u64, data: Bytes) {
        let Some(mut to) = deliverer!(self) else {
            return;
        };
        self.reorder
            .accept(&name, stream, seq, data, self.now, &mut |n, st, d| {
                to.deliver(n, Some(st), d)
            });
    }

    /// Move held notifications into the agent's queue as it has room, oldest first
    /// (what they free of their senders' credit is answered at the next ask).
    fn drain_backlogs(&mut self) {
        if self.backlogs.by_name.is_empty() {
            return;
        }
        let Some(sink) = &self.sink else { return };
        let backlogs = &mut self.backlogs;
        let mut grants = self.grants.lock().unwrap();
        let (mut moved, mut moved_bytes) = (0, 0);
        backlogs.by_name.retain(|name, b| {
            while let Some((stream, data)) = b.items.pop_front() {
                let n = data.len();
                match sink.try_deliver(name, data) {
                    Ok(()) => {
                        b.bytes -= n;
                        moved += 1;
                        moved_bytes += n;
                        if let Some(st) = stream {
                            grants.taken(name, st, n);
                        }
                    }
                    Err(data) => {
                        b.items.push_front((stream, data));
                        break;
                    }
                }
            }
            !b.items.is_empty()
        });
        backlogs.messages -= moved;
        backlogs.bytes -= moved_bytes;
        if backlogs.messages == 0 {
            backlogs.holding.store(false, Ordering::Release);
        }
    }

    /// Tell each known sender whose notifications this round dropped how many, on
    /// our connection to it ([`Kind::Dropped`]): its next operation to us fails.
    fn report_drops(&mut self) {
        for (name, stream, n) in std::mem::take(&mut self.drops.0) {
            let Some(p) = self.peers.get(name.as_str()) else {
                continue;
            };
            let (false, None, Ok(ep)) = (p.nixl, &p.failed, p.ep.clone()) else {
                continue;
            };
            let h = self.me.header(&name, Kind::Dropped, stream, n, &[]);
            let flight = self
                .ucx
                .am_send(ep, wire::AM_ID, h, Bytes::new(), false, Work::Internal);
            self.pings.push(flight);
        }
    }

    /// Probe `peer` now (as a stalled transfer would), on its data endpoint.
    #[cfg(test)]
    pub(crate) fn probe_now(&mut self, peer: &str) {
        self.send_probe(peer, Liveness::within(Duration::from_secs(60)), false);
    }

    /// How many of our notifications `peer` reported dropped that no operation has
    /// failed with yet.
    #[cfg(test)]
    pub(crate) fn dropped_reported(&self, peer: &str) -> u64 {
        self.peers.get(peer).map_or(0, |p| p.dropped)
    }

    /// Whether a probe of `peer` waits for its answer.
    #[cfg(test)]
    pub(crate) fn probing(&self, peer: &str) -> bool {
        self.peers.get(peer).is_some_and(|p| p.probe.is_some())
    }

    /// Send a PING on `peer`'s connection: on its data endpoint, or (`second`) on
    /// its probe endpoint (see [`Liveness`]).
    fn send_probe(&mut self, peer: &str, liveness: Liveness, second: bool) {
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        let Ok(data_ep) = p.ep else { return };
        let ep = match (second, p.probe_ep) {
            (false, _) => data_ep,
            (true, Some(ep)) => ep,
            (true, None) => match Padded::address(&p.address)
                .map_err(|e| e.to_string())
                .and_then(|a| {
                    self.ucx
                        .ep_create(&a, p.peer_failure)
                        .map_err(|e| e.to_string())
                }) {
                Ok(ep) => {
                    p.probe_ep = Some(ep);
                    ep
                }
                Err(e) => {
                    let why = format!("connection failed: the peer is unreachable: {e}");
                    tracing::debug!(peer, why, "ucx: peer failed");
                    p.fail(&mut self.ucx, why);
                    return;
                }
            },
        };
        let seq = p.next_probe;
        p.next_probe += 1;
        p.probe = Some(Probe {
            first: p.probe.map_or(seq, |pr| pr.first),
            seq,
            deadline: Instant::now() + liveness.answer,
            second,
        });
        let h = self.me.header(peer, Kind::Ping, p.epoch, seq, &[]);
        let flight = self
            .ucx
            .am_send(ep, wire::AM_ID, h, Bytes::new(), true, Work::Internal);
        self.pings.push(flight);
    }

    /// Fail connections whose peer is gone: UCX reported an error on an endpoint, or
    /// the peer did not answer a liveness probe in time (see the module docs). Probe
    /// connections whose work has stalled.
    fn check_failures(&mut self) {
        let now = self.now;
        let mut probe = Vec::new();
        for (name, p) in self.peers.iter_mut() {
            if p.failed.is_some() {
                continue;
            }
            let Ok(ep) = p.ep else { continue };
            let err = self
                .ucx
                .ep_error(ep)
                .or_else(|| p.probe_ep.and_then(|e| self.ucx.ep_error(e)));
            let why = if let Some(e) = err {
                format!("connection failed: {e}")
            } else if let Some(pr) = p.probe.filter(|pr| now >= pr.deadline) {
                let Some(l) = self.liveness else { continue };
                if !pr.second {
                    // Ask again, on a separate endpoint.
                    probe.push((name.clone(), l, true));
                    continue;
                }
                format!(
                    "no answer to liveness probes for {:?} while transfers waited on the peer: it is gone",
                    l.answer * 2
                )
            } else {
                if let Some(l) = self.liveness.filter(|_| !p.nixl) {
                    if p.probe.is_none()
                        && (!p.queue.is_empty() || !p.held.is_empty())
                        && now.duration_since(p.last_progress) >= l.after
                    {
                        probe.push((name.clone(), l, false));
                    }
                }
                continue;
            };
            tracing::debug!(peer = %name, why, "ucx: peer failed");
            p.fail(&mut self.ucx, why);
        }
        for (name, l, second) in probe {
            self.send_probe(&name, l, second);
        }
    }

    fn finish(
        &mut self,
        peer: &str,
        f: InFlight,
        work: Work,
        res: std::result::Result<(), UcxError>,
    ) -> Option<InFlight> {
        let failed = self.peers.get(peer).and_then(|p| p.failed.clone());
        let err = |e: UcxError| match &failed {
            Some(why) => disconnected(peer, why).with_source(e),
            None if e.is_disconnect() => disconnected(peer, "connection lost").with_source(e),
            None => Error::new(ErrorKind::Backend, "ucx transfer", format!("peer {peer:?}"))
                .with_source(e),
        };
        match work {
            Work::Done(done) => match (res, f.notif) {
                (Ok(()), Some(msg)) => {
                    // The data is in place at the target: now the notification.
                    self.send_notif(peer, msg, done).map(|flight| InFlight {
                        flight,
                        notif: None,
                    })
                }
                (Ok(()), None) => {
                    done.complete(Ok(()));
                    None
                }
                (Err(e), _) => {
                    done.complete(Err(err(e)));
                    None
                }
            },
            Work::Connect(tx) => {
                let _ = tx.send(res.map_err(err));
                None
            }
            Work::Internal => {
                if let Err(e) = res {
                    tracing::debug!(peer, error = %e, "ucx: control message failed");
                }
                None
            }
        }
    }

    fn reap(&mut self) {
        let mut names = std::mem::take(&mut self.scratch);
        names.extend(
            self.peers
                .iter()
                .filter(|(_, p)| !p.queue.is_empty())
                .map(|(n, _)| n.clone()),
        );
        for name in names.drain(..) {
            while let Some(p) = self.peers.get_mut(&name) {
                let Some(head) = p.queue.front() else { break };
                let Some((work, res)) = self.ucx.poll(head.flight) else {
                    // Part of a long transfer arrived: the peer is alive.
                    if self.ucx.advanced(head.flight) {
                        p.last_progress = self.now;
                        p.probe = None;
                    }
                    break;
                };
                // Progress: the peer (or the transport) is moving.
                p.last_progress = self.now;
                p.probe = None;
                let head = p.queue.pop_front().expect("head exists");
                if let Some(next) = self.finish(&name, head, work, res) {
                    if let Some(p) = self.peers.get_mut(&name) {
                        p.queue.push_front(next);
                    }
                }
            }
        }
        self.scratch = names;
        let ucx = &mut self.ucx;
        self.pings.retain(|f| ucx.poll(*f).is_none());
        let mut i = 0;
        while i < self.orphans.len() {
            if let Some((work, _)) = self.ucx.poll(self.orphans[i].0.flight) {
                let (_, why) = self.orphans.swap_remove(i);
                match work {
                    Work::Done(done) => done.complete(Err(Error::new(
                        ErrorKind::RemoteDisconnected,
                        "ucx transfer",
                        why,
                    ))),
                    Work::Connect(tx) => {
                        let _ = tx.send(Err(Error::new(
                            ErrorKind::RemoteDisconnected,
                            "ucx connect",
                            why,
                        )));
                    }
                    Work::Internal => {}
                }
            } else {
                i += 1;
            }
        }
    }

    /// Log (once, at teardown) what the receive path refused or gave up.
    fn log_refused(&self) {
        let r = &self.refused;
        let (oversized, malformed, rendezvous, unauthenticated) = (
            r.oversized.load(Ordering::Relaxed),
            r.malformed.load(Ordering::Relaxed),
            r.rendezvous.load(Ordering::Relaxed),
            r.unauthenticated.load(Ordering::Relaxed),
        );
        let s = self.reorder.stats();
        let refused = oversized + malformed + rendezvous + unauthenticated;
        if refused + s.gaps_skipped + s.evicted + s.protocol_errors > 0 {
            tracing::info!(
                oversized,
                malformed,
                rendezvous,
                unauthenticated,
                gaps_skipped = s.gaps_skipped,
                streams_evicted = s.evicted,
                protocol_errors = s.protocol_errors,
                streams = self.reorder.streams(),
                held_bytes = self.reorder.held_bytes(),
                "ucx: the receive path refused or reordered notifications out of bounds"
            );
        }
    }

    /// Shutdown, part one: refuse queued work and say goodbye to every known peer (loaded
    /// from metadata) that we talked to or that said HELLO to us from its known
    /// address, on its existing endpoint. No endpoint is made here: an address that
    /// came only in someone's HELLO is never dialled. Returns the flights to wait for
    /// (bounded by the caller).
    fn say_goodbye(&mut self) -> Vec<FlightId> {
        self.closing.store(true, Ordering::Release);
        while let Ok(cmd) = self.rx.try_recv() {
            fail_cmd(cmd, ErrorKind::ShutDown, "the ucx backend is shutting down");
        }
        let targets: Vec<(Arc<str>, EpId)> = self
            .peers
            .iter()
            .filter(|(_, p)| (p.hello_sent || p.heard_hello) && !p.nixl && p.failed.is_none())
            .filter_map(|(n, p)| Some((n.clone(), p.ep.clone().ok()?)))
            .collect();
        let mut flights = Vec::new();
        let me = Bytes::copy_from_slice(self.ucx.address());
        for (peer, ep) in targets {
            let h = self.me.header(&peer, Kind::Bye, 0, 0, &me);
            flights.push(
                self.ucx
                    .am_send(ep, wire::AM_ID, h, me.clone(), false, Work::Internal),
            );
            flights.push(self.ucx.flush(ep, Work::Internal));
        }
        flights
    }
}

/// Tear down: goodbyes (bounded), then fail what is left and close every connection;
/// UCX itself (memory mappings, worker, context) is parked for deregistration and
/// [`nixl::Backend::destroy`]. Runs on the driver.
pub(crate) fn teardown(shared: &Shared) {
    // Held throughout, so deregister and destroy wait for the parking to finish.
    let mut parked = shared.parked.lock().unwrap();
    let core = shared.core.lock().unwrap().take();
    if let Some(mut core) = core {
        core.log_refused();
        let flights = core.say_goodbye();
        let deadline = Instant::now() + shared.bye_bound;
        let mut left = flights;
        while !left.is_empty() && Instant::now() < deadline {
            core.ucx.progress();
            left.retain(|f| core.ucx.poll(*f).is_none());
            if !left.is_empty() {
                std::thread::yield_now();
            }
        }
        // Complete what finished, then close the connections; what is still queued
        // fails when the rest of the core goes.
        core.handle_events();
        core.reap();
        let mut peers: Vec<Arc<str>> = core.peers.keys().cloned().collect();
        peers.extend(core.next.keys().cloned());
        for p in peers {
            core.remove_peer(&p, "the ucx backend is shutting down");
        }
        let Core { mut ucx, .. } = core;
        drop(ucx.close_all());
        if parked.destroyed {
            drop(ucx);
        } else {
            parked.ucx = Some(ucx);
        }
    }
    drop(parked);
    shared.mark_stopped();
}

/// When the driver may sleep, and for how long.
///
/// Not everything UCX still has to do raises an event: a sender whose shared-memory
/// queue was full retries only when progressed. So after activity the driver first
/// spins (`spin`), then wakes on a short tick for a while (`LINGER`), and only then
/// sleeps on the event fd alone.
#[derive(Debug)]
struct Pace {
    spin: Duration,
    last_active: Instant,
}

/// How long a post waits for the driver's round to end before leaving its
/// transfer to the driver ([`Shared::run_inline`]).
const INLINE_WAIT: Duration = Duration::from_micros(20);

/// How long after the last activity the driver keeps a short wake-up tick.
const LINGER: Duration = Duration::from_millis(500);
/// The short tick.
const TICK: Duration = Duration::from_millis(1);

impl Pace {
    fn new(spin: Duration) -> Self {
        Self {
            spin,
            last_active: Instant::now(),
        }
    }

    /// Record a round; returns whether to go round again at once (no sleeping).
    fn hot(&mut self, activity: usize, busy: bool) -> bool {
        let now = Instant::now();
        if activity > 0 {
            self.last_active = now;
            return true;
        }
        busy && now.duration_since(self.last_active) < self.spin
    }

    /// How long to sleep on the event fd at most.
    fn tick(&self, busy: bool, idle: Duration) -> Duration {
        if busy || self.last_active.elapsed() < LINGER {
            TICK
        } else {
            idle
        }
    }
}

/// The tokio progress task: sleeps on the worker's event fd when idle.
pub(crate) async fn run_task(shared: Arc<Shared>, cancel: CancellationToken) {
    let afd = match shared.core.lock().unwrap().as_ref() {
        Some(c) => crate::ffi::watch_event_fd(&c.ucx),
        None => return shared.mark_stopped(),
    };
    let afd = match afd {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "ucx: cannot watch the worker's event fd; stopping");
            teardown(&shared);
            return;
        }
    };
    let Wake::Task(notify) = &shared.wake else {
        unreachable!("task mode uses a Notify")
    };
    let mut pace = Pace::new(shared.spin);
    loop {
        if cancel.is_cancelled() {
            break;
        }
        let (activity, busy, idle) = {
            let mut g = shared.core.lock().unwrap();
            let Some(core) = g.as_mut() else { break };
            let a = core.step();
            (a, core.busy(), core.idle_wait())
        };
        if pace.hot(activity, busy) {
            // Let other tasks (the ones awaiting our completions) run.
            tokio::task::yield_now().await;
            continue;
        }
        let armed = {
            let mut g = shared.core.lock().unwrap();
            let Some(core) = g.as_mut() else { break };
            match core.ucx.arm() {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "ucx: arming the worker failed; polling");
                    false
                }
            }
        };
        if !armed {
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            r = afd.readable() => {
                if let Ok(mut g) = r {
                    g.clear_ready();
                }
            }
            _ = notify.notified() => {}
            _ = tokio::time::sleep(pace.tick(busy, idle)) => {}
        }
    }
    drop(afd);
    teardown(&shared);
}

/// The dedicated progress thread: sleeps in `poll` on the event fd and a wake fd.
pub(crate) fn run_thread(shared: Arc<Shared>, stop: CancellationToken) {
    let Wake::Thread { fd, sleeping } = &shared.wake else {
        unreachable!("thread mode uses a wake fd")
    };
    let efd = match shared.core.lock().unwrap().as_ref() {
        Some(c) => c.ucx.event_fd(),
        None => return shared.mark_stopped(),
    };
    let mut pace = Pace::new(shared.spin);
    while !stop.is_cancelled() {
        let (activity, busy) = {
            let mut g = shared.core.lock().unwrap();
            let Some(core) = g.as_mut() else { break };
            let a = core.step();
            (a, core.busy())
        };
        if pace.hot(activity, busy) {
            std::hint::spin_loop();
            continue;
        }
        let mut g = shared.core.lock().unwrap();
        let Some(core) = g.as_mut() else { break };
        if !core.ucx.arm().unwrap_or(false) {
            continue;
        }
        sleeping.store(true, Ordering::SeqCst);
        // Anything posted before `sleeping` was visible must be run now, not slept on.
        if core.drain_inbox() > 0 {
            sleeping.store(false, Ordering::SeqCst);
            continue;
        }
        // A post may have issued its transfer inline between this thread's round and
        // now (it found `sleeping` false, so it woke nobody): the wait is for what
        // is in flight now, not at the round.
        let (busy, idle) = (busy || core.busy(), core.idle_wait());
        drop(g);
        // The stop flag comes with a wake, so the idle wait can be long.
        fd.wait_with(efd, pace.tick(busy, idle));
        sleeping.store(false, Ordering::SeqCst);
        fd.drain();
    }
    teardown(&shared);
}

/// A random `u64` from the OS (connection epochs).
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("the OS random source works");
    u64::from_le_bytes(b)
}
