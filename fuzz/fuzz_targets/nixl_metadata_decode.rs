//! The NIXL-format metadata and notification decoders on arbitrary bytes: never
//! panic, never over-allocate (the fuzzer's RSS limit catches that), and whatever
//! decodes re-encodes identically.
//!
//! Inputs are prefixed with `nixlSerDes|` unless their first byte's top bit is set,
//! so the fuzzer explores the fields instead of stopping at the prefix.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl::interop::{decode_notification, encode_notification, NixlMetadata, PREFIX};

fuzz_target!(|data: &[u8]| {
    let input = match data.split_first() {
        Some((&mode, rest)) if mode & 0x80 == 0 => [PREFIX, rest].concat(),
        _ => data.to_vec(),
    };
    if let Ok(md) = NixlMetadata::decode(&input) {
        let again = md.encode().expect("decoded metadata re-encodes");
        assert_eq!(again, input, "decode/encode is the identity on valid input");
    }
    if let Ok((name, msg)) = decode_notification(&input, 4096) {
        assert_eq!(encode_notification(&name, msg), input);
    }
});
