//! What this backend puts in active-message headers and registration blobs.
//!
//! Active message header, version 1 (little-endian):
//! `magic u16 | version u8 (1) | kind u8 | stream u64 | seq u64 | name_len u16 | name`.
//! `stream` names one sender endpoint (it changes when the sender reconnects) and `seq`
//! counts notifications on it, so the receiver delivers them in posting order whatever
//! the transport does. `name` is the sender's agent name. The data of HELLO and BYE is
//! the sender's worker address. PING (a liveness probe, see the driver) has no data and
//! goes with a UCX reply endpoint; the receiver answers on it with a PONG carrying the
//! same `stream` and `seq` (and an empty name). DROPPED tells a sender that the
//! receiver dropped notifications it sent (the receiving agent's queue had no room,
//! see [`nixl::NotificationLimits`]): sent on the receiver's own connection to the
//! sender, only to a sender it knows (whose metadata it loaded), with `stream` the
//! dropped notifications' stream (the sender's endpoint, so only that sender takes it)
//! and `seq` how many were dropped; no data. A receiver that predates it drops it as
//! malformed.
//!
//! Version 2, used only by agents with a shared secret ([`nixl::SharedSecret`]): the
//! version 1 header (with version 2), then a 32-byte MAC, nothing after it:
//! `magic u16 | version u8 (2) | kind u8 | stream u64 | seq u64 | name_len u16 | name |
//! mac [32]`, where `mac` is `secret.sign("nixl-ucx v2 message", [receiver, kind,
//! stream, seq, name, data])` (each part length-prefixed by
//! [`nixl::SharedSecret::sign`]; `receiver` is the receiving agent's name, `kind` one
//! byte, `stream` and `seq` little-endian, `data` the message's whole payload). The
//! receiver's name makes a message made for one agent useless at another; the sender's
//! name in it is what the notification is delivered under. A PONG of version 2 names
//! its sender (the agent answering) and is MAC'd for the PING's sender. Version 1 bytes
//! are unchanged, so agents without a secret speak as before.
//!
//! Registration blob: `version u8 | base u64 | len u64 | packed remote key`. NIXL's
//! blob for the same registration is the packed remote key alone.
//!
//! To NIXL agents (peers loaded from NIXL metadata) the backend sends none of the
//! messages above: only NIXL's notifications ([`NIXL_NOTIF_AM_ID`]), and those only
//! without a secret (NIXL's protocol has no authentication).

use bytes::Bytes;
use nixl::SharedSecret;

/// UCX active-message id for this backend's messages.
pub(crate) const AM_ID: u32 = 0x4e58;
/// UCX active-message id of NIXL's notifications (its UCX backend's `NOTIF_STR`):
/// empty header, eager, the payload NIXL's serdes of the sender's name and the
/// message ([`nixl::interop::encode_notification`]).
pub(crate) const NIXL_NOTIF_AM_ID: u32 = 0;
const MAGIC: u16 = 0x4e58;
const VERSION: u8 = 1;
/// The header version that carries a MAC.
const VERSION_MAC: u8 = 2;
/// Bytes of a version 2 header's MAC (HMAC-SHA256).
pub(crate) const MAC_LEN: usize = 32;
/// What [`SharedSecret::sign`] separates this use from others with.
const MAC_CONTEXT: &str = "nixl-ucx v2 message";
const HEADER_FIXED: usize = 2 + 1 + 1 + 8 + 8 + 2;
const BLOB_VERSION: u8 = 1;
const BLOB_FIXED: usize = 1 + 8 + 8;

/// Kinds of active message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A notification; data is the message.
    Notif = 1,
    /// First message on a new endpoint; data is the sender's worker address.
    Hello = 2,
    /// The sender is shutting down; data is its worker address.
    Bye = 3,
    /// A liveness probe: answer with [`Kind::Pong`] (same stream and seq) on the UCX
    /// reply endpoint; no data.
    Ping = 4,
    /// The answer to a [`Kind::Ping`]; no data.
    Pong = 5,
    /// Notifications of the sender's `stream` were dropped (`seq` of them); no data.
    Dropped = 6,
    /// The answer to a [`Kind::CreditAsk`], on the UCX reply endpoint: how far the
    /// asker's `stream` may send. `seq` is `(KiB limit << 32) | message limit`, each
    /// a count since the stream began, modulo 2^32; no data.
    Credit = 7,
    /// A sender's request for its [`Kind::Credit`] on `stream` (sent with a reply
    /// endpoint, as PING); no data.
    CreditAsk = 8,
}

/// A [`Kind::Credit`]'s `seq`: message and KiB limits, each modulo 2^32.
pub(crate) fn credit_seq(messages: u64, kib: u64) -> u64 {
    (kib & 0xffff_ffff) << 32 | (messages & 0xffff_ffff)
}

/// Whether `count` (a running count, modulo 2^32) is still below the limit `limit`
/// (the same, within 2^31 of it).
pub(crate) fn below(count: u64, limit: u32) -> bool {
    (limit.wrapping_sub(count as u32) as i32) > 0
}

/// A decoded header.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) stream: u64,
    pub(crate) seq: u64,
    pub(crate) name: String,
    /// The MAC of a version 2 header; `None` for version 1.
    pub(crate) mac: Option<[u8; MAC_LEN]>,
}

impl Header {
    /// Whether this header's MAC proves that someone holding `secret` sent this
    /// message, with `data`, to the agent named `receiver`. Always `false` for a
    /// version 1 header. Constant time in the MAC.
    pub(crate) fn verify(&self, secret: &SharedSecret, receiver: &str, data: &[u8]) -> bool {
        let Some(mac) = &self.mac else { return false };
        let (k, st, sq) = (
            [self.kind as u8],
            self.stream.to_le_bytes(),
            self.seq.to_le_bytes(),
        );
        let parts: [&[u8]; 6] = [
            receiver.as_bytes(),
            &k,
            &st,
            &sq,
            self.name.as_bytes(),
            data,
        ];
        secret.verify(MAC_CONTEXT, &parts, mac)
    }

    /// The bytes this header decodes from (a version 1 header may have had trailing
    /// bytes, which are not kept). For the fuzz harness's round trip and the tests.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn encode(&self) -> Vec<u8> {
        encode(
            self.kind,
            self.stream,
            self.seq,
            self.name.as_bytes(),
            self.mac.as_ref(),
        )
    }
}

/// The longest prefix of `name` a header carries.
fn wire_name(name: &str) -> &[u8] {
    &name.as_bytes()[..name.len().min(u16::MAX as usize)]
}

/// A version 1 header (no MAC), for agents without a secret.
pub(crate) fn encode_header(kind: Kind, stream: u64, seq: u64, name: &str) -> Vec<u8> {
    encode(kind, stream, seq, wire_name(name), None)
}

/// A version 2 header: `name` (the sender) sends `data` to `receiver`, proved with
/// `secret` (see the module docs).
pub(crate) fn encode_signed_header(
    secret: &SharedSecret,
    receiver: &str,
    kind: Kind,
    stream: u64,
    seq: u64,
    name: &str,
    data: &[u8],
) -> Vec<u8> {
    let name = wire_name(name);
    let (k, st, sq) = ([kind as u8], stream.to_le_bytes(), seq.to_le_bytes());
    let parts: [&[u8]; 6] = [receiver.as_bytes(), &k, &st, &sq, name, data];
    let mac = secret.sign(MAC_CONTEXT, &parts);
    encode(kind, stream, seq, name, Some(&mac))
}

fn encode(kind: Kind, stream: u64, seq: u64, name: &[u8], mac: Option<&[u8; MAC_LEN]>) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_FIXED + name.len() + mac.map_or(0, |_| MAC_LEN));
    v.extend_from_slice(&MAGIC.to_le_bytes());
    v.push(if mac.is_some() { VERSION_MAC } else { VERSION });
    v.push(kind as u8);
    v.extend_from_slice(&stream.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name);
    if let Some(mac) = mac {
        v.extend_from_slice(mac);
    }
    v
}

/// A header of either version, or `None` when it is not one. Total: never panics,
/// copies at most the name (at most `u16::MAX` bytes). A version 2 header must end
/// with its MAC; version 1 ignores trailing bytes, as it always did.
pub(crate) fn decode_header(b: &[u8]) -> Option<Header> {
    if b.len() < HEADER_FIXED || u16::from_le_bytes([b[0], b[1]]) != MAGIC {
        return None;
    }
    let signed = match b[2] {
        VERSION => false,
        VERSION_MAC => true,
        _ => return None,
    };
    let kind = match b[3] {
        1 => Kind::Notif,
        2 => Kind::Hello,
        3 => Kind::Bye,
        4 => Kind::Ping,
        5 => Kind::Pong,
        6 => Kind::Dropped,
        7 => Kind::Credit,
        8 => Kind::CreditAsk,
        _ => return None,
    };
    let stream = u64::from_le_bytes(b[4..12].try_into().ok()?);
    let seq = u64::from_le_bytes(b[12..20].try_into().ok()?);
    let n = u16::from_le_bytes([b[20], b[21]]) as usize;
    let end = HEADER_FIXED + n;
    let name = std::str::from_utf8(b.get(HEADER_FIXED..end)?).ok()?;
    let mac = if signed {
        if b.len() != end + MAC_LEN {
            return None;
        }
        Some(b[end..].try_into().ok()?)
    } else {
        None
    };
    Some(Header {
        kind,
        stream,
        seq,
        name: name.to_owned(),
        mac,
    })
}
/// A region's public blob.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Blob<'a> {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) rkey: &'a [u8],
}

pub(crate) fn encode_blob(base: u64, len: u64, rkey: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(BLOB_FIXED + rkey.len());
    v.push(BLOB_VERSION);
    v.extend_from_slice(&base.to_le_bytes());
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(rkey);
    v.into()
}

pub(crate) fn decode_blob(b: &[u8]) -> Option<Blob<'_>> {
    if b.len() <= BLOB_FIXED || b[0] != BLOB_VERSION {
        return None;
    }
    Some(Blob {
        base: u64::from_le_bytes(b[1..9].try_into().ok()?),
        len: u64::from_le_bytes(b[9..17].try_into().ok()?),
        rkey: &b[BLOB_FIXED..],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_garbage() {
        let h = encode_header(Kind::Notif, 7, 42, "prefill-0");
        assert_eq!(
            decode_header(&h),
            Some(Header {
                kind: Kind::Notif,
                stream: 7,
                seq: 42,
                name: "prefill-0".into(),
                mac: None,
            })
        );
        assert_eq!(decode_header(&h[..h.len() - 1]), None);
        assert_eq!(decode_header(&[0u8; 40]), None);
        for kind in [
            Kind::Hello,
            Kind::Bye,
            Kind::Ping,
            Kind::Pong,
            Kind::Dropped,
            Kind::Credit,
            Kind::CreditAsk,
        ] {
            let h = encode_header(kind, 1, 2, "x");
            assert_eq!(decode_header(&h).map(|d| d.kind), Some(kind));
        }
        let mut bad = h.clone();
        bad[3] = 11;
        assert_eq!(decode_header(&bad), None);
    }

    #[test]
    fn header_decode_refuses_what_a_hostile_sender_can_send() {
        let h = encode_header(Kind::Notif, u64::MAX, u64::MAX, "ab");
        // Extremes of the numbers decode (the receiver judges them).
        let d = decode_header(&h).unwrap();
        assert_eq!((d.stream, d.seq), (u64::MAX, u64::MAX));
        // A name length past the end, every truncation, bad UTF-8, bad magic/version.
        let mut long = h.clone();
        long[20..22].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(decode_header(&long), None);
        for n in 0..h.len() {
            assert_eq!(decode_header(&h[..n]), None, "{n} bytes");
        }
        let mut utf = h.clone();
        utf[HEADER_FIXED] = 0xff;
        assert_eq!(decode_header(&utf), None);
        for i in [0, 1, 2] {
            let mut bad = h.clone();
            bad[i] ^= 0x80;
            assert_eq!(decode_header(&bad), None, "byte {i}");
        }
        // The longest name a header can carry is cut at u16::MAX bytes.
        let name = "n".repeat(70_000);
        let d = decode_header(&encode_header(Kind::Hello, 1, 2, &name)).unwrap();
        assert_eq!(d.name.len(), u16::MAX as usize);
    }

    fn secret(b: &[u8]) -> SharedSecret {
        SharedSecret::new(b).unwrap()
    }

    #[test]
    fn version_1_bytes_are_unchanged() {
        // Agents without a secret talk to earlier builds: the header stays as it was.
        let h = encode_header(Kind::Notif, 0x0102, 3, "ab");
        let mut want = vec![
            0x58, 0x4e, 1, 1, 2, 1, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0,
        ];
        want.extend_from_slice(&[2, 0, b'a', b'b']);
        assert_eq!(h, want);
    }

    #[test]
    fn signed_header_round_trip_and_verification() {
        let s = secret(b"0123456789abcdef");
        let h = encode_signed_header(&s, "decode-0", Kind::Notif, 7, 42, "prefill-0", b"kv");
        assert_eq!(h.len(), HEADER_FIXED + 9 + MAC_LEN);
        assert_eq!(h[2], VERSION_MAC);
        // The MAC ends the header; the rest reads as version 1 does.
        assert_eq!(
            h[..HEADER_FIXED + 9][3..],
            encode_header(Kind::Notif, 7, 42, "prefill-0")[3..]
        );
        let d = decode_header(&h).unwrap();
        assert_eq!(
            (d.kind, d.stream, d.seq, d.name.as_str()),
            (Kind::Notif, 7, 42, "prefill-0")
        );
        assert_eq!(d.encode(), h);
        assert!(d.verify(&s, "decode-0", b"kv"));
        // Another secret, another receiver, other data: refused.
        assert!(!d.verify(&secret(b"0123456789abcdeF"), "decode-0", b"kv"));
        assert!(!d.verify(&s, "decode-1", b"kv"));
        assert!(!d.verify(&s, "decode-0", b"kV"));
        assert!(!d.verify(&s, "decode-0", b""));
        // Each field is covered: change any byte of the header and it no longer
        // verifies (or no longer decodes).
        for i in 3..h.len() {
            let mut bad = h.clone();
            bad[i] ^= 0x01;
            if let Some(d) = decode_header(&bad) {
                assert!(!d.verify(&s, "decode-0", b"kv"), "byte {i} not covered");
            }
        }
        // The same message under a version 1 header verifies against nothing.
        let v1 = decode_header(&encode_header(Kind::Notif, 7, 42, "prefill-0")).unwrap();
        assert_eq!(v1.mac, None);
        assert!(!v1.verify(&s, "decode-0", b"kv"));
        // Every kind carries a MAC; a PONG's covers its (empty) data too.
        for kind in [
            Kind::Hello,
            Kind::Bye,
            Kind::Ping,
            Kind::Pong,
            Kind::Dropped,
            Kind::Credit,
            Kind::CreditAsk,
        ] {
            let h = encode_signed_header(&s, "r", kind, 1, 2, "x", b"");
            let d = decode_header(&h).unwrap();
            assert_eq!(d.kind, kind);
            assert!(d.verify(&s, "r", b""));
        }
    }

    #[test]
    fn signed_header_decode_refuses_what_a_hostile_sender_can_send() {
        let s = secret(b"k");
        let h = encode_signed_header(&s, "r", Kind::Notif, u64::MAX, u64::MAX, "ab", b"");
        // Every truncation (a MAC cut short included), and anything after the MAC.
        for n in 0..h.len() {
            assert_eq!(decode_header(&h[..n]), None, "{n} bytes");
        }
        let mut long = h.clone();
        long.push(0);
        assert_eq!(decode_header(&long), None);
        // A name length reaching into the MAC leaves too few bytes for it.
        let mut into = h.clone();
        into[20..22].copy_from_slice(&(2u16 + 16).to_le_bytes());
        assert_eq!(decode_header(&into), None);
        // Unknown versions.
        for v in [0u8, 3, 0xff] {
            let mut bad = h.clone();
            bad[2] = v;
            assert_eq!(decode_header(&bad), None, "version {v}");
        }
        // The longest name is cut at u16::MAX bytes before it is signed.
        let name = "n".repeat(70_000);
        let d = decode_header(&encode_signed_header(
            &s,
            "r",
            Kind::Hello,
            1,
            2,
            &name,
            b"a",
        ))
        .unwrap();
        assert_eq!(d.name.len(), u16::MAX as usize);
        assert!(d.verify(&s, "r", b"a"));
    }

    #[test]
    fn blob_round_trip_and_garbage() {
        let b = encode_blob(0x1000, 4096, &[1, 2, 3]);
        assert_eq!(
            decode_blob(&b),
            Some(Blob {
                base: 0x1000,
                len: 4096,
                rkey: &[1, 2, 3]
            })
        );
        assert_eq!(decode_blob(&b[..BLOB_FIXED]), None);
        let mut bad = b.to_vec();
        bad[0] ^= 0x5a;
        assert_eq!(decode_blob(&bad), None);
    }

    #[test]
    fn credit_limits_wrap_and_compare_modulo_two_to_the_32() {
        let seq = credit_seq(5, 7);
        assert_eq!((seq >> 32, seq & 0xffff_ffff), (7, 5));
        assert!(below(4, 5) && !below(5, 5) && !below(6, 5));
        // Counts past 2^32 compare with limits that wrapped too.
        let count = (1u64 << 32) + 10;
        let limit = credit_seq(count + 3, 0) as u32;
        assert!(below(count, limit) && !below(count + 3, limit));
        assert!(below(u64::from(u32::MAX), 2), "across the wrap");
    }
}
