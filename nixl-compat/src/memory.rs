//! Memory handed in as NIXL's descriptors: by address (numpy arrays, torch tensors,
//! C pointers), by file descriptor, or by path (NIXL's path-mode FILE registrations).
//!
//! The contract NIXL's APIs document, and both drop-in surfaces repeat, is
//! [`nixl::Memory::from_raw_parts`]'s: from registration until deregistration (or
//! the agent's end), each `addr..addr+len` stays allocated and is not reused; for
//! DRAM it is readable and writable host memory, for VRAM device memory of that
//! device. Peers may read and write it whenever the application's protocol lets
//! them. The agent keeps its own registrations alive while transfers use them;
//! keeping the memory itself alive is the caller's part, as with NIXL.

use nixl::{MemKind, Memory};

/// A file by the caller's descriptor `fd` (NIXL's FILE registration `(offset, len,
/// fd, meta)`; the offset must be 0, as NIXL's file backends take it): the
/// registration keeps its own duplicate, see [`nixl::Memory::file`].
///
/// # Errors
/// `InvalidArgument` for a non-zero offset or a descriptor that is not open; as
/// [`nixl::Memory::file`].
///
/// # Safety
/// No other thread of the process closes `fd` during this call (the registration
/// keeps its own duplicate once it returns).
pub unsafe fn file_memory(offset: u64, len: u64, fd: u32) -> nixl::Result<Memory> {
    if offset != 0 {
        return Err(nixl::Error::new(
            nixl::ErrorKind::InvalidArgument,
            "register file",
            format!("fd {fd}: a FILE registration starts at offset 0 (got {offset}); register (0, length, fd, meta)"),
        ));
    }
    let raw = i32::try_from(fd).map_err(|_| {
        nixl::Error::new(
            nixl::ErrorKind::InvalidArgument,
            "register file",
            format!("{fd} is not a file descriptor"),
        )
    })?;
    // Is it open? (F_GETFD touches nothing; a closed number answers EBADF.)
    // SAFETY: fcntl(F_GETFD) on any integer only reads the descriptor table.
    if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
        return Err(nixl::Error::new(
            nixl::ErrorKind::InvalidArgument,
            "register file",
            format!("fd {fd} is not an open file descriptor of this process"),
        )
        .with_source(std::io::Error::last_os_error()));
    }
    // SAFETY: `raw` is open (checked just above) and stays open for this call (the
    // caller's contract); the borrow ends before this returns (the registration
    // keeps its own duplicate).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
    Memory::file(fd, len)
}

/// NIXL's path-mode FILE registration: meta `"<flags>:<path>"`, flags a comma list
/// of `rw` or `ro`, `create`, `direct` (`(0, len, devId, "rw,create:/kv/0.bin")`):
/// the file is opened here, and descriptors name it by `devId`. `None` when `meta`
/// is not such a spec (the registration is then by descriptor: `devId` is the
/// caller's open fd).
pub fn path_mode(meta: &str) -> Option<(nixl::file::FileOptions, &str)> {
    let (flags, path) = meta.split_once(':')?;
    if path.is_empty() {
        return None;
    }
    let mut o = nixl::file::FileOptions::default();
    let mut access = None;
    for f in flags.split(',') {
        match f.trim() {
            "rw" if access.is_none() => access = Some(true),
            "ro" if access.is_none() => access = Some(false),
            "create" => o.create = true,
            "direct" => o.direct = true,
            _ => return None,
        }
    }
    o.write = access?;
    Some((o, path))
}

/// Open a path-mode FILE registration (see [`path_mode`]): `len` bytes (0: the
/// file's length), named by `device`.
pub fn path_memory(
    offset: u64,
    len: u64,
    device: u32,
    mut options: nixl::file::FileOptions,
    path: &str,
) -> nixl::Result<Memory> {
    if offset != 0 {
        return Err(nixl::Error::new(
            nixl::ErrorKind::InvalidArgument,
            "register file",
            format!("{path}: a FILE registration starts at offset 0 (got {offset})"),
        ));
    }
    options.len = (len > 0).then_some(len);
    options.device = Some(device);
    Memory::open_file(path, &options)
}

/// Wrap `addr..addr+len` of the caller's memory.
///
/// # Errors
/// `InvalidArgument` for a null address or a range that overflows.
///
/// # Safety
/// [`nixl::Memory::from_raw_parts`]' contract (module docs): the range stays
/// allocated and valid for `kind` while registered.
pub unsafe fn caller_memory(addr: u64, len: u64, kind: MemKind) -> nixl::Result<Memory> {
    let Ok(len) = usize::try_from(len) else {
        return Err(nixl::Error::new(
            nixl::ErrorKind::InvalidArgument,
            "register memory",
            format!("length {len} does not fit this machine's address space"),
        ));
    };
    // SAFETY: this function's contract is `from_raw_parts`' own, passed on to the
    // caller; the agent keeps the registration alive while transfers use it.
    unsafe { Memory::from_raw_parts(addr as usize as *mut u8, len, kind) }
}
