//! Peers: loading their metadata, generations, connections.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;

use super::{Agent, Peer};
use crate::descriptor::RangeIndex;
use crate::error::{err, Error, ErrorKind, Result};
use crate::metadata::AgentMetadata;
use crate::region::{RemoteRegion, RemoteRegionInfo};
use crate::transfer::RequestOwner;

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

impl Agent {
    /// Load a peer's metadata (full or partial); returns the peer's name.
    ///
    /// Full metadata replaces what was known and starts a new generation: requests
    /// prepared against the older copy are refused from then on. Partial metadata adds
    /// or replaces regions of a known peer (same instance) and keeps the generation.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`]/[`ErrorKind::NotSupported`] for bad bytes;
    /// [`ErrorKind::InvalidArgument`] for this agent's own metadata;
    /// [`ErrorKind::UnknownPeer`] for partial metadata of a peer never loaded (without
    /// connection info); [`ErrorKind::Mismatch`] for partial metadata of another instance.
    pub fn load_metadata(&self, bytes: &[u8]) -> Result<String> {
        const OP: &str = "load metadata";
        self.shared.check_running(OP)?;
        let md = AgentMetadata::decode(bytes)?;
        if md.name == self.shared.name {
            return err(ErrorKind::InvalidArgument, OP, "this is the agent's own metadata; use the agent's own name as peer for local transfers");
        }
        let mut peers = self.shared.peers.write().unwrap();
        let old = peers.get(&md.name).cloned();
        let has_conn = md.backends.iter().any(|b| b.conn_info.is_some());
        let load = plan_load(
            old.as_ref().map(|p| p.instance),
            md.instance,
            md.partial,
            has_conn,
        )
        .or_else(|(kind, why)| err(kind, OP, format!("peer {:?}: {why}", md.name)))?;
        let base = match load {
            Load::Extend => old.clone(),
            Load::Replace { .. } => None,
        };
        let mut regions = RangeIndex::default();
        let mut by_id = HashMap::new();
        let mut backends: Vec<(String, Option<Bytes>)> = Vec::new();
        if let Some(b) = &base {
            for r in b.by_id.values() {
                if !md.regions.iter().any(|n| n.id == r.id) {
                    regions.insert(r.clone(), OP)?;
                    by_id.insert(r.id, r.clone());
                }
            }
            backends = b.backends.clone();
        }
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
        for rm in &md.regions {
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
        if load == (Load::Replace { restarted: true }) {
            // A peer restarted under the same name: drop connections to the old instance.
            for b in &self.shared.backends {
                if let Err(e) = b.remove_peer(&md.name) {
                    tracing::warn!(peer = %md.name, backend = b.name(), error = %e, "closing connections to the peer's previous instance failed");
                }
            }
        }
        for bm in md.backends.iter().filter(|b| b.conn_info.is_some()) {
            if let Some(b) = self.shared.backends.iter().find(|b| b.name() == bm.name) {
                b.add_peer(&md.name, bm.conn_info.as_deref().unwrap_or_default())?;
            }
        }
        let generation = match &base {
            Some(b) => b.generation,
            None => self.shared.next_generation.fetch_add(1, Ordering::Relaxed),
        };
        peers.insert(
            md.name.clone(),
            Arc::new(Peer {
                instance: md.instance,
                generation,
                backends,
                regions,
                by_id,
            }),
        );
        if let Some(m) = &self.shared.metrics {
            m.peers.set(peers.len() as f64);
        }
        tracing::debug!(agent = %self.shared.name, peer = %md.name, generation, partial = md.partial, regions = md.regions.len(), "loaded peer metadata");
        Ok(md.name)
    }

    /// Forget a peer: its connections close, its in-flight transfers fail, and requests
    /// prepared for it are refused.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownPeer`] if it is not known; the first backend's error when
    /// closing its connections failed (the peer is forgotten all the same).
    pub fn forget_peer(&self, peer: &str) -> Result<()> {
        {
            let mut peers = self.shared.peers.write().unwrap();
            if peers.remove(peer).is_none() {
                return err(
                    ErrorKind::UnknownPeer,
                    "forget peer",
                    format!("peer {peer:?} is not known"),
                );
            }
            if let Some(m) = &self.shared.metrics {
                m.peers.set(peers.len() as f64);
            }
        }
        let mut first = None;
        for b in &self.shared.backends {
            if let Err(e) = b.remove_peer(peer) {
                tracing::warn!(%peer, backend = b.name(), error = %e, "closing the peer's connections failed");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
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
    /// [`ErrorKind::UnknownPeer`]; the first backend's connection error.
    pub async fn connect(&self, peer: &str) -> Result<()> {
        let p = self.peer(peer, "connect")?;
        for b in &self.shared.backends {
            if p.offers(b.name()) {
                b.connect(peer).await?;
            }
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
