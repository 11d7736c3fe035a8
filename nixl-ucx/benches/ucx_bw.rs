//! DRAM-to-DRAM WRITE and READ bandwidth between two processes over nixl-ucx.
//!
//! `cargo bench -p nixl-ucx --bench ucx_bw` (UCX picks transports from `UCX_TLS`).
//! The target is this same binary, re-run as a child (`NIXL_UCX_BW_ROLE=target`); metadata
//! goes over the child's stdin/stdout. Both sides register two buffers: one UCX
//! allocated ([`UcxBackend::alloc`], shared memory a peer on this host maps directly,
//! as `ucx_perftest` uses) and one ordinary ([`AlignedBuf`], reached by CMA or, on UCX
//! 1.13, by active messages). Prints one line per (size, batch) with GB/s (10^9
//! bytes/s) for WRITE and READ on each, one request in flight, and the median time of
//! a single post, as seen by the awaiting task (post to completion). `NIXL_UCX_BW_SIZES`
//! (bytes, comma-separated), `NIXL_UCX_BW_SECS` (per point), `NIXL_UCX_BW_MEM` (`ucx`,
//! `host` or `both`) and `NIXL_UCX_BW_SPAN` (bytes a batch's descriptors spread over;
//! `0`: all on one block, as ucx_perftest reuses one buffer) adjust the run. `benches/compare.sh` runs `ucx_perftest`
//! beside it.
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nixl::{Agent, AlignedBuf, DescList, MemKind, Op, RequestOptions};
use nixl_ucx::UcxBackend;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

const MAX_BUF: usize = 128 << 20;

const MEMS: [&str; 2] = ["ucx", "host"];

fn buffers(backend: &UcxBackend, a: &Agent) -> Vec<nixl::Registration> {
    let ucx = backend.alloc(MAX_BUF).expect("UCX allocates");
    vec![
        a.register(ucx).expect("register"),
        a.register(AlignedBuf::new(MAX_BUF)).expect("register"),
    ]
}

async fn target() {
    let backend = UcxBackend::new().expect("UCX loads");
    let a = Agent::builder("bw-target")
        .backend(backend.clone())
        .build()
        .await
        .expect("agent");
    let _r = buffers(&backend, &a);
    println!("{}", hex(&a.metadata().expect("metadata")));
    std::io::stdout().flush().ok();
    // Wait until the initiator closes our stdin.
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    let _ = a.shutdown().await;
}

async fn initiator() {
    let sizes: Vec<usize> = std::env::var("NIXL_UCX_BW_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| (0..7).map(|i| 4096 << (2 * i)).collect());
    let secs: f64 = std::env::var("NIXL_UCX_BW_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.3);
    // How far a batch's descriptors spread (bytes); `NIXL_UCX_BW_SPAN=0` puts them
    // all on one block, as ucx_perftest reuses one buffer.
    let max_span: usize = std::env::var("NIXL_UCX_BW_SPAN")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(MAX_BUF)
        .min(MAX_BUF);
    let mems: Vec<usize> = match std::env::var("NIXL_UCX_BW_MEM").as_deref() {
        Ok("ucx") => vec![0],
        Ok("host") => vec![1],
        _ => vec![0, 1],
    };
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .env("NIXL_UCX_BW_ROLE", "target")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn target");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("target metadata");
    let backend = UcxBackend::new().expect("UCX loads");
    eprintln!("{}", backend.library_report());
    let a = Agent::builder("bw-initiator")
        .backend(backend.clone())
        .build()
        .await
        .expect("agent");
    let local = buffers(&backend, &a);
    let peer = a.load_metadata(&unhex(line.trim())).expect("load");
    a.connect(&peer).await.expect("connect");
    let remote = a.remote_regions(&peer).expect("regions");
    print!("{:>10} {:>6}", "size", "batch");
    for &m in &mems {
        let m = MEMS[m];
        print!(
            " {:>11} {:>11} {:>11}",
            format!("{m} WRITE"),
            format!("{m} READ"),
            format!("{m} p50 us")
        );
    }
    println!();
    for &size in &sizes {
        for batch in [1usize, 32] {
            print!("{size:>10} {batch:>6}");
            for &m in &mems {
                let (src, rr) = (&local[m], &remote[m]);
                let mut cols = Vec::new();
                let mut lat = 0.0;
                for op in [Op::Write, Op::Read] {
                    let span = (size * batch).min(max_span).max(size);
                    let offs: Vec<u64> = (0..batch).map(|i| ((i * size) % span) as u64).collect();
                    let l = DescList::from_descs(
                        MemKind::Dram,
                        offs.iter().map(|&o| src.desc(o, size as u64)),
                    );
                    let r = DescList::from_descs(
                        MemKind::Dram,
                        offs.iter().map(|&o| rr.desc(o, size as u64)),
                    );
                    let req = a
                        .create_request(
                            op,
                            &l,
                            &peer,
                            &r,
                            &RequestOptions {
                                merge: false,
                                ..Default::default()
                            },
                        )
                        .expect("request");
                    for _ in 0..10 {
                        req.post(None).expect("post").await.expect("warm-up");
                    }
                    let mut times = Vec::new();
                    let t0 = Instant::now();
                    let mut n = 0u64;
                    while t0.elapsed() < Duration::from_secs_f64(secs) || n < 10 {
                        let t = Instant::now();
                        req.post(None).expect("post").await.expect("transfer");
                        times.push(t.elapsed());
                        n += 1;
                    }
                    let el = t0.elapsed().as_secs_f64();
                    cols.push((n as f64 * (size * batch) as f64) / el / 1e9);
                    if op == Op::Write {
                        times.sort();
                        lat = times[times.len() / 2].as_secs_f64() * 1e6;
                    }
                }
                print!(" {:>11.3} {:>11.3} {:>11.2}", cols[0], cols[1], lat);
            }
            println!();
        }
    }
    drop(child.stdin.take());
    let _ = a.shutdown().await;
    let _ = child.wait();
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs us with no work.
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match std::env::var("NIXL_UCX_BW_ROLE").as_deref() {
        Ok("target") => rt.block_on(target()),
        _ => {
            if let Err(e) = UcxBackend::new() {
                println!("SKIP ucx_bw: {e}");
                return;
            }
            rt.block_on(initiator())
        }
    }
}
