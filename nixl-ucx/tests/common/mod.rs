//! Helpers shared by this crate's integration tests, on top of the workspace's test kit.
#![allow(dead_code, unused_imports)]

use std::sync::Arc;
use std::time::Duration;

use nixl::{Agent, AgentOptions, ErrorKind};
use nixl_ucx::{UcxBackend, UcxOptions};

pub(crate) use nixl_testkit::{figure, skip};

/// An agent with one UCX backend made from `o` (see [`builder`]), and that
/// backend; `None` after a SKIP line for `test` when libucp is unavailable.
pub(crate) async fn agent(test: &str, name: &str, o: UcxOptions) -> Option<(Agent, UcxBackend)> {
    let b = backend(test, o)?;
    let a = builder(name, &b).build().await.unwrap();
    Some((a, b))
}

/// A UCX backend made from `o`; `None` after a SKIP line for `test` when libucp is
/// unavailable.
pub(crate) fn backend(test: &str, o: UcxOptions) -> Option<UcxBackend> {
    match UcxBackend::with_options(o) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == ErrorKind::UnavailableLibrary => {
            skip(test, e);
            None
        }
        Err(e) => panic!("ucx backend: {e}"),
    }
}

/// An agent `name` with `b` as its first backend and 5 s drain and shutdown
/// bounds, to build (after adding more backends, if the test wants).
pub(crate) fn builder(name: &str, b: &UcxBackend) -> nixl::AgentBuilder {
    Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
}
