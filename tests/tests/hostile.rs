//! The hostile-peer suite: peers that misbehave on purpose against real agents, one
//! module per area, each proving its limit holds and legitimate peers are still served.

#[path = "hostile/notifications.rs"]
mod hostile_notifications;
