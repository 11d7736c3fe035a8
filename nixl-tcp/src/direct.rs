//! What a direct (same-host) transfer needs to know of its target, and why a transfer
//! cannot go direct: shared by the host-memory path (`same_host`) and the GPU path
//! (`gpu_direct`), below both.

use nixl::{Error, ErrorKind, SegmentRun, TargetRegion};

use crate::shm::Table;
use crate::wire::SegEntry;

/// Why the grant of target registration `t` could not be taken: the target is going
/// away (it closed its table), or it has not granted that memory.
pub(crate) fn not_granted(table: &Table, op: &'static str, t: &TargetRegion) -> Error {
    if table.is_closed() {
        return Error::new(
            ErrorKind::RemoteDisconnected,
            op,
            "the peer is shutting down or closed the connection",
        );
    }
    let id = match t {
        TargetRegion::Remote { region, .. } => *region,
        TargetRegion::Local(r) => r.id(),
    };
    Error::new(
        ErrorKind::NotAllowed,
        op,
        format!(
            "registration {id}: the target has not granted this memory (deregistered, or a forged key)"
        ),
    )
}

/// The target side of a prepared transfer: for each target registration
/// ([`Segments::targets`](nixl::Segments::targets)), the target's same-host slot (0
/// where it offered none: then only the wire entries are used), the registration's
/// key and its start address.
#[derive(Clone, Debug)]
pub(crate) struct Direct {
    pub(crate) targets: Vec<(u32, u64, u64)>,
}

impl Direct {
    /// The wire entry of `run`: key, first block's address, length, stride, blocks.
    pub(crate) fn entry(&self, run: &SegmentRun) -> SegEntry {
        let (_, key, base) = self.targets[run.target as usize];
        SegEntry {
            key,
            addr: base + run.target_offset,
            len: run.len,
            stride: run.target_stride,
            blocks: run.count as u64,
        }
    }
}

/// Why a transfer cannot go direct: it goes over TCP, or fails under `Require` unless
/// no direct path exists for its memory kinds (host memory on one side, GPU memory on
/// the other: staged over TCP either way).
#[derive(Debug)]
pub(crate) struct Unsuitable {
    pub(crate) why: &'static str,
    pub(crate) mixed_kinds: bool,
}

impl Unsuitable {
    pub(crate) fn new(why: &'static str) -> Self {
        Self {
            why,
            mixed_kinds: false,
        }
    }

    /// Host memory on one side and GPU memory on the other.
    pub(crate) fn mixed_kinds(why: &'static str) -> Self {
        Self {
            why,
            mixed_kinds: true,
        }
    }
}
