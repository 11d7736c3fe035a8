//! The backend author's API, apart from the application's (the crate root): what a
//! transport crate implements and the plumbing it shares with the others, so that a
//! new backend starts at its transport code.
//!
//! - The trait and what flows through it: [`Backend`], [`BackendContext`] (name,
//!   secret, cancellation, task tracker, [`NotificationSink`], OS threads),
//!   [`TransferPlan`] and its [`Segments`], [`PreparedTransfer`], [`Completer`],
//!   [`Attachment`] (the started state, set once).
//! - Peers: the agent owns each peer's [`PeerLink`] (made by [`Backend::link`],
//!   closed when the peer goes or moves) and hands it to every transfer it prepares
//!   ([`LinkedPeer`]); [`link_of`] takes the backend's own type back, and a
//!   [`LinkSet`] keeps the live ones to close when the backend stops.
//! - The control connection ([`control`]): one accept loop with admission
//!   ([`control::spawn_accept_loop`]), the shared-secret handshake
//!   ([`control::authenticate_server`], [`control::authenticate_client`],
//!   [`control::Authenticated::check_hello`]), frames, socket settings.
//! - Notifications with back-pressure: [`NotificationSink::deliver_async`] from a
//!   task (the connection is not read meanwhile), or
//!   [`NotificationSink::try_deliver`] and [`NotificationSink::on_room`] where a
//!   backend cannot wait.
//! - Notifications in posting order where transfers finish out of order:
//!   [`Sequencer`]; transfers split over several lanes of one peer: [`StripeGate`].
//! - NIXL's protocol, for a backend that speaks NIXL's dialect of its transport:
//!   [`NixlDialect`].
//!
//! The README's "Writing a native backend" walks through a backend built on these.

mod sequencer;
mod stripe;

pub use crate::backend::{
    Attachment, Backend, BackendContext, Capabilities, NixlDialect, NotificationSink,
    PreparedTransfer, Segment, SegmentRun, Segments, Target, TargetRegion, TransferPlan,
};
pub use crate::completion::{Completer, Op};
pub use crate::control;
pub use crate::peer_link::{link_of, LinkSet, LinkedPeer, PeerLink};
pub use crate::region::{InFlightHold, RegionRef, RegionSlice};
pub use crate::thread::{ThreadSpawner, ThreadWake};
pub use sequencer::{Sequencer, Ticket};
pub use stripe::{Outcome, StripeGate};
