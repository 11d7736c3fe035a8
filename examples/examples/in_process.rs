//! Two agents in one process: exchange metadata in-band, WRITE with a notification,
//! READ it back.
//!
//! Run: `cargo run -p nixl-examples --example in_process`

use nixl::{Agent, DescList, MemKind};
use nixl_tcp::TcpBackend;

#[tokio::main]
async fn main() -> nixl::Result<()> {
    // Two agents, each with the embedded TCP backend (loopback).
    let prefill = Agent::builder("prefill")
        .backend(TcpBackend::new())
        .build()
        .await?;
    let decode = Agent::builder("decode")
        .backend(TcpBackend::new())
        .build()
        .await?;

    // The agents own the buffers they register.
    let kv = prefill.register(b"KV cache block 0 ".repeat(1024))?;
    let slot = decode.register(vec![0u8; kv.len()])?;

    // In-band metadata exchange: the application carries the bytes itself.
    prefill.load_metadata(&decode.metadata()?)?;
    let remote = prefill.remote_regions("decode")?[0].clone();

    // WRITE with a notification: decode sees it only after the bytes are in its memory.
    let mut notes = decode.notifications()?;
    let local = DescList::from_descs(MemKind::Dram, [kv.whole()]);
    let target = DescList::from_descs(MemKind::Dram, [remote.desc(0, kv.len() as u64)]);
    prefill
        .write(&local, "decode", &target, Some("block 0 ready".into()))
        .await?;
    let n = notes.recv().await.expect("notification");
    println!(
        "decode got {:?} from {}",
        String::from_utf8_lossy(&n.msg),
        n.peer
    );
    assert_eq!(slot.to_vec()?, kv.to_vec()?);

    // READ it back into a fresh local buffer.
    let back = prefill.register(vec![0u8; kv.len()])?;
    prefill
        .read(
            &DescList::from_descs(MemKind::Dram, [back.whole()]),
            "decode",
            &target,
            None,
        )
        .await?;
    assert_eq!(back.to_vec()?, kv.to_vec()?);
    println!("wrote and read back {} bytes", kv.len());

    let r1 = prefill.shutdown().await;
    let r2 = decode.shutdown().await;
    println!("shutdown clean: {}", r1.is_clean() && r2.is_clean());
    Ok(())
}
