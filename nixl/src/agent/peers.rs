//! Peers: loading their metadata, generations, connections.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;

use super::links::{self, Dialect};
use super::{Agent, Peer};
use crate::descriptor::RangeIndex;
use crate::error::{err, Error, ErrorKind, Result};
use crate::interop::{self, NixlMetadata};
use crate::memory::MemKind;
use crate::metadata::{AgentMetadata, BackendMeta, RegionBlob, RegionMeta};
use crate::region::{RemoteRegion, RemoteRegionInfo};
use crate::transfer::{PeerSlot, RequestOwner};

/// How many peers, and regions of theirs, an agent keeps; set with
/// [`AgentBuilder::peer_limits`](crate::AgentBuilder::peer_limits).
///
/// Metadata that would go over a limit is refused ([`ErrorKind::NotAllowed`], naming
/// the limit) and changes nothing. The `unverified_*` limits bound what sources that
/// did not authenticate (a side channel's client without the shared secret, NIXL's
/// listener) can make the agent hold: peers they introduced and no trusted source
/// (the application, or the peer itself proving the secret) has confirmed since, and
/// those peers' regions. Room above them is left to the application.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLimits {
    /// Peers known at once; default 16,384.
    pub peers: usize,
    /// Regions of all peers together; default 4,000,000.
    pub regions: usize,
    /// Peers introduced by unauthenticated sources and not confirmed since; default
    /// 1,024.
    pub unverified_peers: usize,
    /// Regions unauthenticated sources put in: those peers' regions, and those they
    /// added to peers a trusted source loaded; default 262,144.
    pub unverified_regions: usize,
}

impl Default for PeerLimits {
    fn default() -> Self {
        Self {
            peers: 16_384,
            regions: 4_000_000,
            unverified_peers: 1_024,
            unverified_regions: 262_144,
        }
    }
}

/// What loading a peer's metadata does to what is known of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    /// Partial metadata of the known instance: add or replace regions, keep the
    /// generation (requests prepared before stay valid).
    Extend,
    /// Full metadata: replace everything, start a new generation. `restarted` when it
    /// comes from another instance than the one known (connections to the old one
    /// must be dropped).
    Replace { restarted: bool },
}

/// How far metadata being loaded is believed: whether it may move a known peer to
/// other connection info (or make the agent forget one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Trust {
    /// The application's word ([`Agent::load_metadata`], its own fetches, etcd keys
    /// it watches), or any client of a side channel whose application accepts peer
    /// updates: may replace anything (a peer that restarted elsewhere).
    Full,
    /// A side-channel client that proved the shared secret as the agent of this
    /// name: [`Trust::Full`] for that peer's own metadata, [`Trust::Unverified`] for
    /// anyone else's.
    Proven(String),
    /// An unauthenticated side-channel client: may introduce a peer not known yet
    /// and add registrations to a known peer's instance; never moves a known peer to
    /// other connection info, never replaces its instance, and never changes or
    /// drops a region already known (see [`PeerLimits`] for how much it may add).
    Unverified,
    /// NIXL's listener, under NIXL's own rules (see [`Agent::load_nixl_untrusted`]).
    NixlListener,
}

impl Trust {
    /// Whether this source may move or forget the peer `name`.
    pub(crate) fn vouches_for(&self, name: &str) -> bool {
        match self {
            Self::Full => true,
            Self::Proven(n) => n == name,
            Self::Unverified | Self::NixlListener => false,
        }
    }
}

/// What would move a known peer (of kind `old_nixl`, with backends `old`) if its
/// backends became `new`: connection info added, changed or removed for any backend,
/// or the peer turning from a NIXL agent into a peer of this crate or back. `None`
/// when every backend keeps its connection info.
fn moved(
    old_nixl: bool,
    old: &[(String, Option<Bytes>)],
    nixl: bool,
    new: &[(String, Option<Bytes>)],
) -> Option<String> {
    if old_nixl != nixl {
        return Some(if old_nixl {
            "a NIXL agent would become a peer of this crate".into()
        } else {
            "a peer of this crate would become a NIXL agent".into()
        });
    }
    let conn = |list: &[(String, Option<Bytes>)], name: &str| {
        list.iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, c)| c.clone())
    };
    for name in old.iter().chain(new).map(|(n, _)| n.as_str()) {
        match (conn(old, name), conn(new, name)) {
            (Some(a), Some(b)) if a == b => {}
            (None, None) => {}
            (Some(_), Some(_)) => return Some(format!("backend {name}: other connection info")),
            (None, Some(_)) => {
                return Some(format!("backend {name}: connection info where it had none"))
            }
            (Some(_), None) => return Some(format!("backend {name}: its connection info removed")),
        }
    }
    None
}

/// The generation rule, as a pure function of what is known and what arrived.
fn plan_load(
    known_instance: Option<u64>,
    instance: u64,
    partial: bool,
    has_conn_info: bool,
) -> std::result::Result<Load, (ErrorKind, &'static str)> {
    match (known_instance, partial) {
        (Some(k), true) if k == instance => Ok(Load::Extend),
        (Some(_), true) => Err((
            ErrorKind::Mismatch,
            "partial metadata comes from another instance; load its full metadata first",
        )),
        (None, true) if !has_conn_info => Err((
            ErrorKind::UnknownPeer,
            "partial metadata without connection info for an unknown peer",
        )),
        (known, _) => Ok(Load::Replace {
            restarted: known.is_some_and(|k| k != instance),
        }),
    }
}

/// Whether two descriptions of a remote region say the same.
fn same_region(a: &RemoteRegion, b: &RemoteRegion) -> bool {
    a.id == b.id && a.kind == b.kind && a.addr == b.addr && a.len == b.len && a.blobs == b.blobs
}

impl Agent {
    /// Load a peer's metadata (full or partial); returns the peer's name.
    ///
    /// Full metadata replaces what was known and starts a new generation: requests
    /// prepared against the older copy are refused from then on. Partial metadata adds
    /// or replaces regions of a known peer (same instance) and keeps the generation.
    ///
    /// Metadata in NIXL's format (from a NIXL agent, see [`crate::interop`]) is
    /// recognised by its first bytes and loads a NIXL peer, reached through the
    /// backends that speak NIXL's dialect ([`Backend::nixl`](crate::Backend::nixl)).
    /// NIXL's loads add: every load adds or replaces descriptors and none are
    /// removed, while the peer's connection info stays the same. New connection info
    /// (a NIXL agent restarted under the same name) replaces everything, as full
    /// metadata of a new instance does. Each NIXL descriptor becomes one remote region
    /// (sections of memory types other than DRAM and VRAM, and of backends this
    /// agent cannot speak, are skipped); overlapping descriptors are refused.
    ///
    /// This is the application's word: it may move a known peer to other connection
    /// info (a peer that restarted elsewhere). A side-channel client that did not
    /// authenticate may not (see
    /// [`SideChannelOptions::accept_peer_updates`](crate::SideChannelOptions::accept_peer_updates)).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`]/[`ErrorKind::NotSupported`] for bad bytes;
    /// [`ErrorKind::InvalidArgument`] for this agent's own metadata;
    /// [`ErrorKind::UnknownPeer`] for partial metadata of a peer never loaded (without
    /// connection info); [`ErrorKind::Mismatch`] for partial metadata of another instance.
    pub fn load_metadata(&self, bytes: &[u8]) -> Result<String> {
        self.load_metadata_from(bytes, None, Trust::Full)
    }

    /// Load metadata as [`Agent::load_metadata`] does, from a source `trust` says how
    /// far to believe. With `expect`, metadata naming another agent than `expect` is
    /// refused ([`ErrorKind::Mismatch`]) before anything is loaded: what was asked
    /// for by name (an etcd key, a fetch naming its peer) must be that peer's.
    pub(crate) fn load_metadata_from(
        &self,
        bytes: &[u8],
        expect: Option<&str>,
        trust: Trust,
    ) -> Result<String> {
        const OP: &str = "load metadata";
        self.shared.check_running(OP)?;
        let check = |name: &str| match expect {
            Some(e) if e != name => err(
                ErrorKind::Mismatch,
                OP,
                format!("asked for {e:?}'s metadata, got {name:?}'s; nothing was loaded"),
            ),
            _ => Ok(()),
        };
        if interop::is_nixl_format(bytes) {
            let md = NixlMetadata::decode(bytes)?;
            check(&md.name)?;
            let (md, nixl_rs) = self.translate_nixl(md)?;
            return self.load_decoded(md, Dialect::Nixl { nixl_rs }, trust);
        }
        let md = AgentMetadata::decode(bytes)?;
        check(&md.name)?;
        self.load_decoded(md, Dialect::Ours, trust)
    }

    /// Load NIXL-format metadata from an unauthenticated source (a NIXL listener's
    /// `LOAD`) under NIXL's own rules: NIXL's format only, never over a peer of this
    /// crate, never new connection info for a known NIXL agent.
    pub(crate) fn load_nixl_untrusted(&self, bytes: &[u8]) -> Result<String> {
        const OP: &str = "load NIXL metadata";
        self.shared.check_running(OP)?;
        if !interop::is_nixl_format(bytes) {
            return err(
                ErrorKind::NotAllowed,
                OP,
                "a NIXL listener loads NIXL's format only",
            );
        }
        let (md, nixl_rs) = self.translate_nixl(NixlMetadata::decode(bytes)?)?;
        self.load_decoded(md, Dialect::Nixl { nixl_rs }, Trust::NixlListener)
    }

    /// Translate a NIXL agent's metadata into this crate's form. The instance is
    /// derived from the connection info (0 without it) and `partial` is set; see
    /// [`Agent::load_decoded`] for how both are then settled.
    /// Also says whether the metadata carries the nixl-rs marker
    /// ([`interop::BACKEND_NIXL_RS`]).
    fn translate_nixl(&self, md: NixlMetadata) -> Result<(AgentMetadata, bool)> {
        const OP: &str = "load NIXL metadata";
        let speakers: Vec<(&str, &dyn crate::backend::NixlDialect)> = self
            .shared
            .backends
            .iter()
            .filter_map(|b| b.nixl().map(|d| (b.name(), d)))
            .collect();
        if speakers.is_empty() {
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "peer {:?} is a NIXL agent, and no backend of this agent speaks NIXL's protocol (nixl-ucx does)",
                    md.name
                ),
            );
        }
        let mut backends: Vec<BackendMeta> = Vec::new();
        let index = |backends: &mut Vec<BackendMeta>, name: &str| {
            backends
                .iter()
                .position(|b| b.name == name)
                .unwrap_or_else(|| {
                    backends.push(BackendMeta {
                        name: name.to_owned(),
                        conn_info: None,
                    });
                    backends.len() - 1
                })
        };
        let mut hasher = std::hash::DefaultHasher::new();
        let nixl_rs = md
            .conns
            .iter()
            .any(|c| c.backend == interop::BACKEND_NIXL_RS && c.info == interop::NIXL_RS_MARKER);
        for c in &md.conns {
            if c.backend == interop::BACKEND_NIXL_RS {
                continue;
            }
            let Some((ours, _)) = speakers.iter().find(|(_, d)| d.backend_type() == c.backend)
            else {
                tracing::debug!(peer = %md.name, backend = %c.backend, "NIXL metadata: skipping a backend no backend here speaks");
                continue;
            };
            if c.info.is_empty() {
                tracing::debug!(peer = %md.name, backend = %c.backend, "NIXL metadata: skipping empty connection info");
                continue;
            }
            let i = index(&mut backends, ours);
            backends[i].conn_info = Some(c.info.clone());
            c.backend.hash(&mut hasher);
            c.info.hash(&mut hasher);
        }
        let has_conn = backends.iter().any(|b| b.conn_info.is_some());
        let mut regions: Vec<RegionMeta> = Vec::new();
        let mut by_range: HashMap<(MemKind, u64, u64), usize> = HashMap::new();
        for s in &md.sections {
            let Some((ours, dialect)) =
                speakers.iter().find(|(_, d)| d.backend_type() == s.backend)
            else {
                continue;
            };
            if s.mem_type != interop::MEM_DRAM && s.mem_type != interop::MEM_VRAM {
                tracing::debug!(peer = %md.name, mem_type = s.mem_type, "NIXL metadata: skipping a section of a memory type this crate does not address");
                continue;
            }
            let b = index(&mut backends, ours) as u16;
            for d in &s.descs {
                let kind = if s.mem_type == interop::MEM_DRAM {
                    MemKind::Dram
                } else {
                    let device = u32::try_from(d.device).map_err(|_| {
                        Error::new(
                            ErrorKind::Corrupt,
                            OP,
                            format!("peer {:?}: device id {} out of range", md.name, d.device),
                        )
                    })?;
                    MemKind::Vram { device }
                };
                let blob = dialect.import_blob(d.addr, d.len, &d.blob)?.to_vec();
                let slot = *by_range.entry((kind, d.addr, d.len)).or_insert_with(|| {
                    let mut h = std::hash::DefaultHasher::new();
                    (kind, d.addr, d.len).hash(&mut h);
                    regions.push(RegionMeta {
                        id: h.finish(),
                        kind,
                        addr: d.addr,
                        len: d.len,
                        blobs: Vec::new(),
                    });
                    regions.len() - 1
                });
                let r = &mut regions[slot];
                r.blobs.retain(|x| x.backend != b);
                r.blobs.push(RegionBlob { backend: b, blob });
            }
        }
        Ok((
            AgentMetadata {
                name: md.name,
                instance: if has_conn { hasher.finish() } else { 0 },
                partial: true,
                backends,
                regions,
            },
            nixl_rs,
        ))
    }

    /// Load decoded metadata, as far as `trust` allows (see [`Trust`]); `dialect`
    /// [`Dialect::Nixl`] for metadata in NIXL's format (from [`Agent::translate_nixl`]),
    /// whose generation rule is settled here, under the lock: without connection info
    /// it extends the known peer; with the same connection info as known it extends
    /// too; new connection info (or an unknown peer) replaces.
    ///
    /// The new state is built, and the backends told, without the agent-wide `peers`
    /// lock (loads are serialised among themselves only), then swapped in: transfers
    /// to other peers go on meanwhile. A backend that refuses the new connection info
    /// leaves the old state whole, in the agent and in the backends told before it.
    fn load_decoded(
        &self,
        mut md: AgentMetadata,
        dialect: Dialect,
        trust: Trust,
    ) -> Result<String> {
        let nixl = matches!(dialect, Dialect::Nixl { .. });
        const OP: &str = "load metadata";
        if md.name == self.shared.name {
            return err(ErrorKind::InvalidArgument, OP, "this is the agent's own metadata; use the agent's own name as peer for local transfers");
        }
        let trust = match trust {
            Trust::Proven(_) if trust.vouches_for(&md.name) => Trust::Full,
            Trust::Proven(_) => Trust::Unverified,
            t => t,
        };
        let _loading = self.shared.loading.lock().unwrap();
        // Shutdown waits for a load already holding the lock (so the links it makes
        // are among those the backends close); one that got the lock later stops here.
        self.shared.check_running(OP)?;
        let old = self.shared.peers.read().unwrap().get(&md.name).cloned();
        let has_conn = md.backends.iter().any(|b| b.conn_info.is_some());
        if trust == Trust::NixlListener {
            // NIXL's rule, for metadata from anyone who reaches a NIXL listener: it
            // neither takes over a peer of this crate nor moves a NIXL agent to new
            // connection info (the old one must be forgotten first).
            match &old {
                Some(p) if !p.nixl => {
                    return err(
                        ErrorKind::NotAllowed,
                        OP,
                        format!("{:?} is a peer of this crate, not a NIXL agent", md.name),
                    )
                }
                Some(p) if has_conn && p.instance != md.instance => {
                    return err(
                        ErrorKind::NotAllowed,
                        OP,
                        format!(
                            "NIXL agent {:?} is known with other connection info; forget it first",
                            md.name
                        ),
                    )
                }
                _ => {}
            }
        }
        if nixl {
            let known = old.as_ref().filter(|p| p.nixl).map(|p| p.instance);
            match known {
                Some(k) if !has_conn || k == md.instance => {
                    md.instance = k;
                    md.partial = true;
                }
                _ => md.partial = !has_conn,
            }
        }
        let mut load = plan_load(
            old.as_ref().map(|p| p.instance),
            md.instance,
            md.partial,
            has_conn,
        )
        .or_else(|(kind, why)| err(kind, OP, format!("peer {:?}: {why}", md.name)))?;
        // An unauthenticated sender adds to a known peer and never replaces it: a new
        // instance is refused, and full metadata of the known instance only adds.
        let add_only = trust == Trust::Unverified && old.is_some();
        if add_only {
            match load {
                Load::Replace { restarted: true } => {
                    return err(
                        ErrorKind::NotAllowed,
                        OP,
                        format!(
                            "peer {:?} is known as another instance; an unauthenticated sender may add to a known peer, never replace it (the application can forget it first, or authenticate the sender with the shared secret)",
                            md.name
                        ),
                    )
                }
                Load::Replace { restarted: false } => load = Load::Extend,
                Load::Extend => {}
            }
        }
        let base = match load {
            Load::Extend => old.clone(),
            Load::Replace { .. } => None,
        };
        let mut regions = RangeIndex::default();
        let mut by_id = HashMap::new();
        let mut backends: Vec<(String, Option<Bytes>)> = base
            .as_ref()
            .map(|b| b.backends.clone())
            .unwrap_or_default();
        for bm in &md.backends {
            let conn = bm.conn_info.clone().map(Bytes::from);
            match backends.iter_mut().find(|(n, _)| *n == bm.name) {
                Some(slot) => {
                    if conn.is_some() {
                        slot.1 = conn;
                    }
                }
                None => backends.push((bm.name.clone(), conn)),
            }
        }
        if trust == Trust::Unverified {
            if let Some(why) = old
                .as_deref()
                .and_then(|p| moved(p.nixl, &p.backends, nixl, &backends))
            {
                return err(
                    ErrorKind::NotAllowed,
                    OP,
                    format!(
                        "peer {:?} is known, and this metadata would move it ({why}); an unauthenticated sender may not move a known peer",
                        md.name
                    ),
                );
            }
        }
        for rm in &md.regions {
            // Limits count regions by id and blobs are kept per backend: a repeated
            // id or backend would hold memory no limit counts.
            let repeated_backend = rm.blobs.len() > 1 && {
                let mut named: Vec<_> = rm.blobs.iter().map(|b| b.backend).collect();
                named.sort_unstable();
                named.windows(2).any(|w| w[0] == w[1])
            };
            if by_id.contains_key(&rm.id) || repeated_backend {
                return err(
                    ErrorKind::Corrupt,
                    OP,
                    format!(
                        "peer {:?}: region {} is listed twice, or names one backend twice",
                        md.name, rm.id
                    ),
                );
            }
            let region = Arc::new(RemoteRegion {
                id: rm.id,
                kind: rm.kind,
                addr: rm.addr,
                len: rm.len,
                blobs: rm
                    .blobs
                    .iter()
                    .map(|b| {
                        (
                            md.backends[b.backend as usize].name.clone(),
                            Bytes::from(b.blob.clone()),
                        )
                    })
                    .collect(),
            });
            regions.insert(region.clone(), OP).map_err(|e| {
                Error::new(
                    ErrorKind::Corrupt,
                    OP,
                    format!("peer {:?}: {}", md.name, e.context()),
                )
            })?;
            by_id.insert(rm.id, region);
        }
        if let Some(b) = &base {
            // What the peer had and this load does not replace stays; for a NIXL
            // agent, whose loads only ever add, a known descriptor that overlaps a new
            // one was deregistered there (its memory registered anew): newest wins.
            for r in b.by_id.values() {
                if let Some(new) = by_id.get(&r.id) {
                    if add_only && !same_region(new, r) {
                        return err(
                            ErrorKind::NotAllowed,
                            OP,
                            format!(
                                "peer {:?}: this metadata would change its known region {}; an unauthenticated sender may add regions, never change one",
                                md.name, r.id
                            ),
                        );
                    }
                    continue;
                }
                match regions.insert(r.clone(), OP) {
                    Ok(()) => {
                        by_id.insert(r.id, r.clone());
                    }
                    Err(_) if add_only => {
                        return err(
                            ErrorKind::NotAllowed,
                            OP,
                            format!(
                                "peer {:?}: this metadata overlaps its known region {}; an unauthenticated sender may add regions, never replace one",
                                md.name, r.id
                            ),
                        );
                    }
                    Err(_) if nixl => {
                        tracing::debug!(peer = %md.name, addr = r.addr, len = r.len, "NIXL metadata: dropping a known descriptor a new one overlaps");
                    }
                    Err(e) => {
                        return err(
                            ErrorKind::Corrupt,
                            OP,
                            format!("peer {:?}: {}", md.name, e.context()),
                        )
                    }
                }
            }
        }
        // A trusted source confirms the peer; an unauthenticated one leaves it as it was.
        let trusted = matches!(trust, Trust::Full | Trust::Proven(_));
        let verified = trusted || old.as_ref().is_some_and(|p| p.verified);
        // The regions unauthenticated senders put in this peer: all of an
        // unverified peer's; those they added to a verified one (a trusted load
        // that replaces the table clears them, one that extends it keeps them).
        let charged = match (verified, trusted, &base) {
            (false, _, _) => by_id.len(),
            (true, true, None) => 0,
            (true, true, Some(b)) => b.charged,
            (true, false, b) => {
                let (had, charged) = b.as_ref().map_or((0, 0), |b| (b.by_id.len(), b.charged));
                charged + by_id.len().saturating_sub(had)
            }
        };
        self.check_peer_limits(&md.name, old.is_none(), verified, by_id.len(), charged)?;
        // A restarted peer gets new links (the old instance's connections close once
        // it is replaced); otherwise a backend whose connection info is the same keeps
        // its link.
        let restarted = load == (Load::Replace { restarted: true });
        // The nixl-rs marker travels with connection info only (NIXL's partial
        // metadata carries none), and only a source trusted to move the peer may
        // change it: otherwise a known NIXL-format peer keeps the dialect its links
        // speak (a partial load would else relink it as a plain NIXL agent, failing
        // what is in flight, or an unauthenticated one flip it either way).
        let dialect = match (dialect, old.as_ref().and_then(|o| o.links.dialect())) {
            (Dialect::Nixl { .. }, Some(known @ Dialect::Nixl { .. }))
                if !has_conn || add_only || trust == Trust::NixlListener =>
            {
                known
            }
            (d, _) => d,
        };
        let links = links::make(
            &self.shared.backends,
            &md.name,
            &backends,
            dialect,
            old.as_deref().map(|p| &p.links),
            restarted,
        )?;
        // Requests prepared on a link this load replaces would post on a closed link:
        // a new generation refuses them instead (prepare them again).
        let relinked = old.as_ref().is_some_and(|o| links.replaces(&o.links));
        let (generation, slot) = match (&base, &old) {
            (Some(b), _) if !relinked => (b.generation, b.slot.clone()),
            (_, old) => {
                let g = self.shared.next_generation.fetch_add(1, Ordering::Relaxed);
                (
                    g,
                    old.as_ref()
                        .map_or_else(|| PeerSlot::new(g), |o| o.slot.clone()),
                )
            }
        };
        let new = Arc::new(Peer {
            nixl,
            verified,
            charged,
            instance: md.instance,
            generation,
            slot: slot.clone(),
            backends,
            links,
            regions,
            by_id,
        });
        let n = {
            let mut peers = self.shared.peers.write().unwrap();
            peers.insert(md.name.clone(), new.clone());
            // Posts see the new generation once it is in place.
            slot.set(generation);
            peers.len()
        };
        if let Some(old) = &old {
            let why = if restarted {
                "the peer restarted"
            } else {
                "the peer's link was replaced (new connection info, or the link failed)"
            };
            old.links.retire(&new.links, why);
        }
        if let Some(m) = &self.shared.metrics {
            m.peers.set(n as f64);
        }
        tracing::debug!(agent = %self.shared.name, peer = %md.name, generation, partial = md.partial, nixl, regions = md.regions.len(), "loaded peer metadata");
        Ok(md.name)
    }

    /// Refuse a load that would take the peer table over [`PeerLimits`]: `name` with
    /// `regions` regions (`new`: not known yet), `verified` or not, `charged` of them
    /// put there by unauthenticated senders. Called with the loading lock held, so
    /// the table cannot change meanwhile.
    fn check_peer_limits(
        &self,
        name: &str,
        new: bool,
        verified: bool,
        regions: usize,
        charged: usize,
    ) -> Result<()> {
        const OP: &str = "load metadata";
        let limits = &self.shared.peer_limits;
        let peers = self.shared.peers.read().unwrap();
        let others = peers.iter().filter(|(n, _)| n.as_str() != name);
        let (mut all, mut unverified, mut unverified_regions) =
            (regions, usize::from(!verified), charged);
        for (_, p) in others {
            all += p.by_id.len();
            unverified += usize::from(!p.verified);
            unverified_regions += p.charged;
        }
        let grows = charged > peers.get(name).map_or(0, |p| p.charged);
        let over = if new && peers.len() >= limits.peers {
            Some(format!("{} peers (PeerLimits::peers)", limits.peers))
        } else if all > limits.regions {
            Some(format!(
                "{} regions of all peers (PeerLimits::regions)",
                limits.regions
            ))
        } else if !verified && unverified > limits.unverified_peers {
            Some(format!(
                "{} peers introduced by unauthenticated senders (PeerLimits::unverified_peers)",
                limits.unverified_peers
            ))
        } else if grows && unverified_regions > limits.unverified_regions {
            Some(format!(
                "{} regions put in by unauthenticated senders (PeerLimits::unverified_regions)",
                limits.unverified_regions
            ))
        } else {
            None
        };
        match over {
            Some(limit) => err(
                ErrorKind::NotAllowed,
                OP,
                format!("peer {name:?} with {regions} regions would exceed this agent's limit of {limit}; nothing was loaded"),
            ),
            None => Ok(()),
        }
    }

    /// Forget a peer: its connections close, its in-flight transfers fail, and requests
    /// prepared for it are refused.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`] if it is not known.
    pub fn forget_peer(&self, peer: &str) -> Result<()> {
        self.forget_peer_unless(peer, |_| None)
    }

    /// Forget `peer` unless `refuse`, told whether the known peer is a NIXL agent,
    /// gives a reason: asked with the loading lock held, so no load replaces the
    /// peer between the question and the forgetting (a remote invalidation may
    /// forget only what it was checked against).
    pub(crate) fn forget_peer_unless(
        &self,
        peer: &str,
        refuse: impl FnOnce(bool) -> Option<Error>,
    ) -> Result<()> {
        let _loading = self.shared.loading.lock().unwrap();
        let gone = {
            let mut peers = self.shared.peers.write().unwrap();
            let Some(known) = peers.get(peer) else {
                return err(
                    ErrorKind::UnknownPeer,
                    "forget peer",
                    format!("peer {peer:?} is not known"),
                );
            };
            if let Some(e) = refuse(known.nixl) {
                return Err(e);
            }
            let p = peers.remove(peer).expect("checked above");
            p.slot.retire();
            if let Some(m) = &self.shared.metrics {
                m.peers.set(peers.len() as f64);
            }
            p
        };
        gone.links.close("the peer was forgotten");
        Ok(())
    }

    /// Whether `peer` was loaded from NIXL-format metadata: a NIXL agent, which this
    /// agent's backends speak to in NIXL's dialect.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`].
    pub fn is_nixl_peer(&self, peer: &str) -> Result<bool> {
        Ok(self.peer(peer, "query peer")?.nixl)
    }

    /// Names of known peers.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<_> = self.shared.peers.read().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

    /// Regions a peer advertised, sorted by id.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`].
    pub fn remote_regions(&self, peer: &str) -> Result<Vec<RemoteRegionInfo>> {
        let p = self.peer(peer, "list remote regions")?;
        let mut v: Vec<_> = p
            .by_id
            .values()
            .map(|r| RemoteRegionInfo {
                id: r.id,
                kind: r.kind,
                addr: r.addr,
                len: r.len,
            })
            .collect();
        v.sort_by_key(|r| r.id);
        Ok(v)
    }

    pub(super) fn peer(&self, peer: &str, op: &'static str) -> Result<Arc<Peer>> {
        self.shared
            .peers
            .read()
            .unwrap()
            .get(peer)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::UnknownPeer,
                    op,
                    format!("peer {peer:?} is not loaded"),
                )
            })
    }

    /// Connect to a loaded peer now with every backend both sides have, instead of at
    /// the first transfer.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`]; [`ErrorKind::ShutDown`] once the agent is shutting
    /// down; the first backend's connection error.
    pub async fn connect(&self, peer: &str) -> Result<()> {
        self.shared.check_running("connect")?;
        let p = self.peer(peer, "connect")?;
        for (_, link) in p.links.iter() {
            link.connect().await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_load_starts_a_generation() {
        assert_eq!(
            plan_load(None, 7, false, true),
            Ok(Load::Replace { restarted: false })
        );
        // Partial metadata with connection info introduces a peer too.
        assert_eq!(
            plan_load(None, 7, true, true),
            Ok(Load::Replace { restarted: false })
        );
    }

    #[test]
    fn partial_of_the_same_instance_keeps_the_generation() {
        assert_eq!(plan_load(Some(7), 7, true, false), Ok(Load::Extend));
        assert_eq!(plan_load(Some(7), 7, true, true), Ok(Load::Extend));
    }

    #[test]
    fn full_reload_replaces_and_restart_is_noticed() {
        assert_eq!(
            plan_load(Some(7), 7, false, true),
            Ok(Load::Replace { restarted: false })
        );
        assert_eq!(
            plan_load(Some(7), 8, false, true),
            Ok(Load::Replace { restarted: true })
        );
    }

    #[test]
    fn moving_means_connection_info_changes() {
        let b = |v: &[(&str, Option<&'static [u8]>)]| -> Vec<(String, Option<Bytes>)> {
            v.iter()
                .map(|(n, c)| (n.to_string(), c.map(Bytes::from_static)))
                .collect()
        };
        let known = b(&[("tcp", Some(b"a:1")), ("ucx", None)]);
        // The same connection info, in any order, with or without backends that
        // have none: not a move.
        assert_eq!(moved(false, &known, false, &known), None);
        assert_eq!(
            moved(false, &known, false, &b(&[("tcp", Some(b"a:1"))])),
            None
        );
        assert_eq!(
            moved(
                false,
                &known,
                false,
                &b(&[("ucx", None), ("tcp", Some(b"a:1"))])
            ),
            None
        );
        // Changed, added, removed, or another kind of peer: a move.
        for new in [
            b(&[("tcp", Some(b"evil:1"))]),
            b(&[("tcp", Some(b"a:1")), ("ucx", Some(b"evil"))]),
            b(&[("tcp", None)]),
            b(&[]),
        ] {
            assert!(moved(false, &known, false, &new).is_some(), "{new:?}");
        }
        assert!(moved(false, &known, true, &known).is_some());
        assert!(moved(true, &known, false, &known).is_some());
    }

    fn md(name: &str, instance: u64, regions: &[(u64, u64)]) -> Vec<u8> {
        AgentMetadata {
            name: name.into(),
            instance,
            partial: false,
            backends: vec![BackendMeta {
                name: "tcp".into(),
                conn_info: Some(format!("{name}:1").into_bytes()),
            }],
            regions: regions
                .iter()
                .map(|&(id, addr)| RegionMeta {
                    id,
                    kind: MemKind::Dram,
                    addr,
                    len: 4096,
                    blobs: vec![RegionBlob {
                        backend: 0,
                        blob: id.to_le_bytes().to_vec(),
                    }],
                })
                .collect(),
        }
        .encode()
        .unwrap()
    }

    fn regions(a: &Agent, peer: &str) -> Vec<(u64, u64)> {
        let mut v: Vec<_> = a
            .remote_regions(peer)
            .unwrap()
            .iter()
            .map(|r| (r.id, r.addr))
            .collect();
        v.sort_unstable();
        v
    }

    /// An unauthenticated sender adds to a known peer and nothing else: it cannot
    /// replace the peer's instance (which would close its connections), change a
    /// known region, or drop one.
    #[tokio::test]
    async fn unverified_metadata_adds_and_never_replaces_or_remaps() {
        let a = Agent::builder("a").build().await.unwrap();
        let load = |bytes: &[u8], trust| a.load_metadata_from(bytes, None, trust);
        load(&md("b", 1, &[(1, 0x1000)]), Trust::Full).unwrap();
        let kind = |r: Result<String>| r.unwrap_err().kind();
        // Another instance, same connection info.
        assert_eq!(
            kind(load(&md("b", 2, &[(1, 0x9000)]), Trust::Unverified)),
            ErrorKind::NotAllowed
        );
        // The same instance with a known region moved elsewhere.
        assert_eq!(
            kind(load(&md("b", 1, &[(1, 0x9000)]), Trust::Unverified)),
            ErrorKind::NotAllowed
        );
        assert_eq!(regions(&a, "b"), [(1, 0x1000)]);
        // The same instance with a new region, and without the known one: added, the
        // known one kept.
        load(&md("b", 1, &[(2, 0x3000)]), Trust::Unverified).unwrap();
        assert_eq!(regions(&a, "b"), [(1, 0x1000), (2, 0x3000)]);
        // The application's word still replaces.
        load(&md("b", 2, &[(1, 0x9000)]), Trust::Full).unwrap();
        assert_eq!(regions(&a, "b"), [(1, 0x9000)]);
    }

    #[tokio::test]
    async fn peer_limits_bound_what_is_loaded() {
        let a = Agent::builder("a")
            .peer_limits(PeerLimits {
                peers: 4,
                regions: 8,
                unverified_peers: 2,
                unverified_regions: 3,
            })
            .build()
            .await
            .unwrap();
        let load = |bytes: &[u8], trust| a.load_metadata_from(bytes, None, trust);
        let refused = |r: Result<String>| {
            let e = r.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
            e.to_string()
        };
        load(&md("u1", 1, &[(1, 0x1000)]), Trust::Unverified).unwrap();
        load(&md("u2", 1, &[(1, 0x1000), (2, 0x2000)]), Trust::Unverified).unwrap();
        assert!(refused(load(&md("u3", 1, &[]), Trust::Unverified)).contains("unverified_peers"));
        // Adding to an unverified peer counts against its sources' region budget.
        assert!(
            refused(load(&md("u1", 1, &[(3, 0x3000)]), Trust::Unverified))
                .contains("unverified_regions")
        );
        // The application's loads have the rest, and confirm the peers they load.
        load(&md("u1", 1, &[(1, 0x1000), (3, 0x3000)]), Trust::Full).unwrap();
        load(&md("v1", 1, &[(1, 0x1000)]), Trust::Full).unwrap();
        load(&md("v2", 1, &[(1, 0x1000)]), Trust::Full).unwrap();
        assert!(refused(load(&md("v3", 1, &[]), Trust::Full)).contains("PeerLimits::peers"));
        assert!(refused(load(
            &md(
                "v2",
                1,
                &[(1, 0x1000), (2, 0x2000), (3, 0x3000), (4, 0x4000)]
            ),
            Trust::Full
        ))
        .contains("PeerLimits::regions"));
        assert_eq!(a.peers(), ["u1", "u2", "v1", "v2"]);
        // A refused load changed nothing.
        assert_eq!(regions(&a, "v2"), [(1, 0x1000)]);
        // Regions an unauthenticated sender adds to a peer the application loaded
        // count against its sources' budget too (u2's 2 + these 2 > 3).
        assert!(refused(load(
            &md("v1", 1, &[(5, 0x5000), (6, 0x6000)]),
            Trust::Unverified
        ))
        .contains("unverified_regions"));
        assert_eq!(regions(&a, "v1"), [(1, 0x1000)]);
        load(&md("v1", 1, &[(5, 0x5000)]), Trust::Unverified).unwrap();
        assert_eq!(regions(&a, "v1"), [(1, 0x1000), (5, 0x5000)]);
    }

    #[test]
    fn refusals() {
        assert_eq!(
            plan_load(Some(7), 8, true, true).unwrap_err().0,
            ErrorKind::Mismatch
        );
        assert_eq!(
            plan_load(None, 8, true, false).unwrap_err().0,
            ErrorKind::UnknownPeer
        );
    }
}
