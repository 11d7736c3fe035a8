//! Arbitrary bytes to a live side-channel listener: see `nixl_fuzz::side_channel_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nixl_fuzz::side_channel_frames(data));
