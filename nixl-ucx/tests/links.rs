//! nixl-ucx's links as the agent makes and replaces them: a load that another backend
//! refuses after nixl-ucx made its new link leaves the peer's current connection
//! working (making a link never disturbs the current one), and a load that goes
//! through moves every use to the new connection.
//!
//! Needs libucp at run time; without it the test prints a SKIP line. With UCX
//! 1.13-1.22 and shared memory, export `UCX_POSIX_ERROR_HANDLING=y
//! UCX_SYSV_ERROR_HANDLING=y` (scripts/test does).

use std::sync::{Arc, Barrier, Mutex};

use nixl::{Agent, Bytes, ErrorKind, Op, PeerLink, RequestOptions, Result};
use nixl_testkit::double::{self, one, Double, NullLink};
use nixl_testkit::{bounded, remote};
use nixl_ucx::UcxOptions;

mod common;

/// A second backend whose connection info is its agent's name, refusing the info
/// `"refused"`: it turns a load away after nixl-ucx made its link. Its `link` can
/// be held on a barrier, so the test acts while the load is in progress.
#[derive(Debug)]
struct Refuser(&'static str, Arc<Mutex<Option<Arc<Barrier>>>>);

impl Double for Refuser {
    fn name(&self) -> &str {
        "refuser"
    }
    fn capabilities(&self) -> nixl::Capabilities {
        nixl::Capabilities::default()
    }
    fn connection_info(&self) -> Bytes {
        Bytes::from_static(self.0.as_bytes())
    }
    fn link(&self, _peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        let held = self.1.lock().unwrap().take();
        if let Some(barrier) = held {
            barrier.wait(); // nixl-ucx made its link; the test posts meanwhile
            barrier.wait();
        }
        if conn_info == b"refused" {
            return Err(nixl::Error::new(
                ErrorKind::Corrupt,
                "link",
                "refused connection info (test double)",
            ));
        }
        Ok(Arc::new(NullLink))
    }
}

async fn agent(
    test: &str,
    name: &str,
    refuser: &'static str,
    hold: &Arc<Mutex<Option<Arc<Barrier>>>>,
) -> Option<Agent> {
    let ucx = common::backend(test, UcxOptions::default())?;
    // nixl-ucx first: its link is made before the refuser's.
    let a = (common::builder(name, &ucx))
        .backend(double::backend(Refuser(refuser, hold.clone())))
        .build()
        .await
        .unwrap();
    Some(a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_load_leaves_the_current_connection_and_an_accepted_one_moves() {
    const TEST: &str = "a_refused_load_leaves_the_current_connection_and_an_accepted_one_moves";
    let hold = Arc::new(Mutex::new(None));
    let Some(a) = agent(TEST, "a", "a", &hold).await else {
        return;
    };
    let b = agent(TEST, "b", "b", &hold).await.unwrap();
    let src = a.register(vec![7u8; 4096]).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let far = remote(&a, "b", dst.id());
    let req = a
        .create_request(
            Op::Write,
            &one(src.desc(0, 4096)),
            "b",
            &one(far.desc(0, 4096)),
            &RequestOptions::default(),
        )
        .unwrap();
    bounded("a write to b", req.post(None).unwrap())
        .await
        .unwrap();

    // "b" restarts as another agent whose second backend's info is refused: nixl-ucx
    // makes a connection for the new instance, and must not let the old one go,
    // neither while the load is in progress nor after it was refused.
    let b2 = agent(TEST, "b", "refused", &hold).await.unwrap();
    let dst2 = b2.register(vec![0u8; 4096]).unwrap();
    let barrier = Arc::new(Barrier::new(2));
    *hold.lock().unwrap() = Some(barrier.clone());
    let load = {
        let (a, md) = (a.clone(), b2.metadata().unwrap());
        std::thread::spawn(move || a.load_metadata(&md))
    };
    tokio::task::block_in_place(|| barrier.wait());
    let during = bounded("the old request during the load", req.post(None).unwrap()).await;
    tokio::task::block_in_place(|| barrier.wait());
    during.expect("the current connection works while a load is in progress");
    let e = load.join().unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    bounded(
        "the old request after a refused load",
        req.post(None).unwrap(),
    )
    .await
    .expect("the current connection still works");
    bounded("a notification", a.notify("b", "still here").unwrap())
        .await
        .unwrap();

    // The restart that loads: the new instance gets the writes, the old request is
    // refused (a new generation).
    let b3 = agent(TEST, "b", "b3", &hold).await.unwrap();
    let dst3 = b3.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b3.metadata().unwrap()).unwrap();
    assert_eq!(
        req.post(None).unwrap_err().kind(),
        ErrorKind::StaleGeneration
    );
    let far3 = remote(&a, "b", dst3.id());
    let t = a
        .transfer(
            Op::Write,
            &one(src.desc(0, 4096)),
            "b",
            &one(far3.desc(0, 4096)),
            None,
        )
        .unwrap();
    bounded("a write to the new instance", t).await.unwrap();
    assert_eq!(dst3.to_vec().unwrap(), vec![7u8; 4096]);
    drop(dst2);
    for x in [a, b, b2, b3] {
        let _ = x.shutdown().await;
    }
}

/// A peer that restarts and speaks first (its HELLO reaches this agent while the
/// old instance's connection is still the current one) hears this agent's BYE at
/// shutdown, though this agent never sent to the new instance: the HELLO counts
/// once the new instance's connection takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_that_spoke_first_hears_goodbye() {
    const TEST: &str = "a_restarted_peer_that_spoke_first_hears_goodbye";
    let Some((us, _)) = common::agent(TEST, "us", UcxOptions::default()).await else {
        return;
    };
    let (p1, _) = common::agent(TEST, "p", UcxOptions::default())
        .await
        .unwrap();
    us.load_metadata(&p1.metadata().unwrap()).unwrap();
    let _ = p1.shutdown().await;

    let (p2, _) = common::agent(TEST, "p", UcxOptions::default())
        .await
        .unwrap();
    p2.load_metadata(&us.metadata().unwrap()).unwrap();
    let mut notes = us.notifications().unwrap();
    bounded(
        "the new instance's notification",
        p2.notify("us", "hi").unwrap(),
    )
    .await
    .unwrap();
    let n = bounded("its delivery", notes.recv()).await.unwrap();
    assert_eq!((n.peer.as_str(), &n.msg[..]), ("p", &b"hi"[..]));
    us.load_metadata(&p2.metadata().unwrap()).unwrap();
    let report = us.shutdown().await;
    assert!(report.is_clean(), "{report:?}");

    // The BYE reaches p2's driver after `shutdown` returned; until it is read a
    // notification may still be sent (into a worker that is gone).
    let e = bounded("p2 hears goodbye", async {
        loop {
            match p2.notify("us", "after").unwrap().await {
                Ok(()) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
                Err(e) => break e,
            }
        }
    })
    .await;
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    assert!(e.to_string().contains("shut down"), "told why: {e}");
    let _ = p2.shutdown().await;
}
