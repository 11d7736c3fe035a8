//! Notifications in posting order, whatever order their transfers finish in, for a
//! backend whose transfers complete out of order (nixl-uccl's engine reports each
//! transfer on its own).
//!
//! Each notification takes a [`Ticket`] when its transfer is posted; a ticket's item
//! is released only after every earlier ticket's item was released or given up (its
//! ticket dropped: the transfer failed, or the agent stopped first). A backend whose
//! lane already keeps order (one stream or queue pair, or a per-connection FIFO of
//! operations) needs none; transfers split over several lanes use
//! [`StripeGate`](super::StripeGate).

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};

/// Releases items in the order their tickets were taken.
pub struct Sequencer<T> {
    state: Mutex<State<T>>,
    release: fn(T),
}

struct State<T> {
    /// The next ticket's number.
    next_post: u64,
    /// The number of `waiting[0]`: the oldest ticket not released or given up.
    next_release: u64,
    /// Tickets from `next_release` on: `None` while unresolved, `Some(None)` given
    /// up, `Some(Some(item))` ready to release after those before it.
    waiting: VecDeque<Option<Option<T>>>,
}

impl<T> fmt::Debug for Sequencer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("Sequencer")
            .field("next_post", &s.next_post)
            .field("next_release", &s.next_release)
            .finish_non_exhaustive()
    }
}

impl<T> Sequencer<T> {
    /// A sequencer that hands each item to `release` in ticket order. `release` runs
    /// under the sequencer's lock, on whichever thread resolved the ticket that let
    /// it go, so that two threads never release out of order: it must not block and
    /// must not resolve a ticket of this sequencer.
    pub fn new(release: fn(T)) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                next_post: 0,
                next_release: 0,
                waiting: VecDeque::new(),
            }),
            release,
        })
    }

    /// The next place in the order.
    pub fn ticket(self: &Arc<Self>) -> Ticket<T> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let seq = s.next_post;
        s.next_post += 1;
        s.waiting.push_back(None);
        Ticket {
            seq,
            seqr: Some(self.clone()),
        }
    }

    /// Tickets taken and not yet released or given up, counting those held back
    /// behind an earlier one.
    pub fn pending(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting
            .len()
    }

    fn resolve(&self, seq: u64, item: Option<T>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let at = usize::try_from(seq - s.next_release).expect("a ticket resolves once");
        s.waiting[at] = Some(item);
        while matches!(s.waiting.front(), Some(Some(_))) {
            let item = s.waiting.pop_front().flatten().flatten();
            s.next_release += 1;
            if let Some(item) = item {
                (self.release)(item);
            }
        }
    }
}

/// A place in a [`Sequencer`]'s order; dropping it unresolved gives the place up, so
/// those after it are not held back.
#[must_use = "dropping a ticket gives its place up"]
pub struct Ticket<T> {
    seq: u64,
    seqr: Option<Arc<Sequencer<T>>>,
}

impl<T> fmt::Debug for Ticket<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").field("seq", &self.seq).finish()
    }
}

impl<T> Ticket<T> {
    /// Release `item` in this ticket's turn: now, if every earlier ticket was
    /// resolved, else by whichever resolves the last of them.
    pub fn release(mut self, item: T) {
        if let Some(s) = self.seqr.take() {
            s.resolve(self.seq, Some(item));
        }
    }
}

impl<T> Drop for Ticket<T> {
    fn drop(&mut self) {
        if let Some(s) = self.seqr.take() {
            s.resolve(self.seq, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex as StdMutex;

    use super::*;

    static OUT: StdMutex<Vec<(u32, u32)>> = StdMutex::new(Vec::new());

    /// Items are (test id, value): each test reads back only its own.
    fn record(item: (u32, u32)) {
        OUT.lock().unwrap().push(item);
    }

    fn released(test: u32) -> Vec<u32> {
        OUT.lock()
            .unwrap()
            .iter()
            .filter(|(t, _)| *t == test)
            .map(|(_, v)| *v)
            .collect()
    }

    #[test]
    fn items_go_in_ticket_order_whatever_order_they_resolve_in() {
        let s = Sequencer::new(record);
        let t: Vec<_> = (0..4).map(|_| s.ticket()).collect();
        let mut t = t.into_iter();
        let (a, b, c, d) = (
            t.next().unwrap(),
            t.next().unwrap(),
            t.next().unwrap(),
            t.next().unwrap(),
        );
        c.release((1, 2));
        b.release((1, 1));
        assert!(released(1).is_empty(), "held behind ticket 0");
        assert_eq!(s.pending(), 4);
        a.release((1, 0));
        assert_eq!(released(1), [0, 1, 2]);
        assert_eq!(s.pending(), 1);
        d.release((1, 3));
        assert_eq!(released(1), [0, 1, 2, 3]);
        assert_eq!(s.pending(), 0);
    }

    #[test]
    fn a_dropped_ticket_gives_its_place_up() {
        let s = Sequencer::new(record);
        let a = s.ticket();
        let b = s.ticket();
        let c = s.ticket();
        c.release((2, 2));
        drop(a);
        assert!(released(2).is_empty(), "held behind ticket 1");
        drop(b);
        assert_eq!(released(2), [2]);
        assert_eq!(s.pending(), 0);
        s.ticket().release((2, 3));
        assert_eq!(released(2), [2, 3]);
    }

    #[test]
    fn threads_resolving_at_once_still_release_in_order() {
        let s = Sequencer::new(record);
        let tickets: Vec<_> = (0..2000).map(|_| s.ticket()).collect();
        let mut halves = [Vec::new(), Vec::new()];
        for (i, t) in tickets.into_iter().enumerate() {
            halves[i % 2].push((i as u32, t));
        }
        let joins: Vec<_> = halves
            .into_iter()
            .map(|mut half| {
                half.reverse();
                std::thread::spawn(move || {
                    for (i, t) in half {
                        t.release((3, i));
                    }
                })
            })
            .collect();
        for j in joins {
            j.join().unwrap();
        }
        assert_eq!(released(3), (0..2000).collect::<Vec<_>>());
    }
}
