//! The handshake (same-host offer, shared secret) and robustness: random bytes, a
//! header alone, tables longer than a chunk, the byte cap.

use super::*;

#[test]
fn same_host_request_waits_for_the_offer() {
    let mut s = Sim::new(None);
    s.feed(&wire::hello("init", LISTENER));
    s.feed(&[1]);
    assert_eq!(s.take(), vec![Seen::Reply(ok_reply()), Seen::Offer]);
    assert!(s.m.need().is_none(), "nothing read before the offer");
    let o = Offer {
        pid: 1,
        table_fd: 3,
        table_addr: 0x1000,
        nonce: [5; crate::shm::NONCE_LEN],
    };
    s.m.offered(Some(&o));
    s.feed(&[]);
    let mut want = vec![1];
    want.extend_from_slice(&wire::encode_offer(&o));
    assert_eq!(s.take(), vec![Seen::Reply(want)]);
    assert!(s.m.at_boundary());
    // No offer: one byte says so.
    let mut s = Sim::new(None);
    s.feed(&wire::hello("init", LISTENER));
    s.feed(&[1]);
    s.take();
    s.m.offered(None);
    s.feed(&[]);
    assert_eq!(s.take(), vec![Seen::Reply(vec![0])]);
}

#[test]
fn shared_secret_gates_every_request() {
    let secret = SharedSecret::new("s3cret-s3cret-s3cret").unwrap();
    let mut auth_required = ok_reply();
    *auth_required.last_mut().unwrap() = wire::ST_AUTH;
    // A hello (and a request) without the proof first: refused, nothing read on.
    let mut s = Sim::new(Some(secret.clone()));
    let mut early = wire::hello("init", LISTENER);
    early.extend_from_slice(&[0; 25]);
    s.feed(&early);
    assert_eq!(s.take(), vec![Seen::Reply(auth_required), Seen::Close]);
    assert!(s.m.need().is_none());
    // The secret proven as "init", then the hello as "init": served.
    let mut s = Sim::new(Some(secret.clone()));
    authenticate(&mut s, &secret, "init").unwrap();
    s.feed(&wire::hello("init", LISTENER));
    s.feed(&[0]);
    assert_eq!(s.take(), vec![Seen::Reply(ok_reply())]);
    assert!(s.m.at_boundary());
    assert_eq!(s.m.peer(), "init");
    // Proven as "init", hello as someone else: refused.
    let mut s = Sim::new(Some(secret.clone()));
    authenticate(&mut s, &secret, "init").unwrap();
    s.feed(&wire::hello("decode-7", LISTENER));
    let mut other_name = ok_reply();
    *other_name.last_mut().unwrap() = wire::ST_REFUSED;
    assert_eq!(s.take(), vec![Seen::Reply(other_name), Seen::Close]);
    // Another secret: the client sees the target's proof fail.
    let wrong = SharedSecret::new("another-secret-entirely").unwrap();
    let mut s = Sim::new(Some(secret.clone()));
    let e = authenticate(&mut s, &wrong, "init").unwrap_err();
    assert!(e.contains("failed to prove"), "{e}");
    // A client proof that does not verify: refused and closed.
    let mut s = Sim::new(Some(secret.clone()));
    let (_, first) =
        ClientAuth::start(wire::AUTH_PROTOCOL, wrong, "init", "target", [9; NONCE_LEN]).unwrap();
    s.feed(&first);
    s.take();
    let mut forged = 4u16.to_le_bytes().to_vec();
    forged.extend_from_slice(b"init");
    forged.extend_from_slice(&[0; 32]);
    s.feed(&forged);
    assert_eq!(s.take(), vec![Seen::Reply(vec![1]), Seen::Close]);
    assert!(s.m.need().is_none());
    // Authenticating where no secret is configured: refused.
    let mut s = Sim::new(None);
    let (_, first) = ClientAuth::start(
        wire::AUTH_PROTOCOL,
        secret,
        "init",
        "target",
        [9; NONCE_LEN],
    )
    .unwrap();
    s.feed(&first);
    assert_eq!(s.take(), vec![Seen::Reply(vec![1]), Seen::Close]);
}

/// With a secret, the same-host offer (which names the target's pid and table) is
/// asked for only past the authentication: a peer that skips it, or fails it,
/// never gets that far.
#[test]
fn the_same_host_offer_is_made_only_after_authentication() {
    let secret = SharedSecret::new("s3cret-s3cret-s3cret").unwrap();
    let mut s = Sim::new(Some(secret.clone()));
    let mut bytes = wire::hello("init", LISTENER);
    bytes.push(1);
    s.feed(&bytes);
    assert!(!s.take().contains(&Seen::Offer), "no offer unauthenticated");
    let wrong = SharedSecret::new("another-secret-entirely").unwrap();
    let mut s = Sim::new(Some(secret.clone()));
    let _ = authenticate(&mut s, &wrong, "init");
    s.feed(&bytes);
    assert!(
        !s.take().contains(&Seen::Offer),
        "no offer to a wrong secret"
    );
    let mut s = Sim::new(Some(secret.clone()));
    authenticate(&mut s, &secret, "init").unwrap();
    s.feed(&bytes);
    assert_eq!(s.take(), vec![Seen::Reply(ok_reply()), Seen::Offer]);
}

#[test]
fn random_bytes_never_panic() {
    // xorshift: deterministic, no dependency.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..2000 {
        let mut s = if round % 2 == 0 {
            Sim::serving()
        } else {
            Sim::new(None)
        };
        let n = (next() % 300) as usize;
        let mut bytes: Vec<u8> = (0..n).map(|_| next() as u8).collect();
        // Often a plausible header, so the deeper steps are reached too.
        if round % 3 == 0 && bytes.len() >= wire::HEADER_LEN {
            bytes[0] = [wire::REQ_WRITE, wire::REQ_READ, wire::REQ_NOTIFY][round % 3];
            bytes[4..8].copy_from_slice(&((next() % 4) as u32).to_le_bytes());
            bytes[16..20].copy_from_slice(&((next() % 64) as u32).to_le_bytes());
        }
        s.feed(&bytes);
    }
}

#[test]
fn a_header_alone_allocates_little() {
    // A header announcing the most runs (40 MiB of table) and the longest
    // notification: only what arrives is allocated, a chunk at a time.
    let mut s = Sim::serving();
    let h = RequestHeader {
        kind: wire::REQ_WRITE,
        has_notif: false,
        part: false,
        segments: wire::MAX_ENTRIES,
        id: 1,
        notif_len: 0,
    };
    s.feed(&h.encode());
    assert_eq!(s.m.need().map(|b| b.len()), Some(GROW));
    assert!(s.m.table.capacity() <= GROW, "{}", s.m.table.capacity());
    let mut s = Sim::serving();
    s.m.max_notification = 1 << 30;
    let h = RequestHeader {
        kind: wire::REQ_NOTIFY,
        has_notif: true,
        part: false,
        segments: 0,
        id: 2,
        notif_len: 1 << 30,
    };
    s.feed(&h.encode());
    assert_eq!(s.m.need().map(|b| b.len()), Some(GROW));
    assert!(s.m.notif.capacity() <= GROW, "{}", s.m.notif.capacity());
}

#[test]
fn tables_and_notifications_longer_than_a_chunk_arrive_whole() {
    let mut s = Sim::serving();
    s.m.max_notification = 3 * GROW;
    // Runs of one byte each, more than a chunk of table.
    let n = GROW / wire::SEG_LEN + 7;
    let runs: Vec<SegEntry> = (0..n as u64).map(|i| run(KEY, BASE + i % LEN, 1)).collect();
    let note: Vec<u8> = (0..2 * GROW + 5).map(|i| i as u8).collect();
    let f = frame(wire::REQ_READ, 8, &runs, Some(&note), None, &[]);
    // Fed a few bytes at a time, then whole.
    for piece in f.chunks(1000) {
        s.feed(piece);
    }
    assert_eq!(
        s.take(),
        vec![
            Seen::Sent(n as u64, n),
            Seen::Deliver(note.clone()),
            Seen::Ack(8, wire::ST_OK),
        ]
    );
    s.request(wire::REQ_READ, 9, &runs, Some(&note), &[]);
    assert_eq!(
        s.take(),
        vec![
            Seen::Sent(n as u64, n),
            Seen::Deliver(note),
            Seen::Ack(9, wire::ST_OK),
        ]
    );
}

#[test]
fn requests_over_the_byte_cap_are_refused_and_the_connection_stays_usable() {
    // Stride 0: one block of a small registration, asked for 2^40 times.
    let endless = SegEntry {
        key: KEY,
        addr: BASE,
        len: LEN,
        stride: 0,
        blocks: 1 << 40,
    };
    let mut s = Sim::serving();
    s.request(wire::REQ_READ, 1, &[endless], Some(b"n"), &[]);
    assert_eq!(
        s.take(),
        vec![Seen::Ack(1, wire::ST_TOO_LARGE)],
        "no data, no notification"
    );
    assert!(s.m.at_boundary());
    // A lower cap; a WRITE over it has its payload skipped, memory untouched.
    s.m.max_request = 64;
    let over = SegEntry {
        key: KEY,
        addr: BASE,
        len: 16,
        stride: 0,
        blocks: 5,
    };
    s.request(wire::REQ_WRITE, 2, &[over], None, &[1; 80]);
    assert_eq!(
        s.take(),
        vec![Seen::Skipped(80), Seen::Ack(2, wire::ST_TOO_LARGE)]
    );
    // A piece of a request over the cap is refused too.
    let f = frame(wire::REQ_READ, 3, &[over], None, Some((0, 16)), &[]);
    s.feed(&f);
    assert_eq!(s.take(), vec![Seen::Ack(3, wire::ST_TOO_LARGE)]);
    // At the cap, served.
    let at = SegEntry { blocks: 4, ..over };
    s.request(wire::REQ_READ, 4, &[at], None, &[]);
    assert_eq!(s.take(), vec![Seen::Sent(64, 1), Seen::Ack(4, wire::ST_OK)]);
    s.request(wire::REQ_WRITE, 5, &[at], None, &[2; 64]);
    assert_eq!(
        s.take(),
        vec![Seen::Received(vec![2; 64]), Seen::Ack(5, wire::ST_OK)]
    );
}

#[test]
fn handshaking_ends_when_requests_begin() {
    let mut s = Sim::new(None);
    assert!(s.m.handshaking());
    s.feed(&wire::hello("init", LISTENER));
    assert!(s.m.handshaking(), "the same-host request is part of it");
    s.feed(&[0]);
    assert!(!s.m.handshaking());
}
