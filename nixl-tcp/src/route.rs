//! How a prepared transfer moves: decided once, when it is prepared, and carried in
//! the prepared transfer. [`Route::choose`] is the one place a route is picked;
//! posting only follows it. The one thing not known at prepare time is whether the
//! connection (made at the first transfer) proved the same-host path; a route that
//! wants it says what to do without it.

use std::sync::Arc;

use nixl::{MemKind, Segments};

use crate::direct::Direct;
use crate::options::TcpOptions;

/// Pieces of a transfer split across connections are cut on page multiples.
const STRIPE_ALIGN: u64 = 4096;

/// How a prepared transfer moves.
#[derive(Debug)]
pub(crate) enum Route {
    /// Host memory on both sides, the peer on this host and every target registration
    /// granted: this process copies the data itself (shared memory or cross-memory
    /// attach), on the posting thread when `inline`, else on the copy thread. Only
    /// the notification goes over the socket. Where the connection did not prove the
    /// same-host path, the transfer goes by `otherwise`.
    SameHost {
        direct: Arc<Direct>,
        inline: bool,
        otherwise: Socket,
    },
    /// GPU memory on this side, the peer on this host and every target registration
    /// granted: this process queues device-to-device copies between its GPU memory
    /// and the target's (opened through the driver's inter-process handles) as one
    /// batch; the notification follows over the socket once the device finished.
    /// Where the connection did not prove the same-host path, or a grant turns out
    /// unusable (host memory, no handle), the transfer goes by `otherwise`, staged.
    SameHostGpu {
        direct: Arc<Direct>,
        otherwise: Socket,
    },
    /// Over the socket.
    Socket(Socket),
}

/// How a transfer moves over the socket.
#[derive(Debug)]
pub(crate) enum Socket {
    /// Whole, on the peer's first connection.
    Whole,
    /// In pieces over several connections (at least two), once the first connection
    /// is up; whole while it is still connecting.
    Striped(Vec<Stripe>),
}

/// One piece of a transfer split across connections: its segments, and where they
/// start in the transfer.
#[derive(Debug)]
pub(crate) struct Stripe {
    pub(crate) from: u64,
    pub(crate) local: Arc<Segments>,
}

/// What [`Route::choose`] decides from.
pub(crate) struct Facts<'a> {
    pub(crate) segs: &'a Segments,
    /// Encoded length of the request's run table.
    pub(crate) table_len: usize,
    /// The target side for the same-host path, when the target granted every
    /// registration of the transfer.
    pub(crate) granted: Option<Direct>,
    /// Whether a connection to this peer asks for the same-host path (same kernel,
    /// not turned off in the options).
    pub(crate) same_host: bool,
}

impl Route {
    /// Pick the route of a transfer. A new route (GPU memory on one host, say) is a
    /// new variant chosen here and one arm where transfers are posted.
    pub(crate) fn choose(f: Facts<'_>, options: &TcpOptions) -> Self {
        let socket = Socket::choose(f.segs, f.table_len, options);
        // Host memory on this side: the host path; GPU memory: the device path.
        // Either finds out from the grants whether the target's memory suits it.
        let kinds = f.segs.locals().iter().map(|r| r.kind());
        let host_only = kinds.clone().all(|k| k == MemKind::Dram);
        let gpu_only = kinds.clone().all(|k| k != MemKind::Dram);
        match f.granted {
            Some(direct) if f.same_host && host_only => Self::SameHost {
                direct: Arc::new(direct),
                inline: f.segs.bytes() <= options.inline_copy_max as u64,
                otherwise: socket,
            },
            Some(direct) if f.same_host && gpu_only => Self::SameHostGpu {
                direct: Arc::new(direct),
                otherwise: socket,
            },
            _ => Self::Socket(socket),
        }
    }

    /// The target side for the same-host path, if this route takes it.
    pub(crate) fn direct(&self) -> Option<&Arc<Direct>> {
        match self {
            Self::SameHost { direct, .. } | Self::SameHostGpu { direct, .. } => Some(direct),
            Self::Socket(_) => None,
        }
    }
}

impl Socket {
    /// Over TCP, large transfers go as pieces over several connections. Every piece
    /// carries the whole table (the target checks all of it), so only transfers whose
    /// table is small beside their data are split.
    fn choose(segs: &Segments, table_len: usize, options: &TcpOptions) -> Self {
        let total = segs.bytes();
        let lanes = options.lanes_for(total);
        if lanes < 2 || (table_len as u64) * (lanes as u64) * 32 > total {
            return Self::Whole;
        }
        let mut from = 0;
        let stripes: Vec<Stripe> = segs
            .split(lanes, STRIPE_ALIGN)
            .into_iter()
            .map(|piece| {
                let s = Stripe {
                    from,
                    local: Arc::new(piece),
                };
                from += s.local.bytes();
                s
            })
            .collect();
        if stripes.len() > 1 {
            Self::Striped(stripes)
        } else {
            Self::Whole
        }
    }
}
