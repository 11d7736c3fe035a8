//! The NIXL-format metadata and notification decoders: see `nixl_fuzz::nixl_metadata_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_fuzz::nixl_metadata_decode(data));
