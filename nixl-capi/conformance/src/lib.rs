//! Tests only (tests/dynamo.rs).
