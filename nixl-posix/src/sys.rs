//! The positional read and write system calls, and the flushes, on raw addresses.
//!
//! Audited `unsafe`: every caller passes host memory of a registration that the
//! transfer's [`nixl::Completer`] keeps registered until its operations finished
//! (see [`crate::batch`]), and the registration's own open file descriptor.
#![allow(unsafe_code)]

use std::os::fd::RawFd;

use nixl::Op;

/// One `pread`/`pwrite` of `len` bytes at `addr` and file offset `off` (with
/// `nowait`, `preadv2`/`pwritev2` with `RWF_NOWAIT`: only what the page cache serves
/// without waiting). Returns the bytes moved or a negative errno; EINTR is retried.
pub(crate) fn transfer(dir: Op, fd: RawFd, addr: u64, len: u32, off: u64, nowait: bool) -> i64 {
    loop {
        let iov = libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: len as usize,
        };
        let off = off as libc::off_t;
        let flags = if nowait { libc::RWF_NOWAIT } else { 0 };
        let res = match dir {
            // SAFETY: `addr..addr+len` is live host memory (see the module docs), read
            // by the kernel only; `fd` is open; `iov` lives across the call.
            Op::Write => unsafe { libc::pwritev2(fd, &iov, 1, off, flags) },
            // SAFETY: as above; the kernel writes the range and no Rust reference to
            // it exists.
            Op::Read => unsafe { libc::preadv2(fd, &iov, 1, off, flags) },
        };
        if res >= 0 {
            return res as i64;
        }
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return -i64::from(errno);
        }
    }
}

/// `fdatasync` (`data`) or `fsync` of `fd`.
pub(crate) fn flush(fd: RawFd, data: bool) -> std::io::Result<()> {
    // SAFETY: `fd` is an open descriptor (the registration's own); neither call takes
    // memory.
    let r = unsafe {
        if data {
            libc::fdatasync(fd)
        } else {
            libc::fsync(fd)
        }
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
