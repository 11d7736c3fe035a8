//! nixl-tcp WRITE throughput between two processes beside a plain loopback TCP stream,
//! measured in the same run.
//!
//! Run: `cargo run --release -p nixl-examples --example tcp_baseline`
//!
//! The plain stream is the ceiling: one socket, one process writing a buffer in a loop,
//! the other reading into a buffer. nixl-tcp adds request headers, target-side checks,
//! acknowledgements and, at depth 1, a round trip per transfer.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nixl::{Agent, DescList, MemKind, Op, RequestOptions};
use nixl_tcp::TcpBackend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MAX: usize = 16 << 20;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Child: a nixl target with a 4 x 16 MiB region, and a plain TCP sink.
async fn child() {
    let agent = Agent::builder("target")
        .backend(TcpBackend::new())
        .build()
        .await
        .unwrap();
    let _mem = agent.register(vec![0u8; 4 * MAX]).unwrap();
    let sink = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!(
        "{} {}",
        sink.local_addr().unwrap().port(),
        hex(&agent.metadata().unwrap())
    );
    std::io::stdout().flush().unwrap();
    let mut notes = agent.notifications().unwrap();
    let (mut s, _) = sink.accept().await.unwrap();
    s.set_nodelay(true).unwrap();
    let mut buf = vec![0u8; MAX];
    let mut total: u64 = 0;
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    s.write_all(&total.to_le_bytes()).await.unwrap();
    notes.recv().await;
    drop(notes);
    let _ = agent.shutdown().await;
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().nth(1).as_deref() == Some("child") {
        return child().await;
    }
    let mut proc = Command::new(std::env::current_exe().unwrap())
        .arg("child")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(proc.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let mut parts = line.split_whitespace();
    let port: u16 = parts.next().unwrap().parse().unwrap();
    let md = unhex(parts.next().unwrap());

    let agent = Agent::builder("initiator")
        .backend(TcpBackend::new())
        .build()
        .await
        .unwrap();
    agent.load_metadata(&md).unwrap();
    agent.connect("target").await.unwrap();
    let src = agent.register(vec![0xA5u8; 4 * MAX]).unwrap();
    let remote = agent.remote_regions("target").unwrap()[0].clone();

    println!(
        "{:>10} {:>6} {:>14} {:>14} {:>8}",
        "block", "depth", "nixl-tcp GB/s", "plain TCP GB/s", "ratio"
    );
    let mut plain_results = Vec::new();
    // Plain TCP first: one stream, total bytes as the nixl runs below.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.set_nodelay(true).unwrap();
    let data = vec![0x5Au8; MAX];
    for &size in &[1usize << 20, 16 << 20] {
        let iters = (1usize << 30) / size; // 1 GiB per point
        let t = Instant::now();
        for _ in 0..iters {
            s.write_all(&data[..size]).await.unwrap();
        }
        s.flush().await.unwrap();
        plain_results.push((size, (iters * size) as u64, t.elapsed()));
    }
    s.shutdown().await.unwrap();
    let mut ack = [0u8; 8];
    s.read_exact(&mut ack).await.unwrap();
    // The last bytes were still in flight when the clock stopped for the last point;
    // the receiver's count confirms everything arrived.
    assert_eq!(
        u64::from_le_bytes(ack),
        plain_results.iter().map(|r| r.1).sum::<u64>()
    );

    for (size, _, plain_time) in &plain_results {
        let size = *size;
        let plain = gbps((1u64 << 30) / size as u64 * size as u64, *plain_time);
        for depth in [1usize, 4] {
            let reqs: Vec<_> = (0..depth)
                .map(|i| {
                    let off = (i * MAX) as u64;
                    agent
                        .create_request(
                            Op::Write,
                            &DescList::from_descs(MemKind::Dram, [src.desc(off, size as u64)]),
                            "target",
                            &DescList::from_descs(MemKind::Dram, [remote.desc(off, size as u64)]),
                            &RequestOptions::default(),
                        )
                        .unwrap()
                })
                .collect();
            let iters = (1usize << 30) / size / depth;
            let t = Instant::now();
            for _ in 0..iters {
                let transfers: Vec<_> = reqs.iter().map(|r| r.post(None).unwrap()).collect();
                for tr in transfers {
                    tr.await.unwrap();
                }
            }
            let elapsed = t.elapsed();
            let nixl = gbps((iters * depth * size) as u64, elapsed);
            println!(
                "{:>10} {:>6} {:>14.2} {:>14.2} {:>7.0}%",
                size,
                depth,
                nixl,
                plain,
                100.0 * nixl / plain
            );
        }
    }
    agent.notify("target", "done").unwrap().await.unwrap();
    let _ = agent.shutdown().await;
    proc.wait().unwrap();
}
