//! nixl-ucx's active-message headers, registration blobs and NIXL notifications: see
//! `nixl_ucx::fuzzing::am_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_ucx::fuzzing::am_header(data));
