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

/// Bind `addr` and serve every connection with `serve` until the agent shuts down
/// or is dropped: the accept loop and each connection are tasks on the agent's
/// tracker, cancelled with its token; at most `max_connections` are served at once
/// (more wait to be accepted). `what` names the listener in logs. Returns the bound
/// address. Shared by the side channel and NIXL's listener protocol.
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
    F: Fn(crate::agent::WeakAgent, tokio::net::TcpStream, std::sync::Arc<O>) -> Fut
        + Send
        + Sync
        + 'static,
    Fut: std::future::Future<Output = std::result::Result<(), String>> + Send + 'static,
{
    use std::sync::Arc;
    use std::time::Duration;

    use crate::error::{err, Error, ErrorKind};

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
    let tracker = agent.tracker().clone();
    let weak = agent.downgrade();
    let options = Arc::new(options);
    let serve = Arc::new(serve);
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    let name = agent.name().to_owned();
    agent.tracker().spawn(async move {
        loop {
            let permit = tokio::select! {
                _ = cancel.cancelled() => break,
                p = slots.clone().acquire_owned() => p.expect("semaphore never closes"),
            };
            let (stream, from) = tokio::select! {
                _ = cancel.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "{what}: accept failed");
                        tokio::select! {
                            _ = cancel.cancelled() => break,
                            _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                        }
                    }
                },
            };
            let token = cancel.child_token();
            let conn = serve(weak.clone(), stream, options.clone());
            tracker.spawn(async move {
                let _permit = permit;
                tokio::select! {
                    _ = token.cancelled() => {}
                    r = conn => {
                        if let Err(why) = r {
                            tracing::info!(%from, %why, "{what}: closed connection");
                        }
                    }
                }
            });
        }
        tracing::debug!(agent = %name, %bound, "{what} listener stopped");
    });
    Ok(bound)
}
