//! Our own declarations of the part of libibverbs' C ABI this crate uses (x86_64
//! Linux, rdma-core 17 and later).
//!
//! Written from the ABI, not copied from rdma-core's headers or generated from them.
//! Only what this binding touches is declared; fields it never reads are kept as
//! padding of the right size so that every struct has libibverbs' exact size and
//! alignment. [`layout`] lists every size, alignment, offset and constant declared
//! here, and [`signatures`] the C type of every function this crate calls: the
//! `abi_layout` test compiles both against the host's `<infiniband/verbs.h>` and
//! compares. The `const` assertions below pin the sizes at build time.
//!
//! Two things differ from what `verbs.h` shows a C program:
//! - The data-path calls (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`,
//!   `ibv_req_notify_cq`) are `static inline` in the header: they call the provider
//!   through the object's `context->ops`. They are not exported symbols, so this crate
//!   calls through [`ibv_context_ops`] the same way.
//! - `ibv_query_port` is an inline wrapper in the header too; the exported symbol
//!   (`ibv_query_port@@IBVERBS_1.1`, the default version `dlsym` finds) fills the
//!   shorter compat struct [`ibv_port_attr_compat`] (`struct _compat_ibv_port_attr`
//!   inside rdma-core), which is `struct ibv_port_attr` without its last field.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::marker::{PhantomData, PhantomPinned};
#[cfg(feature = "abi-layout")]
use std::mem::offset_of;
use std::mem::{align_of, size_of};

/// Marks a type only ever used behind a pointer: not `Send`, `Sync` or `Unpin`, and
/// never built in Rust.
type Opaque = PhantomData<(*mut u8, PhantomPinned)>;

/// `struct ibv_device`: only ever handled by pointer (its name and GUID come from
/// `ibv_get_device_name` and `ibv_get_device_guid`).
#[repr(C)]
pub(crate) struct ibv_device {
    _data: [u8; 0],
    _marker: Opaque,
}

/// `struct ibv_pd`: only ever handled by pointer.
#[repr(C)]
pub(crate) struct ibv_pd {
    _data: [u8; 0],
    _marker: Opaque,
}

/// `struct ibv_srq`: only ever a null pointer here (no shared receive queues).
#[repr(C)]
pub(crate) struct ibv_srq {
    _data: [u8; 0],
    _marker: Opaque,
}

// --- Provider entry points in `struct ibv_context_ops` (the inline data path). -----

/// `ops.poll_cq`: `int (*)(struct ibv_cq *, int, struct ibv_wc *)`.
pub(crate) type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
/// `ops.req_notify_cq`: `int (*)(struct ibv_cq *, int solicited_only)`.
pub(crate) type ReqNotifyCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
/// `ops.post_send`.
pub(crate) type PostSendFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
/// `ops.post_recv`.
pub(crate) type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers, of which the four the header's
/// inline data-path calls use are named. The others are legacy slots (most of them
/// unused since rdma-core 17) that only keep the named ones at their offsets.
#[repr(C)]
pub(crate) struct ibv_context_ops {
    /// `_compat_query_device` .. `_compat_create_cq`.
    _slots_0_10: [*mut c_void; 11],
    /// Poll a completion queue.
    pub(crate) poll_cq: Option<PollCqFn>,
    /// Arm a completion queue's channel.
    pub(crate) req_notify_cq: Option<ReqNotifyCqFn>,
    /// `_compat_cq_event` .. `_compat_destroy_qp` (with `post_srq_recv`).
    _slots_13_24: [*mut c_void; 12],
    /// Post to a send queue.
    pub(crate) post_send: Option<PostSendFn>,
    /// Post to a receive queue.
    pub(crate) post_recv: Option<PostRecvFn>,
    /// `_compat_create_ah` .. `_compat_async_event`.
    _slots_27_31: [*mut c_void; 5],
}

/// `struct ibv_context`: an open device.
#[repr(C)]
pub(crate) struct ibv_context {
    /// The device it was opened from.
    pub(crate) device: *mut ibv_device,
    /// The provider's entry points.
    pub(crate) ops: ibv_context_ops,
    /// The uverbs command descriptor.
    pub(crate) cmd_fd: c_int,
    /// The asynchronous event descriptor.
    pub(crate) async_fd: c_int,
    /// Completion vectors available.
    pub(crate) num_comp_vectors: c_int,
    _mutex: libc::pthread_mutex_t,
    _abi_compat: *mut c_void,
}

/// `struct ibv_device_attr` (`ibv_query_device`).
#[repr(C)]
pub(crate) struct ibv_device_attr {
    _fw_ver: [c_char; 64],
    /// Big-endian.
    pub(crate) node_guid: u64,
    _sys_image_guid: u64,
    /// Largest memory region.
    pub(crate) max_mr_size: u64,
    _page_size_cap: u64,
    _vendor_id: u32,
    _vendor_part_id: u32,
    _hw_ver: u32,
    _max_qp: c_int,
    /// Deepest queue.
    pub(crate) max_qp_wr: c_int,
    _device_cap_flags: c_uint,
    /// Scatter/gather entries per work request.
    pub(crate) max_sge: c_int,
    pub(crate) max_sge_rd: c_int,
    _max_cq: c_int,
    /// Largest completion queue.
    pub(crate) max_cqe: c_int,
    _max_mr: c_int,
    _max_pd: c_int,
    /// READs a queue pair serves at once.
    pub(crate) max_qp_rd_atom: c_int,
    _max_ee_rd_atom: c_int,
    _max_res_rd_atom: c_int,
    /// READs a queue pair issues at once.
    pub(crate) max_qp_init_rd_atom: c_int,
    /// `max_ee_init_rd_atom` through `max_srq_sge` (16 `int`-sized fields, one of
    /// them the `atomic_cap` enum).
    _ints: [c_int; 16],
    _max_pkeys: u16,
    _local_ca_ack_delay: u8,
    /// Ports.
    pub(crate) phys_port_cnt: u8,
}

/// `struct _compat_ibv_port_attr`, what the exported `ibv_query_port` fills: the
/// public `struct ibv_port_attr` without its last field (`port_cap_flags2`).
#[repr(C)]
pub(crate) struct ibv_port_attr_compat {
    /// `enum ibv_port_state`.
    pub(crate) state: u32,
    /// `enum ibv_mtu`.
    pub(crate) max_mtu: u32,
    /// `enum ibv_mtu`.
    pub(crate) active_mtu: u32,
    /// GID table size.
    pub(crate) gid_tbl_len: c_int,
    _port_cap_flags: u32,
    /// Largest message.
    pub(crate) max_msg_sz: u32,
    _bad_pkey_cntr: u32,
    _qkey_viol_cntr: u32,
    _pkey_tbl_len: u16,
    /// Local identifier.
    pub(crate) lid: u16,
    _sm_lid: u16,
    /// `lmc` through `phys_state`.
    _bytes: [u8; 8],
    /// `IBV_LINK_LAYER_*`.
    pub(crate) link_layer: u8,
    _flags: u8,
}

/// `union ibv_gid`: 16 bytes, 8-aligned (its other member is two `__be64`). Only the
/// raw bytes are used, so it is declared as a struct of them with the union's
/// alignment; it is only passed by pointer or embedded, never by value.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub(crate) struct ibv_gid {
    /// The GID, network byte order.
    pub(crate) raw: [u8; 16],
}

/// `struct ibv_gid_entry` (`_ibv_query_gid_ex`, rdma-core 32 and later).
#[repr(C)]
pub(crate) struct ibv_gid_entry {
    /// The GID.
    pub(crate) gid: ibv_gid,
    /// Its index.
    pub(crate) gid_index: u32,
    /// Its port.
    pub(crate) port_num: u32,
    /// `enum ibv_gid_type`.
    pub(crate) gid_type: u32,
    /// The net device's ifindex (RoCE).
    pub(crate) ndev_ifindex: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub(crate) struct ibv_mr {
    /// The device context.
    pub(crate) context: *mut ibv_context,
    /// Its protection domain.
    pub(crate) pd: *mut ibv_pd,
    /// Start.
    pub(crate) addr: *mut c_void,
    /// Length.
    pub(crate) length: usize,
    /// Kernel handle.
    pub(crate) handle: u32,
    /// Local key.
    pub(crate) lkey: u32,
    /// Remote key.
    pub(crate) rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub(crate) struct ibv_comp_channel {
    /// The device context.
    pub(crate) context: *mut ibv_context,
    /// Readable when an event is pending.
    pub(crate) fd: c_int,
    /// Completion queues using it.
    pub(crate) refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub(crate) struct ibv_cq {
    /// The device context, whose `ops` poll and arm it.
    pub(crate) context: *mut ibv_context,
    /// Its completion channel.
    pub(crate) channel: *mut ibv_comp_channel,
    /// The user's value.
    pub(crate) cq_context: *mut c_void,
    /// Kernel handle.
    pub(crate) handle: u32,
    /// Entries granted.
    pub(crate) cqe: c_int,
    _mutex: libc::pthread_mutex_t,
    _cond: libc::pthread_cond_t,
    _comp_events_completed: u32,
    _async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub(crate) struct ibv_qp {
    /// The device context, whose `ops` post to it.
    pub(crate) context: *mut ibv_context,
    /// The user's value.
    pub(crate) qp_context: *mut c_void,
    /// Its protection domain.
    pub(crate) pd: *mut ibv_pd,
    /// Send completions go here.
    pub(crate) send_cq: *mut ibv_cq,
    /// Receive completions go here.
    pub(crate) recv_cq: *mut ibv_cq,
    /// Shared receive queue (none here).
    pub(crate) srq: *mut ibv_srq,
    /// Kernel handle.
    pub(crate) handle: u32,
    /// Its number.
    pub(crate) qp_num: u32,
    /// `enum ibv_qp_state` (as last known to the library).
    pub(crate) state: u32,
    /// `enum ibv_qp_type`.
    pub(crate) qp_type: u32,
    _mutex: libc::pthread_mutex_t,
    _cond: libc::pthread_cond_t,
    _events_completed: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_qp_cap {
    /// Send queue depth.
    pub(crate) max_send_wr: u32,
    /// Receive queue depth.
    pub(crate) max_recv_wr: u32,
    /// Entries per send.
    pub(crate) max_send_sge: u32,
    /// Entries per receive.
    pub(crate) max_recv_sge: u32,
    /// Largest inline send.
    pub(crate) max_inline_data: u32,
}

/// `struct ibv_qp_init_attr` (`ibv_create_qp`, which writes the granted `cap` back).
#[repr(C)]
pub(crate) struct ibv_qp_init_attr {
    /// The user's value.
    pub(crate) qp_context: *mut c_void,
    /// Send completion queue.
    pub(crate) send_cq: *mut ibv_cq,
    /// Receive completion queue.
    pub(crate) recv_cq: *mut ibv_cq,
    /// Shared receive queue, or null.
    pub(crate) srq: *mut ibv_srq,
    /// Capacities asked for, then granted.
    pub(crate) cap: ibv_qp_cap,
    /// `enum ibv_qp_type`.
    pub(crate) qp_type: u32,
    /// Nonzero: every send generates a completion.
    pub(crate) sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_global_route {
    /// The peer's GID.
    pub(crate) dgid: ibv_gid,
    /// Flow label.
    pub(crate) flow_label: u32,
    /// Our GID's index.
    pub(crate) sgid_index: u8,
    /// Hop limit.
    pub(crate) hop_limit: u8,
    /// Traffic class.
    pub(crate) traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_ah_attr {
    /// Global route (read when `is_global`).
    pub(crate) grh: ibv_global_route,
    /// The peer's LID.
    pub(crate) dlid: u16,
    /// Service level.
    pub(crate) sl: u8,
    /// Source path bits.
    pub(crate) src_path_bits: u8,
    /// Static rate.
    pub(crate) static_rate: u8,
    /// Whether `grh` is used.
    pub(crate) is_global: u8,
    /// Local port.
    pub(crate) port_num: u8,
}

/// `struct ibv_qp_attr` (`ibv_modify_qp`; the mask says which fields count).
#[repr(C)]
pub(crate) struct ibv_qp_attr {
    /// `enum ibv_qp_state` to move to.
    pub(crate) qp_state: u32,
    /// `enum ibv_qp_state`.
    pub(crate) cur_qp_state: u32,
    /// `enum ibv_mtu`.
    pub(crate) path_mtu: u32,
    /// `enum ibv_mig_state`.
    pub(crate) path_mig_state: u32,
    /// Q_Key (UD).
    pub(crate) qkey: u32,
    /// Receive PSN.
    pub(crate) rq_psn: u32,
    /// Send PSN.
    pub(crate) sq_psn: u32,
    /// Peer's queue pair number.
    pub(crate) dest_qp_num: u32,
    /// `enum ibv_access_flags`.
    pub(crate) qp_access_flags: c_uint,
    /// Capacities.
    pub(crate) cap: ibv_qp_cap,
    /// Primary path.
    pub(crate) ah_attr: ibv_ah_attr,
    /// Alternate path.
    pub(crate) alt_ah_attr: ibv_ah_attr,
    /// Partition key index.
    pub(crate) pkey_index: u16,
    /// Alternate partition key index.
    pub(crate) alt_pkey_index: u16,
    /// SQD event.
    pub(crate) en_sqd_async_notify: u8,
    /// Draining (query only).
    pub(crate) sq_draining: u8,
    /// READs issued at once.
    pub(crate) max_rd_atomic: u8,
    /// READs served at once.
    pub(crate) max_dest_rd_atomic: u8,
    /// RNR NAK timer.
    pub(crate) min_rnr_timer: u8,
    /// Local port.
    pub(crate) port_num: u8,
    /// Local ACK timeout.
    pub(crate) timeout: u8,
    /// Retries on timeout.
    pub(crate) retry_cnt: u8,
    /// Retries on RNR NAK.
    pub(crate) rnr_retry: u8,
    /// Alternate port.
    pub(crate) alt_port_num: u8,
    /// Alternate timeout.
    pub(crate) alt_timeout: u8,
    /// Packet pacing (kbps).
    pub(crate) rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_sge {
    /// Address.
    pub(crate) addr: u64,
    /// Bytes.
    pub(crate) length: u32,
    /// Local key.
    pub(crate) lkey: u32,
}

/// The `rdma` member of `ibv_send_wr`'s `wr` union.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_send_wr_rdma {
    /// Remote address.
    pub(crate) remote_addr: u64,
    /// Remote key.
    pub(crate) rkey: u32,
}

/// `ibv_send_wr`'s `wr` union: `rdma`, and room for its `atomic` (32 bytes) and `ud`
/// members, which this crate never posts.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union ibv_send_wr_wr {
    /// RDMA WRITE / READ.
    pub(crate) rdma: ibv_send_wr_rdma,
    _atomic_ud: [u64; 4],
}

/// `struct ibv_send_wr` (128 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_send_wr {
    /// Returned in the completion.
    pub(crate) wr_id: u64,
    /// Next in the chain, or null.
    pub(crate) next: *mut Self,
    /// Gather list.
    pub(crate) sg_list: *mut ibv_sge,
    /// Its length.
    pub(crate) num_sge: c_int,
    /// `enum ibv_wr_opcode`.
    pub(crate) opcode: u32,
    /// `enum ibv_send_flags`.
    pub(crate) send_flags: c_uint,
    /// `imm_data` (big-endian) / `invalidate_rkey` (an anonymous union in C).
    pub(crate) imm_data: u32,
    /// Operation arguments.
    pub(crate) wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`.
    pub(crate) qp_type: u32,
    /// The anonymous `bind_mw` / `tso` union (48 bytes, 8-aligned).
    _bind_mw_tso: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_recv_wr {
    /// Returned in the completion.
    pub(crate) wr_id: u64,
    /// Next in the chain, or null.
    pub(crate) next: *mut Self,
    /// Scatter list.
    pub(crate) sg_list: *mut ibv_sge,
    /// Its length.
    pub(crate) num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_wc {
    /// The work request's id.
    pub(crate) wr_id: u64,
    /// `enum ibv_wc_status`.
    pub(crate) status: u32,
    /// `enum ibv_wc_opcode`.
    pub(crate) opcode: u32,
    /// Vendor detail.
    pub(crate) vendor_err: u32,
    /// Bytes received.
    pub(crate) byte_len: u32,
    /// `imm_data` / `invalidated_rkey` (an anonymous union in C).
    pub(crate) imm_data: u32,
    /// Local queue pair.
    pub(crate) qp_num: u32,
    /// Remote queue pair (UD).
    pub(crate) src_qp: u32,
    /// `enum ibv_wc_flags`.
    pub(crate) wc_flags: c_uint,
    /// Partition key index (UD).
    pub(crate) pkey_index: u16,
    /// Source LID (UD).
    pub(crate) slid: u16,
    /// Service level (UD).
    pub(crate) sl: u8,
    /// Path bits (UD).
    pub(crate) dlid_path_bits: u8,
}

/// All-zero values of the plain-data structs this crate fills in before a call (what
/// C code gets from `= {}` or `memset`).
macro_rules! zero_consts {
    ($($t:ident),* $(,)?) => {
        $(
            impl $t {
                /// All fields zero (pointers null).
                // SAFETY: the struct holds only integers, arrays of them, unions of
                // them and raw pointers, for which all-zero bytes are valid values.
                pub(crate) const ZERO: Self = unsafe { std::mem::zeroed() };
            }
        )*
    };
}
zero_consts!(
    ibv_device_attr,
    ibv_port_attr_compat,
    ibv_gid,
    ibv_gid_entry,
    ibv_qp_init_attr,
    ibv_qp_attr,
    ibv_send_wr,
    ibv_recv_wr,
    ibv_wc,
);

// The sizes libibverbs has had on x86_64 since rdma-core 17 (its ABI never changes
// these structs; extensions go into new `_ex` structs).
const _: () = assert!(size_of::<ibv_context_ops>() == 256);
const _: () = assert!(size_of::<ibv_context>() == 328);
const _: () = assert!(size_of::<ibv_device_attr>() == 232);
const _: () = assert!(size_of::<ibv_port_attr_compat>() == 48);
const _: () = assert!(size_of::<ibv_gid>() == 16 && align_of::<ibv_gid>() == 8);
const _: () = assert!(size_of::<ibv_gid_entry>() == 32);
const _: () = assert!(size_of::<ibv_mr>() == 48);
const _: () = assert!(size_of::<ibv_comp_channel>() == 16);
const _: () = assert!(size_of::<ibv_cq>() == 128);
const _: () = assert!(size_of::<ibv_qp>() == 160);
const _: () = assert!(size_of::<ibv_qp_cap>() == 20);
const _: () = assert!(size_of::<ibv_qp_init_attr>() == 64);
const _: () = assert!(size_of::<ibv_global_route>() == 24);
const _: () = assert!(size_of::<ibv_ah_attr>() == 32);
const _: () = assert!(size_of::<ibv_qp_attr>() == 144);
const _: () = assert!(size_of::<ibv_sge>() == 16);
const _: () = assert!(size_of::<ibv_send_wr>() == 128);
const _: () = assert!(size_of::<ibv_recv_wr>() == 32);
const _: () = assert!(size_of::<ibv_wc>() == 48);

// --- Constants (enum values of verbs.h). ------------------------------------------

/// `IBV_QPT_RC`.
pub(crate) const IBV_QPT_RC: u32 = 2;

/// `IBV_QPS_INIT`.
pub(crate) const IBV_QPS_INIT: u32 = 1;
/// `IBV_QPS_RTR`.
pub(crate) const IBV_QPS_RTR: u32 = 2;
/// `IBV_QPS_RTS`.
pub(crate) const IBV_QPS_RTS: u32 = 3;
/// `IBV_QPS_ERR`.
pub(crate) const IBV_QPS_ERR: u32 = 6;

/// `IBV_QP_STATE`.
pub(crate) const IBV_QP_STATE: c_int = 1 << 0;
/// `IBV_QP_ACCESS_FLAGS`.
pub(crate) const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
/// `IBV_QP_PKEY_INDEX`.
pub(crate) const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
/// `IBV_QP_PORT`.
pub(crate) const IBV_QP_PORT: c_int = 1 << 5;
/// `IBV_QP_AV`.
pub(crate) const IBV_QP_AV: c_int = 1 << 7;
/// `IBV_QP_PATH_MTU`.
pub(crate) const IBV_QP_PATH_MTU: c_int = 1 << 8;
/// `IBV_QP_TIMEOUT`.
pub(crate) const IBV_QP_TIMEOUT: c_int = 1 << 9;
/// `IBV_QP_RETRY_CNT`.
pub(crate) const IBV_QP_RETRY_CNT: c_int = 1 << 10;
/// `IBV_QP_RNR_RETRY`.
pub(crate) const IBV_QP_RNR_RETRY: c_int = 1 << 11;
/// `IBV_QP_RQ_PSN`.
pub(crate) const IBV_QP_RQ_PSN: c_int = 1 << 12;
/// `IBV_QP_MAX_QP_RD_ATOMIC`.
pub(crate) const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
/// `IBV_QP_MIN_RNR_TIMER`.
pub(crate) const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
/// `IBV_QP_SQ_PSN`.
pub(crate) const IBV_QP_SQ_PSN: c_int = 1 << 16;
/// `IBV_QP_MAX_DEST_RD_ATOMIC`.
pub(crate) const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
/// `IBV_QP_DEST_QPN`.
pub(crate) const IBV_QP_DEST_QPN: c_int = 1 << 20;

/// `IBV_WR_RDMA_WRITE`.
pub(crate) const IBV_WR_RDMA_WRITE: u32 = 0;
/// `IBV_WR_SEND`.
pub(crate) const IBV_WR_SEND: u32 = 2;
/// `IBV_WR_RDMA_READ`.
pub(crate) const IBV_WR_RDMA_READ: u32 = 4;

/// `IBV_SEND_FENCE`.
pub(crate) const IBV_SEND_FENCE: c_uint = 1 << 0;
/// `IBV_SEND_SIGNALED`.
pub(crate) const IBV_SEND_SIGNALED: c_uint = 1 << 1;
/// `IBV_SEND_INLINE`.
pub(crate) const IBV_SEND_INLINE: c_uint = 1 << 3;

/// `IBV_WC_SEND`.
pub(crate) const IBV_WC_SEND: u32 = 0;
/// `IBV_WC_RDMA_WRITE`.
pub(crate) const IBV_WC_RDMA_WRITE: u32 = 1;
/// `IBV_WC_RDMA_READ`.
pub(crate) const IBV_WC_RDMA_READ: u32 = 2;
/// `IBV_WC_RECV`.
pub(crate) const IBV_WC_RECV: u32 = 1 << 7;

/// `IBV_LINK_LAYER_INFINIBAND`.
pub(crate) const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET`.
pub(crate) const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// `IBV_GID_TYPE_IB`.
pub(crate) const IBV_GID_TYPE_IB: u32 = 0;
/// `IBV_GID_TYPE_ROCE_V1`.
pub(crate) const IBV_GID_TYPE_ROCE_V1: u32 = 1;
/// `IBV_GID_TYPE_ROCE_V2`.
pub(crate) const IBV_GID_TYPE_ROCE_V2: u32 = 2;

// --- Exported functions, resolved at run time. ---------------------------------------

/// `ibv_get_device_list`.
pub(crate) type GetDeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
/// `ibv_free_device_list`.
pub(crate) type FreeDeviceListFn = unsafe extern "C" fn(*mut *mut ibv_device);
/// `ibv_get_device_name`.
pub(crate) type GetDeviceNameFn = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
/// `ibv_get_device_guid` (returns the GUID big-endian).
pub(crate) type GetDeviceGuidFn = unsafe extern "C" fn(*mut ibv_device) -> u64;
/// `ibv_open_device`.
pub(crate) type OpenDeviceFn = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
/// `ibv_close_device`.
pub(crate) type CloseDeviceFn = unsafe extern "C" fn(*mut ibv_context) -> c_int;
/// `ibv_query_device`.
pub(crate) type QueryDeviceFn =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
/// `ibv_query_port@@IBVERBS_1.1` (the exported symbol, with the compat struct).
pub(crate) type QueryPortFn =
    unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr_compat) -> c_int;
/// `ibv_query_gid`.
pub(crate) type QueryGidFn =
    unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
/// `_ibv_query_gid_ex` (IBVERBS_1.11: rdma-core 32 and later).
pub(crate) type QueryGidExFn =
    unsafe extern "C" fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int;
/// `ibv_alloc_pd`.
pub(crate) type AllocPdFn = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
/// `ibv_dealloc_pd`.
pub(crate) type DeallocPdFn = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
/// `ibv_reg_mr`.
pub(crate) type RegMrFn =
    unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
/// `ibv_reg_dmabuf_mr` (IBVERBS_1.12: rdma-core 34 and later).
pub(crate) type RegDmabufMrFn =
    unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
/// `ibv_dereg_mr`.
pub(crate) type DeregMrFn = unsafe extern "C" fn(*mut ibv_mr) -> c_int;
/// `ibv_create_comp_channel`.
pub(crate) type CreateCompChannelFn =
    unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel;
/// `ibv_destroy_comp_channel`.
pub(crate) type DestroyCompChannelFn = unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int;
/// `ibv_create_cq`.
pub(crate) type CreateCqFn = unsafe extern "C" fn(
    *mut ibv_context,
    c_int,
    *mut c_void,
    *mut ibv_comp_channel,
    c_int,
) -> *mut ibv_cq;
/// `ibv_destroy_cq`.
pub(crate) type DestroyCqFn = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
/// `ibv_get_cq_event`.
pub(crate) type GetCqEventFn =
    unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
/// `ibv_ack_cq_events`.
pub(crate) type AckCqEventsFn = unsafe extern "C" fn(*mut ibv_cq, c_uint);
/// `ibv_create_qp`.
pub(crate) type CreateQpFn =
    unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
/// `ibv_modify_qp`.
pub(crate) type ModifyQpFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
/// `ibv_destroy_qp`.
pub(crate) type DestroyQpFn = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
/// `ibv_wc_status_str`.
pub(crate) type WcStatusStrFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The C type of every function this crate calls, as `verbs.h` spells it, beside the
/// Rust type above that declares it: exported symbols by name, the inline data path
/// as `ibv_context_ops.<field>`. The `abi_layout` test has the C compiler check each
/// against the header (`__builtin_types_compatible_p`).
#[cfg(feature = "abi-layout")]
pub fn signatures() -> &'static [(&'static str, &'static str)] {
    &[
        ("ibv_get_device_list", "struct ibv_device **(*)(int *)"),
        ("ibv_free_device_list", "void (*)(struct ibv_device **)"),
        ("ibv_get_device_name", "const char *(*)(struct ibv_device *)"),
        ("ibv_get_device_guid", "__be64 (*)(struct ibv_device *)"),
        ("ibv_open_device", "struct ibv_context *(*)(struct ibv_device *)"),
        ("ibv_close_device", "int (*)(struct ibv_context *)"),
        (
            "ibv_query_device",
            "int (*)(struct ibv_context *, struct ibv_device_attr *)",
        ),
        (
            "ibv_query_port",
            "int (*)(struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *)",
        ),
        (
            "ibv_query_gid",
            "int (*)(struct ibv_context *, uint8_t, int, union ibv_gid *)",
        ),
        (
            "_ibv_query_gid_ex",
            "int (*)(struct ibv_context *, uint32_t, uint32_t, struct ibv_gid_entry *, uint32_t, size_t)",
        ),
        ("ibv_alloc_pd", "struct ibv_pd *(*)(struct ibv_context *)"),
        ("ibv_dealloc_pd", "int (*)(struct ibv_pd *)"),
        (
            "ibv_reg_mr",
            "struct ibv_mr *(*)(struct ibv_pd *, void *, size_t, int)",
        ),
        (
            "ibv_reg_dmabuf_mr",
            "struct ibv_mr *(*)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int)",
        ),
        ("ibv_dereg_mr", "int (*)(struct ibv_mr *)"),
        (
            "ibv_create_comp_channel",
            "struct ibv_comp_channel *(*)(struct ibv_context *)",
        ),
        (
            "ibv_destroy_comp_channel",
            "int (*)(struct ibv_comp_channel *)",
        ),
        (
            "ibv_create_cq",
            "struct ibv_cq *(*)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int)",
        ),
        ("ibv_destroy_cq", "int (*)(struct ibv_cq *)"),
        (
            "ibv_get_cq_event",
            "int (*)(struct ibv_comp_channel *, struct ibv_cq **, void **)",
        ),
        ("ibv_ack_cq_events", "void (*)(struct ibv_cq *, unsigned int)"),
        (
            "ibv_create_qp",
            "struct ibv_qp *(*)(struct ibv_pd *, struct ibv_qp_init_attr *)",
        ),
        (
            "ibv_modify_qp",
            "int (*)(struct ibv_qp *, struct ibv_qp_attr *, int)",
        ),
        ("ibv_destroy_qp", "int (*)(struct ibv_qp *)"),
        ("ibv_wc_status_str", "const char *(*)(enum ibv_wc_status)"),
        (
            "ibv_context_ops.poll_cq",
            "int (*)(struct ibv_cq *, int, struct ibv_wc *)",
        ),
        ("ibv_context_ops.req_notify_cq", "int (*)(struct ibv_cq *, int)"),
        (
            "ibv_context_ops.post_send",
            "int (*)(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **)",
        ),
        (
            "ibv_context_ops.post_recv",
            "int (*)(struct ibv_qp *, struct ibv_recv_wr *, struct ibv_recv_wr **)",
        ),
    ]
}

/// Every size, alignment, field offset and constant declared here, as
/// `(C type or "enum", C field / constant name or "sizeof" / "alignof", value)`, for
/// the `abi_layout` test to compare with what a C compiler says of `verbs.h`.
///
/// Field names are C's (`imm_data` of an anonymous union, `wr.rdma.rkey`), whatever
/// the Rust field is called. `struct _compat_ibv_port_attr` is not in the public
/// header: it is `struct ibv_port_attr` up to `port_cap_flags2`, and the test checks
/// it against that.
#[cfg(feature = "abi-layout")]
pub fn layout() -> Vec<(&'static str, &'static str, usize)> {
    macro_rules! rows {
        ($out:ident, $c:literal, $t:ty; $($f:ident),* $(,)?) => {
            $out.push(($c, "sizeof", size_of::<$t>()));
            $out.push(($c, "alignof", align_of::<$t>()));
            $( $out.push(($c, stringify!($f), offset_of!($t, $f))); )*
        };
    }
    let mut v = Vec::new();
    rows!(v, "struct ibv_context_ops", ibv_context_ops; poll_cq, req_notify_cq, post_send, post_recv);
    rows!(v, "struct ibv_context", ibv_context; device, ops, cmd_fd, async_fd, num_comp_vectors);
    rows!(v, "struct ibv_device_attr", ibv_device_attr;
        node_guid, max_mr_size, max_qp_wr, max_sge, max_sge_rd, max_cqe, max_qp_rd_atom,
        max_qp_init_rd_atom, phys_port_cnt);
    rows!(v, "struct _compat_ibv_port_attr", ibv_port_attr_compat;
        state, max_mtu, active_mtu, gid_tbl_len, max_msg_sz, lid, link_layer);
    rows!(v, "union ibv_gid", ibv_gid; raw);
    rows!(v, "struct ibv_gid_entry", ibv_gid_entry; gid, gid_index, port_num, gid_type, ndev_ifindex);
    rows!(v, "struct ibv_mr", ibv_mr; context, pd, addr, length, handle, lkey, rkey);
    rows!(v, "struct ibv_comp_channel", ibv_comp_channel; context, fd, refcnt);
    rows!(v, "struct ibv_cq", ibv_cq; context, channel, cq_context, handle, cqe);
    rows!(v, "struct ibv_qp", ibv_qp;
        context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type);
    rows!(v, "struct ibv_qp_cap", ibv_qp_cap;
        max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data);
    rows!(v, "struct ibv_qp_init_attr", ibv_qp_init_attr;
        qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all);
    rows!(v, "struct ibv_global_route", ibv_global_route;
        dgid, flow_label, sgid_index, hop_limit, traffic_class);
    rows!(v, "struct ibv_ah_attr", ibv_ah_attr;
        grh, dlid, sl, src_path_bits, static_rate, is_global, port_num);
    rows!(v, "struct ibv_qp_attr", ibv_qp_attr;
        qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn,
        dest_qp_num, qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index,
        alt_pkey_index, en_sqd_async_notify, sq_draining, max_rd_atomic,
        max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry,
        alt_port_num, alt_timeout, rate_limit);
    rows!(v, "struct ibv_sge", ibv_sge; addr, length, lkey);
    rows!(v, "struct ibv_send_wr", ibv_send_wr;
        wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr, qp_type);
    let wr = offset_of!(ibv_send_wr, wr);
    v.push((
        "struct ibv_send_wr",
        "wr.rdma.remote_addr",
        wr + offset_of!(ibv_send_wr_rdma, remote_addr),
    ));
    v.push((
        "struct ibv_send_wr",
        "wr.rdma.rkey",
        wr + offset_of!(ibv_send_wr_rdma, rkey),
    ));
    v.push((
        "struct ibv_send_wr",
        "bind_mw",
        offset_of!(ibv_send_wr, _bind_mw_tso),
    ));
    rows!(v, "struct ibv_recv_wr", ibv_recv_wr; wr_id, next, sg_list, num_sge);
    rows!(v, "struct ibv_wc", ibv_wc;
        wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags,
        pkey_index, slid, sl, dlid_path_bits);

    macro_rules! consts {
        ($out:ident; $($name:ident = $val:expr),* $(,)?) => {
            $( $out.push(("enum", stringify!($name), $val as usize)); )*
        };
    }
    use crate::api;
    consts!(v;
        IBV_QPT_RC = IBV_QPT_RC,
        IBV_QPS_INIT = IBV_QPS_INIT,
        IBV_QPS_RTR = IBV_QPS_RTR,
        IBV_QPS_RTS = IBV_QPS_RTS,
        IBV_QPS_ERR = IBV_QPS_ERR,
        IBV_QP_STATE = IBV_QP_STATE,
        IBV_QP_ACCESS_FLAGS = IBV_QP_ACCESS_FLAGS,
        IBV_QP_PKEY_INDEX = IBV_QP_PKEY_INDEX,
        IBV_QP_PORT = IBV_QP_PORT,
        IBV_QP_AV = IBV_QP_AV,
        IBV_QP_PATH_MTU = IBV_QP_PATH_MTU,
        IBV_QP_TIMEOUT = IBV_QP_TIMEOUT,
        IBV_QP_RETRY_CNT = IBV_QP_RETRY_CNT,
        IBV_QP_RNR_RETRY = IBV_QP_RNR_RETRY,
        IBV_QP_RQ_PSN = IBV_QP_RQ_PSN,
        IBV_QP_MAX_QP_RD_ATOMIC = IBV_QP_MAX_QP_RD_ATOMIC,
        IBV_QP_MIN_RNR_TIMER = IBV_QP_MIN_RNR_TIMER,
        IBV_QP_SQ_PSN = IBV_QP_SQ_PSN,
        IBV_QP_MAX_DEST_RD_ATOMIC = IBV_QP_MAX_DEST_RD_ATOMIC,
        IBV_QP_DEST_QPN = IBV_QP_DEST_QPN,
        IBV_WR_RDMA_WRITE = IBV_WR_RDMA_WRITE,
        IBV_WR_SEND = IBV_WR_SEND,
        IBV_WR_RDMA_READ = IBV_WR_RDMA_READ,
        IBV_SEND_FENCE = IBV_SEND_FENCE,
        IBV_SEND_SIGNALED = IBV_SEND_SIGNALED,
        IBV_SEND_INLINE = IBV_SEND_INLINE,
        IBV_WC_SEND = IBV_WC_SEND,
        IBV_WC_RDMA_WRITE = IBV_WC_RDMA_WRITE,
        IBV_WC_RDMA_READ = IBV_WC_RDMA_READ,
        IBV_WC_RECV = IBV_WC_RECV,
        IBV_LINK_LAYER_INFINIBAND = IBV_LINK_LAYER_INFINIBAND,
        IBV_LINK_LAYER_ETHERNET = IBV_LINK_LAYER_ETHERNET,
        IBV_GID_TYPE_IB = IBV_GID_TYPE_IB,
        IBV_GID_TYPE_ROCE_V1 = IBV_GID_TYPE_ROCE_V1,
        IBV_GID_TYPE_ROCE_V2 = IBV_GID_TYPE_ROCE_V2,
        // The crate's API passes these through unchanged: they must be verbs.h's.
        IBV_ACCESS_LOCAL_WRITE = api::access::LOCAL_WRITE,
        IBV_ACCESS_REMOTE_WRITE = api::access::REMOTE_WRITE,
        IBV_ACCESS_REMOTE_READ = api::access::REMOTE_READ,
        IBV_PORT_ACTIVE = api::PORT_ACTIVE,
        IBV_WC_SUCCESS = api::WcStatus::SUCCESS.0,
        IBV_WC_LOC_PROT_ERR = api::WcStatus::LOC_PROT_ERR.0,
        IBV_WC_WR_FLUSH_ERR = api::WcStatus::WR_FLUSH_ERR.0,
        IBV_WC_REM_ACCESS_ERR = api::WcStatus::REM_ACCESS_ERR.0,
        IBV_WC_RETRY_EXC_ERR = api::WcStatus::RETRY_EXC_ERR.0,
        IBV_WC_RNR_RETRY_EXC_ERR = api::WcStatus::RNR_RETRY_EXC_ERR.0,
        IBV_MTU_256 = mtu(256),
        IBV_MTU_512 = mtu(512),
        IBV_MTU_1024 = mtu(1024),
        IBV_MTU_2048 = mtu(2048),
        IBV_MTU_4096 = mtu(4096),
    );
    v
}

/// The crate's value of the MTU of `bytes` (0 when it has none).
#[cfg(feature = "abi-layout")]
fn mtu(bytes: u32) -> u8 {
    crate::api::Mtu::from_bytes(bytes).map_or(0, |m| m.0)
}
