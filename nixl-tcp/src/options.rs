//! The backend's options, and what attaching to an agent gives it.

use std::net::SocketAddr;
use std::time::Duration;

use nixl::control::ListenerOptions;
use nixl::BackendContext;
use tokio_util::sync::CancellationToken;

use crate::same_host::SameHost;

/// Options for [`TcpBackend`](crate::TcpBackend).
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// The listener and connections ([`ListenerOptions`], as every backend's):
    /// where to listen and what to publish, the connect and handshake bounds, the
    /// admission limits, the bound on noticing a silent peer, and the shared secret.
    /// With a secret, both ends of every connection (data connections included)
    /// prove it and their agent names before any request is read: a client without
    /// it reaches no registered memory, whatever keys it has. Here
    /// [`ListenerOptions::dead_peer_timeout`] sets TCP keepalive probes and
    /// `TCP_USER_TIMEOUT`, and also bounds a target that stops reading without
    /// saying so: data it leaves unread (a zero window) for this long closes the
    /// connection (`TCP_USER_TIMEOUT` counts zero-window probes, Linux 5.11 and
    /// later), and the transfers on it fail with `RemoteDisconnected` (naming this
    /// timeout where the connection's reader or writer saw the kernel's `ETIMEDOUT`;
    /// the other sees only the closed socket). One more incoming connection past
    /// [`ListenerOptions::max_incoming_connections`] is closed when its handshake
    /// ends, unless a connection idle for a minute gives it its place.
    pub listener: ListenerOptions,
    /// Longest a target may hold back reading a connection without answering any
    /// request (default 60 s). A target pauses a connection (it says so: PAUSE)
    /// while its application leaves notifications unread, and `TCP_USER_TIMEOUT` is
    /// lifted meanwhile, so the zero window of a deliberate pause does not count as a
    /// dead peer. Each answer starts the bound again, so a slow but moving target is
    /// never cut; one that pauses and then never reads (or keeps saying PAUSE and
    /// RESUME without reading) is: when the bound runs out with requests waiting, the
    /// connection is closed and every transfer on it fails with `TimedOut` naming the
    /// stall. Raise it where applications may leave their notifications unread for
    /// longer; a deadline per transfer is the caller's (cancel or drop the transfer).
    pub pause_timeout: Duration,
    /// Longest notification accepted.
    pub max_notification: usize,
    /// Most bytes one READ or WRITE request may move at this target, over all its
    /// runs (default 64 GiB). Larger requests are refused (`InvalidArgument` at the
    /// initiator); a stride-0 run would otherwise let a tiny request stream up to
    /// 2^64 bytes.
    pub max_request_bytes: u64,
    /// The same-host path (default [`SameHost::Auto`]).
    pub same_host: SameHost,
    /// Same-host transfers up to this many bytes are copied on the thread that posts
    /// them and complete before `post` returns; larger ones on the backend's copy
    /// thread (one per agent, started at the first such transfer). Handing a copy to
    /// another thread costs two thread wake-ups, tens of microseconds on small
    /// machines, so the default (4 MiB) keeps everything but the largest copies inline;
    /// at DRAM speed a 4 MiB copy holds the posting thread for about a millisecond.
    /// Lower it where tokio workers must never be held that long.
    pub inline_copy_max: usize,
    /// TCP connections per peer for large transfers (at least 1). One TCP stream is
    /// bound by the core that copies it on each side; a transfer of at least
    /// [`TcpOptions::stripe_min`] bytes is cut into this many pieces of equal size
    /// that move over as many connections at once. The first connection carries
    /// everything else; the others are opened at the first large transfer. Default:
    /// as many as this process may use cores, between 1 and 4 (each connection's
    /// copies run on a core of their own on each side; even on two cores, two
    /// connections let one side's copy overlap the other's).
    pub connections: usize,
    /// Transfers over TCP of at least this many bytes are split across
    /// [`TcpOptions::connections`] (default 1 MiB). Smaller ones stay whole on the
    /// first connection, where splitting would cost more round trips than it saves.
    pub stripe_min: usize,
    /// Same-host copies by cross-memory attach of at least
    /// [`TcpOptions::split_copy_min`] bytes are cut into up to this many pieces of
    /// about equal size, copied at once by the thread moving the transfer and
    /// `copy_threads - 1` threads started for it (each piece at least half of
    /// `split_copy_min`). One thread's copy is bound by its core (page pinning and the
    /// copy itself); with cores idle, several go faster. Default: as many as this
    /// process may use cores, between 1 and 4; 1 turns splitting off.
    pub copy_threads: usize,
    /// Smallest same-host copy by cross-memory attach that is split across
    /// [`TcpOptions::copy_threads`] (default 16 MiB; below it, starting threads costs
    /// more than it saves).
    pub split_copy_min: usize,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            listener: ListenerOptions::default(),
            pause_timeout: Duration::from_secs(60),
            max_notification: 1 << 20,
            max_request_bytes: crate::protocol::target::DEFAULT_MAX_REQUEST,
            same_host: SameHost::Auto,
            inline_copy_max: 4 << 20,
            connections: default_connections(),
            stripe_min: 1 << 20,
            copy_threads: default_connections(),
            split_copy_min: 16 << 20,
        }
    }
}

/// The cores this process may use, between 1 and 4 (the default of
/// [`TcpOptions::connections`] and [`TcpOptions::copy_threads`]).
fn default_connections() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4))
}

impl TcpOptions {
    /// How many connections a transfer of `bytes` over TCP uses.
    pub(crate) fn lanes_for(&self, bytes: u64) -> usize {
        if bytes >= self.stripe_min as u64 {
            self.connections.max(1)
        } else {
            1
        }
    }

    /// How a same-host copy by cross-memory attach is shared between threads.
    pub(crate) fn copy_split(&self) -> crate::cma::Split {
        crate::cma::Split {
            threads: self.copy_threads.max(1),
            min: self.split_copy_min as u64,
        }
    }

    /// The TCP part of the data path's description.
    pub(crate) fn tcp_path(&self) -> String {
        match self.connections {
            0 | 1 => "TCP, one connection".to_owned(),
            n => {
                let min = match self.stripe_min {
                    b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
                    b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
                    b => format!("{b} bytes"),
                };
                format!("TCP, {n} connections per peer (transfers from {min} split across them)")
            }
        }
    }
}

/// What attaching to an agent gave the backend.
#[derive(Debug)]
pub(crate) struct Started {
    pub(crate) ctx: BackendContext,
    /// The listener options' secret, or else the agent's.
    pub(crate) secret: Option<nixl::SharedSecret>,
    pub(crate) addr: SocketAddr,
    pub(crate) cancel: CancellationToken,
}
