//! The handshake against simulated and real targets, pieces and notifications at
//! the target, and holding back (pause, resume, the pause bound).

use super::*;

#[test]
fn handshake_authenticates_both_ways() {
    let s = || Some(SharedSecret::new("s3cret-s3cret-s3cret").unwrap());
    let end = handshake(init(s(), Want::Yes, false), s(), Some(offer()), Ok(()));
    assert_eq!(end.up, Some(Outcome::SameHost));
    // The wrong secret: the target's proof fails at the initiator, which proves
    // nothing and hangs up.
    let wrong = Some(SharedSecret::new("another-secret-entirely").unwrap());
    let end = handshake(init(wrong, Want::Yes, false), s(), None, Ok(()));
    let e = end.failed.expect("refused");
    assert_eq!(e.kind(), ErrorKind::NotAllowed);
    assert!(e.context().contains("failed to prove"), "{e}");
    assert!(end.up.is_none() && !end.serving);
    // The right secret at another agent than the one expected: refused too.
    let elsewhere = Handshake::new(
        "initiator",
        "decode-9",
        LISTENER,
        "peer \"decode-9\" at 127.0.0.1:1".into(),
        s(),
        [9; NONCE_LEN],
        Want::Yes,
        false,
    );
    let end = handshake(elsewhere, s(), None, Ok(()));
    let e = end.failed.expect("refused");
    assert!(e.context().contains("\"decode-9\""), "{e}");
    assert!(end.up.is_none() && !end.serving);
    // One side has a secret, the other none: refused before anything else.
    for (ours, theirs, why) in [
        (s(), None, "it does not authenticate"),
        (None, s(), "it requires a shared secret"),
    ] {
        let end = handshake(init(ours, Want::Yes, false), theirs, None, Ok(()));
        let e = end.failed.expect("refused");
        assert_eq!(e.kind(), ErrorKind::NotAllowed);
        assert!(e.context().contains(why), "{e}");
    }
}

#[test]
fn a_target_that_cannot_prove_the_secret_is_refused() {
    let s = SharedSecret::new("s3cret-s3cret-s3cret").unwrap();
    let mut m = init(Some(s), Want::Yes, false);
    // The authentication comes first; the hello only after it.
    assert!(matches!(
        m.poll(),
        Some(HandshakeAction::Send { what: "auth", .. })
    ));
    assert!(m.poll().is_none());
    assert_eq!(m.what(), "auth reply");
    m.need().unwrap().copy_from_slice(&[0]);
    m.received();
    // A forged proof.
    m.need().unwrap().copy_from_slice(&[1; NONCE_LEN + 32]);
    m.received();
    let Some(HandshakeAction::Fail(e)) = m.poll() else {
        panic!("expected the handshake to fail");
    };
    assert_eq!(e.kind(), ErrorKind::NotAllowed);
    assert!(e.context().contains("failed to prove"), "{e}");
    assert!(m.need().is_none(), "nothing is read after a failure");
}

#[test]
fn a_foreign_or_refusing_endpoint_fails_the_handshake() {
    let reply = |magic: &[u8], version: u16, status: u8| {
        let mut m = init(None, Want::Yes, false);
        m.poll();
        let mut r = magic.to_vec();
        r.extend_from_slice(&version.to_le_bytes());
        r.push(status);
        m.need().unwrap().copy_from_slice(&r);
        m.received();
        match m.poll() {
            Some(HandshakeAction::Fail(e)) => e,
            other => panic!("expected a failure, got {other:?}"),
        }
    };
    assert_eq!(reply(b"HTTP", wire::VERSION, 0).kind(), ErrorKind::Mismatch);
    assert_eq!(
        reply(&wire::MAGIC, wire::VERSION + 1, 0).kind(),
        ErrorKind::Mismatch
    );
    let e = reply(&wire::MAGIC, wire::VERSION, wire::ST_REFUSED);
    assert_eq!(e.kind(), ErrorKind::NotAllowed);
    assert!(e.context().contains("the name differs"), "{e}");
    let e = reply(&wire::MAGIC, wire::VERSION, 9);
    assert_eq!(e.kind(), ErrorKind::NotAllowed);
    assert!(e.context().contains("handshake refused (status 9)"), "{e}");
}

#[test]
fn a_piece_of_a_write_moves_its_range_at_the_target() {
    let mut t = serving_target();
    let table = run_table(2);
    let (head, n) = request_head(wire::REQ_WRITE, 2, Some((1000, 500)), None, 7);
    assert_eq!(n, wire::HEADER_LEN + wire::PART_LEN);
    let mut req = head[..n].to_vec();
    req.extend_from_slice(&table);
    let seen = serve(&mut t, &req);
    assert_eq!(seen, vec![target::Action::Receive { len: 500 }]);
    assert_eq!(t.runs(), &Some((1000, 500)));
    t.moved();
    let acked = serve(&mut t, &[]);
    assert!(matches!(
        acked.as_slice(),
        [target::Action::Ack {
            id: 7,
            status: wire::ST_OK,
            ..
        }]
    ));
}

#[test]
fn a_read_with_a_notification_and_a_notification_alone_reach_the_target() {
    let mut t = serving_target();
    let (head, n) = request_head(wire::REQ_READ, 1, None, Some(5), 8);
    assert_eq!(n, wire::HEADER_LEN);
    let mut req = head[..n].to_vec();
    req.extend_from_slice(&run_table(1));
    req.extend_from_slice(b"hello");
    let seen = serve(&mut t, &req);
    assert!(matches!(seen.as_slice(), [target::Action::SendData(_)]));
    t.moved();
    let after = serve(&mut t, &[]);
    assert!(matches!(
        after.as_slice(),
        [target::Action::Deliver(n), target::Action::Ack { id: 8, status: wire::ST_OK, .. }] if &n[..] == b"hello"
    ));
    let (head, n) = request_head(wire::REQ_NOTIFY, 0, None, Some(3), 9);
    let mut req = head[..n].to_vec();
    req.extend_from_slice(b"bye");
    let seen = serve(&mut t, &req);
    assert!(matches!(
        seen.as_slice(),
        [target::Action::Deliver(n), target::Action::Ack { id: 9, status: wire::ST_OK, .. }] if &n[..] == b"bye"
    ));
}

#[test]
fn the_user_timeout_comes_back_only_once_the_target_answers_after_resuming() {
    let (mut h, at) = hold_back();
    let ack = ok_ack;
    // Answers with nothing held back change nothing.
    assert_eq!(h.on_frame(&ack(1), || 2, at(0)), None);
    assert_eq!(
        h.on_frame(&Frame::Paused(true), || 5, at(0)),
        Some(UserTimeout::Lift)
    );
    assert_eq!(
        h.on_frame(&Frame::Paused(true), || 5, at(0)),
        None,
        "lifted once"
    );
    assert_eq!(h.on_frame(&ack(3), || 5, at(0)), None);
    // RESUME, then answers to requests sent before it: still lifted.
    assert_eq!(h.on_frame(&Frame::Paused(false), || 5, at(0)), None);
    assert_eq!(h.on_frame(&ack(4), || 9, at(0)), None);
    // An answer to a request sent after RESUME: the target reads again.
    let data = Frame::Data { id: 5, len: 8 };
    assert_eq!(h.on_frame(&data, || 9, at(0)), Some(UserTimeout::Restore));
    assert_eq!(h.deadline(), None, "nothing held back, nothing to time");
    assert_eq!(h.on_frame(&ack(6), || 9, at(0)), None);
    // A RESUME without a PAUSE is nothing to act on.
    assert_eq!(h.on_frame(&Frame::Paused(false), || 9, at(0)), None);
    assert_eq!(h.on_frame(&ack(10), || 11, at(0)), None);
}

/// Hole 8 of issue 39: a target that says PAUSE and then never reads again stalled
/// its initiator's requests forever (the user timeout lifted, nothing else timing).
/// The hold-back is bounded: requests that waited the whole limit without an answer
/// close the connection with a `TimedOut` naming the stall, and never sooner.
#[test]
fn a_target_that_pauses_and_never_answers_is_cut_at_the_bound() {
    let (mut h, at) = hold_back();
    assert_eq!(h.deadline(), None);
    assert_eq!(
        h.on_frame(&Frame::Paused(true), || 2, at(0)),
        Some(UserTimeout::Lift)
    );
    assert_eq!(
        h.deadline(),
        Some(at(2)),
        "checked every quarter of the limit"
    );
    // Requests wait from the first check on: cut 8 s later, not before.
    let (s, e) = run_checks(&mut h, &at, 30, true).expect("cut");
    assert_eq!(s, 10);
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    assert!(e.context().contains("\"target\" stalled"), "{e}");
    assert!(e.context().contains("TcpOptions::pause_timeout"), "{e}");
}

/// PAUSE and RESUME frames move nothing on: a target cycling them without reading
/// (or answering) is cut at the same bound as one that paused once.
#[test]
fn pausing_and_resuming_without_answers_does_not_stretch_the_bound() {
    let (mut h, at) = hold_back();
    h.on_frame(&Frame::Paused(true), || 2, at(0));
    for s in 1..=30 {
        let paused = s % 2 == 0;
        assert_eq!(h.on_frame(&Frame::Paused(paused), || 2, at(s)), None);
        if h.deadline().is_some_and(|d| d <= at(s)) && h.timed_out(at(s), true).is_err() {
            assert_eq!(s, 10);
            return;
        }
    }
    panic!("never cut");
}

/// A slow target that keeps answering is never cut: each answer starts the bound
/// again, however long the hold-back lasts in all.
#[test]
fn each_answer_while_held_back_starts_the_bound_again() {
    let (mut h, at) = hold_back();
    h.on_frame(&Frame::Paused(true), || 2, at(0));
    for s in 0..=100 {
        if s % 7 == 0 {
            // An answer to a request sent before any RESUME: still held back.
            h.answered(at(s));
            assert_eq!(h.on_frame(&ok_ack(1), || 2, at(s)), None);
        }
        if h.deadline().is_some_and(|d| d <= at(s)) {
            assert!(h.timed_out(at(s), true).is_ok(), "cut at {s} s");
        }
    }
    assert!(
        run_checks(&mut h, &at, 200, true).is_some(),
        "then silence is cut"
    );
}

/// Time with nothing waiting counts for nothing, and the hold-back stays on (the
/// target never said it reads again): a request posted late is cut only once it
/// waited the whole limit itself, and the user timeout is not restored meanwhile.
#[test]
fn a_hold_back_with_nothing_waiting_cuts_no_one_and_stays() {
    let (mut h, at) = hold_back();
    h.on_frame(&Frame::Paused(true), || 2, at(0));
    // Idle for a minute: nothing cut, still held back (checks go on).
    assert!(run_checks(&mut h, &at, 59, false).is_none());
    assert!(h.deadline().is_some(), "still held back");
    // A request from 59 s on: cut no sooner than 8 s after it was first seen.
    let (s, _) = (60..=100)
        .find_map(|s| {
            (h.deadline().is_some_and(|d| d <= at(s)))
                .then(|| h.timed_out(at(s), true).err().map(|e| (s, e)))
                .flatten()
        })
        .expect("cut");
    assert!((68..=70).contains(&s), "cut at {s} s");
    // An answer after RESUME ends it all.
    let (mut h, at) = hold_back();
    h.on_frame(&Frame::Paused(true), || 2, at(0));
    h.on_frame(&Frame::Paused(false), || 3, at(1));
    assert_eq!(
        h.on_frame(&ok_ack(3), || 4, at(1)),
        Some(UserTimeout::Restore)
    );
    assert_eq!(h.deadline(), None);
}

/// A bound too large to add to the clock is no bound (never an instant cut).
#[test]
fn an_endless_pause_bound_never_cuts() {
    let t0 = Instant::now();
    let mut h = HoldBack::new("target", Duration::MAX);
    h.on_frame(&Frame::Paused(true), || 2, t0);
    let year = Duration::from_secs(365 * 24 * 3600);
    assert!(h.deadline().is_none_or(|d| d > t0 + year));
    assert!(h.timed_out(t0 + year, true).is_ok());
}

/// What waits for the target: requests in the table and a WRITE whose payload is
/// being sent; none once answered or once the connection died.
#[test]
fn outstanding_counts_requests_sent_and_being_sent() {
    let mut t = table();
    assert!(!t.outstanding());
    let id = t.issue();
    t.sending(id);
    assert!(t.outstanding(), "a payload being sent waits for the target");
    assert!(t.sent(id, Done(id)).is_none());
    assert!(t.outstanding(), "sent, not answered");
    assert!(matches!(
        t.on_frame(ack(id, wire::ST_OK, "")),
        Answer::Complete(..)
    ));
    assert!(!t.outstanding());
    let id = t.issue();
    t.sending(id);
    let _ = t.fail(Error::new(ErrorKind::RemoteDisconnected, "t", "gone"));
    assert!(!t.outstanding());
}
