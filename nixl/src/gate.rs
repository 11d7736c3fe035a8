//! The gate every backend access to a registration passes: deregistration closes it,
//! and once it is closed no byte of the memory is touched again.
//!
//! A target that moves bytes itself (nixl-tcp receiving a peer's WRITE into
//! registered memory, or sending a READ from it) copies at the peer's pace; a request
//! that passed its key check before the registration was withdrawn would otherwise go
//! on writing into memory the application has already freed (a framework's tensor
//! handed in by address). Each access is one copy or one non-blocking system call,
//! entered and left around it, never held across an await.
//!
//! Deregistration does not simply close: it may still be refused (transfers of this
//! agent use the memory), and a refused deregistration must be invisible to every
//! access. So closing is a decision taken with the gate held ([`Gate::close_if`]):
//! the gate stops admitting, waits for the accesses running at that moment, asks the
//! caller whether to close, and then either closes for good or opens again. An access
//! that arrives meanwhile waits for the decision instead of being refused. The
//! decision takes microseconds (one running copy, one counter read), so waiting for
//! it cannot deadlock a single-threaded runtime.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::Duration;

const OPEN: u8 = 0;
/// A closer is deciding: accesses wait.
const DECIDING: u8 = 1;
const CLOSED: u8 = 2;

/// Accesses in progress and whether new ones are admitted.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    active: AtomicUsize,
    state: AtomicU8,
    /// Held by the one closer deciding at a time.
    closers: Mutex<()>,
}

/// One access in progress; leaving the gate when dropped.
#[must_use]
pub(crate) struct Access<'a>(&'a Gate);

/// One access through two gates ([`Gate::enter_both`]); the second is `None` when
/// both were the same gate.
#[must_use]
pub(crate) struct Both<'a> {
    _first: Access<'a>,
    _second: Option<Access<'a>>,
}

impl Drop for Access<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, SeqCst);
    }
}

/// Wait a little, longer the more often it is called: spin, then yield, then sleep.
fn back_off(round: &mut u32) {
    *round += 1;
    if *round < 100 {
        std::hint::spin_loop();
    } else if *round < 1000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// What trying to enter found.
enum Try<'a> {
    In(Access<'a>),
    Closed,
    /// A closer is deciding: not counted; wait for the decision, then try again.
    Deciding,
}

impl Gate {
    fn try_enter(&self) -> Try<'_> {
        // Counted first, checked second; a closer sets the state first and counts
        // second: with sequentially consistent order one of the two sees the other.
        self.active.fetch_add(1, SeqCst);
        let access = Access(self);
        match self.state.load(SeqCst) {
            OPEN => Try::In(access),
            CLOSED => Try::Closed,
            // Not counted while waiting, so the closer's wait ends.
            _ => Try::Deciding,
        }
    }

    fn await_decision(&self, round: &mut u32) {
        while self.state.load(SeqCst) == DECIDING {
            back_off(round);
        }
    }

    /// Enter for one access, or `None` once the gate is closed. While a closer is
    /// deciding, waits for its decision.
    ///
    /// Never call it while holding an access to any gate (the closer of this one
    /// may be waiting for that access to end, and this call for the closer): enter
    /// two gates with [`Gate::enter_both`].
    pub(crate) fn enter(&self) -> Option<Access<'_>> {
        let mut round = 0;
        loop {
            match self.try_enter() {
                Try::In(a) => return Some(a),
                Try::Closed => return None,
                Try::Deciding => self.await_decision(&mut round),
            }
        }
    }

    /// Enter `a` and `b` (possibly the same gate) for one access that touches both,
    /// or `None` once either is closed. Never waits for a decision while holding an
    /// access: when the second gate is deciding, the first access is given back
    /// first, so two closers and two such accesses can never wait on each other.
    pub(crate) fn enter_both<'a>(a: &'a Self, b: &'a Self) -> Option<Both<'a>> {
        if std::ptr::eq(a, b) {
            return a.enter().map(|x| Both {
                _first: x,
                _second: None,
            });
        }
        let mut round = 0;
        loop {
            let first = match a.try_enter() {
                Try::In(x) => x,
                Try::Closed => return None,
                Try::Deciding => {
                    a.await_decision(&mut round);
                    continue;
                }
            };
            match b.try_enter() {
                Try::In(y) => {
                    return Some(Both {
                        _first: first,
                        _second: Some(y),
                    })
                }
                Try::Closed => return None,
                Try::Deciding => {
                    drop(first);
                    b.await_decision(&mut round);
                }
            }
        }
    }

    /// Stop admitting accesses, wait for those in progress (each a single copy or
    /// system call) to end, then close for good if `close` says so, or admit again
    /// as if nothing happened. Returns whether the gate is closed. Accesses that
    /// arrive while `close` runs wait for the decision; none is refused unless the
    /// gate closes.
    ///
    /// `close` must be quick and must not enter this gate.
    pub(crate) fn close_if(&self, close: impl FnOnce() -> bool) -> bool {
        let _one = self.closers.lock().unwrap_or_else(|p| p.into_inner());
        if self.state.load(SeqCst) == CLOSED {
            return true;
        }
        self.state.store(DECIDING, SeqCst);
        let mut round = 0;
        while self.active.load(SeqCst) != 0 {
            back_off(&mut round);
        }
        // A panic in `close` must not leave accesses waiting forever.
        struct Reopen<'a>(&'a AtomicU8);
        impl Drop for Reopen<'_> {
            fn drop(&mut self) {
                let _ = self.0.compare_exchange(DECIDING, OPEN, SeqCst, SeqCst);
            }
        }
        let reopen = Reopen(&self.state);
        let closed = close();
        self.state.store(if closed { CLOSED } else { OPEN }, SeqCst);
        drop(reopen);
        closed
    }

    /// Close for good: refuse new accesses and wait for those in progress to end.
    #[cfg(test)]
    pub(crate) fn close(&self) {
        self.close_if(|| true);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    use super::Gate;

    #[test]
    fn closed_gate_refuses_and_a_refused_close_changes_nothing() {
        let g = Gate::default();
        assert!(g.enter().is_some());
        assert!(!g.close_if(|| false));
        assert!(g.enter().is_some());
        assert!(g.close_if(|| true));
        assert!(g.enter().is_none());
        assert!(g.close_if(|| false), "closed stays closed");
        assert!(g.enter().is_none());
    }

    /// Threads write through the gate while another closes it: after `close`
    /// returns, the value never changes again.
    #[test]
    fn nothing_passes_after_close_returns() {
        for _ in 0..50 {
            let gate = Arc::new(Gate::default());
            let value = Arc::new(AtomicU64::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let writers: Vec<_> = (0..2)
                .map(|_| {
                    let (gate, value, stop) = (gate.clone(), value.clone(), stop.clone());
                    std::thread::spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            if let Some(_a) = gate.enter() {
                                value.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    })
                })
                .collect();
            while value.load(Ordering::Relaxed) < 100 {
                std::thread::yield_now();
            }
            gate.close();
            let seen = value.load(Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(2));
            assert_eq!(value.load(Ordering::Relaxed), seen);
            stop.store(true, Ordering::Relaxed);
            for w in writers {
                w.join().unwrap();
            }
        }
    }

    /// A close that is refused is invisible: threads entering all the while are
    /// never turned away (the old close, read, reopen order turned some away).
    #[test]
    fn a_refused_close_never_refuses_an_access() {
        let gate = Arc::new(Gate::default());
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicU64::new(0));
        let entered = Arc::new(AtomicU64::new(0));
        let users: Vec<_> = (0..2)
            .map(|_| {
                let (gate, stop) = (gate.clone(), stop.clone());
                let (refused, entered) = (refused.clone(), entered.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        match gate.enter() {
                            Some(_a) => entered.fetch_add(1, Ordering::Relaxed),
                            None => refused.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                })
            })
            .collect();
        // Both users are entering before the closer starts.
        while entered.load(Ordering::Relaxed) < 1_000 {
            std::thread::yield_now();
        }
        for _ in 0..20_000 {
            assert!(!gate.close_if(|| false));
        }
        stop.store(true, Ordering::Relaxed);
        for u in users {
            u.join().unwrap();
        }
        assert!(entered.load(Ordering::Relaxed) > 0);
        assert_eq!(
            refused.load(Ordering::Relaxed),
            0,
            "a refused close turned accesses away"
        );
    }

    /// Copies through two gates (the same one twice, or two in either order) while
    /// both gates' closers keep deciding: none of them waits for the others forever
    /// (entering the second gate while holding the first could: its closer waits for
    /// the held access, the access for its decision).
    #[test]
    fn accesses_through_two_gates_never_wait_on_closers() {
        let (a, b) = (Arc::new(Gate::default()), Arc::new(Gate::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let copies = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for (x, y) in [(&a, &a), (&a, &b), (&b, &a)] {
            let (x, y, stop, copies) = (x.clone(), y.clone(), stop.clone(), copies.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(_both) = Gate::enter_both(&x, &y) {
                        copies.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        let closes = Arc::new(AtomicU64::new(0));
        for g in [&a, &b] {
            let (g, stop, closes) = (g.clone(), stop.clone(), closes.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    assert!(!g.close_if(|| false));
                    closes.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        // Generous: a deadlock stops both counts for good.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while copies.load(Ordering::Relaxed) < 200_000 || closes.load(Ordering::Relaxed) < 200_000 {
            assert!(
                std::time::Instant::now() < deadline,
                "stalled at {} copies and {} closes (closers and accesses waiting on each other)",
                copies.load(Ordering::Relaxed),
                closes.load(Ordering::Relaxed)
            );
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
    }

    /// A panic while deciding leaves the gate open, not stuck deciding.
    #[test]
    fn a_panicking_decision_reopens() {
        let g = Gate::default();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            g.close_if(|| panic!("decision failed"))
        }));
        assert!(r.is_err());
        assert!(g.enter().is_some());
    }
}
