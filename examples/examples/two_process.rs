//! A target process and an initiator process; the target's metadata travels through a
//! pipe (the target's stdout).
//!
//! Run: `cargo run -p nixl-examples --example two_process` (the initiator starts the
//! target as a child process). Or by hand, in two shells:
//! `two_process target > md.hex` and `two_process initiator md.hex`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use nixl::{Agent, DescList, MemKind};
use nixl_tcp::TcpBackend;

const SIZE: usize = 8 << 20;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

async fn target() -> nixl::Result<()> {
    let agent = Agent::builder("target")
        .backend(TcpBackend::new())
        .build()
        .await?;
    let mem = agent.register(vec![0u8; SIZE])?;
    let mut notes = agent.notifications()?;
    println!("{}", hex(&agent.metadata()?));
    std::io::stdout().flush().ok();
    while let Some(n) = notes.recv().await {
        if &n.msg[..] == b"done" {
            let sum: u64 = mem.to_vec()?.iter().map(|&b| b as u64).sum();
            eprintln!(
                "[target] {} says done; byte sum of my memory: {sum}",
                n.peer
            );
            break;
        }
    }
    drop(notes);
    let _ = agent.shutdown().await;
    Ok(())
}

async fn initiator(metadata: Vec<u8>) -> nixl::Result<()> {
    let agent = Agent::builder("initiator")
        .backend(TcpBackend::new())
        .build()
        .await?;
    let peer = agent.load_metadata(&metadata)?;
    let src = agent.register(vec![3u8; SIZE])?;
    let remote = agent.remote_regions(&peer)?[0].clone();
    let t = std::time::Instant::now();
    agent
        .write(
            &DescList::from_descs(MemKind::Dram, [src.whole()]),
            &peer,
            &DescList::from_descs(MemKind::Dram, [remote.desc(0, SIZE as u64)]),
            None,
        )
        .await?;
    println!(
        "[initiator] wrote {SIZE} bytes to {peer} in {:?}; expected byte sum {}",
        t.elapsed(),
        3 * SIZE
    );
    agent.notify(&peer, "done")?.await?;
    let _ = agent.shutdown().await;
    Ok(())
}

#[tokio::main]
async fn main() -> nixl::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("target") => target().await,
        Some("initiator") => {
            let file = args
                .get(2)
                .expect("usage: two_process initiator <metadata-file>");
            let text = std::fs::read_to_string(file).expect("read metadata file");
            initiator(unhex(text.trim())).await
        }
        _ => {
            // Start the target as a child and read its metadata from the pipe.
            let mut child = Command::new(std::env::current_exe().expect("own path"))
                .arg("target")
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn target");
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .expect("metadata line");
            let result = initiator(unhex(line.trim())).await;
            let status = child.wait().expect("target exit");
            println!("[initiator] target exited: {status}");
            result
        }
    }
}
