//! Arbitrary requests to a live nixl-tcp target (all refused: random key): see `nixl_fuzz::tcp_wire`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_fuzz::tcp_wire(data));
