//! Unit tests of the GPU parts.
#![allow(unsafe_code)]

/// Without a driver (the CI machines), asking for the GPU is an error value that
/// names what is missing, never a panic; nothing else is affected.
#[test]
fn no_driver_is_an_error_naming_it() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        nixl_testkit::skip(
            "no_driver_is_an_error_naming_it",
            "this machine has an NVIDIA driver",
        );
        return;
    }
    // The public path, unless a stand-in test in this process has replaced the
    // driver (`cargo test` runs them in one process): then the CUDA check itself.
    let status = || match super::access::STAND_IN.get() {
        None => super::status(),
        Some(_) => super::cuda::cuda().map(|c| super::driver::GpuDriver::info(&*c)),
    };
    let e = status().unwrap_err();
    assert!(
        matches!(
            e.kind(),
            crate::ErrorKind::UnavailableLibrary | crate::ErrorKind::NotSupported
        ),
        "{e}"
    );
    assert!(e.to_string().contains("libcuda.so.1"), "{e}");
    // Asking again gives the same answer (checked once), still without a panic.
    assert_eq!(status().unwrap_err().to_string(), e.to_string());
    if super::access::STAND_IN.get().is_none() {
        assert!(super::bind_thread(0).is_err());
        assert!(super::PinnedBuf::new(4096).is_err());
    }
}

/// Staging through pinned buffers, on the host stand-in (a test double for the
/// device copies: this tests the bookkeeping around them, not CUDA).
#[cfg(feature = "gpu-test-double")]
mod stand_in {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use super::super::stand_in::STAND_IN_COPIES;
    use super::super::{reaper, use_host_stand_in, PinnedBuf};
    use crate::region::{RegionInner, RegionRef};
    use crate::{ErrorKind, MemKind, Memory};

    fn region(mem: Memory) -> RegionRef {
        RegionRef {
            inner: Arc::new(RegionInner {
                id: 1,
                mem,
                inflight: AtomicUsize::new(0),
                registered: AtomicBool::new(true),
                backends: Mutex::new(Vec::new()),
                gate: Default::default(),
                idle: Default::default(),
            }),
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[tokio::test]
    async fn copies_move_the_bytes_both_ways() {
        use_host_stand_in();
        let len = (5 << 20) + 123;
        let r = region(Memory::vram(1, len).unwrap());
        let whole = r.slice(0, len).unwrap();
        let data = pattern(len, 9);
        whole.write_from(0, &data).unwrap();

        // Device to host, from an offset, into a larger buffer.
        let s = r.slice(4096, 3 << 20).unwrap();
        let buf = PinnedBuf::new(4 << 20).unwrap();
        assert_eq!(buf.len(), 4 << 20);
        let buf = s.copy_to_pinned(100, buf, 2 << 20).unwrap().await.unwrap();
        assert_eq!(&buf[..2 << 20], &data[4096 + 100..4096 + 100 + (2 << 20)]);

        // Host to device (1 MiB and more land late on the stand-in: the future
        // resolves only after).
        let mut buf = buf;
        buf[..2 << 20].copy_from_slice(&pattern(2 << 20, 77));
        let _buf = s.copy_from_pinned(7, buf, 2 << 20).unwrap().await.unwrap();
        let mut got = vec![0u8; 2 << 20];
        s.read_into(7, &mut got).unwrap();
        assert_eq!(got, pattern(2 << 20, 77));
        // The bytes around it are untouched.
        let mut edge = [0u8; 7];
        s.read_into(0, &mut edge).unwrap();
        assert_eq!(&edge[..], &data[4096..4096 + 7]);

        // Host memory is copied at once, through the same calls.
        let host = region(Memory::from(pattern(8192, 3)));
        let hs = host.slice(0, 8192).unwrap();
        let b = hs
            .copy_to_pinned(0, PinnedBuf::new(8192).unwrap(), 8192)
            .unwrap();
        assert_eq!(&b.await.unwrap()[..], &pattern(8192, 3)[..]);
    }

    /// The export covers whole host pages around the range; the offset says where
    /// the range starts in it.
    #[test]
    fn dma_buf_covers_whole_pages() {
        use_host_stand_in();
        let d = super::super::dma_buf(0, 0x10_0000 + 100, 5000).unwrap();
        assert_eq!((d.offset, d.len), (100, 8192));
        let d = super::super::dma_buf(1, 0x10_0000, 4096).unwrap();
        assert_eq!((d.offset, d.len), (0, 4096));
        for (addr, len) in [(0x1000, 0), (u64::MAX - 10, 100)] {
            let e = super::super::dma_buf(0, addr, len).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
        }
        assert!(
            super::super::dma_buf(2, 0x1000, 1).is_err(),
            "GPU 2 does not exist"
        );
    }

    #[tokio::test]
    async fn out_of_range_copies_are_refused() {
        use_host_stand_in();
        let r = region(Memory::vram(0, 1 << 20).unwrap());
        let s = r.slice(4096, 8192).unwrap();
        let e = s
            .copy_to_pinned(4096, PinnedBuf::new(8192).unwrap(), 8192)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
        let e = s
            .copy_from_pinned(0, PinnedBuf::new(100).unwrap(), 101)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    }

    /// Owns the stand-in "device memory" of a test and records, when freed,
    /// whether the copy into it had finished by then.
    struct Watch {
        mem: crate::aligned::AlignedBuf,
        expect: Vec<u8>,
        freed: Arc<AtomicBool>,
        complete: Arc<AtomicBool>,
    }

    impl Drop for Watch {
        fn drop(&mut self) {
            let mut now = vec![0u8; self.expect.len()];
            // SAFETY: the buffer is alive (we own it) and nothing else uses it
            // once its last holder let go.
            unsafe {
                std::ptr::copy_nonoverlapping(self.mem.as_mut_ptr(), now.as_mut_ptr(), now.len())
            };
            self.complete.store(now == self.expect, Ordering::SeqCst);
            self.freed.store(true, Ordering::SeqCst);
        }
    }

    /// A copy whose future and memory handles are all dropped before it ran keeps
    /// the memory and its buffer alive until it has finished.
    #[test]
    fn a_dropped_copy_keeps_its_memory_until_it_finished() {
        use_host_stand_in();
        let len = 64 << 10;
        let expect = pattern(len, 5);
        let (freed, complete) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let mem = crate::aligned::AlignedBuf::new(len);
        let ptr = mem.as_mut_ptr();
        let watch = Watch {
            mem,
            expect: expect.clone(),
            freed: freed.clone(),
            complete: complete.clone(),
        };
        // SAFETY: `ptr..ptr+len` is the Watch's buffer, which the Memory owns (as
        // its owner) and keeps alive; on the stand-in, device memory is host
        // memory.
        let mem = unsafe {
            Memory::from_raw_parts_with_owner(ptr, len, MemKind::Vram { device: 0 }, Some(watch))
        }
        .unwrap();
        let r = region(mem);
        let mut buf = PinnedBuf::new(len).unwrap();
        buf.copy_from_slice(&expect);
        {
            // Copies wait while this is held.
            let _paused = STAND_IN_COPIES.write().unwrap();
            let copy = r
                .slice(0, len)
                .unwrap()
                .copy_from_pinned(0, buf, len)
                .unwrap();
            drop(copy);
            drop(r);
            std::thread::sleep(Duration::from_millis(20));
            assert!(
                !freed.load(Ordering::SeqCst),
                "memory freed under a running copy"
            );
            assert!(reaper::pending() > 0, "the copy is the reaper's to free");
        }
        // The copy runs now; its completion wakes the reaper, which frees the memory.
        let start = Instant::now();
        while !freed.load(Ordering::SeqCst) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the copy never finished"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            complete.load(Ordering::SeqCst),
            "memory freed before the copy landed"
        );
    }

    /// The reaper is a thread that exists while orphaned copies do, and that stops
    /// and joins when told to (the process's last agent does at its shutdown).
    #[test]
    fn the_reaper_runs_for_orphans_and_joins_when_stopped() {
        use_host_stand_in();
        let len = 4096;
        let r = region(Memory::vram(0, len).unwrap());
        {
            let _paused = STAND_IN_COPIES.write().unwrap();
            let copy = r
                .slice(0, len)
                .unwrap()
                .copy_from_pinned(0, PinnedBuf::new(len).unwrap(), len)
                .unwrap();
            drop(copy);
            // A new thread names itself once it runs.
            let until = Instant::now() + Duration::from_secs(5);
            while nixl_testkit::threads::named("nixl-gpu-reaper") == 0 {
                assert!(Instant::now() < until, "an orphaned copy starts the reaper");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let stopping = reaper::stop().expect("the reaper was running");
        let left = stopping.join_blocking(Instant::now() + Duration::from_secs(10));
        assert_eq!(left, None, "the reaper joins once its orphan finished");
        assert_eq!(reaper::pending(), 0);
    }
}
