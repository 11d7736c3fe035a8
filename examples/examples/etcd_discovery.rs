//! Agents find each other through etcd: published under a lease, fetched with a watch.
//!
//! Needs a running etcd and the `etcd` feature (which needs `protoc`):
//! ```sh
//! etcd --data-dir /tmp/nixl-etcd &      # Debian: apt-get install etcd-server
//! cargo run -p nixl-examples --features etcd --example etcd_discovery -- http://127.0.0.1:2379
//! ```

use std::time::Duration;

use nixl::exchange::{EtcdExchange, EtcdOptions};
use nixl::{Agent, DescList, MemKind};
use nixl_tcp::TcpBackend;

#[tokio::main]
async fn main() -> nixl::Result<()> {
    let endpoint = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "http://127.0.0.1:2379".into());
    let options = EtcdOptions {
        endpoints: vec![endpoint],
        namespace: "nixl-example".into(),
        lease_ttl: Duration::from_secs(5),
        ..Default::default()
    };
    let decode = Agent::builder("decode")
        .backend(TcpBackend::new())
        .build()
        .await?;
    let slot = decode.register(vec![0u8; 4096])?;
    let xd = EtcdExchange::connect(&decode, options.clone()).await?;
    xd.publish().await?;
    println!(
        "decode published {} (lease {})",
        xd.key("decode", "full"),
        xd.lease_id()
    );

    let prefill = Agent::builder("prefill")
        .backend(TcpBackend::new())
        .build()
        .await?;
    let xp = EtcdExchange::connect(&prefill, options).await?;
    xp.fetch("decode", Duration::from_secs(5)).await?;
    let kv = prefill.register(vec![7u8; 4096])?;
    let remote = prefill.remote_regions("decode")?[0].clone();
    prefill
        .write(
            &DescList::from_descs(MemKind::Dram, [kv.whole()]),
            "decode",
            &DescList::from_descs(MemKind::Dram, [remote.desc(0, 4096)]),
            None,
        )
        .await?;
    assert_eq!(slot.to_vec()?, vec![7u8; 4096]);
    println!("wrote 4096 bytes to an agent found through etcd");

    // Shutdown revokes decode's lease: prefill's watch forgets it.
    let _ = decode.shutdown().await;
    for _ in 0..100 {
        if prefill.peers().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "after decode's shutdown, prefill knows {:?}",
        prefill.peers()
    );
    let _ = prefill.shutdown().await;
    Ok(())
}
