//! The plain data the verbs calls of this crate take and return. The calls themselves
//! are one crate-internal trait (`VerbsApi`, in the crate's `ffi` module, with the
//! rest of its `unsafe` code), implemented by the host's libibverbs
//! ([`crate::library`], loaded at run time) and, for tests, by an in-process test
//! double (`nixl_verbs::test_double`, feature `test-double`).
//!
//! The backend (connection setup, posting, completions, teardown) is written once
//! against `VerbsApi`; only the binding differs. Handles are opaque addresses whose
//! meaning is the binding's (pointers to libibverbs objects in the real one). Values
//! are plain data in host byte order; the binding converts (`imm_data` is big-endian
//! on the wire, as libibverbs expects).

use std::os::fd::RawFd;

/// An opaque object of the binding: a device context, protection domain, memory
/// region, completion channel, completion queue or queue pair. Only the bindings of
/// this crate make them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub(crate) usize);

/// A device as listed by `ibv_get_device_list`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Node GUID, host byte order.
    pub guid: u64,
}

/// The device limits this crate plans with (`ibv_query_device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Most work requests a queue can hold.
    pub max_qp_wr: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most scatter entries of an RDMA READ.
    pub max_sge_rd: u32,
    /// Most entries of a completion queue.
    pub max_cqe: u32,
    /// Most RDMA READs a queue pair serves at once (as responder).
    pub max_qp_rd_atom: u32,
    /// Most RDMA READs a queue pair issues at once (as initiator).
    pub max_qp_init_rd_atom: u32,
    /// Ports on the device.
    pub phys_port_cnt: u8,
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID (a GID where routed).
    InfiniBand,
    /// Ethernet (RoCE, iWARP): addressed by GID.
    Ethernet,
    /// Not reported (old drivers: treated as InfiniBand).
    Unspecified,
}

/// Path MTU (`enum ibv_mtu`: 1 = 256 bytes ... 5 = 4096 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mtu(pub u8);

impl Mtu {
    /// The MTU of `bytes` (256, 512, 1024, 2048 or 4096).
    pub fn from_bytes(bytes: u32) -> Option<Self> {
        match bytes {
            256 => Some(Self(1)),
            512 => Some(Self(2)),
            1024 => Some(Self(3)),
            2048 => Some(Self(4)),
            4096 => Some(Self(5)),
            _ => None,
        }
    }

    /// Its size in bytes (0 for a value outside 1..=5).
    pub fn bytes(self) -> u32 {
        match self.0 {
            1..=5 => 128 << self.0,
            _ => 0,
        }
    }
}

/// A port as `ibv_query_port` describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// `IBV_PORT_ACTIVE` (4) when usable.
    pub state: u32,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// Current MTU.
    pub active_mtu: Mtu,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Entries in the GID table.
    pub gid_tbl_len: u32,
    /// Largest message.
    pub max_msg_sz: u32,
}

/// `IBV_PORT_ACTIVE`.
pub const PORT_ACTIVE: u32 = 4;

/// GID types (`ibv_gid_entry::gid_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand (or RoCE v1 where the device says so).
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP: routable).
    RoceV2,
    /// A value this crate does not know.
    Other(u32),
}

/// One GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// The GID.
    pub gid: [u8; 16],
    /// Its index in the port's table.
    pub index: u32,
    /// Its type, where the library can tell (`None` before rdma-core 32).
    pub kind: Option<GidType>,
}

/// Access flags of a memory region or queue pair (`enum ibv_access_flags`).
pub mod access {
    /// The NIC may write the memory for local operations (receives, READ results).
    pub const LOCAL_WRITE: u32 = 1;
    /// Peers may RDMA WRITE into it.
    pub const REMOTE_WRITE: u32 = 2;
    /// Peers may RDMA READ from it.
    pub const REMOTE_READ: u32 = 4;
}

/// A registered memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mr {
    /// The binding's object.
    pub handle: Handle,
    /// Key for local scatter/gather entries.
    pub lkey: u32,
    /// Key peers use to reach it.
    pub rkey: u32,
}

/// A completion channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Channel {
    /// The binding's object.
    pub handle: Handle,
    /// Readable when a completion event is pending; non-blocking.
    pub fd: RawFd,
}

/// Capacities of a queue pair (asked for, then as granted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive.
    pub max_recv_sge: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
}

/// A queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Qp {
    /// The binding's object.
    pub handle: Handle,
    /// Its number, which the peer needs.
    pub qp_num: u32,
    /// What the device granted.
    pub caps: QpCaps,
}

/// Where a queue pair sends (`struct ibv_ah_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressVector {
    /// The peer's LID (InfiniBand; 0 on Ethernet).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Local port.
    pub port: u8,
    /// With a global route header: the peer's GID and our GID index (always on
    /// Ethernet).
    pub grh: Option<GlobalRoute>,
}

/// A global route (`struct ibv_global_route`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalRoute {
    /// The peer's GID.
    pub dgid: [u8; 16],
    /// Our GID's index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// One queue-pair state change with the attributes it needs (`ibv_modify_qp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpTransition {
    /// RESET to INIT.
    Init {
        /// Local port.
        port: u8,
        /// Partition key index.
        pkey_index: u16,
        /// What peers may do to memory through it ([`access`] flags).
        access: u32,
    },
    /// INIT to ready-to-receive.
    Rtr {
        /// Path MTU (at most both ports' active MTU).
        path_mtu: Mtu,
        /// The peer's queue pair number.
        dest_qp_num: u32,
        /// The peer's first packet sequence number.
        rq_psn: u32,
        /// READs we serve at once.
        max_dest_rd_atomic: u8,
        /// Receiver-not-ready NAK timer (encoded as in the spec).
        min_rnr_timer: u8,
        /// Where the peer is.
        av: AddressVector,
    },
    /// Ready-to-receive to ready-to-send.
    Rts {
        /// Our first packet sequence number.
        sq_psn: u32,
        /// Local ACK timeout (4.096 µs × 2^timeout).
        timeout: u8,
        /// Retries on timeout.
        retry_cnt: u8,
        /// Retries on receiver-not-ready (7: forever).
        rnr_retry: u8,
        /// READs we issue at once.
        max_rd_atomic: u8,
    },
    /// Any state to ERROR: outstanding work requests complete with a flush error.
    Error,
}

/// One scatter/gather entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Address in this process.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The region's local key (ignored for inline sends).
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// RDMA WRITE of the gather list to `remote_addr`.
    Write {
        /// Target address.
        remote_addr: u64,
        /// Target key.
        rkey: u32,
    },
    /// RDMA READ from `remote_addr` into the scatter list.
    Read {
        /// Source address.
        remote_addr: u64,
        /// Source key.
        rkey: u32,
    },
    /// SEND into the peer's next posted receive.
    Send,
}

/// One send work request; its entries are `sges[first_sge..first_sge + num_sge]` of
/// the slice posted with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// First entry.
    pub first_sge: u32,
    /// Entry count.
    pub num_sge: u32,
    /// Generate a completion (`IBV_SEND_SIGNALED`).
    pub signaled: bool,
    /// Wait for earlier READs to finish first (`IBV_SEND_FENCE`).
    pub fence: bool,
    /// Copy the data at post time (`IBV_SEND_INLINE`; no key needed).
    pub inline: bool,
}

/// One receive work request (a single buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The buffer.
    pub sge: Sge,
}

/// Completion status (`enum ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WcStatus(pub u32);

impl WcStatus {
    /// `IBV_WC_SUCCESS`.
    pub const SUCCESS: Self = Self(0);
    /// `IBV_WC_LOC_PROT_ERR`: a local key or range did not match.
    pub const LOC_PROT_ERR: Self = Self(4);
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because the queue pair went to ERROR.
    pub const WR_FLUSH_ERR: Self = Self(5);
    /// `IBV_WC_REM_ACCESS_ERR`: the peer refused the key or range.
    pub const REM_ACCESS_ERR: Self = Self(10);
    /// `IBV_WC_RETRY_EXC_ERR`: the peer did not answer (gone, or the link is down).
    pub const RETRY_EXC_ERR: Self = Self(12);
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer posted no receive in time.
    pub const RNR_RETRY_EXC_ERR: Self = Self(13);

    /// Whether the work request succeeded.
    pub fn is_ok(self) -> bool {
        self == Self::SUCCESS
    }
}

/// What completed (`enum ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND.
    Send,
    /// An RDMA WRITE.
    Write,
    /// An RDMA READ.
    Read,
    /// A receive (of a SEND).
    Recv,
    /// Anything else.
    Other(u32),
}

/// One work completion (`struct ibv_wc`, the fields this crate reads). On an error
/// status only `wr_id`, `status`, `qp_num` and `vendor_err` are meaningful.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// The queue pair it belongs to.
    pub qp_num: u32,
    /// Vendor's error detail.
    pub vendor_err: u32,
}

impl Completion {
    /// An empty slot for `VerbsApi::poll_cq` to fill.
    pub const EMPTY: Self = Self {
        wr_id: 0,
        status: WcStatus::SUCCESS,
        opcode: WcOpcode::Other(0),
        byte_len: 0,
        qp_num: 0,
        vendor_err: 0,
    };
}

/// Why a post failed after some work requests were accepted.
#[derive(Debug)]
pub struct PostError {
    /// Work requests accepted before the failing one (they will complete).
    pub posted: usize,
    /// What the device said.
    pub error: nixl::Error,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_round_trips() {
        for b in [256, 512, 1024, 2048, 4096] {
            assert_eq!(Mtu::from_bytes(b).unwrap().bytes(), b);
        }
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu(0).bytes(), 0);
        assert_eq!(Mtu(9).bytes(), 0);
        assert!(Mtu(3) < Mtu(5));
    }
}
