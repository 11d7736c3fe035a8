//! Arbitrary bytes sent to a live side-channel listener: it never crashes, closes only
//! the offending connection, and keeps serving (checked every 256 inputs).
#![no_main]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use nixl::{Agent, SideChannelOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct World {
    rt: tokio::runtime::Runtime,
    server: Agent,
    client: Agent,
    addr: SocketAddr,
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (server, client, addr) = rt.block_on(async {
        let server = Agent::builder("server").backend(nixl_tcp::TcpBackend::new()).build().await.unwrap();
        server.register(vec![0u8; 4096]).unwrap();
        let opts = SideChannelOptions { idle_timeout: Duration::from_millis(200), ..Default::default() };
        let addr = server.listen("127.0.0.1:0".parse().unwrap(), &opts).await.unwrap();
        let client = Agent::builder("client").backend(nixl_tcp::TcpBackend::new()).build().await.unwrap();
        (server, client, addr)
    });
    World { rt, server, client, addr }
});

static N: AtomicU64 = AtomicU64::new(0);

fuzz_target!(|data: &[u8]| {
    let w = &*WORLD;
    w.rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
        let _ = s.write_all(data).await;
        let _ = s.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut sink)).await;
        if N.fetch_add(1, Ordering::Relaxed) % 256 == 0 {
            let name = w.client.fetch_metadata(w.addr, &SideChannelOptions::default()).await.expect("listener still serves");
            assert_eq!(name, w.server.name());
        }
    });
});
