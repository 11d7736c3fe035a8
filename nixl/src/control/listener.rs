//! One accept loop for every backend's control listener: accept, admit
//! ([`Admission`]), hand each connection to the backend's task, back off when
//! accepting fails.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::admission::{Admission, Ticket};

/// How long the loop waits after a failed accept (out of file descriptors, most
/// likely) before it tries again, having closed the oldest connection still in its
/// handshake.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// A connection the listener accepted and admitted, for the backend to serve.
#[derive(Debug)]
pub struct Incoming {
    /// The socket.
    pub stream: TcpStream,
    /// Where it came from.
    pub from: SocketAddr,
    /// Its place in the admission: the backend establishes it
    /// ([`Ticket::establish_with`]) once the peer proved itself, and holds it while it
    /// serves.
    pub ticket: Ticket,
    /// Cancelled when the admission closes this connection to make room (see
    /// [`Admission`]) or when the listener's token is cancelled: the backend's task
    /// ends soon after.
    pub close: CancellationToken,
}

/// Serve a connection until `serve` ends or `close` fires, and then drop it at once:
/// for a connection task whose every step may simply stop (nothing it holds needs an
/// orderly end). One that must clean up on the way out (nixl-verbs' queue pairs)
/// watches [`Incoming::close`] itself instead.
pub async fn until_closed(close: CancellationToken, serve: impl Future<Output = ()>) {
    tokio::select! {
        _ = close.cancelled() => {}
        _ = serve => {}
    }
}

/// Accept connections on `listener` until `cancel` fires, each admitted by
/// `admission` and served by `serve` in a task of `tracker`'s. `backend` names the
/// listener in logs.
///
/// When accepting fails, the loop closes the oldest connection still in its
/// handshake ([`Admission::shed_oldest`]) and waits [`ACCEPT_BACKOFF`], so a process
/// out of descriptors frees one for a legitimate peer instead of spinning.
pub fn spawn_accept_loop<F, Fut>(
    backend: &'static str,
    listener: TcpListener,
    admission: Arc<Admission>,
    tracker: &TaskTracker,
    cancel: CancellationToken,
    serve: F,
) where
    F: Fn(Incoming) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let conns = tracker.clone();
    tracker.spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = cancel.cancelled() => break,
                r = listener.accept() => r,
            };
            match accepted {
                Ok((stream, from)) => {
                    let close = cancel.child_token();
                    let ticket = admission.admit(from.ip(), close.clone());
                    conns.spawn(serve(Incoming {
                        stream,
                        from,
                        ticket,
                        close,
                    }));
                }
                Err(e) => {
                    tracing::warn!(backend, error = %e, "accept failed");
                    admission.shed_oldest();
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    }
                }
            }
        }
        tracing::debug!(backend, "listener stopped");
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::AdmissionLimits;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn admits_serves_evicts_and_stops() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admission = Admission::exactly(AdmissionLimits::new(1, 4));
        let (tracker, cancel) = (TaskTracker::new(), CancellationToken::new());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        spawn_accept_loop(
            "test",
            listener,
            admission.clone(),
            &tracker,
            cancel.clone(),
            move |c: Incoming| {
                let tx = tx.clone();
                async move {
                    // Served (socket and ticket held) until closed: the first by the
                    // second's admission, the second when the listener stops.
                    let Incoming {
                        stream,
                        from,
                        ticket,
                        close,
                    } = c;
                    close.cancelled().await;
                    drop((stream, ticket));
                    tx.send(from).unwrap();
                }
            },
        );
        let mut first = TcpStream::connect(addr).await.unwrap();
        let second = TcpStream::connect(addr).await.unwrap();
        // One handshake place: the second's admission closed the first.
        let evicted = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(evicted, first.local_addr().unwrap());
        let _ = first.read(&mut [0u8; 1]).await;
        cancel.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stopped, second.local_addr().unwrap());
        tracker.close();
        tokio::time::timeout(Duration::from_secs(10), tracker.wait())
            .await
            .unwrap();
        assert_eq!(admission.counts(), (0, 0));
    }
}
