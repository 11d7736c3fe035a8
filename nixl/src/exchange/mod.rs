//! Metadata exchange: how agents find each other.
//!
//! Three ways, from simplest to most automatic:
//! 1. In-band: [`Agent::metadata`](crate::Agent::metadata) bytes carried by the
//!    application, loaded with [`Agent::load_metadata`](crate::Agent::load_metadata).
//! 2. The direct side channel ([`Agent::listen`](crate::Agent::listen),
//!    [`Agent::fetch_metadata`](crate::Agent::fetch_metadata), ...): a small framed TCP
//!    protocol, optionally authenticated with a shared secret.
//! 3. etcd (cargo feature `etcd`): publication under leases so a crashed agent's keys
//!    expire, and watches so peers forget it.

mod frame;
mod side_channel;

#[cfg(feature = "etcd")]
mod etcd;

#[cfg(feature = "etcd")]
pub use etcd::{EtcdAuth, EtcdExchange, EtcdOptions, EtcdTls};
/// The etcd client crate [`EtcdOptions::client`] returns a client of.
#[cfg(feature = "etcd")]
pub use etcd_client;
pub use side_channel::{SharedSecret, SideChannelOptions};

/// The label reserved for full metadata.
pub const FULL_LABEL: &str = "full";
