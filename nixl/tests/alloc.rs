//! `Agent::alloc`: the first attached backend that offers faster memory provides it;
//! otherwise ordinary aligned host memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nixl::{
    Agent, AlignedBuf, Capabilities, ErrorKind, Memory, PreparedTransfer, Result, TransferPlan,
};
use nixl_testkit::double::{refused, shared, Double};

/// A backend that only registers, and counts its allocations when `offers` is set.
#[derive(Debug, Default)]
struct Fake {
    offers: bool,
    allocs: AtomicUsize,
}

impl Double for Fake {
    fn name(&self) -> &str {
        if self.offers {
            "offers"
        } else {
            "plain"
        }
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: false,
            notifications: false,
            dram: true,
            vram: false,
            target_checks: true,
            ..Capabilities::default()
        }
    }
    fn alloc(&self, len: usize) -> Option<Result<Memory>> {
        self.offers.then(|| {
            self.allocs.fetch_add(1, Ordering::Relaxed);
            Ok(AlignedBuf::new(len).into())
        })
    }
    fn prepare(&self, _plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        unreachable!("no transfers in this test")
    }
}

#[tokio::test]
async fn alloc_prefers_the_first_backend_that_offers_memory() {
    let plain = Arc::new(Fake::default());
    let offers = Arc::new(Fake {
        offers: true,
        ..Fake::default()
    });
    let a = Agent::builder("a")
        .backend(shared(plain.clone()))
        .backend(shared(offers.clone()))
        .build()
        .await
        .unwrap();
    let m = a.alloc(10_000).unwrap();
    assert_eq!(m.len(), 10_000);
    assert_eq!(offers.allocs.load(Ordering::Relaxed), 1);
    let r = a.register(m).unwrap();
    assert!(r.to_vec().unwrap().iter().all(|&x| x == 0), "zero-filled");
    assert_eq!(a.alloc(0).unwrap_err().kind(), ErrorKind::ZeroLength);
    let _ = a.shutdown().await;
    assert_eq!(a.alloc(1).unwrap_err().kind(), ErrorKind::ShutDown);
}

#[tokio::test]
async fn alloc_falls_back_to_host_memory() {
    let plain = Arc::new(Fake::default());
    let a = Agent::builder("a")
        .backend(shared(plain))
        .build()
        .await
        .unwrap();
    let m = a.alloc(4096).unwrap();
    assert_eq!(m.len(), 4096);
    assert_eq!(m.addr() % nixl::PAGE_SIZE as u64, 0, "page-aligned");
    let r = a.register(m).unwrap();
    r.write_at(0, b"hello").unwrap();
    assert_eq!(&r.to_vec().unwrap()[..5], b"hello");
}

/// A size beyond this machine is an error naming the limit, never an abort.
#[tokio::test]
async fn alloc_beyond_this_machine_is_refused() {
    let plain = Arc::new(Fake::default());
    let a = Agent::builder("a")
        .backend(shared(plain))
        .build()
        .await
        .unwrap();
    let machine = nixl::host_memory().expect("sysinfo answers on Linux");
    for len in [machine as usize + 1, usize::MAX / 2, usize::MAX - 4096] {
        refused(
            a.alloc(len),
            ErrorKind::InvalidArgument,
            "this machine's memory",
        );
        let e = AlignedBuf::try_new(len).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(AlignedBuf::try_with_huge_pages(len).is_err());
    }
    assert_eq!(a.alloc(1 << 20).unwrap().len(), 1 << 20);
}
