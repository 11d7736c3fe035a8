//! nixl-tcp's target under hostile input, spoken straight over the wire: forged keys,
//! out-of-range and stale requests, oversized frames and random bytes are refused, the
//! target's registered memory stays unchanged (checksummed), and it keeps serving.
//! Also: the shared-secret handshake.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::StreamExt;
use nixl::metadata::AgentMetadata;
use nixl::{Agent, ErrorKind, Registration, SharedSecret};
use nixl_tcp::{TcpBackend, TcpOptions};
use nixl_testkit::double::one;
use nixl_testkit::{bounded, checksum, figure, pattern, remote};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// The documented wire format (nixl-tcp/src/wire.rs), written independently here.
const WRITE: u8 = 1;
const READ: u8 = 2;
const ST_OK: u8 = 0;
const ST_BAD_KEY: u8 = 1;
const ST_OUT_OF_RANGE: u8 = 2;
const ST_TOO_LARGE: u8 = 3;

struct Raw {
    s: TcpStream,
    next: u64,
}

impl Raw {
    async fn connect(addr: SocketAddr) -> Self {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&nixl_tcp::wire_hello("mallory")).await.unwrap();
        let mut reply = [0u8; 7];
        s.read_exact(&mut reply).await.unwrap();
        assert_eq!(reply[6], ST_OK, "no secret configured");
        // No same-host path for this client.
        s.write_all(&[0]).await.unwrap();
        Self { s, next: 1 }
    }

    /// Send a request of single blocks (key, address, length); returns the ACK status
    /// and whether DATA came before it.
    async fn request(
        &mut self,
        kind: u8,
        segs: &[(u64, u64, u64)],
        notif: Option<&[u8]>,
        payload: &[u8],
    ) -> (u8, bool) {
        let runs: Vec<_> = segs.iter().map(|&(k, a, l)| (k, a, l, 0, 1)).collect();
        self.request_runs(kind, &runs, notif, payload).await
    }

    /// Send a request of runs (key, address, length, stride, blocks).
    async fn request_runs(
        &mut self,
        kind: u8,
        runs: &[(u64, u64, u64, u64, u64)],
        notif: Option<&[u8]>,
        payload: &[u8],
    ) -> (u8, bool) {
        self.send_raw(
            kind,
            runs.len() as u32,
            notif.map_or(0, |n| n.len() as u32),
            notif.is_some(),
        )
        .await;
        let mut body = Vec::new();
        for &(k, a, l, stride, blocks) in runs {
            for x in [k, a, l, stride, blocks] {
                body.extend_from_slice(&x.to_le_bytes());
            }
        }
        body.extend_from_slice(notif.unwrap_or_default());
        body.extend_from_slice(payload);
        self.s.write_all(&body).await.unwrap();
        self.ack().await
    }

    /// Send bytes `from..from + len` of a request of runs as a piece (flag bit 1, the
    /// range after the header); returns the ACK status and the DATA a READ got.
    async fn piece(
        &mut self,
        kind: u8,
        runs: &[(u64, u64, u64, u64, u64)],
        (from, len): (u64, u64),
        payload: &[u8],
    ) -> (u8, Option<Vec<u8>>) {
        let mut frame = [0u8; 24].to_vec();
        frame[0] = kind;
        frame[1] = 2;
        frame[4..8].copy_from_slice(&(runs.len() as u32).to_le_bytes());
        frame[8..16].copy_from_slice(&self.next.to_le_bytes());
        self.next += 1;
        frame.extend_from_slice(&from.to_le_bytes());
        frame.extend_from_slice(&len.to_le_bytes());
        for &(k, a, l, stride, blocks) in runs {
            for x in [k, a, l, stride, blocks] {
                frame.extend_from_slice(&x.to_le_bytes());
            }
        }
        frame.extend_from_slice(payload);
        self.s.write_all(&frame).await.unwrap();
        let mut data = None;
        loop {
            let mut h = [0u8; 24];
            self.s.read_exact(&mut h).await.unwrap();
            let n = u64::from_le_bytes(h[16..24].try_into().unwrap()) as usize;
            let msg_len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
            match h[0] {
                0x81 => {
                    let mut d = vec![0u8; n];
                    self.s.read_exact(&mut d).await.unwrap();
                    data = Some(d);
                }
                0x80 => {
                    let mut msg = vec![0u8; msg_len];
                    self.s.read_exact(&mut msg).await.unwrap();
                    return (h[1], data);
                }
                k => panic!("unexpected response kind {k:#x}"),
            }
        }
    }

    async fn send_raw(&mut self, kind: u8, segments: u32, notif_len: u32, has_notif: bool) {
        let mut h = [0u8; 24];
        h[0] = kind;
        h[1] = u8::from(has_notif);
        h[4..8].copy_from_slice(&segments.to_le_bytes());
        h[8..16].copy_from_slice(&self.next.to_le_bytes());
        h[16..20].copy_from_slice(&notif_len.to_le_bytes());
        self.next += 1;
        self.s.write_all(&h).await.unwrap();
    }

    async fn ack(&mut self) -> (u8, bool) {
        let mut data = false;
        loop {
            let mut h = [0u8; 24];
            self.s.read_exact(&mut h).await.unwrap();
            match h[0] {
                0x81 => {
                    data = true;
                    let len = u64::from_le_bytes(h[16..24].try_into().unwrap());
                    let mut skip = vec![0u8; len as usize];
                    self.s.read_exact(&mut skip).await.unwrap();
                }
                0x80 => {
                    let msg_len = u32::from_le_bytes(h[4..8].try_into().unwrap());
                    let mut msg = vec![0u8; msg_len as usize];
                    self.s.read_exact(&mut msg).await.unwrap();
                    return (h[1], data);
                }
                k => panic!("unexpected response kind {k:#x}"),
            }
        }
    }

    /// Whether the target closed the connection.
    async fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match bounded("read until close", self.s.read(&mut b)).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    }
}

fn key_of(md: &[u8], region: u64) -> u64 {
    let md = AgentMetadata::decode(md).unwrap();
    let r = md.regions.iter().find(|r| r.id == region).unwrap();
    u64::from_le_bytes(r.blobs[0].blob[..8].try_into().unwrap())
}

async fn target(options: TcpOptions) -> (Agent, SocketAddr) {
    let b = TcpBackend::with_options(options);
    let agent = Agent::builder("target")
        .backend(b.clone())
        .build()
        .await
        .unwrap();
    (agent, b.local_addr().unwrap())
}

fn sums(rs: &[&Registration]) -> Vec<u64> {
    rs.iter().map(|r| checksum(r)).collect()
}

fn with_secret(s: Option<&str>) -> TcpOptions {
    TcpOptions {
        listener: nixl::control::ListenerOptions {
            secret: s.map(|s| SharedSecret::new(s).unwrap()),
            ..nixl::control::ListenerOptions::default()
        },
        ..Default::default()
    }
}

#[path = "wire/connections.rs"]
mod connections;
#[path = "wire/requests.rs"]
mod requests;
