//! Shims of transfers: prepared lists, requests, posting and polling, telemetry,
//! cost estimates, memory views.

use std::ffi::{c_char, c_int, c_void};

use super::agent::{opt, AgentH, BackendH};
use super::lists::{OptArgsH, RemoteListH, XferListH};
use super::{cstr, destroy, free, get, guard, new_handle, ok, tagged, Handle, Out};
use crate::agent::op;
use crate::runtime::Locked;
use crate::status::{Failure, Outcome, Status, INVALID_STATE, SUCCESS};
use crate::xfer::{Prepared, XferReq};

/// `nixl_capi_xfer_dlist_handle_t`.
pub struct DlistH(pub Prepared);
/// `nixl_capi_xfer_req_t`.
pub struct ReqH(pub XferReq);

tagged! {
    DlistH => 0x6e69_786c_5052_4550, "xfer dlist handle (prepared)";
    ReqH => 0x6e69_786c_5846_5251, "xfer request handle";
}

/// `struct nixl_capi_xfer_telemetry_s`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TelemetryC {
    start_time_us: u64,
    post_duration_us: u64,
    xfer_duration_us: u64,
    total_bytes: u64,
    desc_count: u64,
}

/// Prepare a descriptor list: `agent_name` empty for local memory, a loaded peer's
/// name, or this agent's own (its memory as the remote side).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_prep_xfer_dlist(
    agent: *mut Handle<AgentH>,
    agent_name: *const c_char,
    descs: *mut Handle<XferListH>,
    dlist_hndl: *mut *mut Handle<DlistH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("prep_xfer_dlist", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, peer, l, out) = unsafe {
            opt(opt_args)?;
            (
                get(agent)?,
                cstr(agent_name, "agent_name")?,
                get(descs)?,
                Out::new(dlist_hndl, "dlist_hndl")?,
            )
        };
        let list = l.0.locked().clone();
        out.set(new_handle(DlistH(a.0.prep(peer, &list)?)));
        ok()
    })
}

/// Free a prepared list (requests made from it keep what they need).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_release_xfer_dlist_handle(
    agent: *mut Handle<AgentH>,
    dlist_handle: *mut Handle<DlistH>,
) -> Status {
    // The agent is not needed (nixl-sys may release a list after its agent).
    let _ = agent;
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("release_xfer_dlist_handle", dlist_handle) }
}

/// Indices from C (non-negative).
///
/// # Safety
/// `p` is null or points to `n` readable `int`s.
unsafe fn indices(p: *const c_int, n: usize, what: &str) -> Outcome<Vec<usize>> {
    // SAFETY: the contract is `bytes`'s, for `n` ints.
    let len = n
        .checked_mul(std::mem::size_of::<c_int>())
        .ok_or_else(|| Failure::invalid(format!("{what}: {n} indices")))?;
    // SAFETY: as above, for `len` bytes.
    let raw = unsafe { super::bytes(p.cast(), len, what) }?;
    raw.chunks_exact(std::mem::size_of::<c_int>())
        .map(|c| {
            let i = c_int::from_ne_bytes(c.try_into().expect("int-sized"));
            usize::try_from(i).map_err(|_| Failure::invalid(format!("{what} holds {i}")))
        })
        .collect()
}

/// A request from prepared lists, by index.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_make_xfer_req(
    agent: *mut Handle<AgentH>,
    operation: u32,
    local_descs: *mut Handle<DlistH>,
    local_indices: *const c_int,
    local_indices_count: usize,
    remote_descs: *mut Handle<DlistH>,
    remote_indices: *const c_int,
    remote_indices_count: usize,
    req_hndl: *mut *mut Handle<ReqH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("make_xfer_req", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, l, li, r, ri, out, o) = unsafe {
            (
                get(agent)?,
                get(local_descs)?,
                indices(local_indices, local_indices_count, "local_indices")?,
                get(remote_descs)?,
                indices(remote_indices, remote_indices_count, "remote_indices")?,
                Out::new(req_hndl, "req_hndl")?,
                opt(opt_args)?,
            )
        };
        let req =
            a.0.make_request(op(operation)?, &l.0, &li, &r.0, &ri, o.as_ref())?;
        out.set(new_handle(ReqH(req)));
        ok()
    })
}

/// A request from two lists and a peer (this agent's own name: local moves).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_xfer_req(
    agent: *mut Handle<AgentH>,
    operation: u32,
    local_descs: *mut Handle<XferListH>,
    remote_descs: *mut Handle<XferListH>,
    remote_agent: *const c_char,
    req_hndl: *mut *mut Handle<ReqH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("create_xfer_req", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, l, r, peer, out, o) = unsafe {
            (
                get(agent)?,
                get(local_descs)?,
                get(remote_descs)?,
                cstr(remote_agent, "remote_agent")?,
                Out::new(req_hndl, "req_hndl")?,
                opt(opt_args)?,
            )
        };
        // One lock at a time: the two may be the same list (a local transfer from a
        // list to itself), and holding both guards at once would lock it twice.
        let l = l.0.locked().clone();
        let r = r.0.locked().clone();
        let req = a.0.create_request(
            op(operation).map_err(Failure::collapsed)?,
            &l,
            &r,
            peer,
            o.as_ref(),
        )?;
        out.set(new_handle(ReqH(req)));
        ok()
    })
}

/// Post: SUCCESS when it finished within the call, else IN_PROG. Optional
/// arguments, when given, replace the request's notification (none: no
/// notification).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_post_xfer_req(
    agent: *mut Handle<AgentH>,
    req_hndl: *mut Handle<ReqH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("post_xfer_req", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (r, o) = unsafe {
            get(agent)?;
            (get(req_hndl)?, opt(opt_args)?)
        };
        r.0.post(o.map(|o| o.notif()))
    })
}

/// SUCCESS, IN_PROG, or how the transfer failed.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_xfer_status(
    agent: *mut Handle<AgentH>,
    req_hndl: *mut Handle<ReqH>,
) -> Status {
    guard("get_xfer_status", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let r = unsafe {
            get(agent)?;
            get(req_hndl)?
        };
        r.0.status()
    })
}

/// A new handle naming the backend serving the request.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_query_xfer_backend(
    agent: *mut Handle<AgentH>,
    req_hndl: *mut Handle<ReqH>,
    backend: *mut *mut Handle<BackendH>,
) -> Status {
    guard("query_xfer_backend", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (r, out) = unsafe {
            get(agent)?;
            (get(req_hndl)?, Out::new(backend, "backend")?)
        };
        let name = r.0.backend()?;
        // The agent's own copies ("agent") have no NIXL name; they are not a
        // backend one can hint.
        let ours = nixl_compat::backends::ours(&name).unwrap_or("agent");
        out.set(new_handle(BackendH { name: ours }));
        ok()
    })
}

/// Cost estimates: no backend of nixl-rs has a cost model (BACKEND, NIXL's
/// NOT_SUPPORTED; the outputs are zeroed).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_estimate_xfer_cost(
    agent: *mut Handle<AgentH>,
    req_hndl: *mut Handle<ReqH>,
    opt_args: *mut Handle<OptArgsH>,
    duration_us: *mut i64,
    err_margin_us: *mut i64,
    method: *mut u32,
) -> Status {
    guard("estimate_xfer_cost", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (r, d, e, m) = unsafe {
            get(agent)?;
            opt(opt_args)?;
            (
                get(req_hndl)?,
                Out::new(duration_us, "duration_us")?,
                Out::new(err_margin_us, "err_margin_us")?,
                Out::new(method, "method")?,
            )
        };
        d.set(0);
        e.set(0);
        m.set(0);
        Err(Failure::backend(format!(
            "estimate transfer cost: backend {} has no cost model (not supported by nixl-rs)",
            r.0.backend()?
        )))
    })
}

/// Release a request: an unfinished transfer is cancelled.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_release_xfer_req(
    agent: *mut Handle<AgentH>,
    req: *mut Handle<ReqH>,
) -> Status {
    guard("release_xfer_req", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let r = unsafe {
            get(agent)?;
            get(req)?
        };
        r.0.release()?;
        ok()
    })
}

/// Free a released request (not released: INVALID_STATE, nothing freed).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_xfer_req(req: *mut Handle<ReqH>) -> Status {
    guard("destroy_xfer_req", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        if !unsafe { get(req) }?.0.is_released() {
            return Err(Failure::new(
                INVALID_STATE,
                "destroy transfer request: release it first (nixl_capi_release_xfer_req)",
            ));
        }
        // SAFETY: as above.
        unsafe { free(req) }?;
        ok()
    })
}

/// The latest post's telemetry (the agent must record it).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_xfer_telemetry(
    agent: *mut Handle<AgentH>,
    req_hndl: *mut Handle<ReqH>,
    telemetry: *mut TelemetryC,
) -> Status {
    guard("get_xfer_telemetry", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (r, out) = unsafe {
            get(agent)?;
            (get(req_hndl)?, Out::new(telemetry, "telemetry")?)
        };
        match r.0.telemetry()? {
            None => Ok(crate::status::IN_PROG),
            Some(t) => {
                out.set(TelemetryC {
                    start_time_us: t.start_us,
                    post_duration_us: t.post_us,
                    xfer_duration_us: t.xfer_us,
                    total_bytes: t.bytes,
                    desc_count: t.descs,
                });
                Ok(SUCCESS)
            }
        }
    })
}

/// Both memory-view preparations: arguments checked as NIXL's, then NOT_FOUND (no
/// backend of nixl-rs offers NIXL's device-initiated API).
///
/// # Safety
/// As [`get`] for each handle; `mvh` as [`Out::new`].
unsafe fn refuse_view<T: super::Tagged>(
    agent: *mut Handle<AgentH>,
    descs: *mut Handle<T>,
    mvh: *mut *mut c_void,
    opt_args: *mut Handle<OptArgsH>,
) -> crate::status::Outcome<Status> {
    // SAFETY: the caller's contract.
    unsafe {
        get(agent)?;
        get(descs)?;
        Out::new(mvh, "mvh")?;
        opt(opt_args)?;
    }
    Err(Failure::not_found(
        "memory views: no backend of nixl-rs offers NIXL's device-initiated API \
         (GPU kernels posting transfers)",
    ))
}

/// Memory views of local buffers: no backend offers them (NOT_FOUND).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_prep_mem_view_local(
    agent: *mut Handle<AgentH>,
    descs: *mut Handle<XferListH>,
    mvh: *mut *mut c_void,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    guard("prep_mem_view_local", || unsafe {
        refuse_view(agent, descs, mvh, opt_args)
    })
}

/// Memory views of remote buffers: no backend offers them (NOT_FOUND).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_prep_mem_view_remote(
    agent: *mut Handle<AgentH>,
    descs: *mut Handle<RemoteListH>,
    mvh: *mut *mut c_void,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    guard("prep_mem_view_remote", || unsafe {
        refuse_view(agent, descs, mvh, opt_args)
    })
}

/// Release a memory view: none is ever made, so any handle is not one of ours
/// (INVALID_PARAM).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_release_mem_view(
    agent: *mut Handle<AgentH>,
    mvh: *mut c_void,
) -> Status {
    guard("release_mem_view", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        unsafe { get(agent) }?;
        if mvh.is_null() {
            return Err(Failure::invalid("mvh is null"));
        }
        Err(Failure::invalid(
            "release memory view: not a memory view of this library (it makes none)",
        ))
    })
}
