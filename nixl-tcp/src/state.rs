//! The backend's shared state: options, registrations, same-host grants and the
//! known peers with their connections. Below the listener (`crate::target`) and the
//! backend (`lib.rs`), which both work on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use nixl::{Attachment, ErrorKind, RegionRef};

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
    pub(crate) peers: Mutex<HashMap<String, PeerEntry>>,
    /// This kernel's boot id, when the same-host path is on.
    pub(crate) boot: Option<String>,
    /// This backend's listener id (random, in its connection info): hellos for
    /// another are refused, so stale metadata never reaches whoever listens at a
    /// reused address.
    pub(crate) listener: u64,
    /// The copy thread for large same-host transfers, started at the first one.
    pub(crate) copier: Mutex<Option<std::sync::mpsc::Sender<CopyJob>>>,
}

/// A known peer: where it listens and the connections to it.
#[derive(Debug)]
pub(crate) struct PeerEntry {
    /// Where it listens, the listener's id and its kernel boot id.
    pub(crate) info: ConnInfo,
    /// The first connection: everything but the other pieces of large transfers.
    pub(crate) conn: Option<Arc<Conn>>,
    /// Further connections for the pieces of large transfers, opened at the first.
    pub(crate) extra: Vec<Arc<Conn>>,
}

impl PeerEntry {
    /// Close every connection to this peer.
    pub(crate) fn close(&self, kind: ErrorKind, why: &str) {
        for c in self.conn.iter().chain(&self.extra) {
            c.close(kind, why);
        }
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
