//! Thousands of agent lifecycles over the engine **test double**, each under a
//! watchdog: setups and teardowns in the orders that hung or crashed NIXL's UCCL
//! backend (never registered, shutdown with transfers in flight, a peer dropped
//! mid-transfer, notifications without registrations, drop without shutdown). Zero
//! hangs, zero leaked threads, engines or connections, zero misuse of the engine API.
//!
//! Runs: `NIXL_UCCL_STRESS_RUNS` (default 2000); seed: `NIXL_UCCL_STRESS_SEED`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Agent, AgentOptions, DescList, Op};
use nixl_testkit::double::one;
use nixl_testkit::threads;
use nixl_uccl::test_double::{self, TestDouble};
use nixl_uccl::{UcclBackend, UcclOptions};

const WATCHDOG: Duration = Duration::from_secs(20);
const THREADS: [&str; 6] = [
    "uccl-accept",
    "uccl-progress",
    "uccl-connect",
    "uccl-create",
    "uccl-confirm",
    "uccl-verify",
];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

async fn agent(name: String) -> (Agent, UcclBackend) {
    let b = UcclBackend::with_api(
        TestDouble::api(),
        UcclOptions {
            listener: nixl::control::ListenerOptions {
                dead_peer_timeout: Duration::from_millis(500),
                ..nixl::control::ListenerOptions::default()
            },
            stall_timeout: Duration::from_secs(5),
            ..Default::default()
        },
    );
    let a = Agent::builder(&name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_millis(50),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    (a, b)
}

fn whole_remote(a: &Agent, peer: &str, id: u64) -> DescList {
    let r = a
        .remote_regions(peer)
        .unwrap()
        .into_iter()
        .find(|r| r.id == id)
        .unwrap();
    one(r.desc(0, r.len))
}

async fn end(a: Agent, shutdown: bool, what: &str) {
    if shutdown {
        let r = a.shutdown().await;
        assert!(
            r.threads_left.is_empty() && r.backend_errors.is_empty() && r.tasks_left == 0,
            "{what}: {r:?}"
        );
    } else {
        drop(a);
    }
}

/// One lifecycle; returns its scenario's name.
async fn run(seed: u64, i: u64) -> &'static str {
    let mut rng = Rng(seed ^ (i.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
    let scenario = rng.below(7);
    let n = |s: &str| format!("{s}-{i}");
    match scenario {
        0 => {
            let (a, _) = agent(n("lonely")).await;
            if rng.below(2) == 0 {
                tokio::time::sleep(Duration::from_micros(rng.below(2000))).await;
            }
            end(a, rng.below(2) == 0, "never registered").await;
            "never registered"
        }
        1 => {
            let (a, _) = agent(n("solo")).await;
            let _r = a.register(vec![0u8; 4096]).unwrap();
            tokio::time::sleep(Duration::from_micros(rng.below(2000))).await;
            end(a, rng.below(2) == 0, "registered, no peers").await;
            "registered, no peers"
        }
        2..=4 => {
            let (a, _) = agent(n("ini")).await;
            let (b, bb) = agent(n("tgt")).await;
            let len = 1usize << (10 + rng.below(8));
            let src = a.register(vec![3u8; len]).unwrap();
            let dst = b.register(vec![0u8; len]).unwrap();
            a.load_metadata(&b.metadata().unwrap()).unwrap();
            let rd = whole_remote(&a, &n("tgt"), dst.id());
            let notif = (rng.below(2) == 0).then(|| Bytes::from(vec![1u8; 300]));
            if scenario == 2 {
                // Complete, then tear down in either order.
                a.write(&one(src.whole()), &n("tgt"), &rd, notif)
                    .await
                    .unwrap();
                assert_eq!(dst.to_vec().unwrap(), vec![3u8; len]);
                let sd = rng.below(2) == 0;
                if rng.below(2) == 0 {
                    end(a, sd, "pair a").await;
                    end(b, sd, "pair b").await;
                } else {
                    end(b, sd, "pair b").await;
                    end(a, sd, "pair a").await;
                }
                "transfer done, then teardown"
            } else if scenario == 3 {
                // In flight while the initiator stops. When frozen, the target thaws
                // (late completions) or goes away (flushed) first, so nothing stays
                // in the engine for good (that case is poisoned and leaked on
                // purpose; see the lifecycle tests).
                let frozen = rng.below(2) == 0;
                let meta = bb.engine_metadata().unwrap();
                if frozen {
                    test_double::freeze(&meta);
                }
                let t = a
                    .transfer(Op::Write, &one(src.whole()), &n("tgt"), &rd, notif)
                    .unwrap();
                tokio::time::sleep(Duration::from_micros(rng.below(3000))).await;
                let sd = rng.below(2) == 0;
                if frozen && rng.below(2) == 0 {
                    end(b, sd, "target first").await;
                    end(a, sd, "initiator stops mid-transfer").await;
                } else {
                    test_double::thaw(&meta);
                    end(a, sd, "initiator stops mid-transfer").await;
                    end(b, sd, "target after").await;
                }
                let _ = t.await;
                "initiator stops mid-transfer"
            } else {
                // The target vanishes mid-transfer.
                test_double::freeze(&bb.engine_metadata().unwrap());
                let t = a
                    .transfer(Op::Read, &one(src.whole()), &n("tgt"), &rd, notif)
                    .unwrap();
                tokio::time::sleep(Duration::from_micros(rng.below(3000))).await;
                drop(b);
                // Failed (liveness), or "done" because the engine flushed it first:
                // UCCL reports a flushed operation as done, and a one-sided
                // transport cannot tell. Either way it ends.
                let _ = t.await;
                end(a, true, "after the peer vanished").await;
                "peer vanishes mid-transfer"
            }
        }
        5 => {
            // Notifications only: the target never registers.
            let (a, _) = agent(n("note-a")).await;
            let (b, _) = agent(n("note-b")).await;
            a.load_metadata(&b.metadata().unwrap()).unwrap();
            let mut nb = b.notifications().unwrap();
            a.notify(&n("note-b"), "hi").unwrap().await.unwrap();
            assert_eq!(&nb.recv().await.unwrap().msg[..], b"hi");
            let sd = rng.below(2) == 0;
            end(b, sd, "notify b").await;
            end(a, sd, "notify a").await;
            "notifications without registrations"
        }
        _ => {
            // Two initiators on one host into one target, then everything dropped.
            let (t, _) = agent(n("hub")).await;
            let dst = t.register(vec![0u8; 8192]).unwrap();
            let mut xs = Vec::new();
            for k in 0..2 {
                let (x, _) = agent(n(&format!("spoke{k}"))).await;
                let s = x.register(vec![k as u8 + 1; 4096]).unwrap();
                x.load_metadata(&t.metadata().unwrap()).unwrap();
                let r = x
                    .remote_regions(&n("hub"))
                    .unwrap()
                    .into_iter()
                    .find(|r| r.id == dst.id())
                    .unwrap();
                x.write(
                    &one(s.whole()),
                    &n("hub"),
                    &one(r.desc(4096 * k, 4096)),
                    None,
                )
                .await
                .unwrap();
                xs.push((x, s));
            }
            let got = dst.to_vec().unwrap();
            assert!(got[..4096].iter().all(|&v| v == 1) && got[4096..].iter().all(|&v| v == 2));
            drop(xs);
            drop(t);
            "two initiators, one target, dropped"
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_shutdown_scenarios() {
    let runs: u64 = std::env::var("NIXL_UCCL_STRESS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed: u64 = std::env::var("NIXL_UCCL_STRESS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("stress: seed {seed}, {runs} runs (NIXL_UCCL_STRESS_SEED={seed} repeats them)");
    let t0 = Instant::now();
    let mut seen = std::collections::BTreeMap::<&str, u64>::new();
    for i in 0..runs {
        let what = tokio::time::timeout(WATCHDOG, run(seed, i))
            .await
            .unwrap_or_else(|_| {
                panic!("run {i} (seed {seed}) hung past the {WATCHDOG:?} watchdog")
            });
        *seen.entry(what).or_default() += 1;
    }
    // Everything is gone: threads, engines, connections; nothing was misused.
    for t in THREADS {
        assert!(
            threads::settle(t, 0),
            "{} thread(s) named {t} left",
            threads::named(t)
        );
    }
    assert!(
        test_double::wait_until(Duration::from_secs(10), || test_double::live_engines() == 0),
        "{} engine(s) never destroyed",
        test_double::live_engines()
    );
    assert!(
        test_double::wait_until(Duration::from_secs(10), || test_double::live_connections()
            == 0),
        "{} connection(s) never closed: {:?}",
        test_double::live_connections(),
        test_double::connection_details()
    );
    assert_eq!(test_double::violations(), Vec::<String>::new());
    assert_eq!(test_double::notifications_sent(), 0);
    println!("scenarios: {seen:?}");
    nixl_testkit::figure(
        "UCCL lifecycle stress (test double)",
        format!("{runs} runs in {:.1} s, 0 hangs, 0 leaked threads, engines or connections, 0 engine misuse", t0.elapsed().as_secs_f64()),
    );
}
