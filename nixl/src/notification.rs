//! Notifications: a stream of `(peer, bytes)` per agent, bounded per peer, per agent
//! and for senders the agent does not know.
//!
//! Every notification received and not yet read counts against three bounds
//! ([`NotificationLimits`]): its sender's own (per name), the agent's total, and,
//! when the sender is not a known peer (a name whose metadata the agent has not
//! loaded), the pool that all unknown names share, which also caps how many distinct
//! unknown names may have something queued. Sender names are the sender's to choose
//! (without a shared secret nobody proves one; with one, any holder can prove any
//! name), so a flood of fresh names fills the unknown pool and nothing else: a known
//! peer within its own bound is admitted however many unknown names flood, as long as
//! known peers together stay within the total less the unknown pool.
//!
//! A backend that delivers from a task waits for room
//! ([`NotificationSink::deliver_async`](crate::NotificationSink::deliver_async)),
//! which stops it reading that sender's connection: back-pressure on the sender
//! alone. One that delivers from a thread that cannot wait
//! ([`NotificationSink::deliver`](crate::NotificationSink::deliver)) drops the
//! notification instead, counts it ([`NotificationStats::dropped`], the
//! `nixl_notifications_dropped_total` metric), logs a warning naming the sender (at
//! most one a second per agent), and tells the sender where its protocol can (see
//! each backend).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_core::Stream;
use tokio::sync::{mpsc, Notify};

use crate::error::{err, ErrorKind, Result};

/// A notification received from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Name of the agent that sent it.
    pub peer: String,
    /// Its bytes.
    pub msg: Bytes,
}

/// A notification in the agent's queue, with the pool it is counted in.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) note: Notification,
    /// Counted as from a known peer (else in the unknown names' pool).
    pub(crate) known: bool,
}

pub(crate) type Slot = Arc<Mutex<Option<mpsc::UnboundedReceiver<Queued>>>>;

/// Whether a sender name is a known peer (one whose metadata the agent loaded).
pub(crate) type KnownPeer = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// Bounds on the notifications an agent holds received and not yet read by the
/// application; set with
/// [`AgentBuilder::notification_limits`](crate::AgentBuilder::notification_limits).
///
/// Three bounds apply to each notification:
/// - **Per sender name** (`messages`, `bytes`): what one name may have queued.
/// - **Per agent** (`total_messages`, `total_bytes`): everything queued, whoever
///   sent it.
/// - **Unknown names** (`unknown_peers`, `unknown_messages`, `unknown_bytes`): a
///   name that is not a known peer (the agent has not loaded its metadata:
///   [`Agent::load_metadata`](crate::Agent::load_metadata) and the exchanges) shares
///   this pool with every other unknown name, and at most `unknown_peers` distinct
///   unknown names may have something queued at once.
///
/// Sender names are the sender's to choose (nobody proves one without a shared
/// secret, and any holder of the secret can prove any name), so a flood under fresh
/// names fills the unknown pool and stops there. The unknown pool is part of the
/// total, and is smaller than it, so known peers together always have the total less
/// the unknown pool: a known peer within its own bound is admitted however many
/// unknown names flood, unless known peers themselves fill that. A peer the agent
/// has not loaded (a NIXL-style target that never loads its initiators' metadata) is
/// served too, from the unknown pool; load its metadata to give it a bound of its
/// own that no unknown name can take.
///
/// A notification that would go over a bound waits (backends that deliver from a
/// task stop reading that sender's connection until the application reads) or is
/// dropped, counted and, where the backend's protocol can, reported to its sender
/// (backends that deliver from a thread that cannot wait); see the
/// [`NotificationSink`](crate::NotificationSink) methods. A notification longer than
/// the room a byte bound has left is queued once nothing else is queued under that
/// bound (for the total: nothing from known peers, for a known sender; nothing at all,
/// for an unknown one), so any notification the backend carries gets through, and
/// each byte bound is passed by at most one notification. The agent's own
/// notifications (from same-agent transfers, which the application posts itself) are
/// counted as a known peer's but never held back or dropped.
///
/// Build with struct update syntax, so fields added later keep their defaults:
/// `NotificationLimits { messages: 64, ..NotificationLimits::default() }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotificationLimits {
    /// Notifications queued per sender name; default 4096.
    pub messages: usize,
    /// Bytes of notifications queued per sender name; default 64 MiB.
    pub bytes: usize,
    /// Notifications queued in all; default 65,536. Above `unknown_messages`.
    pub total_messages: usize,
    /// Bytes of notifications queued in all; default 256 MiB. Above `unknown_bytes`.
    pub total_bytes: usize,
    /// Distinct unknown sender names with something queued; default 256.
    pub unknown_peers: usize,
    /// Notifications queued from unknown names together; default 4096.
    pub unknown_messages: usize,
    /// Bytes of notifications queued from unknown names together; default 16 MiB.
    pub unknown_bytes: usize,
}

impl Default for NotificationLimits {
    fn default() -> Self {
        Self {
            messages: 4096,
            bytes: 64 << 20,
            total_messages: 65_536,
            total_bytes: 256 << 20,
            unknown_peers: 256,
            unknown_messages: 4096,
            unknown_bytes: 16 << 20,
        }
    }
}

impl NotificationLimits {
    /// Why these limits cannot work, if they cannot: a bound of zero, or an unknown
    /// pool that leaves known peers no room.
    pub(crate) fn invalid(&self) -> Option<String> {
        let counts = [
            self.messages,
            self.bytes,
            self.total_messages,
            self.total_bytes,
            self.unknown_peers,
            self.unknown_messages,
            self.unknown_bytes,
        ];
        if counts.contains(&0) {
            return Some(format!(
                "notification limits must all be at least 1, not {self:?}"
            ));
        }
        if self.unknown_messages >= self.total_messages || self.unknown_bytes >= self.total_bytes {
            return Some(format!(
                "the unknown names' notification pool must be smaller than the total, so known peers keep room: {self:?}"
            ));
        }
        None
    }
}

/// Notifications received and not yet read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueuedNotifications {
    /// How many.
    pub messages: usize,
    /// Their bytes.
    pub bytes: usize,
}

impl QueuedNotifications {
    fn add(&mut self, len: usize) {
        self.messages += 1;
        self.bytes += len;
    }

    fn sub(&mut self, len: usize) {
        self.messages = self.messages.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(len);
    }

    fn max(self, o: Self) -> Self {
        Self {
            messages: self.messages.max(o.messages),
            bytes: self.bytes.max(o.bytes),
        }
    }
}

/// The most the agent's notification queue ever held at once since it started
/// (each figure its own maximum).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NotificationPeaks {
    /// Everything queued.
    pub queued: QueuedNotifications,
    /// Queued from unknown names.
    pub unknown: QueuedNotifications,
    /// Distinct unknown names with something queued.
    pub unknown_peers: usize,
}

/// The agent's notification queue now; see
/// [`Agent::notification_stats`](crate::Agent::notification_stats).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NotificationStats {
    /// What each sender name has queued (names with nothing queued are absent): the
    /// known peers, and at most [`NotificationLimits::unknown_peers`] unknown names.
    pub peers: BTreeMap<String, QueuedNotifications>,
    /// What unknown names have queued together.
    pub unknown: QueuedNotifications,
    /// How many distinct unknown names have something queued.
    pub unknown_peers: usize,
    /// Notifications dropped since the agent started because a bound was full (only
    /// backends that deliver without waiting drop).
    pub dropped: u64,
    /// The most ever queued at once.
    pub peaks: NotificationPeaks,
}

impl NotificationStats {
    /// What all peers have queued together.
    pub fn queued(&self) -> QueuedNotifications {
        self.peers
            .values()
            .fold(QueuedNotifications::default(), |a, q| QueuedNotifications {
                messages: a.messages + q.messages,
                bytes: a.bytes + q.bytes,
            })
    }
}

/// Warn about dropped notifications at most this often (per agent).
const WARN_EVERY: Duration = Duration::from_secs(1);

/// Which bound refused a notification: what its delivery waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Short {
    /// The sender name's own bound.
    Peer,
    /// The total, for a known peer.
    Known,
    /// The unknown names' pool (or the total, for an unknown name).
    Unknown,
}

impl Short {
    fn what(self) -> &'static str {
        match self {
            Self::Peer => "its sender's queue is full",
            Self::Known => "the agent's notification queue is full",
            Self::Unknown => "the queue shared by senders this agent does not know is full",
        }
    }
}

/// One sender name's part of the queue.
#[derive(Debug, Default)]
struct PeerQueue {
    queued: QueuedNotifications,
    /// How many of them were counted in the unknown pool.
    unknown: usize,
    /// Woken when the application reads one of this name's notifications. Waiters
    /// hold a clone, so an entry with more than one reference has waiters.
    space: Arc<Notify>,
}

impl PeerQueue {
    fn idle(&self) -> bool {
        self.queued.messages == 0 && Arc::strong_count(&self.space) == 1
    }
}

/// The counting behind an agent's notification queue: which notification fits,
/// what is queued per name, per pool and in all. Plain data (no I/O, no clock).
#[derive(Debug)]
struct Accounting {
    limits: NotificationLimits,
    /// Names with something queued or someone waiting for room in their own queue.
    peers: HashMap<String, PeerQueue>,
    all: QueuedNotifications,
    /// Counted as from known peers (the agent's own included).
    known: QueuedNotifications,
    unknown: QueuedNotifications,
    /// Names with something counted in the unknown pool.
    unknown_peers: usize,
    peaks: NotificationPeaks,
    dropped: u64,
}

impl Accounting {
    fn new(limits: NotificationLimits) -> Self {
        Self {
            limits,
            peers: HashMap::new(),
            all: QueuedNotifications::default(),
            known: QueuedNotifications::default(),
            unknown: QueuedNotifications::default(),
            unknown_peers: 0,
            peaks: NotificationPeaks::default(),
            dropped: 0,
        }
    }

    /// Count a notification of `len` bytes from `peer` (`known`: a known peer) if
    /// every bound has room; else say which has none.
    fn admit(&mut self, peer: &str, len: usize, known: bool) -> std::result::Result<(), Short> {
        let l = &self.limits;
        let (own, holds_a_name) = self
            .peers
            .get(peer)
            .map_or((QueuedNotifications::default(), false), |q| {
                (q.queued, q.unknown > 0)
            });
        // A byte bound with nothing queued under it admits any length.
        let fits = |q: QueuedNotifications, bound: usize, empty: bool| {
            empty || q.bytes.saturating_add(len) <= bound
        };
        if own.messages >= l.messages || !fits(own, l.bytes, own.messages == 0) {
            return Err(Short::Peer);
        }
        let total = self.all.messages < l.total_messages;
        if known {
            if !total || !fits(self.all, l.total_bytes, self.known.messages == 0) {
                return Err(Short::Known);
            }
        } else {
            let u = self.unknown;
            let room = (holds_a_name || self.unknown_peers < l.unknown_peers)
                && u.messages < l.unknown_messages
                && fits(u, l.unknown_bytes, u.messages == 0)
                && total
                && fits(self.all, l.total_bytes, self.all.messages == 0);
            if !room {
                return Err(Short::Unknown);
            }
        }
        self.add(peer, len, known);
        Ok(())
    }

    /// Count a notification whatever the bounds (the agent's own).
    fn add(&mut self, peer: &str, len: usize, known: bool) {
        let q = match self.peers.get_mut(peer) {
            Some(q) => q,
            None => self.peers.entry(peer.to_owned()).or_default(),
        };
        q.queued.add(len);
        if known {
            self.known.add(len);
        } else {
            if q.unknown == 0 {
                self.unknown_peers += 1;
            }
            q.unknown += 1;
            self.unknown.add(len);
        }
        self.all.add(len);
        let p = &mut self.peaks;
        p.queued = p.queued.max(self.all);
        p.unknown = p.unknown.max(self.unknown);
        p.unknown_peers = p.unknown_peers.max(self.unknown_peers);
    }

    /// One of `peer`'s notifications left the queue; returns its name's waiters'
    /// wake-up, when someone waits for room there.
    fn release(&mut self, peer: &str, len: usize, known: bool) -> Option<Arc<Notify>> {
        self.all.sub(len);
        if known {
            self.known.sub(len);
        } else {
            self.unknown.sub(len);
        }
        let q = self.peers.get_mut(peer)?;
        q.queued.sub(len);
        if !known && q.unknown > 0 {
            q.unknown -= 1;
            if q.unknown == 0 {
                self.unknown_peers -= 1;
            }
        }
        if q.idle() {
            self.peers.remove(peer);
            None
        } else {
            Some(q.space.clone())
        }
    }

    fn stats(&self) -> NotificationStats {
        NotificationStats {
            peers: self
                .peers
                .iter()
                .filter(|(_, q)| q.queued.messages > 0)
                .map(|(p, q)| (p.clone(), q.queued))
                .collect(),
            unknown: self.unknown,
            unknown_peers: self.unknown_peers,
            dropped: self.dropped,
            peaks: self.peaks,
        }
    }
}

/// Drops not yet reported in a warning, and when the last warning went out.
#[derive(Debug, Default)]
struct DropLog {
    unwarned: u64,
    warned_at: Option<Instant>,
}

/// An agent's notification queue's admission, shared by its sinks and its
/// [`Notifications`] handle. The notifications themselves travel through one
/// channel, in arrival order; this only admits them, counts them and wakes waiters.
pub(crate) struct PeerQueues {
    agent: String,
    limits: NotificationLimits,
    known: KnownPeer,
    state: Mutex<Accounting>,
    log: Mutex<DropLog>,
    /// Woken, one waiter at a time, as notifications leave the queue: deliveries
    /// waiting for room in the total (known peers) or in the unknown pool.
    pub(crate) known_room: Notify,
    pub(crate) unknown_room: Notify,
    /// Called each time the application reads a notification (room may be free):
    /// set by a backend that holds notifications and cannot wait on `Notify`s.
    pub(crate) on_room: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl fmt::Debug for PeerQueues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerQueues")
            .field("agent", &self.agent)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl PeerQueues {
    /// `known` says whether a sender name is a known peer (the agent's peer table).
    pub(crate) fn new(agent: &str, limits: NotificationLimits, known: KnownPeer) -> Self {
        Self {
            agent: agent.to_owned(),
            limits,
            known,
            state: Mutex::new(Accounting::new(limits)),
            log: Mutex::new(DropLog::default()),
            known_room: Notify::new(),
            unknown_room: Notify::new(),
            on_room: Mutex::new(Vec::new()),
        }
    }

    /// Count a notification of `len` bytes from `peer` if every bound has room;
    /// returns whether it was counted as a known peer's, or which bound is full.
    pub(crate) fn admit(&self, peer: &str, len: usize) -> std::result::Result<bool, Short> {
        // Asked before locking: the peer table has a lock of its own.
        let known = (self.known)(peer);
        self.state.lock().unwrap().admit(peer, len, known)?;
        Ok(known)
    }

    /// Count the agent's own notification, room or not.
    pub(crate) fn admit_own(&self, peer: &str, len: usize) {
        self.state.lock().unwrap().add(peer, len, true);
    }

    /// The application read (or the agent discarded) one of `peer`'s notifications.
    pub(crate) fn release(&self, peer: &str, len: usize, known: bool) {
        let space = self.state.lock().unwrap().release(peer, len, known);
        if let Some(s) = space {
            s.notify_waiters();
        }
        // Room in the total and maybe the unknown pool: one waiter of each looks (a
        // waiter that gets in passes it on, see `pass_on`).
        self.known_room.notify_one();
        self.unknown_room.notify_one();
        for f in self.on_room.lock().unwrap().iter() {
            f();
        }
    }

    /// A delivery that waited for room in the pool `short` names got in: the next
    /// waiter looks too (room may be left).
    pub(crate) fn pass_on(&self, short: Short) {
        match short {
            Short::Peer => {}
            Short::Known => self.known_room.notify_one(),
            Short::Unknown => self.unknown_room.notify_one(),
        }
    }

    /// Register interest in room in `peer`'s own queue; `None` when it has nothing
    /// queued any more (try again). Undone by [`Self::unwait`].
    pub(crate) fn wait(&self, peer: &str) -> Option<Arc<Notify>> {
        let st = self.state.lock().unwrap();
        st.peers.get(peer).map(|q| q.space.clone())
    }

    /// Stop waiting for room in `peer`'s queue.
    pub(crate) fn unwait(&self, peer: &str, space: Arc<Notify>) {
        let mut st = self.state.lock().unwrap();
        drop(space);
        if st.peers.get(peer).is_some_and(PeerQueue::idle) {
            st.peers.remove(peer);
        }
    }

    /// Count a notification from `peer` dropped because `short` had no room, and
    /// warn (rate limited).
    pub(crate) fn dropped(&self, peer: &str, len: usize, short: Short) {
        let (total, queued) = {
            let mut st = self.state.lock().unwrap();
            st.dropped += 1;
            let queued = st.peers.get(peer).map(|q| q.queued).unwrap_or_default();
            (st.dropped, queued)
        };
        let dropped = {
            let mut log = self.log.lock().unwrap();
            log.unwarned += 1;
            let now = Instant::now();
            if log
                .warned_at
                .is_some_and(|t| now.duration_since(t) < WARN_EVERY)
            {
                return;
            }
            log.warned_at = Some(now);
            std::mem::take(&mut log.unwarned)
        };
        tracing::warn!(
            agent = %self.agent,
            peer,
            len,
            dropped,
            total_dropped = total,
            queued = queued.messages,
            queued_bytes = queued.bytes,
            limits = ?self.limits,
            "dropped a notification from {peer:?}: {} because the application reads notifications too slowly ({dropped} dropped since the last warning)",
            short.what(),
        );
    }

    pub(crate) fn stats(&self) -> NotificationStats {
        self.state.lock().unwrap().stats()
    }
}

/// The agent's incoming notifications, in arrival order (per peer: the order the peer
/// posted them). Also a [`Stream`].
///
/// One handle exists at a time; dropping it hands the queue back to the agent, so
/// nothing is lost between handles.
///
/// Reading a notification makes room under the bounds it counted against
/// ([`NotificationLimits`]).
pub struct Notifications {
    rx: Option<mpsc::UnboundedReceiver<Queued>>,
    slot: Slot,
    queues: Arc<PeerQueues>,
}

impl Notifications {
    pub(crate) fn new(
        rx: mpsc::UnboundedReceiver<Queued>,
        slot: Slot,
        queues: Arc<PeerQueues>,
    ) -> Self {
        Self {
            rx: Some(rx),
            slot,
            queues,
        }
    }

    /// Count `q` out of the queue.
    fn read(&self, q: Option<Queued>) -> Option<Notification> {
        let q = q?;
        self.queues.release(&q.note.peer, q.note.msg.len(), q.known);
        Some(q.note)
    }

    /// The next notification; `None` once the agent and its backends are gone.
    ///
    /// # Cancel safety
    /// Cancel-safe: a notification is never lost by dropping this future.
    pub async fn recv(&mut self) -> Option<Notification> {
        let n = self.rx.as_mut()?.recv().await;
        self.read(n)
    }

    /// A notification if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Option<Notification> {
        let n = self.rx.as_mut()?.try_recv().ok();
        self.read(n)
    }
}

impl Stream for Notifications {
    type Item = Notification;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Notification>> {
        let polled = match self.rx.as_mut() {
            Some(rx) => rx.poll_recv(cx),
            None => Poll::Ready(None),
        };
        polled.map(|n| self.read(n))
    }
}

impl Drop for Notifications {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            *self.slot.lock().unwrap() = Some(rx);
        }
    }
}

impl fmt::Debug for Notifications {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifications").finish_non_exhaustive()
    }
}

/// A notification longer than the backend carries (`max`, its
/// [`Capabilities::max_notification`]) is refused before it is sent.
pub(crate) fn check_notification(
    msg: &[u8],
    max: usize,
    backend: &str,
    op: &'static str,
) -> Result<()> {
    if msg.len() > max {
        return err(
            ErrorKind::InvalidArgument,
            op,
            format!(
                "notification of {} bytes exceeds {backend}'s limit of {max}",
                msg.len()
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn q(messages: usize, bytes: usize) -> QueuedNotifications {
        QueuedNotifications { messages, bytes }
    }

    const SMALL: NotificationLimits = NotificationLimits {
        messages: 4,
        bytes: 100,
        total_messages: 20,
        total_bytes: 1000,
        unknown_peers: 3,
        unknown_messages: 6,
        unknown_bytes: 300,
    };

    #[test]
    fn a_name_is_bounded_by_its_own_queue_and_one_long_notification_passes_alone() {
        let mut a = Accounting::new(SMALL);
        for _ in 0..4 {
            a.admit("p", 10, true).unwrap();
        }
        assert_eq!(a.admit("p", 10, true), Err(Short::Peer));
        let mut a = Accounting::new(SMALL);
        a.admit("p", 60, true).unwrap();
        assert_eq!(a.admit("p", 41, true), Err(Short::Peer));
        a.admit("p", 40, true).unwrap();
        a.release("p", 60, true);
        a.release("p", 40, true);
        assert!(a.peers.is_empty());
        // Longer than the bound: in, as nothing else of "p" is queued; then nothing.
        a.admit("p", 500, true).unwrap();
        assert_eq!(a.admit("p", 1, true), Err(Short::Peer));
    }

    #[test]
    fn unknown_names_are_capped_and_share_one_pool() {
        let mut a = Accounting::new(SMALL);
        for n in ["u0", "u1", "u2"] {
            a.admit(n, 10, false).unwrap();
        }
        // A fourth distinct unknown name: no.
        assert_eq!(a.admit("u3", 10, false), Err(Short::Unknown));
        // A name that already holds a place: yes, up to the pool's bound.
        a.admit("u0", 10, false).unwrap();
        a.admit("u1", 10, false).unwrap();
        a.admit("u2", 10, false).unwrap();
        assert_eq!(a.admit("u0", 10, false), Err(Short::Unknown));
        assert_eq!(a.unknown, q(6, 60));
        assert_eq!(a.unknown_peers, 3);
        // u2's notifications read: its place goes to the next name.
        a.release("u2", 10, false);
        assert_eq!(
            a.admit("u3", 10, false),
            Err(Short::Unknown),
            "u2 still holds one"
        );
        a.release("u2", 10, false);
        a.admit("u3", 10, false).unwrap();
        assert_eq!(a.unknown_peers, 3);
        assert!(!a.peers.contains_key("u2"));
        // The pool's bytes.
        let mut a = Accounting::new(SMALL);
        a.admit("u0", 290, false).unwrap();
        assert_eq!(a.admit("u1", 11, false), Err(Short::Unknown));
        a.admit("u1", 10, false).unwrap();
    }

    #[test]
    fn a_known_peer_is_admitted_however_many_unknown_names_flood() {
        let mut a = Accounting::new(SMALL);
        let mut refused = 0;
        for i in 0..10_000 {
            if a.admit(&format!("evil-{i}"), 50, false).is_err() {
                refused += 1;
            }
        }
        // Three names, one notification each: the rest refused.
        assert_eq!(refused, 10_000 - 3);
        assert_eq!((a.unknown_peers, a.unknown), (3, q(3, 150)));
        // The names that hold a place fill the pool.
        for n in ["evil-0", "evil-1", "evil-2"] {
            a.admit(n, 40, false).unwrap();
        }
        assert_eq!(a.admit("evil-1", 10, false), Err(Short::Unknown));
        assert_eq!(a.unknown, q(6, 270));
        // Known peers keep the total less the unknown pool: 14 messages here.
        for i in 0..14 {
            a.admit(&format!("good-{}", i % 5), 10, true).unwrap();
        }
        assert_eq!(a.all.messages, SMALL.total_messages);
        assert_eq!(a.admit("good-0", 10, true), Err(Short::Known));
        assert_eq!(a.admit("good-9", 10, true), Err(Short::Known));
        assert_eq!(a.admit("evil-x", 10, false), Err(Short::Unknown));
        let s = a.stats();
        assert_eq!(s.peaks.unknown_peers, 3);
        assert_eq!(s.peaks.queued, q(20, 270 + 140));
        assert_eq!(s.queued(), q(20, 410));
        assert_eq!(s.peers.len(), 3 + 5);
    }

    #[test]
    fn unknown_names_may_not_use_room_known_peers_filled() {
        let mut a = Accounting::new(SMALL);
        for i in 0..20 {
            a.admit(&format!("good-{}", i % 5), 1, true).unwrap();
        }
        assert_eq!(a.admit("evil", 1, false), Err(Short::Unknown));
        a.release("good-0", 1, true);
        a.admit("evil", 1, false).unwrap();
        // Total bytes: a known peer's long notification passes once no known one is
        // queued; an unknown name's only once nothing at all is.
        let mut a = Accounting::new(SMALL);
        a.admit("good", 90, true).unwrap();
        a.admit("good2", 90, true).unwrap();
        a.admit("evil", 90, false).unwrap();
        for i in 0..9 {
            a.admit(&format!("g{i}"), 80, true).unwrap();
        }
        assert_eq!(a.all.bytes, 990);
        assert_eq!(a.admit("g9", 20, true), Err(Short::Known));
        assert_eq!(a.admit("evil2", 20, false), Err(Short::Unknown));
    }

    #[test]
    fn a_name_that_became_known_counts_each_notification_in_its_own_pool() {
        let mut a = Accounting::new(SMALL);
        a.admit("p", 10, false).unwrap();
        a.admit("p", 20, true).unwrap();
        assert_eq!(
            (a.unknown, a.known, a.unknown_peers),
            (q(1, 10), q(1, 20), 1)
        );
        a.release("p", 10, false);
        assert_eq!(
            (a.unknown, a.known, a.unknown_peers),
            (q(0, 0), q(1, 20), 0)
        );
        assert_eq!(a.peers["p"].queued, q(1, 20));
        a.release("p", 20, true);
        assert!(a.peers.is_empty());
        assert_eq!(a.all, q(0, 0));
    }

    #[test]
    fn limits_that_cannot_work_are_named() {
        assert_eq!(NotificationLimits::default().invalid(), None);
        assert_eq!(SMALL.invalid(), None);
        for bad in [
            NotificationLimits {
                unknown_peers: 0,
                ..SMALL
            },
            NotificationLimits {
                messages: 0,
                ..SMALL
            },
            NotificationLimits {
                unknown_messages: 20,
                ..SMALL
            },
            NotificationLimits {
                unknown_bytes: 1000,
                ..SMALL
            },
        ] {
            assert!(bad.invalid().is_some(), "{bad:?}");
        }
    }

    proptest! {
        /// Any sequence of deliveries and reads: the bounds hold (bytes past a bound
        /// by one notification at most), and a known peer with room in its own queue
        /// and in the known peers' share of the total is always admitted.
        #[test]
        fn bounds_hold_and_known_peers_keep_their_share(
            ops in prop::collection::vec((0u8..4, 0usize..40, any::<bool>(), 1usize..150), 1..400)
        ) {
            let l = SMALL;
            let max_len = 150;
            let mut a = Accounting::new(l);
            let mut queued: std::collections::VecDeque<(String, usize, bool)> = Default::default();
            for (op, name, known, len) in ops {
                if op == 0 {
                    if let Some((p, len, k)) = queued.pop_front() {
                        a.release(&p, len, k);
                    }
                    continue;
                }
                // Names below 8 are known peers, the rest unknown.
                let known = known && name < 8;
                let name = format!("n{}", if known { name % 8 } else { name.max(8) });
                let own = a.peers.get(&name).map(|q| q.queued).unwrap_or_default();
                let own_room =
                    own.messages < l.messages && (own.messages == 0 || own.bytes + len <= l.bytes);
                // The known peers' share: the total less the unknown pool.
                let share = a.known.messages < l.total_messages - l.unknown_messages
                    && a.known.bytes + len <= l.total_bytes - l.unknown_bytes;
                match a.admit(&name, len, known) {
                    Ok(()) => queued.push_back((name, len, known)),
                    Err(s) => prop_assert!(
                        !(known && own_room && share),
                        "a known peer with room was refused ({:?}, {:?})", s, a.stats()
                    ),
                }
                prop_assert!(a.all.messages <= l.total_messages);
                // Notifications here are shorter than the unknown pool's byte bound, so
                // only a known peer's may pass the total's, once.
                prop_assert!(a.all.bytes <= l.total_bytes + max_len);
                prop_assert!(a.unknown.messages <= l.unknown_messages);
                prop_assert!(a.unknown.bytes <= l.unknown_bytes + max_len);
                prop_assert!(a.unknown_peers <= l.unknown_peers);
                for q in a.peers.values() {
                    prop_assert!(q.queued.messages <= l.messages);
                    prop_assert!(q.queued.bytes <= l.bytes + max_len);
                }
                let sum = a.peers.values().fold(q(0, 0), |s, p| q(s.messages + p.queued.messages, s.bytes + p.queued.bytes));
                prop_assert_eq!(sum, a.all);
                prop_assert_eq!(a.peers.values().filter(|p| p.unknown > 0).count(), a.unknown_peers);
            }
            while let Some((p, len, k)) = queued.pop_front() {
                a.release(&p, len, k);
            }
            prop_assert!(a.peers.is_empty());
            prop_assert_eq!((a.all, a.known, a.unknown, a.unknown_peers), (q(0, 0), q(0, 0), q(0, 0), 0));
        }
    }
}
