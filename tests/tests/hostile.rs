//! The hostile-peer suite: peers that misbehave on purpose (forged requests, tampered
//! shared memory, processes killed at the worst moment), one module per area.

#[path = "hostile/same_host.rs"]
mod hostile_same_host;
