//! Memory handed in by address (numpy arrays, torch tensors, raw pointers).
//!
//! The contract, documented on `nixl_agent.register_memory`, is
//! [`nixl::Memory::from_raw_parts`]'s: from registration until
//! `deregister_memory` returns (or the agent is shut down or collected), each
//! `addr..addr+len` stays allocated and is not reused; for DRAM it is readable and
//! writable host memory, for VRAM device memory of that device. Peers may read and
//! write it whenever the application's protocol lets them. The agent keeps its own
//! registrations alive while transfers use them (deregistering memory in use is
//! refused); keeping the Python object that owns the memory alive is the caller's
//! part, as with NIXL.

use nixl::{MemKind, Memory};

/// Wrap `addr..addr+len` of the caller's memory.
///
/// # Errors
/// `InvalidArgument` for a null address or a range that overflows.
pub(crate) fn caller_memory(addr: u64, len: u64, kind: MemKind) -> nixl::Result<Memory> {
    let Ok(len) = usize::try_from(len) else {
        return Err(nixl::Error::new(
            nixl::ErrorKind::InvalidArgument,
            "register memory",
            format!("length {len} does not fit this machine's address space"),
        ));
    };
    // SAFETY: the Python API's contract (module docs, and `register_memory`'s
    // docstring) is `from_raw_parts`' own: the caller keeps the range allocated and
    // valid for its kind while registered; the agent keeps the registration alive
    // while transfers use it and refuses to deregister it meanwhile. This is the
    // trust NIXL's Python API places in the same call.
    unsafe { Memory::from_raw_parts(addr as usize as *mut u8, len, kind) }
}
