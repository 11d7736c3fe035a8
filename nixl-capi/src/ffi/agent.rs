//! Shims of the agent: creation, plugins and backends, registration, metadata,
//! notifications, memory queries; and the library's identity.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

use super::lists::{
    MemListH, NotifMapH, OptArgsH, ParamsH, QueryRespH, RegListH, StringListH, XferListH,
};
use super::{
    bytes, cstr, destroy, get, guard, guard_quiet, malloc_copy, malloc_str, new_handle, ok, tagged,
    Handle, Out,
};
use crate::agent::{backend_name, CAgent, Config};
use crate::lists::{cstring, mem, Params};
use crate::runtime::Locked;
use crate::status::{Failure, Outcome, Status};
use nixl_compat::backends;

/// `nixl_capi_agent_t`.
pub struct AgentH(pub CAgent);
/// `nixl_capi_backend_t`: names a backend of an agent (ours name).
pub struct BackendH {
    /// Our name of the backend.
    pub name: &'static str,
}

tagged! {
    AgentH => 0x6e69_786c_4147_4e54, "agent handle";
    BackendH => 0x6e69_786c_4241_434b, "backend handle";
}

/// `nixl_capi_agent_config_t`, byte for byte (`bool`s read as bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AgentConfigC {
    enable_prog_thread: u8,
    enable_listen_thread: u8,
    listen_port: c_int,
    thread_sync: u32,
    num_workers: u32,
    pthr_delay_us: u64,
    lthr_delay_us: u64,
    capture_telemetry: u8,
}

/// The optional arguments, if given.
///
/// # Safety
/// As [`get`].
pub(super) unsafe fn opt(p: *mut Handle<OptArgsH>) -> Outcome<Option<crate::lists::OptArgs>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the contract is `get`'s.
    Ok(Some(unsafe { get(p) }?.0.locked().clone()))
}

fn new_agent(name: &str, config: Config, out: Out<*mut Handle<AgentH>>) -> Outcome<Status> {
    crate::runtime::init_logging();
    let a = CAgent::new(name, config)?;
    tracing::info!(target: "nixl_capi", agent = name, "agent created");
    out.set(new_handle(AgentH(a)));
    ok()
}

/// An agent with NIXL's C defaults (no listener, no telemetry).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_agent(
    name: *const c_char,
    agent: *mut *mut Handle<AgentH>,
) -> Status {
    guard("create_agent", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (n, out) = unsafe { (cstr(name, "name")?, Out::new(agent, "agent")?) };
        new_agent(n, Config::default(), out)
    })
}

/// An agent with a configuration: the listener (`enable_listen_thread`,
/// `listen_port`) and `capture_telemetry` apply; progress threads, thread-sync
/// modes and delays are NIXL's internals (nixl-rs is thread-safe and progresses
/// its backends itself), accepted and not needed.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_configured_agent(
    name: *const c_char,
    cfg: *const AgentConfigC,
    agent: *mut *mut Handle<AgentH>,
) -> Status {
    guard("create_configured_agent", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs); a
        // non-null `cfg` points to a config struct.
        let (n, out, c) = unsafe {
            (
                cstr(name, "name")?,
                Out::new(agent, "agent")?,
                cfg.as_ref()
                    .copied()
                    .ok_or_else(|| Failure::invalid("cfg is null"))?,
            )
        };
        let listen = if c.enable_listen_thread != 0 {
            Some(u16::try_from(c.listen_port).map_err(|_| {
                Failure::invalid(format!("listen_port {} is not a port", c.listen_port))
            })?)
        } else {
            None
        };
        new_agent(
            n,
            Config {
                listen,
                capture_telemetry: c.capture_telemetry != 0,
            },
            out,
        )
    })
}

/// Destroy an agent: its transfers are cancelled, its backends and listener
/// stopped, its registrations dropped.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_agent(agent: *mut Handle<AgentH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_agent", agent) }
}

/// The backends this library offers, by NIXL's names.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_available_plugins(
    agent: *mut Handle<AgentH>,
    plugins: *mut *mut Handle<StringListH>,
) -> Status {
    guard("get_available_plugins", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe {
            get(agent)?;
            Out::new(plugins, "plugins")?
        };
        let list = backends::plugins().into_iter().map(cstring).collect();
        out.set(new_handle(StringListH(list)));
        ok()
    })
}

fn mems_and_params(
    mems: Vec<u32>,
    params: Params,
    m: Out<*mut Handle<MemListH>>,
    p: Out<*mut Handle<ParamsH>>,
) {
    m.set(new_handle(MemListH(mems)));
    p.set(new_handle(ParamsH(Mutex::new(params))));
}

/// A backend's memory types and parameters with their defaults.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_plugin_params(
    agent: *mut Handle<AgentH>,
    plugin_name: *const c_char,
    mems: *mut *mut Handle<MemListH>,
    params: *mut *mut Handle<ParamsH>,
) -> Status {
    guard("get_plugin_params", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (name, m, p) = unsafe {
            get(agent)?;
            (
                cstr(plugin_name, "plugin_name")?,
                Out::new(mems, "mems")?,
                Out::new(params, "params")?,
            )
        };
        let ours = backend_name(name)?;
        let mut defaults = Params::default();
        for (k, v) in backends::params(ours) {
            defaults.add(k, v);
        }
        let types = backends::mem_types(ours)
            .into_iter()
            .map(mem::by_name)
            .collect();
        mems_and_params(types, defaults, m, p);
        ok()
    })
}

/// Make backend `plugin_name` for the agent with `params`.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_backend(
    agent: *mut Handle<AgentH>,
    plugin_name: *const c_char,
    params: *mut Handle<ParamsH>,
    backend: *mut *mut Handle<BackendH>,
) -> Status {
    guard("create_backend", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, name, out) = unsafe {
            (
                get(agent)?,
                cstr(plugin_name, "plugin_name")?,
                Out::new(backend, "backend")?,
            )
        };
        let params = if params.is_null() {
            Params::default()
        } else {
            // SAFETY: as above.
            unsafe { get(params) }?.0.locked().clone()
        };
        let ours = a.0.create_backend(name, &params)?;
        tracing::info!(target: "nixl_capi", agent = a.0.name(), backend = name, "backend created");
        out.set(new_handle(BackendH { name: ours }));
        ok()
    })
}

/// Add a backend hint.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_add_backend(
    args: *mut Handle<OptArgsH>,
    backend: *mut Handle<BackendH>,
) -> Status {
    guard("opt_args_add_backend", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, b) = unsafe { (get(args)?, get(backend)?) };
        let mut a = a.0.locked();
        if !a.backends.contains(&b.name) {
            a.backends.push(b.name);
        }
        ok()
    })
}

/// Free a backend handle (the backend stays with its agent until it is destroyed).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_backend(backend: *mut Handle<BackendH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_backend", backend) }
}

/// A created backend's memory types and parameters.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_backend_params(
    agent: *mut Handle<AgentH>,
    backend: *mut Handle<BackendH>,
    mems: *mut *mut Handle<MemListH>,
    params: *mut *mut Handle<ParamsH>,
) -> Status {
    guard("get_backend_params", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, b, m, p) = unsafe {
            (
                get(agent)?,
                get(backend)?,
                Out::new(mems, "mems")?,
                Out::new(params, "params")?,
            )
        };
        let (types, values) = a.0.backend_params(b.name)?;
        mems_and_params(types, values, m, p);
        ok()
    })
}

/// Register memory (see `memory` for the contract).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_register_mem(
    agent: *mut Handle<AgentH>,
    dlist: *mut Handle<RegListH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("register_mem", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, l, o) = unsafe { (get(agent)?, get(dlist)?, opt(opt_args)?) };
        let list = l.0.locked().clone();
        a.0.register(&list, &o.unwrap_or_default())?;
        ok()
    })
}

/// Deregister memory registered before (matched by address, length, device).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_deregister_mem(
    agent: *mut Handle<AgentH>,
    dlist: *mut Handle<RegListH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("deregister_mem", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, l) = unsafe {
            opt(opt_args)?;
            (get(agent)?, get(dlist)?)
        };
        let list = l.0.locked().clone();
        a.0.deregister(&list)?;
        ok()
    })
}

/// Connect to a loaded peer now rather than at the first transfer.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_agent_make_connection(
    agent: *mut Handle<AgentH>,
    remote_agent: *const c_char,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("agent_make_connection", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, peer) = unsafe {
            opt(opt_args)?;
            (get(agent)?, cstr(remote_agent, "remote_agent")?)
        };
        a.0.make_connection(peer)?;
        ok()
    })
}

/// What a backend knows of each descriptor's file (POSIX: size, mode, mtime).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_query_mem(
    agent: *mut Handle<AgentH>,
    descs: *mut Handle<RegListH>,
    resp: *mut Handle<QueryRespH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("query_mem", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, l, r, o) = unsafe { (get(agent)?, get(descs)?, get(resp)?, opt(opt_args)?) };
        let list = l.0.locked().clone();
        let answers = a.0.query_mem(&list, o.as_ref())?;
        *r.0.locked() = answers;
        ok()
    })
}

fn put_md(md: &[u8], data: Out<*mut c_void>, len: Out<usize>) -> Outcome<Status> {
    data.set(malloc_copy(md)?);
    len.set(md.len());
    ok()
}

/// This agent's metadata (`malloc`ed; the caller `free`s it).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_local_md(
    agent: *mut Handle<AgentH>,
    data: *mut *mut c_void,
    len: *mut usize,
) -> Status {
    guard("get_local_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, d, l) = unsafe { (get(agent)?, Out::new(data, "data")?, Out::new(len, "len")?) };
        put_md(&a.0.local_md()?, d, l)
    })
}

/// Part of this agent's metadata: an empty list gives its connection info, else
/// the registrations holding the descriptors.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_local_partial_md(
    agent: *mut Handle<AgentH>,
    descs: *mut Handle<RegListH>,
    data: *mut *mut c_void,
    len: *mut usize,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("get_local_partial_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, l, d, n) = unsafe {
            opt(opt_args)?;
            (
                get(agent)?,
                get(descs)?,
                Out::new(data, "data")?,
                Out::new(len, "len")?,
            )
        };
        let list = l.0.locked().clone();
        put_md(&a.0.local_partial_md(&list)?, d, n)
    })
}

/// Load a peer's metadata; its name (`malloc`ed; the caller `free`s it).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_load_remote_md(
    agent: *mut Handle<AgentH>,
    data: *const c_void,
    len: usize,
    agent_name: *mut *mut c_char,
) -> Status {
    guard("load_remote_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, md, out) = unsafe {
            (
                get(agent)?,
                bytes(data, len, "data")?,
                Out::new(agent_name, "agent_name")?,
            )
        };
        let name = a.0.load_remote_md(md)?;
        out.set(malloc_str(&name)?);
        ok()
    })
}

/// Forget a peer.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_invalidate_remote_md(
    agent: *mut Handle<AgentH>,
    remote_agent: *const c_char,
) -> Status {
    guard("invalidate_remote_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, peer) = unsafe { (get(agent)?, cstr(remote_agent, "remote_agent")?) };
        a.0.invalidate_remote_md(peer)?;
        ok()
    })
}

/// SUCCESS when the peer's metadata is loaded (and covers `descs`, if given),
/// else NOT_FOUND.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_check_remote_md(
    agent: *mut Handle<AgentH>,
    remote_name: *const c_char,
    descs: *mut Handle<XferListH>,
) -> Status {
    guard_quiet("check_remote_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, peer) = unsafe { (get(agent)?, cstr(remote_name, "remote_name")?) };
        let list = if descs.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(unsafe { get(descs) }?.0.locked().clone())
        };
        a.0.check_remote_md(peer, list.as_ref())?;
        ok()
    })
}

/// Send this agent's metadata to the listener at the arguments' address.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_send_local_md(
    agent: *mut Handle<AgentH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("send_local_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, o) = unsafe { (get(agent)?, opt(opt_args)?) };
        a.0.send_local_md(None, &o.unwrap_or_default())?;
        ok()
    })
}

/// Send part of this agent's metadata to the listener at the arguments' address.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_send_local_partial_md(
    agent: *mut Handle<AgentH>,
    descs: *mut Handle<RegListH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("send_local_partial_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, l, o) = unsafe { (get(agent)?, get(descs)?, opt(opt_args)?) };
        let list = l.0.locked().clone();
        a.0.send_local_md(Some(&list), &o.unwrap_or_default())?;
        ok()
    })
}

/// Fetch a peer's metadata from the listener at the arguments' address (loaded in
/// the background: `check_remote_md` says when).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_fetch_remote_md(
    agent: *mut Handle<AgentH>,
    remote_name: *const c_char,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("fetch_remote_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, peer, o) = unsafe {
            (
                get(agent)?,
                cstr(remote_name, "remote_name")?,
                opt(opt_args)?,
            )
        };
        a.0.fetch_remote_md(peer, &o.unwrap_or_default())?;
        ok()
    })
}

/// Tell the listener at the arguments' address to forget this agent.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_invalidate_local_md(
    agent: *mut Handle<AgentH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("invalidate_local_md", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, o) = unsafe { (get(agent)?, opt(opt_args)?) };
        a.0.invalidate_local_md(&o.unwrap_or_default())?;
        ok()
    })
}

/// Append the notifications received since the last call to `notif_map`.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_get_notifs(
    agent: *mut Handle<AgentH>,
    notif_map: *mut Handle<NotifMapH>,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard_quiet("get_notifs", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, m, o) = unsafe { (get(agent)?, get(notif_map)?, opt(opt_args)?) };
        a.0.get_notifs(&mut m.0.locked(), o.as_ref())?;
        ok()
    })
}

/// Send a notification to a peer.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_gen_notif(
    agent: *mut Handle<AgentH>,
    remote_agent: *const c_char,
    data: *const c_void,
    len: usize,
    opt_args: *mut Handle<OptArgsH>,
) -> Status {
    guard("gen_notif", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, peer, msg) = unsafe {
            opt(opt_args)?;
            (
                get(agent)?,
                cstr(remote_agent, "remote_agent")?,
                bytes(data, len, "data")?,
            )
        };
        a.0.gen_notif(peer, msg)?;
        ok()
    })
}

/// Always false: this is a library, not nixl-sys' stub.
#[no_mangle]
pub extern "C" fn nixl_capi_is_stub() -> bool {
    false
}

/// The implementation, a static string: `nixl-rs <version> (NIXL C API 1.5.1)`.
#[no_mangle]
pub extern "C" fn nixl_rs_capi_version() -> *const c_char {
    crate::IMPLEMENTATION.as_ptr().cast()
}

/// The native transport libraries mapped in this process, newline-separated
/// (`malloc`ed; the caller `free`s it).
#[no_mangle]
pub unsafe extern "C" fn nixl_rs_capi_native_libraries(paths: *mut *mut c_char) -> Status {
    guard("native_libraries", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe { Out::new(paths, "paths") }?;
        out.set(malloc_str(&nixl_compat::native_libraries().join("\n"))?);
        ok()
    })
}
