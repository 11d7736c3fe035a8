//! The host's `libibverbs.so.1` (rdma-core), loaded at run time, as a `VerbsApi`.
//!
//! Nothing is linked at build time and nothing of rdma-core is bundled (see
//! `DESIGN.md`, "Native libraries"): the host's library and its provider plugins
//! (`libmlx5`, `libefa`, ...) are the ones used, so a process that also runs NCCL holds
//! one libibverbs. The library is opened once per process per request through the
//! core's loader ([`NativeLibrary`]) and never unloaded; [`Libibverbs::report`] says
//! what was bound: its real path, the rdma-core release its file name carries, the
//! providers installed next to it and the driver configuration directory.
//!
//! The declarations are this crate's own (its `ffi::sys` module, checked against the
//! host header by the `abi_layout` test); the calls `verbs.h` makes
//! `static inline` (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`) go through the object's `context->ops`, as the header does.
//! Posting converts the crate's work requests into libibverbs' chained structs in
//! per-thread buffers that are reused, so steady-state posting does not allocate.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr, CString};
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::ptr::{null_mut, NonNull};
use std::sync::{Arc, Mutex};

use nixl::native::{self, BoundObject, NativeLibrary};
pub use nixl::native::{LibraryReport, LibrarySource};
use nixl::{Error, ErrorKind, Result};

use super::sys::*;
use super::VerbsApi;
use crate::api::{
    Channel, Completion, DeviceInfo, DeviceLimits, GidEntry, GidType, Handle, LinkLayer, Mr, Mtu,
    PortInfo, PostError, Qp, QpCaps, QpTransition, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};

/// Default soname of libibverbs (searched the loader's usual way).
pub const DEFAULT_SONAME: &str = "libibverbs.so.1";
/// Environment variable with an explicit libibverbs path (or soname).
pub const ENV_LIB: &str = "NIXL_VERBS_LIB";
/// Where rdma-core reads its provider list (`<name>.driver` files) by default.
pub const DRIVER_CONFIG_DIR: &str = "/etc/libibverbs.d";

/// What the distributions call the packages that carry libibverbs and its providers.
const HOW_TO_INSTALL: &str =
    "install libibverbs1 and ibverbs-providers (Debian/Ubuntu) or rdma-core";

/// Completions taken from the provider per `poll_cq` call (a stack buffer).
const POLL_BATCH: usize = 32;

/// The host's libibverbs, bound. Cheap to share ([`Arc`]); its functions stay valid
/// for the life of the process.
pub struct Libibverbs {
    get_device_list: GetDeviceListFn,
    free_device_list: FreeDeviceListFn,
    get_device_name: GetDeviceNameFn,
    get_device_guid: GetDeviceGuidFn,
    open_device: OpenDeviceFn,
    close_device: CloseDeviceFn,
    query_device: QueryDeviceFn,
    query_port: QueryPortFn,
    query_gid: QueryGidFn,
    /// `_ibv_query_gid_ex`, where the library has it (rdma-core 32 and later).
    query_gid_ex: Option<QueryGidExFn>,
    alloc_pd: AllocPdFn,
    dealloc_pd: DeallocPdFn,
    reg_mr: RegMrFn,
    /// `ibv_reg_dmabuf_mr`, where the library has it (rdma-core 34 and later).
    reg_dmabuf_mr: Option<RegDmabufMrFn>,
    dereg_mr: DeregMrFn,
    create_comp_channel: CreateCompChannelFn,
    destroy_comp_channel: DestroyCompChannelFn,
    create_cq: CreateCqFn,
    destroy_cq: DestroyCqFn,
    get_cq_event: GetCqEventFn,
    ack_cq_events: AckCqEventsFn,
    create_qp: CreateQpFn,
    modify_qp: ModifyQpFn,
    destroy_qp: DestroyQpFn,
    wc_status_str: WcStatusStrFn,
    report: LibraryReport,
}

impl fmt::Debug for Libibverbs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Libibverbs")
            .field("path", &self.report.object("libibverbs"))
            .field("version", &self.report.version)
            .field("query_gid_ex", &self.query_gid_ex.is_some())
            .finish_non_exhaustive()
    }
}

/// Libraries bound in this process, by request. Never unloaded.
static BOUND: Mutex<Option<HashMap<String, Arc<Libibverbs>>>> = Mutex::new(None);

impl Libibverbs {
    /// The library [`ENV_LIB`] names (a path or a soname), else [`DEFAULT_SONAME`].
    /// Loaded once per process per request; later calls return the same binding.
    ///
    /// # Errors
    /// [`ErrorKind::UnavailableLibrary`] when the library cannot be loaded (saying how
    /// to install it) or lacks a function this crate needs (naming it).
    pub fn load() -> Result<Arc<Self>> {
        match std::env::var(ENV_LIB) {
            Ok(v) if !v.is_empty() => bind(&v, LibrarySource::Env),
            _ => bind(DEFAULT_SONAME, LibrarySource::Default),
        }
    }

    /// The library `name` (a path or a soname), whatever the environment says.
    ///
    /// # Errors
    /// As [`Libibverbs::load`].
    pub fn load_from(name: &str) -> Result<Arc<Self>> {
        bind(name, LibrarySource::Option)
    }

    /// What was bound, and from where.
    pub fn report(&self) -> &LibraryReport {
        &self.report
    }

    /// The RDMA devices present (none where the kernel has no RDMA stack).
    ///
    /// # Errors
    /// When libibverbs cannot list them.
    pub fn rdma_devices(&self) -> Result<Vec<DeviceInfo>> {
        VerbsApi::devices(self)
    }

    /// libibverbs' text for a completion status.
    pub fn status_text(&self, status: WcStatus) -> String {
        VerbsApi::status_str(self, status)
    }

    fn device_list(&self) -> Result<DeviceList<'_>> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid place for the count; the list is freed by DeviceList.
        let list = unsafe { (self.get_device_list)(&mut n) };
        match NonNull::new(list) {
            Some(list) => Ok(DeviceList {
                lib: self,
                list: Some(list),
                len: usize::try_from(n).unwrap_or(0),
            }),
            None => {
                let errno = last_errno();
                if errno == libc::ENOSYS {
                    // The kernel has no RDMA stack (no /sys/class/infiniband_verbs):
                    // no devices, not an error.
                    tracing::debug!("ibv_get_device_list: no RDMA support in the kernel");
                    Ok(DeviceList {
                        lib: self,
                        list: None,
                        len: 0,
                    })
                } else {
                    Err(errno_error("ibv_get_device_list", errno, String::new()))
                }
            }
        }
    }

    /// The name of `dev`, a device of a live list.
    fn device_name(&self, dev: *mut ibv_device) -> String {
        // SAFETY: `dev` is an entry of a device list that is still live.
        let name = unsafe { (self.get_device_name)(dev) };
        if name.is_null() {
            return String::new();
        }
        // SAFETY: libibverbs returns the device's NUL-terminated name, stored in the
        // device, which lives as long as the list; copied out at once.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A device list, freed on drop.
struct DeviceList<'a> {
    lib: &'a Libibverbs,
    /// `None` when the library returned no list (no RDMA in the kernel).
    list: Option<NonNull<*mut ibv_device>>,
    len: usize,
}

impl DeviceList<'_> {
    fn devices(&self) -> &[*mut ibv_device] {
        match self.list {
            // SAFETY: libibverbs returned `len` device pointers (then a NULL) at
            // `list`, valid until the list is freed, which `self` does last.
            Some(list) if self.len > 0 => unsafe {
                std::slice::from_raw_parts(list.as_ptr(), self.len)
            },
            _ => &[],
        }
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        if let Some(list) = self.list {
            // SAFETY: the list came from ibv_get_device_list and is freed once; opened
            // contexts keep their own reference to their device.
            unsafe { (self.lib.free_device_list)(list.as_ptr()) }
        }
    }
}

/// Handle → object pointer; a null handle is an argument error rather than a crash.
fn obj<T>(h: Handle, op: &'static str) -> Result<*mut T> {
    if h.0 == 0 {
        return Err(Error::new(ErrorKind::InvalidArgument, op, "a null handle"));
    }
    Ok(h.0 as *mut T)
}

fn handle<T>(p: *mut T) -> Handle {
    Handle(p as usize)
}

/// The calling thread's `errno`.
fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `errno` text: `Cannot allocate memory (errno 12)`.
fn errno_text(errno: i32) -> String {
    if errno == 0 {
        return "failed without setting errno".to_owned();
    }
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    let text = text
        .strip_suffix(&format!(" (os error {errno})"))
        .unwrap_or(&text);
    format!("{text} (errno {errno})")
}

/// What to do about `errno` from `op`, where there is something to say.
fn hint(op: &str, errno: i32) -> Option<&'static str> {
    match (op, errno) {
        ("ibv_reg_mr" | "ibv_create_cq" | "ibv_create_qp", libc::ENOMEM) => {
            Some("check RLIMIT_MEMLOCK (ulimit -l): registered memory and queues are pinned")
        }
        ("ibv_reg_mr", libc::EFAULT) => Some("the range is not mapped in this process"),
        ("ibv_post_send", libc::ENOMEM) => {
            Some("the send queue is full (more outstanding than max_send_wr)")
        }
        ("ibv_post_recv", libc::ENOMEM) => {
            Some("the receive queue is full (more outstanding than max_recv_wr)")
        }
        ("ibv_post_send" | "ibv_post_recv", libc::EINVAL) => Some(
            "a work request the queue pair cannot take (too many entries, inline data over max_inline_data, or not in RTS)",
        ),
        (_, libc::EPERM | libc::EACCES) => Some(
            "no access to /dev/infiniband/uverbs* (device permissions, or a container started without the RDMA devices)",
        ),
        _ => None,
    }
}

/// A failed verbs call: [`ErrorKind::Backend`] with the function, the errno text,
/// `detail` (what it was doing) and a hint.
fn errno_error(op: &'static str, errno: i32, detail: String) -> Error {
    let mut msg = errno_text(errno);
    if !detail.is_empty() {
        msg.push(' ');
        msg.push_str(&detail);
    }
    if let Some(h) = hint(op, errno) {
        msg.push_str("; ");
        msg.push_str(h);
    }
    Error::new(ErrorKind::Backend, op, msg)
}

/// The errno of a failed call's return value: libibverbs returns the errno itself
/// (most calls), or -1 with `errno` set (a few, and some providers), or a negated one
/// (some providers' data path).
fn errno_of(rc: c_int) -> i32 {
    match rc {
        -1 => last_errno(),
        r if r < 0 => r.saturating_neg(),
        r => r,
    }
}

/// `Ok` for 0, else the error of [`errno_of`] `rc`.
fn check(op: &'static str, rc: c_int, detail: impl FnOnce() -> String) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(errno_error(op, errno_of(rc), detail()))
    }
}

fn to_c_int(v: u32, op: &'static str, what: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| {
        Error::new(
            ErrorKind::InvalidArgument,
            op,
            format!("{what} {v} does not fit a C int"),
        )
    })
}

fn non_negative(v: c_int) -> u32 {
    u32::try_from(v).unwrap_or(0)
}

fn gid_type(t: u32) -> GidType {
    match t {
        IBV_GID_TYPE_IB => GidType::Ib,
        IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
        IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
        other => GidType::Other(other),
    }
}

fn wc_opcode(op: u32) -> WcOpcode {
    match op {
        IBV_WC_SEND => WcOpcode::Send,
        IBV_WC_RDMA_WRITE => WcOpcode::Write,
        IBV_WC_RDMA_READ => WcOpcode::Read,
        IBV_WC_RECV => WcOpcode::Recv,
        other => WcOpcode::Other(other),
    }
}

fn completion(wc: &ibv_wc) -> Completion {
    Completion {
        wr_id: wc.wr_id,
        status: WcStatus(wc.status),
        opcode: wc_opcode(wc.opcode),
        byte_len: wc.byte_len,
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
    }
}

fn sge(s: &Sge) -> ibv_sge {
    ibv_sge {
        addr: s.addr,
        length: s.len,
        lkey: s.lkey,
    }
}

/// The attributes and mask of one queue-pair transition.
fn qp_attr(to: &QpTransition) -> (ibv_qp_attr, c_int) {
    let mut a = ibv_qp_attr::ZERO;
    let mask = match *to {
        QpTransition::Init {
            port,
            pkey_index,
            access,
        } => {
            a.qp_state = IBV_QPS_INIT;
            a.pkey_index = pkey_index;
            a.port_num = port;
            a.qp_access_flags = access;
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
        }
        QpTransition::Rtr {
            path_mtu,
            dest_qp_num,
            rq_psn,
            max_dest_rd_atomic,
            min_rnr_timer,
            av,
        } => {
            a.qp_state = IBV_QPS_RTR;
            a.path_mtu = u32::from(path_mtu.0);
            a.dest_qp_num = dest_qp_num;
            a.rq_psn = rq_psn;
            a.max_dest_rd_atomic = max_dest_rd_atomic;
            a.min_rnr_timer = min_rnr_timer;
            a.ah_attr.dlid = av.dlid;
            a.ah_attr.sl = av.sl;
            a.ah_attr.port_num = av.port;
            if let Some(g) = av.grh {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = g.dgid;
                a.ah_attr.grh.sgid_index = g.sgid_index;
                a.ah_attr.grh.hop_limit = g.hop_limit;
                a.ah_attr.grh.traffic_class = g.traffic_class;
            }
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER
        }
        QpTransition::Rts {
            sq_psn,
            timeout,
            retry_cnt,
            rnr_retry,
            max_rd_atomic,
        } => {
            a.qp_state = IBV_QPS_RTS;
            a.sq_psn = sq_psn;
            a.timeout = timeout;
            a.retry_cnt = retry_cnt;
            a.rnr_retry = rnr_retry;
            a.max_rd_atomic = max_rd_atomic;
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC
        }
        QpTransition::Error => {
            a.qp_state = IBV_QPS_ERR;
            IBV_QP_STATE
        }
    };
    (a, mask)
}

fn transition_name(to: &QpTransition) -> &'static str {
    match to {
        QpTransition::Init { .. } => "INIT",
        QpTransition::Rtr { .. } => "RTR",
        QpTransition::Rts { .. } => "RTS",
        QpTransition::Error => "ERROR",
    }
}

/// Reusable per-thread buffers for posting (`ibv_send_wr` chains and their entries).
#[derive(Default)]
struct SendScratch {
    wrs: Vec<ibv_send_wr>,
    sges: Vec<ibv_sge>,
}

/// Reusable per-thread buffers for posting receives.
#[derive(Default)]
struct RecvScratch {
    wrs: Vec<ibv_recv_wr>,
    sges: Vec<ibv_sge>,
}

thread_local! {
    static SEND_SCRATCH: RefCell<SendScratch> = RefCell::new(SendScratch::default());
    static RECV_SCRATCH: RefCell<RecvScratch> = RefCell::new(RecvScratch::default());
}

/// How many work requests of a chain of `n` at `base` were accepted before `bad`.
fn accepted_before<T>(base: *const T, bad: *const T, n: usize) -> usize {
    let size = std::mem::size_of::<T>();
    let (b, x) = (base as usize, bad as usize);
    if bad.is_null() || x < b || size == 0 {
        return 0;
    }
    ((x - b) / size).min(n)
}

fn post_error(posted: usize, error: Error) -> PostError {
    PostError { posted, error }
}

fn invalid_post(op: &'static str, what: String) -> PostError {
    post_error(0, Error::new(ErrorKind::InvalidArgument, op, what))
}

impl SendScratch {
    /// Build the chain for `wrs` and post it with `post`.
    ///
    /// # Safety
    /// `qp` is a live queue pair whose context's `post_send` is `post`; the memory
    /// conditions of `VerbsApi::post_send` hold.
    unsafe fn post(
        &mut self,
        post: PostSendFn,
        qp: *mut ibv_qp,
        wrs: &[SendWr],
        sges: &[Sge],
    ) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_send";
        let Self {
            wrs: chain,
            sges: entries,
        } = self;
        entries.clear();
        entries.extend(sges.iter().map(sge));
        chain.clear();
        chain.reserve(wrs.len());
        let sge_base = entries.as_mut_ptr();
        for (i, w) in wrs.iter().enumerate() {
            let (first, num) = (w.first_sge as usize, w.num_sge as usize);
            if first.checked_add(num).is_none_or(|end| end > sges.len()) {
                return Err(invalid_post(
                    OP,
                    format!(
                        "work request {i} names entries {first}..{} of {}",
                        first.saturating_add(num),
                        sges.len()
                    ),
                ));
            }
            let num_sge = to_c_int(w.num_sge, OP, "num_sge").map_err(|e| post_error(0, e))?;
            let mut wr = ibv_send_wr::ZERO;
            wr.wr_id = w.wr_id;
            // In bounds (checked above): `first <= entries.len()`.
            wr.sg_list = if num == 0 {
                null_mut()
            } else {
                sge_base.wrapping_add(first)
            };
            wr.num_sge = num_sge;
            match w.op {
                SendOp::Write { remote_addr, rkey } => {
                    wr.opcode = IBV_WR_RDMA_WRITE;
                    wr.wr.rdma = ibv_send_wr_rdma { remote_addr, rkey };
                }
                SendOp::Read { remote_addr, rkey } => {
                    wr.opcode = IBV_WR_RDMA_READ;
                    wr.wr.rdma = ibv_send_wr_rdma { remote_addr, rkey };
                }
                SendOp::Send => wr.opcode = IBV_WR_SEND,
            }
            wr.send_flags = (if w.signaled { IBV_SEND_SIGNALED } else { 0 })
                | (if w.fence { IBV_SEND_FENCE } else { 0 })
                | (if w.inline { IBV_SEND_INLINE } else { 0 });
            chain.push(wr);
        }
        let n = chain.len();
        let base = chain.as_mut_ptr();
        for i in 1..n {
            // SAFETY: `i - 1` and `i` are below `n`, the chain's length; nothing else
            // refers to the buffer while it is linked and posted.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ibv_send_wr = null_mut();
        // SAFETY: `qp` is live and `post` its provider's post_send (caller); the chain
        // is `n` linked, initialised requests whose gather lists point into `entries`,
        // all alive until the call returns (the provider copies them into its queue);
        // the memory they name is the caller's promise.
        let rc = unsafe { post(qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let posted = accepted_before(base, bad, n);
        Err(post_error(
            posted,
            errno_error(OP, errno_of(rc), format!("at work request {posted} of {n}")),
        ))
    }
}

impl RecvScratch {
    /// Build the chain for `wrs` and post it with `post`.
    ///
    /// # Safety
    /// As [`SendScratch::post`], for receives.
    unsafe fn post(
        &mut self,
        post: PostRecvFn,
        qp: *mut ibv_qp,
        wrs: &[RecvWr],
    ) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_recv";
        let Self {
            wrs: chain,
            sges: entries,
        } = self;
        entries.clear();
        entries.extend(wrs.iter().map(|w| sge(&w.sge)));
        chain.clear();
        chain.reserve(wrs.len());
        let sge_base = entries.as_mut_ptr();
        for (i, w) in wrs.iter().enumerate() {
            let mut wr = ibv_recv_wr::ZERO;
            wr.wr_id = w.wr_id;
            // In bounds: one entry per request.
            wr.sg_list = sge_base.wrapping_add(i);
            wr.num_sge = 1;
            chain.push(wr);
        }
        let n = chain.len();
        let base = chain.as_mut_ptr();
        for i in 1..n {
            // SAFETY: `i - 1` and `i` are below `n`, the chain's length; nothing else
            // refers to the buffer while it is linked and posted.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ibv_recv_wr = null_mut();
        // SAFETY: `qp` is live and `post` its provider's post_recv (caller); the chain
        // is `n` linked requests of one entry each in `entries`, alive until the call
        // returns; the buffers are the caller's promise.
        let rc = unsafe { post(qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let posted = accepted_before(base, bad, n);
        Err(post_error(
            posted,
            errno_error(OP, errno_of(rc), format!("at work request {posted} of {n}")),
        ))
    }
}

impl VerbsApi for Libibverbs {
    fn describe(&self) -> String {
        let path = self.report.object("libibverbs").map_or_else(
            || self.report.requested.clone(),
            |p| p.display().to_string(),
        );
        format!("libibverbs {} ({path})", self.report.version_string())
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let list = self.device_list()?;
        Ok(list
            .devices()
            .iter()
            .map(|&dev| DeviceInfo {
                name: self.device_name(dev),
                // SAFETY: `dev` is an entry of the live list.
                guid: u64::from_be(unsafe { (self.get_device_guid)(dev) }),
            })
            .collect())
    }

    fn open(&self, device: &str) -> Result<Handle> {
        const OP: &str = "ibv_open_device";
        let list = self.device_list()?;
        let mut names = Vec::new();
        for &dev in list.devices() {
            let name = self.device_name(dev);
            if name == device {
                // SAFETY: `dev` is an entry of the live list; the context keeps its
                // own reference to the device after the list is freed.
                let ctx = unsafe { (self.open_device)(dev) };
                if ctx.is_null() {
                    return Err(errno_error(OP, last_errno(), format!("opening {device}")));
                }
                return Ok(handle(ctx));
            }
            names.push(name);
        }
        Err(Error::new(
            ErrorKind::NotFound,
            OP,
            if names.is_empty() {
                format!("no RDMA device {device:?}: this host has no RDMA devices")
            } else {
                format!("no RDMA device {device:?}; present: {}", names.join(", "))
            },
        ))
    }

    fn query_device(&self, ctx: Handle) -> Result<DeviceLimits> {
        const OP: &str = "ibv_query_device";
        let ctx = obj::<ibv_context>(ctx, OP)?;
        let mut a = ibv_device_attr::ZERO;
        // SAFETY: `ctx` is a live context (trait contract); `a` is a whole
        // `struct ibv_device_attr` for the library to fill.
        let rc = unsafe { (self.query_device)(ctx, &mut a) };
        check(OP, rc, String::new)?;
        Ok(DeviceLimits {
            max_mr_size: a.max_mr_size,
            max_qp_wr: non_negative(a.max_qp_wr),
            max_sge: non_negative(a.max_sge),
            max_sge_rd: non_negative(a.max_sge_rd),
            max_cqe: non_negative(a.max_cqe),
            max_qp_rd_atom: non_negative(a.max_qp_rd_atom),
            max_qp_init_rd_atom: non_negative(a.max_qp_init_rd_atom),
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    fn query_port(&self, ctx: Handle, port: u8) -> Result<PortInfo> {
        const OP: &str = "ibv_query_port";
        let ctx = obj::<ibv_context>(ctx, OP)?;
        let mut a = ibv_port_attr_compat::ZERO;
        // SAFETY: `ctx` is live; the exported ibv_query_port fills exactly the compat
        // struct `a` is (it passes its own size on to the provider).
        let rc = unsafe { (self.query_port)(ctx, port, &mut a) };
        check(OP, rc, || format!("port {port}"))?;
        Ok(PortInfo {
            state: a.state,
            lid: a.lid,
            active_mtu: Mtu(u8::try_from(a.active_mtu).unwrap_or(0)),
            link_layer: match a.link_layer {
                IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
            gid_tbl_len: non_negative(a.gid_tbl_len),
            max_msg_sz: a.max_msg_sz,
        })
    }

    fn query_gid(&self, ctx: Handle, port: u8, index: u32) -> Result<Option<GidEntry>> {
        let ctx = obj::<ibv_context>(ctx, "ibv_query_gid")?;
        if let Some(query_ex) = self.query_gid_ex {
            const OP: &str = "_ibv_query_gid_ex";
            let mut e = ibv_gid_entry::ZERO;
            // SAFETY: `ctx` is live; `e` is a whole `struct ibv_gid_entry` and its size
            // is passed; flags must be 0.
            let rc = unsafe {
                query_ex(
                    ctx,
                    u32::from(port),
                    index,
                    &mut e,
                    0,
                    std::mem::size_of::<ibv_gid_entry>(),
                )
            };
            return match errno_of(rc) {
                0 => Ok(Some(GidEntry {
                    gid: e.gid.raw,
                    index: e.gid_index,
                    kind: Some(gid_type(e.gid_type)),
                })),
                libc::ENODATA => Ok(None),
                errno => Err(errno_error(OP, errno, format!("port {port} index {index}"))),
            };
        }
        const OP: &str = "ibv_query_gid";
        let c_index = to_c_int(index, OP, "GID index")?;
        let mut gid = ibv_gid::ZERO;
        // SAFETY: `ctx` is live; `gid` is a whole `union ibv_gid`.
        let rc = unsafe { (self.query_gid)(ctx, port, c_index, &mut gid) };
        check(OP, rc, || format!("port {port} index {index}"))?;
        Ok((gid.raw != [0; 16]).then_some(GidEntry {
            gid: gid.raw,
            index,
            kind: None,
        }))
    }

    fn alloc_pd(&self, ctx: Handle) -> Result<Handle> {
        const OP: &str = "ibv_alloc_pd";
        let ctx = obj::<ibv_context>(ctx, OP)?;
        // SAFETY: `ctx` is live.
        let pd = unsafe { (self.alloc_pd)(ctx) };
        if pd.is_null() {
            return Err(errno_error(OP, last_errno(), String::new()));
        }
        Ok(handle(pd))
    }

    unsafe fn reg_mr(&self, pd: Handle, addr: usize, len: usize, access: u32) -> Result<Mr> {
        const OP: &str = "ibv_reg_mr";
        let pd = obj::<ibv_pd>(pd, OP)?;
        let c_access = to_c_int(access, OP, "access flags")?;
        // SAFETY: `pd` is live; the caller keeps the range mapped until dereg_mr.
        let mr = unsafe { (self.reg_mr)(pd, addr as *mut c_void, len, c_access) };
        if mr.is_null() {
            return Err(errno_error(
                OP,
                last_errno(),
                format!("registering {len} bytes at {addr:#x}"),
            ));
        }
        // SAFETY: a non-null result is a live `struct ibv_mr`; its keys are read once.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr {
            handle: handle(mr),
            lkey,
            rkey,
        })
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Handle,
        offset: u64,
        len: usize,
        iova: u64,
        fd: BorrowedFd<'_>,
        access: u32,
    ) -> Result<Mr> {
        const OP: &str = "ibv_reg_dmabuf_mr";
        let Some(reg) = self.reg_dmabuf_mr else {
            return Err(Error::new(
                ErrorKind::NotSupported,
                OP,
                "this libibverbs lacks ibv_reg_dmabuf_mr (rdma-core 34 or later has it)",
            ));
        };
        let pd = obj::<ibv_pd>(pd, OP)?;
        let c_access = to_c_int(access, OP, "access flags")?;
        // SAFETY: `pd` is live, `fd` an open descriptor for the call; the caller
        // keeps the memory behind the dma-buf allocated until dereg_mr.
        let mr = unsafe { reg(pd, offset, len, iova, fd.as_raw_fd(), c_access) };
        if mr.is_null() {
            return Err(errno_error(
                OP,
                last_errno(),
                format!("registering {len} bytes at offset {offset} of a dma-buf as {iova:#x}"),
            ));
        }
        // SAFETY: a non-null result is a live `struct ibv_mr`; its keys are read once.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr {
            handle: handle(mr),
            lkey,
            rkey,
        })
    }

    unsafe fn dereg_mr(&self, mr: Handle) -> Result<()> {
        const OP: &str = "ibv_dereg_mr";
        let mr = obj::<ibv_mr>(mr, OP)?;
        // SAFETY: the caller guarantees `mr` is live and unused from now on.
        let rc = unsafe { (self.dereg_mr)(mr) };
        check(OP, rc, String::new)
    }

    fn create_channel(&self, ctx: Handle) -> Result<Channel> {
        const OP: &str = "ibv_create_comp_channel";
        let ctx = obj::<ibv_context>(ctx, OP)?;
        // SAFETY: `ctx` is live.
        let ch = unsafe { (self.create_comp_channel)(ctx) };
        if ch.is_null() {
            return Err(errno_error(OP, last_errno(), String::new()));
        }
        // SAFETY: a non-null result is a live `struct ibv_comp_channel`.
        let fd = unsafe { (*ch).fd };
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL only change
        // its status flags.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            let errno = last_errno();
            // SAFETY: the channel was just created and nothing else refers to it.
            unsafe { (self.destroy_comp_channel)(ch) };
            return Err(errno_error(
                "fcntl(O_NONBLOCK)",
                errno,
                "on a completion channel".into(),
            ));
        }
        Ok(Channel {
            handle: handle(ch),
            fd,
        })
    }

    fn create_cq(&self, ctx: Handle, cqe: u32, channel: Handle) -> Result<Handle> {
        const OP: &str = "ibv_create_cq";
        let ctx = obj::<ibv_context>(ctx, OP)?;
        let c_cqe = to_c_int(cqe, OP, "cqe")?;
        // A zero handle: no channel (polling only).
        let ch = channel.0 as *mut ibv_comp_channel;
        // SAFETY: `ctx` is live and `ch` a live channel of it or null; no user context,
        // completion vector 0 (every device has one).
        let cq = unsafe { (self.create_cq)(ctx, c_cqe, null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(errno_error(OP, last_errno(), format!("of {cqe} entries")));
        }
        Ok(handle(cq))
    }

    fn req_notify_cq(&self, cq: Handle) -> Result<()> {
        const OP: &str = "ibv_req_notify_cq";
        let cq = obj::<ibv_cq>(cq, OP)?;
        // SAFETY: `cq` is live, and so is the context it was created on (closed only
        // after it); `ops` is the provider's table, filled at open.
        let notify = unsafe { (*(*cq).context).ops.req_notify_cq };
        let notify = notify.ok_or_else(|| missing_op(OP))?;
        // SAFETY: the provider's req_notify_cq on its own live queue; 0: any completion.
        let rc = unsafe { notify(cq, 0) };
        check(OP, rc, String::new)
    }

    fn get_cq_event(&self, channel: Handle) -> Result<Option<Handle>> {
        const OP: &str = "ibv_get_cq_event";
        let ch = obj::<ibv_comp_channel>(channel, OP)?;
        loop {
            let mut cq: *mut ibv_cq = null_mut();
            let mut cq_context: *mut c_void = null_mut();
            // SAFETY: `ch` is live; both out-pointers are valid places; its descriptor
            // is non-blocking, so this reads or fails at once.
            let rc = unsafe { (self.get_cq_event)(ch, &mut cq, &mut cq_context) };
            if rc == 0 {
                return Ok(Some(handle(cq)));
            }
            match last_errno() {
                libc::EAGAIN => return Ok(None),
                libc::EINTR => continue,
                errno => return Err(errno_error(OP, errno, String::new())),
            }
        }
    }

    fn ack_cq_events(&self, cq: Handle, events: u32) {
        if cq.0 == 0 || events == 0 {
            return;
        }
        // SAFETY: `cq` is live (trait contract); acknowledging takes its lock only.
        unsafe { (self.ack_cq_events)(cq.0 as *mut ibv_cq, events) }
    }

    fn poll_cq(&self, cq: Handle, out: &mut [Completion]) -> Result<usize> {
        const OP: &str = "ibv_poll_cq";
        let cq = obj::<ibv_cq>(cq, OP)?;
        // SAFETY: as in req_notify_cq: the queue and its context are live.
        let poll = unsafe { (*(*cq).context).ops.poll_cq };
        let poll = poll.ok_or_else(|| missing_op(OP))?;
        let mut wc = [ibv_wc::ZERO; POLL_BATCH];
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(POLL_BATCH);
            // SAFETY: the provider's poll_cq on its own live queue, writing at most
            // `want` (<= POLL_BATCH, fits an int) entries into `wc`.
            let n = unsafe { poll(cq, want as c_int, wc.as_mut_ptr()) };
            if n < 0 {
                if done > 0 {
                    // Hand over what was taken; the error comes back on the next poll.
                    break;
                }
                return Err(Error::new(
                    ErrorKind::Backend,
                    OP,
                    format!("the provider's poll_cq returned {n}: the completion queue is in error (overrun?)"),
                ));
            }
            let n = (n as usize).min(want);
            for (o, w) in out[done..].iter_mut().zip(&wc[..n]) {
                *o = completion(w);
            }
            done += n;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> Result<Qp> {
        const OP: &str = "ibv_create_qp";
        let pd = obj::<ibv_pd>(pd, OP)?;
        let cq = obj::<ibv_cq>(cq, OP)?;
        let mut init = ibv_qp_init_attr::ZERO;
        init.send_cq = cq;
        init.recv_cq = cq;
        init.cap = ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        init.qp_type = IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: `pd` and `cq` are live objects of one context; `init` is a whole
        // `struct ibv_qp_init_attr`, into whose `cap` the library writes what it
        // granted.
        let qp = unsafe { (self.create_qp)(pd, &mut init) };
        if qp.is_null() {
            return Err(errno_error(
                OP,
                last_errno(),
                format!("asking for {caps:?}"),
            ));
        }
        // SAFETY: a non-null result is a live `struct ibv_qp`.
        let qp_num = unsafe { (*qp).qp_num };
        let c = init.cap;
        Ok(Qp {
            handle: handle(qp),
            qp_num,
            caps: QpCaps {
                max_send_wr: c.max_send_wr,
                max_recv_wr: c.max_recv_wr,
                max_send_sge: c.max_send_sge,
                max_recv_sge: c.max_recv_sge,
                max_inline_data: c.max_inline_data,
            },
        })
    }

    fn modify_qp(&self, qp: Handle, to: &QpTransition) -> Result<()> {
        const OP: &str = "ibv_modify_qp";
        let qp = obj::<ibv_qp>(qp, OP)?;
        let (mut attr, mask) = qp_attr(to);
        // SAFETY: `qp` is live; `attr` is a whole `struct ibv_qp_attr` whose fields
        // named by `mask` are set.
        let rc = unsafe { (self.modify_qp)(qp, &mut attr, mask) };
        check(OP, rc, || format!("to {}", transition_name(to)))
    }

    unsafe fn post_send(
        &self,
        qp: Handle,
        wrs: &[SendWr],
        sges: &[Sge],
    ) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_send";
        if wrs.is_empty() {
            return Ok(());
        }
        let qp = obj::<ibv_qp>(qp, OP).map_err(|e| post_error(0, e))?;
        // SAFETY: as in req_notify_cq: the queue pair and its context are live.
        let post = unsafe { (*(*qp).context).ops.post_send };
        let post = post.ok_or_else(|| post_error(0, missing_op(OP)))?;
        SEND_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            // SAFETY: `qp` is live with `post` as its provider's post_send; the
            // memory conditions are the caller's.
            Ok(mut s) => unsafe { s.post(post, qp, wrs, sges) },
            // Re-entered on this thread (never in practice): fresh buffers.
            // SAFETY: as above.
            Err(_) => unsafe { SendScratch::default().post(post, qp, wrs, sges) },
        })
    }

    unsafe fn post_recv(&self, qp: Handle, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        const OP: &str = "ibv_post_recv";
        if wrs.is_empty() {
            return Ok(());
        }
        let qp = obj::<ibv_qp>(qp, OP).map_err(|e| post_error(0, e))?;
        // SAFETY: as in req_notify_cq: the queue pair and its context are live.
        let post = unsafe { (*(*qp).context).ops.post_recv };
        let post = post.ok_or_else(|| post_error(0, missing_op(OP)))?;
        RECV_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            // SAFETY: `qp` is live with `post` as its provider's post_recv; the
            // buffers are the caller's promise.
            Ok(mut s) => unsafe { s.post(post, qp, wrs) },
            // SAFETY: as above, with fresh buffers (re-entered on this thread).
            Err(_) => unsafe { RecvScratch::default().post(post, qp, wrs) },
        })
    }

    unsafe fn destroy_qp(&self, qp: Handle) -> Result<()> {
        const OP: &str = "ibv_destroy_qp";
        let qp = obj::<ibv_qp>(qp, OP)?;
        // SAFETY: the caller guarantees `qp` is live and unused from now on.
        let rc = unsafe { (self.destroy_qp)(qp) };
        check(OP, rc, String::new)
    }

    unsafe fn destroy_cq(&self, cq: Handle) -> Result<()> {
        const OP: &str = "ibv_destroy_cq";
        let cq = obj::<ibv_cq>(cq, OP)?;
        // SAFETY: the caller guarantees `cq` is live, unused from now on, its queue
        // pairs gone and its events acknowledged.
        let rc = unsafe { (self.destroy_cq)(cq) };
        check(OP, rc, String::new)
    }

    unsafe fn destroy_channel(&self, channel: Handle) -> Result<()> {
        const OP: &str = "ibv_destroy_comp_channel";
        let ch = obj::<ibv_comp_channel>(channel, OP)?;
        // SAFETY: the caller guarantees `ch` is live, unused from now on and that
        // its completion queues are gone.
        let rc = unsafe { (self.destroy_comp_channel)(ch) };
        check(OP, rc, String::new)
    }

    unsafe fn dealloc_pd(&self, pd: Handle) -> Result<()> {
        const OP: &str = "ibv_dealloc_pd";
        let pd = obj::<ibv_pd>(pd, OP)?;
        // SAFETY: the caller guarantees `pd` is live and unused from now on.
        let rc = unsafe { (self.dealloc_pd)(pd) };
        check(OP, rc, String::new)
    }

    unsafe fn close(&self, ctx: Handle) -> Result<()> {
        const OP: &str = "ibv_close_device";
        let ctx = obj::<ibv_context>(ctx, OP)?;
        // SAFETY: the caller guarantees `ctx` is live and everything made from it gone.
        let rc = unsafe { (self.close_device)(ctx) };
        check(OP, rc, String::new)
    }

    fn status_str(&self, status: WcStatus) -> String {
        let Ok(code) = c_int::try_from(status.0) else {
            return format!("unknown status {}", status.0);
        };
        // SAFETY: ibv_wc_status_str takes any value and returns a static string
        // ("unknown" for values it does not know).
        let s = unsafe { (self.wc_status_str)(code) };
        if s.is_null() {
            return format!("unknown status {}", status.0);
        }
        // SAFETY: a non-null result is a static NUL-terminated string.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

fn missing_op(op: &'static str) -> Error {
    Error::new(
        ErrorKind::Backend,
        op,
        "the device's provider has no such entry point",
    )
}

// --- Loading and the report. ----------------------------------------------------------

fn unavailable(requested: &str, source: LibrarySource, detail: &str) -> Error {
    let how = match source {
        LibrarySource::Default => {
            format!("{DEFAULT_SONAME} not found; {HOW_TO_INSTALL}, or set {ENV_LIB}")
        }
        LibrarySource::Env => format!("{ENV_LIB}={requested} cannot be loaded"),
        LibrarySource::Option => format!("libibverbs {requested:?} cannot be loaded"),
    };
    Error::new(
        ErrorKind::UnavailableLibrary,
        "load libibverbs",
        format!("{how}: {detail}"),
    )
}

/// The rdma-core release in the real file name of libibverbs
/// (`libibverbs.so.1.14.44.0` → `44.0`), and its library ABI (`1.14`).
fn version_of(path: &Path) -> Option<(String, String)> {
    let name = path.file_name()?.to_str()?;
    let parts: Vec<&str> = name.strip_prefix("libibverbs.so.")?.split('.').collect();
    if parts.len() < 4 || !parts.iter().all(|p| p.parse::<u32>().is_ok()) {
        return None;
    }
    Some((parts[2..].join("."), format!("{}.{}", parts[0], parts[1])))
}

/// Provider plugins in `dir` (`lib<name>-rdmav<abi>.so`): names, sorted, and the
/// provider ABIs seen.
fn providers_in(dir: &Path) -> (Vec<String>, Vec<String>) {
    let mut names = Vec::new();
    let mut abis = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let file = entry.file_name();
        let Some(stem) = file
            .to_str()
            .and_then(|f| f.strip_prefix("lib"))
            .and_then(|f| f.strip_suffix(".so"))
        else {
            continue;
        };
        if let Some((name, abi)) = stem.rsplit_once("-rdmav") {
            names.push(name.to_owned());
            let abi = format!("rdmav{abi}");
            if !abis.contains(&abi) {
                abis.push(abi);
            }
        }
    }
    names.sort();
    abis.sort();
    (names, abis)
}

/// What the report says besides the library itself: providers, driver
/// configuration, kernel support, GID query.
fn notes(lib_path: Option<&Path>, abi: Option<&str>, has_gid_ex: bool) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(abi) = abi {
        notes.push(format!("libibverbs ABI {abi}"));
    }
    match lib_path.and_then(Path::parent) {
        Some(dir) => {
            let pdir = dir.join("libibverbs");
            let (names, abis) = providers_in(&pdir);
            if names.is_empty() {
                notes.push(format!(
                    "no provider plugins in {} (install ibverbs-providers / rdma-core): devices cannot be opened",
                    pdir.display()
                ));
            } else {
                notes.push(format!(
                    "providers in {} ({}): {}",
                    pdir.display(),
                    abis.join(", "),
                    names.join(", ")
                ));
            }
        }
        None => notes.push("providers: unknown (the library's path is unknown)".into()),
    }
    let conf = Path::new(DRIVER_CONFIG_DIR);
    match std::fs::read_dir(conf) {
        Ok(d) => {
            let mut drivers: Vec<String> = d
                .flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_suffix(".driver"))
                        .map(str::to_owned)
                })
                .collect();
            drivers.sort();
            notes.push(format!(
                "driver config {DRIVER_CONFIG_DIR}: {} .driver files",
                drivers.len()
            ));
        }
        Err(_) => notes.push(format!(
            "driver config {DRIVER_CONFIG_DIR} absent (providers are found only through RDMAV_DRIVERS or the built-in list)"
        )),
    }
    for var in ["RDMAV_DRIVERS", "IBV_DRIVERS"] {
        if let Ok(v) = std::env::var(var) {
            notes.push(format!("{var}={v}"));
        }
    }
    if !Path::new("/sys/class/infiniband_verbs").exists() {
        notes
            .push("the kernel exposes no RDMA devices (/sys/class/infiniband_verbs absent)".into());
    }
    if !has_gid_ex {
        notes.push("_ibv_query_gid_ex absent (rdma-core older than 32): GID types unknown".into());
    }
    notes
}

/// Load (or reuse) libibverbs for `requested`.
fn bind(requested: &str, source: LibrarySource) -> Result<Arc<Libibverbs>> {
    let mut guard = BOUND.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(lib) = map.get(requested) {
        return Ok(lib.clone());
    }
    if requested.contains('/') && !Path::new(requested).exists() {
        return Err(unavailable(requested, source, "no such file"));
    }
    if CString::new(requested).is_err() {
        return Err(unavailable(requested, source, "a name with a NUL byte"));
    }
    let preloaded = native::mapped_objects(&["libibverbs.so"]);
    let requested_was_loaded = native::is_loaded(requested);
    let lib = NativeLibrary::open(requested)
        .map_err(|e| unavailable(requested, source, &e.to_string()))?;
    let lacks = |e: native::LoadError| {
        let name = e.symbol.clone().unwrap_or_default();
        unavailable(
            requested,
            source,
            &format!("it lacks {name}, which this crate needs (not libibverbs, or older than rdma-core 17?): {}", e.message),
        )
    };
    macro_rules! sym {
        ($name:literal, $ty:ty) => {{
            // SAFETY: `$ty` is the symbol's C type as `verbs.h` declares it (ffi/sys.rs;
            // the abi_layout test checks each against the header), and `dlsym` finds
            // its default version (IBVERBS_1.1 for every one bound here; 1.0 for the
            // completion channel calls). The library is never unloaded.
            unsafe { lib.symbol::<$ty>($name) }.map_err(lacks)?
        }};
    }
    let query_gid_ex = {
        // SAFETY: as in `sym!`: `_ibv_query_gid_ex@@IBVERBS_1.11` has this type.
        unsafe { lib.symbol::<QueryGidExFn>("_ibv_query_gid_ex") }.ok()
    };
    let reg_dmabuf_mr = {
        // SAFETY: as in `sym!`: `ibv_reg_dmabuf_mr@@IBVERBS_1.12` has this type.
        unsafe { lib.symbol::<RegDmabufMrFn>("ibv_reg_dmabuf_mr") }.ok()
    };
    let path = lib.path_of_symbol(&["ibv_get_device_list", "ibv_open_device"]);
    let (version, abi) = match path.as_deref().and_then(version_of) {
        Some((v, a)) => (Some(v), Some(a)),
        None => (None, None),
    };
    let other_copies: Vec<PathBuf> = native::mapped_objects(&["libibverbs.so"])
        .into_iter()
        .filter(|p| Some(p) != path.as_ref())
        .collect();
    let report = LibraryReport {
        library: "libibverbs".into(),
        requested: requested.to_owned(),
        source,
        requested_was_loaded,
        preloaded,
        version,
        notes: notes(path.as_deref(), abi.as_deref(), query_gid_ex.is_some()),
        objects: vec![BoundObject {
            name: "libibverbs".into(),
            path,
        }],
        same_installation: true,
        other_copies,
    };
    let bound = Libibverbs {
        get_device_list: sym!("ibv_get_device_list", GetDeviceListFn),
        free_device_list: sym!("ibv_free_device_list", FreeDeviceListFn),
        get_device_name: sym!("ibv_get_device_name", GetDeviceNameFn),
        get_device_guid: sym!("ibv_get_device_guid", GetDeviceGuidFn),
        open_device: sym!("ibv_open_device", OpenDeviceFn),
        close_device: sym!("ibv_close_device", CloseDeviceFn),
        query_device: sym!("ibv_query_device", QueryDeviceFn),
        query_port: sym!("ibv_query_port", QueryPortFn),
        query_gid: sym!("ibv_query_gid", QueryGidFn),
        query_gid_ex,
        alloc_pd: sym!("ibv_alloc_pd", AllocPdFn),
        dealloc_pd: sym!("ibv_dealloc_pd", DeallocPdFn),
        reg_mr: sym!("ibv_reg_mr", RegMrFn),
        reg_dmabuf_mr,
        dereg_mr: sym!("ibv_dereg_mr", DeregMrFn),
        create_comp_channel: sym!("ibv_create_comp_channel", CreateCompChannelFn),
        destroy_comp_channel: sym!("ibv_destroy_comp_channel", DestroyCompChannelFn),
        create_cq: sym!("ibv_create_cq", CreateCqFn),
        destroy_cq: sym!("ibv_destroy_cq", DestroyCqFn),
        get_cq_event: sym!("ibv_get_cq_event", GetCqEventFn),
        ack_cq_events: sym!("ibv_ack_cq_events", AckCqEventsFn),
        create_qp: sym!("ibv_create_qp", CreateQpFn),
        modify_qp: sym!("ibv_modify_qp", ModifyQpFn),
        destroy_qp: sym!("ibv_destroy_qp", DestroyQpFn),
        wc_status_str: sym!("ibv_wc_status_str", WcStatusStrFn),
        report,
    };
    if bound.report.is_mixed() {
        tracing::warn!(report = %bound.report, "more than one libibverbs in this process");
    } else {
        tracing::info!(report = %bound.report, "bound libibverbs");
    }
    let bound = Arc::new(bound);
    map.insert(requested.to_owned(), bound.clone());
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AddressVector, GlobalRoute};

    #[test]
    fn version_comes_from_the_real_file_name() {
        let v = version_of(Path::new(
            "/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0",
        ));
        assert_eq!(v, Some(("44.0".into(), "1.14".into())));
        assert_eq!(version_of(Path::new("/x/libibverbs.so.1")), None);
        assert_eq!(version_of(Path::new("/x/libibverbs.so.1.0.0")), None);
        assert_eq!(version_of(Path::new("/x/libmlx5.so.1.24.44.0")), None);
    }

    #[test]
    fn providers_are_listed_from_the_plugin_directory() {
        let dir = std::env::temp_dir().join(format!("nixl-verbs-prov-{}", std::process::id()));
        let pdir = dir.join("libibverbs");
        std::fs::create_dir_all(&pdir).unwrap();
        for f in [
            "libmlx5-rdmav34.so",
            "libefa-rdmav34.so",
            "README",
            "libfoo.so.1",
        ] {
            std::fs::write(pdir.join(f), b"").unwrap();
        }
        let (names, abis) = providers_in(&pdir);
        assert_eq!(names, ["efa", "mlx5"]);
        assert_eq!(abis, ["rdmav34"]);
        let n = notes(
            Some(&dir.join("libibverbs.so.1.14.44.0")),
            Some("1.14"),
            true,
        );
        assert!(
            n.iter()
                .any(|l| l.contains("efa, mlx5") && l.contains("rdmav34")),
            "{n:?}"
        );
        let empty = std::env::temp_dir().join(format!("nixl-verbs-none-{}", std::process::id()));
        let n = notes(Some(&empty.join("libibverbs.so.1")), None, false);
        assert!(n.iter().any(|l| l.contains("no provider plugins")), "{n:?}");
        assert!(
            n.iter().any(|l| l.contains("_ibv_query_gid_ex absent")),
            "{n:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_name_the_call_the_errno_and_what_to_do() {
        let e = errno_error(
            "ibv_reg_mr",
            libc::ENOMEM,
            "registering 4096 bytes at 0x1000".into(),
        );
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert_eq!(e.operation(), "ibv_reg_mr");
        let s = e.to_string();
        assert!(s.contains("Cannot allocate memory (errno 12)"), "{s}");
        assert!(s.contains("ulimit -l"), "{s}");
        assert!(!s.contains("os error"), "{s}");
        let e = unavailable(DEFAULT_SONAME, LibrarySource::Default, "x: cannot open");
        assert_eq!(e.kind(), ErrorKind::UnavailableLibrary);
        assert!(
            e.to_string().contains(
                "libibverbs.so.1 not found; install libibverbs1 and ibverbs-providers (Debian/Ubuntu) or rdma-core, or set NIXL_VERBS_LIB"
            ),
            "{e}"
        );
        let e = unavailable("/opt/x.so", LibrarySource::Env, "gone");
        assert!(e.to_string().contains("NIXL_VERBS_LIB=/opt/x.so"), "{e}");
    }

    #[test]
    fn return_codes_map_to_errno() {
        assert_eq!(errno_of(12), 12);
        assert_eq!(errno_of(-22), 22);
        assert!(check("x", 0, String::new).is_ok());
        assert_eq!(
            check("x", 22, String::new).unwrap_err().kind(),
            ErrorKind::Backend
        );
    }

    #[test]
    fn transitions_set_their_fields_and_masks() {
        let (a, m) = qp_attr(&QpTransition::Init {
            port: 1,
            pkey_index: 3,
            access: 7,
        });
        assert_eq!(
            m,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
        );
        assert_eq!(
            (a.qp_state, a.port_num, a.pkey_index, a.qp_access_flags),
            (1, 1, 3, 7)
        );

        let av = AddressVector {
            dlid: 9,
            sl: 2,
            port: 1,
            grh: Some(GlobalRoute {
                dgid: [7; 16],
                sgid_index: 3,
                hop_limit: 64,
                traffic_class: 5,
            }),
        };
        let (a, m) = qp_attr(&QpTransition::Rtr {
            path_mtu: Mtu(5),
            dest_qp_num: 0x1234,
            rq_psn: 77,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            av,
        });
        assert_eq!(m, 0x1 | 0x80 | 0x100 | 0x100000 | 0x1000 | 0x20000 | 0x8000);
        assert_eq!(a.qp_state, IBV_QPS_RTR);
        assert_eq!((a.path_mtu, a.dest_qp_num, a.rq_psn), (5, 0x1234, 77));
        assert_eq!((a.max_dest_rd_atomic, a.min_rnr_timer), (16, 12));
        assert_eq!(
            (a.ah_attr.dlid, a.ah_attr.sl, a.ah_attr.port_num),
            (9, 2, 1)
        );
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(a.ah_attr.grh.dgid.raw, [7; 16]);
        assert_eq!(
            (
                a.ah_attr.grh.sgid_index,
                a.ah_attr.grh.hop_limit,
                a.ah_attr.grh.traffic_class
            ),
            (3, 64, 5)
        );
        let (a, _) = qp_attr(&QpTransition::Rtr {
            path_mtu: Mtu(3),
            dest_qp_num: 1,
            rq_psn: 0,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 1,
            av: AddressVector { grh: None, ..av },
        });
        assert_eq!(a.ah_attr.is_global, 0);

        let (a, m) = qp_attr(&QpTransition::Rts {
            sq_psn: 5,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 8,
        });
        assert_eq!(m, 0x1 | 0x200 | 0x400 | 0x800 | 0x10000 | 0x2000);
        assert_eq!(
            (
                a.qp_state,
                a.sq_psn,
                a.timeout,
                a.retry_cnt,
                a.rnr_retry,
                a.max_rd_atomic
            ),
            (3, 5, 14, 7, 7, 8)
        );

        let (a, m) = qp_attr(&QpTransition::Error);
        assert_eq!((a.qp_state, m), (IBV_QPS_ERR, IBV_QP_STATE));
    }

    // A fake provider post_send that records the chain it was given and refuses the
    // third request, to check the conversion and the `posted` count.
    /// What the fake provider saw of one request: id, opcode, flags, entries, remote
    /// address and key.
    type Seen = (u64, u32, u32, Vec<(u64, u32, u32)>, u64, u32);

    thread_local! {
        static SEEN: RefCell<Vec<Seen>> = const { RefCell::new(Vec::new()) };
    }

    unsafe extern "C" fn fake_post_send(
        _qp: *mut ibv_qp,
        mut wr: *mut ibv_send_wr,
        bad: *mut *mut ibv_send_wr,
    ) -> c_int {
        let mut i = 0;
        while !wr.is_null() {
            // SAFETY: the chain under test is well formed.
            let w = unsafe { &*wr };
            if i == 2 {
                // SAFETY: `bad` is the caller's out-pointer.
                unsafe { *bad = wr };
                return libc::ENOMEM;
            }
            let sges = (0..w.num_sge as usize)
                // SAFETY: `num_sge` entries at `sg_list`.
                .map(|k| unsafe { *w.sg_list.add(k) })
                .map(|s| (s.addr, s.length, s.lkey))
                .collect();
            // SAFETY: `rdma` is the member written for these opcodes (zero otherwise).
            let rdma = unsafe { w.wr.rdma };
            SEEN.with(|s| {
                s.borrow_mut().push((
                    w.wr_id,
                    w.opcode,
                    w.send_flags,
                    sges,
                    rdma.remote_addr,
                    rdma.rkey,
                ))
            });
            wr = w.next;
            i += 1;
        }
        0
    }

    #[test]
    fn send_chains_are_built_linked_and_counted() {
        let sges = [
            Sge {
                addr: 0x1000,
                len: 8,
                lkey: 1,
            },
            Sge {
                addr: 0x2000,
                len: 16,
                lkey: 2,
            },
            Sge {
                addr: 0x3000,
                len: 32,
                lkey: 3,
            },
        ];
        let wr = |id, op, first, num| SendWr {
            wr_id: id,
            op,
            first_sge: first,
            num_sge: num,
            signaled: id == 2,
            fence: id == 1,
            inline: false,
        };
        let wrs = [
            wr(
                1,
                SendOp::Write {
                    remote_addr: 0xa,
                    rkey: 5,
                },
                0,
                2,
            ),
            wr(
                2,
                SendOp::Read {
                    remote_addr: 0xb,
                    rkey: 6,
                },
                2,
                1,
            ),
        ];
        let mut s = SendScratch::default();
        // SAFETY: the fake provider reads only the chain.
        unsafe { s.post(fake_post_send, null_mut(), &wrs, &sges) }.unwrap();
        let seen = SEEN.with(|s| std::mem::take(&mut *s.borrow_mut()));
        assert_eq!(seen.len(), 2);
        assert_eq!(
            seen[0],
            (
                1,
                IBV_WR_RDMA_WRITE,
                IBV_SEND_FENCE,
                vec![(0x1000, 8, 1), (0x2000, 16, 2)],
                0xa,
                5
            )
        );
        assert_eq!(
            seen[1],
            (
                2,
                IBV_WR_RDMA_READ,
                IBV_SEND_SIGNALED,
                vec![(0x3000, 32, 3)],
                0xb,
                6
            )
        );
        let cap = s.wrs.capacity();

        // Four requests: the fake refuses the third, so two were posted.
        let four = [
            wrs[0],
            wrs[1],
            wr(3, SendOp::Send, 0, 1),
            wr(4, SendOp::Send, 1, 1),
        ];
        // SAFETY: as above.
        let e = unsafe { s.post(fake_post_send, null_mut(), &four, &sges) }.unwrap_err();
        assert_eq!(e.posted, 2);
        assert_eq!(e.error.operation(), "ibv_post_send");
        assert!(
            e.error.to_string().contains("send queue is full"),
            "{}",
            e.error
        );
        SEEN.with(|s| s.borrow_mut().clear());

        // Entries out of range: refused before the provider sees anything.
        // SAFETY: as above.
        let e = unsafe {
            s.post(
                fake_post_send,
                null_mut(),
                &[wr(9, SendOp::Send, 2, 2)],
                &sges,
            )
        }
        .unwrap_err();
        assert_eq!((e.posted, e.error.kind()), (0, ErrorKind::InvalidArgument));
        assert!(SEEN.with(|s| s.borrow().is_empty()));
        assert!(s.wrs.capacity() >= cap);
    }

    #[test]
    fn a_bad_pointer_outside_the_chain_counts_as_none_posted() {
        let base = 0x1000 as *const ibv_send_wr;
        assert_eq!(accepted_before(base, null_mut(), 4), 0);
        assert_eq!(accepted_before(base, base.wrapping_add(3), 4), 3);
        assert_eq!(accepted_before(base, base.wrapping_add(9), 4), 4);
        assert_eq!(accepted_before(base, 0x800 as *const ibv_send_wr, 4), 0);
    }

    #[test]
    fn completions_convert() {
        let mut wc = ibv_wc::ZERO;
        wc.wr_id = 42;
        wc.status = 5;
        wc.opcode = IBV_WC_RECV;
        wc.byte_len = 100;
        wc.qp_num = 7;
        wc.vendor_err = 0x81;
        let c = completion(&wc);
        assert_eq!(c.wr_id, 42);
        assert_eq!(c.status, WcStatus::WR_FLUSH_ERR);
        assert_eq!(c.opcode, WcOpcode::Recv);
        assert_eq!((c.byte_len, c.qp_num, c.vendor_err), (100, 7, 0x81));
        assert_eq!(wc_opcode(129), WcOpcode::Other(129));
        assert_eq!(gid_type(2), GidType::RoceV2);
        assert_eq!(gid_type(9), GidType::Other(9));
    }

    #[test]
    fn null_handles_are_argument_errors() {
        assert_eq!(
            obj::<ibv_qp>(Handle(0), "x").unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}
