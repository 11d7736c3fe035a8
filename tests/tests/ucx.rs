//! The conformance suite on nixl-ucx.
//!
//! Needs libucp at run time (Debian: `apt-get install libucx0`; or `NIXL_UCX_LIB`
//! pointing at one); without it every case prints a SKIP line. Pick transports with
//! `UCX_TLS` (for example `shm,self` or `tcp,self`).

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};

const UCX: BackendUnderTest = BackendUnderTest {
    name: "ucx",
    make: || Ok(Arc::new(nixl_ucx::UcxBackend::new()?)),
};

conformance_tests!(UCX);
