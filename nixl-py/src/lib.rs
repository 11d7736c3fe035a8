//! # nixl-py
//!
//! The native half of the Python distribution `nixl-rs`: NIXL's Python API
//! (`nixl_rs._api`, and NIXL's own package name `nixl`: `nixl._api`,
//! `nixl._bindings`; `nixl_agent`, `nixl_agent_config`, same method names, keywords,
//! return values and defaults as NIXL 1.5.1's) over the Rust agent of crate `nixl`,
//! plus asyncio counterparts. The Python layer (`python/nixl_rs/_api.py`, and
//! `python/nixl/` over it) keeps NIXL's signatures; this crate is the module
//! `nixl_rs._native` they call.
//!
//! Built with maturin (`maturin build` / `maturin develop` in this folder), which
//! turns on the `extension-module` feature; a plain `cargo build` makes an rlib and
//! never links libpython.
//!
//! How calls behave:
//! - posting (`transfer`) and polling (`check_xfer_state`) never block: they hold the
//!   GIL for a post (or an atomic read) and return; a post large enough that the
//!   backend may copy on the caller's thread releases the GIL while it runs;
//! - everything that waits (shutdown, connecting, registering, metadata exchange)
//!   releases the GIL, on one shared tokio runtime; completions of the asyncio
//!   counterparts reach the event loop through `call_soon_threadsafe`, so no Python
//!   thread polls;
//! - errors are Python exceptions of NIXL's classes carrying our error kind
//!   (module `errors`).
#![deny(unsafe_code)]

mod agent;
use nixl_compat::backends;
mod errors;
mod handles;
// Audited: turns caller-provided addresses and file descriptors into `nixl::Memory` under the Python
// API's documented contract.
#[allow(unsafe_code)]
mod memory;
mod runtime;

use pyo3::prelude::*;

/// The module `nixl_rs._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    runtime::init_logging();
    errors::register(m)?;
    m.add_class::<agent::PyAgent>()?;
    m.add_class::<handles::XferHandle>()?;
    m.add_class::<handles::DlistHandle>()?;
    m.add_function(wrap_pyfunction!(plugins, m)?)?;
    m.add_function(wrap_pyfunction!(plugin_params, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::finalize, m)?)?;
    m.add_function(wrap_pyfunction!(native_libraries, m)?)?;
    m.add("VERSION", nixl::VERSION)?;
    m.add("DEFAULT_COMM_PORT", nixl::exchange::NIXL_DEFAULT_PORT)?;
    Ok(())
}

/// NIXL names of the backends this build has.
#[pyfunction]
fn plugins() -> Vec<&'static str> {
    backends::plugins()
}

/// Native libraries of the transports mapped in this process (UCX, verbs, UCCL, the
/// CUDA driver), by path: what the backends bound so far.
#[pyfunction]
fn native_libraries() -> Vec<String> {
    nixl_compat::native_libraries()
}

/// A backend's parameter names and defaults (NIXL's `get_plugin_params`).
#[pyfunction]
fn plugin_params(name: &str) -> std::collections::HashMap<&'static str, &'static str> {
    backends::params(name).into_iter().collect()
}
