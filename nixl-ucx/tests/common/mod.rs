//! This crate's integration tests use the workspace's shared test kit.
#![allow(dead_code, unused_imports)]

pub(crate) use nixl_testkit::{figure, skip};
