//! Over TCP, small requests are written from the submitting thread while the
//! connection is idle and queue behind the writer task otherwise. Many requests at
//! once fill the socket buffer, so both paths and the hand-over between them (a
//! frame partly written here, finished by the writer) run; every byte must land
//! and notifications must arrive in the order the requests were posted.

use std::time::Duration;

use futures_util::future::join_all;
use futures_util::StreamExt;
use nixl::{Agent, AgentOptions, DescList, MemKind};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};

async fn agent(name: &str) -> Agent {
    let b = TcpBackend::with_options(TcpOptions {
        same_host: SameHost::Off,
        ..TcpOptions::default()
    });
    Agent::builder(name)
        .backend(b)
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap()
}

fn pattern(seed: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed as u8))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_small_requests_keeps_bytes_and_order() {
    // Sizes around the inline bound (64 KiB frames), and below it.
    const SIZES: [usize; 4] = [4096, 40_000, 65_000, 70_000];
    const N: usize = 400;
    let slot = 72 * 1024;
    let a = agent("a").await;
    let b = agent("b").await;
    let src = a.register(vec![0u8; N * slot]).unwrap();
    let dst = b.register(vec![0u8; N * slot]).unwrap();
    let sizes: Vec<usize> = (0..N).map(|i| SIZES[i % SIZES.len()]).collect();
    for (i, &n) in sizes.iter().enumerate() {
        src.write_at(i * slot, &pattern(i, n)).unwrap();
    }
    let peer = a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.connect(&peer).await.unwrap();
    let remote = a.remote_regions(&peer).unwrap()[0].clone();
    let mut notes = b.notifications().unwrap();

    // Every third request is a READ of what an earlier WRITE of the burst put there:
    // it is posted after that WRITE, so it must see its bytes.
    let back = a.register(vec![0u8; N * slot]).unwrap();
    let transfers = sizes.iter().enumerate().map(|(i, &n)| {
        let at = (i * slot) as u64;
        let (a, peer, remote) = (&a, &peer, &remote);
        let local = DescList::from_descs(MemKind::Dram, [src.desc((i * slot) as u64, n as u64)]);
        let far = DescList::from_descs(MemKind::Dram, [remote.desc(at, n as u64)]);
        let read_local =
            DescList::from_descs(MemKind::Dram, [back.desc((i * slot) as u64, n as u64)]);
        async move {
            a.write(&local, peer, &far, Some(format!("{i}").into()))
                .await
                .map_err(|e| format!("WRITE {i}: {e}"))?;
            if i % 3 == 0 {
                a.read(&read_local, peer, &far, None)
                    .await
                    .map_err(|e| format!("READ {i}: {e}"))?;
            }
            Ok::<_, String>(())
        }
    });
    let results = tokio::time::timeout(Duration::from_secs(60), join_all(transfers))
        .await
        .expect("the burst finishes within 60 s");
    for r in results {
        r.unwrap();
    }
    for (i, &n) in sizes.iter().enumerate() {
        let mut got = vec![0u8; n];
        dst.read_at(i * slot, &mut got).unwrap();
        assert!(got == pattern(i, n), "WRITE {i} ({n} B) landed wrong");
        if i % 3 == 0 {
            back.read_at(i * slot, &mut got).unwrap();
            assert!(got == pattern(i, n), "READ {i} ({n} B) came back wrong");
        }
    }
    for i in 0..N {
        let note = tokio::time::timeout(Duration::from_secs(10), notes.next())
            .await
            .expect("a notification within 10 s")
            .expect("the stream is open");
        assert_eq!(
            &note.msg[..],
            format!("{i}").as_bytes(),
            "notification order"
        );
    }
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
