//! The hostile-peer suite: peers that break the rules on purpose (idle or slow
//! sockets, oversized or endless requests, notification floods, an initiator killed
//! inside a same-host copy, targets that stall their initiators) against real agents, one module per area, each proving
//! its limit holds and legitimate peers are still served.

#[path = "hostile/admission.rs"]
mod hostile_admission;
#[path = "hostile/identity.rs"]
mod hostile_identity;
#[path = "hostile/listeners.rs"]
mod hostile_listeners;
#[path = "hostile/notifications.rs"]
mod hostile_notifications;
#[path = "hostile/same_host.rs"]
mod hostile_same_host;
#[path = "hostile/same_host_offer.rs"]
mod hostile_same_host_offer;
#[path = "hostile/stalls.rs"]
mod hostile_stalls;
