//! Descriptor preparation and request building.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::choice::{self, Candidate, Need};
use super::local::{LocalCopy, AGENT_COPY};
use super::segments::build_segments;
use super::{Agent, RequestOptions};
use crate::backend::{PreparedTransfer, Target, TransferPlan};
use crate::descriptor::DescList;
use crate::error::{err, Error, ErrorKind, Result};
use crate::memory::MemKind;
use crate::region::{RegionInner, RemoteRegion};
use crate::transfer::{Op, RequestOwner, Transfer, XferRequest};

/// Descriptor lists checked once, to build many requests from by index.
#[derive(Debug)]
pub struct PreparedDescs {
    side: Side,
    kind: MemKind,
    entries: Vec<Resolved>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Side {
    Local,
    Remote { peer: String, generation: u64 },
}

#[derive(Debug, Clone)]
pub(super) enum Resolved {
    Local {
        region: Arc<RegionInner>,
        offset: u64,
        len: u64,
    },
    Remote {
        region: Arc<RemoteRegion>,
        offset: u64,
        len: u64,
    },
}

impl Resolved {
    fn len(&self) -> u64 {
        match self {
            Self::Local { len, .. } | Self::Remote { len, .. } => *len,
        }
    }
}

impl PreparedDescs {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
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
}

impl Agent {
    /// Check a local descriptor list once.
    ///
    /// # Errors
    /// Per descriptor: [`ErrorKind::ZeroLength`], [`ErrorKind::OutOfRange`],
    /// [`ErrorKind::SpansRegions`], [`ErrorKind::Mismatch`].
    pub fn prep_local(&self, descs: &DescList) -> Result<PreparedDescs> {
        const OP: &str = "prepare local descriptors";
        self.shared.check_running(OP)?;
        let regions = self.shared.regions.read().unwrap();
        let entries = descs
            .descs()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let (region, offset) = regions
                    .index
                    .lookup(descs.kind(), d, OP, || format!("local descriptor {i}"))?;
                Ok(Resolved::Local {
                    region,
                    offset,
                    len: d.len,
                })
            })
            .collect::<Result<_>>()?;
        Ok(PreparedDescs {
            side: Side::Local,
            kind: descs.kind(),
            entries,
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
        let entries = descs
            .descs()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let (region, offset) = p.regions.lookup(descs.kind(), d, OP, || {
                    format!("remote descriptor {i} of {peer:?}")
                })?;
                Ok(Resolved::Remote {
                    region,
                    offset,
                    len: d.len,
                })
            })
            .collect::<Result<_>>()?;
        Ok(PreparedDescs {
            side: Side::Remote {
                peer: peer.to_owned(),
                generation: p.generation,
            },
            kind: descs.kind(),
            entries,
        })
    }

    /// Build a request from prepared lists, pairing `local_idx[i]` with `remote_idx[i]`.
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
    /// it, for example more segments than any backend carries); backend errors.
    pub fn make_request(
        &self,
        op: Op,
        local: &PreparedDescs,
        local_idx: &[usize],
        remote: &PreparedDescs,
        remote_idx: &[usize],
        options: &RequestOptions,
    ) -> Result<XferRequest> {
        const OP: &str = "make transfer request";
        self.shared.check_running(OP)?;
        if local.side != Side::Local {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                "the local list was prepared for a peer",
            );
        }
        if local_idx.len() != remote_idx.len() {
            return err(
                ErrorKind::LengthMismatch,
                OP,
                format!(
                    "{} local vs {} remote descriptors",
                    local_idx.len(),
                    remote_idx.len()
                ),
            );
        }
        if local_idx.is_empty() {
            return err(ErrorKind::InvalidArgument, OP, "no descriptors");
        }
        let peer = match &remote.side {
            Side::Local => None,
            Side::Remote { peer, generation } => {
                let current = self.shared.peer_generation(peer, OP)?;
                if current != *generation {
                    return err(ErrorKind::StaleGeneration, OP, format!("remote descriptors were prepared against generation {generation} of {peer:?}, current is {current}"));
                }
                Some(self.peer(peer, OP)?)
            }
        };
        fn pick<'a>(list: &'a PreparedDescs, idx: usize, which: &str) -> Result<&'a Resolved> {
            list.entries.get(idx).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    OP,
                    format!(
                        "{which} index {idx} out of bounds ({} descriptors)",
                        list.entries.len()
                    ),
                )
            })
        }
        let mut pairs = Vec::with_capacity(local_idx.len());
        for (&li, &ri) in local_idx.iter().zip(remote_idx) {
            let l = pick(local, li, "local")?;
            let r = pick(remote, ri, "remote")?;
            if l.len() != r.len() {
                return err(
                    ErrorKind::LengthMismatch,
                    OP,
                    format!(
                        "local descriptor {li} has {} bytes, remote descriptor {ri} has {}",
                        l.len(),
                        r.len()
                    ),
                );
            }
            pairs.push((l, r));
        }
        // Regions this request keeps alive while in flight.
        let mut keep: Vec<Arc<RegionInner>> = Vec::new();
        for (l, r) in &pairs {
            for x in [l, r] {
                if let Resolved::Local { region, .. } = x {
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
        }
        let peer_name = match &remote.side {
            Side::Local => None,
            Side::Remote { peer, .. } => Some(peer.clone()),
        };
        let generation = peer.as_ref().map_or(0, |p| p.generation);
        let owner: Arc<dyn RequestOwner> = self.shared.clone();
        let request = |backend: String,
                       prepared: Box<dyn PreparedTransfer>,
                       bytes: u64,
                       segments: usize,
                       max_notification: usize| XferRequest {
            owner: Arc::downgrade(&owner),
            op,
            peer: peer_name.clone(),
            generation,
            backend,
            prepared,
            regions: keep.clone(),
            bytes,
            segments,
            max_notification,
            last: Mutex::new(None),
        };

        // Backend names are checked even when the agent serves the request itself.
        let order = self.backend_order(options.backends.as_deref(), OP)?;
        if peer.is_none() && local.kind == MemKind::Dram && remote.kind == MemKind::Dram {
            let segments = build_segments(&pairs, AGENT_COPY, options.merge);
            let bytes = segments.iter().map(|s| s.local.len() as u64).sum();
            let n = segments.len();
            let pairs = segments
                .into_iter()
                .map(|s| match s.target {
                    Target::Local(t) => (s.local, t),
                    Target::Remote { .. } => unreachable!("local request"),
                })
                .collect();
            let copy = LocalCopy {
                op,
                pairs,
                agent: self.shared.name.clone(),
                sink: self.shared.sink.clone(),
            };
            return Ok(request(
                AGENT_COPY.to_owned(),
                Box::new(copy),
                bytes,
                n,
                usize::MAX,
            ));
        }

        // Backend choice needs the merged segment count; merging does not depend on
        // the backend (only the blob does).
        let nseg = build_segments(&pairs, "", options.merge).len();
        let candidates: Vec<Candidate<'_>> = order
            .iter()
            .map(|&i| {
                let name = self.shared.backends[i].name();
                Candidate {
                    name,
                    caps: self.shared.caps[i],
                    locals_registered: keep.iter().all(|r| r.registered_with(i)),
                    peer_offers: peer.as_ref().is_none_or(|p| p.offers(name)),
                    remotes_registered: pairs.iter().all(|(_, r)| match r {
                        Resolved::Remote { region, .. } => region.blob(name).is_some(),
                        Resolved::Local { .. } => true,
                    }),
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
        let segments = build_segments(&pairs, b.name(), options.merge);
        let bytes = segments.iter().map(|s| s.local.len() as u64).sum();
        let n = segments.len();
        let prepared = b.prepare(TransferPlan {
            op,
            peer: peer_name.clone(),
            segments,
        })?;
        Ok(request(
            b.name().to_owned(),
            prepared,
            bytes,
            n,
            self.shared.caps[backend].max_notification,
        ))
    }

    /// Build a request from plain descriptor lists (checks them, then prepares). `peer`
    /// may be this agent's own name for a local transfer.
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
        let r = self.prep_remote(peer, remote)?;
        let idx: Vec<usize> = (0..local.len()).collect();
        self.make_request(op, &l, &idx, &r, &idx, options)
    }

    /// One-shot transfer: check, prepare and post. Await the returned future.
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
        self.create_request(op, local, peer, remote, &RequestOptions::default())?
            .post(notif)
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
