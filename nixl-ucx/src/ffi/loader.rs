//! Loading `libucp` with the system's dynamic loader and finding out what was bound.

use std::ffi::{c_void, CStr, CString};
use std::path::PathBuf;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use super::sys::{self, Api};

/// A loaded `libucp` and its function table. Never unloaded: UCX does not support
/// being unloaded, and function pointers into it live as long as the process.
pub(crate) struct Loaded {
    pub(crate) api: Api,
    /// Kept so the mapping stays; leaked on purpose (see above).
    _lib: Library,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Loaded(libucp)")
    }
}

/// Why loading failed.
#[derive(Debug)]
pub(crate) enum LoadError {
    /// The loader could not open it (missing, wrong architecture, unresolved symbols).
    Open(libloading::Error),
    /// It loaded but lacks a function we need.
    Symbol(&'static str, libloading::Error),
}

/// Whether an object matching `name` (a soname or path) is already loaded in this
/// process, without loading it.
pub(crate) fn is_loaded(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a valid C string; RTLD_NOLOAD never loads (so no initialisers
    // run); a non-null handle holds a reference we give back right away.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}

/// Open `name` (a soname searched the usual way, or a path) with every symbol resolved
/// now, so a broken mixture fails here rather than at a later call.
pub(crate) fn open(name: &str) -> Result<Loaded, LoadError> {
    // SAFETY: loading libucp runs UCX's library initialisers, which are designed to
    // run at dlopen time in any process. RTLD_NOW makes unresolved symbols an error
    // here instead of a crash later; RTLD_LOCAL keeps its symbols out of the global
    // scope, so we do not interpose on another UCX already in the process.
    let lib =
        unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL) }.map_err(LoadError::Open)?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol is a function of libucp with exactly the signature
            // declared in `Api` (see sys.rs); the pointer stays valid because the
            // library is never unloaded (`Loaded` keeps it and is leaked).
            let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| LoadError::Symbol($name, e))?;
            *s
        }};
    }
    let api = Api {
        get_version: sym!("ucp_get_version"),
        status_string: sym!("ucs_status_string"),
        config_read: sym!("ucp_config_read"),
        config_modify: sym!("ucp_config_modify"),
        config_release: sym!("ucp_config_release"),
        init_version: sym!("ucp_init_version"),
        cleanup: sym!("ucp_cleanup"),
        context_query: sym!("ucp_context_query"),
        worker_create: sym!("ucp_worker_create"),
        worker_destroy: sym!("ucp_worker_destroy"),
        worker_get_address: sym!("ucp_worker_get_address"),
        worker_release_address: sym!("ucp_worker_release_address"),
        worker_get_efd: sym!("ucp_worker_get_efd"),
        worker_arm: sym!("ucp_worker_arm"),
        worker_progress: sym!("ucp_worker_progress"),
        worker_set_am_recv_handler: sym!("ucp_worker_set_am_recv_handler"),
        ep_create: sym!("ucp_ep_create"),
        ep_close_nbx: sym!("ucp_ep_close_nbx"),
        ep_flush_nbx: sym!("ucp_ep_flush_nbx"),
        mem_map: sym!("ucp_mem_map"),
        mem_unmap: sym!("ucp_mem_unmap"),
        mem_query: sym!("ucp_mem_query"),
        rkey_pack: sym!("ucp_rkey_pack"),
        rkey_buffer_release: sym!("ucp_rkey_buffer_release"),
        ep_rkey_unpack: sym!("ucp_ep_rkey_unpack"),
        rkey_destroy: sym!("ucp_rkey_destroy"),
        put_nbx: sym!("ucp_put_nbx"),
        get_nbx: sym!("ucp_get_nbx"),
        am_send_nbx: sym!("ucp_am_send_nbx"),
        am_data_release: sym!("ucp_am_data_release"),
        request_check_status: sym!("ucp_request_check_status"),
        request_free: sym!("ucp_request_free"),
    };
    Ok(Loaded { api, _lib: lib })
}

impl Loaded {
    /// `ucp_get_version`.
    pub(crate) fn version(&self) -> (u32, u32, u32) {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers; the call only writes them.
        unsafe { (self.api.get_version)(&mut a, &mut b, &mut c) };
        (a, b, c)
    }

    /// The file each of libucp, libucs and libuct was really bound from: found with
    /// `dladdr` on a function of each, looked up through libucp's own dependency
    /// scope (so it is the copy libucp itself uses, whatever else the process holds).
    pub(crate) fn bound_paths(&self) -> [Option<PathBuf>; 3] {
        let ucp = path_of(self.api.init_version as *const c_void);
        let ucs = path_of(self.api.status_string as *const c_void);
        let uct = ["uct_md_close", "uct_iface_close", "uct_component_query"]
            .iter()
            .find_map(|s| {
                let name = CString::new(*s).ok()?;
                // SAFETY: `_lib` is a live handle; looking a name up has no side effect.
                let p: Result<libloading::os::unix::Symbol<*const c_void>, _> =
                    unsafe { self._lib.get(name.as_bytes_with_nul()) };
                p.ok().and_then(|p| path_of(*p))
            });
        [ucp, ucs, uct]
    }
}

/// The canonical path of the loaded object that contains `addr`.
fn path_of(addr: *const c_void) -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data; all-zero is a valid value for it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables and writes `info`.
    let ok = unsafe { libc::dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname points to the loader's NUL-terminated copy of the object's
    // name, valid while the object stays loaded (ours never unloads).
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let p = PathBuf::from(name.to_string_lossy().into_owned());
    Some(std::fs::canonicalize(&p).unwrap_or(p))
}

/// Render a UCX status.
pub(crate) fn status_text(api: &Api, status: sys::Status) -> String {
    // SAFETY: ucs_status_string accepts any status and returns a static string.
    let p = unsafe { (api.status_string)(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null result of ucs_status_string: a static NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
