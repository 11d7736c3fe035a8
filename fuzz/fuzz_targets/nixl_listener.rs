//! NIXL's listener protocol: frames and their commands, as any client sends them: see
//! `nixl::fuzzing::nixl_listener_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl::fuzzing::nixl_listener_frames(data));
