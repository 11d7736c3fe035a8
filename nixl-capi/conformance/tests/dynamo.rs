//! NIXL's Rust binding (nixl-sys 1.5.1, stub mode: it `dlopen`s
//! `libnixl_capi.so`) driving nixl-rs' library in the order NVIDIA Dynamo's KV
//! block manager calls it: one agent per worker, `get_plugin_params` then
//! `create_backend` with overrides, registrations dropped RAII-style, metadata
//! exchanged as blobs, `create_xfer_req` (the agent's own name for storage),
//! posting then polling `get_xfer_status`, notification maps.
//!
//! Run by scripts/test with the library on LD_LIBRARY_PATH; without it, nixl-sys
//! aborts at the first call, so each test first checks `is_stub()` and SKIPs.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs,
    SystemStorage, XferDescList, XferOp, XferStatus,
};

fn library_present(test: &str) -> bool {
    if nixl_sys::is_stub() {
        println!("SKIP nixl-capi conformance {test}: libnixl_capi.so not found (build nixl-capi and put its directory on LD_LIBRARY_PATH)");
        return false;
    }
    true
}

/// A Dynamo worker's agent with `backend`, made as Dynamo's `build_agent` does.
fn worker(name: &str, backend: &str, overrides: &[(&str, &str)]) -> Agent {
    let agent = Agent::new(name).expect("create agent");
    let (mems, mut params) = agent.get_plugin_params(backend).expect("plugin params");
    assert!(
        !mems.is_empty().unwrap(),
        "{backend} serves some memory type"
    );
    for (k, v) in overrides {
        params.set(k, v).unwrap();
    }
    agent
        .create_backend(backend, &params)
        .expect("create backend");
    agent
}

fn wait(agent: &Agent, req: &nixl_sys::XferRequest, posted_in_progress: bool) {
    if !posted_in_progress {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match agent.get_xfer_status(req).expect("transfer status") {
            XferStatus::Success => return,
            XferStatus::InProgress => {
                assert!(
                    Instant::now() < deadline,
                    "transfer still in progress after 20 s"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn xfer_list(storage: &SystemStorage) -> XferDescList<'static> {
    let mut l = XferDescList::new(MemType::Dram).unwrap();
    // SAFETY: the storage outlives every request made from this list in these tests.
    l.add_desc(unsafe { storage.as_ptr() } as usize, storage.size(), 0);
    l
}

fn notifications_from(agent: &Agent, peer: &str, want: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < want {
        let mut map = NotificationMap::new().unwrap();
        agent
            .get_notifications(&mut map, None)
            .expect("get notifications");
        if let Some(v) = map.take_notifs().unwrap().remove(peer) {
            got.extend(v);
        }
        assert!(
            Instant::now() < deadline,
            "{} of {want} notifications after 10 s",
            got.len()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

/// Two workers: metadata both ways, WRITE with a notification, READ back,
/// telemetry, a prepared request, then RAII teardown.
fn two_workers(backend: &str, overrides: &[(&str, &str)]) {
    let a = worker(&format!("kvbm-worker-0-{backend}"), backend, overrides);
    let b = worker(&format!("kvbm-worker-1-{backend}"), backend, overrides);
    let mut src = SystemStorage::new(1 << 20).unwrap();
    let dst = SystemStorage::new(1 << 20).unwrap();
    let back = SystemStorage::new(1 << 20).unwrap();
    for (i, x) in (0..).zip(unsafe_bytes(&src)) {
        *x = (i * 7 % 251) as u8;
    }
    let _ra = a.register_memory(&src, None).expect("register src");
    let _rb = b.register_memory(&dst, None).expect("register dst");
    let _rback = a.register_memory(&back, None).expect("register back");

    let name_b = a
        .load_remote_md(&b.get_local_md().unwrap())
        .expect("load b");
    assert_eq!(name_b, b.name());
    assert_eq!(
        b.load_remote_md(&a.get_local_md().unwrap()).unwrap(),
        a.name()
    );
    assert!(a.check_remote_metadata(&name_b, Some(&xfer_list(&dst))));
    assert!(!a.check_remote_metadata("nobody", None));

    let mut opt = OptArgs::new().unwrap();
    opt.set_notification_message(b"block-7 written").unwrap();
    opt.set_has_notification(true).unwrap();
    let req = a
        .create_xfer_req(
            XferOp::Write,
            &xfer_list(&src),
            &xfer_list(&dst),
            &name_b,
            Some(&opt),
        )
        .expect("create write");
    let in_progress = a.post_xfer_req(&req, None).expect("post write");
    wait(&a, &req, in_progress);
    assert_eq!(
        notifications_from(&b, &a.name(), 1),
        vec!["block-7 written".to_owned()]
    );
    assert_eq!(src.as_slice(), dst.as_slice(), "WRITE moved the bytes");
    let backend_of = a.query_xfer_backend(&req).expect("query backend");
    drop(backend_of);
    drop(req);

    // Prepared lists, by index (Dynamo's v2 executor path).
    let local = a
        .prepare_xfer_dlist("", &xfer_list(&back), None)
        .expect("prep local");
    let remote = a
        .prepare_xfer_dlist(&name_b, &xfer_list(&dst), None)
        .expect("prep remote");
    let req = a
        .make_xfer_req(XferOp::Read, &local, &[0], &remote, &[0], None)
        .expect("make read");
    let in_progress = a.post_xfer_req(&req, None).expect("post read");
    wait(&a, &req, in_progress);
    assert_eq!(back.as_slice(), src.as_slice(), "READ brought them back");

    // A standalone notification, and the sender's own view of the peer.
    a.send_notification(&name_b, b"done", None)
        .expect("gen notif");
    assert_eq!(
        notifications_from(&b, &a.name(), 1),
        vec!["done".to_owned()]
    );
    drop(req);
    src.memset(0);
}

/// View a storage's bytes mutably (SystemStorage only hands out a shared slice).
fn unsafe_bytes(s: &SystemStorage) -> &mut [u8] {
    // SAFETY: the tests write the source before any transfer reads it, on one
    // thread; nothing else holds the slice.
    unsafe { std::slice::from_raw_parts_mut(s.as_ptr().cast_mut(), s.size()) }
}

#[test]
fn two_workers_over_ucx() {
    if library_present("two_workers_over_ucx") {
        two_workers("UCX", &[]);
    }
}

#[test]
fn two_workers_over_tcp() {
    if library_present("two_workers_over_tcp") {
        two_workers("TCP", &[("listen", "127.0.0.1:0")]);
    }
}

/// A file registered by descriptor, as Dynamo's disk tier does (FILE, dev_id = fd).
#[derive(Debug)]
struct DiskStorage {
    file: std::fs::File,
    len: usize,
}

impl MemoryRegion for DiskStorage {
    unsafe fn as_ptr(&self) -> *const u8 {
        std::ptr::null()
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for DiskStorage {
    fn mem_type(&self) -> MemType {
        MemType::File
    }
    fn device_id(&self) -> u64 {
        self.file.as_raw_fd() as u64
    }
}

#[test]
fn disk_round_trip_over_posix() {
    if !library_present("disk_round_trip_over_posix") {
        return;
    }
    let agent = worker("kvbm-worker-disk", "POSIX", &[]);
    let dir = std::env::temp_dir().join(format!("nixl-capi-disk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("blocks.bin");
    const LEN: usize = 1 << 20;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    file.set_len(LEN as u64).unwrap();
    let disk = DiskStorage { file, len: LEN };
    let host = SystemStorage::new(LEN).unwrap();
    for (i, x) in (0..).zip(unsafe_bytes(&host)) {
        *x = (i % 253) as u8;
    }
    let want = host.as_slice().to_vec();
    let _rh = agent.register_memory(&host, None).expect("register host");
    let _rd = agent.register_memory(&disk, None).expect("register file");

    let mut file_list = XferDescList::new(MemType::File).unwrap();
    file_list.add_desc(0, LEN, disk.device_id());
    // Host -> disk: the agent's own name as the remote agent.
    let me = agent.name();
    let req = agent
        .create_xfer_req(XferOp::Write, &xfer_list(&host), &file_list, &me, None)
        .expect("create write to file");
    let in_progress = agent.post_xfer_req(&req, None).expect("post");
    wait(&agent, &req, in_progress);
    drop(req);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        want,
        "the file holds the block"
    );

    unsafe_bytes(&host).fill(0);
    let req = agent
        .create_xfer_req(XferOp::Read, &xfer_list(&host), &file_list, &me, None)
        .expect("create read from file");
    let in_progress = agent.post_xfer_req(&req, None).expect("post");
    wait(&agent, &req, in_progress);
    drop(req);
    assert_eq!(host.as_slice(), &want[..], "READ brought the block back");

    // Without a notification backend, get_notifs is an error (as NIXL's).
    let mut map = NotificationMap::new().unwrap();
    assert!(agent.get_notifications(&mut map, None).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn telemetry_of_a_configured_agent() {
    if !library_present("telemetry_of_a_configured_agent") {
        return;
    }
    let cfg = AgentConfig {
        capture_telemetry: true,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured("kvbm-telemetry", &cfg).unwrap();
    let (_, params) = agent.get_plugin_params("TCP").unwrap();
    agent.create_backend("TCP", &params).unwrap();
    let src = SystemStorage::new(64 << 10).unwrap();
    let dst = SystemStorage::new(64 << 10).unwrap();
    let _r1 = agent.register_memory(&src, None).unwrap();
    let _r2 = agent.register_memory(&dst, None).unwrap();
    let me = agent.name();
    let req = agent
        .create_xfer_req(XferOp::Write, &xfer_list(&src), &xfer_list(&dst), &me, None)
        .unwrap();
    assert!(req.get_telemetry().is_err(), "no telemetry before a post");
    let in_progress = agent.post_xfer_req(&req, None).unwrap();
    wait(&agent, &req, in_progress);
    let t = req.get_telemetry().expect("telemetry after the post");
    assert_eq!(t.total_bytes, 64 << 10);
    assert_eq!(t.desc_count, 1);
    assert!(t.start_time().as_micros() > 0);
}

#[test]
fn library_says_it_is_nixl_rs() {
    if !library_present("library_says_it_is_nixl_rs") {
        return;
    }
    // The library is loaded (by nixl-sys' stubs, RTLD_LOCAL); ask it by name.
    let name = c"libnixl_capi.so";
    // SAFETY: dlopen of a library already loaded, dlsym of a function taking
    // nothing and returning a static string.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "libnixl_capi.so is loaded");
        let f = libc::dlsym(h, c"nixl_rs_capi_version".as_ptr());
        assert!(!f.is_null(), "the library loaded is nixl-rs'");
        let f: extern "C" fn() -> *const std::ffi::c_char = std::mem::transmute(f);
        let v = std::ffi::CStr::from_ptr(f()).to_str().unwrap();
        assert!(v.starts_with("nixl-rs "), "{v}");
        libc::dlclose(h);
    }
}

/// The same list as both sides of a request (NIXL accepts it: a local copy of a
/// buffer onto itself) returns, within a bound, instead of locking the list twice.
#[test]
fn one_list_as_both_sides_of_a_request() {
    if !library_present("one_list_as_both_sides_of_a_request") {
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    // Its own thread, left behind if it hangs, so the test fails instead.
    std::thread::spawn(move || {
        let agent = worker("kvbm-same-list", "TCP", &[]);
        let buf = SystemStorage::new(4096).unwrap();
        let _r = agent.register_memory(&buf, None).unwrap();
        let list = xfer_list(&buf);
        let r = agent.create_xfer_req(XferOp::Write, &list, &list, &agent.name(), None);
        tx.send(r.map(|_| ()).map_err(|e| e.to_string())).unwrap();
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("create_xfer_req with one list as both sides returned");
    r.expect("the request is made");
}
