//! The same-host data path: the target's grants and the initiator's direct copies
//! (the crate docs describe the design; the primitives are in `shm`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl::{Error, ErrorKind, Op, RegionRef, RegionSlice, Result, Segments};

use crate::cma::{CallLimits, Copies, Piece, Split};
use crate::direct::{not_granted, Direct, Unsuitable};
use crate::gpu_direct::GpuPeer;
use crate::shm::{self, Access, GpuGrant, Grant, Mapping, Table};
use crate::sock_diag::{self, SocketFacts};
use crate::wire::Offer;

/// Whether nixl-tcp moves data between agents on one host without the socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SameHost {
    /// Use the same-host path where it is proven to work, else TCP (one logged reason).
    #[default]
    Auto,
    /// Always TCP.
    Off,
    /// Same-host or nothing: connecting fails (with the reason) where the path cannot
    /// be set up, and a transfer that cannot go direct fails instead of using TCP.
    /// For tests and benchmarks that must measure the direct path.
    Require,
}

impl std::str::FromStr for SameHost {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            "require" | "on" => Ok(Self::Require),
            _ => Err(format!("{s:?}: expected auto, off or require")),
        }
    }
}

/// Longest wait for a live initiator to leave a revoked grant. A host-memory access
/// is one copy or one system call; a GPU one is a batch queued on the initiator's
/// device plus the mapping it keeps open, closed by its watcher once the grant is
/// withdrawn, so this is reached only by a peer stopped mid-copy (a debugger), or
/// whose device queue is held up for that long by its own work. Past it the
/// registration is kept alive (never freed under a copy), and the deregistration
/// says so. An initiator that died inside a copy is not waited for at all: its
/// table's lock ([`Table::peer_holds`]) tells.
pub(crate) const REVOKE_BOUND: Duration = Duration::from_secs(10);

/// Target side: what this agent grants, and the tables of its same-host connections.
#[derive(Debug, Default)]
pub(crate) struct Grants {
    state: Mutex<GrantState>,
    /// Memfd allocations by address: (descriptor, length).
    allocs: Arc<Mutex<HashMap<u64, (i32, usize)>>>,
}

#[derive(Debug, Default)]
struct GrantState {
    /// Slot -> grant, for every registration granted.
    granted: HashMap<u32, Grant>,
    free: Vec<u32>,
    next: u32,
    /// Tables of live connections, and of ended ones whose initiator may still be
    /// inside a grant (closed; dropped once [`ConnTable::settled`]).
    tables: Vec<Arc<ConnTable>>,
}

/// One incoming same-host connection's table.
#[derive(Debug)]
pub(crate) struct ConnTable {
    pub(crate) table: Table,
    /// Registrations a peer did not leave in time: kept alive until the table goes.
    held: Mutex<Vec<RegionRef>>,
    /// Its initiator is gone: no count up in the table will come down, and none
    /// needs to (nothing touches the memory any more).
    gone: AtomicBool,
    /// Held while a grant is published and while the table is closed, so that no
    /// grant is published in a table closed meanwhile (grants are published
    /// outside the agent's grant lock). Never held across a wait.
    publish: Mutex<()>,
}

impl ConnTable {
    /// Whether the initiator is gone (probed only while a count is up, so that an
    /// initiator still setting up, with no access yet, is never taken for gone).
    fn gone(&self) -> bool {
        if self.gone.load(Ordering::Acquire) {
            return true;
        }
        let gone = !self.table.peer_holds();
        if gone {
            self.gone.store(true, Ordering::Release);
        }
        gone
    }

    /// No access to `slot` is in progress, or none can be: the initiator is gone.
    fn quiet(&self, slot: u32) -> bool {
        self.table.idle(slot) || self.gone()
    }

    /// Closed and nothing in it in progress (or its initiator gone): it can go.
    fn settled(&self) -> bool {
        self.table.is_closed() && (self.table.all_idle() || self.gone())
    }

    /// Grant `g` in `slot` unless the table is closed or its initiator gone; waits
    /// until `deadline` at most (briefly, but for a stopped or hostile initiator: a
    /// live one that looked at the free slot leaves at once) for the slot to be
    /// idle. Called with no lock held: a slow table holds up nothing but this grant.
    fn grant(&self, slot: u32, g: Grant, deadline: Instant) {
        if self.table.is_closed() || self.gone.load(Ordering::Acquire) {
            return;
        }
        let idle = wait_until(deadline, || self.quiet(slot));
        let _publishing = self.publish.lock().unwrap();
        if self.table.is_closed() || self.gone.load(Ordering::Acquire) {
            return;
        }
        if !idle || !self.table.grant(slot, g) {
            tracing::warn!(slot, "tcp: a same-host peer kept a grant slot busy; it cannot reach this registration directly");
        }
    }

    /// Close the table and withdraw every grant in it, without waiting.
    fn withdraw_all(&self) {
        let _publishing = self.publish.lock().unwrap();
        self.table.withdraw_all();
    }
}

/// Wait on this thread until `done`, or `deadline`; whether `done` became true.
/// Spins, then yields, then sleeps 50 µs at a time: the waits it serves end within a
/// copy's time, or at once when the peer is found gone.
fn wait_until(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    let mut spins = 0u32;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else if spins < 1024 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Grants {
    /// Allocate shared memory for [`Agent::alloc`](nixl::Agent::alloc).
    pub(crate) fn alloc(&self, len: usize) -> Result<nixl::Memory> {
        const OP: &str = "tcp alloc";
        let m = shm::Memfd::new(c"nixl-tcp", len).map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                OP,
                format!("cannot create {len} bytes of shared memory"),
            )
            .with_source(e)
        })?;
        let (addr, fd) = (m.mapping().addr(), m.raw_fd());
        let allocs = self.allocs.clone();
        allocs.lock().unwrap().insert(addr, (fd, m.mapping().len()));
        m.into_memory(len, move || {
            allocs.lock().unwrap().remove(&addr);
        })
    }

    /// Grant a new registration to every same-host connection; returns its slot, or
    /// `None` when the table is full (the registration is reached over TCP only).
    pub(crate) fn grant(&self, key: u64, region: &RegionRef) -> Option<u32> {
        let seg = region.segment();
        let (addr, len) = (seg.addr(), seg.len());
        let memfd = self
            .allocs
            .lock()
            .unwrap()
            .get(&addr)
            .filter(|(_, l)| *l >= len)
            .map(|(fd, _)| *fd);
        let gpu = match region.kind() {
            // Files are never registered with this backend (it does not declare
            // them), so never granted.
            nixl::MemKind::Dram | nixl::MemKind::File { .. } => None,
            nixl::MemKind::Vram { device } => Some(GpuGrant {
                device,
                export: match nixl::gpu::ipc_export(device, addr) {
                    // The handle maps one allocation: a registration running past it
                    // (raw memory over several allocations) cannot go through it.
                    Ok(x)
                        if addr >= x.base
                            && matches!(
                                (addr.checked_add(len as u64), x.base.checked_add(x.len)),
                                (Some(end), Some(limit)) if end <= limit
                            ) =>
                    {
                        Some((x.handle, x.base))
                    }
                    Ok(x) => {
                        tracing::info!(addr, len, alloc = x.base, alloc_len = x.len, "tcp: GPU registration spans more than one allocation; peers in other processes stage it over TCP");
                        None
                    }
                    Err(e) => {
                        // Reachable directly from this process only; other processes
                        // stage it over TCP.
                        tracing::info!(error = %e, "tcp: GPU memory without an inter-process handle; peers in other processes stage it over TCP");
                        None
                    }
                },
            }),
        };
        self.publish(Grant {
            key,
            addr,
            len: len as u64,
            memfd,
            gpu,
        })
    }

    /// Give `g` a slot and publish it in every same-host connection's table.
    ///
    /// The lock is held only to take the slot and record the grant (a connection
    /// attached from then on gets it with the others); the tables of connections
    /// already there are written after letting go of it, since one may have to wait
    /// for its initiator to leave the slot. So a slow or hostile same-host peer
    /// holds up this registration, for [`REVOKE_BOUND`] at most in all, and never
    /// another registration, deregistration or connection.
    fn publish(&self, g: Grant) -> Option<u32> {
        let (slot, tables) = {
            let mut st = self.state.lock().unwrap();
            let slot = match st.free.pop() {
                Some(s) => s,
                None if st.next < shm::SLOTS => {
                    st.next += 1;
                    st.next - 1
                }
                None => {
                    tracing::warn!(
                        slots = shm::SLOTS,
                        "tcp: same-host grant table full; this registration goes over TCP"
                    );
                    return None;
                }
            };
            st.granted.insert(slot, g);
            (slot, st.tables.clone())
        };
        let deadline = Instant::now() + REVOKE_BOUND;
        for t in &tables {
            t.grant(slot, g, deadline);
        }
        Some(slot)
    }

    /// Withdraw a registration from every same-host connection; returns once no peer
    /// touches it. Waits on the caller's thread (the backend's `deregister` is
    /// synchronous) for copies in progress in live peers, each one `memcpy` or system
    /// call; not for a peer that died inside a copy (found at once). A live peer still
    /// inside at [`REVOKE_BOUND`] (stopped in a debugger) keeps `region` alive until
    /// its table goes (its connection ended and its copy too, or it died), and the
    /// deregistration reports it.
    pub(crate) fn revoke(&self, slot: u32, region: &RegionRef) -> Result<()> {
        let tables = {
            let mut st = self.state.lock().unwrap();
            if st.granted.remove(&slot).is_none() {
                return Ok(());
            }
            prune(&mut st);
            st.tables.clone()
        };
        for t in &tables {
            t.table.withdraw(slot);
        }
        // The state lock is not held while waiting: connections come and go, other
        // registrations come and go meanwhile (none reuses this slot: it is not free).
        wait_until(Instant::now() + REVOKE_BOUND, || {
            tables.iter().all(|t| t.quiet(slot))
        });
        let mut stuck = 0;
        for t in tables.iter().filter(|t| !t.quiet(slot)) {
            stuck += 1;
            t.held.lock().unwrap().push(region.clone());
        }
        // A slot a stuck peer still counts in is never reused while that table lives.
        if stuck == 0 {
            self.state.lock().unwrap().free.push(slot);
        }
        if stuck > 0 {
            return Err(Error::new(
                ErrorKind::TimedOut,
                "tcp deregister",
                format!("{stuck} same-host peer(s) still copying after {REVOKE_BOUND:?}; the memory stays alive until they disconnect"),
            ));
        }
        Ok(())
    }

    /// A table for a new same-host connection, holding every current grant.
    pub(crate) fn attach(&self, nonce: &[u8; shm::NONCE_LEN]) -> std::io::Result<Arc<ConnTable>> {
        let t = Arc::new(ConnTable {
            table: Table::create(nonce)?,
            held: Mutex::default(),
            gone: AtomicBool::new(false),
            publish: Mutex::default(),
        });
        let mut st = self.state.lock().unwrap();
        prune(&mut st);
        for (&slot, &g) in &st.granted {
            // A fresh table: every slot idle, nothing to wait for.
            t.table.grant(slot, g);
        }
        st.tables.push(t.clone());
        Ok(t)
    }

    /// The connection of `t` ended. Its grants are withdrawn at once, without waiting
    /// (this runs on the connection's task): an initiator that died with a copy in
    /// progress is found gone and the table dropped now; a live one still copying
    /// keeps the table listed, so deregistration and shutdown still wait for it, and
    /// the table is dropped once it settles.
    pub(crate) fn detach(&self, t: &Arc<ConnTable>) {
        t.withdraw_all();
        let mut st = self.state.lock().unwrap();
        prune(&mut st);
    }

    /// Revoke every grant in every table (shutdown): no peer touches this agent's
    /// memory afterwards. Waits asynchronously, up to `bound` (and at most
    /// [`REVOKE_BOUND`]), only for live peers with a copy in progress; one still in
    /// a copy then is an error (for the shutdown report), not a silent overrun.
    pub(crate) async fn revoke_everything(&self, bound: Duration) -> Result<()> {
        let tables = std::mem::take(&mut self.state.lock().unwrap().tables);
        for t in &tables {
            t.withdraw_all();
        }
        let bound = bound.min(REVOKE_BOUND);
        let deadline = Instant::now() + bound;
        let mut pause = Duration::from_micros(100);
        loop {
            let busy = tables.iter().filter(|t| !t.settled()).count();
            if busy == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    peers = busy,
                    "tcp: a same-host peer kept copying past the revoke bound"
                );
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    "tcp shutdown",
                    format!("{busy} same-host peer(s) still inside a copy of this agent's memory after {bound:?}"),
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
}

/// Drop the tables of ended connections that settled.
fn prune(st: &mut GrantState) {
    st.tables.retain(|t| !t.settled());
}

impl Drop for Grants {
    fn drop(&mut self) {
        // Normally after `revoke_everything` (shutdown), with nothing left to wait for.
        // Otherwise waits on this thread, as `revoke` does, for live peers' copies.
        let tables = std::mem::take(&mut self.state.get_mut().unwrap().tables);
        for t in &tables {
            t.withdraw_all();
        }
        if !wait_until(Instant::now() + REVOKE_BOUND, || {
            tables.iter().all(|t| t.settled())
        }) {
            tracing::warn!("tcp: a same-host peer kept copying past the revoke bound");
        }
    }
}

/// A peer's memfd as mapped for one grant: its key, and the mapping (`None`: the
/// memfd was refused, and the grant's transfers go over TCP).
type Mapped = (u64, Option<Arc<Mapping>>);

/// Initiator side: a connected same-host peer.
#[derive(Debug)]
pub(crate) struct Peer {
    pid: u32,
    table: Arc<Table>,
    /// The GPU side: the target's GPU registrations opened here.
    pub(crate) gpu: GpuPeer,
    /// Why cross-memory attach is off, if it is.
    cma_refused: Option<String>,
    /// The peer's memfds we mapped, by slot.
    maps: Mutex<HashMap<u32, Mapped>>,
    /// How large cross-memory-attach copies are shared between threads.
    split: Split,
}

/// The forms `/proc/net/tcp{,6}` print `a` in: `%08X:%04X` (IPv4) or
/// `%08X%08X%08X%08X:%04X` (IPv6), each 32-bit word in host byte order. An IPv4
/// address also in its IPv4-mapped IPv6 form (a dual-stack listener's sockets).
fn proc_net_forms(a: SocketAddr) -> Vec<String> {
    let words = |b: &[u8]| -> String {
        b.chunks(4)
            .map(|w| format!("{:08X}", u32::from_ne_bytes(w.try_into().expect("4 bytes"))))
            .collect()
    };
    let port = a.port();
    let v4 = match a.ip() {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(ip) => ip.to_ipv4_mapped(),
    };
    let mut forms = Vec::with_capacity(2);
    if let Some(ip) = v4 {
        forms.push(format!("{}:{port:04X}", words(&ip.octets())));
        forms.push(format!(
            "{}:{port:04X}",
            words(&ip.to_ipv6_mapped().octets())
        ));
    } else if let IpAddr::V6(ip) = a.ip() {
        forms.push(format!("{}:{port:04X}", words(&ip.octets())));
    }
    forms
}

/// The TCP socket from `from` to `to` in this network namespace, if there is one:
/// asked of the kernel's socket diagnostics ([`sock_diag`]), or where those cannot be
/// asked, found in `/proc/net/tcp{,6}`.
fn socket_facts(from: SocketAddr, to: SocketAddr) -> Option<SocketFacts> {
    match sock_diag::lookup(from, to) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "tcp: no socket diagnostics; reading /proc/net/tcp");
            proc_socket(from, to)
        }
    }
}

/// The TCP socket from `from` to `to` in this network namespace
/// (`/proc/net/tcp{,6}`), if there is one.
fn proc_socket(from: SocketAddr, to: SocketAddr) -> Option<SocketFacts> {
    let (local, remote) = (proc_net_forms(from), proc_net_forms(to));
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .into_iter()
        .filter_map(|file| std::fs::read_to_string(file).ok())
        .find_map(|text| {
            text.lines().skip(1).find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let (l, r, st) = (f.get(1)?, f.get(2)?, f.get(3)?);
                if !(local.iter().any(|x| x == l) && remote.iter().any(|x| x == r)) {
                    return None;
                }
                Some(SocketFacts {
                    state: u8::from_str_radix(st, 16).ok()?,
                    uid: f.get(7)?.parse().ok()?,
                    inode: f.get(9)?.parse().ok()?,
                })
            })
        })
}

/// Whether the target may offer its same-host path (its grant table: its pid, the
/// table's descriptor and address) on an incoming connection from `peer` to our
/// `local` address. Only a peer proven to be on this host, as this process's user,
/// sees any of it:
///
/// - the connection comes from a loopback address, or from our own address (a
///   connection to a routable address of this host from this host comes from that
///   address), and
/// - its other end is a socket of this host's network namespace, held by a
///   process (`theirs()`: that socket's owner and inode, asked of the kernel only
///   once the address passed), and
/// - that socket belongs to `me`, this process's user (the initiator's
///   `open_peer_memfd` accepts only a target of its own user too).
///
/// A peer on another host, in another network namespace or of another user gets no
/// offer, and uses TCP. (A local proxy forwarding remote clients is itself a local
/// peer; it passes if it runs as our user.) Returns why not.
pub(crate) fn may_offer(
    local: SocketAddr,
    peer: SocketAddr,
    theirs: impl FnOnce() -> Option<(u32, u64)>,
    me: u32,
) -> std::result::Result<(), String> {
    let (ours, from) = (local.ip().to_canonical(), peer.ip().to_canonical());
    if !(from.is_loopback() || from == ours) {
        return Err(format!(
            "the connection comes from {from}, not from this host (loopback or {ours})"
        ));
    }
    match theirs() {
        Some((uid, inode)) if inode != 0 && uid == me => Ok(()),
        Some((uid, inode)) if inode != 0 => Err(format!(
            "the other end of the connection belongs to user {uid}, not to this process's user {me}"
        )),
        _ => Err(format!(
            "the other end of the connection ({peer}) is not a socket of this host's network namespace"
        )),
    }
}

/// [`may_offer`] for an incoming connection from `peer` to our `local` address,
/// with this host's `/proc`.
pub(crate) fn offer_allowed(
    local: SocketAddr,
    peer: SocketAddr,
) -> std::result::Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let me = std::fs::metadata("/proc/self")
        .map_err(|e| format!("cannot tell this process's user ({e})"))?
        .uid();
    let theirs = || socket_facts(peer, local).map(|s| (s.uid, s.inode));
    may_offer(local, peer, theirs, me)
}

/// Whether our connection from `local` to `remote` is known to be closing (the peer
/// closed its end: its setup failing then says nothing about the same-host path).
pub(crate) fn connection_closed(local: SocketAddr, remote: SocketAddr) -> bool {
    socket_facts(local, remote).is_some_and(|s| s.state != sock_diag::ESTABLISHED)
}

/// Check that process `pid` holds the socket at the other end of our TCP connection
/// from `local` to `remote`: the socket whose local address is `remote` and whose
/// peer is `local` in this network namespace's `/proc/net/tcp{,6}`, among the
/// process's descriptors. So the pid the offer names is the target we talk to, not a
/// process the network picked. Fails where it cannot tell (another network
/// namespace, a proxy in between): then the connection uses TCP.
fn holds_connection(pid: u32, local: SocketAddr, remote: SocketAddr) -> std::io::Result<()> {
    let inode = match socket_facts(remote, local) {
        Some(SocketFacts { inode, .. }) if inode != 0 => format!("socket:[{inode}]"),
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                format!("the other end of the connection ({remote}) is not an open socket of this network namespace"),
            ))
        }
    };
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        if std::fs::read_link(entry?.path()).is_ok_and(|l| l.as_os_str() == inode.as_str()) {
            return Ok(());
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!("process {pid} named by the offer does not hold the other end of the connection"),
    ))
}

impl Peer {
    /// Check that the offering process is the one at the other end of our connection
    /// (`local` to `remote`), map its table and probe cross-memory attach. `threads`
    /// starts the agent-owned thread that closes GPU mappings, when one is opened;
    /// `split` says when large copies are cut across threads.
    pub(crate) fn open(
        offer: &Offer,
        local: SocketAddr,
        remote: SocketAddr,
        threads: nixl::ThreadSpawner,
        split: Split,
    ) -> std::io::Result<Self> {
        holds_connection(offer.pid, local, remote)?;
        let table = Arc::new(Table::open(offer.pid, offer.table_fd, &offer.nonce)?);
        let cma_refused = match shm::cma_peek::<{ shm::NONCE_LEN }>(offer.pid, offer.table_addr) {
            Ok(n) if n == offer.nonce => None,
            Ok(_) => Some("the cross-memory probe read the wrong bytes".to_owned()),
            Err(e) => Some(format!("the kernel refused cross-memory attach ({e}); ptrace restrictions such as Yama's ptrace_scope")),
        };
        Ok(Self {
            pid: offer.pid,
            gpu: GpuPeer::new(table.clone(), offer.pid, threads),
            table,
            cma_refused,
            maps: Mutex::default(),
            split,
        })
    }

    /// Why cross-memory attach is off, if it is.
    pub(crate) fn cma_refused(&self) -> Option<&str> {
        self.cma_refused.as_deref()
    }

    /// Move the data of one transfer directly. `Err(Unsuitable)`: nothing was touched,
    /// send it over TCP instead. `Ok(result)`: the transfer's outcome.
    pub(crate) fn transfer(
        &self,
        op: Op,
        segs: &Segments,
        direct: &Direct,
    ) -> std::result::Result<Result<()>, Unsuitable> {
        const OP: &str = "tcp same-host transfer";
        if segs
            .locals()
            .iter()
            .any(|r| r.kind() != nixl::MemKind::Dram)
        {
            return Err(Unsuitable::mixed_kinds("the local memory is GPU memory"));
        }
        // Every target registration's grant, held while the data moves.
        let mut held: Vec<(Access<'_>, Grant)> = Vec::with_capacity(direct.targets.len());
        for (t, &(slot, key, _)) in segs.targets().iter().zip(&direct.targets) {
            let Some((access, g)) = self.table.acquire(slot).filter(|(_, g)| g.key == key) else {
                return Ok(Err(not_granted(&self.table, OP, t)));
            };
            if g.gpu.is_some() {
                return Err(Unsuitable::mixed_kinds("the target's memory is GPU memory"));
            }
            if g.memfd.is_none() && self.cma_refused.is_some() {
                return Err(Unsuitable::new(
                    "cross-memory attach is refused and the memory is not shared",
                ));
            }
            held.push((access, g));
        }
        for (i, r) in segs.runs().iter().enumerate() {
            let e = direct.entry(r);
            let g = &held[r.target as usize].1;
            // Blocks ascend: the run lies inside the grant when its first block starts
            // and its last block ends inside.
            let inside = e.addr >= g.addr
                && e.last()
                    .and_then(|last| last.checked_add(e.len))
                    .zip(g.addr.checked_add(g.len))
                    .is_some_and(|(end, limit)| end <= limit);
            if !inside || e.len == 0 {
                return Ok(Err(Error::new(
                    ErrorKind::OutOfRange,
                    OP,
                    format!(
                        "run {i}: {} blocks of {:#x}+{} every {} bytes are not all inside registration {:#x}+{}",
                        e.blocks, e.addr, e.len, e.stride, g.addr, g.len
                    ),
                )));
            }
        }
        let write = op == Op::Write;
        // Shared memory first, then the rest by cross-memory attach in batches.
        let mut maps = Vec::with_capacity(held.len());
        for (&(slot, ..), (_, g)) in direct.targets.iter().zip(&held) {
            maps.push(match g.memfd {
                Some(fd) => match self.mapping(slot, g, fd) {
                    Ok(Some(m)) => Some(m),
                    Ok(None) => {
                        return Err(Unsuitable::new(
                            "the target's shared memory is not a sealed nixl-tcp memfd",
                        ))
                    }
                    Err(e) => return Ok(Err(e)),
                },
                None => None,
            });
        }
        let mut copies = Copies::default();
        for r in segs.runs() {
            let e = direct.entry(r);
            let g = &held[r.target as usize].1;
            let region = &segs.locals()[r.local as usize];
            for j in 0..r.count {
                // Inside the grant (checked above for the whole run).
                let addr = e.addr + j as u64 * e.stride;
                match &maps[r.target as usize] {
                    Some(map) => {
                        let block = region
                            .slice(r.local_at(j) as usize, r.len as usize)
                            .expect("the agent checked every segment");
                        if let Err(e) =
                            shm::copy_mapped(&block, map, (addr - g.addr) as usize, write)
                        {
                            return Ok(Err(Error::new(
                                ErrorKind::Backend,
                                OP,
                                "copy through shared memory failed",
                            )
                            .with_source(e)));
                        }
                    }
                    None => copies.push(Piece {
                        local: r.local,
                        offset: r.local_at(j) as usize,
                        remote: addr,
                        len: r.len as usize,
                    }),
                }
            }
        }
        if copies.bytes() > 0 {
            if let Err(e) = self.cma_copies(write, segs.locals(), &copies) {
                return Ok(Err(e));
            }
        }
        drop(held);
        Ok(Ok(()))
    }

    /// Every cross-memory-attach copy of a transfer, in calls within the kernel's limits.
    fn cma_copies(&self, write: bool, locals: &[RegionRef], copies: &Copies) -> Result<()> {
        let threads = self.split.threads_for(copies.bytes());
        if threads > 1 {
            // Threads scoped to this transfer: each runs a bounded run of system
            // calls and all are joined before the transfer completes.
            let parts = copies.split(threads, 4096);
            return std::thread::scope(|s| {
                // This thread copies the first part, and any whose thread did not start.
                let mut here = Vec::new();
                let mut started = Vec::new();
                for (i, r) in parts.into_iter().enumerate() {
                    let spawned = (i > 0).then(|| {
                        let r = r.clone();
                        std::thread::Builder::new()
                            .name("nixl-tcp-copy-part".into())
                            .spawn_scoped(s, move || self.cma_range(write, locals, copies, r))
                    });
                    match spawned {
                        Some(Ok(h)) => started.push(h),
                        _ => here.push(r),
                    }
                }
                let mut out = here
                    .into_iter()
                    .try_for_each(|r| self.cma_range(write, locals, copies, r));
                for h in started {
                    let r = h.join().unwrap_or_else(|_| {
                        Err(Error::new(
                            ErrorKind::Backend,
                            "tcp same-host transfer",
                            "a copy thread panicked",
                        ))
                    });
                    if out.is_ok() {
                        out = r;
                    }
                }
                out
            });
        }
        self.cma_range(write, locals, copies, 0..copies.bytes())
    }

    fn cma_range(
        &self,
        write: bool,
        locals: &[RegionRef],
        copies: &Copies,
        range: std::ops::Range<u64>,
    ) -> Result<()> {
        let limits = CallLimits {
            ranges: shm::IOV_MAX,
            bytes: shm::CMA_CALL_MAX,
        };
        let mut local = Vec::new();
        let mut remote = Vec::new();
        copies.each_call(range, limits, |call| {
            local.clear();
            remote.clear();
            for p in call {
                local.push(
                    locals[p.local as usize]
                        .slice(p.offset, p.len)
                        .expect("the agent checked every segment"),
                );
                remote.push((p.remote, p.len as u64));
            }
            self.cma(write, &local, &remote)
        })
    }

    fn cma(&self, write: bool, local: &[RegionSlice], remote: &[(u64, u64)]) -> Result<()> {
        const OP: &str = "tcp same-host transfer";
        let want: u64 = remote.iter().map(|r| r.1).sum();
        match shm::cma(self.pid, write, local, remote) {
            Ok(n) if n as u64 == want => Ok(()),
            Ok(n) => Err(Error::new(
                ErrorKind::Backend,
                OP,
                format!("cross-memory attach moved {n} of {want} bytes (the peer's memory is not mapped)"),
            )),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(Error::new(
                ErrorKind::RemoteDisconnected,
                OP,
                "the peer process is gone",
            )
            .with_source(e)),
            Err(e) => Err(Error::new(ErrorKind::Backend, OP, "cross-memory attach failed").with_source(e)),
        }
    }

    /// The peer's memfd for `slot` (called while the slot's access is held, so the
    /// descriptor is the granted one and still open). `Ok(None)`: the descriptor is
    /// not one this crate may map (not a nixl-tcp memfd, not sealed, too short, not
    /// our user's), remembered for the grant so that it is logged once.
    fn mapping(&self, slot: u32, g: &Grant, fd: i32) -> Result<Option<Arc<Mapping>>> {
        let mut maps = self.maps.lock().unwrap();
        if let Some((key, m)) = maps.get(&slot) {
            if *key == g.key && m.as_ref().is_none_or(|m| m.len() as u64 >= g.len) {
                return Ok(m.clone());
            }
        }
        let m = match shm::map_peer(self.pid, fd, g.len as usize) {
            Ok(m) => Some(Arc::new(m)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::new(
                    ErrorKind::RemoteDisconnected,
                    "tcp same-host transfer",
                    "cannot map the peer's shared memory",
                )
                .with_source(e))
            }
            Err(e) => {
                tracing::info!(pid = self.pid, fd, error = %e, "tcp: refusing the peer's shared memory; its transfers go over TCP");
                None
            }
        };
        maps.insert(slot, (g.key, m.clone()));
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// Hole 9 of issue 39: the offer (pid, table descriptor and address) went to any
    /// client that asked. Only a peer on this host, in this network namespace and
    /// of this process's user may have it.
    #[test]
    fn only_a_peer_proven_on_this_host_as_our_user_is_offered_the_path() {
        const ME: u32 = 1000;
        let held = || Some((ME, 4242));
        // Loopback, v4 and v6, and a dual-stack listener's mapped form.
        may_offer(at("127.0.0.1:5000"), at("127.0.0.1:40000"), held, ME).unwrap();
        may_offer(at("[::1]:5000"), at("[::1]:40000"), held, ME).unwrap();
        may_offer(
            at("[::ffff:127.0.0.1]:5000"),
            at("[::ffff:127.0.0.1]:4"),
            held,
            ME,
        )
        .unwrap();
        // A routable address of this host, connected from this host.
        may_offer(at("10.1.2.3:5000"), at("10.1.2.3:40000"), held, ME).unwrap();
        // Another host: refused before /proc is even read.
        let never = || -> Option<(u32, u64)> { panic!("no /proc read for a remote peer") };
        for (local, peer) in [
            ("10.1.2.3:5000", "10.1.2.4:40000"),
            ("[::ffff:10.1.2.3]:5000", "[::ffff:192.168.0.9]:40000"),
            ("[2001:db8::1]:5000", "[2001:db8::2]:40000"),
            ("0.0.0.0:5000", "8.8.8.8:40000"),
        ] {
            let why = may_offer(at(local), at(peer), never, ME).unwrap_err();
            assert!(why.contains("not from this host"), "{why}");
        }
        // A local address whose other end is not a socket here (another network
        // namespace behind a bridge or NAT, or a socket no process holds).
        for theirs in [None, Some((ME, 0))] {
            let why =
                may_offer(at("127.0.0.1:5000"), at("127.0.0.1:4"), || theirs, ME).unwrap_err();
            assert!(why.contains("not a socket of this host"), "{why}");
        }
        // Another user's process on this host.
        let why =
            may_offer(at("127.0.0.1:5000"), at("127.0.0.1:4"), || Some((0, 7)), ME).unwrap_err();
        assert!(why.contains("belongs to user 0"), "{why}");
    }

    /// The same decision on real sockets: a connection of ours over loopback is
    /// offered the path; a connection whose other end this namespace does not have
    /// (an address pair no socket uses) is not.
    #[test]
    fn the_offer_decision_reads_this_hosts_sockets() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (theirs, from) = listener.accept().unwrap();
        let local = theirs.local_addr().unwrap();
        offer_allowed(local, from).unwrap();
        let why = offer_allowed(local, at("127.0.0.1:1")).unwrap_err();
        assert!(why.contains("not a socket of this host"), "{why}");
        drop(ours);
    }

    fn grant(key: u64) -> Grant {
        Grant {
            key,
            addr: 0x10_000 * key,
            len: 4096,
            memfd: None,
            gpu: None,
        }
    }

    /// Hole 9 of issue 39: a registration waited (up to 10 s) for each same-host
    /// table whose slot an initiator held busy, under the lock every registration,
    /// deregistration and new connection takes. A table's slot held busy now holds
    /// up only the grant that waits for it.
    #[test]
    fn a_slot_held_busy_holds_up_no_other_registration() {
        let grants = Arc::new(Grants::default());
        let nonce = [7u8; shm::NONCE_LEN];
        let t = grants.attach(&nonce).unwrap();
        // An initiator (this process, its own open of the table: its shared lock
        // marks it alive) holds slot 0 busy, as one stopped between looking at the
        // free slot and leaving it would.
        let initiator = Table::open(std::process::id(), t.table.raw_fd().unwrap(), &nonce).unwrap();
        let busy = initiator.hold(0);
        // The first registration takes slot 0 and waits for it...
        let first = {
            let grants = grants.clone();
            std::thread::spawn(move || grants.publish(grant(1)))
        };
        // ...once it has taken it (the lock is free and the slot handed out)...
        let deadline = Instant::now() + REVOKE_BOUND * 2;
        loop {
            if let Ok(st) = grants.state.try_lock() {
                if st.next >= 1 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the first grant never took its slot"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // ...a second registration goes through meanwhile, granted in the table.
        assert_eq!(grants.publish(grant(2)), Some(1));
        assert!(
            initiator.still_granted(1, 2),
            "the second grant is published"
        );
        assert!(
            !first.is_finished(),
            "the second registration waited for the first one's busy slot"
        );
        assert!(!initiator.still_granted(0, 1));
        // The initiator leaves the slot: the first grant is published too.
        drop(busy);
        assert_eq!(first.join().unwrap(), Some(0));
        assert!(initiator.still_granted(0, 1));
        // Deregistering both (no access in progress) finds nothing to wait for.
        drop(initiator);
    }

    /// The offer's pid is believed only when that process holds the other end of the
    /// connection the offer came on.
    #[test]
    fn the_offering_process_must_hold_the_other_end() {
        for at in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = std::net::TcpListener::bind(at) else {
                continue; // no IPv6 loopback here
            };
            let ours = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (theirs, _) = listener.accept().unwrap();
            let (l, r) = (ours.local_addr().unwrap(), ours.peer_addr().unwrap());
            let me = std::process::id();
            holds_connection(me, l, r).unwrap();
            assert!(!connection_closed(l, r));
            // Another process (our parent, the test runner) does not hold it.
            let parent = std::os::unix::process::parent_id();
            let e = holds_connection(parent, l, r).unwrap_err();
            assert!(
                e.to_string().contains("does not hold")
                    || e.kind() == std::io::ErrorKind::PermissionDenied,
                "{e}"
            );
            // Addresses no socket of this namespace has.
            let nowhere: SocketAddr = "127.0.0.1:1".parse().unwrap();
            let e = holds_connection(me, l, nowhere).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::Unsupported, "{e}");
            // The target closing its end shows on ours.
            drop(theirs);
            let deadline = Instant::now() + Duration::from_secs(5);
            while !connection_closed(l, r) {
                assert!(Instant::now() < deadline, "the close never showed");
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(holds_connection(me, l, r).is_err());
        }
    }
}
