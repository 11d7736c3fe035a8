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

#[test]
fn table_has_nixlbench_columns_and_one_row_per_block_size() {
    let out = ok(SMALL);
    for col in COLUMNS {
        assert!(out.contains(col), "column {col:?} missing:\n{out}");
    }
    for needle in [
        "nixl-bench ",
        "nixl-tcp ",
        "tcp",
        "WRITE",
        "GB = 10^9 bytes",
        "loopback",
    ] {
        assert!(
            out.contains(needle),
            "{needle:?} missing in the header:\n{out}"
        );
    }
    let rows = table_rows(&out);
    let blocks: Vec<f64> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(blocks, [4096.0, 8192.0, 16384.0, 32768.0, 65536.0], "{out}");
    for r in &rows {
        assert_eq!(r.len(), 13, "{r:?}");
        assert_eq!(r[1], 1.0, "batch size");
        assert_eq!((r[11], r[12]), (1.0, 1.0), "one segment in one run: {r:?}");
        assert!(r[2] > 0.0, "bandwidth {r:?}");
        assert!(r[3] > 0.0 && r[8] > 0.0, "latencies {r:?}");
        // With 20 samples the p99 is the largest one, never below the mean or the
        // median.
        for (avg, p99) in [(4, 5), (6, 7), (8, 10)] {
            assert!(r[p99] >= r[avg], "p99 below average in {r:?}");
        }
        assert!(r[10] >= r[9] && r[9] > 0.0, "p99 below median in {r:?}");
    }
}

#[test]
fn json_is_one_object_with_run_and_results() {
    let out = ok(&with(&["--json", "--op-type", "read"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON document");
    let run = &v["run"];
    assert_eq!(run["backend"], "tcp");
    assert_eq!(run["mode"], "local");
    assert_eq!(run["op_types"][0], "READ");
    assert_eq!(run["num_iter"], 20);
    assert!(run["versions"]["nixl"].is_string() && run["versions"]["nixl_bench"].is_string());
    assert!(run["transport"]["target"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 5);
    for (r, block) in results.iter().zip([4096, 8192, 16384, 32768, 65536]) {
        for f in FIELDS {
            assert!(r.get(f).is_some(), "{f} missing in {r}");
        }
        assert_eq!(r["op"], "READ");
        assert_eq!(r["block_size"], block);
        assert!(r["bw_gbps"].as_f64().unwrap() > 0.0);
        assert!(r["avg_tx_us"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn csv_has_the_header_and_a_row_per_point() {
    let out = ok(&with(&["--csv"]));
    let mut lines = out.lines();
    assert_eq!(lines.next().unwrap(), FIELDS.join(","));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 5, "{out}");
    for r in rows {
        assert_eq!(r.len(), FIELDS.len());
        assert_eq!(r[0], "WRITE");
        for f in &r[1..] {
            f.parse::<f64>().unwrap();
        }
    }
}

#[test]
fn consistency_check_passes_for_write() {
    let out = ok(&with(&[
        "--check-consistency",
        "--op-type",
        "WRITE",
        "--num-threads",
        "2",
        "--pipeline-depth",
        "2",
        "--max-batch-size",
        "2",
    ]));
    assert!(out.contains("consistency check on"), "{out}");
    assert_eq!(table_rows(&out).len(), 10);
}

/// Scattered blocks are a strided list: a batch of 8 reaches the backend as 8
/// segments in one run, and every byte still checks.
#[test]
fn scattered_batches_reach_the_backend_as_one_run() {
    let out = ok(&with(&[
        "--descriptor-layout",
        "scattered",
        "--start-batch-size",
        "8",
        "--max-batch-size",
        "8",
        "--check-consistency",
    ]));
    let rows = table_rows(&out);
    assert_eq!(rows.len(), 5, "{out}");
    for r in &rows {
        assert_eq!((r[1], r[11], r[12]), (8.0, 8.0, 1.0), "{r:?}");
    }
}

/// `--memory backend` reaches the target through setup; tcp offers no memory of its
/// own, so both sides get ordinary memory from `Agent::alloc`, and every byte checks.
#[test]
fn backend_memory_passes_the_consistency_check() {
    let out = ok(&with(&["--memory", "backend", "--check-consistency"]));
    assert!(out.contains("backend (Agent::alloc) memory"), "{out}");
    assert_eq!(table_rows(&out).len(), 5);
}

#[test]
fn consistency_check_passes_for_read_with_recreated_requests() {
    let out = ok(&with(&[
        "--check_consistency",
        "--op_type",
        "read",
        "--recreate-xfer",
        "--pipeline-depth",
        "3",
    ]));
    assert_eq!(table_rows(&out).len(), 5);
}

#[test]
fn plot_writes_a_parseable_svg() {
    let path = temp_path("plot.svg");
    let out = ok(&with(&[
        "--op-type",
        "READ,WRITE",
        "--plot",
        path.to_str().unwrap(),
    ]));
    assert_eq!(table_rows(&out).len(), 10);
    let svg = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let doc = roxmltree::Document::parse(&svg).expect("well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    // Two panels (bandwidth, latency) x two series (READ, WRITE).
    let lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .count();
    assert_eq!(lines, 4);
    let text: String = doc.descendants().filter_map(|n| n.text()).collect();
    for needle in [
        "Block size",
        "Bandwidth",
        "latency",
        "READ tcp",
        "WRITE tcp",
        "64K",
    ] {
        assert!(
            text.contains(needle),
            "{needle:?} missing in the plot's text"
        );
    }
}

#[test]
fn usage_errors_say_why_and_exit_2() {
    /// What `--etcd-endpoints` alone says, with and without the `etcd` feature.
    const ETCD: (&[&str], &str) = if cfg!(feature = "etcd") {
        (
            &[
                "--role",
                "local",
                "--etcd-endpoints",
                "http://127.0.0.1:2379",
            ],
            "--etcd-endpoints is for two hosts",
        )
    } else {
        (
            &[
                "--role",
                "target",
                "--etcd-endpoints",
                "http://127.0.0.1:2379",
            ],
            "rebuild with `cargo build --release -p nixl-bench --features etcd`",
        )
    };
    for (args, needle) in [
        (
            &["--initiator-seg-type", "VRAM", "--memory", "backend"][..],
            "backend memory is host memory",
        ),
        // Built without nixl-ucx, the ucx backend is refused; with it, a NIXL peer
        // needs ucx.
        if cfg!(feature = "ucx") {
            (
                &[
                    "--role",
                    "initiator",
                    "--peer",
                    "h:1",
                    "--peer-kind",
                    "nixl",
                ][..],
                "needs --backend ucx",
            )
        } else {
            (&["--backend", "ucx"][..], "backend ucx")
        },
        (
            &["--backend-param", "bogus=1"][..],
            "unknown tcp backend parameter",
        ),
        ETCD,
        (
            &["--benchmark_group", "g1"][..],
            "--benchmark-group is for etcd mode",
        ),
        (&["--max-block-size", "1Q"][..], "unknown size suffix"),
        // Sizes beyond this machine are refused before anything is allocated, naming
        // the flag and the machine's memory (1T used to abort the process).
        (
            &["--max-block-size", "1T"][..],
            "--max-block-size is too large for this machine",
        ),
        (
            &["--max-block-size", "1G", "--max-batch-size", "100000"][..],
            "bytes of memory (RAM and swap)",
        ),
        (
            &["--total-buffer-size", "64T"][..],
            "--total-buffer-size is too large for this machine",
        ),
        (
            &["--num-iter", "1000000000000000"][..],
            "--num-iter 1000000000000000 is too large",
        ),
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// On a machine without an NVIDIA driver, a VRAM run fails before measuring, naming
/// the missing driver library (a run-time failure, exit 1, not a usage error).
#[test]
fn vram_without_a_gpu_names_the_driver() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        nixl_testkit::skip(
            "vram_without_a_gpu_names_the_driver",
            "this machine has an NVIDIA driver (scripts/gpu-check runs VRAM there)",
        );
        return;
    }
    let out = run_cmd(bench().env_remove("NIXL_CUDA_LIB").args([
        "--initiator-seg-type",
        "VRAM",
        "--target-seg-type",
        "VRAM",
        "--max-block-size",
        "4K",
        "--num-iter",
        "4",
        "--warmup-iter",
        "1",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("libcuda.so.1"), "{stderr}");
}

/// The bench's VRAM path end to end (the target in a child process, WRITE and READ,
/// checked byte for byte) through nixl's real CUDA calls, bound to the CUDA driver
/// **test double** (`nixl_testkit::fake_cuda`, through `NIXL_CUDA_LIB`). It proves the
/// bench and nixl drive the driver API correctly, not a GPU.
#[test]
fn vram_sweep_through_the_driver_double() {
    let lib = match nixl_testkit::fake_cuda::library() {
        Ok(l) => l,
        Err(e) => return skip("vram_sweep_through_the_driver_double", e),
    };
    let out = run_cmd(bench().env("NIXL_CUDA_LIB", &lib).args([
        "--initiator-seg-type",
        "VRAM",
        "--target-seg-type",
        "VRAM",
        "--device-id",
        "1",
        "--op-type",
        "WRITE,READ",
        "--check-consistency",
        "--start-block-size",
        "4K",
        "--max-block-size",
        "8M",
        "--num-iter",
        "8",
        "--warmup-iter",
        "1",
    ]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("initiator VRAM -> target VRAM"), "{stdout}");
    assert!(
        stdout.contains("nixl-fake-cuda"),
        "the GPU line names the driver: {stdout}"
    );
    // 4 KiB to 8 MiB is 12 points per op, each checked.
    let rows = stdout
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<u64>().is_ok())
        })
        .count();
    assert_eq!(rows, 24, "{stdout}");
}

#[cfg(feature = "etcd")]
#[test]
fn secured_etcd_flags_are_checked() {
    let etcd = [
        "--role",
        "target",
        "--etcd-endpoints",
        "https://127.0.0.1:2379",
    ];
    for (extra, needle) in [
        (&["--etcd-user", "nixl"][..], "NIXL_ETCD_PASSWORD"),
        (
            &["--etcd-ca", "/nonexistent/ca.pem"][..],
            "cannot read /nonexistent/ca.pem",
        ),
        (
            &["--etcd-cert", "c.pem", "--etcd-key", "k.pem"][..],
            "need --etcd-ca",
        ),
    ] {
        let mut args = etcd.to_vec();
        args.extend_from_slice(extra);
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
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

#[test]
fn two_hosts_mode_runs_a_sweep() {
    let target = Target::start();
    let out = ok(&with(&[
        "--role",
        "initiator",
        "--peer",
        &target.addr,
        "--check-consistency",
    ]));
    assert!(out.contains(&format!("peer at {}", target.addr)), "{out}");
    assert_eq!(table_rows(&out).len(), 5);
}

#[test]
fn killed_target_fails_the_initiator_quickly() {
    let mut target = Target::start();
    let (mut initiator, _, _) = start_long_run(&["--role", "initiator", "--peer", &target.addr]);
    target.child.kill().unwrap();
    let status = wait_within(&mut initiator, Duration::from_secs(30))
        .expect("the initiator exits within 30 s of its target dying");
    assert!(!status.success(), "{status}");
}

#[test]
fn hung_target_times_out_the_initiator() {
    let target = Target::start();
    // Over TCP a stopped target stops draining its socket, and the initiator's
    // transfer timeout must fire. The same-host path is left out on purpose: it
    // copies into the target's memory without the target's CPU (as RDMA does), so
    // a stopped target does not stall it and there is nothing to time out.
    let (mut initiator, _, _) = start_long_run(&[
        "--role",
        "initiator",
        "--peer",
        &target.addr,
        "--backend-param",
        "same_host=off",
        "--xfer-timeout",
        "2s",
        "--teardown-timeout",
        "2s",
    ]);
    let pid = target.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let status = wait_within(&mut initiator, Duration::from_secs(30));
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let status = status.expect("the initiator exits within 30 s of its target hanging");
    assert!(!status.success(), "{status}");
}

#[test]
fn dead_initiator_ends_the_target() {
    let mut target = Target::start();
    let (mut initiator, _, _) = start_long_run(&["--role", "initiator", "--peer", &target.addr]);
    initiator.kill().unwrap();
    initiator.wait().unwrap();
    let status = wait_within(&mut target.child, Duration::from_secs(30))
        .expect("the target exits within 30 s of its initiator dying");
    assert!(!status.success(), "{status}");
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

#[test]
fn killed_child_target_fails_the_local_run() {
    let (mut initiator, header, _) = start_long_run(&[]);
    let pid = child_pid(&header);
    assert!(Command::new("kill")
        .args(["-9", &pid])
        .status()
        .unwrap()
        .success());
    let status = wait_within(&mut initiator, Duration::from_secs(30))
        .expect("the run ends within 30 s of its child dying");
    assert!(!status.success(), "{status}");
    assert!(!alive(&pid), "child {pid} was not reaped");
}

/// Whether `pid` still runs: a zombie (an orphan whose new parent has not reaped it
/// yet) does not.
fn running(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
        !state.is_some_and(|s| s.starts_with('Z'))
    })
}

/// The child target needs no one to stop it: when the initiator dies without a word
/// (SIGKILL, no `done`), the child sees its control socket close and exits.
#[test]
fn killed_initiator_ends_its_child_target() {
    let (mut initiator, header, _) = start_long_run(&[]);
    let pid = child_pid(&header);
    assert!(running(&pid));
    // The private directory of the control socket went when the child connected, so
    // even a parent killed outright leaves none behind.
    let dir = format!("nixl-bench-{}-", initiator.id());
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(&dir))
        .collect();
    assert!(left.is_empty(), "control socket directories left: {left:?}");
    initiator.kill().unwrap();
    initiator.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while running(&pid) {
        assert!(
            Instant::now() < deadline,
            "child {pid} still runs 30 s after its parent died"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The child target's stdout and stderr are not the control channel: a child that
/// prints junk on both (as UCX does with `UCX_PROTO_INFO=y`) before and during the run
/// still completes a checked sweep, the junk goes to our stderr, and our stdout stays
/// the report alone.
#[test]
fn a_chatty_child_target_does_not_break_the_local_run() {
    let out = run_cmd(
        bench()
            .args(with(&["--json", "--check-consistency"]))
            .env("NIXL_BENCH_TEST_NOISE", "1"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stderr}", out.status);
    for noise in ["[noise on stdout 0]", "[noise on stderr 0]"] {
        assert!(
            stderr.contains(noise),
            "the child printed no {noise:?}: {stderr}"
        );
    }
    let v: serde_json::Value =
        serde_json::from_str(&stdout).expect("stdout is one JSON document, without the noise");
    assert_eq!(v["results"].as_array().map(Vec::len), Some(5), "{stdout}");
}

#[test]
fn ctrl_c_stops_the_run_and_reaps_the_child() {
    let (mut initiator, header, _) = start_long_run(&[]);
    let pid = child_pid(&header);
    assert!(alive(&pid));
    let me = initiator.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &me])
        .status()
        .unwrap()
        .success());
    let status = wait_within(&mut initiator, Duration::from_secs(30))
        .expect("Ctrl-C ends the run within 30 s");
    assert_eq!(status.code(), Some(130), "{status}");
    assert!(!alive(&pid), "child {pid} was not reaped");
}

use nixl_testkit::skip;

#[cfg(not(feature = "etcd"))]
#[test]
fn etcd_two_hosts() {
    skip(
        "nixl-bench etcd two-host tests",
        "built without the `etcd` feature (needs protoc; scripts/test enables it when protoc is present)",
    );
}

/// Two hosts that find each other through a real etcd: the host's `etcd` binary on free
/// loopback ports, with a temporary data directory.
#[cfg(feature = "etcd")]
mod etcd {
    use super::*;

    /// A running etcd, killed and its data removed when dropped.
    struct Etcd {
        child: Child,
        dir: PathBuf,
        endpoint: String,
    }

    use nixl_testkit::free_port;

    /// The etcd binary: `NIXL_ETCD_BIN`, else `etcd` on `PATH`.
    fn binary() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("NIXL_ETCD_BIN") {
            return Some(PathBuf::from(p));
        }
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("etcd"))
                .find(|p| p.is_file())
        })
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    impl Etcd {
        /// Start etcd and wait until it answers; `None` (after a SKIP line) when there
        /// is no etcd binary.
        fn start(case: &str) -> Option<Self> {
            let Some(bin) = binary() else {
                skip(
                    case,
                    "no etcd binary (install Debian etcd-server or set NIXL_ETCD_BIN)",
                );
                return None;
            };
            let (client_port, peer_port) = (free_port(), free_port());
            let dir = std::env::temp_dir().join(format!(
                "nixl-bench-etcd-{}-{client_port}",
                std::process::id()
            ));
            let endpoint = format!("http://127.0.0.1:{client_port}");
            let peer = format!("http://127.0.0.1:{peer_port}");
            let child = Command::new(bin)
                .arg("--name=nixl-bench-test")
                .arg(format!("--data-dir={}", dir.display()))
                .arg(format!("--listen-client-urls={endpoint}"))
                .arg(format!("--advertise-client-urls={endpoint}"))
                .arg(format!("--listen-peer-urls={peer}"))
                .arg(format!("--initial-advertise-peer-urls={peer}"))
                .arg(format!("--initial-cluster=nixl-bench-test={peer}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start etcd");
            let etcd = Self {
                child,
                dir,
                endpoint,
            };
            let ready = runtime().block_on(async {
                for _ in 0..400 {
                    if let Ok(mut c) = etcd_client::Client::connect([&etcd.endpoint], None).await {
                        if c.get("/ready", None).await.is_ok() {
                            return true;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                false
            });
            assert!(ready, "etcd did not come up on {}", etcd.endpoint);
            Some(etcd)
        }

        /// The keys under `prefix`.
        fn keys(&self, prefix: &str) -> Vec<String> {
            runtime().block_on(async {
                let mut c = etcd_client::Client::connect([&self.endpoint], None)
                    .await
                    .unwrap();
                let options = etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only();
                let got = c.get(prefix, Some(options)).await.unwrap();
                got.kvs()
                    .iter()
                    .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
                    .collect()
            })
        }
    }

    impl Drop for Etcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    impl Target {
        /// A `--role target` registered in etcd `group`; `addr` is the control address
        /// it advertised there.
        fn start_in(etcd: &Etcd, group: &str) -> Self {
            let mut child = bench()
                .args(["--role", "target", "--etcd-endpoints", &etcd.endpoint])
                .args(["--benchmark-group", group])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start the target");
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            let mut next = || lines.next().expect("a line").expect("text");
            let listening = next();
            assert!(listening.starts_with("listening on "), "{listening:?}");
            let registered = next();
            let addr = registered
                .strip_prefix(&format!("registered in etcd group {group:?} as "))
                .and_then(|rest| rest.split_whitespace().next())
                .unwrap_or_else(|| panic!("unexpected second line {registered:?}"))
                .to_owned();
            Self { child, addr }
        }
    }

    fn initiator_args<'a>(etcd: &'a Etcd, group: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = with(&["--role", "initiator", "--etcd-endpoints", &etcd.endpoint]);
        args.extend_from_slice(&["--benchmark_group", group]);
        args.extend_from_slice(extra);
        args
    }

    #[test]
    fn initiator_waits_for_its_target_and_both_clean_up() {
        let Some(etcd) = Etcd::start("etcd initiator_waits_for_its_target_and_both_clean_up")
        else {
            return;
        };
        // The initiator first: it waits in etcd for a target to join its group.
        let args: Vec<String> = initiator_args(&etcd, "g1", &["--check-consistency"])
            .into_iter()
            .map(str::to_owned)
            .collect();
        let initiator = std::thread::spawn(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&args)
        });
        std::thread::sleep(Duration::from_millis(500));
        let mut target = Target::start_in(&etcd, "g1");
        let out = initiator.join().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "initiator: {}\n{stderr}", out.status);
        let stdout = String::from_utf8(out.stdout).unwrap();
        for col in COLUMNS {
            assert!(stdout.contains(col), "column {col:?} missing:\n{stdout}");
        }
        assert!(
            stdout.contains(&format!(
                "peer at {}, found in etcd group \"g1\"",
                target.addr
            )),
            "{stdout}"
        );
        let rows = table_rows(&stdout);
        let blocks: Vec<f64> = rows.iter().map(|r| r[0]).collect();
        assert_eq!(
            blocks,
            [4096.0, 8192.0, 16384.0, 32768.0, 65536.0],
            "{stdout}"
        );
        for r in &rows {
            assert_eq!(r.len(), 13, "{r:?}");
            assert!(r[2] > 0.0 && r[8] > 0.0, "{r:?}");
        }
        let status = wait_within(&mut target.child, Duration::from_secs(30))
            .expect("the target exits after its run");
        assert!(status.success(), "target: {status}");
        // The target's lease went with it: the group is free for the next target.
        assert_eq!(etcd.keys("/nixl-bench/g1/"), Vec::<String>::new());
    }

    /// Without `--role`, two processes started together in one group sort themselves
    /// out: one is the target, the other the initiator, and the sweep runs.
    #[test]
    fn two_processes_without_a_role_pair_up() {
        let Some(etcd) = Etcd::start("etcd two_processes_without_a_role_pair_up") else {
            return;
        };
        let spawn = || {
            let args: Vec<String> = with(&[
                "--etcd-endpoints",
                &etcd.endpoint,
                "--benchmark-group",
                "auto",
            ])
            .into_iter()
            .map(str::to_owned)
            .collect();
            std::thread::spawn(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                run(&args)
            })
        };
        let (p1, p2) = (spawn(), spawn());
        let outs = [p1.join().unwrap(), p2.join().unwrap()];
        let mut roles = Vec::new();
        for out in &outs {
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
            if stderr.contains("this one is the initiator")
                || stderr.contains("this process is the initiator")
            {
                assert_eq!(table_rows(&stdout).len(), 5, "{stdout}");
                roles.push("initiator");
            } else {
                assert!(stderr.contains("this process is the target"), "{stderr}");
                assert!(
                    stdout.contains("registered in etcd group \"auto\""),
                    "{stdout}"
                );
                roles.push("target");
            }
        }
        roles.sort();
        assert_eq!(roles, ["initiator", "target"]);
        assert_eq!(etcd.keys("/nixl-bench/auto/"), Vec::<String>::new());
    }

    #[test]
    fn initiator_without_a_target_fails_within_its_bound() {
        let Some(etcd) = Etcd::start("etcd initiator_without_a_target_fails_within_its_bound")
        else {
            return;
        };
        let t0 = Instant::now();
        let out = run(&initiator_args(
            &etcd,
            "nobody-here",
            &["--connect-timeout", "2s", "--exchange-timeout", "2s"],
        ));
        let took = t0.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("no target registered in etcd group \"nobody-here\" within 2s"),
            "{stderr}"
        );
        assert!(took < Duration::from_secs(15), "took {took:?}");
    }

    #[test]
    fn a_group_has_one_target_at_a_time() {
        let Some(etcd) = Etcd::start("etcd a_group_has_one_target_at_a_time") else {
            return;
        };
        let mut first = Target::start_in(&etcd, "g2");
        let out = run(&[
            "--role",
            "target",
            "--etcd-endpoints",
            &etcd.endpoint,
            "--benchmark-group",
            "g2",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "benchmark group \"g2\" already has a target (control address {})",
                first.addr
            )),
            "{stderr}"
        );
        // The first target still serves its group.
        let stdout = ok(&initiator_args(&etcd, "g2", &[]));
        assert!(
            stdout.contains(&format!("peer at {}", first.addr)),
            "{stdout}"
        );
        assert_eq!(table_rows(&stdout).len(), 5);
        let status = wait_within(&mut first.child, Duration::from_secs(30))
            .expect("the target exits after its run");
        assert!(status.success(), "target: {status}");
    }
}

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

#[cfg(feature = "prometheus")]
#[test]
fn metrics_addr_serves_counters_during_the_run() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let (mut child, _, _rx) = start_long_run(&["--metrics-addr", &addr]);
    let labels = ["agent=\"initiator\"", "op=\"write\"", "backend=\"tcp\""];
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < 2 && Instant::now() < deadline {
        let body = scrape(&addr).expect("the bench serves metrics while it runs");
        if let (Some(done), Some(bytes)) = (
            series(&body, "nixl_transfers_completed_total{", &labels),
            series(&body, "nixl_transfer_bytes_total{", &labels),
        ) {
            // Blocks are powers of two from 4 KiB. (The two series are not read at one
            // instant, so they are not compared with each other.)
            assert!(
                bytes > 0.0 && bytes % 4096.0 == 0.0,
                "{bytes} bytes for {done} transfers"
            );
            if seen.last().is_none_or(|&d| d < done) {
                seen.push(done);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        seen.len() >= 2,
        "completed transfers grew between scrapes: {seen:?}"
    );
}

#[cfg(feature = "prometheus")]
#[test]
fn metrics_addr_in_use_is_an_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run(&with(&["--metrics-addr", &addr]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("serve metrics on"), "{stderr}");
}

/// `--peer-kind nixl` against a real NIXL agent (the `nixl-cu12` wheel's Python API in
/// a child process, `tests/nixl_peer.py`), with nixl-ucx bound to the wheel's libucp.
#[cfg(feature = "ucx")]
#[test]
fn targets_a_real_nixl_agent() {
    use std::io::Write;
    let case = "targets_a_real_nixl_agent";
    let Some((wheel, libucp)) = nixl_testkit::nixl_wheel(case) else {
        return;
    };
    let port = nixl_testkit::free_port();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/nixl_peer.py");
    let mut nixl = Command::new("python3")
        .arg(script)
        .args([
            "nixl-target",
            &(4 << 20 | 4096).to_string(),
            &port.to_string(),
        ])
        .env("PYTHONPATH", &wheel)
        .env("UCX_NET_DEVICES", "lo")
        .env("UCX_MODULES", "^ib")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut lines = BufReader::new(nixl.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("the NIXL agent starts").unwrap();
        if line.starts_with("@@ OK ready") {
            break;
        }
    }
    let peer = format!("127.0.0.1:{port}");
    let out = bench()
        .args([
            "--role",
            "initiator",
            "--peer-kind",
            "nixl",
            "--peer",
            &peer,
            "--backend",
            "ucx",
            "--op-type",
            "READ,WRITE",
            "--start-block-size",
            "4K",
            "--max-block-size",
            "1M",
            "--total-buffer-size",
            "4M",
            "--num-iter",
            "20",
            "--warmup-iter",
            "2",
        ])
        .env("NIXL_UCX_LIB", &libucp)
        .env("UCX_NET_DEVICES", "lo")
        .env("UCX_MODULES", "^ib")
        .output()
        .expect("nixl-bench runs");
    let _ = writeln!(nixl.stdin.as_mut().unwrap(), "EXIT");
    let _ = wait_within(&mut nixl, Duration::from_secs(10));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("NIXL agent \"nixl-target\""), "{stdout}");
    let rows = table_rows(&stdout);
    assert_eq!(rows.len(), 2 * 9, "4K to 1M, READ and WRITE: {stdout}");
    assert!(
        rows.iter().all(|r| r[2] > 0.0),
        "bandwidth measured: {stdout}"
    );
}

/// rdma-core comes from the host at run time: the bench (built with nixl-verbs by
/// default) has no `DT_NEEDED` entry for libibverbs, librdmacm or a provider, and no
/// `ibv_*` symbol in its dynamic table; where no RDMA device exists, `--backend
/// verbs` says so instead of failing to start.
#[test]
fn verbs_is_loaded_at_run_time_and_explains_a_missing_device() {
    let l = nixl_testkit::elf::linkage(std::path::Path::new(BIN));
    assert!(
        l.needed_matching(&[
            "libibverbs",
            "librdmacm",
            "libmlx",
            "libefa",
            "libbnxt",
            "liberdma",
            "libirdma"
        ])
        .is_empty(),
        "{BIN} links {:?}",
        l.needed
    );
    assert_eq!(
        l.symbols_matching(&["ibv_", "_ibv_", "rdma_", "mlx5dv_"]),
        Vec::<&str>::new()
    );
    let out = bench()
        .args([
            "--backend",
            "verbs",
            "--max-block-size",
            "64K",
            "--num-iter",
            "8",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // A host with an RDMA device (or soft-RoCE): the run itself is the check.
        return;
    }
    assert!(
        err.contains("backend verbs is unavailable")
            && (err.contains("no RDMA device") || err.contains("libibverbs.so.1")),
        "{err}"
    );
}
