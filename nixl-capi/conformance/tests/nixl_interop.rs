//! A C-API agent on nixl-rs' library (driven through nixl-sys) and a real NIXL
//! 1.5.1 agent (the nixl-cu12 wheel's Python API in a child process, the repo's
//! tests/nixl_peer.py) exchange metadata and move data both ways over UCX, with
//! notifications both ways.
//!
//! Needs `NIXL_TEST_NIXL_WHEEL_DIR` (the wheel installed with `pip install
//! --no-deps --target DIR nixl-cu12==1.5.1 numpy`); both sides bind the wheel's
//! own libucp (our UCX backend through `NIXL_UCX_LIB`). Its own test binary: the
//! UCX it loads is the wheel's, not the host's the other tests use.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, MemType, MemoryRegion, NotificationMap, OptArgs, SystemStorage, XferDescList, XferOp,
    XferStatus,
};

const LEN: usize = 1 << 20;

fn wheel() -> Option<(PathBuf, PathBuf)> {
    let Some(dir) = std::env::var_os("NIXL_TEST_NIXL_WHEEL_DIR").map(PathBuf::from) else {
        println!("SKIP nixl-capi NIXL interop: NIXL_TEST_NIXL_WHEEL_DIR is not set (pip install --no-deps --target DIR nixl-cu12==1.5.1 numpy)");
        return None;
    };
    let ucp = std::fs::read_dir(dir.join("nixl_cu12.libs"))
        .ok()?
        .find_map(|e| {
            let p = e.ok()?.path();
            let n = p.file_name()?.to_str()?.to_owned();
            (n.starts_with("libucp-") && n.contains(".so")).then_some(p)
        });
    match ucp {
        Some(ucp) => Some((dir, ucp)),
        None => {
            println!(
                "SKIP nixl-capi NIXL interop: no libucp in {}/nixl_cu12.libs",
                dir.display()
            );
            None
        }
    }
}

/// The NIXL agent in a Python child (line protocol of tests/nixl_peer.py).
struct NixlPeer {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    addr: u64,
}

impl NixlPeer {
    fn start(wheel: &Path, name: &str) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/nixl_peer.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(name)
            .arg(LEN.to_string())
            .env("PYTHONPATH", wheel)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut p = Self {
            child,
            stdin,
            out,
            addr: 0,
        };
        let ready = p.answer().expect("the NIXL agent starts");
        p.addr = ready.split_whitespace().nth(1).unwrap().parse().unwrap();
        p
    }

    fn answer(&mut self) -> Result<String, String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line).unwrap() == 0 {
                return Err("the NIXL agent exited".into());
            }
            if let Some(rest) = line.strip_prefix("@@ OK") {
                return Ok(rest.trim().to_owned());
            }
            if let Some(rest) = line.strip_prefix("@@ ERR") {
                return Err(rest.trim().to_owned());
            }
        }
    }

    fn ok(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.answer()
            .unwrap_or_else(|e| panic!("NIXL agent: {cmd:?} failed: {e}"))
    }
}

impl Drop for NixlPeer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "EXIT");
        let _ = self.child.wait();
    }
}

fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "-".into();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    if s == "-" {
        return Vec::new();
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn bytes_of(s: &SystemStorage) -> &mut [u8] {
    // SAFETY: one thread writes the buffer while no transfer uses it.
    unsafe { std::slice::from_raw_parts_mut(s.as_ptr().cast_mut(), s.size()) }
}

fn list(addr: u64, len: usize) -> XferDescList<'static> {
    let mut l = XferDescList::new(MemType::Dram).unwrap();
    l.add_desc(addr as usize, len, 0);
    l
}

fn run(agent: &Agent, op: XferOp, local: u64, remote: u64, peer: &str, notif: Option<&[u8]>) {
    let mut opt = OptArgs::new().unwrap();
    if let Some(n) = notif {
        opt.set_notification_message(n).unwrap();
        opt.set_has_notification(true).unwrap();
    }
    let req = agent
        .create_xfer_req(op, &list(local, LEN), &list(remote, LEN), peer, Some(&opt))
        .expect("create transfer");
    let mut running = agent.post_xfer_req(&req, None).expect("post");
    let deadline = Instant::now() + Duration::from_secs(20);
    while running {
        assert!(
            Instant::now() < deadline,
            "transfer still running after 20 s"
        );
        running = matches!(
            agent.get_xfer_status(&req).expect("status"),
            XferStatus::InProgress
        );
    }
}

#[test]
fn a_c_api_agent_and_a_nixl_agent_move_data_both_ways_over_ucx() {
    let Some((wheel, ucp)) = wheel() else { return };
    if nixl_sys::is_stub() {
        println!("SKIP nixl-capi NIXL interop: libnixl_capi.so not found");
        return;
    }
    // Both sides on the wheel's UCX, loopback only (the wheel's UCX crashes at exit
    // on hosts without RDMA unless its ib module is off).
    std::env::set_var("NIXL_UCX_LIB", &ucp);
    std::env::set_var("UCX_NET_DEVICES", "lo");
    std::env::set_var("UCX_MODULES", "^ib");
    std::env::remove_var("UCX_TLS");

    let mut nixl = NixlPeer::start(&wheel, "nixl-1.5.1");
    let agent = Agent::new("capi-agent").unwrap();
    let (_, params) = agent.get_plugin_params("UCX").unwrap();
    agent
        .create_backend("UCX", &params)
        .expect("UCX on the wheel's libucp");
    let buf = SystemStorage::new(LEN).unwrap();
    let _reg = agent.register_memory(&buf, None).unwrap();
    let ours = buf.as_slice().as_ptr() as u64;

    // Metadata both ways, as blobs.
    let md = agent.get_local_md().unwrap();
    assert_eq!(nixl.ok(&format!("LOAD {}", hex(&md))), "capi-agent");
    let theirs = unhex(&nixl.ok("MD"));
    assert_eq!(agent.load_remote_md(&theirs).unwrap(), "nixl-1.5.1");

    // We WRITE into NIXL's buffer, with a notification.
    for (i, b) in bytes_of(&buf).iter_mut().enumerate() {
        *b = (i % 241) as u8;
    }
    run(
        &agent,
        XferOp::Write,
        ours,
        nixl.addr,
        "nixl-1.5.1",
        Some(b"from-capi"),
    );
    let dumped = unhex(&nixl.ok(&format!("DUMP 0 {LEN}")));
    assert_eq!(dumped, buf.as_slice(), "NIXL's buffer holds what we wrote");
    let got = nixl.ok("NOTIFS 1 10");
    assert!(
        got.contains(&format!("capi-agent:{}", hex(b"from-capi"))),
        "{got}"
    );

    // NIXL WRITEs into ours, with a notification.
    nixl.ok(&format!("FILL 0 {LEN} 90"));
    nixl.ok(&format!(
        "XFER WRITE capi-agent 0 {LEN} {ours} {}",
        hex(b"from-nixl")
    ));
    assert!(
        buf.as_slice().iter().all(|&b| b == 90),
        "our buffer holds NIXL's bytes"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let notes = loop {
        let mut map = NotificationMap::new().unwrap();
        agent.get_notifications(&mut map, None).unwrap();
        let mut n = map.take_notifs().unwrap();
        if let Some(v) = n.remove("nixl-1.5.1") {
            break v;
        }
        assert!(Instant::now() < deadline, "no notification from NIXL");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(notes, vec!["from-nixl".to_owned()]);

    // READs both ways.
    nixl.ok(&format!("FILL 0 {LEN} 17"));
    run(&agent, XferOp::Read, ours, nixl.addr, "nixl-1.5.1", None);
    assert!(
        buf.as_slice().iter().all(|&b| b == 17),
        "we READ NIXL's buffer"
    );
    bytes_of(&buf).fill(33);
    nixl.ok(&format!("XFER READ capi-agent 0 {LEN} {ours}"));
    let dumped = unhex(&nixl.ok(&format!("DUMP 0 {LEN}")));
    assert!(dumped.iter().all(|&b| b == 33), "NIXL READ our buffer");
}
