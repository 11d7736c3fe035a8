//! The one tokio runtime every agent of the process shares, logging, and the exit
//! hook that stops calling into Python before the interpreter goes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

static RT: OnceLock<Runtime> = OnceLock::new();
/// Set at interpreter exit (`atexit`): tasks no longer call into Python.
static FINALIZING: AtomicBool = AtomicBool::new(false);

/// The shared runtime, started on first use (after a fork, only the parent's is
/// started: make agents after forking). Workers: `NIXL_RS_THREADS`, else up to 4.
pub(crate) fn rt() -> PyResult<&'static Runtime> {
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let workers = std::env::var("NIXL_RS_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get().min(4))
                .unwrap_or(2)
        });
    let built = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("nixl-rs")
        .enable_all()
        .build()
        .map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!("starting nixl-rs' runtime: {e}"))
        })?;
    // A racing first call built another one; the loser is dropped here, unused.
    let _ = RT.set(built);
    Ok(RT.get().expect("set above"))
}

/// Whether tasks may still call into Python.
pub(crate) fn python_alive() -> bool {
    !FINALIZING.load(Ordering::Acquire)
}

/// Called from `atexit` after every agent was shut down: from here on, completions
/// are not delivered to Python.
#[pyfunction]
pub(crate) fn finalize() {
    FINALIZING.store(true, Ordering::Release);
}

/// Log to stderr, filtered by `NIXL_RS_LOG` (tracing's syntax; default `warn`).
pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NIXL_RS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Another subscriber in the process (an embedding Rust program) wins.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
