//! Metadata exchange through a real etcd server (feature `etcd`).

#[cfg(not(feature = "etcd"))]
#[test]
fn etcd_exchange() {
    nixl_conformance::support::skip(
        "etcd exchange tests",
        "built without the `etcd` feature (needs protobuf-compiler and libprotobuf-dev; scripts/test enables it when protoc is present)",
    );
}

#[cfg(feature = "etcd")]
mod with_etcd {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use nixl::exchange::{EtcdExchange, EtcdOptions};
    use nixl::{ErrorKind, Op};
    use nixl_conformance::etcd_server::EtcdServer;
    use nixl_conformance::support::tcp_agent as agent;
    use nixl_conformance::support::{bounded, one, pattern, remote};

    fn options(etcd: &EtcdServer, ttl: u64) -> EtcdOptions {
        EtcdOptions {
            endpoints: vec![etcd.endpoint()],
            namespace: "/test/ns/".into(),
            lease_ttl: Duration::from_secs(ttl),
            timeout: Duration::from_secs(2),
            max_backoff: Duration::from_millis(500),
            ..EtcdOptions::default()
        }
    }

    /// Wait until `cond` holds, up to `limit`; returns how long it took.
    async fn until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
        let t0 = Instant::now();
        while !cond() {
            assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        t0.elapsed()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn discover_transfer_partial_invalidate() {
        let Some(etcd) = EtcdServer::start("discover_transfer_partial_invalidate").await else {
            return;
        };
        let a = agent("a").await;
        let b = agent("b").await;
        let xa = EtcdExchange::connect(&a, options(&etcd, 30)).await.unwrap();
        let xb = EtcdExchange::connect(&b, options(&etcd, 30)).await.unwrap();
        assert_eq!(xb.key("b", "full"), "/test/ns/b/full");
        let dst = b.register(vec![0u8; 1 << 20]).unwrap();
        // Fetch first: it waits for the peer to appear.
        let fetch = tokio::spawn({
            let xa = xa.clone();
            async move { xa.fetch("b", Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        xb.publish().await.unwrap();
        bounded("fetch", fetch).await.unwrap().unwrap();
        let src = a.register(pattern(5, 1 << 20)).unwrap();
        let rd = remote(&a, "b", dst.id());
        a.write(&one(src.whole()), "b", &one(rd.desc(0, 1 << 20)), None)
            .await
            .unwrap();
        assert_eq!(dst.to_vec().unwrap(), src.to_vec().unwrap());
        // Labelled partial metadata.
        let late = b.register(vec![0u8; 64]).unwrap();
        xb.publish_partial("late", std::slice::from_ref(&late), false)
            .await
            .unwrap();
        xa.fetch_partial("b", "late", Duration::from_secs(5))
            .await
            .unwrap();
        assert!(a
            .remote_regions("b")
            .unwrap()
            .iter()
            .any(|r| r.id == late.id()));
        // Missing peer: a clear timeout, no hang.
        let e = xa
            .fetch("nobody", Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        // Invalidate: the peer is forgotten.
        xb.invalidate().await.unwrap();
        until("forget after invalidate", Duration::from_secs(10), || {
            a.peers().is_empty()
        })
        .await;
        let _ = a.shutdown().await;
        let _ = b.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_revokes_lease() {
        let Some(etcd) = EtcdServer::start("shutdown_revokes_lease").await else {
            return;
        };
        let a = agent("a").await;
        let b = agent("b").await;
        let xa = EtcdExchange::connect(&a, options(&etcd, 60)).await.unwrap();
        let xb = EtcdExchange::connect(&b, options(&etcd, 60)).await.unwrap();
        xb.publish().await.unwrap();
        xa.fetch("b", Duration::from_secs(5)).await.unwrap();
        let report = b.shutdown().await;
        assert!(report.is_clean(), "{report:?}");
        // Far sooner than the 60 s TTL: the lease was revoked.
        let took = until(
            "forget after peer shutdown",
            Duration::from_secs(10),
            || a.peers().is_empty(),
        )
        .await;
        println!("peer forgotten {took:?} after its shutdown (lease TTL 60 s)");
        let e = xa.fetch("b", Duration::from_millis(300)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        let monitor = a.task_monitor();
        assert!(a.shutdown().await.is_clean());
        assert!(monitor.is_empty(), "lease keeper and watches joined");
    }

    /// A claimed key is held by one agent at a time, goes with its lease, and comes
    /// back under the new lease when the old one was lost (here revoked behind the
    /// agent's back, as etcd does when the agent could not renew it within the TTL).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claimed_key_restored_after_lost_lease() {
        let Some(etcd) = EtcdServer::start("claimed_key_restored_after_lost_lease").await else {
            return;
        };
        let a = agent("a").await;
        let b = agent("b").await;
        let xa = EtcdExchange::connect(&a, options(&etcd, 2)).await.unwrap();
        let xb = EtcdExchange::connect(&b, options(&etcd, 2)).await.unwrap();
        xa.publish().await.unwrap();
        const KEY: &str = "/test/ns/control";
        assert_eq!(xa.claim(KEY, "a-addr").await.unwrap(), None);
        assert_eq!(
            xb.claim(KEY, "b-addr").await.unwrap().as_deref(),
            Some(&b"a-addr"[..])
        );
        let mut raw = etcd_client::Client::connect([etcd.endpoint()], None)
            .await
            .unwrap();
        let old = xa.lease_id();
        raw.lease_revoke(old).await.unwrap();
        assert!(
            raw.get(KEY, None).await.unwrap().kvs().is_empty(),
            "gone with the lease"
        );
        let t0 = Instant::now();
        loop {
            let got = raw.get(KEY, None).await.unwrap();
            if let Some(kv) = got.kvs().first() {
                assert_eq!(kv.value(), b"a-addr");
                assert_eq!(kv.lease(), xa.lease_id());
                assert_ne!(kv.lease(), old);
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "claim not restored");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The full metadata came back too.
        let full = raw.get(xa.key("a", "full"), None).await.unwrap();
        assert_eq!(full.kvs().len(), 1);
        println!("claim restored {:?} after the lease was lost", t0.elapsed());
        let _ = a.shutdown().await;
        assert!(
            raw.get(KEY, None).await.unwrap().kvs().is_empty(),
            "released at shutdown"
        );
        let _ = b.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_target_forgotten_within_ttl() {
        let Some(etcd) = EtcdServer::start("killed_target_forgotten_within_ttl").await else {
            return;
        };
        const TTL: u64 = 2;
        let mut child = Command::new(env!("CARGO_BIN_EXE_nixl-peer"))
            .args([
                (32usize << 20).to_string(),
                "etcd".into(),
                etcd.endpoint(),
                TTL.to_string(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let published = tokio::task::spawn_blocking(move || {
            let ok = lines.any(|l| l.map(|l| l == "PUBLISHED").unwrap_or(false));
            (ok, lines)
        });
        let (ok, _lines) = bounded("peer publishes", published).await.unwrap();
        assert!(ok);
        let a = agent("initiator").await;
        let xa = EtcdExchange::connect(
            &a,
            EtcdOptions {
                namespace: "nixl".into(),
                ..options(&etcd, 30)
            },
        )
        .await
        .unwrap();
        xa.fetch("target", Duration::from_secs(5)).await.unwrap();
        let src = a.register(vec![1u8; 32 << 20]).unwrap();
        let rd = a.remote_regions("target").unwrap()[0].clone();
        let t = a
            .transfer(
                Op::Write,
                &one(src.whole()),
                "target",
                &one(rd.desc(0, 32 << 20)),
                None,
            )
            .unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        let killed = Instant::now();
        let r = bounded("in-flight transfer to killed peer", t).await;
        if let Err(e) = r {
            assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
        }
        until("forget killed peer", Duration::from_secs(TTL + 8), || {
            a.peers().is_empty()
        })
        .await;
        println!(
            "killed peer forgotten {:?} after SIGKILL (lease TTL {TTL} s)",
            killed.elapsed()
        );
        nixl_conformance::support::figure(
            "etcd: SIGKILLed peer forgotten through lease expiry",
            format!("after {:?} (lease TTL {TTL} s)", killed.elapsed()),
        );
        let e = a
            .transfer(
                Op::Write,
                &one(src.whole()),
                "target",
                &one(rd.desc(0, 16)),
                None,
            )
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownPeer);
        let _ = a.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn survives_etcd_restart() {
        let Some(mut etcd) = EtcdServer::start("survives_etcd_restart").await else {
            return;
        };
        let a = std::sync::Arc::new(agent("a").await);
        let b = agent("b").await;
        let xa = EtcdExchange::connect(&a, options(&etcd, 5)).await.unwrap();
        let xb = EtcdExchange::connect(&b, options(&etcd, 5)).await.unwrap();
        let load_dst = b.register(vec![0u8; 1 << 20]).unwrap();
        xb.publish().await.unwrap();
        xa.fetch("b", Duration::from_secs(5)).await.unwrap();
        // Load: transfers run back to back through the whole outage and restart.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load = tokio::spawn({
            let (a, stop) = (a.clone(), stop.clone());
            let rd = remote(&a, "b", load_dst.id());
            let src = a.register(vec![7u8; 1 << 20]).unwrap();
            async move {
                let (mut ok, mut failed) = (0u64, 0u64);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match a
                        .write(&one(src.whole()), "b", &one(rd.desc(0, 1 << 20)), None)
                        .await
                    {
                        Ok(()) => ok += 1,
                        Err(_) => failed += 1,
                    }
                }
                (ok, failed)
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        etcd.stop();
        // etcd away: clear errors within the bound, no hang.
        let e = bounded("publish while etcd is down", xb.publish())
            .await
            .unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::Backend),
            "{e}"
        );
        let e = bounded(
            "fetch while etcd is down",
            xa.fetch("c", Duration::from_secs(1)),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::Backend),
            "{e}"
        );
        // Transfers do not depend on etcd.
        let dst = b.register(vec![0u8; 64]).unwrap();
        let src = a.register(vec![9u8; 64]).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        a.write(
            &one(src.whole()),
            "b",
            &one(remote(&a, "b", dst.id()).desc(0, 64)),
            None,
        )
        .await
        .unwrap();
        etcd.restart().await;
        // Recovers: publishing and fetching work again.
        let t0 = Instant::now();
        loop {
            match xb
                .publish_partial("after", std::slice::from_ref(&dst), false)
                .await
            {
                Ok(()) => break,
                Err(e) => assert!(
                    t0.elapsed() < Duration::from_secs(15),
                    "publish after restart: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        xa.fetch_partial("b", "after", Duration::from_secs(5))
            .await
            .unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (ok, failed) = bounded("load", load).await.unwrap();
        assert_eq!(
            failed, 0,
            "transfers under load failed during the etcd outage"
        );
        assert!(ok > 0);
        nixl_conformance::support::figure(
            "etcd killed and restarted under load",
            format!(
                "1 restart survived; publishing worked again {:?} after restart; {ok} 1 MiB transfers ran through the outage, 0 failed",
                t0.elapsed()
            ),
        );
        assert!(a.peers().contains(&"b".to_string()));
        // b's full metadata is (again) in etcd under a live lease.
        let c = agent("c").await;
        let xc = EtcdExchange::connect(&c, options(&etcd, 5)).await.unwrap();
        bounded(
            "fetch after restart",
            xc.fetch("b", Duration::from_secs(10)),
        )
        .await
        .unwrap();
        let _ = a.shutdown().await;
        for x in [b, c] {
            let _ = x.shutdown().await;
        }
    }
}
