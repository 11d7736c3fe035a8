//! nixl-verbs' wire decoders: see `nixl_fuzz::verbs_wire`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_fuzz::verbs_wire(data));
