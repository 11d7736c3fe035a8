//! The suite's nixl-tcp agents and options, for tests that need a real backend but
//! test something else, and for the child-process binaries (feature `tcp`, on by
//! default: without it the suite's library depends on the core alone).

use std::time::Duration;

use nixl::Agent;

/// An agent with one default nixl-tcp backend (loopback), for tests that need a real
/// backend but test something else (exchanges, telemetry).
pub async fn tcp_agent(name: &str) -> Agent {
    Agent::builder(name)
        .backend(nixl_tcp::TcpBackend::new())
        .build()
        .await
        .unwrap()
}

/// `TcpOptions` from `NIXL_TCP_LISTEN`, `NIXL_TCP_DEAD_PEER_MS`,
/// `NIXL_TCP_CONNECT_MS` (for test processes started in network namespaces),
/// `NIXL_TCP_HANDSHAKE_MS` (the target's handshake timeout),
/// `NIXL_TCP_SAME_HOST` (`auto`, `off` or `require`; `scripts/test` runs the suite
/// under each) and `NIXL_TCP_CONNECTIONS` / `NIXL_TCP_STRIPE_MIN` (connections per
/// peer, and the size from which transfers are split across them; `scripts/test`
/// runs the suite over TCP with small transfers split across three), and
/// `NIXL_TCP_COPY_THREADS` / `NIXL_TCP_SPLIT_COPY_MIN` (threads per same-host copy by
/// cross-memory attach, and the size from which copies are split across them;
/// `scripts/test` runs the suite on the same-host path with copies from 4 KiB split
/// across three).
///
/// # Panics
/// On a `NIXL_TCP_SAME_HOST` that is none of those, or a count or size that is not a
/// number.
pub fn tcp_options_from_env() -> nixl_tcp::TcpOptions {
    let mut o = nixl_tcp::TcpOptions::default();
    if let Ok(v) = std::env::var("NIXL_TCP_SAME_HOST") {
        o.same_host = v
            .parse()
            .unwrap_or_else(|e| panic!("NIXL_TCP_SAME_HOST={e}"));
    }
    if let Some(a) = std::env::var("NIXL_TCP_LISTEN")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        o.listener.listen = Some(a);
    }
    let ms = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    };
    if let Some(d) = ms("NIXL_TCP_DEAD_PEER_MS") {
        o.listener.dead_peer_timeout = d;
    }
    if let Some(d) = ms("NIXL_TCP_CONNECT_MS") {
        o.listener.connect_timeout = d;
    }
    if let Some(d) = ms("NIXL_TCP_HANDSHAKE_MS") {
        o.listener.handshake_timeout = d;
    }
    let number = |name: &str| {
        std::env::var(name).ok().map(|v| {
            v.parse::<usize>()
                .unwrap_or_else(|e| panic!("{name}={v:?}: {e}"))
        })
    };
    if let Some(n) = number("NIXL_TCP_CONNECTIONS") {
        o.connections = n;
    }
    if let Some(n) = number("NIXL_TCP_STRIPE_MIN") {
        o.stripe_min = n;
    }
    if let Some(n) = number("NIXL_TCP_COPY_THREADS") {
        o.copy_threads = n;
    }
    if let Some(n) = number("NIXL_TCP_SPLIT_COPY_MIN") {
        o.split_copy_min = n;
    }
    o
}
