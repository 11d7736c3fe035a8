//! The one tokio runtime every agent of the process shares, and logging.
//!
//! C callers block on it (building an agent, connecting, deregistering, shutting
//! down); posting and polling never do. Its workers park when idle: no thread
//! spins while nothing moves.

use tokio::runtime::Runtime;

use crate::status::{Failure, Outcome};

/// The shared runtime (`nixl_compat::runtime::shared`: `NIXL_RS_THREADS` workers,
/// else up to 4), started on first use.
pub fn rt() -> Outcome<&'static Runtime> {
    nixl_compat::runtime::shared()
        .map_err(|e| Failure::backend(format!("starting nixl-rs' runtime: {e}")))
}

/// Run `fut` on the shared runtime and wait for it. From a thread that is itself
/// inside a tokio runtime of this library (a Rust program using this crate from
/// async code), the wait happens on a scoped helper thread, where blocking is
/// allowed. (A C or nixl-sys caller's own tokio is another copy of tokio: its
/// threads are not "inside" ours.)
pub fn block_on<F>(fut: F) -> Outcome<F::Output>
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    let rt = rt()?;
    if tokio::runtime::Handle::try_current().is_err() {
        return Ok(rt.block_on(fut));
    }
    std::thread::scope(|s| {
        s.spawn(|| rt.block_on(fut))
            .join()
            .map_err(|_| Failure::backend("a blocking call panicked"))
    })
}

/// Lock `m`, also after a panic while it was held (every call is caught at the C
/// boundary; the state a lock protects here stays consistent across one).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`lock`] as a method.
pub trait Locked<T> {
    /// The guard, poisoned or not.
    fn locked(&self) -> std::sync::MutexGuard<'_, T>;
}

impl<T> Locked<T> for std::sync::Mutex<T> {
    fn locked(&self) -> std::sync::MutexGuard<'_, T> {
        lock(self)
    }
}

/// Log to stderr once per process, filtered by `NIXL_RS_LOG` (tracing's syntax),
/// else by NIXL's `NIXL_LOG_LEVEL` (TRACE, DEBUG, INFO, WARN, ERROR, FATAL),
/// else warnings and errors. A subscriber the host program installed wins.
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("NIXL_RS_LOG")
            .ok()
            .or_else(|| {
                let level = match std::env::var("NIXL_LOG_LEVEL")
                    .ok()?
                    .to_ascii_uppercase()
                    .as_str()
                {
                    "TRACE" => "trace",
                    "DEBUG" => "debug",
                    "INFO" => "info",
                    "WARN" | "WARNING" => "warn",
                    "ERROR" | "FATAL" => "error",
                    _ => return None,
                };
                Some(tracing_subscriber::EnvFilter::new(level))
            })
            .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
        tracing::info!(
            target: "nixl_capi",
            "{}; native libraries are bound as backends are created (nixl_rs_capi_native_libraries)",
            crate::IMPLEMENTATION.trim_end_matches('\0')
        );
    });
}
