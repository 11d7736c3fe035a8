//! What this machine gives without nixl, measured in the bench's own process right
//! before the sweep (`--baselines`), so results and baselines come from one run:
//! single-thread memcpy of each point's bytes, a plain loopback TCP stream, and a
//! loopback TCP ping-pong.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Context, Result};

/// How long each measurement runs.
const RUN: Duration = Duration::from_millis(200);

/// Baseline figures. GB/s with GB = 10^9 bytes; times in microseconds.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Baselines {
    /// (bytes, GB/s): `copy_from_slice` between two buffers of that size, one thread.
    pub(crate) memcpy: Vec<(u64, f64)>,
    /// One loopback TCP stream, 16 MiB writes, blocking sockets on two threads.
    pub(crate) tcp_stream_gbps: f64,
    /// Half the round trip of a 64-byte ping-pong over loopback TCP (nodelay).
    pub(crate) tcp_half_rtt_us: f64,
    /// Half the round trip of a 4 KiB message answered by 24 bytes (a WRITE's shape).
    pub(crate) tcp_half_rtt_4k_us: f64,
    /// Half the round trip of a 64-byte message answered by 4 KiB (a READ's shape).
    pub(crate) tcp_half_rtt_4k_read_us: f64,
}

/// Measure everything; `sizes` are the bytes one request of each sweep point moves.
///
/// # Errors
/// Loopback sockets that cannot be made.
pub(crate) fn measure(sizes: &[u64]) -> Result<Baselines> {
    let mut memcpy = Vec::new();
    for &n in sizes {
        if memcpy.iter().any(|&(m, _)| m == n) {
            continue;
        }
        memcpy.push((n, memcpy_gbps(n as usize)));
    }
    Ok(Baselines {
        memcpy,
        tcp_stream_gbps: tcp_stream().context("baseline: loopback TCP stream")?,
        tcp_half_rtt_us: ping_pong(64, 64).context("baseline: loopback TCP ping-pong")?,
        tcp_half_rtt_4k_us: ping_pong(4096, 24).context("baseline: loopback TCP ping-pong")?,
        tcp_half_rtt_4k_read_us: ping_pong(64, 4096).context("baseline: loopback TCP ping-pong")?,
    })
}

fn memcpy_gbps(n: usize) -> f64 {
    let src = vec![0x5au8; n];
    let mut dst = vec![0u8; n];
    // Touch both once, so page faults are not measured.
    dst.copy_from_slice(&src);
    let t0 = Instant::now();
    let mut iters = 0u64;
    while t0.elapsed() < RUN {
        for _ in 0..8 {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        iters += 8;
    }
    (n as u64 * iters) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let a = TcpStream::connect(l.local_addr()?)?;
    let (b, _) = l.accept()?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    Ok((a, b))
}

fn tcp_stream() -> std::io::Result<f64> {
    const CHUNK: usize = 16 << 20;
    let (mut a, mut b) = pair()?;
    let reader = std::thread::spawn(move || -> std::io::Result<(u64, Duration)> {
        let mut buf = vec![0u8; CHUNK];
        let mut got = 0u64;
        let mut t0 = None;
        loop {
            match b.read(&mut buf)? {
                0 => break,
                n => {
                    t0.get_or_insert_with(Instant::now);
                    got += n as u64;
                }
            }
        }
        Ok((got, t0.map(|t| t.elapsed()).unwrap_or_default()))
    });
    let buf = vec![0x11u8; CHUNK];
    let t0 = Instant::now();
    while t0.elapsed() < RUN {
        a.write_all(&buf)?;
    }
    drop(a);
    let (got, took) = reader.join().expect("reader thread")?;
    Ok(got as f64 / took.as_secs_f64().max(1e-9) / 1e9)
}

fn ping_pong(request: usize, reply: usize) -> std::io::Result<f64> {
    let (mut a, mut b) = pair()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buf = vec![0u8; request];
        let answer = vec![0u8; reply];
        loop {
            match b.read_exact(&mut buf) {
                Ok(()) => b.write_all(&answer)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let msg = vec![0u8; request];
    let mut back = vec![0u8; reply];
    for _ in 0..100 {
        a.write_all(&msg)?;
        a.read_exact(&mut back)?;
    }
    let mut rtts = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < RUN {
        let t = Instant::now();
        a.write_all(&msg)?;
        a.read_exact(&mut back)?;
        rtts.push(t.elapsed());
    }
    drop(a);
    echo.join().expect("echo thread")?;
    rtts.sort();
    // The median, so one preempted round trip does not move it.
    Ok(rtts[rtts.len() / 2].as_secs_f64() * 1e6 / 2.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn baselines_are_positive() {
        let b = super::measure(&[4096, 4096, 65536]).unwrap();
        assert_eq!(b.memcpy.len(), 2, "sizes measured once each");
        assert!(b.memcpy.iter().all(|&(_, g)| g > 0.0));
        assert!(b.tcp_stream_gbps > 0.0);
        assert!(b.tcp_half_rtt_us > 0.0 && b.tcp_half_rtt_4k_us > 0.0);
        assert!(b.tcp_half_rtt_4k_read_us > 0.0);
    }
}
