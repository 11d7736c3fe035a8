//! What this machine and process allow: memory for allocations, descriptors for
//! connections. Sizes a user can type are checked against these before anything is
//! allocated or accepted.
#![allow(unsafe_code)]

use crate::error::{err, ErrorKind, Result};

/// This machine's memory: RAM plus swap, the most any allocation can be backed by;
/// `None` where the system does not say.
pub fn host_memory() -> Option<u64> {
    // SAFETY: sysinfo only writes the struct it is given, which is plain data.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable sysinfo struct.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return None;
    }
    let unit = u64::from(info.mem_unit.max(1));
    // c_ulong: 64 bits on the platforms we build for, 32 on some others.
    #[allow(clippy::unnecessary_cast)]
    let total = (info.totalram as u64).saturating_add(info.totalswap as u64);
    Some(total.saturating_mul(unit))
}

/// Refuse a host allocation of `len` bytes larger than this machine's memory, naming
/// the limit, before anything is allocated. `what` says what the bytes are for.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] when `len` exceeds [`host_memory`].
pub(crate) fn check_host_len(len: u64, what: &str, op: &'static str) -> Result<()> {
    match host_memory() {
        Some(limit) if len > limit => err(
            ErrorKind::InvalidArgument,
            op,
            format!("{what} of {len} bytes is more than this machine's memory ({limit} bytes of RAM and swap)"),
        ),
        _ => Ok(()),
    }
}

/// The process's open-files limit (the soft `RLIMIT_NOFILE`), or `None` where the
/// system does not say or sets none.
pub fn open_files_limit() -> Option<u64> {
    // SAFETY: rlimit is plain data; getrlimit only writes the struct it is given.
    let mut l: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `l` is a valid, writable rlimit struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0
        || l.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(l.rlim_cur)
}
