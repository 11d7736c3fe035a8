//! # nixl-capi
//!
//! NIXL's C API over nixl-rs: `libnixl_capi.so` with every function of NIXL
//! 1.5.1's C API (the interface of the `nixl-sys` 1.5.1 crate's `wrapper.h`; our
//! header is `include/nixl_capi.h`), so a program that loads NIXL's C API —
//! `nixl-sys` in its stub mode (NVIDIA Dynamo), or a C program — runs on nixl-rs
//! with nothing changed but the library found under that name.
//!
//! Layers, top to bottom:
//! - `ffi`: the `extern "C"` shims. Every `unsafe` of the crate is there or in
//!   `memory`; each pointer and length is checked, handles carry a type tag, and
//!   no panic crosses the boundary (it becomes `NIXL_CAPI_ERROR_BACKEND`).
//! - [`agent`], [`xfer`], [`lists`]: NIXL's semantics in safe Rust over
//!   [`nixl::Agent`] (statuses in [`status`]).
//! - `nixl_compat`: backends by NIXL's names (`UCX`, `POSIX`, `UCCL`, and our
//!   `TCP`, `VERBS`) and memory from NIXL's descriptors, shared with `nixl-py`.
//!
//! Threads: an agent may be used from several threads at once; posting and
//! polling take only the request's lock; the one shared tokio runtime's workers
//! park while idle.
#![deny(unsafe_code)]

pub mod agent;
// The C interface: its `pub` items are the exported symbols and their types; the
// module itself is private (Rust callers use `agent`, `xfer`, `lists`).
#[allow(unsafe_code, unreachable_pub)]
mod ffi;
pub mod lists;
// Audited: turns C callers' addresses and file descriptors into `nixl::Memory`
// under the registration contract.
#[allow(unsafe_code)]
mod memory;
pub mod runtime;
pub mod status;
pub mod xfer;

/// What `nixl_rs_capi_version` returns (NUL-terminated).
pub const IMPLEMENTATION: &str = concat!(
    "nixl-rs ",
    env!("CARGO_PKG_VERSION"),
    " (NIXL C API 1.5.1, libnixl_capi.so)\0"
);
