//! Entry points for fuzzing (`fuzz/`) and the stable fuzz smoke test: each takes
//! arbitrary bytes as what a hostile peer sends, runs the backend's decoding on
//! them, and panics when an invariant breaks. Not a public API: hidden, and free to
//! change.

use std::collections::HashMap;

use bytes::Bytes;

use crate::wire;

/// The secret and receiver the `am_header` seeds' version 2 headers are made with.
const FUZZ_SECRET: &[u8] = b"nixl-ucx fuzz secret";
const FUZZ_RECEIVER: &str = "decode-0";

fn fuzz_secret() -> nixl::SharedSecret {
    nixl::SharedSecret::new(FUZZ_SECRET).expect("not empty")
}

/// Everything the driver does with an incoming active message's bytes before any
/// state: this backend's header of either version (`wire::decode_header`) and the
/// MAC check of version 2 (`wire::Header::verify`, here for a fixed secret and
/// receiver and empty data), and NIXL's notification payload; and with a peer's
/// registration blob (`wire::decode_blob`) and UCX's packed objects in it or in its
/// connection info (the `packed` checks: worker address, packed remote key).
///
/// # Panics
/// When whatever decodes does not re-encode to the bytes it came from (a version 2
/// header exactly, nothing after its MAC), or when a header whose MAC verifies is
/// not the one the signing encoder makes from its fields (so the MAC covers every
/// byte of it).
pub fn am_header(data: &[u8]) {
    if let Some(h) = wire::decode_header(data) {
        let again = h.encode();
        if h.mac.is_some() {
            assert_eq!(again, data, "a version 2 header re-encodes exactly");
        } else {
            assert!(data.starts_with(&again), "the header re-encodes as it came");
        }
        let secret = fuzz_secret();
        if h.verify(&secret, FUZZ_RECEIVER, &[]) {
            let signed = wire::encode_signed_header(
                &secret,
                FUZZ_RECEIVER,
                h.kind,
                h.stream,
                h.seq,
                &h.name,
                &[],
            );
            assert_eq!(signed, data, "a header that verifies is the signer's");
        }
    }
    if let Some(b) = wire::decode_blob(data) {
        assert_eq!(&wire::encode_blob(b.base, b.len, b.rkey)[..], data);
        check_packed(b.rkey);
    }
    check_packed(data);
    if let Ok((name, msg)) = nixl::interop::decode_notification(data, 4096) {
        assert!(name.len() <= 4096);
        assert_eq!(nixl::interop::encode_notification(&name, msg), data);
    }
}

/// The checks of UCX's packed objects (`packed`) on `data` as a worker address and
/// as a packed remote key: no panic, and what passes has what UCX reads first.
fn check_packed(data: &[u8]) {
    if crate::packed::check_address(data).is_ok() {
        assert!(
            data.len() >= 2 && data[0] & 0x0f <= 1,
            "a header UCX accepts"
        );
        let p = crate::packed::Padded::address(data).expect("checked");
        assert!(p.bytes()[data.len()..].iter().all(|&b| b == 0));
    }
    if crate::packed::check_rkey(data).is_ok() {
        assert!(data.len() >= 9 && data[8] <= 4, "a key UCX accepts");
        let p = crate::packed::Padded::rkey(data).expect("checked");
        assert!(p.bytes().len() > data.len());
    }
}

/// Notifications as a hostile sender numbers them, through the receiver's reorder
/// stage (`crate::reorder::Reorder`, with small limits: 8 held per stream, 64 bytes
/// per stream, 256 in all, 2 streams per sender, 8 in all): `data` is a list of
/// 9-byte records, a stream byte (its low two bits pick one of four senders) and a
/// sequence number (u64 little-endian, so any value up to `u64::MAX`). A record
/// repeating a (stream, number) already sent is skipped: a sender that repeats one
/// replaces its own held message.
///
/// # Panics
/// When a notification is lost or delivered twice (each is delivered once, held,
/// or refused as a protocol error: number `u64::MAX`), when a stream is delivered
/// out of order although no limit was reached, or when the limits do not hold.
pub fn notification_order(data: &[u8]) {
    use std::collections::HashSet;
    use std::time::{Duration, Instant};

    use crate::reorder::{Limits, Reorder};

    let limits = Limits {
        window: 8,
        stream_bytes: 64,
        total_bytes: 256,
        streams_per_sender: 2,
        streams: 8,
        gap_timeout: Duration::from_secs(3600),
    };
    let now = Instant::now();
    let mut r = Reorder::new(limits);
    let mut delivered: Vec<(String, u32)> = Vec::new();
    let mut sent_ids: HashSet<(u8, u64)> = HashSet::new();
    let mut streams_of: HashMap<u32, (String, u8, u64)> = HashMap::new();
    let mut sent = 0u32;
    for rec in data.chunks_exact(9) {
        let stream = rec[0];
        let seq = u64::from_le_bytes(rec[1..].try_into().unwrap());
        if !sent_ids.insert((stream, seq)) {
            continue;
        }
        let name = format!("sender-{}", stream & 3);
        // 4 bytes of tag, padded so the byte limits come into play.
        let mut tag = sent.to_le_bytes().to_vec();
        tag.resize(4 + (stream as usize >> 2) % 13, 0);
        streams_of.insert(sent, (name.clone(), stream, seq));
        r.accept(
            &name,
            u64::from(stream >> 2),
            seq,
            Bytes::from(tag),
            now,
            &mut |n, _, d| {
                delivered.push((n.to_owned(), u32::from_le_bytes(d[..4].try_into().unwrap())));
            },
        );
        assert!(
            r.held_bytes() <= limits.total_bytes,
            "{} bytes held",
            r.held_bytes()
        );
        assert!(r.streams() <= limits.streams, "{} streams", r.streams());
        sent += 1;
    }
    let stats = r.stats();
    let in_limits = stats.gaps_skipped == 0 && stats.evicted == 0;
    for n in 0..4 {
        r.forget(&format!("sender-{n}"), &mut |n, _, d| {
            delivered.push((n.to_owned(), u32::from_le_bytes(d[..4].try_into().unwrap())));
        });
    }
    assert_eq!(r.held_bytes(), 0, "bytes held after every sender left");
    let mut seen: Vec<u32> = delivered.iter().map(|(_, t)| *t).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(
        seen.len(),
        delivered.len(),
        "a notification delivered twice"
    );
    for (n, t) in &delivered {
        assert_eq!(&streams_of[t].0, n, "delivered under another sender's name");
    }
    assert_eq!(
        delivered.len() as u64 + r.stats().protocol_errors,
        u64::from(sent),
        "a notification lost"
    );
    if in_limits {
        // Within the limits (no gap given up, no stream replaced), each stream comes
        // out in ascending order.
        let mut last: HashMap<u8, u64> = HashMap::new();
        for (_, t) in &delivered {
            let (_, stream, seq) = streams_of[t];
            if let Some(&prev) = last.get(&stream) {
                assert!(seq > prev, "stream {stream}: {seq} after {prev}");
            }
            last.insert(stream, seq);
        }
    }
}

/// Seeds for `am_header`: a header of each kind in either version (version 2 made
/// for the target's fixed secret and receiver, with no data), a registration blob and
/// a NIXL notification, from the encoders.
pub fn am_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use wire::Kind;
    let kinds = [
        ("notif", "notif-v2", Kind::Notif),
        ("hello", "hello-v2", Kind::Hello),
        ("bye", "bye-v2", Kind::Bye),
        ("ping", "ping-v2", Kind::Ping),
        ("pong", "pong-v2", Kind::Pong),
    ];
    let secret = fuzz_secret();
    let mut v: Vec<(&'static str, Vec<u8>)> = kinds
        .iter()
        .map(|&(n, _, k)| (n, wire::encode_header(k, 7, 42, "prefill-0")))
        .collect();
    v.extend(kinds.iter().map(|&(_, n, k)| {
        let h = wire::encode_signed_header(&secret, FUZZ_RECEIVER, k, 7, 42, "prefill-0", &[]);
        (n, h)
    }));
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

/// Seeds for `notification_order`: in order, reversed, interleaved streams,
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
