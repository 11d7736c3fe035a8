//! Side-channel frames: `MAGIC`, version, kind, two zero bytes, payload length (u32 LE),
//! payload. Every frame is checked against a size limit before anything is allocated.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub(crate) const MAGIC: [u8; 4] = *b"NXSC";
/// 2: the core's authentication (`crate::control`), which proves agent names.
pub(crate) const VERSION: u8 = 2;
pub(crate) const HEADER_LEN: usize = 12;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// Server -> client, first frame: flags (bit 0: authentication required), then
    /// the server's agent name.
    Hello = 1,
    /// Client -> server: one message of the core's authentication (the first
    /// starts with `AUTH_MAGIC`).
    Auth = 2,
    /// Server -> client: one message of the core's authentication.
    AuthOk = 3,
    /// Client -> server: fetch metadata; payload is a label (empty: full metadata).
    Fetch = 4,
    /// Client -> server: load this metadata.
    Send = 5,
    /// Client -> server: forget the agent named in the payload.
    Invalidate = 6,
    /// Server -> client: metadata bytes.
    Metadata = 7,
    /// Server -> client: done.
    Ok = 8,
    /// Either way: UTF-8 error text; the sender closes after it.
    Error = 9,
}

impl Kind {
    fn from_u8(x: u8) -> Option<Self> {
        Some(match x {
            1 => Self::Hello,
            2 => Self::Auth,
            3 => Self::AuthOk,
            4 => Self::Fetch,
            5 => Self::Send,
            6 => Self::Invalidate,
            7 => Self::Metadata,
            8 => Self::Ok,
            9 => Self::Error,
            _ => return None,
        })
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The connection closed cleanly before a frame started.
    Closed,
    Io(std::io::Error),
    /// Malformed: bad magic, version, kind, reserved bytes, or over the size limit.
    Malformed(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => f.write_str("connection closed"),
            Self::Io(e) => write!(f, "i/o error: {e}"),
            Self::Malformed(m) => write!(f, "malformed frame: {m}"),
        }
    }
}

pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<(Kind, Vec<u8>), FrameError> {
    let mut h = [0u8; HEADER_LEN];
    // Distinguish a clean close (no byte of a new frame) from truncation.
    let n = r.read(&mut h).await.map_err(FrameError::Io)?;
    if n == 0 {
        return Err(FrameError::Closed);
    }
    r.read_exact(&mut h[n..]).await.map_err(FrameError::Io)?;
    if h[..4] != MAGIC {
        return Err(FrameError::Malformed("bad magic".into()));
    }
    if h[4] != VERSION {
        return Err(FrameError::Malformed(format!(
            "unsupported version {}",
            h[4]
        )));
    }
    let kind = Kind::from_u8(h[5])
        .ok_or_else(|| FrameError::Malformed(format!("unknown kind {}", h[5])))?;
    if h[6] != 0 || h[7] != 0 {
        return Err(FrameError::Malformed("reserved bytes set".into()));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > max {
        return Err(FrameError::Malformed(format!(
            "{len}-byte payload exceeds the {max}-byte limit"
        )));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await.map_err(FrameError::Io)?;
    Ok((kind, payload))
}

pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: Kind,
    payload: &[u8],
) -> std::io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| std::io::Error::other("frame payload over 4 GiB"))?;
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = kind as u8;
    h[8..12].copy_from_slice(&len.to_le_bytes());
    w.write_all(&h).await?;
    w.write_all(payload).await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_limits() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Fetch, b"label").await.unwrap();
        let (k, p) = read_frame(&mut &buf[..], 64).await.unwrap();
        assert_eq!((k, &p[..]), (Kind::Fetch, &b"label"[..]));
        assert!(matches!(
            read_frame(&mut &buf[..], 4).await,
            Err(FrameError::Malformed(_))
        ));
        assert!(matches!(
            read_frame(&mut &buf[..7], 64).await,
            Err(FrameError::Io(_))
        ));
        assert!(matches!(
            read_frame(&mut &b""[..], 64).await,
            Err(FrameError::Closed)
        ));
        let mut bad = buf.clone();
        bad[5] = 99;
        assert!(matches!(
            read_frame(&mut &bad[..], 64).await,
            Err(FrameError::Malformed(_))
        ));
    }
}
