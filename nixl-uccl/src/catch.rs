//! The exception boundary (feature `exception-shim`): a small C++ object of ours
//! (`native/catch.cc`, built by `build.rs`, embedded and loaded from memory) through
//! which every call into `libuccl_p2p.so` goes. A C++ exception UCCL throws is caught
//! there and comes back as an error; one unwinding into Rust frames would abort the
//! process. Exceptions thrown on UCCL's own threads are beyond any caller's reach.
//!
//! Audited FFI module: the wrappers' declarations mirror `native/catch.cc`.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use nixl::{Error, ErrorKind, Result};

use crate::api::FifoItem;

/// Length of the buffer an exception's `what()` is copied into.
const ERR_LEN: usize = 512;

type Err = *mut c_char;
type CreateW =
    unsafe extern "C" fn(*const c_void, c_int, bool, *mut *mut c_void, Err, usize) -> c_int;
type Void1W = unsafe extern "C" fn(*const c_void, *mut c_void, Err, usize) -> c_int;
type ConnectW = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    *const c_char,
    *const c_char,
    c_int,
    bool,
    *mut *mut c_void,
    Err,
    usize,
) -> c_int;
type AcceptW = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    *mut c_char,
    usize,
    *mut c_int,
    *mut *mut c_void,
    Err,
    usize,
) -> c_int;
type RegW = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    usize,
    *mut u64,
    *mut c_int,
    Err,
    usize,
) -> c_int;
type MrDestroyW = unsafe extern "C" fn(*const c_void, *mut c_void, u64, Err, usize) -> c_int;
type PrepareFifoW = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    u64,
    *const c_void,
    usize,
    *mut c_char,
    *mut c_int,
    Err,
    usize,
) -> c_int;
type XferW = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    u64,
    *const c_void,
    usize,
    *const FifoItem,
    *mut u64,
    *mut c_int,
    Err,
    usize,
) -> c_int;
type StatusW =
    unsafe extern "C" fn(*const c_void, *mut c_void, u64, *mut bool, Err, usize) -> c_int;
type MetadataW = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    *mut *mut c_char,
    *mut c_int,
    Err,
    usize,
) -> c_int;
type DeleteW = unsafe extern "C" fn(*mut c_char);

/// The wrappers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Catch {
    pub(crate) create: CreateW,
    pub(crate) void1: Void1W,
    pub(crate) connect: ConnectW,
    pub(crate) accept: AcceptW,
    pub(crate) reg: RegW,
    pub(crate) mr_destroy: MrDestroyW,
    pub(crate) prepare_fifo: PrepareFifoW,
    pub(crate) xfer: XferW,
    pub(crate) xfer_status: StatusW,
    pub(crate) get_metadata: MetadataW,
    pub(crate) delete_array: DeleteW,
}

#[cfg(feature = "exception-shim")]
const OBJECT: Option<&[u8]> = Some(include_bytes!(concat!(env!("OUT_DIR"), "/catch.so")));
#[cfg(not(feature = "exception-shim"))]
const OBJECT: Option<&[u8]> = None;

/// The wrappers, loaded once.
///
/// # Errors
/// [`ErrorKind::NotSupported`] in a build without the feature `exception-shim`;
/// [`ErrorKind::UnavailableLibrary`] when the object cannot be loaded.
pub(crate) fn get() -> Result<Catch> {
    static LOADED: OnceLock<std::result::Result<Catch, (ErrorKind, &'static str, String)>> =
        OnceLock::new();
    LOADED
        .get_or_init(|| load().map_err(|e| (e.kind(), e.operation(), e.context().to_owned())))
        .clone()
        .map_err(|(k, op, m)| Error::new(k, op, m))
}

fn load() -> Result<Catch> {
    const OP: &str = "load UCCL";
    let Some(bytes) = OBJECT else {
        return Err(Error::new(
            ErrorKind::NotSupported,
            OP,
            "nixl-uccl was built without its feature `exception-shim` (a C++ shim that catches UCCL's C++ exceptions, which would otherwise abort the process); rebuild with it (the default; it needs g++)",
        ));
    };
    // Local scope: only this crate looks its wrappers up.
    let h =
        crate::host::load_embedded("nixl-uccl-catch", bytes, libc::RTLD_NOW | libc::RTLD_LOCAL)?;
    let sym = |name: &str| -> Result<*mut c_void> {
        let c = std::ffi::CString::new(name).expect("no NUL");
        // SAFETY: a lookup in a handle dlopen returned, never closed.
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        if p.is_null() {
            Err(Error::new(
                ErrorKind::UnavailableLibrary,
                OP,
                format!("nixl-uccl's exception shim lacks {name}"),
            ))
        } else {
            Ok(p)
        }
    };
    macro_rules! w {
        ($name:literal, $ty:ty) => {{
            let p = sym($name)?;
            // SAFETY: `$ty` is the declaration of `$name` in native/catch.cc (both
            // in this crate); the object is never unloaded.
            unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
        }};
    }
    Ok(Catch {
        create: w!("nixl_uccl_create", CreateW),
        void1: w!("nixl_uccl_void1", Void1W),
        connect: w!("nixl_uccl_connect", ConnectW),
        accept: w!("nixl_uccl_accept", AcceptW),
        reg: w!("nixl_uccl_reg", RegW),
        mr_destroy: w!("nixl_uccl_mr_destroy", MrDestroyW),
        prepare_fifo: w!("nixl_uccl_prepare_fifo", PrepareFifoW),
        xfer: w!("nixl_uccl_xfer", XferW),
        xfer_status: w!("nixl_uccl_xfer_status", StatusW),
        get_metadata: w!("nixl_uccl_get_metadata", MetadataW),
        delete_array: w!("nixl_uccl_delete_array", DeleteW),
    })
}

/// Run one wrapper call with an error buffer; a caught exception becomes an
/// [`ErrorKind::Backend`] error naming `op`.
///
/// # Safety
/// `f` calls one wrapper with valid arguments, passing it the buffer and its length.
pub(crate) unsafe fn guarded(op: &'static str, f: impl FnOnce(Err, usize) -> c_int) -> Result<()> {
    let mut buf = [0 as c_char; ERR_LEN];
    if f(buf.as_mut_ptr(), ERR_LEN) == 0 {
        return Ok(());
    }
    // SAFETY: the wrapper NUL-terminated what it wrote within the buffer (or left it
    // zeroed).
    let what = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    tracing::error!(op, %what, "UCCL threw a C++ exception (caught)");
    Err(Error::new(
        ErrorKind::Backend,
        op,
        format!("UCCL threw a C++ exception: {what}"),
    ))
}

#[cfg(all(test, feature = "exception-shim"))]
mod tests {
    use super::*;

    unsafe extern "C" fn returns(_h: *mut c_void) {}

    /// A C++ function that throws, built at test time like UCCL's are.
    fn thrower() -> Option<*mut c_void> {
        let dir = std::env::temp_dir().join(format!("nixl-uccl-thrower-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("thrower.cc");
        std::fs::write(
            &src,
            "#include <stdexcept>\nextern \"C\" void thrower(void*) { throw std::runtime_error(\"boom from C++\"); }\n",
        )
        .unwrap();
        let so = dir.join("libthrower.so");
        let ok = std::process::Command::new("c++")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&so)
            .arg(&src)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            nixl_testkit::skip(
                "exceptions_become_errors",
                "no C++ compiler (c++) to build a throwing function",
            );
            return None;
        }
        let lib = nixl::native::NativeLibrary::open(so.to_str().unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        Some(lib.address("thrower").unwrap().cast_mut())
    }

    #[test]
    fn calls_pass_through() {
        let c = get().unwrap();
        // SAFETY: `returns` has the signature `void f(void*)` nixl_uccl_void1 calls.
        unsafe {
            guarded("test", |e, l| {
                (c.void1)(returns as *const c_void, std::ptr::null_mut(), e, l)
            })
        }
        .unwrap();
    }

    /// Without the shim, this exception would unwind into Rust and abort the test
    /// process.
    #[test]
    fn exceptions_become_errors() {
        let Some(f) = thrower() else { return };
        let c = get().unwrap();
        // SAFETY: `thrower` has the signature `void f(void*)` nixl_uccl_void1 calls.
        let e = unsafe {
            guarded("UCCL test call", |e, l| {
                (c.void1)(f, std::ptr::null_mut(), e, l)
            })
        }
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert!(e.to_string().contains("boom from C++"), "{e}");
    }
}
