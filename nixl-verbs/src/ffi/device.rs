//! The device an agent uses, and owners that release verbs objects in the right
//! order: every memory region and queue pair holds the [`Device`], so the protection
//! domain, completion queue and device context are released only after the last of
//! them, whoever lets go last.
//!
//! These owners are where the crate's unsafe verbs calls are made, and why the rest
//! of it needs none: a memory region owns what keeps its memory mapped (the agent's
//! [`RegionRef`], or a buffer of its own) and lets go of it only after deregistering,
//! so the device, which reaches memory only through the keys of live registrations
//! of this protection domain, never reaches memory that is gone; posting through a
//! [`QueuePair`] is safe for that reason.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use nixl::{AlignedBuf, Error, ErrorKind, RegionRef, Result};
use tokio::io::unix::{AsyncFd, AsyncFdRegisterError};

use crate::api::{
    Channel, DeviceLimits, GidType, Handle, LinkLayer, Mr, PortInfo, PostError, Qp, QpCaps,
    QpTransition, RecvWr, SendWr, Sge, PORT_ACTIVE,
};
use crate::ffi::VerbsApi;
use crate::wire::Endpoint;
use crate::VerbsOptions;

/// One open device with its protection domain and the completion queue every queue
/// pair of this agent reports to.
pub(crate) struct Device {
    pub(crate) api: Arc<dyn VerbsApi>,
    pub(crate) name: String,
    pub(crate) ctx: Handle,
    pub(crate) pd: Handle,
    pub(crate) channel: Channel,
    pub(crate) cq: Handle,
    pub(crate) limits: DeviceLimits,
    pub(crate) port: PortInfo,
    pub(crate) endpoint: Endpoint,
    /// Completion events taken and not yet acknowledged (all must be before the
    /// queue is destroyed).
    pub(crate) unacked: AtomicU32,
    /// Entries of the completion queue.
    cq_size: u32,
    /// Entries inbound queue pairs may reserve together: `cq_size` less the room
    /// kept for outgoing ones ([`VerbsOptions::outgoing_cq_reserve`]).
    inbound_limit: u32,
    /// Entries the live queue pairs can fill at once (their send queues, or receive
    /// queues, as each uses).
    cq_reserved: Mutex<CqReserved>,
}

/// Completion-queue entries reserved by live queue pairs: never more than the
/// queue's size in all (an overflow is fatal on real devices), nor more than
/// `inbound_limit` by inbound ones.
#[derive(Debug, Default)]
struct CqReserved {
    all: u32,
    inbound: u32,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("port", &self.endpoint.port)
            .field("link_layer", &self.endpoint.link_layer)
            .finish_non_exhaustive()
    }
}

fn not_supported(msg: String) -> Error {
    Error::new(ErrorKind::NotSupported, "open verbs device", msg)
}

impl Device {
    /// Pick the device, port and GID the options ask for (or the first usable ones),
    /// open it and make the protection domain and completion queue.
    pub(crate) fn open(api: Arc<dyn VerbsApi>, o: &VerbsOptions) -> Result<Self> {
        let devices = api.devices()?;
        if devices.is_empty() {
            return Err(not_supported(format!(
                "no RDMA device found ({}): this host has no RDMA NIC, its driver is not loaded, or /dev/infiniband is not visible (containers); for a software device see scripts/soft-roce.sh",
                api.describe()
            )));
        }
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        let candidates: Vec<&str> = match &o.device {
            Some(want) => {
                if !names.contains(&want.as_str()) {
                    return Err(Error::new(
                        ErrorKind::NotFound,
                        "open verbs device",
                        format!("no RDMA device {want:?}; present: {}", names.join(", ")),
                    ));
                }
                vec![want.as_str()]
            }
            None => names.clone(),
        };
        let mut why_not = Vec::new();
        for name in candidates {
            let ctx = match api.open(name) {
                Ok(ctx) => ctx,
                Err(e) if o.device.is_none() => {
                    why_not.push(format!("device {name} does not open: {e}"));
                    continue;
                }
                Err(e) => return Err(e),
            };
            match Self::pick_port(&*api, ctx, name, o) {
                Ok((port, info, endpoint, limits)) => {
                    return Self::finish(api, name, ctx, port, info, endpoint, limits, o);
                }
                Err(e) => {
                    why_not.push(e.context().to_owned());
                    // SAFETY: `ctx` was just opened and nothing was made from it.
                    let _ = unsafe { api.close(ctx) };
                }
            }
        }
        Err(not_supported(why_not.join("; ")))
    }

    /// The port and GID to use on an open device.
    fn pick_port(
        api: &dyn VerbsApi,
        ctx: Handle,
        name: &str,
        o: &VerbsOptions,
    ) -> Result<(u8, PortInfo, Endpoint, DeviceLimits)> {
        let limits = api.query_device(ctx)?;
        let ports: Vec<u8> = match o.port {
            Some(p) if p == 0 || p > limits.phys_port_cnt => {
                return Err(not_supported(format!(
                    "device {name} has ports 1 to {}, not {p}",
                    limits.phys_port_cnt
                )))
            }
            Some(p) => vec![p],
            None => (1..=limits.phys_port_cnt).collect(),
        };
        let mut states = Vec::new();
        for port in ports {
            let info = api.query_port(ctx, port)?;
            if info.state != PORT_ACTIVE {
                states.push(format!("port {port} is not active (state {})", info.state));
                continue;
            }
            let (gid_index, gid) = match Self::pick_gid(api, ctx, port, &info, o)? {
                Some(g) => g,
                None => {
                    states.push(format!("port {port} has no usable GID"));
                    continue;
                }
            };
            let endpoint = Endpoint {
                link_layer: match info.link_layer {
                    LinkLayer::Ethernet => LinkLayer::Ethernet,
                    _ => LinkLayer::InfiniBand,
                },
                port,
                mtu: info.active_mtu,
                lid: info.lid,
                gid_index,
                gid,
                max_msg_sz: info.max_msg_sz.max(1),
                max_rd_atomic: limits.max_qp_rd_atom.min(255) as u8,
            };
            return Ok((port, info, endpoint, limits));
        }
        Err(not_supported(format!(
            "device {name}: {}",
            if states.is_empty() {
                "no ports".to_owned()
            } else {
                states.join(", ")
            }
        )))
    }

    /// The GID: the one asked for, else on Ethernet the first RoCE v2 GID (an
    /// IPv4-mapped one first: routable and what peers' IP routes reach), else the
    /// first non-zero GID; on InfiniBand index 0.
    fn pick_gid(
        api: &dyn VerbsApi,
        ctx: Handle,
        port: u8,
        info: &PortInfo,
        o: &VerbsOptions,
    ) -> Result<Option<(u8, [u8; 16])>> {
        if let Some(i) = o.gid_index {
            return Ok(api
                .query_gid(ctx, port, i)?
                .filter(|g| g.gid != [0; 16] && i <= u32::from(u8::MAX))
                .map(|g| (i as u8, g.gid)));
        }
        let mut entries = Vec::new();
        for i in 0..info.gid_tbl_len.min(256) {
            if let Some(g) = api.query_gid(ctx, port, i)? {
                if g.gid != [0; 16] {
                    entries.push(g);
                }
            }
        }
        if info.link_layer != LinkLayer::Ethernet {
            return Ok(entries.first().map(|g| (g.index as u8, g.gid)));
        }
        let v4_mapped = |g: &[u8; 16]| g[..10] == [0; 10] && g[10..12] == [0xff, 0xff];
        let best = entries
            .iter()
            .find(|g| g.kind == Some(GidType::RoceV2) && v4_mapped(&g.gid))
            .or_else(|| entries.iter().find(|g| g.kind == Some(GidType::RoceV2)))
            .or_else(|| entries.first());
        Ok(best.map(|g| (g.index as u8, g.gid)))
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        api: Arc<dyn VerbsApi>,
        name: &str,
        ctx: Handle,
        port: u8,
        info: PortInfo,
        endpoint: Endpoint,
        limits: DeviceLimits,
        o: &VerbsOptions,
    ) -> Result<Self> {
        let _ = port;
        // On failure, release what was made, newest first.
        let pd = match api.alloc_pd(ctx) {
            Ok(pd) => pd,
            Err(e) => {
                // SAFETY: nothing else was made from `ctx`.
                let _ = unsafe { api.close(ctx) };
                return Err(e);
            }
        };
        let channel = match api.create_channel(ctx) {
            Ok(c) => c,
            Err(e) => {
                // SAFETY: `pd` and `ctx` are unused; newest first.
                let _ = unsafe { api.dealloc_pd(pd) };
                // SAFETY: as above.
                let _ = unsafe { api.close(ctx) };
                return Err(e);
            }
        };
        let cqe = o.cq_depth.clamp(16, limits.max_cqe.max(16));
        // (The reservations of `cq_reserved` keep the queue pairs within `cqe`.)
        let cq = match api.create_cq(ctx, cqe, channel.handle) {
            Ok(cq) => cq,
            Err(e) => {
                // SAFETY: nothing uses these; newest first.
                unsafe {
                    let _ = api.destroy_channel(channel.handle);
                    let _ = api.dealloc_pd(pd);
                    let _ = api.close(ctx);
                }
                return Err(e);
            }
        };
        Ok(Self {
            api,
            name: name.to_owned(),
            ctx,
            pd,
            channel,
            cq,
            limits,
            port: info,
            endpoint,
            unacked: AtomicU32::new(0),
            cq_size: cqe,
            // Half the queue unless told otherwise; all of it for outgoing queue
            // pairs leaves none for peers (an agent that only initiates).
            inbound_limit: cqe - o.outgoing_cq_reserve.unwrap_or(cqe / 2).min(cqe),
            cq_reserved: Mutex::new(CqReserved::default()),
        })
    }

    /// How many inbound queue pairs (as [`Device::caps`] asks for them) the
    /// completion queue's inbound share holds.
    pub(crate) fn inbound_qps(&self, o: &VerbsOptions) -> usize {
        (self.inbound_limit / self.caps(o).max_recv_wr.max(1)) as usize
    }

    /// The send queue depth to ask for.
    pub(crate) fn caps(&self, o: &VerbsOptions) -> QpCaps {
        let wr = |want: u32| want.clamp(1, self.limits.max_qp_wr.max(1));
        QpCaps {
            max_send_wr: wr(o.send_queue_depth),
            max_recv_wr: wr(o.recv_queue_depth),
            max_send_sge: self.limits.max_sge.clamp(1, 4),
            max_recv_sge: 1,
            max_inline_data: 64,
        }
    }

    /// The completion channel's descriptor, registered with tokio for readability.
    /// It borrows the device, which keeps the descriptor open.
    ///
    /// # Errors
    /// Registration with the reactor failed.
    pub(crate) fn watch_channel(
        &self,
    ) -> std::result::Result<AsyncFd<ChannelFd<'_>>, AsyncFdRegisterError<ChannelFd<'_>>> {
        // SAFETY: the channel's descriptor stays open, the same one, while the device
        // lives (its `Drop` destroys the channel), and the returned value borrows the
        // device, so it is dropped first.
        unsafe { AsyncFd::register_with_interest(ChannelFd(self), tokio::io::Interest::READABLE) }
    }
}

/// The descriptor of a device's completion channel, for tokio to watch.
#[derive(Debug)]
pub(crate) struct ChannelFd<'a>(&'a Device);

impl AsRawFd for ChannelFd<'_> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.channel.fd
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let api = &self.api;
        let unacked = self.unacked.swap(0, Ordering::AcqRel);
        if unacked > 0 {
            api.ack_cq_events(self.cq, unacked);
        }
        // SAFETY: every queue pair and memory region holds this device, so none is
        // left; the completion loop holds it too, so it has stopped. Newest first.
        unsafe {
            if let Err(e) = api.destroy_cq(self.cq) {
                tracing::warn!(error = %e, "verbs: destroying the completion queue failed");
            }
            if let Err(e) = api.destroy_channel(self.channel.handle) {
                tracing::warn!(error = %e, "verbs: destroying the completion channel failed");
            }
            if let Err(e) = api.dealloc_pd(self.pd) {
                tracing::warn!(error = %e, "verbs: freeing the protection domain failed");
            }
            if let Err(e) = api.close(self.ctx) {
                tracing::warn!(error = %e, "verbs: closing the device failed");
            }
        }
    }
}

/// A registered memory region; deregistered when dropped, then what keeps its memory
/// mapped is let go.
pub(crate) struct MemoryRegion {
    pub(crate) dev: Arc<Device>,
    pub(crate) mr: Mr,
    /// Dropped after `Drop` deregistered the region; leaked should that fail (the
    /// device may still reach the memory).
    memory: Option<Backing>,
}

/// What keeps a registered region's memory mapped.
enum Backing {
    /// The agent's registration: holding it keeps the memory alive.
    Region(#[allow(dead_code)] RegionRef),
    /// A buffer of this crate's own ([`RegisteredBuf`]).
    Buffer(AlignedBuf),
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("lkey", &self.mr.lkey)
            .field("rkey", &self.mr.rkey)
            .finish()
    }
}

impl MemoryRegion {
    /// Register the agent's `region` (host memory) for local use and for peers' READs
    /// and WRITEs; the region is kept until this is dropped.
    pub(crate) fn register(dev: &Arc<Device>, region: &RegionRef) -> Result<Self> {
        let seg = region.segment();
        // SAFETY: `region` keeps the memory mapped while it lives, and the value made
        // here holds it until `Drop` has deregistered the region.
        unsafe {
            Self::register_raw(
                dev,
                seg.addr() as usize,
                seg.len(),
                true,
                Backing::Region(region.clone()),
            )
        }
    }

    /// Register `addr..addr + len` for local use, and for peers' READs and WRITEs
    /// when `remote`; `memory` keeps it mapped.
    ///
    /// # Safety
    /// `memory` keeps `addr..addr + len` mapped while it lives.
    unsafe fn register_raw(
        dev: &Arc<Device>,
        addr: usize,
        len: usize,
        remote: bool,
        memory: Backing,
    ) -> Result<Self> {
        use crate::api::access::*;
        let access = if remote {
            LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
        } else {
            LOCAL_WRITE
        };
        // SAFETY: `memory` keeps the memory mapped until `Drop` deregisters it.
        let mr = unsafe { dev.api.reg_mr(dev.pd, addr, len, access) }?;
        Ok(Self {
            dev: dev.clone(),
            mr,
            memory: Some(memory),
        })
    }
}

impl MemoryRegion {
    /// Register the agent's `region`, memory of GPU `device`, for local use and peers'
    /// READs and WRITEs: by dma-buf (`ibv_reg_dmabuf_mr`) where the driver exports
    /// one and the NIC takes it, else by `ibv_reg_mr` on the device pointer, which
    /// works where the peer-memory module (`nvidia-peermem`) is loaded. Returns the
    /// region and which way it was registered.
    ///
    /// # Errors
    /// As [`nixl::gpu::status`] without a GPU; [`ErrorKind::NotSupported`] naming both
    /// failures when neither way works.
    ///
    /// The agent's `region` is kept until this is dropped.
    pub(crate) fn register_gpu(
        dev: &Arc<Device>,
        device: u32,
        region: &RegionRef,
    ) -> Result<(Self, GpuRegistration)> {
        use crate::api::access::*;
        const OP: &str = "verbs register";
        let seg = region.segment();
        let (addr, len) = (seg.addr() as usize, seg.len());
        let access = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ;
        nixl::gpu::status()?;
        let region = |mr| Self {
            dev: dev.clone(),
            mr,
            memory: Some(Backing::Region(region.clone())),
        };
        let by_dmabuf = nixl::gpu::dma_buf(device, addr as u64, len).and_then(|d| {
            // SAFETY: `region` keeps the device memory allocated while it lives, and
            // the value made of the result holds it until `Drop` has deregistered
            // it; `d.fd` is open for the call (the registration keeps its own
            // reference to the dma-buf).
            unsafe {
                dev.api
                    .reg_dmabuf_mr(dev.pd, d.offset, len, addr as u64, d.fd.as_fd(), access)
            }
        });
        let dmabuf_error = match by_dmabuf {
            Ok(mr) => return Ok((region(mr), GpuRegistration::DmaBuf)),
            Err(e) => e,
        };
        // SAFETY: as above; with the peer-memory module the NIC maps device memory
        // by its address.
        match unsafe { dev.api.reg_mr(dev.pd, addr, len, access) } {
            Ok(mr) => {
                tracing::info!(error = %dmabuf_error, "verbs: GPU memory registered through the peer-memory module, not by dma-buf");
                Ok((region(mr), GpuRegistration::PeerMemory))
            }
            Err(e) => Err(Error::new(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "GPU {device} memory ({len} bytes): registering it by dma-buf failed ({dmabuf_error}), and as a device pointer too ({e}); GPUDirect RDMA needs dma-buf support (CUDA 11.7+, rdma-core 34+, Linux 5.12+ and a NIC driver that takes dma-bufs) or the nvidia-peermem module"
                ),
            )),
        }
    }
}

/// How GPU memory was registered with the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuRegistration {
    /// `ibv_reg_dmabuf_mr` on the driver's dma-buf.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer (the peer-memory module).
    PeerMemory,
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: whoever used this region holds it; it is the last user.
        if let Err(e) = unsafe { self.dev.api.dereg_mr(self.mr.handle) } {
            tracing::warn!(error = %e, "verbs: deregistering a memory region failed; its memory is leaked");
            std::mem::forget(self.memory.take());
        }
    }
}

/// A buffer of this crate's own (notification buffers), registered for local use.
/// The device writes it (receives) and reads it (sends), so it is reached only by
/// copies through raw pointers, never through a Rust reference.
pub(crate) struct RegisteredBuf(MemoryRegion);

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuf")
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .finish()
    }
}

impl RegisteredBuf {
    /// `len` bytes, registered on `dev`.
    pub(crate) fn new(dev: &Arc<Device>, len: usize) -> Result<Self> {
        let mem = AlignedBuf::new(len);
        let (addr, len) = (mem.as_mut_ptr() as usize, mem.len());
        // SAFETY: the buffer moves into the region, which frees it only after
        // deregistering (or never).
        unsafe { MemoryRegion::register_raw(dev, addr, len, false, Backing::Buffer(mem)) }.map(Self)
    }

    fn mem(&self) -> &AlignedBuf {
        match &self.0.memory {
            Some(Backing::Buffer(b)) => b,
            _ => unreachable!("a RegisteredBuf is made with its buffer"),
        }
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.mem().len()
    }

    /// The key of its local scatter/gather entries.
    pub(crate) fn lkey(&self) -> u32 {
        self.0.mr.lkey
    }

    /// The address of byte `offset`, for work requests.
    pub(crate) fn addr(&self, offset: usize) -> u64 {
        self.mem().as_mut_ptr() as u64 + offset as u64
    }

    /// Copy `dst.len()` bytes out, from `offset`. What the bytes mean is the caller's
    /// protocol: read a receive buffer once its completion arrived and before it is
    /// posted again.
    ///
    /// # Panics
    /// When the range does not fit the buffer.
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) {
        let mem = self.mem();
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|e| e <= mem.len()),
            "read past a registered buffer"
        );
        // SAFETY: the range lies inside the buffer (checked above), which lives as
        // long as `self`; `dst` is a separate allocation; bytes have no invalid
        // values, and no Rust reference to the buffer exists.
        unsafe {
            std::ptr::copy_nonoverlapping(
                mem.as_mut_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
    }

    /// Copy `src` in, at `offset`. As for [`RegisteredBuf::read`], when the device
    /// reads it is the caller's protocol: write a send buffer no work request names.
    ///
    /// # Panics
    /// When the range does not fit the buffer.
    pub(crate) fn write(&self, offset: usize, src: &[u8]) {
        let mem = self.mem();
        assert!(
            offset
                .checked_add(src.len())
                .is_some_and(|e| e <= mem.len()),
            "write past a registered buffer"
        );
        // SAFETY: as in `read`; `src` is a separate allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), mem.as_mut_ptr().add(offset), src.len())
        };
    }
}

/// A queue pair; moved to ERROR and destroyed when dropped (or by
/// [`QueuePair::destroy`]), after which the device touches none of the memory its work
/// requests named.
pub(crate) struct QueuePair {
    pub(crate) dev: Arc<Device>,
    pub(crate) qp: Qp,
    /// Completion-queue entries reserved for it.
    reserved: u32,
    role: QpUse,
    destroyed: bool,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp.qp_num)
            .finish()
    }
}

/// Which queues of a queue pair produce completions.
#[derive(Clone, Copy, Debug)]
pub(crate) enum QpUse {
    /// An initiator's: sends only.
    Send,
    /// A target's: receives only (notifications).
    Recv,
}

impl QueuePair {
    /// A queue pair whose completions fit the completion queue with everyone
    /// else's; an inbound one ([`QpUse::Recv`]) also fits the queue's inbound share,
    /// so peers never take the room this agent's own connections need.
    ///
    /// # Errors
    /// [`ErrorKind::NotSupported`] when the completion queue (or its inbound share)
    /// has no room left for it (raise [`VerbsOptions::cq_depth`](crate::VerbsOptions)
    /// or lower the queue depths); the device's own errors.
    pub(crate) fn create(dev: &Arc<Device>, caps: QpCaps, role: QpUse) -> Result<Self> {
        let qp = dev.api.create_qp(dev.pd, dev.cq, caps)?;
        let need = match role {
            QpUse::Send => qp.caps.max_send_wr,
            QpUse::Recv => qp.caps.max_recv_wr,
        };
        // Dropped (destroyed) without a reservation if it does not fit.
        let mut me = Self {
            dev: dev.clone(),
            qp,
            reserved: 0,
            role,
            destroyed: false,
        };
        let mut r = dev.cq_reserved.lock().unwrap();
        let all = r.all.checked_add(need).filter(|&t| t <= dev.cq_size);
        let inbound = match role {
            QpUse::Send => Some(r.inbound),
            QpUse::Recv => r
                .inbound
                .checked_add(need)
                .filter(|&t| t <= dev.inbound_limit),
        };
        match (all, inbound) {
            (Some(all), Some(inbound)) => {
                *r = CqReserved { all, inbound };
                drop(r);
                me.reserved = need;
                Ok(me)
            }
            (None, _) => Err(Error::new(
                ErrorKind::NotSupported,
                "verbs queue pair",
                format!(
                    "the completion queue of {} entries has {} left, and a queue pair needs {need}: raise VerbsOptions::cq_depth (device limit {}) or lower the queue depths",
                    dev.cq_size,
                    dev.cq_size.saturating_sub(r.all),
                    dev.limits.max_cqe
                ),
            )),
            (Some(_), None) => Err(Error::new(
                ErrorKind::NotSupported,
                "verbs queue pair",
                format!(
                    "peers' queue pairs may take {} of the completion queue's {} entries (the rest is kept for this agent's own connections: VerbsOptions::outgoing_cq_reserve); {} are left, and a queue pair needs {need}",
                    dev.inbound_limit,
                    dev.cq_size,
                    dev.inbound_limit.saturating_sub(r.inbound),
                ),
            )),
        }
    }

    /// Apply state changes in order.
    pub(crate) fn modify(&self, steps: &[QpTransition]) -> Result<()> {
        for s in steps {
            self.dev.api.modify_qp(self.qp.handle, s)?;
        }
        Ok(())
    }

    /// Post `wrs` as one chain. Entries name memory by the keys of registrations on
    /// this device, which the device checks; an inline entry (copied during the call,
    /// without a key) must lie in `inline`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for an inline entry outside `inline` (nothing
    /// posted); the device's, with the count it accepted.
    pub(crate) fn post_send(
        &self,
        wrs: &[SendWr],
        sges: &[Sge],
        inline: &[u8],
    ) -> std::result::Result<(), PostError> {
        let (lo, hi) = (
            inline.as_ptr() as u64,
            inline.as_ptr() as u64 + inline.len() as u64,
        );
        let outside = wrs.iter().filter(|w| w.inline).any(|w| {
            let at = w.first_sge as usize;
            sges.get(at..at + w.num_sge as usize).is_none_or(|es| {
                es.iter()
                    .any(|e| e.addr < lo || e.addr.saturating_add(u64::from(e.len)) > hi)
            })
        });
        if outside {
            return Err(PostError {
                posted: 0,
                error: Error::new(
                    ErrorKind::InvalidArgument,
                    "verbs post",
                    "an inline entry lies outside the bytes given to send inline",
                ),
            });
        }
        // SAFETY: the device reaches memory only through the keys of this device's
        // live registrations (a wrong key or range fails the work request), and each
        // registration keeps its memory mapped until it is deregistered, after which
        // the device no longer reaches it; inline entries lie in `inline` (checked
        // above), which is read during the call only.
        unsafe { self.dev.api.post_send(self.qp.handle, wrs, sges) }
    }

    /// Post receives. Each buffer is named by the key of a registration on this
    /// device, which the device checks.
    ///
    /// # Errors
    /// The device's, with the count it accepted.
    pub(crate) fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        // SAFETY: as for `post_send`: the device writes only memory of live
        // registrations, which keep it mapped until deregistered.
        unsafe { self.dev.api.post_recv(self.qp.handle, wrs) }
    }

    /// Move it to ERROR and destroy it.
    ///
    /// # Errors
    /// When the device refused to destroy it: it may still reach the memory its work
    /// requests name, so the caller must keep that memory (it leaks it).
    pub(crate) fn destroy(&mut self) -> Result<()> {
        if self.destroyed {
            return Ok(());
        }
        let api = &self.dev.api;
        let _ = api.modify_qp(self.qp.handle, &QpTransition::Error);
        // SAFETY: the owner of this queue pair is its only user and lets go now.
        unsafe { api.destroy_qp(self.qp.handle) }?;
        self.destroyed = true;
        let mut r = self.dev.cq_reserved.lock().unwrap();
        r.all -= self.reserved;
        if matches!(self.role, QpUse::Recv) {
            r.inbound -= self.reserved;
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::error!(error = %e, qp = self.qp.qp_num, "verbs: destroying a queue pair failed");
        }
    }
}
