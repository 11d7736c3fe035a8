//! nixl-tcp's same-host path against an initiator that dies inside a copy.
//!
//! (Sealed shared memory and the initiator's checks of what a target offers are unit
//! tests of nixl-tcp's `shm` module: they need file descriptors made by hand.)

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nixl::{Agent, AgentOptions};
use nixl_conformance::support::{figure, hex, skip};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};

/// Kills the child however the test ends.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An initiator process SIGKILLed while it copies into the target's shared memory
/// leaves an access counted in the target's grant table that nothing will ever end.
/// The target finds it gone at once: deregistering the memory returns promptly, and
/// the agent's shutdown stays within its bound and is clean. (Before, both waited
/// 10 s per stuck grant, on the caller's thread or a tokio worker.)
///
/// A current-thread runtime on purpose: a wait that blocked its one thread would
/// stall the whole agent.
#[tokio::test]
async fn an_initiator_killed_inside_a_copy_holds_up_neither_deregistration_nor_shutdown() {
    killed_inside_a_copy(true).await;
}

/// As above, the memory still registered at shutdown: the shutdown's revocation of
/// every grant finds the initiator gone. (Its wait is bounded by half the shutdown
/// bound, so the shutdown's duration alone could not tell a revocation that found
/// the initiator gone from one that waited it out; a wait that runs out is named in
/// the shutdown report, which must be clean.)
#[tokio::test]
async fn an_initiator_killed_inside_a_copy_does_not_stretch_shutdown() {
    killed_inside_a_copy(false).await;
}

async fn killed_inside_a_copy(deregister_first: bool) {
    const CASE: &str = "same-host initiator killed inside a copy";
    // Large enough that nearly all of the child's time is spent inside a copy.
    const LEN: usize = 128 << 20;
    const BOUND: Duration = Duration::from_secs(3);
    let target = Agent::builder("target")
        .backend(TcpBackend::with_options(TcpOptions {
            same_host: SameHost::Auto,
            ..TcpOptions::default()
        }))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(1),
            shutdown_timeout: BOUND,
        })
        .build()
        .await
        .unwrap();
    let mem = target.register(target.alloc(LEN).unwrap()).unwrap();
    let md = hex(&target.metadata().unwrap());

    let mut child = Kill(
        Command::new(env!("CARGO_BIN_EXE_nixl-fault-initiator"))
            .env("NIXL_TCP_SAME_HOST", "auto")
            .env("NIXL_FAULT_WRITE_LEN", LEN.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn nixl-fault-initiator"),
    );
    writeln!(child.0.stdin.as_mut().unwrap(), "{md}").unwrap();
    // Lines arrive on a thread; this runtime keeps serving the child meanwhile.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let out = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut next = async |what: &str| {
        tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: nothing within 20 s"))
            .unwrap_or_else(|| panic!("{what}: the child exited"))
    };
    let path = next("the data path").await;
    if !path.starts_with("PATH same-host: shared memory") {
        skip(CASE, &format!("no same-host shared memory here: {path}"));
        return;
    }
    // Copies flow; the next is under way when the child dies.
    let mut last = String::new();
    for _ in 0..3 {
        last = next("a transfer").await;
        assert!(last.starts_with("OK"), "{last}");
    }
    // Into the next copy (a few milliseconds each; this lands about half way).
    let ms: u64 = last.trim_start_matches("OK ").parse().unwrap_or(0);
    std::thread::sleep(Duration::from_millis(ms / 2 + 1));
    let killed = Instant::now();
    // SIGKILL, and reaped: the process is gone, its copy cut short.
    child.0.kill().unwrap();
    child.0.wait().unwrap();

    // On this thread, before the connection's task has seen the end of the
    // connection: the revoke itself must find the initiator gone.
    if deregister_first {
        let r = target.deregister(&mem);
        let deregistered = killed.elapsed();
        assert!(r.is_ok(), "deregistration: {r:?}");
        assert!(
            deregistered < Duration::from_secs(2),
            "deregistration took {deregistered:?}"
        );
    }

    let started = Instant::now();
    let report = target.shutdown().await;
    let took = started.elapsed();
    assert!(
        took < BOUND + Duration::from_secs(1),
        "shutdown took {took:?}, past its bound of {BOUND:?}"
    );
    assert!(report.is_clean(), "{report:?}");
    figure(
        &format!(
            "hostile: same-host initiator SIGKILLed inside a copy ({})",
            if deregister_first {
                "deregistered, then shut down"
            } else {
                "shut down registered"
            }
        ),
        format!(
            "target shutdown {} ms (bound {} s), clean",
            took.as_millis(),
            BOUND.as_secs()
        ),
    );
    drop(mem);
}
