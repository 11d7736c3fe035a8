//! No busy polling when idle: with peers connected and no work, the progress driver
//! (task or thread) sleeps on the worker's event fd, so the process uses next to no
//! CPU. Measured over a few seconds of idleness after traffic, for both progress
//! modes; the bound (a tenth of one core) is generous: a driver that polled would use
//! a whole core.
//!
//! Needs libucp at run time; without it each test prints a SKIP line.
#![allow(unsafe_code)] // getrusage, to read this process's CPU time

use std::time::{Duration, Instant};

use nixl::{Agent, DescList, MemKind};
use nixl_ucx::{ProgressMode, UcxOptions};

mod common;

/// CPU time (user + system) of this whole process so far.
fn process_cpu() -> Duration {
    // SAFETY: getrusage writes only the struct we pass, which lives across the call.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut ru), 0);
        ru
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

async fn agent(name: &str, progress: ProgressMode) -> Option<Agent> {
    let o = UcxOptions {
        progress,
        ..UcxOptions::default()
    };
    common::agent("idle_drivers_do_not_poll", name, o)
        .await
        .map(|(a, _)| a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_drivers_do_not_poll() {
    const IDLE: Duration = Duration::from_secs(3);
    for mode in [ProgressMode::Task, ProgressMode::Thread] {
        let Some(a) = agent("a", mode).await else {
            return;
        };
        let b = agent("b", mode).await.unwrap();
        let src = a.register(vec![1u8; 1 << 20]).unwrap();
        let dst = b.register(vec![0u8; 1 << 20]).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        b.load_metadata(&a.metadata().unwrap()).unwrap();
        a.connect("b").await.unwrap();
        b.connect("a").await.unwrap();
        let rd = a.remote_regions("b").unwrap().remove(0);
        let one = |d| DescList::from_descs(MemKind::Dram, [d]);
        // Traffic both ways first, so the drivers have been busy.
        for _ in 0..50 {
            a.write(&one(src.whole()), "b", &one(rd.desc(0, 1 << 20)), None)
                .await
                .unwrap();
            a.notify("b", "n").unwrap().await.unwrap();
            b.notify("a", "n").unwrap().await.unwrap();
        }
        // Past the driver's short after-activity tick (0.5 s), then measure.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let (c0, t0) = (process_cpu(), Instant::now());
        tokio::time::sleep(IDLE).await;
        let (cpu, wall) = (process_cpu() - c0, t0.elapsed());
        let share = cpu.as_secs_f64() / wall.as_secs_f64();
        common::figure(
            &format!("ucx idle CPU, two connected agents, {mode:?} progress"),
            format!(
                "{:.2}% of one core ({cpu:?} over {wall:.1?})",
                share * 100.0
            ),
        );
        assert!(
            share < 0.10,
            "{mode:?} progress: {cpu:?} of CPU in {wall:?} while idle: the driver is polling"
        );
        // And still serving after the idle spell.
        a.write(&one(src.whole()), "b", &one(rd.desc(0, 1 << 20)), None)
            .await
            .unwrap();
        assert_eq!(dst.to_vec().unwrap()[..16], [1u8; 16]);
        let _ = a.shutdown().await;
        let _ = b.shutdown().await;
    }
}
