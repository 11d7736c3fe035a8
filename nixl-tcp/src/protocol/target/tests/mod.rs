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

mod handshake;
mod requests;
