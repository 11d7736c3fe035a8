//! Liveness probing: a peer gone without UCX noticing fails its transfers within
//! [`UcxOptions::dead_peer_timeout`], and a live peer busy with a long transfer is not
//! failed by it.
//!
//! Needs libucp at run time; without it each test prints a SKIP line. With Debian's
//! UCX 1.13 and shared memory, export `UCX_POSIX_ERROR_HANDLING=y
//! UCX_SYSV_ERROR_HANDLING=y` (without them the endpoints run without peer-failure
//! handling, and probing still bounds the wait).

use std::time::{Duration, Instant};

use nixl::{Agent, ErrorKind, Op, RequestOptions};
use nixl_testkit::double::one;
use nixl_ucx::UcxOptions;

mod common;

fn options(liveness: Duration, tls: Option<&str>) -> UcxOptions {
    let mut o = UcxOptions {
        dead_peer_timeout: Some(liveness),
        ..UcxOptions::default()
    };
    if let Some(t) = tls {
        o.ucx_config.push(("TLS".into(), t.into()));
    }
    o
}

async fn agent(test: &str, name: &str, o: &UcxOptions) -> Option<Agent> {
    common::agent(test, name, o.clone()).await.map(|(a, _)| a)
}

/// The torture's hang, made deterministic: the peer's worker is destroyed (its agent
/// dropped, never shut down, in this live process) after its metadata went out. With
/// RMA over shared-memory active messages (`sysv,self`), every transfer needs the
/// peer; UCX never fails the endpoint (its keepalive checks the peer's process, which
/// lives). The probes must fail the transfers within the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_peer_fails_within_liveness_bound() {
    const TEST: &str = "dead_peer_fails_within_liveness_bound";
    let bound = Duration::from_secs(1);
    if std::env::var_os("UCX_SYSV_ERROR_HANDLING").is_none() {
        // UCX reads this setting from the environment only (ucp_config_modify does not
        // reach memory-domain settings), so the backend cannot set it for you.
        return common::skip(
            TEST,
            "needs UCX_SYSV_ERROR_HANDLING=y in the environment (scripts/test sets it): without it UCX's sysv transport keeps the dead peer's endpoint usable and the transfers wait past the bound",
        );
    }
    let o = options(bound, Some("sysv,self"));
    let Some(a) = agent(TEST, "a", &o).await else {
        return;
    };
    let src = a.register(vec![7u8; 1 << 20]).unwrap();
    let mut keep = Vec::new();
    for wait_ms in [0, 50] {
        let b = agent(TEST, "b", &o).await.unwrap();
        let monitor = b.task_monitor();
        // Kept alive: a one-sided write may land in it until the peer is known gone.
        let dst = b.register(vec![0u8; 1 << 20]).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        let rd = a.remote_regions("b").unwrap().remove(0);
        keep.push(dst);
        // Prepared while the peer lives (keys unpacked on the connection).
        let write = a
            .create_request(
                Op::Write,
                &one(src.whole()),
                "b",
                &one(rd.desc(0, rd.len)),
                &RequestOptions::default(),
            )
            .unwrap();
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        drop(b);
        tokio::time::timeout(Duration::from_secs(10), monitor.wait())
            .await
            .expect("the dropped peer's tasks end");
        let t0 = Instant::now();
        let ts = [
            write.post(None),
            a.transfer(
                Op::Read,
                &one(src.whole()),
                "b",
                &one(rd.desc(0, rd.len)),
                None,
            ),
            a.notify("b", &b"x"[..]),
        ];
        for t in ts {
            let e = match t {
                Ok(t) => tokio::time::timeout(Duration::from_secs(10), t)
                    .await
                    .expect("resolves (no hang)")
                    .expect_err("the peer is gone"),
                Err(e) => e,
            };
            assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
        }
        let took = t0.elapsed();
        // The bound, plus the driver's tick and scheduling slack on a busy machine.
        assert!(
            took < bound + Duration::from_secs(2),
            "dead peer noticed after {took:?} (bound {bound:?})"
        );
        a.forget_peer("b").unwrap();
    }
    assert_eq!(a.shutdown().await.tasks_left, 0);
    drop(keep);
}

/// A live peer, busy with one long transfer each way, with a tight bound: nothing
/// fails. The pieces of a transfer finishing show the peer alive; a PING, where one
/// goes out, is answered on the connection or on the separate endpoint. (Over TCP a
/// PONG can wait behind the rest of a 512 MiB READ for longer than the bound, so
/// progress within the transfer is what keeps it alive there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_peer_long_transfer_not_failed() {
    const TEST: &str = "live_peer_long_transfer_not_failed";
    // Probed after 120 ms of no progress, 240 ms per answer: each transfer below takes
    // longer than that on shared memory and TCP alike.
    let o = options(Duration::from_millis(600), None);
    let Some(a) = agent(TEST, "a", &o).await else {
        return;
    };
    let b = agent(TEST, "b", &o).await.unwrap();
    let len = 512usize << 20;
    let src = a.register(vec![3u8; len]).unwrap();
    let dst = b.register(vec![0u8; len]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    b.load_metadata(&a.metadata().unwrap()).unwrap();
    let rd = a.remote_regions("b").unwrap().remove(0);
    for op in [Op::Write, Op::Read, Op::Write] {
        let t0 = Instant::now();
        a.transfer(op, &one(src.whole()), "b", &one(rd.desc(0, rd.len)), None)
            .unwrap()
            .await
            .unwrap_or_else(|e| panic!("{op} of {len} bytes to a live peer: {e}"));
        println!("{op} of {len} bytes: {:?}", t0.elapsed());
    }
    let mut head = [0u8; 16];
    dst.read_at(len - 16, &mut head).unwrap();
    assert_eq!(head, [3u8; 16]);
    assert_eq!(a.shutdown().await.tasks_left, 0);
    assert_eq!(b.shutdown().await.tasks_left, 0);
}
