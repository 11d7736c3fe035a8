//! Helpers shared by this crate's integration tests.
#![allow(dead_code)]

use std::time::Duration;

use nixl::{Agent, AgentOptions};
use nixl_verbs::{VerbsBackend, VerbsOptions};

/// An agent `name` on the verbs test double with default options and 5 s drain and
/// shutdown bounds.
pub(crate) async fn agent(name: &str) -> Agent {
    agent_with(name, VerbsOptions::default()).await
}

/// The same with options `o`.
pub(crate) async fn agent_with(name: &str, o: VerbsOptions) -> Agent {
    Agent::builder(name)
        .backend(VerbsBackend::with_test_double(o).unwrap())
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap()
}
