//! Helpers shared by the cases.

use std::sync::Arc;
use std::time::Duration;

use nixl::{
    Agent, AgentOptions, Backend, Capabilities, DescList, ErrorKind, MemKind, Registration,
    RemoteRegionInfo,
};

/// A backend to run the suite against.
#[derive(Clone, Copy, Debug)]
pub struct BackendUnderTest {
    /// Name for messages.
    pub name: &'static str,
    /// Make a fresh backend instance; an `UnavailableLibrary` error skips the suite.
    pub make: fn() -> nixl::Result<Arc<dyn Backend>>,
}

/// Generous bound that catches hangs (never a performance assertion).
pub const HANG: Duration = Duration::from_secs(30);

/// Record a reliability figure: a `FIGURE <name>: <value>` line on stderr and, when
/// `NIXL_FIGURE_LOG` names a file (`scripts/test` sets it), in that file, which the
/// test script prints at the end of the run (the README's Reliability table comes
/// from it).
pub fn figure(name: &str, value: impl std::fmt::Display) {
    let line = format!("FIGURE {name}: {value}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("NIXL_FIGURE_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// Record a visible skip: a `SKIP <case>: <reason>` line on stderr and, when
/// `NIXL_SKIP_LOG` names a file (`scripts/test` sets it), in that file, which the test
/// script lists at the end of the run.
pub fn skip(case: &str, why: &str) {
    let line = format!("SKIP {case}: {why}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("NIXL_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

impl BackendUnderTest {
    /// Capabilities of a fresh instance, or `None` (after a SKIP line) when unavailable.
    pub fn capabilities(&self, case: &str) -> Option<Capabilities> {
        match (self.make)() {
            Ok(b) => Some(b.capabilities()),
            Err(e) if e.kind() == ErrorKind::UnavailableLibrary => {
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
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        b.load_metadata(&a.metadata().unwrap()).unwrap();
        (a, b)
    }
}

/// Deterministic pattern byte `i` of stream `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// FNV-1a checksum of a registration's bytes.
pub fn checksum(r: &Registration) -> u64 {
    checksum_bytes(&r.to_vec().unwrap())
}

/// FNV-1a of bytes.
pub fn checksum_bytes(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A one-descriptor DRAM list.
pub fn one(d: nixl::Desc) -> DescList {
    DescList::from_descs(MemKind::Dram, [d])
}

/// The peer's region with id `id`.
pub fn remote(a: &Agent, peer: &str, id: u64) -> RemoteRegionInfo {
    a.remote_regions(peer)
        .unwrap()
        .into_iter()
        .find(|r| r.id == id)
        .expect("peer advertised the region")
}

/// Threads in this process (Linux).
pub fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Threads:"))
                .and_then(|l| l[8..].trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Await with the hang bound.
pub async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(HANG, f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for {HANG:?}"))
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

/// `TcpOptions` from `NIXL_TCP_LISTEN`, `NIXL_TCP_DEAD_PEER_MS` and
/// `NIXL_TCP_CONNECT_MS` (for test processes started in network namespaces).
pub fn tcp_options_from_env() -> nixl_tcp::TcpOptions {
    let mut o = nixl_tcp::TcpOptions::default();
    if let Some(a) = std::env::var("NIXL_TCP_LISTEN")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        o.listen = a;
    }
    let ms = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    };
    if let Some(d) = ms("NIXL_TCP_DEAD_PEER_MS") {
        o.dead_peer_timeout = d;
    }
    if let Some(d) = ms("NIXL_TCP_CONNECT_MS") {
        o.connect_timeout = d;
    }
    o
}
