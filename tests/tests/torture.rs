//! Teardown torture on nixl-tcp: randomized lifecycles with watchdogs.
//!
//! `lifecycle_torture_tcp` runs 1,000 seeded lifecycles (the base seed is printed;
//! `NIXL_TORTURE_SEED` fixes it, `NIXL_TORTURE_RUNS` changes the count).
//! `stress_lifecycle_tcp` is ignored by default: run it with
//! `NIXL_STRESS_RUNS=100000 cargo nextest run -p nixl-conformance --test torture --run-ignored only`.

use std::sync::Arc;

use nixl_conformance::support::figure;
use nixl_conformance::torture::{base_seed, env_u64, run_lifecycles};
use nixl_conformance::BackendUnderTest;

const TCP: BackendUnderTest = BackendUnderTest {
    name: "tcp",
    make: || {
        Ok(Arc::new(nixl_tcp::TcpBackend::with_options(
            nixl_conformance::support::tcp_options_from_env(),
        )))
    },
    skip_case: |_| None,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_torture_tcp() {
    nixl_conformance::torture::keep_logs_for_a_failure();
    let base = base_seed();
    let runs = env_u64("NIXL_TORTURE_RUNS").unwrap_or(1000);
    println!("torture: base seed {base}, {runs} runs (NIXL_TORTURE_SEED={base} reproduces)");
    let t0 = std::time::Instant::now();
    let r = run_lifecycles(&TCP, base, runs).await;
    println!("torture: {r:?} in {:?}", t0.elapsed());
    figure(
        "lifecycle runs (tcp)",
        format!(
            "{} runs, {} ops, {} transfers posted ({} ok, {} failed as expected, {} dropped mid-flight), {} agents shut down or dropped, 0 hangs, 0 leaked tasks or threads",
            r.runs, r.ops, r.posted, r.succeeded, r.failed, r.dropped, r.shutdowns
        ),
    );
    figure(
        "bytes verified after successful WRITEs (torture)",
        format!("{} verified, {} lost", r.bytes_verified, r.bytes_lost),
    );
    assert_eq!(r.runs, runs);
    assert_eq!(r.bytes_lost, 0);
    assert!(r.posted > runs, "the driver must actually post transfers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: set NIXL_STRESS_RUNS and run with --run-ignored only"]
async fn stress_lifecycle_tcp() {
    let base = base_seed();
    let runs = env_u64("NIXL_STRESS_RUNS").unwrap_or(10_000);
    println!("stress: base seed {base}, {runs} runs");
    let r = run_lifecycles(&TCP, base, runs).await;
    println!("FIGURE stress {r:?}");
    assert_eq!(r.bytes_lost, 0);
}
