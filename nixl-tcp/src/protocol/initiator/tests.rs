//! The initiator's protocol driven by simulated targets: answers in and out of
//! order, a hostile target's answers (unknown ids, stray data, wrong lengths, broken
//! frames), READ data, the connection dying with requests outstanding, and the
//! handshake against the real target machine.

use nixl::control::NONCE_LEN;

use super::*;
use crate::protocol::target::{self, Refusal, Registry, Target};

/// A request's completion in the tests: which request it was.
#[derive(Debug, PartialEq, Eq)]
struct Done(u64);

fn table() -> Requests<Done> {
    Requests::new("target")
}

/// Issue an id and park it (`read`: a READ of that many bytes).
fn post(t: &mut Requests<Done>, read: Option<u64>) -> u64 {
    let id = t.issue();
    t.park(id, Done(id), read).expect("alive");
    id
}

fn ack(id: u64, status: u8, msg: &str) -> Frame {
    Frame::Ack {
        id,
        status,
        msg: msg.to_owned(),
    }
}

#[track_caller]
fn completes(a: Answer<Done>) -> (u64, Result<()>) {
    match a {
        Answer::Complete(Done(id), r) => (id, r),
        other => panic!("expected a completion, got {other:?}"),
    }
}

#[track_caller]
fn broke(a: Answer<Done>) -> (Error, Option<u64>) {
    match a {
        Answer::Broke(e, p) => (e, p.map(|Done(id)| id)),
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

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

/// Feed `bytes` to a response reader as the socket would (exact reads).
fn frames(bytes: &[u8]) -> Vec<std::result::Result<Frame, String>> {
    let mut r = Responses::default();
    let mut at = 0;
    let mut out = Vec::new();
    loop {
        let need = r.need();
        if at + need.len() > bytes.len() {
            return out;
        }
        need.copy_from_slice(&bytes[at..at + need.len()]);
        at += need.len();
        match r.received() {
            Ok(Some(f)) => {
                if let Frame::Data { len, .. } = f {
                    at += len as usize;
                }
                out.push(Ok(f));
            }
            Ok(None) => {}
            Err(e) => {
                out.push(Err(e));
                return out;
            }
        }
    }
}

fn response(kind: u8, status: u8, id: u64, msg: &[u8], data_len: u64) -> Vec<u8> {
    let h = ResponseHeader {
        kind,
        status,
        msg_len: msg.len() as u32,
        id,
        data_len,
    };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(msg);
    b
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

/// Registrations for the simulated target: none (the handshake touches none).
#[derive(Default)]
struct NoRegs;

impl Registry for NoRegs {
    type Runs = ();

    fn check(&self, _: &[u8], _: &mut ()) -> std::result::Result<(), Refusal> {
        Err(Refusal {
            status: wire::ST_BAD_KEY,
            msg: "none".into(),
        })
    }

    fn restrict(_: &mut (), _: u64, _: u64) {}

    fn clear(_: &mut ()) {}
}

fn offer() -> Offer {
    Offer {
        pid: 4242,
        table_fd: 7,
        table_addr: 0x7000_0000,
        nonce: [5; crate::shm::NONCE_LEN],
    }
}

/// How a simulated handshake ended.
#[derive(Debug)]
struct Ended {
    up: Option<Outcome>,
    failed: Option<Error>,
    /// The offer the initiator was told to open.
    opened: Option<Offer>,
    /// Why the target closed, if it did.
    target_closed: Option<String>,
    /// Whether the target reached its requests.
    serving: bool,
}

/// Run a handshake between the initiator's machine and the real target machine,
/// moving bytes between them as two sockets would. `offers`: what the target offers;
/// `opens`: how opening an offer goes.
fn handshake(
    mut m: Handshake,
    target_secret: Option<SharedSecret>,
    offers: Option<Offer>,
    opens: std::result::Result<(), String>,
) -> Ended {
    let mut t = Target::<NoRegs>::new(target_secret, "target", LISTENER, 1024, [3; NONCE_LEN]);
    let (mut to_target, mut to_init) = (Vec::<u8>::new(), Vec::<u8>::new());
    let mut end = Ended {
        up: None,
        failed: None,
        opened: None,
        target_closed: None,
        serving: false,
    };
    for _ in 0..100 {
        while let Some(a) = m.poll() {
            match a {
                HandshakeAction::Send { bytes, .. } => to_target.extend(bytes),
                HandshakeAction::Open(o) => {
                    end.opened = Some(o);
                    m.opened(opens.clone());
                }
                HandshakeAction::Up(o) => end.up = Some(o),
                HandshakeAction::Fail(e) => end.failed = Some(e),
            }
        }
        while let Some(a) = t.poll() {
            match a {
                target::Action::Reply(b) => to_init.extend(b),
                target::Action::Offer => t.offered(offers.as_ref()),
                target::Action::Close(why) => end.target_closed = Some(why),
                other => panic!("unexpected target action {other:?}"),
            }
        }
        let mut moved = false;
        if let Some(buf) = m.need() {
            if buf.len() <= to_init.len() {
                let n = buf.len();
                buf.copy_from_slice(&to_init[..n]);
                to_init.drain(..n);
                m.received();
                moved = true;
            }
        }
        if let Some(buf) = t.need() {
            if buf.len() <= to_target.len() {
                let n = buf.len();
                buf.copy_from_slice(&to_target[..n]);
                to_target.drain(..n);
                t.received(&NoRegs);
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    end.serving = t.at_boundary();
    end
}

/// The simulated target's listener id.
const LISTENER: u64 = 0x5eed;

fn init(secret: Option<SharedSecret>, want: Want, require: bool) -> Handshake {
    Handshake::new(
        "initiator",
        "target",
        LISTENER,
        "peer \"target\" at 127.0.0.1:1".into(),
        secret,
        [9; NONCE_LEN],
        want,
        require,
    )
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

/// Registrations that take every run: the target machine's parsing alone.
#[derive(Default)]
struct TakeAll;

impl Registry for TakeAll {
    type Runs = Option<(u64, u64)>;

    fn check(&self, _: &[u8], runs: &mut Self::Runs) -> std::result::Result<(), Refusal> {
        *runs = Some((0, u64::MAX));
        Ok(())
    }

    fn restrict(runs: &mut Self::Runs, from: u64, len: u64) {
        *runs = Some((from, len));
    }

    fn clear(runs: &mut Self::Runs) {
        *runs = None;
    }
}

/// A target past its handshake (no secret, no same-host path).
fn serving_target() -> Target<TakeAll> {
    let mut t = Target::<TakeAll>::new(None, "target", LISTENER, 1024, [0; NONCE_LEN]);
    let feed = |t: &mut Target<TakeAll>, bytes: &[u8]| {
        let buf = t.need().expect("reading");
        buf.copy_from_slice(&bytes[..buf.len()]);
        t.received(&TakeAll);
    };
    let hello = wire::hello("initiator", LISTENER);
    feed(&mut t, &hello[..4]);
    feed(&mut t, &hello[4..8]);
    feed(&mut t, &hello[8..17]);
    feed(&mut t, &hello[17..]);
    feed(&mut t, &[0]);
    while t.poll().is_some() {}
    assert!(t.at_boundary());
    t
}

/// Feed a whole request to the target and collect what it does.
fn serve(t: &mut Target<TakeAll>, bytes: &[u8]) -> Vec<target::Action> {
    let mut at = 0;
    let mut seen = Vec::new();
    loop {
        while let Some(a) = t.poll() {
            seen.push(a);
        }
        match t.need() {
            Some(buf) if at + buf.len() <= bytes.len() => {
                let n = buf.len();
                buf.copy_from_slice(&bytes[at..at + n]);
                at += n;
                t.received(&TakeAll);
            }
            _ => return seen,
        }
    }
}

fn run_table(entries: u64) -> Vec<u8> {
    let mut table = Vec::new();
    for i in 0..entries {
        wire::SegEntry {
            key: 1,
            addr: 0x1000 * (i + 1),
            len: 512,
            stride: 512,
            blocks: 2,
        }
        .encode_into(&mut table);
    }
    table
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

/// A hold-back with a bound of 8 s (checked every 2 s), and the instant `s` seconds
/// after its start.
fn hold_back() -> (HoldBack, impl Fn(u64) -> Instant) {
    let t0 = Instant::now();
    (HoldBack::new("target", Duration::from_secs(8)), move |s| {
        t0 + Duration::from_secs(s)
    })
}

/// Check at every deadline up to `until` s, with `outstanding`; the first error.
fn run_checks(
    h: &mut HoldBack,
    at: &impl Fn(u64) -> Instant,
    until: u64,
    outstanding: bool,
) -> Option<(u64, nixl::Error)> {
    for s in 0..=until {
        if h.deadline().is_some_and(|d| d <= at(s)) {
            if let Err(e) = h.timed_out(at(s), outstanding) {
                return Some((s, e));
            }
        }
    }
    None
}

fn ok_ack(id: u64) -> Frame {
    Frame::Ack {
        id,
        status: wire::ST_OK,
        msg: String::new(),
    }
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
