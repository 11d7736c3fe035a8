//! # nixl-compat
//!
//! NIXL's vocabulary over nixl-rs, for the crates that let NIXL's users switch
//! without rewriting: `nixl-py` (NIXL's Python API) and `nixl-capi` (NIXL's C API,
//! `libnixl_capi.so`). Both take backends by NIXL's names with string parameters
//! and memory as NIXL's descriptors (address, length, device id, meta); this crate
//! is the one place that turns those into nixl-rs backends and [`nixl::Memory`].
#![deny(unsafe_code)]

pub mod backends;
pub mod background;
pub mod etcd;
pub mod runtime;
// Audited: turns caller-provided addresses and file descriptors into `nixl::Memory`
// under the callers' documented contract.
#[allow(unsafe_code)]
pub mod memory;

/// Native libraries of the transports mapped in this process (UCX, verbs, UCCL, the
/// CUDA driver), by path: what the backends bound so far.
pub fn native_libraries() -> Vec<String> {
    nixl::native::mapped_objects(&[
        "libucp.so",
        "libucs.so",
        "libuct.so",
        "libibverbs.so",
        "libuccl_p2p.so",
        "libcuda.so",
    ])
    .into_iter()
    .map(|p| p.display().to_string())
    .collect()
}
