//! How many queue pairs peers may have made for them. Every inbound queue pair
//! reserves room in the agent's one completion queue, and a queue that is full
//! refuses every queue pair, inbound and outgoing alike; so a connection's queue
//! pairs are made only once this budget admits it:
//!
//! - all inbound queue pairs together stay within the completion queue's inbound
//!   share (the rest is kept for this agent's own connections:
//!   [`VerbsOptions::outgoing_cq_reserve`](crate::VerbsOptions)), and
//! - the connections of one [`Source`] (the agent name it proved where the agent has
//!   a secret, else its IP address: without a secret a name proves nothing) hold at
//!   most [`VerbsOptions::max_qps_per_source`](crate::VerbsOptions) of them.
//!
//! Plain bookkeeping, no I/O: a [`Grant`] holds its place until dropped.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Whom a connection's queue pairs are counted against.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// The agent the connection proved it is (the agent has a secret).
    Agent(String),
    /// The address it came from (no secret: the name in its hello proves nothing).
    Address(IpAddr),
}

impl Source {
    /// The source of a connection from `from` that proved agent `proven`, if any.
    pub(crate) fn of(proven: Option<&str>, from: IpAddr) -> Self {
        match proven {
            Some(name) => Self::Agent(name.to_owned()),
            // An IPv4 peer reaching an IPv6 listener counts as its IPv4 address.
            None => Self::Address(from.to_canonical()),
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Agent(name) => write!(f, "agent {name:?}"),
            Self::Address(ip) => write!(f, "address {ip}"),
        }
    }
}

/// The inbound queue pairs admitted, in total and per source.
#[derive(Debug)]
pub(crate) struct Budget {
    /// Inbound queue pairs the completion queue's inbound share holds.
    max_total: usize,
    max_per_source: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    /// Only sources holding at least one queue pair: as many entries as live
    /// grants, at most.
    by_source: HashMap<Source, usize>,
}

/// Why [`Budget::admit`] refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The source already holds `held` of its `max`.
    Source {
        source: Source,
        held: usize,
        max: usize,
        asked: usize,
    },
    /// Peers together hold `held` of the inbound share's `max`.
    Share {
        held: usize,
        max: usize,
        asked: usize,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Source {
                source,
                held,
                max,
                asked,
            } => write!(
                f,
                "{source} holds {held} of the {max} queue pairs one source may have here and asks for {asked} more (VerbsOptions::max_qps_per_source)"
            ),
            Self::Share { held, max, asked } => write!(
                f,
                "peers hold {held} of the {max} queue pairs the completion queue has room for beside this agent's own connections, and this one asks for {asked} (VerbsOptions::outgoing_cq_reserve, VerbsOptions::cq_depth)"
            ),
        }
    }
}

impl Budget {
    /// At most `max_total` inbound queue pairs, `max_per_source` of them per source.
    pub(crate) fn new(max_total: usize, max_per_source: usize) -> Arc<Self> {
        Arc::new(Self {
            max_total,
            max_per_source,
            held: Mutex::new(Held::default()),
        })
    }

    /// Admit `qps` queue pairs for `source`, or say why not (nothing changes then).
    pub(crate) fn admit(self: &Arc<Self>, source: Source, qps: usize) -> Result<Grant, Refusal> {
        let mut h = self.held.lock().unwrap();
        let mine = h.by_source.get(&source).copied().unwrap_or(0);
        if mine
            .checked_add(qps)
            .is_none_or(|n| n > self.max_per_source)
        {
            return Err(Refusal::Source {
                source,
                held: mine,
                max: self.max_per_source,
                asked: qps,
            });
        }
        if h.total.checked_add(qps).is_none_or(|n| n > self.max_total) {
            return Err(Refusal::Share {
                held: h.total,
                max: self.max_total,
                asked: qps,
            });
        }
        h.total += qps;
        if qps > 0 {
            *h.by_source.entry(source.clone()).or_default() += qps;
        }
        Ok(Grant {
            budget: self.clone(),
            source,
            qps,
        })
    }

    /// Queue pairs admitted now: in total, and for `source`.
    #[cfg(test)]
    fn held(&self, source: &Source) -> (usize, usize) {
        let h = self.held.lock().unwrap();
        (h.total, h.by_source.get(source).copied().unwrap_or(0))
    }
}

/// Queue pairs admitted for one connection; dropping it gives their place back
/// (drop it once they are destroyed).
#[derive(Debug)]
pub(crate) struct Grant {
    budget: Arc<Budget>,
    source: Source,
    qps: usize,
}

impl Drop for Grant {
    fn drop(&mut self) {
        let mut h = self.budget.held.lock().unwrap();
        h.total -= self.qps;
        if let Some(n) = h.by_source.get_mut(&self.source) {
            *n -= self.qps;
            if *n == 0 {
                h.by_source.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(last: u8) -> Source {
        Source::Address(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn one_source_gets_its_budget_and_no_more() {
        let b = Budget::new(100, 32);
        let g1 = b.admit(addr(1), 16).unwrap();
        let g2 = b.admit(addr(1), 16).unwrap();
        let e = b.admit(addr(1), 1).unwrap_err();
        assert_eq!(
            e,
            Refusal::Source {
                source: addr(1),
                held: 32,
                max: 32,
                asked: 1
            }
        );
        assert!(e.to_string().contains("max_qps_per_source"), "{e}");
        // Another source is not held back by it.
        let g3 = b.admit(addr(2), 16).unwrap();
        assert_eq!(b.held(&addr(1)), (48, 32));
        drop(g1);
        assert_eq!(b.held(&addr(1)), (32, 16));
        let g4 = b.admit(addr(1), 16).unwrap();
        drop((g2, g3, g4));
        assert_eq!(b.held(&addr(1)), (0, 0));
        assert!(b.held.lock().unwrap().by_source.is_empty(), "no entry left");
    }

    #[test]
    fn all_sources_together_stay_within_the_share() {
        let b = Budget::new(40, 16);
        let grants: Vec<_> = (0..5).map(|i| b.admit(addr(i), 8).unwrap()).collect();
        let e = b.admit(addr(9), 1).unwrap_err();
        assert!(
            matches!(
                e,
                Refusal::Share {
                    held: 40,
                    max: 40,
                    asked: 1
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("outgoing_cq_reserve"), "{e}");
        // A refusal changes nothing.
        assert_eq!(b.held(&addr(9)), (40, 0));
        drop(grants);
        assert_eq!(b.held(&addr(0)), (0, 0));
        assert!(b.admit(addr(9), 16).is_ok());
    }

    #[test]
    fn a_proven_agent_is_its_own_source_wherever_it_comes_from() {
        let b = Budget::new(100, 16);
        let from = |last| IpAddr::from([10, 0, 0, last]);
        let _g = b.admit(Source::of(Some("a"), from(1)), 16).unwrap();
        // The same agent from another address: the same budget, spent.
        assert!(b.admit(Source::of(Some("a"), from(2)), 1).is_err());
        // Another agent from the same address: its own.
        assert!(b.admit(Source::of(Some("b"), from(1)), 16).is_ok());
        // Without a secret, names count for nothing: the address is the source.
        let _h = b.admit(Source::of(None, from(3)), 16).unwrap();
        assert!(b.admit(Source::of(None, from(3)), 1).is_err());
        // An IPv4 peer seen through an IPv6 listener is the same address.
        let mapped: IpAddr = "::ffff:10.0.0.3".parse().unwrap();
        assert_eq!(Source::of(None, mapped), Source::of(None, from(3)));
    }

    #[test]
    fn asking_more_than_a_source_may_hold_is_refused_even_when_empty() {
        let b = Budget::new(1000, 8);
        assert!(matches!(
            b.admit(addr(1), 16),
            Err(Refusal::Source {
                held: 0,
                max: 8,
                asked: 16,
                ..
            })
        ));
        assert_eq!(b.held(&addr(1)), (0, 0));
    }
}
