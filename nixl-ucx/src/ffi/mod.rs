//! Everything that touches UCX, and the crate's only `unsafe` code, in three layers:
//!
//! 1. [`sys`]: our own declarations of the UCP structs, constants and function types;
//!    [`loader`]: `dlopen` of libucp and the function table resolved from it.
//! 2. A thin layer turning `ucs_status_t` and status pointers into `Result`s.
//! 3. [`Ucx`]: the safe owner of one context and one worker and of everything made from
//!    them (endpoints, remote keys, memory mappings, requests). It hands out plain ids,
//!    never raw handles, and its `Drop` releases in UCX's order: remote keys, then
//!    endpoints (young ones first get time to finish their wireup, see [`MIN_EP_AGE`];
//!    then force-closed, with bounded progress until they are gone), then memory
//!    mappings, then the worker, then the context (which memory UCX allocated for the
//!    application, an [`Allocation`], keeps until the last one is freed). Work that
//!    keeps application memory alive (a [`Completer`] inside `K`) is handed back only
//!    once UCX can no longer touch that memory.
//!
//! Threading: the worker is created in `UCS_THREAD_MODE_SERIALIZED`; `Ucx` is `Send` but
//! not `Sync`, and every method takes `&mut self`, so calls never overlap. The context
//! is created with `mt_workers_shared`, so UCX locks its context-level calls and an
//! [`Allocation`] may be freed on any thread.
#![allow(unsafe_code)]

mod loader;
mod sys;

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_void, CString};
use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI8, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Completer, MemSegment, RegionRef};

use crate::packed::Padded;

pub(crate) use loader::{open, Loaded};

/// A UCX call that failed.
#[derive(Debug, Clone)]
pub(crate) struct UcxError {
    /// What we called.
    pub(crate) what: &'static str,
    /// The raw `ucs_status_t`.
    pub(crate) status: i8,
    /// `ucs_status_string` of it.
    pub(crate) text: String,
}

impl UcxError {
    /// The peer is gone or unreachable (endpoint and link failures, resets).
    pub(crate) fn is_disconnect(&self) -> bool {
        matches!(
            self.status,
            sys::UCS_ERR_CONNECTION_RESET
                | sys::UCS_ERR_NOT_CONNECTED
                | sys::UCS_ERR_UNREACHABLE
                | sys::UCS_ERR_TIMED_OUT
                | sys::UCS_ERR_CANCELED
        ) || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE)
            .contains(&self.status)
    }
}

impl UcxError {
    /// The receiver declined the message (`UCS_ERR_REJECTED`): how a rendezvous offer
    /// to this crate's handlers fails at its sender.
    #[cfg(test)]
    pub(crate) fn is_rejected(&self) -> bool {
        self.status == sys::UCS_ERR_REJECTED
    }
}

impl fmt::Display for UcxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.what, self.text, self.status)
    }
}

impl std::error::Error for UcxError {}

fn check(api: &sys::Api, what: &'static str, status: sys::Status) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError {
            what,
            status,
            text: loader::status_text(api, status),
        })
    }
}

/// Largest piece one put or get of host memory moves: longer segments are posted in
/// pieces, so a long transfer shows progress as its pieces finish ([`Ucx::advanced`]).
const MAX_PIECE: usize = 4 << 20;

/// The largest piece one put or get moves from or to local memory of `kind`. GPU
/// memory goes whole: UCX's CUDA transports (cuda_ipc above all) pay a fixed cost
/// per operation and move one large block at device speed, so cutting it only
/// slows it down, and one operation finishes quickly enough to show progress.
pub(crate) fn piece_limit(kind: nixl::MemKind) -> usize {
    match kind {
        // Files never reach nixl-ucx (it does not declare them).
        nixl::MemKind::Dram | nixl::MemKind::File { .. } => MAX_PIECE,
        nixl::MemKind::Vram { .. } => usize::MAX,
    }
}

/// Bytes posted between two marks of a one-sided transfer (see [`Flight::marks`]).
const MARK_BYTES: usize = 4 << 20;

/// Release a flight's marks not yet freed. `ucp_request_free` may be given a request
/// still in progress: UCX finishes the operation and frees it then.
fn free_marks<K>(api: &sys::Api, f: &mut Flight<K>) {
    for &req in &f.marks[f.marked..] {
        // SAFETY: live requests of ours, each freed once (the cursor moves past them).
        unsafe { (api.request_free)(req) };
    }
    f.marked = f.marks.len();
}

/// What a non-blocking call returned.
enum Posted {
    Done(sys::Status),
    Pending(*mut c_void),
}

fn posted(p: sys::StatusPtr) -> Posted {
    if sys::ptr_is_ptr(p) {
        Posted::Pending(p)
    } else if sys::ptr_is_err(p) {
        Posted::Done(sys::ptr_status(p))
    } else {
        Posted::Done(sys::UCS_OK)
    }
}

/// An endpoint, as handed out by [`Ucx`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct EpId {
    idx: u32,
    gen: u32,
}

/// A remote key unpacked on one endpoint (an index into that endpoint's keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RkeyId(u32);

/// An operation in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FlightId(u32);

/// A run of `count` equally sized segments of a one-sided transfer: segment `i` is
/// `local` moved `i * local_stride` bytes on, paired with `remote + i * remote_stride`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RmaSeg {
    /// Local memory of the first segment (source of a put, destination of a get).
    pub(crate) local: MemSegment,
    /// Address of the first segment in the peer's address space.
    pub(crate) remote: u64,
    /// Distance between consecutive segments' local starts.
    pub(crate) local_stride: usize,
    /// Distance between consecutive segments' remote starts.
    pub(crate) remote_stride: u64,
    /// Segments in the run (at least 1).
    pub(crate) count: usize,
    /// The peer region's key, unpacked on the endpoint the transfer uses.
    pub(crate) rkey: RkeyId,
    /// Longer segments are posted in pieces of this size ([`piece_limit`]).
    pub(crate) max_piece: usize,
}

/// Work whose memory must stay alive while UCX may touch it: it carries the
/// transfer's [`Completer`], which keeps the transfer's registrations alive.
pub(crate) trait HoldsMemory {
    /// The completer that keeps the memory of every segment posted with this value.
    fn completer(&self) -> Option<&Completer>;
}

enum EpState {
    Free,
    Open {
        raw: sys::Ep,
        err: *mut AtomicI8,
        rkeys: Vec<sys::RKey>,
        created: Instant,
        /// Closed by the owner while too young (see [`MIN_EP_AGE`]): unusable, and
        /// really closed at this time.
        close_at: Option<Instant>,
    },
    Closing {
        req: *mut c_void,
        err: *mut AtomicI8,
    },
}

struct EpSlot {
    gen: u32,
    state: EpState,
}

struct Flight<K> {
    /// Null once finished (then `status` holds the outcome).
    req: *mut c_void,
    status: sys::Status,
    keep: Option<K>,
    /// Requests of some of a one-sided transfer's operations, one per [`MARK_BYTES`]
    /// posted, in posting order; `marks[..marked]` are finished and freed. Their
    /// completions show progress within a long transfer ([`Ucx::advanced`]).
    marks: Vec<*mut c_void>,
    marked: usize,
    /// Buffers UCX reads until the request finishes (active message header and data).
    _header: Vec<u8>,
    _data: Bytes,
}

struct MemEntry {
    /// Our own mapping of the region, or the allocation it lies in (whose mapping
    /// the allocation owns).
    map: Mapping,
    /// Keeps the memory alive for as long as it is mapped.
    _region: RegionRef,
}

enum Mapping {
    Own(sys::MemH),
    Allocated { _alloc: Arc<Allocation> },
}

/// The UCP context: shared by the [`Ucx`] owner and by every [`Allocation`], and
/// cleaned up when the last of them goes (so memory UCX allocated stays valid for as
/// long as the application holds it, even after the backend shut down).
struct Context {
    api: sys::Api,
    raw: sys::Context,
}

// SAFETY: the context is created with `mt_workers_shared`, so UCX serialises its
// context-level calls (memory map/unmap, key packing) with its own lock; `raw` is
// only used through those calls and `ucp_cleanup` (in Drop, once, by the last owner).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the last owner: the worker is destroyed (Ucx's Drop does that before
        // letting go) and every mapping of the context is unmapped.
        unsafe { (self.api.cleanup)(self.raw) };
    }
}

/// Memory allocated and mapped by UCX (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`):
/// shared memory that peers on this host map directly, so a put or get into it is a
/// plain copy with no system call and no help from this process. Unmapped (freed)
/// when dropped.
pub(crate) struct Allocation {
    ctx: Arc<Context>,
    memh: sys::MemH,
    addr: *mut u8,
    len: usize,
}

// SAFETY: the memory is owned by this value until it is dropped; `memh` is only used
// in Drop (a context-level call, serialised by UCX, see `Context`) and for key packing
// under the `Ucx` owner.
unsafe impl Send for Allocation {}
// SAFETY: as above; shared access never touches the memory through `&self`.
unsafe impl Sync for Allocation {}

impl Allocation {
    fn contains(&self, addr: u64, len: usize) -> bool {
        let start = self.addr as u64;
        addr >= start && addr.saturating_add(len as u64) <= start + self.len as u64
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: our mapping of a live context (we hold it), unmapped once; no
        // registration uses it any more (each holds an `Arc` of us).
        let st = unsafe { (self.ctx.api.mem_unmap)(self.ctx.raw, self.memh) };
        if let Err(e) = check(&self.ctx.api, "ucp_mem_unmap", st) {
            tracing::warn!(error = %e, "freeing UCX-allocated memory failed");
        }
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

/// Wrap an allocation as memory an agent can register (it keeps the allocation).
pub(crate) fn allocation_memory(a: Arc<Allocation>) -> nixl::Result<nixl::Memory> {
    let (ptr, len) = (a.addr, a.len);
    // SAFETY: `ptr..ptr+len` is host memory UCX allocated and mapped for reading and
    // writing, zero-filled by `Ucx::alloc`; the owner passed along keeps it mapped
    // for as long as the `Memory` and every registration made from it live.
    unsafe { nixl::Memory::from_raw_parts_with_owner(ptr, len, nixl::MemKind::Dram, Some(a)) }
}

/// An incoming active message, as the handler sees it.
#[derive(Debug)]
pub(crate) struct AmIn<'a> {
    /// Our header.
    pub(crate) header: &'a [u8],
    /// The payload; `None` when UCX offered it by rendezvous. This crate and NIXL send
    /// eagerly only, so only a hostile or foreign sender offers one: it is declined
    /// unread (UCX drops it, and the sender's send fails with `UCS_ERR_REJECTED`).
    pub(crate) data: Option<&'a [u8]>,
}

/// The active-message handler. It may return a reply header: when the sender asked
/// for a reply endpoint ([`Ucx::am_send`] with `reply`), the reply goes back at once
/// on that endpoint (eager, no data), so answering never creates an endpoint.
pub(crate) type AmFn = Box<dyn FnMut(AmIn<'_>) -> Option<Vec<u8>> + Send>;

struct AmSlot {
    f: AmFn,
    id: u32,
    api: sys::Api,
    /// Replies UCX has not finished sending: the request and the header it reads.
    replies: Vec<(*mut c_void, Vec<u8>)>,
}

/// Options for [`Ucx::new`].
#[derive(Debug, Clone, Default)]
pub(crate) struct UcxInit {
    /// `ucp_config_modify` pairs (`("TLS", "shm,self")`).
    pub(crate) config: Vec<(String, String)>,
    /// Pairs for transports that may be absent (UCX refuses the key of a transport
    /// whose module did not load): applied when UCX takes them, quietly skipped
    /// otherwise. [`Ucx::optional_applied`] says which were.
    pub(crate) optional: Vec<(String, String)>,
}

/// The owner of one UCP context and one worker (see the module docs).
pub(crate) struct Ucx<K> {
    api: sys::Api,
    ctx: Arc<Context>,
    worker: sys::Worker,
    address: Vec<u8>,
    efd: RawFd,
    memory_types: u64,
    eps: Vec<EpSlot>,
    free_eps: Vec<u32>,
    flights: Vec<Option<Flight<K>>>,
    free_flights: Vec<u32>,
    mems: HashMap<u64, MemEntry>,
    /// Memory this context allocated, by start address.
    allocs: BTreeMap<u64, Weak<Allocation>>,
    /// Active-message handlers, one per id.
    am: Vec<*mut AmSlot>,
    /// How long teardown progresses the worker waiting for closes and requests.
    pub(crate) teardown_bound: Duration,
    /// The keys of [`UcxInit::optional`] UCX took.
    pub(crate) optional_applied: Vec<String>,
}

// SAFETY: the worker is created in UCS_THREAD_MODE_SERIALIZED (any thread may call it,
// one at a time) and the context is not shared between workers; `Ucx` is not `Sync`
// and every call goes through `&mut self`, so no two threads ever call UCX on these
// objects at once. The raw pointers it holds are owned by it alone. `K` and the AM
// closure are `Send`.
unsafe impl<K: Send> Send for Ucx<K> {}

impl<K> fmt::Debug for Ucx<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ucx")
            .field("eps", &(self.eps.len() - self.free_eps.len()))
            .field("flights", &(self.flights.len() - self.free_flights.len()))
            .field("mems", &self.mems.len())
            .finish_non_exhaustive()
    }
}

unsafe extern "C" fn err_trampoline(arg: *mut c_void, _ep: sys::Ep, status: sys::Status) {
    // SAFETY: `arg` is the AtomicI8 we boxed for this endpoint; it is freed only after
    // the endpoint is fully closed or the worker destroyed, after which UCX calls no
    // handler of it.
    let slot = unsafe { &*(arg as *const AtomicI8) };
    let s = if status == sys::UCS_OK {
        sys::UCS_ERR_CONNECTION_RESET
    } else {
        status
    };
    slot.store(s, Ordering::Release);
}

unsafe extern "C" fn am_trampoline(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::AmRecvParam,
) -> sys::Status {
    // SAFETY: `arg` is the AmSlot we registered; it lives until after the worker is
    // destroyed, and UCX calls this only from inside `ucp_worker_progress`, which only
    // `Ucx::progress` (and teardown) call while no other reference to the slot exists.
    let slot = unsafe { &mut *(arg as *mut AmSlot) };
    let attr = if param.is_null() {
        0
    } else {
        // SAFETY: UCX passes a valid parameter struct for the duration of the call.
        unsafe { (*param).recv_attr }
    };
    let header = if header.is_null() || header_length == 0 {
        &[][..]
    } else {
        // SAFETY: UCX guarantees `header_length` readable bytes for the call.
        unsafe { std::slice::from_raw_parts(header as *const u8, header_length) }
    };
    let rndv = attr & sys::AM_RECV_ATTR_FLAG_RNDV != 0;
    let body = if rndv {
        None
    } else if data.is_null() || length == 0 {
        Some(&[][..])
    } else {
        // SAFETY: for eager data UCX guarantees `length` readable bytes for the call.
        Some(unsafe { std::slice::from_raw_parts(data as *const u8, length) })
    };
    let f = &mut slot.f;
    // A panic must not unwind into C.
    let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        f(AmIn { header, data: body })
    }))
    .ok()
    .flatten();
    let reply_ep = if attr & sys::AM_RECV_ATTR_FIELD_REPLY_EP != 0 && !param.is_null() {
        // SAFETY: UCX set the reply endpoint field for the duration of the call.
        unsafe { (*param).reply_ep }
    } else {
        std::ptr::null_mut()
    };
    if let (Some(h), false) = (reply, reply_ep.is_null()) {
        let rp = sys::RequestParam {
            op_attr_mask: sys::OP_ATTR_FIELD_FLAGS,
            flags: sys::AM_SEND_FLAG_EAGER,
            ..Default::default()
        };
        // SAFETY: the reply endpoint UCX handed us, live for this call (sending from
        // a receive callback is allowed; progressing is not, and we do not). The
        // header is moved into the slot below and kept until the request finishes
        // or the worker is destroyed.
        let p = unsafe {
            (slot.api.am_send_nbx)(
                reply_ep,
                slot.id,
                h.as_ptr() as *const c_void,
                h.len(),
                std::ptr::null(),
                0,
                &rp,
            )
        };
        if let Posted::Pending(req) = posted(p) {
            slot.replies.push((req, h));
        }
    }
    if rndv {
        // Declined: an error status makes UCX drop the descriptor itself and fail the
        // sender's `ucp_am_send_nbx` with this status (`ucp_am_recv_callback_t`'s
        // contract, the same in 1.13 and 1.22). The descriptor must not be released
        // here as well: `ucp_am_rndv_process_rts` releases it (and acknowledges the
        // sender) after every callback that neither returned `UCS_INPROGRESS` nor
        // started a receive, so a release here would be a second one.
        return sys::UCS_ERR_REJECTED;
    }
    sys::UCS_OK
}

impl<K: HoldsMemory> Ucx<K> {
    /// Create a context (RMA, active messages, wakeup) and one worker.
    ///
    /// # Errors
    /// The failing UCX call.
    pub(crate) fn new(lib: &'static Loaded, init: &UcxInit) -> Result<Self, UcxError> {
        let api = lib.api;
        let mut config: sys::Config = std::ptr::null_mut();
        // SAFETY: null prefix and file mean "UCX_ environment variables, default
        // file"; `config` is a valid out-pointer.
        check(&api, "ucp_config_read", unsafe {
            (api.config_read)(std::ptr::null(), std::ptr::null(), &mut config)
        })?;
        for (k, v) in &init.config {
            let (Ok(ck), Ok(cv)) = (CString::new(k.as_str()), CString::new(v.as_str())) else {
                continue;
            };
            // SAFETY: `config` is live; both strings are valid C strings.
            let st = unsafe { (api.config_modify)(config, ck.as_ptr(), cv.as_ptr()) };
            if let Err(e) = check(&api, "ucp_config_modify", st) {
                tracing::warn!(key = %k, value = %v, error = %e, "UCX refused a configuration setting; ignoring it");
            }
        }
        let mut optional_applied = Vec::new();
        for (k, v) in &init.optional {
            let (Ok(ck), Ok(cv)) = (CString::new(k.as_str()), CString::new(v.as_str())) else {
                continue;
            };
            // SAFETY: `config` is live; both strings are valid C strings.
            let st = unsafe { (api.config_modify)(config, ck.as_ptr(), cv.as_ptr()) };
            match check(&api, "ucp_config_modify", st) {
                Ok(()) => optional_applied.push(k.clone()),
                Err(e) => {
                    tracing::debug!(key = %k, error = %e, "ucx: optional setting not taken (its transport is not loaded)")
                }
            }
        }
        let params = sys::Params {
            field_mask: sys::PARAM_FIELD_FEATURES | sys::PARAM_FIELD_MT_WORKERS_SHARED,
            features: sys::FEATURE_RMA | sys::FEATURE_AM | sys::FEATURE_WAKEUP,
            // UCX then locks its context-level calls, so an `Allocation` can be
            // freed on any thread while the worker is in use on another.
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut context: sys::Context = std::ptr::null_mut();
        // SAFETY: params and config are valid for the call; 1.13 is the API version
        // our declarations were checked against (and the oldest we accept).
        let st = unsafe { (api.init_version)(1, 13, &params, config, &mut context) };
        // SAFETY: the config is no longer needed once the context exists (or failed).
        unsafe { (api.config_release)(config) };
        check(&api, "ucp_init", st)?;
        let mut attr = sys::ContextAttr {
            field_mask: sys::ATTR_FIELD_MEMORY_TYPES,
            ..Default::default()
        };
        // SAFETY: live context, valid out struct.
        let memory_types = match unsafe { (api.context_query)(context, &mut attr) } {
            sys::UCS_OK => attr.memory_types,
            _ => 1 << sys::MEMORY_TYPE_HOST,
        };
        let wparams = sys::WorkerParams {
            field_mask: sys::WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: sys::THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut worker: sys::Worker = std::ptr::null_mut();
        // SAFETY: live context, valid params and out-pointer.
        let st = unsafe { (api.worker_create)(context, &wparams, &mut worker) };
        if let Err(e) = check(&api, "ucp_worker_create", st) {
            // Cleans the context up (nothing else holds it).
            drop(Context { api, raw: context });
            return Err(e);
        }
        let ctx = Arc::new(Context { api, raw: context });
        let mut me = Self {
            api,
            ctx,
            worker,
            address: Vec::new(),
            efd: -1,
            memory_types,
            eps: Vec::new(),
            free_eps: Vec::new(),
            flights: Vec::new(),
            free_flights: Vec::new(),
            mems: HashMap::new(),
            allocs: BTreeMap::new(),
            am: Vec::new(),
            teardown_bound: Duration::from_secs(2),
            optional_applied,
        };
        // From here on, Drop cleans up whatever fails.
        let mut addr: *mut sys::Address = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker, valid out-pointers.
        check(&api, "ucp_worker_get_address", unsafe {
            (api.worker_get_address)(worker, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`, ours until released.
        me.address = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: releasing exactly what get_address returned, once.
        unsafe { (api.worker_release_address)(worker, addr) };
        let mut efd = -1;
        // SAFETY: live worker created with the WAKEUP feature; valid out-pointer.
        check(&api, "ucp_worker_get_efd", unsafe {
            (api.worker_get_efd)(worker, &mut efd)
        })?;
        me.efd = efd;
        Ok(me)
    }

    /// Bitmask of `ucs_memory_type_t` the context supports.
    pub(crate) fn cuda_supported(&self) -> bool {
        self.memory_types & (1 << sys::MEMORY_TYPE_CUDA) != 0
    }

    /// The worker address peers connect to.
    pub(crate) fn address(&self) -> &[u8] {
        &self.address
    }

    /// The worker's event file descriptor (owned by UCX; valid while `self` lives).
    pub(crate) fn event_fd(&self) -> RawFd {
        self.efd
    }

    /// Install the active-message handler for `id`. Called from inside
    /// [`Ucx::progress`] only.
    ///
    /// # Errors
    /// The failing UCX call.
    pub(crate) fn set_am_handler(&mut self, id: u32, f: AmFn) -> Result<(), UcxError> {
        let slot = Box::into_raw(Box::new(AmSlot {
            f,
            id,
            api: self.api,
            replies: Vec::new(),
        }));
        let param = sys::AmHandlerParam {
            field_mask: sys::AM_HANDLER_PARAM_FIELD_ID
                | sys::AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::AM_HANDLER_PARAM_FIELD_CB
                | sys::AM_HANDLER_PARAM_FIELD_ARG,
            id,
            flags: sys::AM_FLAG_WHOLE_MSG,
            cb: Some(am_trampoline),
            arg: slot as *mut c_void,
            ..Default::default()
        };
        // SAFETY: live worker; the slot outlives the worker (freed in Drop after
        // ucp_worker_destroy).
        let st = unsafe { (self.api.worker_set_am_recv_handler)(self.worker, &param) };
        if let Err(e) = check(&self.api, "ucp_worker_set_am_recv_handler", st) {
            // SAFETY: UCX did not take the slot; we still own it.
            drop(unsafe { Box::from_raw(slot) });
            return Err(e);
        }
        // SAFETY: every slot in `am` is live (freed only here and in Drop).
        if let Some(i) = self.am.iter().position(|&a| unsafe { (*a).id } == id) {
            let old = std::mem::replace(&mut self.am[i], slot);
            // The handler for `id` was replaced; UCX no longer calls the old slot.
            // SAFETY: we own both slots and UCX dropped its reference to the old one
            // above. Replies still in flight move to the new slot, which frees them
            // (and keeps their headers) as the old one would have.
            let mut old = unsafe { Box::from_raw(old) };
            // SAFETY: `slot` is live (just registered) and nothing else touches it now.
            unsafe { (*slot).replies.append(&mut old.replies) };
            drop(old);
        } else {
            self.am.push(slot);
        }
        Ok(())
    }

    /// `ucp_worker_progress`: run callbacks (incoming messages) and complete requests.
    pub(crate) fn progress(&mut self) -> u32 {
        // SAFETY: live worker, serialized access (`&mut self`).
        let n = unsafe { (self.api.worker_progress)(self.worker) };
        let api = self.api;
        for &am in &self.am {
            // SAFETY: the slot lives until after the worker is destroyed, and UCX uses
            // it only inside ucp_worker_progress, which has returned.
            let slot = unsafe { &mut *am };
            slot.replies.retain(|(req, _)| {
                // SAFETY: a live request of a reply, not yet freed.
                if unsafe { (api.request_check_status)(*req) } == sys::UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: finished, freed once (its header is dropped with the entry).
                unsafe { (api.request_free)(*req) };
                false
            });
        }
        n
    }

    /// `ucp_worker_arm`: `Ok(true)` when armed (sleep on the event fd), `Ok(false)` when
    /// events are pending (progress again).
    ///
    /// # Errors
    /// The failing UCX call.
    pub(crate) fn arm(&mut self) -> Result<bool, UcxError> {
        // SAFETY: live worker, serialized access.
        match unsafe { (self.api.worker_arm)(self.worker) } {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            st => check(&self.api, "ucp_worker_arm", st).map(|_| false),
        }
    }

    /// Map a region for remote access; returns the packed remote key.
    ///
    /// # Errors
    /// The failing UCX call.
    pub(crate) fn mem_map(&mut self, region: &RegionRef, cuda: bool) -> Result<Vec<u8>, UcxError> {
        let seg = region.segment();
        if let Some(a) = self.allocation_of(seg.addr(), seg.len()) {
            // Memory this context allocated is mapped already (as shared memory
            // peers can map): advertise that mapping's key.
            let packed = self.pack(a.memh)?;
            self.insert_mem(region, Mapping::Allocated { _alloc: a });
            return Ok(packed);
        }
        let params = sys::MemMapParams {
            field_mask: sys::MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::MEM_MAP_PARAM_FIELD_LENGTH
                | sys::MEM_MAP_PARAM_FIELD_PROT
                | sys::MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: seg.addr() as *mut c_void,
            length: seg.len(),
            prot: sys::MEM_MAP_PROT_LOCAL_READ
                | sys::MEM_MAP_PROT_LOCAL_WRITE
                | sys::MEM_MAP_PROT_REMOTE_READ
                | sys::MEM_MAP_PROT_REMOTE_WRITE,
            memory_type: if cuda {
                sys::MEMORY_TYPE_CUDA
            } else {
                sys::MEMORY_TYPE_HOST
            },
            ..Default::default()
        };
        let mut memh: sys::MemH = std::ptr::null_mut();
        // SAFETY: live context; the address range is registered memory that the
        // RegionRef we store below keeps alive until after ucp_mem_unmap.
        check(&self.api, "ucp_mem_map", unsafe {
            (self.api.mem_map)(self.ctx.raw, &params, &mut memh)
        })?;
        let packed = match self.pack(memh) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the mapping we just made, unmapped once.
                unsafe { (self.api.mem_unmap)(self.ctx.raw, memh) };
                return Err(e);
            }
        };
        self.insert_mem(region, Mapping::Own(memh));
        Ok(packed)
    }

    fn insert_mem(&mut self, region: &RegionRef, map: Mapping) {
        let entry = MemEntry {
            map,
            _region: region.clone(),
        };
        if let Some(old) = self.mems.insert(region.id(), entry) {
            self.unmap(old);
        }
    }

    /// The packed remote key of a mapping.
    fn pack(&self, memh: sys::MemH) -> Result<Vec<u8>, UcxError> {
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live context and memh; valid out-pointers.
        let st = unsafe { (self.api.rkey_pack)(self.ctx.raw, memh, &mut buf, &mut len) };
        check(&self.api, "ucp_rkey_pack", st)?;
        // SAFETY: UCX returned `len` readable bytes at `buf`, ours until released.
        let packed = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
        // SAFETY: releasing exactly the buffer rkey_pack returned, once.
        unsafe { (self.api.rkey_buffer_release)(buf) };
        Ok(packed)
    }

    /// The packed remote key of an allocation of this context.
    #[cfg(test)]
    pub(crate) fn pack_allocation(&self, a: &Allocation) -> Result<Vec<u8>, UcxError> {
        self.pack(a.memh)
    }

    /// The live allocation of this context that holds `addr..addr+len`, if any.
    fn allocation_of(&self, addr: u64, len: usize) -> Option<Arc<Allocation>> {
        let (_, w) = self.allocs.range(..=addr).next_back()?;
        w.upgrade().filter(|a| a.contains(addr, len))
    }

    /// Allocate `len` bytes of host memory through UCX (shared memory on this host's
    /// transports that can do so), zero-filled.
    ///
    /// # Errors
    /// The failing UCX call.
    pub(crate) fn alloc(&mut self, len: usize) -> Result<Arc<Allocation>, UcxError> {
        let params = sys::MemMapParams {
            field_mask: sys::MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::MEM_MAP_PARAM_FIELD_LENGTH
                | sys::MEM_MAP_PARAM_FIELD_FLAGS
                | sys::MEM_MAP_PARAM_FIELD_PROT
                | sys::MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: std::ptr::null_mut(),
            length: len,
            flags: sys::MEM_MAP_ALLOCATE,
            prot: sys::MEM_MAP_PROT_LOCAL_READ
                | sys::MEM_MAP_PROT_LOCAL_WRITE
                | sys::MEM_MAP_PROT_REMOTE_READ
                | sys::MEM_MAP_PROT_REMOTE_WRITE,
            memory_type: sys::MEMORY_TYPE_HOST,
            ..Default::default()
        };
        let mut memh: sys::MemH = std::ptr::null_mut();
        // SAFETY: live context; valid params and out-pointer (a null address with
        // ALLOCATE lets UCX choose where).
        check(&self.api, "ucp_mem_map", unsafe {
            (self.api.mem_map)(self.ctx.raw, &params, &mut memh)
        })?;
        let mut attr = sys::MemAttr {
            field_mask: sys::MEM_ATTR_FIELD_ADDRESS | sys::MEM_ATTR_FIELD_LENGTH,
            address: std::ptr::null_mut(),
            length: 0,
            mem_type: 0,
            _pad: 0,
        };
        // SAFETY: the mapping just made; valid out struct.
        let st = unsafe { (self.api.mem_query)(memh, &mut attr) };
        let a = Arc::new(Allocation {
            ctx: self.ctx.clone(),
            memh,
            addr: attr.address as *mut u8,
            len,
        });
        // From here on, dropping `a` unmaps.
        check(&self.api, "ucp_mem_query", st)?;
        if a.addr.is_null() || attr.length < len {
            return Err(UcxError {
                what: "ucp_mem_map",
                status: sys::UCS_ERR_NO_MEMORY,
                text: format!(
                    "UCX allocated {} bytes at {:p} for a request of {len}",
                    attr.length, a.addr
                ),
            });
        }
        // SAFETY: `len` bytes at `addr` are ours, mapped for writing, and nothing
        // else uses them yet. UCX may hand out recycled heap memory, so zero it.
        unsafe { std::ptr::write_bytes(a.addr, 0, len) };
        self.allocs.retain(|_, w| w.strong_count() > 0);
        self.allocs.insert(a.addr as u64, Arc::downgrade(&a));
        Ok(a)
    }

    /// Unmap a region mapped by [`Ucx::mem_map`] (no-op if unknown).
    pub(crate) fn mem_unmap(&mut self, region_id: u64) {
        if let Some(m) = self.mems.remove(&region_id) {
            self.unmap(m);
        }
    }

    /// Create an endpoint to the worker at `address`, with peer-failure handling
    /// (`UCP_ERR_HANDLING_MODE_PEER`) or without.
    ///
    /// # Errors
    /// The failing UCX call.
    pub(crate) fn ep_create(
        &mut self,
        address: &Padded,
        peer_failure: bool,
    ) -> Result<EpId, UcxError> {
        let err = Box::into_raw(Box::new(AtomicI8::new(0)));
        let params = sys::EpParams {
            field_mask: sys::EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::EP_PARAM_FIELD_ERR_HANDLER,
            address: address.bytes().as_ptr() as *const sys::Address,
            err_mode: if peer_failure {
                sys::ERR_HANDLING_MODE_PEER
            } else {
                sys::ERR_HANDLING_MODE_NONE
            },
            err_cb: Some(err_trampoline),
            err_arg: err as *mut c_void,
            ..Default::default()
        };
        let mut ep: sys::Ep = std::ptr::null_mut();
        // SAFETY: live worker; `address` holds a worker address whose header was
        // checked and after which enough zeroed padding follows that UCX's parse,
        // which takes no length, stays inside it whatever the bytes say (see
        // `packed`), for the duration of the call (UCX copies what it keeps); the
        // error slot outlives the endpoint (freed only after it is closed).
        let st = unsafe { (self.api.ep_create)(self.worker, &params, &mut ep) };
        if let Err(e) = check(&self.api, "ucp_ep_create", st) {
            // SAFETY: UCX did not keep the slot.
            drop(unsafe { Box::from_raw(err) });
            return Err(e);
        }
        let state = EpState::Open {
            raw: ep,
            err,
            rkeys: Vec::new(),
            created: Instant::now(),
            close_at: None,
        };
        let idx = match self.free_eps.pop() {
            Some(i) => {
                let s = &mut self.eps[i as usize];
                s.gen = s.gen.wrapping_add(1);
                s.state = state;
                i
            }
            None => {
                self.eps.push(EpSlot { gen: 0, state });
                (self.eps.len() - 1) as u32
            }
        };
        Ok(EpId {
            idx,
            gen: self.eps[idx as usize].gen,
        })
    }

    fn open_ep(&self, id: EpId) -> Option<(sys::Ep, &Vec<sys::RKey>)> {
        match self.eps.get(id.idx as usize) {
            Some(EpSlot {
                gen,
                state:
                    EpState::Open {
                        raw,
                        rkeys,
                        close_at: None,
                        ..
                    },
            }) if *gen == id.gen => Some((*raw, rkeys)),
            _ => None,
        }
    }

    /// Whether `e` is "no transport can reach the peer".
    pub(crate) fn is_unreachable(e: &UcxError) -> bool {
        e.status == sys::UCS_ERR_UNREACHABLE
    }

    /// The error UCX reported for this endpoint (peer failure), or a "not connected"
    /// error once it is closed; `None` while healthy.
    pub(crate) fn ep_error(&self, id: EpId) -> Option<UcxError> {
        let st = match self.eps.get(id.idx as usize) {
            Some(EpSlot {
                gen,
                state:
                    EpState::Open {
                        err,
                        close_at: None,
                        ..
                    },
            }) if *gen == id.gen => {
                // SAFETY: the slot lives while the endpoint is open.
                unsafe { &**err }.load(Ordering::Acquire)
            }
            _ => sys::UCS_ERR_NOT_CONNECTED,
        };
        (st != 0).then(|| UcxError {
            what: "endpoint",
            status: st,
            text: loader::status_text(&self.api, st),
        })
    }

    /// Unpack a packed remote key on an endpoint.
    ///
    /// # Errors
    /// The failing UCX call, or "not connected" for a closed endpoint.
    pub(crate) fn rkey_unpack(&mut self, id: EpId, packed: &Padded) -> Result<RkeyId, UcxError> {
        let Some((ep, _)) = self.open_ep(id) else {
            return Err(self.not_connected("ucp_ep_rkey_unpack"));
        };
        let mut rkey: sys::RKey = std::ptr::null_mut();
        // SAFETY: live endpoint; `packed` is a packed key whose layout was checked
        // (memory type, each domain's length inside it), followed by enough zeroed
        // padding that each transport's unpacking, which takes no length, stays
        // inside it (see `packed`), readable for the call (UCX copies what it keeps).
        check(&self.api, "ucp_ep_rkey_unpack", unsafe {
            (self.api.ep_rkey_unpack)(ep, packed.bytes().as_ptr() as *const c_void, &mut rkey)
        })?;
        let Some(EpSlot {
            state: EpState::Open { rkeys, .. },
            ..
        }) = self.eps.get_mut(id.idx as usize)
        else {
            unreachable!("checked open above");
        };
        rkeys.push(rkey);
        Ok(RkeyId((rkeys.len() - 1) as u32))
    }

    fn not_connected(&self, what: &'static str) -> UcxError {
        UcxError {
            what,
            status: sys::UCS_ERR_NOT_CONNECTED,
            text: loader::status_text(&self.api, sys::UCS_ERR_NOT_CONNECTED),
        }
    }

    /// Close an endpoint (pending operations on it fail), after destroying its remote
    /// keys. Completes in later progress calls. The endpoint is unusable from now on;
    /// one younger than [`MIN_EP_AGE`] is really closed only at that age (by
    /// [`Ucx::reap_closed`]).
    pub(crate) fn ep_close(&mut self, id: EpId) {
        let Some(slot) = self.eps.get_mut(id.idx as usize) else {
            return;
        };
        if slot.gen != id.gen {
            return;
        }
        let EpState::Open {
            created, close_at, ..
        } = &mut slot.state
        else {
            return;
        };
        if close_at.is_some() {
            return;
        }
        if created.elapsed() < MIN_EP_AGE {
            *close_at = Some(*created + MIN_EP_AGE);
            return;
        }
        self.close_now(id.idx);
    }

    fn close_now(&mut self, idx: u32) {
        let slot = &mut self.eps[idx as usize];
        let EpState::Open {
            raw, err, rkeys, ..
        } = std::mem::replace(&mut slot.state, EpState::Free)
        else {
            return;
        };
        for k in rkeys {
            // SAFETY: keys unpacked on this endpoint, destroyed once, before it is
            // closed (as UCX requires).
            unsafe { (self.api.rkey_destroy)(k) };
        }
        let param = sys::RequestParam {
            op_attr_mask: sys::OP_ATTR_FIELD_FLAGS,
            flags: sys::EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: a live endpoint, closed once.
        let p = unsafe { (self.api.ep_close_nbx)(raw, &param) };
        let slot = &mut self.eps[idx as usize];
        match posted(p) {
            Posted::Pending(req) => slot.state = EpState::Closing { req, err },
            Posted::Done(_) => {
                // SAFETY: the endpoint is gone; UCX calls its handler no more.
                drop(unsafe { Box::from_raw(err) });
                self.free_eps.push(idx);
            }
        }
    }

    /// Close endpoints whose deferred close is due, and move finished closes to free
    /// slots; returns how many are still closing (deferred ones included).
    pub(crate) fn reap_closed(&mut self) -> usize {
        // Read the clock only when some endpoint waits to close (every round calls
        // this, posts included).
        let mut now = None;
        let mut left = 0;
        for i in 0..self.eps.len() {
            if let EpState::Open {
                close_at: Some(t), ..
            } = self.eps[i].state
            {
                if *now.get_or_insert_with(Instant::now) >= t {
                    self.close_now(i as u32);
                } else {
                    left += 1;
                }
            }
        }
        for (i, slot) in self.eps.iter_mut().enumerate() {
            if let EpState::Closing { req, err } = slot.state {
                // SAFETY: a live request returned by ep_close_nbx.
                let st = unsafe { (self.api.request_check_status)(req) };
                if st == sys::UCS_INPROGRESS {
                    left += 1;
                    continue;
                }
                // SAFETY: a finished request, freed once; the endpoint is gone, so
                // its error slot can go too.
                unsafe {
                    (self.api.request_free)(req);
                    drop(Box::from_raw(err));
                }
                slot.state = EpState::Free;
                self.free_eps.push(i as u32);
            }
        }
        left
    }

    fn flight(&mut self, f: Flight<K>) -> FlightId {
        match self.free_flights.pop() {
            Some(i) => {
                self.flights[i as usize] = Some(f);
                FlightId(i)
            }
            None => {
                self.flights.push(Some(f));
                FlightId((self.flights.len() - 1) as u32)
            }
        }
    }

    fn done_flight(&mut self, status: sys::Status, keep: K) -> FlightId {
        self.flight(Flight {
            req: std::ptr::null_mut(),
            status,
            keep: Some(keep),
            marks: Vec::new(),
            marked: 0,
            _header: Vec::new(),
            _data: Bytes::new(),
        })
    }

    fn flush_ep(&self, ep: sys::Ep) -> Posted {
        let param = sys::RequestParam::default();
        // SAFETY: live endpoint; no callback (we poll the request).
        posted(unsafe { (self.api.ep_flush_nbx)(ep, &param) })
    }

    /// Post a put (`write`) or get per segment of every run, then an endpoint flush;
    /// the flight finishes when every segment is complete at both ends.
    ///
    /// The segments must come from the transfer whose [`Completer`] `keep` carries:
    /// that keeps their memory alive, and `keep` is handed back (from
    /// [`Ucx::poll`] or teardown) only once UCX no longer touches it. Posting never
    /// allocates per segment.
    pub(crate) fn rma(&mut self, id: EpId, write: bool, segs: &[RmaSeg], keep: K) -> FlightId {
        debug_assert!(keep.completer().is_some() || segs.is_empty());
        let Some((ep, rkeys)) = self.open_ep(id) else {
            return self.done_flight(sys::UCS_ERR_NOT_CONNECTED, keep);
        };
        let param = sys::RequestParam::default();
        let mut first_err = sys::UCS_OK;
        let mut marks = Vec::new();
        let mut unmarked = 0usize;
        'runs: for s in segs {
            let Some(&rkey) = rkeys.get(s.rkey.0 as usize) else {
                first_err = sys::UCS_ERR_NOT_CONNECTED;
                break;
            };
            for i in 0..s.count {
                let base = s.local.addr() as usize + i * s.local_stride;
                let remote = s.remote + i as u64 * s.remote_stride;
                let len = s.local.len();
                let mut off = 0;
                loop {
                    let piece = (len - off).min(s.max_piece.max(1));
                    let ptr = (base + off) as *mut c_void;
                    // SAFETY: live endpoint and a key unpacked on it; every segment of
                    // the run lies in registered memory (the agent checked each run
                    // against its registration), and a piece lies in its segment. It
                    // is kept alive by `keep`'s completer until this flight is handed
                    // back, which happens only after the flush below completes (so
                    // after this operation), or after the worker is destroyed. No
                    // callback (request polled through the flush, or as a mark).
                    let p = unsafe {
                        if write {
                            (self.api.put_nbx)(ep, ptr, piece, remote + off as u64, rkey, &param)
                        } else {
                            (self.api.get_nbx)(ep, ptr, piece, remote + off as u64, rkey, &param)
                        }
                    };
                    unmarked += piece;
                    match posted(p) {
                        Posted::Done(sys::UCS_OK) => {}
                        // Kept as a mark (freed once finished or with the flight).
                        Posted::Pending(req) if unmarked >= MARK_BYTES => {
                            marks.push(req);
                            unmarked = 0;
                        }
                        // Completion is tracked by the flush; UCX frees it when done.
                        // SAFETY: a live request handed to us, freed once.
                        Posted::Pending(req) => unsafe { (self.api.request_free)(req) },
                        Posted::Done(st) => {
                            first_err = st;
                            break 'runs;
                        }
                    }
                    off += piece;
                    if off >= len {
                        break;
                    }
                }
            }
        }
        // Always flush, even after an error, so earlier segments are finished before
        // the memory is handed back.
        let (req, status) = match self.flush_ep(ep) {
            Posted::Pending(req) => (req, first_err),
            Posted::Done(st) => (
                std::ptr::null_mut(),
                if first_err != sys::UCS_OK {
                    first_err
                } else {
                    st
                },
            ),
        };
        self.flight(Flight {
            req,
            status,
            keep: Some(keep),
            marks,
            marked: 0,
            _header: Vec::new(),
            _data: Bytes::new(),
        })
    }

    /// Flush an endpoint (everything posted on it before completes remotely).
    pub(crate) fn flush(&mut self, id: EpId, keep: K) -> FlightId {
        let Some((ep, _)) = self.open_ep(id) else {
            return self.done_flight(sys::UCS_ERR_NOT_CONNECTED, keep);
        };
        match self.flush_ep(ep) {
            Posted::Pending(req) => self.flight(Flight {
                req,
                status: sys::UCS_OK,
                keep: Some(keep),
                marks: Vec::new(),
                marked: 0,
                _header: Vec::new(),
                _data: Bytes::new(),
            }),
            Posted::Done(st) => self.done_flight(st, keep),
        }
    }

    /// Send an active message (eager protocol, so the receiver always gets the data
    /// inline). `header` and `data` stay owned by the flight until UCX is done.
    ///
    /// With `reply`, UCX gives the receiver's handler a reply endpoint, which an
    /// [`AmFn`] answer goes back on.
    pub(crate) fn am_send(
        &mut self,
        id: EpId,
        am_id: u32,
        header: Vec<u8>,
        data: Bytes,
        reply: bool,
        keep: K,
    ) -> FlightId {
        let flags = sys::AM_SEND_FLAG_EAGER | if reply { sys::AM_SEND_FLAG_REPLY } else { 0 };
        self.am_send_flags(id, am_id, header, data, flags, keep)
    }

    /// [`Ucx::am_send`] by rendezvous (`UCP_AM_SEND_FLAG_RNDV`), as only a hostile
    /// sender does: the receiver gets a descriptor, not the data.
    #[cfg(test)]
    pub(crate) fn am_send_rndv(
        &mut self,
        id: EpId,
        am_id: u32,
        header: Vec<u8>,
        data: Bytes,
        keep: K,
    ) -> FlightId {
        self.am_send_flags(id, am_id, header, data, sys::AM_SEND_FLAG_RNDV, keep)
    }

    fn am_send_flags(
        &mut self,
        id: EpId,
        am_id: u32,
        header: Vec<u8>,
        data: Bytes,
        flags: u32,
        keep: K,
    ) -> FlightId {
        let Some((ep, _)) = self.open_ep(id) else {
            return self.done_flight(sys::UCS_ERR_NOT_CONNECTED, keep);
        };
        let param = sys::RequestParam {
            op_attr_mask: sys::OP_ATTR_FIELD_FLAGS,
            flags,
            ..Default::default()
        };
        // SAFETY: live endpoint; header and data are heap buffers moved into the
        // flight below, which keeps them until the request finishes (or the worker is
        // destroyed).
        let p = unsafe {
            (self.api.am_send_nbx)(
                ep,
                am_id,
                header.as_ptr() as *const c_void,
                header.len(),
                data.as_ptr() as *const c_void,
                data.len(),
                &param,
            )
        };
        let (req, status) = match posted(p) {
            Posted::Pending(r) => (r, sys::UCS_OK),
            Posted::Done(st) => (std::ptr::null_mut(), st),
        };
        self.flight(Flight {
            req,
            status,
            keep: Some(keep),
            marks: Vec::new(),
            marked: 0,
            _header: header,
            _data: data,
        })
    }

    /// Whether a flight has finished, without taking it.
    pub(crate) fn is_done(&mut self, id: FlightId) -> bool {
        let api = self.api;
        let Some(Some(f)) = self.flights.get_mut(id.0 as usize) else {
            return true;
        };
        if f.req.is_null() {
            return true;
        }
        // SAFETY: a live request of ours, not yet freed.
        let st = unsafe { (api.request_check_status)(f.req) };
        if st == sys::UCS_INPROGRESS {
            return false;
        }
        // SAFETY: finished; freed once (then forgotten).
        unsafe { (api.request_free)(f.req) };
        f.req = std::ptr::null_mut();
        if f.status == sys::UCS_OK {
            f.status = st;
        }
        true
    }

    /// Whether operations of an unfinished flight finished since the last call: part
    /// of a long one-sided transfer arrived, so its peer is alive.
    pub(crate) fn advanced(&mut self, id: FlightId) -> bool {
        let api = self.api;
        let Some(Some(f)) = self.flights.get_mut(id.0 as usize) else {
            return false;
        };
        let before = f.marked;
        while let Some(&req) = f.marks.get(f.marked) {
            // SAFETY: a live request of ours, not yet freed (the cursor passes it once).
            if unsafe { (api.request_check_status)(req) } == sys::UCS_INPROGRESS {
                break;
            }
            // SAFETY: finished, freed once.
            unsafe { (api.request_free)(req) };
            f.marked += 1;
        }
        f.marked > before
    }

    /// Take a finished flight: its `keep` and outcome. `None` while in flight.
    pub(crate) fn poll(&mut self, id: FlightId) -> Option<(K, Result<(), UcxError>)> {
        if !self.is_done(id) {
            return None;
        }
        let mut f = self.flights.get_mut(id.0 as usize)?.take()?;
        free_marks(&self.api, &mut f);
        self.free_flights.push(id.0);
        let keep = f.keep?;
        Some((keep, check(&self.api, "transfer", f.status)))
    }

    /// Operations or closes still in flight.
    pub(crate) fn busy(&self) -> bool {
        // SAFETY: the slot lives as long as `self`; nothing else touches it now.
        let replies = self
            .am
            .iter()
            .any(|&am| !unsafe { &*am }.replies.is_empty());
        replies
            || self.flights.len() > self.free_flights.len()
            || self.eps.iter().any(|s| {
                matches!(
                    s.state,
                    EpState::Closing { .. }
                        | EpState::Open {
                            close_at: Some(_),
                            ..
                        }
                )
            })
    }
}

impl<K> Ucx<K> {
    fn unmap(&mut self, m: MemEntry) {
        if let Mapping::Own(memh) = m.map {
            // SAFETY: a mapping of this context, unmapped once; the region it covers
            // is dropped (by dropping `m`) only afterwards.
            let st = unsafe { (self.api.mem_unmap)(self.ctx.raw, memh) };
            if let Err(e) = check(&self.api, "ucp_mem_unmap", st) {
                tracing::warn!(error = %e, "unmapping registered memory failed");
            }
        }
        // An allocation's mapping is its own: dropping our `Arc` may free it.
        drop(m);
    }
}

impl<K> Ucx<K> {
    /// Close every endpoint (forced: pending operations fail) and progress, within the
    /// teardown bound, until the closes and outstanding requests are finished. Memory
    /// mappings, the worker and the context stay. Returns what finished requests held.
    /// Called by shutdown (connections close before memory is deregistered) and by
    /// `Drop`; a second call finds nothing to do.
    pub(crate) fn close_all(&mut self) -> Vec<K> {
        let api = self.api;
        // 0. Let endpoints younger than MIN_EP_AGE finish UCX's wireup first (see
        // there), progressing the worker, within the teardown bound.
        let young = self
            .eps
            .iter()
            .filter_map(|s| match s.state {
                EpState::Open { created, .. } => Some(created + MIN_EP_AGE),
                _ => None,
            })
            .max();
        if let Some(until) = young {
            let until = until.min(Instant::now() + self.teardown_bound);
            while Instant::now() < until {
                // SAFETY: live worker, exclusive access (we are in Drop).
                if unsafe { (api.worker_progress)(self.worker) } == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
        // 1. Remote keys, then endpoints (forced: pending operations fail).
        for i in 0..self.eps.len() {
            if let EpState::Open {
                raw, err, rkeys, ..
            } = std::mem::replace(&mut self.eps[i].state, EpState::Free)
            {
                for k in rkeys {
                    // SAFETY: keys of this endpoint, destroyed once, before it closes.
                    unsafe { (api.rkey_destroy)(k) };
                }
                let param = sys::RequestParam {
                    op_attr_mask: sys::OP_ATTR_FIELD_FLAGS,
                    flags: sys::EP_CLOSE_FLAG_FORCE,
                    ..Default::default()
                };
                // SAFETY: a live endpoint, closed once.
                match posted(unsafe { (api.ep_close_nbx)(raw, &param) }) {
                    Posted::Pending(req) => self.eps[i].state = EpState::Closing { req, err },
                    // SAFETY: the endpoint is gone; its handler is never called again.
                    Posted::Done(_) => drop(unsafe { Box::from_raw(err) }),
                }
            }
        }
        // 2. Bounded progress until closes and requests are finished.
        let deadline = Instant::now() + self.teardown_bound;
        let mut handed_back: Vec<K> = Vec::new();
        loop {
            // SAFETY: live worker, exclusive access (we are in Drop).
            unsafe { (api.worker_progress)(self.worker) };
            let mut closing = 0;
            for slot in &mut self.eps {
                if let EpState::Closing { req, err } = slot.state {
                    // SAFETY: a live request of ep_close_nbx.
                    if unsafe { (api.request_check_status)(req) } == sys::UCS_INPROGRESS {
                        closing += 1;
                        continue;
                    }
                    // SAFETY: finished request freed once; endpoint gone with it.
                    unsafe {
                        (api.request_free)(req);
                        drop(Box::from_raw(err));
                    }
                    slot.state = EpState::Free;
                }
            }
            let mut pending = 0;
            for f in self.flights.iter_mut() {
                let Some(fl) = f else { continue };
                // The flush request (below) tracks the marks' operations.
                free_marks(&api, fl);
                if !fl.req.is_null() {
                    // SAFETY: a live request of ours.
                    if unsafe { (api.request_check_status)(fl.req) } == sys::UCS_INPROGRESS {
                        pending += 1;
                        continue;
                    }
                    // SAFETY: finished, freed once.
                    unsafe { (api.request_free)(fl.req) };
                    fl.req = std::ptr::null_mut();
                }
                if let Some(k) = f.take().and_then(|f| f.keep) {
                    handed_back.push(k);
                }
            }
            if closing + pending == 0 {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    closing,
                    pending,
                    "UCX teardown: endpoints or requests still busy after {:?}; destroying the worker",
                    self.teardown_bound
                );
                break;
            }
            std::thread::yield_now();
        }
        handed_back
    }
}

impl<K> Drop for Ucx<K> {
    fn drop(&mut self) {
        let api = self.api;
        let mut handed_back = self.close_all();
        // 3. Memory mappings.
        for (_, m) in std::mem::take(&mut self.mems) {
            self.unmap(m);
        }
        // 4. The worker: this ends every endpoint and request still left.
        // SAFETY: live worker, destroyed once; nothing uses it afterwards.
        unsafe { (api.worker_destroy)(self.worker) };
        for slot in &mut self.eps {
            if let EpState::Closing { err, .. } = slot.state {
                // SAFETY: the worker is gone, so no handler can run any more.
                drop(unsafe { Box::from_raw(err) });
                slot.state = EpState::Free;
            }
        }
        for am in self.am.drain(..) {
            // SAFETY: the worker that could call it is destroyed.
            drop(unsafe { Box::from_raw(am) });
        }
        // 5. The context: cleaned up when our `ctx` goes, unless allocations the
        // application still holds keep it (then by the last of them).
        // Requests left are gone with the worker: UCX will not touch their memory any
        // more, so their completers may now release it.
        for f in self.flights.drain(..).flatten() {
            if let Some(k) = f.keep {
                handed_back.push(k);
            }
        }
        drop(handed_back);
    }
}

/// Youngest endpoint [`Ucx::ep_close`] closes at once; a younger one is closed when it
/// reaches this age.
///
/// When two workers make endpoints to each other at about the same time, UCX pairs
/// them (its connection matching). Closing one of them while the peer's wireup request
/// for it is still on its way makes the peer's endpoint receive two different remote
/// ids, which UCX 1.13 builds with assertions enabled (Debian's) abort on
/// (`ucp_ep_update_remote_id`). Any live peer has answered well within this.
pub(crate) const MIN_EP_AGE: Duration = Duration::from_millis(200);

/// Copy between two regions of this process: `memmove` per pair, `(local, target)`.
/// `done` is the completer of the transfer the segments belong to: it keeps them alive.
/// The worker's event fd, for tokio's reactor. It does not own the fd (UCX does).
#[derive(Debug)]
pub(crate) struct EventFd(RawFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Watch a worker's event fd with tokio.
///
/// The returned value must be dropped before the [`Ucx`] that owns the fd (the driver
/// drops it before tearing UCX down).
///
/// # Errors
/// Registration with the reactor failed.
pub(crate) fn watch_event_fd<K>(
    ucx: &Ucx<K>,
) -> std::io::Result<tokio::io::unix::AsyncFd<EventFd>> {
    // SAFETY: the fd belongs to the UCX worker, which stays alive (and keeps the fd
    // open, never replacing it) until after the driver drops this AsyncFd: the driver
    // drops it before it tears UCX down, and nothing else closes the fd.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            EventFd(ucx.efd),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(std::io::Error::from)
}

/// An eventfd that wakes a dedicated progress thread.
#[derive(Debug)]
pub(crate) struct WakeFd(OwnedFd);

impl WakeFd {
    /// A non-blocking, close-on-exec eventfd.
    ///
    /// # Errors
    /// The OS error.
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: plain syscall; no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Make the fd readable.
    pub(crate) fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our own fd.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr() as *const c_void, 8) };
    }

    /// Reset it.
    pub(crate) fn drain(&self) {
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from our own (non-blocking) fd.
        unsafe { libc::read(self.0.as_raw_fd(), b.as_mut_ptr() as *mut c_void, 8) };
    }

    /// Wait until `other` or this fd is readable, or `timeout` passes.
    pub(crate) fn wait_with(&self, other: RawFd, timeout: Duration) {
        let mut fds = [
            libc::pollfd {
                fd: other,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: two valid pollfd entries in a live array.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    }
}
