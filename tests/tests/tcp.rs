//! The conformance suite on nixl-tcp. `NIXL_TCP_SAME_HOST=auto|off|require` picks the
//! same-host mode (default auto; `scripts/test` runs all three): `require` makes every
//! transfer between the suite's agents take the same-host path or fail, `off` keeps
//! them on TCP.

use std::sync::Arc;

use nixl_conformance::support::tcp_options_from_env;
use nixl_conformance::{conformance_tests, BackendUnderTest};

const TCP: BackendUnderTest = BackendUnderTest {
    name: "tcp",
    make: || {
        Ok(Arc::new(nixl_tcp::TcpBackend::with_options(
            tcp_options_from_env(),
        )))
    },
    skip_case: |_| None,
};

conformance_tests!(TCP);
