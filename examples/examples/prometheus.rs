//! A service that exports its agents' metrics for Prometheus: two agents with metrics
//! and per-transfer records on, a few WRITEs, then the scrape page printed (and served
//! at `METRICS_ADDR`, default 127.0.0.1:9091, until it exits; `HOLD_SECS` keeps it up
//! for that long so you can point Prometheus or `curl` at it).
//!
//! Run: `cargo run -p nixl-examples --example prometheus`

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusBuilder;
use nixl::{Agent, DescList, MemKind, TelemetryOptions};
use nixl_tcp::TcpBackend;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::var("METRICS_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:9091".into())
        .parse()?;
    // The exporter is the process's `metrics` recorder, served over HTTP.
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()?;
    let telemetry = TelemetryOptions {
        transfers: true,
        metrics: true,
        peer_labels: true,
    };
    let prefill = Agent::builder("prefill")
        .backend(TcpBackend::new())
        .telemetry(telemetry)
        .build()
        .await?;
    let decode = Agent::builder("decode")
        .backend(TcpBackend::new())
        .telemetry(telemetry)
        .build()
        .await?;
    let kv = prefill.register(vec![7u8; 1 << 20])?;
    let _slot = decode.register(vec![0u8; 1 << 20])?;
    prefill.load_metadata(&decode.metadata()?)?;
    let remote = prefill.remote_regions("decode")?[0].clone();
    for i in 0..8u64 {
        let local = DescList::from_descs(MemKind::Dram, [kv.desc(i << 17, 1 << 17)]);
        let target = DescList::from_descs(MemKind::Dram, [remote.desc(i << 17, 1 << 17)]);
        let mut t = prefill.transfer(nixl::Op::Write, &local, "decode", &target, None)?;
        (&mut t).await?;
        if let Some(r) = t.telemetry() {
            println!(
                "WRITE {} bytes to {:?}: post {:?}, done after {:?}",
                r.bytes,
                r.peer.as_deref().unwrap_or("-"),
                r.post_duration.unwrap_or_default(),
                r.duration.unwrap_or_default()
            );
        }
    }
    // What Prometheus would scrape.
    let body = scrape(addr).await?;
    for line in body.lines().filter(|l| l.starts_with("nixl_")) {
        println!("{line}");
    }
    let hold = std::env::var("HOLD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if hold > 0 {
        println!("serving http://{addr}/metrics for {hold} s");
        tokio::time::sleep(Duration::from_secs(hold)).await;
    }
    let _ = prefill.shutdown().await;
    let _ = decode.shutdown().await;
    Ok(())
}

/// GET /metrics over HTTP/1.0.
async fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for _ in 0..100 {
        // The listener starts on its own task.
        if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
                .await?;
            let mut out = String::new();
            s.read_to_string(&mut out).await?;
            return Ok(out
                .split_once("\r\n\r\n")
                .map_or(out.clone(), |b| b.1.to_owned()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(std::io::Error::other("the exporter did not start"))
}
