//! The target's side of a connection as a plain state machine: it is told the bytes
//! it asked for and what the I/O task finished, and says what to do next. No
//! sockets, no clocks; the I/O task (`crate::target`) only moves bytes.
//!
//! The machine reads the authentication (the core's [`ServerAuth`], where a secret is
//! set), the hello and the same-host request, then
//! one request after another: header, a piece's range, the run table and the
//! notification, each of the length the previous part announced (bounded before
//! anything is allocated, and read in chunks of at most [`GROW`] bytes, so memory
//! grows only as bytes arrive: a header alone allocates nothing large). A request
//! moving more than the target's byte cap in all is refused. A request is checked whole against the registrations
//! ([`Registry::check`]) before any byte of registered memory is touched; its
//! payload itself moves between socket and memory in the I/O task
//! ([`Action::Receive`], [`Action::Skip`], [`Action::SendData`]), which then calls
//! [`Target::moved`]. A refused WRITE's payload is skipped, so the connection stays
//! usable; a request the target will not even read closes the connection.

use std::collections::VecDeque;

use bytes::Bytes;
use nixl::control::{Refusal as AuthRefusal, ServerAuth, AUTH_MAGIC, NONCE_LEN};
use nixl::SharedSecret;

use crate::wire::{self, Offer, RequestHeader, ResponseHeader, SegEntry};

/// The most a run table or notification buffer grows ahead of the bytes that
/// arrived: a header may announce up to [`wire::MAX_ENTRIES`] runs (40 MiB), but
/// only a peer that sends them gets them allocated.
pub(crate) const GROW: usize = 64 << 10;

/// Default cap on the bytes one READ or WRITE request moves at the target, over all
/// its runs (`TcpOptions::max_request_bytes`).
pub(crate) const DEFAULT_MAX_REQUEST: u64 = 64 << 30;

/// Why a request was refused (its ACK's status and message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) status: u8,
    pub(crate) msg: String,
}

/// The registrations requests are checked against.
pub(crate) trait Registry {
    /// The checked runs of a request: what its data moves through.
    type Runs: Default;
    /// Check every entry of `table` (whole `SEG_LEN` entries); fill `runs` only if
    /// all pass.
    fn check(&self, table: &[u8], runs: &mut Self::Runs) -> Result<(), Refusal>;
    /// Keep only bytes `from..from + len` of `runs` (a piece of the request).
    fn restrict(runs: &mut Self::Runs, from: u64, len: u64);
    /// Empty `runs` (letting go of what they hold), keeping their capacity.
    fn clear(runs: &mut Self::Runs);
}

/// What the I/O task does next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Write these handshake bytes and flush.
    Reply(Vec<u8>),
    /// Write an ACK for request `id` and flush.
    Ack { id: u64, status: u8, msg: String },
    /// The initiator asks for the same-host path: make an offer (or not) and pass it
    /// to [`Target::offered`].
    Offer,
    /// Hand a notification to the agent.
    Deliver(Bytes),
    /// Receive `len` bytes from the socket into the checked runs, then
    /// [`Target::moved`].
    Receive { len: u64 },
    /// Read and discard `len` bytes (a refused WRITE's payload), then
    /// [`Target::moved`].
    Skip(u64),
    /// Write this DATA header and then the checked runs' bytes, then
    /// [`Target::moved`].
    SendData([u8; wire::HEADER_LEN]),
    /// Close the connection: the peer broke the protocol or a limit.
    Close(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The first four bytes: [`AUTH_MAGIC`] or, after authentication or without a
    /// secret, the hello's magic.
    Start,
    /// The rest of the hello's header: version and name length.
    Hello,
    Name {
        version_ok: bool,
    },
    /// The listener id the hello wants, after its name.
    Listener,
    Auth,
    Want,
    /// Waiting for [`Target::offered`].
    Offering,
    Header,
    Part,
    Table,
    Notif,
    /// Waiting for the I/O task to move a payload ([`Target::moved`]).
    Moving,
    Closed,
}

/// What follows a payload once it moved.
#[derive(Debug)]
enum After {
    /// Deliver the notification (if any), then ACK with success.
    Done,
    /// ACK with this refusal.
    Refused(Refusal),
}

/// One incoming connection's protocol state.
#[derive(Debug)]
pub(crate) struct Target<R: Registry> {
    step: Step,
    /// The bytes asked for: `need` of `small`, or `need` bytes of the table or the
    /// notification, which grow [`GROW`] bytes at a time as they arrive.
    small: [u8; wire::HEADER_LEN],
    need: usize,
    /// How many bytes of the table or notification arrived.
    have: usize,
    table: Vec<u8>,
    notif: Vec<u8>,
    /// Most bytes one request moves in all.
    max_request: u64,
    secret: Option<SharedSecret>,
    /// This agent's name, which the authentication proves to the peer.
    me: String,
    /// This listener's id (in its connection info); a hello wanting another is
    /// refused.
    listener: u64,
    nonce: [u8; NONCE_LEN],
    /// The authentication under way.
    auth: Option<ServerAuth>,
    /// The name the peer proved; its hello must give the same.
    proven: Option<String>,
    max_notification: usize,
    peer: String,
    /// The request being read or served.
    head: RequestHeader,
    part: Option<(u64, u64)>,
    note: Option<Bytes>,
    runs: R::Runs,
    after: Option<After>,
    out: VecDeque<Action>,
}

fn header_none() -> RequestHeader {
    RequestHeader {
        kind: 0,
        has_notif: false,
        part: false,
        segments: 0,
        id: 0,
        notif_len: 0,
    }
}

impl<R: Registry> Target<R> {
    /// A new connection to agent `me`; `nonce` is this side's authentication
    /// challenge (used only with a secret).
    pub(crate) fn new(
        secret: Option<SharedSecret>,
        me: &str,
        listener: u64,
        max_notification: usize,
        nonce: [u8; NONCE_LEN],
    ) -> Self {
        Self {
            step: Step::Start,
            small: [0; wire::HEADER_LEN],
            need: 4,
            have: 0,
            table: Vec::new(),
            notif: Vec::new(),
            max_request: DEFAULT_MAX_REQUEST,
            secret,
            me: me.to_owned(),
            listener,
            nonce,
            auth: None,
            proven: None,
            max_notification,
            peer: String::new(),
            head: header_none(),
            part: None,
            note: None,
            runs: R::Runs::default(),
            after: None,
            out: VecDeque::new(),
        }
    }

    /// Refuse READ and WRITE requests that move more than `bytes` in all.
    pub(crate) fn with_max_request(mut self, bytes: u64) -> Self {
        self.max_request = bytes;
        self
    }

    /// Whether the handshake is still under way (hello, authentication, same-host
    /// request and offer).
    pub(crate) fn handshaking(&self) -> bool {
        matches!(
            self.step,
            Step::Start
                | Step::Hello
                | Step::Name { .. }
                | Step::Listener
                | Step::Auth
                | Step::Want
                | Step::Offering
        )
    }

    /// The peer's agent name (empty before its hello).
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    /// The checked runs of the request whose payload moves now.
    pub(crate) fn runs(&self) -> &R::Runs {
        &self.runs
    }

    /// The next thing to do, until there is none: then read [`Target::need`].
    pub(crate) fn poll(&mut self) -> Option<Action> {
        self.out.pop_front()
    }

    /// Where the bytes the machine waits for go (read exactly this many), or `None`
    /// while it waits for the I/O task or is closed.
    pub(crate) fn need(&mut self) -> Option<&mut [u8]> {
        match self.step {
            Step::Offering | Step::Moving | Step::Closed => None,
            Step::Table | Step::Name { .. } | Step::Auth => {
                Some(grow(&mut self.table, self.have, self.need))
            }
            Step::Notif => Some(grow(&mut self.notif, self.have, self.need)),
            _ => Some(&mut self.small[..self.need]),
        }
    }

    /// Whether the connection may end here: between requests.
    pub(crate) fn at_boundary(&self) -> bool {
        self.step == Step::Header
    }

    fn close(&mut self, why: impl Into<String>) {
        self.step = Step::Closed;
        self.out.push_back(Action::Close(why.into()));
    }

    fn ask(&mut self, step: Step, n: usize) {
        self.step = step;
        self.need = n;
        self.have = 0;
    }

    /// The bytes [`Target::need`] asked for arrived.
    pub(crate) fn received(&mut self, registry: &R) {
        // The table and the notification arrive a chunk at a time.
        match self.step {
            Step::Table | Step::Name { .. } | Step::Auth => self.have = self.table.len(),
            Step::Notif => self.have = self.notif.len(),
            _ => {}
        }
        if matches!(
            self.step,
            Step::Table | Step::Name { .. } | Step::Auth | Step::Notif
        ) && self.have < self.need
        {
            return;
        }
        match self.step {
            Step::Start => self.on_start(),
            Step::Hello => self.on_hello(),
            Step::Name { version_ok } => self.on_name(version_ok),
            Step::Listener => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&self.small[..8]);
                self.on_listener(u64::from_le_bytes(b));
            }
            Step::Auth => self.on_auth(),
            Step::Want => {
                if self.small[0] == 1 {
                    self.step = Step::Offering;
                    self.out.push_back(Action::Offer);
                } else {
                    self.serving();
                }
            }
            Step::Header => self.on_header(registry),
            Step::Part => {
                let mut b = [0u8; wire::PART_LEN];
                b.copy_from_slice(&self.small[..wire::PART_LEN]);
                self.part = Some(wire::decode_part(&b));
                self.table_next(registry);
            }
            Step::Table => self.notif_next(registry),
            Step::Notif => {
                let n = Bytes::from(std::mem::take(&mut self.notif));
                if self.head.kind == wire::REQ_NOTIFY {
                    self.out.push_back(Action::Deliver(n));
                    self.ack(wire::ST_OK, String::new());
                    self.ask(Step::Header, wire::HEADER_LEN);
                } else {
                    self.note = Some(n);
                    self.evaluate(registry);
                }
            }
            Step::Offering | Step::Moving | Step::Closed => {}
        }
    }

    fn on_start(&mut self) {
        let head = [self.small[0], self.small[1], self.small[2], self.small[3]];
        if head == wire::MAGIC {
            return self.ask(Step::Hello, 4);
        }
        if head != AUTH_MAGIC {
            return self.close("not a nixl-tcp hello");
        }
        match (&self.secret, &self.auth, &self.proven) {
            (None, _, _) => self.refuse_auth(AuthRefusal::no_secret_here()),
            (Some(_), None, None) => {
                let secret = self.secret.clone().expect("matched above");
                let auth = ServerAuth::new(wire::AUTH_PROTOCOL, secret, &self.me, self.nonce);
                self.table.clear();
                self.ask(Step::Auth, auth.need());
                self.auth = Some(auth);
            }
            _ => self.close("authenticated twice"),
        }
    }

    fn refuse_auth(&mut self, r: AuthRefusal) {
        if let Some(reply) = r.reply {
            self.out.push_back(Action::Reply(reply));
        }
        self.close(r.why);
    }

    fn on_auth(&mut self) {
        let Some(auth) = self.auth.as_mut() else {
            return self.close("authentication without a secret");
        };
        match auth.received(&self.table) {
            Err(r) => self.refuse_auth(r),
            Ok(out) => {
                if !out.is_empty() {
                    self.out.push_back(Action::Reply(out));
                }
                let next = auth.need();
                if next > 0 {
                    self.table.clear();
                    return self.ask(Step::Auth, next);
                }
                // Proven: the hello follows.
                self.proven = auth.proven().map(str::to_owned);
                self.auth = None;
                self.ask(Step::Start, 4);
            }
        }
    }

    fn on_hello(&mut self) {
        let hello = &self.small[..4];
        let version_ok = hello[..2] == wire::VERSION.to_le_bytes();
        let name_len = u16::from_le_bytes([hello[2], hello[3]]) as usize;
        if name_len == 0 || name_len > wire::MAX_NAME {
            return self.close(format!("peer name of {name_len} bytes"));
        }
        // The name may be longer than `small`: read it into the table buffer.
        self.table.clear();
        self.ask(Step::Name { version_ok }, name_len);
    }

    fn on_name(&mut self, version_ok: bool) {
        let Ok(peer) = std::str::from_utf8(&self.table) else {
            return self.close("peer name is not UTF-8");
        };
        self.peer = peer.to_owned();
        if version_ok {
            self.ask(Step::Listener, 8);
        } else {
            // Another version's hello may end here: answer now.
            self.reply(1);
        }
    }

    fn on_listener(&mut self, wanted: u64) {
        // Another listener first: that client wants an agent that is not here, and
        // the id it names is public (connection info) whatever it proved.
        let status = match (&self.secret, &self.proven) {
            _ if wanted != wire::ANY_LISTENER && wanted != self.listener => wire::ST_NOT_PEER,
            (Some(_), None) => wire::ST_AUTH,
            (None, _) => wire::ST_OK,
            (Some(_), Some(name)) if *name == self.peer => wire::ST_OK,
            (Some(_), Some(_)) => wire::ST_REFUSED,
        };
        self.reply(status);
    }

    /// Answer the hello with `status`; go on after `ST_OK`, else close.
    fn reply(&mut self, status: u8) {
        let mut reply = Vec::with_capacity(7);
        reply.extend_from_slice(&wire::MAGIC);
        reply.extend_from_slice(&wire::VERSION.to_le_bytes());
        reply.push(status);
        self.out.push_back(Action::Reply(reply));
        match status {
            wire::ST_OK => self.ask(Step::Want, 1),
            wire::ST_AUTH => self.close(format!(
                "peer {:?} did not prove the shared secret",
                self.peer
            )),
            wire::ST_REFUSED => self.close(format!(
                "peer authenticated as {:?} but says hello as {:?}",
                self.proven.as_deref().unwrap_or_default(),
                self.peer
            )),
            wire::ST_NOT_PEER => self.close(format!(
                "peer {:?} wants another listener (stale connection info)",
                self.peer
            )),
            _ => self.close("unsupported protocol version"),
        }
    }

    /// The same-host offer the I/O task made (or not) for [`Action::Offer`].
    pub(crate) fn offered(&mut self, offer: Option<&Offer>) {
        if self.step != Step::Offering {
            return;
        }
        let reply = match offer {
            Some(o) => {
                let mut b = Vec::with_capacity(1 + wire::OFFER_LEN);
                b.push(1);
                b.extend_from_slice(&wire::encode_offer(o));
                b
            }
            None => vec![0],
        };
        self.out.push_back(Action::Reply(reply));
        self.serving();
    }

    /// The handshake is over: requests from here on.
    fn serving(&mut self) {
        tracing::debug!(peer = %self.peer, "tcp: peer connected");
        self.ask(Step::Header, wire::HEADER_LEN);
    }

    fn ack(&mut self, status: u8, msg: String) {
        self.out.push_back(Action::Ack {
            id: self.head.id,
            status,
            msg,
        });
    }

    fn on_header(&mut self, registry: &R) {
        let mut b = [0u8; wire::HEADER_LEN];
        b.copy_from_slice(&self.small[..wire::HEADER_LEN]);
        let h = RequestHeader::decode(&b);
        self.head = h;
        self.part = None;
        self.note = None;
        if h.notif_len as usize > self.max_notification {
            self.ack(wire::ST_TOO_LARGE, "notification too large".into());
            return self.close(format!("notification of {} bytes", h.notif_len));
        }
        match h.kind {
            wire::REQ_NOTIFY => {
                self.notif = Vec::new();
                self.ask(Step::Notif, h.notif_len as usize);
            }
            wire::REQ_WRITE | wire::REQ_READ => {
                if h.segments > wire::MAX_ENTRIES {
                    self.ack(wire::ST_TOO_LARGE, "too many run entries".into());
                    return self.close(format!("{} segments", h.segments));
                }
                if h.part {
                    self.ask(Step::Part, wire::PART_LEN);
                } else {
                    self.table_next(registry);
                }
            }
            other => self.close(format!("unknown request kind {other:#x}")),
        }
    }

    /// Read the run table next (nothing to read for none).
    fn table_next(&mut self, registry: &R) {
        self.table.clear();
        let len = self.head.segments as usize * wire::SEG_LEN;
        if len == 0 {
            return self.notif_next(registry);
        }
        self.ask(Step::Table, len);
    }

    /// Read the notification next, if the request carries one; else serve it.
    fn notif_next(&mut self, registry: &R) {
        if !self.head.has_notif {
            return self.evaluate(registry);
        }
        self.notif = Vec::new();
        if self.head.notif_len == 0 {
            self.note = Some(Bytes::new());
            return self.evaluate(registry);
        }
        self.ask(Step::Notif, self.head.notif_len as usize);
    }

    /// The request is read (but for a WRITE's payload): check it whole, then move its
    /// data or refuse it.
    fn evaluate(&mut self, registry: &R) {
        let total = SegEntry::decode_all(&self.table).try_fold(0u64, |total, e| {
            e.bytes().and_then(|b| total.checked_add(b))
        });
        let Some(total) = total else {
            return self.close("segment lengths overflow");
        };
        // A piece moves its range of the request; the whole request is checked all
        // the same, so every piece of a bad one is refused.
        let (from, len) = self.part.unwrap_or((0, total));
        if from.checked_add(len).is_none_or(|end| end > total) {
            return self.close(format!(
                "piece {from}+{len} outside a request of {total} bytes"
            ));
        }
        if total > self.max_request {
            let refusal = Refusal {
                status: wire::ST_TOO_LARGE,
                msg: format!(
                    "a request of {total} bytes is over this target's limit of {} bytes per request (TcpOptions::max_request_bytes)",
                    self.max_request
                ),
            };
            return self.refuse(refusal, len);
        }
        let checked = registry.check(&self.table, &mut self.runs);
        if checked.is_ok() && self.part.is_some() {
            R::restrict(&mut self.runs, from, len);
        }
        let write = self.head.kind == wire::REQ_WRITE;
        match checked {
            Ok(()) if write => {
                self.after = Some(After::Done);
                self.step = Step::Moving;
                self.out.push_back(Action::Receive { len });
            }
            Ok(()) => {
                let d = ResponseHeader {
                    kind: wire::RESP_DATA,
                    status: wire::ST_OK,
                    msg_len: 0,
                    id: self.head.id,
                    data_len: len,
                };
                self.after = Some(After::Done);
                self.step = Step::Moving;
                self.out.push_back(Action::SendData(d.encode()));
            }
            Err(refusal) => self.refuse(refusal, len),
        }
    }

    /// Refuse the request read: a WRITE's payload is skipped first, so the
    /// connection stays usable.
    fn refuse(&mut self, refusal: Refusal, len: u64) {
        tracing::debug!(peer = %self.peer, status = refusal.status, msg = %refusal.msg, "tcp: refused request");
        R::clear(&mut self.runs);
        if self.head.kind == wire::REQ_WRITE {
            // Skip the payload without touching memory.
            self.after = Some(After::Refused(refusal));
            self.step = Step::Moving;
            self.out.push_back(Action::Skip(len));
        } else {
            self.ack(refusal.status, refusal.msg);
            self.ask(Step::Header, wire::HEADER_LEN);
        }
    }

    /// The payload of [`Action::Receive`], [`Action::Skip`] or [`Action::SendData`]
    /// moved: now the notification (the data is in place), then the ACK.
    pub(crate) fn moved(&mut self) {
        if self.step != Step::Moving {
            return;
        }
        R::clear(&mut self.runs);
        match self.after.take() {
            Some(After::Done) | None => {
                if let Some(n) = self.note.take() {
                    self.out.push_back(Action::Deliver(n));
                }
                self.ack(wire::ST_OK, String::new());
            }
            Some(After::Refused(r)) => self.ack(r.status, r.msg),
        }
        self.ask(Step::Header, wire::HEADER_LEN);
    }
}

/// Grow `buf`, of which `have` bytes arrived, by at most [`GROW`] bytes towards
/// `want`, and return the part the next read fills.
fn grow(buf: &mut Vec<u8>, have: usize, want: usize) -> &mut [u8] {
    let end = want.min(have + GROW);
    buf.resize(end, 0);
    &mut buf[have..end]
}

#[cfg(test)]
mod tests;
