//! Putting received notifications back in posting order, within fixed memory.
//!
//! Each of this backend's notifications carries its sender's name, a stream id (one
//! per sender connection) and a sequence number on that stream ([`crate::wire`]).
//! Without a shared secret none of the three is authenticated: any process that can
//! reach the worker can send any of them. With one, the driver has checked their MAC
//! before they get here, but a holder of the secret (or someone replaying a captured
//! message) can still send any numbers. So everything kept per stream is bounded, and
//! a sender that breaks the rules costs only its own ordering:
//!
//! - A stream delivers sequence `next` at once, then whatever it held that follows.
//!   A later sequence waits (is *held*) only while it is within [`Limits::window`] of
//!   `next` and the stream holds at most [`Limits::stream_bytes`] bytes and all
//!   streams together [`Limits::total_bytes`]. Otherwise the gap is given up: what
//!   the stream held is delivered in order, then the new message, and `next` moves
//!   past it (counted in [`Stats::gaps_skipped`]). A gap is also given up when it
//!   has stayed open for [`Limits::gap_timeout`] (UCX delivers reliably, so a
//!   missing message that late is not coming). An earlier sequence (late, or a
//!   repeat) is delivered at once. Nothing is dropped here except protocol errors;
//!   the agent's per-peer notification queue bounds what is delivered.
//! - Sequence `u64::MAX` is a protocol error (a sender would need 2^64 notifications
//!   on one connection to get there): the message is dropped and counted, so `next`
//!   never needs to go past `u64::MAX`.
//! - At most [`Limits::streams_per_sender`] streams per sender name and
//!   [`Limits::streams`] in all are tracked; a new stream beyond either replaces the
//!   least recently used one (of that sender, or of all), delivering what it held
//!   ([`Stats::evicted`]). A sender has one live stream (a new connection makes a new
//!   one), so only stale streams go unless someone floods. A stream that comes back
//!   after it was replaced starts over at `next = 0`; its first message then waits
//!   until the gap timeout, the window or a limit gives up the gap (at once if it is
//!   more than a window ahead), so it is delivered late but not lost.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Bounds on what the reorder stage keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// How far past `next` a sequence number may be and still be held.
    pub(crate) window: u64,
    /// Bytes held per stream.
    pub(crate) stream_bytes: usize,
    /// Bytes held over all streams.
    pub(crate) total_bytes: usize,
    /// Streams tracked per sender name.
    pub(crate) streams_per_sender: usize,
    /// Streams tracked in all.
    pub(crate) streams: usize,
    /// How long a gap may stay open.
    pub(crate) gap_timeout: Duration,
}

impl Limits {
    /// The driver's limits: 256 messages and 4 MiB held per stream, 64 MiB in all,
    /// 4 streams per sender and 1024 in all, gaps open for 1 s at most.
    pub(crate) const DEFAULT: Self = Self {
        window: 256,
        stream_bytes: 4 << 20,
        total_bytes: 64 << 20,
        streams_per_sender: 4,
        streams: 1024,
        gap_timeout: Duration::from_secs(1),
    };
}

/// What the reorder stage did besides delivering in order.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stats {
    /// Gaps given up (a window or byte limit reached): held messages delivered out of
    /// order.
    pub(crate) gaps_skipped: u64,
    /// Streams replaced by newer ones.
    pub(crate) evicted: u64,
    /// Messages dropped as protocol errors (sequence `u64::MAX`).
    pub(crate) protocol_errors: u64,
}

#[derive(Debug)]
struct Stream {
    id: u64,
    next: u64,
    held: BTreeMap<u64, Bytes>,
    bytes: usize,
    /// The reorder stage's clock when the stream last received.
    used: u64,
    /// When the current gap opened (`held` became non-empty, or its front moved).
    since: Option<Instant>,
}

/// The reorder stage: per sender name, its streams.
#[derive(Debug)]
pub(crate) struct Reorder {
    limits: Limits,
    senders: HashMap<String, Vec<Stream>>,
    streams: usize,
    bytes: usize,
    clock: u64,
    /// Streams with a gap open (`since` set).
    gapped: usize,
    /// No gap times out before this (`None`: nothing is held).
    deadline: Option<Instant>,
    stats: Stats,
}

impl Reorder {
    pub(crate) fn new(limits: Limits) -> Self {
        Self {
            limits,
            senders: HashMap::new(),
            streams: 0,
            bytes: 0,
            clock: 0,
            gapped: 0,
            deadline: None,
            stats: Stats::default(),
        }
    }

    /// Take in message `seq` of `name`'s `stream`, received at `now`; `out` gets every
    /// message now due, in order, with its sender's name and stream.
    pub(crate) fn accept(
        &mut self,
        name: &str,
        stream: u64,
        seq: u64,
        data: Bytes,
        now: Instant,
        out: &mut dyn FnMut(&str, u64, Bytes),
    ) {
        if seq == u64::MAX {
            self.stats.protocol_errors += 1;
            tracing::warn!(
                peer = name,
                stream,
                "ucx: dropping a notification with sequence number u64::MAX (protocol error)"
            );
            return;
        }
        let i = self.stream_index(name, stream, out);
        let was = self.senders[name][i].since.is_some();
        self.take(name, i, seq, data, now, out);
        let is = self.senders[name][i].since.is_some();
        // Streams with a gap open: `self.gapped` counts them, so `deadline` is
        // cleared when the last one closes.
        self.gapped = self.gapped + usize::from(is) - usize::from(was);
        self.settle();
    }

    /// [`Reorder::accept`] on the sender's `i`th stream.
    fn take(
        &mut self,
        name: &str,
        i: usize,
        seq: u64,
        data: Bytes,
        now: Instant,
        out: &mut dyn FnMut(&str, u64, Bytes),
    ) {
        self.clock += 1;
        let clock = self.clock;
        let limits = self.limits;
        let s = &mut self.senders.get_mut(name).expect("just ensured")[i];
        s.used = clock;
        if seq <= s.next {
            // In order, or late (a repeat, or after a gap was given up).
            out(name, s.id, data);
            if seq == s.next {
                // `seq < u64::MAX`, so this does not overflow.
                s.next = seq + 1;
                self.bytes -= s.drain_due(name, out);
                if !s.held.is_empty() {
                    // A later gap: its own clock.
                    s.since = Some(now);
                    let due = now + limits.gap_timeout;
                    self.deadline = Some(self.deadline.map_or(due, |d| d.min(due)));
                }
            }
            return;
        }
        let len = data.len();
        let old = s.held.get(&seq).map_or(0, Bytes::len);
        let fits = seq - s.next <= limits.window
            && s.bytes - old + len <= limits.stream_bytes
            && self.bytes - old + len <= limits.total_bytes;
        if fits {
            s.held.insert(seq, data);
            s.bytes = s.bytes - old + len;
            self.bytes = self.bytes - old + len;
            if s.since.is_none() {
                s.since = Some(now);
                let due = now + limits.gap_timeout;
                self.deadline = Some(self.deadline.map_or(due, |d| d.min(due)));
            }
            return;
        }
        self.stats.gaps_skipped += 1;
        tracing::warn!(
            peer = name,
            stream = s.id,
            next = s.next,
            seq,
            held = s.held.len(),
            "ucx: notifications held too long waiting for an earlier one; giving up the gap and delivering out of order"
        );
        if let Some(old) = s.held.insert(seq, data) {
            s.bytes -= old.len();
            self.bytes -= old.len();
        }
        self.bytes -= s.bytes;
        s.flush(name, out);
    }

    /// Give up every gap open for the gap timeout at `now`, delivering what waited.
    pub(crate) fn expire(&mut self, now: Instant, out: &mut dyn FnMut(&str, u64, Bytes)) {
        if self.deadline.is_none_or(|d| now < d) {
            return;
        }
        let timeout = self.limits.gap_timeout;
        let mut deadline = None::<Instant>;
        for (name, v) in &mut self.senders {
            for s in v.iter_mut() {
                let Some(since) = s.since else { continue };
                if now.duration_since(since) >= timeout {
                    self.stats.gaps_skipped += 1;
                    tracing::warn!(peer = %name, stream = s.id, next = s.next, held = s.held.len(), "ucx: a notification never came; delivering those after it");
                    self.bytes -= s.bytes;
                    self.gapped -= 1;
                    s.flush(name, out);
                } else {
                    let due = since + timeout;
                    deadline = Some(deadline.map_or(due, |d| d.min(due)));
                }
            }
        }
        self.deadline = deadline;
        self.settle();
    }

    /// No gap open: no deadline.
    fn settle(&mut self) {
        if self.gapped == 0 {
            self.deadline = None;
        }
    }

    /// When [`Reorder::expire`] next has work (`None`: nothing is held).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Forget `name`'s streams (it said goodbye), delivering what they held.
    pub(crate) fn forget(&mut self, name: &str, out: &mut dyn FnMut(&str, u64, Bytes)) {
        for mut s in self.senders.remove(name).unwrap_or_default() {
            self.streams -= 1;
            self.bytes -= s.bytes;
            self.gapped -= usize::from(s.since.is_some());
            s.flush(name, out);
        }
        self.settle();
    }

    /// Bytes held over all streams.
    pub(crate) fn held_bytes(&self) -> usize {
        self.bytes
    }

    /// Streams tracked.
    pub(crate) fn streams(&self) -> usize {
        self.streams
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats
    }

    /// The index of `name`'s `stream` in its sender's list, made (replacing the least
    /// recently used stream where a limit is reached) if new.
    fn stream_index(
        &mut self,
        name: &str,
        stream: u64,
        out: &mut dyn FnMut(&str, u64, Bytes),
    ) -> usize {
        if let Some(i) = self
            .senders
            .get(name)
            .and_then(|v| v.iter().position(|s| s.id == stream))
        {
            return i;
        }
        if self.senders.get(name).map_or(0, Vec::len) >= self.limits.streams_per_sender {
            self.evict_lru(Some(name), out);
        } else if self.streams >= self.limits.streams {
            self.evict_lru(None, out);
        }
        let v = self.senders.entry(name.to_owned()).or_default();
        v.push(Stream {
            id: stream,
            next: 0,
            held: BTreeMap::new(),
            bytes: 0,
            used: 0,
            since: None,
        });
        self.streams += 1;
        v.len() - 1
    }

    /// Drop the least recently used stream (of sender `only`, or of all), delivering
    /// what it held.
    fn evict_lru(&mut self, only: Option<&str>, out: &mut dyn FnMut(&str, u64, Bytes)) {
        let victim = self
            .senders
            .iter()
            .filter(|(n, _)| only.is_none_or(|o| o == n.as_str()))
            .flat_map(|(n, v)| v.iter().enumerate().map(move |(i, s)| (s.used, n, i)))
            .min()
            .map(|(_, n, i)| (n.clone(), i));
        let Some((name, i)) = victim else { return };
        let v = self.senders.get_mut(&name).expect("found above");
        let mut s = v.swap_remove(i);
        if v.is_empty() {
            self.senders.remove(&name);
        }
        self.streams -= 1;
        self.bytes -= s.bytes;
        self.gapped -= usize::from(s.since.is_some());
        self.stats.evicted += 1;
        tracing::debug!(peer = %name, stream = s.id, held = s.held.len(), "ucx: too many notification streams; replacing the least recently used");
        s.flush(&name, out);
    }
}

impl Stream {
    /// Deliver the held messages that follow `next` without a gap, advancing `next`;
    /// returns the bytes released.
    fn drain_due(&mut self, name: &str, out: &mut dyn FnMut(&str, u64, Bytes)) -> usize {
        let mut freed = 0;
        while let Some(d) = self.held.remove(&self.next) {
            freed += d.len();
            out(name, self.id, d);
            // Held sequence numbers are below `u64::MAX` (see `Reorder::accept`).
            self.next += 1;
        }
        self.bytes -= freed;
        if self.held.is_empty() {
            self.since = None;
        }
        freed
    }

    /// Deliver everything held, in order, and move `next` past the last of it.
    fn flush(&mut self, name: &str, out: &mut dyn FnMut(&str, u64, Bytes)) {
        for (seq, d) in std::mem::take(&mut self.held) {
            out(name, self.id, d);
            self.next = seq + 1;
        }
        self.bytes = 0;
        self.since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Limits = Limits {
        window: 8,
        stream_bytes: 64,
        total_bytes: 256,
        streams_per_sender: 2,
        streams: 6,
        gap_timeout: Duration::from_secs(1),
    };

    fn msg(tag: u64) -> Bytes {
        Bytes::from(tag.to_le_bytes().to_vec())
    }

    /// Feed `r` and collect what comes out as (sender, tag).
    fn feed(r: &mut Reorder, name: &str, stream: u64, seq: u64, got: &mut Vec<(String, u64)>) {
        r.accept(
            name,
            stream,
            seq,
            msg(seq),
            Instant::now(),
            &mut |n, _, d| got.push((n.to_owned(), u64::from_le_bytes(d[..].try_into().unwrap()))),
        );
    }

    fn check(r: &Reorder, l: Limits) {
        assert!(r.held_bytes() <= l.total_bytes, "{} held", r.held_bytes());
        assert!(r.streams() <= l.streams, "{} streams", r.streams());
        let real: usize = r.senders.values().flatten().map(|s| s.bytes).sum();
        assert_eq!(real, r.held_bytes());
        for (n, v) in &r.senders {
            assert!(v.len() <= l.streams_per_sender, "{n}: {} streams", v.len());
            for s in v {
                assert!(s.bytes <= l.stream_bytes);
                assert!(s.held.keys().all(|&q| q > s.next && q - s.next <= l.window));
                assert_eq!(s.bytes, s.held.values().map(Bytes::len).sum::<usize>());
            }
        }
        assert_eq!(r.streams(), r.senders.values().map(Vec::len).sum::<usize>());
        let open = r.senders.values().flatten().filter(|s| s.since.is_some());
        assert_eq!(r.gapped, open.count());
        assert!(r
            .senders
            .values()
            .flatten()
            .all(|s| s.since.is_some() != s.held.is_empty()));
        assert_eq!(r.gapped == 0, r.deadline.is_none());
    }

    #[test]
    fn reorders_within_the_window() {
        let mut r = Reorder::new(SMALL);
        let mut got = Vec::new();
        for q in [2, 1, 3] {
            feed(&mut r, "a", 7, q, &mut got);
        }
        assert!(got.is_empty());
        assert_eq!(r.held_bytes(), 24);
        feed(&mut r, "a", 7, 0, &mut got);
        let tags: Vec<u64> = got.iter().map(|(_, t)| *t).collect();
        assert_eq!(tags, [0, 1, 2, 3]);
        assert_eq!(r.held_bytes(), 0);
        assert_eq!(r.stats(), Stats::default());
    }

    #[test]
    fn a_gap_never_filled_costs_a_window_at_most() {
        // Sequence 0 never comes: what waits for it stays within the window and the
        // byte bounds, and everything else is delivered, in order after the gap.
        let mut r = Reorder::new(SMALL);
        let mut got = Vec::new();
        for q in 1..=10_000 {
            feed(&mut r, "a", 1, q, &mut got);
            check(&r, SMALL);
        }
        assert!(got.len() >= 10_000 - 8, "{} delivered", got.len());
        assert!(
            got.windows(2).all(|w| w[0].1 < w[1].1),
            "in order after the gap"
        );
        assert!(r.stats().gaps_skipped >= 1);
        // A far-ahead number gives up the gap at once.
        let mut r = Reorder::new(SMALL);
        got.clear();
        feed(&mut r, "a", 1, 1 << 40, &mut got);
        assert_eq!(got.len(), 1);
        assert_eq!(r.held_bytes(), 0);
        feed(&mut r, "a", 1, (1 << 40) + 1, &mut got);
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn bytes_held_are_bounded_per_stream_and_in_all() {
        let mut r = Reorder::new(SMALL);
        let mut n = 0usize;
        let mut out = |_: &str, _: u64, _: Bytes| n += 1;
        // Big messages: the per-stream byte bound, not the window, gives up the gap.
        for q in 1..=8 {
            r.accept(
                "a",
                1,
                q,
                Bytes::from(vec![0u8; 40]),
                Instant::now(),
                &mut out,
            );
            check(&r, SMALL);
        }
        // One message over the stream bound is delivered at once.
        r.accept(
            "b",
            1,
            5,
            Bytes::from(vec![0u8; 100]),
            Instant::now(),
            &mut out,
        );
        check(&r, SMALL);
        // Many senders each holding up to their bound: the total bound holds.
        for s in 0..100u64 {
            for q in 1..=8 {
                r.accept(
                    &format!("s{s}"),
                    s,
                    q,
                    Bytes::from(vec![0u8; 8]),
                    Instant::now(),
                    &mut out,
                );
                check(&r, SMALL);
            }
        }
        assert!(r.stats().gaps_skipped > 0);
        assert!(n > 0);
    }

    #[test]
    fn fresh_streams_and_names_are_bounded() {
        let mut r = Reorder::new(SMALL);
        let mut got = Vec::new();
        // One sender cycling stream ids, each holding a message.
        for s in 0..1000 {
            feed(&mut r, "h", s, 1, &mut got);
            check(&r, SMALL);
        }
        assert!(r.senders["h"].len() <= 2);
        // Fresh names.
        for s in 0..1000 {
            feed(&mut r, &format!("h{s}"), s, 1, &mut got);
            check(&r, SMALL);
        }
        assert_eq!(r.streams(), SMALL.streams);
        assert!(r.stats().evicted >= 1998 - SMALL.streams as u64);
        // What evicted streams held was delivered, not lost.
        assert_eq!(got.len() + r.held_bytes() / 8, 2000);
    }

    #[test]
    fn a_live_stream_is_served_while_another_sender_floods() {
        let mut r = Reorder::new(SMALL);
        let mut got = Vec::new();
        for q in 0..500u64 {
            feed(&mut r, "good", 1, q, &mut got);
            // Between two good messages, a flood of fresh streams and gaps.
            for s in 0..20u64 {
                feed(&mut r, &format!("bad{s}"), q * 100 + s, 3, &mut got);
            }
            check(&r, SMALL);
        }
        let good: Vec<u64> = got
            .iter()
            .filter(|(n, _)| n == "good")
            .map(|(_, t)| *t)
            .collect();
        // Evicted and started over, the good stream may deliver late, but never loses
        // a message and never delivers one twice.
        let mut sorted = good.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), good.len());
        let held: usize = r
            .senders
            .get("good")
            .map_or(0, |v| v.iter().map(|s| s.held.len()).sum());
        assert_eq!(good.len() + held, 500);
    }

    #[test]
    fn sequence_numbers_at_the_top_of_the_range() {
        let mut r = Reorder::new(SMALL);
        let mut got = Vec::new();
        // u64::MAX is a protocol error: dropped and counted, nothing else changes.
        feed(&mut r, "a", 1, u64::MAX, &mut got);
        assert!(got.is_empty());
        assert_eq!(r.stats().protocol_errors, 1);
        // The last valid number: delivered (far ahead), `next` ends at u64::MAX.
        feed(&mut r, "a", 1, u64::MAX - 1, &mut got);
        assert_eq!(got.len(), 1);
        assert_eq!(r.senders["a"][0].next, u64::MAX);
        // Repeats and earlier numbers are late, delivered; MAX stays refused.
        feed(&mut r, "a", 1, u64::MAX - 1, &mut got);
        feed(&mut r, "a", 1, u64::MAX - 3, &mut got);
        feed(&mut r, "a", 1, u64::MAX, &mut got);
        assert_eq!(got.len(), 3);
        assert_eq!(r.stats().protocol_errors, 2);
        // Held up to the top, then filled: drains to u64::MAX without overflow.
        let mut r = Reorder::new(SMALL);
        got.clear();
        feed(&mut r, "b", 2, u64::MAX - 10, &mut got); // far ahead: next = MAX - 9
        for q in (u64::MAX - 8)..u64::MAX {
            feed(&mut r, "b", 2, q, &mut got);
        }
        feed(&mut r, "b", 2, u64::MAX - 9, &mut got);
        assert_eq!(got.len(), 10);
        assert_eq!(r.senders["b"][0].next, u64::MAX);
        assert!(got.windows(2).all(|w| w[0].1 < w[1].1));
        check(&r, SMALL);
    }

    #[test]
    fn a_gap_open_too_long_is_given_up() {
        let mut r = Reorder::new(SMALL);
        let mut got = Vec::new();
        let t0 = Instant::now();
        let take = |r: &mut Reorder, seq: u64, at: Instant, got: &mut Vec<u64>| {
            r.accept("a", 1, seq, msg(seq), at, &mut |_, _, d| {
                got.push(u64::from_le_bytes(d[..].try_into().unwrap()))
            })
        };
        let expire = |r: &mut Reorder, at: Instant, got: &mut Vec<u64>| {
            r.expire(at, &mut |_, _, d| {
                got.push(u64::from_le_bytes(d[..].try_into().unwrap()))
            })
        };
        assert_eq!(r.deadline(), None);
        take(&mut r, 2, t0, &mut got);
        take(&mut r, 3, t0 + Duration::from_millis(500), &mut got);
        assert_eq!(r.deadline(), Some(t0 + SMALL.gap_timeout));
        expire(&mut r, t0 + Duration::from_millis(999), &mut got);
        assert!(got.is_empty());
        expire(&mut r, t0 + SMALL.gap_timeout, &mut got);
        assert_eq!(got, [2, 3]);
        assert_eq!((r.held_bytes(), r.deadline()), (0, None));
        assert_eq!(r.stats().gaps_skipped, 1);
        // In order from there; the missing ones are late, delivered as they come.
        take(&mut r, 4, t0 + SMALL.gap_timeout, &mut got);
        take(&mut r, 0, t0 + SMALL.gap_timeout, &mut got);
        assert_eq!(got, [2, 3, 4, 0]);
        // A gap filled in time: in order.
        let t1 = t0 + Duration::from_secs(10);
        take(&mut r, 7, t1, &mut got);
        take(&mut r, 6, t1 + Duration::from_millis(900), &mut got);
        take(&mut r, 5, t1 + Duration::from_millis(950), &mut got);
        assert_eq!(&got[4..], [5, 6, 7]);
        assert_eq!((r.held_bytes(), r.deadline()), (0, None));
        // A gap that moves on (8 came, 10 did not) starts its own clock.
        take(&mut r, 9, t1, &mut got);
        take(&mut r, 11, t1, &mut got);
        take(&mut r, 8, t1 + Duration::from_millis(800), &mut got);
        assert_eq!(&got[7..], [8, 9]);
        expire(&mut r, t1 + Duration::from_millis(1500), &mut got);
        assert_eq!(got.len(), 9);
        expire(&mut r, t1 + Duration::from_millis(1800), &mut got);
        assert_eq!(&got[9..], [11]);
    }

    #[test]
    fn goodbye_forgets_and_delivers() {
        let mut r = Reorder::new(SMALL);
        let mut got = Vec::new();
        feed(&mut r, "a", 1, 2, &mut got);
        feed(&mut r, "a", 2, 5, &mut got);
        assert!(got.is_empty());
        r.forget("a", &mut |n, _, d| {
            got.push((n.to_owned(), u64::from_le_bytes(d[..].try_into().unwrap())))
        });
        assert_eq!(got.len(), 2);
        assert_eq!((r.streams(), r.held_bytes()), (0, 0));
    }
}
