//! A hostile sender on the real UCX against an agent's receive path.
//!
//! The hostile side is a bare UCX worker of this crate's own binding (no agent), so it
//! can put anything in this backend's active messages: notifications over the limit,
//! gaps that never fill, a fresh stream or sender name per message, a HELLO naming
//! someone else's address. The receiving agent must refuse or bound all of it, keep
//! delivering a legitimate peer's notifications in order, and at shutdown dial no
//! address it learned only from a HELLO. Lives inside the crate (not in the
//! conformance suite) because it needs the raw active-message sender.
//!
//! With a shared secret, the same kind of worker forges what only a holder of the
//! secret could make (notifications, HELLO, BYE and PING of either header version,
//! MAC'd with another secret or for another agent, NIXL's notifications), and agents
//! with different or one-sided secrets talk to each other: nothing unauthenticated
//! is acted on.
//!
//! Needs libucp at run time; without it the tests print a SKIP line.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Agent, AgentOptions, ErrorKind, SharedSecret};

use crate::driver::Work;
use crate::ffi::{EpId, FlightId, Ucx, UcxInit};
use crate::packed::Padded;
use crate::wire::{self, Kind};
use crate::{library, UcxBackend, UcxOptions};

const MAX_NOTIFICATION: usize = 4096;

/// Run `ucx`'s progress until every flight finished (bounded).
fn settle(ucx: &mut Ucx<Work>, mut flights: Vec<FlightId>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !flights.is_empty() {
        assert!(Instant::now() < deadline, "hostile sends did not finish");
        ucx.progress();
        flights.retain(|f| ucx.poll(*f).is_none());
    }
}

fn send(
    ucx: &mut Ucx<Work>,
    ep: EpId,
    kind: Kind,
    name: &str,
    stream: u64,
    seq: u64,
    data: Bytes,
) -> FlightId {
    let h = wire::encode_header(kind, stream, seq, name);
    ucx.am_send(ep, wire::AM_ID, h, data, false, Work::Internal)
}

async fn agent(name: &str, b: &UcxBackend) -> Agent {
    agent_with(name, b, None).await
}

async fn agent_with(name: &str, b: &UcxBackend, secret: Option<&SharedSecret>) -> Agent {
    let mut builder = Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        });
    if let Some(s) = secret {
        builder = builder.secret(s.clone());
    }
    builder.build().await.unwrap()
}

/// A UCX backend, or `None` (after a SKIP line naming `test`) without libucp.
fn backend(test: &str, o: &UcxOptions) -> Option<UcxBackend> {
    match UcxBackend::with_options(o.clone()) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == ErrorKind::UnavailableLibrary => {
            println!("SKIP {test}: {e}");
            None
        }
        Err(e) => panic!("ucx backend: {e}"),
    }
}

/// A bare UCX worker of this crate's binding (no agent), as a hostile sender uses.
fn bare_worker(o: &UcxOptions) -> Ucx<Work> {
    let (req, src) = o.request();
    let (lib, _) = library::bind(&req, src, &o.expectations()).unwrap();
    let init = UcxInit {
        config: vec![("RNDV_THRESH".into(), "inf".into())],
        optional: Vec::new(),
    };
    Ucx::<Work>::new(lib, &init).unwrap()
}

/// An endpoint from `ucx` to the worker at `addr`.
fn dial(ucx: &mut Ucx<Work>, addr: &[u8]) -> EpId {
    let addr = Padded::address(addr).unwrap();
    ucx.ep_create(&addr, true)
        .or_else(|_| ucx.ep_create(&addr, false))
        .unwrap()
}

fn secret(s: &str) -> SharedSecret {
    SharedSecret::new(s).unwrap()
}

/// What a bare worker got on this backend's message id: the headers, decoded.
fn record_headers(ucx: &mut Ucx<Work>) -> Arc<Mutex<Vec<wire::Header>>> {
    let got: Arc<Mutex<Vec<wire::Header>>> = Arc::default();
    let g = got.clone();
    ucx.set_am_handler(
        wire::AM_ID,
        Box::new(move |m| {
            if let Some(h) = wire::decode_header(m.header) {
                g.lock().unwrap().push(h);
            }
            None
        }),
    )
    .unwrap();
    got
}

/// The next notification, within a bound that only catches hangs.
async fn next(notes: &mut nixl::Notifications) -> nixl::Notification {
    tokio::time::timeout(Duration::from_secs(20), notes.recv())
        .await
        .expect("a notification arrives")
        .expect("notifications open")
}

/// The receive path's count of unauthenticated messages at `b`.
fn unauthenticated(b: &UcxBackend) -> u64 {
    let g = b.inner.shared.core.lock().unwrap();
    g.as_ref()
        .map_or(0, |c| c.refused.unauthenticated.load(Ordering::Relaxed))
}

/// Two agents with these secrets notify each other; returns whether each side got
/// the other's notification (`a` got b's, `b` got a's). A side that refuses is
/// waited for until it counted the other's HELLO and notification as unauthenticated.
async fn exchange(
    test: &str,
    sa: Option<&SharedSecret>,
    sb: Option<&SharedSecret>,
) -> Option<(bool, bool)> {
    let o = UcxOptions::default();
    let ba = backend(test, &o)?;
    let bb = UcxBackend::with_options(o).unwrap();
    let a = agent_with("a", &ba, sa).await;
    let b = agent_with("b", &bb, sb).await;
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    b.load_metadata(&a.metadata().unwrap()).unwrap();
    let (mut na, mut nb) = (a.notifications().unwrap(), b.notifications().unwrap());
    // The send itself succeeds either way: UCX delivered it; the receiver judges it.
    a.notify("b", "from a").unwrap().await.unwrap();
    b.notify("a", "from b").unwrap().await.unwrap();
    let mut got = Vec::new();
    for (backend, notes, from) in [(&ba, &mut na, "b"), (&bb, &mut nb, "a")] {
        let deadline = Instant::now() + Duration::from_secs(20);
        let delivered = loop {
            if let Some(n) = notes.try_recv() {
                assert_eq!(
                    (n.peer.as_str(), &n.msg[..]),
                    (from, format!("from {from}").as_bytes())
                );
                break true;
            }
            // Its HELLO and its notification, both refused.
            if unauthenticated(backend) >= 2 {
                break false;
            }
            assert!(
                Instant::now() < deadline,
                "{from}'s notification neither delivered nor refused"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        if delivered {
            assert_eq!(unauthenticated(backend), 0);
        } else {
            assert_eq!(unauthenticated(backend), 2);
            assert!(notes.try_recv().is_none(), "delivered although refused");
        }
        got.push(delivered);
    }
    assert!(a.shutdown().await.is_clean());
    assert!(b.shutdown().await.is_clean());
    Some((got[0], got[1]))
}

/// Send everything in `msgs` from `ucx` on `ep` by rendezvous, `rounds` times, and
/// progress until every send finished (bounded); returns how many were rejected by
/// the receiver and how many succeeded, per message of `msgs` (any other outcome
/// panics).
fn rendezvous_flood(
    ucx: &mut Ucx<Work>,
    ep: EpId,
    msgs: &[(u32, Vec<u8>, Bytes)],
    rounds: usize,
) -> Vec<(usize, usize)> {
    let mut outcome = vec![(0, 0); msgs.len()];
    let mut flights: Vec<(usize, FlightId)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    // Progress until at most `left` sends are in flight.
    let mut drain = |ucx: &mut Ucx<Work>, flights: &mut Vec<(usize, FlightId)>, left: usize| {
        while flights.len() > left {
            assert!(Instant::now() < deadline, "rendezvous sends did not finish");
            ucx.progress();
            flights.retain(|&(i, f)| {
                let Some((_, r)) = ucx.poll(f) else {
                    return true;
                };
                match r {
                    Err(e) if e.is_rejected() => outcome[i].0 += 1,
                    Err(e) => panic!("message {i}: {e} (expected a rejection)"),
                    Ok(()) => outcome[i].1 += 1,
                }
                false
            });
        }
    };
    for _ in 0..rounds {
        for (i, (id, h, data)) in msgs.iter().enumerate() {
            let f = ucx.am_send_rndv(ep, *id, h.clone(), data.clone(), Work::Internal);
            flights.push((i, f));
        }
        // A few rounds at a time in flight, so the receiver sees them interleaved
        // with the legitimate peer's traffic rather than all at once.
        drain(ucx, &mut flights, 4 * msgs.len());
    }
    drain(ucx, &mut flights, 0);
    outcome
}

/// A small deterministic generator (xorshift64*), so a failing case can be re-run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `valid` cut short (anywhere), or followed by garbage (up to 300 bytes), or (with
/// `version`) with its first byte's low nibble (a worker address's version) set to
/// 2..=15.
fn damaged(r: &mut Rng, valid: &[u8], version: bool) -> Vec<u8> {
    let mut v = valid.to_vec();
    match r.below(if version { 3 } else { 2 }) {
        0 => v.truncate(r.below(valid.len())),
        1 => v.extend((0..1 + r.below(300)).map(|_| r.next() as u8)),
        _ => v[0] = (v[0] & 0xf0) | (2 + r.below(14) as u8),
    }
    v
}

mod probes;
mod receive;
