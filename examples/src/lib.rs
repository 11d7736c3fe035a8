//! Runnable examples live in `examples/`.
#![forbid(unsafe_code)]
