//! An initiator that writes to a peer in a loop, for network-fault tests.
//!
//! Reads the target's metadata (hex) as the first line of stdin, then posts 4 MiB
//! WRITEs (`NIXL_FAULT_WRITE_LEN` bytes, when set) back to back, printing `OK <ms>`
//! or `ERR <kind> <ms>` for each, until stdin says `stop` (or closes); then shuts
//! down and prints `STOPPED`. After the first transfer it prints `PATH <data path>`
//! (how the backend reaches the target). TCP options come from the `NIXL_TCP_*`
//! variables (see `tcp_options_from_env`).
#![forbid(unsafe_code)]

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use nixl::{Agent, Backend, DescList, MemKind, Op};
use nixl_conformance::support::{tcp_options_from_env, unhex};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let md = unhex(rx.recv().await.expect("metadata line").trim()).expect("hex");
    let backend = nixl_tcp::TcpBackend::with_options(tcp_options_from_env());
    let agent = Agent::builder("initiator")
        .backend(backend.clone())
        .build()
        .await
        .expect("agent");
    let peer = agent.load_metadata(&md).expect("metadata");
    let len: u64 = std::env::var("NIXL_FAULT_WRITE_LEN")
        .ok()
        .map(|v| v.parse().expect("NIXL_FAULT_WRITE_LEN: a byte count"))
        .unwrap_or(4 << 20);
    let src = agent
        .register(vec![0x3Cu8; len as usize])
        .expect("register");
    let remote = agent.remote_regions(&peer).unwrap()[0].clone();
    let local = DescList::from_descs(MemKind::Dram, [src.whole()]);
    let target = DescList::from_descs(MemKind::Dram, [remote.desc(0, len)]);
    let mut out = std::io::stdout();
    let mut first = true;
    loop {
        match rx.try_recv() {
            Ok(l) if l.trim() == "stop" => break,
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => break,
            _ => {}
        }
        let t0 = Instant::now();
        let r = match agent.transfer(Op::Write, &local, &peer, &target, None) {
            Ok(t) => tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .unwrap_or_else(|_| {
                    Err(nixl::Error::new(
                        nixl::ErrorKind::TimedOut,
                        "fault test",
                        "hung for 60 s",
                    ))
                }),
            Err(e) => Err(e),
        };
        let ms = t0.elapsed().as_millis();
        if std::mem::take(&mut first) {
            let path = backend.data_path(&peer).unwrap_or_else(|| "unknown".into());
            say(writeln!(out, "PATH {path}"));
        }
        match r {
            Ok(()) => say(writeln!(out, "OK {ms}")),
            Err(e) => {
                say(writeln!(out, "ERR {:?} {ms} {e}", e.kind()));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        say(out.flush());
    }
    let report = agent.shutdown().await;
    say(writeln!(out, "STOPPED clean={}", report.is_clean()));
}

/// A line to the parent; once the parent stopped listening (it killed or left this
/// child), there is nobody to tell: exit quietly instead of panicking.
fn say(written: std::io::Result<()>) {
    if written.is_err() {
        std::process::exit(0);
    }
}
