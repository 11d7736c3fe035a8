//! Telemetry: per-transfer records, a `tracing` span per transfer, and agent metrics
//! through the [`metrics`] facade. Everything is off unless the agent is built with
//! [`AgentBuilder::telemetry`](crate::AgentBuilder::telemetry); off, a post pays one
//! branch.
//!
//! # Per-transfer records
//! With [`TelemetryOptions::transfers`], every post records when it was posted, how
//! long the post call took, how long until completion, and the outcome. Read them with
//! [`XferRequest::telemetry`](crate::XferRequest::telemetry) (the latest post) or
//! [`Transfer::telemetry`](crate::Transfer::telemetry). Each post is also a `tracing`
//! span named `nixl_transfer` at INFO level, with the fields `agent`, `op`, `peer`,
//! `backend`, `bytes`, `segments`, and, once known, `post_us`, `duration_us` and
//! `outcome`; it closes when the transfer finishes.
//!
//! # Metrics
//! With [`TelemetryOptions::metrics`], the agent records these through the `metrics`
//! facade; install any recorder (a Prometheus exporter, OpenTelemetry, your own) to
//! collect them. Without a recorder they cost a few atomic operations per transfer.
//!
//! | Name | Type | Labels | What |
//! |---|---|---|---|
//! | `nixl_transfers_posted_total` | counter | agent, op, backend\[, peer\] | posts accepted (a post refused synchronously is not counted) |
//! | `nixl_transfers_completed_total` | counter | agent, op, backend\[, peer\] | transfers finished successfully |
//! | `nixl_transfer_bytes_total` | counter | agent, op, backend\[, peer\] | bytes of successful transfers: `op="write"` is sent, `op="read"` received |
//! | `nixl_transfer_errors_total` | counter | agent, op, backend, kind\[, peer\] | transfers that failed, by [`ErrorKind`] (`kind="RemoteDisconnected"` counts dead-peer failures) |
//! | `nixl_transfer_duration_seconds` | histogram | agent, op, backend | post to completion, successful transfers |
//! | `nixl_transfer_post_seconds` | histogram | agent, op, backend | time spent in the post call |
//! | `nixl_notifications_sent_total` | counter | agent | notifications posted (with a transfer or standalone) |
//! | `nixl_notifications_received_total` | counter | agent | notifications queued for the application |
//! | `nixl_notifications_dropped_total` | counter | agent | notifications dropped because a bound on the queue was full (deliveries that cannot wait) ([`NotificationLimits`](crate::NotificationLimits)) |
//! | `nixl_registered_bytes` | gauge | agent, kind | bytes registered, by memory kind (`dram`, `vram`) |
//! | `nixl_registrations` | gauge | agent, kind | live registrations, by memory kind |
//! | `nixl_peers` | gauge | agent | peers whose metadata is loaded |
//!
//! `op` is `read` or `write`; `backend` is the serving backend's name (`agent` for
//! same-agent copies the agent does itself). The `peer` label is off by default
//! ([`TelemetryOptions::peer_labels`]): it makes one series per peer, so turn it on only
//! with a bounded number of peers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram, Label};

use crate::completion::{Observer, Op, Status};
use crate::error::{Error, ErrorKind};
use crate::memory::MemKind;

/// What an agent records; all off by default. See the [module docs](self).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TelemetryOptions {
    /// Per-transfer records and a `nixl_transfer` tracing span per post.
    pub transfers: bool,
    /// Agent metrics through the `metrics` facade.
    pub metrics: bool,
    /// Add a `peer` label to the per-transfer metrics (one series per peer).
    pub peer_labels: bool,
}

/// What one post did, as recorded with [`TelemetryOptions::transfers`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferTelemetry {
    /// READ or WRITE.
    pub op: Op,
    /// The peer (`None` for a local transfer).
    pub peer: Option<String>,
    /// The backend that served it.
    pub backend: String,
    /// Bytes moved.
    pub bytes: u64,
    /// Segments after merging.
    pub segments: usize,
    /// Wall-clock time of the post.
    pub posted_at: SystemTime,
    /// Time spent in the post call; `None` while that call has not returned.
    pub post_duration: Option<Duration>,
    /// From the start of the post to completion, or to the post call's return when
    /// the transfer completed inside it, so it is never shorter than
    /// [`post_duration`](Self::post_duration); `None` while in flight.
    pub duration: Option<Duration>,
    /// Outcome so far.
    pub status: Status,
}

/// What a request is, shared by its posts' records.
#[derive(Debug)]
pub(crate) struct TransferInfo {
    pub(crate) op: Op,
    pub(crate) peer: Option<String>,
    pub(crate) backend: String,
    pub(crate) bytes: u64,
    pub(crate) segments: usize,
}

fn op_label(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
    }
}

/// Index into the per-kind gauges, and the `kind` label.
fn kind_slot(kind: MemKind) -> (usize, &'static str) {
    match kind {
        MemKind::Dram => (0, "dram"),
        MemKind::Vram { .. } => (1, "vram"),
        MemKind::File { .. } => (2, "file"),
    }
}

/// The metric handles of one (op, backend[, peer]).
#[derive(Debug)]
pub(crate) struct OpMetrics {
    labels: Vec<Label>,
    posted: Counter,
    completed: Counter,
    bytes: Counter,
    duration: Histogram,
    post: Histogram,
}

impl OpMetrics {
    fn new(agent: &str, op: Op, backend: &str, peer: Option<&str>) -> Self {
        let mut labels = vec![
            Label::new("agent", agent.to_owned()),
            Label::new("op", op_label(op)),
            Label::new("backend", backend.to_owned()),
        ];
        let timing = labels.clone();
        if let Some(p) = peer {
            labels.push(Label::new("peer", p.to_owned()));
        }
        Self {
            posted: counter!("nixl_transfers_posted_total", labels.iter()),
            completed: counter!("nixl_transfers_completed_total", labels.iter()),
            bytes: counter!("nixl_transfer_bytes_total", labels.iter()),
            duration: histogram!("nixl_transfer_duration_seconds", timing.iter()),
            post: histogram!("nixl_transfer_post_seconds", timing.iter()),
            labels,
        }
    }

    fn failed(&self, kind: ErrorKind) {
        let mut labels = self.labels.clone();
        labels.push(Label::new("kind", format!("{kind:?}")));
        counter!("nixl_transfer_errors_total", labels.iter()).increment(1);
    }
}

/// Op, backend and (with peer labels) peer of a set of handles.
type OpKey = (Op, String, Option<String>);

/// An agent's metric handles (with [`TelemetryOptions::metrics`]).
#[derive(Debug)]
pub(crate) struct AgentMetrics {
    agent: String,
    peer_labels: bool,
    ops: Mutex<HashMap<OpKey, Arc<OpMetrics>>>,
    pub(crate) notifications_sent: Counter,
    pub(crate) notifications_received: Counter,
    pub(crate) notifications_dropped: Counter,
    registered_bytes: [Gauge; 3],
    registrations: [Gauge; 3],
    pub(crate) peers: Gauge,
}

impl AgentMetrics {
    pub(crate) fn new(agent: &str, options: &TelemetryOptions) -> Self {
        let a = || Label::new("agent", agent.to_owned());
        let by_kind = |name: &'static str| {
            [
                MemKind::Dram,
                MemKind::Vram { device: 0 },
                MemKind::File { fd: 0 },
            ]
            .map(|k| gauge!(name, [a(), Label::new("kind", kind_slot(k).1)].iter()))
        };
        Self {
            agent: agent.to_owned(),
            peer_labels: options.peer_labels,
            ops: Mutex::new(HashMap::new()),
            notifications_sent: counter!("nixl_notifications_sent_total", [a()].iter()),
            notifications_received: counter!("nixl_notifications_received_total", [a()].iter()),
            notifications_dropped: counter!("nixl_notifications_dropped_total", [a()].iter()),
            registered_bytes: by_kind("nixl_registered_bytes"),
            registrations: by_kind("nixl_registrations"),
            peers: gauge!("nixl_peers", [a()].iter()),
        }
    }

    /// The handles for requests of `op` served by `backend` to `peer` (made once).
    pub(crate) fn op(&self, op: Op, backend: &str, peer: Option<&str>) -> Arc<OpMetrics> {
        let peer = peer.filter(|_| self.peer_labels);
        let key = (op, backend.to_owned(), peer.map(str::to_owned));
        self.ops
            .lock()
            .unwrap()
            .entry(key)
            .or_insert_with(|| Arc::new(OpMetrics::new(&self.agent, op, backend, peer)))
            .clone()
    }

    /// A registration of `len` bytes of `kind` came (`came`) or went.
    pub(crate) fn registration(&self, kind: MemKind, len: usize, came: bool) {
        let i = kind_slot(kind).0;
        if came {
            self.registered_bytes[i].increment(len as f64);
            self.registrations[i].increment(1.0);
        } else {
            self.registered_bytes[i].decrement(len as f64);
            self.registrations[i].decrement(1.0);
        }
    }
}

/// What a request records per post (see [`Probe`]).
#[derive(Debug, Clone)]
pub(crate) struct RequestTelemetry {
    pub(crate) info: Arc<TransferInfo>,
    pub(crate) agent: Arc<str>,
    pub(crate) record: bool,
    pub(crate) metrics: Option<Arc<OpMetrics>>,
}

/// The record of one post, kept in its completion state.
#[derive(Debug)]
pub(crate) struct Probe {
    t: RequestTelemetry,
    started: Instant,
    posted_at: SystemTime,
    /// Nanoseconds the post call took; `u64::MAX` until it returned.
    post_ns: AtomicU64,
    done: OnceLock<(Duration, Status)>,
    span: Mutex<Option<tracing::Span>>,
}

impl Probe {
    /// Start recording a post (just before the backend's post).
    pub(crate) fn start(t: &RequestTelemetry) -> Self {
        let span = t.record.then(|| {
            let i = &t.info;
            tracing::info_span!(
                "nixl_transfer",
                agent = &*t.agent,
                op = op_label(i.op),
                peer = i.peer.as_deref().unwrap_or(""),
                backend = i.backend.as_str(),
                bytes = i.bytes,
                segments = i.segments,
                post_us = tracing::field::Empty,
                duration_us = tracing::field::Empty,
                outcome = tracing::field::Empty,
            )
        });
        if let Some(m) = &t.metrics {
            m.posted.increment(1);
        }
        Self {
            t: t.clone(),
            started: Instant::now(),
            posted_at: if t.record {
                SystemTime::now()
            } else {
                SystemTime::UNIX_EPOCH
            },
            post_ns: AtomicU64::new(u64::MAX),
            done: OnceLock::new(),
            span: Mutex::new(span),
        }
    }

    /// The post call returned.
    ///
    /// The span closes once both the post returned and the transfer finished,
    /// whichever comes last; both steps run under its lock, so a transfer that
    /// finishes on another thread before the post call returns keeps `post_us`.
    pub(crate) fn posted(&self) {
        let took = self.started.elapsed();
        let mut span = self.span.lock().unwrap();
        self.post_ns.store(
            took.as_nanos().min(u64::MAX as u128 - 1) as u64,
            Ordering::Release,
        );
        if let Some(m) = &self.t.metrics {
            m.post.record(took.as_secs_f64());
        }
        if let Some(s) = span.as_ref() {
            s.record("post_us", took.as_micros() as u64);
        }
        let closed = self.done.get().is_some().then(|| span.take());
        drop(span);
        drop(closed);
    }

    /// The transfer finished with `result` (possibly inside the post call).
    fn finish(&self, result: &Result<(), Error>) {
        let took = self.started.elapsed();
        let status = match result {
            Ok(()) => Status::Done,
            Err(e) => Status::Failed(e.kind()),
        };
        // Under the span's lock, as `posted`.
        let mut span = self.span.lock().unwrap();
        if self.done.set((took, status)).is_err() {
            return;
        }
        if let Some(m) = &self.t.metrics {
            match result {
                Ok(()) => {
                    m.completed.increment(1);
                    m.bytes.increment(self.t.info.bytes);
                    m.duration.record(took.as_secs_f64());
                }
                Err(e) => m.failed(e.kind()),
            }
        }
        if let Some(s) = span.as_ref() {
            s.record("duration_us", took.as_micros() as u64);
            match result {
                Ok(()) => s.record("outcome", "ok"),
                Err(e) => s.record("outcome", tracing::field::display(e.kind())),
            };
        }
        let posted = self.post_ns.load(Ordering::Acquire) != u64::MAX;
        let closed = posted.then(|| span.take());
        drop(span);
        drop(closed);
    }

    /// The record so far (`None` unless records are on).
    pub(crate) fn telemetry(&self) -> Option<TransferTelemetry> {
        if !self.t.record {
            return None;
        }
        let i = &self.t.info;
        let post_ns = self.post_ns.load(Ordering::Acquire);
        let post_duration = (post_ns != u64::MAX).then(|| Duration::from_nanos(post_ns));
        let done = self.done.get();
        Some(TransferTelemetry {
            op: i.op,
            peer: i.peer.clone(),
            backend: i.backend.clone(),
            bytes: i.bytes,
            segments: i.segments,
            posted_at: self.posted_at,
            post_duration,
            // A transfer that completes inside the post call is stamped before the
            // call returns; the whole never ends before its post does.
            duration: done.map(|d| post_duration.map_or(d.0, |p| d.0.max(p))),
            status: done.map_or(Status::InFlight, |d| d.1),
        })
    }
}

impl Observer for Probe {
    fn finished(&self, result: &Result<(), Error>) {
        self.finish(result);
    }
}
