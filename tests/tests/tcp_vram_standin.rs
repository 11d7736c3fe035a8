//! The VRAM conformance cases on nixl-tcp, with the GPU replaced by the core's **host
//! stand-in** (`nixl::gpu::use_host_stand_in`, a test double: "device memory" is host
//! memory and device copies are `memcpy`).
//!
//! This runs nixl-tcp's staging of GPU memory (chunks copied asynchronously through
//! page-locked buffers while the socket moves another, the target answering only
//! after its last copy), the registration and lifetime rules and the agent's own device copies on any
//! machine. It proves nothing about CUDA: the same cases run on a real GPU through
//! `tests/tcp.rs` (and `scripts/gpu-check`), and skip there without one.

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};

fn make() -> nixl::Result<Arc<dyn nixl::Backend>> {
    nixl::gpu::use_host_stand_in();
    Ok(Arc::new(nixl_tcp::TcpBackend::with_options(
        nixl_conformance::support::tcp_options_from_env(),
    )))
}

const TCP_GPU_STAND_IN: BackendUnderTest = BackendUnderTest {
    name: "tcp (GPU host stand-in)",
    make,
    skip_case: |_| None,
};

conformance_tests!(TCP_GPU_STAND_IN;
    vram_transfers,
    vram_notifications_after_data,
    vram_lifetime,
    vram_peer_gone_mid_transfer,
);

/// Two connections per peer and transfers split across them: the staged pieces land
/// in order with the notification after all of them.
mod split {
    use super::*;

    fn make() -> nixl::Result<Arc<dyn nixl::Backend>> {
        nixl::gpu::use_host_stand_in();
        Ok(Arc::new(nixl_tcp::TcpBackend::with_options(
            nixl_tcp::TcpOptions {
                same_host: nixl_tcp::SameHost::Off,
                connections: 3,
                stripe_min: 1 << 20,
                ..nixl_tcp::TcpOptions::default()
            },
        )))
    }

    const TCP_GPU_STAND_IN_SPLIT: BackendUnderTest = BackendUnderTest {
        name: "tcp (GPU host stand-in, 3 connections)",
        make,
        skip_case: |_| None,
    };

    conformance_tests!(TCP_GPU_STAND_IN_SPLIT; vram_transfers, vram_notifications_after_data);
}
