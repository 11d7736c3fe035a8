//! The conformance suite on nixl-ucx.
//!
//! Needs libucp at run time (Debian: `apt-get install libucx0`; or `NIXL_UCX_LIB`
//! pointing at one); without it every case prints a SKIP line. Pick transports with
//! `UCX_TLS` (for example `shm,self` or `tcp,self`).

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};

const UCX: BackendUnderTest = BackendUnderTest {
    name: "ucx",
    make: || Ok(Arc::new(nixl_ucx::UcxBackend::new()?)),
};

conformance_tests!(UCX);

/// Teardown torture on UCX (fewer runs than tcp: each run maps memory and creates
/// UCX workers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_torture_ucx() {
    if UCX.capabilities("lifecycle_torture_ucx").is_none() {
        return;
    }
    let base = nixl_conformance::torture::base_seed();
    let runs = nixl_conformance::torture::env_u64("NIXL_TORTURE_RUNS_UCX").unwrap_or(200);
    println!("torture (ucx): base seed {base}, {runs} runs");
    let r = nixl_conformance::torture::run_lifecycles(&UCX, base, runs).await;
    nixl_conformance::support::figure(
        "lifecycle runs (ucx)",
        format!("{} runs, {} transfers posted ({} ok, {} failed, {} dropped mid-flight), 0 hangs, 0 leaked tasks or threads; {} bytes verified, {} lost", r.runs, r.posted, r.succeeded, r.failed, r.dropped, r.bytes_verified, r.bytes_lost),
    );
    assert_eq!(r.bytes_lost, 0);
}
