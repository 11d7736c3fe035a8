//! nixl-verbs' own lifecycle rules, on the verbs **test double** (no NIC): the
//! completion queue is never promised to more queue pairs than it holds (an overflow
//! is fatal to a real device), options are checked before anything opens, and a
//! link closed while it connects says it was closed.

use std::time::Duration;

use nixl::{Agent, Backend, DescList, ErrorKind, MemKind};
use nixl_verbs::wire::ConnInfo;
use nixl_verbs::{VerbsBackend, VerbsOptions};

use common::agent_with as agent;

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_pairs_beyond_the_completion_queue_are_refused() {
    // The double grants 128-entry send queues: one peer fits in 150 entries, two
    // do not.
    let small = VerbsOptions {
        cq_depth: 150,
        ..VerbsOptions::default()
    };
    let a = agent("a", small).await;
    let b = agent("b", VerbsOptions::default()).await;
    let c = agent("c", VerbsOptions::default()).await;
    let src = a.register(vec![1u8; 4096]).unwrap();
    for peer in [&b, &c] {
        a.load_metadata(&peer.metadata().unwrap()).unwrap();
    }
    a.connect("b").await.unwrap();
    let e = a.connect("c").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}");
    assert!(e.to_string().contains("cq_depth"), "{e}");
    // The first connection still works.
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let r = a
        .remote_regions("b")
        .unwrap()
        .into_iter()
        .find(|r| r.id == dst.id())
        .unwrap();
    a.write(
        &DescList::from_descs(MemKind::Dram, [src.whole()]),
        "b",
        &DescList::from_descs(MemKind::Dram, [r.desc(0, 4096)]),
        None,
    )
    .await
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![1u8; 4096]);
    for x in [a, b, c] {
        assert!(x.shutdown().await.is_clean());
    }
}

#[test]
fn bad_options_are_refused_before_anything_opens() {
    for (o, needle) in [
        (
            VerbsOptions {
                mtu: 1500,
                ..VerbsOptions::default()
            },
            "MTU 1500",
        ),
        (
            VerbsOptions {
                qps_per_peer: 0,
                ..VerbsOptions::default()
            },
            "qps_per_peer",
        ),
        (
            VerbsOptions {
                reliability: nixl_verbs::plan::Reliability {
                    timeout: 40,
                    ..Default::default()
                },
                ..VerbsOptions::default()
            },
            "timeout 40",
        ),
    ] {
        let e = VerbsBackend::with_test_double(o).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains(needle), "{e}");
    }
}

/// A link the agent closes (the peer moved or was forgotten) while it still
/// connects fails its connect with `RemoteDisconnected` and the agent's reason, as
/// everything else waiting on it does, not with the cancellation closing causes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_closed_while_it_connects_says_it_was_closed() {
    const HANG: Duration = Duration::from_secs(30);
    let vb = VerbsBackend::with_test_double(VerbsOptions::default()).unwrap();
    let a = Agent::builder("a")
        .backend(vb.clone())
        .build()
        .await
        .unwrap();
    // A peer whose control listener accepts and never answers.
    let (silent, quiet) = nixl_testkit::silent_listener().await;
    let mut info = ConnInfo::decode(&vb.connection_info()).unwrap();
    info.control = silent;
    let link = vb.link("p", &info.encode()).unwrap();
    let mut connect = Box::pin(link.connect());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut connect)
            .await
            .is_err(),
        "the silent peer let the connect finish"
    );
    link.close("the peer moved");
    // The connect's own task sees its cancellation meanwhile.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let e = tokio::time::timeout(HANG, connect)
        .await
        .expect("the connect ended when the link closed")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    assert!(e.to_string().contains("the peer moved"), "{e}");
    quiet.abort();
    let _ = a.shutdown().await;
}
