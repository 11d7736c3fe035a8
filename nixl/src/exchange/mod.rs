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
//!
//! With NIXL agents: NIXL's own listener protocol ([`Agent::listen_nixl`](crate::Agent::listen_nixl),
//! [`Agent::fetch_nixl_metadata`](crate::Agent::fetch_nixl_metadata), ...), and NIXL's
//! etcd key layout (`EtcdOptions::nixl_layout`, feature `etcd`).

mod frame;
mod nixl_listener;
mod side_channel;

#[cfg(feature = "etcd")]
mod etcd;

#[cfg(feature = "etcd")]
pub use etcd::{
    EtcdAuth, EtcdExchange, EtcdLayout, EtcdOptions, EtcdTls, NIXL_ETCD_NAMESPACE, NIXL_FULL_LABEL,
};
/// The etcd client crate [`EtcdOptions::client`] returns a client of.
#[cfg(feature = "etcd")]
pub use etcd_client;
pub use nixl_listener::{NixlListenerOptions, NIXL_DEFAULT_PORT};
pub use side_channel::{SharedSecret, SideChannelOptions};

/// The label reserved for full metadata.
pub const FULL_LABEL: &str = "full";
