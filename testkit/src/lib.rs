//! Test helpers shared by nixl-rs's test suites: visible SKIP and FIGURE lines,
//! deterministic byte patterns, OS-thread checks, a real etcd server, and backend
//! test doubles with the agent fixtures most tests start with ([`double`]). Dev-only.
//!
//! SKIP and FIGURE lines go to stderr and, when `NIXL_SKIP_LOG` / `NIXL_FIGURE_LOG`
//! name a file (`scripts/test` sets both), are appended there, so the script lists
//! them at the end of a run (nextest hides a passing test's stderr).
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

pub mod double;
pub mod elf;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod fake_cuda;

/// A TCP port on 127.0.0.1 that was free a moment ago (for a server a test starts
/// in another process, which must be told a port).
///
/// Taken below the kernel's ephemeral range (`ip_local_port_range`): a port the
/// kernel handed out for port 0 and took back would be handed out again, to any
/// process connecting out meanwhile (the suite's other tests connect all the time),
/// so a server told it a moment later could find it taken. Below the range only
/// servers bind, and each candidate is checked free; the start is spread by the
/// process id and the clock, so concurrent tests seldom try the same ones.
pub fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    const FROM: u32 = 10_000;
    if low <= FROM + 1000 {
        // An unusual range: the kernel's own choice, as before.
        return std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
    }
    let span = low - FROM;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let start = std::process::id().wrapping_mul(7919).wrapping_add(nanos);
    for i in 0..span {
        let port = (FROM + start.wrapping_add(i.wrapping_mul(104_729)) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free TCP port on 127.0.0.1 between {FROM} and {low}");
}

/// The directory the `nixl-cu12` wheel (NIXL 1.5.1, its Python API and its own
/// bundled UCX) was installed into (`NIXL_TEST_NIXL_WHEEL_DIR`, as `.ci/run` sets it)
/// and the libucp inside it; `None`, after a SKIP line for `case`, without them.
pub fn nixl_wheel(case: &str) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let Some(dir) = std::env::var_os("NIXL_TEST_NIXL_WHEEL_DIR").map(std::path::PathBuf::from)
    else {
        skip(
            case,
            "NIXL_TEST_NIXL_WHEEL_DIR is not set (a directory with the nixl-cu12 1.5.1 wheel installed; ./scripts/test under .ci/run sets it)",
        );
        return None;
    };
    let ucp = std::fs::read_dir(dir.join("nixl_cu12.libs"))
        .ok()
        .and_then(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libucp-") && n.contains(".so"))
            })
        });
    match ucp {
        Some(ucp) if dir.join("nixl_cu12").is_dir() => Some((dir, ucp)),
        _ => {
            skip(
                case,
                format!(
                    "no nixl_cu12 wheel with a bundled libucp under {}",
                    dir.display()
                ),
            );
            None
        }
    }
}

fn emit(var: &str, line: &str) {
    eprintln!("{line}");
    if let Some(path) = std::env::var_os(var) {
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

/// Record a visible skip of `case`: it passes without asserting and is listed at the
/// end of `scripts/test`, never counted as coverage.
pub fn skip(case: &str, why: impl std::fmt::Display) {
    emit("NIXL_SKIP_LOG", &format!("SKIP {case}: {why}"));
}

/// Record a measured figure (the README's reliability table comes from these).
pub fn figure(name: &str, value: impl std::fmt::Display) {
    emit("NIXL_FIGURE_LOG", &format!("FIGURE {name}: {value}"));
}

/// Run the calling test, named `test` (its path inside the test binary), in a child
/// process of its own: for a test that binds process-wide state other tests of its
/// binary must not share (one UCX per process). nextest already gives each test a
/// process; plain `cargo test` runs a binary's tests as threads of one.
///
/// Returns `false` in the child: the caller then runs its body there. Returns `true`
/// in the parent once the child passed (its output is printed; its SKIP and FIGURE
/// lines reach the logs from the child); panics with the child's output when it
/// failed.
pub fn in_own_process(test: &str) -> bool {
    const VAR: &str = "NIXL_TEST_OWN_PROCESS";
    if std::env::var(VAR).as_deref() == Ok(test) {
        return false;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(VAR, test)
        .output()
        .expect("the test binary runs again as a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{test} in a child process:\n{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "{test} failed in its child process ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("1 passed"),
        "{test}: the child ran no test named so:\n{stdout}"
    );
    true
}

/// A loopback listener that accepts one connection and never answers it: a peer
/// stuck in its handshake. The connection stays open until the task is aborted (or
/// [`HANG`] passes). Needs a tokio runtime.
pub async fn silent_listener() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        tokio::time::sleep(HANG).await;
        drop(s);
    });
    (at, held)
}

/// Generous bound that catches hangs (never a performance assertion).
pub const HANG: std::time::Duration = std::time::Duration::from_secs(30);

/// Await `f` within [`HANG`]; panics naming `what` when it hangs.
pub async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(HANG, f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for {HANG:?}"))
}

/// FNV-1a checksum of a registration's bytes.
pub fn checksum(r: &nixl::Registration) -> u64 {
    checksum_bytes(&r.to_vec().expect("the registration's bytes"))
}

/// The region with id `id` that `peer` advertised to `a`.
pub fn remote(a: &nixl::Agent, peer: &str, id: u64) -> nixl::RemoteRegionInfo {
    a.remote_regions(peer)
        .expect("the peer is loaded")
        .into_iter()
        .find(|r| r.id == id)
        .expect("peer advertised the region")
}

/// `len` deterministic pattern bytes of stream `seed` (xorshift).
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

/// FNV-1a of bytes.
pub fn checksum_bytes(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// OS threads of this process, by the name the kernel keeps (15 bytes at most).
pub mod threads {
    use super::*;

    /// How many threads of this process are named `name` (cut to 15 bytes, as the
    /// kernel keeps it), from `/proc/self/task/*/comm`.
    pub fn named(name: &str) -> usize {
        let want = &name[..name.len().min(15)];
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                    .filter(|c| c.trim_end() == want)
                    .count()
            })
            .unwrap_or(0)
    }

    /// Wait (up to 5 s) until exactly `n` threads are named `name` (a new thread
    /// names itself once it runs; an exiting one is listed for a moment).
    pub fn settle(name: &str, n: usize) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while named(name) != n {
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }
}

/// A fresh directory under the system's temporary directory, removed when dropped.
#[derive(Debug)]
pub struct TempDir {
    /// Its path.
    pub path: std::path::PathBuf,
}

impl TempDir {
    /// A new directory whose name starts with `prefix` (and is unique in the process).
    ///
    /// # Panics
    /// When it cannot be created.
    pub fn new(prefix: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("temporary directory");
        Self { path }
    }

    /// A path inside it.
    pub fn file(&self, name: &str) -> std::path::PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
