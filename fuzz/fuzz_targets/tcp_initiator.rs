//! nixl-tcp's initiator: handshake replies, response frames and the request table, as a hostile target
//! sends them: see `nixl_tcp::fuzzing::initiator_responses`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_tcp::fuzzing::initiator_responses(data));
