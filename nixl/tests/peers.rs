//! Loading peers' metadata: what the agent and its backends believe after a backend
//! refuses, and that a load does not stop transfers to other peers.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use nixl::{
    Agent, Bytes, Capabilities, Completer, ErrorKind, Op, PeerLink, PreparedTransfer, RegionRef,
    RequestOptions, Result, TransferPlan,
};
use nixl_testkit::double::{one, refused, shared, Double};

/// A test double of a transport that keeps a ledger of the links it made (peer and
/// connection info, open or closed), refuses connection info it is told to, can
/// hold `link` until a barrier opens, and completes every transfer at once without
/// moving data, failing it when its link was closed.
#[derive(Debug)]
struct Ledger {
    name: &'static str,
    info: Mutex<Vec<u8>>,
    links: Mutex<Vec<Arc<LedgerLink>>>,
    refuse: Mutex<Option<Vec<u8>>>,
    hold: Mutex<Option<(String, Arc<Barrier>)>>,
    /// Holds the next `prepare` until the barrier opens twice.
    hold_prepare: Mutex<Option<Arc<Barrier>>>,
}

#[derive(Debug)]
struct LedgerLink {
    peer: String,
    info: Vec<u8>,
    closed: AtomicBool,
    /// What the link says when asked whether it failed for good.
    failed: AtomicBool,
}

#[async_trait]
impl PeerLink for LedgerLink {
    async fn connect(&self) -> Result<()> {
        Ok(())
    }
    fn notify(&self, _msg: Bytes, done: Completer) {
        done.complete(Ok(()));
    }
    fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }
    fn close(&self, _why: &str) {
        self.closed.store(true, Ordering::SeqCst);
    }
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

impl Ledger {
    fn new(name: &'static str, info: &[u8]) -> Arc<Self> {
        Arc::new(Self {
            name,
            info: Mutex::new(info.to_vec()),
            links: Mutex::new(Vec::new()),
            refuse: Mutex::new(None),
            hold: Mutex::new(None),
            hold_prepare: Mutex::new(None),
        })
    }

    /// The connection info of `peer`'s open link; panics if it has more than one.
    fn knows(&self, peer: &str) -> Option<Vec<u8>> {
        let links = self.links.lock().unwrap();
        let open: Vec<_> = (links.iter())
            .filter(|l| l.peer == peer && !l.closed.load(Ordering::SeqCst))
            .collect();
        assert!(open.len() <= 1, "{peer:?} has {} open links", open.len());
        open.first().map(|l| l.info.clone())
    }
}

/// Posts fail once the link they were prepared on is closed.
#[derive(Debug)]
struct Done(Arc<LedgerLink>);

impl PreparedTransfer for Done {
    fn post(&self, _notif: Option<Bytes>, done: Completer) {
        done.complete(if self.0.closed.load(Ordering::SeqCst) {
            Err(nixl::Error::new(
                ErrorKind::RemoteDisconnected,
                "post",
                "the link is closed (test double)",
            ))
        } else {
            Ok(())
        });
    }
}

#[async_trait]
impl Double for Ledger {
    fn name(&self) -> &str {
        self.name
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: true,
            dram: true,
            ..Capabilities::default()
        }
    }
    fn connection_info(&self) -> Bytes {
        Bytes::from(self.info.lock().unwrap().clone())
    }
    fn register(&self, _region: &RegionRef) -> Result<Bytes> {
        Ok(Bytes::from_static(b"key"))
    }
    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        let held = self.hold.lock().unwrap().clone();
        if let Some((p, barrier)) = held {
            if p == peer {
                barrier.wait(); // the test posts meanwhile
                barrier.wait();
            }
        }
        if self.refuse.lock().unwrap().as_deref() == Some(conn_info) {
            return Err(nixl::Error::new(
                ErrorKind::Backend,
                "link",
                "this connection info is refused (test double)",
            ));
        }
        let link = Arc::new(LedgerLink {
            peer: peer.to_owned(),
            info: conn_info.to_vec(),
            closed: AtomicBool::new(false),
            failed: AtomicBool::new(false),
        });
        self.links.lock().unwrap().push(link.clone());
        Ok(link)
    }
    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        let peer = plan.peer.expect("a transfer to a peer");
        let held = self.hold_prepare.lock().unwrap().take();
        if let Some(barrier) = held {
            barrier.wait(); // the test reloads the peer meanwhile
            barrier.wait();
        }
        let link: Arc<LedgerLink> = nixl::kit::link_of(&peer.link, "prepare")?;
        if link.closed.load(Ordering::SeqCst) {
            return Err(nixl::Error::new(
                ErrorKind::RemoteDisconnected,
                "prepare",
                "the link is closed (test double)",
            ));
        }
        Ok(Box::new(Done(link)))
    }
    /// Closes every link it made, as a backend's `LinkSet` does.
    async fn shutdown(&self, _timeout: Duration) -> Result<()> {
        for l in self.links.lock().unwrap().iter() {
            l.close("the backend stopped");
        }
        Ok(())
    }
}

async fn agent(name: &str, backends: &[&Arc<Ledger>]) -> Agent {
    let mut b = Agent::builder(name);
    for l in backends {
        b = b.backend(shared(Arc::clone(l)));
    }
    b.build().await.unwrap()
}

/// A request from `a` to `peer`'s first region.
fn request(a: &Agent, peer: &str, src: &nixl::Registration) -> nixl::XferRequest {
    let rd = a.remote_regions(peer).unwrap()[0].clone();
    a.create_request(
        Op::Write,
        &one(src.desc(0, 64)),
        peer,
        &one(rd.desc(0, 64)),
        &RequestOptions::default(),
    )
    .unwrap()
}

#[tokio::test]
async fn a_refused_load_leaves_the_old_peer_whole_in_the_agent_and_its_backends() {
    let (first, second) = (Ledger::new("first", b"a1"), Ledger::new("second", b"a2"));
    let a = agent("a", &[&first, &second]).await;
    let src = a.register(vec![1u8; 64]).unwrap();

    let (b_first, b_second) = (Ledger::new("first", b"b1"), Ledger::new("second", b"b2"));
    let b = agent("b", &[&b_first, &b_second]).await;
    let _dst = b.register(vec![0u8; 64]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    assert_eq!(first.knows("b").as_deref(), Some(&b"b1"[..]));
    assert_eq!(second.knows("b").as_deref(), Some(&b"b2"[..]));
    let req = request(&a, "b", &src);
    req.post(None).unwrap().await.unwrap();
    let regions = a.remote_regions("b").unwrap();

    // "b" restarts with new connection info, which a's second backend refuses after
    // its first one took it.
    let b2_first = Ledger::new("first", b"b1-new");
    let b2_second = Ledger::new("second", b"bad");
    let b2 = agent("b", &[&b2_first, &b2_second]).await;
    let _dst2 = b2.register(vec![0u8; 128]).unwrap();
    *second.refuse.lock().unwrap() = Some(b"bad".to_vec());
    refused(
        a.load_metadata(&b2.metadata().unwrap()),
        ErrorKind::Backend,
        "",
    );

    // The agent still knows the old "b", and the request made for it still posts.
    assert_eq!(a.remote_regions("b").unwrap(), regions);
    req.post(None).unwrap().await.unwrap();
    // The link the first backend made before the refusal is closed; the old ones
    // stay open.
    assert_eq!(first.knows("b").as_deref(), Some(&b"b1"[..]));
    assert_eq!(second.knows("b").as_deref(), Some(&b"b2"[..]));

    // A restart that loads: the new instance gets new links, the old ones close,
    // and the request made for the old instance is refused.
    *second.refuse.lock().unwrap() = None;
    a.load_metadata(&b2.metadata().unwrap()).unwrap();
    assert_eq!(first.knows("b").as_deref(), Some(&b"b1-new"[..]));
    assert_eq!(second.knows("b").as_deref(), Some(&b"bad"[..]));
    refused(req.post(None), ErrorKind::StaleGeneration, "");

    // A peer never seen before, refused: no backend keeps it.
    *second.refuse.lock().unwrap() = Some(b"bad".to_vec());
    let c_first = Ledger::new("first", b"c1");
    let c_second = Ledger::new("second", b"bad");
    let c = agent("c", &[&c_first, &c_second]).await;
    assert!(a.load_metadata(&c.metadata().unwrap()).is_err());
    assert_eq!(first.knows("c"), None);
    assert!(a.remote_regions("c").is_err());
    for x in [a, b, b2, c] {
        let _ = x.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_in_progress_does_not_stop_posts_to_other_peers() {
    let (first, b_first, s_first) = (
        Ledger::new("first", b"a1"),
        Ledger::new("first", b"b1"),
        Ledger::new("first", b"s1"),
    );
    let a = agent("a", &[&first]).await;
    let b = agent("b", &[&b_first]).await;
    let slow = agent("slow", &[&s_first]).await;
    let src = a.register(vec![1u8; 64]).unwrap();
    let _dst = b.register(vec![0u8; 64]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let req = request(&a, "b", &src);

    // Loading "slow" stops inside a's backend until the test has posted to "b".
    let barrier = Arc::new(Barrier::new(2));
    *first.hold.lock().unwrap() = Some(("slow".to_owned(), barrier.clone()));
    let md = slow.metadata().unwrap();
    let loader = {
        let a = a.clone();
        std::thread::spawn(move || a.load_metadata(&md))
    };
    let b2 = barrier.clone();
    let posted = tokio::task::spawn_blocking(move || {
        b2.wait(); // the load is inside link
        let ok = req.post(None).is_ok();
        b2.wait(); // let the load finish
        ok
    });
    let posted = tokio::time::timeout(Duration::from_secs(20), posted)
        .await
        .expect("a post waited for a load of another peer")
        .unwrap();
    assert!(posted, "the post failed while another peer loaded");
    assert_eq!(loader.join().unwrap().unwrap(), "slow");
    for x in [a, b, slow] {
        let _ = x.shutdown().await;
    }
}

#[tokio::test]
async fn a_link_is_kept_while_its_info_stays_and_made_again_once_it_failed() {
    let first = Ledger::new("first", b"a1");
    let a = agent("a", &[&first]).await;
    let b_first = Ledger::new("first", b"b1");
    let b = agent("b", &[&b_first]).await;
    let dst = b.register(vec![0u8; 64]).unwrap();
    let md = b.metadata().unwrap();
    a.load_metadata(&md).unwrap();
    a.load_metadata(&md).unwrap();
    assert_eq!(
        first.links.lock().unwrap().len(),
        1,
        "the same info keeps its link"
    );

    // A link that failed for good is replaced at the next load, and closed.
    first.links.lock().unwrap()[0]
        .failed
        .store(true, Ordering::SeqCst);
    a.load_metadata(&md).unwrap();
    {
        let links = first.links.lock().unwrap();
        assert_eq!(links.len(), 2);
        assert!(
            links[0].closed.load(Ordering::SeqCst),
            "the failed link is closed"
        );
        assert!(!links[1].closed.load(Ordering::SeqCst));
    }
    assert_eq!(first.knows("b").as_deref(), Some(&b"b1"[..]));

    // The peer moves (partial metadata of the same instance with new connection
    // info): a new link, the old one closed, and a request prepared on the old one
    // is refused as stale rather than posted on a closed link.
    let src = a.register(vec![1u8; 64]).unwrap();
    let req = request(&a, "b", &src);
    req.post(None).unwrap().await.unwrap();
    *b_first.info.lock().unwrap() = b"b1-moved".to_vec();
    a.load_metadata(
        &b.partial_metadata(std::slice::from_ref(&dst), true)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first.knows("b").as_deref(), Some(&b"b1-moved"[..]));
    refused(req.post(None), ErrorKind::StaleGeneration, "");
    request(&a, "b", &src).post(None).unwrap().await.unwrap();

    // Forgetting the peer closes its link.
    a.forget_peer("b").unwrap();
    assert_eq!(first.knows("b"), None);
    for x in [a, b] {
        let _ = x.shutdown().await;
    }
}

/// A load racing the agent's shutdown either finishes before the backends stop (so
/// the links it made are among those they close) or is refused: no link outlives
/// the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_racing_shutdown_leaves_no_link_open() {
    let first = Ledger::new("first", b"a1");
    let a = agent("a", &[&first]).await;
    let b = agent("b", &[&Ledger::new("first", b"b1")]).await;
    let barrier = Arc::new(Barrier::new(2));
    *first.hold.lock().unwrap() = Some(("b".to_owned(), barrier.clone()));
    let md = b.metadata().unwrap();
    let loader = {
        let a = a.clone();
        std::thread::spawn(move || a.load_metadata(&md))
    };
    tokio::task::block_in_place(|| barrier.wait()); // the load is inside link
    let mut stop = tokio::spawn({
        let a = a.clone();
        async move { a.shutdown().await }
    });
    // Time for a shutdown that does not wait for the load to close the backends'
    // links before the load makes its own (the bug this catches); one that waits is
    // still waiting when this ends.
    let early = tokio::time::timeout(Duration::from_millis(300), &mut stop).await;
    tokio::task::block_in_place(|| barrier.wait());
    let report = match early {
        Ok(r) => r.unwrap(),
        Err(_) => tokio::time::timeout(Duration::from_secs(20), stop)
            .await
            .expect("shutdown finished once the load did")
            .unwrap(),
    };
    assert!(report.is_clean(), "{report:?}");
    match loader.join().unwrap() {
        Ok(name) => assert_eq!(name, "b"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::ShutDown, "{e}"),
    }
    assert_eq!(first.knows("b"), None, "a link outlived the agent");
    refused(a.connect("b").await, ErrorKind::ShutDown, "");
    let _ = b.shutdown().await;
}

/// A prepare that meets a link a reload closed meanwhile is refused as stale, so
/// `create_request` prepares again on the new link rather than failing with the
/// closed link's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_on_a_link_a_reload_closed_is_made_again() {
    let first = Ledger::new("first", b"a1");
    let a = agent("a", &[&first]).await;
    let src = a.register(vec![1u8; 64]).unwrap();
    let b_first = Ledger::new("first", b"b1");
    let b = agent("b", &[&b_first]).await;
    let _dst = b.register(vec![0u8; 64]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = a.remote_regions("b").unwrap()[0].clone();

    // "b" moves (the same instance with new connection info) while a request to it
    // is being prepared.
    let barrier = Arc::new(Barrier::new(2));
    *first.hold_prepare.lock().unwrap() = Some(barrier.clone());
    let maker = {
        let (a, local, remote) = (a.clone(), one(src.desc(0, 64)), one(rd.desc(0, 64)));
        std::thread::spawn(move || {
            a.create_request(Op::Write, &local, "b", &remote, &RequestOptions::default())
        })
    };
    tokio::task::block_in_place(|| barrier.wait()); // the prepare is in progress
    *b_first.info.lock().unwrap() = b"b1-moved".to_vec();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    tokio::task::block_in_place(|| barrier.wait());
    let req = maker
        .join()
        .unwrap()
        .expect("prepared again on the new link");
    req.post(None).unwrap().await.unwrap();
    assert_eq!(first.knows("b").as_deref(), Some(&b"b1-moved"[..]));
    for x in [a, b] {
        let _ = x.shutdown().await;
    }
}

/// Limits count a peer's regions by id and blobs are kept per backend: metadata
/// that lists an id twice (at other addresses) or names a backend twice in one
/// region is refused as corrupt, so no region or blob escapes the count.
#[tokio::test]
async fn a_region_id_or_blob_backend_listed_twice_is_corrupt() {
    use nixl::metadata::{AgentMetadata, RegionBlob};
    let first = Ledger::new("first", b"a1");
    let a = agent("a", &[&first]).await;
    let b = agent("b", &[&Ledger::new("first", b"b1")]).await;
    let _dst = b.register(vec![0u8; 64]).unwrap();
    let md = AgentMetadata::decode(&b.metadata().unwrap()).unwrap();

    let mut twice = md.clone();
    let mut copy = twice.regions[0].clone();
    copy.addr += 1 << 20; // elsewhere: no overlap, the same id
    twice.regions.push(copy);
    refused(
        a.load_metadata(&twice.encode().unwrap()),
        ErrorKind::Corrupt,
        "listed twice",
    );

    let mut blobs = md.clone();
    let again = RegionBlob {
        backend: blobs.regions[0].blobs[0].backend,
        blob: Vec::new(),
    };
    blobs.regions[0].blobs.push(again);
    refused(
        a.load_metadata(&blobs.encode().unwrap()),
        ErrorKind::Corrupt,
        "listed twice",
    );
    assert!(a.remote_regions("b").is_err(), "nothing was loaded");
    a.load_metadata(&md.encode().unwrap()).unwrap();
    assert_eq!(a.remote_regions("b").unwrap().len(), 1);
    for x in [a, b] {
        let _ = x.shutdown().await;
    }
}
