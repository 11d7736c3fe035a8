//! Backend threads started through `BackendContext::spawn_thread` are gone after
//! shutdown, after dropping the agent, and after dropping the runtime that ran the
//! agent, without anyone calling shutdown; one that ignores its stop is named in the
//! report, and shutdown stays bounded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nixl::{
    Agent, AgentOptions, BackendContext, Capabilities, PreparedTransfer, Result, TransferPlan,
};
use nixl_testkit::double::{backend, Double};

/// Test double: a backend whose only work is one OS thread that blocks in a channel
/// receive until its wake sends on the channel (or, when `stubborn`, ignores its stop
/// until the test releases it). With `slow_stop`, its shutdown takes 300 ms and then
/// sets the flag.
#[derive(Debug)]
struct ThreadDouble {
    thread: String,
    stubborn: Option<Arc<AtomicBool>>,
    slow_stop: Option<Arc<AtomicBool>>,
}

#[async_trait]
impl Double for ThreadDouble {
    fn name(&self) -> &str {
        "threads"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            dram: true,
            ..Capabilities::default()
        }
    }
    async fn start(&self, ctx: BackendContext) -> Result<()> {
        let (tx, rx) = mpsc::channel::<()>();
        let tx = Mutex::new(tx);
        let stubborn = self.stubborn.clone();
        ctx.spawn_thread(
            &self.thread,
            move |stop| match stubborn {
                Some(release) => {
                    while !release.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                None => {
                    // Blocks until woken; the token is set before the wake.
                    let _ = rx.recv();
                    assert!(stop.is_cancelled(), "woken without being stopped");
                }
            },
            move || {
                let _ = tx.lock().unwrap().send(());
            },
        )
    }
    fn prepare(&self, _plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        unreachable!("no transfers in this test")
    }
    async fn shutdown(&self, _timeout: Duration) -> Result<()> {
        if let Some(stopped) = &self.slow_stop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            stopped.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
}

use nixl_testkit::threads::settle;

/// One thread named `name` is running.
fn running(name: &str) -> bool {
    settle(name, 1)
}

/// No thread is named `name` any more.
fn gone(name: &str) -> bool {
    settle(name, 0)
}

async fn agent(thread: &str) -> Agent {
    Agent::builder("threads")
        .backend(backend(ThreadDouble {
            thread: thread.into(),
            stubborn: None,
            slow_stop: None,
        }))
        .build()
        .await
        .unwrap()
}

#[tokio::test]
async fn thread_gone_after_shutdown() {
    const T: &str = "t-shutdown";
    let a = agent(T).await;
    assert!(running(T));
    assert_eq!(a.task_monitor().threads(), [T]);
    let report = a.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
    assert!(report.threads_left.is_empty());
    assert!(gone(T), "thread {T} still running after shutdown");
    assert!(a.task_monitor().threads().is_empty());
}

#[tokio::test]
async fn thread_gone_after_dropping_the_agent() {
    const T: &str = "t-drop-agent";
    let a = agent(T).await;
    let monitor = a.task_monitor();
    assert!(running(T));
    drop(a);
    // Dropping joins (bounded) before it returns.
    assert!(monitor.threads().is_empty());
    assert!(
        gone(T),
        "thread {T} still running after the agent was dropped"
    );
}

#[test]
fn thread_gone_after_dropping_the_runtime() {
    const T: &str = "t-drop-runtime";
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The agent lives in a task that never ends; dropping the runtime drops the task
    // and with it the agent, with no shutdown call and no runtime left to run one.
    let (tx, rx) = mpsc::channel();
    rt.spawn(async move {
        let a = agent(T).await;
        tx.send(a.task_monitor()).unwrap();
        std::future::pending::<()>().await;
        drop(a);
    });
    let monitor = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(running(T));
    drop(rt);
    assert!(monitor.threads().is_empty());
    assert!(
        gone(T),
        "thread {T} still running after the runtime was dropped"
    );

    // And an agent that outlives its runtime: its drop, outside any runtime, joins.
    const T2: &str = "t-outlives-rt";
    let rt = tokio::runtime::Runtime::new().unwrap();
    let a = rt.block_on(agent(T2));
    drop(rt);
    assert!(running(T2), "the agent still owns its thread");
    drop(a);
    assert!(
        gone(T2),
        "thread {T2} still running after the agent was dropped"
    );
}

#[tokio::test]
async fn stubborn_thread_is_named_not_waited_on() {
    const T: &str = "t-stubborn";
    let release = Arc::new(AtomicBool::new(false));
    let a = Agent::builder("stubborn")
        .backend(backend(ThreadDouble {
            thread: T.into(),
            stubborn: Some(release.clone()),
            slow_stop: None,
        }))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(1),
            shutdown_timeout: Duration::from_millis(200),
        })
        .build()
        .await
        .unwrap();
    let t0 = Instant::now();
    let report = a.shutdown().await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "shutdown not bounded"
    );
    assert_eq!(report.threads_left, [T]);
    assert!(!report.is_clean());
    release.store(true, Ordering::SeqCst);
    assert!(gone(T));
}

/// A second `shutdown()` while the first runs returns only once the first finished.
#[tokio::test]
async fn a_concurrent_shutdown_waits_for_the_first() {
    let stopped = Arc::new(AtomicBool::new(false));
    let a = Agent::builder("slow")
        .backend(backend(ThreadDouble {
            thread: "t-slow-stop".into(),
            stubborn: None,
            slow_stop: Some(stopped.clone()),
        }))
        .build()
        .await
        .unwrap();
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.shutdown().await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = a.shutdown().await;
    assert!(second.already_shut_down);
    assert!(
        stopped.load(Ordering::SeqCst),
        "the second call returned while the first was still stopping the backend"
    );
    let first = first.await.unwrap();
    assert!(!first.already_shut_down && first.is_clean(), "{first:?}");
}
