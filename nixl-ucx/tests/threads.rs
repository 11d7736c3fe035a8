//! The progress thread (`ProgressMode::Thread`) is owned by the agent: gone after
//! shutdown, after dropping the agent, and after dropping the runtime that ran the
//! agent without shutdown. One test, so no other test of this process starts
//! progress threads meanwhile (threads are counted by name).

mod common;

use std::time::Duration;

use nixl::Agent;
use nixl_testkit::threads::{named, settle};
use nixl_ucx::{ProgressMode, UcxOptions};

const THREAD: &str = "nixl-ucx-progress";
const TEST: &str = "progress_thread_never_outlives_its_agent";

async fn agent(name: &str) -> Option<Agent> {
    let o = UcxOptions {
        progress: ProgressMode::Thread,
        ..UcxOptions::default()
    };
    common::agent(TEST, name, o).await.map(|(a, _)| a)
}

#[test]
fn progress_thread_never_outlives_its_agent() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 1. shutdown(): the report names no thread, and none is left.
    let Some(a) = rt.block_on(agent("a")) else {
        return;
    };
    assert!(settle(THREAD, 1), "{} progress threads", named(THREAD));
    assert_eq!(a.task_monitor().threads(), [THREAD]);
    let report = rt.block_on(a.shutdown());
    assert!(report.is_clean(), "{report:?}");
    assert!(settle(THREAD, 0), "progress thread left after shutdown");

    // 2. Dropping the agent (no shutdown) joins it.
    let b = rt.block_on(agent("b")).unwrap();
    let monitor = b.task_monitor();
    assert!(settle(THREAD, 1));
    drop(b);
    assert!(monitor.threads().is_empty());
    assert!(
        settle(THREAD, 0),
        "progress thread left after dropping the agent"
    );

    // 3. The runtime goes first, with the agent inside a task that never ends:
    // dropping the runtime drops the agent, with no runtime left to run anything.
    let (tx, rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let c = agent("c").await.unwrap();
        tx.send(c.task_monitor()).unwrap();
        std::future::pending::<()>().await;
        drop(c);
    });
    let monitor = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(settle(THREAD, 1));
    drop(rt);
    assert!(monitor.threads().is_empty());
    assert!(
        settle(THREAD, 0),
        "progress thread left after dropping the runtime"
    );

    // 4. An agent that outlives its runtime still owns its thread, until dropped.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let d = rt.block_on(agent("d")).unwrap();
    drop(rt);
    assert!(settle(THREAD, 1), "the agent still owns its thread");
    drop(d);
    assert!(
        settle(THREAD, 0),
        "progress thread left after dropping the agent"
    );
}
