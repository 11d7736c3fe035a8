//! Shims of the value handles: parameters and their iterator, memory-type and
//! string lists, optional arguments, descriptor lists, notification maps, query
//! responses.

use std::ffi::{c_char, c_void, CString};
use std::sync::Mutex;

use super::{
    bytes, cstr, destroy, get, guard, index, malloc_copy, new_handle, ok, tagged, Handle, Out,
};
use crate::lists::{mem, DescList, NotifMap, OptArgs, Params, QueryResponses, RemoteList};
use crate::runtime::Locked;
use crate::status::{Failure, Status};

/// `nixl_capi_params_t`.
pub struct ParamsH(pub Mutex<Params>);
/// `nixl_capi_param_iter_t`: walks a parameter map by index; the map outlives it
/// (NIXL's contract) and is not changed meanwhile.
pub struct ParamIterH {
    params: *const Handle<ParamsH>,
    next: Mutex<usize>,
}
/// `nixl_capi_mem_list_t`.
pub struct MemListH(pub Vec<u32>);
/// `nixl_capi_string_list_t`.
pub struct StringListH(pub Vec<CString>);
/// `nixl_capi_opt_args_t`.
pub struct OptArgsH(pub Mutex<OptArgs>);
/// `nixl_capi_xfer_dlist_t`.
pub struct XferListH(pub Mutex<DescList>);
/// `nixl_capi_reg_dlist_t`.
pub struct RegListH(pub Mutex<DescList>);
/// `nixl_capi_remote_dlist_t`.
pub struct RemoteListH(pub Mutex<RemoteList>);
/// `nixl_capi_notif_map_t`.
pub struct NotifMapH(pub Mutex<NotifMap>);
/// `nixl_capi_query_resp_list_t`.
pub struct QueryRespH(pub Mutex<QueryResponses>);

tagged! {
    ParamsH => 0x6e69_786c_5052_4d53, "params handle";
    ParamIterH => 0x6e69_786c_5049_5452, "param iterator handle";
    MemListH => 0x6e69_786c_4d45_4d4c, "mem list handle";
    StringListH => 0x6e69_786c_5354_524c, "string list handle";
    OptArgsH => 0x6e69_786c_4f50_5441, "opt args handle";
    XferListH => 0x6e69_786c_5846_444c, "xfer dlist handle";
    RegListH => 0x6e69_786c_5245_444c, "reg dlist handle";
    RemoteListH => 0x6e69_786c_524d_444c, "remote dlist handle";
    NotifMapH => 0x6e69_786c_4e54_4650, "notif map handle";
    QueryRespH => 0x6e69_786c_5152_5350, "query resp list handle";
}

// ---- parameters ---------------------------------------------------------------

/// New empty parameters.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_params(params: *mut *mut Handle<ParamsH>) -> Status {
    guard("create_params", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe { Out::new(params, "params") }?;
        out.set(new_handle(ParamsH(Mutex::default())));
        ok()
    })
}

/// Free parameters.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_params(params: *mut Handle<ParamsH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_params", params) }
}

/// Set `key` to `value`.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_params_add(
    params: *mut Handle<ParamsH>,
    key: *const c_char,
    value: *const c_char,
) -> Status {
    guard("params_add", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (p, k, v) = unsafe { (get(params)?, cstr(key, "key")?, cstr(value, "value")?) };
        p.0.locked().add(k, v);
        ok()
    })
}

/// Whether there are none.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_params_is_empty(
    params: *mut Handle<ParamsH>,
    is_empty: *mut bool,
) -> Status {
    guard("params_is_empty", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (p, out) = unsafe { (get(params)?, Out::new(is_empty, "is_empty")?) };
        out.set(p.0.locked().0.is_empty());
        ok()
    })
}

/// An iterator over the parameters.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_params_create_iterator(
    params: *mut Handle<ParamsH>,
    iter: *mut *mut Handle<ParamIterH>,
) -> Status {
    guard("params_create_iterator", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe {
            get(params)?;
            Out::new(iter, "iter")?
        };
        out.set(new_handle(ParamIterH {
            params,
            next: Mutex::new(0),
        }));
        ok()
    })
}

/// The next pair: pointers into the parameters themselves (valid while they are
/// unchanged); at the end `has_next` is false and `key`/`value` are not written.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_params_iterator_next(
    iter: *mut Handle<ParamIterH>,
    key: *mut *const c_char,
    value: *mut *const c_char,
    has_next: *mut bool,
) -> Status {
    guard("params_iterator_next", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs); the
        // iterator's map outlives it (the API's contract).
        let (it, k, v, more, params) = unsafe {
            let it = get(iter)?;
            (
                it,
                Out::new(key, "key")?,
                Out::new(value, "value")?,
                Out::new(has_next, "has_next")?,
                get(it.params)?,
            )
        };
        let map = params.0.locked();
        let mut next = it.next.locked();
        match map.0.get(*next) {
            Some((mk, mv)) => {
                k.set(mk.as_ptr());
                v.set(mv.as_ptr());
                *next += 1;
                more.set(*next < map.0.len());
            }
            None => more.set(false),
        }
        ok()
    })
}

/// Free an iterator.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_params_destroy_iterator(
    iter: *mut Handle<ParamIterH>,
) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("params_destroy_iterator", iter) }
}

// ---- memory-type and string lists ----------------------------------------------

/// Whether the memory-type list is empty.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_mem_list_is_empty(
    list: *mut Handle<MemListH>,
    is_empty: *mut bool,
) -> Status {
    guard("mem_list_is_empty", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(is_empty, "is_empty")?) };
        out.set(l.0.is_empty());
        ok()
    })
}

/// Its size.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_mem_list_size(
    list: *mut Handle<MemListH>,
    size: *mut usize,
) -> Status {
    guard("mem_list_size", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(size, "size")?) };
        out.set(l.0.len());
        ok()
    })
}

/// Entry `index`.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_mem_list_get(
    list: *mut Handle<MemListH>,
    index_: usize,
    mem_type: *mut u32,
) -> Status {
    guard("mem_list_get", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(mem_type, "mem_type")?) };
        out.set(l.0[index(index_, l.0.len(), "mem list")?]);
        ok()
    })
}

/// A memory type's name (static).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_mem_type_to_string(
    mem_type: u32,
    s: *mut *const c_char,
) -> Status {
    guard("mem_type_to_string", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe { Out::new(s, "str") }?;
        let name = mem::NAMES
            .get(mem_type as usize)
            .ok_or_else(|| Failure::invalid(format!("memory type {mem_type} is not one")))?;
        out.set(name.as_ptr().cast());
        ok()
    })
}

/// Free a memory-type list.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_mem_list(list: *mut Handle<MemListH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_mem_list", list) }
}

/// Its size.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_string_list_size(
    list: *mut Handle<StringListH>,
    size: *mut usize,
) -> Status {
    guard("string_list_size", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(size, "size")?) };
        out.set(l.0.len());
        ok()
    })
}

/// String `index`, borrowed until the list is destroyed.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_string_list_get(
    list: *mut Handle<StringListH>,
    index_: usize,
    s: *mut *const c_char,
) -> Status {
    guard("string_list_get", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(s, "str")?) };
        out.set(l.0[index(index_, l.0.len(), "string list")?].as_ptr());
        ok()
    })
}

/// Free a string list.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_string_list(list: *mut Handle<StringListH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_string_list", list) }
}

// ---- optional arguments -----------------------------------------------------------

/// New default optional arguments.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_opt_args(args: *mut *mut Handle<OptArgsH>) -> Status {
    guard("create_opt_args", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe { Out::new(args, "args") }?;
        out.set(new_handle(OptArgsH(Mutex::default())));
        ok()
    })
}

/// Free optional arguments.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_opt_args(args: *mut Handle<OptArgsH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_opt_args", args) }
}

/// Set the notification message.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_set_notif_msg(
    args: *mut Handle<OptArgsH>,
    data: *const c_void,
    len: usize,
) -> Status {
    guard("opt_args_set_notif_msg", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, d) = unsafe { (get(args)?, bytes(data, len, "data")?) };
        a.0.locked().notif_msg = d.to_vec();
        ok()
    })
}

/// A `malloc`ed copy of the notification message (empty: null and 0).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_get_notif_msg(
    args: *mut Handle<OptArgsH>,
    data: *mut *mut c_void,
    len: *mut usize,
) -> Status {
    guard("opt_args_get_notif_msg", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, d, l) = unsafe { (get(args)?, Out::new(data, "data")?, Out::new(len, "len")?) };
        let a = a.0.locked();
        put_blob(&a.notif_msg, d, l)
    })
}

fn put_blob(b: &[u8], d: Out<*mut c_void>, l: Out<usize>) -> crate::status::Outcome<Status> {
    if b.is_empty() {
        d.set(std::ptr::null_mut());
    } else {
        d.set(malloc_copy(b)?);
    }
    l.set(b.len());
    ok()
}

/// Set the backend-defined blob.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_set_custom_param(
    args: *mut Handle<OptArgsH>,
    data: *const c_void,
    len: usize,
) -> Status {
    guard("opt_args_set_custom_param", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, d) = unsafe { (get(args)?, bytes(data, len, "data")?) };
        a.0.locked().custom_param = Some(d.to_vec());
        ok()
    })
}

/// A `malloc`ed copy of the backend-defined blob (unset: null and 0).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_get_custom_param(
    args: *mut Handle<OptArgsH>,
    data: *mut *mut c_void,
    len: *mut usize,
) -> Status {
    guard("opt_args_get_custom_param", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, d, l) = unsafe { (get(args)?, Out::new(data, "data")?, Out::new(len, "len")?) };
        let a = a.0.locked();
        put_blob(a.custom_param.as_deref().unwrap_or_default(), d, l)
    })
}

/// Whether to send the notification.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_set_has_notif(
    args: *mut Handle<OptArgsH>,
    has_notif: bool,
) -> Status {
    guard("opt_args_set_has_notif", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        unsafe { get(args) }?.0.locked().has_notif = has_notif;
        ok()
    })
}

/// Whether the notification is sent.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_get_has_notif(
    args: *mut Handle<OptArgsH>,
    has_notif: *mut bool,
) -> Status {
    guard("opt_args_get_has_notif", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, out) = unsafe { (get(args)?, Out::new(has_notif, "has_notif")?) };
        out.set(a.0.locked().has_notif);
        ok()
    })
}

/// Keep adjacent descriptors apart (prepared requests).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_set_skip_desc_merge(
    args: *mut Handle<OptArgsH>,
    skip_merge: bool,
) -> Status {
    guard("opt_args_set_skip_desc_merge", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        unsafe { get(args) }?.0.locked().skip_desc_merge = skip_merge;
        ok()
    })
}

/// Whether adjacent descriptors are kept apart.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_get_skip_desc_merge(
    args: *mut Handle<OptArgsH>,
    skip_merge: *mut bool,
) -> Status {
    guard("opt_args_get_skip_desc_merge", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, out) = unsafe { (get(args)?, Out::new(skip_merge, "skip_merge")?) };
        out.set(a.0.locked().skip_desc_merge);
        ok()
    })
}

/// The peer's address for the metadata calls.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_set_ip_addr(
    args: *mut Handle<OptArgsH>,
    ip_addr: *const c_char,
) -> Status {
    guard("opt_args_set_ip_addr", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (a, ip) = unsafe { (get(args)?, cstr(ip_addr, "ip_addr")?) };
        a.0.locked().ip_addr = ip.to_owned();
        ok()
    })
}

/// Its port.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_opt_args_set_port(
    args: *mut Handle<OptArgsH>,
    port: u16,
) -> Status {
    guard("opt_args_set_port", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        unsafe { get(args) }?.0.locked().port = port;
        ok()
    })
}

// ---- notification maps ---------------------------------------------------------------

/// A new empty notification map.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_notif_map(
    notif_map: *mut *mut Handle<NotifMapH>,
) -> Status {
    guard("create_notif_map", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe { Out::new(notif_map, "notif_map") }?;
        out.set(new_handle(NotifMapH(Mutex::default())));
        ok()
    })
}

/// Free a notification map.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_notif_map(notif_map: *mut Handle<NotifMapH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_notif_map", notif_map) }
}

/// The number of senders in the map.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_notif_map_size(
    map: *mut Handle<NotifMapH>,
    size: *mut usize,
) -> Status {
    guard("notif_map_size", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (m, out) = unsafe { (get(map)?, Out::new(size, "size")?) };
        out.set(m.0.locked().0.len());
        ok()
    })
}

/// Sender `index` (borrowed until the map changes).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_notif_map_get_agent_at(
    map: *mut Handle<NotifMapH>,
    index_: usize,
    agent_name: *mut *const c_char,
) -> Status {
    guard("notif_map_get_agent_at", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (m, out) = unsafe { (get(map)?, Out::new(agent_name, "agent_name")?) };
        let m = m.0.locked();
        out.set(m.0[index(index_, m.0.len(), "notif map")?].0.as_ptr());
        ok()
    })
}

/// The number of notifications from `agent_name`.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_notif_map_get_notifs_size(
    map: *mut Handle<NotifMapH>,
    agent_name: *const c_char,
    size: *mut usize,
) -> Status {
    guard("notif_map_get_notifs_size", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (m, name, out) = unsafe {
            (
                get(map)?,
                cstr(agent_name, "agent_name")?,
                Out::new(size, "size")?,
            )
        };
        out.set(m.0.locked().of(name.as_bytes())?.len());
        ok()
    })
}

/// Notification `index` from `agent_name` (borrowed until the map changes).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_notif_map_get_notif(
    map: *mut Handle<NotifMapH>,
    agent_name: *const c_char,
    index_: usize,
    data: *mut *const c_void,
    len: *mut usize,
) -> Status {
    guard("notif_map_get_notif", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (m, name, d, l) = unsafe {
            (
                get(map)?,
                cstr(agent_name, "agent_name")?,
                Out::new(data, "data")?,
                Out::new(len, "len")?,
            )
        };
        let m = m.0.locked();
        let v = m.of(name.as_bytes())?;
        let msg = &v[index(index_, v.len(), "notification")?];
        d.set(msg.as_ptr().cast());
        l.set(msg.len());
        ok()
    })
}

/// Empty the map.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_notif_map_clear(map: *mut Handle<NotifMapH>) -> Status {
    guard("notif_map_clear", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        unsafe { get(map) }?.0.locked().0.clear();
        ok()
    })
}

// ---- query responses -------------------------------------------------------------------

/// A new empty response list.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_query_resp_list(
    list: *mut *mut Handle<QueryRespH>,
) -> Status {
    guard("create_query_resp_list", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe { Out::new(list, "list") }?;
        out.set(new_handle(QueryRespH(Mutex::default())));
        ok()
    })
}

/// Free a response list.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_query_resp_list(
    list: *mut Handle<QueryRespH>,
) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_query_resp_list", list) }
}

/// The number of responses.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_query_resp_list_size(
    list: *mut Handle<QueryRespH>,
    size: *mut usize,
) -> Status {
    guard("query_resp_list_size", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(size, "size")?) };
        out.set(l.0.locked().0.len());
        ok()
    })
}

/// Whether response `index` holds parameters.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_query_resp_list_has_value(
    list: *mut Handle<QueryRespH>,
    index_: usize,
    has_value: *mut bool,
) -> Status {
    guard("query_resp_list_has_value", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(has_value, "has_value")?) };
        let l = l.0.locked();
        out.set(l.0[index(index_, l.0.len(), "query response")?].is_some());
        ok()
    })
}

/// A new copy of response `index`'s parameters (the caller destroys it).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_query_resp_list_get_params(
    list: *mut Handle<QueryRespH>,
    index_: usize,
    params: *mut *mut Handle<ParamsH>,
) -> Status {
    guard("query_resp_list_get_params", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, out) = unsafe { (get(list)?, Out::new(params, "params")?) };
        let l = l.0.locked();
        let p = l.0[index(index_, l.0.len(), "query response")?]
            .clone()
            .ok_or_else(|| Failure::invalid(format!("query response {index_} holds no value")))?;
        out.set(new_handle(ParamsH(Mutex::new(p))));
        ok()
    })
}
