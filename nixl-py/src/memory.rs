//! Memory handed in from Python (numpy arrays, torch tensors, raw pointers, file
//! descriptors), under the contract `nixl_agent.register_memory` documents:
//! [`nixl::Memory::from_raw_parts`]'s (see `nixl_compat::memory`). Keeping the
//! Python object that owns the memory alive is the caller's part, as with NIXL.

use nixl::{MemKind, Memory};

pub(crate) use nixl_compat::memory::{path_memory, path_mode};

/// A file by the caller's descriptor (see `nixl_compat::memory::file_memory`).
pub(crate) fn file_memory(offset: u64, len: u64, fd: u32) -> nixl::Result<Memory> {
    // SAFETY: called with the GIL held, so no Python thread closes `fd` meanwhile.
    unsafe { nixl_compat::memory::file_memory(offset, len, fd) }
}

/// Wrap `addr..addr+len` of the caller's memory.
pub(crate) fn caller_memory(addr: u64, len: u64, kind: MemKind) -> nixl::Result<Memory> {
    // SAFETY: the Python API's contract (module docs, and `register_memory`'s
    // docstring) is `from_raw_parts`' own: the caller keeps the range allocated and
    // valid for its kind while registered. This is the trust NIXL's Python API
    // places in the same call.
    unsafe { nixl_compat::memory::caller_memory(addr, len, kind) }
}
