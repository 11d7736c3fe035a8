//! nixl-bench (work in progress).
fn main() {}
