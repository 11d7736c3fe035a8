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

/// With `NIXL_TORTURE_TRACE` set to a log filter (for example
/// `nixl=debug,nixl_tcp=trace`), the last 20,000 log lines are kept and printed when
/// the test panics (a watchdog fired), so a rare hang shows what the agents did last.
fn keep_logs_for_a_failure() {
    use std::collections::VecDeque;
    use std::sync::{Mutex, OnceLock};
    const KEEP: usize = 20_000;
    static RING: OnceLock<Mutex<VecDeque<String>>> = OnceLock::new();
    let Ok(filter) = std::env::var("NIXL_TORTURE_TRACE") else {
        return;
    };
    struct Ring;
    impl std::io::Write for Ring {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let mut r = RING.get_or_init(Mutex::default).lock().unwrap();
            if r.len() == KEEP {
                r.pop_front();
            }
            r.push_back(String::from_utf8_lossy(b).into_owned());
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(false)
        .with_thread_names(true)
        .with_writer(|| Ring)
        .try_init();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Some(r) = RING.get() {
            let r = r.lock().unwrap_or_else(|p| p.into_inner());
            eprintln!("-- the last {} log lines --", r.len());
            for l in r.iter() {
                eprint!("{l}");
            }
        }
        previous(info);
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_torture_tcp() {
    keep_logs_for_a_failure();
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
