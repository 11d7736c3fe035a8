//! The conformance suite on nixl-tcp.

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};

const TCP: BackendUnderTest = BackendUnderTest {
    name: "tcp",
    make: || Ok(Arc::new(nixl_tcp::TcpBackend::new())),
    skip_case: |_| None,
};

conformance_tests!(TCP);
