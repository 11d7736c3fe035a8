//! Memory handed in by C callers: addresses and file descriptors, under the
//! contract of NIXL's `registerMem`, which `nixl_capi.h` repeats: from
//! `nixl_capi_register_mem` until `nixl_capi_deregister_mem` returns (or the agent
//! is destroyed), each `addr..addr+len` stays allocated and is not reused; DRAM is
//! readable and writable host memory, VRAM device memory of that device. Peers may
//! read and write it whenever the application's protocol lets them. A FILE
//! descriptor is duplicated by the registration; the caller does not close it while
//! `nixl_capi_register_mem` runs.

use nixl::{MemKind, Memory};

/// Wrap `addr..addr+len` of the caller's memory.
pub(crate) fn caller(addr: u64, len: u64, kind: MemKind) -> nixl::Result<Memory> {
    // SAFETY: the C API's registration contract (module docs) is
    // `from_raw_parts`' own, the trust NIXL's C API places in the same call.
    unsafe { nixl_compat::memory::caller_memory(addr, len, kind) }
}

/// A file by the caller's descriptor.
pub(crate) fn file(offset: u64, len: u64, fd: u32) -> nixl::Result<Memory> {
    // SAFETY: the contract (module docs) keeps `fd` open during the call.
    unsafe { nixl_compat::memory::file_memory(offset, len, fd) }
}
