//! nixl-ucx's reordering of notifications by their sender's sequence numbers: see
//! `nixl_ucx::fuzzing::notification_order`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_ucx::fuzzing::notification_order(data));
