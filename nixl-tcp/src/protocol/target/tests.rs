//! The target's protocol driven by a simulated initiator: handshakes, requests that
//! work, and the hostile requests `tests/tcp_wire.rs` sends over real sockets.

use std::collections::HashMap;

use nixl::control::ClientAuth;

use super::*;

const BASE: u64 = 0x10_000;
const LEN: u64 = 4096;
const KEY: u64 = 0xfeed;

/// Registrations as (start, length) by key, checked by the real target's rules: a
/// run lies inside when its first block is non-empty and inside, and its last block
/// is inside.
#[derive(Default)]
struct Fake(HashMap<u64, (u64, u64)>);

#[derive(Default, Debug)]
struct Runs {
    entries: Vec<SegEntry>,
    piece: Option<(u64, u64)>,
}

fn inside(base: u64, len: u64, addr: u64, n: u64) -> bool {
    addr >= base && addr.checked_add(n).is_some_and(|end| end <= base + len)
}

impl Registry for Fake {
    type Runs = Runs;

    fn check(&self, table: &[u8], runs: &mut Runs) -> Result<(), Refusal> {
        runs.entries.clear();
        for (i, e) in SegEntry::decode_all(table).enumerate() {
            let Some(&(base, len)) = self.0.get(&e.key) else {
                return Err(Refusal {
                    status: wire::ST_BAD_KEY,
                    msg: format!("run {i}: unknown or forged key"),
                });
            };
            let ok = e.len > 0
                && inside(base, len, e.addr, e.len)
                && e.last().is_some_and(|l| inside(base, len, l, e.len));
            if !ok {
                return Err(Refusal {
                    status: wire::ST_OUT_OF_RANGE,
                    msg: format!("run {i}: outside"),
                });
            }
            runs.entries.push(e);
        }
        Ok(())
    }

    fn restrict(runs: &mut Runs, from: u64, len: u64) {
        runs.piece = Some((from, len));
    }

    fn clear(runs: &mut Runs) {
        runs.entries.clear();
        runs.piece = None;
    }
}

/// What the simulated I/O saw, in order.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Reply(Vec<u8>),
    Ack(u64, u8),
    Offer,
    Deliver(Vec<u8>),
    /// Payload bytes received into memory.
    Received(Vec<u8>),
    Skipped(u64),
    /// DATA sent: its length, and the runs it was sent from.
    Sent(u64, usize),
    Close,
}

struct Sim {
    m: Target<Fake>,
    reg: Fake,
    input: Vec<u8>,
    at: usize,
    seen: Vec<Seen>,
}

/// The simulated target's listener id.
const LISTENER: u64 = 0x1157_e4e4;

impl Sim {
    fn new(secret: Option<SharedSecret>) -> Self {
        let mut reg = Fake::default();
        reg.0.insert(KEY, (BASE, LEN));
        Self {
            m: Target::new(secret, "target", LISTENER, 1024, [7; NONCE_LEN]),
            reg,
            input: Vec::new(),
            at: 0,
            seen: Vec::new(),
        }
    }

    /// A target past a plain handshake (no secret, no same-host path).
    fn serving() -> Self {
        let mut s = Self::new(None);
        s.feed(&wire::hello("init", LISTENER));
        s.feed(&[0]);
        assert_eq!(s.take(), vec![Seen::Reply(ok_reply())]);
        assert!(s.m.at_boundary());
        s
    }

    fn take(&mut self) -> Vec<Seen> {
        std::mem::take(&mut self.seen)
    }

    /// The initiator sends `bytes`; the simulated I/O runs the machine as far as
    /// they go, moving payloads as it is told.
    fn feed(&mut self, bytes: &[u8]) {
        self.input.extend_from_slice(bytes);
        loop {
            while let Some(a) = self.m.poll() {
                let seen = match a {
                    Action::Reply(b) => Seen::Reply(b),
                    Action::Ack { id, status, .. } => Seen::Ack(id, status),
                    Action::Offer => Seen::Offer,
                    Action::Deliver(n) => Seen::Deliver(n.to_vec()),
                    Action::Receive { len } => {
                        let n = len as usize;
                        if self.input.len() - self.at < n {
                            // Not here yet: the test feeds it.
                            self.seen.push(Seen::Received(Vec::new()));
                            return;
                        }
                        let b = self.input[self.at..self.at + n].to_vec();
                        self.at += n;
                        self.m.moved();
                        Seen::Received(b)
                    }
                    Action::Skip(len) => {
                        if ((self.input.len() - self.at) as u64) < len {
                            self.seen.push(Seen::Skipped(len));
                            return;
                        }
                        self.at += len as usize;
                        self.m.moved();
                        Seen::Skipped(len)
                    }
                    Action::SendData(h) => {
                        let d = ResponseHeader::decode(&h);
                        assert_eq!(d.kind, wire::RESP_DATA);
                        let runs = self.m.runs().entries.len();
                        self.m.moved();
                        Seen::Sent(d.data_len, runs)
                    }
                    Action::Close(_) => Seen::Close,
                };
                self.seen.push(seen);
            }
            let avail = self.input.len() - self.at;
            let Some(buf) = self.m.need() else { return };
            if buf.len() > avail {
                return;
            }
            let n = buf.len();
            buf.copy_from_slice(&self.input[self.at..self.at + n]);
            self.at += n;
            self.m.received(&self.reg);
        }
    }

    fn request(
        &mut self,
        kind: u8,
        id: u64,
        runs: &[SegEntry],
        notif: Option<&[u8]>,
        payload: &[u8],
    ) {
        self.feed(&frame(kind, id, runs, notif, None, payload));
    }
}

fn ok_reply() -> Vec<u8> {
    let mut r = wire::MAGIC.to_vec();
    r.extend_from_slice(&wire::VERSION.to_le_bytes());
    r.push(wire::ST_OK);
    r
}

fn run(key: u64, addr: u64, len: u64) -> SegEntry {
    SegEntry {
        key,
        addr,
        len,
        stride: len,
        blocks: 1,
    }
}

fn frame(
    kind: u8,
    id: u64,
    runs: &[SegEntry],
    notif: Option<&[u8]>,
    part: Option<(u64, u64)>,
    payload: &[u8],
) -> Vec<u8> {
    let h = RequestHeader {
        kind,
        has_notif: notif.is_some(),
        part: part.is_some(),
        segments: runs.len() as u32,
        id,
        notif_len: notif.map_or(0, |n| n.len() as u32),
    };
    let mut b = h.encode().to_vec();
    if let Some((from, len)) = part {
        b.extend_from_slice(&wire::encode_part(from, len));
    }
    for r in runs {
        r.encode_into(&mut b);
    }
    b.extend_from_slice(notif.unwrap_or_default());
    b.extend_from_slice(payload);
    b
}

#[test]
fn write_lands_then_notification_then_ack() {
    let mut s = Sim::serving();
    s.request(
        wire::REQ_WRITE,
        5,
        &[run(KEY, BASE, 4)],
        Some(b"hi"),
        b"good",
    );
    assert_eq!(
        s.take(),
        vec![
            Seen::Received(b"good".to_vec()),
            Seen::Deliver(b"hi".to_vec()),
            Seen::Ack(5, wire::ST_OK),
        ]
    );
    assert!(s.m.at_boundary());
    assert!(
        s.m.runs().entries.is_empty(),
        "runs let go after the request"
    );
}

#[test]
fn write_waits_for_its_payload() {
    let mut s = Sim::serving();
    let f = frame(
        wire::REQ_WRITE,
        1,
        &[run(KEY, BASE, 8)],
        None,
        None,
        b"12345678",
    );
    s.feed(&f[..f.len() - 8]);
    assert_eq!(
        s.take(),
        vec![Seen::Received(Vec::new())],
        "asked for the payload"
    );
    assert_eq!(
        s.m.need().map(|b| b.len()),
        None,
        "reads nothing while it moves"
    );
}

#[test]
fn read_sends_data_then_notification_then_ack() {
    let mut s = Sim::serving();
    let strided = SegEntry {
        key: KEY,
        addr: BASE + 100,
        len: 4,
        stride: 8,
        blocks: 3,
    };
    s.request(wire::REQ_READ, 9, &[strided], Some(b"n"), &[]);
    assert_eq!(
        s.take(),
        vec![
            Seen::Sent(12, 1),
            Seen::Deliver(b"n".to_vec()),
            Seen::Ack(9, wire::ST_OK),
        ]
    );
}

#[test]
fn notification_alone_is_delivered_and_acked() {
    let mut s = Sim::serving();
    let h = RequestHeader {
        kind: wire::REQ_NOTIFY,
        has_notif: true,
        part: false,
        segments: 0,
        id: 3,
        notif_len: 5,
    };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(b"hello");
    s.feed(&b);
    assert_eq!(
        s.take(),
        vec![Seen::Deliver(b"hello".to_vec()), Seen::Ack(3, wire::ST_OK)]
    );
}

#[test]
fn hostile_requests_are_refused_and_the_connection_stays_usable() {
    let mut s = Sim::serving();
    let junk = [0xAB; 80];
    let cases: Vec<(&str, Vec<SegEntry>, u64, u8)> = vec![
        (
            "forged key",
            vec![run(KEY ^ 1, BASE, 16)],
            16,
            wire::ST_BAD_KEY,
        ),
        (
            "past the end",
            vec![run(KEY, BASE + 4090, 16)],
            16,
            wire::ST_OUT_OF_RANGE,
        ),
        (
            "before the start",
            vec![run(KEY, BASE - 8, 16)],
            16,
            wire::ST_OUT_OF_RANGE,
        ),
        (
            "empty run",
            vec![run(KEY, BASE, 0)],
            0,
            wire::ST_OUT_OF_RANGE,
        ),
        (
            "wrapping address",
            vec![run(KEY, u64::MAX - 4, 16)],
            16,
            wire::ST_OUT_OF_RANGE,
        ),
        (
            "one bad run of two",
            vec![run(KEY, BASE, 8), run(KEY ^ 2, BASE, 8)],
            16,
            wire::ST_BAD_KEY,
        ),
        (
            "strided past the end",
            vec![SegEntry {
                key: KEY,
                addr: BASE,
                len: 16,
                stride: 1024,
                blocks: 5,
            }],
            80,
            wire::ST_OUT_OF_RANGE,
        ),
        (
            "no blocks",
            vec![SegEntry {
                key: KEY,
                addr: BASE,
                len: 16,
                stride: 16,
                blocks: 0,
            }],
            0,
            wire::ST_OUT_OF_RANGE,
        ),
    ];
    for (i, (what, runs, len, status)) in cases.into_iter().enumerate() {
        let id = i as u64 + 100;
        s.request(wire::REQ_WRITE, id, &runs, None, &junk[..len as usize]);
        assert_eq!(
            s.take(),
            vec![Seen::Skipped(len), Seen::Ack(id, status)],
            "WRITE, {what}: payload skipped, memory untouched"
        );
        s.request(wire::REQ_READ, id, &runs, Some(b"x"), &[]);
        assert_eq!(
            s.take(),
            vec![Seen::Ack(id, status)],
            "READ, {what}: no data, no notification"
        );
        assert!(s.m.at_boundary(), "{what}: ready for the next request");
    }
    // The connection still works after refusals.
    s.request(wire::REQ_WRITE, 1, &[run(KEY, BASE, 4)], None, b"good");
    assert_eq!(
        s.take(),
        vec![Seen::Received(b"good".to_vec()), Seen::Ack(1, wire::ST_OK)]
    );
}

#[test]
fn limits_and_broken_requests_close_the_connection() {
    let header = |kind, segments, notif_len, has_notif| {
        RequestHeader {
            kind,
            has_notif,
            part: false,
            segments,
            id: 77,
            notif_len,
        }
        .encode()
    };
    // A segment count the target will not allocate for.
    let mut s = Sim::serving();
    s.feed(&header(wire::REQ_WRITE, u32::MAX, 0, false));
    assert_eq!(
        s.take(),
        vec![Seen::Ack(77, wire::ST_TOO_LARGE), Seen::Close]
    );
    assert!(s.m.need().is_none(), "reads nothing more");
    // A notification over the limit, on any kind of request.
    for kind in [wire::REQ_WRITE, wire::REQ_NOTIFY] {
        let mut s = Sim::serving();
        s.feed(&header(kind, 1, u32::MAX, true));
        assert_eq!(
            s.take(),
            vec![Seen::Ack(77, wire::ST_TOO_LARGE), Seen::Close]
        );
    }
    // Run lengths whose total overflows.
    let mut s = Sim::serving();
    let huge = SegEntry {
        key: KEY,
        addr: BASE,
        len: u64::MAX / 2,
        stride: 0,
        blocks: 4,
    };
    s.request(wire::REQ_WRITE, 1, &[huge], None, &[]);
    assert_eq!(s.take(), vec![Seen::Close]);
    // Unknown request kind.
    let mut s = Sim::serving();
    s.feed(&header(0x42, 0, 0, false));
    assert_eq!(s.take(), vec![Seen::Close]);
    // A piece outside its request.
    let mut s = Sim::serving();
    let f = frame(
        wire::REQ_WRITE,
        1,
        &[run(KEY, BASE, 16)],
        None,
        Some((8, 16)),
        &[],
    );
    s.feed(&f);
    assert_eq!(s.take(), vec![Seen::Close]);
}

#[test]
fn pieces_move_their_range_and_are_checked_whole() {
    let mut s = Sim::serving();
    let runs = [run(KEY, BASE, 16), run(KEY, BASE + 32, 16)];
    let f = frame(wire::REQ_WRITE, 4, &runs, None, Some((8, 16)), &[1; 16]);
    s.feed(&f);
    assert_eq!(
        s.take(),
        vec![Seen::Received(vec![1; 16]), Seen::Ack(4, wire::ST_OK)]
    );
    // One bad entry anywhere refuses every piece, whatever range it covers.
    let bad = [run(KEY, BASE, 16), run(KEY ^ 1, BASE + 32, 16)];
    let f = frame(wire::REQ_WRITE, 5, &bad, None, Some((0, 8)), &[1; 8]);
    s.feed(&f);
    assert_eq!(
        s.take(),
        vec![Seen::Skipped(8), Seen::Ack(5, wire::ST_BAD_KEY)]
    );
    let f = frame(wire::REQ_READ, 6, &runs, None, Some((16, 16)), &[]);
    s.feed(&f);
    assert_eq!(s.take(), vec![Seen::Sent(16, 2), Seen::Ack(6, wire::ST_OK)]);
}

#[test]
fn hello_is_checked() {
    let mut bad_magic = wire::hello("x", LISTENER);
    bad_magic[0] ^= 1;
    let mut no_name = wire::hello("x", LISTENER);
    no_name[6..8].copy_from_slice(&0u16.to_le_bytes());
    let mut long_name = wire::hello("x", LISTENER);
    long_name[6..8].copy_from_slice(&(wire::MAX_NAME as u16 + 1).to_le_bytes());
    for (what, hello) in [
        ("magic", bad_magic),
        ("empty name", no_name),
        ("long name", long_name),
    ] {
        let mut s = Sim::new(None);
        s.feed(&hello);
        assert_eq!(s.take(), vec![Seen::Close], "{what}");
    }
    // A name that is not UTF-8.
    let mut s = Sim::new(None);
    let mut h = wire::hello("ab", LISTENER);
    h[8] = 0xff;
    s.feed(&h);
    assert_eq!(s.take(), vec![Seen::Close]);
    // Another version: answered (so the peer can say why), then closed.
    let mut s = Sim::new(None);
    let mut h = wire::hello("ab", LISTENER);
    h[4..6].copy_from_slice(&(wire::VERSION + 1).to_le_bytes());
    s.feed(&h);
    let mut reply = ok_reply();
    *reply.last_mut().unwrap() = 1;
    assert_eq!(s.take(), vec![Seen::Reply(reply), Seen::Close]);
    // The longest name is read whole.
    let mut s = Sim::new(None);
    s.feed(&wire::hello(&"n".repeat(wire::MAX_NAME), LISTENER));
    assert_eq!(s.take(), vec![Seen::Reply(ok_reply())]);
    assert_eq!(s.m.peer(), "n".repeat(wire::MAX_NAME));
    // A hello for another listener (stale connection info): refused, then closed.
    let mut s = Sim::new(None);
    s.feed(&wire::hello("ab", LISTENER ^ 1));
    let mut reply = ok_reply();
    *reply.last_mut().unwrap() = wire::ST_NOT_PEER;
    assert_eq!(s.take(), vec![Seen::Reply(reply), Seen::Close]);
    // Also where this target wants a secret the client did not prove: the client
    // learns it reached another agent, not that it lacks a secret.
    let mut s = Sim::new(Some(SharedSecret::new("s3cret-s3cret-s3cret").unwrap()));
    s.feed(&wire::hello("ab", LISTENER ^ 1));
    let mut reply = ok_reply();
    *reply.last_mut().unwrap() = wire::ST_NOT_PEER;
    assert_eq!(s.take(), vec![Seen::Reply(reply), Seen::Close]);
    // One for any listener (connection info without an id): served.
    let mut s = Sim::new(None);
    s.feed(&wire::hello("ab", wire::ANY_LISTENER));
    assert_eq!(s.take(), vec![Seen::Reply(ok_reply())]);
    // Version 6's hello ends with the name: another version is answered right there.
    let mut s = Sim::new(None);
    let mut h = wire::hello("ab", LISTENER);
    h.truncate(h.len() - 8);
    h[4..6].copy_from_slice(&6u16.to_le_bytes());
    s.feed(&h);
    let mut reply = ok_reply();
    *reply.last_mut().unwrap() = 1;
    assert_eq!(s.take(), vec![Seen::Reply(reply), Seen::Close]);
}

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

/// Run the core's client side of the authentication against the target as agent
/// `name`; the target's answers are what it replied so far.
fn authenticate(s: &mut Sim, key: &SharedSecret, name: &str) -> std::result::Result<(), String> {
    let (mut c, first) = ClientAuth::start(
        wire::AUTH_PROTOCOL,
        key.clone(),
        name,
        "target",
        [9; NONCE_LEN],
    )
    .unwrap();
    s.feed(&first);
    let mut inbox = Vec::new();
    while !c.is_done() {
        for seen in s.take() {
            match seen {
                Seen::Reply(b) => inbox.extend(b),
                Seen::Close => {}
                other => panic!("{other:?} during authentication"),
            }
        }
        let n = c.need();
        if inbox.len() < n {
            return Err("the target stopped answering".into());
        }
        let b: Vec<u8> = inbox.drain(..n).collect();
        let out = c.received(&b).map_err(|r| r.why)?;
        s.feed(&out);
    }
    Ok(())
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
