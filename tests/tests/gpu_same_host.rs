//! nixl-tcp's same-host path for GPU memory between two processes: the initiator opens
//! the target's GPU registrations through CUDA inter-process handles and the device
//! copies directly, with nixl's real CUDA code bound to the **CUDA driver test
//! double** (`nixl_testkit::fake_cuda`; `NIXL_CUDA_LIB`). The double backs device
//! memory with shared memory so a handle opened in another process reaches the same
//! bytes, refuses a handle in the process that made it (as CUDA does), and aborts an
//! exporter that frees memory another live process still has open (undefined in
//! CUDA). `scripts/gpu-check` runs the same shape on a real GPU.
//!
//! The other process is `nixl-gpu-peer` (its doc says what it answers; the
//! `NIXL_GPU_PEER_BIN` variable names it where it is not where cargo built it).
//! With `NIXL_TEST_GPU=real` the cases use the driver nixl finds (or `NIXL_CUDA_LIB`)
//! instead of the double, and leave out what only the double can show (its mappings).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use bytes::Bytes;
use nixl::{Agent, Backend, DescList, MemKind, Memory, Op, Registration};
use nixl_conformance::support::{bounded, checksum_bytes, figure, hex, pattern, skip, unhex};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};

const GPU: MemKind = MemKind::Vram { device: 0 };

/// Whether the cases run on a real driver (`NIXL_TEST_GPU=real`).
fn real_gpu() -> bool {
    std::env::var("NIXL_TEST_GPU").as_deref() == Ok("real")
}

/// Point this process, and the peers it starts, at the driver double (or check the
/// real driver); false, after a SKIP line, when neither is there.
fn use_driver(case: &str) -> bool {
    if real_gpu() {
        return match nixl::gpu::status() {
            Ok(_) => true,
            Err(e) => {
                skip(
                    case,
                    &format!("no usable CUDA driver (NIXL_TEST_GPU=real): {e}"),
                );
                false
            }
        };
    }
    match nixl_testkit::fake_cuda::library() {
        Ok(lib) => {
            std::env::set_var(nixl::gpu::ENV_LIB, lib);
            // Named by the process id, which the system hands out again: a file left
            // by an earlier process with this id would count its launches here.
            let log = launch_log().unwrap();
            let _ = std::fs::remove_file(&log);
            std::env::set_var("NIXL_FAKE_CUDA_LAUNCH_LOG", log);
            true
        }
        Err(e) => {
            skip(
                case,
                &format!("cannot build the CUDA driver test double: {e}"),
            );
            false
        }
    }
}

struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl Peer {
    fn spawn(role: &str, size: usize) -> Self {
        Self::spawn_with(role, size, &[])
    }

    fn spawn_with(role: &str, size: usize, env: &[(&str, &str)]) -> Self {
        let bin = std::env::var("NIXL_GPU_PEER_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_nixl-gpu-peer").to_owned());
        let mut child = Command::new(bin)
            .args([role, &size.to_string()])
            .env("NIXL_TCP_SAME_HOST", "require")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn nixl-gpu-peer");
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            stdin,
            lines,
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("peer stdin");
    }

    /// The rest of the next line starting with `prefix` (others are skipped).
    fn line(&mut self, prefix: &str) -> String {
        loop {
            let l = self
                .lines
                .next()
                .unwrap_or_else(|| panic!("peer ended before {prefix:?}"))
                .unwrap();
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }

    /// Ask and wait for the answer, off the runtime's threads.
    async fn ask(mut self, command: &str, answer: &'static str) -> (Self, String) {
        let command = command.to_owned();
        tokio::task::spawn_blocking(move || {
            if !command.is_empty() {
                self.send(&command);
            }
            let a = self.line(answer);
            (self, a)
        })
        .await
        .unwrap()
    }
}

impl Peer {
    /// Tell the peer to quit; it stops its agent cleanly and exits 0 (`why` says what
    /// that proves).
    async fn quit(self, why: &str) {
        let (mut peer, stopped) = self.ask("QUIT", "STOPPED ").await;
        assert_eq!(stopped, "clean=true");
        let status = tokio::task::spawn_blocking(move || peer.child.wait().unwrap())
            .await
            .unwrap();
        assert!(status.success(), "{why}: {status}");
    }
}

/// A target process serving `size` bytes of GPU memory (its `env` added) and an
/// initiator agent here that loaded its metadata: the peer, the initiator's backend
/// and agent, and the target's region.
async fn target_and_initiator(
    size: usize,
    env: &'static [(&'static str, &'static str)],
) -> (Peer, TcpBackend, Agent, nixl::RemoteRegionInfo) {
    let peer = tokio::task::spawn_blocking(move || Peer::spawn_with("target", size, env))
        .await
        .unwrap();
    let (peer, md) = peer.ask("", "METADATA ").await;
    let b = backend();
    let a = agent("initiator", &b).await;
    assert_eq!(a.load_metadata(&unhex(&md).unwrap()).unwrap(), "target");
    let rd = a.remote_regions("target").unwrap()[0].clone();
    (peer, b, a, rd)
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn backend() -> TcpBackend {
    TcpBackend::with_options(TcpOptions {
        same_host: SameHost::Require,
        ..Default::default()
    })
}

async fn agent(name: &str, backend: &TcpBackend) -> Agent {
    Agent::builder(name)
        .backend(backend.clone())
        .build()
        .await
        .unwrap()
}

/// Where the driver double logs this process's kernel launches (`None` on a real
/// driver).
fn launch_log() -> Option<std::path::PathBuf> {
    (!real_gpu()).then(|| {
        std::env::temp_dir().join(format!(
            "nixl-gpu-same-host-{}.launches",
            std::process::id()
        ))
    })
}

/// The kernel launches the double ran for this process: (grid x, grid y, entries);
/// `None` on a real driver, and where other tests share the process (`cargo test`:
/// their launches would be counted too; nextest runs each test in its own).
fn launches() -> Option<Vec<(u32, u32, u32)>> {
    if std::env::var("NEXTEST_EXECUTION_MODE").as_deref() != Ok("process-per-test") {
        return None;
    }
    let log = std::fs::read_to_string(launch_log()?).unwrap_or_default();
    Some(
        log.lines()
            .map(|l| {
                let w: Vec<u32> = l.split(' ').skip(1).map(|n| n.parse().unwrap()).collect();
                (w[0], w[1], w[3])
            })
            .collect(),
    )
}

/// Mappings in this process of device memory the double allocated (its own
/// allocations, and other processes' memory opened through handles); `None` on a real
/// driver, and where other tests share the process (`cargo test`: their memory would
/// be counted too; nextest runs each test in its own, as `scripts/test` does).
fn device_mappings() -> Option<usize> {
    let own_process = std::env::var("NEXTEST_EXECUTION_MODE").as_deref() == Ok("process-per-test");
    (!real_gpu() && own_process).then(|| {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| l.contains("memfd:fake-cuda-device"))
            .count()
    })
}

fn gpu(descs: impl IntoIterator<Item = nixl::Desc>) -> DescList {
    DescList::from_descs(GPU, descs)
}

async fn vram(a: &Agent, len: usize, seed: u64) -> Registration {
    let r = a.register(Memory::vram(0, len).unwrap()).unwrap();
    r.write_at(0, &pattern(seed, len)).unwrap();
    r
}

/// WRITE and READ between this process's GPU memory and another's, one block (a copy
/// engine copy), 32 scattered ones and 8 longer than a kernel slice (gather kernel
/// launches): the bytes arrive, the notification comes after them, the copies went
/// through a handle opened here, and the target's deregistration closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_between_processes_moves_through_ipc_handles() {
    const CASE: &str = "gpu_memory_between_processes_moves_through_ipc_handles";
    if !use_driver(CASE) {
        return;
    }
    const SIZE: usize = 4 << 20;
    const BLOCK: usize = 64 << 10;
    let (peer, b, a, rd) = target_and_initiator(SIZE, &[]).await;
    let src = vram(&a, SIZE, 7).await;
    let back = vram(&a, SIZE, 8).await;
    let own = device_mappings();
    if own.is_none() && !real_gpu() {
        skip(
            "gpu_memory_between_processes_moves_through_ipc_handles (mapping counts)",
            "counts this process's device mappings only in a process of its own (nextest)",
        );
    }

    // One block, WRITE with a notification, then READ back.
    bounded(
        "write",
        a.write(
            &gpu([src.whole()]),
            "target",
            &gpu([rd.desc(0, SIZE as u64)]),
            Some(Bytes::from_static(b"one")),
        ),
    )
    .await
    .unwrap();
    let mut image = src.to_vec().unwrap();
    let (peer, notif) = peer.ask("", "NOTIF ").await;
    assert_eq!(
        notif,
        format!("one {}", checksum_bytes(&image)),
        "the notification arrives after the data"
    );
    assert_eq!(
        device_mappings(),
        own.map(|n| n + 1),
        "the target's memory is open here through its handle"
    );
    bounded(
        "read",
        a.read(
            &gpu([back.whole()]),
            "target",
            &gpu([rd.desc(0, SIZE as u64)]),
            None,
        ),
    )
    .await
    .unwrap();
    assert!(
        back.to_vec().unwrap() == image,
        "read back what was written"
    );
    assert_eq!(
        launches(),
        launches().map(|_| vec![]),
        "one block: no kernel"
    );

    // 32 scattered blocks each way, in a permuted order on the target.
    let place = |i: usize| ((i * 13) % 32) * 2 * BLOCK + BLOCK / 2 + i;
    let blocks = vram(&a, 32 * BLOCK, 9).await;
    let mine = blocks.to_vec().unwrap();
    bounded(
        "scattered write",
        a.write(
            &gpu((0..32).map(|i| blocks.desc((i * BLOCK) as u64, BLOCK as u64))),
            "target",
            &gpu((0..32).map(|i| rd.desc(place(i) as u64, BLOCK as u64))),
            Some(Bytes::from_static(b"scattered")),
        ),
    )
    .await
    .unwrap();
    for i in 0..32 {
        image[place(i)..place(i) + BLOCK].copy_from_slice(&mine[i * BLOCK..(i + 1) * BLOCK]);
    }
    let (peer, notif) = peer.ask("", "NOTIF ").await;
    assert_eq!(notif, format!("scattered {}", checksum_bytes(&image)));
    let gathered = vram(&a, 32 * BLOCK, 10).await;
    bounded(
        "scattered read",
        a.read(
            &gpu((0..32).map(|i| gathered.desc(((31 - i) * BLOCK) as u64, BLOCK as u64))),
            "target",
            &gpu((0..32).map(|i| rd.desc(place(i) as u64, BLOCK as u64))),
            None,
        ),
    )
    .await
    .unwrap();
    let got = gathered.to_vec().unwrap();
    for i in 0..32 {
        assert!(
            got[(31 - i) * BLOCK..(32 - i) * BLOCK] == mine[i * BLOCK..(i + 1) * BLOCK],
            "block {i} read back"
        );
    }
    assert_eq!(
        launches(),
        launches().map(|_| vec![(32, 1, 32); 2]),
        "each 32-block request is one launch of one 64 KiB slice per block"
    );

    // Blocks longer than a kernel slice, of an odd length: the grid covers them.
    const LONG: usize = 200 * 1024 + 13;
    let at = |i: usize| (7 - i) * (LONG + 4099);
    let long = vram(&a, 8 * LONG, 11).await;
    let mine = long.to_vec().unwrap();
    bounded(
        "long blocks",
        a.write(
            &gpu((0..8).map(|i| long.desc((i * LONG) as u64, LONG as u64))),
            "target",
            &gpu((0..8).map(|i| rd.desc(at(i) as u64, LONG as u64))),
            Some(Bytes::from_static(b"long")),
        ),
    )
    .await
    .unwrap();
    for i in 0..8 {
        image[at(i)..at(i) + LONG].copy_from_slice(&mine[i * LONG..(i + 1) * LONG]);
    }
    let (peer, notif) = peer.ask("", "NOTIF ").await;
    assert_eq!(notif, format!("long {}", checksum_bytes(&image)));
    if let Some(l) = launches() {
        assert_eq!(l.last(), Some(&(8, 4, 8)), "four 64 KiB slices per block");
    }

    // Outside the registration: refused before any copy, the target untouched.
    let e = bounded(
        "out of range",
        a.write(
            &gpu([src.desc(0, 4096), src.desc(4096, 4096)]),
            "target",
            &gpu([
                rd.desc(SIZE as u64 - 4096, 4096),
                rd.desc(SIZE as u64, 4096),
            ]),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), nixl::ErrorKind::OutOfRange, "{e}");

    let path = b.data_path("target").unwrap();
    assert!(path.contains("CUDA IPC"), "{path}");
    let (peer, sum) = peer.ask("CHECKSUM", "CHECKSUM ").await;
    assert_eq!(
        sum,
        checksum_bytes(&image).to_string(),
        "nothing else written"
    );

    // The target deregisters and frees: this process closed its mapping first (the
    // double would abort the target otherwise).
    let before = device_mappings();
    let (peer, dereg) = peer.ask("DEREG", "DEREG ").await;
    assert!(dereg.starts_with("ok"), "{dereg}");
    assert_eq!(
        device_mappings(),
        before.map(|n| n - 1),
        "the mapping was closed"
    );
    let (peer, _) = peer.ask("", "FREED").await;
    peer.quit("the target exited cleanly").await;
    assert!(a.shutdown().await.is_clean());
}

/// The target deregisters and frees its GPU memory while WRITEs into it are queued on
/// this process's device: deregistration waits for those copies and for this process
/// to close its mapping, then the memory is freed without harm (the double aborts on
/// a free of memory still open elsewhere); the WRITEs each end, none hangs, and later
/// ones fail cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_deregisters_gpu_memory_under_in_flight_writes() {
    const CASE: &str = "target_deregisters_gpu_memory_under_in_flight_writes";
    if !use_driver(CASE) {
        return;
    }
    const SIZE: usize = 16 << 20;
    let (peer, _, a, rd) = target_and_initiator(SIZE, &[]).await;
    let src = vram(&a, SIZE, 3).await;
    let (local, remote) = (gpu([src.whole()]), gpu([rd.desc(0, SIZE as u64)]));
    bounded("warm-up", a.write(&local, "target", &remote, None))
        .await
        .unwrap();
    let writes: Vec<_> = (0..16)
        .map(|_| {
            a.transfer(Op::Write, &local, "target", &remote, None)
                .unwrap()
        })
        .collect();
    let (peer, dereg) = peer.ask("DEREG", "DEREG ").await;
    assert!(dereg.starts_with("ok"), "{dereg}");
    let (peer, _) = peer.ask("", "FREED").await;
    let (mut ok, mut failed) = (0, 0);
    for w in writes {
        match bounded("a WRITE in flight at deregistration", w).await {
            Ok(()) => ok += 1,
            Err(e) => {
                failed += 1;
                println!("in flight at deregistration: {e}");
            }
        }
    }
    figure(
        "GPU deregistration under 16 x 16 MiB WRITEs (driver double)",
        format!("{ok} finished before it, {failed} refused; target took {dereg}"),
    );
    let e = bounded(
        "a WRITE after deregistration",
        a.write(&local, "target", &remote, None),
    )
    .await
    .unwrap_err();
    println!("after deregistration: {e}");
    peer.quit("the target freed its memory unharmed").await;
    assert!(a.shutdown().await.is_clean());
}

/// An initiator in another process is SIGKILLed while its copies into this process's
/// GPU memory run: deregistration does not wait for it, the memory is freed without
/// harm, and the agent shuts down cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_killed_mid_copy_releases_the_target() {
    const CASE: &str = "initiator_killed_mid_copy_releases_the_target";
    if !use_driver(CASE) {
        return;
    }
    const SIZE: usize = 16 << 20;
    let b = backend();
    let t = agent("target", &b).await;
    let mem = t.register(Memory::vram(0, SIZE).unwrap()).unwrap();
    let md = hex(&t.metadata().unwrap());
    let peer = tokio::task::spawn_blocking(|| Peer::spawn("initiator", SIZE))
        .await
        .unwrap();
    let (peer, path) = peer.ask(&md, "PATH ").await;
    assert!(path.contains("CUDA IPC"), "{path}");
    let (mut peer, _) = peer.ask("", "OK ").await;
    peer.child.kill().expect("SIGKILL the initiator");
    let t0 = Instant::now();
    tokio::task::block_in_place(|| t.deregister(&mem)).unwrap();
    let took = t0.elapsed();
    figure(
        "GPU deregistration after its initiator was SIGKILLed mid-copy (driver double)",
        format!("{took:?}"),
    );
    assert!(
        mem.to_vec().unwrap().iter().all(|&b| b == 0x5A || b == 0),
        "only the initiator's bytes"
    );
    drop(mem);
    let status = tokio::task::spawn_blocking(move || peer.child.wait().unwrap())
        .await
        .unwrap();
    assert!(!status.success());
    let report = bounded("shutdown", t.shutdown()).await;
    assert!(report.is_clean(), "{report:?}");
}

/// A target registration that runs past the allocation it starts in (raw memory over
/// several allocations): one allocation's handle cannot reach all of it, so the
/// target grants it without one, and the same-host path refuses it (with
/// `same_host=require`; otherwise it is staged over TCP) rather than copy through a
/// mapping shorter than the registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_longer_than_its_allocation_gets_no_handle() {
    const CASE: &str = "a_registration_longer_than_its_allocation_gets_no_handle";
    if !use_driver(CASE) {
        return;
    }
    const SIZE: usize = 1 << 20;
    const OVERLONG: &[(&str, &str)] = &[("NIXL_GPU_PEER_OVERLONG", "65536")];
    let (peer, _, a, rd) = target_and_initiator(SIZE, OVERLONG).await;
    assert_eq!(rd.len, (SIZE + 65536) as u64);
    let src = vram(&a, 4096, 5).await;
    let e = bounded(
        "write",
        a.write(
            &gpu([src.whole()]),
            "target",
            &gpu([rd.desc(0, 4096)]),
            None,
        ),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), nixl::ErrorKind::NotSupported, "{e}");
    assert!(e.to_string().contains("inter-process handle"), "{e}");
    peer.quit("the target exited cleanly").await;
    assert!(a.shutdown().await.is_clean());
}

/// `NIXL_GPU_GATHER=off` keeps a batch on the copy engine: the bytes arrive, and no
/// kernel was launched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gather_kernel_can_be_turned_off() {
    const CASE: &str = "the_gather_kernel_can_be_turned_off";
    if !use_driver(CASE) {
        return;
    }
    if launches().is_none() {
        // The setting is process-wide: it would change the other cases' path.
        return skip(
            CASE,
            "needs a process of its own on the driver double (nextest, as scripts/test runs it)",
        );
    }
    std::env::set_var(nixl::gpu::ENV_GATHER, "off");
    const BLOCK: usize = 16 << 10;
    let (peer, _, a, rd) = target_and_initiator(64 * BLOCK, &[]).await;
    let src = vram(&a, 32 * BLOCK, 12).await;
    bounded(
        "scattered write",
        a.write(
            &gpu((0..32).map(|i| src.desc((i * BLOCK) as u64, BLOCK as u64))),
            "target",
            &gpu((0..32).map(|i| rd.desc((2 * i * BLOCK) as u64, BLOCK as u64))),
            Some(Bytes::from_static(b"engine")),
        ),
    )
    .await
    .unwrap();
    let mine = src.to_vec().unwrap();
    let mut image = vec![0u8; 64 * BLOCK];
    for i in 0..32 {
        image[2 * i * BLOCK..(2 * i + 1) * BLOCK]
            .copy_from_slice(&mine[i * BLOCK..(i + 1) * BLOCK]);
    }
    let (peer, notif) = peer.ask("", "NOTIF ").await;
    assert_eq!(notif, format!("engine {}", checksum_bytes(&image)));
    assert_eq!(launches(), Some(vec![]), "no kernel");
    peer.quit("the target exited cleanly").await;
    assert!(a.shutdown().await.is_clean());
}

/// Threads of this process named as nixl-tcp's GPU mapping watcher (the kernel keeps
/// 15 bytes of a thread's name).
fn mapping_watchers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "nixl-tcp-gpu-wa")
        .count()
}

/// The initiator's shutdown closes its mappings of the target's GPU memory and joins
/// the thread that watches them, though its backend (and so the connection) is still
/// referenced and the target has not deregistered: nothing of the agent runs after
/// its shutdown returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_gpu_mappings_and_joins_their_watcher() {
    const CASE: &str = "shutdown_closes_gpu_mappings_and_joins_their_watcher";
    if !use_driver(CASE) {
        return;
    }
    if launches().is_none() {
        // Mappings and threads are counted per process.
        return skip(
            CASE,
            "needs a process of its own on the driver double (nextest, as scripts/test runs it)",
        );
    }
    const SIZE: usize = 1 << 20;
    let (peer, b, a, rd) = target_and_initiator(SIZE, &[]).await;
    let src = vram(&a, SIZE, 21).await;
    bounded(
        "write",
        a.write(
            &gpu([src.whole()]),
            "target",
            &gpu([rd.desc(0, SIZE as u64)]),
            None,
        ),
    )
    .await
    .unwrap();
    let mapped = device_mappings().unwrap();
    // A thread names itself once it runs: wait for the watcher's name (bounded).
    let named = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while mapping_watchers() == 0 && std::time::Instant::now() < named {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert_eq!(mapping_watchers(), 1, "one watcher for the open mapping");
    let report = a.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
    // A joined thread leaves the task list a moment after the join (bounded wait).
    let gone = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while mapping_watchers() > 0 && std::time::Instant::now() < gone {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert_eq!(mapping_watchers(), 0, "the watcher was joined by shutdown");
    assert_eq!(
        device_mappings(),
        Some(mapped - 1),
        "the target's memory was closed (ours is still registered)"
    );
    drop((src, b));
    let (peer, dereg) = peer.ask("DEREG", "DEREG ").await;
    assert!(dereg.starts_with("ok"), "{dereg}");
    let (peer, _) = peer.ask("", "FREED").await;
    peer.quit("the target exited cleanly").await;
}
