//! Requests at the target: WRITE, READ, notifications, hostile requests, pieces,
//! and the hello.

use super::*;

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
