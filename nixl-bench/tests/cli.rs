//! End-to-end tests of the `nixl-bench` binary: small sweeps in every output format,
//! consistency checks, two-host mode (also through a real etcd, with the `etcd`
//! feature), and peers that die or hang mid-run.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nixl-bench");

/// Flags of a small, fast sweep: 4K..64K, 5 points.
const SMALL: &[&str] = &[
    "--max-block-size",
    "64K",
    "--num-iter",
    "20",
    "--warmup-iter",
    "2",
];

/// Bound on any run here; far above what they take, low enough to catch a hang.
const HANG: Duration = Duration::from_secs(60);

const COLUMNS: [&str; 12] = [
    "Block Size (B)",
    "Batch Size",
    "B/W (GB/Sec)",
    "Avg Lat. (us)",
    "Avg Prep (us)",
    "P99 Prep (us)",
    "Avg Post (us)",
    "P99 Post (us)",
    "Avg Tx (us)",
    "P99 Tx (us)",
    "Segments",
    "Runs",
];

const FIELDS: [&str; 14] = [
    "op",
    "block_size",
    "batch_size",
    "bw_gbps",
    "avg_lat_us",
    "avg_prep_us",
    "p99_prep_us",
    "avg_post_us",
    "p99_post_us",
    "avg_tx_us",
    "p50_tx_us",
    "p99_tx_us",
    "segments",
    "segment_runs",
];

fn bench() -> Command {
    let mut c = Command::new(BIN);
    // Keep stderr free of log noise.
    c.env_remove("RUST_LOG");
    c.env_remove("NIXL_ETCD_PASSWORD");
    c
}

/// Run to completion within [`HANG`].
fn run(args: &[&str]) -> Output {
    run_cmd(bench().args(args))
}

/// Run `cmd` (a [`bench`] command) to completion within [`HANG`].
fn run_cmd(cmd: &mut Command) -> Output {
    let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start nixl-bench");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        stdout.read_to_end(&mut v).unwrap();
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        stderr.read_to_end(&mut v).unwrap();
        v
    });
    let status =
        wait_within(&mut child, HANG).unwrap_or_else(|| panic!("nixl-bench {args:?} hung"));
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

fn wait_within(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ok(args: &[&str]) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "nixl-bench {args:?} failed: {}\n{stderr}",
        out.status
    );
    String::from_utf8(out.stdout).unwrap()
}

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = SMALL.to_vec();
    v.extend_from_slice(extra);
    v
}

/// The table's data rows, split into fields.
fn table_rows(stdout: &str) -> Vec<Vec<f64>> {
    stdout
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| {
            l.split_whitespace()
                .map(|f| {
                    f.parse::<f64>()
                        .unwrap_or_else(|_| panic!("bad field {f:?} in {l:?}"))
                })
                .collect()
        })
        .collect()
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("nixl-bench-{}-{name}", std::process::id()))
}

/// A `--role target` process and the address it listens on.
struct Target {
    child: Child,
    addr: String,
}

impl Target {
    fn start() -> Self {
        let mut child = bench()
            .args(["--role", "target", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the target");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .trim()
            .to_owned();
        Self { child, addr }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start a long run (`args`) and return once its table header is out (setup done,
/// transfers under way), with the stdout lines seen so far.
fn start_long_run(args: &[&str]) -> (Child, Vec<String>, mpsc::Receiver<String>) {
    let mut child = bench()
        .args(args)
        .args(["--max-block-size", "64K", "--num-iter", "100000000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the initiator");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the run started");
        let header = line.starts_with("Block Size (B)");
        seen.push(line);
        if header {
            break;
        }
    }
    // Let some transfers happen.
    std::thread::sleep(Duration::from_millis(300));
    (child, seen, rx)
}

/// The child's pid from the table header ("Target  child process N on this host").
fn child_pid(header: &[String]) -> String {
    header
        .iter()
        .find_map(|l| l.split("child process ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the header names the child process")
        .to_owned()
}

fn alive(pid: &str) -> bool {
    // A reaped process has no /proc entry; a zombie would still have one.
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `pid` still runs: a zombie (an orphan whose new parent has not reaped it
/// yet) does not.
fn running(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
        !state.is_some_and(|s| s.starts_with('Z'))
    })
}

use nixl_testkit::skip;

/// GET /metrics over HTTP/1.0; the body, or `None` while nothing listens.
fn scrape(addr: &str) -> Option<String> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    Some(out.split_once("\r\n\r\n")?.1.to_owned())
}

/// The value of a series, given as its name and labels up to the value.
fn series(body: &str, prefix: &str, labels: &[&str]) -> Option<f64> {
    body.lines()
        .filter(|l| l.starts_with(prefix) && labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit_once(' ')?.1.parse().ok())
}

#[path = "cli/peers.rs"]
mod peers;
#[path = "cli/runs.rs"]
mod runs;
