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

mod answers;
mod handshake;
