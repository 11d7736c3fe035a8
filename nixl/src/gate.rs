//! The gate every backend access to a registration passes: deregistration closes it,
//! and once [`Gate::close`] has returned no byte of the memory is touched again.
//!
//! A target that moves bytes itself (nixl-tcp receiving a peer's WRITE into
//! registered memory, or sending a READ from it) copies at the peer's pace; a request
//! that passed its key check before the registration was withdrawn would otherwise go
//! on writing into memory the application has already freed (a framework's tensor
//! handed in by address). Each access is one copy or one non-blocking system call,
//! entered and left around it, never held across an await; closing waits only for the
//! accesses running at that moment, so it takes microseconds and cannot deadlock on a
//! single-threaded runtime.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

/// Accesses in progress and whether new ones are refused.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    active: AtomicUsize,
    closed: AtomicBool,
}

/// One access in progress; leaving the gate when dropped.
#[must_use]
pub(crate) struct Access<'a>(&'a Gate);

impl Drop for Access<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, SeqCst);
    }
}

impl Gate {
    /// Enter for one access, or `None` once the gate is closed.
    pub(crate) fn enter(&self) -> Option<Access<'_>> {
        // Counted first, checked second; `close` sets the flag first and counts
        // second: with sequentially consistent order one of the two sees the other.
        self.active.fetch_add(1, SeqCst);
        let access = Access(self);
        (!self.closed.load(SeqCst)).then_some(access)
    }

    /// Refuse new accesses and wait for those in progress (each a single copy or
    /// system call) to end.
    pub(crate) fn close(&self) {
        self.closed.store(true, SeqCst);
        let mut waited = 0u32;
        while self.active.load(SeqCst) != 0 {
            waited += 1;
            if waited < 100 {
                std::hint::spin_loop();
            } else if waited < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Admit accesses again (a deregistration that was refused after closing).
    pub(crate) fn reopen(&self) {
        self.closed.store(false, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    use super::Gate;

    #[test]
    fn closed_gate_refuses_and_reopens() {
        let g = Gate::default();
        assert!(g.enter().is_some());
        g.close();
        assert!(g.enter().is_none());
        g.reopen();
        assert!(g.enter().is_some());
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
}
