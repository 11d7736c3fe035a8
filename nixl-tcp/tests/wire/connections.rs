//! A connection bound to the name it proved; the agent's secret over the backend
//! and the side channel.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random bytes after a valid hello never crash the target or touch its memory.
    #[test]
    fn random_wire_bytes(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 1..5)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let (b, addr) = target(TcpOptions::default()).await;
            let mem = b.register(pattern(4, 4096)).unwrap();
            let before = checksum(&mem);
            for c in &chunks {
                let mut raw = Raw::connect(addr).await;
                let _ = raw.s.write_all(c).await;
                let _ = raw.s.shutdown().await;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            assert_eq!(checksum(&mem), before);
            // Still serving.
            let mut ok = Raw::connect(addr).await;
            let key = key_of(&b.metadata().unwrap(), mem.id());
            assert_eq!(ok.request(READ, &[(key, mem.addr(), 8)], None, &[]).await, (ST_OK, true));
            let _ = b.shutdown().await;
        });
    }
}

/// Deregistration cuts off the requests the target is serving from that memory.
mod deregistration {
    use super::*;

    /// Register `mem` filled with 0x11 and start a WRITE of all of it whose payload
    /// comes in two parts; deregister between them. Nothing of the second part may
    /// reach the memory, and the target cuts the connection.
    async fn slow_write_cut_by_deregister(mem: nixl::Memory) {
        let (b, addr) = target(TcpOptions::default()).await;
        let len = mem.len();
        let r = b.register(mem).unwrap();
        r.write_at(0, &vec![0x11; len]).unwrap();
        let key = key_of(&b.metadata().unwrap(), r.id());
        let mut c = Raw::connect(addr).await;
        c.send_raw(WRITE, 1, 0, false).await;
        let mut table = Vec::new();
        for x in [key, r.addr(), len as u64, 0, 1] {
            table.extend_from_slice(&x.to_le_bytes());
        }
        c.s.write_all(&table).await.unwrap();
        // One staging chunk of GPU memory (they move whole).
        let first = 4 << 20;
        c.s.write_all(&vec![0xEE; first]).await.unwrap();
        bounded("the first part lands", async {
            loop {
                let mut b = [0u8; 1];
                r.read_at(first - 1, &mut b).unwrap();
                if b[0] == 0xEE {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await;
        // Refused while a staging copy of the first part still runs (GPU memory).
        bounded("deregister", async {
            loop {
                match b.deregister(&r) {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::NotAllowed => {
                        tokio::time::sleep(Duration::from_millis(1)).await
                    }
                    Err(e) => panic!("deregister: {e}"),
                }
            }
        })
        .await;
        let at_deregistration = r.to_vec().unwrap();
        // The rest of the payload (the target may already have cut the connection).
        let _ = c.s.write_all(&vec![0xEE; len - first]).await;
        let mut reply = [0u8; 24];
        let answered = bounded("the target answers or closes", c.s.read(&mut reply)).await;
        assert!(
            r.to_vec().unwrap() == at_deregistration,
            "bytes were written into the memory after deregister returned"
        );
        assert!(
            at_deregistration.contains(&0x11),
            "the whole payload landed before the cut"
        );
        figure(
            &format!("hostile: slow WRITE cut by deregister ({})", r.kind()),
            format!(
                "{} MiB sent after deregister returned, 0 bytes of it landed; connection cut",
                (len - first) >> 20
            ),
        );
        assert!(
            matches!(answered, Ok(0) | Err(_)),
            "the target answered a request into withdrawn memory instead of cutting it: {answered:?}"
        );
        // The target still serves others.
        let other = b.register(pattern(9, 4096)).unwrap();
        let okey = key_of(&b.metadata().unwrap(), other.id());
        let mut c = Raw::connect(addr).await;
        let (status, _) = c
            .request(WRITE, &[(okey, other.addr(), 16)], None, &[7; 16])
            .await;
        assert_eq!(status, ST_OK);
        assert!(b.shutdown().await.is_clean());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_write_after_deregister_leaves_host_memory_untouched() {
        slow_write_cut_by_deregister(pattern(1, 12 << 20).into()).await;
    }

    /// GPU memory (the CUDA driver test double) goes through staging copies: none
    /// starts after deregistration.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_write_after_deregister_leaves_device_memory_untouched() {
        const CASE: &str = "a_slow_write_after_deregister_leaves_device_memory_untouched";
        match nixl_testkit::fake_cuda::library() {
            Ok(lib) => std::env::set_var(nixl::gpu::ENV_LIB, lib),
            Err(e) => return nixl_testkit::skip(CASE, format!("no CUDA driver double: {e}")),
        }
        slow_write_cut_by_deregister(nixl::Memory::vram(0, 12 << 20).unwrap()).await;
    }

    /// A READ being sent stops sending from the memory at deregistration: bytes
    /// written into it afterwards never reach the peer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_stops_sending_at_deregister() {
        let (b, addr) = target(TcpOptions::default()).await;
        let len = 32 << 20;
        let r = b.register(vec![0x11; len]).unwrap();
        let key = key_of(&b.metadata().unwrap(), r.id());
        let mut c = Raw::connect(addr).await;
        c.send_raw(READ, 1, 0, false).await;
        let mut table = Vec::new();
        for x in [key, r.addr(), len as u64, 0, 1] {
            table.extend_from_slice(&x.to_le_bytes());
        }
        c.s.write_all(&table).await.unwrap();
        let mut head = [0u8; 24];
        c.s.read_exact(&mut head).await.unwrap();
        assert_eq!(head[0], 0x81, "DATA first");
        let mut got = vec![0u8; 1 << 20];
        c.s.read_exact(&mut got).await.unwrap();
        b.deregister(&r).unwrap();
        r.write_at(0, &vec![0xBB; len]).unwrap();
        let mut late = 0usize;
        let mut total = got.len();
        while total < len + 24 {
            match bounded("read until the cut", c.s.read(&mut got)).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    late += got[..n].iter().filter(|&&x| x == 0xBB).count();
                    total += n;
                }
            }
        }
        assert_eq!(
            late, 0,
            "bytes read from the memory after deregister reached the peer"
        );
        assert!(total < len + 24, "the whole READ was sent: {total} bytes");
        figure(
            "hostile: READ being sent when deregistered",
            format!("{} MiB of {} MiB sent (what the socket held at deregistration), 0 bytes of memory written afterwards reached the peer", total >> 20, len >> 20),
        );
        assert!(b.shutdown().await.is_clean());
    }
}

/// A connection is bound to the agent name it proved: a holder of the secret that
/// authenticates as one agent and says hello as another (to send notifications in
/// its name) is refused before anything is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cannot_say_hello_as_another_agent_than_it_proved() {
    let secret = SharedSecret::new("deployment-secret").unwrap();
    let (t, addr) = target(with_secret(Some("deployment-secret"))).await;
    for (proven, hello, accepted) in [
        ("mallory", "prefill-0", false),
        ("prefill-0", "prefill-0", true),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let (mut auth, first) = nixl::control::ClientAuth::start(
            "nixl-tcp",
            secret.clone(),
            proven,
            "target",
            nixl::control::nonce(),
        )
        .unwrap();
        s.write_all(&first).await.unwrap();
        while !auth.is_done() {
            let mut b = vec![0u8; auth.need()];
            s.read_exact(&mut b).await.unwrap();
            let out = auth.received(&b).unwrap();
            s.write_all(&out).await.unwrap();
        }
        s.write_all(&nixl_tcp::wire_hello(hello)).await.unwrap();
        let mut reply = [0u8; 7];
        s.read_exact(&mut reply).await.unwrap();
        if !accepted {
            assert_eq!(reply[6], 5, "proved {proven:?}, said hello as {hello:?}");
            assert_eq!(s.read(&mut [0u8; 1]).await.unwrap(), 0, "then closed");
            continue;
        }
        assert_eq!(reply[6], 0);
        // No same-host path, then a notification: it arrives under the proven name.
        s.write_all(&[0]).await.unwrap();
        let note = b"kv ready";
        let mut req = vec![3u8, 1, 0, 0];
        req.extend_from_slice(&0u32.to_le_bytes());
        req.extend_from_slice(&1u64.to_le_bytes());
        req.extend_from_slice(&(note.len() as u32).to_le_bytes());
        req.extend_from_slice(&[0; 4]);
        req.extend_from_slice(note);
        s.write_all(&req).await.unwrap();
    }
    let mut notes = t.notifications().unwrap();
    let n = bounded("the notification", notes.next()).await.unwrap();
    assert_eq!(
        (n.peer.as_str(), &n.msg[..]),
        ("prefill-0", &b"kv ready"[..])
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(200), notes.next())
            .await
            .is_err(),
        "nothing arrived from the refused connection"
    );
    let _ = t.shutdown().await;
}

/// One agent-level secret (`AgentBuilder::secret`) authenticates nixl-tcp's
/// connections and the side channel alike: an agent without it reaches neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_secret_gates_the_backend_and_the_side_channel() {
    let secret = SharedSecret::new("deployment-secret").unwrap();
    let agent = |name: &'static str, secret: Option<SharedSecret>| async move {
        let b = Agent::builder(name).backend(TcpBackend::with_options(TcpOptions {
            same_host: nixl_tcp::SameHost::Off,
            ..TcpOptions::default()
        }));
        match secret {
            Some(s) => b.secret(s),
            None => b,
        }
        .build()
        .await
        .unwrap()
    };
    let t = agent("target", Some(secret.clone())).await;
    let mem = t.register(vec![0u8; 4096]).unwrap();
    let sc = nixl::SideChannelOptions::default();
    let at = t.listen("127.0.0.1:0".parse().unwrap(), &sc).await.unwrap();

    // Without the secret: the side channel and the backend both refuse.
    let outsider = agent("outsider", None).await;
    let e = bounded("fetch", outsider.fetch_metadata(at, &sc))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "side channel: {e}");
    outsider.load_metadata(&t.metadata().unwrap()).unwrap();
    let src = outsider.register(vec![7u8; 4096]).unwrap();
    let rd = remote(&outsider, "target", mem.id());
    let e = bounded(
        "write",
        outsider.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "nixl-tcp: {e}");
    assert_eq!(mem.to_vec().unwrap(), vec![0u8; 4096]);

    // With it: both work, with no secret in either's own options.
    let insider = agent("insider", Some(secret)).await;
    assert_eq!(
        bounded("fetch", insider.fetch_metadata(at, &sc))
            .await
            .unwrap(),
        "target"
    );
    let src = insider.register(vec![9u8; 4096]).unwrap();
    let rd = remote(&insider, "target", mem.id());
    bounded(
        "write",
        insider.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap();
    assert_eq!(mem.to_vec().unwrap(), vec![9u8; 4096]);
    for a in [outsider, insider, t] {
        assert!(bounded("shutdown", a.shutdown()).await.is_clean());
    }
}
