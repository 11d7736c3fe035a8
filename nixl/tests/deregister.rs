//! A refused deregistration changes nothing: while transfers of this agent keep a
//! registration in flight, `deregister` is refused, and a backend serving a peer from
//! that memory at the same moment (a target sending a READ, receiving a WRITE) is
//! never turned away. Once allowed, nothing reaches the memory any more. And a
//! transfer awaited with a deadline ends there, canceled.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use nixl::{
    Agent, Capabilities, Completer, ErrorKind, Op, PreparedTransfer, RegionRef, Result,
    TransferPlan,
};
use nixl_testkit::double::{backend, one, Double};

/// Test double: a backend whose transfers stay in flight until the test completes
/// them, and which hands the test its registrations (as a target serving peers
/// would use them).
#[derive(Debug, Default)]
struct HeldDouble {
    regions: Arc<Mutex<Vec<RegionRef>>>,
    held: Arc<Mutex<Vec<Completer>>>,
}

#[derive(Debug)]
struct Held(Arc<Mutex<Vec<Completer>>>);

impl PreparedTransfer for Held {
    fn post(&self, _notif: Option<Bytes>, done: Completer) {
        self.0.lock().unwrap().push(done);
    }
}

impl Double for HeldDouble {
    fn name(&self) -> &str {
        "held"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: true,
            dram: true,
            ..Capabilities::default()
        }
    }
    fn connection_info(&self) -> Bytes {
        Bytes::from_static(b"held")
    }
    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        self.regions.lock().unwrap().push(region.clone());
        Ok(Bytes::new())
    }
    fn prepare(&self, _plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        Ok(Box::new(Held(self.held.clone())))
    }
}

/// What the test sees of the initiator's double: its registrations and held posts.
struct Handles {
    regions: Arc<Mutex<Vec<RegionRef>>>,
    held: Arc<Mutex<Vec<Completer>>>,
}

/// An initiator and a target ("target", with a `len`-byte registration the initiator
/// knows), both on the double; the initiator's handles.
async fn pair(len: usize) -> (Agent, Agent, Handles, nixl::Registration) {
    let double = HeldDouble::default();
    let handles = Handles {
        regions: double.regions.clone(),
        held: double.held.clone(),
    };
    let a = Agent::builder("initiator")
        .backend(backend(double))
        .build()
        .await
        .unwrap();
    let b = Agent::builder("target")
        .backend(backend(HeldDouble::default()))
        .build()
        .await
        .unwrap();
    let dst = b.register(vec![0u8; len]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    (a, b, handles, dst)
}

/// Post a WRITE of all of `src` into the target's `dst`.
fn write(a: &Agent, src: &nixl::Registration, dst: &nixl::Registration) -> nixl::Transfer {
    a.transfer(
        Op::Write,
        &one(src.whole()),
        "target",
        &one(dst.whole()),
        None,
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_deregistration_is_invisible_to_the_backend() {
    let (a, _b, double, dst) = pair(4096).await;
    let (regions, held) = (double.regions, double.held);
    let src = a.register(vec![7u8; 4096]).unwrap();
    let region = regions.lock().unwrap()[0].clone();
    let t = write(&a, &src, &dst);
    assert_eq!(src.inflight(), 1);

    // A "target" thread serves a peer from the same registration all along.
    let slice = region.slice(0, 4096).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (served, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let server = {
        let (stop, served, refused) = (stop.clone(), served.clone(), refused.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !stop.load(Ordering::Relaxed) {
                match slice.read_into(0, &mut buf) {
                    Ok(()) => served.fetch_add(1, Ordering::Relaxed),
                    Err(_) => refused.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };
    for _ in 0..20_000 {
        nixl_testkit::double::refused(a.deregister(&src), ErrorKind::NotAllowed, "");
    }
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
    assert!(served.load(Ordering::Relaxed) > 0);
    assert_eq!(
        refused.load(Ordering::Relaxed),
        0,
        "a refused deregistration turned the backend's accesses away"
    );
    assert!(src.is_registered());

    // Once the transfer is done, deregistration is allowed and the gate stays shut.
    for c in held.lock().unwrap().drain(..) {
        c.complete(Ok(()));
    }
    t.await.unwrap();
    a.deregister(&src).unwrap();
    let mut buf = [0u8; 16];
    let e = region
        .slice(0, 16)
        .unwrap()
        .read_into(0, &mut buf)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

/// A transfer that never completes ends at its deadline as `TimedOut`, and its
/// memory stays in flight until the backend lets go.
#[tokio::test]
async fn a_transfer_deadline_cancels_a_stalled_transfer() {
    let (a, _b, double, dst) = pair(64).await;
    let held = double.held;
    let src = a.register(vec![7u8; 64]).unwrap();
    let t = write(&a, &src, &dst);
    let e = t.timeout(Duration::from_millis(50)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert_eq!(src.inflight(), 1, "the backend still holds it");
    for c in held.lock().unwrap().drain(..) {
        c.complete(Ok(()));
    }
    assert_eq!(src.inflight(), 0);
    a.deregister(&src).unwrap();
    // A transfer that finishes in time reports its outcome.
    let src = a.register(vec![7u8; 64]).unwrap();
    let t = write(&a, &src, &dst);
    for c in held.lock().unwrap().drain(..) {
        c.complete(Ok(()));
    }
    t.timeout(Duration::from_secs(5)).await.unwrap();
}

/// A deregistration that waits: it ends as soon as the backend lets go of the last
/// transfer using the memory (dropped, then finished by the backend), and refuses,
/// changing nothing, when that does not happen within its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_when_idle_waits_for_the_backend_to_let_go() {
    let (a, _b, double, dst) = pair(64).await;
    let held = double.held;
    let src = a.register(vec![7u8; 64]).unwrap();
    let t = write(&a, &src, &dst);
    drop(t);
    assert_eq!(src.inflight(), 1, "the backend still holds it");

    let e = a
        .deregister_when_idle(&src, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    assert!(src.is_registered(), "a refusal changes nothing");

    let releaser = {
        let held = held.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            for c in held.lock().unwrap().drain(..) {
                c.complete(Ok(()));
            }
        })
    };
    let started = std::time::Instant::now();
    a.deregister_when_idle(&src, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "woken when the count fell to zero, not at the timeout"
    );
    assert!(!src.is_registered());
    releaser.await.unwrap();
    // Unknown (already deregistered) stays NotFound, without waiting.
    let e = a
        .deregister_when_idle(&src, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}
