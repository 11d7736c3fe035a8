//! Entry points for fuzzing (`fuzz/`) and the stable fuzz smoke test: each takes
//! arbitrary bytes as what a hostile peer sends, runs the parser on them, and panics
//! when an invariant breaks. Not a public API: hidden, and free to change.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

/// NIXL's listener protocol (`crate::NixlListenerOptions`) on `data` as one
/// connection's bytes: frames (length-checked before allocation) and their
/// commands.
///
/// # Panics
/// When an invariant breaks (see the listener's frame reader).
pub fn nixl_listener_frames(data: &[u8]) {
    crate::exchange::fuzz_nixl_listener(data);
}

/// Run a future that never waits (a reader over bytes in memory) to its end.
///
/// # Panics
/// When it does wait.
pub fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a read from memory waited"),
    }
}

/// Seeds for `nixl_listener_frames`: each command as NIXL frames it, and several
/// in one frame as NIXL's reader accepts them.
pub fn nixl_listener_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let frame = |body: &[u8]| [&(body.len() as u64).to_le_bytes()[..], body].concat();
    let md = crate::interop::NixlMetadata {
        name: "nixl-peer".into(),
        conns: vec![crate::interop::NixlConn {
            backend: "UCX".into(),
            info: vec![1, 2, 3, 4],
        }],
        sections: Vec::new(),
    }
    .encode()
    .expect("valid NIXL metadata");
    let load = frame(&[&b"NIXLCOMM:LOAD"[..], &md].concat());
    vec![
        ("send", frame(b"NIXLCOMM:SEND")),
        ("load", load.clone()),
        ("invalidate", frame(b"NIXLCOMM:INVLprefill-0")),
        (
            "several",
            [
                frame(b"NIXLCOMM:SENDNIXLCOMM:INVLaNIXLCOMM:LOADx"),
                load,
                frame(b"NIXLCOMM:SEND"),
            ]
            .concat(),
        ),
    ]
}
