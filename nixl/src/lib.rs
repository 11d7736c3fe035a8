//! # nixl
//!
//! An async SDK that moves memory between processes and machines for AI inference
//! (KV-cache transfer between prefill and decode workers, weight shipping).
//!
//! - An [`Agent`] owns backends, memory [`Registration`]s, known peers, a
//!   [`Notifications`] stream and every background task it starts.
//! - Notifications queue up to bounds per sender, per agent and for senders the
//!   agent does not know ([`NotificationLimits`]); a sender at a bound is held back
//!   where the backend can wait (nixl-tcp and nixl-uccl stop reading its connection,
//!   nixl-verbs stops taking its sends), otherwise (nixl-ucx) its excess is dropped,
//!   counted, logged ([`Agent::notification_stats`]) and reported to the sender.
//! - Peers exchange [`metadata`] (versioned, checksummed, size-limited bytes); NIXL's
//!   own format ([`interop`]) is read and written too, so an agent works with NIXL
//!   agents over a backend that speaks NIXL's dialect ([`NixlDialect`]).
//! - Transfers (READ/WRITE) are futures: one-shot ([`Agent::write`], [`Agent::read`],
//!   [`Agent::transfer`]) or prepared ([`Agent::prep_local`], [`Agent::prep_remote`],
//!   [`Agent::make_request`], then [`XferRequest::post`] many times).
//! - Descriptor lists are runs of regularly spaced blocks ([`Strided`]; a KV cache's
//!   pages): checking a list and building requests from it cost O(runs), not
//!   O(blocks), and backends get the segments as runs ([`Segments`]).
//! - Transports implement the object-safe [`Backend`] trait, one crate each
//!   (`nixl-tcp` is the embedded default). What a backend author needs, and the
//!   plumbing backends share (listener, handshake, back-pressure, split transfers),
//!   is in [`kit`]; the crate root is the application's API.
//!
//! ```no_run
//! # async fn demo(backend_a: impl nixl::Backend, backend_b: impl nixl::Backend) -> nixl::Result<()> {
//! use nixl::{Agent, DescList, MemKind};
//! let a = Agent::builder("prefill").backend(backend_a).build().await?;
//! let b = Agent::builder("decode").backend(backend_b).build().await?;
//! let src = a.register(vec![7u8; 4096])?;
//! let dst = b.register(vec![0u8; 4096])?;
//! a.load_metadata(&b.metadata()?)?;
//! let local = DescList::from_descs(MemKind::Dram, [src.whole()]);
//! let remote = DescList::from_descs(MemKind::Dram, [a.remote_regions("decode")?[0].desc(0, 4096)]);
//! a.write(&local, "decode", &remote, Some("kv ready".into())).await?;
//! # Ok(()) }
//! ```
#![deny(unsafe_code)]

mod agent;
mod aligned;
mod backend;
mod completion;
pub mod control;
mod descriptor;
mod error;
pub mod exchange;
pub mod file;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod gate;
pub mod gpu;
pub mod interop;
pub mod kit;
mod memory;
pub mod metadata;
pub mod native;
mod notification;
mod peer_link;
mod region;
mod secret;
mod system;
pub mod telemetry;
mod thread;
mod transfer;

pub use agent::{
    Agent, AgentBuilder, AgentOptions, Indices, PeerLimits, PreparedDescs, RegisterOptions,
    RequestOptions, ShutdownReport, TaskMonitor,
};
pub use backend::{
    Attachment, Backend, BackendContext, Capabilities, NixlDialect, NotificationSink,
    PreparedTransfer, Segment, SegmentRun, Segments, Target, TargetRegion, TransferPlan,
};
pub use bytes::Bytes;
pub use completion::{Completer, Op, Status};
pub use descriptor::{Desc, DescList, Strided};
pub use error::{Error, ErrorKind, Result};
pub use exchange::{NixlListenerOptions, SharedSecret, SideChannelOptions};
pub use memory::{AlignedBuf, MemKind, MemSegment, Memory, HUGE_PAGE_SIZE, PAGE_SIZE};
pub use notification::{
    Notification, NotificationLimits, NotificationPeaks, NotificationStats, Notifications,
    QueuedNotifications,
};
pub use peer_link::{LinkedPeer, PeerLink};
pub use region::{InFlightHold, RegionRef, RegionSlice, Registration, RemoteRegionInfo};
pub use system::{host_memory, open_files_limit};
pub use telemetry::{TelemetryOptions, TransferTelemetry};
pub use thread::{ThreadSpawner, ThreadWake};
pub use transfer::{Transfer, XferRequest};

/// Version of this crate.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
