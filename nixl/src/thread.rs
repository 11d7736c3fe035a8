//! OS threads the agent owns on behalf of its backends.
//!
//! Native libraries often need a thread of their own: a progress loop that sleeps in
//! `poll(2)`, a blocking accept loop. Such a thread must never outlive its agent and
//! must never hang teardown. The agent's [`ThreadSet`] stops (a [`CancellationToken`]
//! the thread's body watches), wakes (a backend-supplied function that interrupts the
//! blocking call: writing an event fd, calling a library's stop-accept) and joins
//! every thread with a bound, from [`Agent::shutdown`](crate::Agent::shutdown) and from
//! dropping the agent alike. No tokio task takes part, so this works after the tokio
//! runtime is gone. A thread that does not end within the bound is left detached and
//! named in the [`ShutdownReport`](crate::ShutdownReport), never waited on forever.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::error::{Error, ErrorKind, Result};

/// What wakes a backend thread out of a blocking call so it sees its stop token.
pub type ThreadWake = Arc<dyn Fn() + Send + Sync + 'static>;

struct Owned {
    name: String,
    stop: CancellationToken,
    wake: ThreadWake,
    handle: JoinHandle<()>,
}

/// The threads of one agent.
#[derive(Default)]
pub(crate) struct ThreadSet {
    threads: Mutex<Vec<Owned>>,
    /// Set once the set was stopped: later spawns are refused.
    closed: Mutex<bool>,
}

impl fmt::Debug for ThreadSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadSet")
            .field("threads", &self.names())
            .finish()
    }
}

impl ThreadSet {
    /// Start `body` on a new thread named `name`. `body` gets a token that is
    /// cancelled when the agent stops; `wake` is called right after cancelling, to
    /// interrupt whatever the thread blocks in. Threads that ended on their own are
    /// joined here, and their `wake` dropped, on the calling thread: a `wake` should
    /// hold nothing whose drop does real work (a weak reference, a sender).
    pub(crate) fn spawn(
        &self,
        name: &str,
        parent: &CancellationToken,
        body: Box<dyn FnOnce(CancellationToken) + Send + 'static>,
        wake: ThreadWake,
    ) -> Result<()> {
        const OP: &str = "spawn backend thread";
        let closed = self.closed.lock().unwrap();
        if *closed || parent.is_cancelled() {
            return Err(Error::new(
                ErrorKind::ShutDown,
                OP,
                format!("the agent is shutting down; thread {name:?} not started"),
            ));
        }
        let stop = parent.child_token();
        let token = stop.clone();
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || body(token))
            .map_err(|e| {
                Error::new(
                    ErrorKind::Backend,
                    OP,
                    format!("cannot start thread {name:?}"),
                )
                .with_source(e)
            })?;
        let finished: Vec<Owned> = {
            let mut threads = self.threads.lock().unwrap();
            // Threads that ended on their own (one per connection, say) are joined
            // here, so a long-lived agent's set holds only live ones.
            let (done, live) = std::mem::take(&mut *threads)
                .into_iter()
                .partition(|t| t.handle.is_finished());
            *threads = live;
            threads.push(Owned {
                name: name.to_owned(),
                stop,
                wake,
                handle,
            });
            done
        };
        drop(closed);
        finished.into_iter().for_each(join);
        Ok(())
    }

    /// Names of the threads still running.
    pub(crate) fn names(&self) -> Vec<String> {
        self.threads
            .lock()
            .unwrap()
            .iter()
            .filter(|t| !t.handle.is_finished())
            .map(|t| t.name.clone())
            .collect()
    }

    /// Refuse new threads, cancel every thread's token and wake it.
    pub(crate) fn stop(&self) {
        *self.closed.lock().unwrap() = true;
        // Wakes run outside the lock: a wake may look at the agent's threads itself.
        let wakes: Vec<(CancellationToken, ThreadWake)> = self
            .threads
            .lock()
            .unwrap()
            .iter()
            .map(|t| (t.stop.clone(), t.wake.clone()))
            .collect();
        for (stop, wake) in wakes {
            stop.cancel();
            wake();
        }
    }

    /// Take the threads that have finished (joined) and those still running.
    fn take(&self) -> Vec<Owned> {
        std::mem::take(&mut *self.threads.lock().unwrap())
    }

    /// Stop, then join every thread until `deadline`, blocking the calling thread.
    /// Returns the names of threads that did not end in time (left detached).
    pub(crate) fn join_blocking(&self, deadline: Instant) -> Vec<String> {
        self.stop();
        let mut left = Vec::new();
        for t in self.take() {
            if t.handle.thread().id() == std::thread::current().id() {
                // The agent was dropped on its own backend thread: that thread ends
                // on its own once this returns (its token is cancelled).
                continue;
            }
            let mut pause = Duration::from_micros(50);
            while !t.handle.is_finished() && Instant::now() < deadline {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(2));
            }
            finish(t, &mut left);
        }
        left
    }

    /// Stop, then join every thread until `deadline` without blocking the runtime.
    pub(crate) async fn join(&self, deadline: Instant) -> Vec<String> {
        self.stop();
        let mut left = Vec::new();
        for t in self.take() {
            let mut pause = Duration::from_micros(50);
            while !t.handle.is_finished() && Instant::now() < deadline {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(2));
            }
            finish(t, &mut left);
        }
        left
    }
}

/// Join a thread that has finished.
fn join(t: Owned) {
    if t.handle.join().is_err() {
        tracing::error!(thread = %t.name, "backend thread panicked");
    }
}

fn finish(t: Owned, left: &mut Vec<String>) {
    if t.handle.is_finished() {
        join(t);
    } else {
        tracing::error!(thread = %t.name, "backend thread did not stop in time; left detached");
        left.push(t.name);
    }
}

/// Handle for starting backend threads, part of the [`BackendContext`](crate::BackendContext).
#[derive(Clone)]
pub struct ThreadSpawner {
    pub(crate) set: Arc<ThreadSet>,
    pub(crate) cancel: CancellationToken,
}

impl fmt::Debug for ThreadSpawner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadSpawner").finish_non_exhaustive()
    }
}

impl ThreadSpawner {
    /// Start an OS thread the agent owns. See
    /// [`BackendContext::spawn_thread`](crate::BackendContext::spawn_thread).
    ///
    /// # Errors
    /// [`ErrorKind::ShutDown`] once the agent stops; [`ErrorKind::Backend`] when the
    /// OS refuses a thread.
    pub fn spawn<F, W>(&self, name: &str, body: F, wake: W) -> Result<()>
    where
        F: FnOnce(CancellationToken) + Send + 'static,
        W: Fn() + Send + Sync + 'static,
    {
        self.set
            .spawn(name, &self.cancel, Box::new(body), Arc::new(wake))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn stop_wakes_and_joins() {
        let set = ThreadSet::default();
        let root = CancellationToken::new();
        let woke = Arc::new(AtomicBool::new(false));
        let w = woke.clone();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        set.spawn(
            "t-wake",
            &root,
            Box::new(move |_stop| {
                // Blocks until woken: only the wake ends it.
                let _ = rx.recv();
            }),
            Arc::new(move || {
                w.store(true, Ordering::SeqCst);
                let _ = tx.send(());
            }),
        )
        .unwrap();
        assert_eq!(set.names(), ["t-wake"]);
        let left = set.join_blocking(Instant::now() + Duration::from_secs(5));
        assert!(left.is_empty(), "{left:?}");
        assert!(woke.load(Ordering::SeqCst));
        assert!(set.names().is_empty());
        // Closed: no new threads.
        let e = set
            .spawn("late", &root, Box::new(|_| {}), Arc::new(|| {}))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ShutDown);
    }

    #[test]
    fn finished_threads_are_joined_at_the_next_spawn() {
        let set = ThreadSet::default();
        let root = CancellationToken::new();
        set.spawn("short", &root, Box::new(|_| {}), Arc::new(|| {}))
            .unwrap();
        while !set.threads.lock().unwrap()[0].handle.is_finished() {
            std::thread::sleep(Duration::from_millis(1));
        }
        set.spawn(
            "long",
            &root,
            Box::new(|stop| {
                while !stop.is_cancelled() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }),
            Arc::new(|| {}),
        )
        .unwrap();
        let held: Vec<String> = set
            .threads
            .lock()
            .unwrap()
            .iter()
            .map(|t| t.name.clone())
            .collect();
        assert_eq!(held, ["long"]);
        let left = set.join_blocking(Instant::now() + Duration::from_secs(5));
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn overrun_is_reported_not_waited_on() {
        let set = ThreadSet::default();
        let root = CancellationToken::new();
        let release = Arc::new(AtomicBool::new(false));
        let r = release.clone();
        set.spawn(
            "t-stuck",
            &root,
            Box::new(move |_stop| {
                // Ignores its token until the test lets it go.
                while !r.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }),
            Arc::new(|| {}),
        )
        .unwrap();
        let t0 = Instant::now();
        let left = set.join_blocking(Instant::now() + Duration::from_millis(50));
        assert_eq!(left, ["t-stuck"]);
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "join was not bounded"
        );
        release.store(true, Ordering::SeqCst);
    }

    #[tokio::test]
    async fn async_join_sees_the_token() {
        let set = ThreadSet::default();
        let root = CancellationToken::new();
        set.spawn(
            "t-token",
            &root,
            Box::new(|stop: CancellationToken| {
                while !stop.is_cancelled() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }),
            Arc::new(|| {}),
        )
        .unwrap();
        let left = set.join(Instant::now() + Duration::from_secs(5)).await;
        assert!(left.is_empty(), "{left:?}");
    }
}
