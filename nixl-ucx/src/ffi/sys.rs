//! Our own declarations of the part of the UCP API this backend uses.
//!
//! Written from the documented API, not copied from UCX's headers. Layouts were checked
//! against the installed headers of UCX 1.13 (Debian 12) and 1.22 (the `libucx-cu12`
//! wheel): every parameter struct starts with a field mask and only grows at its end,
//! so we declare the common prefix we use and pad each struct past the largest size we
//! have seen (the library reads only the fields our mask names). The `layout` unit test
//! pins the offsets.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ucs_status_t`: a packed (one-byte) enum in UCX.
pub(crate) type Status = i8;
/// `ucs_status_ptr_t`: a request pointer, `NULL` (done) or a status cast to a pointer.
pub(crate) type StatusPtr = *mut c_void;

pub(crate) type Context = *mut c_void;
pub(crate) type Config = *mut c_void;
pub(crate) type Worker = *mut c_void;
pub(crate) type Ep = *mut c_void;
pub(crate) type MemH = *mut c_void;
pub(crate) type RKey = *mut c_void;
pub(crate) type Address = c_void;

pub(crate) const UCS_OK: Status = 0;
pub(crate) const UCS_INPROGRESS: Status = 1;
pub(crate) const UCS_ERR_NO_MEMORY: Status = -4;
pub(crate) const UCS_ERR_BUSY: Status = -15;
pub(crate) const UCS_ERR_CANCELED: Status = -16;
pub(crate) const UCS_ERR_CONNECTION_RESET: Status = -25;
pub(crate) const UCS_ERR_UNREACHABLE: Status = -6;
pub(crate) const UCS_ERR_FIRST_LINK_FAILURE: Status = -40;
pub(crate) const UCS_ERR_LAST_ENDPOINT_FAILURE: Status = -89;
pub(crate) const UCS_ERR_TIMED_OUT: Status = -20;
pub(crate) const UCS_ERR_NOT_CONNECTED: Status = -24;
pub(crate) const UCS_ERR_REJECTED: Status = -23;
/// `UCS_ERR_LAST`: status pointers are the values at or above this, as unsigned.
pub(crate) const UCS_ERR_LAST: isize = -100;

// ucp_params_t
pub(crate) const PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub(crate) const FEATURE_RMA: u64 = 1 << 1;
pub(crate) const FEATURE_WAKEUP: u64 = 1 << 4;
pub(crate) const FEATURE_AM: u64 = 1 << 6;

// ucp_worker_params_t
pub(crate) const WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub(crate) const THREAD_MODE_SERIALIZED: c_uint = 1;

// ucp_ep_params_t
pub(crate) const EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub(crate) const ERR_HANDLING_MODE_NONE: c_uint = 0;
pub(crate) const ERR_HANDLING_MODE_PEER: c_uint = 1;

// ucp_mem_map_params_t
pub(crate) const MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub(crate) const MEM_MAP_ALLOCATE: c_uint = 1 << 1;
pub(crate) const MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub(crate) const MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
pub(crate) const MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub(crate) const MEM_MAP_PROT_LOCAL_WRITE: c_uint = 1 << 1;
pub(crate) const MEM_MAP_PROT_REMOTE_READ: c_uint = 1 << 8;
pub(crate) const MEM_MAP_PROT_REMOTE_WRITE: c_uint = 1 << 9;
pub(crate) const MEMORY_TYPE_HOST: c_uint = 0;
pub(crate) const MEMORY_TYPE_CUDA: c_uint = 1;

// ucp_mem_attr_t
pub(crate) const MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;

// ucp_request_param_t
pub(crate) const OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(crate) const EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
pub(crate) const AM_SEND_FLAG_REPLY: u32 = 1 << 0;
pub(crate) const AM_SEND_FLAG_EAGER: u32 = 1 << 1;
#[cfg(test)]
pub(crate) const AM_SEND_FLAG_RNDV: u32 = 1 << 2;

// ucp_am_handler_param_t
pub(crate) const AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub(crate) const AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub(crate) const AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub(crate) const AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
pub(crate) const AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
pub(crate) const AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
pub(crate) const AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

// ucp_context_attr_t
pub(crate) const ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;

/// `ucp_params_t` (80 bytes in 1.13, 88 in 1.22).
#[repr(C)]
pub(crate) struct Params {
    pub(crate) field_mask: u64,
    pub(crate) features: u64,
    pub(crate) request_size: usize,
    pub(crate) request_init: *mut c_void,
    pub(crate) request_cleanup: *mut c_void,
    pub(crate) tag_sender_mask: u64,
    pub(crate) mt_workers_shared: c_int,
    pub(crate) _pad: c_int,
    pub(crate) _reserved: [u64; 10],
}

/// `ucp_worker_params_t` (200 bytes in both).
#[repr(C)]
pub(crate) struct WorkerParams {
    pub(crate) field_mask: u64,
    pub(crate) thread_mode: c_uint,
    pub(crate) _pad: c_uint,
    /// `ucs_cpu_set_t`: 1024 bits.
    pub(crate) cpu_mask: [u64; 16],
    pub(crate) events: u64,
    pub(crate) _reserved: [u64; 12],
}

/// `ucp_err_handler_cb_t`.
pub(crate) type ErrHandlerCb = unsafe extern "C" fn(arg: *mut c_void, ep: Ep, status: Status);

/// `ucp_ep_params_t` (104 bytes in both).
#[repr(C)]
pub(crate) struct EpParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *const Address,
    pub(crate) err_mode: c_uint,
    pub(crate) _pad: c_uint,
    pub(crate) err_cb: Option<ErrHandlerCb>,
    pub(crate) err_arg: *mut c_void,
    pub(crate) user_data: *mut c_void,
    pub(crate) flags: c_uint,
    pub(crate) _pad2: c_uint,
    pub(crate) _reserved: [u64; 12],
}

/// `ucp_mem_map_params_t` (40 bytes in 1.13, 48 in 1.22).
#[repr(C)]
pub(crate) struct MemMapParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *mut c_void,
    pub(crate) length: usize,
    pub(crate) flags: c_uint,
    pub(crate) prot: c_uint,
    pub(crate) memory_type: c_uint,
    pub(crate) _pad: c_uint,
    pub(crate) _reserved: [u64; 8],
}

/// `ucp_mem_attr_t` (32 bytes in both; we read the first three fields).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct MemAttr {
    pub(crate) field_mask: u64,
    pub(crate) address: *mut c_void,
    pub(crate) length: usize,
    pub(crate) mem_type: c_uint,
    pub(crate) _pad: c_uint,
}

/// `ucp_request_param_t` (72 bytes in 1.13, 96 in 1.22).
#[repr(C)]
pub(crate) struct RequestParam {
    pub(crate) op_attr_mask: u32,
    pub(crate) flags: u32,
    pub(crate) request: *mut c_void,
    /// A union of callback pointers; we never set one (requests are polled).
    pub(crate) cb: *mut c_void,
    pub(crate) datatype: u64,
    pub(crate) user_data: *mut c_void,
    pub(crate) reply_buffer: *mut c_void,
    pub(crate) memory_type: c_uint,
    pub(crate) _pad: c_uint,
    pub(crate) recv_info: *mut c_void,
    pub(crate) _reserved: [u64; 10],
}

/// `ucp_am_recv_param_t` (16 bytes; only read).
#[repr(C)]
pub(crate) struct AmRecvParam {
    pub(crate) recv_attr: u64,
    pub(crate) reply_ep: Ep,
}

/// `ucp_am_recv_callback_t`.
pub(crate) type AmRecvCb = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const AmRecvParam,
) -> Status;

/// `ucp_am_handler_param_t` (32 bytes in both).
#[repr(C)]
pub(crate) struct AmHandlerParam {
    pub(crate) field_mask: u64,
    pub(crate) id: c_uint,
    pub(crate) flags: u32,
    pub(crate) cb: Option<AmRecvCb>,
    pub(crate) arg: *mut c_void,
    pub(crate) _reserved: [u64; 4],
}

/// `ucp_context_attr_t` (64 bytes in 1.13, 72 in 1.22; written by the library, masked).
#[repr(C)]
pub(crate) struct ContextAttr {
    pub(crate) field_mask: u64,
    pub(crate) request_size: usize,
    pub(crate) thread_mode: c_uint,
    pub(crate) _pad: c_uint,
    pub(crate) memory_types: u64,
    pub(crate) name: [c_char; 32],
    pub(crate) _reserved: [u64; 8],
}

macro_rules! zeroed_default {
    ($($t:ty),*) => {$(
        impl Default for $t {
            fn default() -> Self {
                // SAFETY: every field is an integer, a raw pointer, an `Option` of a
                // function pointer or an array of those: all-zero is a valid value
                // (null pointers, `None`), and it is what UCX expects for unused fields.
                unsafe { std::mem::zeroed() }
            }
        }
    )*};
}
zeroed_default!(
    Params,
    WorkerParams,
    EpParams,
    MemMapParams,
    RequestParam,
    AmHandlerParam,
    ContextAttr,
    MemAttr,
    UctComponentAttr
);

/// `UCS_PTR_IS_ERR`.
pub(crate) fn ptr_is_err(p: StatusPtr) -> bool {
    (p as usize) >= (UCS_ERR_LAST as usize)
}

/// `UCS_PTR_IS_PTR`.
pub(crate) fn ptr_is_ptr(p: StatusPtr) -> bool {
    (p as usize).wrapping_sub(1) < (UCS_ERR_LAST as usize).wrapping_sub(1)
}

/// `UCS_PTR_RAW_STATUS`.
pub(crate) fn ptr_status(p: StatusPtr) -> Status {
    p as isize as Status
}

/// `uct_component_h`.
pub(crate) type UctComponent = *mut c_void;

// uct_component_attr_t
pub(crate) const UCT_COMPONENT_ATTR_FIELD_NAME: u64 = 1 << 0;
pub(crate) const UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT: u64 = 1 << 1;

/// `uct_component_attr_t` (48 bytes, the same in 1.13 and 1.22).
#[repr(C)]
pub(crate) struct UctComponentAttr {
    pub(crate) field_mask: u64,
    /// `UCT_COMPONENT_NAME_MAX`.
    pub(crate) name: [c_char; 16],
    pub(crate) md_resource_count: c_uint,
    pub(crate) md_resources: *mut c_void,
    pub(crate) flags: u64,
}

/// The few libuct functions we call (resolved through libucp's dependency scope, so
/// they are the libuct that libucp itself uses).
#[derive(Clone, Copy)]
pub(crate) struct UctApi {
    pub(crate) query_components:
        unsafe extern "C" fn(*mut *mut UctComponent, *mut c_uint) -> Status,
    pub(crate) release_component_list: unsafe extern "C" fn(*mut UctComponent),
    pub(crate) component_query: unsafe extern "C" fn(UctComponent, *mut UctComponentAttr) -> Status,
}

/// The function table, resolved from the loaded `libucp` at run time.
#[derive(Clone, Copy)]
pub(crate) struct Api {
    pub(crate) get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub(crate) status_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(crate) config_read:
        unsafe extern "C" fn(*const c_char, *const c_char, *mut Config) -> Status,
    pub(crate) config_modify: unsafe extern "C" fn(Config, *const c_char, *const c_char) -> Status,
    pub(crate) config_release: unsafe extern "C" fn(Config),
    pub(crate) init_version:
        unsafe extern "C" fn(c_uint, c_uint, *const Params, Config, *mut Context) -> Status,
    pub(crate) cleanup: unsafe extern "C" fn(Context),
    pub(crate) context_query: unsafe extern "C" fn(Context, *mut ContextAttr) -> Status,
    pub(crate) worker_create:
        unsafe extern "C" fn(Context, *const WorkerParams, *mut Worker) -> Status,
    pub(crate) worker_destroy: unsafe extern "C" fn(Worker),
    pub(crate) worker_get_address:
        unsafe extern "C" fn(Worker, *mut *mut Address, *mut usize) -> Status,
    pub(crate) worker_release_address: unsafe extern "C" fn(Worker, *mut Address),
    pub(crate) worker_get_efd: unsafe extern "C" fn(Worker, *mut c_int) -> Status,
    pub(crate) worker_arm: unsafe extern "C" fn(Worker) -> Status,
    pub(crate) worker_progress: unsafe extern "C" fn(Worker) -> c_uint,
    pub(crate) worker_set_am_recv_handler:
        unsafe extern "C" fn(Worker, *const AmHandlerParam) -> Status,
    pub(crate) ep_create: unsafe extern "C" fn(Worker, *const EpParams, *mut Ep) -> Status,
    pub(crate) ep_close_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> StatusPtr,
    pub(crate) ep_flush_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> StatusPtr,
    pub(crate) mem_map: unsafe extern "C" fn(Context, *const MemMapParams, *mut MemH) -> Status,
    pub(crate) mem_unmap: unsafe extern "C" fn(Context, MemH) -> Status,
    pub(crate) mem_query: unsafe extern "C" fn(MemH, *mut MemAttr) -> Status,
    pub(crate) rkey_pack:
        unsafe extern "C" fn(Context, MemH, *mut *mut c_void, *mut usize) -> Status,
    pub(crate) rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub(crate) ep_rkey_unpack: unsafe extern "C" fn(Ep, *const c_void, *mut RKey) -> Status,
    pub(crate) rkey_destroy: unsafe extern "C" fn(RKey),
    pub(crate) put_nbx:
        unsafe extern "C" fn(Ep, *const c_void, usize, u64, RKey, *const RequestParam) -> StatusPtr,
    pub(crate) get_nbx:
        unsafe extern "C" fn(Ep, *mut c_void, usize, u64, RKey, *const RequestParam) -> StatusPtr,
    pub(crate) am_send_nbx: unsafe extern "C" fn(
        Ep,
        c_uint,
        *const c_void,
        usize,
        *const c_void,
        usize,
        *const RequestParam,
    ) -> StatusPtr,
    pub(crate) request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    pub(crate) request_free: unsafe extern "C" fn(*mut c_void),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets measured with `offsetof` against the headers of UCX 1.13.1 and 1.22.0
    /// (identical for every field we declare); sizes at least the larger of the two.
    #[test]
    fn layout() {
        assert_eq!(offset_of!(Params, features), 8);
        assert_eq!(offset_of!(Params, mt_workers_shared), 48);
        assert!(size_of::<Params>() >= 88);

        assert_eq!(offset_of!(WorkerParams, thread_mode), 8);
        assert_eq!(offset_of!(WorkerParams, cpu_mask), 16);
        assert_eq!(offset_of!(WorkerParams, events), 144);
        assert!(size_of::<WorkerParams>() >= 200);

        assert_eq!(offset_of!(EpParams, address), 8);
        assert_eq!(offset_of!(EpParams, err_mode), 16);
        assert_eq!(offset_of!(EpParams, err_cb), 24);
        assert_eq!(offset_of!(EpParams, err_arg), 32);
        assert_eq!(offset_of!(EpParams, user_data), 40);
        assert_eq!(offset_of!(EpParams, flags), 48);
        assert!(size_of::<EpParams>() >= 104);

        assert_eq!(offset_of!(MemMapParams, address), 8);
        assert_eq!(offset_of!(MemMapParams, length), 16);
        assert_eq!(offset_of!(MemMapParams, flags), 24);
        assert_eq!(offset_of!(MemMapParams, prot), 28);
        assert_eq!(offset_of!(MemMapParams, memory_type), 32);
        assert!(size_of::<MemMapParams>() >= 48);

        assert_eq!(offset_of!(RequestParam, flags), 4);
        assert_eq!(offset_of!(RequestParam, request), 8);
        assert_eq!(offset_of!(RequestParam, cb), 16);
        assert_eq!(offset_of!(RequestParam, datatype), 24);
        assert_eq!(offset_of!(RequestParam, user_data), 32);
        assert_eq!(offset_of!(RequestParam, reply_buffer), 40);
        assert_eq!(offset_of!(RequestParam, memory_type), 48);
        assert_eq!(offset_of!(RequestParam, recv_info), 56);
        assert!(size_of::<RequestParam>() >= 96);

        assert_eq!(offset_of!(AmHandlerParam, id), 8);
        assert_eq!(offset_of!(AmHandlerParam, flags), 12);
        assert_eq!(offset_of!(AmHandlerParam, cb), 16);
        assert_eq!(offset_of!(AmHandlerParam, arg), 24);
        assert!(size_of::<AmHandlerParam>() >= 32);

        assert_eq!(offset_of!(AmRecvParam, reply_ep), 8);
        assert_eq!(size_of::<AmRecvParam>(), 16);

        assert_eq!(offset_of!(ContextAttr, thread_mode), 16);
        assert_eq!(offset_of!(ContextAttr, memory_types), 24);
        assert_eq!(offset_of!(ContextAttr, name), 32);
        assert!(size_of::<ContextAttr>() >= 72);

        assert_eq!(offset_of!(MemAttr, address), 8);
        assert_eq!(offset_of!(MemAttr, length), 16);
        assert_eq!(offset_of!(MemAttr, mem_type), 24);
        assert_eq!(size_of::<MemAttr>(), 32);

        assert_eq!(offset_of!(UctComponentAttr, name), 8);
        assert_eq!(offset_of!(UctComponentAttr, md_resource_count), 24);
        assert_eq!(offset_of!(UctComponentAttr, md_resources), 32);
        assert_eq!(offset_of!(UctComponentAttr, flags), 40);
        assert_eq!(size_of::<UctComponentAttr>(), 48);
    }

    #[test]
    fn status_pointers() {
        assert!(!ptr_is_err(std::ptr::null_mut()));
        assert!(!ptr_is_ptr(std::ptr::null_mut()));
        let e = UCS_ERR_CANCELED as isize as StatusPtr;
        assert!(ptr_is_err(e) && !ptr_is_ptr(e));
        assert_eq!(ptr_status(e), UCS_ERR_CANCELED);
        let p = 0x1000 as StatusPtr;
        assert!(ptr_is_ptr(p) && !ptr_is_err(p));
    }
}
