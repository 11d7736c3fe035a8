//! The initiator: sets the target up over the control channel, runs the sweep, checks
//! consistency, and reports each point as it finishes.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use nixl::metadata::AgentMetadata;
use nixl::{Agent, MemKind, Op};

use crate::backend;
use crate::buffer::{self, Buffer, Layout, Pattern, RemoteBuffer, VerifyReport};
use crate::cli::{Config, Point, SegType};
use crate::control::{self, Channel, Setup, ToInitiator, ToTarget, PROTOCOL};
use crate::error::{fail, BenchError, Context, Result};
use crate::report::{Output, RunInfo, Transport, Units, Versions};
use crate::runner::{self, agent_options, shutdown, Phase, Session};
use crate::stats::Row;

/// How often the initiator tells the target it is alive.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Where the target runs, for the report.
#[derive(Debug)]
pub(crate) struct TargetInfo {
    /// `local` or `two-host`.
    pub(crate) mode: &'static str,
    /// "child process 1234 on this host", "peer at 10.0.0.2:5555".
    pub(crate) process: String,
}

/// Run the whole sweep against the target at the other end of `channel`. `host` is the
/// address the target reaches this machine on (the default for the backend listener).
///
/// # Errors
/// Whatever stops the run: setup, a failed or timed-out transfer, a failed consistency
/// check, or the target failing (its message is included).
pub(crate) async fn run(
    config: &Config,
    channel: Channel,
    host: IpAddr,
    target: TargetInfo,
) -> Result<(RunInfo, Vec<Row>)> {
    let (agent, backend) = start_agent(config, host).await?;
    run_with(config, channel, agent, backend, target).await
}

/// The initiator's agent and its backend, listening on `host`.
///
/// # Errors
/// A backend that cannot be made or started.
pub(crate) async fn start_agent(
    config: &Config,
    host: IpAddr,
) -> Result<(Arc<Agent>, Arc<dyn nixl::Backend>)> {
    let backend = backend::make(&config.backend, &config.backend_params, host)?;
    let agent = Agent::builder("initiator")
        .backend_arc(backend.clone())
        .options(agent_options(config.timeouts.teardown))
        .telemetry(crate::metrics::telemetry(config))
        .huge_pages(config.sweep.huge_pages)
        .build()
        .await
        .context("start the initiator agent")?;
    Ok((Arc::new(agent), backend))
}

/// As [`run`], with an agent started beforehand (etcd mode loads the target's metadata
/// into it first). Shuts `agent` down at the end, within the teardown bound.
///
/// # Errors
/// As [`run`].
pub(crate) async fn run_with(
    config: &Config,
    mut channel: Channel,
    agent: Arc<Agent>,
    backend: Arc<dyn nixl::Backend>,
    target: TargetInfo,
) -> Result<(RunInfo, Vec<Row>)> {
    let t = config.timeouts;
    let result = drive(config, &mut channel, &agent, &*backend, target).await;
    // Whatever happened, stop the agent within the teardown bound. Leftovers are
    // expected after a failure, and worth a warning after a clean run.
    if let (Some(problem), Ok(_)) = (shutdown(&agent, t.teardown).await, &result) {
        eprintln!("nixl-bench: warning: {problem}");
    }
    result
}

async fn drive(
    config: &Config,
    channel: &mut Channel,
    agent: &Arc<Agent>,
    backend: &dyn nixl::Backend,
    target: TargetInfo,
) -> Result<(RunInfo, Vec<Row>)> {
    // From here on the target hears from us at least every second, or gives up.
    let _heartbeat = channel.heartbeat(HEARTBEAT);
    let local = Buffer::register(
        agent,
        config.sweep.total_buffer_size,
        config.sweep.memory,
        config.sweep.huge_pages,
        config.sweep.initiator_seg_type,
        config.sweep.device_id,
    )?;
    let (peer, remote, target_md) = exchange(config, channel, agent).await?;
    let target_endpoint = AgentMetadata::decode(&target_md)
        .ok()
        .and_then(|md| {
            md.backends
                .into_iter()
                .find(|b| b.name == config.backend)
                .and_then(|b| b.conn_info)
        })
        .map_or_else(|| "?".to_owned(), |c| endpoint(&c));
    let loopback = target_endpoint
        .parse::<SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback());
    let run = run_info(config, backend, &peer, target_endpoint, loopback, target).await?;
    let session = Arc::new(Session {
        agent: agent.clone(),
        local,
        peer,
        remote,
    });
    let rows = sweep(config, Some(channel), &session, &run).await?;
    finish(channel, config.timeouts.exchange).await?;
    Ok((run, rows))
}

/// Run the sweep against a NIXL agent whose listener is at `addr` (`--peer-kind
/// nixl`): its metadata through NIXL's listener protocol, ours sent back to it, then
/// READs and WRITEs on its largest DRAM registration. No consistency check (a NIXL
/// agent has no control channel). Shuts the agent down at the end.
///
/// # Errors
/// As [`run`].
pub(crate) async fn run_nixl(config: &Config, addr: SocketAddr) -> Result<(RunInfo, Vec<Row>)> {
    let host = if addr.ip().is_loopback() {
        addr.ip()
    } else {
        IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
    };
    let (agent, backend) = start_agent(config, host).await?;
    let t = config.timeouts;
    let result = async {
        let local = Buffer::register(
            &agent,
            config.sweep.total_buffer_size,
            config.sweep.memory,
            config.sweep.huge_pages,
            config.sweep.initiator_seg_type,
            config.sweep.device_id,
        )?;
        let opts = nixl::NixlListenerOptions {
            timeout: t.exchange,
            ..nixl::NixlListenerOptions::default()
        };
        let peer = agent
            .fetch_nixl_metadata(addr, &opts)
            .await
            .with_context(|| format!("fetch the NIXL agent's metadata from its listener at {addr}"))?;
        agent
            .send_nixl_metadata(addr, &opts)
            .await
            .context("send our metadata to the NIXL agent")?;
        let size = config.sweep.total_buffer_size;
        let region = agent
            .remote_regions(&peer)?
            .into_iter()
            .filter(|r| r.kind == MemKind::Dram && r.len >= size)
            .max_by_key(|r| r.len)
            .ok_or_else(|| {
                BenchError::new(format!(
                    "the NIXL agent {peer:?} registered no DRAM of at least {size} bytes (--total-buffer-size)"
                ))
            })?;
        let remote = RemoteBuffer::new(region, size)?;
        match tokio::time::timeout(t.connect, agent.connect(&peer)).await {
            Ok(r) => r.context("connect ucx to the NIXL agent")?,
            Err(_) => return fail(format!("could not connect to the NIXL agent within {:?}", t.connect)),
        }
        let target = TargetInfo {
            mode: "NIXL agent",
            process: format!("NIXL agent {peer:?}, listener at {addr}"),
        };
        let run = run_info(config, &*backend, &peer, addr.to_string(), addr.ip().is_loopback(), target).await?;
        let session = Arc::new(Session {
            agent: agent.clone(),
            local,
            peer,
            remote,
        });
        let rows = sweep(config, None, &session, &run).await?;
        Ok((run, rows))
    }
    .await;
    if let (Some(problem), Ok(_)) = (shutdown(&agent, t.teardown).await, &result) {
        eprintln!("nixl-bench: warning: {problem}");
    }
    result
}

/// The run's header: versions, transport, baselines (measured now, if asked).
async fn run_info(
    config: &Config,
    backend: &dyn nixl::Backend,
    peer: &str,
    target_endpoint: String,
    loopback: bool,
    target: TargetInfo,
) -> Result<RunInfo> {
    let baselines = if config.sweep.baselines {
        let sizes: Vec<u64> = config
            .sweep
            .points()
            .iter()
            .map(|p| p.block_size * p.batch_size as u64)
            .collect();
        let b = tokio::task::spawn_blocking(move || crate::baseline::measure(&sizes))
            .await
            .map_err(|e| BenchError::new(format!("baseline measurement failed: {e}")))??;
        Some(b)
    } else {
        None
    };
    Ok(RunInfo {
        versions: Versions::current(),
        mode: target.mode,
        backend: config.backend.clone(),
        backend_params: config.backend_params.iter().cloned().collect(),
        transport: Transport {
            initiator: endpoint(&backend.connection_info()),
            target: target_endpoint,
            target_process: target.process,
            loopback,
            library: backend::library_report(&config.backend, &config.backend_params),
            data_path: backend.data_path(peer),
        },
        sweep: config.sweep.clone(),
        timeouts_s: config.timeouts,
        units: Units::default(),
        notes: config.notes.clone(),
        baselines,
    })
}

/// Send setup, load the target's metadata, connect. Returns the target's name, its
/// buffer, and its raw metadata.
async fn exchange(
    config: &Config,
    channel: &mut Channel,
    agent: &Agent,
) -> Result<(String, RemoteBuffer, Vec<u8>)> {
    let t = config.timeouts;
    let s = &config.sweep;
    let setup = Setup {
        protocol: PROTOCOL,
        version: env!("CARGO_PKG_VERSION").to_owned(),
        backend: config.backend.clone(),
        buffer_size: s.total_buffer_size,
        seg_type: s.target_seg_type,
        device_id: s.device_id,
        memory: s.memory,
        huge_pages: s.huge_pages,
        initiator_metadata: control::hex(&agent.metadata()?),
    };
    channel.send(&ToTarget::Setup(Box::new(setup))).await?;
    let md = match reply(channel, t.exchange, "metadata").await? {
        ToInitiator::Metadata(md) => md,
        other => return fail(format!("expected the target's metadata, got {other:?}")),
    };
    let peer = agent
        .load_metadata(&md)
        .context("load the target's metadata")?;
    let region = agent
        .remote_regions(&peer)?
        .into_iter()
        .find(|r| match s.target_seg_type {
            SegType::Dram => r.kind == MemKind::Dram,
            SegType::Vram => matches!(r.kind, MemKind::Vram { .. }),
        })
        .ok_or_else(|| {
            BenchError::new(format!(
                "the target advertised no {:?} region",
                s.target_seg_type
            ))
        })?;
    let remote = RemoteBuffer::new(region, s.total_buffer_size)?;
    match tokio::time::timeout(t.connect, agent.connect(&peer)).await {
        Ok(r) => r.with_context(|| format!("connect {} to the target", config.backend))?,
        Err(_) => {
            return fail(format!(
                "the {} backend could not connect to the target within {:?}",
                config.backend, t.connect
            ))
        }
    }
    Ok((peer, remote, md))
}

/// The target's answer to a request, or its error.
async fn reply(channel: &mut Channel, timeout: Duration, what: &str) -> Result<ToInitiator> {
    match channel.recv(timeout, what).await? {
        ToInitiator::Error(e) => fail(format!("{} failed: {e}", channel.peer())),
        m => Ok(m),
    }
}

/// Tell the target we are done and wait for its goodbye.
async fn finish(channel: &mut Channel, timeout: Duration) -> Result<()> {
    channel.send(&ToTarget::Done).await?;
    match reply(channel, timeout, "goodbye").await? {
        ToInitiator::Bye => Ok(()),
        other => fail(format!("expected bye, got {other:?}")),
    }
}

/// Connection info as text when it is text (tcp: `ip:port`, without the `;key=value`
/// parts after it), else its size.
fn endpoint(info: &[u8]) -> String {
    match std::str::from_utf8(info) {
        Ok(s) if !s.is_empty() && s.chars().all(|c| c.is_ascii_graphic()) => {
            s.split(';').next().unwrap_or_default().to_owned()
        }
        _ => format!("<{} bytes of connection info>", info.len()),
    }
}

async fn sweep(
    config: &Config,
    mut channel: Option<&mut Channel>,
    session: &Arc<Session>,
    run: &RunInfo,
) -> Result<Vec<Row>> {
    let s = &config.sweep;
    let points = s.points();
    let mut out = Output::new(config.format, points.len(), s.op_types.len());
    out.begin(run).context("write results")?;
    for (i, &point) in points.iter().enumerate() {
        let Point {
            op,
            block_size,
            batch_size,
        } = point;
        let layout = Layout {
            block_size,
            batch_size,
            depth: s.pipeline_depth,
            threads: s.num_threads,
            thread_stride: s.thread_buffer_size(),
            spacing: s.descriptor_layout.spacing(block_size),
        };
        let what = format!("{op} {block_size} B x {batch_size}");
        let (warmup, iters) = s.iterations(block_size);
        let pattern = Pattern {
            seed: 0x6e69_786c_u64 ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            ranges: layout.ranges(),
        };
        if let (true, Some(channel)) = (s.check_consistency, channel.as_deref_mut()) {
            out.progress(&format!("{what}: filling the check pattern"));
            prepare_check(config, channel, session, op, &pattern).await?;
        }
        let phase = |iters_per_thread| Phase {
            op,
            layout,
            iters_per_thread,
            recreate: s.recreate_xfer,
            merge: s.merge_descriptors,
            xfer_timeout: config.timeouts.xfer,
        };
        if warmup > 0 {
            out.progress(&format!("{what}: warmup"));
            runner::run(session, phase(warmup))
                .await
                .with_context(|| format!("{what}: warmup"))?;
        }
        out.progress(&format!("{what}: measuring"));
        let stats = runner::run(session, phase(iters))
            .await
            .context(what.clone())?;
        if let (true, Some(channel)) = (s.check_consistency, channel.as_deref_mut()) {
            out.progress(&format!("{what}: checking"));
            let report = check(config, channel, session, op, pattern).await?;
            if !report.is_ok() {
                return fail(format!(
                    "consistency check failed after {what}: {} of {} bytes differ, the first at offset {}",
                    report.wrong,
                    report.checked,
                    report.first_wrong.unwrap_or_default()
                ));
            }
        }
        out.row(Row::new(
            op,
            block_size,
            batch_size,
            iters,
            s.num_threads,
            stats,
        ))
        .context("write results")?;
    }
    out.finish(run).context("write results")
}

/// Write the pattern at the source and a different one (poison) at the destination, so
/// only bytes that really moved pass the check.
async fn prepare_check(
    config: &Config,
    channel: &mut Channel,
    session: &Session,
    op: Op,
    pattern: &Pattern,
) -> Result<()> {
    let poison = Pattern {
        seed: !pattern.seed,
        ..pattern.clone()
    };
    let (local, remote) = match op {
        Op::Write => (pattern.clone(), poison),
        Op::Read => (poison, pattern.clone()),
    };
    channel.send(&ToTarget::Fill(remote)).await?;
    buffer::off_thread(&session.local, local, buffer::fill).await?;
    match reply(channel, config.timeouts.exchange, "fill acknowledgement").await? {
        ToInitiator::Ok => Ok(()),
        other => fail(format!("expected ok, got {other:?}")),
    }
}

/// Check the destination: the target's memory after WRITEs, ours after READs.
async fn check(
    config: &Config,
    channel: &mut Channel,
    session: &Session,
    op: Op,
    pattern: Pattern,
) -> Result<VerifyReport> {
    match op {
        Op::Read => buffer::off_thread(&session.local, pattern, buffer::verify).await,
        Op::Write => {
            channel.send(&ToTarget::Verify(pattern)).await?;
            match reply(channel, config.timeouts.exchange, "check result").await? {
                ToInitiator::Verified(r) => Ok(r),
                other => fail(format!("expected a check result, got {other:?}")),
            }
        }
    }
}
