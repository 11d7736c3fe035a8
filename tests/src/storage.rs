//! Storage cases of the suite: every backend that declares files
//! ([`Capabilities::file`](nixl::Capabilities)) passes them. Each case builds its own
//! agent on the backend under test and works in its own scratch directory.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use nixl::file::FileOptions;
use nixl::{
    Agent, AlignedBuf, Desc, DescList, ErrorKind, MemKind, Memory, Op, Registration, RequestOptions,
};

use crate::support::{bounded, pattern, skip, BackendUnderTest};

/// The scratch directory of a storage case (from the shared test kit).
pub use nixl_testkit::TempDir as Scratch;

/// An agent of the backend under test, or `None` after a SKIP line when the backend
/// does not take files.
async fn storage_agent(but: &BackendUnderTest, case: &str) -> Option<Agent> {
    let caps = but.capabilities(case)?;
    if !caps.file {
        skip(case, &format!("backend {} does not take files", but.name));
        return None;
    }
    Some(but.agent("storage").await)
}

/// Options that create a file of `len` bytes (or grow it to that).
fn create(len: u64) -> FileOptions {
    FileOptions {
        create: true,
        len: Some(len),
        ..FileOptions::default()
    }
}

/// Register a new file of `len` bytes at `path` (opened here).
fn new_file(agent: &Agent, path: &Path, len: u64) -> Registration {
    agent
        .register(Memory::open_file(path, &create(len)).unwrap())
        .unwrap()
}

/// Shut `agent` down; every task and thread it started must be gone.
pub async fn shut_down_clean(agent: &Agent) {
    let report = agent.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
}

/// Move `mem_descs` to (WRITE) or from (READ) `file_descs`, and await it.
pub async fn storage_xfer(
    agent: &Agent,
    op: Op,
    mem: &[Desc],
    file_kind: MemKind,
    files: &[Desc],
) -> nixl::Result<()> {
    let local = DescList::from_descs(MemKind::Dram, mem.iter().copied());
    let remote = DescList::from_descs(file_kind, files.iter().copied());
    let req = agent.create_request(
        op,
        &local,
        agent.name(),
        &remote,
        &RequestOptions::default(),
    )?;
    bounded("storage transfer", req.post(None)?).await
}

fn fd_of(r: &Registration) -> u32 {
    r.kind().device()
}

/// Round trips at many sizes and file offsets: bytes written land in the file at
/// their offsets (read back with `std::fs`), bytes read come from there.
pub async fn storage_round_trip(but: &BackendUnderTest) {
    const CASE: &str = "storage_round_trip";
    let Some(agent) = storage_agent(but, CASE).await else {
        return;
    };
    let dir = Scratch::new(CASE);
    let path = dir.file("cache.bin");
    let file_len = 16 << 20;
    let file = new_file(&agent, &path, file_len);
    let fd = fd_of(&file);
    let kind = MemKind::File { fd };
    let max = (4 << 20) + 3;
    let src = agent.register(pattern(7, max)).unwrap();
    let dst = agent.register(vec![0u8; max]).unwrap();
    for (i, &len) in [1u64, 100, 4096, 65_543, (1 << 20) + 3, 4 << 20]
        .iter()
        .enumerate()
    {
        for &off in &[0u64, 1, 4095, 12_345 + i as u64 * 1000] {
            storage_xfer(
                &agent,
                Op::Write,
                &[src.desc(0, len)],
                kind,
                &[Desc::new(off, len, fd)],
            )
            .await
            .unwrap_or_else(|e| panic!("WRITE {len} at {off}: {e}"));
            let on_disk = std::fs::read(&path).unwrap();
            assert_eq!(
                &on_disk[off as usize..(off + len) as usize],
                &pattern(7, max)[..len as usize],
                "WRITE {len} at {off}"
            );
            dst.write_at(0, &vec![0u8; len as usize]).unwrap();
            storage_xfer(
                &agent,
                Op::Read,
                &[dst.desc(0, len)],
                kind,
                &[Desc::new(off, len, fd)],
            )
            .await
            .unwrap_or_else(|e| panic!("READ {len} at {off}: {e}"));
            let mut got = vec![0u8; len as usize];
            dst.read_at(0, &mut got).unwrap();
            assert_eq!(got, pattern(7, max)[..len as usize], "READ {len} at {off}");
        }
    }
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        file_len,
        "no size change"
    );
    shut_down_clean(&agent).await;
}

/// Both of NIXL's layouts: blocks at offsets of one large file (Dynamo's disk tier)
/// and one file per block from a pool of pre-opened files (LMCache's), a whole batch
/// per request, registered by descriptor.
pub async fn storage_layouts(but: &BackendUnderTest) {
    const CASE: &str = "storage_layouts";
    let Some(agent) = storage_agent(but, CASE).await else {
        return;
    };
    let dir = Scratch::new(CASE);
    let (block, n) = (64u64 << 10, 32usize);
    let src = agent.register(pattern(11, block as usize * n)).unwrap();
    let dst = agent.register(vec![0u8; block as usize * n]).unwrap();
    // One large file, blocks in reverse order (no merging into one segment).
    let big = dir.file("big.bin");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&big)
        .unwrap();
    let big_reg = agent
        .register(Memory::file(f.as_fd(), block * n as u64).unwrap())
        .unwrap();
    let fd = fd_of(&big_reg);
    let mem: Vec<Desc> = (0..n).map(|j| src.desc(j as u64 * block, block)).collect();
    let files: Vec<Desc> = (0..n)
        .map(|j| Desc::new((n - 1 - j) as u64 * block, block, fd))
        .collect();
    storage_xfer(&agent, Op::Write, &mem, MemKind::File { fd }, &files)
        .await
        .unwrap();
    let disk = std::fs::read(&big).unwrap();
    let want = pattern(11, block as usize * n);
    for j in 0..n {
        let at = (n - 1 - j) * block as usize;
        assert_eq!(
            &disk[at..at + block as usize],
            &want[j * block as usize..(j + 1) * block as usize],
            "block {j}"
        );
    }
    let back: Vec<Desc> = (0..n).map(|j| dst.desc(j as u64 * block, block)).collect();
    storage_xfer(&agent, Op::Read, &back, MemKind::File { fd }, &files)
        .await
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), want);
    // A pool of files, one block each, a whole batch in one request: a list of files
    // names each descriptor's file by its device id, as NIXL's FILE lists do.
    let mut pool = Vec::new();
    for j in 0..8 {
        let p = dir.file(&format!("block-{j}.bin"));
        let reg = new_file(&agent, &p, block);
        pool.push((p, reg));
    }
    let mem: Vec<Desc> = (0..8).map(|j| src.desc(j as u64 * block, block)).collect();
    let files: Vec<Desc> = pool
        .iter()
        .map(|(_, r)| Desc::new(0, block, fd_of(r)))
        .collect();
    let kind = MemKind::File {
        fd: fd_of(&pool[0].1),
    };
    storage_xfer(&agent, Op::Write, &mem, kind, &files)
        .await
        .unwrap();
    for (j, (p, _)) in pool.iter().enumerate() {
        assert_eq!(
            std::fs::read(p).unwrap(),
            &want[j * block as usize..(j + 1) * block as usize],
            "file {j}"
        );
    }
    dst.write_at(0, &vec![0u8; block as usize * n]).unwrap();
    let back: Vec<Desc> = (0..8).map(|j| dst.desc(j as u64 * block, block)).collect();
    storage_xfer(&agent, Op::Read, &back, kind, &files)
        .await
        .unwrap();
    assert_eq!(
        dst.to_vec().unwrap()[..8 * block as usize],
        want[..8 * block as usize]
    );
    shut_down_clean(&agent).await;
}

/// O_DIRECT: aligned transfers move; a misaligned offset, length or address is
/// refused when the request is made, naming the segment, and nothing moves.
pub async fn storage_direct_io(but: &BackendUnderTest) {
    const CASE: &str = "storage_direct_io";
    let Some(agent) = storage_agent(but, CASE).await else {
        return;
    };
    let dir = Scratch::new(CASE);
    let path = dir.file("direct.bin");
    let opts = FileOptions {
        direct: true,
        ..create(4 << 20)
    };
    let mem = match Memory::open_file(&path, &opts) {
        Ok(m) => m,
        Err(e) if e.to_string().contains("Invalid argument") => {
            return skip(
                CASE,
                &format!(
                    "the filesystem of {} refuses O_DIRECT: {e}",
                    dir.path.display()
                ),
            );
        }
        Err(e) => panic!("open O_DIRECT: {e}"),
    };
    let file = agent.register(mem).unwrap();
    let align = file.file().unwrap().direct().expect("opened O_DIRECT");
    let fd = fd_of(&file);
    let kind = MemKind::File { fd };
    let len = 1usize << 20;
    let mut buf = AlignedBuf::new(len);
    buf.copy_from_slice(&pattern(3, len));
    let src = agent.register(buf).unwrap();
    let dst = agent.register(AlignedBuf::new(len)).unwrap();
    for &(off, n) in &[(0u64, 4096u64), (8192, 65_536), (1 << 20, 1 << 20)] {
        storage_xfer(
            &agent,
            Op::Write,
            &[src.desc(0, n)],
            kind,
            &[Desc::new(off, n, fd)],
        )
        .await
        .unwrap();
        storage_xfer(
            &agent,
            Op::Read,
            &[dst.desc(0, n)],
            kind,
            &[Desc::new(off, n, fd)],
        )
        .await
        .unwrap();
        let mut got = vec![0u8; n as usize];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(3, len)[..n as usize], "{n} at {off}");
    }
    let a = u64::from(align.offset);
    let before = std::fs::read(&path).unwrap();
    for (what, m, f) in [
        ("offset", src.desc(0, a), Desc::new(a / 2 + 1, a, fd)),
        ("length", src.desc(0, a + 1), Desc::new(0, a + 1, fd)),
        ("address", src.desc(1, a), Desc::new(0, a, fd)),
    ] {
        let local = DescList::from_descs(MemKind::Dram, [m]);
        let remote = DescList::from_descs(kind, [f]);
        let e = agent
            .create_request(
                Op::Write,
                &local,
                agent.name(),
                &remote,
                &RequestOptions::default(),
            )
            .expect_err(what);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{what}: {e}");
        assert!(
            e.to_string().contains("segment 0") && e.to_string().contains("O_DIRECT"),
            "{what}: {e}"
        );
    }
    assert_eq!(std::fs::read(&path).unwrap(), before, "nothing moved");
    shut_down_clean(&agent).await;
}

/// A READ past the end of a file truncated under its registration fails with
/// [`ErrorKind::Io`], naming the segment and the bytes that did move.
pub async fn storage_truncated_file(but: &BackendUnderTest) {
    const CASE: &str = "storage_truncated_file";
    let Some(agent) = storage_agent(but, CASE).await else {
        return;
    };
    let dir = Scratch::new(CASE);
    let path = dir.file("t.bin");
    let file = new_file(&agent, &path, 1 << 20);
    let fd = fd_of(&file);
    let dst = agent.register(vec![0u8; 1 << 20]).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let e = storage_xfer(
        &agent,
        Op::Read,
        &[dst.desc(0, 65_536)],
        MemKind::File { fd },
        &[Desc::new(0, 65_536, fd)],
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    let s = e.to_string();
    assert!(
        s.contains("segment 0")
            && s.contains("end of file")
            && s.contains("4096 of the transfer's 65536 bytes moved"),
        "{s}"
    );
    // Blocks wholly past the end: nothing moves.
    let e = storage_xfer(
        &agent,
        Op::Read,
        &[dst.desc(0, 4096)],
        MemKind::File { fd },
        &[Desc::new(8192, 4096, fd)],
    )
    .await
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("0 of the transfer's 4096 bytes moved"),
        "{e}"
    );
    shut_down_clean(&agent).await;
}

/// The registration keeps its own handle: closing the caller's descriptor, and a new
/// file taking its number, never redirects a transfer; access modes and misuse are
/// refused clearly.
pub async fn storage_closed_fd_and_misuse(but: &BackendUnderTest) {
    const CASE: &str = "storage_closed_fd_and_misuse";
    let Some(agent) = storage_agent(but, CASE).await else {
        return;
    };
    let dir = Scratch::new(CASE);
    let (a, b) = (dir.file("a.bin"), dir.file("b.bin"));
    let fa = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&a)
        .unwrap();
    let reg = agent
        .register(Memory::file(fa.as_fd(), 4096).unwrap())
        .unwrap();
    let fd = fd_of(&reg);
    drop(fa);
    // Likely takes the closed number.
    let fb = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&b)
        .unwrap();
    let src = agent.register(pattern(5, 4096)).unwrap();
    storage_xfer(
        &agent,
        Op::Write,
        &[src.desc(0, 4096)],
        MemKind::File { fd },
        &[Desc::new(0, 4096, fd)],
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(&a).unwrap(),
        pattern(5, 4096),
        "the registered file got the data"
    );
    assert_eq!(
        std::fs::metadata(&b).unwrap().len(),
        0,
        "the file that took the number did not"
    );
    // A file opened read-only refuses WRITEs before anything moves.
    let ro = agent
        .register(
            Memory::open_file(
                &a,
                &FileOptions {
                    write: false,
                    ..FileOptions::default()
                },
            )
            .unwrap(),
        )
        .unwrap();
    let rfd = fd_of(&ro);
    let local = DescList::from_descs(MemKind::Dram, [src.desc(0, 4096)]);
    let remote = DescList::from_descs(MemKind::File { fd: rfd }, [Desc::new(0, 4096, rfd)]);
    let e = agent
        .create_request(
            Op::Write,
            &local,
            agent.name(),
            &remote,
            &RequestOptions::default(),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    // Files on the local side, notifications, and files past their registration.
    let e = agent
        .create_request(
            Op::Write,
            &remote,
            agent.name(),
            &local,
            &RequestOptions::default(),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let req = agent
        .create_request(
            Op::Read,
            &local,
            agent.name(),
            &remote,
            &RequestOptions::default(),
        )
        .unwrap();
    let e = bounded(
        "notified storage transfer",
        req.post(Some("no".into())).unwrap(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}");
    let past = DescList::from_descs(MemKind::File { fd: rfd }, [Desc::new(4000, 200, rfd)]);
    let e = agent
        .create_request(
            Op::Read,
            &local_one(&src, 200),
            agent.name(),
            &past,
            &RequestOptions::default(),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    // A descriptor registered by number shares its flags with the caller's: one
    // switched to O_APPEND since refuses WRITEs (Linux would put every block at
    // the end of the file and report success).
    let c = dir.file("c.bin");
    let fc = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&c)
        .unwrap();
    let creg = agent
        .register(Memory::file(fc.as_fd(), 4096).unwrap())
        .unwrap();
    let cfd = fd_of(&creg);
    let (from, to) = ([src.desc(0, 4096)], [Desc::new(0, 4096, cfd)]);
    let write_c = || storage_xfer(&agent, Op::Write, &from, MemKind::File { fd: cfd }, &to);
    write_c().await.unwrap();
    let fl = rustix::fs::fcntl_getfl(&fc).unwrap();
    rustix::fs::fcntl_setfl(&fc, fl | rustix::fs::OFlags::APPEND).unwrap();
    let e = write_c().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    assert!(e.to_string().contains("O_APPEND"), "{e}");
    assert_eq!(
        std::fs::metadata(&c).unwrap().len(),
        4096,
        "nothing was appended"
    );
    drop(fc);
    // Files are never published to peers.
    let md = agent.metadata().unwrap();
    drop(fb);
    let other = nixl_testkit::double::agent(
        "peer",
        nixl_testkit::double::backend(nixl_testkit::double::Null),
    )
    .await;
    other.load_metadata(&md).unwrap();
    let published = other.remote_regions("storage").unwrap();
    assert_eq!(
        published.iter().map(|r| (r.id, r.kind)).collect::<Vec<_>>(),
        vec![(src.id(), MemKind::Dram)],
        "only the memory is published, no file"
    );
    shut_down_clean(&other).await;
    shut_down_clean(&agent).await;
}

fn local_one(r: &Registration, len: u64) -> DescList {
    DescList::from_descs(MemKind::Dram, [r.desc(0, len)])
}

/// ENOSPC, for real: a file on a 1 MiB tmpfs, a 4 MiB WRITE. Needs to mount
/// (root); SKIPs visibly otherwise.
pub async fn storage_no_space(but: &BackendUnderTest) {
    const CASE: &str = "storage_no_space";
    let Some(agent) = storage_agent(but, CASE).await else {
        return;
    };
    let dir = Scratch::new(CASE);
    let mnt = dir.file("small");
    std::fs::create_dir_all(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "nixl-enospc"])
        .arg(&mnt)
        .output();
    match mounted {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return skip(
                CASE,
                &format!(
                    "cannot mount a small tmpfs: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ),
            )
        }
        Err(e) => return skip(CASE, &format!("cannot run mount: {e}")),
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let path = mnt.join("full.bin");
    let file = new_file(&agent, &path, 4 << 20);
    let fd = fd_of(&file);
    let src = agent.register(pattern(9, 4 << 20)).unwrap();
    let e = storage_xfer(
        &agent,
        Op::Write,
        &[src.desc(0, 4 << 20)],
        MemKind::File { fd },
        &[Desc::new(0, 4 << 20, fd)],
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    let io = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .unwrap_or_else(|| panic!("the OS error is the source: {e}"));
    assert_eq!(io.raw_os_error(), Some(28), "ENOSPC: {e}");
    assert!(
        e.to_string().contains("segment 0")
            && e.to_string()
                .contains("of the transfer's 4194304 bytes moved"),
        "{e}"
    );
    drop(file);
    shut_down_clean(&agent).await;
}

/// Dropping a transfer's future: nothing hangs, the memory is released once the
/// kernel is done with it, and the agent deregisters it.
pub async fn storage_drop_in_flight(but: &BackendUnderTest) {
    const CASE: &str = "storage_drop_in_flight";
    let Some(agent) = storage_agent(but, CASE).await else {
        return;
    };
    let dir = Scratch::new(CASE);
    let path = dir.file("d.bin");
    let (block, n) = (64u64 << 10, 256usize);
    let file = new_file(&agent, &path, block * n as u64);
    let fd = fd_of(&file);
    let src = agent.register(pattern(1, block as usize * n)).unwrap();
    let mem: Vec<Desc> = (0..n).map(|j| src.desc(j as u64 * block, block)).collect();
    let files: Vec<Desc> = (0..n)
        .map(|j| Desc::new((n - 1 - j) as u64 * block, block, fd))
        .collect();
    let local = DescList::from_descs(MemKind::Dram, mem);
    let remote = DescList::from_descs(MemKind::File { fd }, files);
    let mut reqs = Vec::new();
    for _ in 0..20 {
        let req = agent
            .create_request(
                Op::Write,
                &local,
                agent.name(),
                &remote,
                &RequestOptions::default(),
            )
            .unwrap();
        drop(req.post(None).unwrap());
        reqs.push(req);
    }
    bounded("in-flight count reaches zero", async {
        while src.inflight() > 0 || file.inflight() > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;
    drop(reqs);
    agent.deregister(&src).unwrap();
    agent.deregister(&file).unwrap();
    shut_down_clean(&agent).await;
}

/// Generate one `#[tokio::test]` per storage case for a backend.
#[macro_export]
macro_rules! storage_tests {
    ($but:expr) => {
        $crate::storage_tests!($but;
            storage_round_trip,
            storage_layouts,
            storage_direct_io,
            storage_truncated_file,
            storage_closed_fd_and_misuse,
            storage_no_space,
            storage_drop_in_flight,
        );
    };
    ($but:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                if let Some(why) = ($but.skip_case)(stringify!($case)) {
                    return $crate::support::skip(stringify!($case), &why);
                }
                $crate::storage::$case(&$but).await;
            }
        )*
    };
}
