//! nixl-tcp initiators against targets that stall them: a raw target (this file
//! speaks the wire itself) takes the handshake and the start of a request, then
//! says PAUSE and never reads again, keeps saying PAUSE and RESUME without reading,
//! or stops reading without a word. Each stalled transfer fails within its bound
//! (`TcpOptions::pause_timeout`, the listener's `dead_peer_timeout`) with an error
//! naming the stall, instead of waiting forever; the initiator then shuts down clean.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nixl::{Agent, AgentOptions, ErrorKind};
use nixl_tcp::{SameHost, TcpBackend, TcpOptions};
use nixl_testkit::double::one;
use nixl_testkit::{bounded, figure, remote};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The initiator's bounds in these tests.
const PAUSE: Duration = Duration::from_secs(1);
const DEAD: Duration = Duration::from_secs(1);
/// A WRITE far larger than both sockets' buffers: its payload meets a zero window.
const BIG: usize = 64 << 20;

/// How the raw target stalls once it has read a request's header.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// PAUSE, then nothing: never reads, never answers.
    PauseForever,
    /// PAUSE and RESUME every 100 ms, never reading.
    PauseResumeCycle,
    /// Never reads again and says nothing (a zero window only).
    Silent,
}

/// A response header of `kind` with every other field zero (PAUSE: 0x82, RESUME:
/// 0x83).
fn frame(kind: u8) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[0] = kind;
    h
}

/// Serve one connection as a stalling target: the handshake (no secret, no
/// same-host offer), the first request's 24-byte header, then `stall`. Holds the
/// socket open until the test ends.
async fn stalling_target(listener: TcpListener, stall: Stall) {
    let (mut s, _) = listener.accept().await.unwrap();
    let mut hello = [0u8; 8];
    s.read_exact(&mut hello).await.unwrap();
    let name_len = u16::from_le_bytes([hello[6], hello[7]]) as usize;
    // The name, then the listener id it wants.
    let mut name = vec![0u8; name_len + 8];
    s.read_exact(&mut name).await.unwrap();
    let mut reply = b"NXTC".to_vec();
    reply.extend_from_slice(&nixl_tcp::WIRE_VERSION.to_le_bytes());
    reply.push(0); // OK
    s.write_all(&reply).await.unwrap();
    let mut want = [0u8; 1];
    s.read_exact(&mut want).await.unwrap();
    if want[0] == 1 {
        s.write_all(&[0]).await.unwrap(); // no same-host offer
    }
    let mut head = [0u8; 24];
    s.read_exact(&mut head).await.unwrap();
    match stall {
        Stall::PauseForever => {
            let _ = s.write_all(&frame(0x82)).await;
            std::future::pending::<()>().await;
        }
        Stall::PauseResumeCycle => loop {
            for kind in [0x82, 0x83] {
                if s.write_all(&frame(kind)).await.is_err() {
                    return std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        },
        Stall::Silent => std::future::pending::<()>().await,
    }
}

/// An agent named `target` whose metadata sends its peers to `addr` (the raw
/// target), with one registration of `len` bytes.
async fn target_metadata(addr: SocketAddr, len: usize) -> (Agent, nixl::Registration) {
    let a = Agent::builder("target")
        .backend(TcpBackend::with_options(TcpOptions {
            listener: nixl::control::ListenerOptions {
                advertise: Some(addr),
                ..nixl::control::ListenerOptions::default()
            },
            same_host: SameHost::Off,
            ..TcpOptions::default()
        }))
        .build()
        .await
        .unwrap();
    let r = a.register(vec![0u8; len]).unwrap();
    (a, r)
}

async fn initiator() -> Agent {
    Agent::builder("initiator")
        .backend(TcpBackend::with_options(TcpOptions {
            listener: nixl::control::ListenerOptions {
                dead_peer_timeout: DEAD,
                ..nixl::control::ListenerOptions::default()
            },
            same_host: SameHost::Off,
            connections: 1,
            pause_timeout: PAUSE,
            ..TcpOptions::default()
        }))
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(2),
            shutdown_timeout: Duration::from_secs(5),
        })
        .build()
        .await
        .unwrap()
}

/// Run `stall` against a transfer: a notification (`big` false) or a WRITE of
/// [`BIG`] bytes with a notification (`big` true). Returns the transfer's error
/// and how long it took to come.
async fn stalled(stall: Stall, big: bool) -> (nixl::Error, Duration) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let raw = tokio::spawn(stalling_target(listener, stall));
    let (t, dst) = target_metadata(addr, BIG).await;
    let a = initiator().await;
    a.load_metadata(&t.metadata().unwrap()).unwrap();
    let started = Instant::now();
    let r = if big {
        let src = a.register(vec![7u8; BIG]).unwrap();
        let rd = remote(&a, "target", dst.id());
        let (local, far) = (one(src.whole()), one(rd.desc(0, BIG as u64)));
        let w = a.write(&local, "target", &far, Some(Bytes::from_static(b"done")));
        bounded(&format!("a WRITE stalled by {stall:?}"), w).await
    } else {
        let n = a.notify("target", "hello").unwrap();
        bounded(&format!("a notification stalled by {stall:?}"), n).await
    };
    let took = started.elapsed();
    let e = r.expect_err("a stalled transfer cannot succeed");
    let report = bounded("initiator shutdown", a.shutdown()).await;
    assert!(report.is_clean(), "{report:?}");
    raw.abort();
    let _ = t.shutdown().await;
    (e, took)
}

/// Hole 8 of issue 39: one PAUSE, then never reading, stalled the initiator's
/// requests forever (its user timeout lifted for the pause, nothing else timing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_pauses_and_never_reads_fails_the_transfer_at_the_bound() {
    for big in [false, true] {
        let (e, took) = stalled(Stall::PauseForever, big).await;
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(
            e.context().contains("stalled") && e.context().contains("pause_timeout"),
            "{e}"
        );
        assert!(
            took >= PAUSE,
            "cut after {took:?}, before the bound of {PAUSE:?}"
        );
        figure(
            &format!(
                "hostile: nixl-tcp target says PAUSE and never reads ({})",
                if big { "64 MiB WRITE" } else { "notification" }
            ),
            format!(
                "transfer failed TimedOut after {} ms (pause_timeout {} ms)",
                took.as_millis(),
                PAUSE.as_millis()
            ),
        );
    }
}

/// PAUSE and RESUME frames without reading do not stretch the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_cycling_pause_and_resume_without_reading_fails_the_transfer_at_the_bound() {
    let (e, took) = stalled(Stall::PauseResumeCycle, true).await;
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(e.context().contains("stalled"), "{e}");
    figure(
        "hostile: nixl-tcp target cycles PAUSE and RESUME, never reading (64 MiB WRITE)",
        format!(
            "transfer failed TimedOut after {} ms (pause_timeout {} ms)",
            took.as_millis(),
            PAUSE.as_millis()
        ),
    );
}

/// A target that stops reading without a word: the zero window is counted against
/// `dead_peer_timeout` (`TCP_USER_TIMEOUT`) and the connection is cut. (The error
/// names the timeout when the half of the connection that reads the kernel's
/// `ETIMEDOUT` reports first; when the other half does, it sees only the closed
/// socket, "Broken pipe" or an end of file: which one is the kernel's race.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_stops_reading_without_pausing_is_cut() {
    let (e, took) = stalled(Stall::Silent, true).await;
    assert_eq!(e.kind(), ErrorKind::RemoteDisconnected, "{e}");
    figure(
        "hostile: nixl-tcp target stops reading without PAUSE (64 MiB WRITE)",
        format!(
            "transfer failed RemoteDisconnected after {} ms (dead_peer_timeout {} ms, TCP_USER_TIMEOUT)",
            took.as_millis(),
            DEAD.as_millis()
        ),
    );
}
