//! The randomized lifecycle driver ("teardown torture").
//!
//! Each run, from one seed: a few agents are created, some listen on the side channel,
//! they exchange metadata (in-band or over the side channel), register and deregister
//! memory, post transfers that are awaited, dropped mid-flight or left pending,
//! reload or forget peers, notify, and are shut down or dropped, in random order. Every
//! await has a watchdog. At the end every pending transfer must resolve, every agent's
//! tasks must have ended, and the process must not have gained threads. Successful
//! WRITEs that had the memory to themselves are verified byte for byte.
//!
//! A failing run prints its seed; rerun it alone with `NIXL_TORTURE_SEED=<seed>` and
//! `NIXL_TORTURE_RUNS=1`.

use std::time::Duration;

use bytes::Bytes;
use nixl::{
    Agent, AgentOptions, DescList, MemKind, Op, Registration, SideChannelOptions, TaskMonitor,
    Transfer,
};

use crate::support::{own_thread_count, thread_count, thread_names, BackendUnderTest};

/// Watchdog for each await inside a run.
const WATCHDOG: Duration = Duration::from_secs(20);

/// Totals over many runs.
#[derive(Debug, Default, Clone)]
pub struct TortureReport {
    /// Runs completed.
    pub runs: u64,
    /// Random operations performed.
    pub ops: u64,
    /// Transfers posted.
    pub posted: u64,
    /// Transfers that completed successfully.
    pub succeeded: u64,
    /// Transfers that failed with an error (peer gone, memory deregistered, ...).
    pub failed: u64,
    /// Transfer futures dropped while in flight.
    pub dropped: u64,
    /// Bytes of successful WRITEs verified at the target.
    pub bytes_verified: u64,
    /// Bytes that differed (must stay zero).
    pub bytes_lost: u64,
    /// Agents shut down / dropped.
    pub shutdowns: u64,
    /// Agents dropped without shutdown.
    pub drops: u64,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

struct Slot {
    agent: Agent,
    monitor: TaskMonitor,
    regs: Vec<Registration>,
    listen: Option<std::net::SocketAddr>,
    alive: bool,
}

async fn watchdog<F: std::future::Future>(seed: u64, what: &str, f: F) -> F::Output {
    match tokio::time::timeout(WATCHDOG, f).await {
        Ok(x) => x,
        Err(_) => panic!("seed {seed}: {what} hung for {WATCHDOG:?}"),
    }
}

/// A `u64` from the environment variable `name`, if set and valid.
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The base seed: `NIXL_TORTURE_SEED`, else the clock (printed by the callers, so a
/// failing run can be reproduced).
pub fn base_seed() -> u64 {
    env_u64("NIXL_TORTURE_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    })
}

/// With `NIXL_TORTURE_TRACE` set to a log filter (for example
/// `nixl=debug,nixl_tcp=trace`), the last 20,000 log lines are kept and printed when
/// the test panics (a watchdog fired), so a rare hang shows what the agents did last.
pub fn keep_logs_for_a_failure() {
    use std::collections::VecDeque;
    use std::sync::{Mutex, OnceLock};
    const KEEP: usize = 20_000;
    static RING: OnceLock<Mutex<VecDeque<String>>> = OnceLock::new();
    let Ok(filter) = std::env::var("NIXL_TORTURE_TRACE") else {
        return;
    };
    struct Ring;
    impl std::io::Write for Ring {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let mut r = RING.get_or_init(Mutex::default).lock().unwrap();
            if r.len() == KEEP {
                r.pop_front();
            }
            r.push_back(String::from_utf8_lossy(b).into_owned());
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(false)
        .with_thread_names(true)
        .with_writer(|| Ring)
        .try_init();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Some(r) = RING.get() {
            let r = r.lock().unwrap_or_else(|p| p.into_inner());
            eprintln!("-- the last {} log lines --", r.len());
            for l in r.iter() {
                eprint!("{l}");
            }
        }
        previous(info);
    }));
}

/// Run `count` lifecycles with seeds `base..base+count` against `but`.
pub async fn run_lifecycles(but: &BackendUnderTest, base: u64, count: u64) -> TortureReport {
    let mut report = TortureReport::default();
    let threads_before = own_thread_count(&format!("lifecycle torture ({})", but.name));
    for i in 0..count {
        let seed = base.wrapping_add(i) | 1;
        one_run(but, seed, &mut report).await;
        report.runs += 1;
        if let Some(before) = threads_before {
            let threads = thread_count();
            assert!(
                threads <= before,
                "seed {seed}: {threads} threads after the run, {before} before: {:?}",
                thread_names()
            );
        }
    }
    report
}

async fn one_run(but: &BackendUnderTest, seed: u64, report: &mut TortureReport) {
    let mut rng = Rng(seed);
    let side = SideChannelOptions {
        timeout: Duration::from_secs(5),
        ..Default::default()
    };
    let n = 2 + rng.below(2);
    let mut slots = Vec::new();
    for i in 0..n {
        let backend = (but.make)().expect("backend constructs");
        let agent = Agent::builder(format!("t{i}"))
            .backend_arc(backend)
            .options(AgentOptions {
                drain_timeout: Duration::from_secs(2),
                shutdown_timeout: Duration::from_secs(5),
            })
            .build()
            .await
            .expect("agent builds");
        let listen = if rng.chance(50) {
            Some(
                agent
                    .listen("127.0.0.1:0".parse().unwrap(), &side)
                    .await
                    .unwrap(),
            )
        } else {
            None
        };
        let monitor = agent.task_monitor();
        slots.push(Slot {
            agent,
            monitor,
            regs: Vec::new(),
            listen,
            alive: true,
        });
    }
    for s in &mut slots {
        let size = 1 + rng.below(64 * 1024);
        s.regs.push(s.agent.register(vec![0u8; size]).unwrap());
    }
    // Metadata exchange.
    for i in 0..n {
        for j in 0..n {
            if i == j || rng.chance(20) {
                continue;
            }
            match slots[j].listen {
                Some(addr) if rng.chance(50) => {
                    watchdog(
                        seed,
                        "side-channel fetch",
                        slots[i].agent.fetch_metadata(addr, &side),
                    )
                    .await
                    .unwrap();
                }
                _ => {
                    let md = slots[j].agent.metadata().unwrap();
                    slots[i].agent.load_metadata(&md).unwrap();
                }
            }
        }
    }
    // Every registration ever made in this run, to know whether any transfer (also a
    // dropped one the backend has not finished yet) may still touch memory.
    let mut all_regs: Vec<Registration> = slots.iter().flat_map(|s| s.regs.clone()).collect();
    let quiet = |all: &[Registration]| all.iter().all(|r| r.inflight() == 0);
    let mut pending: Vec<Transfer> = Vec::new();
    let ops = 10 + rng.below(25);
    for _ in 0..ops {
        report.ops += 1;
        let i = rng.below(n);
        let j = rng.below(n);
        match rng.below(100) {
            0..=9 => {
                if slots[i].alive {
                    let size = 1 + rng.below(256 * 1024);
                    if let Ok(r) = slots[i].agent.register(vec![rng.next() as u8; size]) {
                        all_regs.push(r.clone());
                        slots[i].regs.push(r);
                    }
                }
            }
            10..=15 => {
                if !slots[i].regs.is_empty() {
                    let k = rng.below(slots[i].regs.len());
                    if slots[i].agent.deregister(&slots[i].regs[k]).is_ok() {
                        slots[i].regs.swap_remove(k);
                    }
                }
            }
            16..=20 => {
                if i != j && slots[j].alive {
                    if let Ok(md) = slots[j].agent.metadata() {
                        let _ = slots[i].agent.load_metadata(&md);
                    }
                }
            }
            21..=23 => {
                let _ = slots[i].agent.forget_peer(&format!("t{j}"));
            }
            24..=27 => {
                if let Ok(t) = slots[i]
                    .agent
                    .notify(&format!("t{j}"), Bytes::from_static(b"ping"))
                {
                    pending.push(t);
                }
            }
            28..=30 => {
                // Shut down or drop an agent.
                if slots[i].alive {
                    slots[i].alive = false;
                    report.shutdowns += 1;
                    if rng.chance(50) {
                        let r = watchdog(seed, "shutdown", slots[i].agent.shutdown()).await;
                        assert_eq!(r.tasks_left, 0, "seed {seed}: {r:?}");
                    } else {
                        report.drops += 1;
                        let fresh = Agent::builder(format!("gone{i}")).build().await.unwrap();
                        drop(std::mem::replace(&mut slots[i].agent, fresh));
                        slots[i].regs.clear();
                    }
                }
            }
            _ => {
                // A transfer from i to j (j == i: a local transfer).
                let peer = format!("t{j}");
                let Some(local) = slots[i]
                    .regs
                    .get(rng.below(slots[i].regs.len().max(1)))
                    .cloned()
                else {
                    continue;
                };
                let remote = if i == j {
                    slots[i]
                        .regs
                        .get(rng.below(slots[i].regs.len()))
                        .map(|r| (r.addr(), r.len() as u64, None))
                } else {
                    match slots[i].agent.remote_regions(&peer) {
                        Ok(rs) if !rs.is_empty() => {
                            let r = &rs[rng.below(rs.len())];
                            let reg = slots[j]
                                .regs
                                .iter()
                                .find(|x| x.id() == r.id && x.addr() == r.addr)
                                .cloned();
                            Some((r.addr, r.len, reg))
                        }
                        _ => None,
                    }
                };
                let Some((raddr, rlen, rreg)) = remote else {
                    continue;
                };
                let len = 1 + rng.below(local.len().min(rlen as usize));
                let lo = rng.below(local.len() - len + 1) as u64;
                let ro = rng.below(rlen as usize - len + 1) as u64;
                let op = if rng.chance(50) { Op::Write } else { Op::Read };
                let ld = DescList::from_descs(MemKind::Dram, [local.desc(lo, len as u64)]);
                let rd = DescList::from_descs(
                    MemKind::Dram,
                    [nixl::Desc::new(raddr + ro, len as u64, 0)],
                );
                let notif = rng.chance(30).then(|| Bytes::from_static(b"n"));
                let notif_set = notif.is_some();
                let alone = pending.is_empty() && quiet(&all_regs);
                let Ok(t) = slots[i].agent.transfer(op, &ld, &peer, &rd, notif) else {
                    continue;
                };
                report.posted += 1;
                match rng.below(3) {
                    0 => {
                        drop(t);
                        report.dropped += 1;
                    }
                    1 => pending.push(t),
                    _ => {
                        // What the transfer was, for the message should it hang.
                        let what = format!(
                            "transfer ({op:?} t{i} -> t{j}, {len} bytes, notification {}, target {}, target known {})",
                            notif_set,
                            if slots[j].alive { "alive" } else { "gone" },
                            slots[i].agent.peers().contains(&peer),
                        );
                        match watchdog(seed, &what, t).await {
                            Ok(()) => {
                                report.succeeded += 1;
                                // Verify a WRITE that nothing else could have touched.
                                let alone = alone && quiet(&all_regs);
                                if let (Op::Write, true, Some(target)) = (op, alone && i != j, rreg)
                                {
                                    let mut a = vec![0u8; len];
                                    let mut b = vec![0u8; len];
                                    local.read_at(lo as usize, &mut a).unwrap();
                                    target.read_at(ro as usize, &mut b).unwrap();
                                    report.bytes_verified += len as u64;
                                    report.bytes_lost +=
                                        a.iter().zip(&b).filter(|(x, y)| x != y).count() as u64;
                                }
                            }
                            Err(_) => report.failed += 1,
                        }
                    }
                }
            }
        }
    }
    // Every pending transfer resolves.
    for t in pending {
        match watchdog(seed, "pending transfer", t).await {
            Ok(()) => report.succeeded += 1,
            Err(_) => report.failed += 1,
        }
    }
    // Tear down what is left, randomly by shutdown or drop; every task must end.
    let mut monitors = Vec::new();
    for s in slots {
        monitors.push(s.monitor.clone());
        if s.alive {
            report.shutdowns += 1;
            if rng.chance(50) {
                let r = watchdog(seed, "final shutdown", s.agent.shutdown()).await;
                assert_eq!(r.tasks_left, 0, "seed {seed}: {r:?}");
            } else {
                report.drops += 1;
                drop(s.agent);
            }
        }
    }
    for m in monitors {
        watchdog(seed, "agent tasks to end", m.wait()).await;
        assert!(m.is_empty(), "seed {seed}: tasks left");
    }
    assert_eq!(
        report.bytes_lost, 0,
        "seed {seed}: bytes differ after a successful WRITE"
    );
}
