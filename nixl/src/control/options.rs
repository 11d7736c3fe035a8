//! The options of a backend's control listener and of its connections to peers: one
//! struct with one set of names and defaults, which nixl-tcp, nixl-verbs and
//! nixl-uccl embed as their `listener` field, and one parser of them from
//! `KEY=VALUE` parameters (the bench's `--backend-param`, NIXL's backend
//! parameters).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use super::Admission;
use crate::error::{Error, ErrorKind, Result};

/// How a backend listens for peers and connects to them.
#[derive(Clone, Debug)]
pub struct ListenerOptions {
    /// Address to listen on. `None` (the default): the backend's own choice,
    /// loopback on any port (`127.0.0.1:0`) for nixl-tcp and nixl-verbs, the
    /// address UCCL's engine announces (any port) for nixl-uccl. Use an address
    /// peers on other hosts reach.
    pub listen: Option<SocketAddr>,
    /// Address to publish in metadata when peers must use another one than the bound
    /// address (NAT, `0.0.0.0` listeners). Default: the bound address.
    pub advertise: Option<SocketAddr>,
    /// Bound on connecting to a peer, its handshake included (default 10 s).
    pub connect_timeout: Duration,
    /// An incoming connection that has not finished its handshake (shared secret,
    /// hello) within this long is closed (default 10 s).
    pub handshake_timeout: Duration,
    /// Bound on noticing a peer that went silent (host crash, cut link): TCP
    /// keepalive and `TCP_USER_TIMEOUT` are set from it on every connection, and a
    /// backend that pings its peers (nixl-uccl) declares one dead after this long
    /// without an answer. A peer process that dies is noticed at once (its kernel
    /// closes the connection). Default 10 s.
    pub dead_peer_timeout: Duration,
    /// Most incoming connections in their handshake at once (default 256). When
    /// another arrives, the oldest of them is closed to admit it, so idle or slow
    /// sockets never lock a legitimate peer out.
    pub max_incoming_handshakes: usize,
    /// Most incoming connections past their handshake at once (default 4096), half
    /// of them from one address (an IPv6 /64). Connections, not peers: nixl-tcp
    /// opens up to its `connections` option per peer, the others one. What happens
    /// to one more is the backend's (see [`Admission`]); a connection at work, or one
    /// that proved the shared secret, never gives its place. Both bounds are clamped
    /// to a quarter and an eighth of the process's open-files limit.
    pub max_incoming_connections: usize,
    /// When set, both ends of every connection prove they know this secret and their
    /// agent names (the challenge-response of [`super`]) before anything else is
    /// read, instead of the agent's ([`AgentBuilder::secret`]): a peer without it
    /// gets nothing made for it, and a peer's hello must name the agent it proved.
    /// The same secret on every agent of a deployment. `None` (the default): the
    /// agent's, if it has one.
    ///
    /// [`AgentBuilder::secret`]: crate::AgentBuilder::secret
    pub secret: Option<crate::secret::SharedSecret>,
}

impl Default for ListenerOptions {
    fn default() -> Self {
        Self {
            listen: None,
            advertise: None,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            dead_peer_timeout: Duration::from_secs(10),
            max_incoming_handshakes: 256,
            max_incoming_connections: 4096,
            secret: None,
        }
    }
}

/// A listener bound by [`ListenerOptions::bind`].
#[derive(Debug)]
pub struct BoundListener {
    /// The socket, listening.
    pub listener: TcpListener,
    /// The address it is bound to.
    pub bound: SocketAddr,
    /// The address to publish: [`ListenerOptions::advertise`], else `bound`.
    pub advertised: SocketAddr,
}

impl ListenerOptions {
    /// The parameter keys [`ListenerOptions::set`] takes.
    pub const KEYS: &'static [&'static str] = &[
        "listen",
        "advertise",
        "connect_timeout",
        "handshake_timeout",
        "dead_peer_timeout",
        "max_incoming_handshakes",
        "max_incoming_connections",
    ];

    /// Set the option named `key` from its text: addresses as `IP:PORT`, durations
    /// as [`parse_duration`] reads them, counts as positive integers. `None` when
    /// `key` is not one of [`ListenerOptions::KEYS`] (the backend's own key, or an
    /// unknown one); `Some(Err)` says what the value should have been.
    pub fn set(&mut self, key: &str, value: &str) -> Option<std::result::Result<(), String>> {
        let addr = |v: &str| {
            v.trim()
                .parse::<SocketAddr>()
                .map_err(|_| format!("{key}={value:?}: expected an IP:PORT address"))
        };
        let duration = |v: &str| parse_duration(v).map_err(|e| format!("{key}: {e}"));
        let count = |v: &str| match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{key}={value:?}: expected a count of at least 1")),
        };
        let set = |o: &mut Self| -> std::result::Result<(), String> {
            match key {
                "listen" => o.listen = Some(addr(value)?),
                "advertise" => o.advertise = Some(addr(value)?),
                "connect_timeout" => o.connect_timeout = duration(value)?,
                "handshake_timeout" => o.handshake_timeout = duration(value)?,
                "dead_peer_timeout" => o.dead_peer_timeout = duration(value)?,
                "max_incoming_handshakes" => o.max_incoming_handshakes = count(value)?,
                "max_incoming_connections" => o.max_incoming_connections = count(value)?,
                _ => unreachable!("a key of KEYS without a setter"),
            }
            Ok(())
        };
        Self::KEYS.contains(&key).then(|| set(self))
    }

    /// Refuse options no listener or connection can work with: a bound under
    /// [`MIN_DURATION`] (zero disables the kernel's `TCP_USER_TIMEOUT` rather than
    /// tightening it, and fails every handshake or connect at once), a limit of zero
    /// (every peer refused), or an advertised address peers cannot reach (an
    /// unspecified IP such as `0.0.0.0`, or port 0).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the option.
    pub fn check(&self, op: &'static str) -> Result<()> {
        let bad = |what: String| Err(Error::new(ErrorKind::InvalidArgument, op, what));
        for (name, d) in [
            ("connect_timeout", self.connect_timeout),
            ("handshake_timeout", self.handshake_timeout),
            ("dead_peer_timeout", self.dead_peer_timeout),
        ] {
            if d < MIN_DURATION {
                return bad(format!("listener {name} {d:?} is under {MIN_DURATION:?}"));
            }
        }
        for (name, n) in [
            ("max_incoming_handshakes", self.max_incoming_handshakes),
            ("max_incoming_connections", self.max_incoming_connections),
        ] {
            if n == 0 {
                return bad(format!("listener {name} is 0: every peer would be refused"));
            }
        }
        match self.advertise {
            Some(a) if a.ip().is_unspecified() || a.port() == 0 => bad(format!(
                "listener advertise {a} is not an address peers can reach (a specific IP and port)"
            )),
            _ => Ok(()),
        }
    }

    /// Bind the listener: at [`ListenerOptions::listen`], else at `default`, after
    /// [`ListenerOptions::check`]. A listener on an unspecified address (`0.0.0.0`)
    /// with no [`ListenerOptions::advertise`] publishes that address, which only
    /// peers on this host reach: that is logged as a warning.
    ///
    /// # Errors
    /// As [`ListenerOptions::check`]; [`ErrorKind::Backend`] naming the address that
    /// could not be bound.
    pub async fn bind(&self, default: SocketAddr, op: &'static str) -> Result<BoundListener> {
        self.check(op)?;
        let at = self.listen.unwrap_or(default);
        let listener = TcpListener::bind(at).await.map_err(|e| {
            Error::new(ErrorKind::Backend, op, format!("cannot listen on {at}")).with_source(e)
        })?;
        let bound = listener.local_addr().map_err(|e| {
            Error::new(ErrorKind::Backend, op, "listener has no address").with_source(e)
        })?;
        let advertised = self.advertise.unwrap_or(bound);
        if advertised.ip().is_unspecified() {
            tracing::warn!(%bound, "{op}: listening on an unspecified address with no advertise address; peers on other hosts cannot reach {advertised} (set the listener's advertise)");
        }
        Ok(BoundListener {
            listener,
            bound,
            advertised,
        })
    }

    /// The admission policy of these limits, clamped to the open-files limit.
    pub fn admission(&self) -> Arc<Admission> {
        Admission::new(self.max_incoming_handshakes, self.max_incoming_connections)
    }
}

/// The loopback address on any port: nixl-tcp's and nixl-verbs' listener default.
pub const LOOPBACK_ANY_PORT: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

/// The shortest bound a listener option takes (a millisecond: the kernel's
/// `TCP_USER_TIMEOUT` counts in them).
pub const MIN_DURATION: Duration = Duration::from_millis(1);

/// A duration of at least [`MIN_DURATION`] written as a number and a unit: `500ms`,
/// `5s`, `1.5m`, `1h` (a bare number is seconds).
///
/// # Errors
/// What is wrong with `s`.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{s:?} is not a positive duration"));
    }
    let (num, unit) = match t.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => t.split_at(i),
        None => (t, "s"),
    };
    let scale = match unit.trim() {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("{s:?}: unknown unit {other:?}; use ms, s, m or h")),
    };
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v * scale < 1e9 => {
            let d = Duration::from_secs_f64(v * scale);
            if d < MIN_DURATION {
                return Err(format!("{s:?} is under {MIN_DURATION:?}"));
            }
            Ok(d)
        }
        _ => Err(format!("{s:?} is not a positive duration")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_takes_every_key_and_refuses_bad_values() {
        let mut o = ListenerOptions::default();
        for (k, v) in [
            ("listen", "10.0.0.1:7000"),
            ("advertise", "[::1]:7001"),
            ("connect_timeout", "2s"),
            ("handshake_timeout", "500ms"),
            ("dead_peer_timeout", "1.5m"),
            ("max_incoming_handshakes", "8"),
            ("max_incoming_connections", "16"),
        ] {
            assert_eq!(o.set(k, v), Some(Ok(())), "{k}={v}");
        }
        assert_eq!(o.listen, Some("10.0.0.1:7000".parse().unwrap()));
        assert_eq!(o.advertise, Some("[::1]:7001".parse().unwrap()));
        assert_eq!(o.connect_timeout, Duration::from_secs(2));
        assert_eq!(o.handshake_timeout, Duration::from_millis(500));
        assert_eq!(o.dead_peer_timeout, Duration::from_secs(90));
        assert_eq!(
            (o.max_incoming_handshakes, o.max_incoming_connections),
            (8, 16)
        );
        assert_eq!(ListenerOptions::KEYS.len(), 7);

        assert_eq!(o.set("window", "4"), None);
        let refused = |k: &str, v: &str| ListenerOptions::default().set(k, v).unwrap().unwrap_err();
        assert!(refused("listen", "nowhere").contains("IP:PORT"));
        assert!(refused("connect_timeout", "5 parsecs").contains("unknown unit"));
        assert!(refused("dead_peer_timeout", "0s").contains("not a positive"));
        assert!(refused("max_incoming_handshakes", "0").contains("at least 1"));
        // Rounded to zero, or under the kernel's millisecond: refused, not disabled.
        assert!(refused("dead_peer_timeout", "0.0000000001").contains("under 1ms"));
        assert!(refused("dead_peer_timeout", "0.5ms").contains("under 1ms"));
        assert!(refused("connect_timeout", "-5s").contains("not a positive"));
        assert_eq!(parse_duration("1ms"), Ok(MIN_DURATION));
    }

    #[tokio::test]
    async fn bind_uses_the_default_unless_told_and_advertises() {
        let b = ListenerOptions::default()
            .bind(LOOPBACK_ANY_PORT, "test")
            .await
            .unwrap();
        assert!(b.bound.ip().is_loopback() && b.bound.port() != 0);
        assert_eq!(b.advertised, b.bound);

        let there: SocketAddr = "192.0.2.1:9".parse().unwrap();
        let o = ListenerOptions {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            advertise: Some(there),
            ..ListenerOptions::default()
        };
        let b = o.bind("0.0.0.0:1".parse().unwrap(), "test").await.unwrap();
        assert_eq!(
            (b.bound.ip(), b.advertised),
            ("127.0.0.1".parse().unwrap(), there)
        );

        let taken = ListenerOptions {
            listen: Some(b.bound),
            ..ListenerOptions::default()
        };
        let e = taken.bind(LOOPBACK_ANY_PORT, "test").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert!(e.to_string().contains(&b.bound.to_string()), "{e}");
    }

    #[tokio::test]
    async fn options_no_listener_can_work_with_are_refused_before_binding() {
        let d = ListenerOptions::default;
        for (o, says) in [
            (
                ListenerOptions {
                    dead_peer_timeout: Duration::from_micros(500),
                    ..d()
                },
                "dead_peer_timeout",
            ),
            (
                ListenerOptions {
                    handshake_timeout: Duration::ZERO,
                    ..d()
                },
                "handshake_timeout",
            ),
            (
                ListenerOptions {
                    connect_timeout: Duration::ZERO,
                    ..d()
                },
                "connect_timeout",
            ),
            (
                ListenerOptions {
                    max_incoming_connections: 0,
                    ..d()
                },
                "max_incoming_connections",
            ),
            (
                ListenerOptions {
                    max_incoming_handshakes: 0,
                    ..d()
                },
                "max_incoming_handshakes",
            ),
            (
                ListenerOptions {
                    advertise: Some("0.0.0.0:7000".parse().unwrap()),
                    ..d()
                },
                "0.0.0.0:7000",
            ),
            (
                ListenerOptions {
                    advertise: Some("10.0.0.1:0".parse().unwrap()),
                    ..d()
                },
                "10.0.0.1:0",
            ),
        ] {
            let e = o.bind(LOOPBACK_ANY_PORT, "test").await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            assert!(e.to_string().contains(says), "{says}: {e}");
        }
        assert!(d().check("test").is_ok());
    }
}
