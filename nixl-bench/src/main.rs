//! # nixl-bench
//!
//! Measures nixl transfers between two agents and prints nixlbench's table (or JSON,
//! CSV, an SVG plot). With no arguments it runs a quick sweep from this process to a
//! target agent in a child process, over the embedded tcp backend on loopback:
//!
//! ```sh
//! cargo run --release -p nixl-bench
//! ```
//!
//! On two hosts, run `--role target --listen ADDR` on one and
//! `--role initiator --peer ADDR` on the other; or, in a build with `--features etcd`,
//! give both `--etcd-endpoints URLS --benchmark-group NAME` and they find each other
//! through etcd (nixlbench's ETCD runtime). See `--help` for every parameter
//! (nixlbench's names, with dashes or underscores).
//!
//! Every phase has a time limit, so a dead or hung peer ends the run with an error and a
//! non-zero exit status; the child target is always stopped and reaped, also on Ctrl-C.
#![forbid(unsafe_code)]

mod backend;
mod baseline;
mod buffer;
mod child;
mod cli;
mod control;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod initiator;
mod metrics;
mod plot;
mod progress;
mod report;
mod runner;
mod stats;
#[cfg(feature = "posix")]
mod storage;
mod target;

use std::io::{IsTerminal, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use crate::child::TargetProcess;
use crate::cli::{Cli, Config, Role};
use crate::control::Channel;
use crate::error::{fail, Context, Result};
use crate::initiator::TargetInfo;
use crate::report::RunInfo;
use crate::stats::Row;

/// Exit status after Ctrl-C, as shells report a SIGINT death.
const INTERRUPTED: u8 = 130;

fn main() -> ExitCode {
    // Usage errors (including an unknown backend or parameter) exit with 2, like clap's.
    let config = Cli::parse().into_config().and_then(|c| {
        backend::make(
            &c.backend,
            &c.backend_params,
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        )?;
        Ok(c)
    });
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("nixl-bench: error: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nixl-bench: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        if let Some(addr) = config.metrics_addr {
            if let Err(e) = metrics::serve(addr) {
                return Some(Err(e));
            }
        }
        tokio::select! {
            r = run(&config) => Some(r),
            () = interrupted() => None,
        }
    });
    // Agents and the child were already stopped within their bounds (or dropped, which
    // cancels them); don't let a stray blocking read hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match outcome {
        Some(Ok(())) => ExitCode::SUCCESS,
        Some(Err(e)) => {
            let who = if config.role == Role::Target {
                "nixl-bench target"
            } else {
                "nixl-bench"
            };
            eprintln!("{who}: error: {e}");
            ExitCode::FAILURE
        }
        None => {
            eprintln!("nixl-bench: interrupted");
            ExitCode::from(INTERRUPTED)
        }
    }
}

/// Resolves on Ctrl-C (never, if the handler cannot be installed).
async fn interrupted() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn run(config: &Config) -> Result<()> {
    #[cfg(feature = "posix")]
    if config.backend == "posix" {
        if config.role != Role::Local {
            return fail("--backend posix runs one agent on its own files: no --role");
        }
        let (run, rows) = storage::run(config).await?;
        return plot(config, &run, &rows);
    }
    match config.role {
        Role::Local => local(config).await,
        Role::Initiator => remote_initiator(config).await,
        Role::Target => match &config.control_socket {
            Some(path) => child_target(config, path).await,
            None => remote_target(config).await,
        },
        Role::Auto => auto_role(config).await,
    }
}

/// Through etcd without `--role`: target or initiator, whichever the group needs.
#[cfg(feature = "etcd")]
async fn auto_role(config: &Config) -> Result<()> {
    let Some(etcd) = &config.etcd else {
        return fail("choosing the role needs --etcd-endpoints");
    };
    match etcd::auto(config, etcd).await? {
        Some((run, rows)) => plot(config, &run, &rows),
        None => Ok(()),
    }
}

/// Without the `etcd` feature there is no etcd mode (the arguments were refused).
#[cfg(not(feature = "etcd"))]
async fn auto_role(_config: &Config) -> Result<()> {
    fail("choosing the role needs etcd mode (the `etcd` feature)")
}

/// Initiator here, target in a child process, both on loopback.
async fn local(config: &Config) -> Result<()> {
    if let Some(addr) = backend::fixed_port(&config.backend, &config.backend_params) {
        return fail(format!(
            "--backend-param listen={addr}: both agents run on this host and cannot share a fixed port; use port 0"
        ));
    }
    let host = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let (child, channel) = TargetProcess::spawn(config).await?;
    let target = TargetInfo {
        mode: "local",
        process: format!("child process {} on this host", child.id()),
    };
    // On error, dropping `child` kills and reaps it.
    let (run, rows) = initiator::run(config, channel, host, target).await?;
    child.wait(config.timeouts.teardown).await?;
    plot(config, &run, &rows)
}

/// Initiator only: the target runs elsewhere (`--peer`, or found through etcd).
async fn remote_initiator(config: &Config) -> Result<()> {
    #[cfg(feature = "etcd")]
    if let Some(etcd) = &config.etcd {
        let (run, rows) = etcd::initiator(config, etcd).await?;
        return plot(config, &run, &rows);
    }
    let peer = config.peer.as_deref().unwrap_or_default();
    if config.peer_kind == cli::PeerKind::Nixl {
        let addr = tokio::net::lookup_host(peer)
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                error::BenchError::new(format!("--peer {peer:?}: not a HOST:PORT that resolves"))
            })?;
        let (run, rows) = initiator::run_nixl(config, addr).await?;
        return plot(config, &run, &rows);
    }
    let stream = control::connect(peer, config.timeouts.connect).await?;
    let host = stream.local_addr()?.ip();
    let remote = stream.peer_addr()?;
    let channel = Channel::tcp(
        stream,
        format!("the target at {remote}"),
        config.timeouts.exchange,
    );
    let target = TargetInfo {
        mode: "two-host",
        process: format!("peer at {remote}"),
    };
    let (run, rows) = initiator::run(config, channel, host, target).await?;
    plot(config, &run, &rows)
}

/// The target in the local mode's child process: serve the parent over its socket.
async fn child_target(config: &Config, socket: &std::path::Path) -> Result<()> {
    let _noise = child::Noise::start();
    let channel = child::connect(socket, config.timeouts.exchange).await?;
    target::serve(config, channel, IpAddr::V4(Ipv4Addr::LOCALHOST)).await
}

/// Target only: wait for one initiator, serve it, exit.
async fn remote_target(config: &Config) -> Result<()> {
    #[cfg(feature = "etcd")]
    if let Some(etcd) = &config.etcd {
        return etcd::target(config, etcd).await;
    }
    let (stream, from) = control::accept(config.listen, config.timeouts.connect, |addr| {
        println!("listening on {addr}");
        let _ = std::io::stdout().flush();
    })
    .await?;
    eprintln!("nixl-bench target: initiator connected from {from}");
    let host = stream.local_addr()?.ip();
    let channel = Channel::tcp(
        stream,
        format!("the initiator at {from}"),
        config.timeouts.exchange,
    );
    target::serve(config, channel, host).await?;
    eprintln!("nixl-bench target: done");
    Ok(())
}

fn plot(config: &Config, run: &RunInfo, rows: &[Row]) -> Result<()> {
    match &config.plot {
        Some(path) => plot::write(path, run, rows).context("plot"),
        None => Ok(()),
    }
}

#[cfg(all(test, feature = "tcp"))]
mod tests {
    use super::*;

    /// A VRAM-to-VRAM sweep, READ and WRITE with `--check-consistency`, both agents in
    /// this process over an in-memory control channel, on the host stand-in for GPU
    /// memory (a test double: it proves the bench's VRAM plumbing, buffer zeroing and
    /// checks, not CUDA; `scripts/gpu-check` runs the real thing).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn vram_sweep_checks_consistency_on_the_host_stand_in() {
        nixl::gpu::use_host_stand_in();
        let config = Cli::try_parse_from([
            "nixl-bench",
            "--initiator-seg-type",
            "VRAM",
            "--target-seg-type",
            "VRAM",
            "--device-id",
            "1",
            "--op-type",
            "WRITE,READ",
            "--check-consistency",
            "--start-block-size",
            "4K",
            "--max-block-size",
            "4M",
            "--num-iter",
            "4",
            "--warmup-iter",
            "1",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        let (a, b) = tokio::io::duplex(1 << 16);
        let ((ar, aw), (br, bw)) = (tokio::io::split(a), tokio::io::split(b));
        let t = config.timeouts.exchange;
        let host = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let target_info = TargetInfo {
            mode: "local",
            process: "this process (test)".to_owned(),
        };
        let (run, served) = tokio::join!(
            initiator::run(
                &config,
                Channel::new(ar, aw, "the target", t),
                host,
                target_info
            ),
            target::serve(&config, Channel::new(br, bw, "the initiator", t), host),
        );
        served.unwrap();
        let (_, rows) = run.unwrap();
        // 4 KiB to 4 MiB in powers of two, both ops, each checked byte for byte.
        assert_eq!(rows.len(), 2 * 11, "{rows:?}");
    }
}
