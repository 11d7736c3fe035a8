//! The direct side channel: fetch/send/invalidate, authentication, bad frames,
//! concurrency, and teardown of the listener.

use std::net::SocketAddr;
use std::time::Duration;

use nixl::{ErrorKind, SharedSecret, SideChannelOptions};
use nixl_conformance::support::tcp_agent as agent;
use nixl_conformance::support::{bounded, one, pattern};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn opts(secret: Option<&str>) -> SideChannelOptions {
    SideChannelOptions {
        secret: secret.map(|s| SharedSecret::new(s).unwrap()),
        timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_send_invalidate_then_transfer() {
    let a = agent("a").await;
    let b = agent("b").await;
    let dst = b.register(vec![0u8; 4096]).unwrap();
    let extra = b.register(vec![0u8; 128]).unwrap();
    // Without a secret, only a server that accepts peer updates forgets a known peer
    // for a client (see tests/tests/hostile/identity.rs for the refusals).
    let served = SideChannelOptions {
        accept_peer_updates: true,
        ..opts(None)
    };
    let addr = b.listen(loopback(), &served).await.unwrap();
    assert_eq!(
        bounded("fetch", a.fetch_metadata(addr, &opts(None)))
            .await
            .unwrap(),
        "b"
    );
    let rd = a
        .remote_regions("b")
        .unwrap()
        .into_iter()
        .find(|r| r.id == dst.id())
        .unwrap();
    let src = a.register(pattern(1, 4096)).unwrap();
    a.write(&one(src.whole()), "b", &one(rd.desc(0, 4096)), None)
        .await
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());

    // Labelled partial metadata.
    let late = b.register(vec![0u8; 64]).unwrap();
    b.publish_partial("late", std::slice::from_ref(&late), false)
        .unwrap();
    assert_eq!(
        a.fetch_partial_metadata(addr, "late", &opts(None))
            .await
            .unwrap(),
        "b"
    );
    assert!(a
        .remote_regions("b")
        .unwrap()
        .iter()
        .any(|r| r.id == late.id()));
    let e = a
        .fetch_partial_metadata(addr, "nope", &opts(None))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_eq!(
        b.publish_partial("full", &[extra], false)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );

    // Send: b learns a; invalidate: b forgets a.
    a.send_metadata(addr, &opts(None)).await.unwrap();
    assert_eq!(b.peers(), vec!["a".to_string()]);
    a.invalidate_at(addr, &opts(None)).await.unwrap();
    assert!(b.peers().is_empty());
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_listener() {
    let a = agent("a").await;
    let b = agent("b").await;
    let addr = match b.listen("[::1]:0".parse().unwrap(), &opts(None)).await {
        Ok(a) => a,
        Err(e) => {
            nixl_conformance::support::skip(
                "ipv6_listener",
                &format!("no IPv6 loopback here: {e}"),
            );
            return;
        }
    };
    assert!(addr.is_ipv6());
    assert_eq!(a.fetch_metadata(addr, &opts(None)).await.unwrap(), "b");
    let _ = b.shutdown().await;
    let _ = a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_required_and_checked() {
    let a = agent("a").await;
    let b = agent("b").await;
    b.register(vec![0u8; 64]).unwrap();
    let addr = b
        .listen(loopback(), &opts(Some("s3cret-s3cret")))
        .await
        .unwrap();
    for (client, why) in [(None, "missing secret"), (Some("wrong"), "wrong secret")] {
        let e = bounded(why, a.fetch_metadata(addr, &opts(client)))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{why}: {e}");
        let e = bounded(why, a.send_metadata(addr, &opts(client)))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{why}: {e}");
    }
    assert!(a.peers().is_empty(), "nothing was served");
    nixl_conformance::support::figure(
        "side channel: clients without the secret",
        "4 tried (fetch and send, missing and wrong secret), 4 refused, nothing served or loaded",
    );
    assert!(b.peers().is_empty(), "nothing was loaded");
    // The right secret works, both ways.
    assert_eq!(
        a.fetch_metadata(addr, &opts(Some("s3cret-s3cret")))
            .await
            .unwrap(),
        "b"
    );
    a.send_metadata(addr, &opts(Some("s3cret-s3cret")))
        .await
        .unwrap();
    assert_eq!(b.peers(), vec!["a".to_string()]);
    // A client with a secret refuses a server without one.
    let c = agent("c").await;
    let open = c.listen(loopback(), &opts(None)).await.unwrap();
    let e = a
        .fetch_metadata(open, &opts(Some("s3cret-s3cret")))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    // The secret never appears in Debug output.
    assert!(!format!("{:?}", opts(Some("s3cret-s3cret"))).contains("s3cret"));
    for x in [a, b, c] {
        let _ = x.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_fetches() {
    let b = agent("b").await;
    b.register(vec![0u8; 64]).unwrap();
    let addr = b.listen(loopback(), &opts(Some("k"))).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..100 {
        tasks.push(tokio::spawn(async move {
            let a = agent(&format!("a{i}")).await;
            let name = a.fetch_metadata(addr, &opts(Some("k"))).await;
            let _ = a.shutdown().await;
            name
        }));
    }
    for t in tasks {
        assert_eq!(bounded("fetch", t).await.unwrap().unwrap(), "b");
    }
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_close_only_their_connection() {
    let a = agent("a").await;
    let b = agent("b").await;
    let addr = b
        .listen(
            loopback(),
            &SideChannelOptions {
                max_frame: 1 << 20,
                ..opts(None)
            },
        )
        .await
        .unwrap();
    // Oversized frame: header claims 1 GiB.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server's hello: a 12-byte header, then flags and its name.
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.unwrap();
    let mut hello = vec![0u8; u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize];
    s.read_exact(&mut hello).await.unwrap();
    assert_eq!(hello, b"\x00b", "no secret; agent b");
    let mut h = b"NXSC\x02\x04\x00\x00".to_vec();
    h.extend_from_slice(&(1u32 << 30).to_le_bytes());
    s.write_all(&h).await.unwrap();
    let mut rest = Vec::new();
    bounded("server closes", s.read_to_end(&mut rest))
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&rest).contains("exceeds"),
        "error frame names the reason"
    );
    // Truncated frame, then close.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"NXSC\x02").await.unwrap();
    drop(s);
    // Garbage.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&[0xFF; 64]).await.unwrap();
    drop(s);
    // Still serving.
    assert_eq!(
        bounded("fetch", a.fetch_metadata(addr, &opts(None)))
            .await
            .unwrap(),
        "b"
    );
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_server_times_out() {
    let a = agent("a").await;
    let silent = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let addr = silent.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let (s, _) = silent.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(s);
    });
    let o = SideChannelOptions {
        timeout: Duration::from_millis(300),
        ..opts(None)
    };
    let e = bounded("fetch from silent server", a.fetch_metadata(addr, &o))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    hold.abort();
    let _ = a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_joined_after_shutdown_and_drop() {
    // Shutdown.
    let b = agent("b").await;
    let addr = b.listen(loopback(), &opts(None)).await.unwrap();
    let monitor = b.task_monitor();
    let report = b.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
    assert!(monitor.is_empty());
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "port closed after shutdown"
    );
    // Drop, with a connection open.
    let c = agent("c").await;
    let addr = c.listen(loopback(), &opts(None)).await.unwrap();
    let _open = tokio::net::TcpStream::connect(addr).await.unwrap();
    let monitor = c.task_monitor();
    assert!(!monitor.is_empty());
    drop(c);
    bounded("listener tasks end after drop", monitor.wait()).await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "port closed after drop"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random bytes (sometimes behind a valid frame header) never take the listener down.
    #[test]
    fn fuzzed_frames_never_crash_listener(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..200), 1..6),
        valid_prefix in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let a = agent("a").await;
            let b = agent("b").await;
            let addr = b.listen(loopback(), &opts(None)).await.unwrap();
            for c in &chunks {
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                if valid_prefix {
                    let mut h = b"NXSC\x01".to_vec();
                    h.push(c.first().copied().unwrap_or(4) % 10);
                    h.extend_from_slice(&[0, 0]);
                    h.extend_from_slice(&(c.len() as u32).to_le_bytes());
                    let _ = s.write_all(&h).await;
                }
                let _ = s.write_all(c).await;
                let _ = s.shutdown().await;
            }
            let name = bounded("fetch after fuzz", a.fetch_metadata(addr, &opts(None))).await.unwrap();
            assert_eq!(name, "b");
            let _ = a.shutdown().await;
            let _ = b.shutdown().await;
        });
    }
}
