//! The authentication exchange (see [`super`]) over a `TcpStream`, before a
//! backend's own hello, for backends whose connections are async streams.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::handshake::{nonce, ClientAuth, Refusal, ServerAuth, AUTH_MAGIC};
use crate::error::{err, Error, ErrorKind, Result};
use crate::secret::SharedSecret;

const OP: &str = "authenticate a control connection";

fn gone(peer: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::RemoteDisconnected,
        OP,
        format!("{peer}: the connection ended during authentication"),
    )
    .with_source(e)
}

fn refused(peer: &str, r: Refusal) -> Error {
    Error::new(ErrorKind::NotAllowed, OP, format!("{peer}: {}", r.why))
}

fn timed_out<T>(peer: &str, timeout: Duration) -> Result<T> {
    err(
        ErrorKind::TimedOut,
        OP,
        format!("{peer} did not finish authenticating within {timeout:?}"),
    )
}

/// The connecting side of `protocol` (see [`ClientAuth::start`]), as agent `me` to
/// the agent named `peer`: with a secret, prove it and this agent's name and check
/// the server's proof of both, within `timeout`; without one, nothing. `who`
/// describes the peer in errors.
///
/// # Errors
/// [`ErrorKind::NotAllowed`] when the server does not authenticate, is not `peer`,
/// or either proof fails; [`ErrorKind::TimedOut`]; [`ErrorKind::RemoteDisconnected`].
pub async fn authenticate_client(
    s: &mut TcpStream,
    protocol: &'static str,
    secret: Option<&SharedSecret>,
    me: &str,
    peer: &str,
    who: &str,
    timeout: Duration,
) -> Result<()> {
    let Some(secret) = secret else { return Ok(()) };
    let run = async {
        let (mut m, first) = ClientAuth::start(protocol, secret.clone(), me, peer, nonce())
            .map_err(|r| refused(who, r))?;
        s.write_all(&first).await.map_err(|e| gone(who, e))?;
        let mut buf = Vec::new();
        while !m.is_done() {
            buf.resize(m.need(), 0);
            s.read_exact(&mut buf).await.map_err(|e| gone(who, e))?;
            let out = m.received(&buf).map_err(|r| refused(who, r))?;
            s.write_all(&out).await.map_err(|e| gone(who, e))?;
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(r) => r,
        Err(_) => timed_out(who, timeout),
    }
}

/// What [`authenticate_server`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authenticated {
    /// The peer proved the secret and that it is the agent of this name: its hello
    /// must name it ([`Authenticated::check_hello`]).
    As(String),
    /// No secret is configured here and the peer did not try: nothing is proven.
    Open,
    /// A secret is configured and the peer started with its own hello instead:
    /// refuse it in the backend's protocol (the hello is unread) and close.
    Missing,
}

impl Authenticated {
    /// Check the name a peer's hello gives against the one it proved.
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] when the peer proved another name, or did not
    /// authenticate where a secret is required.
    pub fn check_hello(&self, hello: &str, op: &'static str, who: &str) -> Result<()> {
        match self {
            Self::Open => Ok(()),
            Self::As(name) if name == hello => Ok(()),
            Self::As(name) => err(
                ErrorKind::NotAllowed,
                op,
                format!("{who} authenticated as agent {name:?} but says hello as {hello:?}"),
            ),
            Self::Missing => err(
                ErrorKind::NotAllowed,
                op,
                format!("{who} did not prove the shared secret"),
            ),
        }
    }
}

/// The accepting side of `protocol`, agent `me`, before the backend reads its
/// hello: with a secret, prove it and this agent's name and require the peer's
/// proof; without one, refuse a peer that tries to authenticate. Within `timeout`;
/// `who` describes the peer in errors.
///
/// # Errors
/// [`ErrorKind::NotAllowed`] when the peer's proof fails or it tries to authenticate
/// where no secret is configured (it has been told, and the connection is to be
/// closed); [`ErrorKind::TimedOut`]; [`ErrorKind::RemoteDisconnected`].
pub async fn authenticate_server(
    s: &mut TcpStream,
    protocol: &'static str,
    secret: Option<&SharedSecret>,
    me: &str,
    who: &str,
    timeout: Duration,
) -> Result<Authenticated> {
    let run = async {
        let io = |e| gone(who, e);
        // Peeked, not read: without authentication the bytes are the backend's
        // hello. A peer that sent fewer than four is polled again, ever less often.
        let mut head = [0u8; 4];
        let mut nap = Duration::from_millis(1);
        loop {
            let n = s.peek(&mut head).await.map_err(io)?;
            if n == 0 {
                return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            if n >= head.len() {
                break;
            }
            tokio::time::sleep(nap).await;
            nap = (nap * 2).min(Duration::from_millis(100));
        }
        let tries = head == AUTH_MAGIC;
        let secret = match (secret, tries) {
            (None, false) => return Ok(Authenticated::Open),
            (Some(_), false) => return Ok(Authenticated::Missing),
            (None, true) => {
                let r = Refusal::no_secret_here();
                s.write_all(r.reply.as_deref().unwrap_or_default())
                    .await
                    .map_err(io)?;
                return Err(refused(who, r));
            }
            (Some(secret), true) => secret,
        };
        s.read_exact(&mut head).await.map_err(io)?;
        let mut m = ServerAuth::new(protocol, secret.clone(), me, nonce());
        let mut buf = Vec::new();
        while m.need() > 0 {
            buf.resize(m.need(), 0);
            s.read_exact(&mut buf).await.map_err(io)?;
            match m.received(&buf) {
                Ok(out) => s.write_all(&out).await.map_err(io)?,
                Err(r) => {
                    if let Some(reply) = &r.reply {
                        let _ = s.write_all(reply).await;
                    }
                    return Err(refused(who, r));
                }
            }
        }
        let proven = m.proven().expect("a finished exchange proved a name");
        Ok(Authenticated::As(proven.to_owned()))
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(r) => r,
        Err(_) => timed_out(who, timeout),
    }
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
            let r =
                authenticate_client(&mut c, "test", cs.as_ref(), "cli", "srv", "server", t).await;
            if r.is_ok() {
                // The backend's hello.
                c.write_all(b"\x05\x00\x00\x00hello").await.unwrap();
            }
            r
        };
        let server = async {
            let r = authenticate_server(&mut s, "test", ss.as_ref(), "srv", "client", t).await;
            if matches!(r, Ok(Authenticated::As(_) | Authenticated::Open)) {
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
        let s = s.unwrap();
        assert_eq!(s, Authenticated::As("cli".into()));
        assert!(s.check_hello("cli", "t", "client").is_ok());
        let e = s.check_hello("someone-else", "t", "client").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed);
        let (c, s) = run(None, None).await;
        assert!(c.is_ok(), "{c:?}");
        assert_eq!(s.unwrap(), Authenticated::Open);
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
        let r = authenticate_server(&mut s, "test", Some(&secret), "srv", "client", t).await;
        assert_eq!(r.unwrap(), Authenticated::Missing);
        // A client with a secret, a server without: both refuse.
        let (c, s) = run(Some("k"), None).await;
        assert_eq!(c.unwrap_err().kind(), ErrorKind::NotAllowed);
        assert_eq!(s.unwrap_err().kind(), ErrorKind::NotAllowed);
    }

    #[tokio::test]
    async fn a_client_expecting_another_agent_refuses_the_server() {
        let (mut c, mut s) = pair().await;
        let k = SharedSecret::new("k").unwrap();
        let t = Duration::from_secs(5);
        let k2 = k.clone();
        // The client hangs up on failing, as a backend's would.
        let client = async move {
            authenticate_client(&mut c, "test", Some(&k2), "cli", "decode-1", "server", t).await
        };
        let (c, s) = tokio::join!(
            client,
            authenticate_server(&mut s, "test", Some(&k), "decode-2", "client", t),
        );
        assert_eq!(c.unwrap_err().kind(), ErrorKind::NotAllowed);
        assert_eq!(s.unwrap_err().kind(), ErrorKind::RemoteDisconnected);
    }

    #[tokio::test]
    async fn a_silent_peer_times_out() {
        let (_c, mut s) = pair().await;
        let secret = SharedSecret::new("k").unwrap();
        let r = authenticate_server(
            &mut s,
            "test",
            Some(&secret),
            "srv",
            "client",
            Duration::from_millis(50),
        )
        .await;
        assert_eq!(r.unwrap_err().kind(), ErrorKind::TimedOut);
    }
}
