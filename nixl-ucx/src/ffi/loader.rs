//! Loading `libucp` through the core's native loader and finding out what was bound.

use std::path::PathBuf;

use nixl::native::{self, NativeLibrary};

use super::sys::{self, Api};

use nixl::native::LoadError;

/// A loaded `libucp` and its function table. Never unloaded: UCX does not support
/// being unloaded, and function pointers into it live as long as the process.
pub(crate) struct Loaded {
    pub(crate) api: Api,
    lib: NativeLibrary,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Loaded(libucp)")
    }
}

/// Open `name` (a soname searched the usual way, or a path) and resolve every function
/// we call.
pub(crate) fn open(name: &str) -> Result<Loaded, LoadError> {
    let lib = NativeLibrary::open(name)?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is a function of libucp with exactly the signature
            // declared in `Api` (see sys.rs); the library is never unloaded.
            unsafe { lib.symbol($name)? }
        };
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
        request_check_status: sym!("ucp_request_check_status"),
        request_free: sym!("ucp_request_free"),
    };
    Ok(Loaded { api, lib })
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
        let ucp = native::path_of(self.api.init_version as *const std::ffi::c_void);
        let ucs = native::path_of(self.api.status_string as *const std::ffi::c_void);
        let uct =
            self.lib
                .path_of_symbol(&["uct_md_close", "uct_iface_close", "uct_component_query"]);
        [ucp, ucs, uct]
    }
}

/// Render a UCX status.
pub(crate) fn status_text(api: &Api, status: sys::Status) -> String {
    // SAFETY: ucs_status_string accepts any status and returns a static string.
    let p = unsafe { (api.status_string)(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null result of ucs_status_string: a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}
