//! nixl-uccl's lifecycle against the engine **test double** (`nixl_uccl::test_double`),
//! in the situations that hung or crashed NIXL's UCCL backend. The double reproduces
//! UCCL's blocking behaviour; these tests prove this crate's structure, not UCCL's
//! data path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Agent, AgentOptions, Backend, ErrorKind, Op, Registration};
use nixl_testkit::double::one;
use nixl_uccl::test_double::{self, TestDouble};
use nixl_uccl::{UcclBackend, UcclOptions, MAX_NOTIFICATION};

/// Catches hangs; never a performance bound.
const HANG: Duration = Duration::from_secs(30);

fn options() -> UcclOptions {
    let mut o = UcclOptions::default();
    o.listener.dead_peer_timeout = Duration::from_secs(1);
    o
}

async fn agent_with(name: &str, o: UcclOptions) -> (Agent, UcclBackend) {
    let b = UcclBackend::with_api(TestDouble::api(), o);
    let a = Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(1),
            shutdown_timeout: Duration::from_secs(2),
        })
        .build()
        .await
        .unwrap();
    (a, b)
}

async fn agent(name: &str) -> (Agent, UcclBackend) {
    agent_with(name, options()).await
}

fn remote(a: &Agent, peer: &str, r: &Registration) -> nixl::Desc {
    let info = a
        .remote_regions(peer)
        .unwrap()
        .into_iter()
        .find(|x| x.id == r.id())
        .unwrap();
    info.desc(0, info.len)
}

/// A 4 KiB WRITE from `a` to `b` (`peer`, on backend `bb`) while b's engine leaves
/// inbound connections pending: a's UCCL connect blocks inside the engine, as
/// UCCL's does when the peer does not accept. Returns the transfer and the two
/// registrations it uses.
fn write_to_a_held_engine(
    a: &Agent,
    b: &Agent,
    bb: &UcclBackend,
    peer: &str,
) -> (nixl::Transfer, [Registration; 2]) {
    let src = a.register(vec![1u8; 4096]).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    test_double::hold_accepts(&bb.engine_metadata().unwrap(), true);
    let t = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            peer,
            &one(remote(a, peer, &dst)),
            None,
        )
        .unwrap();
    (t, [src, dst])
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(HANG, f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

fn no_misuse() {
    assert_eq!(test_double::violations(), Vec::<String>::new());
    assert_eq!(test_double::notifications_sent(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_that_never_registered_shuts_down_at_once() {
    let (a, _) = agent("lonely").await;
    // Let the accept loop reach whatever it blocks in.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let r = bounded("shutdown", a.shutdown()).await;
    assert!(r.is_clean(), "{r:?}");
    // Well inside the agent's 2 s bound: nothing waited for a registration.
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // Dropped without shutdown, too.
    let (b, _) = agent("lonely-dropped").await;
    drop(b);
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_during_connect_never_races_destroy() {
    let (a, ab) = agent("a-connect").await;
    let (b, bb) = agent("b-held").await;
    let a_meta = ab.engine_metadata().unwrap();
    let (t, _regs) = write_to_a_held_engine(&a, &b, &bb, "b-held");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    let r = bounded("shutdown during connect", a.shutdown()).await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "shutdown was not bounded"
    );
    // The connect thread is still inside the engine: named, not waited on.
    assert_eq!(r.threads_left, vec!["uccl-connect".to_string()], "{r:?}");
    assert!(bounded("transfer", t).await.is_err());
    assert!(
        test_double::engine_alive(&a_meta),
        "destroyed under a running connect"
    );
    // B goes away: the stuck connect returns, and only then is A's engine destroyed.
    let _ = b.shutdown().await;
    assert!(
        test_double::wait_until(Duration::from_secs(10), || !test_double::engine_alive(
            &a_meta
        )),
        "A's engine was not destroyed after its last user returned"
    );
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_peer_fails_transfers_within_the_liveness_bound() {
    let (a, _) = agent("a-vanish").await;
    let (b, bb) = agent("b-vanish").await;
    let src = a.register(vec![1u8; 1 << 16]).unwrap();
    let dst = b.register(vec![0u8; 1 << 16]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    // Connected and working first.
    a.write(
        &one(src.whole()),
        "b-vanish",
        &one(remote(&a, "b-vanish", &dst)),
        None,
    )
    .await
    .unwrap();
    // Then B's engine stops completing anything ("done" never comes), and B dies;
    // its queue pairs would be flushed only after a retry timeout (10 s here), so
    // only the liveness of the control connection can fail the transfer in time.
    let b_meta = bb.engine_metadata().unwrap();
    test_double::freeze(&b_meta);
    test_double::set_flush_delay(&b_meta, Duration::from_secs(10));
    let t = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "b-vanish",
            &one(remote(&a, "b-vanish", &dst)),
            None,
        )
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    drop(b);
    let e = bounded("transfer to a vanished peer", t).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    // Within the documented bound (liveness, 1 s here), with slack for a loaded host.
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // Later posts fail fast too.
    let e = bounded(
        "post after",
        a.write(
            &one(src.whole()),
            "b-vanish",
            &one(remote(&a, "b-vanish", &dst)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::RemoteDisconnected | ErrorKind::TimedOut
        ),
        "{e}"
    );
    assert!(a.shutdown().await.threads_left.is_empty());
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_but_live_peer_times_out() {
    let (a, ab) = agent_with(
        "a-stall",
        UcclOptions {
            stall_timeout: Duration::from_millis(500),
            ..options()
        },
    )
    .await;
    let (b, bb) = agent("b-stall").await;
    let src = a.register(vec![1u8; 4096]).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let b_meta = bb.engine_metadata().unwrap();
    test_double::freeze(&b_meta);
    let e = bounded(
        "stalled write",
        a.write(
            &one(src.whole()),
            "b-stall",
            &one(remote(&a, "b-stall", &dst)),
            Some(Bytes::from_static(b"never")),
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    // Its notification was never sent: B's stream stays empty.
    let mut nb = b.notifications().unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(300), nb.recv())
        .await
        .is_err());
    // The operation is still in the engine: deregistering the source is refused
    // (nothing changes) until the engine is done with it.
    let a_meta = ab.engine_metadata().unwrap();
    assert_eq!(test_double::registrations(&a_meta), 1);
    let e = a.deregister(&src).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    assert!(src.is_registered());
    assert_eq!(test_double::registrations(&a_meta), 1);
    test_double::thaw(&b_meta);
    assert!(
        test_double::wait_until(Duration::from_secs(10), || src.inflight() == 0),
        "the registration stayed in flight after the engine was done"
    );
    a.deregister(&src).unwrap();
    assert_eq!(
        test_double::registrations(&a_meta),
        0,
        "deregistered, but the memory region was not destroyed"
    );
    let r = a.shutdown().await;
    assert!(r.is_clean(), "{r:?}");
    let _ = b.shutdown().await;
    assert!(test_double::wait_until(Duration::from_secs(10), || {
        !test_double::engine_alive(&a_meta)
    }));
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_go_to_their_agent_whole_and_named() {
    let (a, _) = agent("a-notes").await;
    let (c, _) = agent("c-notes").await;
    let (b, _) = agent("b-notes").await;
    let (d, _) = agent("d-notes").await;
    let dst = b.register(vec![0u8; 1 << 16]).unwrap();
    let dst_d = d.register(vec![0u8; 16]).unwrap();
    let sa = a.register(vec![0xaa; 1 << 16]).unwrap();
    let sc = c.register(vec![0xcc; 1 << 15]).unwrap();
    for x in [&a, &c] {
        x.load_metadata(&b.metadata().unwrap()).unwrap();
        x.load_metadata(&d.metadata().unwrap()).unwrap();
    }
    let big = Bytes::from((0..64 * 1024).map(|i| i as u8).collect::<Vec<u8>>());
    let mut nb = b.notifications().unwrap();
    let mut nd = d.notifications().unwrap();
    // Two initiators in one process (one host) write to B, each with a notification
    // far beyond UCCL's 256 bytes.
    a.write(
        &one(sa.whole()),
        "b-notes",
        &one(remote(&a, "b-notes", &dst)),
        Some(big.clone()),
    )
    .await
    .unwrap();
    let half = remote(&c, "b-notes", &dst);
    c.write(
        &one(sc.whole()),
        "b-notes",
        &one(nixl::Desc {
            len: 1 << 15,
            ..half
        }),
        Some(Bytes::from_static(b"from c")),
    )
    .await
    .unwrap();
    let n1 = bounded("b's first", nb.recv()).await.unwrap();
    let n2 = bounded("b's second", nb.recv()).await.unwrap();
    assert_eq!((n1.peer.as_str(), n1.msg.len()), ("a-notes", big.len()));
    assert_eq!(n1.msg, big, "never truncated");
    assert_eq!((n2.peer.as_str(), &n2.msg[..]), ("c-notes", &b"from c"[..]));
    // The data is there: C's half over A's.
    let got = dst.to_vec().unwrap();
    assert!(got[..1 << 15].iter().all(|&x| x == 0xcc) && got[1 << 15..].iter().all(|&x| x == 0xaa));
    // D got nothing of it (nothing is process-wide).
    assert!(tokio::time::timeout(Duration::from_millis(200), nd.recv())
        .await
        .is_err());
    let _ = dst_d;
    // Oversize is refused when posted, with a clear error.
    let e = a
        .notify("b-notes", vec![0u8; MAX_NOTIFICATION + 1])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // Exactly the limit goes through whole.
    bounded(
        "max notify",
        a.notify("b-notes", vec![7u8; MAX_NOTIFICATION]).unwrap(),
    )
    .await
    .unwrap();
    let n = bounded("max recv", nb.recv()).await.unwrap();
    assert_eq!(n.msg.len(), MAX_NOTIFICATION);
    for x in [a, b, c, d] {
        let r = x.shutdown().await;
        assert!(r.is_clean(), "{r:?}");
    }
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_link_to_an_unregistered_peer_stays_up() {
    // Liveness 1 s: an idle link to a target that never registers memory must keep
    // answering pings (it only withholds "ready" for the engine connection).
    let (a, ab) = agent("a-idle").await;
    let (b, _) = agent("b-unregistered").await;
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let mut nb = b.notifications().unwrap();
    bounded("first", a.notify("b-unregistered", "one").unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let path = ab.data_path("b-unregistered").unwrap();
    assert!(
        !path.contains("not connected"),
        "the link dropped while idle: {path}"
    );
    bounded("second", a.notify("b-unregistered", "two").unwrap())
        .await
        .unwrap();
    for want in ["one", "two"] {
        let n = bounded("recv", nb.recv()).await.unwrap();
        assert_eq!(&n.msg[..], want.as_bytes());
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_never_done_leave_engine_and_memory_alive() {
    // A transfer fails (stall bound) while its operation stays in the engine, and the
    // agent then shuts down with it still there: the engine may yet write that
    // memory, so the memory region, its memory and the engine are left alive on
    // purpose rather than destroyed under it.
    let (a, ab) = agent_with(
        "a-poison",
        UcclOptions {
            stall_timeout: Duration::from_millis(300),
            ..options()
        },
    )
    .await;
    let (b, bb) = agent("b-poison").await;
    let dst = a.register(vec![0u8; 4096]).unwrap();
    let src = b.register(vec![9u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let b_meta = bb.engine_metadata().unwrap();
    test_double::freeze(&b_meta);
    let e = bounded(
        "stalled read",
        a.read(
            &one(dst.whole()),
            "b-poison",
            &one(remote(&a, "b-poison", &src)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    let a_meta = ab.engine_metadata().unwrap();
    let r = a.shutdown().await;
    // Said, not hidden: the region the engine may still use was not deregistered.
    assert!(
        r.backend_errors
            .iter()
            .any(|(b, e)| b == "uccl" && e.to_string().contains("never reported done")),
        "{r:?}"
    );
    drop((a, ab, dst));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        test_double::engine_alive(&a_meta),
        "engine destroyed under an operation"
    );
    assert_eq!(
        test_double::registrations(&a_meta),
        1,
        "region destroyed under an operation"
    );
    test_double::thaw(&b_meta);
    let _ = b.shutdown().await;
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_target_confirms_only_for_the_registrations_key() {
    // A registration's confirmation key travels in its metadata blob, after UCCL's
    // FifoItem; the target digests only ranges asked for with the right key, so a
    // client without the metadata learns nothing through confirmation requests.
    let (a, _) = agent("a-key").await;
    let (b, _) = agent("b-key").await;
    let src = a.register(vec![3u8; 4096]).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    let mut md = nixl::metadata::AgentMetadata::decode(&b.metadata().unwrap()).unwrap();
    let blob = &mut md.regions[0].blobs[0].blob;
    assert_eq!(blob.len(), 64 + 8, "FifoItem and key");
    *blob.last_mut().unwrap() ^= 1;
    a.load_metadata(&md.encode().unwrap()).unwrap();
    // The region's address and length are the same in both metadata.
    let (local, target) = (one(src.whole()), one(remote(&a, "b-key", &dst)));
    let write = || a.write(&local, "b-key", &target, None);
    let e = bounded("write with a wrong key", write())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
    assert!(e.to_string().contains("could not confirm"), "{e}");
    // The engine moved the bytes; only the confirmation was refused.
    assert_eq!(dst.to_vec().unwrap(), vec![3u8; 4096]);
    // With the registration's own metadata the same transfer is confirmed.
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    bounded("write with the key", write()).await.unwrap();
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
    no_misuse();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_touches_memory_after_deregister_returned() {
    // A READ fails (stall bound) while its operation is still in the engine, which
    // will yet write the destination when it finishes. Deregistering that memory
    // must not return Ok while the engine may still touch it: it is refused until
    // the engine is done, and once it returns Ok the memory region is gone from the
    // engine and no operation writes the memory any more.
    let (a, ab) = agent_with(
        "a-dereg",
        UcclOptions {
            stall_timeout: Duration::from_millis(300),
            ..options()
        },
    )
    .await;
    let (b, bb) = agent("b-dereg").await;
    let dst = a.register(vec![0u8; 4096]).unwrap();
    let src = b.register(vec![9u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let (a_meta, b_meta) = (ab.engine_metadata().unwrap(), bb.engine_metadata().unwrap());
    test_double::delay_operations(&b_meta, true);
    let e = bounded(
        "delayed read",
        a.read(
            &one(dst.whole()),
            "b-dereg",
            &one(remote(&a, "b-dereg", &src)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert_eq!(test_double::operations_in_flight(&a_meta), 1);
    match a.deregister(&dst) {
        Err(e) if e.kind() == ErrorKind::NotAllowed => {
            // Refused, and nothing changed.
            assert!(dst.is_registered());
            assert_eq!(test_double::registrations(&a_meta), 1);
            // The engine finishes the operation while the memory is registered.
            assert_eq!(test_double::finish_delayed(&b_meta), 1);
            assert_eq!(dst.to_vec().unwrap(), vec![9u8; 4096]);
            assert!(
                test_double::wait_until(HANG, || dst.inflight() == 0),
                "still in flight after the engine was done"
            );
            a.deregister(&dst).unwrap();
        }
        Ok(()) => {}
        Err(e) => panic!("deregister: {e}"),
    }
    // Deregister returned Ok: the memory region is gone from the engine, and
    // nothing the engine still had writes the memory.
    let before = dst.to_vec().unwrap();
    assert_eq!(
        test_double::registrations(&a_meta),
        0,
        "deregister returned Ok while the memory region stayed registered with the engine"
    );
    assert_eq!(
        test_double::operations_in_flight(&a_meta),
        0,
        "deregister returned Ok while an operation on the memory was still in the engine"
    );
    test_double::finish_delayed(&b_meta);
    assert_eq!(
        dst.to_vec().unwrap(),
        before,
        "an operation wrote the memory after deregister returned Ok"
    );
    let r = a.shutdown().await;
    assert!(r.is_clean(), "{r:?}");
    let _ = b.shutdown().await;
    no_misuse();
}

/// `info` with its control listener moved to `control` (connection info version 3:
/// the version byte, then the control and engine addresses, each after its length
/// as a little-endian u16).
fn with_control(info: &[u8], control: &str) -> Vec<u8> {
    assert_eq!(info[0], 3, "connection info version");
    let n = u16::from_le_bytes([info[1], info[2]]) as usize;
    let engine = &info[3 + n..];
    let mut out = vec![3];
    out.extend_from_slice(&(control.len() as u16).to_le_bytes());
    out.extend_from_slice(control.as_bytes());
    out.extend_from_slice(engine);
    out
}

/// A link the agent closes (the peer moved or was forgotten) while it still
/// connects fails its connect at once with `RemoteDisconnected` and the agent's
/// reason (so do the notifications queued behind it), not at the connect timeout
/// (set beyond the hang bound here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_closed_while_it_connects_fails_its_connect_at_once() {
    let mut o = options();
    o.listener.connect_timeout = 4 * HANG;
    let (a, b) = agent_with("a", o).await;
    // A peer whose control listener accepts and never answers.
    let (silent, quiet) = nixl_testkit::silent_listener().await;
    let info = with_control(&b.connection_info(), &silent.to_string());
    let link = b.link("p", &info).unwrap();
    let mut connect = Box::pin(link.connect());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut connect)
            .await
            .is_err(),
        "the silent peer let the connect finish"
    );
    link.close("the peer moved");
    let e = bounded("the connect", connect).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    assert!(e.to_string().contains("the peer moved"), "{e}");
    quiet.abort();
    let _ = a.shutdown().await;
}

/// The same while the link's engine connection is being made (UCCL's connect
/// blocked inside the engine): the transfer waiting on it fails at once when the
/// peer is forgotten, and the connection UCCL makes later is closed unused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_closed_while_its_engine_connects_fails_its_transfer_at_once() {
    let mut o = options();
    o.listener.connect_timeout = 4 * HANG;
    let (a, _) = agent_with("a-closing", o).await;
    let (b, bb) = agent("b-closing").await;
    let (t, _regs) = write_to_a_held_engine(&a, &b, &bb, "b-closing");
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.forget_peer("b-closing").unwrap();
    let e = bounded("the transfer", t).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    test_double::hold_accepts(&bb.engine_metadata().unwrap(), false);
    let _ = b.shutdown().await;
    let _ = a.shutdown().await;
    no_misuse();
}
