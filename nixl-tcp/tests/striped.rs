//! Large transfers over TCP split across several connections to one peer
//! (`TcpOptions::connections`): the pieces really travel on separate connections,
//! every byte lands where one connection would put it (cuts inside blocks of strided
//! lists included), notifications keep posting order and follow all of their
//! transfer's data, and a request the target refuses is refused whole.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::StreamExt;
use nixl::metadata::AgentMetadata;
use nixl::{Agent, AgentOptions, Backend, DescList, ErrorKind, MemKind, Op};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};
use nixl_testkit::double::one;

const CONNECTIONS: usize = 3;

async fn agent(name: &str) -> (Agent, TcpBackend) {
    let b = TcpBackend::with_options(TcpOptions {
        same_host: SameHost::Off,
        connections: CONNECTIONS,
        stripe_min: 64 * 1024,
        ..TcpOptions::default()
    });
    let agent = Agent::builder(name)
        .backend(b.clone())
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    (agent, b)
}

fn pattern(seed: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed as u8) ^ (i >> 12) as u8)
        .collect()
}

/// Established TCP connections whose remote end is `to` (as the kernel lists them).
fn connections_to(to: SocketAddr) -> usize {
    let port = format!(":{:04X}", to.port());
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[2].ends_with(&port) && f[3] == "01"
        })
        .count()
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 30 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfers_move_over_several_connections_in_order() {
    let (a, ab) = agent("a").await;
    let (b, bb) = agent("b").await;
    let target = bb.local_addr().unwrap();
    // 100 blocks of 31 KiB + 7 at a 40 KiB stride on both sides: cuts fall inside
    // blocks, and the gaps between blocks must stay untouched.
    let (block, stride, blocks) = (31 * 1024 + 7, 40 * 1024, 100);
    let span = stride * blocks;
    let src = a.register(pattern(1, span)).unwrap();
    let dst = b.register(vec![0u8; span + 4096]).unwrap();
    let back = a.register(vec![0u8; span]).unwrap();
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.connect(&peer).await.unwrap();
    assert_eq!(
        connections_to(target),
        1,
        "one connection until a large transfer"
    );
    let path = ab.data_path(&peer).unwrap_or_default();
    assert!(path.contains("3 connections per peer"), "{path}");
    let remote = a.remote_regions(&peer).unwrap()[0].clone();
    let list = |r: &dyn Fn(u64) -> nixl::Desc| {
        DescList::from_descs(
            MemKind::Dram,
            (0..blocks as u64).map(|i| r(i * stride as u64)),
        )
    };
    let local = list(&|o| src.desc(o, block as u64));
    let far = list(&|o| remote.desc(o, block as u64));
    let mut notes = b.notifications().unwrap();

    // The large WRITE, then a small one posted before the first is done: the
    // notifications come in posting order, each after its data.
    let big = a
        .transfer(Op::Write, &local, &peer, &far, Some("big".into()))
        .unwrap();
    let small = a
        .transfer(
            Op::Write,
            &one(src.desc(0, 4096)),
            &peer,
            &one(remote.desc(span as u64, 4096)),
            Some("small".into()),
        )
        .unwrap();
    let first = bounded("first notification", notes.next()).await.unwrap();
    assert_eq!(&first.msg[..], b"big", "notifications keep posting order");
    let mut got = vec![0u8; span];
    dst.read_at(0, &mut got).unwrap();
    let want = pattern(1, span);
    for i in 0..blocks {
        let (at, gap) = (i * stride, i * stride + block);
        assert!(
            got[at..gap] == want[at..gap],
            "block {i} complete at its notification"
        );
        assert!(
            got[gap..at + stride].iter().all(|&x| x == 0),
            "gap after block {i} untouched"
        );
    }
    let second = bounded("second notification", notes.next()).await.unwrap();
    assert_eq!(&second.msg[..], b"small");
    bounded("big", big).await.unwrap();
    bounded("small", small).await.unwrap();
    assert_eq!(
        connections_to(target),
        CONNECTIONS,
        "the large transfer opened the other connections"
    );

    // READ it back the same way, with a notification to the target.
    let back_list = list(&|o| back.desc(o, block as u64));
    bounded("read", a.read(&back_list, &peer, &far, Some("read".into())))
        .await
        .unwrap();
    let note = bounded("read notification", notes.next()).await.unwrap();
    assert_eq!(&note.msg[..], b"read");
    let mut got = vec![0u8; span];
    back.read_at(0, &mut got).unwrap();
    for i in 0..blocks {
        let (at, gap) = (i * stride, i * stride + block);
        assert!(got[at..gap] == want[at..gap], "block {i} read back");
    }

    // One 5 MiB + 1 block: cut inside the block, page-aligned.
    let n = 5 * 1024 * 1024 + 1;
    let whole_src = a.register(pattern(7, n)).unwrap();
    let whole_dst = b.register(vec![0u8; n]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let r = a
        .remote_regions(&peer)
        .unwrap()
        .into_iter()
        .find(|r| r.id == whole_dst.id())
        .unwrap();
    bounded(
        "one block",
        a.write(
            &one(whole_src.whole()),
            &peer,
            &one(r.desc(0, n as u64)),
            None,
        ),
    )
    .await
    .unwrap();
    assert!(
        whole_dst.to_vec().unwrap() == pattern(7, n),
        "one large block"
    );
    assert_eq!(connections_to(target), CONNECTIONS, "connections are kept");
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_writes_no_piece() {
    let (a, _) = agent("a").await;
    let (b, _) = agent("b").await;
    let n = 1 << 20;
    let src = a.register(pattern(3, 2 * n)).unwrap();
    let dst = b.register(vec![0u8; n]).unwrap();
    // Metadata that claims the registration twice as long as it is: only the
    // target's own check stands between the request and memory past its end.
    let mut md = AgentMetadata::decode(&b.metadata().unwrap()).unwrap();
    for r in &mut md.regions {
        r.len *= 2;
    }
    let peer = a.load_metadata(&md.encode().unwrap()).unwrap();
    a.connect(&peer).await.unwrap();
    let remote = a.remote_regions(&peer).unwrap()[0].clone();
    let e = bounded(
        "overrun",
        a.write(
            &one(src.desc(0, 2 * n as u64)),
            &peer,
            &one(remote.desc(0, 2 * n as u64)),
            Some("never".into()),
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    assert!(
        dst.to_vec().unwrap().iter().all(|&x| x == 0),
        "the pieces inside the registration were refused too"
    );
    let back = a.register(vec![0u8; 2 * n]).unwrap();
    let e = bounded(
        "overrun read",
        a.read(
            &one(back.desc(0, 2 * n as u64)),
            &peer,
            &one(remote.desc(0, 2 * n as u64)),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    assert!(
        back.to_vec().unwrap().iter().all(|&x| x == 0),
        "nothing read"
    );
    let mut notes = b.notifications().unwrap();
    // The connections still work, and the refused WRITE's notification never came.
    bounded(
        "a good write after",
        a.write(
            &one(src.desc(0, n as u64)),
            &peer,
            &one(remote.desc(0, n as u64)),
            Some("good".into()),
        ),
    )
    .await
    .unwrap();
    let note = bounded("notification", notes.next()).await.unwrap();
    assert_eq!(&note.msg[..], b"good");
    assert!(dst.to_vec().unwrap() == pattern(3, n));
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// A peer that goes away while split transfers (with notifications) are in flight:
/// each fails as a peer that is gone, never as a request the backend dropped, however
/// the pieces and the first connection's writer race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_transfers_to_a_vanishing_peer_fail_as_disconnected() {
    for round in 0..20 {
        let (a, _) = agent("a").await;
        let (b, _) = agent("b").await;
        let n = 4 << 20;
        let src = a.register(pattern(round, n)).unwrap();
        let dst = b.register(vec![0u8; n]).unwrap();
        let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
        a.connect(&peer).await.unwrap();
        let remote = a.remote_regions(&peer).unwrap()[0].clone();
        let transfers: Vec<_> = (0..4)
            .map(|i| {
                a.transfer(
                    if i % 2 == 0 { Op::Write } else { Op::Read },
                    &one(src.whole()),
                    &peer,
                    &one(remote.desc(0, n as u64)),
                    Some(format!("{i}").into()),
                )
                .unwrap()
            })
            .collect();
        // Let some pieces start, then the target goes.
        tokio::time::sleep(std::time::Duration::from_micros(200 * round as u64)).await;
        drop(b);
        for t in transfers {
            if let Err(e) = bounded("transfer to a vanished peer", t).await {
                assert!(
                    e.kind() == ErrorKind::RemoteDisconnected
                        && !e.to_string().contains("without completing"),
                    "round {round}: {e}"
                );
            }
        }
        let _ = a.shutdown().await;
        drop(dst);
    }
}
