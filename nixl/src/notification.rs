//! Notifications: a stream of `(peer, bytes)` per agent.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_core::Stream;
use tokio::sync::mpsc;

use crate::error::{err, ErrorKind, Result};

/// A notification received from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Name of the agent that sent it.
    pub peer: String,
    /// Its bytes.
    pub msg: Bytes,
}

pub(crate) type Slot = Arc<Mutex<Option<mpsc::UnboundedReceiver<Notification>>>>;

/// The agent's incoming notifications, in arrival order (per peer: the order the peer
/// posted them). Also a [`Stream`].
///
/// One handle exists at a time; dropping it hands the queue back to the agent, so
/// nothing is lost between handles.
pub struct Notifications {
    rx: Option<mpsc::UnboundedReceiver<Notification>>,
    slot: Slot,
}

impl Notifications {
    pub(crate) fn new(rx: mpsc::UnboundedReceiver<Notification>, slot: Slot) -> Self {
        Self { rx: Some(rx), slot }
    }

    /// The next notification; `None` once the agent and its backends are gone.
    ///
    /// # Cancel safety
    /// Cancel-safe: a notification is never lost by dropping this future.
    pub async fn recv(&mut self) -> Option<Notification> {
        self.rx.as_mut()?.recv().await
    }

    /// A notification if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Option<Notification> {
        self.rx.as_mut()?.try_recv().ok()
    }
}

impl Stream for Notifications {
    type Item = Notification;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Notification>> {
        match self.rx.as_mut() {
            Some(rx) => rx.poll_recv(cx),
            None => Poll::Ready(None),
        }
    }
}

impl Drop for Notifications {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            *self.slot.lock().unwrap() = Some(rx);
        }
    }
}

impl fmt::Debug for Notifications {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifications").finish_non_exhaustive()
    }
}

/// A notification longer than the backend carries (`max`, its
/// [`Capabilities::max_notification`]) is refused before it is sent.
pub(crate) fn check_notification(
    msg: &[u8],
    max: usize,
    backend: &str,
    op: &'static str,
) -> Result<()> {
    if msg.len() > max {
        return err(
            ErrorKind::InvalidArgument,
            op,
            format!(
                "notification of {} bytes exceeds {backend}'s limit of {max}",
                msg.len()
            ),
        );
    }
    Ok(())
}
