//! Two hosts that find each other through etcd (cargo feature `etcd`), like nixlbench's
//! ETCD runtime: start the target and the initiator anywhere, in either order, with the
//! same `--etcd-endpoints` and `--benchmark-group`. Without `--role`, a process
//! becomes the target when the group has none yet (or loses the race for it and becomes
//! the initiator), and the initiator otherwise.
//!
//! Keys, in the namespace `nixl-bench/<group>`:
//!
//! ```text
//! /nixl-bench/<group>/control        HOST:PORT of the target's control listener
//! /nixl-bench/<group>/target/full    the target agent's metadata (nixl's EtcdExchange)
//! ```
//!
//! Both hang on the target agent's etcd lease: they go when the target ends (its agent's
//! shutdown revokes the lease) and expire within [`LEASE_TTL`] when it crashes. The
//! initiator loads the metadata with [`EtcdExchange::fetch`], which also watches it: a
//! target whose keys go is forgotten and its transfers fail at once. The target claims
//! its group by creating the control key only if it is absent, so a second target in a
//! group is refused instead of silently taking over; after an etcd outage that cost
//! the lease, the exchange claims it again under the new lease. Once the initiator is connected to
//! the control address, the run is the plain two-host one: the same control protocol,
//! setup, sweep and teardown, each with its time limit.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use etcd_client::{Client, EventType, WatchOptions};
use nixl::exchange::{EtcdExchange, EtcdOptions, FULL_LABEL};
use nixl::Agent;
use tokio::net::TcpListener;

use crate::cli::{Config, EtcdConfig};
use crate::control::{self, Channel};
use crate::error::{fail, BenchError, Context, Result};
use crate::initiator::{self, TargetInfo};
use crate::report::RunInfo;
use crate::runner::shutdown;
use crate::stats::Row;
use crate::target;

/// How long a crashed target's keys outlive it.
const LEASE_TTL: Duration = Duration::from_secs(10);

/// etcd's client port, for endpoints given without one.
const DEFAULT_PORT: u16 = 2379;

/// The [`EtcdExchange`] namespace of a benchmark group.
fn namespace(group: &str) -> String {
    format!("nixl-bench/{group}")
}

/// The key holding the group's target control address (outside the agent's own keys,
/// which peers watching the agent read as metadata).
fn control_key(group: &str) -> String {
    format!("/{}/control", namespace(group))
}

fn exchange_options(config: &Config, etcd: &EtcdConfig) -> EtcdOptions {
    EtcdOptions {
        endpoints: etcd.endpoints.clone(),
        namespace: namespace(&etcd.group),
        lease_ttl: LEASE_TTL,
        timeout: config.timeouts.exchange,
        tls: etcd.tls.clone(),
        auth: etcd.auth.clone(),
        ..EtcdOptions::default()
    }
}

/// Target: listen, register the agent and its control address in etcd, serve the first
/// initiator that connects, then exit (which deletes the keys).
///
/// # Errors
/// etcd unreachable, the group already taken, no initiator within the connect timeout,
/// or anything that stops the run.
pub(crate) async fn target(config: &Config, etcd: &EtcdConfig) -> Result<()> {
    serve_target(config, etcd, false).await.map(|_| ())
}

/// No `--role`: the first process of a group is its target, the next its initiator
/// (nixlbench assigns ranks the same way). Returns the initiator's results, or `None`
/// when this process was the target.
///
/// # Errors
/// As [`target()`] and [`initiator()`].
pub(crate) async fn auto(
    config: &Config,
    etcd: &EtcdConfig,
) -> Result<Option<(RunInfo, Vec<Row>)>> {
    let key = control_key(&etcd.group);
    let mut client = client(etcd, config.timeouts.exchange).await?;
    let free = bounded(
        config.timeouts.exchange,
        || format!("read {key} from etcd at {}", etcd.endpoints.join(",")),
        client.get(key.as_str(), None),
    )
    .await?
    .kvs()
    .is_empty();
    if free {
        eprintln!(
            "nixl-bench: etcd group {:?} has no target: this process is the target",
            etcd.group
        );
        if serve_target(config, etcd, true).await? {
            return Ok(None);
        }
        eprintln!("nixl-bench: another process became the group's target first: this one is the initiator");
    } else {
        eprintln!(
            "nixl-bench: etcd group {:?} has a target: this process is the initiator",
            etcd.group
        );
    }
    initiator(config, etcd).await.map(Some)
}

/// As [`target()`]; with `yield_if_taken`, a group that already has a target is not an
/// error: returns `false` (having stopped everything it started).
async fn serve_target(config: &Config, etcd: &EtcdConfig, yield_if_taken: bool) -> Result<bool> {
    let t = config.timeouts;
    let listener = control::bind(config.listen).await?;
    let bound = listener.local_addr()?;
    let host = if bound.ip().is_unspecified() {
        reachable_ip(&etcd.endpoints, t.exchange).await?
    } else {
        bound.ip()
    };
    let advertised = SocketAddr::new(host, bound.port());
    let agent = target::start_agent(config, host).await?;
    let channel = match announce(config, etcd, &agent, listener, advertised, yield_if_taken).await {
        Ok(Some(c)) => c,
        r => {
            // Revokes the lease, so the group is free again at once.
            let _ = shutdown(&agent, t.teardown).await;
            return r.map(|_| false);
        }
    };
    target::serve_with(config, channel, agent).await?;
    eprintln!("nixl-bench target: done");
    Ok(true)
}

/// Claim the group, publish the agent, say so on stdout, and wait for the initiator.
async fn announce(
    config: &Config,
    etcd: &EtcdConfig,
    agent: &Agent,
    listener: TcpListener,
    advertised: SocketAddr,
    yield_if_taken: bool,
) -> Result<Option<Channel>> {
    let t = config.timeouts;
    let exchange = EtcdExchange::connect(agent, exchange_options(config, etcd))
        .await
        .with_context(|| format!("connect to etcd at {}", etcd.endpoints.join(",")))?;
    if let Some(holder) = claim(etcd, &exchange, advertised).await? {
        if yield_if_taken {
            return Ok(None);
        }
        return fail(format!(
            "benchmark group {:?} already has a target (control address {holder}); give this one another --benchmark-group, or wait for that one to end (a crashed target's keys expire within {LEASE_TTL:?})",
            etcd.group
        ));
    }
    exchange
        .publish()
        .await
        .context("publish the target's metadata in etcd")?;
    println!("listening on {}", listener.local_addr()?);
    println!(
        "registered in etcd group {:?} as {advertised} ({})",
        etcd.group,
        control_key(&etcd.group)
    );
    let _ = std::io::stdout().flush();
    let (stream, from) = control::accept_one(listener, t.connect).await?;
    eprintln!("nixl-bench target: initiator connected from {from}");
    Ok(Some(Channel::tcp(
        stream,
        format!("the initiator at {from}"),
        t.exchange,
    )))
}

/// Create the group's control key under the agent's lease, only if no other target
/// holds it (the exchange creates it again after a lost lease); the holder's control
/// address when one does.
async fn claim(
    etcd: &EtcdConfig,
    exchange: &EtcdExchange,
    advertised: SocketAddr,
) -> Result<Option<String>> {
    let key = control_key(&etcd.group);
    let held = exchange
        .claim(&key, advertised.to_string())
        .await
        .with_context(|| format!("register {key} in etcd at {}", etcd.endpoints.join(",")))?;
    Ok(held.map(|h| text(&h)))
}

/// Initiator: wait for the group's target in etcd, connect to it, load its metadata from
/// etcd, then run the sweep as in plain two-host mode.
///
/// # Errors
/// etcd unreachable, no target within the connect timeout, or anything that stops the
/// run.
pub(crate) async fn initiator(config: &Config, etcd: &EtcdConfig) -> Result<(RunInfo, Vec<Row>)> {
    let t = config.timeouts;
    let addr = find_target(config, etcd).await?;
    let stream = control::connect(&addr, t.connect)
        .await
        .with_context(|| {
            format!(
                "connect to the target registered in etcd group {:?} (a crashed target's address stays there for up to {LEASE_TTL:?})",
                etcd.group
            )
        })?;
    let host = stream.local_addr()?.ip();
    let remote = stream.peer_addr()?;
    let channel = Channel::tcp(stream, format!("the target at {remote}"), t.exchange);
    let (agent, backend) = initiator::start_agent(config, host).await?;
    if let Err(e) = load_target(config, etcd, &agent).await {
        let _ = shutdown(&agent, t.teardown).await;
        return Err(e);
    }
    let target = TargetInfo {
        mode: "two-host",
        process: format!("peer at {remote}, found in etcd group {:?}", etcd.group),
    };
    initiator::run_with(config, channel, agent, backend, target).await
}

/// Load the target's metadata from etcd (waiting up to the exchange timeout for it) and
/// watch it from then on.
async fn load_target(config: &Config, etcd: &EtcdConfig, agent: &Agent) -> Result<()> {
    let exchange = EtcdExchange::connect(agent, exchange_options(config, etcd))
        .await
        .with_context(|| format!("connect to etcd at {}", etcd.endpoints.join(",")))?;
    exchange
        .fetch(target::AGENT_NAME, config.timeouts.exchange)
        .await
        .with_context(|| {
            format!(
                "load the target's metadata from etcd ({})",
                exchange.key(target::AGENT_NAME, FULL_LABEL)
            )
        })
}

/// The control address of the group's target, waiting up to the connect timeout for a
/// target to register.
async fn find_target(config: &Config, etcd: &EtcdConfig) -> Result<String> {
    let t = config.timeouts;
    let key = control_key(&etcd.group);
    let mut client = client(etcd, t.exchange).await?;
    let got = bounded(
        t.exchange,
        || format!("read {key} from etcd at {}", etcd.endpoints.join(",")),
        client.get(key.as_str(), None),
    )
    .await?;
    if let Some(kv) = got.kvs().first() {
        return Ok(text(kv.value()));
    }
    let revision = got.header().map_or(0, |h| h.revision());
    let watch = bounded(
        t.exchange,
        || format!("watch {key} in etcd at {}", etcd.endpoints.join(",")),
        client.watch(
            key.as_str(),
            Some(WatchOptions::new().with_start_revision(revision + 1)),
        ),
    )
    .await?;
    let appeared = async move {
        let mut stream = watch;
        loop {
            let msg = stream
                .message()
                .await
                .with_context(|| format!("watch {key} in etcd"))?
                .ok_or_else(|| BenchError::new(format!("etcd ended the watch of {key}")))?;
            for ev in msg.events() {
                if let (EventType::Put, Some(kv)) = (ev.event_type(), ev.kv()) {
                    return Ok(text(kv.value()));
                }
            }
        }
    };
    match tokio::time::timeout(t.connect, appeared).await {
        Ok(r) => r,
        Err(_) => fail(format!(
            "no target registered in etcd group {group:?} within {:?} (etcd at {endpoints}); start one with `nixl-bench --role target --etcd-endpoints {endpoints} --benchmark-group {group}`, or raise --connect-timeout",
            t.connect,
            group = etcd.group,
            endpoints = etcd.endpoints.join(","),
        )),
    }
}

/// An etcd client whose every request is bounded by `timeout`.
async fn client(etcd: &EtcdConfig, timeout: Duration) -> Result<Client> {
    let options = EtcdOptions {
        endpoints: etcd.endpoints.clone(),
        timeout,
        tls: etcd.tls.clone(),
        auth: etcd.auth.clone(),
        ..EtcdOptions::default()
    };
    options
        .client()
        .await
        .with_context(|| format!("connect to etcd at {}", etcd.endpoints.join(",")))
}

/// `f` within `timeout`, its error said as `what` failed.
async fn bounded<T>(
    timeout: Duration,
    what: impl FnOnce() -> String,
    f: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.with_context(what),
        Err(_) => fail(format!(
            "{}: etcd did not answer within {timeout:?}",
            what()
        )),
    }
}

/// A key's value as text (a control address).
fn text(value: &[u8]) -> String {
    String::from_utf8_lossy(value).trim().to_owned()
}

/// This host's address on the route to etcd: the one to advertise when the target
/// listens on every interface (hosts that share an etcd mostly reach each other the same
/// way; `--listen IP:PORT` chooses another). Sends nothing: connecting a UDP socket only
/// picks the route.
async fn reachable_ip(endpoints: &[String], timeout: Duration) -> Result<IpAddr> {
    let mut why = String::from("no endpoint");
    for url in endpoints {
        let authority = authority(url);
        match tokio::time::timeout(timeout, route_from(&authority)).await {
            Ok(Ok(ip)) => return Ok(ip),
            Ok(Err(e)) => why = format!("{authority}: {e}"),
            Err(_) => why = format!("{authority}: no answer within {timeout:?}"),
        }
    }
    fail(format!(
        "cannot tell which address of this host to advertise in etcd ({why}); give one with --listen IP:PORT"
    ))
}

/// The local address a packet to `authority` (HOST:PORT) would leave from.
async fn route_from(authority: &str) -> std::io::Result<IpAddr> {
    let to = tokio::net::lookup_host(authority)
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))?;
    let any: SocketAddr = if to.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = tokio::net::UdpSocket::bind(any).await?;
    socket.connect(to).await?;
    Ok(socket.local_addr()?.ip())
}

/// HOST:PORT of an etcd URL (`http://h:2379/`, `h:2379`, `h`, `http://[::1]`).
fn authority(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host_port = rest.split('/').next().unwrap_or(rest);
    let has_port = match host_port.rfind(']') {
        Some(i) => host_port[i..].contains(':'),
        None => host_port.contains(':'),
    };
    if has_port {
        host_port.to_owned()
    } else {
        format!("{host_port}:{DEFAULT_PORT}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!(namespace("g1"), "nixl-bench/g1");
        assert_eq!(control_key("g1"), "/nixl-bench/g1/control");
    }

    #[test]
    fn authorities() {
        assert_eq!(authority("http://10.0.0.1:2379"), "10.0.0.1:2379");
        assert_eq!(authority("https://etcd.local:2380/"), "etcd.local:2380");
        assert_eq!(authority("etcd.local"), "etcd.local:2379");
        assert_eq!(authority("http://[::1]"), "[::1]:2379");
        assert_eq!(authority("http://[::1]:12379/x"), "[::1]:12379");
    }

    #[tokio::test]
    async fn loopback_etcd_means_loopback_address() {
        let ip = reachable_ip(&["http://127.0.0.1:2379".into()], Duration::from_secs(5))
            .await
            .unwrap();
        assert!(ip.is_loopback(), "{ip}");
        let e = reachable_ip(
            &["http://no-such-host.invalid".into()],
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("--listen IP:PORT"), "{e}");
    }
}
