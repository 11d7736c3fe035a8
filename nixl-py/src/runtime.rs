//! The one tokio runtime every agent of the process shares, logging, and the exit
//! hook that stops calling into Python before the interpreter goes.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use tokio::runtime::Runtime;

/// Set at interpreter exit (`atexit`): tasks no longer call into Python.
static FINALIZING: AtomicBool = AtomicBool::new(false);

/// The shared runtime (`nixl_compat::runtime::shared`), started on first use
/// (after a fork, only the parent's is started: make agents after forking).
/// Workers: `NIXL_RS_THREADS`, else up to 4.
pub(crate) fn rt() -> PyResult<&'static Runtime> {
    nixl_compat::runtime::shared().map_err(|e| {
        pyo3::exceptions::PyOSError::new_err(format!("starting nixl-rs' runtime: {e}"))
    })
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
