//! Agents find each other through the direct side channel, with a shared secret.
//!
//! Run: `cargo run -p nixl-examples --example side_channel`

use nixl::{Agent, DescList, MemKind, SharedSecret, SideChannelOptions};
use nixl_tcp::TcpBackend;

#[tokio::main]
async fn main() -> nixl::Result<()> {
    let options = SideChannelOptions {
        secret: Some(SharedSecret::new("a secret both deployments know")?),
        ..Default::default()
    };
    let decode = Agent::builder("decode")
        .backend(TcpBackend::new())
        .build()
        .await?;
    let slot = decode.register(vec![0u8; 4096])?;
    // decode serves its metadata (loopback here; a routable address in a cluster).
    let addr = decode
        .listen("127.0.0.1:0".parse().unwrap(), &options)
        .await?;
    println!("decode serves metadata on {addr}");

    let prefill = Agent::builder("prefill")
        .backend(TcpBackend::new())
        .build()
        .await?;
    // Fetch resolves once decode's metadata is loaded; send ours so decode knows us too.
    let peer = prefill.fetch_metadata(addr, &options).await?;
    prefill.send_metadata(addr, &options).await?;
    println!("prefill loaded {peer:?}; decode knows {:?}", decode.peers());

    let kv = prefill.register(vec![42u8; 4096])?;
    let remote = prefill.remote_regions(&peer)?[0].clone();
    prefill
        .write(
            &DescList::from_descs(MemKind::Dram, [kv.whole()]),
            &peer,
            &DescList::from_descs(MemKind::Dram, [remote.desc(0, 4096)]),
            None,
        )
        .await?;
    assert_eq!(slot.to_vec()?, vec![42u8; 4096]);
    println!("wrote 4096 bytes through metadata found over the side channel");

    // A client without the secret gets nothing.
    let stranger = Agent::builder("stranger")
        .backend(TcpBackend::new())
        .build()
        .await?;
    let refused = stranger
        .fetch_metadata(addr, &SideChannelOptions::default())
        .await;
    println!("without the secret: {}", refused.unwrap_err());

    prefill.invalidate_at(addr, &options).await?;
    println!("after invalidate, decode knows {:?}", decode.peers());
    for a in [prefill, decode, stranger] {
        let _ = a.shutdown().await;
    }
    Ok(())
}
