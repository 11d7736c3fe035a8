//! The agent's links to a peer, one per backend both sides have ([`PeerLink`]): made
//! when the peer's connection info for that backend is new, kept while it stays the
//! same, closed when the peer is forgotten, restarts or moves. A load makes the new
//! links before anything changes and closes the old ones only once the new peer is in
//! place, so a refused load leaves the old peer whole, links included.

use std::sync::Arc;

use bytes::Bytes;

use crate::backend::Backend;
use crate::error::Result;
use crate::peer_link::PeerLink;

/// Which format a peer's metadata came in, and so which protocol its backends get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dialect {
    /// This crate's format.
    Ours,
    /// NIXL's format; `nixl_rs` when it carries the nixl-rs marker
    /// ([`BACKEND_NIXL_RS`](crate::interop::BACKEND_NIXL_RS)).
    Nixl { nixl_rs: bool },
}

/// One backend's link to a peer, with what it was made for.
#[derive(Clone, Debug)]
pub(super) struct LinkEntry {
    info: Bytes,
    dialect: Dialect,
    pub(super) link: Arc<dyn PeerLink>,
}

/// A peer's links, by the agent's backend index.
#[derive(Debug, Default)]
pub(super) struct PeerLinks(Vec<Option<LinkEntry>>);

impl PeerLinks {
    /// The link through backend `i`, if the peer offers it.
    pub(super) fn get(&self, i: usize) -> Option<&Arc<dyn PeerLink>> {
        self.0.get(i)?.as_ref().map(|e| &e.link)
    }

    /// Every link, with its backend index.
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Arc<dyn PeerLink>)> {
        (self.0.iter().enumerate()).filter_map(|(i, e)| Some((i, &e.as_ref()?.link)))
    }

    /// The dialect the links were made for (`None` without links).
    pub(super) fn dialect(&self) -> Option<Dialect> {
        self.0.iter().flatten().map(|e| e.dialect).next()
    }

    /// Close every link (the peer is forgotten).
    pub(super) fn close(&self, why: &str) {
        for (_, l) in self.iter() {
            l.close(why);
        }
    }

    /// Whether `self` replaces a link of `old` (the backend had one, and it is not
    /// kept).
    pub(super) fn replaces(&self, old: &Self) -> bool {
        old.iter()
            .any(|(_, o)| !self.iter().any(|(_, n)| Arc::ptr_eq(n, o)))
    }

    /// Close the links of `self` that `new` does not keep (the peer restarted or
    /// moved; `new` is in place).
    pub(super) fn retire(&self, new: &Self, why: &str) {
        for (_, old) in self.iter() {
            if !new.iter().any(|(_, n)| Arc::ptr_eq(n, old)) {
                old.close(why);
            }
        }
    }
}

/// The links for `peer` with connection infos `infos` (backend name, info if any):
/// `old`'s link where the backend's info and the dialect are the same, the peer did
/// not restart and the link did not fail for good; a new one otherwise.
///
/// # Errors
/// The first backend's refusal; the links made before it are closed, and `old`'s
/// are untouched.
pub(super) fn make(
    backends: &[Arc<dyn Backend>],
    peer: &str,
    infos: &[(String, Option<Bytes>)],
    dialect: Dialect,
    old: Option<&PeerLinks>,
    restarted: bool,
) -> Result<PeerLinks> {
    let mut links = Vec::with_capacity(backends.len());
    let mut made: Vec<Arc<dyn PeerLink>> = Vec::new();
    for (i, b) in backends.iter().enumerate() {
        let Some(info) = infos
            .iter()
            .find(|(n, _)| n == b.name())
            .and_then(|(_, c)| c.clone())
        else {
            links.push(None);
            continue;
        };
        let kept = old
            .and_then(|o| o.0.get(i)?.as_ref())
            .filter(|e| !restarted && e.info == info && e.dialect == dialect)
            .filter(|e| !e.link.failed());
        if let Some(e) = kept {
            links.push(Some(e.clone()));
            continue;
        }
        let link = match (dialect, b.nixl()) {
            (Dialect::Nixl { nixl_rs }, Some(d)) => d.link(peer, &info, nixl_rs),
            _ => b.link(peer, &info),
        };
        match link {
            Ok(link) => {
                made.push(link.clone());
                links.push(Some(LinkEntry {
                    info,
                    dialect,
                    link,
                }));
            }
            Err(e) => {
                for l in made {
                    l.close("the peer's metadata was refused");
                }
                return Err(e);
            }
        }
    }
    Ok(PeerLinks(links))
}
