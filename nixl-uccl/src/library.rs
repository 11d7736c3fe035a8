//! The real `libuccl_p2p.so`, loaded at run time, bound by its C++ symbol names.
//!
//! UCCL's `uccl_engine_*` functions have C++ linkage, so their symbols are mangled, and
//! a mangled name encodes the parameter types (not the return type). This crate
//! declares each function itself (UCCL's headers are never copied here) and resolves
//! it by the mangled name of exactly the signature it declares ([`SYMBOLS`]); a test
//! checks every one against the dynamic symbol table of the real wheel's library. A
//! library whose signature changed then fails to load with a clear error instead of
//! being called with the wrong arguments.
//!
//! Only functions with C-compatible parameters are bound: pointers, integers,
//! `bool`, a reference (passed as a pointer), and the by-value `FifoItem` (a trivially
//! copyable 64-byte aggregate, passed in memory like the same C struct). The vector
//! calls (`uccl_engine_read_vector` and `uccl_engine_write_vector` take `std::vector`
//! by value) are not: building libstdc++ objects from Rust would tie us to one
//! standard library's layout and to who frees their buffers. A transfer is one
//! `uccl_engine_write`/`uccl_engine_read` per piece instead. UCCL's notification calls
//! are not bound either: nixl-uccl carries notifications itself (see the crate docs).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use nixl::native::{self, BoundObject, LibraryReport, LibrarySource, NativeLibrary};
use nixl::{Error, ErrorKind, Result};

use crate::api::{Accepted, ConnHandle, EngineApi, EngineHandle, FifoItem};
use crate::catch::{self, guarded, Catch};
use crate::host;

/// Default soname of UCCL's p2p engine (searched the loader's usual way:
/// `LD_LIBRARY_PATH`, the cache). The PyPI wheel `uccl` has it under `uccl/lib/`.
pub const DEFAULT_SONAME: &str = "libuccl_p2p.so";
/// Environment variable with an explicit `libuccl_p2p.so` path (or soname).
pub const ENV_LIB: &str = "NIXL_UCCL_LIB";
/// The CUDA driver UCCL's engine needs (a `DT_NEEDED` of `libuccl_p2p.so`).
pub const CUDA_DRIVER: &str = "libcuda.so.1";
/// The CUDA runtime UCCL's engine needs (a `DT_NEEDED` of `libuccl_p2p.so`).
pub const CUDA_RUNTIME: &str = "libcudart.so.12";

/// One bound function: what we call it, its mangled name, and the C++ declaration that
/// mangled name stands for.
#[derive(Clone, Copy, Debug)]
pub struct Symbol {
    /// Short name.
    pub name: &'static str,
    /// Itanium-mangled symbol.
    pub mangled: &'static str,
    /// The declaration (return type included, which the mangled name does not encode).
    pub declaration: &'static str,
}

/// Every function this crate binds, checked against the real library by a test.
pub const SYMBOLS: &[Symbol] = &[
    Symbol {
        name: "create",
        mangled: "_Z18uccl_engine_createib",
        declaration: "uccl_engine* uccl_engine_create(int num_cpus, bool in_python)",
    },
    Symbol {
        name: "destroy",
        mangled: "_Z19uccl_engine_destroyP11uccl_engine",
        declaration: "void uccl_engine_destroy(uccl_engine*)",
    },
    Symbol {
        name: "connect",
        mangled: "_Z19uccl_engine_connectP11uccl_enginePKcS2_ib",
        declaration: "uccl_conn* uccl_engine_connect(uccl_engine*, const char* ip, const char* remote_gpu, int port, bool same_process)",
    },
    Symbol {
        name: "accept",
        mangled: "_Z18uccl_engine_acceptP11uccl_enginePcmPi",
        declaration: "uccl_conn* uccl_engine_accept(uccl_engine*, char* ip_buf, size_t ip_buf_len, int* remote_gpu)",
    },
    Symbol {
        name: "stop_accept",
        mangled: "_Z23uccl_engine_stop_acceptP11uccl_engine",
        declaration: "void uccl_engine_stop_accept(uccl_engine*)",
    },
    Symbol {
        name: "reg",
        mangled: "_Z15uccl_engine_regP11uccl_enginemmRm",
        declaration: "int uccl_engine_reg(uccl_engine*, uintptr_t data, size_t size, uint64_t& mr_id)",
    },
    Symbol {
        name: "mr_destroy",
        mangled: "_Z22uccl_engine_mr_destroyP11uccl_enginem",
        declaration: "void uccl_engine_mr_destroy(uccl_engine*, uint64_t mr)",
    },
    Symbol {
        name: "prepare_fifo",
        mangled: "_Z24uccl_engine_prepare_fifoP11uccl_enginemPKvmPc",
        declaration: "int uccl_engine_prepare_fifo(uccl_engine*, uint64_t mr, const void* data, size_t size, char* fifo_buf)",
    },
    Symbol {
        name: "write",
        mangled: "_Z17uccl_engine_writeP9uccl_connmPKvm8FifoItemPm",
        declaration: "int uccl_engine_write(uccl_conn*, uint64_t mr, const void* data, size_t size, FifoItem, uint64_t* transfer_id)",
    },
    Symbol {
        name: "read",
        mangled: "_Z16uccl_engine_readP9uccl_connmPKvm8FifoItemPm",
        declaration: "int uccl_engine_read(uccl_conn*, uint64_t mr, const void* data, size_t size, FifoItem, uint64_t* transfer_id)",
    },
    Symbol {
        name: "xfer_status",
        mangled: "_Z23uccl_engine_xfer_statusP9uccl_connm",
        declaration: "bool uccl_engine_xfer_status(uccl_conn*, uint64_t transfer_id)",
    },
    Symbol {
        name: "conn_destroy",
        mangled: "_Z24uccl_engine_conn_destroyP9uccl_conn",
        declaration: "void uccl_engine_conn_destroy(uccl_conn*)",
    },
    Symbol {
        name: "get_metadata",
        mangled: "_Z24uccl_engine_get_metadataP11uccl_enginePPc",
        declaration: "int uccl_engine_get_metadata(uccl_engine*, char** metadata_str)",
    },
];

fn mangled(name: &str) -> &'static str {
    SYMBOLS
        .iter()
        .find(|s| s.name == name)
        .map(|s| s.mangled)
        .expect("a bound symbol")
}

type CreateFn = unsafe extern "C" fn(c_int, bool) -> *mut c_void;
type EngineFn = unsafe extern "C" fn(*mut c_void);
type ConnectFn =
    unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char, c_int, bool) -> *mut c_void;
type AcceptFn = unsafe extern "C" fn(*mut c_void, *mut c_char, usize, *mut c_int) -> *mut c_void;
type RegFn = unsafe extern "C" fn(*mut c_void, usize, usize, *mut u64) -> c_int;
type MrDestroyFn = unsafe extern "C" fn(*mut c_void, u64);
type PrepareFifoFn =
    unsafe extern "C" fn(*mut c_void, u64, *const c_void, usize, *mut c_char) -> c_int;
type XferFn =
    unsafe extern "C" fn(*mut c_void, u64, *const c_void, usize, FifoItem, *mut u64) -> c_int;
type StatusFn = unsafe extern "C" fn(*mut c_void, u64) -> bool;
type MetadataFn = unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> c_int;

/// The bound library.
pub(crate) struct Uccl {
    path: String,
    create: CreateFn,
    destroy: EngineFn,
    connect: ConnectFn,
    accept: AcceptFn,
    stop_accept: EngineFn,
    reg: RegFn,
    mr_destroy: MrDestroyFn,
    prepare_fifo: PrepareFifoFn,
    write: XferFn,
    read: XferFn,
    xfer_status: StatusFn,
    conn_destroy: EngineFn,
    get_metadata: MetadataFn,
    /// The exception boundary every call goes through (`None` in a build without
    /// the feature `exception-shim`: the library loads, but no engine is created).
    catch: Option<Catch>,
}

impl std::fmt::Debug for Uccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uccl")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// UCCL keeps its registration table (`mem_reg_info`) in one unguarded global map,
/// whatever the engine: `reg` and `mr_destroy` change it, and `read`/`write` look
/// addresses up in it on a same-host connection. Calls that change it (and engine or
/// connection creation and destruction) take this lock exclusively; `read`/`write`
/// share it. `xfer_status` touches no shared state and takes none, so a post that
/// spins on a full queue can never keep the completions that would drain the queue
/// from being polled by another thread (the progress thread also bounds what it
/// keeps outstanding, `UcclOptions::max_outstanding`).
static ENGINE_LOCK: RwLock<()> = RwLock::new(());

fn locked() -> std::sync::RwLockWriteGuard<'static, ()> {
    ENGINE_LOCK.write().unwrap_or_else(|e| e.into_inner())
}

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    ENGINE_LOCK.read().unwrap_or_else(|e| e.into_inner())
}

fn backend_err(op: &'static str, what: String) -> Error {
    Error::new(ErrorKind::Backend, op, what)
}

impl Uccl {
    /// The exception boundary, present whenever an engine exists (creation needs it).
    fn catch(&self, op: &'static str) -> Result<Catch> {
        self.catch.ok_or_else(|| {
            Error::new(
                ErrorKind::NotSupported,
                op,
                "nixl-uccl was built without its feature `exception-shim`",
            )
        })
    }

    /// A call that returns nothing: an exception is logged (there is nobody to tell).
    fn void_call(&self, op: &'static str, f: *const c_void, h: usize) {
        let r = self.catch(op).and_then(|c| {
            // SAFETY: `f` is one of UCCL's `void f(handle)` functions and `h` a live
            // handle of it (the callers' contracts).
            unsafe { guarded(op, |e, l| (c.void1)(f, h as *mut c_void, e, l)) }
        });
        if let Err(e) = r {
            tracing::error!(%e, "{op}");
        }
    }
}

impl EngineApi for Uccl {
    fn describe(&self) -> String {
        format!("UCCL p2p engine ({})", self.path)
    }

    fn bind_thread(&self, device: u32) -> Result<()> {
        nixl::gpu::bind_thread(device)
    }

    fn create(&self) -> Result<EngineHandle> {
        const OP: &str = "create UCCL engine";
        let c = self.catch(OP)?;
        // What would crash UCCL's engine later (no RDMA device) is refused now.
        host::transport_ready(host::Transport::from_env())?;
        let _g = locked();
        let mut e: *mut c_void = std::ptr::null_mut();
        // SAFETY: `create` takes an int and a bool (SYMBOLS); `num_cpus` is unused by
        // UCCL 0.1 and `in_python` false: this process does not run the engine inside
        // Python (UCCL then never calls the Python functions `host` supplies).
        unsafe {
            guarded(OP, |er, l| {
                (c.create)(self.create as *const c_void, 0, false, &mut e, er, l)
            })?
        };
        if e.is_null() {
            return Err(backend_err(OP, "uccl_engine_create returned NULL".into()));
        }
        Ok(EngineHandle(e as usize))
    }

    unsafe fn destroy(&self, e: EngineHandle) {
        let _g = locked();
        self.void_call("destroy UCCL engine", self.destroy as *const c_void, e.0);
    }

    fn metadata(&self, e: EngineHandle) -> Result<String> {
        const OP: &str = "UCCL metadata";
        let c = self.catch(OP)?;
        let mut out: *mut c_char = std::ptr::null_mut();
        let mut rc: c_int = -1;
        {
            let _g = locked();
            // SAFETY: `e` is live (trait contract); `out` is a valid place for the
            // pointer UCCL allocates, `rc` for its status.
            unsafe {
                guarded(OP, |er, l| {
                    (c.get_metadata)(
                        self.get_metadata as *const c_void,
                        e.0 as *mut c_void,
                        &mut out,
                        &mut rc,
                        er,
                        l,
                    )
                })?
            };
        }
        if rc != 0 || out.is_null() {
            return Err(backend_err(
                OP,
                format!("uccl_engine_get_metadata returned {rc}"),
            ));
        }
        // SAFETY: UCCL wrote a NUL-terminated string (strcpy) into `out`.
        let s = unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `out` came from `new char[]` in the library; the shim's `delete[]`
        // is the same C++ runtime's (one libstdc++.so.6 in the process).
        unsafe { (c.delete_array)(out) };
        Ok(s)
    }

    fn connect(&self, e: EngineHandle, ip: &str, gpu: &str, port: u16) -> Result<ConnHandle> {
        const OP: &str = "UCCL connect";
        let c = self.catch(OP)?;
        let ip_c = CString::new(ip).map_err(|_| backend_err(OP, "an address with a NUL".into()))?;
        let gpu_c = CString::new(gpu).map_err(|_| backend_err(OP, "a GPU id with a NUL".into()))?;
        // Not under ENGINE_LOCK: connect blocks on the network and does not touch the
        // global registration map. (UCCL 0.1.1's own passive accept thread updates the
        // endpoint's tables concurrently with some unlocked reads of its own; nothing
        // a caller can serialize.)
        let mut conn: *mut c_void = std::ptr::null_mut();
        // SAFETY: `e` is live; both strings are NUL-terminated and outlive the call.
        unsafe {
            guarded(OP, |er, l| {
                (c.connect)(
                    self.connect as *const c_void,
                    e.0 as *mut c_void,
                    ip_c.as_ptr(),
                    gpu_c.as_ptr(),
                    c_int::from(port),
                    false,
                    &mut conn,
                    er,
                    l,
                )
            })?
        };
        if conn.is_null() {
            return Err(Error::new(
                ErrorKind::RemoteDisconnected,
                OP,
                format!("uccl_engine_connect to {ip}:{port} (GPU {gpu}) failed"),
            ));
        }
        Ok(ConnHandle(conn as usize))
    }

    fn accept(&self, e: EngineHandle) -> Option<Accepted> {
        const OP: &str = "UCCL accept";
        let c = self.catch(OP).ok()?;
        let mut ip = [0 as c_char; 128];
        let mut gpu: c_int = -1;
        let mut conn: *mut c_void = std::ptr::null_mut();
        // Not under ENGINE_LOCK: it blocks until a peer connects or stop_accept.
        // SAFETY: `e` is live; `ip` has the length passed and `gpu` is a valid int.
        let r = unsafe {
            guarded(OP, |er, l| {
                (c.accept)(
                    self.accept as *const c_void,
                    e.0 as *mut c_void,
                    ip.as_mut_ptr(),
                    ip.len() - 1,
                    &mut gpu,
                    &mut conn,
                    er,
                    l,
                )
            })
        };
        if r.is_err() || conn.is_null() {
            return None;
        }
        // SAFETY: the buffer is NUL-terminated: UCCL strncpy's at most len-1 bytes into
        // a zeroed buffer one byte longer.
        let ip = unsafe { CStr::from_ptr(ip.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Some(Accepted {
            conn: ConnHandle(conn as usize),
            ip,
        })
    }

    fn stop_accept(&self, e: EngineHandle) {
        // `e` is live; stop_accept is meant to run while accept blocks.
        self.void_call("UCCL stop accept", self.stop_accept as *const c_void, e.0);
    }

    unsafe fn reg(&self, e: EngineHandle, addr: usize, len: usize) -> Result<u64> {
        const OP: &str = "UCCL register";
        let c = self.catch(OP)?;
        let mut mr = 0u64;
        let mut rc: c_int = -1;
        {
            let _g = locked();
            // SAFETY: the caller guarantees the range; `mr` is the reference UCCL
            // writes the id through.
            unsafe {
                guarded(OP, |er, l| {
                    (c.reg)(
                        self.reg as *const c_void,
                        e.0 as *mut c_void,
                        addr,
                        len,
                        &mut mr,
                        &mut rc,
                        er,
                        l,
                    )
                })?
            };
        }
        if rc != 0 {
            return Err(backend_err(
                OP,
                format!("uccl_engine_reg of {len} bytes at {addr:#x} returned {rc}"),
            ));
        }
        Ok(mr)
    }

    fn mr_destroy(&self, e: EngineHandle, mr: u64) {
        const OP: &str = "UCCL deregister";
        let _g = locked();
        let r = self.catch(OP).and_then(|c| {
            // SAFETY: `e` is live; an unknown id is ignored by UCCL (it searches its
            // map).
            unsafe {
                guarded(OP, |er, l| {
                    (c.mr_destroy)(
                        self.mr_destroy as *const c_void,
                        e.0 as *mut c_void,
                        mr,
                        er,
                        l,
                    )
                })
            }
        });
        if let Err(e) = r {
            tracing::error!(%e, "{OP}");
        }
    }

    fn prepare_fifo(&self, e: EngineHandle, mr: u64, addr: usize, len: usize) -> Result<FifoItem> {
        const OP: &str = "UCCL register";
        let c = self.catch(OP)?;
        let mut buf = [0 as c_char; crate::api::FIFO_ITEM_LEN];
        let mut rc: c_int = -1;
        {
            let _g = locked();
            // SAFETY: `e` is live, `mr` one of its regions covering the range; UCCL
            // writes exactly 64 bytes into `buf`.
            unsafe {
                guarded(OP, |er, l| {
                    (c.prepare_fifo)(
                        self.prepare_fifo as *const c_void,
                        e.0 as *mut c_void,
                        mr,
                        addr as *const c_void,
                        len,
                        buf.as_mut_ptr(),
                        &mut rc,
                        er,
                        l,
                    )
                })?
            };
        }
        if rc != 0 {
            return Err(backend_err(
                OP,
                format!("uccl_engine_prepare_fifo returned {rc}"),
            ));
        }
        let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
        FifoItem::decode(&bytes).ok_or_else(|| backend_err(OP, "short FifoItem".into()))
    }

    unsafe fn write(
        &self,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { self.xfer(self.write, "UCCL write", c, mr, addr, len, remote) }
    }

    unsafe fn read(
        &self,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { self.xfer(self.read, "UCCL read", c, mr, addr, len, remote) }
    }

    fn done(&self, c: ConnHandle, id: u64) -> Result<bool> {
        const OP: &str = "UCCL transfer status";
        let w = self.catch(OP)?;
        let mut done = false;
        // SAFETY: `c` is live and `id` one of its transfers, not yet seen done.
        unsafe {
            guarded(OP, |er, l| {
                (w.xfer_status)(
                    self.xfer_status as *const c_void,
                    c.0 as *mut c_void,
                    id,
                    &mut done,
                    er,
                    l,
                )
            })?
        };
        Ok(done)
    }

    unsafe fn conn_destroy(&self, c: ConnHandle) {
        let _g = locked();
        // The caller guarantees `c` is live and unused from now on.
        self.void_call(
            "close UCCL connection",
            self.conn_destroy as *const c_void,
            c.0,
        );
    }
}

impl Uccl {
    /// One `uccl_engine_write`/`uccl_engine_read` (same signature).
    ///
    /// # Safety
    /// As [`EngineApi::write`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn xfer(
        &self,
        f: XferFn,
        op: &'static str,
        c: ConnHandle,
        mr: u64,
        addr: usize,
        len: usize,
        remote: FifoItem,
    ) -> Result<u64> {
        let w = self.catch(op)?;
        let mut id = 0u64;
        let mut rc: c_int = -1;
        {
            let _g = shared();
            // SAFETY: the caller guarantees the local range and the handles; `remote`
            // goes by value as UCCL's FifoItem (same layout, see api::FifoItem).
            unsafe {
                guarded(op, |er, l| {
                    (w.xfer)(
                        f as *const c_void,
                        c.0 as *mut c_void,
                        mr,
                        addr as *const c_void,
                        len,
                        &remote,
                        &mut id,
                        &mut rc,
                        er,
                        l,
                    )
                })?
            };
        }
        if rc != 0 {
            return Err(backend_err(op, format!("{op} returned {rc}")));
        }
        Ok(id)
    }
}

struct Bound {
    lib: std::sync::Arc<Uccl>,
    report: LibraryReport,
}

/// Libraries bound in this process, by request. Never unloaded.
static BOUND: Mutex<Option<HashMap<String, Bound>>> = Mutex::new(None);

fn unavailable(op: &'static str, msg: String) -> Error {
    Error::new(ErrorKind::UnavailableLibrary, op, msg)
}

/// The version of the wheel a library file came from (`.../site-packages/uccl/lib/
/// libuccl_p2p.so` next to `.../site-packages/uccl-0.1.1.dist-info`), if any.
pub(crate) fn wheel_version(lib: &Path) -> Option<String> {
    let site = lib.parent()?.parent()?.parent()?;
    std::fs::read_dir(site).ok()?.flatten().find_map(|e| {
        let n = e.file_name().into_string().ok()?;
        let v = n.strip_prefix("uccl-")?.strip_suffix(".dist-info")?;
        Some(v.to_owned())
    })
}

/// Why a `dlopen` failed, with what to do about it.
fn explain_load_failure(requested: &str, source: LibrarySource, message: &str) -> String {
    let what = match source {
        LibrarySource::Default => format!(
            "{DEFAULT_SONAME} not found or not loadable (it ships in the PyPI wheel `uccl` under uccl/lib/; put that directory on LD_LIBRARY_PATH or set {ENV_LIB} to the file)"
        ),
        LibrarySource::Env => format!("{ENV_LIB}={requested} cannot be loaded"),
        LibrarySource::Option => format!("UCCL library {requested:?} cannot be loaded"),
    };
    let hint = if message.contains(CUDA_RUNTIME) {
        format!("; it needs the CUDA runtime {CUDA_RUNTIME} on the loader path (the PyPI wheel nvidia-cuda-runtime-cu12, or a CUDA 12 toolkit)")
    } else {
        String::new()
    };
    format!("{what}: {message}{hint}")
}

/// Load (or reuse) the UCCL library named by `requested`.
pub(crate) fn bind(
    requested: &str,
    source: LibrarySource,
) -> Result<(std::sync::Arc<Uccl>, LibraryReport)> {
    const OP: &str = "load UCCL";
    let mut guard = BOUND.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(b) = map.get(requested) {
        return Ok((b.lib.clone(), b.report.clone()));
    }
    if requested.contains('/') && !Path::new(requested).exists() {
        return Err(unavailable(
            OP,
            explain_load_failure(requested, source, "no such file"),
        ));
    }
    // The wheel's library references Python's C API: supplied (inert) where the
    // process has no Python, before the library is loaded.
    let python = host::supply_python_symbols()?;
    let preloaded = native::mapped_objects(&["libuccl_p2p"]);
    let requested_was_loaded = native::is_loaded(requested);
    let lib = NativeLibrary::open(requested).map_err(|e| {
        let mut msg = explain_load_failure(requested, source, &e.message);
        // The loader names only the first dependency it misses; the driver is the
        // one a machine without a GPU lacks, so name it whenever it is missing.
        if e.message.contains(CUDA_DRIVER) {
            msg.push_str(&format!(
                "; {CUDA_DRIVER} is the CUDA driver: UCCL's engine needs an NVIDIA GPU and its driver"
            ));
        } else if let Err(d) = NativeLibrary::open(CUDA_DRIVER) {
            msg.push_str(&format!(
                "; the CUDA driver {CUDA_DRIVER} is missing too (UCCL's engine needs an NVIDIA GPU and its driver): {d}"
            ));
        }
        unavailable(OP, msg)
    })?;
    let driver = NativeLibrary::open(CUDA_DRIVER).map_err(|e| {
        unavailable(
            OP,
            format!("UCCL's p2p engine needs the CUDA driver {CUDA_DRIVER}: {e}"),
        )
    })?;
    let sym = |name: &str| -> Result<*const c_void> {
        let m = mangled(name);
        lib.address(m).ok_or_else(|| {
            unavailable(
                OP,
                format!(
                    "{} lacks {m} ({name}): not the UCCL p2p ABI this crate declares (checked against uccl 0.1.1)",
                    lib.name()
                ),
            )
        })
    };
    macro_rules! f {
        ($name:literal, $ty:ty) => {{
            let p = sym($name)?;
            // SAFETY: the mangled name encodes exactly the parameter types declared
            // in SYMBOLS, which `$ty` spells in C ABI terms (see the module docs);
            // the return type is UCCL's documented one. The library is never
            // unloaded, so the pointer stays valid.
            unsafe { std::mem::transmute::<*const c_void, $ty>(p) }
        }};
    }
    // Without the exception shim the library still loads (probe, reports), but no
    // engine is created.
    let catch = match catch::get() {
        Ok(c) => Some(c),
        Err(e) if e.kind() == ErrorKind::NotSupported => None,
        Err(e) => return Err(e),
    };
    let path = lib
        .path_of_symbol(&[mangled("create")])
        .unwrap_or_else(|| PathBuf::from(requested));
    let uccl = Uccl {
        path: path.display().to_string(),
        create: f!("create", CreateFn),
        destroy: f!("destroy", EngineFn),
        connect: f!("connect", ConnectFn),
        accept: f!("accept", AcceptFn),
        stop_accept: f!("stop_accept", EngineFn),
        reg: f!("reg", RegFn),
        mr_destroy: f!("mr_destroy", MrDestroyFn),
        prepare_fifo: f!("prepare_fifo", PrepareFifoFn),
        write: f!("write", XferFn),
        read: f!("read", XferFn),
        xfer_status: f!("xfer_status", StatusFn),
        conn_destroy: f!("conn_destroy", EngineFn),
        get_metadata: f!("get_metadata", MetadataFn),
        catch,
    };
    let uccl_has_catch = uccl.catch.is_some();
    let mut objects = vec![BoundObject {
        name: "libuccl_p2p".into(),
        path: Some(path.clone()),
    }];
    objects.push(BoundObject {
        name: "libcudart".into(),
        path: lib.path_of_symbol(&["cudaGetDeviceCount"]),
    });
    objects.push(BoundObject {
        name: "libcuda".into(),
        path: driver.path_of_symbol(&["cuInit"]),
    });
    let other_copies: Vec<PathBuf> = native::mapped_objects(&["libuccl_p2p"])
        .into_iter()
        .filter(|p| std::fs::canonicalize(p).ok().as_deref() != Some(path.as_path()))
        .collect();
    let report = LibraryReport {
        library: "UCCL p2p".into(),
        requested: requested.to_owned(),
        source,
        requested_was_loaded,
        preloaded,
        version: wheel_version(&path),
        objects,
        same_installation: other_copies.is_empty(),
        other_copies,
        notes: vec![
            "bound: scalar uccl_engine_write/read per piece (the std::vector calls are not bound)".into(),
            "notifications: nixl-uccl's own control connection (UCCL's process-global list is not used)".into(),
            match python {
                host::PythonSymbols::Python => "Python C API: the process's Python runtime".into(),
                host::PythonSymbols::Stubs => "Python C API: nixl-uccl's inert definitions (no Python in this process)".into(),
            },
            if uccl_has_catch {
                "C++ exceptions: caught at nixl-uccl's boundary".into()
            } else {
                "C++ exceptions: no shim in this build (feature `exception-shim`); engines are refused".into()
            },
            format!("transport: {:?} ({}={:?})", host::Transport::from_env(), host::ENV_TRANSPORT, std::env::var(host::ENV_TRANSPORT).unwrap_or_default()),
        ],
    };
    tracing::info!(%report, "UCCL bound");
    let lib = std::sync::Arc::new(uccl);
    map.insert(
        requested.to_owned(),
        Bound {
            lib: lib.clone(),
            report: report.clone(),
        },
    );
    Ok((lib, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_comes_from_the_wheel_the_library_lies_in() {
        let root = std::env::temp_dir().join(format!("nixl-uccl-wheel-{}", std::process::id()));
        let lib = root.join("uccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(root.join("uccl-0.1.1.dist-info")).unwrap();
        let so = lib.join("libuccl_p2p.so");
        assert_eq!(wheel_version(&so).as_deref(), Some("0.1.1"));
        assert_eq!(wheel_version(Path::new("/usr/lib/libuccl_p2p.so")), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn symbols_are_unique_and_mangled() {
        let mut names: Vec<_> = SYMBOLS.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SYMBOLS.len());
        for s in SYMBOLS {
            // `_Z<len>uccl_engine_<name>`: the function name the declaration gives.
            let f = s
                .declaration
                .split('(')
                .next()
                .unwrap()
                .rsplit(' ')
                .next()
                .unwrap();
            let f = f.trim_start_matches('*');
            assert!(s.mangled.starts_with(&format!("_Z{}{f}", f.len())), "{s:?}");
        }
    }

    #[test]
    fn load_errors_say_what_to_do() {
        let m = explain_load_failure(DEFAULT_SONAME, LibrarySource::Default, "x: cannot open");
        assert!(
            m.contains("PyPI wheel `uccl`") && m.contains(ENV_LIB),
            "{m}"
        );
        let m = explain_load_failure(
            "/p",
            LibrarySource::Env,
            "libcudart.so.12: cannot open shared object file",
        );
        assert!(
            m.contains("NIXL_UCCL_LIB=/p") && m.contains("nvidia-cuda-runtime-cu12"),
            "{m}"
        );
    }
}
