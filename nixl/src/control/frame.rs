//! Length-prefixed control frames: a little-endian `u32` length, then that many
//! bytes. The reader bounds the length before allocating.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Write one frame holding `body`.
///
/// # Errors
/// The write failed, or `body` is longer than a `u32` counts.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "control frame too long")
    })?;
    let mut f = Vec::with_capacity(4 + body.len());
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(body);
    w.write_all(&f).await
}

/// Read one frame's body, refusing empty frames and frames over `max` bytes before
/// reading them; `Ok(None)` at a clean end of stream (between frames).
///
/// # Errors
/// [`std::io::ErrorKind::InvalidData`] for a length out of bounds;
/// [`std::io::ErrorKind::UnexpectedEof`] for a stream that ends inside a frame.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    if r.read(&mut len[..1]).await? == 0 {
        return Ok(None);
    }
    r.read_exact(&mut len[1..]).await?;
    let n = u32::from_le_bytes(len) as usize;
    if n == 0 || n > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("control frame of {n} bytes"),
        ));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_bounds_hold() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello").await.unwrap();
        write_frame(&mut buf, &[7u8; 300]).await.unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_frame(&mut r, 300).await.unwrap().unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 300).await.unwrap().unwrap(), [7u8; 300]);
        assert!(
            read_frame(&mut r, 300).await.unwrap().is_none(),
            "clean end"
        );
        // Over the bound, empty, or cut inside a frame.
        let mut r = buf.as_slice();
        read_frame(&mut r, 300).await.unwrap();
        let e = read_frame(&mut r, 299).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        let e = read_frame(&mut &[0u8, 0, 0, 0][..], 10).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        for cut in [2, 4, 7] {
            let e = read_frame(&mut &buf[..cut], 300).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
    }
}
