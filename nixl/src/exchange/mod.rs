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
#[cfg(feature = "fuzzing")]
pub(crate) use nixl_listener::fuzz_frames as fuzz_nixl_listener;
pub use nixl_listener::{NixlListenerOptions, NIXL_DEFAULT_PORT};
pub use side_channel::{SharedSecret, SideChannelOptions};

use crate::control::Ticket;

/// The label reserved for full metadata.
pub const FULL_LABEL: &str = "full";

/// Bind `addr` and serve every connection with `serve` until the agent shuts down
/// or is dropped: the accept loop and each connection are tasks on the agent's
/// tracker, cancelled with its token. Connections are admitted by the one policy
/// of [`Admission`](crate::control::Admission): at most a quarter of
/// `max_connections` in their handshake (a newcomer closes the oldest of those,
/// first its own address's) and `max_connections` established, clamped to the
/// process's open-files limit. `serve` gets the connection's [`Ticket`]: it
/// establishes it once the client identified itself (authenticated with the
/// secret: never closed to make room) and touches it on every request, so only a
/// connection idle for a while gives its place to a newcomer. `what` names the
/// listener in logs. Returns the bound address. Shared by the side channel and
/// NIXL's listener protocol.
pub(crate) async fn serve_connections<O, F, Fut>(
    agent: &crate::agent::Agent,
    addr: std::net::SocketAddr,
    op: &'static str,
    what: &'static str,
    max_connections: usize,
    options: O,
    serve: F,
) -> crate::error::Result<std::net::SocketAddr>
where
    O: Send + Sync + 'static,
    F: Fn(crate::agent::WeakAgent, tokio::net::TcpStream, std::sync::Arc<O>, Ticket) -> Fut
        + Send
        + 'static,
    Fut: std::future::Future<Output = std::result::Result<(), String>> + Send + 'static,
{
    use crate::control::Admission;
    use crate::error::{err, Error, ErrorKind};
    use std::sync::Arc;

    if !agent.is_running() {
        return err(ErrorKind::ShutDown, op, "the agent is shutting down");
    }
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Error::new(ErrorKind::Backend, op, format!("cannot listen on {addr}")).with_source(e)
    })?;
    let bound = listener.local_addr().map_err(|e| {
        Error::new(ErrorKind::Backend, op, "listener has no address").with_source(e)
    })?;
    let cancel = agent.child_token();
    let weak = agent.downgrade();
    let options = Arc::new(options);
    let max = max_connections.max(1);
    let admission = Admission::new(max.div_ceil(4), max);
    crate::control::spawn_accept_loop(
        what,
        listener,
        admission,
        agent.tracker(),
        cancel,
        move |c| {
            let from = c.from;
            let conn = serve(weak.clone(), c.stream, options.clone(), c.ticket);
            crate::control::until_closed(c.close, async move {
                if let Err(why) = conn.await {
                    tracing::info!(%from, %why, "{what}: closed connection");
                }
            })
        },
    );
    Ok(bound)
}
