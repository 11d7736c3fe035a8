//! Same-agent transfers: copies by the agent, whatever backends are attached (host
//! memory by `memmove`, GPU memory by device copies, see [`crate::gpu`]).

use bytes::Bytes;

use crate::backend::{NotificationSink, PreparedTransfer, Segments, Target};
use crate::completion::{Completer, Op};

/// Name reported by [`XferRequest::backend`](crate::XferRequest::backend) for requests
/// the agent serves itself.
pub(crate) const AGENT_COPY: &str = "agent";

/// Segments between regions of one agent, copied by the agent.
#[derive(Debug)]
pub(super) struct LocalCopy {
    pub(super) op: Op,
    pub(super) segments: Segments,
    pub(super) agent: String,
    pub(super) sink: NotificationSink,
}

impl PreparedTransfer for LocalCopy {
    fn post(&self, notif: Option<Bytes>, done: Completer) {
        for s in self.segments.iter() {
            let Target::Local(target) = &s.target else {
                unreachable!("a same-agent request has local targets")
            };
            let r = match self.op {
                Op::Write => target.copy_from(&s.local),
                Op::Read => s.local.copy_from(target),
            };
            if let Err(e) = r {
                return done.complete(Err(e));
            }
        }
        // The data is in place: now the notification.
        if let Some(n) = notif {
            self.sink.deliver_own(&self.agent, n);
        }
        done.complete(Ok(()));
    }
}
