//! The steps every backend's control connection takes before its own hello: connect,
//! socket settings, and the shared-secret exchange. What follows (the backend's
//! hello, its framing, the name check with [`Authenticated::check_hello`]) is the
//! backend's.

use std::fmt::Display;
use std::time::Duration;

use tokio::net::{TcpStream, ToSocketAddrs};

use super::{authenticate_client, authenticate_server, tune, Authenticated};
use crate::error::{Error, ErrorKind, Result};
use crate::secret::SharedSecret;

/// Who is at each end of a control connection, and how it is authenticated.
#[derive(Clone, Copy, Debug)]
pub struct Ends<'a> {
    /// The backend's protocol name (see [`super::ClientAuth::start`]).
    pub protocol: &'static str,
    /// The shared secret, where this agent has one.
    pub secret: Option<&'a SharedSecret>,
    /// This agent's name.
    pub me: &'a str,
}

/// Connect to the agent `peer` at `addr`, set the socket's dead-peer bounds to
/// `dead` ([`tune`]) and authenticate, within `timeout` for the exchange: a
/// stream bound to `peer` (it proved the name where there is a secret), ready for
/// the backend's hello.
///
/// # Errors
/// [`ErrorKind::RemoteDisconnected`] when the connection cannot be made or ends
/// (naming `op`, `peer` and `addr`); as [`authenticate_client`].
pub async fn dial(
    op: &'static str,
    ends: Ends<'_>,
    peer: &str,
    addr: impl ToSocketAddrs + Display,
    dead: Duration,
    timeout: Duration,
) -> Result<TcpStream> {
    let who = format!("peer {peer:?} at {addr}");
    let mut s = TcpStream::connect(&addr).await.map_err(|e| {
        Error::new(
            ErrorKind::RemoteDisconnected,
            op,
            format!("{who}: cannot connect"),
        )
        .with_source(e)
    })?;
    tune(&s, dead);
    authenticate_client(
        &mut s,
        ends.protocol,
        ends.secret,
        ends.me,
        peer,
        &who,
        timeout,
    )
    .await?;
    Ok(s)
}

/// The accepting side of [`dial`]: set the socket's dead-peer bounds to `dead` and
/// authenticate the connection from `from`, within `timeout`. The backend refuses
/// [`Authenticated::Missing`] in its own protocol, then reads the hello and checks
/// its name ([`Authenticated::check_hello`]).
///
/// # Errors
/// As [`authenticate_server`].
pub async fn answer(
    s: &mut TcpStream,
    ends: Ends<'_>,
    from: impl Display,
    dead: Duration,
    timeout: Duration,
) -> Result<Authenticated> {
    tune(s, dead);
    let who = format!("control connection from {from}");
    authenticate_server(s, ends.protocol, ends.secret, ends.me, &who, timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn both_ends_authenticate_and_a_wrong_peer_is_refused() {
        let secret = SharedSecret::new("s3cret-s3cret-s3cret").unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = {
            let secret = secret.clone();
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for _ in 0..2 {
                    let (mut s, from) = listener.accept().await.unwrap();
                    let ends = Ends {
                        protocol: "test",
                        secret: Some(&secret),
                        me: "server",
                    };
                    let r = answer(
                        &mut s,
                        ends,
                        from,
                        Duration::from_secs(5),
                        Duration::from_secs(5),
                    );
                    answers.push(
                        r.await
                            .map(|a| matches!(a, Authenticated::As(n) if n == "client")),
                    );
                }
                answers
            })
        };
        let ends = Ends {
            protocol: "test",
            secret: Some(&secret),
            me: "client",
        };
        let t = Duration::from_secs(5);
        assert!(dial("test", ends, "server", addr, t, t).await.is_ok());
        // The server is not "elsewhere": refused, both sides.
        let e = dial("test", ends, "elsewhere", addr, t, t)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
        let answers = server.await.unwrap();
        assert!(matches!(answers[0], Ok(true)), "{answers:?}");
        assert!(answers[1].is_err(), "{answers:?}");

        // Nobody listening: RemoteDisconnected, naming the peer and address.
        drop(answers);
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let e = dial("test", ends, "server", closed, t, t)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RemoteDisconnected);
        assert!(e.to_string().contains(&closed.to_string()), "{e}");
    }
}
