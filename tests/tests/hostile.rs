//! The hostile-peer suite: peers that break the rules on purpose (idle or slow
//! sockets, oversized or endless requests, notification floods, an initiator killed
//! inside a same-host copy) against real agents, one module per area, each proving
//! its limit holds and legitimate peers are still served. nixl-tcp's own hostile
//! tests that need no child process (stalling targets, the same-host offer across
//! hosts, the raw wire, notification floods) are in its crate.

#[path = "hostile/admission.rs"]
mod hostile_admission;
#[path = "hostile/identity.rs"]
mod hostile_identity;
#[path = "hostile/listeners.rs"]
mod hostile_listeners;
#[path = "hostile/same_host.rs"]
mod hostile_same_host;
