//! The metadata decoder on arbitrary bytes: never panics, never over-allocates (the
//! fuzzer's RSS limit catches that), and whatever decodes re-encodes identically.
//!
//! Half the inputs are used as they are; the other half are taken as a body and
//! sealed with a valid header and checksum first, so the fuzzer explores the body
//! parser instead of stopping at the checksum.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl::metadata::{AgentMetadata, MAGIC, VERSION};

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

fn seal(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(12 + body.len() + 4);
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&u16::from(flags & 1).to_le_bytes());
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(body);
    let c = crc32(&v);
    v.extend_from_slice(&c.to_le_bytes());
    v
}

fuzz_target!(|data: &[u8]| {
    let input = match data.split_first() {
        Some((&mode, body)) if mode & 0x80 != 0 => seal(mode, body),
        _ => data.to_vec(),
    };
    if let Ok(md) = AgentMetadata::decode(&input) {
        let again = md.encode().expect("decoded metadata re-encodes");
        assert_eq!(again, input, "decode/encode is the identity on valid input");
    }
});
