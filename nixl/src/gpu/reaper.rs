//! The thread that frees what asynchronous GPU copies held after their futures were
//! dropped (page-locked buffers, the memory they copied).
//!
//! The driver's completion callback may make no CUDA call, so it cannot free that
//! memory itself: it sends it here instead, and this thread drops it. Nothing polls:
//! the thread sleeps in a channel receive until a callback sends, and ends once
//! nobody can send any more, that is, once it has been told to stop and every copy
//! that was orphaned before has finished. It starts at the first orphaned copy,
//! and the shutdown of the process's last agent stops it, joined within the shutdown
//! bound ([`stop`]); an overrun is named in that agent's shutdown report.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What an orphaned copy held, freed on the reaper's thread.
pub(crate) type Held = Box<dyn Any + Send>;

/// The thread's name, as shutdown reports name it.
const NAME: &str = "nixl-gpu-reaper";

/// Where a finished orphan's holdings go. Each orphaned copy keeps one until its
/// callback has sent what it held, so the thread runs until the last one is in.
#[derive(Debug, Clone)]
pub(crate) struct Grave {
    tx: Sender<Held>,
    pending: Arc<AtomicUsize>,
}

impl Grave {
    /// Hand over what a finished copy held (from the driver's callback: no CUDA call
    /// is made here). Dropping `self` afterwards lets the thread end once it was told
    /// to stop.
    pub(crate) fn bury(self, held: Held) {
        if let Err(back) = self.tx.send(held) {
            // The thread is gone (it cannot be while a Grave lives, as the Grave
            // keeps the channel open); never free in the callback: leak instead.
            tracing::error!("the GPU reaper is gone; leaking a finished copy's buffers");
            std::mem::forget(back.0);
        }
    }
}

struct Reaper {
    grave: Grave,
    handle: JoinHandle<()>,
}

static REAPER: Mutex<Option<Reaper>> = Mutex::new(None);

/// A grave for one more orphaned copy, starting the thread if it is not running.
/// `None` when the OS refuses a thread.
pub(crate) fn adopt() -> Option<Grave> {
    let mut g = REAPER.lock().unwrap_or_else(PoisonError::into_inner);
    if g.is_none() {
        let (tx, rx) = channel::<Held>();
        let pending = Arc::new(AtomicUsize::new(0));
        let left = pending.clone();
        let handle = std::thread::Builder::new()
            .name(NAME.into())
            .spawn(move || {
                for held in rx {
                    drop(held);
                    left.fetch_sub(1, Ordering::AcqRel);
                }
            });
        match handle {
            Ok(handle) => {
                *g = Some(Reaper {
                    grave: Grave { tx, pending },
                    handle,
                })
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot start the GPU reaper thread");
                return None;
            }
        }
    }
    let r = g.as_ref().expect("started above");
    r.grave.pending.fetch_add(1, Ordering::AcqRel);
    Some(r.grave.clone())
}

/// Orphaned copies not yet freed (tests on the host stand-in).
#[cfg(all(test, feature = "gpu-test-double"))]
pub(crate) fn pending() -> usize {
    REAPER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .map_or(0, |r| r.grave.pending.load(Ordering::Acquire))
}

/// The reaper being stopped: it ends once every orphaned copy has finished.
#[derive(Debug)]
pub(crate) struct Stopping {
    handle: JoinHandle<()>,
    pending: Arc<AtomicUsize>,
}

/// Tell the reaper to stop (the process's last agent is shutting down). `None` when
/// it was not running. A later orphaned copy starts a new one.
pub(crate) fn stop() -> Option<Stopping> {
    let r = REAPER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()?;
    // Dropping our sender leaves only the orphans' ones: the thread's receive loop
    // ends when the last of them is buried.
    let Reaper { grave, handle } = r;
    let pending = grave.pending.clone();
    drop(grave);
    Some(Stopping { handle, pending })
}

impl Stopping {
    /// Whether the thread has ended.
    pub(crate) fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Join the thread (it has ended), or leave it detached past the deadline and
    /// say why, for the shutdown report.
    pub(crate) fn finish(self) -> Option<String> {
        if self.handle.is_finished() {
            let _ = self.handle.join();
            None
        } else {
            Some(format!(
                "{NAME} ({} orphaned GPU copies still running)",
                self.pending.load(Ordering::Acquire)
            ))
        }
    }

    /// Wait for the thread until `deadline`, blocking this thread (for `Drop`).
    pub(crate) fn join_blocking(self, deadline: Instant) -> Option<String> {
        while !self.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.finish()
    }

    /// Wait for the thread until `deadline` without blocking the runtime.
    pub(crate) async fn join(self, deadline: Instant) -> Option<String> {
        while !self.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.finish()
    }
}
