//! The background calls a drop-in surface's agent makes on the caller's behalf
//! (NIXL's metadata calls return at once; asyncio waiters): tracked, cancelled
//! and waited for (bounded) when the agent goes.

use std::future::Future;
use std::time::Duration;

use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// One agent's background calls.
#[derive(Debug, Default)]
pub struct Background {
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl Background {
    /// The tracker every background task of the agent runs under.
    pub fn tracker(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Cancelled when the agent stops.
    pub fn token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Run `fut` on `rt` until it ends or the agent stops; a failure is logged as
    /// `what` failing.
    pub fn spawn_logged(
        &self,
        rt: &Runtime,
        what: &'static str,
        fut: impl Future<Output = nixl::Result<()>> + Send + 'static,
    ) {
        let cancel = self.cancel.clone();
        rt.spawn(self.tasks.track_future(async move {
            tokio::select! {
                r = fut => if let Err(e) = r {
                    tracing::warn!(error = %e, "{what} failed");
                },
                () = cancel.cancelled() => {}
            }
        }));
    }

    /// Cancel every task and wait up to `bound` for them; whether they all ended.
    pub async fn stop(&self, bound: Duration) -> bool {
        self.cancel.cancel();
        self.tasks.close();
        tokio::time::timeout(bound, self.tasks.wait()).await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_cancels_and_waits() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let bg = Background::default();
        bg.spawn_logged(&rt, "forever", std::future::pending());
        assert_eq!(bg.tracker().len(), 1);
        assert!(
            rt.block_on(bg.stop(Duration::from_secs(5))),
            "cancelled at once"
        );
        assert!(bg.tracker().is_empty());
        assert!(bg.token().is_cancelled());
    }
}
