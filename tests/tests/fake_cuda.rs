//! The VRAM conformance cases on nixl-tcp, and on the engine and verbs test doubles of
//! nixl-uccl and nixl-verbs, with nixl's **real CUDA code path** (the
//! driver check, cudarc's binding, primary contexts, cuMemAlloc, pinned staging with
//! asynchronous copies and stream callbacks) bound through `NIXL_CUDA_LIB` to a
//! **test double of the CUDA driver library** (`nixl_testkit::fake_cuda`, built from C
//! here). The double runs copies and callbacks on threads of its own and aborts on
//! misuse (a driver call from a callback, a copy whose memory was freed first). It
//! proves how nixl drives the CUDA API on machines without a GPU; `scripts/gpu-check`
//! runs the same cases against a real driver.
#![allow(unsafe_code)] // calls into the CUDA driver double, and memory from raw parts

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};

/// Point nixl at the driver double (before any GPU call of this process).
fn use_fake_driver() -> nixl::Result<()> {
    let lib = nixl_testkit::fake_cuda::library().map_err(|e| {
        nixl::Error::new(
            nixl::ErrorKind::UnavailableLibrary,
            "build the CUDA driver test double",
            e,
        )
    })?;
    std::env::set_var(nixl::gpu::ENV_LIB, lib);
    Ok(())
}

fn make() -> nixl::Result<Arc<dyn nixl::Backend>> {
    use_fake_driver()?;
    Ok(Arc::new(nixl_tcp::TcpBackend::with_options(
        nixl_conformance::support::tcp_options_from_env(),
    )))
}

const TCP_FAKE_CUDA: BackendUnderTest = BackendUnderTest {
    name: "tcp (CUDA driver test double)",
    make,
    skip_case: |_| None,
};

conformance_tests!(TCP_FAKE_CUDA;
    vram_transfers,
    vram_notifications_after_data,
    vram_lifetime,
    vram_peer_gone_mid_transfer,
);

/// The library nixl binds is the one `NIXL_CUDA_LIB` names (not one cudarc would
/// search for), and the core's GPU calls work against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_named_driver_is_the_one_bound() {
    if let Err(e) = use_fake_driver() {
        return nixl_testkit::skip("the_named_driver_is_the_one_bound", e);
    }
    let info = nixl::gpu::status().unwrap();
    assert_eq!(info.devices, 2, "{info:?}");
    assert!(info.driver.contains("nixl-fake-cuda"), "{info:?}");
    assert!(info.driver.contains("CUDA driver 12.4"), "{info:?}");
    // Device memory, written and read back through the driver.
    let m = nixl::Memory::vram(1, 3 << 20).unwrap();
    let agent = nixl::Agent::builder("a")
        .backend(nixl_tcp::TcpBackend::new())
        .build()
        .await
        .unwrap();
    let r = agent.register(m).unwrap();
    let data: Vec<u8> = (0..3 << 20).map(|i: usize| (i % 253) as u8).collect();
    r.write_at(0, &data).unwrap();
    assert_eq!(r.to_vec().unwrap(), data);
    // A dma-buf export of an unaligned range inside it.
    let d = nixl::gpu::dma_buf(1, r.addr() + 100, 5000).unwrap();
    assert_eq!((d.offset, d.len), (100, 8192));
    // Pinned buffers come from the driver.
    let mut b = nixl::gpu::PinnedBuf::new(1 << 20).unwrap();
    b[0] = 1;
    drop(b);
    assert!(agent.shutdown().await.is_clean());
}

/// nixl-verbs' GPU registration (dma-buf export through the driver, then the verbs
/// test double's `ibv_reg_dmabuf_mr`) with the driver double.
mod verbs_double {
    use super::*;

    const VERBS_FAKE_CUDA: BackendUnderTest = BackendUnderTest {
        name: "verbs (test double, CUDA driver test double)",
        make: || {
            use_fake_driver()?;
            Ok(Arc::new(nixl_verbs::VerbsBackend::with_test_double(
                nixl_verbs::VerbsOptions::default(),
            )?))
        },
        skip_case: |_| None,
    };

    conformance_tests!(VERBS_FAKE_CUDA; vram_transfers, vram_lifetime, vram_peer_gone_mid_transfer);
}

/// nixl-uccl handing GPU memory to its engine (test double) with the driver double.
mod uccl_double {
    use super::*;

    const UCCL_FAKE_CUDA: BackendUnderTest = BackendUnderTest {
        name: "uccl (test double, CUDA driver test double)",
        make: || {
            use_fake_driver()?;
            Ok(Arc::new(nixl_uccl::UcclBackend::with_api(
                nixl_uccl::test_double::TestDouble::api(),
                nixl_uccl::UcclOptions::default(),
            )))
        },
        skip_case: |_| None,
    };

    conformance_tests!(UCCL_FAKE_CUDA; vram_transfers, vram_lifetime, vram_peer_gone_mid_transfer);
}

/// A GPU registration no attached backend takes says why, in the backend's words
/// (here nixl-ucx bound to a UCX without CUDA support, such as Debian's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_gpu_memory_says_why() {
    const CASE: &str = "unsupported_gpu_memory_says_why";
    if let Err(e) = use_fake_driver() {
        return nixl_testkit::skip(CASE, e);
    }
    let ucx = match nixl_ucx::UcxBackend::new() {
        Ok(b) => b,
        Err(e) => return nixl_testkit::skip(CASE, format!("no UCX: {e}")),
    };
    if nixl::Backend::capabilities(&ucx).vram {
        return nixl_testkit::skip(CASE, "the bound UCX has CUDA support");
    }
    let a = nixl::Agent::builder("a")
        .backend(ucx)
        .build()
        .await
        .unwrap();
    let e = a
        .register(nixl::Memory::vram(0, 4096).unwrap())
        .unwrap_err();
    assert_eq!(e.kind(), nixl::ErrorKind::NotSupported, "{e}");
    let text = e.to_string();
    assert!(text.contains("no attached backend supports VRAM"), "{text}");
    assert!(text.contains("ucx: the bound UCX"), "{text}");
    assert!(text.contains("no CUDA support"), "{text}");
    assert!(a.shutdown().await.is_clean());
}

/// nixl's device calls leave the calling thread's current CUDA context as they found
/// it (they push and pop the device's primary context): an application thread bound
/// to GPU 1 stays on GPU 1 after nixl allocated, copied and exported on GPU 0.
#[test]
fn device_calls_leave_the_threads_context_alone() {
    const CASE: &str = "device_calls_leave_the_threads_context_alone";
    if let Err(e) = use_fake_driver() {
        return nixl_testkit::skip(CASE, e);
    }
    type GetCurrent = unsafe extern "C" fn(*mut *mut std::ffi::c_void) -> std::ffi::c_int;
    type Retain =
        unsafe extern "C" fn(*mut *mut std::ffi::c_void, std::ffi::c_int) -> std::ffi::c_int;
    let path = nixl_testkit::fake_cuda::library().unwrap();
    let lib = nixl::native::NativeLibrary::open(path.to_str().unwrap()).unwrap();
    // SAFETY: the driver API's signatures (cuda.h) for these two calls.
    let (get, retain) = unsafe {
        (
            lib.symbol::<GetCurrent>("cuCtxGetCurrent").unwrap(),
            lib.symbol::<Retain>("cuDevicePrimaryCtxRetain").unwrap(),
        )
    };
    let current = || {
        let mut c = std::ptr::null_mut();
        // SAFETY: an out-parameter; the library is loaded.
        assert_eq!(unsafe { get(&mut c) }, 0);
        c
    };
    nixl::gpu::bind_thread(1).unwrap();
    let mut gpu1 = std::ptr::null_mut();
    // SAFETY: as above; device 1 exists in the double.
    assert_eq!(unsafe { retain(&mut gpu1, 1) }, 0);
    assert_eq!(current(), gpu1);
    let m = nixl::Memory::vram(0, 1 << 20).unwrap();
    let b = nixl::gpu::PinnedBuf::new(4096).unwrap();
    let d = nixl::gpu::dma_buf(0, m.addr(), 8192).unwrap();
    drop((m, b, d));
    assert_eq!(current(), gpu1, "GPU 1's context is still current");
    // What backends use around a GPU-aware library's call on such a thread.
    let mut gpu0 = std::ptr::null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { retain(&mut gpu0, 0) }, 0);
    let inside = nixl::gpu::with_context(0, || Ok(current() as usize)).unwrap();
    assert_eq!(inside, gpu0 as usize, "GPU 0's context is current inside");
    assert_eq!(current(), gpu1, "and GPU 1's again after");
}
