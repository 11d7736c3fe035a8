//! A peer's address outlives the peer: once an agent is gone, its port can be taken
//! by a restarted agent (same name, new registrations) or by any other agent. A peer
//! that still holds the old metadata must find the old agent gone, as a closed port
//! would say, and never deliver a WRITE or a notification to whoever listens there
//! now, nor wait on it.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::StreamExt;
use nixl::{Agent, DescList, ErrorKind, MemKind};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};

async fn agent(name: &str, listen: SocketAddr, same_host: SameHost) -> (Agent, SocketAddr) {
    let b = TcpBackend::with_options(TcpOptions {
        listener: nixl::control::ListenerOptions {
            listen: Some(listen),
            ..nixl::control::ListenerOptions::default()
        },
        same_host,
        ..TcpOptions::default()
    });
    let a = Agent::builder(name)
        .backend(b.clone())
        .build()
        .await
        .unwrap();
    let addr = b.local_addr().expect("listening");
    (a, addr)
}

/// Within this bound, or the test fails (as a hang would).
async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for 20 s"))
}

async fn stale_metadata_reaches_nobody(
    same_host: SameHost,
    connected_first: bool,
    same_name: bool,
) {
    let case =
        format!("same_host={same_host:?} connected_first={connected_first} same_name={same_name}");
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let (a, _) = agent("a", loopback, same_host).await;
    let src = a.register(vec![7u8; 4096]).unwrap();
    let (b, addr) = agent("b", loopback, same_host).await;
    let b_mem = b.register(vec![0u8; 4096]).unwrap();
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    let far = a.remote_regions(&peer).unwrap()[0].clone();
    let local = DescList::from_descs(MemKind::Dram, [src.desc(0, 4096)]);
    let remote = DescList::from_descs(MemKind::Dram, [far.desc(0, 4096)]);
    if connected_first {
        a.write(&local, &peer, &remote, None).await.unwrap();
        assert_eq!(b_mem.to_vec().unwrap(), vec![7u8; 4096], "{case}");
    }
    drop(b_mem);
    let _ = b.shutdown().await;
    drop(b);

    // Another agent takes the address, with memory where b's was.
    let (c, c_addr) = agent(if same_name { "b" } else { "c" }, addr, same_host).await;
    assert_eq!(c_addr, addr);
    let c_mem = c.register(vec![0u8; 4096]).unwrap();
    let mut c_notes = c.notifications().unwrap();

    // Connections made to b before it went may still be taken for live (the TCP
    // one, the same-host one): a request can fail on them first, b having closed
    // them. Then the address is dialled again and the listener check answers.
    for what in ["WRITE", "notification"] {
        let mut tries = 0;
        loop {
            tries += 1;
            let r = bounded(&format!("{what} with stale metadata"), async {
                match what {
                    "WRITE" => a.write(&local, &peer, &remote, Some("w".into())).await,
                    _ => a.notify(&peer, &b"x"[..])?.await,
                }
            })
            .await;
            let e = r.expect_err("no agent b listens there now");
            assert_eq!(
                e.kind(),
                ErrorKind::RemoteDisconnected,
                "{case}: {what}: {e}"
            );
            if e.to_string().contains("another agent listens") {
                break;
            }
            assert!(
                connected_first && tries < 3,
                "{case}: {what} try {tries}: {e}"
            );
        }
    }

    // Nothing reached the new agent.
    assert_eq!(c_mem.to_vec().unwrap(), vec![0u8; 4096], "{case}");
    let got = tokio::time::timeout(Duration::from_millis(200), c_notes.next()).await;
    assert!(got.is_err(), "{case}: the new agent got {got:?}");

    // With its current metadata, the new agent is reached.
    a.forget_peer(&peer).unwrap();
    let peer = a.load_metadata(&c.metadata().unwrap()).unwrap();
    let far = a.remote_regions(&peer).unwrap()[0].clone();
    let remote = DescList::from_descs(MemKind::Dram, [far.desc(0, 4096)]);
    bounded(
        "WRITE with current metadata",
        a.write(&local, &peer, &remote, None),
    )
    .await
    .unwrap();
    assert_eq!(c_mem.to_vec().unwrap(), vec![7u8; 4096], "{case}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_address_is_not_the_peer() {
    for same_host in [SameHost::Off, SameHost::Auto] {
        for connected_first in [false, true] {
            for same_name in [false, true] {
                stale_metadata_reaches_nobody(same_host, connected_first, same_name).await;
            }
        }
    }
}

/// The agent now at the address wants a secret this peer does not have: still
/// "another agent", not "a secret is required".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_address_with_a_secret_is_not_the_peer() {
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let (a, _) = agent("a", loopback, SameHost::Off).await;
    let (b, addr) = agent("b", loopback, SameHost::Off).await;
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    let _ = b.shutdown().await;
    drop(b);
    let c = Agent::builder("c")
        .backend(TcpBackend::with_options(TcpOptions {
            listener: nixl::control::ListenerOptions {
                listen: Some(addr),
                secret: Some(nixl::SharedSecret::new("s3cret-s3cret-s3cret").unwrap()),
                ..nixl::control::ListenerOptions::default()
            },
            same_host: SameHost::Off,
            ..TcpOptions::default()
        }))
        .build()
        .await
        .unwrap();
    let e = bounded("notification with stale metadata", async {
        a.notify(&peer, &b"x"[..])?.await
    })
    .await
    .expect_err("no agent b listens there now");
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    assert!(e.to_string().contains("another agent listens"), "{e}");
    drop(c);
}
