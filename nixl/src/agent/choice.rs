//! Which backend serves a request: the first candidate, in preference order, that can.

use crate::backend::Capabilities;
use crate::memory::MemKind;

/// One backend as a candidate for one request.
#[derive(Clone, Debug)]
pub(super) struct Candidate<'a> {
    pub(super) name: &'a str,
    pub(super) caps: Capabilities,
    /// Every local region of the request is registered with it.
    pub(super) locals_registered: bool,
    /// The peer published connection info for it (`true` for local requests).
    pub(super) peer_offers: bool,
    /// Every remote region of the request carries a blob for it (`true` for local).
    pub(super) remotes_registered: bool,
}

/// What the request needs.
#[derive(Clone, Copy, Debug)]
pub(super) struct Need {
    pub(super) remote: bool,
    pub(super) local_kind: MemKind,
    pub(super) remote_kind: MemKind,
    /// Segment runs after merging.
    pub(super) segments: usize,
}

/// Why `c` cannot serve `need`, or `None` when it can.
pub(super) fn refusal(c: &Candidate<'_>, need: &Need) -> Option<String> {
    let why = if !need.remote && !c.caps.local {
        "no local transfers"
    } else if need.remote && !c.caps.remote {
        "no remote transfers"
    } else if !c.caps.supports(need.local_kind) || !c.caps.supports(need.remote_kind) {
        "memory kind not supported"
    } else if !c.locals_registered {
        "a local region is not registered with it"
    } else if !c.peer_offers {
        "the peer does not offer it"
    } else if !c.remotes_registered {
        "a remote region is not registered with it at the peer"
    } else if need.segments > c.caps.max_segments {
        return Some(format!(
            "{} segment runs, more than its limit of {}",
            need.segments, c.caps.max_segments
        ));
    } else {
        return None;
    };
    Some(why.to_owned())
}

/// The index (into `candidates`) of the first that can serve `need`, or every
/// candidate's reason.
pub(super) fn choose(
    candidates: &[Candidate<'_>],
    need: &Need,
) -> std::result::Result<usize, String> {
    let mut reasons = Vec::with_capacity(candidates.len());
    for (i, c) in candidates.iter().enumerate() {
        match refusal(c, need) {
            None => return Ok(i),
            Some(w) => reasons.push(format!("{}: {w}", c.name)),
        }
    }
    Err(reasons.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(remote: bool, vram: bool) -> Capabilities {
        Capabilities {
            local: true,
            remote,
            notifications: true,
            dram: true,
            vram,
            ..Capabilities::default()
        }
    }

    fn cand(name: &str, caps: Capabilities) -> Candidate<'_> {
        Candidate {
            name,
            caps,
            locals_registered: true,
            peer_offers: true,
            remotes_registered: true,
        }
    }

    const DRAM_REMOTE: Need = Need {
        remote: true,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::Dram,
        segments: 4,
    };

    #[test]
    fn first_capable_in_order_wins() {
        let c = [cand("a", caps(true, false)), cand("b", caps(true, true))];
        assert_eq!(choose(&c, &DRAM_REMOTE), Ok(0));
        let vram = Need {
            remote_kind: MemKind::Vram { device: 0 },
            ..DRAM_REMOTE
        };
        assert_eq!(choose(&c, &vram), Ok(1));
    }

    #[test]
    fn every_reason_is_listed() {
        let mut unregistered = cand("b", caps(true, false));
        unregistered.locals_registered = false;
        let mut not_offered = cand("c", caps(true, false));
        not_offered.peer_offers = false;
        let mut no_blob = cand("d", caps(true, false));
        no_blob.remotes_registered = false;
        let c = [
            cand("a", caps(false, false)),
            unregistered,
            not_offered,
            no_blob,
        ];
        let e = choose(&c, &DRAM_REMOTE).unwrap_err();
        assert_eq!(
            e,
            "a: no remote transfers; b: a local region is not registered with it; \
             c: the peer does not offer it; d: a remote region is not registered with it at the peer"
        );
    }

    #[test]
    fn segment_limit_is_a_reason() {
        let mut small = caps(true, false);
        small.max_segments = 2;
        let c = [cand("small", small), cand("big", caps(true, false))];
        assert_eq!(choose(&c, &DRAM_REMOTE), Ok(1));
        let e = choose(&c[..1], &DRAM_REMOTE).unwrap_err();
        assert!(
            e.contains("4 segment runs, more than its limit of 2"),
            "{e}"
        );
    }

    #[test]
    fn local_requests_need_local_capability() {
        let mut no_local = caps(true, true);
        no_local.local = false;
        let need = Need {
            remote: false,
            local_kind: MemKind::Vram { device: 0 },
            remote_kind: MemKind::Vram { device: 0 },
            segments: 1,
        };
        assert!(choose(&[cand("x", no_local)], &need)
            .unwrap_err()
            .contains("no local transfers"));
    }
}
