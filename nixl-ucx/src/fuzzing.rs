//! Entry points for fuzzing (`fuzz/`) and the stable fuzz smoke test: each takes
//! arbitrary bytes as what a hostile peer sends, runs the backend's decoding on
//! them, and panics when an invariant breaks. Not a public API: hidden, and free to
//! change.

use std::collections::HashMap;

use bytes::Bytes;

use crate::driver::Reorder;
use crate::wire;

/// Everything the driver does with an incoming active message's bytes before any
/// state: this backend's header ([`wire::decode_header`]) and NIXL's notification
/// payload; and with a peer's registration blob ([`wire::decode_blob`]).
///
/// # Panics
/// When whatever decodes does not re-encode to the bytes it came from.
pub fn am_header(data: &[u8]) {
    if let Some(h) = wire::decode_header(data) {
        let again = wire::encode_header(h.kind, h.stream, h.seq, &h.name);
        assert!(data.starts_with(&again), "the header re-encodes as it came");
    }
    if let Some(b) = wire::decode_blob(data) {
        assert_eq!(&wire::encode_blob(b.base, b.len, b.rkey)[..], data);
    }
    if let Ok((name, msg)) = nixl::interop::decode_notification(data, 4096) {
        assert!(name.len() <= 4096);
        assert_eq!(nixl::interop::encode_notification(&name, msg), data);
    }
}

/// Notifications as a hostile sender numbers them, through the receiver's
/// reordering (with room for 8 held back per stream, where the driver holds
/// 65536): `data` is a list of 9-byte records, a stream byte and a sequence number
/// (u64 little-endian, so any value up to `u64::MAX`).
///
/// # Panics
/// When a notification is lost (but for one held back and replaced by a later one
/// with the same number: the sender's own doing), delivered twice, or delivered
/// before one of its stream it should follow while room was left; or on arithmetic
/// overflow.
pub fn notification_order(data: &[u8]) {
    const ROOM: usize = 8;
    let mut streams: HashMap<u8, Reorder> = HashMap::new();
    let mut delivered: Vec<u32> = Vec::new();
    let mut sent = 0u32;
    let mut replaced = 0usize;
    for rec in data.chunks_exact(9) {
        let stream = rec[0];
        let seq = u64::from_le_bytes(rec[1..].try_into().unwrap());
        let r = streams.entry(stream).or_default();
        let (next_before, held) = r.state();
        let held: Vec<u64> = held.collect();
        if seq > next_before && held.len() < ROOM && held.contains(&seq) {
            replaced += 1;
        }
        let before = delivered.len();
        let tag = Bytes::copy_from_slice(&sent.to_le_bytes());
        let in_order = r.take(seq, tag, ROOM, |d| {
            delivered.push(u32::from_le_bytes(d[..].try_into().unwrap()));
        });
        let (next, held) = r.state();
        let held: Vec<u64> = held.collect();
        assert!(
            next >= next_before,
            "the expected sequence number went back"
        );
        assert!(held.len() <= ROOM, "{} held back", held.len());
        assert!(held.iter().all(|&s| s > next), "a held notification is due");
        if seq > next_before && in_order {
            assert_eq!(delivered.len(), before, "held, yet delivered");
        } else {
            assert_eq!(delivered.get(before), Some(&sent), "delivered first");
        }
        sent += 1;
    }
    // Nothing lost or delivered twice: each was delivered once or is held.
    let held: usize = streams.values().map(|r| r.state().1.count()).sum();
    let mut seen = delivered.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(
        seen.len(),
        delivered.len(),
        "a notification delivered twice"
    );
    assert_eq!(
        delivered.len() + held + replaced,
        sent as usize,
        "a notification lost"
    );
}

/// Seeds for [`am_header`]: a header of each kind, a registration blob and a NIXL
/// notification, from the encoders.
pub fn am_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use wire::Kind;
    let mut v: Vec<(&'static str, Vec<u8>)> = [
        ("notif", Kind::Notif),
        ("hello", Kind::Hello),
        ("bye", Kind::Bye),
        ("ping", Kind::Ping),
        ("pong", Kind::Pong),
    ]
    .into_iter()
    .map(|(n, k)| (n, wire::encode_header(k, 7, 42, "prefill-0")))
    .collect();
    v.push((
        "blob",
        wire::encode_blob(0x7f00_1000, 4096, &[1, 2, 3, 4]).to_vec(),
    ));
    v.push((
        "nixl-notif",
        nixl::interop::encode_notification("nixl-peer", b"done"),
    ));
    v
}

/// Seeds for [`notification_order`]: in order, reversed, interleaved streams,
/// duplicates, a full hold-back and numbers at the top of the range.
pub fn order_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let recs = |r: &[(u8, u64)]| {
        r.iter()
            .flat_map(|&(s, q)| [&[s][..], &q.to_le_bytes()].concat())
            .collect::<Vec<u8>>()
    };
    vec![
        ("in-order", recs(&[(0, 0), (0, 1), (0, 2), (0, 3)])),
        ("reversed", recs(&[(0, 3), (0, 2), (0, 1), (0, 0)])),
        ("streams", recs(&[(0, 1), (1, 0), (0, 0), (1, 2), (1, 1)])),
        (
            "duplicates",
            recs(&[(0, 2), (0, 2), (0, 0), (0, 0), (0, 1)]),
        ),
        // Regression: the held notifications a full hold-back let the next one
        // overtake stayed held for good.
        (
            "held-full",
            recs(&(1..=10).map(|q| (0, q * 2)).collect::<Vec<_>>()),
        ),
        ("top", recs(&[(0, u64::MAX - 1), (0, u64::MAX), (0, 0)])),
        // Regression: once the hold-back was full, a number at the top overflowed
        // the expected one, and the held notifications it overtook stayed held.
        (
            "top-after-full",
            recs(
                &(1..=8)
                    .map(|q| (0, q * 2))
                    .chain([(0, u64::MAX), (0, 0)])
                    .collect::<Vec<_>>(),
            ),
        ),
    ]
}
