//! What a target owes one inbound control connection: the answers it has not yet
//! written. Bounded whatever the peer sends:
//! - a `Ping` owes one `Pong`, however many arrive before it is written (they are
//!   coalesced: a peer that pings and never reads is owed one answer, not one per
//!   ping);
//! - a `Verify` is accepted only while fewer than [`confirm::MAX_QUEUED`] are
//!   accepted and unwritten (being digested, or digested and waiting for the
//!   writer); past that the connection's reader waits for room, reading nothing
//!   more, so a peer that sends requests and never reads the answers stalls on its
//!   own full socket instead of growing this side's memory.
//!
//! The writer takes answers one at a time and must write each within a deadline,
//! else the connection is cut (see `serve_control`).
//!
//! [`confirm::MAX_QUEUED`]: crate::confirm::MAX_QUEUED

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::wire::Frame;

/// The answers owed, as plain state.
#[derive(Debug)]
pub(crate) struct Owed {
    pong: bool,
    verified: VecDeque<Frame>,
    /// `Verify` requests accepted and not yet handed to the writer.
    accepted: usize,
    max_accepted: usize,
}

impl Owed {
    pub(crate) fn new(max_accepted: usize) -> Self {
        Self {
            pong: false,
            verified: VecDeque::new(),
            accepted: 0,
            max_accepted: max_accepted.max(1),
        }
    }

    /// A `Ping` arrived: one `Pong` is owed (still one if one was owed already).
    pub(crate) fn ping(&mut self) {
        self.pong = true;
    }

    /// Take one more `Verify`, unless as many as allowed are owed already.
    pub(crate) fn accept_verify(&mut self) -> bool {
        if self.accepted >= self.max_accepted {
            return false;
        }
        self.accepted += 1;
        true
    }

    /// An accepted `Verify`'s answer is ready to write.
    pub(crate) fn answered(&mut self, f: Frame) {
        debug_assert!(
            self.verified.len() < self.accepted,
            "answer to a request never accepted"
        );
        self.verified.push_back(f);
    }

    /// The next answer to write: the `Pong` first (it is liveness), then
    /// confirmations in the order they were made.
    pub(crate) fn next(&mut self) -> Option<Frame> {
        if std::mem::take(&mut self.pong) {
            return Some(Frame::Pong);
        }
        let f = self.verified.pop_front()?;
        self.accepted -= 1;
        Some(f)
    }

    /// Answers owed: the `Pong`, and every accepted `Verify` (answered or not).
    pub(crate) fn owed(&self) -> usize {
        usize::from(self.pong) + self.accepted
    }
}

/// What the control listener has held for its peers, across connections (see
/// [`UcclBackend::control_stats`](crate::UcclBackend::control_stats)).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) most_owed: AtomicUsize,
    pub(crate) cut_not_reading: AtomicU64,
}

/// [`Owed`] shared by one connection's reader, writer and the confirmation worker.
#[derive(Debug)]
pub(crate) struct Replies {
    owed: Mutex<Owed>,
    /// The connection was cut for not reading (counted once).
    cut: std::sync::atomic::AtomicBool,
    /// Wakes the writer: an answer is owed.
    ready: Notify,
    /// Wakes the reader: a `Verify` may be accepted again.
    room: Notify,
    stats: Arc<Stats>,
}

impl Replies {
    pub(crate) fn new(max_accepted: usize, stats: Arc<Stats>) -> Arc<Self> {
        Arc::new(Self {
            owed: Mutex::new(Owed::new(max_accepted)),
            cut: Default::default(),
            ready: Notify::new(),
            room: Notify::new(),
            stats,
        })
    }

    fn changed(&self, o: &Owed) {
        self.stats.most_owed.fetch_max(o.owed(), Ordering::Relaxed);
    }

    /// The connection ended with `e`: when that is a write that could not finish in
    /// time, or the kernel's user timeout (answers left unacknowledged: the peer's
    /// window stayed closed), count it, once per connection.
    pub(crate) fn cut_if_not_reading(&self, e: &std::io::Error, from: std::net::SocketAddr) {
        if e.kind() == std::io::ErrorKind::TimedOut && !self.cut.swap(true, Ordering::Relaxed) {
            self.stats.cut_not_reading.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%from, "UCCL control: cut a peer that does not read its answers ({e})");
        }
    }

    pub(crate) fn ping(&self) {
        let mut o = self.owed.lock().unwrap();
        o.ping();
        self.changed(&o);
        drop(o);
        self.ready.notify_one();
    }

    /// Accept one `Verify`, waiting for room (reading nothing meanwhile).
    pub(crate) async fn accept_verify(&self) {
        loop {
            {
                let mut o = self.owed.lock().unwrap();
                if o.accept_verify() {
                    self.changed(&o);
                    return;
                }
            }
            // A permit stored by a wake between the check and here is not lost.
            self.room.notified().await;
        }
    }

    /// An accepted `Verify`'s answer (from the confirmation worker).
    pub(crate) fn answered(&self, f: Frame) {
        self.owed.lock().unwrap().answered(f);
        self.ready.notify_one();
    }

    /// The next answer to write, waiting for one.
    pub(crate) async fn next(&self) -> Frame {
        loop {
            if let Some(f) = self.owed.lock().unwrap().next() {
                if matches!(f, Frame::Verified { .. }) {
                    self.room.notify_one();
                }
                return f;
            }
            self.ready.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pings_owe_one_pong_however_many() {
        let mut o = Owed::new(4);
        for _ in 0..100_000 {
            o.ping();
        }
        assert_eq!(o.owed(), 1);
        assert_eq!(o.next(), Some(Frame::Pong));
        assert_eq!(o.next(), None);
        assert_eq!(o.owed(), 0);
        // A ping after the pong was taken is owed its own.
        o.ping();
        assert_eq!(o.next(), Some(Frame::Pong));
    }

    #[test]
    fn verifies_are_bounded_until_their_answers_are_taken() {
        let mut o = Owed::new(2);
        assert!(o.accept_verify());
        assert!(o.accept_verify());
        assert!(!o.accept_verify(), "a third while two are owed");
        o.ping();
        assert_eq!(o.owed(), 3);
        // Answered but not yet taken by the writer: still owed, still no room.
        o.answered(Frame::Verified {
            id: 1,
            digest: None,
        });
        assert!(!o.accept_verify());
        assert_eq!(o.next(), Some(Frame::Pong));
        assert_eq!(
            o.next(),
            Some(Frame::Verified {
                id: 1,
                digest: None
            })
        );
        assert!(o.accept_verify(), "room once an answer went to the writer");
        assert!(!o.accept_verify());
        o.answered(Frame::Verified {
            id: 2,
            digest: Some(7),
        });
        o.answered(Frame::Verified {
            id: 3,
            digest: None,
        });
        assert_eq!(
            o.next(),
            Some(Frame::Verified {
                id: 2,
                digest: Some(7)
            })
        );
        assert_eq!(
            o.next(),
            Some(Frame::Verified {
                id: 3,
                digest: None
            })
        );
        assert_eq!(o.next(), None);
        assert_eq!(o.owed(), 0);
    }

    #[tokio::test]
    async fn a_waiting_reader_is_woken_when_the_writer_takes_an_answer() {
        let r = Replies::new(1, Arc::default());
        r.accept_verify().await;
        let reader = {
            let r = r.clone();
            tokio::spawn(async move { r.accept_verify().await })
        };
        tokio::task::yield_now().await;
        assert!(!reader.is_finished(), "accepted past the bound");
        r.answered(Frame::Verified {
            id: 0,
            digest: None,
        });
        assert_eq!(
            r.next().await,
            Frame::Verified {
                id: 0,
                digest: None
            }
        );
        tokio::time::timeout(std::time::Duration::from_secs(30), reader)
            .await
            .expect("the reader was never woken")
            .unwrap();
        assert_eq!(r.stats.most_owed.load(Ordering::Relaxed), 1);
    }
}
