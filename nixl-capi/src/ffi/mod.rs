//! The C boundary: every `nixl_capi_*` function of NIXL 1.5.1's C API, as thin
//! shims over the safe layers (`agent`, `lists`, `xfer`).
//!
//! The audit, in one place (each shim's `SAFETY` comment refers here):
//! - Handles are `Box`es of [`Handle<T>`] given to C; each begins with a tag naming
//!   its type, checked on every use, so a null pointer, a handle of another type,
//!   and (while the memory is not reused) a destroyed handle are refused with
//!   INVALID_PARAM rather than read. Everything else about a handle (that it was
//!   made by this library and is not freed concurrently with a use) is the C
//!   caller's contract, as with NIXL's library.
//! - Strings are NUL-terminated and UTF-8 (else INVALID_PARAM); byte buffers are
//!   (pointer, length), a null or dangling pointer with length 0 is never read.
//! - Out-pointers are checked for null before any work, and written only on
//!   success, so a failed call leaves them and allocates nothing.
//! - Blobs and strings handed to C are `malloc`ed (the caller `free`s them, as
//!   nixl-sys does); borrowed pointers (`const char**`) point into the handle that
//!   owns them and stay valid until it changes or is destroyed.
//! - No panic crosses the boundary: [`guard`] catches it and returns BACKEND, as
//!   NIXL's library returns BACKEND for a C++ exception.
//! - C `bool`s inside structs are read as bytes (any non-zero is true).

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use crate::status::{Failure, Outcome, Status, BACKEND, INVALID_PARAM, NOT_FOUND, SUCCESS};

mod agent;
mod dlists;
mod lists;
mod xfer;

/// A value handed to C, tagged with its type.
#[repr(C)]
pub struct Handle<T> {
    tag: u64,
    value: T,
}

/// Types handed to C, each with its tag.
pub trait Tagged {
    /// Unique per type; a freed handle's tag is cleared.
    const TAG: u64;
    /// For messages.
    const WHAT: &'static str;
}

macro_rules! tagged {
    ($($t:ty => $tag:expr, $what:expr;)*) => {
        $(impl $crate::ffi::Tagged for $t {
            const TAG: u64 = $tag;
            const WHAT: &'static str = $what;
        })*
    };
}
pub(crate) use tagged;

/// Hand `value` to C.
pub fn new_handle<T: Tagged>(value: T) -> *mut Handle<T> {
    Box::into_raw(Box::new(Handle { tag: T::TAG, value }))
}

/// Borrow the value behind a handle from C.
///
/// # Safety
/// `p` is null or points to readable memory at least as large as a `Handle<T>`'s
/// tag (a handle of this library); the value is not freed while borrowed.
pub unsafe fn get<'a, T: Tagged>(p: *const Handle<T>) -> Outcome<&'a T> {
    if p.is_null() {
        return Err(Failure::invalid(format!("{} is null", T::WHAT)));
    }
    // SAFETY: non-null and, by the contract, a handle of this library: its tag is
    // readable.
    let tag = unsafe { std::ptr::addr_of!((*p).tag).read() };
    if tag != T::TAG {
        return Err(Failure::invalid(format!(
            "{} is not one (a handle of another type, or destroyed)",
            T::WHAT
        )));
    }
    // SAFETY: tag checked: a live `Handle<T>` made by `new_handle`.
    Ok(unsafe { &(*p).value })
}

/// Free a handle from C.
///
/// # Safety
/// As [`get`]; no other thread uses the handle meanwhile or afterwards.
pub unsafe fn free<T: Tagged>(p: *mut Handle<T>) -> Outcome {
    // SAFETY: the contract is `get`'s.
    unsafe { get(p) }?;
    // SAFETY: a live handle made by `new_handle` (`Box::into_raw`); the tag is
    // cleared first so a second free of the same (not yet reused) memory is refused.
    unsafe {
        (*p).tag = 0;
        drop(Box::from_raw(p));
    }
    Ok(())
}

/// Free a handle and report it, for the `destroy_*` shims.
///
/// # Safety
/// As [`free`].
pub unsafe fn destroy<T: Tagged>(op: &'static str, p: *mut Handle<T>) -> Status {
    guard(op, || {
        // SAFETY: the caller's contract is `free`'s.
        unsafe { free(p) }?;
        ok()
    })
}

/// An out-pointer from C, checked non-null; written once, on success.
pub struct Out<T>(NonNull<T>);

impl<T> Out<T> {
    /// Check `p`.
    ///
    /// # Safety
    /// `p` is null or valid for a write of `T` until [`Out::set`] is called.
    pub unsafe fn new(p: *mut T, what: &str) -> Outcome<Self> {
        NonNull::new(p)
            .map(Self)
            .ok_or_else(|| Failure::invalid(format!("{what} is null")))
    }

    /// Write the result.
    pub fn set(self, v: T) {
        // SAFETY: non-null and writable by `new`'s contract.
        unsafe { self.0.as_ptr().write(v) }
    }
}

/// A NUL-terminated UTF-8 string from C.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that lives as long as `'a`.
pub unsafe fn cstr<'a>(p: *const c_char, what: &str) -> Outcome<&'a str> {
    if p.is_null() {
        return Err(Failure::invalid(format!("{what} is null")));
    }
    // SAFETY: non-null and NUL-terminated by the contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Failure::invalid(format!("{what} is not UTF-8")))
}

/// `len` bytes at `p` (never read when `len` is 0).
///
/// # Safety
/// When `len > 0`, `p` is null or points to `len` readable bytes that live as long
/// as `'a`.
pub unsafe fn bytes<'a>(p: *const c_void, len: usize, what: &str) -> Outcome<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Failure::invalid(format!(
            "{what} is null with length {len}"
        )));
    }
    if isize::try_from(len).is_err() {
        return Err(Failure::invalid(format!(
            "{what}: length {len} is too large"
        )));
    }
    // SAFETY: non-null, `len` readable bytes by the contract, length checked.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// A `malloc`ed copy of `b` the C caller `free`s (at least one byte, so never null
/// on success).
pub fn malloc_copy(b: &[u8]) -> Outcome<*mut c_void> {
    // SAFETY: malloc of a non-zero size; null is checked.
    let p = unsafe { libc::malloc(b.len().max(1)) };
    if p.is_null() {
        return Err(Failure::backend(format!(
            "out of memory ({} bytes)",
            b.len()
        )));
    }
    // SAFETY: `p` holds at least `b.len()` bytes and does not overlap `b`.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p.cast::<u8>(), b.len()) };
    Ok(p)
}

/// A `malloc`ed NUL-terminated copy of `s` the C caller `free`s.
pub fn malloc_str(s: &str) -> Outcome<*mut c_char> {
    let mut v = Vec::with_capacity(s.len() + 1);
    v.extend_from_slice(s.as_bytes());
    v.push(0);
    Ok(malloc_copy(&v)?.cast())
}

/// Run a shim's body: its failure becomes its status (logged), a panic becomes
/// BACKEND.
pub fn guard(op: &'static str, f: impl FnOnce() -> Outcome<Status>) -> Status {
    run(op, false, f)
}

/// As [`guard`], logging failures at debug level only: for calls that are polled
/// or whose failure is an answer (`check_remote_md`, `get_notifs`).
pub fn guard_quiet(op: &'static str, f: impl FnOnce() -> Outcome<Status>) -> Status {
    run(op, true, f)
}

fn run(op: &'static str, quiet: bool, f: impl FnOnce() -> Outcome<Status>) -> Status {
    let op = op.strip_prefix("nixl_capi_").unwrap_or(op);
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(s)) => s,
        Ok(Err(fail)) => {
            if quiet || fail.status == NOT_FOUND {
                tracing::debug!(target: "nixl_capi", "nixl_capi_{op}: {fail}");
            } else {
                tracing::warn!(target: "nixl_capi", "nixl_capi_{op}: {fail}");
            }
            fail.status
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(target: "nixl_capi", "nixl_capi_{op}: internal error (panic): {msg}");
            BACKEND
        }
    }
}

/// Success.
pub fn ok() -> Outcome<Status> {
    Ok(SUCCESS)
}

/// A checked index into a list of `len`.
pub fn index(i: usize, len: usize, what: &str) -> Outcome<usize> {
    if i < len {
        Ok(i)
    } else {
        Err(Failure::new(
            INVALID_PARAM,
            format!("{what} index {i} is out of range (size {len})"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct A(u32);
    #[derive(Debug)]
    struct B;
    tagged! {
        A => 0xA, "test handle A";
        B => 0xB, "test handle B";
    }

    #[test]
    fn handles_check_their_tag_and_refuse_a_second_free() {
        let a = new_handle(A(7));
        // SAFETY: a live handle of this module.
        assert_eq!(unsafe { get(a) }.unwrap().0, 7);
        // SAFETY: the same allocation read as another handle type: only its tag
        // is read, and refused.
        let wrong = unsafe { get(a.cast::<Handle<B>>()) };
        assert_eq!(wrong.unwrap_err().status, INVALID_PARAM);
        // SAFETY: null is refused before any read.
        assert!(unsafe { get::<A>(std::ptr::null()) }.is_err());
        // SAFETY: a live handle, freed once.
        unsafe { free(a) }.unwrap();
    }

    #[test]
    fn a_panic_becomes_backend() {
        assert_eq!(guard("test", || panic!("boom")), BACKEND);
        assert_eq!(
            guard("test", || Err(Failure::not_found("x"))),
            crate::status::NOT_FOUND
        );
        assert_eq!(guard("test", ok), SUCCESS);
    }

    #[test]
    fn buffers_and_strings() {
        // SAFETY: length 0 is never read, whatever the pointer.
        assert!(unsafe { bytes(std::ptr::null(), 0, "b") }
            .unwrap()
            .is_empty());
        // SAFETY: null with a length is refused before any read.
        assert!(unsafe { bytes(std::ptr::null(), 3, "b") }.is_err());
        let p = malloc_str("abc").unwrap();
        // SAFETY: `p` is a NUL-terminated malloc'd string, freed once below.
        assert_eq!(unsafe { cstr(p, "s") }.unwrap(), "abc");
        // SAFETY: malloc'd above.
        unsafe { libc::free(p.cast()) };
        assert!(index(2, 2, "x").is_err());
    }
}
