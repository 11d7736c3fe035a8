//! The initiator's side of a connection as plain state machines, with no sockets
//! and no clocks; the I/O (`crate::conn`) only moves bytes and completes requests.
//!
//! - [`Handshake`]: the authentication (the core's [`ClientAuth`], where a secret is
//!   set), the hello and the same-host request. It is
//!   told the bytes it asked for and says what to send, which offer to try, and
//!   how the connection came up (or why it failed).
//! - [`Responses`]: cuts the target's byte stream into [`Frame`]s (ACKs and READ
//!   data headers), refusing lengths beyond the limits before allocating.
//! - [`request_head`]: what a request (a WRITE, a READ, a piece of either, a
//!   notification) begins with; its run table, notification and payload follow.
//! - [`Requests`]: the requests in flight: ids, the table of requests waiting for
//!   their answer, answers that arrive before the sender let go of a request, READ
//!   data, and the connection's death failing everything outstanding. It holds each
//!   request's completion as an opaque `P`, which it hands back with the outcome.
//!
//! `Requests` is shared by the tasks and callers of one connection (behind one
//! lock), so its calls return their action instead of queueing it: whoever made the
//! call carries the action out, after letting go of the lock.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use nixl::control::{ClientAuth, NONCE_LEN};
use nixl::{Error, ErrorKind, Result, SharedSecret};

use crate::wire::{self, Offer, RequestHeader, ResponseHeader};

/// At most this many answers may wait for requests the sender still holds. Only a
/// WRITE whose payload is being sent can be answered before it is parked, one at a
/// time per connection; more means the target answers requests never (or no longer)
/// in flight.
const MAX_EARLY: usize = 16;

/// Whether a connection asks for the same-host path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Want {
    /// Ask for it.
    Yes,
    /// Do not ask, for this reason (the first connection to a peer).
    No(String),
    /// A further connection for pieces of large transfers: TCP only, nothing to say.
    Extra,
}

/// How the connection came up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The target's same-host offer was opened ([`HandshakeAction::Open`]).
    SameHost,
    /// TCP only; for the first connection, why the same-host path is off.
    Tcp(Option<String>),
}

/// What the I/O does next during the handshake.
#[derive(Debug)]
pub(crate) enum HandshakeAction {
    /// Write these bytes (`what` names them in an I/O error).
    Send { what: &'static str, bytes: Vec<u8> },
    /// Try the target's same-host offer; tell [`Handshake::opened`] how it went.
    Open(Offer),
    /// The connection is up.
    Up(Outcome),
    /// The handshake failed.
    Fail(Error),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HsStep {
    Auth,
    Reply,
    OfferStatus,
    Offer,
    Opening,
    Over,
}

/// The initiator's handshake.
#[derive(Debug)]
pub(crate) struct Handshake {
    step: HsStep,
    buf: [u8; wire::OFFER_LEN + NONCE_LEN],
    need: usize,
    agent: String,
    /// The id of the listener wanted (from the peer's connection info).
    listener: u64,
    /// "peer X at ADDR", for messages.
    who: String,
    /// The authentication under way (with a secret, before the hello).
    auth: Option<ClientAuth>,
    want: Want,
    require: bool,
    out: VecDeque<HandshakeAction>,
}

impl Handshake {
    /// Start: `agent` is this side's name, `peer` the name of the agent it connects
    /// to (which the target must prove, with a secret), `listener` the id of its
    /// listener (which the target checks), `who` describes the peer in
    /// messages, `nonce` is this side's challenge (used only with a secret),
    /// `require` makes a missing same-host path fail the connection.
    #[allow(clippy::too_many_arguments)] // one connection's whole setup
    pub(crate) fn new(
        agent: &str,
        peer: &str,
        listener: u64,
        who: String,
        secret: Option<SharedSecret>,
        nonce: [u8; NONCE_LEN],
        want: Want,
        require: bool,
    ) -> Self {
        let mut m = Self {
            step: HsStep::Reply,
            buf: [0; wire::OFFER_LEN + NONCE_LEN],
            need: 7,
            agent: agent.to_owned(),
            listener,
            who,
            auth: None,
            want,
            require,
            out: VecDeque::new(),
        };
        match secret {
            Some(secret) => {
                match ClientAuth::start(wire::AUTH_PROTOCOL, secret, agent, peer, nonce) {
                    Ok((auth, first)) => {
                        m.out.push_back(HandshakeAction::Send {
                            what: "auth",
                            bytes: first,
                        });
                        m.ask(HsStep::Auth, auth.need());
                        m.auth = Some(auth);
                    }
                    Err(r) => m.refused(&r.why),
                }
            }
            None => m.hello(),
        }
        m
    }

    fn hello(&mut self) {
        self.out.push_back(HandshakeAction::Send {
            what: "hello",
            bytes: wire::hello(&self.agent, self.listener),
        });
        self.ask(HsStep::Reply, 7);
    }

    /// The next thing to do, until there is none: then read [`Handshake::need`].
    pub(crate) fn poll(&mut self) -> Option<HandshakeAction> {
        self.out.pop_front()
    }

    /// Where the bytes the machine waits for go (read exactly this many), or `None`
    /// while it waits for [`Handshake::opened`] or is over.
    pub(crate) fn need(&mut self) -> Option<&mut [u8]> {
        match self.step {
            HsStep::Opening | HsStep::Over => None,
            _ => Some(&mut self.buf[..self.need]),
        }
    }

    /// What is being read now, for an I/O error.
    pub(crate) fn what(&self) -> &'static str {
        match self.step {
            HsStep::Auth => "auth reply",
            HsStep::Reply => "hello reply",
            HsStep::OfferStatus => "same-host reply",
            HsStep::Offer | HsStep::Opening | HsStep::Over => "same-host offer",
        }
    }

    fn ask(&mut self, step: HsStep, n: usize) {
        self.step = step;
        self.need = n;
    }

    fn fail(&mut self, e: Error) {
        self.step = HsStep::Over;
        self.out.push_back(HandshakeAction::Fail(e));
    }

    fn refused(&mut self, why: &str) {
        let e = Error::new(
            ErrorKind::NotAllowed,
            "tcp connect",
            format!("{}: {why}", self.who),
        );
        self.fail(e);
    }

    /// The bytes [`Handshake::need`] asked for arrived.
    pub(crate) fn received(&mut self) {
        match self.step {
            HsStep::Reply => self.on_reply(),
            HsStep::Auth => {
                let auth = self.auth.as_mut().expect("asked only with a secret");
                match auth.received(&self.buf[..self.need]) {
                    Err(r) => self.refused(&r.why),
                    Ok(out) => {
                        if !out.is_empty() {
                            self.out.push_back(HandshakeAction::Send {
                                what: "auth",
                                bytes: out,
                            });
                        }
                        if auth.is_done() {
                            self.auth = None;
                            self.hello();
                        } else {
                            let next = auth.need();
                            self.ask(HsStep::Auth, next);
                        }
                    }
                }
            }
            HsStep::OfferStatus => {
                if self.buf[0] == 1 {
                    self.ask(HsStep::Offer, wire::OFFER_LEN);
                } else {
                    self.tcp(Some("the target does not offer it".to_owned()));
                }
            }
            HsStep::Offer => {
                let mut b = [0u8; wire::OFFER_LEN];
                b.copy_from_slice(&self.buf[..wire::OFFER_LEN]);
                self.step = HsStep::Opening;
                self.out
                    .push_back(HandshakeAction::Open(wire::decode_offer(&b)));
            }
            HsStep::Opening | HsStep::Over => {}
        }
    }

    fn on_reply(&mut self) {
        let reply = &self.buf[..7];
        if reply[..4] != wire::MAGIC || reply[4..6] != wire::VERSION.to_le_bytes() {
            let e = Error::new(
                ErrorKind::Mismatch,
                "tcp connect",
                format!("{} is not a compatible nixl-tcp endpoint", self.who),
            );
            return self.fail(e);
        }
        match reply[6] {
            wire::ST_OK => self.same_host_request(),
            wire::ST_AUTH => self.refused("it requires a shared secret; none is configured"),
            wire::ST_REFUSED => {
                self.refused("it refused our hello: the name differs from the one proven")
            }
            wire::ST_NOT_PEER => {
                // The agent is gone and another listens at its address: for this
                // connection, the peer is as unreachable as a closed port says.
                let e = Error::new(
                    ErrorKind::RemoteDisconnected,
                    "tcp connect",
                    format!(
                        "{} is gone: another agent listens at its address now (its metadata is stale; load the peer's current metadata)",
                        self.who
                    ),
                );
                self.fail(e);
            }
            status => self.refused(&format!("handshake refused (status {status})")),
        }
    }

    /// Ask for the same-host path (or say no).
    fn same_host_request(&mut self) {
        let yes = self.want == Want::Yes;
        self.out.push_back(HandshakeAction::Send {
            what: "same-host request",
            bytes: vec![u8::from(yes)],
        });
        match &self.want {
            Want::Yes => self.ask(HsStep::OfferStatus, 1),
            Want::No(why) => {
                let why = why.clone();
                self.tcp(Some(why));
            }
            Want::Extra => {
                self.step = HsStep::Over;
                self.out.push_back(HandshakeAction::Up(Outcome::Tcp(None)));
            }
        }
    }

    /// The same-host path is off for this reason: TCP, unless it is required.
    fn tcp(&mut self, why_not: Option<String>) {
        if self.require {
            let e = Error::new(
                ErrorKind::NotSupported,
                "tcp connect",
                format!(
                    "{}: the same-host path is required, but {}",
                    self.who,
                    why_not.as_deref().unwrap_or_default()
                ),
            );
            return self.fail(e);
        }
        self.step = HsStep::Over;
        self.out
            .push_back(HandshakeAction::Up(Outcome::Tcp(why_not)));
    }

    /// How trying the offer of [`HandshakeAction::Open`] went (on failure, why).
    pub(crate) fn opened(&mut self, r: std::result::Result<(), String>) {
        if self.step != HsStep::Opening {
            return;
        }
        match r {
            Ok(()) => {
                self.step = HsStep::Over;
                self.out.push_back(HandshakeAction::Up(Outcome::SameHost));
            }
            Err(why) => self.tcp(Some(why)),
        }
    }
}

/// The head of request `id`: its header, then for a piece its range (offset and
/// length within the whole request). `kind` is a `wire::REQ_*`, `entries` the
/// number of run-table entries that follow, `notif` the length of the notification
/// after them, if any. Returns the bytes, and how many of them to send.
pub(crate) fn request_head(
    kind: u8,
    entries: u32,
    part: Option<(u64, u64)>,
    notif: Option<u32>,
    id: u64,
) -> ([u8; wire::HEADER_LEN + wire::PART_LEN], usize) {
    let h = RequestHeader {
        kind,
        has_notif: notif.is_some(),
        part: part.is_some(),
        segments: entries,
        id,
        notif_len: notif.unwrap_or(0),
    };
    let mut b = [0u8; wire::HEADER_LEN + wire::PART_LEN];
    b[..wire::HEADER_LEN].copy_from_slice(&h.encode());
    match part {
        Some((from, len)) => {
            b[wire::HEADER_LEN..].copy_from_slice(&wire::encode_part(from, len));
            (b, wire::HEADER_LEN + wire::PART_LEN)
        }
        None => (b, wire::HEADER_LEN),
    }
}

/// A response from the target, cut from its byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    /// The answer to request `id`.
    Ack { id: u64, status: u8, msg: String },
    /// `len` bytes of data for READ `id` follow on the stream.
    Data { id: u64, len: u64 },
    /// The target stops reading this connection for a while (back-pressure):
    /// `true`, or reads it again: `false`.
    Paused(bool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RStep {
    Header,
    Msg,
}

/// Cuts the target's stream into frames. Owned by the reading task.
#[derive(Debug)]
pub(crate) struct Responses {
    step: RStep,
    head: [u8; wire::HEADER_LEN],
    msg: Vec<u8>,
    h: ResponseHeader,
}

impl Default for Responses {
    fn default() -> Self {
        Self {
            step: RStep::Header,
            head: [0; wire::HEADER_LEN],
            msg: Vec::new(),
            h: ResponseHeader {
                kind: 0,
                status: 0,
                msg_len: 0,
                id: 0,
                data_len: 0,
            },
        }
    }
}

impl Responses {
    /// Where the next bytes go: read exactly this many, then [`Responses::received`].
    pub(crate) fn need(&mut self) -> &mut [u8] {
        match self.step {
            RStep::Header => &mut self.head,
            RStep::Msg => &mut self.msg,
        }
    }

    /// The bytes [`Responses::need`] asked for arrived: a whole frame, nothing yet,
    /// or why the stream breaks the protocol (then the connection closes). After a
    /// [`Frame::Data`], its `len` bytes are the I/O's to read before the next call.
    pub(crate) fn received(&mut self) -> std::result::Result<Option<Frame>, String> {
        if self.step == RStep::Msg {
            self.step = RStep::Header;
            let msg = String::from_utf8_lossy(&self.msg).into_owned();
            return Ok(Some(self.ack(msg)));
        }
        let h = ResponseHeader::decode(&self.head);
        self.h = h;
        match h.kind {
            wire::RESP_ACK => {
                if h.msg_len > wire::MAX_ERROR_MSG {
                    return Err(format!("error message of {} bytes", h.msg_len));
                }
                if h.msg_len == 0 {
                    return Ok(Some(self.ack(String::new())));
                }
                self.msg.clear();
                self.msg.resize(h.msg_len as usize, 0);
                self.step = RStep::Msg;
                Ok(None)
            }
            wire::RESP_DATA => Ok(Some(Frame::Data {
                id: h.id,
                len: h.data_len,
            })),
            wire::RESP_PAUSE | wire::RESP_RESUME => {
                if (h.status, h.msg_len, h.id, h.data_len) != (0, 0, 0, 0) {
                    return Err(format!("pause frame {h:?} with non-zero fields"));
                }
                Ok(Some(Frame::Paused(h.kind == wire::RESP_PAUSE)))
            }
            other => Err(format!("unknown response kind {other:#x}")),
        }
    }

    fn ack(&self, msg: String) -> Frame {
        Frame::Ack {
            id: self.h.id,
            status: self.h.status,
            msg,
        }
    }
}

/// What to do with a [`Frame`] ([`Requests::on_frame`]).
#[derive(Debug)]
pub(crate) enum Answer<P> {
    /// Complete this request with this outcome.
    Complete(P, Result<()>),
    /// Nothing now: the answer waits for the sender to let go of its request.
    Kept,
    /// Receive the data into this READ's memory, then [`Requests::landed`].
    Receive(P),
    /// The target broke the protocol: fail the request given (if any) with the
    /// error, and close the connection with it.
    Broke(Error, Option<P>),
}

#[derive(Debug)]
struct Waiting<P> {
    done: P,
    /// For READs: how many bytes the data brings.
    read: Option<u64>,
}

/// What to do with the connection's user timeout (`TCP_USER_TIMEOUT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UserTimeout {
    /// The target stops reading on purpose: its zero window is no sign of death.
    Lift,
    /// The target reads again: count unacknowledged data against it again.
    Restore,
}

/// Whether the target holds back reading this connection ([`Frame::Paused`]), and
/// for how long it may.
///
/// The user timeout is lifted at PAUSE and restored only once the target answered a
/// request sent after its RESUME: restoring at RESUME itself, before the window
/// reopens, would let Linux count the whole pause against the timeout and cut the
/// connection at the next zero-window probe.
///
/// While it is lifted nothing in the kernel notices a target that never reads again,
/// so the hold-back is bounded here: requests that wait for the target must see an
/// answer within `limit` (counted from the later of the first check that found them
/// waiting, the PAUSE, and the last answer). The checks come every quarter of the
/// limit while the target holds back ([`HoldBack::deadline`]); a request is never
/// cut before it waited the whole limit, and at most a quarter more. PAUSE and
/// RESUME frames themselves move nothing on (a target cycling them without reading
/// stalls like one that paused once). Past the bound ([`HoldBack::timed_out`]) the
/// connection is closed with a `TimedOut` naming the stall. Time with nothing
/// waiting counts for nothing, and the user timeout stays lifted until the target
/// reads again: a target still paused when a large WRITE comes must not be taken for
/// dead by the kernel.
#[derive(Debug)]
pub(crate) struct HoldBack {
    peer: String,
    limit: Duration,
    lifted: bool,
    /// Restore once a request from this id on is answered.
    until_answer_from: Option<u64>,
    /// While lifted: the PAUSE, or the last answer since.
    since: Option<Instant>,
    /// While lifted: the first check that found requests waiting (none found since).
    waiting: Option<Instant>,
    /// While lifted: when to check next.
    next_check: Option<Instant>,
}

impl HoldBack {
    /// Nothing held back yet; `limit` bounds how long requests wait without answers.
    pub(crate) fn new(peer: &str, limit: Duration) -> Self {
        Self {
            peer: peer.to_owned(),
            limit,
            lifted: false,
            until_answer_from: None,
            since: None,
            waiting: None,
            next_check: None,
        }
    }

    /// A frame arrived at `now`; `next_id` says the id the next request will get
    /// (asked only at RESUME).
    pub(crate) fn on_frame(
        &mut self,
        frame: &Frame,
        next_id: impl FnOnce() -> u64,
        now: Instant,
    ) -> Option<UserTimeout> {
        match frame {
            Frame::Paused(true) => {
                self.until_answer_from = None;
                if self.lifted {
                    // Pausing again restarts nothing: only answers do.
                    return None;
                }
                self.lifted = true;
                self.since = Some(now);
                self.waiting = None;
                self.next_check = now.checked_add(self.limit / 4);
                Some(UserTimeout::Lift)
            }
            Frame::Paused(false) => {
                if self.lifted {
                    self.until_answer_from = Some(next_id());
                }
                None
            }
            Frame::Ack { id, .. } | Frame::Data { id, .. } => match self.until_answer_from {
                Some(from) if *id >= from => {
                    self.end();
                    Some(UserTimeout::Restore)
                }
                _ => None,
            },
        }
    }

    /// The target answered a request at `now` (the request table completed it, or
    /// its READ data arrives): it makes progress, the bound starts again.
    pub(crate) fn answered(&mut self, now: Instant) {
        if self.lifted {
            self.since = Some(now);
        }
    }

    /// When to call [`HoldBack::timed_out`] next. `None` while the target does not
    /// hold back (or the limit is too large to add to the clock: no limit).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.next_check.filter(|_| self.lifted)
    }

    /// The time is `now`; `outstanding` says whether requests wait for the target
    /// (sent or being sent, unanswered). The error to close the connection with,
    /// when they waited the whole limit without an answer.
    pub(crate) fn timed_out(&mut self, now: Instant, outstanding: bool) -> Result<()> {
        match self.deadline() {
            Some(at) if now >= at => {}
            _ => return Ok(()),
        }
        let step = self.limit / 4;
        if !outstanding {
            self.waiting = None;
            self.next_check = now.checked_add(step);
            return Ok(());
        }
        let first = *self.waiting.get_or_insert(now);
        let start = self.since.map_or(first, |s| s.max(first));
        match start.checked_add(self.limit) {
            Some(end) if now >= end => Err(Error::new(
                ErrorKind::TimedOut,
                "tcp transfer",
                format!(
                    "peer {:?} stalled: it held back reading this connection (PAUSE) and answered no request for {:?} (TcpOptions::pause_timeout); the connection is closed",
                    self.peer, self.limit
                ),
            )),
            Some(end) => {
                self.next_check = Some(now.checked_add(step).map_or(end, |n| n.min(end)));
                Ok(())
            }
            None => {
                self.next_check = None;
                Ok(())
            }
        }
    }

    fn end(&mut self) {
        self.lifted = false;
        self.until_answer_from = None;
        self.since = None;
        self.waiting = None;
        self.next_check = None;
    }
}

/// The requests of one connection: what waits for an answer, and whether the
/// connection died (and why).
#[derive(Debug)]
pub(crate) struct Requests<P> {
    peer: String,
    next_id: u64,
    dead: Option<Error>,
    pending: HashMap<u64, Waiting<P>>,
    /// Answers that arrived before the sender handed its request over.
    early: HashMap<u64, Result<()>>,
    /// The WRITE whose payload the sender is sending (its request is with the
    /// sender meanwhile, not in `pending`).
    sending: Option<u64>,
}

impl<P> Requests<P> {
    pub(crate) fn new(peer: &str) -> Self {
        Self {
            peer: peer.to_owned(),
            next_id: 1,
            dead: None,
            pending: HashMap::new(),
            early: HashMap::new(),
            sending: None,
        }
    }

    /// WRITE `id`'s payload is being sent: until [`Requests::sent`], it waits for
    /// the target as much as a request in the table does.
    pub(crate) fn sending(&mut self, id: u64) {
        self.sending = Some(id);
    }

    /// Whether any request waits for the target: sent (or being sent) and not
    /// answered yet.
    pub(crate) fn outstanding(&self) -> bool {
        !self.pending.is_empty() || self.sending.is_some()
    }

    /// The id the next request will get.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id
    }

    /// A new request id (ids start at 1 and are never reused).
    pub(crate) fn issue(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    /// Why the connection died (or that it is closed).
    pub(crate) fn dead_error(&self) -> Error {
        self.dead.as_ref().map(Error::cloned).unwrap_or_else(|| {
            Error::new(
                ErrorKind::RemoteDisconnected,
                "tcp transfer",
                format!("connection to peer {:?} is closed", self.peer),
            )
        })
    }

    /// Wait for request `id`'s answer before sending it (`read`: a READ of this many
    /// bytes). When the connection is dead the request comes back with the reason.
    pub(crate) fn park(
        &mut self,
        id: u64,
        done: P,
        read: Option<u64>,
    ) -> std::result::Result<(), (P, Error)> {
        if let Some(e) = &self.dead {
            return Err((done, e.cloned()));
        }
        self.pending.insert(id, Waiting { done, read });
        Ok(())
    }

    /// WRITE `id`'s payload is sent: wait for its answer, or finish it when the
    /// answer came already (or the connection died meanwhile).
    pub(crate) fn sent(&mut self, id: u64, done: P) -> Option<(P, Result<()>)> {
        if self.sending == Some(id) {
            self.sending = None;
        }
        if let Some(r) = self.early.remove(&id) {
            return Some((done, r));
        }
        if let Some(e) = &self.dead {
            return Some((done, Err(e.cloned())));
        }
        self.pending.insert(id, Waiting { done, read: None });
        None
    }

    /// READ `id`'s data landed: wait for its ACK (or fail it, when the connection
    /// died meanwhile).
    pub(crate) fn landed(&mut self, id: u64, done: P, len: u64) -> Option<(P, Error)> {
        if let Some(e) = &self.dead {
            return Some((done, e.cloned()));
        }
        self.pending.insert(
            id,
            Waiting {
                done,
                read: Some(len),
            },
        );
        None
    }

    /// The connection died: every request waiting fails with the first reason.
    /// Returns them, and the error to fail them with.
    pub(crate) fn fail(&mut self, e: Error) -> (Vec<P>, Error) {
        if self.dead.is_none() {
            self.dead = Some(e.cloned());
        }
        self.early.clear();
        self.sending = None;
        let waiting = self.pending.drain().map(|(_, w)| w.done).collect();
        (waiting, e)
    }

    /// The error for a target that broke the protocol.
    pub(crate) fn broke(&self, msg: String) -> Error {
        Error::new(
            ErrorKind::Backend,
            "tcp transfer",
            format!("peer {:?} broke the protocol: {msg}", self.peer),
        )
    }

    /// A frame from the target.
    pub(crate) fn on_frame(&mut self, frame: Frame) -> Answer<P> {
        match frame {
            Frame::Ack { id, status, msg } => {
                let result = status_result(status, &self.peer, &msg);
                if let Some(w) = self.pending.remove(&id) {
                    return Answer::Complete(w.done, result);
                }
                if id == 0 || id >= self.next_id {
                    return Answer::Broke(
                        self.broke(format!("answer to request {id}, never sent")),
                        None,
                    );
                }
                if self.early.len() >= MAX_EARLY && !self.early.contains_key(&id) {
                    return Answer::Broke(
                        self.broke(format!("answer to request {id}, not in flight")),
                        None,
                    );
                }
                self.early.insert(id, result);
                Answer::Kept
            }
            Frame::Data { id, len } => {
                let Some(Waiting { done, read }) = self.pending.remove(&id) else {
                    return Answer::Broke(
                        self.broke(format!("data for unknown request {id}")),
                        None,
                    );
                };
                let Some(total) = read else {
                    let e = self.broke(format!("data for request {id} that is not a READ"));
                    return Answer::Broke(e, Some(done));
                };
                if total != len {
                    let e = self.broke(format!("{len} bytes of data for a {total}-byte READ"));
                    return Answer::Broke(e, Some(done));
                }
                Answer::Receive(done)
            }
            // The connection's I/O acts on these; no request is concerned.
            Frame::Paused(_) => Answer::Kept,
        }
    }
}

/// The outcome an ACK's status says.
fn status_result(status: u8, peer: &str, msg: &str) -> Result<()> {
    let kind = match status {
        wire::ST_OK => return Ok(()),
        wire::ST_BAD_KEY => ErrorKind::NotAllowed,
        wire::ST_OUT_OF_RANGE => ErrorKind::OutOfRange,
        wire::ST_TOO_LARGE => ErrorKind::InvalidArgument,
        _ => ErrorKind::Backend,
    };
    Err(Error::new(
        kind,
        "tcp transfer",
        format!("peer {peer:?} refused the request: {msg}"),
    ))
}

#[cfg(test)]
mod tests;
