//! The conformance suite on nixl-verbs on a real RDMA device.
//!
//! Needs the host's libibverbs (`libibverbs1` and `ibverbs-providers` on Debian, or
//! rdma-core; `NIXL_VERBS_LIB` names another) and a device with an active port: an
//! RDMA NIC, or soft-RoCE (`scripts/soft-roce.sh`). Where either is missing, every case
//! prints a SKIP line naming it. `NIXL_VERBS_DEVICE`, `NIXL_VERBS_PORT` and
//! `NIXL_VERBS_GID_INDEX` pick the device, port and GID.

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};
use nixl_verbs::{VerbsBackend, VerbsOptions};

fn options() -> VerbsOptions {
    let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
    VerbsOptions {
        device: var("NIXL_VERBS_DEVICE"),
        port: var("NIXL_VERBS_PORT").map(|p| p.parse().expect("NIXL_VERBS_PORT is a port number")),
        gid_index: var("NIXL_VERBS_GID_INDEX")
            .map(|g| g.parse().expect("NIXL_VERBS_GID_INDEX is a number")),
        ..VerbsOptions::default()
    }
}

const VERBS: BackendUnderTest = BackendUnderTest {
    name: "verbs",
    make: || Ok(Arc::new(VerbsBackend::with_options(options())?)),
    skip_case: |_| None,
};

conformance_tests!(VERBS);
