//! Pure planning, free of I/O: the state changes that connect a queue pair, and the
//! work requests a transfer becomes at the device's limits.

use crate::api::{
    access, AddressVector, GlobalRoute, LinkLayer, Mtu, QpTransition, SendOp, SendWr, Sge,
};
use crate::wire::Endpoint;

/// Reliability settings of a connection (from the options).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reliability {
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout per try.
    pub timeout: u8,
    /// Retries after a timeout before the queue pair fails.
    pub retry_cnt: u8,
    /// Largest MTU to use (the ports' active MTUs may lower it).
    pub max_mtu: Mtu,
    /// READs in flight per queue pair, each way (the devices may lower it).
    pub max_rd_atomic: u8,
    /// Traffic class of the global route header (RoCE: the DSCP and ECN bits; lossless
    /// RoCE fabrics usually need the class their PFC priority maps to).
    pub traffic_class: u8,
    /// InfiniBand service level.
    pub service_level: u8,
}

impl Default for Reliability {
    fn default() -> Self {
        Self {
            // 4.096 µs × 2^14 ≈ 67 ms per try, 7 retries: a peer that vanished without
            // closing its control connection fails the queue pair within about 0.5 s.
            timeout: 14,
            retry_cnt: 7,
            max_mtu: Mtu(5),
            max_rd_atomic: 16,
            traffic_class: 0,
            service_level: 0,
        }
    }
}

impl Reliability {
    /// Check the values against what the verbs fields hold.
    ///
    /// # Errors
    /// [`nixl::ErrorKind::InvalidArgument`] naming the value out of range.
    pub fn check(&self) -> nixl::Result<()> {
        let bad = |what: String| {
            Err(nixl::Error::new(
                nixl::ErrorKind::InvalidArgument,
                "verbs options",
                what,
            ))
        };
        if self.timeout > 31 {
            return bad(format!("timeout {} is over 31", self.timeout));
        }
        if self.retry_cnt > 7 {
            return bad(format!("retry_cnt {} is over 7", self.retry_cnt));
        }
        if self.service_level > 15 {
            return bad(format!("service_level {} is over 15", self.service_level));
        }
        if self.max_mtu.bytes() == 0 {
            return bad("max_mtu is not 256 to 4096 bytes".to_owned());
        }
        Ok(())
    }

    /// The longest a queue pair keeps retrying a peer that stopped answering:
    /// `(retry_cnt + 1) × 4.096 µs × 2^timeout`.
    pub fn give_up_after(&self) -> std::time::Duration {
        let per_try_ns = 4096u64 << self.timeout.min(31);
        std::time::Duration::from_nanos(per_try_ns * (u64::from(self.retry_cnt) + 1))
    }
}

/// The three state changes that connect our queue pair (`local`, first PSN
/// `local_psn`) to the peer's (`remote`, number `remote_qp`, first PSN
/// `remote_psn`): RESET to INIT, to ready-to-receive, to ready-to-send.
///
/// `max_dest_rd` / `max_init_rd` are our device's limits for READs served and
/// issued; we issue no more than the peer serves (`remote.max_rd_atomic`). On
/// Ethernet (RoCE) every packet carries a global route header to the peer's GID; on
/// InfiniBand only where the peers are in different subnets (their GIDs' 64-bit
/// subnet prefixes differ).
#[allow(clippy::too_many_arguments)]
pub fn connect(
    local: &Endpoint,
    local_psn: u32,
    remote: &Endpoint,
    remote_qp: u32,
    remote_psn: u32,
    rel: &Reliability,
    max_dest_rd: u32,
    max_init_rd: u32,
) -> [QpTransition; 3] {
    let ethernet = local.link_layer == LinkLayer::Ethernet;
    let routed = ethernet || local.gid[..8] != remote.gid[..8];
    let av = AddressVector {
        dlid: if ethernet { 0 } else { remote.lid },
        sl: rel.service_level,
        port: local.port,
        grh: routed.then_some(GlobalRoute {
            dgid: remote.gid,
            sgid_index: local.gid_index,
            hop_limit: 64,
            traffic_class: rel.traffic_class,
        }),
    };
    let rd = |dev: u32| rel.max_rd_atomic.min(dev.min(255) as u8).max(1);
    [
        QpTransition::Init {
            port: local.port,
            pkey_index: 0,
            access: access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ,
        },
        QpTransition::Rtr {
            path_mtu: rel.max_mtu.min(local.mtu).min(remote.mtu),
            dest_qp_num: remote_qp,
            rq_psn: remote_psn,
            max_dest_rd_atomic: rd(max_dest_rd),
            // 12: 0.64 ms before a receiver-not-ready retry.
            min_rnr_timer: 12,
            av,
        },
        QpTransition::Rts {
            sq_psn: local_psn,
            timeout: rel.timeout,
            retry_cnt: rel.retry_cnt,
            // 7: retry forever while the peer has no receive posted (it reposts
            // notification buffers as it consumes them).
            rnr_retry: 7,
            max_rd_atomic: rd(max_init_rd.min(u32::from(remote.max_rd_atomic))),
        },
    ]
}

/// A random 24-bit packet sequence number.
pub fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    getrandom::getrandom(&mut b).expect("the OS random source works");
    u32::from_le_bytes(b) & 0xFF_FFFF
}

/// Device limits that shape work requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrLimits {
    /// Largest message (the port's `max_msg_sz`).
    pub max_msg: u64,
    /// Scatter/gather entries per work request (the queue pair's granted
    /// `max_send_sge`).
    pub max_sge: u32,
}

/// One contiguous piece of a transfer: local bytes and where they go (or come from)
/// at the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Local address.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Local key of the region it lies in.
    pub lkey: u32,
    /// Peer address.
    pub remote_addr: u64,
    /// Peer key.
    pub rkey: u32,
}

/// The work requests of a transfer (ids and signalling are set at post time).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WrPlan {
    /// Work requests, in order.
    pub wrs: Vec<SendWr>,
    /// Their entries.
    pub sges: Vec<Sge>,
}

impl WrPlan {
    /// Bytes the plan moves.
    pub fn bytes(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.len)).sum()
    }
}

/// Turn pieces into RDMA WRITEs or READs (`read`), at the limits: pieces that follow
/// each other at the peer under one key share a work request (a gather list on
/// WRITE, a scatter list on READ) up to `max_sge` entries and `max_msg` bytes; a piece
/// longer than `max_msg` is cut into several. Entries never exceed `u32::MAX` bytes.
pub fn work_requests(read: bool, pieces: impl IntoIterator<Item = Piece>, lim: WrLimits) -> WrPlan {
    let max_msg = lim.max_msg.clamp(1, u64::from(u32::MAX));
    let max_sge = lim.max_sge.max(1);
    let mut plan = WrPlan::default();
    // The open work request: its peer address end, key and bytes so far.
    let mut open: Option<(u64, u32, u64)> = None;
    for p in pieces {
        let (mut addr, mut remote, mut left) = (p.addr, p.remote_addr, p.len);
        while left > 0 {
            let joins = match (open, plan.wrs.last()) {
                (Some((end, key, bytes)), Some(w)) => {
                    end == remote && key == p.rkey && bytes < max_msg && w.num_sge < max_sge
                }
                _ => false,
            };
            if !joins {
                let op = if read {
                    SendOp::Read {
                        remote_addr: remote,
                        rkey: p.rkey,
                    }
                } else {
                    SendOp::Write {
                        remote_addr: remote,
                        rkey: p.rkey,
                    }
                };
                plan.wrs.push(SendWr {
                    wr_id: 0,
                    op,
                    first_sge: plan.sges.len() as u32,
                    num_sge: 0,
                    signaled: false,
                    fence: false,
                    inline: false,
                });
                open = Some((remote, p.rkey, 0));
            }
            let (end, key, bytes) = open.expect("a work request is open");
            let n = left.min(max_msg - bytes);
            plan.sges.push(Sge {
                addr,
                len: n as u32,
                lkey: p.lkey,
            });
            plan.wrs.last_mut().expect("just pushed").num_sge += 1;
            open = Some((end + n, key, bytes + n));
            addr += n;
            remote += n;
            left -= n;
        }
    }
    plan
}

/// Which of `n` work requests to signal so that at most `window` are ever posted
/// without a signaled one among them: every `window`-th, and the last. A signaled
/// completion retires it and every unsignaled request before it, so the send queue
/// (holding at least `window` entries) never fills with requests nothing will retire.
pub fn signaled(n: usize, window: usize) -> impl Iterator<Item = bool> {
    let window = window.max(1);
    (0..n).map(move |i| i + 1 == n || (i + 1) % window == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ep(ll: LinkLayer, lid: u16, gid_last: u8, mtu: u8) -> Endpoint {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[15] = gid_last;
        Endpoint {
            link_layer: ll,
            port: 1,
            mtu: Mtu(mtu),
            lid,
            gid_index: 1,
            gid,
            max_msg_sz: 1 << 30,
            max_rd_atomic: 16,
        }
    }

    #[test]
    fn roce_connects_with_a_global_route_at_the_smaller_mtu() {
        let a = ep(LinkLayer::Ethernet, 0, 1, 5);
        let b = ep(LinkLayer::Ethernet, 0, 2, 3);
        let [init, rtr, rts] = connect(&a, 100, &b, 7, 200, &Reliability::default(), 16, 8);
        assert!(matches!(
            init,
            QpTransition::Init {
                port: 1,
                access: 7,
                ..
            }
        ));
        match rtr {
            QpTransition::Rtr {
                path_mtu,
                dest_qp_num,
                rq_psn,
                max_dest_rd_atomic,
                av,
                ..
            } => {
                assert_eq!((path_mtu, dest_qp_num, rq_psn), (Mtu(3), 7, 200));
                assert_eq!(max_dest_rd_atomic, 16);
                assert_eq!(av.dlid, 0);
                let grh = av.grh.expect("RoCE needs a global route");
                assert_eq!((grh.dgid, grh.sgid_index), (b.gid, 1));
            }
            other => panic!("{other:?}"),
        }
        match rts {
            QpTransition::Rts {
                sq_psn,
                max_rd_atomic,
                rnr_retry,
                ..
            } => assert_eq!((sq_psn, max_rd_atomic, rnr_retry), (100, 8, 7)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn infiniband_routes_only_across_subnets() {
        let a = ep(LinkLayer::InfiniBand, 3, 1, 5);
        let b = ep(LinkLayer::InfiniBand, 9, 2, 5);
        let [_, rtr, _] = connect(&a, 1, &b, 2, 3, &Reliability::default(), 4, 4);
        let QpTransition::Rtr { av, .. } = rtr else {
            panic!()
        };
        assert_eq!((av.dlid, av.grh), (9, None), "same subnet: LID only");
        let mut far = b;
        far.gid[0] = 0x20;
        let [_, rtr, _] = connect(&a, 1, &far, 2, 3, &Reliability::default(), 4, 4);
        let QpTransition::Rtr { av, .. } = rtr else {
            panic!()
        };
        assert_eq!(av.grh.map(|g| g.dgid), Some(far.gid));
        // We issue no more READs than the peer serves.
        let mut few = b;
        few.max_rd_atomic = 2;
        let [_, _, rts] = connect(&a, 1, &few, 2, 3, &Reliability::default(), 16, 16);
        assert!(matches!(
            rts,
            QpTransition::Rts {
                max_rd_atomic: 2,
                ..
            }
        ));
        // A device that serves no READ still gets at least one.
        let [_, rtr, _] = connect(&a, 1, &b, 2, 3, &Reliability::default(), 0, 0);
        assert!(matches!(
            rtr,
            QpTransition::Rtr {
                max_dest_rd_atomic: 1,
                ..
            }
        ));
    }

    #[test]
    fn reliability_is_checked() {
        assert!(Reliability::default().check().is_ok());
        for bad in [
            Reliability {
                timeout: 32,
                ..Reliability::default()
            },
            Reliability {
                retry_cnt: 8,
                ..Reliability::default()
            },
            Reliability {
                service_level: 16,
                ..Reliability::default()
            },
            Reliability {
                max_mtu: Mtu(6),
                ..Reliability::default()
            },
        ] {
            assert_eq!(
                bad.check().unwrap_err().kind(),
                nixl::ErrorKind::InvalidArgument
            );
        }
    }

    #[test]
    fn give_up_bound() {
        let r = Reliability::default();
        let d = r.give_up_after();
        assert!(
            d > std::time::Duration::from_millis(500) && d < std::time::Duration::from_millis(600),
            "{d:?}"
        );
    }

    fn piece(addr: u64, len: u64, remote_addr: u64) -> Piece {
        Piece {
            addr,
            len,
            lkey: 1,
            remote_addr,
            rkey: 2,
        }
    }

    #[test]
    fn pieces_merge_and_split_at_the_limits() {
        let lim = WrLimits {
            max_msg: 100,
            max_sge: 2,
        };
        // Contiguous at the peer, scattered locally: one request of two entries, then a
        // new one (entry limit).
        let p = work_requests(
            false,
            [
                piece(0, 10, 1000),
                piece(500, 10, 1010),
                piece(900, 10, 1020),
            ],
            lim,
        );
        assert_eq!(p.wrs.len(), 2);
        assert_eq!((p.wrs[0].num_sge, p.wrs[1].num_sge), (2, 1));
        assert_eq!(
            p.wrs[1].op,
            SendOp::Write {
                remote_addr: 1020,
                rkey: 2
            }
        );
        // One piece of 250 bytes: three requests of 100, 100, 50.
        let p = work_requests(true, [piece(0, 250, 5000)], lim);
        let lens: Vec<u32> = p.sges.iter().map(|s| s.len).collect();
        assert_eq!(lens, vec![100, 100, 50]);
        assert_eq!(
            p.wrs[2].op,
            SendOp::Read {
                remote_addr: 5200,
                rkey: 2
            }
        );
        // A gap at the peer starts a new request.
        let p = work_requests(false, [piece(0, 10, 0), piece(10, 10, 20)], lim);
        assert_eq!(p.wrs.len(), 2);
        // A request that is full in bytes does not take the next piece.
        let p = work_requests(false, [piece(0, 100, 0), piece(100, 10, 100)], lim);
        assert_eq!(p.wrs.len(), 2);
    }

    #[test]
    fn signaling_windows() {
        let s: Vec<bool> = signaled(7, 3).collect();
        assert_eq!(s, vec![false, false, true, false, false, true, true]);
        assert_eq!(signaled(1, 64).collect::<Vec<_>>(), vec![true]);
        assert_eq!(signaled(0, 64).count(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Every byte of every piece is covered exactly once, in order, at the right
        /// peer address, and no request breaks a limit.
        #[test]
        fn work_requests_cover_pieces_within_limits(
            shapes in proptest::collection::vec((1u64..300, 0u64..3, 0u64..3), 1..20),
            max_msg in 1u64..400,
            max_sge in 1u32..5,
            read in any::<bool>(),
        ) {
            let (mut local, mut remote) = (0u64, 1u64 << 32);
            let pieces: Vec<Piece> = shapes.iter().map(|&(len, lgap, rgap)| {
                let p = Piece { addr: local, len, lkey: 7, remote_addr: remote, rkey: 9 };
                local += len + lgap;
                remote += len + rgap;
                p
            }).collect();
            let plan = work_requests(read, pieces.iter().copied(), WrLimits { max_msg, max_sge });
            // Expand both to (local, remote) byte pairs, run-length encoded.
            let mut want = Vec::new();
            for p in &pieces { want.push((p.addr, p.remote_addr, p.len)); }
            let mut got = Vec::new();
            for w in &plan.wrs {
                prop_assert!(w.num_sge >= 1 && w.num_sge <= max_sge);
                let sges = &plan.sges[w.first_sge as usize..(w.first_sge + w.num_sge) as usize];
                let total: u64 = sges.iter().map(|s| u64::from(s.len)).sum();
                prop_assert!(total <= max_msg);
                let (mut at, key) = match w.op {
                    SendOp::Write { remote_addr, rkey } => { prop_assert!(!read); (remote_addr, rkey) }
                    SendOp::Read { remote_addr, rkey } => { prop_assert!(read); (remote_addr, rkey) }
                    SendOp::Send => { prop_assert!(false, "no sends"); (0, 0) }
                };
                prop_assert_eq!(key, 9);
                for s in sges {
                    prop_assert!(s.len > 0);
                    got.push((s.addr, at, u64::from(s.len)));
                    at += u64::from(s.len);
                }
            }
            let merge = |v: Vec<(u64, u64, u64)>| {
                let mut out: Vec<(u64, u64, u64)> = Vec::new();
                for (l, r, n) in v {
                    match out.last_mut() {
                        Some((pl, pr, pn)) if *pl + *pn == l && *pr + *pn == r => *pn += n,
                        _ => out.push((l, r, n)),
                    }
                }
                out
            };
            prop_assert_eq!(merge(got), merge(want));
            prop_assert_eq!(plan.bytes(), pieces.iter().map(|p| p.len).sum::<u64>());
        }
    }
}
