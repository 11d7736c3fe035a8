//! Interrupts, two hosts through etcd, the metrics endpoint, a real NIXL agent as
//! target, and the verbs backend loaded at run time.

use super::*;

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
