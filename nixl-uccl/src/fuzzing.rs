//! Entry points for fuzzing (`fuzz/`) and the stable fuzz smoke test: each takes
//! arbitrary bytes as what a hostile peer sends, runs the backend's decoding on
//! them, and panics when an invariant breaks. Not a public API: hidden, and free to
//! change.

use crate::wire::{self, ConnInfo, Frame};

/// The UCCL wire format on `data`: as a peer's connection info (from metadata), as
/// one control frame's body, and as a control connection's bytes, read as the
/// listener reads them (the first frame, before the peer said who it is, under a
/// 1 KiB limit; then up to `wire::MAX_FRAME`).
///
/// # Panics
/// When whatever decodes does not re-encode to the bytes it came from, or a frame
/// over its limit is read.
pub fn wire_format(data: &[u8]) {
    if let Some(info) = ConnInfo::decode(data) {
        assert_eq!(
            &info.encode()[..],
            data,
            "connection info re-encodes as it came"
        );
        if let Some((ip, _, _)) = info.engine_endpoint() {
            assert!(!ip.is_empty());
        }
    }
    if let Some(f) = Frame::decode(data) {
        assert_eq!(&f.encode()[4..], data, "a frame re-encodes as it came");
    }
    let mut r = data;
    let mut max = 1024;
    loop {
        let before = r.len();
        match nixl::fuzzing::ready(wire::read_frame_max(&mut r, max)) {
            Ok(Some(f)) => {
                let e = f.encode();
                assert!(e.len() - 4 <= max, "a frame of {} bytes read", e.len() - 4);
                assert_eq!(before - r.len(), e.len(), "bytes lost between frames");
                assert_eq!(&e[..], &data[data.len() - before..][..e.len()]);
                max = wire::MAX_FRAME;
            }
            Ok(None) => {
                assert!(r.is_empty());
                return;
            }
            Err(_) => return,
        }
    }
}

/// Seeds for `wire_format`: connection info, each control frame, and a control
/// connection's opening.
pub fn wire_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let info = ConnInfo {
        control: "127.0.0.1:4000".into(),
        engine: "10.0.0.2:5000?0000:4a:00.0".into(),
    };
    let frames = [
        ("hello", Frame::Hello("prefill-0".into())),
        ("hello-ack", Frame::HelloAck("decode-0".into())),
        ("ready", Frame::Ready),
        ("notif", Frame::Notif(bytes::Bytes::from_static(b"done"))),
        ("ping", Frame::Ping),
        ("pong", Frame::Pong),
        (
            "verify",
            Frame::Verify {
                id: 3,
                ranges: vec![(0x7f00_0000_0000, 4096, 0x1234_5678_9abc_def0)],
            },
        ),
        (
            "verified",
            Frame::Verified {
                id: 3,
                digest: Some(0xfeed),
            },
        ),
    ];
    let mut v = vec![("conn-info", info.encode().to_vec())];
    for (name, f) in &frames {
        v.push((*name, f.encode()[4..].to_vec()));
    }
    let stream: Vec<u8> = frames
        .iter()
        .flat_map(|(_, f)| f.encode().to_vec())
        .collect();
    v.push(("stream", stream));
    v
}
