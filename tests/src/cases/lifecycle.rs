//! Peers going away and agents stopping: shutdown mid-transfer, dropped transfers and agents, moved peers.

use super::*;

/// The target shuts down while transfers run: every transfer ends, none hangs.
pub async fn peer_shutdown_mid_transfer(but: &BackendUnderTest) {
    need!(but, "peer_shutdown_mid_transfer", remote, dram);
    let (a, b) = but.pair().await;
    let src = a.register(vec![3u8; 16 << 20]).unwrap();
    let dst = b.register(vec![0u8; 16 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    let req = a
        .create_request(
            Op::Write,
            &one(src.whole()),
            "target",
            &one(rd.whole_desc()),
            &RequestOptions::default(),
        )
        .unwrap();
    bounded("warm-up", req.post(None).unwrap()).await.unwrap();
    let mut transfers = Vec::new();
    for _ in 0..8 {
        transfers.push(
            a.transfer(
                Op::Write,
                &one(src.whole()),
                "target",
                &one(rd.whole_desc()),
                None,
            )
            .unwrap(),
        );
    }
    let failed = shut_down_under(b, transfers, "transfer").await;
    println!("{failed} of 8 in-flight transfers failed when the target shut down");
    // New transfers to the dead peer fail fast with an error.
    let e = bounded("post to dead peer", req.post(None).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    assert!(a.shutdown().await.is_clean());
}

/// Dropping in-flight futures, then shutting down, leaks no task or thread.
pub async fn drop_in_flight_then_shutdown(but: &BackendUnderTest) {
    need!(but, "drop_in_flight_then_shutdown", remote, dram);
    let threads_before = own_thread_count("drop_in_flight_then_shutdown");
    let (a, b) = but.pair().await;
    let (ma, mb) = (a.task_monitor(), b.task_monitor());
    let src = a.register(vec![3u8; 8 << 20]).unwrap();
    let dst = b.register(vec![0u8; 8 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    for i in 0..16 {
        let op = if i % 2 == 0 { Op::Write } else { Op::Read };
        drop(
            a.transfer(
                op,
                &one(src.whole()),
                "target",
                &one(rd.whole_desc()),
                Some(Bytes::from_static(b"x")),
            )
            .unwrap(),
        );
    }
    assert!(
        !ma.is_empty() || !ma.threads().is_empty(),
        "the agent runs tasks or threads while connected"
    );
    let ra = bounded("shutdown a", a.shutdown()).await;
    let rb = bounded("shutdown b", b.shutdown()).await;
    assert_eq!((ra.tasks_left, rb.tasks_left), (0, 0), "{ra:?} {rb:?}");
    assert!(ra.backend_errors.is_empty(), "{ra:?}");
    assert_eq!((ma.len(), mb.len()), (0, 0));
    assert!(ma.threads().is_empty() && mb.threads().is_empty());
    assert!(ra.threads_left.is_empty() && rb.threads_left.is_empty());
    assert_eq!(src.inflight(), 0, "dropped transfers released their memory");
    assert!(!src.is_registered() && !dst.is_registered());
    if let Some(before) = threads_before {
        assert!(
            thread_count() <= before,
            "threads {} > {before} before",
            thread_count()
        );
    }
    // Using a shut-down agent is an error, not a hang.
    assert_eq!(kind(a.register(vec![0u8; 8])), ErrorKind::ShutDown);
    assert!(a.shutdown().await.already_shut_down);
}

/// Dropping agents (no shutdown) ends every task they started within the bound.
pub async fn drop_agent_ends_tasks(but: &BackendUnderTest) {
    need!(but, "drop_agent_ends_tasks", remote, dram);
    let threads_before = own_thread_count("drop_agent_ends_tasks");
    let (a, b) = but.pair().await;
    let (ma, mb) = (a.task_monitor(), b.task_monitor());
    let src = a.register(vec![3u8; 4 << 20]).unwrap();
    let dst = b.register(vec![0u8; 4 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "target", dst.id());
    bounded(
        "write",
        a.write(&one(src.whole()), "target", &one(rd.whole_desc()), None),
    )
    .await
    .unwrap();
    let inflight = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "target",
            &one(rd.whole_desc()),
            None,
        )
        .unwrap();
    drop(a);
    drop(b);
    bounded("tasks of dropped agents", async {
        ma.wait().await;
        mb.wait().await;
    })
    .await;
    // The in-flight transfer resolves (it may have finished before the drop).
    let _ = bounded("transfer of dropped agent", inflight).await;
    assert_eq!(src.inflight(), 0);
    if let Some(before) = threads_before {
        assert!(thread_count() <= before);
    }
}

/// One initiator, two targets, concurrent transfers to both.
pub async fn three_agents_one_process(but: &BackendUnderTest) {
    need!(but, "three_agents_one_process", remote, dram);
    let a = but.agent("a").await;
    let b = but.agent("b").await;
    let c = but.agent("c").await;
    let src = a.register(pattern(11, 1 << 20)).unwrap();
    let db = b.register(vec![0u8; 1 << 20]).unwrap();
    let dc = c.register(vec![0u8; 1 << 20]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.load_metadata(&c.metadata().unwrap()).unwrap();
    assert_eq!(a.peers(), vec!["b".to_string(), "c".to_string()]);
    let tb = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "b",
            &one(remote(&a, "b", db.id()).whole_desc()),
            None,
        )
        .unwrap();
    let tc = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "c",
            &one(remote(&a, "c", dc.id()).whole_desc()),
            None,
        )
        .unwrap();
    bounded("b", tb).await.unwrap();
    bounded("c", tc).await.unwrap();
    let s = checksum_bytes(&src.to_vec().unwrap());
    assert_eq!((checksum(&db), checksum(&dc)), (s, s));
    for x in [a, b, c] {
        assert!(x.shutdown().await.is_clean());
    }
}

/// Peers dropped without shutdown (so without goodbye), in the ways the lifecycle
/// torture found hanging: before this agent ever used its connection, once the
/// connection had been set up in the background but never used, and while transfers
/// and notifications to it were in flight. Every transfer and notification to them
/// resolves within the bound (an error, or `Ok` where a one-sided transport cannot
/// tell the target is gone), later posts too, and shutdown is clean.
pub async fn dropped_peers_never_hang(but: &BackendUnderTest) {
    need!(but, "dropped_peers_never_hang", remote, dram, notifications);
    // Ending with one of these is fine; hanging, or another error, is not.
    fn gone(what: &str, e: &nixl::Error) {
        assert!(
            matches!(
                e.kind(),
                ErrorKind::RemoteDisconnected | ErrorKind::Canceled
            ),
            "{what}: {e}"
        );
    }
    let a = but.agent("survivor").await;
    let src = a.register(vec![5u8; 1 << 20]).unwrap();
    // The dead peers' memory stays alive here: a one-sided transport may still write
    // into it (in this process) until it notices the peer is gone.
    let mut keep = Vec::new();
    let mut pending = Vec::new();
    let mut requests = Vec::new();
    let mut refused = 0;
    for (name, wait_ms, busy) in [
        ("gone-early", 0, false),
        ("gone-idle", 50, false),
        ("gone-busy", 0, true),
    ] {
        let b = but.agent(name).await;
        let monitor = b.task_monitor();
        let dst = b.register(vec![0u8; 1 << 20]).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        let rd = remote(&a, name, dst.id());
        keep.push(dst);
        let req = a
            .create_request(
                Op::Write,
                &one(src.whole()),
                name,
                &one(rd.whole_desc()),
                &RequestOptions::default(),
            )
            .unwrap();
        let mut post = |what: &'static str, t: nixl::Result<nixl::Transfer>| match t {
            Ok(t) => pending.push((name, what, t)),
            // Refused at once: the backend already knows the peer is gone.
            Err(e) => {
                gone(what, &e);
                refused += 1;
            }
        };
        let desc = |op: Op, notif: &'static [u8]| {
            a.transfer(
                op,
                &one(src.desc(0, 4096)),
                name,
                &one(rd.desc(0, 4096)),
                (!notif.is_empty()).then(|| Bytes::from_static(notif)),
            )
        };
        if busy {
            post("write in flight", req.post(None));
            post("read in flight", desc(Op::Read, b""));
            post("notification in flight", a.notify(name, &b"n"[..]));
        }
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        drop(b);
        bounded("dropped peer's tasks to end", monitor.wait()).await;
        if !busy {
            post("write", req.post(None));
        }
        post("write with notification", desc(Op::Write, b"w"));
        post("read with notification", desc(Op::Read, b"r"));
        post("notification", a.notify(name, &b"x"[..]));
        requests.push((name, req));
    }
    let t0 = std::time::Instant::now();
    let mut failed = 0;
    for (name, what, t) in pending {
        if let Err(e) = bounded(&format!("{what} to dropped peer {name}"), t).await {
            gone(&format!("{what} to {name}"), &e);
            failed += 1;
        }
    }
    println!(
        "transfers to dropped peers resolved within {:?} ({failed} failed, {refused} refused at once)",
        t0.elapsed()
    );
    // Posting again resolves too (typically failing fast now).
    for (name, req) in &requests {
        match req.post(None) {
            Ok(t) => {
                if let Err(e) = bounded(&format!("repost to dropped peer {name}"), t).await {
                    gone(&format!("repost to {name}"), &e);
                }
            }
            Err(e) => gone(&format!("repost to {name}"), &e),
        }
    }
    let report = bounded("survivor shutdown", a.shutdown()).await;
    assert_eq!(report.tasks_left, 0, "{report:?}");
    drop(keep);
}

/// A peer whose connection info changed (it restarted at another address) is closed
/// on every backend: the agent closes its old link, and what still waited on the old
/// connection fails at once with
/// [`ErrorKind::RemoteDisconnected`] (not at a stall bound, and never delivered to the
/// new address), and the next notification reaches the agent at the new address.
///
/// The old connection is kept busy by back-pressure: the receiver reads nothing and
/// queues one notification per peer, so the sender's further notifications wait.
pub async fn moved_peer_closed(but: &BackendUnderTest) {
    let caps = need!(but, "moved_peer_closed", remote, notifications, dram);
    let build = |name: &'static str, backend: std::sync::Arc<dyn nixl::Backend>| async move {
        nixl::Agent::builder(name)
            .backend_arc(backend)
            .notification_limits(nixl::NotificationLimits {
                messages: 1,
                ..nixl::NotificationLimits::default()
            })
            .options(nixl::AgentOptions {
                drain_timeout: Duration::from_secs(5),
                shutdown_timeout: Duration::from_secs(10),
            })
            .build()
            .await
            .expect("agent builds")
    };
    let make = || (but.make)().expect("backend constructs");
    let sender = build("sender", make()).await;
    let receiver = build("receiver", make()).await;
    let moved = build("receiver", make()).await;
    // Registered memory: some backends accept connections only once they have some.
    let _regs: Vec<_> = [&sender, &receiver, &moved]
        .iter()
        .map(|a| a.register(vec![0u8; 4096]).unwrap())
        .collect();
    sender.load_metadata(&receiver.metadata().unwrap()).unwrap();
    receiver.load_metadata(&sender.metadata().unwrap()).unwrap();
    moved.load_metadata(&sender.metadata().unwrap()).unwrap();
    bounded("connect", sender.connect("receiver"))
        .await
        .unwrap();

    // Post until some notifications stay pending (transports buffer a few).
    let size = caps.max_notification.min(4096);
    let msg = Bytes::from(vec![b'n'; size]);
    let mut posted = Vec::new();
    while posted.len() < 4096 {
        for _ in 0..32 {
            let f = sender.notify("receiver", msg.clone()).unwrap();
            posted.push(tokio::spawn(f));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        if posted.iter().filter(|t| !t.is_finished()).count() >= 4 {
            break;
        }
    }
    let waiting = posted.iter().filter(|t| !t.is_finished()).count();
    assert!(
        waiting > 0,
        "{}: {} notifications completed although the receiver read none",
        but.name,
        posted.len()
    );

    // The receiver moved (restarted elsewhere): the sender loads its new metadata,
    // and the agent closes the old link.
    sender.load_metadata(&moved.metadata().unwrap()).unwrap();
    let mut failed = 0;
    for t in posted {
        match bounded("a notification waiting on the old connection", t)
            .await
            .unwrap()
        {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{}: {e}", but.name);
                failed += 1;
            }
        }
    }
    assert!(
        failed > 0,
        "{}: every waiting notification completed after the move",
        but.name
    );
    assert!(
        moved.notification_stats().peers.is_empty(),
        "{}: the old connection's notifications reached the new address",
        but.name
    );

    // The next one goes to the new address.
    bounded(
        "a notification to the new address",
        sender.notify("receiver", "after the move").unwrap(),
    )
    .await
    .unwrap();
    let mut notes = moved.notifications().unwrap();
    let n = bounded("the notification at the new address", notes.recv())
        .await
        .expect("the agent is alive");
    assert_eq!(
        (n.peer.as_str(), &n.msg[..]),
        ("sender", &b"after the move"[..])
    );
    figure(
        &format!("moved peer closed ({})", but.name),
        format!("{waiting} notifications waiting on the old connection, {failed} failed RemoteDisconnected at the move, the next reached the new address"),
    );
    for a in [sender, receiver, moved] {
        let _ = bounded("shutdown", a.shutdown()).await;
    }
}
