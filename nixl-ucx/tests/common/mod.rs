//! Helpers shared by this crate's integration tests, on top of the workspace's test kit.
#![allow(dead_code, unused_imports)]

use std::sync::Arc;
use std::time::Duration;

use nixl::{Agent, AgentOptions, ErrorKind};
use nixl_ucx::{UcxBackend, UcxOptions};

pub(crate) use nixl_testkit::{figure, skip};

/// An agent with one UCX backend made from `o` (5 s drain and shutdown bounds), and
/// that backend; `None` after a SKIP line for `test` when libucp is unavailable.
pub(crate) async fn agent(test: &str, name: &str, o: UcxOptions) -> Option<(Agent, UcxBackend)> {
    let b = match UcxBackend::with_options(o) {
        Ok(b) => b,
        Err(e) if e.kind() == ErrorKind::UnavailableLibrary => {
            skip(test, e);
            return None;
        }
        Err(e) => panic!("ucx backend: {e}"),
    };
    let a = Agent::builder(name)
        .backend_arc(Arc::new(b.clone()))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap();
    Some((a, b))
}
