//! The end of a transfer split into stripes over several connections or queue pairs
//! of one peer (nixl-tcp's connections, nixl-verbs' queue pairs).
//!
//! The first lane carries its stripe, then the gate: nothing queued behind the gate
//! on that lane goes before every stripe has completed; then the transfer's
//! notification goes first (so notifications keep posting order and follow all of
//! their transfer's data, as on one lane), or its outcome is reported. Whoever lets
//! go last (the lane that stopped, or the last stripe completing after it) finishes
//! a transfer left in the gate, so it never ends as "dropped without completing".

use std::sync::Mutex;

use bytes::Bytes;
use tokio::sync::Notify;

use crate::completion::Completer;
use crate::error::{Error, ErrorKind, Result};

/// A split transfer whose every stripe completed: its completer, the stripes'
/// combined result, and the notification to send.
#[derive(Debug)]
pub struct Outcome {
    /// Completes the transfer.
    pub done: Completer,
    /// The stripes' combined result.
    pub result: Result<()>,
    /// The notification to send after the data, if any.
    pub notif: Option<Bytes>,
}

impl Outcome {
    /// Finish without the first lane: the data moved (or failed) already; only a
    /// notification can no longer be sent (`why`).
    pub fn finish_without_lane(self, why: Error) {
        let r = match (self.result, self.notif) {
            (Err(e), _) => Err(e),
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(_)) => Err(why),
        };
        self.done.complete(r);
    }
}

/// Where a split transfer's outcome meets its first lane: it sits on the first lane
/// after that lane's stripe and holds back what follows until every stripe completed;
/// then the transfer's notification goes first, or its outcome is reported. Whoever
/// lets go last (the lane that stopped, or the last stripe) finishes the transfer.
#[derive(Debug)]
pub struct StripeGate {
    op: &'static str,
    peer: String,
    state: Mutex<State>,
    ready: Notify,
}

#[derive(Debug, Default)]
struct State {
    outcome: Option<Outcome>,
    /// The first lane went away before the gate was passed.
    closed: Option<Error>,
}

impl StripeGate {
    /// A gate for a transfer of operation `op` (in errors) to `peer`.
    pub fn new(op: &'static str, peer: &str) -> Self {
        Self {
            op,
            peer: peer.to_owned(),
            state: Mutex::new(State::default()),
            ready: Notify::new(),
        }
    }

    /// Every stripe completed: hand the outcome to the first lane, or finish it here
    /// when that lane is gone.
    pub fn open(&self, outcome: Outcome) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &st.closed {
            let e = e.cloned();
            drop(st);
            return outcome.finish_without_lane(e);
        }
        st.outcome = Some(outcome);
        drop(st);
        self.ready.notify_one();
    }

    /// The outcome, once every stripe completed; `None` before, and after it was
    /// taken (a lane that polls takes it when it reaches the gate).
    pub fn take(&self) -> Option<Outcome> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .outcome
            .take()
    }

    /// Wait until open and take the outcome (for a lane that is a task). Dropping
    /// the wait leaves the outcome to [`StripeGate::close`] or the gate's drop.
    pub async fn wait(&self) -> Outcome {
        loop {
            let ready = self.ready.notified();
            if let Some(o) = self.take() {
                return o;
            }
            ready.await;
        }
    }

    /// The first lane is gone (failed, or its writer stopped): finish the transfer
    /// now if its stripes are done, else when they are; a notification that can no
    /// longer be sent fails it with `why`.
    pub fn close(&self, why: Error) {
        let outcome = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.closed.get_or_insert_with(|| why.cloned());
            st.outcome.take()
        };
        if let Some(o) = outcome {
            o.finish_without_lane(why);
        }
    }

    /// The error a notification that can no longer be sent fails with, when the
    /// lane's connection closed.
    pub fn closed_error(&self) -> Error {
        Error::new(
            ErrorKind::RemoteDisconnected,
            self.op,
            format!(
                "peer {:?}: the connection closed before the notification was sent",
                self.peer
            ),
        )
    }
}

impl Drop for StripeGate {
    fn drop(&mut self) {
        let outcome = self
            .state
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .outcome
            .take();
        if let Some(o) = outcome {
            o.finish_without_lane(self.closed_error());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::completion::{CompletionState, Status};

    fn outcome(result: Result<()>, notif: Option<&'static str>) -> (Outcome, Arc<CompletionState>) {
        let state = CompletionState::standalone();
        (
            Outcome {
                done: Completer::new(state.clone()),
                result,
                notif: notif.map(|n| Bytes::from_static(n.as_bytes())),
            },
            state,
        )
    }

    #[tokio::test]
    async fn the_lane_takes_the_outcome_once_every_stripe_completed() {
        let g = StripeGate::new("test transfer", "peer");
        assert!(g.take().is_none());
        let (o, _t) = outcome(Ok(()), Some("n"));
        g.open(o);
        let o = g.wait().await;
        assert_eq!(o.notif.as_deref(), Some(&b"n"[..]));
        assert!(g.take().is_none(), "taken once");
    }

    #[test]
    fn a_gone_lane_fails_only_what_still_needed_it() {
        // Closed first, outcome later: a notification can no longer be sent.
        let g = StripeGate::new("test transfer", "peer");
        g.close(g.closed_error());
        let (o, t) = outcome(Ok(()), Some("n"));
        g.open(o);
        assert_eq!(t.status(), Status::Failed(ErrorKind::RemoteDisconnected));
        // Without a notification the data is in place: done.
        let g = StripeGate::new("test transfer", "peer");
        let (o, t) = outcome(Ok(()), None);
        g.open(o);
        g.close(g.closed_error());
        assert_eq!(t.status(), Status::Done);
        // A stripe's failure is reported as it is.
        let g = StripeGate::new("test transfer", "peer");
        let (o, t) = outcome(
            Err(Error::new(ErrorKind::Backend, "x", "stripe")),
            Some("n"),
        );
        g.open(o);
        drop(g);
        assert_eq!(t.status(), Status::Failed(ErrorKind::Backend));
        // Dropped with the outcome in it: finished, never left unreported.
        let g = StripeGate::new("test transfer", "peer");
        let (o, t) = outcome(Ok(()), Some("n"));
        g.open(o);
        drop(g);
        assert_eq!(t.status(), Status::Failed(ErrorKind::RemoteDisconnected));
    }
}
