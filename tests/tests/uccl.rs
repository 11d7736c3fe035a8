//! The conformance suite on nixl-uccl, against the real UCCL engine.
//!
//! Needs `libuccl_p2p.so` (PyPI wheel `uccl`, under `uccl/lib/`; point
//! `NIXL_UCCL_LIB` at it or put its directory on `LD_LIBRARY_PATH`), the CUDA driver
//! and runtime, an NVIDIA GPU and an RDMA NIC. Where any is missing, every case prints
//! a SKIP line naming it.

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};

const UCCL: BackendUnderTest = BackendUnderTest {
    name: "uccl",
    make: || Ok(Arc::new(nixl_uccl::UcclBackend::new()?)),
    skip_case: |_| None,
};

conformance_tests!(UCCL);
