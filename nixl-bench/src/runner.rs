//! The measured loop: initiator threads (tokio tasks), each with its own slice of the
//! buffer and `pipeline_depth` requests in flight, timing prepare, post and completion.
//!
//! - Prep: in the default prepared mode, `make_request` for each request from
//!   descriptor lists resolved once per thread (`prep_local`/`prep_remote`, untimed);
//!   with `--recreate-xfer`, `create_request` (checks and prepares) before every post.
//! - Post: the time for [`XferRequest::post`] to return.
//! - Tx: from `post` returning until the request's completion is observed.
//! - Elapsed: from starting the threads until the last one finished.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use nixl::{
    Agent, AgentOptions, Desc, DescList, Op, PreparedDescs, RequestOptions, Transfer, XferRequest,
};
use tokio::task::JoinSet;

use crate::buffer::{Buffer, Layout, RemoteBuffer};
use crate::error::{fail, BenchError, Context, Result};
use crate::stats::{PhaseStats, Samples};

/// The initiator's side of a run: its agent, its buffer, and the target's buffer.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) agent: Arc<Agent>,
    pub(crate) local: Buffer,
    pub(crate) peer: String,
    pub(crate) remote: RemoteBuffer,
}

/// One phase (warmup or measurement) of one sweep point.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Phase {
    pub(crate) op: Op,
    pub(crate) layout: Layout,
    pub(crate) iters_per_thread: usize,
    pub(crate) recreate: bool,
    /// Merge contiguous descriptors.
    pub(crate) merge: bool,
    /// Bound on waiting for any request to complete.
    pub(crate) xfer_timeout: Duration,
}

/// Run `phase` on `layout.threads` tasks at once.
///
/// # Errors
/// The first thread's failure: a request that could not be made or posted, a transfer
/// that failed (the peer died), or no completion within the timeout (the peer hung).
pub(crate) async fn run(session: &Arc<Session>, phase: Phase) -> Result<PhaseStats> {
    let mut set = JoinSet::new();
    let start = Instant::now();
    for t in 0..phase.layout.threads {
        let s = session.clone();
        set.spawn(async move { (t, worker(&s, t, phase).await) });
    }
    let mut out = PhaseStats::default();
    // Dropping `set` on an early return aborts the other threads.
    while let Some(joined) = set.join_next().await {
        let (t, result) = joined
            .map_err(|e| BenchError::new(format!("an initiator thread ended abnormally: {e}")))?;
        let mut s = match result {
            Ok(s) => s,
            Err(e) if phase.layout.threads > 1 => return Err(e).context(format!("thread {t}")),
            Err(e) => return Err(e),
        };
        out.prep.append(&mut s.prep);
        out.post.append(&mut s.post);
        out.tx.append(&mut s.tx);
        out.segments = out.segments.max(s.segments);
        out.runs = out.runs.max(s.runs);
    }
    out.elapsed = start.elapsed();
    Ok(out)
}

/// What one request's completion carries back to the loop.
struct Done {
    slot: usize,
    result: nixl::Result<()>,
    posted: Instant,
    finished: Instant,
}

async fn track(slot: usize, transfer: Transfer, posted: Instant) -> Done {
    let result = transfer.await;
    Done {
        slot,
        result,
        posted,
        finished: Instant::now(),
    }
}

/// How a thread makes its requests.
enum Maker {
    /// Lists resolved once; requests made by index (slot `k` takes descriptors
    /// `k * batch..(k + 1) * batch`).
    Prepared {
        local: Box<PreparedDescs>,
        remote: Box<PreparedDescs>,
        batch: usize,
    },
    /// Plain lists per request, checked and prepared on every make.
    Recreate { lists: Vec<(DescList, DescList)> },
}

/// One initiator thread: `depth` requests kept in flight until `iters_per_thread`
/// have completed.
async fn worker(s: &Session, t: usize, p: Phase) -> Result<PhaseStats> {
    let l = p.layout;
    let iters = p.iters_per_thread;
    // As nixlbench: never more requests in flight than iterations.
    let depth = l.depth.min(iters);
    let mut out = PhaseStats {
        prep: Samples::with_capacity(if p.recreate { iters } else { depth }),
        post: Samples::with_capacity(iters),
        tx: Samples::with_capacity(iters),
        elapsed: Duration::ZERO,
        segments: 0,
        runs: 0,
    };
    if iters == 0 {
        return Ok(out);
    }
    let batch = l.batch_size;
    let descs = |k: std::ops::Range<usize>| -> (Vec<Desc>, Vec<Desc>) {
        k.map(|k| {
            let off = l.offset(t, k);
            (
                s.local.desc(off, l.block_size),
                s.remote.desc(off, l.block_size),
            )
        })
        .unzip()
    };
    let (lk, rk) = (s.local.kind(), s.remote.kind());
    let lists =
        |lo: Vec<Desc>, re: Vec<Desc>| (DescList::from_descs(lk, lo), DescList::from_descs(rk, re));
    let maker = if p.recreate {
        Maker::Recreate {
            lists: (0..depth)
                .map(|slot| {
                    let (lo, re) = descs(slot * batch..(slot + 1) * batch);
                    lists(lo, re)
                })
                .collect(),
        }
    } else {
        let (lo, re) = descs(0..depth * batch);
        Maker::Prepared {
            local: Box::new(s.agent.prep_local(&DescList::from_descs(lk, lo))?),
            remote: Box::new(
                s.agent
                    .prep_remote(&s.peer, &DescList::from_descs(rk, re))?,
            ),
            batch,
        }
    };
    // Off by default: every descriptor its own segment, a batch is `batch` blocks, as
    // in nixlbench.
    let options = RequestOptions {
        merge: p.merge,
        ..RequestOptions::default()
    };
    let make = |slot: usize, prep: &mut Samples| -> Result<XferRequest> {
        let t0 = Instant::now();
        let req = match &maker {
            Maker::Prepared {
                local,
                remote,
                batch,
            } => {
                let k = slot * batch..(slot + 1) * batch;
                s.agent
                    .make_request(p.op, local, k.clone(), remote, k, &options)
            }
            Maker::Recreate { lists } => {
                let (lo, re) = &lists[slot];
                s.agent.create_request(p.op, lo, &s.peer, re, &options)
            }
        };
        prep.push(t0.elapsed());
        req.context("make a transfer request")
    };

    let mut reqs = Vec::with_capacity(depth);
    for slot in 0..depth {
        reqs.push(make(slot, &mut out.prep)?);
    }
    out.segments = reqs[0].segments();
    out.runs = reqs[0].segment_runs();
    let mut inflight = FuturesUnordered::new();
    let post = |slot: usize, req: &XferRequest, samples: &mut Samples| -> Result<_> {
        let t0 = Instant::now();
        let transfer = req.post(None).context("post a transfer")?;
        let posted = Instant::now();
        samples.push(posted - t0);
        Ok(track(slot, transfer, posted))
    };
    for (slot, req) in reqs.iter().enumerate() {
        inflight.push(post(slot, req, &mut out.post)?);
    }
    let mut issued = depth;
    let mut completed = 0;
    while completed < iters {
        let next = tokio::time::timeout(p.xfer_timeout, inflight.next()).await;
        let Ok(Some(done)) = next else {
            return fail(format!(
                "no transfer completed within {:?} (the target is hung or unreachable; see --xfer-timeout)",
                p.xfer_timeout
            ));
        };
        done.result.context("transfer failed")?;
        out.tx.push(done.finished - done.posted);
        completed += 1;
        if issued < iters {
            if p.recreate {
                reqs[done.slot] = make(done.slot, &mut out.prep)?;
            }
            inflight.push(post(done.slot, &reqs[done.slot], &mut out.post)?);
            issued += 1;
        }
    }
    Ok(out)
}

/// Agent options that keep teardown within `teardown`.
pub(crate) fn agent_options(teardown: Duration) -> AgentOptions {
    AgentOptions {
        drain_timeout: teardown / 2,
        shutdown_timeout: teardown / 2,
    }
}

/// Shut `agent` down within `teardown`. Returns what did not stop cleanly, if anything
/// (expected after a failure, worth a warning after a clean run).
pub(crate) async fn shutdown(agent: &Agent, teardown: Duration) -> Option<String> {
    match tokio::time::timeout(teardown + Duration::from_secs(1), agent.shutdown()).await {
        Ok(report) if report.is_clean() => None,
        Ok(report) => Some(format!(
            "{} agent shutdown was not clean: {report:?}",
            agent.name()
        )),
        Err(_) => Some(format!(
            "{} agent shutdown overran {teardown:?}",
            agent.name()
        )),
    }
}
