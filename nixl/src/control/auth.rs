//! The challenge-response a control connection starts with (see [`super`]).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{err, Error, ErrorKind, Result};
use crate::secret::SharedSecret;

/// What a connection that authenticates starts with. As a little-endian `u32` frame
/// length it is over a gigabyte, so no backend's first frame is mistaken for it.
pub const AUTH_MAGIC: [u8; 4] = *b"NXAU";
const NONCE: usize = 32;
const MAC: usize = 32;
const CLIENT_CONTEXT: &str = "nixl control v1 client";
const SERVER_CONTEXT: &str = "nixl control v1 server";
const OK: u8 = 0;
const REFUSED: u8 = 1;

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    getrandom::getrandom(&mut n).expect("the OS random source works");
    n
}

fn gone(op: &'static str, peer: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::RemoteDisconnected,
        op,
        format!("{peer}: the connection ended during authentication"),
    )
    .with_source(e)
}

/// The connecting side: with a secret, prove it and check the server's proof, within
/// `timeout`; without one, nothing.
///
/// # Errors
/// [`ErrorKind::NotAllowed`] when the server does not authenticate or its proof or
/// ours fails; [`ErrorKind::TimedOut`]; [`ErrorKind::RemoteDisconnected`].
pub async fn authenticate_client(
    s: &mut TcpStream,
    secret: Option<&SharedSecret>,
    peer: &str,
    timeout: Duration,
) -> Result<()> {
    const OP: &str = "authenticate a control connection";
    let Some(secret) = secret else { return Ok(()) };
    let run = async {
        let io = |e| gone(OP, peer, e);
        let mine = nonce();
        let mut hello = AUTH_MAGIC.to_vec();
        hello.extend_from_slice(&mine);
        s.write_all(&hello).await.map_err(io)?;
        if s.read_u8().await.map_err(io)? != OK {
            return err(
                ErrorKind::NotAllowed,
                OP,
                format!("{peer} does not authenticate, but a shared secret is configured here"),
            );
        }
        let mut theirs = [0u8; NONCE + MAC];
        s.read_exact(&mut theirs).await.map_err(io)?;
        let (their_nonce, their_mac) = theirs.split_at(NONCE);
        if !secret.verify(SERVER_CONTEXT, &[&mine, their_nonce], their_mac) {
            return err(
                ErrorKind::NotAllowed,
                OP,
                format!("{peer} failed to prove it knows the shared secret"),
            );
        }
        let proof = secret.sign(CLIENT_CONTEXT, &[their_nonce, &mine]);
        s.write_all(&proof).await.map_err(io)?;
        match s.read_u8().await.map_err(io)? {
            OK => Ok(()),
            _ => err(
                ErrorKind::NotAllowed,
                OP,
                format!("{peer} refused our shared secret"),
            ),
        }
    };
    tokio::time::timeout(timeout, run)
        .await
        .unwrap_or_else(|_| {
            err(
                ErrorKind::TimedOut,
                OP,
                format!("{peer} did not finish authenticating within {timeout:?}"),
            )
        })
}

/// What [`authenticate_server`] concluded.
#[derive(Debug, PartialEq, Eq)]
pub enum Authenticated {
    /// The peer proved the secret (or none is configured and it did not try): go on
    /// with the backend's hello.
    Yes,
    /// A secret is configured and the peer started with its own hello instead:
    /// refuse it in the backend's protocol (the hello is unread) and close.
    Missing,
}

/// The accepting side, before the backend reads its hello: with a secret, require
/// the peer's proof and give ours; without one, refuse a peer that tries to
/// authenticate. Within `timeout`.
///
/// # Errors
/// [`ErrorKind::NotAllowed`] when the peer's proof fails or it tries to authenticate
/// where no secret is configured (it has been told, and the connection is to be
/// closed); [`ErrorKind::TimedOut`]; [`ErrorKind::RemoteDisconnected`].
pub async fn authenticate_server(
    s: &mut TcpStream,
    secret: Option<&SharedSecret>,
    peer: &str,
    timeout: Duration,
) -> Result<Authenticated> {
    const OP: &str = "authenticate a control connection";
    let run = async {
        let io = |e| gone(OP, peer, e);
        let mut head = [0u8; 4];
        loop {
            let n = s.peek(&mut head).await.map_err(io)?;
            if n == 0 {
                return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            if n >= head.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let tries = head == AUTH_MAGIC;
        let secret = match (secret, tries) {
            (None, false) => return Ok(Authenticated::Yes),
            (Some(_), false) => return Ok(Authenticated::Missing),
            (None, true) => {
                s.write_all(&[REFUSED]).await.map_err(io)?;
                return err(
                    ErrorKind::NotAllowed,
                    OP,
                    format!("{peer} authenticates, but no shared secret is configured here"),
                );
            }
            (Some(secret), true) => secret,
        };
        let mut hello = [0u8; 4 + NONCE];
        s.read_exact(&mut hello).await.map_err(io)?;
        let their_nonce = &hello[4..];
        let mine = nonce();
        let mut reply = vec![OK];
        reply.extend_from_slice(&mine);
        reply.extend_from_slice(&secret.sign(SERVER_CONTEXT, &[their_nonce, &mine]));
        s.write_all(&reply).await.map_err(io)?;
        let mut proof = [0u8; MAC];
        s.read_exact(&mut proof).await.map_err(io)?;
        if !secret.verify(CLIENT_CONTEXT, &[&mine, their_nonce], &proof) {
            s.write_all(&[REFUSED]).await.map_err(io)?;
            return err(
                ErrorKind::NotAllowed,
                OP,
                format!("{peer} failed to prove it knows the shared secret"),
            );
        }
        s.write_all(&[OK]).await.map_err(io)?;
        Ok(Authenticated::Yes)
    };
    tokio::time::timeout(timeout, run)
        .await
        .unwrap_or_else(|_| {
            err(
                ErrorKind::TimedOut,
                OP,
                format!("{peer} did not finish authenticating within {timeout:?}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap());
        let (c, a) = tokio::join!(c, l.accept());
        (c.unwrap(), a.unwrap().0)
    }

    async fn run(
        client: Option<&str>,
        server: Option<&str>,
    ) -> (Result<()>, Result<Authenticated>) {
        let (mut c, mut s) = pair().await;
        let (cs, ss) = (
            client.map(|k| SharedSecret::new(k).unwrap()),
            server.map(|k| SharedSecret::new(k).unwrap()),
        );
        let t = Duration::from_secs(5);
        // The client's stream goes when it is done, as a backend's would on error.
        let client = async move {
            let r = authenticate_client(&mut c, cs.as_ref(), "server", t).await;
            if r.is_ok() {
                // The backend's hello.
                c.write_all(b"\x05\x00\x00\x00hello").await.unwrap();
            }
            r
        };
        let server = async {
            let r = authenticate_server(&mut s, ss.as_ref(), "client", t).await;
            if matches!(r, Ok(Authenticated::Yes)) {
                let mut h = [0u8; 9];
                s.read_exact(&mut h).await.unwrap();
                assert_eq!(&h, b"\x05\x00\x00\x00hello", "the hello follows intact");
            }
            r
        };
        tokio::join!(client, server)
    }

    #[tokio::test]
    async fn the_same_secret_or_none_passes() {
        let (c, s) = run(Some("k"), Some("k")).await;
        assert!(c.is_ok(), "{c:?}");
        assert_eq!(s.unwrap(), Authenticated::Yes);
        let (c, s) = run(None, None).await;
        assert!(c.is_ok(), "{c:?}");
        assert_eq!(s.unwrap(), Authenticated::Yes);
    }

    #[tokio::test]
    async fn a_wrong_or_missing_secret_is_refused_on_both_sides() {
        let (c, s) = run(Some("k"), Some("other")).await;
        assert_eq!(c.unwrap_err().kind(), ErrorKind::NotAllowed);
        // The client found the server's proof wrong and hung up before proving.
        let e = s.unwrap_err().kind();
        assert!(
            matches!(e, ErrorKind::NotAllowed | ErrorKind::RemoteDisconnected),
            "{e:?}"
        );
        // A client without: the server sees its hello start and refuses it.
        let (mut c, mut s) = pair().await;
        c.write_all(b"\x05\x00\x00\x00hello").await.unwrap();
        let secret = SharedSecret::new("k").unwrap();
        let t = Duration::from_secs(5);
        let r = authenticate_server(&mut s, Some(&secret), "client", t).await;
        assert_eq!(r.unwrap(), Authenticated::Missing);
        // A client with a secret, a server without: both refuse.
        let (c, s) = run(Some("k"), None).await;
        assert_eq!(c.unwrap_err().kind(), ErrorKind::NotAllowed);
        assert_eq!(s.unwrap_err().kind(), ErrorKind::NotAllowed);
    }

    #[tokio::test]
    async fn a_silent_peer_times_out() {
        let (_c, mut s) = pair().await;
        let secret = SharedSecret::new("k").unwrap();
        let r =
            authenticate_server(&mut s, Some(&secret), "client", Duration::from_millis(50)).await;
        assert_eq!(r.unwrap_err().kind(), ErrorKind::TimedOut);
    }
}
