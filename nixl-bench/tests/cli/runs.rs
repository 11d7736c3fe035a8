//! One bench run: its table, JSON, CSV and plot, consistency checks, usage errors,
//! GPU memory through the driver double, and the two processes of a run failing.

use super::*;

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
