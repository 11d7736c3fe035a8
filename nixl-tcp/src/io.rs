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

/// Write all of host slice `s` to `w` (after whatever `w` holds).
async fn send_host(
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

/// Fill all of host slice `s` from `r` (buffered bytes first).
async fn recv_host(r: &mut BufReader<OwnedReadHalf>, s: &RegionSlice) -> io::Result<()> {
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

/// Device copies one staged run of slices keeps in flight ahead of (sending) or
/// behind (receiving) the socket, at most, and the bytes they may hold.
const STAGE_WINDOW_COPIES: usize = 16;
const STAGE_WINDOW_BYTES: usize = 16 << 20;

/// A staging buffer of `n` bytes (page-locked, from the process's pool).
fn pinned(n: usize) -> io::Result<PinnedBuf> {
    PinnedBuf::new(n).map_err(io_err)
}

async fn finish(c: GpuCopy) -> io::Result<PinnedBuf> {
    c.await.map_err(io::Error::other)
}

/// One piece of a run of slices, in wire order: host memory goes as it is, GPU
/// memory in chunks of at most [`STAGE_CHUNK`].
enum Piece {
    Host(RegionSlice),
    Gpu(RegionSlice, usize, usize),
}

/// The pieces of `slices`, lazily (a request may have millions of blocks).
fn pieces(slices: impl IntoIterator<Item = RegionSlice>) -> impl Iterator<Item = Piece> {
    slices.into_iter().flat_map(|s| {
        let gpu = s.kind() != MemKind::Dram;
        let host = (!gpu).then(|| Piece::Host(s.clone()));
        let len = if gpu { s.len() } else { 0 };
        host.into_iter()
            .chain(stage_chunks(len, STAGE_CHUNK).map(move |(at, n)| Piece::Gpu(s.clone(), at, n)))
    })
}

/// What [`send_slices`] has lined up: host slices, and GPU chunks whose copy to the
/// host has started.
enum Ahead {
    Host(RegionSlice),
    Gpu(GpuCopy, usize),
}

/// Write `slices` to `w` in order (after whatever `w` holds). GPU memory goes through
/// page-locked buffers: the device-to-host copies of up to [`STAGE_WINDOW_COPIES`]
/// chunks ahead run on the GPU while earlier ones are written to the socket, so a run
/// of many small GPU blocks costs one copy latency, not one per block.
pub(crate) async fn send_slices(
    w: &mut BufWriter<OwnedWriteHalf>,
    slices: impl IntoIterator<Item = RegionSlice>,
    scratch: &mut Vec<u8>,
) -> io::Result<()> {
    let mut ahead = std::collections::VecDeque::new();
    let r = send_ahead(w, slices, scratch, &mut ahead).await;
    if r.is_err() {
        // The copies already started finish before the transfer is reported failed.
        for a in ahead {
            if let Ahead::Gpu(c, _) = a {
                let _ = c.await;
            }
        }
    }
    r
}

async fn send_ahead(
    w: &mut BufWriter<OwnedWriteHalf>,
    slices: impl IntoIterator<Item = RegionSlice>,
    scratch: &mut Vec<u8>,
    ahead: &mut std::collections::VecDeque<Ahead>,
) -> io::Result<()> {
    let mut next = pieces(slices);
    let (mut copies, mut bytes) = (0usize, 0usize);
    loop {
        // Line up more, starting their copies, within the window.
        while copies < STAGE_WINDOW_COPIES
            && bytes < STAGE_WINDOW_BYTES
            && ahead.len() < 4 * STAGE_WINDOW_COPIES
        {
            match next.next() {
                Some(Piece::Host(s)) => ahead.push_back(Ahead::Host(s)),
                Some(Piece::Gpu(s, at, n)) => {
                    let c = s.copy_to_pinned(at, pinned(n)?, n).map_err(io_err)?;
                    ahead.push_back(Ahead::Gpu(c, n));
                    copies += 1;
                    bytes += n;
                }
                None => break,
            }
        }
        match ahead.pop_front() {
            None => return Ok(()),
            Some(Ahead::Host(s)) => send_host(w, &s, scratch).await?,
            Some(Ahead::Gpu(c, n)) => {
                let buf = finish(c).await?;
                copies -= 1;
                bytes -= n;
                w.write_all(&buf[..n]).await?;
            }
        }
    }
}

/// Fill `slices` from `r` in order (buffered bytes first). GPU memory is read into
/// page-locked buffers and copied to the device while later pieces are read, up to
/// [`STAGE_WINDOW_COPIES`] copies at once; every copy has finished, and every byte is
/// in memory, when this returns.
pub(crate) async fn recv_slices(
    r: &mut BufReader<OwnedReadHalf>,
    slices: impl IntoIterator<Item = RegionSlice>,
) -> io::Result<()> {
    let mut behind = std::collections::VecDeque::new();
    let res = recv_behind(r, slices, &mut behind).await;
    // Every copy started finishes before this returns, on error too: the transfer is
    // answered or reported failed only after no copy touches its memory.
    let mut copied = Ok(());
    for (c, _) in behind {
        if let Err(e) = finish(c).await {
            copied = copied.and(Err(e));
        }
    }
    res.and(copied)
}

async fn recv_behind(
    r: &mut BufReader<OwnedReadHalf>,
    slices: impl IntoIterator<Item = RegionSlice>,
    behind: &mut std::collections::VecDeque<(GpuCopy, usize)>,
) -> io::Result<()> {
    let mut bytes = 0usize;
    for piece in pieces(slices) {
        match piece {
            Piece::Host(s) => recv_host(r, &s).await?,
            Piece::Gpu(s, at, n) => {
                while behind.len() >= STAGE_WINDOW_COPIES
                    || (bytes >= STAGE_WINDOW_BYTES && !behind.is_empty())
                {
                    let (c, m) = behind.pop_front().expect("checked non-empty");
                    finish(c).await?;
                    bytes -= m;
                }
                let mut buf = pinned(n)?;
                r.read_exact(&mut buf[..n]).await?;
                behind.push_back((s.copy_from_pinned(at, buf, n).map_err(io_err)?, n));
                bytes += n;
            }
        }
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
