//! Moving bytes between a socket and registered memory without a Rust reference into
//! that memory (peers and other transfers may write it at any time).
//!
//! Pieces shorter than the stream's buffer go through it and are copied in or out with
//! [`RegionSlice::write_from`]/[`RegionSlice::read_into`] (raw copies); large ones go
//! straight between the kernel and registered memory with [`RegionSlice::recv`] and
//! [`RegionSlice::send`], once the buffered bytes are used up or flushed. GPU memory
//! goes through page-locked staging buffers, with asynchronous device copies
//! pipelined against the socket I/O.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use nixl::gpu::{GpuCopy, PinnedBuf};
use nixl::{MemKind, RegionSlice};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter, Interest};
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

/// GPU memory moves through page-locked host buffers in chunks of this size, the
/// device copy of one chunk overlapping the socket I/O of another. All of it, small
/// pieces too: the staging copies run on their own stream and never wait for the
/// application's work on the device.
pub(crate) const STAGE_CHUNK: usize = 4 << 20;

/// Write all of `s` to `w` (after whatever `w` holds).
pub(crate) async fn send_slice(
    w: &mut BufWriter<OwnedWriteHalf>,
    s: &RegionSlice,
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    if s.kind() != MemKind::Dram {
        return send_staged(w, s).await;
    }
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

/// Fill all of `s` from `r` (buffered bytes first). GPU memory is filled through host
/// buffers; it holds the data when this returns (every copy finished).
pub(crate) async fn recv_slice(
    r: &mut BufReader<OwnedReadHalf>,
    s: &RegionSlice,
) -> io::Result<()> {
    if s.kind() != MemKind::Dram {
        return recv_staged(r, s).await;
    }
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

/// The chunks of `s` staging moves: (offset, length).
pub(crate) fn stage_chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk)).map(move |k| (k * chunk, chunk.min(len - k * chunk)))
}

/// A staging buffer of `n` bytes (page-locked, from the process's pool).
fn pinned(n: usize) -> io::Result<PinnedBuf> {
    PinnedBuf::new(n).map_err(io_err)
}

async fn finish(c: GpuCopy) -> io::Result<PinnedBuf> {
    c.await.map_err(io::Error::other)
}

/// Send GPU memory through page-locked buffers: chunk `k + 1` is copied to the host
/// (asynchronously, on the GPU's copy engine) while chunk `k` is written to the
/// socket.
async fn send_staged(w: &mut BufWriter<OwnedWriteHalf>, s: &RegionSlice) -> io::Result<()> {
    let chunks: Vec<(usize, usize)> = stage_chunks(s.len(), STAGE_CHUNK).collect();
    let Some(&(at, n)) = chunks.first() else {
        return Ok(());
    };
    let size = STAGE_CHUNK.min(s.len());
    let mut copying = Some(s.copy_to_pinned(at, pinned(size)?, n).map_err(io_err)?);
    let mut spare = None;
    for (k, &(_, n)) in chunks.iter().enumerate() {
        let buf = finish(copying.take().expect("one copy per chunk")).await?;
        if let Some(&(at, next)) = chunks.get(k + 1) {
            let b = match spare.take() {
                Some(b) => b,
                None => pinned(size)?,
            };
            copying = Some(s.copy_to_pinned(at, b, next).map_err(io_err)?);
        }
        w.write_all(&buf[..n]).await?;
        spare = Some(buf);
    }
    Ok(())
}

/// Receive into GPU memory through page-locked buffers: chunk `k` is copied to the
/// device while chunk `k + 1` is read from the socket. Every copy has finished, and
/// the bytes are in device memory, when this returns.
async fn recv_staged(r: &mut BufReader<OwnedReadHalf>, s: &RegionSlice) -> io::Result<()> {
    let size = STAGE_CHUNK.min(s.len());
    let mut copying: Option<GpuCopy> = None;
    let mut spare = None;
    for (at, n) in stage_chunks(s.len(), STAGE_CHUNK) {
        let mut buf = match spare.take() {
            Some(b) => b,
            None => pinned(size)?,
        };
        r.read_exact(&mut buf[..n]).await?;
        if let Some(c) = copying.take() {
            spare = Some(finish(c).await?);
        }
        copying = Some(s.copy_from_pinned(at, buf, n).map_err(io_err)?);
    }
    if let Some(c) = copying {
        finish(c).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn stage_chunks_cover_the_slice_in_order() {
        let c: Vec<_> = super::stage_chunks(10, 4).collect();
        assert_eq!(c, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(super::stage_chunks(8, 4).count(), 2);
        assert_eq!(super::stage_chunks(0, 4).count(), 0);
        assert_eq!(super::stage_chunks(3, 4).collect::<Vec<_>>(), vec![(0, 3)]);
    }
}
