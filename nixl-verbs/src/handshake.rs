//! The control connection's handshake, apart from sockets and queue pairs: what the
//! initiator makes of the target's reply, and what the target answers to a hello.
//! The I/O around it (`lib.rs`) reads and writes the frames and makes the queue
//! pairs these decisions allow.
//!
//! ```text
//! initiator                               target
//!   [authentication, nixl::control]
//!   Hello { agent, endpoint, qps }  --->  name proven? established place? budget?
//!                                   <---  Accepted { max_notification, qps }
//!                                         or Refused(why)
//! ```

use nixl::control::Authenticated;
use nixl::{Error, ErrorKind, Result};

use crate::wire::{Hello, QpHalf, Reply};

const CONNECT: &str = "verbs connect";
const ACCEPT: &str = "verbs accept";

/// What an accepted reply gives the initiator: the longest notification both sides'
/// buffers hold, and the target's queue pairs in the hello's order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Accepted {
    pub(crate) max_notification: usize,
    pub(crate) theirs: Vec<QpHalf>,
}

/// The initiator's reading of the target's `reply` to a hello that offered `offered`
/// queue pairs, with its own notification bound `own_max`.
///
/// # Errors
/// [`ErrorKind::Corrupt`] for an answer with another number of queue pairs;
/// [`ErrorKind::Backend`] with the target's reason for a refusal.
pub(crate) fn on_reply(
    peer: &str,
    reply: Reply,
    offered: usize,
    own_max: usize,
) -> Result<Accepted> {
    match reply {
        Reply::Accepted {
            max_notification,
            qps,
        } if qps.len() == offered => Ok(Accepted {
            // Our send buffers hold our own limit; the peer's receive buffers its.
            max_notification: (max_notification as usize).min(own_max),
            theirs: qps,
        }),
        Reply::Accepted { qps, .. } => Err(Error::new(
            ErrorKind::Corrupt,
            CONNECT,
            format!(
                "peer {peer:?} answered with {} queue pairs for {offered}",
                qps.len()
            ),
        )),
        Reply::Refused(why) => Err(Error::new(
            ErrorKind::Backend,
            CONNECT,
            format!("peer {peer:?} could not accept the connection: {why}"),
        )),
    }
}

/// Why the target refuses a connection before it makes anything for it; the reason
/// goes to the initiator in [`Reply::Refused`].
#[derive(Debug)]
pub(crate) enum Refusal {
    /// This agent has a secret and the connection did not prove it.
    NoSecret,
    /// The hello names another agent than the one the connection proved.
    NotTheProvenName(Error),
    /// The established connections are at their bound.
    TooManyPeers,
    /// The source's share of queue pairs, or the peers' share of the completion
    /// queue, is used up.
    Budget(String),
}

impl Refusal {
    /// The reason, as the initiator reads it.
    pub(crate) fn why(&self) -> String {
        match self {
            Self::NoSecret => "this agent requires its shared secret (AgentBuilder::secret); the connection did not prove it".into(),
            Self::NotTheProvenName(e) => e.to_string(),
            Self::TooManyPeers => {
                "too many peers connected (VerbsOptions::listener.max_incoming_connections)".into()
            }
            Self::Budget(why) => why.clone(),
        }
    }

    /// The error the target's connection task ends with, naming the connection
    /// (`peer`) and the hello's name where one was read.
    pub(crate) fn into_error(self, peer: &str, hello: Option<&str>) -> Error {
        match (self, hello) {
            (Self::NotTheProvenName(e), _) => e,
            (r @ Self::Budget(_), Some(name)) => Error::new(
                ErrorKind::NotAllowed,
                ACCEPT,
                format!("{peer} (hello as {name:?}): {}", r.why()),
            ),
            (r, _) => Error::new(
                ErrorKind::NotAllowed,
                ACCEPT,
                format!("{peer}: {}", r.why()),
            ),
        }
    }
}

/// Before the hello: a connection that did not prove this agent's secret gets
/// nothing.
pub(crate) fn on_authenticated(auth: &Authenticated) -> std::result::Result<(), Refusal> {
    match auth {
        Authenticated::Missing => Err(Refusal::NoSecret),
        _ => Ok(()),
    }
}

/// A decoded hello must name the agent the connection proved (`peer` names the
/// connection in errors); a frame that is not a hello ends the connection before
/// this ([`Hello::decode`]).
///
/// # Errors
/// [`Refusal::NotTheProvenName`] for a hello of another name.
pub(crate) fn on_hello(
    hello: &Hello,
    auth: &Authenticated,
    peer: &str,
) -> std::result::Result<(), Refusal> {
    auth.check_hello(&hello.agent, ACCEPT, peer)
        .map_err(Refusal::NotTheProvenName)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{LinkLayer, Mtu};
    use crate::wire::Endpoint;

    fn half(n: u32) -> QpHalf {
        QpHalf { qp_num: n, psn: n }
    }

    #[test]
    fn an_accepted_reply_gives_the_smaller_bound_and_the_targets_queue_pairs() {
        let r = Reply::Accepted {
            max_notification: 8192,
            qps: vec![half(1), half(2)],
        };
        assert_eq!(
            on_reply("t", r, 2, 4096).unwrap(),
            Accepted {
                max_notification: 4096,
                theirs: vec![half(1), half(2)]
            }
        );
        let r = Reply::Accepted {
            max_notification: 1024,
            qps: vec![half(3)],
        };
        assert_eq!(on_reply("t", r, 1, 4096).unwrap().max_notification, 1024);
    }

    #[test]
    fn a_reply_with_other_queue_pairs_is_corrupt_and_a_refusal_carries_its_reason() {
        let r = Reply::Accepted {
            max_notification: 4096,
            qps: vec![half(1)],
        };
        let e = on_reply("t", r, 2, 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.to_string().contains("1 queue pairs for 2"), "{e}");
        let e = on_reply("t", Reply::Refused("budget".into()), 1, 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert!(
            e.to_string()
                .contains("could not accept the connection: budget"),
            "{e}"
        );
    }

    #[test]
    fn the_target_refuses_a_missing_secret_and_a_hello_for_another_name() {
        assert!(matches!(
            on_authenticated(&Authenticated::Missing),
            Err(Refusal::NoSecret)
        ));
        assert!(on_authenticated(&Authenticated::Open).is_ok());
        let hello = Hello {
            agent: "alice".into(),
            endpoint: Endpoint {
                link_layer: LinkLayer::Ethernet,
                port: 1,
                mtu: Mtu(5),
                lid: 0,
                gid_index: 3,
                gid: [7; 16],
                max_msg_sz: 1 << 30,
                max_rd_atomic: 16,
            },
            qps: vec![half(7)],
        };
        assert!(on_hello(&hello, &Authenticated::As("alice".into()), "conn").is_ok());
        assert!(on_hello(&hello, &Authenticated::Open, "conn").is_ok());
        match on_hello(&hello, &Authenticated::As("bob".into()), "conn") {
            Err(r @ Refusal::NotTheProvenName(_)) => {
                assert_eq!(r.into_error("conn", None).kind(), ErrorKind::NotAllowed)
            }
            other => panic!("{other:?}"),
        }
        // A frame that is not a hello never gets this far.
        assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        assert!(Hello::decode(b"junk").is_err());
    }

    #[test]
    fn refusals_name_the_connection_and_the_option_to_raise() {
        let e = Refusal::TooManyPeers.into_error("control connection from 10.0.0.1:5", None);
        assert_eq!(e.kind(), ErrorKind::NotAllowed);
        assert!(e.to_string().contains("max_incoming_connections"), "{e}");
        let e = Refusal::Budget("source over its share".into()).into_error("c", Some("bob"));
        assert!(
            e.to_string()
                .contains("(hello as \"bob\"): source over its share"),
            "{e}"
        );
        assert!(Refusal::NoSecret.why().contains("shared secret"));
    }
}
