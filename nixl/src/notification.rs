//! Notifications: a stream of `(peer, bytes)` per agent, bounded per peer.
//!
//! Every notification received and not yet read counts against its peer's bound
//! ([`NotificationLimits`]). A backend that delivers from a task waits for room in that
//! peer's queue ([`NotificationSink::deliver_async`](crate::NotificationSink::deliver_async)),
//! which stops it reading that peer's connection: back-pressure on the flooding peer
//! alone. One that delivers from a thread that cannot wait
//! ([`NotificationSink::deliver`](crate::NotificationSink::deliver)) drops the
//! notification instead, counts it ([`NotificationStats::dropped`], the
//! `nixl_notifications_dropped_total` metric) and logs a warning naming the peer (at
//! most one a second per agent).

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

pub(crate) type Slot = Arc<Mutex<Option<mpsc::UnboundedReceiver<Notification>>>>;

/// How many notifications, and how many bytes of them, one peer may have queued at an
/// agent (received, not yet read by the application); set with
/// [`AgentBuilder::notification_limits`](crate::AgentBuilder::notification_limits).
///
/// A notification that would go over either bound waits (backends that deliver from
/// a task stop reading that peer's connection until the application reads) or is
/// dropped and counted (backends that deliver from a thread that cannot wait); see
/// the [`NotificationSink`](crate::NotificationSink) methods. A notification longer
/// than `bytes` is queued once that peer has nothing else queued, so a peer's queue
/// holds at most `bytes`, or one notification. The agent's own notifications (from
/// same-agent transfers, which the application posts itself) are counted but never
/// held back or dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotificationLimits {
    /// Notifications queued per peer; default 4096.
    pub messages: usize,
    /// Bytes of notifications queued per peer; default 64 MiB.
    pub bytes: usize,
}

impl Default for NotificationLimits {
    fn default() -> Self {
        Self {
            messages: 4096,
            bytes: 64 << 20,
        }
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

/// The agent's notification queue now; see
/// [`Agent::notification_stats`](crate::Agent::notification_stats).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NotificationStats {
    /// What each peer has queued (peers with nothing queued are absent).
    pub peers: BTreeMap<String, QueuedNotifications>,
    /// Notifications dropped since the agent started because their peer's queue was
    /// full (only backends that deliver without waiting drop).
    pub dropped: u64,
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

/// The per-peer accounting of an agent's notification queue, shared by its sinks and
/// its [`Notifications`] handle. The notifications themselves travel through one
/// channel, in arrival order; this only admits them, counts them and wakes waiters.
#[derive(Debug)]
pub(crate) struct PeerQueues {
    agent: String,
    limits: NotificationLimits,
    state: Mutex<QueueState>,
}

#[derive(Debug, Default)]
struct QueueState {
    /// Peers with something queued or someone waiting for room.
    peers: HashMap<String, PeerQueue>,
    dropped: u64,
    /// Drops not yet reported in a warning, and when the last warning went out.
    unwarned: u64,
    warned_at: Option<Instant>,
}

#[derive(Debug, Default)]
struct PeerQueue {
    queued: QueuedNotifications,
    /// Woken when the application reads one of this peer's notifications. Waiters
    /// hold a clone, so an entry with more than one reference has waiters.
    space: Arc<Notify>,
}

impl PeerQueue {
    fn idle(&self) -> bool {
        self.queued.messages == 0 && Arc::strong_count(&self.space) == 1
    }
}

/// What a dropped notification should log.
struct DropWarning {
    dropped: u64,
    total: u64,
    queued: QueuedNotifications,
}

impl PeerQueues {
    pub(crate) fn new(agent: &str, limits: NotificationLimits) -> Self {
        Self {
            agent: agent.to_owned(),
            limits,
            state: Mutex::new(QueueState::default()),
        }
    }

    /// Count a notification of `len` bytes against `peer` if its queue has room.
    pub(crate) fn admit(&self, peer: &str, len: usize) -> bool {
        let mut st = self.state.lock().unwrap();
        let q = match st.peers.get_mut(peer) {
            Some(q) => q,
            // An empty queue always has room (the builder refuses a bound of zero).
            None => {
                let q = PeerQueue {
                    queued: QueuedNotifications {
                        messages: 1,
                        bytes: len,
                    },
                    space: Arc::default(),
                };
                st.peers.insert(peer.to_owned(), q);
                return true;
            }
        };
        let room = q.queued.messages < self.limits.messages
            && (q.queued.messages == 0 || q.queued.bytes.saturating_add(len) <= self.limits.bytes);
        if room {
            q.queued.messages += 1;
            q.queued.bytes += len;
        }
        room
    }

    /// Count the agent's own notification, room or not.
    pub(crate) fn admit_own(&self, peer: &str, len: usize) {
        let mut st = self.state.lock().unwrap();
        let q = st.peers.entry(peer.to_owned()).or_default();
        q.queued.messages += 1;
        q.queued.bytes += len;
    }

    /// The application read (or the agent discarded) one of `peer`'s notifications.
    pub(crate) fn release(&self, peer: &str, len: usize) {
        let mut st = self.state.lock().unwrap();
        let Some(q) = st.peers.get_mut(peer) else {
            return;
        };
        q.queued.messages = q.queued.messages.saturating_sub(1);
        q.queued.bytes = q.queued.bytes.saturating_sub(len);
        if q.idle() {
            st.peers.remove(peer);
        } else {
            q.space.notify_waiters();
        }
    }

    /// Register interest in room in `peer`'s queue; undone by [`Self::unwait`].
    pub(crate) fn wait(&self, peer: &str) -> Arc<Notify> {
        let mut st = self.state.lock().unwrap();
        st.peers.entry(peer.to_owned()).or_default().space.clone()
    }

    /// Stop waiting for room in `peer`'s queue.
    pub(crate) fn unwait(&self, peer: &str, space: Arc<Notify>) {
        let mut st = self.state.lock().unwrap();
        drop(space);
        if st.peers.get(peer).is_some_and(PeerQueue::idle) {
            st.peers.remove(peer);
        }
    }

    /// Count a notification from `peer` dropped for want of room, and warn (rate
    /// limited).
    pub(crate) fn dropped(&self, peer: &str, len: usize) {
        let warning = {
            let mut st = self.state.lock().unwrap();
            st.dropped += 1;
            st.unwarned += 1;
            let now = Instant::now();
            if st
                .warned_at
                .is_some_and(|t| now.duration_since(t) < WARN_EVERY)
            {
                None
            } else {
                st.warned_at = Some(now);
                Some(DropWarning {
                    dropped: std::mem::take(&mut st.unwarned),
                    total: st.dropped,
                    queued: st.peers.get(peer).map(|q| q.queued).unwrap_or_default(),
                })
            }
        };
        if let Some(w) = warning {
            tracing::warn!(
                agent = %self.agent,
                peer,
                len,
                dropped = w.dropped,
                total_dropped = w.total,
                queued = w.queued.messages,
                queued_bytes = w.queued.bytes,
                max_messages = self.limits.messages,
                max_bytes = self.limits.bytes,
                "dropped a notification from {peer:?}: its queue is full because the application reads notifications too slowly ({} dropped since the last warning)",
                w.dropped
            );
        }
    }

    pub(crate) fn stats(&self) -> NotificationStats {
        let st = self.state.lock().unwrap();
        NotificationStats {
            peers: st
                .peers
                .iter()
                .filter(|(_, q)| q.queued.messages > 0)
                .map(|(p, q)| (p.clone(), q.queued))
                .collect(),
            dropped: st.dropped,
        }
    }
}

/// The agent's incoming notifications, in arrival order (per peer: the order the peer
/// posted them). Also a [`Stream`].
///
/// One handle exists at a time; dropping it hands the queue back to the agent, so
/// nothing is lost between handles.
///
/// Reading a notification makes room in its peer's queue ([`NotificationLimits`]).
pub struct Notifications {
    rx: Option<mpsc::UnboundedReceiver<Notification>>,
    slot: Slot,
    queues: Arc<PeerQueues>,
}

impl Notifications {
    pub(crate) fn new(
        rx: mpsc::UnboundedReceiver<Notification>,
        slot: Slot,
        queues: Arc<PeerQueues>,
    ) -> Self {
        Self {
            rx: Some(rx),
            slot,
            queues,
        }
    }

    /// Count `n` out of its peer's queue.
    fn read(&self, n: Option<Notification>) -> Option<Notification> {
        if let Some(n) = &n {
            self.queues.release(&n.peer, n.msg.len());
        }
        n
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
