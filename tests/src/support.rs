//! Helpers shared by the cases.

use std::sync::Arc;
use std::time::Duration;

use nixl::{Agent, AgentOptions, Backend, Capabilities, ErrorKind};

/// A backend to run the suite against.
#[derive(Clone, Copy, Debug)]
pub struct BackendUnderTest {
    /// Name for messages.
    pub name: &'static str,
    /// Make a fresh backend instance; an `UnavailableLibrary` error (or `NotSupported`:
    /// the library loads, the hardware it drives is absent) skips the suite.
    pub make: fn() -> nixl::Result<Arc<dyn Backend>>,
    /// A reason to skip a case (by name) in this environment: a known defect of the
    /// bound native library that would abort the whole test process. `None` runs it.
    pub skip_case: fn(&str) -> Option<String>,
}

pub use nixl_testkit::{bounded, checksum, checksum_bytes, figure, pattern, remote, HANG};

/// Record a visible skip (see [`nixl_testkit::skip`]).
pub fn skip(case: &str, why: &str) {
    nixl_testkit::skip(case, why);
}

impl BackendUnderTest {
    /// Capabilities of a fresh instance, or `None` (after a SKIP line) when unavailable.
    pub fn capabilities(&self, case: &str) -> Option<Capabilities> {
        match (self.make)() {
            Ok(b) => Some(b.capabilities()),
            // A missing library, or a library without the hardware it drives.
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::UnavailableLibrary | ErrorKind::NotSupported
                ) =>
            {
                skip(case, &format!("backend {} unavailable: {e}", self.name));
                None
            }
            Err(e) => panic!("backend {} failed to construct: {e}", self.name),
        }
    }

    /// Build an agent with this backend.
    pub async fn agent(&self, name: &str) -> Agent {
        let b = (self.make)().expect("backend constructs");
        Agent::builder(name)
            .backend_arc(b)
            .options(AgentOptions {
                drain_timeout: Duration::from_secs(10),
                shutdown_timeout: Duration::from_secs(10),
            })
            .build()
            .await
            .expect("agent builds")
    }

    /// Two agents that know each other (`a` knows `b` and `b` knows `a`).
    pub async fn pair(&self) -> (Agent, Agent) {
        let a = self.agent("initiator").await;
        let b = self.agent("target").await;
        nixl_testkit::double::introduce(&a, &b);
        (a, b)
    }
}

pub use nixl_testkit::double::one;

#[cfg(feature = "tcp")]
pub use crate::tcp::{tcp_agent, tcp_options_from_env};

/// Threads in this process (Linux).
pub fn thread_count() -> usize {
    process_threads()
}

/// The process's thread count before a case, when the case has the process to itself;
/// `None`, after a SKIP line for the thread-count check of `case`, when other tests run
/// as threads of the same process (`cargo test`), where their runtimes starting and
/// stopping would be counted too. nextest (`scripts/test`) runs every test in its own
/// process, and `cargo test -- --test-threads=1` runs them one at a time.
pub fn own_thread_count(case: &str) -> Option<usize> {
    let alone = std::env::var("NEXTEST_EXECUTION_MODE").as_deref() == Ok("process-per-test")
        || std::env::var("RUST_TEST_THREADS").as_deref() == Ok("1");
    if alone {
        Some(process_threads())
    } else {
        skip(
            &format!("{case} (process thread count)"),
            "other tests share this process under cargo test; checked under nextest (scripts/test) or with --test-threads=1",
        );
        None
    }
}

/// The names of this process's threads (`/proc/self/task/*/comm`), sorted, for a
/// thread-count failure to say which thread stayed.
pub fn thread_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                .map(|n| n.trim().to_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn process_threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Threads:"))
                .and_then(|l| l[8..].trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Parse lower- or upper-case hex.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}
