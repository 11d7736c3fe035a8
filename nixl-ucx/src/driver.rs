//! The progress driver: the only code that calls into UCX after setup.
//!
//! [`Core`] holds the [`Ucx`] owner and the backend's connection state behind one mutex.
//! Posting a transfer only enqueues a [`Cmd`] and wakes the driver; the driver (a tokio
//! task waiting on the worker's event fd, or a dedicated thread) drains the queue,
//! issues UCX operations, progresses the worker and completes requests. Setup calls
//! that must answer synchronously (`register`, `add_peer`, `prepare`) take the same
//! mutex briefly, so UCX is never entered by two threads at once.
//!
//! # Dead peers
//! UCX fails an endpoint when its transport notices the peer is gone (a closed socket,
//! a dead process, keepalive). It does not notice a peer *worker* that was destroyed
//! while its process lives on (an agent dropped, or shut down before it knew us, in a
//! process that keeps running; or another agent of the same process): shared-memory
//! keepalive checks only the peer's process, and an endpoint whose wireup the peer
//! never answered is never checked at all. Operations that need the peer (the wireup
//! itself, active-message emulation of RMA, a full shared-memory FIFO) then wait
//! forever. So the driver probes: while a connection has work that has made no
//! progress for a while, it sends a PING, which the peer answers with a PONG from its
//! progress loop; no answer within the bound fails the connection (see [`Liveness`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Completer, Error, ErrorKind, NotificationSink, Result};
use tokio::sync::{oneshot, Notify};
use tokio_util::sync::CancellationToken;

use crate::ffi::{EpId, FlightId, HoldsMemory, RkeyId, RmaSeg, Ucx, UcxError, WakeFd};
use crate::wire::{self, Kind};

/// What a flight keeps until UCX is done with it.
#[derive(Debug)]
pub(crate) enum Work {
    /// A transfer or notification: its completer (which keeps its memory alive).
    Done(Completer),
    /// `connect()` waiting for its flush.
    Connect(oneshot::Sender<Result<()>>),
    /// Internal messages (HELLO, BYE).
    Internal,
}

impl HoldsMemory for Work {
    fn completer(&self) -> Option<&Completer> {
        match self {
            Self::Done(c) => Some(c),
            _ => None,
        }
    }
}

/// A remote transfer, resolved once at prepare time.
#[derive(Debug)]
pub(crate) struct RemoteXfer {
    pub(crate) peer: Arc<str>,
    pub(crate) epoch: u64,
    pub(crate) write: bool,
    pub(crate) segs: Vec<RmaSeg>,
}

/// Work posted to the driver.
#[derive(Debug)]
pub(crate) enum Cmd {
    Transfer {
        xfer: Arc<RemoteXfer>,
        notif: Option<Bytes>,
        done: Completer,
    },
    Notify {
        peer: String,
        msg: Bytes,
        done: Completer,
    },
    Connect {
        peer: String,
        tx: oneshot::Sender<Result<()>>,
    },
}

#[derive(Debug)]
struct InFlight {
    flight: FlightId,
    /// Notification to send once the data is in place.
    notif: Option<Bytes>,
}

/// A liveness probe waiting for its PONG.
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// First PING of this round (a PONG to any PING of the round answers it).
    first: u64,
    /// The latest PING.
    seq: u64,
    deadline: Instant,
    /// The latest PING went out on the probe endpoint.
    second: bool,
}

/// When to probe a connection, and how long to wait for the answer.
///
/// Progress is an operation of the connection finishing, or a piece of its oldest
/// one (one-sided transfers are posted in pieces of at most 4 MiB, and some pieces
/// are watched), or the peer answering a probe.
///
/// A connection whose oldest operation has made no progress for `after` gets a PING
/// on its data endpoint, sent with a UCX reply endpoint, on which the peer's progress
/// loop answers a PONG at once (so answering never makes an endpoint). A PONG within
/// `answer` proves the peer alive and restarts the clock: a long transfer to a live
/// peer is probed about once per `after` and not failed.
///
/// The first PING can go unanswered while the peer lives: it waits behind the
/// connection's own traffic (a large WRITE ahead of it, or the data of a large READ
/// ahead of the PONG, where UCX runs RMA over active messages), or the peer dropped
/// its side of the connection (UCX then drops what arrives on it, and UCX's keepalive
/// fails the connection). So the second PING goes out on a separate endpoint, made
/// for this (only when needed: more endpoints between two workers strain UCX's
/// connection matching). No PONG to it within `answer` fails the connection: its
/// transfers end with `RemoteDisconnected`. A peer gone before it answered UCX's
/// handshake fails the same way (both PINGs wait for the handshake).
///
/// So a dead peer is noticed within `after + 2 * answer` (plus a driver tick).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Liveness {
    pub(crate) after: Duration,
    pub(crate) answer: Duration,
}

impl Liveness {
    /// Split a total bound: probe after a fifth of it, wait two fifths per PING.
    pub(crate) fn within(total: Duration) -> Self {
        let after = total / 5;
        Self {
            after,
            answer: (total - after) / 2,
        }
    }
}

#[derive(Debug)]
pub(crate) struct PeerConn {
    /// Unique per connection; also the stream id in our message headers.
    pub(crate) epoch: u64,
    pub(crate) address: Vec<u8>,
    pub(crate) ep: std::result::Result<EpId, String>,
    /// Whether the endpoints use UCX peer-failure handling.
    peer_failure: bool,
    /// A NIXL agent: notifications in NIXL's format, none of our own messages (no
    /// HELLO, BYE or liveness probes), failures from UCX's endpoint errors alone.
    pub(crate) nixl: bool,
    /// Why the connection is dead, once it is.
    pub(crate) failed: Option<String>,
    hello_sent: bool,
    next_seq: u64,
    /// Remote keys unpacked on this connection, by the peer's region id.
    rkeys: HashMap<u64, (Bytes, RkeyId)>,
    queue: VecDeque<InFlight>,
    /// When an operation of this connection (or a watched piece of its oldest) last
    /// finished, or the queue last became non-empty, or the peer last answered a probe.
    last_progress: Instant,
    /// The separate endpoint for a second PING (made when first needed).
    probe_ep: Option<EpId>,
    probe: Option<Probe>,
    next_probe: u64,
}

impl PeerConn {
    /// Queue a flight; an idle connection starts its progress clock `now`.
    fn push(&mut self, f: InFlight, now: Instant) {
        if self.queue.is_empty() {
            self.last_progress = now;
        }
        self.queue.push_back(f);
    }

    /// Mark the connection dead and force-close its endpoints, which completes what
    /// UCX still holds for it (with an error).
    fn fail<K: HoldsMemory>(&mut self, ucx: &mut Ucx<K>, why: String) {
        self.failed = Some(why);
        self.rkeys.clear();
        self.probe = None;
        if let Ok(ep) = self.ep {
            ucx.ep_close(ep);
        }
        if let Some(ep) = self.probe_ep.take() {
            ucx.ep_close(ep);
        }
    }
}

#[derive(Debug)]
enum AmEvent {
    /// One of our messages.
    Ours { header: wire::Header, data: Bytes },
    /// A NIXL agent's notification.
    Nixl { sender: String, msg: Bytes },
}

#[derive(Debug, Default)]
pub(crate) struct Reorder {
    next: u64,
    held: BTreeMap<u64, Bytes>,
}

/// Most notifications held back waiting for an earlier one, per sender stream.
const MAX_HELD: usize = 1 << 16;

impl Reorder {
    /// Notification `seq` of this stream arrived: hand it, and every held one it
    /// makes next, to `deliver` in order; or hold it until the ones before it arrive,
    /// unless `max_held` are held already. Returns false when it went out of order
    /// for that; then the held ones it overtook go right after it, in order (they
    /// would never be next again). The counter saturates: the peer picks `seq`, up
    /// to `u64::MAX`.
    pub(crate) fn take(
        &mut self,
        seq: u64,
        data: Bytes,
        max_held: usize,
        mut deliver: impl FnMut(Bytes),
    ) -> bool {
        if seq > self.next && self.held.len() < max_held {
            self.held.insert(seq, data);
            return true;
        }
        let in_order = seq <= self.next;
        deliver(data);
        self.next = self.next.max(seq.saturating_add(1));
        while let Some(held) = self.held.first_entry() {
            let s = *held.key();
            if s > self.next {
                break;
            }
            deliver(held.remove());
            if s == self.next {
                self.next = self.next.saturating_add(1);
            }
        }
        in_order
    }

    /// The next sequence number expected, and how many are held back.
    pub(crate) fn state(&self) -> (u64, impl Iterator<Item = u64> + '_) {
        (self.next, self.held.keys().copied())
    }
}

/// Longest sender name accepted in a NIXL notification.
const NIXL_MAX_NAME: usize = 4096;

/// Connection state and the UCX owner; always behind [`Shared::core`].
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) ucx: Ucx<Work>,
    rx: mpsc::Receiver<Cmd>,
    pub(crate) peers: HashMap<Arc<str>, PeerConn>,
    /// Flights of connections that were replaced or forgotten.
    orphans: Vec<(InFlight, String)>,
    events: Arc<Mutex<Vec<AmEvent>>>,
    reorder: HashMap<(String, u64), Reorder>,
    /// Peers that said HELLO to us: name -> their worker address.
    inbound: HashMap<String, Vec<u8>>,
    /// PINGs in flight (outside their connection's queue: nothing waits for them).
    pings: Vec<FlightId>,
    /// Set once shutdown began: PINGs are no longer answered.
    closing: Arc<AtomicBool>,
    pub(crate) agent: String,
    /// The bound UCX's version, for messages.
    pub(crate) ucx_version: String,
    pub(crate) sink: Option<NotificationSink>,
    max_notification: usize,
    liveness: Option<Liveness>,
    /// The time, read once per round (at [`Core::drain_inbox`]): progress clocks
    /// need no finer grain, and clock reads are a noticeable part of a small
    /// transfer's cost.
    now: Instant,
    /// Reused by [`Core::reap`].
    scratch: Vec<Arc<str>>,
    /// The GPU whose primary context UCX calls run in, once GPU memory was mapped
    /// (UCX before 1.19 copies CUDA memory in the context current on the calling
    /// thread).
    pub(crate) gpu: Option<u32>,
}

/// UCX between teardown and destroy.
#[derive(Debug, Default)]
pub(crate) struct Parked {
    pub(crate) ucx: Option<Ucx<Work>>,
    /// `destroy` ran (or the backend is gone): a teardown after it drops UCX at once.
    pub(crate) destroyed: bool,
}

/// How the driver is woken when work is posted.
#[derive(Debug)]
pub(crate) enum Wake {
    Task(Notify),
    Thread { fd: WakeFd, sleeping: AtomicBool },
}

/// What the backend and the driver share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) core: Mutex<Option<Core>>,
    /// UCX after the driver stopped: connections closed, memory still mapped, the
    /// worker and context alive until [`nixl::Backend::destroy`] (or drop), so the
    /// agent deregisters memory after the connections and before the context.
    pub(crate) parked: Mutex<Parked>,
    pub(crate) tx: mpsc::Sender<Cmd>,
    pub(crate) wake: Wake,
    /// Set when the driver has torn UCX down.
    pub(crate) stopped: AtomicBool,
    pub(crate) stopped_notify: Notify,
    pub(crate) spin: Duration,
    pub(crate) bye_bound: Duration,
    /// Whether posting may run the driver's round on the caller's thread
    /// ([`crate::UcxOptions::post_inline`]).
    pub(crate) inline: bool,
}

impl Shared {
    /// Hand a command to the driver. Never blocks.
    pub(crate) fn submit(&self, cmd: Cmd) {
        if let Err(mpsc::SendError(cmd)) = self.tx.send(cmd) {
            fail_cmd(cmd, ErrorKind::ShutDown, "the ucx backend has stopped");
            return;
        }
        if self.inline && self.run_inline() {
            return;
        }
        match &self.wake {
            Wake::Task(n) => n.notify_one(),
            Wake::Thread { fd, sleeping } => {
                if sleeping.swap(false, Ordering::SeqCst) {
                    fd.wake();
                }
            }
        }
    }

    /// Run the driver's round on the calling thread when nobody else is in UCX: the
    /// command just queued (and any before it, in order) is issued at once, and on
    /// shared memory a small transfer usually completes before `post` returns, with
    /// no thread hop. Returns whether nothing is left in flight, so the driver need
    /// not be woken; `false` (the driver is busy, or work is pending) wakes it as
    /// usual.
    fn run_inline(&self) -> bool {
        let Ok(mut g) = self.core.try_lock() else {
            return false;
        };
        let Some(core) = g.as_mut() else {
            return false;
        };
        core.step();
        !core.busy()
    }

    pub(crate) fn mark_stopped(&self) {
        self.stopped.store(true, Ordering::Release);
        self.stopped_notify.notify_waiters();
    }

    /// Wait until the driver has stopped.
    pub(crate) async fn wait_stopped(&self) {
        loop {
            let n = self.stopped_notify.notified();
            if self.stopped.load(Ordering::Acquire) {
                return;
            }
            n.await;
        }
    }
}

fn fail_cmd(cmd: Cmd, kind: ErrorKind, why: &str) {
    let e = || Error::new(kind, "ucx transfer", why);
    match cmd {
        Cmd::Transfer { done, .. } | Cmd::Notify { done, .. } => done.complete(Err(e())),
        Cmd::Connect { tx, .. } => {
            let _ = tx.send(Err(e()));
        }
    }
}

/// Introduce ourselves on `p`'s connection once (the peer learns our address, to say
/// goodbye to us at its shutdown).
fn say_hello(ucx: &mut Ucx<Work>, agent: &str, p: &mut PeerConn, now: Instant) {
    let (false, false, Ok(ep)) = (p.nixl, p.hello_sent, p.ep.clone()) else {
        return;
    };
    p.hello_sent = true;
    let h = wire::encode_header(Kind::Hello, p.epoch, 0, agent);
    let data = Bytes::copy_from_slice(ucx.address());
    let flight = ucx.am_send(ep, wire::AM_ID, h, data, false, Work::Internal);
    p.push(
        InFlight {
            flight,
            notif: None,
        },
        now,
    );
}

fn disconnected(peer: &str, why: &str) -> Error {
    Error::new(
        ErrorKind::RemoteDisconnected,
        "ucx transfer",
        format!("peer {peer:?}: {why}"),
    )
}

impl Core {
    pub(crate) fn new(
        mut ucx: Ucx<Work>,
        rx: mpsc::Receiver<Cmd>,
        max_notification: usize,
        liveness: Option<Liveness>,
    ) -> std::result::Result<Self, UcxError> {
        let events: Arc<Mutex<Vec<AmEvent>>> = Arc::default();
        let ev = events.clone();
        let closing = Arc::new(AtomicBool::new(false));
        let closing2 = closing.clone();
        ucx.set_am_handler(
            wire::AM_ID,
            Box::new(move |m| {
                let Some(header) = wire::decode_header(m.header) else {
                    tracing::warn!(
                        len = m.header.len(),
                        "ucx: dropping an active message with a malformed header"
                    );
                    return None;
                };
                if header.kind == Kind::Ping {
                    // Answered here, on the reply endpoint, while the driver runs.
                    return (!closing2.load(Ordering::Acquire)).then(|| {
                        wire::encode_header(Kind::Pong, header.stream, header.seq, "")
                    });
                }
                let Some(data) = m.data else {
                    tracing::warn!(from = %header.name, "ucx: dropping a rendezvous active message (never requested)");
                    return None;
                };
                ev.lock().unwrap().push(AmEvent::Ours {
                    header,
                    data: Bytes::copy_from_slice(data),
                });
                None
            }),
        )?;
        let ev = events.clone();
        // The serdes framing around the message: prefix, two tags, lengths, bars.
        let max_nixl = max_notification.saturating_add(64 + NIXL_MAX_NAME);
        ucx.set_am_handler(
            wire::NIXL_NOTIF_AM_ID,
            Box::new(move |m| {
                let Some(data) = m.data else {
                    tracing::warn!("ucx: dropping a NIXL notification offered by rendezvous (never requested)");
                    return None;
                };
                if data.len() > max_nixl {
                    tracing::warn!(len = data.len(), "ucx: dropping a NIXL notification over the notification limit");
                    return None;
                }
                match nixl::interop::decode_notification(data, NIXL_MAX_NAME) {
                    Ok((sender, msg)) => ev.lock().unwrap().push(AmEvent::Nixl {
                        sender,
                        msg: Bytes::copy_from_slice(msg),
                    }),
                    Err(e) => {
                        tracing::warn!(len = data.len(), error = %e, "ucx: dropping a malformed NIXL notification")
                    }
                }
                None
            }),
        )?;
        Ok(Self {
            ucx,
            rx,
            peers: HashMap::new(),
            orphans: Vec::new(),
            events,
            reorder: HashMap::new(),
            inbound: HashMap::new(),
            pings: Vec::new(),
            closing,
            agent: String::new(),
            ucx_version: String::new(),
            sink: None,
            max_notification,
            liveness,
            now: Instant::now(),
            scratch: Vec::new(),
            gpu: None,
        })
    }

    /// Learn a peer's worker address; keeps a healthy connection to the same address.
    /// `nixl`: the peer is a NIXL agent (see [`PeerConn::nixl`]).
    pub(crate) fn add_peer(&mut self, peer: &str, address: &[u8], nixl: bool) {
        if let Some(p) = self.peers.get(peer) {
            if p.address == address && p.failed.is_none() && p.ep.is_ok() && p.nixl == nixl {
                return;
            }
        }
        self.remove_peer(peer, "the peer's connection info changed");
        let mut peer_failure = true;
        let ep = match self.ucx.ep_create(address, true) {
            // NIXL makes every endpoint with peer-failure handling; a NIXL agent we
            // cannot reach so is one whose UCX build ours cannot talk to (connecting
            // anyway can end in an assertion inside UCX).
            Err(e) if nixl => Err(e),
            Err(e) if Ucx::<Work>::is_unreachable(&e) => {
                // UCX 1.13-1.22 shared-memory transports handle peer failure only
                // with UCX_POSIX_ERROR_HANDLING=y / UCX_SYSV_ERROR_HANDLING=y; without
                // them, peer error handling makes a shm-only peer unreachable.
                tracing::warn!(
                    peer,
                    error = %e,
                    "ucx: no transport to the peer supports peer-failure handling; connecting without it (set UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y for shared memory); a crashed peer is then noticed only by its transfers' errors"
                );
                peer_failure = false;
                self.ucx.ep_create(address, false)
            }
            r => r,
        }
        .map_err(|e| {
            tracing::warn!(peer, error = %e, "ucx: cannot create an endpoint to the peer");
            if nixl {
                format!(
                    "UCX {} bound here cannot reach this NIXL agent ({e}): bind the UCX build the NIXL agents use (NIXL_UCX_LIB=<its libucp>; for the nixl-cu12 wheel, nixl_cu12.libs/libucp-*.so*)",
                    self.ucx_version
                )
            } else {
                e.to_string()
            }
        });
        tracing::debug!(peer, ok = ep.is_ok(), peer_failure, "ucx endpoint created");
        self.peers.insert(
            Arc::from(peer),
            PeerConn {
                epoch: random_u64(),
                address: address.to_vec(),
                ep,
                peer_failure,
                nixl,
                failed: None,
                hello_sent: false,
                next_seq: 0,
                rkeys: HashMap::new(),
                queue: VecDeque::new(),
                last_progress: Instant::now(),
                probe_ep: None,
                probe: None,
                next_probe: 0,
            },
        );
    }

    /// Forget a peer: close its endpoint; its in-flight work fails.
    pub(crate) fn remove_peer(&mut self, peer: &str, why: &str) {
        if let Some(mut p) = self.peers.remove(peer) {
            if let Ok(ep) = p.ep {
                self.ucx.ep_close(ep);
            }
            if let Some(ep) = p.probe_ep.take() {
                self.ucx.ep_close(ep);
            }
            for f in p.queue.drain(..) {
                self.orphans.push((f, format!("peer {peer:?}: {why}")));
            }
        }
    }

    /// Resolve a remote key for `region` of `peer`, unpacking it once per connection.
    pub(crate) fn rkey(
        &mut self,
        peer: &str,
        region: u64,
        blob: &Bytes,
        packed: &[u8],
    ) -> Result<(u64, RkeyId)> {
        const OP: &str = "ucx prepare";
        let Some(p) = self.peers.get_mut(peer) else {
            return Err(Error::new(
                ErrorKind::UnknownPeer,
                OP,
                format!("ucx: no connection info for peer {peer:?}"),
            ));
        };
        if let Some(why) = &p.failed {
            return Err(disconnected(peer, why));
        }
        let ep = match &p.ep {
            Ok(ep) => *ep,
            Err(e) => {
                return Err(Error::new(
                    ErrorKind::RemoteDisconnected,
                    OP,
                    format!("peer {peer:?} is unreachable over UCX: {e}"),
                ))
            }
        };
        if let Some((b, k)) = p.rkeys.get(&region) {
            if b == blob {
                return Ok((p.epoch, *k));
            }
        }
        let k = self.ucx.rkey_unpack(ep, packed).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                OP,
                format!("peer {peer:?} region {region}: the remote key does not unpack"),
            )
            .with_source(e)
        })?;
        p.rkeys.insert(region, (blob.clone(), k));
        Ok((p.epoch, k))
    }

    fn ensure_hello(&mut self, peer: &str) {
        if let Some(p) = self.peers.get_mut(peer) {
            say_hello(&mut self.ucx, &self.agent, p, self.now);
        }
    }

    fn exec(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Transfer { xfer, notif, done } => {
                let now = self.now;
                let Some(p) = self.peers.get_mut(&*xfer.peer) else {
                    return done.complete(Err(Error::new(
                        ErrorKind::UnknownPeer,
                        "ucx transfer",
                        format!("peer {:?} was forgotten", xfer.peer),
                    )));
                };
                if p.epoch != xfer.epoch {
                    return done.complete(Err(Error::new(
                        ErrorKind::StaleGeneration,
                        "ucx transfer",
                        format!(
                            "the connection to {:?} was replaced since this request was prepared; prepare it again",
                            xfer.peer
                        ),
                    )));
                }
                if let Some(why) = &p.failed {
                    return done.complete(Err(disconnected(&xfer.peer, why)));
                }
                if done.is_canceled() {
                    return done.complete(Err(Error::new(
                        ErrorKind::Canceled,
                        "ucx transfer",
                        "dropped before it started",
                    )));
                }
                let Ok(ep) = p.ep else {
                    return done.complete(Err(disconnected(&xfer.peer, "unreachable")));
                };
                say_hello(&mut self.ucx, &self.agent, p, now);
                let flight = self.ucx.rma(ep, xfer.write, &xfer.segs, Work::Done(done));
                p.push(InFlight { flight, notif }, now);
            }
            Cmd::Notify { peer, msg, done } => {
                if msg.len() > self.max_notification {
                    return done.complete(Err(Error::new(
                        ErrorKind::InvalidArgument,
                        "ucx notify",
                        format!(
                            "notification of {} bytes exceeds the limit of {}",
                            msg.len(),
                            self.max_notification
                        ),
                    )));
                }
                match self.peers.get(peer.as_str()) {
                    None => done.complete(Err(Error::new(
                        ErrorKind::UnknownPeer,
                        "ucx notify",
                        format!("ucx: no connection info for peer {peer:?}"),
                    ))),
                    Some(p) if p.failed.is_some() || p.ep.is_err() => {
                        let why = p.failed.clone().unwrap_or_else(|| "unreachable".into());
                        done.complete(Err(disconnected(&peer, &why)))
                    }
                    Some(_) => {
                        self.ensure_hello(&peer);
                        let f = self.send_notif(&peer, msg, done);
                        if let (Some(p), Some(f)) = (self.peers.get_mut(peer.as_str()), f) {
                            p.push(
                                InFlight {
                                    flight: f,
                                    notif: None,
                                },
                                self.now,
                            );
                        }
                    }
                }
            }
            Cmd::Connect { peer, tx } => match self.peers.get(peer.as_str()) {
                None => {
                    let _ = tx.send(Err(Error::new(
                        ErrorKind::UnknownPeer,
                        "ucx connect",
                        format!("ucx: no connection info for peer {peer:?}"),
                    )));
                }
                Some(p) if p.failed.is_some() || p.ep.is_err() => {
                    let why = p
                        .failed
                        .clone()
                        .unwrap_or_else(|| p.ep.as_ref().err().cloned().unwrap_or_default());
                    let _ = tx.send(Err(disconnected(&peer, &why)));
                }
                Some(p) => {
                    let ep = p.ep.clone().expect("checked above");
                    self.ensure_hello(&peer);
                    let flight = self.ucx.flush(ep, Work::Connect(tx));
                    if let Some(p) = self.peers.get_mut(peer.as_str()) {
                        p.push(
                            InFlight {
                                flight,
                                notif: None,
                            },
                            self.now,
                        );
                    }
                }
            },
        }
    }

    /// Send a notification on `peer`'s connection; `None` if the peer is gone (then
    /// `done` was completed).
    fn send_notif(&mut self, peer: &str, msg: Bytes, done: Completer) -> Option<FlightId> {
        let Some(p) = self.peers.get_mut(peer) else {
            done.complete(Err(disconnected(peer, "forgotten")));
            return None;
        };
        let Ok(ep) = p.ep else {
            done.complete(Err(disconnected(peer, "unreachable")));
            return None;
        };
        if p.nixl {
            let data = Bytes::from(nixl::interop::encode_notification(&self.agent, &msg));
            return Some(self.ucx.am_send(
                ep,
                wire::NIXL_NOTIF_AM_ID,
                Vec::new(),
                data,
                false,
                Work::Done(done),
            ));
        }
        let h = wire::encode_header(Kind::Notif, p.epoch, p.next_seq, &self.agent);
        p.next_seq += 1;
        Some(
            self.ucx
                .am_send(ep, wire::AM_ID, h, msg, false, Work::Done(done)),
        )
    }

    /// One round: commands, progress, incoming messages, failures, completions.
    /// Returns the number of commands executed.
    pub(crate) fn step(&mut self) -> usize {
        if let Some(d) = self.gpu {
            // Whichever thread runs this round (the driver, or a caller posting
            // inline), UCX finds the GPU's context current.
            if let Err(e) = nixl::gpu::bind_thread(d) {
                tracing::warn!(error = %e, "ucx: binding the GPU context failed");
            }
        }
        let mut n = self.drain_inbox();
        for _ in 0..64 {
            let p = self.ucx.progress() as usize;
            n += p;
            if p == 0 {
                break;
            }
        }
        self.handle_events();
        self.check_failures();
        self.reap();
        self.ucx.reap_closed();
        n
    }

    /// Run every queued command; returns how many.
    pub(crate) fn drain_inbox(&mut self) -> usize {
        self.now = Instant::now();
        let mut n = 0;
        while let Ok(cmd) = self.rx.try_recv() {
            self.exec(cmd);
            n += 1;
        }
        n
    }

    /// Operations in flight (the driver keeps progressing while this holds).
    pub(crate) fn busy(&self) -> bool {
        self.ucx.busy()
    }

    fn handle_events(&mut self) {
        let events = std::mem::take(&mut *self.events.lock().unwrap());
        for ev in events {
            let (h, data) = match ev {
                AmEvent::Ours { header, data } => (header, data),
                AmEvent::Nixl { sender, msg } => {
                    // NIXL does not order notifications; neither can we.
                    if let Some(sink) = &self.sink {
                        sink.deliver(&sender, msg);
                    }
                    continue;
                }
            };
            let ev_data = data;
            match h.kind {
                Kind::Notif => self.deliver(h.name, h.stream, h.seq, ev_data),
                Kind::Hello => {
                    tracing::debug!(peer = %h.name, "ucx: peer connected");
                    self.inbound.insert(h.name, ev_data.to_vec());
                }
                // Answered by the message handler.
                Kind::Ping => {}
                Kind::Pong => {
                    let p = self.peers.values_mut().find(|p| p.epoch == h.stream);
                    if let Some(p) = p {
                        if p.probe
                            .is_some_and(|pr| (pr.first..=pr.seq).contains(&h.seq))
                        {
                            p.probe = None;
                            p.last_progress = self.now;
                        }
                    }
                }
                Kind::Bye => {
                    tracing::debug!(peer = %h.name, "ucx: peer said goodbye");
                    self.reorder.retain(|(n, _), _| *n != h.name);
                    if self
                        .inbound
                        .get(&h.name)
                        .is_some_and(|a| **a == ev_data[..])
                    {
                        self.inbound.remove(&h.name);
                    }
                    if let Some(p) = self.peers.get_mut(h.name.as_str()) {
                        if p.address == ev_data[..] && p.failed.is_none() && !p.nixl {
                            p.fail(&mut self.ucx, "the peer shut down".into());
                        }
                    }
                }
            }
        }
    }

    fn deliver(&mut self, name: String, stream: u64, seq: u64, data: Bytes) {
        let Some(sink) = &self.sink else { return };
        let r = self.reorder.entry((name.clone(), stream)).or_default();
        if !r.take(seq, data, MAX_HELD, |d| sink.deliver(&name, d)) {
            tracing::warn!(peer = %name, "ucx: too many notifications held back; delivering out of order");
        }
    }

    /// Send a PING on `peer`'s connection: on its data endpoint, or (`second`) on
    /// its probe endpoint (see [`Liveness`]).
    fn send_probe(&mut self, peer: &str, liveness: Liveness, second: bool) {
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        let Ok(data_ep) = p.ep else { return };
        let ep = match (second, p.probe_ep) {
            (false, _) => data_ep,
            (true, Some(ep)) => ep,
            (true, None) => match self.ucx.ep_create(&p.address, p.peer_failure) {
                Ok(ep) => {
                    p.probe_ep = Some(ep);
                    ep
                }
                Err(e) => {
                    let why = format!("connection failed: the peer is unreachable: {e}");
                    tracing::debug!(peer, why, "ucx: peer failed");
                    p.fail(&mut self.ucx, why);
                    return;
                }
            },
        };
        let seq = p.next_probe;
        p.next_probe += 1;
        p.probe = Some(Probe {
            first: p.probe.map_or(seq, |pr| pr.first),
            seq,
            deadline: Instant::now() + liveness.answer,
            second,
        });
        let h = wire::encode_header(Kind::Ping, p.epoch, seq, &self.agent);
        let flight = self
            .ucx
            .am_send(ep, wire::AM_ID, h, Bytes::new(), true, Work::Internal);
        self.pings.push(flight);
    }

    /// Fail connections whose peer is gone: UCX reported an error on an endpoint, or
    /// the peer did not answer a liveness probe in time (see the module docs). Probe
    /// connections whose work has stalled.
    fn check_failures(&mut self) {
        let now = self.now;
        let mut probe = Vec::new();
        for (name, p) in self.peers.iter_mut() {
            if p.failed.is_some() {
                continue;
            }
            let Ok(ep) = p.ep else { continue };
            let err = self
                .ucx
                .ep_error(ep)
                .or_else(|| p.probe_ep.and_then(|e| self.ucx.ep_error(e)));
            let why = if let Some(e) = err {
                format!("connection failed: {e}")
            } else if let Some(pr) = p.probe.filter(|pr| now >= pr.deadline) {
                let Some(l) = self.liveness else { continue };
                if !pr.second {
                    // Ask again, on a separate endpoint.
                    probe.push((name.clone(), l, true));
                    continue;
                }
                format!(
                    "no answer to liveness probes for {:?} while transfers waited on the peer: it is gone",
                    l.answer * 2
                )
            } else {
                if let Some(l) = self.liveness.filter(|_| !p.nixl) {
                    if p.probe.is_none()
                        && !p.queue.is_empty()
                        && now.duration_since(p.last_progress) >= l.after
                    {
                        probe.push((name.clone(), l, false));
                    }
                }
                continue;
            };
            tracing::debug!(peer = %name, why, "ucx: peer failed");
            p.fail(&mut self.ucx, why);
        }
        for (name, l, second) in probe {
            self.send_probe(&name, l, second);
        }
    }

    fn finish(
        &mut self,
        peer: &str,
        f: InFlight,
        work: Work,
        res: std::result::Result<(), UcxError>,
    ) -> Option<InFlight> {
        let failed = self.peers.get(peer).and_then(|p| p.failed.clone());
        let err = |e: UcxError| match &failed {
            Some(why) => disconnected(peer, why).with_source(e),
            None if e.is_disconnect() => disconnected(peer, "connection lost").with_source(e),
            None => Error::new(ErrorKind::Backend, "ucx transfer", format!("peer {peer:?}"))
                .with_source(e),
        };
        match work {
            Work::Done(done) => match (res, f.notif) {
                (Ok(()), Some(msg)) => {
                    // The data is in place at the target: now the notification.
                    self.send_notif(peer, msg, done).map(|flight| InFlight {
                        flight,
                        notif: None,
                    })
                }
                (Ok(()), None) => {
                    done.complete(Ok(()));
                    None
                }
                (Err(e), _) => {
                    done.complete(Err(err(e)));
                    None
                }
            },
            Work::Connect(tx) => {
                let _ = tx.send(res.map_err(err));
                None
            }
            Work::Internal => {
                if let Err(e) = res {
                    tracing::debug!(peer, error = %e, "ucx: control message failed");
                }
                None
            }
        }
    }

    fn reap(&mut self) {
        let mut names = std::mem::take(&mut self.scratch);
        names.extend(
            self.peers
                .iter()
                .filter(|(_, p)| !p.queue.is_empty())
                .map(|(n, _)| n.clone()),
        );
        for name in names.drain(..) {
            while let Some(p) = self.peers.get_mut(&name) {
                let Some(head) = p.queue.front() else { break };
                let Some((work, res)) = self.ucx.poll(head.flight) else {
                    // Part of a long transfer arrived: the peer is alive.
                    if self.ucx.advanced(head.flight) {
                        p.last_progress = self.now;
                        p.probe = None;
                    }
                    break;
                };
                // Progress: the peer (or the transport) is moving.
                p.last_progress = self.now;
                p.probe = None;
                let head = p.queue.pop_front().expect("head exists");
                if let Some(next) = self.finish(&name, head, work, res) {
                    if let Some(p) = self.peers.get_mut(&name) {
                        p.queue.push_front(next);
                    }
                }
            }
        }
        self.scratch = names;
        let ucx = &mut self.ucx;
        self.pings.retain(|f| ucx.poll(*f).is_none());
        let mut i = 0;
        while i < self.orphans.len() {
            if let Some((work, _)) = self.ucx.poll(self.orphans[i].0.flight) {
                let (_, why) = self.orphans.swap_remove(i);
                match work {
                    Work::Done(done) => done.complete(Err(Error::new(
                        ErrorKind::RemoteDisconnected,
                        "ucx transfer",
                        why,
                    ))),
                    Work::Connect(tx) => {
                        let _ = tx.send(Err(Error::new(
                            ErrorKind::RemoteDisconnected,
                            "ucx connect",
                            why,
                        )));
                    }
                    Work::Internal => {}
                }
            } else {
                i += 1;
            }
        }
    }

    /// Shutdown, part one: refuse queued work and say goodbye to every peer that talked
    /// to us or that we talked to. Returns the flights to wait for (bounded).
    fn say_goodbye(&mut self) -> Vec<FlightId> {
        self.closing.store(true, Ordering::Release);
        while let Ok(cmd) = self.rx.try_recv() {
            fail_cmd(cmd, ErrorKind::ShutDown, "the ucx backend is shutting down");
        }
        let mut targets: Vec<(String, Vec<u8>)> = self
            .peers
            .iter()
            .filter(|(_, p)| p.hello_sent && !p.nixl && p.failed.is_none() && p.ep.is_ok())
            .map(|(n, p)| (n.to_string(), p.address.clone()))
            .collect();
        for (n, a) in &self.inbound {
            if !targets.iter().any(|(tn, ta)| tn == n && ta == a) {
                targets.push((n.clone(), a.clone()));
            }
        }
        let mut flights = Vec::new();
        let me = Bytes::copy_from_slice(self.ucx.address());
        for (name, addr) in targets {
            let ep = match self.peers.get(name.as_str()) {
                Some(p) if p.address == addr && p.failed.is_none() => p.ep.clone().ok(),
                _ => self
                    .ucx
                    .ep_create(&addr, true)
                    .or_else(|_| self.ucx.ep_create(&addr, false))
                    .ok(),
            };
            let Some(ep) = ep else { continue };
            let h = wire::encode_header(Kind::Bye, 0, 0, &self.agent);
            flights.push(
                self.ucx
                    .am_send(ep, wire::AM_ID, h, me.clone(), false, Work::Internal),
            );
            flights.push(self.ucx.flush(ep, Work::Internal));
        }
        flights
    }
}

/// Tear down: goodbyes (bounded), then fail what is left and close every connection;
/// UCX itself (memory mappings, worker, context) is parked for deregistration and
/// [`nixl::Backend::destroy`]. Runs on the driver.
pub(crate) fn teardown(shared: &Shared) {
    // Held throughout, so deregister and destroy wait for the parking to finish.
    let mut parked = shared.parked.lock().unwrap();
    let core = shared.core.lock().unwrap().take();
    if let Some(mut core) = core {
        let flights = core.say_goodbye();
        let deadline = Instant::now() + shared.bye_bound;
        let mut left = flights;
        while !left.is_empty() && Instant::now() < deadline {
            core.ucx.progress();
            left.retain(|f| core.ucx.poll(*f).is_none());
            if !left.is_empty() {
                std::thread::yield_now();
            }
        }
        // Complete what finished, then close the connections; what is still queued
        // fails when the rest of the core goes.
        core.handle_events();
        core.reap();
        let peers: Vec<Arc<str>> = core.peers.keys().cloned().collect();
        for p in peers {
            core.remove_peer(&p, "the ucx backend is shutting down");
        }
        let Core { mut ucx, .. } = core;
        drop(ucx.close_all());
        if parked.destroyed {
            drop(ucx);
        } else {
            parked.ucx = Some(ucx);
        }
    }
    drop(parked);
    shared.mark_stopped();
}

/// When the driver may sleep, and for how long.
///
/// Not everything UCX still has to do raises an event: a sender whose shared-memory
/// queue was full retries only when progressed. So after activity the driver first
/// spins (`spin`), then wakes on a short tick for a while (`LINGER`), and only then
/// sleeps on the event fd alone.
#[derive(Debug)]
struct Pace {
    spin: Duration,
    last_active: Instant,
}

/// How long after the last activity the driver keeps a short wake-up tick.
const LINGER: Duration = Duration::from_millis(500);
/// The short tick.
const TICK: Duration = Duration::from_millis(1);

impl Pace {
    fn new(spin: Duration) -> Self {
        Self {
            spin,
            last_active: Instant::now(),
        }
    }

    /// Record a round; returns whether to go round again at once (no sleeping).
    fn hot(&mut self, activity: usize, busy: bool) -> bool {
        let now = Instant::now();
        if activity > 0 {
            self.last_active = now;
            return true;
        }
        busy && now.duration_since(self.last_active) < self.spin
    }

    /// How long to sleep on the event fd at most.
    fn tick(&self, busy: bool, idle: Duration) -> Duration {
        if busy || self.last_active.elapsed() < LINGER {
            TICK
        } else {
            idle
        }
    }
}

/// The tokio progress task: sleeps on the worker's event fd when idle.
pub(crate) async fn run_task(shared: Arc<Shared>, cancel: CancellationToken) {
    let afd = match shared.core.lock().unwrap().as_ref() {
        Some(c) => crate::ffi::watch_event_fd(&c.ucx),
        None => return shared.mark_stopped(),
    };
    let afd = match afd {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "ucx: cannot watch the worker's event fd; stopping");
            teardown(&shared);
            return;
        }
    };
    let Wake::Task(notify) = &shared.wake else {
        unreachable!("task mode uses a Notify")
    };
    let mut pace = Pace::new(shared.spin);
    loop {
        if cancel.is_cancelled() {
            break;
        }
        let (activity, busy) = {
            let mut g = shared.core.lock().unwrap();
            let Some(core) = g.as_mut() else { break };
            let a = core.step();
            (a, core.busy())
        };
        if pace.hot(activity, busy) {
            // Let other tasks (the ones awaiting our completions) run.
            tokio::task::yield_now().await;
            continue;
        }
        let armed = {
            let mut g = shared.core.lock().unwrap();
            let Some(core) = g.as_mut() else { break };
            match core.ucx.arm() {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "ucx: arming the worker failed; polling");
                    false
                }
            }
        };
        if !armed {
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            r = afd.readable() => {
                if let Ok(mut g) = r {
                    g.clear_ready();
                }
            }
            _ = notify.notified() => {}
            _ = tokio::time::sleep(pace.tick(busy, Duration::from_secs(3600))) => {}
        }
    }
    drop(afd);
    teardown(&shared);
}

/// The dedicated progress thread: sleeps in `poll` on the event fd and a wake fd.
pub(crate) fn run_thread(shared: Arc<Shared>, stop: CancellationToken) {
    let Wake::Thread { fd, sleeping } = &shared.wake else {
        unreachable!("thread mode uses a wake fd")
    };
    let efd = match shared.core.lock().unwrap().as_ref() {
        Some(c) => c.ucx.event_fd(),
        None => return shared.mark_stopped(),
    };
    let mut pace = Pace::new(shared.spin);
    while !stop.is_cancelled() {
        let (activity, busy) = {
            let mut g = shared.core.lock().unwrap();
            let Some(core) = g.as_mut() else { break };
            let a = core.step();
            (a, core.busy())
        };
        if pace.hot(activity, busy) {
            std::hint::spin_loop();
            continue;
        }
        let mut g = shared.core.lock().unwrap();
        let Some(core) = g.as_mut() else { break };
        if !core.ucx.arm().unwrap_or(false) {
            continue;
        }
        sleeping.store(true, Ordering::SeqCst);
        // Anything posted before `sleeping` was visible must be run now, not slept on.
        if core.drain_inbox() > 0 {
            sleeping.store(false, Ordering::SeqCst);
            continue;
        }
        drop(g);
        // The stop flag comes with a wake, so the idle wait can be long.
        fd.wait_with(efd, pace.tick(busy, Duration::from_secs(3600)));
        sleeping.store(false, Ordering::SeqCst);
        fd.drain();
    }
    teardown(&shared);
}

/// A random `u64` from the OS (connection epochs).
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("the OS random source works");
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(r: &mut Reorder, seq: u64, max_held: usize) -> (bool, Vec<u64>) {
        let mut out = Vec::new();
        let data = Bytes::copy_from_slice(&seq.to_le_bytes());
        let in_order = r.take(seq, data, max_held, |d| {
            out.push(u64::from_le_bytes(d[..].try_into().unwrap()));
        });
        (in_order, out)
    }

    #[test]
    fn notifications_are_reordered_and_a_full_hold_back_strands_none() {
        let mut r = Reorder::default();
        assert_eq!(take(&mut r, 1, 2), (true, vec![]));
        assert_eq!(take(&mut r, 0, 2), (true, vec![0, 1]));
        // Two held; the third overtakes them, and they follow it instead of
        // staying held for good.
        assert_eq!(take(&mut r, 4, 2), (true, vec![]));
        assert_eq!(take(&mut r, 5, 2), (true, vec![]));
        assert_eq!(take(&mut r, 9, 2), (false, vec![9, 4, 5]));
        assert_eq!(r.state().1.count(), 0);
        assert_eq!(take(&mut r, 10, 2), (true, vec![10]));
        // The sender picks the numbers: the top one does not overflow.
        assert_eq!(take(&mut r, 12, 2), (true, vec![]));
        assert_eq!(take(&mut r, 13, 2), (true, vec![]));
        assert_eq!(take(&mut r, u64::MAX, 2), (false, vec![u64::MAX, 12, 13]));
        assert_eq!(take(&mut r, 3, 2), (true, vec![3]));
    }
}
