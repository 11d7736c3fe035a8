//! The target: registers the buffer the initiator asks for, publishes its metadata,
//! then serves pattern fills and checks until the initiator says `done`.

use std::net::IpAddr;
use std::time::Duration;

use nixl::Agent;

use crate::backend;
use crate::buffer::{self, Buffer};
use crate::cli::Config;
use crate::control::{self, Channel, ToInitiator, ToTarget, PROTOCOL};
use crate::error::{fail, BenchError, Context, Result};
use crate::runner::{agent_options, shutdown};

/// The target agent's name (the key etcd mode publishes it under).
pub(crate) const AGENT_NAME: &str = "target";

/// The target's heartbeat bound is never shorter than this (the initiator pings every
/// second).
const MIN_IDLE: Duration = Duration::from_secs(3);

/// Serve one initiator over `channel`. `host` is the address the initiator reaches
/// this machine on (the default for the backend's listener).
///
/// # Errors
/// Anything that stops the run; the initiator is told (`error ...`) when it can be.
pub(crate) async fn serve(config: &Config, channel: Channel, host: IpAddr) -> Result<()> {
    let agent = match start_agent(config, host).await {
        Ok(a) => a,
        Err(e) => {
            tell(&channel, &e).await;
            return Err(e);
        }
    };
    serve_with(config, channel, agent).await
}

/// Serve one initiator over `channel` with an agent started beforehand (etcd mode
/// publishes it before the initiator arrives). Shuts `agent` down at the end, within the
/// teardown bound.
///
/// # Errors
/// As [`serve`].
pub(crate) async fn serve_with(config: &Config, mut channel: Channel, agent: Agent) -> Result<()> {
    let result = session(config, &mut channel, &agent).await;
    if let Err(e) = &result {
        tell(&channel, e).await;
    }
    if let (Some(problem), Ok(())) = (shutdown(&agent, config.timeouts.teardown).await, &result) {
        eprintln!("nixl-bench target: warning: {problem}");
    }
    result
}

/// Tell the initiator why we stop (if it still listens).
async fn tell(channel: &Channel, e: &BenchError) {
    let _ = channel.send(&ToInitiator::Error(e.to_string())).await;
}

/// The target's agent, its backend listening on `host`.
///
/// # Errors
/// A backend that cannot be made or started.
pub(crate) async fn start_agent(config: &Config, host: IpAddr) -> Result<Agent> {
    let backend = backend::make(&config.backend, &config.backend_params, host)?;
    Agent::builder(AGENT_NAME)
        .backend_arc(backend)
        .options(agent_options(config.timeouts.teardown))
        .telemetry(crate::metrics::telemetry(config))
        .build()
        .await
        .context("start the target agent")
}

async fn session(config: &Config, channel: &mut Channel, agent: &Agent) -> Result<()> {
    let t = config.timeouts;
    let setup = loop {
        match channel.recv(t.exchange, "setup").await? {
            ToTarget::Setup(s) => break s,
            ToTarget::Ping => {}
            other => return fail(format!("expected setup, got {other:?}")),
        }
    };
    if setup.protocol != PROTOCOL {
        return fail(format!(
            "the initiator (nixl-bench {}) speaks control protocol {}, this target (nixl-bench {}) speaks {PROTOCOL}; run the same version on both sides",
            setup.version,
            setup.protocol,
            env!("CARGO_PKG_VERSION")
        ));
    }
    if setup.backend != config.backend {
        return fail(format!(
            "the initiator uses backend {}, this target {}; start the target with --backend {}",
            setup.backend, config.backend, setup.backend
        ));
    }
    let buf = Buffer::register(
        agent,
        setup.buffer_size,
        setup.memory,
        setup.huge_pages,
        setup.seg_type,
        setup.device_id,
    )?;
    if !setup.initiator_metadata.is_empty() {
        agent
            .load_metadata(&control::unhex(&setup.initiator_metadata)?)
            .context("load the initiator's metadata")?;
    }
    channel
        .send(&ToInitiator::Metadata(agent.metadata()?.to_vec()))
        .await?;
    let idle = t.xfer.max(MIN_IDLE);
    loop {
        match channel.recv(idle, "the next request").await? {
            ToTarget::Ping => {}
            ToTarget::Fill(p) => {
                buffer::off_thread(&buf, p, buffer::fill).await?;
                channel.send(&ToInitiator::Ok).await?;
            }
            ToTarget::Verify(p) => {
                let report = buffer::off_thread(&buf, p, buffer::verify).await?;
                channel.send(&ToInitiator::Verified(report)).await?;
            }
            ToTarget::Done => {
                channel.send(&ToInitiator::Bye).await?;
                return Ok(());
            }
            ToTarget::Setup(_) => return fail("got a second setup"),
        }
    }
}
