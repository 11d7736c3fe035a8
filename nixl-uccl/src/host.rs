//! What the host gives UCCL's engine, checked before the library is loaded or an
//! engine is created, so that nothing UCCL does on a host that lacks it can take the
//! process down:
//! - **Python.** UCCL 0.1.1's `libuccl_p2p.so` is built for its Python module and
//!   references three Python C-API functions ([`PYTHON_SYMBOLS`]), so a process
//!   without Python cannot load it (`undefined symbol: PyGILState_Release`). When the
//!   process has no Python runtime in its global scope, [`supply_python_symbols`]
//!   loads inert definitions of ours ([`PYTHON_STUBS`], built from
//!   `native/python_stubs.c`) into the global namespace first.
//! - **A transport.** UCCL's default (RDMA) transport takes the first RDMA device
//!   without checking there is one, and crashes (SIGSEGV) at the first registration
//!   on a host with none. [`transport_ready`] lists the devices through the host's
//!   libibverbs (the shared loader, as nixl-verbs does), or, for UCCL's TCP transport
//!   (`UCCL_P2P_TRANSPORT=tcp`), checks that the NCCL library it runs on is there.
//!
//! Audited FFI module: embedded objects loaded from memory, two libibverbs calls.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void, CString};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::OnceLock;

use nixl::native::NativeLibrary;
use nixl::{Error, ErrorKind, Result};

/// The Python C-API functions `libuccl_p2p.so` (uccl 0.1.1) references and this crate
/// supplies where the process has no Python. A test checks that these are the only
/// symbols the wheel's library leaves unresolved beyond its declared dependencies.
pub const PYTHON_SYMBOLS: &[&str] = &[
    "PyErr_CheckSignals",
    "PyGILState_Ensure",
    "PyGILState_Release",
];

/// The shared object with inert definitions of [`PYTHON_SYMBOLS`].
pub const PYTHON_STUBS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/python_stubs.so"));

/// The environment variable UCCL reads (once per process) to choose its transport:
/// unset or anything else is RDMA (ibverbs), `tcp`, `tcpx` or `nccl` its TCP
/// transport over NCCL, `efa` AWS EFA (ibverbs too).
pub const ENV_TRANSPORT: &str = "UCCL_P2P_TRANSPORT";

/// Where the Python C-API functions UCCL references come from in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PythonSymbols {
    /// A Python runtime is in the process's global scope: UCCL binds to it.
    Python,
    /// This crate's inert definitions ([`PYTHON_STUBS`]).
    Stubs,
}

/// Write `bytes` to an anonymous in-memory file and `dlopen` it with `flags`; the
/// handle is never closed (the object stays for the life of the process).
pub(crate) fn load_embedded(name: &str, bytes: &[u8], flags: c_int) -> Result<*mut c_void> {
    const OP: &str = "load nixl-uccl shim";
    let fail = |what: String| Error::new(ErrorKind::UnavailableLibrary, OP, what);
    let cname = CString::new(name).map_err(|_| fail(format!("{name:?}: a NUL")))?;
    // SAFETY: a valid C string and flags; the returned descriptor is owned below.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(fail(format!(
            "memfd_create for {name}: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes)
        .map_err(|e| fail(format!("writing {name} to memory: {e}")))?;
    let path = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("no NUL");
    // SAFETY: the object is ours (built from this crate's sources); its initialisers
    // are the compiler's defaults.
    let h = unsafe { libc::dlopen(path.as_ptr(), flags) };
    if h.is_null() {
        // SAFETY: dlerror returns a message owned by the loader, or NULL.
        let msg = unsafe {
            let m = libc::dlerror();
            if m.is_null() {
                "unknown error".to_owned()
            } else {
                std::ffi::CStr::from_ptr(m).to_string_lossy().into_owned()
            }
        };
        return Err(fail(format!("dlopen of {name} from memory: {msg}")));
    }
    // The descriptor stays open: the loader knows the object by the path
    // `/proc/self/fd/N`, and a later object loaded through a reused N would be taken
    // for this one. (Close-on-exec: children do not inherit it.)
    std::mem::forget(file);
    Ok(h)
}

/// Whether a Python runtime is in the process's global scope.
pub fn python_in_process() -> bool {
    // SAFETY: looking a name up in the global scope has no side effect.
    !unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"Py_IsInitialized".as_ptr()) }.is_null()
}

/// Make [`PYTHON_SYMBOLS`] resolvable for `libuccl_p2p.so`: nothing to do inside
/// Python; elsewhere, this crate's inert definitions, loaded once into the global
/// namespace (`RTLD_GLOBAL`).
///
/// # Errors
/// [`ErrorKind::UnavailableLibrary`] when the definitions cannot be loaded.
pub fn supply_python_symbols() -> Result<PythonSymbols> {
    static DONE: OnceLock<std::result::Result<PythonSymbols, String>> = OnceLock::new();
    DONE.get_or_init(|| {
        if python_in_process() {
            return Ok(PythonSymbols::Python);
        }
        load_embedded(
            "nixl-uccl-python-stubs",
            PYTHON_STUBS,
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
        )
        .map(|_| PythonSymbols::Stubs)
        .map_err(|e| e.context().to_owned())
    })
    .clone()
    .map_err(|m| Error::new(ErrorKind::UnavailableLibrary, "load UCCL", m))
}

/// UCCL's transports, as `UCCL_P2P_TRANSPORT` chooses them (read the way UCCL 0.1.1
/// reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// RDMA over ibverbs (the default).
    Rdma,
    /// TCP, over NCCL's socket transport (`tcp`, `tcpx`, `nccl`).
    Tcp,
    /// AWS EFA over ibverbs (`efa`).
    Efa,
}

impl Transport {
    /// The transport UCCL will use in this process.
    pub fn from_env() -> Self {
        Self::parse(std::env::var(ENV_TRANSPORT).ok().as_deref())
    }

    /// UCCL 0.1.1's `get_transport_type`: exact, case-sensitive matches.
    pub fn parse(v: Option<&str>) -> Self {
        match v {
            Some("tcp" | "tcpx" | "nccl") => Self::Tcp,
            Some("efa") => Self::Efa,
            _ => Self::Rdma,
        }
    }
}

/// The host's libibverbs.
pub const LIBIBVERBS: &str = "libibverbs.so.1";
/// The NCCL library UCCL's TCP transport loads (UCCL tries `libnccl.so`, then this).
pub const LIBNCCL: &[&str] = &["libnccl.so.2", "libnccl.so"];

type GetDeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceListFn = unsafe extern "C" fn(*mut *mut c_void);

/// How many RDMA devices the host's libibverbs lists.
///
/// # Errors
/// The reason there can be none: libibverbs missing, or the kernel without RDMA.
pub fn rdma_devices() -> std::result::Result<usize, String> {
    let lib = NativeLibrary::open(LIBIBVERBS).map_err(|e| {
        format!("the host's {LIBIBVERBS} cannot be loaded ({e}; apt-get install libibverbs1 ibverbs-providers)")
    })?;
    // SAFETY: the declarations of <infiniband/verbs.h>: `struct ibv_device
    // **ibv_get_device_list(int *num_devices)`, `void ibv_free_device_list(struct
    // ibv_device **list)`.
    let (get, free) = unsafe {
        (
            lib.symbol::<GetDeviceListFn>("ibv_get_device_list")
                .map_err(|e| e.to_string())?,
            lib.symbol::<FreeDeviceListFn>("ibv_free_device_list")
                .map_err(|e| e.to_string())?,
        )
    };
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid int to write the count to.
    let list = unsafe { get(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "ibv_get_device_list failed: {e} (no RDMA support in this kernel?)"
        ));
    }
    // SAFETY: the list came from ibv_get_device_list and is freed once.
    unsafe { free(list) };
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Refuse, before an engine is created, what would crash UCCL 0.1.1's engine: its
/// RDMA and EFA transports on a host with no RDMA device (it takes the first device
/// without checking and dies of SIGSEGV at the first registration), its TCP
/// transport without NCCL.
///
/// # Errors
/// [`ErrorKind::NotSupported`] saying what is missing and what to do.
pub fn transport_ready(transport: Transport) -> Result<()> {
    const OP: &str = "create UCCL engine";
    let refuse = |m: String| Err(Error::new(ErrorKind::NotSupported, OP, m));
    match transport {
        Transport::Rdma | Transport::Efa => match rdma_devices() {
            Ok(n) if n > 0 => Ok(()),
            Ok(_) => refuse(format!(
                "no RDMA device ({LIBIBVERBS} lists none): UCCL's {transport:?} transport needs one (UCCL 0.1.1 would take a device that is not there and crash at the first registration); on a host without an RDMA NIC set {ENV_TRANSPORT}=tcp (UCCL's TCP transport, which needs NCCL's libnccl.so.2)"
            )),
            Err(why) => refuse(format!(
                "no RDMA device: {why}; UCCL's {transport:?} transport needs one; on a host without an RDMA NIC set {ENV_TRANSPORT}=tcp (UCCL's TCP transport, which needs NCCL's libnccl.so.2)"
            )),
        },
        Transport::Tcp => {
            let mut why = Vec::new();
            for l in LIBNCCL {
                match NativeLibrary::open(l) {
                    Ok(_) => return Ok(()),
                    Err(e) => why.push(e.message),
                }
            }
            refuse(format!(
                "{ENV_TRANSPORT}=tcp: UCCL's TCP transport runs on NCCL, and {} cannot be loaded ({}); install NCCL (the PyPI wheel nvidia-nccl-cu12, its lib directory on LD_LIBRARY_PATH)",
                LIBNCCL[0],
                why.join("; ")
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_is_read_as_uccl_reads_it() {
        assert_eq!(Transport::parse(None), Transport::Rdma);
        assert_eq!(Transport::parse(Some("tcp")), Transport::Tcp);
        assert_eq!(Transport::parse(Some("tcpx")), Transport::Tcp);
        assert_eq!(Transport::parse(Some("nccl")), Transport::Tcp);
        assert_eq!(Transport::parse(Some("efa")), Transport::Efa);
        assert_eq!(Transport::parse(Some("TCP")), Transport::Rdma);
        assert_eq!(Transport::parse(Some("rdma")), Transport::Rdma);
    }

    #[test]
    fn the_stubs_supply_the_python_symbols_without_python() {
        assert!(!python_in_process(), "a Rust test process has no Python");
        assert_eq!(supply_python_symbols().unwrap(), PythonSymbols::Stubs);
        for s in PYTHON_SYMBOLS {
            let c = CString::new(*s).unwrap();
            // SAFETY: a lookup in the global scope.
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) };
            assert!(!p.is_null(), "{s} is not in the global scope");
        }
        // SAFETY: PyErr_CheckSignals as the stubs define it: `int f(void)`.
        let check: unsafe extern "C" fn() -> c_int = unsafe {
            std::mem::transmute(libc::dlsym(
                libc::RTLD_DEFAULT,
                c"PyErr_CheckSignals".as_ptr(),
            ))
        };
        // SAFETY: an inert function.
        assert_eq!(unsafe { check() }, 0);
        // Still no Python runtime: the stubs do not define Py_IsInitialized.
        assert!(!python_in_process());
        // Once.
        assert_eq!(supply_python_symbols().unwrap(), PythonSymbols::Stubs);
    }

    #[test]
    fn no_rdma_device_is_refused_with_what_to_do() {
        match rdma_devices() {
            Ok(n) if n > 0 => {
                assert!(transport_ready(Transport::Rdma).is_ok());
            }
            _ => {
                let e = transport_ready(Transport::Rdma).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}");
                let m = e.to_string();
                assert!(
                    m.contains("no RDMA device") && m.contains("UCCL_P2P_TRANSPORT=tcp"),
                    "{m}"
                );
            }
        }
    }
}
