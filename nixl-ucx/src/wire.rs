//! What this backend puts in active-message headers and registration blobs.
//!
//! Active message header (little-endian):
//! `magic u16 | version u8 | kind u8 | stream u64 | seq u64 | name_len u16 | name`.
//! `stream` names one sender endpoint (it changes when the sender reconnects) and `seq`
//! counts notifications on it, so the receiver delivers them in posting order whatever
//! the transport does. The data of HELLO and BYE is the sender's worker address.
//! PING (a liveness probe, see the driver) has no data and goes with a UCX reply
//! endpoint; the receiver answers on it with a PONG carrying the same `stream` and
//! `seq` (and an empty name).
//!
//! Registration blob: `version u8 | base u64 | len u64 | packed remote key`. NIXL's
//! blob for the same registration is the packed remote key alone.
//!
//! To NIXL agents (peers loaded from NIXL metadata) the backend sends none of the
//! messages above: only NIXL's notifications ([`NIXL_NOTIF_AM_ID`]).

use bytes::Bytes;

/// UCX active-message id for this backend's messages.
pub(crate) const AM_ID: u32 = 0x4e58;
/// UCX active-message id of NIXL's notifications (its UCX backend's `NOTIF_STR`):
/// empty header, eager, the payload NIXL's serdes of the sender's name and the
/// message ([`nixl::interop::encode_notification`]).
pub(crate) const NIXL_NOTIF_AM_ID: u32 = 0;
const MAGIC: u16 = 0x4e58;
const VERSION: u8 = 1;
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
}

/// A decoded header.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) stream: u64,
    pub(crate) seq: u64,
    pub(crate) name: String,
}

pub(crate) fn encode_header(kind: Kind, stream: u64, seq: u64, name: &str) -> Vec<u8> {
    let name = &name.as_bytes()[..name.len().min(u16::MAX as usize)];
    let mut v = Vec::with_capacity(HEADER_FIXED + name.len());
    v.extend_from_slice(&MAGIC.to_le_bytes());
    v.push(VERSION);
    v.push(kind as u8);
    v.extend_from_slice(&stream.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name);
    v
}

pub(crate) fn decode_header(b: &[u8]) -> Option<Header> {
    if b.len() < HEADER_FIXED || u16::from_le_bytes([b[0], b[1]]) != MAGIC || b[2] != VERSION {
        return None;
    }
    let kind = match b[3] {
        1 => Kind::Notif,
        2 => Kind::Hello,
        3 => Kind::Bye,
        4 => Kind::Ping,
        5 => Kind::Pong,
        _ => return None,
    };
    let stream = u64::from_le_bytes(b[4..12].try_into().ok()?);
    let seq = u64::from_le_bytes(b[12..20].try_into().ok()?);
    let n = u16::from_le_bytes([b[20], b[21]]) as usize;
    let name = std::str::from_utf8(b.get(HEADER_FIXED..HEADER_FIXED + n)?).ok()?;
    Some(Header {
        kind,
        stream,
        seq,
        name: name.to_owned(),
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
                name: "prefill-0".into()
            })
        );
        assert_eq!(decode_header(&h[..h.len() - 1]), None);
        assert_eq!(decode_header(&[0u8; 40]), None);
        for kind in [Kind::Hello, Kind::Bye, Kind::Ping, Kind::Pong] {
            let h = encode_header(kind, 1, 2, "x");
            assert_eq!(decode_header(&h).map(|d| d.kind), Some(kind));
        }
        let mut bad = h.clone();
        bad[3] = 9;
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
}
