//! The control connection's protocol, apart from its sockets: what each side makes
//! of each frame it reads. The tasks in `lib.rs` read and write the frames and carry
//! the answers out.
//!
//! ```text
//! initiator                            target
//!   [authentication, nixl::control]
//!   Hello(own name)               --->  name proven? established place?
//!                                 <---  HelloAck(own name)
//!                                 <---  Ready (once its engine accepts)
//!   Ping (a third of liveness)    --->
//!                                 <---  Pong (one however many Pings)
//!   Notif(bytes) (after the data) --->  delivered, waiting for room
//!   Verify { id, ranges }         --->
//!                                 <---  Verified { id, digest }
//! ```

use nixl::{Error, ErrorKind, Result};

use crate::wire::Frame;

const CONNECT: &str = "uccl connect";

/// The initiator's reading of the answer to its hello, from `peer` (whom it called)
/// at `at`: `None` is the connection closing first.
///
/// # Errors
/// [`ErrorKind::Mismatch`] for another agent answering (stale metadata: someone else
/// listens there now); [`ErrorKind::RemoteDisconnected`] for a close;
/// [`ErrorKind::Corrupt`] for any other frame.
pub(crate) fn on_hello_ack(peer: &str, at: &str, answer: Option<Frame>) -> Result<()> {
    match answer {
        Some(Frame::HelloAck(name)) if name == peer => Ok(()),
        Some(Frame::HelloAck(name)) => Err(Error::new(
            ErrorKind::Mismatch,
            CONNECT,
            format!("{at} answers as {name:?}, not {peer:?}"),
        )),
        // The peer closed the connection before answering: it is going away.
        None => Err(Error::new(
            ErrorKind::RemoteDisconnected,
            CONNECT,
            format!("{peer:?} closed the control connection ({at}) before answering hello"),
        )),
        Some(other) => Err(Error::new(
            ErrorKind::Corrupt,
            CONNECT,
            format!("{peer:?} answered {other:?} to hello"),
        )),
    }
}

/// What the initiator does with a frame from the target after the handshake.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AtInitiator {
    /// The target's engine accepts connections now.
    Ready,
    /// The answer to the `Verify` numbered `id`.
    Verified { id: u64, digest: Option<u64> },
    /// Nothing to do (a `Pong`: the read itself showed the target alive).
    Nothing,
    /// The link is dead, for this reason.
    Dead(String),
}

/// The initiator's reading of what it read from `peer`'s target: a frame, `None`
/// for a close.
pub(crate) fn at_initiator(peer: &str, read: Option<Frame>) -> AtInitiator {
    match read {
        Some(Frame::Ready) => AtInitiator::Ready,
        Some(Frame::Verified { id, digest }) => AtInitiator::Verified { id, digest },
        Some(_) => AtInitiator::Nothing,
        None => AtInitiator::Dead(format!("{peer:?} closed the control connection")),
    }
}

/// Longest hello frame a target reads (a name and its header): before the hello,
/// nothing larger is buffered for a connection.
pub(crate) const MAX_HELLO: usize = 1024;

/// The name a target reads from the first frame of a connection, if it is a hello.
pub(crate) fn hello_name(first: Option<Frame>) -> Option<String> {
    match first {
        Some(Frame::Hello(name)) => Some(name),
        _ => None,
    }
}

/// What the target does with a frame from an initiator after the handshake.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AtTarget {
    /// Deliver a notification, waiting for room (the connection is not read
    /// meanwhile: back-pressure on this peer alone).
    Deliver(bytes::Bytes),
    /// Owe one `Pong` (however many `Ping`s came before it went out).
    Pong,
    /// Digest these ranges and answer `Verified` (nothing more is read until the
    /// answers owed have room).
    Verify {
        id: u64,
        ranges: Vec<(u64, u64, u64)>,
    },
    /// Close the connection: a frame only a target sends, or a second hello.
    Close,
}

/// The target's reading of a frame from an initiator.
pub(crate) fn at_target(frame: Frame) -> AtTarget {
    match frame {
        Frame::Notif(m) => AtTarget::Deliver(m),
        Frame::Ping => AtTarget::Pong,
        Frame::Verify { id, ranges } => AtTarget::Verify { id, ranges },
        _ => AtTarget::Close,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hello_is_answered_by_the_agent_called() {
        assert!(on_hello_ack("b", "10.0.0.2:7", Some(Frame::HelloAck("b".into()))).is_ok());
        let e = on_hello_ack("b", "10.0.0.2:7", Some(Frame::HelloAck("c".into()))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch);
        assert!(e.to_string().contains("answers as \"c\", not \"b\""), "{e}");
        let e = on_hello_ack("b", "x", None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RemoteDisconnected);
        assert_eq!(
            on_hello_ack("b", "x", Some(Frame::Ready))
                .unwrap_err()
                .kind(),
            ErrorKind::Corrupt
        );
    }

    #[test]
    fn the_initiator_acts_on_ready_and_verified_and_dies_on_a_close() {
        assert_eq!(at_initiator("b", Some(Frame::Ready)), AtInitiator::Ready);
        assert_eq!(
            at_initiator(
                "b",
                Some(Frame::Verified {
                    id: 3,
                    digest: Some(9)
                })
            ),
            AtInitiator::Verified {
                id: 3,
                digest: Some(9)
            }
        );
        assert_eq!(at_initiator("b", Some(Frame::Pong)), AtInitiator::Nothing);
        assert!(matches!(at_initiator("b", None), AtInitiator::Dead(w) if w.contains("closed")));
    }

    #[test]
    fn the_target_takes_only_an_initiators_frames() {
        assert_eq!(hello_name(Some(Frame::Hello("a".into()))), Some("a".into()));
        assert_eq!(hello_name(Some(Frame::Ping)), None);
        assert_eq!(hello_name(None), None);
        let m = bytes::Bytes::from_static(b"kv ready");
        assert_eq!(at_target(Frame::Notif(m.clone())), AtTarget::Deliver(m));
        assert_eq!(at_target(Frame::Ping), AtTarget::Pong);
        assert_eq!(
            at_target(Frame::Verify {
                id: 1,
                ranges: vec![(0, 8, 2)]
            }),
            AtTarget::Verify {
                id: 1,
                ranges: vec![(0, 8, 2)]
            }
        );
        for f in [
            Frame::Hello("again".into()),
            Frame::HelloAck("x".into()),
            Frame::Ready,
            Frame::Pong,
            Frame::Verified {
                id: 1,
                digest: None,
            },
        ] {
            assert_eq!(at_target(f), AtTarget::Close);
        }
    }
}
