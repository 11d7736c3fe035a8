//! Helpers shared by this crate's integration tests.
#![allow(dead_code)]

use std::time::Duration;

use nixl::{Agent, AgentOptions};
use nixl_verbs::{VerbsBackend, VerbsOptions};

/// An agent `name` on the verbs test double with default options and 5 s drain and
/// shutdown bounds.
pub(crate) async fn agent(name: &str) -> Agent {
    Agent::builder(name)
        .backend(VerbsBackend::with_test_double(VerbsOptions::default()).unwrap())
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap()
}
