//! The double against the verbs semantics it claims: peers gone, the queue pair
//! state machine, teardown, misuse, the worker thread.

use super::*;

#[test]
fn killed_or_destroyed_peer_gives_retry_exceeded() {
    let (a, b) = pair(4096, CAPS);
    b.recv(1, 0, 64).unwrap();
    kill(b.ctx);
    a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
        .unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::RETRY_EXC_ERR);
    a.post(&[wr(2, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
        .unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::WR_FLUSH_ERR);
    // The dead side's work vanishes without completions.
    b.recv(2, 0, 64).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(b.queued(), 0);
    a.teardown();
    b.teardown();

    // A SEND waiting for a receive fails once the peer's queue pair is destroyed.
    let (a, b) = pair(4096, CAPS);
    a.post(&[wr(3, SendOp::Send, 0, 1, true)], &[a.sge(0, 8)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(10));
    // SAFETY: b's queue pair is unused from now on.
    unsafe { b.api.destroy_qp(b.qp.handle) }.unwrap();
    assert_eq!(a.wait(1)[0].status, WcStatus::RETRY_EXC_ERR);
    a.teardown();
    // SAFETY: the rest of b, in order.
    unsafe {
        b.api.dereg_mr(b.mr.handle).unwrap();
        b.api.destroy_cq(b.cq).unwrap();
        b.api.destroy_channel(b.chan.handle).unwrap();
        b.api.dealloc_pd(b.pd).unwrap();
        b.api.close(b.ctx).unwrap();
    }
    assert!(violations_of(b.ctx).is_empty());
}

#[test]
fn state_machine_rejects_wrong_order() {
    let (a, b) = (Side::new(4096, CAPS), Side::new(4096, CAPS));
    let api = &a.api;
    let h = a.qp.handle;
    let kind = |r: Result<()>| r.unwrap_err().kind();
    let send = || a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)]);
    assert_eq!(send().unwrap_err().error.kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        a.recv(1, 0, 8).unwrap_err().error.kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        kind(api.modify_qp(h, &rtr(b.qp.qp_num, GIDS[1]))),
        ErrorKind::InvalidArgument
    );
    let init = QpTransition::Init {
        port: 1,
        pkey_index: 0,
        access: ALL,
    };
    api.modify_qp(h, &init).unwrap();
    assert_eq!(kind(api.modify_qp(h, &init)), ErrorKind::InvalidArgument);
    a.recv(1, 0, 8).unwrap(); // receives from INIT on
    let rts = QpTransition::Rts {
        sq_psn: 0,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
    };
    assert_eq!(kind(api.modify_qp(h, &rts)), ErrorKind::InvalidArgument);
    // RTR: a GID of the device, an MTU the port has (the destination is not
    // checked, as on a NIC: a missing one fails the first request).
    assert!(api.modify_qp(h, &rtr(b.qp.qp_num, [7; 16])).is_err());
    let QpTransition::Rtr { av, .. } = rtr(b.qp.qp_num, GIDS[1]) else {
        unreachable!()
    };
    let no_grh = QpTransition::Rtr {
        path_mtu: Mtu(5),
        dest_qp_num: b.qp.qp_num,
        rq_psn: 0,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        av: AddressVector { grh: None, ..av },
    };
    assert!(api.modify_qp(h, &no_grh).is_err());
    let big_mtu = QpTransition::Rtr {
        path_mtu: Mtu(6),
        dest_qp_num: b.qp.qp_num,
        rq_psn: 0,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        av,
    };
    assert!(api.modify_qp(h, &big_mtu).is_err());
    api.modify_qp(h, &rtr(b.qp.qp_num, GIDS[1])).unwrap();
    assert_eq!(send().unwrap_err().error.kind(), ErrorKind::InvalidArgument);
    api.modify_qp(h, &rts).unwrap();
    api.modify_qp(h, &QpTransition::Error).unwrap();
    assert_eq!(kind(api.modify_qp(h, &init)), ErrorKind::InvalidArgument);
    // ERROR flushes the receive posted in INIT.
    let f = a.wait(1);
    assert_eq!(
        (f[0].status, f[0].opcode),
        (WcStatus::WR_FLUSH_ERR, WcOpcode::Recv)
    );
    a.teardown();
    b.teardown();
}

#[test]
fn destroying_a_cq_with_unacked_events_is_a_violation() {
    let (a, b) = pair(4096, CAPS);
    let api = a.api.clone();
    api.req_notify_cq(a.cq).unwrap();
    a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
        .unwrap();
    assert!(readable(a.chan.fd, 10_000));
    assert_eq!(api.get_cq_event(a.chan.handle).unwrap(), Some(a.cq));
    a.wait(1);
    // Still used by a queue pair: refused, recorded.
    // SAFETY: refused (the queue stays live).
    let busy = unsafe { api.destroy_cq(a.cq) }.unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::NotAllowed);
    // SAFETY: live objects, unused from now on.
    unsafe {
        api.destroy_qp(a.qp.handle).unwrap();
        api.destroy_cq(a.cq).unwrap();
        api.dereg_mr(a.mr.handle).unwrap();
        api.destroy_channel(a.chan.handle).unwrap();
        api.dealloc_pd(a.pd).unwrap();
        api.close(a.ctx).unwrap();
    }
    let v = violations_of(a.ctx);
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(v[0].contains("still use it"), "{v:?}");
    assert!(v[1].contains("not acknowledged"), "{v:?}");
    assert!(violations().iter().any(|s| s.contains("not acknowledged")));
    b.teardown();
}

#[test]
fn misuse_is_recorded_not_fatal() {
    let api = api();
    let ctx = api.open(DEVICE_NAME).unwrap();
    let pd = api.alloc_pd(ctx).unwrap();
    let ch = api.create_channel(ctx).unwrap();
    let cq = api.create_cq(ctx, 4, ch.handle).unwrap();
    let qp = api.create_qp(pd, cq, CAPS).unwrap();
    let mut m = vec![0u8; 64];
    // SAFETY: `m` outlives the registration (the context's close removes it).
    let mr = unsafe { api.reg_mr(pd, m.as_mut_ptr() as usize, 64, ALL) }.unwrap();
    // Wrong kind, never made.
    assert!(api.poll_cq(pd, &mut [Completion::EMPTY]).is_err());
    assert!(api.query_device(Handle(usize::MAX)).is_err());
    // Entries outside the posted list.
    let init = QpTransition::Init {
        port: 1,
        pkey_index: 0,
        access: ALL,
    };
    api.modify_qp(qp.handle, &init).unwrap();
    api.modify_qp(qp.handle, &rtr(qp.qp_num, GIDS[0])).unwrap();
    let rts = QpTransition::Rts {
        sq_psn: 0,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
    };
    api.modify_qp(qp.handle, &rts).unwrap();
    let e = Sge {
        addr: m.as_ptr() as u64,
        len: 8,
        lkey: mr.lkey,
    };
    // SAFETY: refused before any entry is used.
    let r = unsafe { api.post_send(qp.handle, &[wr(1, SendOp::Send, 1, 1, true)], &[e]) };
    assert_eq!(r.unwrap_err().error.kind(), ErrorKind::InvalidArgument);
    // SAFETY: refused (EBUSY): the PD and channel stay live.
    unsafe {
        assert_eq!(
            api.dealloc_pd(pd).unwrap_err().kind(),
            ErrorKind::NotAllowed
        );
        assert_eq!(
            api.destroy_channel(ch.handle).unwrap_err().kind(),
            ErrorKind::NotAllowed
        );
    }
    // Destroy the QP twice, then use it.
    // SAFETY: live, then (wrongly, on purpose) stale: the double only records it.
    unsafe {
        api.destroy_qp(qp.handle).unwrap();
        assert!(api.destroy_qp(qp.handle).is_err());
    }
    api.ack_cq_events(cq, 3); // more than taken
                              // Close with children: recorded, and the children go with it.
                              // SAFETY: the context is unused from now on.
    unsafe { api.close(ctx) }.unwrap();
    assert_eq!(live_objects_of(ctx), 0);
    // SAFETY: stale on purpose.
    assert!(unsafe { api.dereg_mr(mr.handle) }.is_err());
    let v = violations_of(ctx).join("\n");
    for needle in [
        "is a protection domain, not a completion queue",
        "entries 1..+1 of a list of 1",
        "region(s) and 1 queue pair(s) still in it",
        "still report to it",
        "was destroyed",
        "acknowledged, only 0 taken",
        "still live",
        "ibv_dereg_mr",
    ] {
        assert!(v.contains(needle), "{needle:?} missing from:\n{v}");
    }
    assert!(violations().iter().any(|s| s.contains("never made")));
    drop(m);
}

#[test]
fn status_strings_match_libibverbs() {
    let api = api();
    assert_eq!(
        api.status_str(WcStatus::WR_FLUSH_ERR),
        "Work Request Flushed Error"
    );
    assert_eq!(
        api.status_str(WcStatus::RETRY_EXC_ERR),
        "transport retry counter exceeded"
    );
    assert!(api.status_str(WcStatus(999)).contains("999"));
    assert!(api.describe().contains("test double"));
}

#[test]
fn worker_thread_ends_when_idle() {
    let (a, b) = pair(4096, CAPS);
    a.post(&[wr(1, write_to(&b, 0), 0, 1, true)], &[a.sge(0, 8)])
        .unwrap();
    assert!(worker_running());
    a.wait(1);
    a.teardown();
    b.teardown();
    // Other tests of this binary may keep it busy for a while; generous bound.
    assert!(wait_until(Duration::from_secs(60), || !worker_running()));
}
