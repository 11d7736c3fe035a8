//! A target agent in its own process, for the two-process tests.
//!
//! `nixl-peer <bytes> [etcd <endpoint> <ttl-secs>]`: registers `<bytes>` zeroed bytes
//! with a tcp agent named `target`, prints `METADATA <hex>` on stdout (and, with etcd,
//! publishes it under a lease and prints `PUBLISHED`), then for each notification prints
//! `NOTIF <text>`; on the notification `done` it prints `CHECKSUM <fnv1a>` of its
//! memory, shuts down and exits. TCP options come from `NIXL_TCP_LISTEN`,
//! `NIXL_TCP_DEAD_PEER_MS` and `NIXL_TCP_CONNECT_MS` when set.
#![forbid(unsafe_code)]

use std::io::Write;

use nixl::Agent;
use nixl_conformance::support::{checksum, hex};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let size: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
    let agent = Agent::builder("target")
        .backend(nixl_tcp::TcpBackend::with_options(
            nixl_conformance::support::tcp_options_from_env(),
        ))
        .build()
        .await
        .expect("agent");
    let mem = agent.register(vec![0u8; size]).expect("register");
    let mut notes = agent.notifications().expect("notifications");
    let mut out = std::io::stdout();
    writeln!(
        out,
        "METADATA {}",
        hex(&agent.metadata().expect("metadata"))
    )
    .unwrap();
    out.flush().unwrap();
    #[cfg(feature = "etcd")]
    let _etcd = if args.get(2).map(String::as_str) == Some("etcd") {
        let options = nixl::exchange::EtcdOptions {
            endpoints: vec![args[3].clone()],
            lease_ttl: std::time::Duration::from_secs(args[4].parse().expect("ttl")),
            ..Default::default()
        };
        let x = nixl::exchange::EtcdExchange::connect(&agent, options)
            .await
            .expect("etcd");
        x.publish().await.expect("publish");
        writeln!(out, "PUBLISHED").unwrap();
        out.flush().unwrap();
        Some(x)
    } else {
        None
    };
    while let Some(n) = notes.recv().await {
        let text = String::from_utf8_lossy(&n.msg).into_owned();
        writeln!(out, "NOTIF {text}").unwrap();
        if text == "done" {
            writeln!(out, "CHECKSUM {}", checksum(&mem)).unwrap();
            out.flush().unwrap();
            break;
        }
        out.flush().unwrap();
    }
    drop(notes);
    let report = agent.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
}
