//! The metadata decoder: see `nixl_fuzz::metadata_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_fuzz::metadata_decode(data));
