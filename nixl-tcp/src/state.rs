//! The backend's shared state: options, registrations, same-host grants and the
//! known peers with their connections. Below the listener (`crate::target`) and the
//! backend (`lib.rs`), which both work on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use nixl::{Attachment, Error, ErrorKind, RegionRef, Result};

use crate::conn::Conn;
use crate::options::{Started, TcpOptions};
use crate::same_host;
use crate::wire::ConnInfo;

/// A large same-host transfer for the copy thread.
pub(crate) type CopyJob = Box<dyn FnOnce() + Send>;

/// What the backend's handles, its listener and its connections share.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) options: TcpOptions,
    pub(crate) started: Attachment<Started>,
    /// Same-host grants. Declared before `regions`: dropping it revokes every grant
    /// before the registrations (and the memory they keep alive) go.
    pub(crate) grants: same_host::Grants,
    /// Registrations by key, for incoming requests.
    pub(crate) regions: RwLock<HashMap<u64, RegionRef>>,
    /// Region id -> (key, same-host grant slot).
    pub(crate) keys: Mutex<HashMap<u64, (u64, Option<u32>)>>,
    /// The entries of the links this backend made and the agent still holds.
    pub(crate) peers: nixl::kit::LinkSet<PeerEntry>,
    /// This kernel's boot id, when the same-host path is on.
    pub(crate) boot: Option<String>,
    /// This backend's listener id (random, in its connection info): hellos for
    /// another are refused, so stale metadata never reaches whoever listens at a
    /// reused address.
    pub(crate) listener: u64,
    /// The copy thread for large same-host transfers, started at the first one.
    pub(crate) copier: Mutex<Option<std::sync::mpsc::Sender<CopyJob>>>,
}

/// A known peer: where it listens and the connections to it. A prepared transfer
/// holds its peer's entry, so posting takes only that peer's lock, never the table's,
/// and never looks the peer up by name.
#[derive(Debug)]
pub(crate) struct PeerEntry {
    pub(crate) name: String,
    /// Where it listens, the listener's id and its kernel boot id.
    pub(crate) info: ConnInfo,
    lanes: Mutex<Lanes>,
}

#[derive(Debug, Default)]
struct Lanes {
    /// The first connection: everything but the other pieces of large transfers.
    first: Option<Arc<Conn>>,
    /// Further connections for the pieces of large transfers, opened at the first.
    extra: Vec<Arc<Conn>>,
    /// Set when the entry was closed (the peer forgotten or moved, the agent
    /// stopping): no connection is opened any more, and uses fail with this.
    closed: Option<(ErrorKind, String)>,
}

impl PeerEntry {
    pub(crate) fn new(name: &str, info: ConnInfo) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            info,
            lanes: Mutex::new(Lanes::default()),
        })
    }

    /// Close every connection to this peer: their transfers fail with `kind`, and so
    /// does every later use of this entry.
    pub(crate) fn close(&self, kind: ErrorKind, why: &str) {
        let mut lanes = self.lanes.lock().unwrap();
        lanes.closed.get_or_insert_with(|| (kind, why.to_owned()));
        for c in lanes.first.iter().chain(&lanes.extra) {
            c.close(kind, why);
        }
    }

    fn refuse_closed(&self, lanes: &Lanes, op: &'static str) -> Result<()> {
        match &lanes.closed {
            Some((kind, why)) => Err(Error::new(
                *kind,
                op,
                format!("peer {:?}: {why}", self.name),
            )),
            None => Ok(()),
        }
    }

    /// The first connection, opened by `open` when there is none or it died.
    pub(crate) fn first(
        &self,
        op: &'static str,
        open: impl FnOnce() -> Arc<Conn>,
    ) -> Result<Arc<Conn>> {
        let mut lanes = self.lanes.lock().unwrap();
        self.refuse_closed(&lanes, op)?;
        if let Some(c) = &lanes.first {
            if !c.is_dead() {
                return Ok(c.clone());
            }
        }
        let c = open();
        lanes.first = Some(c.clone());
        Ok(c)
    }

    /// Connections 1 to `n - 1` (the first is [`PeerEntry::first`]'s), opened or
    /// reopened by `open` as needed.
    pub(crate) fn extra(
        &self,
        op: &'static str,
        n: usize,
        open: impl Fn() -> Arc<Conn>,
    ) -> Result<Vec<Arc<Conn>>> {
        let mut lanes = self.lanes.lock().unwrap();
        self.refuse_closed(&lanes, op)?;
        for c in &mut lanes.extra {
            if c.is_dead() {
                *c = open();
            }
        }
        while lanes.extra.len() + 1 < n {
            lanes.extra.push(open());
        }
        Ok(lanes.extra.clone())
    }

    /// How data moves on the first connection, once it is up; `None` once closed.
    pub(crate) fn path(&self) -> Option<String> {
        let lanes = self.lanes.lock().unwrap();
        if lanes.closed.is_some() {
            return None;
        }
        lanes.first.as_ref()?.path()
    }
}

impl Inner {
    /// Whether the backend is shutting down (its listener and connections are being
    /// cancelled, and its registrations dropped).
    pub(crate) fn stopping(&self) -> bool {
        self.started
            .try_get()
            .is_some_and(|s| s.cancel.is_cancelled())
    }
}
