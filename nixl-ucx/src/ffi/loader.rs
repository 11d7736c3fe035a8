//! Loading `libucp` through the core's native loader and finding out what was bound.

use std::path::PathBuf;

use nixl::native::{self, NativeLibrary};

use super::sys::{self, Api};

use nixl::native::LoadError;

/// A loaded `libucp` and its function table. Never unloaded: UCX does not support
/// being unloaded, and function pointers into it live as long as the process.
pub(crate) struct Loaded {
    pub(crate) api: Api,
    /// libuct's component queries; `None` if libuct does not export them (every UCX
    /// since 1.7 does).
    uct: Option<sys::UctApi>,
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
    // SAFETY: functions of the libuct libucp depends on, with exactly the signatures
    // declared in `UctApi`; the library is never unloaded.
    let uct = unsafe {
        match (
            lib.symbol("uct_query_components"),
            lib.symbol("uct_release_component_list"),
            lib.symbol("uct_component_query"),
        ) {
            (Ok(query_components), Ok(release_component_list), Ok(component_query)) => {
                Some(sys::UctApi {
                    query_components,
                    release_component_list,
                    component_query,
                })
            }
            _ => None,
        }
    };
    Ok(Loaded { api, uct, lib })
}

impl Loaded {
    /// `ucp_get_version`.
    pub(crate) fn version(&self) -> (u32, u32, u32) {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers; the call only writes them.
        unsafe { (self.api.get_version)(&mut a, &mut b, &mut c) };
        (a, b, c)
    }

    /// Whether the bound UCX has the transport component `name` (`"cuda_ipc"`) with at
    /// least one memory domain here: its module loaded (its own libraries found) and
    /// found a device. `None` when libuct cannot be asked.
    ///
    /// Settings of a transport's interface are used only where such a domain exists;
    /// UCX 1.13 takes any key in `ucp_config_modify` and warns at every worker creation
    /// about one nothing used ("invalid configuration"), so optional settings are given
    /// only to a UCX that has their transport.
    pub(crate) fn has_transport(&self, name: &str) -> Option<bool> {
        let uct = self.uct?;
        let mut list: *mut sys::UctComponent = std::ptr::null_mut();
        let mut n: std::ffi::c_uint = 0;
        // SAFETY: valid out-pointers; on success UCX hands us a list of `n` components
        // that we release below, once.
        let st = unsafe { (uct.query_components)(&mut list, &mut n) };
        if st != sys::UCS_OK || list.is_null() {
            return None;
        }
        let mut found = false;
        for i in 0..n as usize {
            let mut attr = sys::UctComponentAttr {
                field_mask: sys::UCT_COMPONENT_ATTR_FIELD_NAME
                    | sys::UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT,
                ..Default::default()
            };
            // SAFETY: `i < n` indexes the list UCX returned; `attr` is a valid out
            // struct of the declared layout, and with this mask UCX writes only its
            // name (NUL-terminated within the array) and resource count.
            let st = unsafe { (uct.component_query)(*list.add(i), &mut attr) };
            if st != sys::UCS_OK {
                continue;
            }
            // Up to its NUL, never past the array.
            let len = attr.name.iter().position(|&c| c == 0).unwrap_or(16);
            let got = attr.name[..len].iter().map(|&c| c as u8);
            if got.eq(name.bytes()) && attr.md_resource_count > 0 {
                found = true;
            }
        }
        // SAFETY: the list query_components returned, released once.
        unsafe { (uct.release_component_list)(list) };
        Some(found)
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
