//! Moving bytes between a socket and registered memory without a Rust reference into
//! that memory (peers and other transfers may write it at any time).
//!
//! Pieces shorter than the stream's buffer go through it and are copied in or out with
//! [`RegionSlice::write_from`]/[`RegionSlice::read_into`] (raw copies); large ones go
//! straight between the kernel and registered memory with [`RegionSlice::recv`] and
//! [`RegionSlice::send`], once the buffered bytes are used up or flushed.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use nixl::RegionSlice;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter, Interest};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// Capacity of every connection's read and write buffer.
pub(crate) const IO_BUF: usize = 64 * 1024;

/// Pieces shorter than the buffer are copied through it (one system call carries
/// several of them, and the request header); larger ones go direct, where tokio's
/// buffered streams would bypass their buffer too.
const SMALL: usize = IO_BUF - 1;

fn io_err(e: nixl::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

/// Write all of `s` to `w` (after whatever `w` holds).
pub(crate) async fn send_slice(
    w: &mut BufWriter<OwnedWriteHalf>,
    s: &RegionSlice,
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    if s.len() <= SMALL {
        scratch.resize(s.len(), 0);
        s.read_into(0, scratch).map_err(io_err)?;
        return w.write_all(scratch).await;
    }
    w.flush().await?;
    let stream: &TcpStream = w.get_ref().as_ref();
    direct(
        stream,
        Interest::WRITABLE,
        s,
        0,
        RegionSlice::send,
        io::ErrorKind::WriteZero,
    )
    .await
}

/// Fill all of `s` from `r` (buffered bytes first).
pub(crate) async fn recv_slice(
    r: &mut BufReader<OwnedReadHalf>,
    s: &RegionSlice,
) -> io::Result<()> {
    let mut at = 0;
    while at < s.len() {
        let buffered = r.buffer();
        if buffered.is_empty() && s.len() - at > SMALL {
            break;
        }
        let buffered = if buffered.is_empty() {
            let b = r.fill_buf().await?;
            if b.is_empty() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            b
        } else {
            buffered
        };
        let n = buffered.len().min(s.len() - at);
        s.write_from(at, &buffered[..n]).map_err(io_err)?;
        r.consume(n);
        at += n;
    }
    let stream: &TcpStream = r.get_ref().as_ref();
    direct(
        stream,
        Interest::READABLE,
        s,
        at,
        RegionSlice::recv,
        io::ErrorKind::UnexpectedEof,
    )
    .await
}

/// Move `s[at..]` between the socket and registered memory with `call` (one
/// non-blocking `recv` or `send` per readiness) until all of it has moved; a call that
/// moves nothing ends the stream with `zero`.
async fn direct(
    stream: &TcpStream,
    interest: Interest,
    s: &RegionSlice,
    mut at: usize,
    call: fn(&RegionSlice, usize, usize, BorrowedFd<'_>) -> io::Result<usize>,
    zero: io::ErrorKind,
) -> io::Result<()> {
    while at < s.len() {
        stream.ready(interest).await?;
        match stream.try_io(interest, || call(s, at, s.len() - at, stream.as_fd())) {
            Ok(0) => return Err(zero.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
