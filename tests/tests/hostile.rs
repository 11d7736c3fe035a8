//! The hostile-peer suite: peers that break the rules (idle or slow sockets,
//! oversized or endless requests, bogus answers) against real agents, proving the
//! limits hold and legitimate peers are still served.

#[path = "hostile/listeners.rs"]
mod hostile_listeners;
