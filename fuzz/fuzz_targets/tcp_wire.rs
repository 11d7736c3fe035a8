//! Arbitrary request bytes after a valid hello, sent to a live nixl-tcp target: it
//! never crashes, and its registered memory never changes (checksummed each input).
#![no_main]

use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use nixl::{Agent, Registration};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct World {
    rt: tokio::runtime::Runtime,
    _agent: Agent,
    mem: Registration,
    expect: Vec<u8>,
    addr: SocketAddr,
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (agent, mem, addr) = rt.block_on(async {
        let backend = nixl_tcp::TcpBackend::new();
        let agent = Agent::builder("target").backend(backend.clone()).build().await.unwrap();
        let mem = agent.register((0..4096u32).map(|i| i as u8).collect::<Vec<u8>>()).unwrap();
        (agent, mem, backend.local_addr().unwrap())
    });
    let expect = mem.to_vec().unwrap();
    World { rt, _agent: agent, mem, expect, addr }
});

fuzz_target!(|data: &[u8]| {
    let w = &*WORLD;
    w.rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
        let mut hello = b"NXTC\x04\x00\x04\x00fuzz".to_vec();
        hello.extend_from_slice(data);
        let _ = s.write_all(&hello).await;
        let _ = s.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut sink)).await;
    });
    assert!(w.mem.to_vec().unwrap() == w.expect, "registered memory changed");
});
