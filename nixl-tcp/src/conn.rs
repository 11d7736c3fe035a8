//! Initiator side: one connection to one peer, many requests in flight.
//!
//! The protocol (the handshake, request ids, answers early and late, READ data, a
//! target that breaks the protocol, the connection's death) is
//! [`protocol::initiator`](crate::protocol::initiator)'s; this module only moves
//! bytes, runs the tasks and timers, and completes requests as the protocol says.
//!
//! Ownership rule that keeps memory safe: each request's [`Completer`] (which keeps the
//! request's memory alive) has exactly one owner at a time: the writer task while it
//! sends a WRITE payload from memory, the pending table while the request waits for its
//! answer, or the reader task while it receives READ data into memory. Whoever fails or
//! finishes a request completes it, and nobody touches its memory afterwards.
//!
//! The socket's write half has one owner at a time, a value that moves: the writer
//! task while it has work, and the connection's idle slot ([`Idle`]) when it has
//! none (everything flushed, nothing queued). Small requests skip the writer task
//! while the socket is idle: [`Conn::submit`] writes the whole frame (a WRITE's
//! payload copied into it) from the caller's thread with one non-blocking write
//! under the slot's lock, so a lone 4 KiB transfer costs no task wake-up before it
//! reaches the socket. Whoever queues work for the writer while the socket is idle
//! takes it out of the slot and queues it first (with what the socket did not take),
//! and the writer puts it back only when its queue is empty, under the same lock; so
//! the byte stream keeps the order requests were submitted in.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::kit::{Outcome as Striped, StripeGate};
use nixl::{Completer, Error, ErrorKind, Op, Result, Segments};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::direct::{Direct, Unsuitable};
use crate::io::{recv_slices, send_slices, IO_BUF};
use crate::options::{Started, TcpOptions};
use crate::protocol::initiator::{
    request_head, Answer, Frame, Handshake, HandshakeAction, HoldBack, Outcome, Requests,
    Responses, UserTimeout, Want,
};
use crate::runs::local_blocks;
use crate::same_host::{self, SameHost};
use crate::wire;

/// Requests whose whole frame (header, descriptor table, notification and a WRITE's
/// payload) is at most this long are written from the submitting thread when the
/// connection is idle; larger ones always go through the writer task, which sends
/// payloads straight from registered memory.
const FAST_FRAME_MAX: usize = 64 * 1024;

/// The socket's write half.
type Sink = BufWriter<OwnedWriteHalf>;

/// What the writer task sends.
enum Item {
    /// The socket, taken out of the idle slot by whoever queues work behind it.
    Own(Sink),
    Job(Job),
    /// The rest of a frame [`Conn::submit`] began writing itself.
    Raw(Vec<u8>),
    /// The end of a transfer split across connections: nothing queued after it is
    /// sent before every piece has landed (then its notification goes first).
    Gate(Arc<StripeGate>),
}

/// Which connection to a peer this is.
#[derive(Debug)]
pub(crate) enum Lane {
    /// The first: asks for the same-host path (or says why not) and carries
    /// everything but the other pieces of large transfers.
    First(std::result::Result<(), String>),
    /// A further connection for pieces of large transfers; TCP only.
    Extra,
}

/// The socket while the writer task is idle (flushed, nothing queued): the one place
/// it rests when no task owns it. Under the lock a submitter may write to it (never
/// waiting) or take it to hand it to the writer; while the writer owns it (or before
/// the connection is up) the slot is empty and every request queues.
type Idle = Mutex<Option<Sink>>;

/// A request handed to the connection's writer.
pub(crate) struct Job {
    kind: JobKind,
    notif: Option<Bytes>,
    done: Completer,
}

enum JobKind {
    Transfer {
        op: Op,
        table: Bytes,
        local: Arc<Segments>,
        /// The remote side for the same-host path, when the target granted it.
        direct: Option<Arc<Direct>>,
        /// Bytes this job moves: the transfer's, or its piece's.
        total: u64,
        /// A piece of a transfer split across connections: its byte range (offset,
        /// length) within the transfer; `local` is the piece's own segments, `table`
        /// the whole transfer's.
        part: Option<(u64, u64)>,
    },
    Notify,
}

impl Job {
    pub(crate) fn transfer(
        op: Op,
        table: Bytes,
        local: Arc<Segments>,
        direct: Option<Arc<Direct>>,
        total: u64,
        notif: Option<Bytes>,
        done: Completer,
    ) -> Self {
        Self {
            kind: JobKind::Transfer {
                op,
                table,
                local,
                direct,
                total,
                part: None,
            },
            notif,
            done,
        }
    }

    /// Bytes `from..from + local.bytes()` of a transfer split across connections:
    /// `table` is the whole transfer's (the target checks all of it), `local` the
    /// piece's own segments. Pieces carry no notification.
    pub(crate) fn piece(
        op: Op,
        table: Bytes,
        local: Arc<Segments>,
        from: u64,
        done: Completer,
    ) -> Self {
        let total = local.bytes();
        Self {
            kind: JobKind::Transfer {
                op,
                table,
                local,
                direct: None,
                total,
                part: Some((from, total)),
            },
            notif: None,
            done,
        }
    }

    /// The request header (with a piece's range), for request `id`.
    fn head(&self, id: u64) -> ([u8; wire::HEADER_LEN + wire::PART_LEN], usize) {
        let (kind, entries, part) = match &self.kind {
            JobKind::Notify => (wire::REQ_NOTIFY, 0, None),
            JobKind::Transfer {
                op, table, part, ..
            } => (
                match op {
                    Op::Read => wire::REQ_READ,
                    Op::Write => wire::REQ_WRITE,
                },
                table.len() / wire::SEG_LEN,
                *part,
            ),
        };
        let notif = self.notif.as_ref().map(|n| n.len() as u32);
        request_head(kind, entries as u32, part, notif, id)
    }

    pub(crate) fn notify(msg: Bytes, done: Completer) -> Self {
        Self {
            kind: JobKind::Notify,
            notif: Some(msg),
            done,
        }
    }
}

/// A request waiting for its answer, as the protocol's [`Requests`] holds it.
struct Pending {
    done: Completer,
    /// For READs: where the data goes.
    read: Option<Arc<Segments>>,
}

/// The connection's requests: the protocol state, behind the connection's lock.
type Table = Requests<Pending>;

#[derive(Clone, Debug)]
enum State {
    Connecting,
    Up,
    Failed(ErrorKind, String),
}

/// A connection to a peer.
pub(crate) struct Conn {
    peer: String,
    tx: mpsc::UnboundedSender<Item>,
    idle: Arc<Idle>,
    table: Arc<Mutex<Table>>,
    dead: Arc<AtomicBool>,
    cancel: CancellationToken,
    state: watch::Receiver<State>,
    /// Set once connected, when the same-host path works to this peer.
    same_host: Arc<OnceLock<Arc<same_host::Peer>>>,
    /// How data moves to this peer, once connected.
    path: Arc<OnceLock<String>>,
    require: bool,
    /// The listener options'
    /// [`dead_peer_timeout`](nixl::control::ListenerOptions::dead_peer_timeout), for
    /// messages.
    dead_peer: Duration,
}

/// The error of a transfer that cannot go same-host when the options require it.
fn required_error(peer: &str, why: &Unsuitable) -> Error {
    Error::new(
        ErrorKind::NotSupported,
        "tcp transfer",
        format!(
            "peer {peer:?}: the same-host path is required, but {}",
            why.why
        ),
    )
}

/// What follows a direct (same-host) copy, wherever it ran. Returns what is left to
/// send over TCP: the notification of a copy that worked (it follows over TCP, so it
/// arrives after the data, and the transfer completes once the target has it), the
/// whole transfer (built by `whole`) where the copy could not be made and the
/// options allow TCP, or nothing.
fn after_direct(
    peer: &str,
    require: bool,
    r: std::result::Result<Result<()>, Unsuitable>,
    notif: Option<Bytes>,
    done: Completer,
    whole: impl FnOnce(Option<Bytes>, Completer) -> Job,
) -> Option<Job> {
    match r {
        Ok(Ok(())) => match notif {
            Some(n) => Some(Job::notify(n, done)),
            None => {
                done.complete(Ok(()));
                None
            }
        },
        Ok(Err(e)) => {
            done.complete(Err(e));
            None
        }
        Err(why) if require && !why.mixed_kinds => {
            done.complete(Err(required_error(peer, &why)));
            None
        }
        Err(_) => Some(whole(notif, done)),
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.peer)
            .field("dead", &self.is_dead())
            .finish()
    }
}

/// Fail every pending request and mark the connection dead (first reason wins).
fn fail(table: &Mutex<Table>, dead: &AtomicBool, e: Error) {
    let (waiting, e) = table.lock().unwrap().fail(e);
    dead.store(true, Ordering::Release);
    for p in waiting {
        p.done.complete(Err(e.cloned()));
    }
}

fn dead_error(table: &Mutex<Table>) -> Error {
    table.lock().unwrap().dead_error()
}

impl Conn {
    /// Start connecting to `addr`; requests queue until the connection is up.
    pub(crate) fn open(
        peer: String,
        to: &wire::ConnInfo,
        lane: Lane,
        options: &TcpOptions,
        started: &Started,
    ) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (state_tx, state) = watch::channel(State::Connecting);
        let idle = Arc::new(Mutex::new(None));
        let conn = Arc::new(Self {
            peer: peer.clone(),
            tx,
            idle: idle.clone(),
            table: Arc::new(Mutex::new(Requests::new(&peer))),
            dead: Arc::default(),
            cancel: started.cancel.child_token(),
            state,
            same_host: Arc::default(),
            path: Arc::default(),
            require: options.same_host == SameHost::Require,
            dead_peer: options.listener.dead_peer_timeout,
        });
        let task = Task {
            held: Held::default(),
            peer,
            addr: to.addr,
            listener: to.listener,
            lane,
            same_host: conn.same_host.clone(),
            path: conn.path.clone(),
            options: TcpOptions {
                listener: nixl::control::ListenerOptions {
                    secret: started.secret.clone(),
                    ..options.listener.clone()
                },
                ..options.clone()
            },
            agent: started.ctx.agent_name.clone(),
            table: conn.table.clone(),
            dead: conn.dead.clone(),
            cancel: conn.cancel.clone(),
            tracker: started.ctx.tracker.clone(),
            threads: started.ctx.threads.clone(),
            idle,
            conn: Arc::downgrade(&conn),
        };
        started.ctx.tracker.spawn(task.run(rx, state_tx));
        conn
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Whether the connection is up (handshake done, not closed).
    pub(crate) fn is_up(&self) -> bool {
        self.path.get().is_some() && !self.is_dead()
    }

    /// Queue the gate of a split transfer behind everything queued so far.
    pub(crate) fn submit_gate(&self, gate: Arc<StripeGate>) {
        let mut idle = self.idle.lock().unwrap();
        self.hand_over(&mut idle);
        // On failure the connection is closing: the gate finishes the transfer when
        // its last piece completes.
        if let Err(mpsc::error::SendError(Item::Gate(g))) = self.tx.send(Item::Gate(gate)) {
            g.close(g.closed_error());
        }
    }

    /// The same-host peer, once connected with the path working.
    pub(crate) fn same_host(&self) -> Option<Arc<same_host::Peer>> {
        self.same_host.get().cloned()
    }

    /// How data moves to this peer, once connected.
    pub(crate) fn path(&self) -> Option<String> {
        self.path.get().cloned()
    }

    /// What follows a direct copy to this peer (see [`after_direct`]).
    pub(crate) fn after_direct(
        &self,
        r: std::result::Result<Result<()>, Unsuitable>,
        notif: Option<Bytes>,
        done: Completer,
        whole: impl FnOnce(Option<Bytes>, Completer) -> Job,
    ) -> Option<Job> {
        if let Ok(Err(e)) = &r {
            self.direct_failed(e);
        }
        after_direct(&self.peer, self.require, r, notif, done, whole)
    }

    /// A direct transfer that found the target gone (its table closed, its process
    /// exited) ends this connection too, before its reader may have seen the socket
    /// close: the next request dials the peer's address again instead of failing on
    /// the same stale path.
    fn direct_failed(&self, e: &Error) {
        if e.kind() == ErrorKind::RemoteDisconnected {
            self.close(
                ErrorKind::RemoteDisconnected,
                "the same-host path found the peer gone",
            );
        }
    }

    /// GPU memory to or from this same-host peer: device copies queued here as one
    /// batch; the notification (or the completion) follows once the device finished
    /// them, from the driver's callback. Where the grants do not suit, returns the
    /// transfer to send over the socket now, staged (without its direct route, so it
    /// is not tried again), unless the same-host path is required.
    #[allow(clippy::too_many_arguments)] // the parts of a transfer job, moved in
    pub(crate) fn direct_gpu(
        self: &Arc<Self>,
        peer: &same_host::Peer,
        op: Op,
        table: Bytes,
        local: Arc<Segments>,
        direct: Arc<Direct>,
        total: u64,
        notif: Option<Bytes>,
        done: Completer,
    ) -> Option<Job> {
        let batch = match peer.gpu.batch(op, &local, &direct) {
            Ok(Ok(batch)) => batch,
            Ok(Err(e)) => {
                self.direct_failed(&e);
                done.complete(Err(e));
                return None;
            }
            Err(why) => {
                let staged = |n, d| Job::transfer(op, table, local, None, total, n, d);
                return self.after_direct(Err(why), notif, done, staged);
            }
        };
        // The callback takes these; a batch that cannot start gives them back.
        let waiting = Arc::new(Mutex::new(Some((notif, done))));
        let taken = waiting.clone();
        let conn = self.clone();
        let finished = Box::new(move |r: Result<()>| {
            let Some((notif, done)) = taken.lock().unwrap().take() else {
                return;
            };
            let staged = |n, d| Job::transfer(op, table, local, None, total, n, d);
            if let Some(rest) = conn.after_direct(Ok(r), notif, done, staged) {
                conn.submit(rest);
            }
        });
        if let Err(e) = batch.start(finished) {
            if let Some((_, done)) = waiting.lock().unwrap().take() {
                done.complete(Err(e));
            }
        }
        None
    }

    /// Send `job` over TCP: written here when the connection is idle and the frame is
    /// small, otherwise queued for the writer task.
    pub(crate) fn submit(&self, job: Job) {
        if self.is_dead() {
            job.done.complete(Err(dead_error(&self.table)));
            return;
        }
        let mut idle = self.idle.lock().unwrap();
        let job = match self.write_now(&mut idle, job) {
            Some(job) => job,
            None => return,
        };
        // Queued under the lock, so that no request is written ahead of it.
        self.hand_over(&mut idle);
        if let Err(mpsc::error::SendError(Item::Job(job))) = self.tx.send(Item::Job(job)) {
            job.done.complete(Err(dead_error(&self.table)));
        }
    }

    /// The writer task is about to get work: if the socket is idle, it goes to the
    /// writer first. Called under the slot's lock, before queueing.
    fn hand_over(&self, idle: &mut Option<Sink>) {
        if let Some(w) = idle.take() {
            // On failure the connection is closing; the socket goes with it.
            let _ = self.tx.send(Item::Own(w));
        }
    }

    /// Write `job`'s whole frame to the socket, if it is idle. Gives the job back
    /// when the socket is busy or the job not small enough (or a WRITE being
    /// dropped); otherwise it is parked in the pending table and whatever the socket
    /// did not take goes to the writer, with the socket.
    fn write_now(&self, idle: &mut Option<Sink>, job: Job) -> Option<Job> {
        if idle.is_none() {
            return Some(job);
        }
        let notif = job.notif.as_deref().unwrap_or_default();
        let (table, payload, read) = match &job.kind {
            JobKind::Notify => (&[][..], 0, None),
            JobKind::Transfer {
                op: Op::Read,
                table,
                local,
                total,
                ..
            } => (&table[..], 0, Some((local.clone(), *total))),
            JobKind::Transfer {
                op: Op::Write,
                table,
                total,
                ..
            } => (&table[..], *total, None),
        };
        let (_, head_len) = job.head(0);
        let len = head_len as u64 + table.len() as u64 + notif.len() as u64 + payload;
        // GPU memory goes the staged way (asynchronous copies on their own stream),
        // never by a blocking device copy on the posting thread.
        let gpu = match &job.kind {
            JobKind::Transfer {
                op: Op::Write,
                local,
                ..
            } => local
                .locals()
                .iter()
                .any(|r| r.kind() != nixl::MemKind::Dram),
            _ => false,
        };
        if gpu || len > FAST_FRAME_MAX as u64 || job.done.is_canceled() {
            return Some(job);
        }
        // An id only for a request written here: the writer issues its own.
        let id = self.table.lock().unwrap().issue();
        let (head, _) = job.head(id);
        let mut frame = Vec::with_capacity(len as usize);
        frame.extend_from_slice(&head[..head_len]);
        frame.extend_from_slice(table);
        frame.extend_from_slice(notif);
        if let JobKind::Transfer {
            op: Op::Write,
            local,
            ..
        } = &job.kind
        {
            for seg in local_blocks(local) {
                let at = frame.len();
                frame.resize(at + seg.len(), 0);
                if let Err(e) = seg.read_into(0, &mut frame[at..]) {
                    job.done.complete(Err(e));
                    return None;
                }
            }
        }
        // The payload is in `frame`: the request's memory is no longer needed here,
        // and the answer may come as soon as the first byte leaves.
        if !park(&self.table, id, job.done, read) {
            return None;
        }
        let socket = idle.as_ref().expect("checked above").get_ref();
        let mut at = 0;
        while at < frame.len() {
            match socket.try_write(&frame[at..]) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    fail(
                        &self.table,
                        &self.dead,
                        socket_error(&self.peer, "sending", self.dead_peer, e),
                    );
                    self.cancel.cancel();
                    return None;
                }
            }
        }
        if at < frame.len() {
            self.hand_over(idle);
            // On failure the connection is closing and the parked request fails with it.
            let _ = self.tx.send(Item::Raw(frame.split_off(at)));
        }
        None
    }

    /// Close: fail everything pending with `kind`, stop the tasks.
    pub(crate) fn close(&self, kind: ErrorKind, why: &str) {
        fail(
            &self.table,
            &self.dead,
            Error::new(kind, "tcp transfer", format!("peer {:?}: {why}", self.peer)),
        );
        self.cancel.cancel();
    }

    /// Wait until connected (or failed).
    pub(crate) async fn ready(&self) -> Result<()> {
        let mut rx = self.state.clone();
        let st = rx
            .wait_for(|s| !matches!(s, State::Connecting))
            .await
            .map(|s| s.clone())
            .unwrap_or(State::Failed(
                ErrorKind::Canceled,
                "connection task ended".into(),
            ));
        match st {
            State::Up => Ok(()),
            State::Failed(kind, msg) => Err(Error::new(kind, "tcp connect", msg)),
            State::Connecting => unreachable!("waited for a non-connecting state"),
        }
    }
}

/// The completer of a request whose memory a task is using right now. Kept outside
/// the task's future so that, when the future is dropped (cancelled), the request can
/// still be failed with the connection's real error instead of a generic one, and
/// only after the future (and its use of the memory) is gone.
#[derive(Default)]
struct Held(Mutex<Option<Completer>>);

impl Held {
    fn put(&self, c: Completer) {
        *self.0.lock().unwrap() = Some(c);
    }

    fn take(&self) -> Option<Completer> {
        self.0.lock().unwrap().take()
    }

    /// Fail the held request (if any) with the connection's error.
    fn fail(&self, table: &Mutex<Table>) {
        if let Some(c) = self.take() {
            c.complete(Err(dead_error(table)));
        }
    }
}

struct Task {
    held: Held,
    peer: String,
    addr: SocketAddr,
    /// The id of the listener wanted there.
    listener: u64,
    lane: Lane,
    same_host: Arc<OnceLock<Arc<same_host::Peer>>>,
    path: Arc<OnceLock<String>>,
    options: TcpOptions,
    agent: String,
    table: Arc<Mutex<Table>>,
    dead: Arc<AtomicBool>,
    cancel: CancellationToken,
    tracker: tokio_util::task::TaskTracker,
    /// The agent's threads (the same-host GPU path's mapping watcher is one).
    threads: nixl::ThreadSpawner,
    idle: Arc<Idle>,
    /// The connection, for device copies queued before it was up: their completion
    /// sends what follows through it.
    conn: std::sync::Weak<Conn>,
}

impl Task {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<Item>, state: watch::Sender<State>) {
        let connected = tokio::select! {
            _ = self.cancel.cancelled() => Err(Error::new(ErrorKind::Canceled, "tcp connect", "canceled")),
            r = tokio::time::timeout(self.options.listener.connect_timeout, self.establish()) => match r {
                Ok(r) => r,
                Err(_) => Err(Error::new(ErrorKind::TimedOut, "tcp connect", format!("peer {:?} at {} did not answer within {:?}", self.peer, self.addr, self.options.listener.connect_timeout))),
            },
        };
        let stream = match connected {
            Ok((s, peer, path)) => {
                if let Some(p) = peer {
                    let _ = self.same_host.set(Arc::new(p));
                }
                let _ = self.path.set(path);
                s
            }
            Err(e) => {
                tracing::debug!(peer = %self.peer, addr = %self.addr, error = %e, "tcp connect failed");
                let _ = state.send(State::Failed(e.kind(), e.context().to_owned()));
                self.finish(&mut rx, e);
                return;
            }
        };
        let _ = state.send(State::Up);
        tracing::debug!(peer = %self.peer, addr = %self.addr, "tcp connected");
        let (rd, wr) = stream.into_split();
        self.tracker.spawn(reader(
            rd,
            Timeouts {
                dead_peer: self.options.listener.dead_peer_timeout,
                pause: self.options.pause_timeout,
            },
            self.peer.clone(),
            self.table.clone(),
            self.dead.clone(),
            self.cancel.clone(),
        ));
        let e = tokio::select! {
            _ = self.cancel.cancelled() => Error::new(ErrorKind::Canceled, "tcp transfer", format!("connection to {:?} closed", self.peer)),
            e = self.writer(wr, &mut rx) => e,
        };
        // The socket closes with its owner: the writer's future, or the idle slot.
        self.idle.lock().unwrap().take();
        self.finish(&mut rx, e);
        // The writer's future is gone: a WRITE it was sending can be failed now.
        self.held.fail(&self.table);
    }

    /// Fail pending and queued work, stop the reader.
    fn finish(&self, rx: &mut mpsc::UnboundedReceiver<Item>, e: Error) {
        fail(&self.table, &self.dead, e);
        self.cancel.cancel();
        // Closed under the lock every sender holds while it sends: a send counts its
        // message before it writes it, and `try_recv` sees a counted message not yet
        // written as none, so a send racing an unlocked close could land after the
        // drain below and wait, unfailed, until the connection is dropped. Under the
        // lock, a send is either whole before the close (and drained) or refused.
        {
            let _senders = self.idle.lock().unwrap();
            rx.close();
        }
        // Queued work fails with the first reason the connection died for.
        while let Ok(item) = rx.try_recv() {
            match item {
                Item::Job(job) => job.done.complete(Err(dead_error(&self.table))),
                Item::Gate(gate) => gate.close(gate.closed_error()),
                Item::Own(_) | Item::Raw(_) => {}
            }
        }
    }

    /// A handshake step that failed on the socket.
    fn connect_error(&self, what: &str, e: std::io::Error) -> Error {
        Error::new(
            ErrorKind::RemoteDisconnected,
            "tcp connect",
            format!("peer {:?} at {}: {what}", self.peer, self.addr),
        )
        .with_source(e)
    }

    /// Connect, say hello, authenticate, and set up the same-host path where possible.
    /// Returns the stream, the same-host peer and a description of the data path. The
    /// handshake is [`Handshake`]'s; this only moves its bytes and opens the offer.
    async fn establish(&self) -> Result<(TcpStream, Option<same_host::Peer>, String)> {
        let io = |what: &str, e: std::io::Error| self.connect_error(what, e);
        let mut s = TcpStream::connect(self.addr)
            .await
            .map_err(|e| io("connect", e))?;
        nixl::control::tune(&s, self.options.listener.dead_peer_timeout);
        let want = match &self.lane {
            Lane::First(Ok(())) => Want::Yes,
            Lane::First(Err(why)) => Want::No(why.clone()),
            Lane::Extra => Want::Extra,
        };
        let secret = self.options.listener.secret.clone();
        let nonce = match secret {
            Some(_) => nixl::control::nonce(),
            None => [0; nixl::control::NONCE_LEN],
        };
        let mut m = Handshake::new(
            &self.agent,
            &self.peer,
            self.listener,
            format!("peer {:?} at {}", self.peer, self.addr),
            secret,
            nonce,
            want,
            self.options.same_host == SameHost::Require,
        );
        let mut opened = None;
        loop {
            while let Some(action) = m.poll() {
                match action {
                    HandshakeAction::Send { what, bytes } => {
                        s.write_all(&bytes).await.map_err(|e| io(what, e))?
                    }
                    HandshakeAction::Open(offer) => {
                        let (l, r) = (
                            s.local_addr().map_err(|e| io("same-host setup", e))?,
                            s.peer_addr().map_err(|e| io("same-host setup", e))?,
                        );
                        match same_host::Peer::open(
                            &offer,
                            l,
                            r,
                            self.threads.clone(),
                            self.options.copy_split(),
                        ) {
                            Ok(p) => {
                                opened = Some(p);
                                m.opened(Ok(()));
                            }
                            Err(e) => {
                                // The target going away closes its table before its
                                // sockets: a vanished descriptor is told apart from a
                                // path that does not work by the connection closing.
                                let mut waits = if e.kind() == std::io::ErrorKind::NotFound {
                                    20
                                } else {
                                    0
                                };
                                loop {
                                    if same_host::connection_closed(l, r) {
                                        return Err(io("same-host setup", e));
                                    }
                                    if waits == 0 {
                                        break;
                                    }
                                    waits -= 1;
                                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                                }
                                m.opened(Err(format!(
                                    "the target's shared memory could not be used ({e})"
                                )));
                            }
                        }
                    }
                    HandshakeAction::Up(outcome) => {
                        let path = self.path_of(outcome, opened.as_ref());
                        return Ok((s, opened, path));
                    }
                    HandshakeAction::Fail(e) => return Err(e),
                }
            }
            let what = m.what();
            let Some(buf) = m.need() else {
                unreachable!("the handshake waits only for bytes or for the offer");
            };
            s.read_exact(buf).await.map_err(|e| io(what, e))?;
            m.received();
        }
    }

    /// How data moves to this peer, for the way the connection came up.
    fn path_of(&self, outcome: Outcome, peer: Option<&same_host::Peer>) -> String {
        match (outcome, peer) {
            (Outcome::SameHost, Some(p)) => match p.cma_refused() {
                None => "same-host: shared memory for Agent::alloc memory, cross-memory attach for other host memory, device copies through CUDA IPC for GPU memory on both sides (staged over TCP otherwise), TCP for notifications".to_owned(),
                Some(why) => {
                    tracing::info!(peer = %self.peer, reason = %why, "tcp: cross-memory attach off for this peer");
                    format!("same-host: shared memory for Agent::alloc memory, device copies through CUDA IPC for GPU memory on both sides, TCP for the rest ({why})")
                }
            },
            (Outcome::Tcp(Some(why_not)), _) => {
                if self.options.same_host == SameHost::Auto {
                    tracing::info!(peer = %self.peer, reason = %why_not, "tcp: same-host path off for this peer; data goes over TCP");
                }
                format!(
                    "{} (same-host path off: {why_not})",
                    self.options.tcp_path()
                )
            }
            (Outcome::Tcp(None) | Outcome::SameHost, _) => self.options.tcp_path(),
        }
    }

    /// Send jobs until the queue closes or the socket fails; returns why it stopped.
    /// It owns the socket while it has work; idle, it leaves the socket in the slot,
    /// and the socket comes back as the first item queued after.
    async fn writer(&self, wr: OwnedWriteHalf, rx: &mut mpsc::UnboundedReceiver<Item>) -> Error {
        let mut own = Some(BufWriter::with_capacity(IO_BUF, wr));
        let mut scratch = Vec::new();
        let failed = |e: std::io::Error| {
            socket_error(
                &self.peer,
                "sending",
                self.options.listener.dead_peer_timeout,
                e,
            )
        };
        loop {
            if let (Some(w), true) = (own.as_mut(), rx.is_empty()) {
                if let Err(e) = w.flush().await {
                    return failed(e);
                }
                // Idle once everything is on the socket and nothing was queued since;
                // submitters queue under this lock, so none can slip in between.
                let mut idle = self.idle.lock().unwrap();
                if rx.is_empty() {
                    *idle = own.take();
                }
            }
            let Some(item) = rx.recv().await else {
                return Error::new(ErrorKind::Canceled, "tcp transfer", "connection dropped");
            };
            if let Item::Own(w) = item {
                debug_assert!(own.is_none(), "one socket");
                own = Some(w);
                continue;
            }
            let Some(w) = own.as_mut() else {
                // Cannot happen: whoever queues work while the slot holds the socket
                // queues the socket first. Were it to, fail the connection, not hang.
                return Error::new(
                    ErrorKind::Backend,
                    "tcp transfer",
                    format!(
                        "peer {:?}: work reached the writer ahead of the socket",
                        self.peer
                    ),
                );
            };
            let next_id = || self.table.lock().unwrap().issue();
            let sent = match item {
                Item::Own(_) => unreachable!("taken above"),
                Item::Raw(bytes) => w.write_all(&bytes).await,
                Item::Job(job) => self.send(w, &mut scratch, next_id(), job).await,
                Item::Gate(gate) => {
                    // The transfer's first piece must be on its way before waiting
                    // for every piece to land.
                    if let Err(e) = w.flush().await {
                        return failed(e);
                    }
                    // If this future is dropped while waiting, the slot finishes the
                    // transfer when its last piece completes.
                    match gate.wait().await {
                        Striped {
                            done,
                            result: Ok(()),
                            notif: Some(n),
                        } => {
                            self.send(w, &mut scratch, next_id(), Job::notify(n, done))
                                .await
                        }
                        Striped { done, result, .. } => {
                            done.complete(result);
                            Ok(())
                        }
                    }
                }
            };
            if let Err(e) = sent {
                return failed(e);
            }
        }
    }

    async fn send(
        &self,
        w: &mut BufWriter<OwnedWriteHalf>,
        scratch: &mut Vec<u8>,
        id: u64,
        job: Job,
    ) -> std::io::Result<()> {
        let Some(job) = self.try_direct(job) else {
            return Ok(());
        };
        let (head, head_len) = job.head(id);
        let head = &head[..head_len];
        let Job { kind, notif, done } = job;
        let notif = notif.as_deref().unwrap_or_default();
        match kind {
            JobKind::Notify => {
                if !park(&self.table, id, done, None) {
                    return Ok(());
                }
                w.write_all(head).await?;
                w.write_all(notif).await?;
            }
            JobKind::Transfer {
                op: Op::Read,
                table,
                local,
                total,
                ..
            } => {
                if !park(&self.table, id, done, Some((local.clone(), total))) {
                    return Ok(());
                }
                w.write_all(head).await?;
                w.write_all(&table).await?;
                w.write_all(notif).await?;
            }
            JobKind::Transfer {
                op: Op::Write,
                table,
                local,
                ..
            } => {
                if done.is_canceled() {
                    done.complete(Err(Error::new(
                        ErrorKind::Canceled,
                        "tcp transfer",
                        "dropped before it was sent",
                    )));
                    return Ok(());
                }
                // `held` keeps the memory alive while the payload is sent; the
                // table counts the request as waiting for the target meanwhile.
                self.held.put(done);
                self.table.lock().unwrap().sending(id);
                w.write_all(head).await?;
                w.write_all(&table).await?;
                w.write_all(notif).await?;
                send_slices(w, local_blocks(&local), scratch).await?;
                // Payload sent: hand the completer to the table (or finish it, if the
                // answer already came).
                let done = self.held.take().expect("held during the payload");
                let answered = self
                    .table
                    .lock()
                    .unwrap()
                    .sent(id, Pending { done, read: None });
                if let Some((p, r)) = answered {
                    p.done.complete(r);
                }
            }
        }
        Ok(())
    }

    /// A transfer queued before the connection was up goes direct now, where it can.
    /// Returns what is left to send over TCP: the job itself, its notification, or
    /// nothing.
    fn try_direct(&self, job: Job) -> Option<Job> {
        let Some(peer) = self.same_host.get() else {
            return Some(job);
        };
        let JobKind::Transfer {
            op,
            local,
            direct: Some(direct),
            ..
        } = &job.kind
        else {
            return Some(job);
        };
        let gpu = local
            .locals()
            .iter()
            .any(|r| r.kind() != nixl::MemKind::Dram);
        if gpu {
            if let Some(c) = self.conn.upgrade() {
                let Job { kind, notif, done } = job;
                let JobKind::Transfer {
                    op,
                    table,
                    local,
                    direct: Some(direct),
                    total,
                    ..
                } = kind
                else {
                    unreachable!("matched above");
                };
                return c.direct_gpu(peer, op, table, local, direct, total, notif, done);
            }
        }
        let r = peer.transfer(*op, local, direct);
        let Job { kind, notif, done } = job;
        let require = self.options.same_host == SameHost::Require;
        after_direct(&self.peer, require, r, notif, done, |notif, done| Job {
            kind,
            notif,
            done,
        })
    }
}

/// Put a request in the pending table before sending it; false if the connection is
/// already dead (then it was failed here).
fn park(
    table: &Mutex<Table>,
    id: u64,
    done: Completer,
    read: Option<(Arc<Segments>, u64)>,
) -> bool {
    let (read, len) = read.unzip();
    let parked = table.lock().unwrap().park(id, Pending { done, read }, len);
    match parked {
        Ok(()) => true,
        Err((p, e)) => {
            p.done.complete(Err(e));
            false
        }
    }
}

async fn reader(
    rd: OwnedReadHalf,
    timeouts: Timeouts,
    peer: String,
    table: Arc<Mutex<Table>>,
    dead: Arc<AtomicBool>,
    cancel: CancellationToken,
) {
    let held = Held::default();
    let e = tokio::select! {
        _ = cancel.cancelled() => None,
        e = read_loop(rd, timeouts, &peer, &table, &held) => Some(e),
    };
    if let Some(e) = e {
        tracing::debug!(%peer, error = %e, "tcp connection closed");
        fail(&table, &dead, e);
        cancel.cancel();
    }
    // The read loop's future is gone: a READ it was receiving can be failed now.
    held.fail(&table);
}

/// The connection's timeouts, as the reader applies them.
#[derive(Clone, Copy, Debug)]
struct Timeouts {
    /// The listener options'
    /// [`dead_peer_timeout`](nixl::control::ListenerOptions::dead_peer_timeout): the
    /// socket's `TCP_USER_TIMEOUT`.
    dead_peer: Duration,
    /// [`TcpOptions::pause_timeout`]: how long the target may hold back unanswering.
    pause: Duration,
}

/// The error of a socket that failed while `doing` (sending or receiving): a timeout
/// there is the kernel's `TCP_USER_TIMEOUT` (or keepalive) giving up on a peer that
/// left our data unacknowledged, or unread behind a zero window, for `dead` or more.
fn socket_error(peer: &str, doing: &str, dead: Duration, e: std::io::Error) -> Error {
    let why = match e.kind() {
        std::io::ErrorKind::UnexpectedEof => format!("{doing}: the peer closed the connection"),
        std::io::ErrorKind::TimedOut => format!(
            "{doing} failed: the peer read nothing of what was sent (or did not acknowledge it) for {dead:?} (TcpOptions::listener.dead_peer_timeout); the connection is closed"
        ),
        _ => format!("{doing} failed"),
    };
    Error::new(
        ErrorKind::RemoteDisconnected,
        "tcp transfer",
        format!("peer {peer:?}: {why}"),
    )
    .with_source(e)
}

/// Fill `buf` from `r` while the target holds back: reads (each cancel-safe, so
/// nothing that arrived is lost) stop at the hold-back's deadline to let [`HoldBack`]
/// judge the stall, and go on unless the stall ends the connection.
async fn fill_held_back(
    r: &mut BufReader<OwnedReadHalf>,
    buf: &mut [u8],
    hold: &mut HoldBack,
    table: &Mutex<Table>,
    timeouts: Timeouts,
    peer: &str,
) -> std::result::Result<(), Error> {
    let mut filled = 0;
    while filled < buf.len() {
        let Some(at) = hold.deadline() else {
            r.read_exact(&mut buf[filled..])
                .await
                .map_err(|e| socket_error(peer, "receiving", timeouts.dead_peer, e))?;
            return Ok(());
        };
        tokio::select! {
            n = r.read(&mut buf[filled..]) => match n {
                Ok(0) => {
                    let eof = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(socket_error(peer, "receiving", timeouts.dead_peer, eof));
                }
                Ok(n) => filled += n,
                Err(e) => return Err(socket_error(peer, "receiving", timeouts.dead_peer, e)),
            },
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {
                let outstanding = table.lock().unwrap().outstanding();
                hold.timed_out(Instant::now(), outstanding)?;
            }
        }
    }
    Ok(())
}

/// Lift or restore the socket's `TCP_USER_TIMEOUT`.
fn user_timeout(r: &BufReader<OwnedReadHalf>, t: UserTimeout, timeouts: Timeouts, peer: &str) {
    let lifted = t == UserTimeout::Lift;
    let timeout = (!lifted).then_some(timeouts.dead_peer);
    nixl::control::set_user_timeout(r.get_ref().as_ref(), timeout);
    tracing::debug!(%peer, lifted, "tcp: the peer holds back reading");
}

async fn read_loop(
    rd: OwnedReadHalf,
    timeouts: Timeouts,
    peer: &str,
    table: &Mutex<Table>,
    held: &Held,
) -> Error {
    let mut r = BufReader::with_capacity(IO_BUF, rd);
    let lost = |e: std::io::Error| socket_error(peer, "receiving", timeouts.dead_peer, e);
    let mut frames = Responses::default();
    let mut hold = HoldBack::new(peer, timeouts.pause);
    loop {
        // Not held back (nearly always): one plain read. Held back: a read that
        // stops at the hold-back's deadline.
        if hold.deadline().is_none() {
            if let Err(e) = r.read_exact(frames.need()).await {
                return lost(e);
            }
        } else if let Err(e) =
            fill_held_back(&mut r, frames.need(), &mut hold, table, timeouts, peer).await
        {
            return e;
        }
        let frame = match frames.received() {
            Ok(Some(f)) => f,
            Ok(None) => continue,
            Err(msg) => return table.lock().unwrap().broke(msg),
        };
        // A target that stopped reading on purpose is alive: its zero window must
        // not end the connection while it holds back (for `pause_timeout` at most
        // without answers: `fill_held_back`).
        let next_id = || table.lock().unwrap().next_id();
        if let Some(t) = hold.on_frame(&frame, next_id, Instant::now()) {
            user_timeout(&r, t, timeouts, peer);
        }
        let data = match frame {
            Frame::Data { id, len } => Some((id, len)),
            Frame::Ack { .. } => None,
            Frame::Paused(_) => continue,
        };
        let answer = table.lock().unwrap().on_frame(frame);
        if matches!(answer, Answer::Complete(..) | Answer::Receive(_)) {
            hold.answered(Instant::now());
        }
        match answer {
            Answer::Complete(p, result) => p.done.complete(result),
            Answer::Kept => {}
            Answer::Broke(e, p) => {
                if let Some(p) = p {
                    p.done.complete(Err(e.cloned()));
                }
                return e;
            }
            Answer::Receive(Pending { done, read }) => {
                let (Some(segs), Some((id, len))) = (read, data) else {
                    unreachable!("only READ data is received");
                };
                held.put(done);
                if let Err(e) = recv_slices(&mut r, local_blocks(&segs)).await {
                    return lost(e);
                }
                let done = held.take().expect("held during the data");
                // The ACK follows; the request waits for it again.
                let read = Some(segs);
                let failed = table
                    .lock()
                    .unwrap()
                    .landed(id, Pending { done, read }, len);
                if let Some((p, e)) = failed {
                    p.done.complete(Err(e));
                }
            }
        }
    }
}
