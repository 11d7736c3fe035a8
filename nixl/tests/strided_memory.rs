//! A regular request of ten million blocks holds O(runs) memory, not O(blocks):
//! counted by a global allocator around preparing both lists and building the
//! request (its own test binary, so no other test allocates meanwhile).
#![allow(unsafe_code)] // a counting global allocator

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::Recorder;
use nixl::{Agent, DescList, Indices, MemKind, RequestOptions};
use nixl_testkit::double::backend;

/// Counts bytes allocated (never subtracts): an upper bound of what was held.
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[tokio::test(flavor = "current_thread")]
async fn ten_million_block_request_holds_o_runs() {
    const N: usize = 10_000_000;
    const BLOCK: u64 = 64;
    const STRIDE: u64 = 128;
    let a = Agent::builder("a")
        .backend(backend(Recorder::default()))
        .build()
        .await
        .unwrap();
    let b = Agent::builder("b")
        .backend(backend(Recorder::default()))
        .build()
        .await
        .unwrap();
    // Zeroed allocations: the pages are never touched.
    let la = a.register(vec![0u8; N * STRIDE as usize]).unwrap();
    let _lb = b.register(vec![0u8; N * STRIDE as usize]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rb = a.remote_regions("b").unwrap()[0].clone();
    let local = DescList::strided(MemKind::Dram, la.desc(0, BLOCK), STRIDE, N);
    let remote = DescList::strided(MemKind::Dram, rb.desc(0, BLOCK), STRIDE, N);

    let (bytes0, count0) = (
        ALLOCATED.load(Ordering::Relaxed),
        ALLOCATIONS.load(Ordering::Relaxed),
    );
    let lp = a.prep_local(&local).unwrap();
    let rp = a.prep_remote("b", &remote).unwrap();
    let req = a
        .make_request(
            nixl::Op::Write,
            &lp,
            Indices::All,
            &rp,
            Indices::All,
            &RequestOptions::default(),
        )
        .unwrap();
    let bytes = ALLOCATED.load(Ordering::Relaxed) - bytes0;
    let count = ALLOCATIONS.load(Ordering::Relaxed) - count0;
    assert_eq!(req.segments(), N);
    assert_eq!(req.bytes(), N as u64 * BLOCK);
    println!("10M-block strided request: {count} allocations, {bytes} bytes (prepare both lists + make request)");
    // One block's bookkeeping per block would be hundreds of megabytes.
    assert!(
        bytes < 64 * 1024,
        "{bytes} bytes allocated in {count} allocations"
    );
    req.post(None).unwrap().await.unwrap();
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
