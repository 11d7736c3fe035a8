//! Shims of the descriptor lists: transfer and registration lists (one macro for
//! both) and remote lists.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

use super::lists::{RegListH, RemoteListH, XferListH};
use super::{bytes, cstr, destroy, get, guard, new_handle, ok, Handle, Out};
use crate::lists::{mem, DescList, RegDesc, RemoteList};
use crate::runtime::Locked;
use crate::status::{Failure, Status};

macro_rules! dlist_shims {
    ($h:ident, $what:literal, $create:ident, $destroy:ident, $get_type:ident, $count:ident,
     $is_empty:ident, $trim:ident, $rem:ident, $clear:ident, $resize:ident, $print:ident) => {
        /// A new empty list of `mem_type`.
        #[no_mangle]
        pub unsafe extern "C" fn $create(mem_type: u32, dlist: *mut *mut Handle<$h>) -> Status {
            guard(stringify!($create), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                let out = unsafe { Out::new(dlist, "dlist") }?;
                if mem_type > mem::UNKNOWN {
                    return Err(Failure::invalid(format!(
                        "memory type {mem_type} is not one"
                    )));
                }
                out.set(new_handle($h(Mutex::new(DescList::new(mem_type)))));
                ok()
            })
        }

        /// Free the list.
        #[no_mangle]
        pub unsafe extern "C" fn $destroy(dlist: *mut Handle<$h>) -> Status {
            // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
            unsafe { destroy(stringify!($destroy), dlist) }
        }

        /// Its memory type.
        #[no_mangle]
        pub unsafe extern "C" fn $get_type(dlist: *mut Handle<$h>, mem_type: *mut u32) -> Status {
            guard(stringify!($get_type), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                let (l, out) = unsafe { (get(dlist)?, Out::new(mem_type, "mem_type")?) };
                out.set(l.0.locked().mem);
                ok()
            })
        }

        /// Its number of descriptors.
        #[no_mangle]
        pub unsafe extern "C" fn $count(dlist: *mut Handle<$h>, count: *mut usize) -> Status {
            guard(stringify!($count), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                let (l, out) = unsafe { (get(dlist)?, Out::new(count, "count")?) };
                out.set(l.0.locked().descs.len());
                ok()
            })
        }

        /// Whether it is empty.
        #[no_mangle]
        pub unsafe extern "C" fn $is_empty(dlist: *mut Handle<$h>, is_empty: *mut bool) -> Status {
            guard(stringify!($is_empty), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                let (l, out) = unsafe { (get(dlist)?, Out::new(is_empty, "is_empty")?) };
                out.set(l.0.locked().descs.is_empty());
                ok()
            })
        }

        /// Release spare capacity (NIXL's returns a trimmed copy it drops: a no-op).
        #[no_mangle]
        pub unsafe extern "C" fn $trim(dlist: *mut Handle<$h>) -> Status {
            guard(stringify!($trim), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                unsafe { get(dlist) }?.0.locked().descs.shrink_to_fit();
                ok()
            })
        }

        /// Remove descriptor `index` (out of range: BACKEND, as NIXL).
        #[no_mangle]
        pub unsafe extern "C" fn $rem(dlist: *mut Handle<$h>, index: c_int) -> Status {
            guard(stringify!($rem), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                unsafe { get(dlist) }?.0.locked().remove(index)?;
                ok()
            })
        }

        /// Remove every descriptor.
        #[no_mangle]
        pub unsafe extern "C" fn $clear(dlist: *mut Handle<$h>) -> Status {
            guard(stringify!($clear), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                unsafe { get(dlist) }?.0.locked().descs.clear();
                ok()
            })
        }

        /// Grow with zeroed descriptors, or truncate.
        #[no_mangle]
        pub unsafe extern "C" fn $resize(dlist: *mut Handle<$h>, new_size: usize) -> Status {
            guard(stringify!($resize), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                unsafe { get(dlist) }?.0.locked().resize(new_size)?;
                ok()
            })
        }

        /// Print the list to stdout.
        #[no_mangle]
        pub unsafe extern "C" fn $print(dlist: *mut Handle<$h>) -> Status {
            guard(stringify!($print), || {
                // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
                let text = unsafe { get(dlist) }?.0.locked().render($what);
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes())
                    .and_then(|()| out.flush())
                    .map_err(|e| Failure::backend(format!("print: {e}")))?;
                ok()
            })
        }
    };
}

dlist_shims!(
    XferListH,
    "transfer descriptor list",
    nixl_capi_create_xfer_dlist,
    nixl_capi_destroy_xfer_dlist,
    nixl_capi_xfer_dlist_get_type,
    nixl_capi_xfer_dlist_desc_count,
    nixl_capi_xfer_dlist_is_empty,
    nixl_capi_xfer_dlist_trim,
    nixl_capi_xfer_dlist_rem_desc,
    nixl_capi_xfer_dlist_clear,
    nixl_capi_xfer_dlist_resize,
    nixl_capi_xfer_dlist_print
);
dlist_shims!(
    RegListH,
    "registration descriptor list",
    nixl_capi_create_reg_dlist,
    nixl_capi_destroy_reg_dlist,
    nixl_capi_reg_dlist_get_type,
    nixl_capi_reg_dlist_desc_count,
    nixl_capi_reg_dlist_is_empty,
    nixl_capi_reg_dlist_trim,
    nixl_capi_reg_dlist_rem_desc,
    nixl_capi_reg_dlist_clear,
    nixl_capi_reg_dlist_resize,
    nixl_capi_reg_dlist_print
);

/// The number of descriptors (NIXL's older name).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_xfer_dlist_len(
    dlist: *mut Handle<XferListH>,
    len: *mut usize,
) -> Status {
    // SAFETY: the same contract.
    unsafe { nixl_capi_xfer_dlist_desc_count(dlist, len) }
}

/// Append a transfer descriptor.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_xfer_dlist_add_desc(
    dlist: *mut Handle<XferListH>,
    addr: usize,
    len: usize,
    dev_id: u64,
) -> Status {
    guard("xfer_dlist_add_desc", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        unsafe { get(dlist) }?.0.locked().descs.push(RegDesc {
            addr: addr as u64,
            len: len as u64,
            dev: dev_id,
            meta: Vec::new(),
        });
        ok()
    })
}

/// Append a registration descriptor with its metadata bytes.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_reg_dlist_add_desc(
    dlist: *mut Handle<RegListH>,
    addr: usize,
    len: usize,
    dev_id: u64,
    metadata: *const c_void,
    metadata_len: usize,
) -> Status {
    guard("reg_dlist_add_desc", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let (l, meta) = unsafe { (get(dlist)?, bytes(metadata, metadata_len, "metadata")?) };
        l.0.locked().descs.push(RegDesc {
            addr: addr as u64,
            len: len as u64,
            dev: dev_id,
            meta: meta.to_vec(),
        });
        ok()
    })
}

/// A new empty remote descriptor list (memory views).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_create_remote_dlist(
    mem_type: u32,
    dlist: *mut *mut Handle<RemoteListH>,
) -> Status {
    guard("create_remote_dlist", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let out = unsafe { Out::new(dlist, "dlist") }?;
        out.set(new_handle(RemoteListH(Mutex::new(RemoteList {
            mem: mem_type,
            descs: Vec::new(),
        }))));
        ok()
    })
}

/// Free a remote descriptor list.
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_destroy_remote_dlist(dlist: *mut Handle<RemoteListH>) -> Status {
    // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
    unsafe { destroy("destroy_remote_dlist", dlist) }
}

/// Append a remote descriptor (its owner's name; null: a placeholder).
#[no_mangle]
pub unsafe extern "C" fn nixl_capi_remote_dlist_add_desc(
    dlist: *mut Handle<RemoteListH>,
    addr: usize,
    len: usize,
    dev_id: u64,
    remote_agent: *const c_char,
) -> Status {
    guard("remote_dlist_add_desc", || {
        // SAFETY: C's arguments, checked by the helpers (module `ffi` docs).
        let l = unsafe { get(dlist) }?;
        let agent = if remote_agent.is_null() {
            String::new()
        } else {
            // SAFETY: as above.
            unsafe { cstr(remote_agent, "remote_agent") }?.to_owned()
        };
        l.0.locked()
            .descs
            .push((addr as u64, len as u64, dev_id, agent));
        ok()
    })
}
