//! Teardown, in the order the [`Backend`](crate::Backend) trait documents, and its
//! report.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use super::Agent;
use crate::error::{Error, ErrorKind};
use crate::gpu::reaper;

/// Agents of this process not yet shut down or dropped. Process-wide services that
/// no one agent owns (the GPU reaper thread) stop with the last of them.
static LIVE_AGENTS: AtomicUsize = AtomicUsize::new(0);

/// One agent's place in [`LIVE_AGENTS`], given up once.
#[derive(Debug)]
pub(super) struct LiveAgent(AtomicBool);

impl LiveAgent {
    pub(super) fn new() -> Self {
        LIVE_AGENTS.fetch_add(1, Ordering::AcqRel);
        Self(AtomicBool::new(true))
    }

    /// Stop counting this agent; the process's last one stops the GPU reaper and
    /// gets it to join.
    pub(super) fn leave(&self) -> Option<reaper::Stopping> {
        if self.0.swap(false, Ordering::AcqRel) && LIVE_AGENTS.fetch_sub(1, Ordering::AcqRel) == 1 {
            reaper::stop()
        } else {
            None
        }
    }
}

/// What [`Agent::shutdown`] could not stop cleanly.
#[derive(Debug, Default)]
#[must_use = "the report says what did not stop in time; check `is_clean()`"]
pub struct ShutdownReport {
    /// Transfers still in flight when the drain timeout passed (then cancelled).
    pub canceled_transfers: usize,
    /// Backends whose shutdown, deregistration or destruction failed or overran, with
    /// the error.
    pub backend_errors: Vec<(String, Error)>,
    /// Exchange hooks (lease revocation, ...) that failed or overran.
    pub exchange_errors: Vec<Error>,
    /// Agent tasks (listeners, connections, ...) still running at the deadline.
    pub tasks_left: usize,
    /// Backend OS threads still running at the deadline, by name (left detached).
    pub threads_left: Vec<String>,
    /// Whether this call found the agent already shut down.
    pub already_shut_down: bool,
}

impl ShutdownReport {
    /// Nothing was cancelled, failed or left running.
    pub fn is_clean(&self) -> bool {
        self.canceled_transfers == 0
            && self.backend_errors.is_empty()
            && self.exchange_errors.is_empty()
            && self.tasks_left == 0
            && self.threads_left.is_empty()
    }
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

impl Agent {
    /// Stop, in order: refuse new work; drain in-flight transfers (up to
    /// [`AgentOptions::drain_timeout`](crate::AgentOptions::drain_timeout), then cancel
    /// them); run the exchanges' hooks; cancel every task and stop the backends'
    /// threads; stop the backends (listeners, connections) concurrently; deregister
    /// all memory; destroy the backends' contexts; wait for every task. Everything
    /// after draining shares one bound,
    /// [`AgentOptions::shutdown_timeout`](crate::AgentOptions::shutdown_timeout).
    /// Returns what did not stop cleanly. Calling it again is harmless: a call made
    /// while another is running waits for that one to finish, then returns a report
    /// with [`ShutdownReport::already_shut_down`] set.
    ///
    /// # Cancel safety
    /// Not cancel-safe: dropping the future part way leaves the agent stopped
    /// part way (it still refuses new work, and dropping it finishes teardown).
    pub async fn shutdown(&self) -> ShutdownReport {
        let s = &self.shared;
        let mut report = ShutdownReport::default();
        if !s.running.swap(false, Ordering::AcqRel) {
            report.already_shut_down = true;
            let mut done = s.shut_down.subscribe();
            // An error means the sender is gone, and with it the agent.
            let _ = done.wait_for(|&d| d).await;
            return report;
        }
        // 1. New work is refused from here on. A metadata load already past its check
        // finishes first (loads are short and never wait on this task), so the
        // backends stop with every link it made; later ones see the stop.
        drop(s.loading.lock().unwrap_or_else(|p| p.into_inner()));
        // 2. Drain.
        let drain = async {
            loop {
                let notified = s.inflight.zero.notified();
                if s.inflight.get() == 0 {
                    break;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(s.options.drain_timeout, drain)
            .await
            .is_err()
        {
            report.canceled_transfers = s.inflight.get();
            tracing::warn!(agent = %s.name, n = report.canceled_transfers, "transfers still in flight after the drain timeout; cancelling");
        }
        let bound = s.options.shutdown_timeout;
        let deadline = Instant::now() + bound;
        // 3. Exchange hooks (revoke leases, ...) while connections still work.
        let hooks = std::mem::take(&mut *s.shutdown_hooks.lock().unwrap());
        let hooks = join_all(
            hooks
                .into_iter()
                .map(|h| tokio::time::timeout(left(deadline), h())),
        );
        for r in hooks.await {
            if r.is_err() {
                report.exchange_errors.push(Error::new(
                    ErrorKind::TimedOut,
                    "shutdown exchange",
                    format!("an exchange's shutdown hook did not finish within {bound:?}"),
                ));
            }
        }
        // 4. Every task sees the token; threads are woken to see theirs.
        s.cancel.cancel();
        s.threads.stop();
        // 5. Backends stop listeners and close connections, all at once.
        let stops = join_all(s.backends.iter().map(|b| async move {
            let t = left(deadline);
            match tokio::time::timeout(t, b.shutdown(t)).await {
                Ok(r) => r,
                Err(_) => Err(Error::new(
                    ErrorKind::TimedOut,
                    "shutdown backend",
                    format!("did not stop within the shutdown bound of {bound:?}"),
                )),
            }
        }))
        .await;
        for (b, r) in s.backends.iter().zip(stops) {
            if let Err(e) = r {
                report.backend_errors.push((b.name().to_owned(), e));
            }
        }
        report.threads_left = s.threads.join(deadline).await;
        s.peers.write().unwrap().clear();
        // 6. Deregister memory, now that no connection can reach it.
        let regions: Vec<_> = s.regions.read().unwrap().by_id.values().cloned().collect();
        for r in &regions {
            report.backend_errors.extend(self.unregister_region(r));
        }
        // 7. Destroy what the backends hold last (contexts, protection domains).
        for b in &s.backends {
            if let Err(e) = b.destroy() {
                report.backend_errors.push((b.name().to_owned(), e));
            }
        }
        // 8. The agent's own tasks.
        s.tracker.close();
        if tokio::time::timeout(left(deadline), s.tracker.wait())
            .await
            .is_err()
        {
            report.tasks_left = s.tracker.len();
            tracing::warn!(agent = %s.name, tasks = report.tasks_left, "tasks still running after the shutdown bound");
        }
        // 9. The process's last agent stops the GPU reaper.
        if let Some(reaper) = s.live.leave() {
            report.threads_left.extend(reaper.join(deadline).await);
        }
        if !report.threads_left.is_empty() {
            tracing::error!(agent = %s.name, threads = ?report.threads_left, "backend threads still running after the shutdown bound");
        }
        s.shut_down.send_replace(true);
        report
    }
}
