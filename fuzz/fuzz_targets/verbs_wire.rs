//! nixl-verbs' decoders on arbitrary bytes: the connection info peers publish in
//! metadata, the handshake hello a control listener reads from any client, its reply,
//! and region blobs. None panics, and whatever decodes re-encodes identically (a
//! refusal's reason is the one lossy field, so only accepted replies are compared).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_verbs::wire::{decode_blob, encode_blob, ConnInfo, Hello, Reply};

fuzz_target!(|data: &[u8]| {
    if let Ok(i) = ConnInfo::decode(data) {
        assert_eq!(i.encode(), data);
    }
    if let Ok(h) = Hello::decode(data) {
        assert_eq!(h.encode(), data);
    }
    if let Ok(r @ Reply::Accepted { .. }) = Reply::decode(data) {
        assert_eq!(r.encode(), data);
    }
    if let Ok(k) = decode_blob(data) {
        assert_eq!(&encode_blob(k)[..], data);
    }
});
