//! Answers to requests: in and out of order, refusals, hostile answers, READ data,
//! a lost connection, responses cut into frames.

use super::*;

#[test]
fn ids_are_fresh_and_start_at_one() {
    let mut t = table();
    let ids: Vec<u64> = (0..4).map(|_| t.issue()).collect();
    assert_eq!(ids, [1, 2, 3, 4]);
}

#[test]
fn answers_in_order_and_out_of_order_complete_their_own_request() {
    let mut t = table();
    let (a, b, c) = (post(&mut t, None), post(&mut t, None), post(&mut t, None));
    let (id, r) = completes(t.on_frame(ack(c, wire::ST_OK, "")));
    assert_eq!((id, r.is_ok()), (c, true));
    let (id, r) = completes(t.on_frame(ack(a, wire::ST_OK, "")));
    assert_eq!((id, r.is_ok()), (a, true));
    let (id, r) = completes(t.on_frame(ack(b, wire::ST_OK, "")));
    assert_eq!((id, r.is_ok()), (b, true));
}

#[test]
fn an_answer_before_the_write_is_parked_waits_for_it() {
    let mut t = table();
    // A WRITE is being sent: its id is out, its completion still with the sender.
    let id = t.issue();
    assert!(matches!(t.on_frame(ack(id, wire::ST_OK, "")), Answer::Kept));
    assert!(matches!(t.sent(id, Done(id)), Some((Done(i), Ok(()))) if i == id));
    // A refusal that comes early is kept as well.
    let id = t.issue();
    assert!(matches!(
        t.on_frame(ack(id, wire::ST_OUT_OF_RANGE, "outside")),
        Answer::Kept
    ));
    let (Done(i), r) = t.sent(id, Done(id)).expect("answered already");
    assert_eq!(i, id);
    assert_eq!(r.unwrap_err().kind(), ErrorKind::OutOfRange);
    // A late answer finds the parked request.
    let id = t.issue();
    assert!(t.sent(id, Done(id)).is_none());
    assert_eq!(completes(t.on_frame(ack(id, wire::ST_OK, ""))).0, id);
}

#[test]
fn the_target_refusing_says_why_with_the_right_kind() {
    let mut t = table();
    for (status, kind) in [
        (wire::ST_BAD_KEY, ErrorKind::NotAllowed),
        (wire::ST_OUT_OF_RANGE, ErrorKind::OutOfRange),
        (wire::ST_TOO_LARGE, ErrorKind::InvalidArgument),
        (0x77, ErrorKind::Backend),
    ] {
        let id = post(&mut t, None);
        let (got, r) = completes(t.on_frame(ack(id, status, "run 0: unknown or forged key")));
        assert_eq!(got, id);
        let e = r.unwrap_err();
        assert_eq!(e.kind(), kind, "status {status}");
        assert!(e.context().contains("run 0: unknown or forged key"), "{e}");
        assert!(e.context().contains("\"target\""), "{e}");
    }
}

#[test]
fn answers_to_requests_never_sent_break_the_protocol() {
    let mut t = table();
    let id = post(&mut t, None);
    for forged in [0, id + 1, u64::MAX] {
        let (e, p) = broke(t.on_frame(ack(forged, wire::ST_OK, "")));
        assert_eq!((e.kind(), p), (ErrorKind::Backend, None));
        assert!(e.context().contains("never sent"), "{e}");
    }
    // The real request is untouched.
    assert_eq!(completes(t.on_frame(ack(id, wire::ST_OK, ""))).0, id);
}

#[test]
fn endless_answers_to_finished_requests_are_bounded() {
    let mut t = table();
    let ids: Vec<u64> = (0..=MAX_EARLY).map(|_| post(&mut t, None)).collect();
    for &id in &ids {
        assert!(completes(t.on_frame(ack(id, wire::ST_OK, ""))).1.is_ok());
    }
    // Each answered again: kept (each could be a WRITE's) up to a bound, then the
    // target is cut off instead of growing this side's memory.
    for &id in &ids[..MAX_EARLY] {
        assert!(matches!(t.on_frame(ack(id, wire::ST_OK, "")), Answer::Kept));
        // The same one again costs nothing more.
        assert!(matches!(t.on_frame(ack(id, wire::ST_OK, "")), Answer::Kept));
    }
    let (e, p) = broke(t.on_frame(ack(ids[MAX_EARLY], wire::ST_OK, "")));
    assert_eq!((e.kind(), p), (ErrorKind::Backend, None));
    assert!(e.context().contains("not in flight"), "{e}");
}

#[test]
fn a_read_receives_its_data_then_completes_on_its_ack() {
    let mut t = table();
    let id = post(&mut t, Some(4096));
    let Answer::Receive(Done(got)) = t.on_frame(Frame::Data { id, len: 4096 }) else {
        panic!("expected the data to be received");
    };
    assert_eq!(got, id);
    // While the data moves, the request is with the reader: an ACK now is early.
    assert!(t.landed(id, Done(id), 4096).is_none());
    let (got, r) = completes(t.on_frame(ack(id, wire::ST_OK, "")));
    assert_eq!((got, r.is_ok()), (id, true));
}

#[test]
fn stray_or_mismatched_data_breaks_the_protocol() {
    let mut t = table();
    // Data for a request that does not exist: nothing to fail but the connection.
    let (e, p) = broke(t.on_frame(Frame::Data { id: 99, len: 8 }));
    assert_eq!((e.kind(), p), (ErrorKind::Backend, None));
    // Data for a WRITE: that request fails with the protocol error.
    let w = post(&mut t, None);
    let (e, p) = broke(t.on_frame(Frame::Data { id: w, len: 8 }));
    assert_eq!(p, Some(w));
    assert!(e.context().contains("not a READ"), "{e}");
    // Data of the wrong length for a READ: likewise.
    let r = post(&mut t, Some(100));
    let (e, p) = broke(t.on_frame(Frame::Data { id: r, len: 101 }));
    assert_eq!(p, Some(r));
    assert!(
        e.context()
            .contains("101 bytes of data for a 100-byte READ"),
        "{e}"
    );
}

#[test]
fn losing_the_connection_fails_everything_outstanding_with_the_first_reason() {
    let mut t = table();
    let ids: Vec<u64> = (0..3)
        .map(|i| post(&mut t, (i == 1).then_some(64)))
        .collect();
    let writing = t.issue();
    // An answer kept for the WRITE being sent goes with the connection.
    assert!(matches!(
        t.on_frame(ack(writing, wire::ST_OK, "")),
        Answer::Kept
    ));
    let lost = Error::new(
        ErrorKind::RemoteDisconnected,
        "tcp transfer",
        "peer went away",
    );
    let (mut failed, e) = t.fail(lost);
    failed.sort_by_key(|d| d.0);
    assert_eq!(failed, ids.iter().map(|&i| Done(i)).collect::<Vec<_>>());
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected);
    // A second failure does not replace the first reason.
    let (none, _) = t.fail(Error::new(ErrorKind::Canceled, "tcp transfer", "closing"));
    assert!(none.is_empty());
    assert_eq!(t.dead_error().kind(), ErrorKind::RemoteDisconnected);
    // Whatever comes back after is failed with it, never parked.
    let (Done(_), e) = t.park(t.next_id, Done(0), None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected);
    let (Done(id), r) = t.sent(writing, Done(writing)).expect("failed");
    assert_eq!(
        (id, r.unwrap_err().kind()),
        (writing, ErrorKind::RemoteDisconnected)
    );
    let (_, e) = t.landed(ids[1], Done(ids[1]), 64).expect("failed");
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected);
}

#[test]
fn a_closed_connection_without_a_reason_says_so() {
    let t = table();
    let e = t.dead_error();
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected);
    assert!(e.context().contains("is closed"), "{e}");
}

#[test]
fn responses_are_cut_into_frames() {
    let mut s = response(wire::RESP_ACK, wire::ST_OK, 1, b"", 0);
    s.extend(response(wire::RESP_DATA, 0, 2, b"", 3));
    s.extend_from_slice(b"abc");
    s.extend(response(
        wire::RESP_ACK,
        wire::ST_BAD_KEY,
        2,
        b"no such key",
        0,
    ));
    assert_eq!(
        frames(&s),
        vec![
            Ok(ack(1, wire::ST_OK, "")),
            Ok(Frame::Data { id: 2, len: 3 }),
            Ok(ack(2, wire::ST_BAD_KEY, "no such key")),
        ]
    );
}

#[test]
fn hostile_responses_are_refused_before_allocating() {
    // An error message over the limit.
    let mut h = response(wire::RESP_ACK, 1, 1, b"", 0);
    h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let got = frames(&h);
    assert_eq!(got.len(), 1);
    let e = got[0].clone().unwrap_err();
    assert!(e.contains("error message of"), "{e}");
    // An unknown kind.
    let got = frames(&response(0x42, 0, 1, b"", 0));
    assert!(got[0]
        .clone()
        .unwrap_err()
        .contains("unknown response kind"));
    // A message that is not UTF-8 is still an answer.
    let got = frames(&response(wire::RESP_ACK, 1, 7, &[0xff, 0xfe], 0));
    assert!(matches!(
        &got[0],
        Ok(Frame::Ack {
            id: 7,
            status: 1,
            ..
        })
    ));
}

#[test]
fn handshake_takes_the_same_host_offer() {
    let end = handshake(init(None, Want::Yes, false), None, Some(offer()), Ok(()));
    assert_eq!(end.up, Some(Outcome::SameHost));
    assert_eq!(end.opened, Some(offer()));
    assert!(
        end.serving,
        "the target serves requests after the handshake"
    );
}

#[test]
fn handshake_without_the_offer_goes_tcp_with_a_reason() {
    let end = handshake(init(None, Want::Yes, false), None, None, Ok(()));
    assert_eq!(
        end.up,
        Some(Outcome::Tcp(Some("the target does not offer it".into())))
    );
    // An offer that cannot be opened: TCP, saying why.
    let end = handshake(
        init(None, Want::Yes, false),
        None,
        Some(offer()),
        Err("no such process".into()),
    );
    assert_eq!(end.up, Some(Outcome::Tcp(Some("no such process".into()))));
    // Not asked for: the reason given.
    let end = handshake(
        init(None, Want::No("turned off".into()), false),
        None,
        Some(offer()),
        Ok(()),
    );
    assert_eq!(end.up, Some(Outcome::Tcp(Some("turned off".into()))));
    assert!(end.opened.is_none() && end.serving);
    // A further connection: TCP, nothing to say.
    let end = handshake(init(None, Want::Extra, false), None, Some(offer()), Ok(()));
    assert_eq!(end.up, Some(Outcome::Tcp(None)));
    assert!(end.serving);
}

#[test]
fn a_required_same_host_path_that_is_missing_fails_the_connection() {
    for (want, offers, opens) in [
        (Want::Yes, None, Ok(())),
        (Want::Yes, Some(offer()), Err("mapping failed".to_owned())),
        (Want::No("another host".into()), Some(offer()), Ok(())),
    ] {
        let end = handshake(init(None, want, true), None, offers, opens);
        let e = end.failed.expect("failed");
        assert_eq!(e.kind(), ErrorKind::NotSupported);
        assert!(
            e.context().contains("the same-host path is required"),
            "{e}"
        );
    }
}

#[test]
fn handshake_reaches_only_the_listener_it_wants() {
    // Another listener at the peer's address (the peer is gone, its port reused by a
    // restarted agent or any other): refused as a disconnected peer, with or without
    // a secret, and nothing is served.
    let s = || Some(SharedSecret::new("s3cret-s3cret-s3cret").unwrap());
    for secret in [None, s()] {
        let stale = Handshake::new(
            "initiator",
            "target",
            LISTENER + 1,
            "peer \"target\" at 127.0.0.1:1".into(),
            secret.clone(),
            [9; NONCE_LEN],
            Want::Yes,
            false,
        );
        let end = handshake(stale, secret.clone(), Some(offer()), Ok(()));
        let e = end.failed.expect("refused");
        assert_eq!(e.kind(), ErrorKind::RemoteDisconnected);
        assert!(e.context().contains("another agent listens"), "{e}");
        assert!(end
            .target_closed
            .expect("closed")
            .contains("another listener"));
        assert!(end.up.is_none() && end.opened.is_none() && !end.serving);
        // Connection info without a listener id takes whichever answers.
        let any = Handshake::new(
            "initiator",
            "target",
            wire::ANY_LISTENER,
            "peer \"target\" at 127.0.0.1:1".into(),
            secret.clone(),
            [9; NONCE_LEN],
            Want::Yes,
            false,
        );
        let end = handshake(any, secret, Some(offer()), Ok(()));
        assert_eq!(end.up, Some(Outcome::SameHost));
    }
}
