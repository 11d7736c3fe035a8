//! Metadata under another peer's name: an unauthenticated side-channel client can
//! neither move a known peer to its own connection info nor make the agent forget it;
//! a real restart is accepted where it is vouched for (the server opted in, a shared
//! secret, the application's own fetch); metadata fetched by name (side channel,
//! full or partial, etcd fetch and watch) must carry that name.

use std::net::SocketAddr;
use std::time::Duration;

use nixl::{Agent, ErrorKind, Registration, SharedSecret, SideChannelOptions};
use nixl_conformance::support::{bounded, one, pattern, remote, tcp_agent};

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn opts() -> SideChannelOptions {
    SideChannelOptions {
        timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

fn with_secret() -> SideChannelOptions {
    SideChannelOptions {
        secret: Some(SharedSecret::new("identity-test-secret").unwrap()),
        ..opts()
    }
}

const LEN: usize = 4096;

/// `a` serves a side channel with `served` and knows `b` (loaded in-band); `b` has
/// a `LEN`-byte region.
async fn known_pair(served: &SideChannelOptions) -> (Agent, SocketAddr, Agent, Registration) {
    let a = tcp_agent("a").await;
    let b = tcp_agent("b").await;
    let dst = b.register(vec![0u8; LEN]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let addr = a.listen(loopback(), served).await.unwrap();
    (a, addr, b, dst)
}

/// Write a pattern from `a` into `peer`'s region `dst` and check it landed there.
async fn write_lands(a: &Agent, peer: &str, dst: &Registration, seed: u64) {
    let src = a.register(pattern(seed, LEN)).unwrap();
    let rd = remote(a, peer, dst.id());
    bounded(
        "write",
        a.write(&one(src.whole()), peer, &one(rd.desc(0, LEN as u64)), None),
    )
    .await
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
}

async fn stop(agents: impl IntoIterator<Item = Agent>) {
    for x in agents {
        let _ = x.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_send_cannot_move_a_known_peer() {
    let (a, addr, b, dst) = known_pair(&opts()).await;
    // Another agent under b's name, with its own connection info.
    let evil = tcp_agent("b").await;
    let trap = evil.register(vec![0u8; LEN]).unwrap();
    let e = bounded("hostile send", evil.send_metadata(addr, &opts()))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    // Transfers still reach the real b.
    write_lands(&a, "b", &dst, 1).await;
    assert!(trap.to_vec().unwrap().iter().all(|&x| x == 0));
    // The real b re-sending (a new registration, the same connection info) is
    // accepted, and a peer not known yet is still introduced by sending.
    let late = b.register(vec![0u8; LEN]).unwrap();
    b.send_metadata(addr, &opts()).await.unwrap();
    write_lands(&a, "b", &late, 2).await;
    let c = tcp_agent("c").await;
    c.send_metadata(addr, &opts()).await.unwrap();
    assert_eq!(a.peers(), ["b", "c"]);
    stop([a, b, c, evil]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_invalidate_cannot_forget_a_known_peer() {
    let (a, addr, b, dst) = known_pair(&opts()).await;
    let evil = tcp_agent("b").await;
    let e = bounded("hostile invalidate", evil.invalidate_at(addr, &opts()))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    assert_eq!(a.peers(), ["b"]);
    write_lands(&a, "b", &dst, 3).await;
    // Invalidating a name that is not known changes nothing and is answered as before.
    let nobody = tcp_agent("nobody").await;
    nobody.invalidate_at(addr, &opts()).await.unwrap();
    assert_eq!(a.peers(), ["b"]);
    stop([a, b, evil, nobody]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_without_trust_goes_through_the_application() {
    let (a, addr, b, _) = known_pair(&opts()).await;
    let _ = b.shutdown().await;
    // b restarted: a new instance on a new port, under the same name.
    let b2 = tcp_agent("b").await;
    let dst = b2.register(vec![0u8; LEN]).unwrap();
    let e = b2.send_metadata(addr, &opts()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    // The application's own fetch, naming the peer, replaces it.
    let at = b2.listen(loopback(), &opts()).await.unwrap();
    a.fetch_peer_metadata(at, "b", &opts()).await.unwrap();
    write_lands(&a, "b", &dst, 4).await;
    stop([a, b2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_accepted_from_trusted_clients() {
    let opted_in = SideChannelOptions {
        accept_peer_updates: true,
        ..opts()
    };
    for (case, served, client) in [
        ("accept_peer_updates", opted_in, opts()),
        ("shared secret", with_secret(), with_secret()),
    ] {
        let (a, addr, b, _) = known_pair(&served).await;
        let _ = b.shutdown().await;
        let b2 = tcp_agent("b").await;
        let dst = b2.register(vec![0u8; LEN]).unwrap();
        bounded(case, b2.send_metadata(addr, &client))
            .await
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        write_lands(&a, "b", &dst, 5).await;
        // A trusted client may make the agent forget a known peer.
        b2.invalidate_at(addr, &client).await.unwrap();
        assert!(a.peers().is_empty(), "{case}");
        stop([a, b2]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_channel_fetch_by_name_refuses_another_name() {
    let a = tcp_agent("a").await;
    let b = tcp_agent("b").await;
    let dst = b.register(vec![0u8; LEN]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    // A server asked for b's metadata answers with its own, c's.
    let c = tcp_agent("c").await;
    let fake = c.listen(loopback(), &opts()).await.unwrap();
    let e = bounded("fetch b from c", a.fetch_peer_metadata(fake, "b", &opts()))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    assert_eq!(a.peers(), ["b"], "nothing was loaded");
    write_lands(&a, "b", &dst, 6).await;
    // The real b, asked by name, is loaded.
    let at = b.listen(loopback(), &opts()).await.unwrap();
    a.fetch_peer_metadata(at, "b", &opts()).await.unwrap();
    stop([a, b, c]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_fetch_by_name_refuses_another_name() {
    let a = tcp_agent("a").await;
    let b = tcp_agent("b").await;
    let dst = b.register(vec![0u8; LEN]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    // c publishes a partial metadata under the label a asks b for.
    let c = tcp_agent("c").await;
    let theirs = c.register(vec![0u8; LEN]).unwrap();
    c.publish_partial("kv", std::slice::from_ref(&theirs), true)
        .unwrap();
    let fake = c.listen(loopback(), &opts()).await.unwrap();
    let e = bounded(
        "fetch b's partial from c",
        a.fetch_peer_partial_metadata(fake, "b", "kv", &opts()),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    assert_eq!(a.peers(), ["b"], "nothing was loaded");
    write_lands(&a, "b", &dst, 7).await;
    // b's own, asked by name, is loaded.
    b.publish_partial("kv", std::slice::from_ref(&dst), true)
        .unwrap();
    let at = b.listen(loopback(), &opts()).await.unwrap();
    a.fetch_peer_partial_metadata(at, "b", "kv", &opts())
        .await
        .unwrap();
    write_lands(&a, "b", &dst, 8).await;
    stop([a, b, c]).await;
}

#[cfg(feature = "etcd")]
mod etcd {
    use std::time::{Duration, Instant};

    use nixl::exchange::{EtcdExchange, EtcdOptions};
    use nixl::ErrorKind;
    use nixl_conformance::etcd_server::EtcdServer;
    use nixl_conformance::support::tcp_agent;

    use super::{stop, write_lands, LEN};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_keys_must_carry_their_peers_name() {
        let Some(etcd) = EtcdServer::start("etcd_keys_must_carry_their_peers_name").await else {
            return;
        };
        let options = EtcdOptions {
            endpoints: vec![etcd.endpoint()],
            namespace: "/hostile/".into(),
            lease_ttl: Duration::from_secs(30),
            timeout: Duration::from_secs(2),
            ..EtcdOptions::default()
        };
        let a = tcp_agent("a").await;
        let b = tcp_agent("b").await;
        let c = tcp_agent("c").await;
        let xa = EtcdExchange::connect(&a, options.clone()).await.unwrap();
        let mut raw = options.client().await.unwrap();
        let key = xa.key("b", "full");
        let bogus = c.metadata().unwrap().to_vec();
        // b's key holding c's metadata: the fetch refuses it.
        raw.put(key.as_str(), bogus.clone(), None).await.unwrap();
        let e = xa.fetch("b", Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        assert!(a.peers().is_empty(), "nothing was loaded");
        // The real b publishes; a fetches it and watches its keys.
        let xb = EtcdExchange::connect(&b, options.clone()).await.unwrap();
        let dst = b.register(vec![0u8; LEN]).unwrap();
        xb.publish().await.unwrap();
        xa.fetch("b", Duration::from_secs(5)).await.unwrap();
        // c's metadata put under b's key: the watch does not load it. b's next
        // update, seen after it (watch events come in order), is loaded.
        raw.put(key.as_str(), bogus, None).await.unwrap();
        let late = b.register(vec![0u8; 64]).unwrap();
        xb.publish_partial("late", std::slice::from_ref(&late), false)
            .await
            .unwrap();
        let t0 = Instant::now();
        while !a
            .remote_regions("b")
            .unwrap()
            .iter()
            .any(|r| r.id == late.id())
        {
            assert!(t0.elapsed() < Duration::from_secs(5), "b's update not seen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(a.peers(), ["b"]);
        write_lands(&a, "b", &dst, 7).await;
        stop([a, b, c]).await;
    }
}
