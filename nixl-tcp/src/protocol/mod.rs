//! nixl-tcp's protocol as plain state machines: they take bytes and events and
//! return actions, with no sockets and no clocks, so they are unit-tested with
//! simulated peers; the connection tasks only move bytes.

pub(crate) mod initiator;
pub(crate) mod target;
