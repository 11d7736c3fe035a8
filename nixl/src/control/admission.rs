//! Which incoming connections a listener keeps: one policy for every listener (the
//! backends' control connections and the exchange's side channel and NIXL listener).
//!
//! - A connection is first *in its handshake*. That set is bounded; a newcomer closes
//!   the oldest in it when full (its own address's oldest when that address holds its
//!   share of the set or more, else the oldest of an address over its share: a few
//!   addresses cannot push out everyone else's), so idle
//!   or slow sockets cannot lock a legitimate peer out: each is closed by the time
//!   enough newer ones arrived, or by its listener's handshake timeout.
//! - Past its handshake it is *established*, in a bounded set with a bound per
//!   source too. An established connection is never closed to make room while it
//!   works: only one idle for [`AdmissionLimits::idle`] may give its place to a
//!   newcomer when the set is full, and never one that proved the agent's shared
//!   secret (an authenticated member).
//! - The bounds are clamped to the process's open-files limit
//!   ([`open_files_limit`](crate::open_files_limit)): each listener takes at most an
//!   eighth of it for handshakes and a quarter for established connections, so a few
//!   listeners together leave descriptors for the rest of the process, and a flood
//!   of connections is refused by the listener instead of exhausting the process.
//!
//! [`Admission`] only counts and decides; the listener's task closes what it is told
//! (the token given with each connection) and holds the [`Ticket`] while it serves.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// A listener's bounds; see [`Admission`] for the policy they bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Connections in their handshake at once (at least 1).
    pub handshakes: usize,
    /// Established connections at once.
    pub established: usize,
    /// Connections in their handshake from one address (an IPv6 address's /64 counts
    /// as one; at least 1).
    pub per_source_handshakes: usize,
    /// Established connections from one address.
    pub per_source_established: usize,
    /// How long an established connection must have been idle before it may give its
    /// place to a newcomer when the established set is full.
    pub idle: Duration,
}

impl AdmissionLimits {
    /// `handshakes` and `established` at once, a quarter of the handshakes and half
    /// the established places per source, 60 s idle.
    pub fn new(handshakes: usize, established: usize) -> Self {
        Self {
            handshakes,
            established,
            per_source_handshakes: handshakes.div_ceil(4),
            per_source_established: established.div_ceil(2),
            idle: Duration::from_secs(60),
        }
    }

    /// These limits clamped to what `open_files` (the process's limit, if any) leaves
    /// one listener: an eighth for handshakes, a quarter for established connections;
    /// the per-source bounds shrink with them, to at most a quarter of the handshakes
    /// and half the established places.
    pub fn clamped(self, open_files: Option<u64>) -> Self {
        let Some(files) = open_files else {
            return self;
        };
        let part = |n: u64| usize::try_from(files / n).unwrap_or(usize::MAX).max(1);
        let handshakes = self.handshakes.min(part(8)).max(1);
        let established = self.established.min(part(4));
        Self {
            handshakes,
            established,
            per_source_handshakes: self
                .per_source_handshakes
                .min(handshakes.div_ceil(4))
                .max(1),
            per_source_established: self.per_source_established.min(established.div_ceil(2)),
            idle: self.idle,
        }
    }
}

/// The listener's connection limits and the connections they count.
///
/// One policy for every listener:
/// - A connection is first in its handshake. That set is bounded; a newcomer closes
///   the oldest in it when full (its own address's oldest when that address holds
///   its share or more, else the oldest of an address over its share).
/// - Past its handshake it is established, in a bounded set with a share per
///   address. Only a connection idle for [`AdmissionLimits::idle`] and not
///   authenticated gives its place to a newcomer when the set is full.
/// - The bounds are clamped to the process's open-files limit
///   ([`AdmissionLimits::clamped`]).
#[derive(Debug)]
pub struct Admission {
    limits: AdmissionLimits,
    epoch: Instant,
    state: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    next: u64,
    /// Connections in their handshake, oldest first.
    handshaking: VecDeque<Entry>,
    /// Established connections by id.
    established: HashMap<u64, Established>,
    /// Per address: (in their handshake, established).
    sources: HashMap<IpAddr, (usize, usize)>,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    from: IpAddr,
    close: CancellationToken,
}

#[derive(Debug)]
struct Established {
    entry: Entry,
    /// Milliseconds since the admission's epoch, of the last [`Ticket::touch`].
    active: Arc<AtomicU64>,
    authenticated: bool,
}

impl Admission {
    /// At most `max_handshakes` connections in their handshake (at least 1) and
    /// `max_established` past it, with [`AdmissionLimits::new`]'s other bounds,
    /// clamped to the process's open-files limit.
    pub fn new(max_handshakes: usize, max_established: usize) -> Arc<Self> {
        Self::with_limits(AdmissionLimits::new(max_handshakes, max_established))
    }

    /// With these limits, clamped to the process's open-files limit
    /// ([`AdmissionLimits::clamped`]).
    pub fn with_limits(limits: AdmissionLimits) -> Arc<Self> {
        Self::exactly(limits.clamped(crate::open_files_limit()))
    }

    /// With exactly these limits (for tests: no clamping).
    pub fn exactly(limits: AdmissionLimits) -> Arc<Self> {
        let mut limits = limits;
        limits.handshakes = limits.handshakes.max(1);
        limits.per_source_handshakes = limits.per_source_handshakes.clamp(1, limits.handshakes);
        Arc::new(Self {
            limits,
            epoch: Instant::now(),
            state: Mutex::new(Counts::default()),
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Count a new connection from `from` as in its handshake; `close` ends it. When
    /// the handshake set is full, the oldest in it is closed to make room: the oldest
    /// of `from`'s own when `from` holds its share or more, else the oldest of an
    /// address over its share, else the oldest of all.
    pub fn admit(self: &Arc<Self>, from: IpAddr, close: CancellationToken) -> Ticket {
        let from = source_key(from);
        let mut s = self.state.lock().unwrap();
        while s.handshaking.len() >= self.limits.handshakes {
            // Full: an address holding its share or more makes room from its own;
            // otherwise the oldest of any address over its share, else the oldest.
            let share = self.limits.per_source_handshakes;
            let over = |ip: &IpAddr| s.sources.get(ip).map_or(0, |c| c.0) >= share;
            let i = if over(&from) {
                s.handshaking.iter().position(|e| e.from == from)
            } else {
                s.handshaking.iter().position(|e| over(&e.from))
            }
            .unwrap_or(0);
            let Some(e) = s.handshaking.remove(i) else {
                break;
            };
            tracing::debug!(from = %e.from, "closing the oldest connection still in its handshake to admit a new one");
            s.evicted(&e);
        }
        let id = s.next;
        s.next += 1;
        s.sources.entry(from).or_default().0 += 1;
        s.handshaking.push_back(Entry { id, from, close });
        Ticket {
            admission: self.clone(),
            id,
            from,
            state: Place::Handshaking,
            active: Arc::default(),
        }
    }

    /// Close the oldest connection still in its handshake, if any: accepting failed
    /// (out of file descriptors, most likely), and idle sockets must not keep a
    /// legitimate peer from being accepted once one comes free.
    pub fn shed_oldest(&self) -> bool {
        let mut s = self.state.lock().unwrap();
        match s.handshaking.pop_front() {
            Some(e) => {
                s.evicted(&e);
                true
            }
            None => false,
        }
    }

    /// Connections counted now: (in their handshake, established).
    pub fn counts(&self) -> (usize, usize) {
        let s = self.state.lock().unwrap();
        (s.handshaking.len(), s.established.len())
    }
}

/// The source an address counts for: an IPv4 address (IPv4-mapped IPv6 ones too), or
/// an IPv6 address's /64 (one host usually holds a whole /64).
fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

impl Counts {
    /// `e` was taken out of the handshaking set to be closed: it no longer counts
    /// against its source (its ticket, dropped later, finds it gone).
    fn evicted(&mut self, e: &Entry) {
        e.close.cancel();
        self.leave_source(e.from, true);
    }

    fn leave_source(&mut self, from: IpAddr, handshaking: bool) {
        if let Some(c) = self.sources.get_mut(&from) {
            if handshaking {
                c.0 = c.0.saturating_sub(1);
            } else {
                c.1 = c.1.saturating_sub(1);
            }
            if *c == (0, 0) {
                self.sources.remove(&from);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Handshaking,
    Established,
}

/// One connection's place in [`Admission`]; dropping it frees the place.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    id: u64,
    from: IpAddr,
    state: Place,
    active: Arc<AtomicU64>,
}

impl Ticket {
    /// The handshake is over: move to the established set. `false` when that set, or
    /// its source's share of it, is full and no connection there has been idle long
    /// enough to give its place (then the connection is to be closed; it still
    /// counts as handshaking until dropped).
    pub fn establish(&mut self) -> bool {
        self.establish_with(false)
    }

    /// [`Ticket::establish`] for a connection that proved the agent's shared secret:
    /// it is never closed to make room for another.
    pub fn establish_authenticated(&mut self) -> bool {
        self.establish_with(true)
    }

    /// [`Ticket::establish_authenticated`] if `authenticated`, else
    /// [`Ticket::establish`].
    pub fn establish_with(&mut self, authenticated: bool) -> bool {
        if self.state == Place::Established {
            return true;
        }
        let a = &self.admission;
        let now = a.now_ms();
        let mut s = a.state.lock().unwrap();
        let idle_ms = u64::try_from(a.limits.idle.as_millis()).unwrap_or(u64::MAX);
        // Still counted as handshaking? (It may have been closed to make room.)
        if !s.handshaking.iter().any(|e| e.id == self.id) {
            return false;
        }
        let full = s.established.len() >= a.limits.established;
        let source_full =
            s.sources.get(&self.from).map_or(0, |c| c.1) >= a.limits.per_source_established;
        if full || source_full {
            // The longest-idle unauthenticated connection idle past the bound gives
            // its place: of this source when its share is full (so the share is
            // never exceeded), of any when only the whole set is.
            let victim = s
                .established
                .values()
                .filter(|e| !e.authenticated && (!source_full || e.entry.from == self.from))
                .map(|e| (e.active.load(Ordering::Relaxed), e.entry.id))
                .filter(|&(at, _)| at != BUSY && now.saturating_sub(at) >= idle_ms)
                .min();
            let Some((_, id)) = victim else {
                return false;
            };
            let e = s.established.remove(&id).expect("found above");
            tracing::debug!(from = %e.entry.from, "closing an established connection idle past its bound to admit a new one");
            e.entry.close.cancel();
            s.leave_source(e.entry.from, false);
        }
        let i = s
            .handshaking
            .iter()
            .position(|e| e.id == self.id)
            .expect("checked above, under the same lock");
        let entry = s.handshaking.remove(i).expect("found above");
        s.leave_source(self.from, true);
        s.sources.entry(self.from).or_default().1 += 1;
        self.active.store(now, Ordering::Relaxed);
        s.established.insert(
            self.id,
            Established {
                entry,
                active: self.active.clone(),
                authenticated,
            },
        );
        self.state = Place::Established;
        true
    }

    /// The connection did some work (a request, a frame): it is not idle.
    pub fn touch(&self) {
        self.active
            .store(self.admission.now_ms(), Ordering::Relaxed);
    }

    /// The connection works until the returned guard is dropped (a long copy, a
    /// wait for room in the agent's notification queue): it is not idle meanwhile,
    /// however long that takes, and counts as active from its end.
    pub fn working(&self) -> Working<'_> {
        self.active.store(BUSY, Ordering::Relaxed);
        Working(self)
    }
}

/// An activity stamp no idle bound reaches: [`Ticket::working`].
const BUSY: u64 = u64::MAX;

/// A connection at work; see [`Ticket::working`].
#[derive(Debug)]
#[must_use = "the connection counts as working only while this lives"]
pub struct Working<'a>(&'a Ticket);

impl Drop for Working<'_> {
    fn drop(&mut self) {
        self.0.touch();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = self.admission.state.lock().unwrap();
        match self.state {
            Place::Established => {
                if s.established.remove(&self.id).is_some() {
                    s.leave_source(self.from, false);
                }
            }
            Place::Handshaking => {
                if let Some(i) = s.handshaking.iter().position(|e| e.id == self.id) {
                    s.handshaking.remove(i);
                    s.leave_source(self.from, true);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    fn limits(handshakes: usize, established: usize) -> AdmissionLimits {
        AdmissionLimits {
            per_source_handshakes: handshakes,
            per_source_established: established,
            ..AdmissionLimits::new(handshakes, established)
        }
    }

    #[test]
    fn a_full_handshake_set_closes_its_oldest() {
        let a = Admission::exactly(limits(2, 1));
        let tokens: Vec<_> = (0..4).map(|_| CancellationToken::new()).collect();
        let t0 = a.admit(ip(1), tokens[0].clone());
        let mut t1 = a.admit(ip(1), tokens[1].clone());
        let _t2 = a.admit(ip(1), tokens[2].clone());
        assert!(tokens[0].is_cancelled(), "the oldest made room");
        assert!(!tokens[1].is_cancelled());
        drop(t0);
        // Established connections leave the handshake set and are never evicted.
        assert!(t1.establish());
        let _t3 = a.admit(ip(1), tokens[3].clone());
        assert!(!tokens[1].is_cancelled());
        assert!(!tokens[2].is_cancelled(), "room was made by t1 leaving");
        // The established set is full (and t1 is not idle): the next one is refused.
        let t4_token = CancellationToken::new();
        let mut t4 = a.admit(ip(1), t4_token.clone());
        assert!(tokens[2].is_cancelled());
        assert!(!t4.establish());
        drop(t1);
        assert!(t4.establish(), "a place came free");
        // Shedding closes the oldest still in its handshake, never an established one.
        assert!(a.shed_oldest());
        assert!(tokens[3].is_cancelled());
        assert!(!a.shed_oldest());
        assert!(!t4_token.is_cancelled());
    }

    /// One address filling the handshake set pushes out only its own connections.
    #[test]
    fn a_flooding_source_evicts_only_its_own_handshakes() {
        let a = Admission::exactly(AdmissionLimits {
            per_source_handshakes: 4,
            ..limits(16, 16)
        });
        let good = CancellationToken::new();
        let _g = a.admit(ip(1), good.clone());
        let flood: Vec<_> = (0..1000)
            .map(|_| {
                let t = CancellationToken::new();
                (a.admit(ip(2), t.clone()), t)
            })
            .collect();
        assert!(
            !good.is_cancelled(),
            "another source's handshake was closed"
        );
        // The set stays full: the flooding address keeps the rest of it, its newest.
        assert_eq!(flood.iter().filter(|(_, t)| !t.is_cancelled()).count(), 15);
        assert!(flood[985..].iter().all(|(_, t)| !t.is_cancelled()));
        assert_eq!(a.counts(), (16, 0));
        // Below the bound nobody is closed, whatever the address.
        let b = Admission::exactly(AdmissionLimits {
            per_source_handshakes: 1,
            ..limits(16, 16)
        });
        let burst: Vec<_> = (0..10)
            .map(|_| {
                let t = CancellationToken::new();
                (b.admit(ip(3), t.clone()), t)
            })
            .collect();
        assert!(burst.iter().all(|(_, t)| !t.is_cancelled()));
        // Newcomers from fresh addresses push out the over-represented address's
        // handshakes, not the lone peer's.
        for n in 10..20 {
            let _ = a.admit(ip(n), CancellationToken::new());
        }
        assert!(
            !good.is_cancelled(),
            "a fresh address pushed out the lone peer"
        );
    }

    /// Established connections are never closed to make room while they work; one
    /// idle past the bound gives its place; an authenticated one never does.
    #[test]
    fn only_idle_unauthenticated_connections_give_their_place() {
        let a = Admission::exactly(AdmissionLimits {
            idle: Duration::from_millis(50),
            ..limits(8, 2)
        });
        let (m, w) = (CancellationToken::new(), CancellationToken::new());
        let mut member = a.admit(ip(1), m.clone());
        assert!(member.establish_authenticated());
        let mut worker = a.admit(ip(2), w.clone());
        assert!(worker.establish());
        let mut late = a.admit(ip(3), CancellationToken::new());
        assert!(!late.establish(), "full, nobody idle");
        std::thread::sleep(Duration::from_millis(80));
        worker.touch();
        assert!(
            !late.establish(),
            "the worker just worked, the member is authenticated"
        );
        assert!(!w.is_cancelled() && !m.is_cancelled());
        std::thread::sleep(Duration::from_millis(80));
        assert!(late.establish(), "the idle worker gave its place");
        assert!(w.is_cancelled());
        assert!(!m.is_cancelled(), "an authenticated member is never closed");
        drop(worker);
        assert_eq!(a.counts(), (0, 2));
    }

    /// One address holds at most its share of the established set.
    #[test]
    fn a_source_holds_at_most_its_share() {
        let a = Admission::exactly(AdmissionLimits {
            per_source_established: 3,
            ..limits(64, 8)
        });
        let mut held = Vec::new();
        for _ in 0..10 {
            let mut t = a.admit(ip(9), CancellationToken::new());
            if t.establish() {
                held.push(t);
            }
        }
        assert_eq!(held.len(), 3);
        let mut other = a.admit(ip(1), CancellationToken::new());
        assert!(other.establish(), "another address still gets in");
    }

    /// A working connection is never idle; an IPv6 /64 is one source; a full share
    /// makes room only from its own source.
    #[test]
    fn working_connections_and_sources() {
        let a = Admission::exactly(AdmissionLimits {
            idle: Duration::from_millis(20),
            per_source_established: 1,
            ..limits(8, 2)
        });
        let v6 = |last: u16| IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, last]);
        let busy_token = CancellationToken::new();
        let mut busy = a.admit(v6(1), busy_token.clone());
        assert!(busy.establish());
        let working = busy.working();
        std::thread::sleep(Duration::from_millis(40));
        // Same /64: its share (1) is full, and its one connection is at work.
        let mut same = a.admit(v6(2), CancellationToken::new());
        assert!(!same.establish(), "a working connection gave its place");
        assert!(!busy_token.is_cancelled());
        drop(working);
        std::thread::sleep(Duration::from_millis(40));
        assert!(
            same.establish(),
            "idle since its work ended: it gives its place"
        );
        assert!(busy_token.is_cancelled());
        // Another source fills the set; a third source finds the set full and takes
        // the idle place of the other one, never exceeding anyone's share.
        let mut other = a.admit(ip(7), CancellationToken::new());
        assert!(other.establish());
        std::thread::sleep(Duration::from_millis(40));
        let mut third = a.admit(ip(8), CancellationToken::new());
        assert!(third.establish());
        assert_eq!(a.counts(), (0, 2));
        // A ticket closed while in its handshake closes no one when it establishes.
        let t = CancellationToken::new();
        let mut pushed = a.admit(ip(9), t.clone());
        let _newer: Vec<_> = (0..8)
            .map(|n| a.admit(ip(20 + n), CancellationToken::new()))
            .collect();
        assert!(t.is_cancelled());
        std::thread::sleep(Duration::from_millis(40));
        assert!(!pushed.establish());
        assert_eq!(a.counts().1, 2);
    }

    #[test]
    fn limits_are_clamped_to_the_open_files_limit() {
        let l = AdmissionLimits::new(256, 4096).clamped(Some(1024));
        assert_eq!((l.handshakes, l.established), (128, 256));
        assert_eq!(
            (l.per_source_handshakes, l.per_source_established),
            (32, 128)
        );
        assert!(l.per_source_handshakes <= l.handshakes);
        assert!(l.per_source_established <= l.established);
        assert_eq!(
            AdmissionLimits::new(256, 4096).clamped(None).established,
            4096
        );
        let tiny = AdmissionLimits::new(256, 4096).clamped(Some(3));
        assert!(tiny.handshakes >= 1 && tiny.per_source_handshakes >= 1);
    }
}
