//! Descriptor preparation and request building.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::choice::{self, Candidate, Need};
use super::local::{LocalCopy, AGENT_COPY};
use super::segments::{build_segments, Merger, RegionTable, Sides};
use super::{Agent, RequestOptions};
use crate::backend::{PreparedTransfer, SegmentRun, Segments, TransferPlan};
use crate::completion::Op;
use crate::descriptor::{DescList, RangeIndex, Ranged};
use crate::error::{err, Error, ErrorKind, Result};
use crate::memory::MemKind;
use crate::peer_link::LinkedPeer;
use crate::region::{RegionInner, RemoteRegion};
use crate::telemetry::{RequestTelemetry, TransferInfo};
use crate::transfer::{RequestOwner, Transfer, XferRequest};

/// Descriptor lists checked once, to build many requests from by index.
///
/// Kept as runs of blocks that each lie in one registration (a strided list that
/// stays inside one registration is one run, however many blocks it has), so
/// preparing and building requests costs O(runs).
#[derive(Debug)]
pub struct PreparedDescs {
    side: Side,
    kind: MemKind,
    regions: RegionTable,
    runs: Vec<PrepRun>,
    /// Index of the first block of each run.
    starts: Vec<usize>,
    len: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Side {
    Local,
    Remote { peer: String, generation: u64 },
}

/// `count` blocks of `len` bytes in registration `region` of the table, the first
/// at `offset` into it, `stride` bytes apart.
#[derive(Debug, Clone, Copy)]
struct PrepRun {
    region: u32,
    offset: u64,
    len: u64,
    stride: u64,
    count: usize,
}

/// Which descriptors of a prepared list a request uses, in order.
///
/// `&[usize]`, `&Vec<usize>` and `&[usize; N]` convert into a list of indices; a
/// `Range<usize>` and [`Indices::All`] name consecutive descriptors without
/// materializing their indices, so a request over a whole strided list costs
/// O(runs). A list of indices costs a comparison per index: consecutive indices
/// within one run become one run of segments.
#[derive(Clone, Debug)]
pub enum Indices<'a> {
    /// Every descriptor, in order.
    All,
    /// Descriptors `start..end`, in order.
    Range(Range<usize>),
    /// These descriptors, in this order.
    List(&'a [usize]),
}

impl Indices<'_> {
    fn count(&self, list_len: usize) -> usize {
        match self {
            Self::All => list_len,
            Self::Range(r) => r.end.saturating_sub(r.start),
            Self::List(l) => l.len(),
        }
    }
}

impl<'a> From<&'a [usize]> for Indices<'a> {
    fn from(l: &'a [usize]) -> Self {
        Self::List(l)
    }
}

impl<'a> From<&'a Vec<usize>> for Indices<'a> {
    fn from(l: &'a Vec<usize>) -> Self {
        Self::List(l)
    }
}

impl<'a, const N: usize> From<&'a [usize; N]> for Indices<'a> {
    fn from(l: &'a [usize; N]) -> Self {
        Self::List(l)
    }
}

impl From<Range<usize>> for Indices<'_> {
    fn from(r: Range<usize>) -> Self {
        Self::Range(r)
    }
}

/// Check every run of `descs` against `index`, splitting runs where they cross from
/// one registration into the next.
fn resolve<T: Ranged + Clone>(
    index: &RangeIndex<T>,
    descs: &DescList,
    op: &'static str,
    what: impl Fn(usize) -> String,
) -> Result<(Vec<T>, Vec<PrepRun>, Vec<usize>)> {
    let mut table: Vec<T> = Vec::new();
    let mut slots: HashMap<u64, u32> = HashMap::new();
    let mut runs = Vec::with_capacity(descs.runs().len());
    let mut starts = Vec::with_capacity(descs.runs().len());
    let mut first = 0usize;
    let mut hint = None;
    for run in descs.runs() {
        let mut block = first;
        index.lookup_run(
            descs.kind(),
            run,
            &mut hint,
            op,
            |i| what(first + i),
            |r, offset, count| {
                // Most lists stay in one registration: check the last one first.
                let slot = match table.last() {
                    Some(t) if t.id() == r.id() => table.len() as u32 - 1,
                    _ => *slots.entry(r.id()).or_insert_with(|| {
                        table.push(r.clone());
                        table.len() as u32 - 1
                    }),
                };
                runs.push(PrepRun {
                    region: slot,
                    offset,
                    len: run.len,
                    stride: run.stride,
                    count,
                });
                starts.push(block);
                block += count;
            },
        )?;
        first += run.count;
    }
    Ok((table, runs, starts))
}

impl PreparedDescs {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of runs the descriptors are kept as (each run lies in one
    /// registration).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The peer these descriptors belong to (`None` for local memory).
    pub fn peer(&self) -> Option<&str> {
        match &self.side {
            Side::Local => None,
            Side::Remote { peer, .. } => Some(peer),
        }
    }

    /// The run holding descriptor `idx` (`idx < len`), trying `hint` and the run
    /// after it before searching.
    fn run_of(&self, idx: usize, hint: usize) -> usize {
        for k in [hint, hint + 1] {
            if let (Some(&s), Some(r)) = (self.starts.get(k), self.runs.get(k)) {
                if idx >= s && idx - s < r.count {
                    return k;
                }
            }
        }
        self.starts.partition_point(|&s| s <= idx) - 1
    }
}

/// Consecutive descriptors of one run of a prepared list that a request uses.
#[derive(Clone, Copy, Debug)]
struct Span {
    /// The run.
    run: usize,
    /// First block within the run.
    first: usize,
    /// Blocks.
    n: usize,
    /// Index of the first block in the list (for errors).
    index: usize,
}

/// A request's descriptors of one list, as spans, in order.
struct Spans<'a> {
    list: &'a PreparedDescs,
    indices: Indices<'a>,
    /// Position in `indices`.
    pos: usize,
    /// Run of the last span (a search hint).
    hint: usize,
    which: &'static str,
}

impl<'a> Spans<'a> {
    fn new(list: &'a PreparedDescs, indices: Indices<'a>, which: &'static str) -> Self {
        Self {
            list,
            indices,
            pos: 0,
            hint: 0,
            which,
        }
    }

    fn out_of_bounds(&self, idx: usize) -> Error {
        Error::new(
            ErrorKind::NotFound,
            "make transfer request",
            format!(
                "{} index {idx} out of bounds ({} descriptors)",
                self.which, self.list.len
            ),
        )
    }

    fn next(&mut self) -> Option<Result<Span>> {
        let l = self.list;
        // The next index, and for ranges the end (exclusive) of the indices.
        let (idx, limit) = match &self.indices {
            Indices::All => (self.pos, l.len),
            Indices::Range(r) => (r.start.checked_add(self.pos)?, r.end),
            Indices::List(v) => (*v.get(self.pos)?, usize::MAX),
        };
        if !matches!(self.indices, Indices::List(_)) && idx >= limit {
            return None;
        }
        if idx >= l.len {
            return Some(Err(self.out_of_bounds(idx)));
        }
        let k = l.run_of(idx, self.hint);
        let first = idx - l.starts[k];
        let room = l.runs[k].count - first;
        let n = match &self.indices {
            Indices::All | Indices::Range(_) => room.min(limit - idx),
            Indices::List(v) => {
                let rest = &v[self.pos + 1..];
                1 + rest
                    .iter()
                    .take(room - 1)
                    .zip(idx + 1..)
                    .take_while(|(&a, b)| a == *b)
                    .count()
            }
        };
        self.pos += n;
        self.hint = k;
        Some(Ok(Span {
            run: k,
            first,
            n,
            index: idx,
        }))
    }
}

impl Agent {
    /// Check a local descriptor list once.
    ///
    /// Costs one registration lookup per run of the list and per registration a run
    /// crosses into, not one per descriptor.
    ///
    /// # Errors
    /// For the first descriptor that fails: [`ErrorKind::ZeroLength`],
    /// [`ErrorKind::OutOfRange`], [`ErrorKind::SpansRegions`], [`ErrorKind::Mismatch`].
    pub fn prep_local(&self, descs: &DescList) -> Result<PreparedDescs> {
        const OP: &str = "prepare local descriptors";
        self.shared.check_running(OP)?;
        let regions = self.shared.regions.read().unwrap();
        let (table, runs, starts) = resolve(&regions.index, descs, OP, |i| {
            format!("local descriptor {i}")
        })?;
        Ok(PreparedDescs {
            side: Side::Local,
            kind: descs.kind(),
            regions: RegionTable::Local(table),
            runs,
            starts,
            len: descs.len(),
        })
    }

    /// Check a peer's descriptor list once against what the peer advertised. Using this
    /// agent's own name checks against local registrations (for local transfers).
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`], and per descriptor as [`Agent::prep_local`].
    pub fn prep_remote(&self, peer: &str, descs: &DescList) -> Result<PreparedDescs> {
        const OP: &str = "prepare remote descriptors";
        if peer == self.shared.name {
            return self.prep_local(descs);
        }
        self.shared.check_running(OP)?;
        let p = self.peer(peer, OP)?;
        let (table, runs, starts) = resolve(&p.regions, descs, OP, |i| {
            format!("remote descriptor {i} of {peer:?}")
        })?;
        Ok(PreparedDescs {
            side: Side::Remote {
                peer: peer.to_owned(),
                generation: p.generation,
            },
            kind: descs.kind(),
            regions: RegionTable::Remote(table),
            runs,
            starts,
            len: descs.len(),
        })
    }

    /// Build a request from prepared lists, pairing the `i`th descriptor `local_idx`
    /// names with the `i`th one `remote_idx` names.
    ///
    /// Indices are `&[usize]` (or `&Vec<usize>`, `&[usize; N]`), a `Range<usize>`,
    /// or [`Indices::All`]; see [`Indices`] for what each costs.
    ///
    /// Same-agent requests between DRAM regions are served by the agent itself
    /// (`memmove`; [`XferRequest::backend`] says `"agent"`); everything else by the
    /// first backend, in preference order, that can.
    ///
    /// # Errors
    /// [`ErrorKind::LengthMismatch`] (index lists differ in length, or paired descriptors
    /// in size); [`ErrorKind::NotFound`] (index out of bounds, deregistered region);
    /// [`ErrorKind::InvalidArgument`] (empty, or `local` is not a local list);
    /// [`ErrorKind::StaleGeneration`]; [`ErrorKind::NotSupported`] (no backend can serve
    /// it, for example more segment runs than any backend carries); backend errors.
    pub fn make_request<'i>(
        &self,
        op: Op,
        local: &PreparedDescs,
        local_idx: impl Into<Indices<'i>>,
        remote: &PreparedDescs,
        remote_idx: impl Into<Indices<'i>>,
        options: &RequestOptions,
    ) -> Result<XferRequest> {
        const OP: &str = "make transfer request";
        let (local_idx, remote_idx) = (local_idx.into(), remote_idx.into());
        self.shared.check_running(OP)?;
        if local.side != Side::Local {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                "the local list was prepared for a peer",
            );
        }
        let (nl, nr) = (local_idx.count(local.len), remote_idx.count(remote.len));
        if nl != nr {
            return err(
                ErrorKind::LengthMismatch,
                OP,
                format!("{nl} local vs {nr} remote descriptors"),
            );
        }
        if nl == 0 {
            return err(ErrorKind::InvalidArgument, OP, "no descriptors");
        }
        if local.kind.is_file() {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                format!(
                    "the local list is {}: a storage transfer takes memory as the local list and the files as the other (a WRITE stores memory into the files, a READ loads it back)",
                    local.kind
                ),
            );
        }
        if remote.kind.is_file() && remote.side != Side::Local {
            return err(
                ErrorKind::NotSupported,
                OP,
                "files are reached only by their own agent (name it as the peer)",
            );
        }
        let peer = match &remote.side {
            Side::Local => None,
            Side::Remote { peer, generation } => {
                let p = self.peer(peer, OP)?;
                if p.generation != *generation {
                    return err(ErrorKind::StaleGeneration, OP, format!("remote descriptors were prepared against generation {generation} of {peer:?}, current is {}", p.generation));
                }
                Some(p)
            }
        };
        let merged = pair_spans(
            Spans::new(local, local_idx, "local"),
            Spans::new(remote, remote_idx, "remote"),
            options.merge,
        )?;
        // A stride-0 run may name one block a huge number of times: the total must
        // still be a byte count.
        let total = merged.iter().try_fold(0u64, |t, p| {
            p.len
                .checked_mul(p.count as u64)
                .and_then(|b| t.checked_add(b))
        });
        if total.is_none() {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                "the request would move more than 2^64 bytes",
            );
        }
        // Regions this request keeps alive while in flight.
        let mut used_l = vec![false; local.regions.len()];
        let mut used_r = vec![false; remote.regions.len()];
        for p in &merged {
            used_l[p.local as usize] = true;
            used_r[p.target as usize] = true;
        }
        let mut keep: Vec<Arc<RegionInner>> = Vec::new();
        let mut remotes: Vec<&Arc<RemoteRegion>> = Vec::new();
        for (table, used) in [(&local.regions, &used_l), (&remote.regions, &used_r)] {
            match table {
                RegionTable::Local(v) => {
                    for region in v.iter().zip(used).filter(|(_, u)| **u).map(|(r, _)| r) {
                        if !region.registered.load(Ordering::Acquire) {
                            return err(
                                ErrorKind::NotFound,
                                OP,
                                format!("registration {} was deregistered", region.id),
                            );
                        }
                        if !keep.iter().any(|k| Arc::ptr_eq(k, region)) {
                            keep.push(region.clone());
                        }
                    }
                }
                RegionTable::Remote(v) => {
                    remotes.extend(v.iter().zip(used).filter(|(_, u)| **u).map(|(r, _)| r));
                }
            }
        }
        let peer_name = match &remote.side {
            Side::Local => None,
            Side::Remote { peer, .. } => Some(peer.clone()),
        };
        let generation = peer.as_ref().map(|p| (p.slot.clone(), p.generation));
        let owner: Arc<dyn RequestOwner> = self.shared.clone();
        let request = |backend: String,
                       prepared: Box<dyn PreparedTransfer>,
                       (bytes, segments, runs): (u64, usize, usize),
                       max_notification: usize| XferRequest {
            telemetry: self.request_telemetry(op, &backend, peer_name.as_deref(), bytes, segments),
            owner: Arc::downgrade(&owner),
            op,
            peer: peer_name.clone(),
            generation: generation.clone(),
            backend,
            prepared,
            regions: keep.clone(),
            bytes,
            segments,
            runs,
            max_notification,
            last: Mutex::new(None),
        };
        let sides = Sides {
            local: &local.regions,
            remote: &remote.regions,
            used_local: &used_l,
            used_remote: &used_r,
        };

        // Backend names are checked even when the agent serves the request itself.
        let order = self.backend_order(options.backends.as_deref(), OP)?;
        // Same-agent memory-to-memory copies are the agent's own; storage transfers
        // (files on the other side) go to a backend that declares files.
        if peer.is_none() && !remote.kind.is_file() {
            let segments = build_segments(merged, &sides, AGENT_COPY);
            let shape = shape(&segments);
            let copy = LocalCopy {
                op,
                segments,
                agent: self.shared.name.clone(),
                sink: self.shared.sink.clone(),
            };
            return Ok(request(
                AGENT_COPY.to_owned(),
                Box::new(copy),
                shape,
                usize::MAX,
            ));
        }

        let nseg = merged.len();
        let candidates: Vec<Candidate<'_>> = order
            .iter()
            .map(|&i| {
                let name = self.shared.backends[i].name();
                Candidate {
                    name,
                    caps: self.shared.caps[i],
                    locals_registered: keep.iter().all(|r| r.registered_with(i)),
                    peer_offers: peer.as_ref().is_none_or(|p| p.offers(name)),
                    remotes_registered: remotes.iter().all(|r| r.blob(name).is_some()),
                }
            })
            .collect();
        let need = Need {
            remote: peer.is_some(),
            local_kind: local.kind,
            remote_kind: remote.kind,
            segments: nseg,
        };
        let backend = match choice::choose(&candidates, &need) {
            Ok(c) => order[c],
            Err(reasons) => {
                return err(
                    ErrorKind::NotSupported,
                    "choose backend",
                    format!("no backend can serve this transfer ({reasons})"),
                )
            }
        };
        let b = &self.shared.backends[backend];
        let segments = build_segments(merged, &sides, b.name());
        let shape = shape(&segments);
        let linked = match (&peer, &peer_name) {
            (Some(p), Some(name)) => Some(LinkedPeer {
                name: name.clone(),
                link: p.links.get(backend).cloned().ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotSupported,
                        "choose backend",
                        format!("peer {name:?} has no {} link", b.name()),
                    )
                })?,
            }),
            _ => None,
        };
        let prepared = b
            .prepare(TransferPlan {
                op,
                peer: linked,
                segments,
            })
            .map_err(|e| match (&generation, &peer_name) {
                // The peer was reloaded or forgotten while this prepared, so the link
                // it used may be closed: say that (callers prepare again), with the
                // backend's error as the source.
                (Some((slot, g)), Some(name)) => match slot.check(name, *g, OP) {
                    Err(moved) => moved.with_source(e),
                    Ok(()) => e,
                },
                _ => e,
            })?;
        Ok(request(
            b.name().to_owned(),
            prepared,
            shape,
            self.shared.caps[backend].max_notification,
        ))
    }

    /// Build a request from plain descriptor lists (checks them, then prepares). `peer`
    /// may be this agent's own name for a local transfer. A reload of the peer's
    /// metadata while this runs makes it prepare again rather than fail.
    ///
    /// # Errors
    /// As [`Agent::prep_local`], [`Agent::prep_remote`] and [`Agent::make_request`];
    /// [`ErrorKind::LengthMismatch`] when the lists differ in length.
    pub fn create_request(
        &self,
        op: Op,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        options: &RequestOptions,
    ) -> Result<XferRequest> {
        if local.len() != remote.len() {
            return err(
                ErrorKind::LengthMismatch,
                "create transfer request",
                format!(
                    "{} local vs {} remote descriptors",
                    local.len(),
                    remote.len()
                ),
            );
        }
        let l = self.prep_local(local)?;
        retry_stale(|| {
            let r = self.prep_remote(peer, remote)?;
            self.make_request(op, &l, Indices::All, &r, Indices::All, options)
        })
    }

    /// One-shot transfer: check, prepare and post. Await the returned future.
    ///
    /// The lists are prepared here, so a reload of the peer's metadata before the post
    /// makes it prepare again against the new generation instead of failing with
    /// [`ErrorKind::StaleGeneration`] (which it still returns if the peer is reloaded
    /// on every attempt).
    ///
    /// # Errors
    /// As [`Agent::create_request`] and [`XferRequest::post`].
    pub fn transfer(
        &self,
        op: Op,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<Bytes>,
    ) -> Result<Transfer> {
        let options = RequestOptions::default();
        retry_stale(|| {
            self.create_request(op, local, peer, remote, &options)?
                .post(notif.clone())
        })
    }

    /// One-shot WRITE of `local` into the peer's `remote`; awaits completion.
    ///
    /// # Errors
    /// As [`Agent::transfer`], and the transfer's outcome.
    pub async fn write(
        &self,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<Bytes>,
    ) -> Result<()> {
        self.transfer(Op::Write, local, peer, remote, notif)?.await
    }

    /// One-shot READ of the peer's `remote` into `local`; awaits completion.
    ///
    /// # Errors
    /// As [`Agent::transfer`], and the transfer's outcome.
    pub async fn read(
        &self,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<Bytes>,
    ) -> Result<()> {
        self.transfer(Op::Read, local, peer, remote, notif)?.await
    }
}

impl Agent {
    /// What a request's posts record (`None` with telemetry off).
    fn request_telemetry(
        &self,
        op: Op,
        backend: &str,
        peer: Option<&str>,
        bytes: u64,
        segments: usize,
    ) -> Option<RequestTelemetry> {
        let t = &self.shared.telemetry;
        if !t.transfers && self.shared.metrics.is_none() {
            return None;
        }
        Some(RequestTelemetry {
            info: Arc::new(TransferInfo {
                op,
                peer: peer.map(str::to_owned),
                backend: backend.to_owned(),
                bytes,
                segments,
            }),
            agent: self.shared.name.as_str().into(),
            record: t.transfers,
            metrics: self
                .shared
                .metrics
                .as_ref()
                .map(|m| m.op(op, backend, peer)),
        })
    }
}

/// How many times a one-shot call prepares again after the peer's metadata was
/// reloaded under it.
const STALE_RETRIES: usize = 8;

/// Run `f`, again while it fails with [`ErrorKind::StaleGeneration`], at most
/// [`STALE_RETRIES`] more times.
///
/// One-shot calls prepare the remote list themselves: a reload between their own
/// prepare and make/post (the peer republished, an exchange refreshed it) leaves
/// nothing stale that the caller holds, so they prepare again against the new
/// generation instead of failing. A peer reloaded on every attempt still fails.
fn retry_stale<T>(mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let mut tries = 0;
    loop {
        match f() {
            Err(e) if e.kind() == ErrorKind::StaleGeneration && tries < STALE_RETRIES => {
                tries += 1;
            }
            r => return r,
        }
    }
}

/// Bytes, segments and runs of a request.
fn shape(s: &Segments) -> (u64, usize, usize) {
    (s.bytes(), s.len(), s.runs().len())
}

/// Pair the spans of both sides position by position into runs of segment pairs,
/// merged where `merge` says ([`Merger`]). Errors come in position order: at one
/// position, the local index, then the remote index, then the lengths.
fn pair_spans(mut ls: Spans<'_>, mut rs: Spans<'_>, merge: bool) -> Result<Vec<SegmentRun>> {
    let (lp, rp) = (ls.list, rs.list);
    // At most one run per run of either side, and never more than the indices.
    let bound = (lp.runs.len() + rp.runs.len()).min(ls.indices.count(lp.len));
    let mut out = Merger::new(merge, bound);
    let (mut l, mut r): (Option<Span>, Option<Span>) = (None, None);
    loop {
        if l.is_none() {
            l = ls.next().transpose()?;
        }
        if r.is_none() {
            r = rs.next().transpose()?;
        }
        let (Some(a), Some(b)) = (l.as_mut(), r.as_mut()) else {
            // Both index lists have the same length, so both end together; never
            // hand a backend half a request if they did not.
            if l.is_some() || r.is_some() {
                return err(
                    ErrorKind::LengthMismatch,
                    "make transfer request",
                    "the index lists ended at different positions",
                );
            }
            return Ok(out.out);
        };
        let (x, y) = (&lp.runs[a.run], &rp.runs[b.run]);
        if x.len != y.len {
            return err(
                ErrorKind::LengthMismatch,
                "make transfer request",
                format!(
                    "local descriptor {} has {} bytes, remote descriptor {} has {}",
                    a.index, x.len, b.index, y.len
                ),
            );
        }
        let n = a.n.min(b.n);
        out.push(SegmentRun {
            local: x.region,
            target: y.region,
            local_offset: x.offset + a.first as u64 * x.stride,
            target_offset: y.offset + b.first as u64 * y.stride,
            local_stride: x.stride,
            target_stride: y.stride,
            len: x.len,
            count: n,
        });
        for s in [&mut *a, &mut *b] {
            s.first += n;
            s.index += n;
            s.n -= n;
        }
        if a.n == 0 {
            l = None;
        }
        if r.as_ref().is_some_and(|b| b.n == 0) {
            r = None;
        }
    }
}
