//! An agent with GPU memory in its own process, for the same-host GPU tests
//! (`tests/gpu_same_host.rs`). The CUDA library is the one `NIXL_CUDA_LIB` names (the
//! tests pass the driver test double); TCP options come from the `NIXL_TCP_*`
//! variables (see `tcp_options_from_env`).
//!
//! `nixl-gpu-peer target <bytes>`: registers `<bytes>` of zeroed memory on GPU 0 with
//! a tcp agent named `target`, prints `METADATA <hex>`, then prints
//! `NOTIF <text> <fnv1a>` for each notification (the checksum of its memory when the
//! notification arrived) and obeys lines on stdin, answering each:
//! `CHECKSUM` -> `CHECKSUM <fnv1a>`; `PATH` -> `PATH <data path to the initiator>`;
//! `DEREG` -> deregisters the memory (`DEREG ok <ms>` or `DEREG err <kind>`), then
//! frees it (`FREED`); `QUIT` -> shuts down, prints `STOPPED clean=<bool>`, exits.
//!
//! With `NIXL_GPU_PEER_OVERLONG=<n>` the target registers its allocation as raw memory
//! `n` bytes longer than it is (as a framework registering a range over several
//! allocations would); only the allocation's bytes may then be transferred.
//!
//! `nixl-gpu-peer initiator <bytes>`: reads the target's metadata (hex) as the first
//! line of stdin, registers `<bytes>` on GPU 0 and WRITEs all of it to the start of the
//! target's first region, four at a time, until killed; prints `PATH <data path>`
//! after the first and `OK <n>` after every 16th.
#![deny(unsafe_code)]

use std::io::{BufRead, Write};
use std::time::Instant;

use nixl::{Agent, Backend, DescList, MemKind, Memory, Op};
use nixl_conformance::support::{checksum, hex, tcp_options_from_env, unhex};

const GPU: MemKind = MemKind::Vram { device: 0 };

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let size: usize = args
        .get(2)
        .and_then(|s| s.parse().ok())
        .expect("usage: nixl-gpu-peer target|initiator <bytes>");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    match args.get(1).map(String::as_str) {
        Some("target") => target(size, rx).await,
        Some("initiator") => initiator(size, rx).await,
        other => panic!("unknown role {other:?}"),
    }
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    // Once the parent stopped listening there is nobody to tell: exit quietly.
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        std::process::exit(0);
    }
}

async fn target(size: usize, mut rx: tokio::sync::mpsc::UnboundedReceiver<String>) {
    let backend = nixl_tcp::TcpBackend::with_options(tcp_options_from_env());
    let agent = Agent::builder("target")
        .backend(backend.clone())
        .build()
        .await
        .expect("agent");
    let vram = Memory::vram(0, size).expect("GPU memory");
    let memory = match std::env::var("NIXL_GPU_PEER_OVERLONG") {
        Ok(n) => {
            let extra: usize = n.parse().expect("NIXL_GPU_PEER_OVERLONG: a byte count");
            let addr = vram.addr();
            #[allow(unsafe_code)]
            // SAFETY: the range starts at a live allocation, kept alive as the owner;
            // its last `extra` bytes lie past it, which is the case under test: the
            // tests transfer only inside the allocation, and the backend must not
            // hand out a handle that covers less than the registration.
            unsafe {
                Memory::from_raw_parts_with_owner(addr as *mut u8, size + extra, GPU, Some(vram))
            }
            .expect("raw GPU memory")
        }
        Err(_) => vram,
    };
    let mem = agent.register(memory).expect("register");
    // The only owner of the registration (the notifier reads through it): taking it
    // out and dropping it frees the GPU memory.
    let mem = std::sync::Arc::new(std::sync::Mutex::new(Some(mem)));
    say(format!("METADATA {}", hex(&agent.metadata().unwrap())));
    let mut notes = agent.notifications().expect("notifications");
    let watched = mem.clone();
    let notifier = tokio::spawn(async move {
        while let Some(n) = notes.recv().await {
            // Read first: the data must be there when the notification arrives.
            let sum = watched
                .lock()
                .unwrap()
                .as_ref()
                .map_or("-".into(), |m| checksum(m).to_string());
            say(format!("NOTIF {} {sum}", String::from_utf8_lossy(&n.msg)));
        }
    });
    while let Some(line) = rx.recv().await {
        match line.trim() {
            "CHECKSUM" => {
                let sum = mem.lock().unwrap().as_ref().map_or(0, checksum);
                say(format!("CHECKSUM {sum}"));
            }
            "PATH" => say(format!(
                "PATH {}",
                backend.data_path("initiator").unwrap_or_default()
            )),
            "DEREG" => {
                let m = mem.lock().unwrap().take().expect("registered");
                let t0 = Instant::now();
                match tokio::task::block_in_place(|| agent.deregister(&m)) {
                    Ok(()) => say(format!("DEREG ok {}", t0.elapsed().as_millis())),
                    Err(e) => say(format!("DEREG err {:?} {e}", e.kind())),
                }
                // cuMemFree (the driver double aborts if another process still has
                // the memory open).
                drop(m);
                say("FREED".into());
            }
            "QUIT" => break,
            other => panic!("unknown command {other:?}"),
        }
    }
    notifier.abort();
    let report = agent.shutdown().await;
    if !report.is_clean() {
        eprintln!("{report:?}");
    }
    say(format!("STOPPED clean={}", report.is_clean()));
}

async fn initiator(size: usize, mut rx: tokio::sync::mpsc::UnboundedReceiver<String>) {
    let md = unhex(rx.recv().await.expect("metadata line").trim()).expect("hex");
    let backend = nixl_tcp::TcpBackend::with_options(tcp_options_from_env());
    let agent = Agent::builder("initiator")
        .backend(backend.clone())
        .build()
        .await
        .expect("agent");
    let peer = agent.load_metadata(&md).expect("metadata");
    let mem = Memory::vram(0, size).expect("GPU memory");
    let src = agent.register(mem).expect("register");
    src.write_at(0, &vec![0x5Au8; size]).expect("fill");
    let remote = agent.remote_regions(&peer).unwrap()[0].clone();
    let local = DescList::from_descs(GPU, [src.whole()]);
    let target = DescList::from_descs(GPU, [remote.desc(0, size as u64)]);
    let mut in_flight = std::collections::VecDeque::new();
    for n in 1u64.. {
        in_flight.push_back(
            agent
                .transfer(Op::Write, &local, &peer, &target, None)
                .expect("post"),
        );
        if in_flight.len() < 4 {
            continue;
        }
        in_flight
            .pop_front()
            .unwrap()
            .await
            .expect("write to the target");
        if n == 4 {
            say(format!(
                "PATH {}",
                backend.data_path(&peer).unwrap_or_default()
            ));
        }
        if n % 16 == 0 {
            say(format!("OK {n}"));
        }
    }
}
