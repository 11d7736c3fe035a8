//! Socket settings every control and data connection takes.

use std::time::Duration;

use tokio::net::TcpStream;

/// Notice a silent peer within `dead`: TCP keepalive (probing after `dead / 2` idle,
/// every second, three times) for an idle connection, and `TCP_USER_TIMEOUT` for
/// data left unacknowledged (Linux applies it to a zero window too, so a peer that
/// stops reading is cut as well). No Nagle: requests and answers are small frames
/// written whole, and Nagle would hold a frame's tail for the previous segment's
/// ACK (delayed by the peer up to 40 ms).
///
/// Socket buffer sizes are left to the kernel on purpose: setting `SO_SNDBUF` or
/// `SO_RCVBUF` turns off Linux's receive-window autotuning, which already grows the
/// buffers to `net.ipv4.tcp_rmem`/`tcp_wmem`'s maximum on a fast link.
pub fn tune(stream: &TcpStream, dead: Duration) {
    let _ = stream.set_nodelay(true);
    let sock = socket2::SockRef::from(stream);
    let idle = (dead / 2).max(Duration::from_secs(1));
    let ka = socket2::TcpKeepalive::new()
        .with_time(idle)
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    let _ = sock.set_tcp_keepalive(&ka);
    set_user_timeout(stream, Some(dead));
}

/// Set (or, with `None`, clear) `TCP_USER_TIMEOUT` alone: a peer that announced it
/// stops reading for a while (back-pressure) must not be cut for its zero window,
/// while keepalive still notices a dead host once the window opens.
pub fn set_user_timeout(stream: &TcpStream, timeout: Option<Duration>) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let _ = socket2::SockRef::from(stream).set_tcp_user_timeout(timeout);
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = (stream, timeout);
}
