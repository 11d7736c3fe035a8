//! The double's process-wide world: its objects, and the worker thread that executes
//! posted work on them.

use super::*;

impl World {
    pub(super) fn new() -> Self {
        use std::hash::BuildHasher;
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64) | 1;
        Self {
            next: 1,
            owner: HashMap::new(),
            ctxs: BTreeMap::new(),
            pds: BTreeMap::new(),
            mrs: BTreeMap::new(),
            chans: BTreeMap::new(),
            cqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            keys: HashMap::new(),
            qp_nums: HashMap::new(),
            next_qp_num: 0x1a0,
            rng: seed,
            limits: Limits::DEFAULT,
            dmabuf: true,
            dmabuf_mrs: 0,
            refuse_sends: 0,
            fail_receive_poll: false,
            violations: Vec::new(),
            worker: None,
        }
    }

    /// A fresh handle of device context `ctx` (`None`: the handle is a context).
    pub(super) fn make(&mut self, ctx: Option<usize>) -> usize {
        let id = self.next;
        self.next += 1;
        self.owner.insert(id, ctx.unwrap_or(id));
        id
    }

    pub(super) fn rand_u32(&mut self) -> u32 {
        // xorshift64*
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32
    }

    pub(super) fn fresh_key(&mut self) -> u32 {
        loop {
            let k = self.rand_u32();
            if k != 0 && !self.keys.contains_key(&k) {
                return k;
            }
        }
    }

    pub(super) fn fresh_qp_num(&mut self) -> u32 {
        loop {
            let n = self.next_qp_num;
            self.next_qp_num = (n + 1) & 0x00ff_ffff;
            if n > 1 && !self.qp_nums.contains_key(&n) {
                return n;
            }
        }
    }

    /// Register `addr..addr + len` (as `reg_mr` does), for `op`.
    pub(super) fn reg(
        &mut self,
        op: &'static str,
        pd: Handle,
        addr: usize,
        len: usize,
        access: u32,
    ) -> Result<Mr> {
        let w = self;
        let Some(p) = w.pds.get(&pd.0) else {
            return Err(w.bad(op, pd, PD));
        };
        let ctx = p.ctx;
        let max = w.limits_of(ctx).device.max_mr_size;
        if len == 0 || addr == 0 || len as u64 > max || addr.checked_add(len).is_none() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                op,
                format!("cannot register {addr:#x}+{len} (empty, null, or over max_mr_size {max})"),
            ));
        }
        // libibverbs: remote write (or atomic) access needs local write.
        if access & (access::REMOTE_WRITE | 8) != 0 && access & access::LOCAL_WRITE == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                op,
                format!("access {access:#x}: REMOTE_WRITE needs LOCAL_WRITE (EINVAL)"),
            ));
        }
        let id = w.make(Some(ctx));
        let lkey = w.fresh_key();
        w.keys.insert(lkey, (id, false));
        let rkey = w.fresh_key();
        w.keys.insert(rkey, (id, true));
        w.mrs.insert(
            id,
            MrObj {
                pd: pd.0,
                addr: addr as u64,
                len: len as u64,
                access,
                lkey,
                rkey,
            },
        );
        Ok(Mr {
            handle: Handle(id),
            lkey,
            rkey,
        })
    }

    pub(super) fn limits_of(&self, ctx: usize) -> Limits {
        self.ctxs.get(&ctx).map_or(self.limits, |c| c.limits)
    }

    pub(super) fn violation(&mut self, ctx: Option<usize>, msg: String) {
        tracing::error!(violation = %msg, "verbs test double: misuse");
        self.violations.push((ctx, msg));
    }

    pub(super) fn kind_of(&self, id: usize) -> Option<&'static str> {
        if self.ctxs.contains_key(&id) {
            Some(CTX)
        } else if self.pds.contains_key(&id) {
            Some(PD)
        } else if self.mrs.contains_key(&id) {
            Some(MR)
        } else if self.chans.contains_key(&id) {
            Some(CHAN)
        } else if self.cqs.contains_key(&id) {
            Some(CQ)
        } else if self.qps.contains_key(&id) {
            Some(QP)
        } else {
            None
        }
    }

    /// Record a bad handle passed where a `want` was expected; the error to return.
    pub(super) fn bad(&mut self, op: &'static str, h: Handle, want: &str) -> Error {
        let why = match self.kind_of(h.0) {
            Some(k) => format!("is a {k}, not a {want}"),
            None if self.owner.contains_key(&h.0) => {
                format!("was destroyed (use of a destroyed {want})")
            }
            None => format!("was never made by the test double (expected a {want})"),
        };
        let msg = format!("{op}: handle {} {why}", h.0);
        let ctx = self.owner.get(&h.0).copied();
        self.violation(ctx, msg.clone());
        Error::new(ErrorKind::InvalidArgument, op, msg)
    }

    /// Start the worker if it is not running, and wake it.
    pub(super) fn kick(&mut self) -> Result<()> {
        if self.worker.as_ref().is_none_or(|h| h.is_finished()) {
            let h = std::thread::Builder::new()
                .name("nixl-verbs-double".into())
                .spawn(worker)
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Backend,
                        "verbs test double",
                        "could not start the double's worker thread",
                    )
                    .with_source(e)
                })?;
            self.worker = Some(h);
        }
        WORK.notify_all();
        Ok(())
    }

    pub(super) fn covers(
        &self,
        key: u32,
        remote: bool,
        pd: usize,
        addr: u64,
        len: u64,
        need: u32,
    ) -> bool {
        let Some(&(mr, is_rkey)) = self.keys.get(&key) else {
            return false;
        };
        let Some(m) = self.mrs.get(&mr) else {
            return false;
        };
        is_rkey == remote
            && m.pd == pd
            && m.access & need == need
            && addr >= m.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= m.addr + m.len)
    }

    pub(super) fn dead(&self, ctx: usize) -> bool {
        self.ctxs.get(&ctx).is_none_or(|c| c.dead)
    }

    /// Add a completion to a queue; fire its channel if armed.
    pub(super) fn complete(&mut self, cq: usize, e: Cqe) {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        if c.entries.len() >= c.cap {
            let (ctx, cap) = (c.ctx, c.cap);
            self.violation(
                Some(ctx),
                format!(
                    "completion queue {cq} overflowed ({cap} entries): completion of wr_id {} \
                     on qp {} lost; poll faster or size the queue for every outstanding request",
                    e.wc.wr_id, e.wc.qp_num
                ),
            );
            return;
        }
        c.entries.push_back(e);
        if c.armed {
            c.armed = false;
            let ch = c.channel;
            if let Some(chan) = self.chans.get_mut(&ch) {
                chan.events.push_back(cq);
                signal(chan.fd);
            }
        }
    }

    pub(super) fn complete_send(
        &mut self,
        qp: usize,
        job: &SendJob,
        status: WcStatus,
        byte_len: u32,
    ) {
        let Some(q) = self.qps.get(&qp) else {
            return;
        };
        let (cq, num) = (q.cq, q.num);
        let wc = Completion {
            wr_id: job.wr.wr_id,
            status,
            opcode: opcode(job.wr.op),
            byte_len,
            qp_num: num,
            vendor_err: 0,
        };
        self.complete(
            cq,
            Cqe {
                wc,
                qp,
                origin: Origin::Send(job.seq),
            },
        );
    }

    pub(super) fn complete_recv(
        &mut self,
        qp: usize,
        r: &RecvJob,
        status: WcStatus,
        byte_len: u32,
    ) {
        let Some(q) = self.qps.get(&qp) else {
            return;
        };
        let (cq, num) = (q.cq, q.num);
        let wc = Completion {
            wr_id: r.wr.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len,
            qp_num: num,
            vendor_err: 0,
        };
        self.complete(
            cq,
            Cqe {
                wc,
                qp,
                origin: Origin::Recv(r.seq),
            },
        );
    }

    pub(super) fn set_error(&mut self, qp: usize) {
        if let Some(q) = self.qps.get_mut(&qp) {
            q.state = QpState::Error;
        }
    }

    pub(super) fn needs_work(&self, q: &QpObj) -> bool {
        !q.sq.is_empty() || (!q.rq.is_empty() && (q.state == QpState::Error || self.dead(q.ctx)))
    }

    pub(super) fn has_pending(&self) -> bool {
        self.qps.values().any(|q| self.needs_work(q))
    }

    /// Run what can run; whether anything happened.
    pub(super) fn run_ready(&mut self) -> bool {
        let ids: Vec<usize> = self
            .qps
            .iter()
            .filter(|(_, q)| self.needs_work(q))
            .map(|(&id, _)| id)
            .collect();
        let mut progressed = false;
        for id in ids {
            progressed |= self.run_qp(id);
        }
        progressed
    }

    /// Flush a queue pair in ERROR: signaled sends and all receives complete with
    /// `WR_FLUSH_ERR`.
    pub(super) fn flush(&mut self, id: usize) -> bool {
        let Some(q) = self.qps.get_mut(&id) else {
            return false;
        };
        let sq = std::mem::take(&mut q.sq);
        let rq = std::mem::take(&mut q.rq);
        let any = !sq.is_empty() || !rq.is_empty();
        for job in sq.iter().filter(|j| j.wr.signaled) {
            self.complete_send(id, job, WcStatus::WR_FLUSH_ERR, 0);
        }
        for r in &rq {
            self.complete_recv(id, r, WcStatus::WR_FLUSH_ERR, 0);
        }
        any
    }

    pub(super) fn run_qp(&mut self, id: usize) -> bool {
        let mut progressed = false;
        loop {
            let Some(q) = self.qps.get(&id) else {
                return progressed;
            };
            if self.dead(q.ctx) {
                // A dead device: its own work vanishes without completions.
                let Some(q) = self.qps.get_mut(&id) else {
                    return progressed;
                };
                let any = !q.sq.is_empty() || !q.rq.is_empty();
                q.sq.clear();
                q.rq.clear();
                return progressed || any;
            }
            if q.state == QpState::Error {
                return self.flush(id) || progressed;
            }
            let Some(q) = self.qps.get_mut(&id) else {
                return progressed;
            };
            let Some(mut job) = q.sq.pop_front() else {
                return progressed;
            };
            match self.execute(id, &mut job) {
                Exec::Blocked => {
                    if let Some(q) = self.qps.get_mut(&id) {
                        q.sq.push_front(job);
                    }
                    return progressed;
                }
                Exec::Done { status, byte_len } => {
                    progressed = true;
                    if job.wr.signaled || !status.is_ok() {
                        self.complete_send(id, &job, status, byte_len);
                    }
                    if !status.is_ok() {
                        self.set_error(id);
                    }
                }
            }
        }
    }

    /// The queue pair that `num` (connected to `dest`) reaches, if it answers.
    pub(super) fn live_peer(&self, num: u32, dest: Option<u32>) -> Option<usize> {
        let peer = *self.qp_nums.get(&dest?)?;
        let p = self.qps.get(&peer)?;
        let ready = matches!(p.state, QpState::Rtr | QpState::Rts);
        (ready && !self.dead(p.ctx) && p.dest == Some(num)).then_some(peer)
    }

    /// Execute one send work request of queue pair `id` (in RTS).
    pub(super) fn execute(&mut self, id: usize, job: &mut SendJob) -> Exec {
        let Some(q) = self.qps.get(&id) else {
            return done(WcStatus::RETRY_EXC_ERR);
        };
        let (pd, ctx, num, dest, rnr_retry) = (q.pd, q.ctx, q.num, q.dest, q.rnr_retry);
        let total: u64 = match &job.inline {
            Some(d) => d.len() as u64,
            None => job.sges.iter().map(|s| u64::from(s.len)).sum(),
        };
        if total > u64::from(self.limits_of(ctx).max_msg_sz) {
            return done(LOC_LEN_ERR);
        }
        if job.inline.is_none() {
            let need = match job.wr.op {
                SendOp::Read { .. } => access::LOCAL_WRITE,
                _ => 0,
            };
            let ok = job.sges.iter().all(|s| {
                s.len == 0 || self.covers(s.lkey, false, pd, s.addr, u64::from(s.len), need)
            });
            if !ok {
                return done(WcStatus::LOC_PROT_ERR);
            }
        }
        let Some(peer) = self.live_peer(num, dest) else {
            return done(WcStatus::RETRY_EXC_ERR);
        };
        let Some(p) = self.qps.get(&peer) else {
            return done(WcStatus::RETRY_EXC_ERR);
        };
        let (peer_pd, peer_access) = (p.pd, p.access);
        match job.wr.op {
            SendOp::Write { remote_addr, rkey } => {
                let need = access::REMOTE_WRITE;
                if total > 0
                    && (peer_access & need == 0
                        || !self.covers(rkey, true, peer_pd, remote_addr, total, need))
                {
                    return done(WcStatus::REM_ACCESS_ERR);
                }
                if total > 0 {
                    // SAFETY: the local entries lie in regions of this queue pair's PD
                    // and the target range in a region of the peer's PD, all live and
                    // checked just above under the world lock.
                    unsafe { gather(job, remote_addr) };
                }
                done(WcStatus::SUCCESS)
            }
            SendOp::Read { remote_addr, rkey } => {
                let need = access::REMOTE_READ;
                if total > 0
                    && (peer_access & need == 0
                        || !self.covers(rkey, true, peer_pd, remote_addr, total, need))
                {
                    return done(WcStatus::REM_ACCESS_ERR);
                }
                if total > 0 {
                    // SAFETY: as for WRITE: all ranges checked above against live
                    // registrations.
                    unsafe { scatter(&job.sges, remote_addr) };
                }
                Exec::Done {
                    status: WcStatus::SUCCESS,
                    byte_len: total as u32,
                }
            }
            SendOp::Send => {
                let Some(p) = self.qps.get_mut(&peer) else {
                    return done(WcStatus::RETRY_EXC_ERR);
                };
                let Some(recv) = p.rq.pop_front() else {
                    if rnr_retry >= 7 {
                        return Exec::Blocked;
                    }
                    let since = *job.rnr_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= RNR_STEP * (u32::from(rnr_retry) + 1) {
                        return done(WcStatus::RNR_RETRY_EXC_ERR);
                    }
                    return Exec::Blocked;
                };
                let s = recv.wr.sge;
                if total > u64::from(s.len) {
                    self.complete_recv(peer, &recv, LOC_LEN_ERR, 0);
                    self.set_error(peer);
                    return done(REM_INV_REQ_ERR);
                }
                if s.len > 0
                    && !self.covers(
                        s.lkey,
                        false,
                        peer_pd,
                        s.addr,
                        u64::from(s.len),
                        access::LOCAL_WRITE,
                    )
                {
                    self.complete_recv(peer, &recv, WcStatus::LOC_PROT_ERR, 0);
                    self.set_error(peer);
                    return done(REM_OP_ERR);
                }
                if total > 0 {
                    // SAFETY: the local entries (or the inline copy) and the receive
                    // buffer, which holds `total` bytes, lie in live registrations
                    // checked above.
                    unsafe { gather(job, s.addr) };
                }
                self.complete_recv(peer, &recv, WcStatus::SUCCESS, total as u32);
                done(WcStatus::SUCCESS)
            }
        }
    }

    /// Remove a queue pair: its work goes without completions, its completions leave
    /// its queue.
    pub(super) fn drop_qp(&mut self, id: usize) {
        let Some(q) = self.qps.remove(&id) else {
            return;
        };
        if self.qp_nums.get(&q.num) == Some(&id) {
            self.qp_nums.remove(&q.num);
        }
        if let Some(c) = self.cqs.get_mut(&q.cq) {
            c.entries.retain(|e| e.qp != id);
        }
    }

    pub(super) fn drop_mr(&mut self, id: usize) {
        if let Some(m) = self.mrs.remove(&id) {
            self.keys.remove(&m.lkey);
            self.keys.remove(&m.rkey);
        }
    }

    pub(super) fn drop_cq(&mut self, id: usize) {
        let Some(c) = self.cqs.remove(&id) else {
            return;
        };
        if let Some(ch) = self.chans.get_mut(&c.channel) {
            ch.events.retain(|&e| e != id);
            if ch.events.is_empty() {
                drain(ch.fd);
            }
        }
    }

    pub(super) fn drop_chan(&mut self, id: usize) {
        if let Some(ch) = self.chans.remove(&id) {
            // SAFETY: the channel owned this descriptor and nothing else closes it;
            // it is removed from the world first, so it is never used again.
            unsafe { libc::close(ch.fd) };
        }
    }

    pub(super) fn children(&self, ctx: usize) -> usize {
        self.owner_count(ctx).saturating_sub(1)
    }

    pub(super) fn owner_count(&self, ctx: usize) -> usize {
        let of = |id: &usize| self.owner.get(id) == Some(&ctx);
        self.ctxs.keys().filter(|id| of(id)).count()
            + self.pds.keys().filter(|id| of(id)).count()
            + self.mrs.keys().filter(|id| of(id)).count()
            + self.chans.keys().filter(|id| of(id)).count()
            + self.cqs.keys().filter(|id| of(id)).count()
            + self.qps.keys().filter(|id| of(id)).count()
    }
}

/// The worker: runs all posted work, parks when there is none, ends after
/// [`IDLE_EXIT`] of idleness.
pub(super) fn worker() {
    let mut g = lock();
    let mut idle_since = Instant::now();
    loop {
        let w = g.get_or_insert_with(World::new);
        let mut progressed = false;
        while w.run_ready() {
            progressed = true;
        }
        if progressed {
            idle_since = Instant::now();
        }
        let pending = w.has_pending();
        // No queue pair left (a NIC with nothing to serve), or idle for a while.
        if !pending && (w.qps.is_empty() || idle_since.elapsed() >= IDLE_EXIT) {
            // Forget our own handle under the lock, so that work posted from now on
            // starts a new worker (unless destroying the last queue pair took the
            // handle to wait for this thread).
            let me = std::thread::current().id();
            if w.worker.as_ref().is_some_and(|h| h.thread().id() == me) {
                w.worker = None;
            }
            return;
        }
        let wait = if pending { RNR_POLL } else { IDLE_EXIT };
        g = match WORK.wait_timeout(g, wait) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        };
    }
}
