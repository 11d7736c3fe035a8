//! Which incoming connections a listener keeps: a bounded set still in their
//! handshake, where a newcomer closes the oldest when the set is full (so idle or
//! slow sockets cannot lock a legitimate peer out: each is closed by the time
//! enough newer ones arrived, or by the handshake timeout), and a bounded set of
//! established ones.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

/// The listener's connection limits and the connections they count.
#[derive(Debug)]
pub struct Admission {
    max_handshakes: usize,
    max_established: usize,
    state: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    next: u64,
    /// Connections in their handshake, oldest first, with the token that closes each.
    handshaking: VecDeque<(u64, CancellationToken)>,
    established: usize,
}

impl Admission {
    /// At most `max_handshakes` connections in their handshake (at least 1) and
    /// `max_established` past it.
    pub fn new(max_handshakes: usize, max_established: usize) -> Arc<Self> {
        Arc::new(Self {
            max_handshakes: max_handshakes.max(1),
            max_established,
            state: Mutex::new(Counts::default()),
        })
    }

    /// Count a new connection as in its handshake; `close` ends it. When the
    /// handshaking set is full, the oldest in it is closed to make room.
    pub fn admit(self: &Arc<Self>, close: CancellationToken) -> Ticket {
        let mut s = self.state.lock().unwrap();
        while s.handshaking.len() >= self.max_handshakes {
            if let Some((_, oldest)) = s.handshaking.pop_front() {
                tracing::debug!(
                    "closing the oldest connection still in its handshake to admit a new one"
                );
                oldest.cancel();
            }
        }
        let id = s.next;
        s.next += 1;
        s.handshaking.push_back((id, close));
        Ticket {
            admission: self.clone(),
            id,
            established: false,
        }
    }

    /// Close the oldest connection still in its handshake, if any: accepting failed
    /// (out of file descriptors, most likely), and idle sockets must not keep a
    /// legitimate peer from being accepted once one comes free.
    pub fn shed_oldest(&self) -> bool {
        let oldest = self.state.lock().unwrap().handshaking.pop_front();
        oldest.map(|(_, t)| t.cancel()).is_some()
    }
}

/// One connection's place in [`Admission`]; dropping it frees the place.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    id: u64,
    established: bool,
}

impl Ticket {
    /// The handshake is over: move to the established set. `false` when that set is
    /// full (then the connection is to be closed; it still counts as handshaking
    /// until dropped).
    pub fn establish(&mut self) -> bool {
        if self.established {
            return true;
        }
        let a = &self.admission;
        let mut s = a.state.lock().unwrap();
        if s.established >= a.max_established {
            return false;
        }
        s.handshaking.retain(|(id, _)| *id != self.id);
        s.established += 1;
        self.established = true;
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = self.admission.state.lock().unwrap();
        if self.established {
            s.established -= 1;
        } else {
            s.handshaking.retain(|(id, _)| *id != self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_handshake_set_closes_its_oldest() {
        let a = Admission::new(2, 1);
        let tokens: Vec<_> = (0..4).map(|_| CancellationToken::new()).collect();
        let t0 = a.admit(tokens[0].clone());
        let mut t1 = a.admit(tokens[1].clone());
        let _t2 = a.admit(tokens[2].clone());
        assert!(tokens[0].is_cancelled(), "the oldest made room");
        assert!(!tokens[1].is_cancelled());
        drop(t0);
        // Established connections leave the handshake set and are never evicted.
        assert!(t1.establish());
        let _t3 = a.admit(tokens[3].clone());
        assert!(!tokens[1].is_cancelled());
        assert!(!tokens[2].is_cancelled(), "room was made by t1 leaving");
        // The established set is full: the next one is refused.
        let t4_token = CancellationToken::new();
        let mut t4 = a.admit(t4_token.clone());
        assert!(tokens[2].is_cancelled());
        assert!(!t4.establish());
        drop(t1);
        assert!(t4.establish(), "a place came free");
        // Shedding closes the oldest still in its handshake, never an established one.
        assert!(a.shed_oldest());
        assert!(tokens[3].is_cancelled());
        assert!(!a.shed_oldest());
        assert!(!t4_token.is_cancelled());
    }
}
