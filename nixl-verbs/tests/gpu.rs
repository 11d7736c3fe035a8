//! GPU memory on nixl-verbs, with two test doubles: the verbs test double (no NIC)
//! and the core's host stand-in for device memory (no GPU). They prove which
//! registration calls nixl-verbs makes for GPU memory, the fallback between them, and
//! that data moves through the regions they give; not GPUDirect RDMA, which needs a
//! GPU and an RDMA NIC (`tests/verbs.rs` in the conformance suite runs there).
#![allow(unsafe_code)] // memory from raw parts, as a framework's GPU memory is

use std::time::Duration;

use nixl::{DescList, ErrorKind, MemKind, Memory};
use nixl_verbs::test_double;

/// The double's dma-buf switch is process-wide: these tests take turns.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

use common::agent;

mod common;

/// A WRITE from GPU memory into GPU memory between two agents; the bytes arrive.
async fn vram_write_moves_bytes() {
    let (a, b) = (agent("a").await, agent("b").await);
    const LEN: usize = (1 << 20) + 4096;
    let vram = MemKind::Vram { device: 0 };
    let src = a.register(Memory::vram(0, LEN).unwrap()).unwrap();
    let dst = b.register(Memory::vram(0, LEN).unwrap()).unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8).collect();
    src.write_at(0, &data).unwrap();
    dst.write_at(0, &vec![0u8; LEN]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let r = a
        .remote_regions("b")
        .unwrap()
        .into_iter()
        .find(|r| r.id == dst.id())
        .unwrap();
    assert_eq!(r.kind, vram);
    tokio::time::timeout(
        Duration::from_secs(30),
        a.write(
            &DescList::from_descs(vram, [src.desc(100, (LEN - 100) as u64)]),
            "b",
            &DescList::from_descs(vram, [r.desc(100, (LEN - 100) as u64)]),
            None,
        ),
    )
    .await
    .expect("no hang")
    .unwrap();
    let got = dst.to_vec().unwrap();
    assert_eq!(&got[100..], &data[100..]);
    assert!(got[..100].iter().all(|&x| x == 0));
    for x in [a, b] {
        assert!(x.shutdown().await.is_clean());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_is_registered_by_dma_buf() {
    let _turn = SERIAL.lock().await;
    nixl::gpu::use_host_stand_in();
    test_double::set_dmabuf(true);
    let before = test_double::dmabuf_registrations();
    vram_write_moves_bytes().await;
    assert_eq!(
        test_double::dmabuf_registrations() - before,
        2,
        "both GPU registrations went through ibv_reg_dmabuf_mr"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_dma_buf_gpu_memory_falls_back_to_the_device_pointer() {
    let _turn = SERIAL.lock().await;
    nixl::gpu::use_host_stand_in();
    test_double::set_dmabuf(false);
    let before = test_double::dmabuf_registrations();
    vram_write_moves_bytes().await;
    test_double::set_dmabuf(true);
    assert_eq!(test_double::dmabuf_registrations(), before);
}

/// Host memory never goes the dma-buf way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_memory_is_registered_as_before() {
    let _turn = SERIAL.lock().await;
    let a = agent("a").await;
    let before = test_double::dmabuf_registrations();
    let r = a.register(vec![0u8; 8192]).unwrap();
    assert_eq!(test_double::dmabuf_registrations(), before);
    a.deregister(&r).unwrap();
    assert!(a.shutdown().await.is_clean());
}

/// Without a GPU driver (and without the stand-in), GPU memory cannot even be made;
/// memory that claims to be GPU memory is refused naming the missing driver.
#[test]
fn no_driver_is_an_error_naming_it() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        nixl_testkit::skip(
            "no_driver_is_an_error_naming_it",
            "this machine has an NVIDIA driver",
        );
        return;
    }
    // A separate process: this one may have the stand-in on.
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "no_driver_child", "--nocapture"])
        .env("NIXL_VERBS_GPU_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("child checked"), "{text}");
}

#[test]
fn no_driver_child() {
    if std::env::var_os("NIXL_VERBS_GPU_CHILD").is_none() {
        return; // run by `no_driver_is_an_error_naming_it` only
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let a = agent("a").await;
        let mut fake = vec![0u8; 4096];
        // SAFETY: the registration is refused before anything touches the memory,
        // which outlives the agent anyway.
        let m = unsafe {
            Memory::from_raw_parts(fake.as_mut_ptr(), fake.len(), MemKind::Vram { device: 0 })
        }
        .unwrap();
        let e = a.register(m).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnavailableLibrary, "{e}");
        assert!(e.to_string().contains("libcuda.so.1"), "{e}");
        assert!(a.shutdown().await.is_clean());
    });
    println!("child checked");
}
