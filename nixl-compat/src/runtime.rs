//! The one tokio runtime a drop-in surface's agents share in a process.

use std::sync::{Mutex, OnceLock};

use tokio::runtime::Runtime;

static RT: OnceLock<Runtime> = OnceLock::new();

/// The shared runtime, started on first use (after a `fork`, only the parent's is
/// started: make agents after forking). Workers: `NIXL_RS_THREADS`, else up to 4;
/// they park while idle.
///
/// # Errors
/// The runtime could not be started.
pub fn shared() -> std::io::Result<&'static Runtime> {
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    // One thread builds it (a runtime built by the loser of a race would be dropped,
    // which panics on a thread inside a runtime).
    static BUILDING: Mutex<()> = Mutex::new(());
    let _one = BUILDING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
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
        .build()?;
    let _ = RT.set(built);
    Ok(RT.get().expect("set above"))
}
