//! The double against the verbs semantics it claims: the fixtures, the data path.

use super::*;
use crate::api::access::{LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};
use crate::api::{AddressVector, GlobalRoute};
use std::mem::ManuallyDrop;

const CAPS: QpCaps = QpCaps {
    max_send_wr: 64,
    max_recv_wr: 64,
    max_send_sge: 4,
    max_recv_sge: 1,
    max_inline_data: 64,
};
const ALL: u32 = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ;
const HANG: Duration = Duration::from_secs(10);

/// One agent: a device, a PD, a channel, a queue, a queue pair and a buffer.
struct Side {
    api: Arc<dyn VerbsApi>,
    ctx: Handle,
    pd: Handle,
    chan: Channel,
    cq: Handle,
    qp: Qp,
    buf: ManuallyDrop<Vec<u8>>,
    mr: Mr,
}

impl Side {
    fn new(len: usize, caps: QpCaps) -> Self {
        let api = api();
        let ctx = api.open(DEVICE_NAME).unwrap();
        let pd = api.alloc_pd(ctx).unwrap();
        let chan = api.create_channel(ctx).unwrap();
        let cq = api.create_cq(ctx, 256, chan.handle).unwrap();
        let qp = api.create_qp(pd, cq, caps).unwrap();
        let mut buf = ManuallyDrop::new(vec![0u8; len]);
        // SAFETY: the buffer is freed only in `teardown`, after `dereg_mr`; a test
        // that panics leaks it, so the worker never writes into freed memory.
        let mr = unsafe { api.reg_mr(pd, buf.as_mut_ptr() as usize, len, ALL) }.unwrap();
        Self {
            api,
            ctx,
            pd,
            chan,
            cq,
            qp,
            buf,
            mr,
        }
    }

    fn addr(&self, off: usize) -> u64 {
        self.buf.as_ptr() as u64 + off as u64
    }

    fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr(off),
            len,
            lkey: self.mr.lkey,
        }
    }

    fn post(&self, wrs: &[SendWr], sges: &[Sge]) -> std::result::Result<(), PostError> {
        // SAFETY: every entry lies in `self.buf`, registered until teardown,
        // which waits for (or flushes) the work first.
        unsafe { self.api.post_send(self.qp.handle, wrs, sges) }
    }

    fn recv(&self, wr_id: u64, off: usize, len: u32) -> std::result::Result<(), PostError> {
        let wr = RecvWr {
            wr_id,
            sge: self.sge(off, len),
        };
        // SAFETY: as in `post`.
        unsafe { self.api.post_recv(self.qp.handle, &[wr]) }
    }

    /// Wait for `n` completions.
    fn wait(&self, n: usize) -> Vec<Completion> {
        let end = Instant::now() + HANG;
        let mut got = Vec::new();
        while got.len() < n {
            let mut out = [Completion::EMPTY; 8];
            let want = (n - got.len()).min(out.len());
            let k = self.api.poll_cq(self.cq, &mut out[..want]).unwrap();
            got.extend_from_slice(&out[..k]);
            if k == 0 {
                assert!(
                    Instant::now() < end,
                    "hang: {} of {n} completions",
                    got.len()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        got
    }

    /// Completions queued and not polled.
    fn queued(&self) -> usize {
        with(|w| w.cqs.get(&self.cq.0).map_or(0, |c| c.entries.len()))
    }

    fn teardown(self) {
        let a = &self.api;
        // SAFETY: each object is live and unused from here on, destroyed in order.
        unsafe {
            a.destroy_qp(self.qp.handle).unwrap();
            a.dereg_mr(self.mr.handle).unwrap();
            a.destroy_cq(self.cq).unwrap();
            a.destroy_channel(self.chan.handle).unwrap();
            a.dealloc_pd(self.pd).unwrap();
            a.close(self.ctx).unwrap();
        }
        assert_eq!(violations_of(self.ctx), Vec::<String>::new());
        assert_eq!(live_objects_of(self.ctx), 0, "{:?}", live_details());
        drop(ManuallyDrop::into_inner(self.buf));
    }
}

fn bring_up(s: &Side, dest: u32, rnr_retry: u8) {
    let a = &s.api;
    a.modify_qp(
        s.qp.handle,
        &QpTransition::Init {
            port: 1,
            pkey_index: 0,
            access: ALL,
        },
    )
    .unwrap();
    a.modify_qp(s.qp.handle, &rtr(dest, GIDS[1])).unwrap();
    a.modify_qp(
        s.qp.handle,
        &QpTransition::Rts {
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry,
            max_rd_atomic: 4,
        },
    )
    .unwrap();
}

fn rtr(dest: u32, dgid: [u8; 16]) -> QpTransition {
    QpTransition::Rtr {
        path_mtu: Mtu(5),
        dest_qp_num: dest,
        rq_psn: 0,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        av: AddressVector {
            dlid: 0,
            sl: 0,
            port: 1,
            grh: Some(GlobalRoute {
                dgid,
                sgid_index: 1,
                hop_limit: 64,
                traffic_class: 0,
            }),
        },
    }
}

fn pair(len: usize, caps: QpCaps) -> (Side, Side) {
    let (a, b) = (Side::new(len, caps), Side::new(len, caps));
    bring_up(&a, b.qp.qp_num, 7);
    bring_up(&b, a.qp.qp_num, 7);
    (a, b)
}

fn wr(wr_id: u64, op: SendOp, first: u32, num: u32, signaled: bool) -> SendWr {
    SendWr {
        wr_id,
        op,
        first_sge: first,
        num_sge: num,
        signaled,
        fence: false,
        inline: false,
    }
}

fn write_to(b: &Side, off: usize) -> SendOp {
    SendOp::Write {
        remote_addr: b.addr(off),
        rkey: b.mr.rkey,
    }
}

fn readable(fd: RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, count 1.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    n == 1 && p.revents & libc::POLLIN != 0
}

fn pattern(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

#[test]
fn device_looks_like_a_small_roce_nic() {
    let api = api();
    assert_eq!(api.devices().unwrap()[0].name, DEVICE_NAME);
    assert_eq!(api.open("mlx5_0").unwrap_err().kind(), ErrorKind::NotFound);
    let ctx = api.open(DEVICE_NAME).unwrap();
    let port = api.query_port(ctx, 1).unwrap();
    assert_eq!(port.state, PORT_ACTIVE);
    assert_eq!(port.link_layer, LinkLayer::Ethernet);
    assert_eq!(port.active_mtu, Mtu(5));
    assert_eq!(port.max_msg_sz, 64 << 10);
    assert_eq!(port.gid_tbl_len, 2);
    let g0 = api.query_gid(ctx, 1, 0).unwrap().unwrap();
    assert_eq!(g0.kind, Some(GidType::RoceV1));
    assert_eq!(&g0.gid[..2], &[0xfe, 0x80]);
    let g1 = api.query_gid(ctx, 1, 1).unwrap().unwrap();
    assert_eq!(g1.kind, Some(GidType::RoceV2));
    assert_eq!(&g1.gid[10..], &[0xff, 0xff, 10, 0, 0, 1]);
    assert_eq!(api.query_gid(ctx, 1, 2).unwrap(), None);
    assert!(api.query_port(ctx, 2).is_err());
    let d = api.query_device(ctx).unwrap();
    assert_eq!((d.max_qp_wr, d.max_sge, d.max_cqe), (128, 4, 4096));
    let pd = api.alloc_pd(ctx).unwrap();
    let ch = api.create_channel(ctx).unwrap();
    let cq = api.create_cq(ctx, 16, ch.handle).unwrap();
    let asked = QpCaps {
        max_inline_data: 1024,
        ..CAPS
    };
    let qp = api.create_qp(pd, cq, asked).unwrap();
    assert_eq!(qp.caps.max_inline_data, 64);
    let too_deep = QpCaps {
        max_send_wr: 129,
        ..CAPS
    };
    assert_eq!(
        api.create_qp(pd, cq, too_deep).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let mut m = vec![0u8; 64];
    // SAFETY: `m` outlives the registration (deregistered below).
    let mr = unsafe { api.reg_mr(pd, m.as_mut_ptr() as usize, 64, ALL) }.unwrap();
    assert!(mr.lkey != 0 && mr.rkey != 0 && mr.lkey != mr.rkey);
    // SAFETY: as above; refused anyway (remote write without local write).
    let refused = unsafe { api.reg_mr(pd, m.as_mut_ptr() as usize, 64, REMOTE_WRITE) };
    assert_eq!(refused.unwrap_err().kind(), ErrorKind::InvalidArgument);
    // SAFETY: live objects, destroyed in order.
    unsafe {
        api.dereg_mr(mr.handle).unwrap();
        api.destroy_qp(qp.handle).unwrap();
        api.destroy_cq(cq).unwrap();
        api.destroy_channel(ch.handle).unwrap();
        api.dealloc_pd(pd).unwrap();
        api.close(ctx).unwrap();
    }
    assert!(violations_of(ctx).is_empty(), "{:?}", violations_of(ctx));
    assert_eq!(live_objects_of(ctx), 0);
}

#[test]
fn write_read_and_send_round_trip() {
    let (mut a, mut b) = pair(4096, CAPS);
    pattern(&mut a.buf[..1024], 1);
    pattern(&mut b.buf[3000..3100], 2);

    // WRITE: two local entries gathered into one remote range.
    let sges = [a.sge(0, 512), a.sge(512, 512)];
    a.post(&[wr(1, write_to(&b, 1024), 0, 2, true)], &sges)
        .unwrap();
    let c = a.wait(1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (1, WcStatus::SUCCESS, WcOpcode::Write)
    );
    assert_eq!(c[0].qp_num, a.qp.qp_num);
    assert_eq!(b.buf[1024..2048], a.buf[..1024]);

    // READ into a local entry.
    let op = SendOp::Read {
        remote_addr: b.addr(3000),
        rkey: b.mr.rkey,
    };
    a.post(&[wr(2, op, 0, 1, true)], &[a.sge(2000, 100)])
        .unwrap();
    let c = a.wait(1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (2, WcStatus::SUCCESS, WcOpcode::Read)
    );
    assert_eq!(a.buf[2000..2100], b.buf[3000..3100]);

    // SEND into the receiver's posted buffer.
    b.recv(77, 0, 256).unwrap();
    a.post(&[wr(3, SendOp::Send, 0, 1, true)], &[a.sge(100, 200)])
        .unwrap();
    let c = a.wait(1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (3, WcStatus::SUCCESS, WcOpcode::Send)
    );
    let r = b.wait(1);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].opcode),
        (77, WcStatus::SUCCESS, WcOpcode::Recv)
    );
    assert_eq!((r[0].byte_len, r[0].qp_num), (200, b.qp.qp_num));
    assert_eq!(b.buf[..200], a.buf[100..300]);

    // An unsignaled request completes silently; the signaled one after it reports.
    pattern(&mut a.buf[..64], 9);
    let sges = [a.sge(0, 32), a.sge(32, 32)];
    let wrs = [
        wr(4, write_to(&b, 0), 0, 1, false),
        wr(5, write_to(&b, 32), 1, 1, true),
    ];
    a.post(&wrs, &sges).unwrap();
    let c = a.wait(1);
    assert_eq!(c[0].wr_id, 5);
    assert_eq!(b.buf[..64], a.buf[..64]);
    assert_eq!(a.queued(), 0);

    a.teardown();
    b.teardown();
}

/// Runs one failing request on a fresh pair; its status, then checks that the
/// queue pair flushes what follows.
fn one_error(len: usize, build: impl Fn(&Side, &Side) -> (SendWr, Vec<Sge>)) -> WcStatus {
    let (a, b) = pair(len, CAPS);
    let (bad, sges) = build(&a, &b);
    a.post(&[bad], &sges).unwrap();
    let c = a.wait(1);
    assert_eq!(c[0].wr_id, bad.wr_id);
    // In ERROR now: a later signaled request is flushed.
    a.post(&[wr(99, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
        .unwrap();
    let f = a.wait(1);
    assert_eq!((f[0].wr_id, f[0].status), (99, WcStatus::WR_FLUSH_ERR));
    a.teardown();
    b.teardown();
    c[0].status
}

#[test]
fn key_and_range_errors_complete_in_error_and_flush_what_follows() {
    let (mut a, b) = pair(4096, CAPS);
    pattern(&mut a.buf[..64], 3);
    a.recv(50, 1000, 64).unwrap();
    let bad = SendOp::Write {
        remote_addr: b.addr(0),
        rkey: b.mr.rkey ^ 0x8000_0001,
    };
    let sges = [a.sge(0, 64)];
    let wrs = [
        wr(1, bad, 0, 1, true),
        wr(2, write_to(&b, 0), 0, 1, true),
        wr(3, write_to(&b, 0), 0, 1, false),
        wr(4, write_to(&b, 0), 0, 1, true),
    ];
    a.post(&wrs, &sges).unwrap();
    let c = a.wait(4);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::REM_ACCESS_ERR));
    let flushed: Vec<(u64, WcStatus, WcOpcode)> = c[1..]
        .iter()
        .map(|c| (c.wr_id, c.status, c.opcode))
        .collect();
    assert!(flushed.contains(&(2, WcStatus::WR_FLUSH_ERR, WcOpcode::Write)));
    assert!(flushed.contains(&(4, WcStatus::WR_FLUSH_ERR, WcOpcode::Write)));
    assert!(flushed.contains(&(50, WcStatus::WR_FLUSH_ERR, WcOpcode::Recv)));
    // Unsignaled 3 produced no flush completion, and nothing was written.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(a.queued(), 0);
    assert!(b.buf[..64].iter().all(|&x| x == 0));
    // Posted later: flushed too.
    a.post(&[wr(5, write_to(&b, 0), 0, 1, true)], &sges)
        .unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::WR_FLUSH_ERR);
    a.teardown();
    b.teardown();

    // Remote range past the region's end.
    let s = one_error(4096, |a, b| {
        (wr(1, write_to(b, 4000), 0, 1, true), vec![a.sge(0, 200)])
    });
    assert_eq!(s, WcStatus::REM_ACCESS_ERR);
    // An rkey where an lkey belongs.
    let s = one_error(4096, |a, b| {
        let mut e = a.sge(0, 16);
        e.lkey = a.mr.rkey;
        (wr(1, write_to(b, 0), 0, 1, true), vec![e])
    });
    assert_eq!(s, WcStatus::LOC_PROT_ERR);
    // A local entry past its region.
    let s = one_error(4096, |a, b| {
        (wr(1, write_to(b, 0), 0, 1, true), vec![a.sge(4090, 16)])
    });
    assert_eq!(s, WcStatus::LOC_PROT_ERR);
    // A message over the port's max_msg_sz (4 × 20000 > 64 KiB): never silent.
    let s = one_error(96 << 10, |a, b| {
        let sges = (0..4).map(|i| a.sge(i * 20_000, 20_000)).collect();
        (wr(1, write_to(b, 0), 0, 4, true), sges)
    });
    assert_eq!(s, LOC_LEN_ERR);
}

#[test]
fn remote_access_needs_the_region_and_queue_pair_flags() {
    // A region registered for READ only refuses a WRITE.
    let (a, b) = pair(4096, CAPS);
    let mut ro = vec![0u8; 128];
    // SAFETY: `ro` outlives the registration (deregistered below).
    let ro_mr = unsafe {
        b.api
            .reg_mr(b.pd, ro.as_mut_ptr() as usize, 128, REMOTE_READ)
    }
    .unwrap();
    let op = SendOp::Write {
        remote_addr: ro.as_ptr() as u64,
        rkey: ro_mr.rkey,
    };
    a.post(&[wr(1, op, 0, 1, true)], &[a.sge(0, 16)]).unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::REM_ACCESS_ERR);
    // SAFETY: unused from now on.
    unsafe { b.api.dereg_mr(ro_mr.handle) }.unwrap();
    a.teardown();
    b.teardown();

    // A queue pair brought up without REMOTE_WRITE refuses a WRITE too.
    let (a, b) = (Side::new(4096, CAPS), Side::new(4096, CAPS));
    bring_up(&a, b.qp.qp_num, 7);
    let init = QpTransition::Init {
        port: 1,
        pkey_index: 0,
        access: LOCAL_WRITE | REMOTE_READ,
    };
    b.api.modify_qp(b.qp.handle, &init).unwrap();
    b.api
        .modify_qp(b.qp.handle, &rtr(a.qp.qp_num, GIDS[0]))
        .unwrap();
    a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 16)])
        .unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::REM_ACCESS_ERR);
    a.teardown();
    b.teardown();
}

#[test]
fn send_larger_than_the_receive_fails_on_both_sides() {
    let (a, b) = pair(4096, CAPS);
    b.recv(7, 0, 100).unwrap();
    b.recv(8, 100, 100).unwrap();
    a.post(&[wr(1, SendOp::Send, 0, 1, true)], &[a.sge(0, 101)])
        .unwrap();
    assert_eq!(a.wait(1)[0].status, REM_INV_REQ_ERR);
    let r = b.wait(2);
    assert_eq!((r[0].wr_id, r[0].status), (7, LOC_LEN_ERR));
    // The receiver went to ERROR: its other receive is flushed.
    assert_eq!((r[1].wr_id, r[1].status), (8, WcStatus::WR_FLUSH_ERR));
    a.teardown();
    b.teardown();
}

#[test]
fn inline_sends_copy_at_post_time_and_respect_the_grant() {
    let (mut a, b) = pair(4096, CAPS);
    pattern(&mut a.buf[..64], 5);
    let sent = a.buf[..64].to_vec();
    b.recv(1, 0, 64).unwrap();
    let mut w = wr(2, SendOp::Send, 0, 1, true);
    w.inline = true;
    let mut e = a.sge(0, 64);
    e.lkey = 0; // no key needed inline
    a.post(&[w], &[e]).unwrap();
    a.buf[..64].fill(0xee); // after the post: must not reach the peer
    assert_eq!(a.wait(1)[0].status, WcStatus::SUCCESS);
    assert_eq!(b.wait(1)[0].byte_len, 64);
    assert_eq!(b.buf[..64], sent[..]);
    let over = a.post(&[w], &[a.sge(0, 65)]).unwrap_err();
    assert_eq!(
        (over.posted, over.error.kind()),
        (0, ErrorKind::InvalidArgument)
    );
    a.teardown();
    b.teardown();
}

#[test]
fn channel_fires_only_for_completions_after_arming() {
    let (a, b) = pair(4096, CAPS);
    let api = &a.api;
    let fd = a.chan.fd;
    let one = |id| a.post(&[wr(id, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)]);
    // A completion queued before arming does not fire.
    one(1).unwrap();
    assert!(wait_until(HANG, || a.queued() == 1));
    api.req_notify_cq(a.cq).unwrap();
    assert!(!readable(fd, 20));
    assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), None);
    // The next one does, once.
    one(2).unwrap();
    assert!(readable(fd, 10_000), "no event after arming");
    assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), Some(a.cq));
    assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), None);
    assert!(
        !readable(fd, 0),
        "descriptor still readable with no event left"
    );
    api.ack_cq_events(a.cq, 1);
    // Disarmed by that event: a third completion fires nothing.
    one(3).unwrap();
    assert!(wait_until(HANG, || a.queued() == 3));
    assert!(!readable(fd, 20));
    assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), None);
    let ids: Vec<u64> = a.wait(3).iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [1, 2, 3]);
    a.teardown();
    b.teardown();
}

#[test]
fn send_queue_capacity_and_retirement() {
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 2,
        ..CAPS
    };
    let (a, b) = pair(4096, caps);
    let sges = [a.sge(0, 8)];
    let w = |id, sig| wr(id, write_to(&b, 0), 0, 1, sig);
    // Three unsignaled and one signaled fill the queue.
    a.post(&[w(1, false), w(2, false), w(3, false), w(4, true)], &sges)
        .unwrap();
    let full = a.post(&[w(5, true)], &sges).unwrap_err();
    assert_eq!((full.posted, full.error.kind()), (0, ErrorKind::Backend));
    // Completed but not polled: not retired yet.
    assert!(wait_until(HANG, || a.queued() == 1));
    assert_eq!(a.post(&[w(5, true)], &sges).unwrap_err().posted, 0);
    // Polling request 4's completion retires 1..=4.
    assert_eq!(a.wait(1)[0].wr_id, 4);
    let part = a
        .post(
            &[w(6, true), w(7, true), w(8, true), w(9, true), w(10, true)],
            &sges,
        )
        .unwrap_err();
    assert_eq!((part.posted, part.error.kind()), (4, ErrorKind::Backend));
    let ids: Vec<u64> = a.wait(4).iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [6, 7, 8, 9]);
    a.post(&[w(11, true)], &sges).unwrap();
    assert_eq!(a.wait(1)[0].wr_id, 11);
    // The receive queue likewise.
    let recvs: Vec<RecvWr> = (0..3)
        .map(|i| RecvWr {
            wr_id: i,
            sge: b.sge(0, 64),
        })
        .collect();
    // SAFETY: entries in b's registered buffer.
    let err = unsafe { b.api.post_recv(b.qp.handle, &recvs) }.unwrap_err();
    assert_eq!((err.posted, err.error.kind()), (2, ErrorKind::Backend));
    a.teardown();
    b.teardown();
}

#[test]
fn send_waits_for_a_receive_without_holding_up_others() {
    let (mut a, b) = pair(4096, CAPS);
    let (c, d) = pair(4096, CAPS);
    pattern(&mut a.buf[..128], 7);
    a.post(&[wr(1, SendOp::Send, 0, 1, true)], &[a.sge(0, 128)])
        .unwrap();
    // Another pair is not held up by the waiting SEND.
    c.post(&[wr(2, write_to(&d, 0), 0, 1, true)], &[c.sge(0, 8)])
        .unwrap();
    assert_eq!(c.wait(1)[0].status, WcStatus::SUCCESS);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(a.queued(), 0, "a SEND completed with no receive posted");
    b.recv(9, 512, 256).unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::SUCCESS);
    let r = b.wait(1);
    assert_eq!((r[0].wr_id, r[0].byte_len), (9, 128));
    assert_eq!(b.buf[512..640], a.buf[..128]);
    for s in [a, b, c, d] {
        s.teardown();
    }
}

#[test]
fn finite_rnr_retry_gives_up() {
    let (a, b) = (Side::new(4096, CAPS), Side::new(4096, CAPS));
    bring_up(&a, b.qp.qp_num, 1);
    bring_up(&b, a.qp.qp_num, 7);
    a.post(&[wr(1, SendOp::Send, 0, 1, true)], &[a.sge(0, 8)])
        .unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::RNR_RETRY_EXC_ERR);
    a.teardown();
    b.teardown();
}

mod lifecycle;
