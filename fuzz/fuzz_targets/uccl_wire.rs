//! nixl-uccl's connection info and control frames: see `nixl_uccl::fuzzing::wire_format`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_uccl::fuzzing::wire_format(data));
