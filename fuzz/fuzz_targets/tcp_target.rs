//! nixl-tcp's target state machine with a planted key, so requests pass the key check and the
//! accepted path (data moves, pieces, notifications, ACKs) is checked against a model: see
//! `nixl_tcp::fuzzing::PlantedTarget::requests`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_fuzz::tcp_target(data));
