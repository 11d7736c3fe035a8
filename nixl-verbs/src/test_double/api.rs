//! The verbs API over the world: each call checks its handles and arguments as
//! libibverbs and the kernel would, records misuse, and changes the world.

use super::*;

impl VerbsApi for TestDouble {
    fn describe(&self) -> String {
        format!(
            "verbs test double (in-process software NIC {DEVICE_NAME}: proves structure, \
             not a data path)"
        )
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![DeviceInfo {
            name: DEVICE_NAME.into(),
            guid: DEVICE_GUID,
        }])
    }

    fn open(&self, device: &str) -> Result<Handle> {
        if device != DEVICE_NAME {
            return Err(Error::new(
                ErrorKind::NotFound,
                "ibv_open_device",
                format!("no RDMA device {device:?}; the test double has only {DEVICE_NAME}"),
            ));
        }
        Ok(with(|w| {
            let id = w.make(None);
            let limits = w.limits;
            w.ctxs.insert(
                id,
                Ctx {
                    limits,
                    dead: false,
                },
            );
            Handle(id)
        }))
    }

    fn query_device(&self, ctx: Handle) -> Result<DeviceLimits> {
        with(|w| match w.ctxs.get(&ctx.0) {
            Some(c) => Ok(c.limits.device),
            None => Err(w.bad("ibv_query_device", ctx, CTX)),
        })
    }

    fn query_port(&self, ctx: Handle, port: u8) -> Result<PortInfo> {
        const OP: &str = "ibv_query_port";
        with(|w| {
            let Some(c) = w.ctxs.get(&ctx.0) else {
                return Err(w.bad(OP, ctx, CTX));
            };
            if port != 1 {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{DEVICE_NAME} has port 1 only, not {port}"),
                ));
            }
            Ok(PortInfo {
                state: PORT_ACTIVE,
                lid: 0,
                active_mtu: PORT_MTU,
                link_layer: LinkLayer::Ethernet,
                gid_tbl_len: GIDS.len() as u32,
                max_msg_sz: c.limits.max_msg_sz,
            })
        })
    }

    fn query_gid(&self, ctx: Handle, port: u8, index: u32) -> Result<Option<GidEntry>> {
        const OP: &str = "ibv_query_gid";
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad(OP, ctx, CTX));
            }
            if port != 1 {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{DEVICE_NAME} has port 1 only, not {port}"),
                ));
            }
            Ok(GIDS.get(index as usize).map(|gid| GidEntry {
                gid: *gid,
                index,
                kind: Some(if index == 0 {
                    GidType::RoceV1
                } else {
                    GidType::RoceV2
                }),
            }))
        })
    }

    fn alloc_pd(&self, ctx: Handle) -> Result<Handle> {
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad("ibv_alloc_pd", ctx, CTX));
            }
            let id = w.make(Some(ctx.0));
            w.pds.insert(id, Pd { ctx: ctx.0 });
            Ok(Handle(id))
        })
    }

    unsafe fn reg_mr(&self, pd: Handle, addr: usize, len: usize, access: u32) -> Result<Mr> {
        with(|w| w.reg("ibv_reg_mr", pd, addr, len, access))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Handle,
        _offset: u64,
        len: usize,
        iova: u64,
        fd: BorrowedFd<'_>,
        access: u32,
    ) -> Result<Mr> {
        const OP: &str = "ibv_reg_dmabuf_mr";
        // The double moves bytes by address: `iova` is where the memory is mapped
        // in this process (true of the core's host stand-in for GPU memory, which
        // exports a placeholder descriptor; `BorrowedFd` proves it open).
        let _ = fd;
        with(|w| {
            if !w.dmabuf {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    OP,
                    "the device cannot register dma-bufs (EOPNOTSUPP)",
                ));
            }
            let mr = w.reg(OP, pd, iova as usize, len, access)?;
            w.dmabuf_mrs += 1;
            Ok(mr)
        })
    }

    unsafe fn dereg_mr(&self, mr: Handle) -> Result<()> {
        with(|w| {
            if !w.mrs.contains_key(&mr.0) {
                return Err(w.bad("ibv_dereg_mr", mr, MR));
            }
            w.drop_mr(mr.0);
            Ok(())
        })
    }

    fn create_channel(&self, ctx: Handle) -> Result<Channel> {
        const OP: &str = "ibv_create_comp_channel";
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad(OP, ctx, CTX));
            }
            // SAFETY: eventfd takes no pointers; its result is checked below.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(
                    Error::new(ErrorKind::Backend, OP, "eventfd for the channel failed")
                        .with_source(std::io::Error::last_os_error()),
                );
            }
            let id = w.make(Some(ctx.0));
            w.chans.insert(
                id,
                Chan {
                    ctx: ctx.0,
                    fd,
                    events: VecDeque::new(),
                },
            );
            Ok(Channel {
                handle: Handle(id),
                fd,
            })
        })
    }

    fn create_cq(&self, ctx: Handle, cqe: u32, channel: Handle) -> Result<Handle> {
        const OP: &str = "ibv_create_cq";
        with(|w| {
            let Some(c) = w.ctxs.get(&ctx.0) else {
                return Err(w.bad(OP, ctx, CTX));
            };
            let max = c.limits.device.max_cqe;
            let Some(ch) = w.chans.get(&channel.0) else {
                return Err(w.bad(OP, channel, CHAN));
            };
            if ch.ctx != ctx.0 {
                let msg = format!(
                    "channel {} belongs to ctx {}, not to ctx {}",
                    channel.0, ch.ctx, ctx.0
                );
                w.violation(Some(ctx.0), format!("{OP}: {msg}"));
                return Err(Error::new(ErrorKind::InvalidArgument, OP, msg));
            }
            if cqe == 0 || cqe > max {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{cqe} entries asked; the device allows 1..={max} (EINVAL)"),
                ));
            }
            let id = w.make(Some(ctx.0));
            w.cqs.insert(
                id,
                Cq {
                    ctx: ctx.0,
                    channel: channel.0,
                    cap: cqe as usize,
                    entries: VecDeque::new(),
                    armed: false,
                    taken: 0,
                    acked: 0,
                },
            );
            Ok(Handle(id))
        })
    }

    fn req_notify_cq(&self, cq: Handle) -> Result<()> {
        with(|w| match w.cqs.get_mut(&cq.0) {
            Some(c) => {
                c.armed = true;
                Ok(())
            }
            None => Err(w.bad("ibv_req_notify_cq", cq, CQ)),
        })
    }

    fn get_cq_event(&self, channel: Handle) -> Result<Option<Handle>> {
        with(|w| {
            let Some(ch) = w.chans.get_mut(&channel.0) else {
                return Err(w.bad("ibv_get_cq_event", channel, CHAN));
            };
            let ev = ch.events.pop_front();
            if ch.events.is_empty() {
                drain(ch.fd);
            }
            if let Some(c) = ev.and_then(|cq| w.cqs.get_mut(&cq)) {
                c.taken += 1;
            }
            Ok(ev.map(Handle))
        })
    }

    fn ack_cq_events(&self, cq: Handle, events: u32) {
        const OP: &str = "ibv_ack_cq_events";
        with(|w| {
            let Some(c) = w.cqs.get_mut(&cq.0) else {
                w.bad(OP, cq, CQ);
                return;
            };
            c.acked += u64::from(events);
            if c.acked > c.taken {
                let (ctx, taken, acked) = (c.ctx, c.taken, c.acked);
                c.acked = taken;
                w.violation(
                    Some(ctx),
                    format!(
                        "{OP}(cq {}): {acked} events acknowledged, only {taken} taken",
                        cq.0
                    ),
                );
            }
        });
    }

    fn poll_cq(&self, cq: Handle, out: &mut [Completion]) -> Result<usize> {
        with(|w| {
            let Some(c) = w.cqs.get_mut(&cq.0) else {
                return Err(w.bad("ibv_poll_cq", cq, CQ));
            };
            if w.fail_receive_poll
                && c.entries
                    .iter()
                    .any(|e| matches!(e.origin, Origin::Recv(_)))
            {
                w.fail_receive_poll = false;
                return Err(Error::new(
                    ErrorKind::Backend,
                    "ibv_poll_cq",
                    "device error (failed by the test)",
                ));
            }
            let n = out.len().min(c.entries.len());
            let taken: Vec<Cqe> = c.entries.drain(..n).collect();
            for (slot, e) in out.iter_mut().zip(&taken) {
                *slot = e.wc;
                if let Some(q) = w.qps.get_mut(&e.qp) {
                    match e.origin {
                        Origin::Send(s) => q.send_retired = q.send_retired.max(s + 1),
                        Origin::Recv(s) => q.recv_retired = q.recv_retired.max(s + 1),
                    }
                }
            }
            Ok(n)
        })
    }

    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> Result<Qp> {
        const OP: &str = "ibv_create_qp";
        with(|w| {
            let Some(p) = w.pds.get(&pd.0) else {
                return Err(w.bad(OP, pd, PD));
            };
            let ctx = p.ctx;
            let Some(c) = w.cqs.get(&cq.0) else {
                return Err(w.bad(OP, cq, CQ));
            };
            if c.ctx != ctx {
                let msg = format!(
                    "completion queue {} belongs to ctx {}, the PD to ctx {ctx}",
                    cq.0, c.ctx
                );
                w.violation(Some(ctx), format!("{OP}: {msg}"));
                return Err(Error::new(ErrorKind::InvalidArgument, OP, msg));
            }
            let lim = w.limits_of(ctx);
            let d = lim.device;
            if caps.max_send_wr > d.max_qp_wr
                || caps.max_recv_wr > d.max_qp_wr
                || caps.max_send_sge > d.max_sge
                || caps.max_recv_sge > d.max_sge
            {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!(
                        "{caps:?} asked; the device allows {} work requests and {} entries \
                         (EINVAL)",
                        d.max_qp_wr, d.max_sge
                    ),
                ));
            }
            let granted = QpCaps {
                max_inline_data: caps.max_inline_data.min(lim.max_inline_data),
                ..caps
            };
            let num = w.fresh_qp_num();
            let id = w.make(Some(ctx));
            w.qp_nums.insert(num, id);
            w.qps.insert(
                id,
                QpObj {
                    ctx,
                    pd: pd.0,
                    cq: cq.0,
                    num,
                    caps: granted,
                    state: QpState::Reset,
                    access: 0,
                    dest: None,
                    rnr_retry: 7,
                    sq: VecDeque::new(),
                    rq: VecDeque::new(),
                    send_posted: 0,
                    send_retired: 0,
                    recv_posted: 0,
                    recv_retired: 0,
                },
            );
            Ok(Qp {
                handle: Handle(id),
                qp_num: num,
                caps: granted,
            })
        })
    }

    fn modify_qp(&self, qp: Handle, to: &QpTransition) -> Result<()> {
        const OP: &str = "ibv_modify_qp";
        with(|w| {
            let Some(q) = w.qps.get(&qp.0) else {
                return Err(w.bad(OP, qp, QP));
            };
            let (state, num, ctx) = (q.state, q.num, q.ctx);
            let lim = w.limits_of(ctx).device;
            let einval = |msg: String| {
                Err(Error::new(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num}: {msg} (EINVAL)"),
                ))
            };
            match (state, *to) {
                (_, QpTransition::Error) => {
                    w.set_error(qp.0);
                    // The worker flushes what is outstanding.
                    w.kick()
                }
                (
                    QpState::Reset,
                    QpTransition::Init {
                        port,
                        pkey_index,
                        access,
                    },
                ) => {
                    if port != 1 {
                        return einval(format!("port {port}; the device has port 1"));
                    }
                    if pkey_index != 0 {
                        return einval(format!("pkey index {pkey_index}; the table has 1 entry"));
                    }
                    if let Some(q) = w.qps.get_mut(&qp.0) {
                        q.state = QpState::Init;
                        q.access = access;
                    }
                    Ok(())
                }
                (
                    QpState::Init,
                    QpTransition::Rtr {
                        path_mtu,
                        dest_qp_num,
                        max_dest_rd_atomic,
                        min_rnr_timer,
                        av,
                        ..
                    },
                ) => {
                    if path_mtu.0 == 0 || path_mtu > PORT_MTU {
                        return einval(format!(
                            "path MTU {path_mtu:?} outside 1..={} (the port's)",
                            PORT_MTU.0
                        ));
                    }
                    // A NIC does not check that the destination exists: a missing
                    // one shows as retries exhausted at the first request.
                    let _ = dest_qp_num;
                    if av.port != 1 {
                        return einval(format!("address vector port {}; expected 1", av.port));
                    }
                    let Some(grh) = av.grh else {
                        return einval(
                            "Ethernet link layer: the address vector needs a global route (grh)"
                                .into(),
                        );
                    };
                    if !GIDS.contains(&grh.dgid) {
                        return einval(format!(
                            "dgid {:02x?} is not a GID of {DEVICE_NAME}",
                            grh.dgid
                        ));
                    }
                    if usize::from(grh.sgid_index) >= GIDS.len() {
                        return einval(format!(
                            "sgid index {} beyond the GID table ({})",
                            grh.sgid_index,
                            GIDS.len()
                        ));
                    }
                    if u32::from(max_dest_rd_atomic) > lim.max_qp_rd_atom {
                        return einval(format!(
                            "max_dest_rd_atomic {max_dest_rd_atomic} over the device's {}",
                            lim.max_qp_rd_atom
                        ));
                    }
                    if min_rnr_timer > 31 {
                        return einval(format!("min_rnr_timer {min_rnr_timer} over 31"));
                    }
                    if let Some(q) = w.qps.get_mut(&qp.0) {
                        q.state = QpState::Rtr;
                        q.dest = Some(dest_qp_num);
                    }
                    Ok(())
                }
                (
                    QpState::Rtr,
                    QpTransition::Rts {
                        timeout,
                        retry_cnt,
                        rnr_retry,
                        max_rd_atomic,
                        ..
                    },
                ) => {
                    if retry_cnt > 7 || rnr_retry > 7 || timeout > 31 {
                        return einval(format!(
                            "retry_cnt {retry_cnt} / rnr_retry {rnr_retry} over 7 or timeout \
                             {timeout} over 31"
                        ));
                    }
                    if u32::from(max_rd_atomic) > lim.max_qp_init_rd_atom {
                        return einval(format!(
                            "max_rd_atomic {max_rd_atomic} over the device's {}",
                            lim.max_qp_init_rd_atom
                        ));
                    }
                    if let Some(q) = w.qps.get_mut(&qp.0) {
                        q.state = QpState::Rts;
                        q.rnr_retry = rnr_retry;
                    }
                    Ok(())
                }
                (s, t) => einval(format!(
                    "is in {}, cannot go to {} (order: RESET, INIT, RTR, RTS; ERROR from any)",
                    s.name(),
                    transition_name(&t)
                )),
            }
        })
    }

    unsafe fn post_send(
        &self,
        qp: Handle,
        wrs: &[SendWr],
        sges: &[Sge],
    ) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_send";
        with(|w| {
            let Some(q) = w.qps.get(&qp.0) else {
                return Err(PostError {
                    posted: 0,
                    error: w.bad(OP, qp, QP),
                });
            };
            let (state, caps, num, ctx) = (q.state, q.caps, q.num, q.ctx);
            if !matches!(state, QpState::Rts | QpState::Error) {
                return Err(post_err(
                    0,
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num} is in {}; sends need RTS", state.name()),
                ));
            }
            if wrs.is_empty() {
                return Ok(());
            }
            if w.refuse_sends > 0 {
                w.refuse_sends -= 1;
                return Err(post_err(
                    0,
                    ErrorKind::Backend,
                    OP,
                    format!("queue pair {num}: out of resources (ENOMEM, refused by the test)"),
                ));
            }
            if let Err(error) = w.kick() {
                return Err(PostError { posted: 0, error });
            }
            for (i, wr) in wrs.iter().enumerate() {
                let first = wr.first_sge as usize;
                let list = first
                    .checked_add(wr.num_sge as usize)
                    .and_then(|end| sges.get(first..end));
                let Some(list) = list else {
                    let msg = format!(
                        "work request {i} (wr_id {}) names entries {first}..+{} of a list of {}",
                        wr.wr_id,
                        wr.num_sge,
                        sges.len()
                    );
                    w.violation(Some(ctx), format!("{OP}: {msg}"));
                    return Err(post_err(i, ErrorKind::InvalidArgument, OP, msg));
                };
                if wr.num_sge > caps.max_send_sge {
                    return Err(post_err(
                        i,
                        ErrorKind::InvalidArgument,
                        OP,
                        format!(
                            "wr_id {}: {} entries; qp {num} takes {} (EINVAL)",
                            wr.wr_id, wr.num_sge, caps.max_send_sge
                        ),
                    ));
                }
                let max_sge_rd = w.limits_of(ctx).device.max_sge_rd;
                if matches!(wr.op, SendOp::Read { .. }) && wr.num_sge > max_sge_rd {
                    return Err(post_err(
                        i,
                        ErrorKind::InvalidArgument,
                        OP,
                        format!(
                            "wr_id {}: an RDMA READ of {} entries; the device takes {max_sge_rd} (EINVAL)",
                            wr.wr_id, wr.num_sge
                        ),
                    ));
                }
                let inline = if wr.inline {
                    if matches!(wr.op, SendOp::Read { .. }) {
                        return Err(post_err(
                            i,
                            ErrorKind::InvalidArgument,
                            OP,
                            format!("wr_id {}: an RDMA READ cannot be inline (EINVAL)", wr.wr_id),
                        ));
                    }
                    let total: u64 = list.iter().map(|s| u64::from(s.len)).sum();
                    if total > u64::from(caps.max_inline_data) {
                        return Err(post_err(
                            i,
                            ErrorKind::InvalidArgument,
                            OP,
                            format!(
                                "wr_id {}: {total} inline bytes; qp {num} was granted {} (EINVAL)",
                                wr.wr_id, caps.max_inline_data
                            ),
                        ));
                    }
                    let mut data = Vec::with_capacity(total as usize);
                    for s in list.iter().filter(|s| s.len > 0) {
                        // SAFETY: post_send's contract: an inline entry's memory is
                        // readable now; it is copied before this call returns.
                        let bytes = unsafe {
                            std::slice::from_raw_parts(s.addr as usize as *const u8, s.len as usize)
                        };
                        data.extend_from_slice(bytes);
                    }
                    Some(data)
                } else {
                    None
                };
                let Some(q) = w.qps.get_mut(&qp.0) else {
                    return Err(post_err(
                        i,
                        ErrorKind::Backend,
                        OP,
                        "queue pair vanished".into(),
                    ));
                };
                if q.send_posted - q.send_retired >= u64::from(q.caps.max_send_wr) {
                    return Err(post_err(
                        i,
                        ErrorKind::Backend,
                        OP,
                        format!(
                            "send queue of qp {num} full: {} work requests outstanding (ENOMEM); \
                             poll completions to retire them",
                            q.caps.max_send_wr
                        ),
                    ));
                }
                let seq = q.send_posted;
                q.send_posted += 1;
                q.sq.push_back(SendJob {
                    seq,
                    wr: *wr,
                    sges: list.to_vec(),
                    inline,
                    rnr_since: None,
                });
            }
            Ok(())
        })
    }

    unsafe fn post_recv(&self, qp: Handle, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_recv";
        with(|w| {
            let Some(q) = w.qps.get(&qp.0) else {
                return Err(PostError {
                    posted: 0,
                    error: w.bad(OP, qp, QP),
                });
            };
            let (state, num, max_sge) = (q.state, q.num, q.caps.max_recv_sge);
            if state == QpState::Reset {
                return Err(post_err(
                    0,
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num} is in RESET; receives need INIT or later"),
                ));
            }
            if max_sge == 0 && !wrs.is_empty() {
                return Err(post_err(
                    0,
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("queue pair {num} was created with max_recv_sge 0 (EINVAL)"),
                ));
            }
            if !wrs.is_empty() {
                if let Err(error) = w.kick() {
                    return Err(PostError { posted: 0, error });
                }
            }
            let Some(q) = w.qps.get_mut(&qp.0) else {
                return Err(post_err(
                    0,
                    ErrorKind::Backend,
                    OP,
                    "queue pair vanished".into(),
                ));
            };
            for (i, wr) in wrs.iter().enumerate() {
                if q.recv_posted - q.recv_retired >= u64::from(q.caps.max_recv_wr) {
                    return Err(post_err(
                        i,
                        ErrorKind::Backend,
                        OP,
                        format!(
                            "receive queue of qp {num} full: {} receives outstanding (ENOMEM)",
                            q.caps.max_recv_wr
                        ),
                    ));
                }
                let seq = q.recv_posted;
                q.recv_posted += 1;
                q.rq.push_back(RecvJob { seq, wr: *wr });
            }
            Ok(())
        })
    }

    unsafe fn destroy_qp(&self, qp: Handle) -> Result<()> {
        let last = with(|w| {
            if !w.qps.contains_key(&qp.0) {
                return Err(w.bad("ibv_destroy_qp", qp, QP));
            }
            w.drop_qp(qp.0);
            // Peers waiting on it look again.
            WORK.notify_all();
            Ok(if w.qps.is_empty() {
                w.worker.take()
            } else {
                None
            })
        })?;
        // The last queue pair is gone: the worker ends now; wait for it, so that a
        // process whose agents shut down has no thread of the double left.
        if let Some(h) = last {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        Ok(())
    }

    unsafe fn destroy_cq(&self, cq: Handle) -> Result<()> {
        const OP: &str = "ibv_destroy_cq";
        with(|w| {
            let Some(c) = w.cqs.get(&cq.0) else {
                return Err(w.bad(OP, cq, CQ));
            };
            let (ctx, unacked) = (c.ctx, c.taken.saturating_sub(c.acked));
            let users = w.qps.values().filter(|q| q.cq == cq.0).count();
            if users > 0 {
                let msg = format!(
                    "{OP}(cq {}): {users} queue pair(s) still use it (EBUSY; destroy them first)",
                    cq.0
                );
                w.violation(Some(ctx), msg.clone());
                return Err(Error::new(ErrorKind::NotAllowed, OP, msg));
            }
            if unacked > 0 {
                w.violation(
                    Some(ctx),
                    format!(
                        "{OP}(cq {}): {unacked} event(s) taken by get_cq_event and not \
                         acknowledged: the real call would wait for them forever",
                        cq.0
                    ),
                );
            }
            w.drop_cq(cq.0);
            Ok(())
        })
    }

    unsafe fn destroy_channel(&self, channel: Handle) -> Result<()> {
        const OP: &str = "ibv_destroy_comp_channel";
        with(|w| {
            let Some(ch) = w.chans.get(&channel.0) else {
                return Err(w.bad(OP, channel, CHAN));
            };
            let ctx = ch.ctx;
            let users = w.cqs.values().filter(|c| c.channel == channel.0).count();
            if users > 0 {
                let msg = format!(
                    "{OP}(channel {}): {users} completion queue(s) still report to it (EBUSY)",
                    channel.0
                );
                w.violation(Some(ctx), msg.clone());
                return Err(Error::new(ErrorKind::NotAllowed, OP, msg));
            }
            w.drop_chan(channel.0);
            Ok(())
        })
    }

    unsafe fn dealloc_pd(&self, pd: Handle) -> Result<()> {
        const OP: &str = "ibv_dealloc_pd";
        with(|w| {
            let Some(p) = w.pds.get(&pd.0) else {
                return Err(w.bad(OP, pd, PD));
            };
            let ctx = p.ctx;
            let mrs = w.mrs.values().filter(|m| m.pd == pd.0).count();
            let qps = w.qps.values().filter(|q| q.pd == pd.0).count();
            if mrs + qps > 0 {
                let msg = format!(
                    "{OP}(pd {}): {mrs} region(s) and {qps} queue pair(s) still in it (EBUSY)",
                    pd.0
                );
                w.violation(Some(ctx), msg.clone());
                return Err(Error::new(ErrorKind::NotAllowed, OP, msg));
            }
            w.pds.remove(&pd.0);
            Ok(())
        })
    }

    unsafe fn close(&self, ctx: Handle) -> Result<()> {
        const OP: &str = "ibv_close_device";
        with(|w| {
            if !w.ctxs.contains_key(&ctx.0) {
                return Err(w.bad(OP, ctx, CTX));
            }
            let children = w.children(ctx.0);
            if children > 0 {
                w.violation(
                    Some(ctx.0),
                    format!(
                        "{OP}(ctx {}): {children} object(s) made from it still live; \
                         destroyed as the kernel would",
                        ctx.0
                    ),
                );
                let mine = |w: &World, id: &usize| w.owner.get(id) == Some(&ctx.0);
                let qps: Vec<usize> = w.qps.keys().filter(|id| mine(w, id)).copied().collect();
                qps.into_iter().for_each(|id| w.drop_qp(id));
                let mrs: Vec<usize> = w.mrs.keys().filter(|id| mine(w, id)).copied().collect();
                mrs.into_iter().for_each(|id| w.drop_mr(id));
                let cqs: Vec<usize> = w.cqs.keys().filter(|id| mine(w, id)).copied().collect();
                cqs.into_iter().for_each(|id| w.drop_cq(id));
                let chans: Vec<usize> = w.chans.keys().filter(|id| mine(w, id)).copied().collect();
                chans.into_iter().for_each(|id| w.drop_chan(id));
                w.pds.retain(|_, p| p.ctx != ctx.0);
                WORK.notify_all();
            }
            w.ctxs.remove(&ctx.0);
            Ok(())
        })
    }

    fn status_str(&self, status: WcStatus) -> String {
        const NAMES: [&str; 24] = [
            "success",
            "local length error",
            "local QP operation error",
            "local EE context operation error",
            "local protection error",
            "Work Request Flushed Error",
            "memory management operation error",
            "bad response error",
            "local access error",
            "remote invalid request error",
            "remote access error",
            "remote operation error",
            "transport retry counter exceeded",
            "RNR retry counter exceeded",
            "local RDD violation error",
            "remote invalid RD request",
            "aborted error",
            "invalid EE context number",
            "invalid EE context state",
            "fatal error",
            "response timeout error",
            "general error",
            "TM error",
            "TM rendezvous pending",
        ];
        NAMES
            .get(status.0 as usize)
            .map_or_else(|| format!("unknown ({})", status.0), |s| (*s).to_string())
    }
}
