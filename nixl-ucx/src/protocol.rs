//! What nixl-ucx decides on each control message of its own protocol (HELLO, BYE,
//! CREDIT, PONG, DROPPED), apart from UCX and the driver's state: the driver looks
//! up what a decision needs, asks here, and carries the answer out. Unit-tested
//! without a UCX library.

use crate::wire;

/// What a HELLO from a peer at `address` changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnHello {
    /// The loaded peer, at the address this agent knows it by: it has heard this
    /// agent's hello.
    Heard,
    /// A peer not loaded yet, or loaded at another address: remembered, in case its
    /// metadata comes later with this address.
    Remember,
    /// Not loaded, and the remembered peers are at their bound: ignored.
    Ignore,
}

/// `known`: the address the peer is loaded with, if loaded; `remembered`: how many
/// unloaded peers are remembered, `bound` the most, and whether this name is one.
pub(crate) fn on_hello(
    known: Option<&[u8]>,
    address: &[u8],
    (remembered, bound, is_remembered): (usize, usize, bool),
) -> OnHello {
    if known == Some(address) {
        OnHello::Heard
    } else if remembered < bound || is_remembered {
        OnHello::Remember
    } else {
        OnHello::Ignore
    }
}

/// What a BYE from a peer at `address` changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct OnBye {
    /// Its notification streams end now (what it sent before is delivered first),
    /// it is forgotten as a remembered peer, and its credit grants go.
    pub(crate) end_streams: bool,
    /// This agent's connection to it fails ("the peer shut down").
    pub(crate) fail_peer: bool,
}

/// The loaded peer's state, for [`on_bye`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Loaded<'a> {
    pub(crate) address: &'a [u8],
    /// Its connection already failed.
    pub(crate) failed: bool,
    /// A NIXL agent (NIXL's protocol has no BYE of ours).
    pub(crate) nixl: bool,
}

/// Only a goodbye from the address this agent knows the sender by (loaded, or
/// remembered from its hello: `heard`) ends its streams early; others' streams age
/// out. Only the loaded peer's own address fails this agent's connection to it.
pub(crate) fn on_bye(address: &[u8], loaded: Option<Loaded<'_>>, heard: Option<&[u8]>) -> OnBye {
    let at_known = loaded.is_some_and(|p| p.address == address);
    OnBye {
        end_streams: at_known || heard == Some(address),
        fail_peer: loaded.is_some_and(|p| p.address == address && !p.failed && !p.nixl),
    }
}

/// A credit grant: limits on the running message and KiB counts, modulo 2^32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) messages: u32,
    pub(crate) kib: u32,
}

/// The grant after an answer `(messages, kib)` arrives, from the one held (if any):
/// answers only move forward, each count on its own, since one computed before
/// another may arrive after it (counts wrap at 2^32).
pub(crate) fn merge_grant(held: Option<Grant>, messages: u32, kib: u32) -> Grant {
    let Some(g) = held else {
        return Grant { messages, kib };
    };
    let newer = |new: u32, old: u32| {
        if wire::below(u64::from(new), old) {
            old
        } else {
            new
        }
    };
    Grant {
        messages: newer(messages, g.messages),
        kib: newer(kib, g.kib),
    }
}

/// Whether a PONG numbered `seq` answers a probe round whose PINGs were numbered
/// `first..=last` (a PONG to any PING of the round does).
pub(crate) fn answers_probe(first: u64, last: u64, seq: u64) -> bool {
    (first..=last).contains(&seq)
}

/// Whether a DROPPED report (or a CREDIT answer) on stream `stream` is about this
/// agent's own connection to the reporter: its stream echoes that connection's
/// epoch, so nobody else can make this agent fail its operations or lift its limits.
pub(crate) fn ours(epoch: u64, nixl: bool, stream: u64) -> bool {
    epoch == stream && !nixl
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_from_the_known_address_is_heard_others_are_remembered_up_to_the_bound() {
        let (a, b) = (&b"addr-a"[..], &b"addr-b"[..]);
        assert_eq!(on_hello(Some(a), a, (0, 4, false)), OnHello::Heard);
        // Loaded at another address: as an unknown peer.
        assert_eq!(on_hello(Some(a), b, (0, 4, false)), OnHello::Remember);
        assert_eq!(on_hello(None, b, (3, 4, false)), OnHello::Remember);
        assert_eq!(on_hello(None, b, (4, 4, false)), OnHello::Ignore);
        // One already remembered is updated even at the bound.
        assert_eq!(on_hello(None, b, (4, 4, true)), OnHello::Remember);
    }

    #[test]
    fn only_the_known_address_says_goodbye() {
        let (a, b) = (&b"addr-a"[..], &b"addr-b"[..]);
        let loaded = |address, failed, nixl| {
            Some(Loaded {
                address,
                failed,
                nixl,
            })
        };
        let both = OnBye {
            end_streams: true,
            fail_peer: true,
        };
        assert_eq!(on_bye(a, loaded(a, false, false), None), both);
        // A restarted or moved peer's old address: nothing.
        assert_eq!(on_bye(b, loaded(a, false, false), None), OnBye::default());
        // Remembered from its hello only: its streams end, no connection to fail.
        assert_eq!(
            on_bye(b, None, Some(b)),
            OnBye {
                end_streams: true,
                fail_peer: false
            }
        );
        assert_eq!(on_bye(b, None, Some(a)), OnBye::default());
        // Failed already, or a NIXL agent: streams end, the connection is left.
        for (failed, nixl) in [(true, false), (false, true)] {
            assert_eq!(
                on_bye(a, loaded(a, failed, nixl), None),
                OnBye {
                    end_streams: true,
                    fail_peer: false
                }
            );
        }
    }

    #[test]
    fn grants_only_move_forward_each_count_on_its_own_across_the_wrap() {
        let g = |messages, kib| Grant { messages, kib };
        assert_eq!(merge_grant(None, 5, 7), g(5, 7));
        assert_eq!(merge_grant(Some(g(10, 10)), 12, 8), g(12, 10));
        assert_eq!(merge_grant(Some(g(10, 10)), 9, 11), g(10, 11));
        // Across 2^32: u32::MAX - 1 is behind 3.
        assert_eq!(
            merge_grant(Some(g(3, u32::MAX - 1)), u32::MAX - 1, 3),
            g(3, 3)
        );
        assert_eq!(merge_grant(Some(g(u32::MAX, 0)), 2, 0), g(2, 0));
    }

    #[test]
    fn a_pong_answers_any_ping_of_its_round_and_reports_count_only_on_our_connection() {
        assert!(answers_probe(4, 6, 4) && answers_probe(4, 6, 6));
        assert!(!answers_probe(4, 6, 3) && !answers_probe(4, 6, 7));
        assert!(ours(9, false, 9));
        assert!(!ours(9, false, 8), "another connection's stream");
        assert!(!ours(9, true, 9), "a NIXL agent speaks none of it");
    }
}
