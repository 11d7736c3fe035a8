//! Agents in two processes over nixl-tcp: transfers, and a target killed mid-transfer.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use nixl::{Agent, ErrorKind, Op};
use nixl_conformance::support::{bounded, checksum_bytes, one, pattern, remote, unhex};

struct Peer {
    child: Child,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl Peer {
    fn spawn(size: usize) -> (Self, Vec<u8>) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nixl-peer"))
            .arg(size.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn nixl-peer");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("peer printed metadata").unwrap();
        let md =
            unhex(first.strip_prefix("METADATA ").expect("METADATA line")).expect("hex metadata");
        (Self { child, lines }, md)
    }

    fn line(&mut self, prefix: &str) -> String {
        loop {
            let l = self.lines.next().expect("peer output").unwrap();
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn initiator() -> Agent {
    Agent::builder("initiator")
        .backend(nixl_tcp::TcpBackend::with_options(
            nixl_conformance::support::tcp_options_from_env(),
        ))
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_write_read_notify() {
    const SIZE: usize = 16 << 20;
    let (mut peer, md) = tokio::task::spawn_blocking(|| Peer::spawn(SIZE))
        .await
        .unwrap();
    let a = initiator().await;
    assert_eq!(a.load_metadata(&md).unwrap(), "target");
    let src = a.register(pattern(42, SIZE)).unwrap();
    let back = a.register(vec![0u8; SIZE]).unwrap();
    let rd = a.remote_regions("target").unwrap()[0].clone();
    bounded(
        "write",
        a.write(
            &one(src.whole()),
            "target",
            &one(rd.desc(0, SIZE as u64)),
            Some(Bytes::from_static(b"written")),
        ),
    )
    .await
    .unwrap();
    bounded(
        "read",
        a.read(
            &one(back.whole()),
            "target",
            &one(rd.desc(0, SIZE as u64)),
            None,
        ),
    )
    .await
    .unwrap();
    assert!(
        back.to_vec().unwrap() == src.to_vec().unwrap(),
        "read back what was written"
    );
    bounded("notify", a.notify("target", "done").unwrap())
        .await
        .unwrap();
    let expect = checksum_bytes(&src.to_vec().unwrap());
    let (notif, sum, status) = tokio::task::spawn_blocking(move || {
        let n = peer.line("NOTIF ");
        let s = peer.line("CHECKSUM ");
        let st = peer.child.wait().unwrap();
        (n, s, st)
    })
    .await
    .unwrap();
    assert_eq!(notif, "written");
    assert_eq!(
        sum.parse::<u64>().unwrap(),
        expect,
        "target process holds the written bytes"
    );
    assert!(status.success());
    assert!(a.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_target_fails_in_flight_and_initiator_keeps_serving() {
    const SIZE: usize = 64 << 20;
    let (mut peer, md) = tokio::task::spawn_blocking(|| Peer::spawn(SIZE))
        .await
        .unwrap();
    let a = initiator().await;
    a.load_metadata(&md).unwrap();
    // A second, healthy peer in this process.
    let c = Agent::builder("other")
        .backend(nixl_tcp::TcpBackend::with_options(
            nixl_conformance::support::tcp_options_from_env(),
        ))
        .build()
        .await
        .unwrap();
    let dc = c.register(vec![0u8; 1 << 20]).unwrap();
    a.load_metadata(&c.metadata().unwrap()).unwrap();
    let src = a.register(vec![7u8; SIZE]).unwrap();
    let rd = a.remote_regions("target").unwrap()[0].clone();
    bounded(
        "warm-up",
        a.write(
            &one(src.desc(0, 4096)),
            "target",
            &one(rd.desc(0, 4096)),
            None,
        ),
    )
    .await
    .unwrap();
    let transfers: Vec<_> = (0..8)
        .map(|_| {
            a.transfer(
                Op::Write,
                &one(src.whole()),
                "target",
                &one(rd.desc(0, SIZE as u64)),
                None,
            )
            .unwrap()
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    peer.child.kill().expect("SIGKILL the target");
    let t0 = std::time::Instant::now();
    let mut failed = 0;
    for t in transfers {
        if let Err(e) = bounded("in-flight transfer to a killed peer", t).await {
            assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
            failed += 1;
        }
    }
    println!(
        "{failed} of 8 in-flight transfers failed with RemoteDisconnected {:?} after SIGKILL",
        t0.elapsed()
    );
    nixl_conformance::support::figure(
        "target SIGKILLed mid-transfer",
        format!("{failed} of 8 in-flight transfers failed with RemoteDisconnected within {:?}; initiator kept serving", t0.elapsed()),
    );
    assert!(
        failed > 0,
        "8 x 64 MiB cannot all have finished within 20 ms"
    );
    // The initiator keeps serving the healthy peer.
    let rc = remote(&a, "other", dc.id());
    bounded(
        "write to healthy peer",
        a.write(
            &one(src.desc(0, 1 << 20)),
            "other",
            &one(rc.desc(0, 1 << 20)),
            None,
        ),
    )
    .await
    .unwrap();
    assert_eq!(dc.to_vec().unwrap(), vec![7u8; 1 << 20]);
    assert!(a.shutdown().await.is_clean());
    assert!(c.shutdown().await.is_clean());
}

/// Across a real permission boundary: an initiator running as another, unprivileged
/// user may not open this (root) process's descriptors, so the same-host path cannot
/// be set up; the target does not even offer it (its pid and grant table are for
/// peers of its own user only). With `auto` it falls back to TCP and says why; with
/// `require` every transfer fails with the reason instead. Needs root (to start the other user's
/// process); skips visibly otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprivileged_initiator_falls_back_to_tcp_or_is_refused() {
    use std::io::Write as _;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    const CASE: &str = "unprivileged_initiator_falls_back_to_tcp_or_is_refused";
    if std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(1)
        != 0
    {
        nixl_conformance::support::skip(CASE, "needs root to start a process as another user");
        return;
    }
    let b = Agent::builder("target")
        .backend(nixl_tcp::TcpBackend::new())
        .build()
        .await
        .unwrap();
    let dst = b.register(vec![0u8; 4 << 20]).unwrap();
    let md = nixl_conformance::support::hex(&b.metadata().unwrap());
    for mode in ["auto", "require"] {
        let spawned = Command::new(env!("CARGO_BIN_EXE_nixl-fault-initiator"))
            .env("NIXL_TCP_SAME_HOST", mode)
            .uid(65534)
            .gid(65534)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            // A checkout under a directory only root may enter (/root, say).
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                nixl_conformance::support::skip(
                    CASE,
                    &format!("user 65534 cannot execute the test binary here ({e})"),
                );
                return;
            }
            Err(e) => panic!("spawn the initiator as nobody: {e}"),
        };
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{md}").unwrap();
        let out = child.stdout.take().unwrap();
        let (path, first) = tokio::task::spawn_blocking(move || {
            let mut lines = BufReader::new(out).lines().map_while(Result::ok);
            let path = lines.find_map(|l| l.strip_prefix("PATH ").map(str::to_owned));
            (path, lines.next())
        })
        .await
        .unwrap();
        // The child may be gone already: it exits at its next line once nobody
        // reads its output (the reader above is dropped).
        let _ = writeln!(stdin, "stop");
        drop(stdin);
        let _ = child.wait();
        let path = path.expect("the initiator reported its data path");
        let first = first.expect("a transfer outcome");
        println!("{mode}: {path}; {first}");
        match mode {
            "auto" => {
                assert!(
                    path.starts_with("TCP") && path.contains("the target does not offer it"),
                    "{path}"
                );
                assert!(first.starts_with("OK"), "{first}");
            }
            _ => assert!(
                first.starts_with("ERR NotSupported") && first.contains("required"),
                "{first}"
            ),
        }
    }
    assert_eq!(
        dst.to_vec().unwrap(),
        vec![0x3Cu8; 4 << 20],
        "the TCP fallback wrote"
    );
    let _ = b.shutdown().await;
}
