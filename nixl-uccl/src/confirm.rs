//! The confirmation workers (see `verify`): agent-owned threads that read registered
//! memory for digests, one for this agent's own side of its transfers and one for
//! peers' `Verify` requests (so that peers asking for much cannot starve this agent's
//! own confirmations), so neither the progress thread nor a tokio worker is held by a
//! long read (or a device copy of GPU memory).

use std::collections::HashMap;
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Duration;

use nixl::{BackendContext, Error, ErrorKind, RegionRef, RegionSlice, Result};
use tokio::sync::oneshot;

use crate::reply::Replies;
use crate::verify;
use crate::wire::Frame;

const OP: &str = "uccl transfer confirmation";

/// `Verify` requests a target keeps accepted and unanswered per control connection
/// (being digested, or waiting to be written); past it the target reads nothing more
/// from that connection until an answer is written (see `reply`).
pub(crate) const MAX_QUEUED: usize = 1024;

/// This agent's registrations.
pub(crate) type Regs = Arc<Mutex<Registry>>;

/// This agent's registrations by id (engine memory region, the region) and by
/// confirmation key (see `verify`), the way `Verify` requests name them.
#[derive(Default)]
pub(crate) struct Registry {
    by_id: HashMap<u64, (u64, RegionRef, u64)>,
    by_key: HashMap<u64, RegionRef>,
}

impl std::fmt::Debug for Registry {
    // Keys stay out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("registrations", &self.by_id.len())
            .finish()
    }
}

impl Registry {
    /// Add registration `region` (engine memory region `mr`); returns its
    /// confirmation key, a fresh random one.
    pub(crate) fn insert(&mut self, mr: u64, region: RegionRef) -> u64 {
        let key = loop {
            let k = random_key();
            if !self.by_key.contains_key(&k) {
                break k;
            }
        };
        self.by_key.insert(key, region.clone());
        // Region ids are never reused; were one registered twice, its old key goes.
        if let Some((_, _, old)) = self.by_id.insert(region.id(), (mr, region, key)) {
            self.by_key.remove(&old);
        }
        key
    }

    /// Remove registration `id`: its engine memory region and the region.
    pub(crate) fn remove(&mut self, id: u64) -> Option<(u64, RegionRef)> {
        let (mr, region, key) = self.by_id.remove(&id)?;
        self.by_key.remove(&key);
        Some((mr, region))
    }

    /// The engine memory region of registration `id`.
    pub(crate) fn mr(&self, id: u64) -> Option<u64> {
        self.by_id.get(&id).map(|(mr, _, _)| *mr)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

/// A random confirmation key (only the registration's metadata tells it).
fn random_key() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("the OS random source works");
    u64::from_le_bytes(b)
}

/// What happens to a confirmed (or refused) transfer.
pub(crate) type Then = Box<dyn FnOnce(Result<()>) + Send>;

/// Confirmations a link asked for and has no answer to yet, by request id.
pub(crate) type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Option<u64>>>>>;

/// The awaited answer to one `Verify` request. Dropped unanswered (a timeout, an
/// earlier part that failed), it takes its request out of the link's table, so
/// answers that never come leave nothing behind.
pub(crate) struct Answer {
    id: u64,
    rx: oneshot::Receiver<Option<u64>>,
    pending: Pending,
}

impl Answer {
    /// Register request `id` in `pending` and return its answer.
    pub(crate) fn expect(pending: &Pending, id: u64) -> Self {
        let (tx, rx) = oneshot::channel();
        pending.lock().unwrap().insert(id, tx);
        Self {
            id,
            rx,
            pending: pending.clone(),
        }
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        self.pending.lock().unwrap().remove(&self.id);
    }
}

/// Work for the worker.
pub(crate) enum Work {
    /// Initiator: digest each group's local slices, then compare with the target's
    /// answers as they come (all within `timeout`), and call `then`.
    Local {
        groups: Vec<(Vec<RegionSlice>, Answer)>,
        ctx: BackendContext,
        timeout: Duration,
        then: Then,
    },
    /// Target: the digest of `ranges` of this agent's registrations, answered as
    /// `Verified` on `reply` (which accepted the request).
    Remote {
        id: u64,
        ranges: Vec<(u64, u64, u64)>,
        reply: Arc<Replies>,
    },
}

/// A handle on the workers.
#[derive(Clone, Debug)]
pub(crate) struct Confirmer {
    local: std_mpsc::Sender<Option<Work>>,
    remote: std_mpsc::Sender<Option<Work>>,
}

impl Confirmer {
    /// Start the worker on an agent-owned thread (joined at shutdown); called on the
    /// agent's runtime.
    pub(crate) fn start(ctx: &BackendContext, regs: Regs) -> Result<Self> {
        Ok(Self {
            local: worker(ctx, "uccl-confirm", regs.clone())?,
            remote: worker(ctx, "uccl-verify", regs)?,
        })
    }

    /// Queue `w` on its worker; gives it back when the worker has stopped.
    pub(crate) fn submit(&self, w: Work) -> std::result::Result<(), Box<Work>> {
        let tx = match w {
            Work::Local { .. } => &self.local,
            Work::Remote { .. } => &self.remote,
        };
        tx.send(Some(w))
            .map_err(|std_mpsc::SendError(w)| Box::new(w.expect("sent Some")))
    }
}

/// Start one worker thread, named `name`.
fn worker(ctx: &BackendContext, name: &str, regs: Regs) -> Result<std_mpsc::Sender<Option<Work>>> {
    let (tx, rx) = std_mpsc::channel::<Option<Work>>();
    let wake = Mutex::new(tx.clone());
    // The agent's runtime, where the answers are awaited.
    let runtime = tokio::runtime::Handle::current();
    ctx.spawn_thread(
        name,
        move |stop| {
            let _entered = runtime.enter();
            while let Ok(Some(w)) = rx.recv() {
                if stop.is_cancelled() {
                    break;
                }
                run(w, &regs);
            }
        },
        move || {
            let _ = wake.lock().unwrap().send(None);
        },
    )?;
    Ok(tx)
}

fn run(w: Work, regs: &Regs) {
    match w {
        Work::Local {
            groups,
            ctx,
            timeout,
            then,
        } => {
            let mut ours = Vec::with_capacity(groups.len());
            let mut answers = Vec::with_capacity(groups.len());
            for (slices, rx) in groups {
                match verify::digest(&slices) {
                    Ok(d) => ours.push(d),
                    Err(e) => {
                        return then(Err(Error::new(
                            e.kind(),
                            OP,
                            format!("cannot read this side of the transfer: {e}"),
                        )))
                    }
                }
                answers.push(rx);
            }
            ctx.spawn(async move {
                let n = ours.len();
                // One bound for the whole transfer, however many parts it has.
                let deadline = tokio::time::Instant::now() + timeout;
                for (i, (d, mut answer)) in ours.into_iter().zip(answers).enumerate() {
                    let r = match tokio::time::timeout_at(deadline, &mut answer.rx).await {
                        Ok(Ok(Some(theirs))) if theirs == d => continue,
                        Ok(Ok(Some(_))) => Error::new(
                            ErrorKind::Backend,
                            OP,
                            format!("UCCL reported the transfer done, but the target's bytes differ from this side's (part {} of {n}): an operation was lost or cut short, or either side's memory changed before the transfer resolved", i + 1),
                        ),
                        Ok(Ok(None)) => Error::new(
                            ErrorKind::Backend,
                            OP,
                            "the target could not confirm the transfer (its memory was deregistered meanwhile, or the ranges asked for are not in its registrations)",
                        ),
                        Ok(Err(_)) => Error::new(
                            ErrorKind::RemoteDisconnected,
                            OP,
                            "the control connection closed before the target confirmed the transfer",
                        ),
                        Err(_) => Error::new(
                            ErrorKind::TimedOut,
                            OP,
                            format!("the target did not confirm the transfer within {timeout:?}"),
                        ),
                    };
                    return then(Err(r));
                }
                then(Ok(()));
            });
        }
        Work::Remote { id, ranges, reply } => {
            let digest = target_slices(regs, &ranges).and_then(|s| verify::digest(&s).ok());
            reply.answered(Frame::Verified { id, digest });
        }
    }
}

/// The slices of this agent's registrations that `ranges` (address here, length,
/// confirmation key) name, in order; `None` when one does not lie inside the
/// registration holding its key.
fn target_slices(regs: &Regs, ranges: &[(u64, u64, u64)]) -> Option<Vec<RegionSlice>> {
    let regs = regs.lock().unwrap();
    ranges
        .iter()
        .map(|&(addr, len, key)| regs.by_key.get(&key)?.slice_at(addr, len))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_given_up_leaves_nothing_pending() {
        let pending = Pending::default();
        let answered = Answer::expect(&pending, 1);
        let abandoned = Answer::expect(&pending, 2);
        assert_eq!(pending.lock().unwrap().len(), 2);
        // The reader takes an answered request out and sends its digest.
        let tx = pending.lock().unwrap().remove(&1).unwrap();
        tx.send(Some(7)).unwrap();
        drop(abandoned);
        assert!(pending.lock().unwrap().is_empty());
        let mut answered = answered;
        assert_eq!(answered.rx.try_recv().unwrap(), Some(7));
        drop(answered);
        assert!(pending.lock().unwrap().is_empty());
    }
}
