//! One TCP socket of this network namespace looked up by its addresses, through the
//! kernel's socket-diagnostics netlink interface (`NETLINK_SOCK_DIAG`, what `ss`
//! uses): a request naming the socket's four-tuple, one answer with its state, owner
//! and inode. The kernel finds it in its connection hash, so the cost does not grow
//! with the sockets on the host, where reading `/proc/net/tcp` (the fallback, for
//! kernels or sandboxes without the interface) costs tens of milliseconds on a busy
//! one. Plain bytes over a netlink socket: no `unsafe`.

use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// What the kernel says of one TCP socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SocketFacts {
    /// The TCP state (`TCP_ESTABLISHED` is 1).
    pub(crate) state: u8,
    /// The user owning it.
    pub(crate) uid: u32,
    /// Its inode (0: no process holds it any more).
    pub(crate) inode: u64,
}

/// `TCP_ESTABLISHED`.
pub(crate) const ESTABLISHED: u8 = 1;

const NLMSG_HDR: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `struct inet_diag_req_v2`: family, protocol, extensions, pad, states, then the
/// socket id (ports, addresses, interface, cookie).
const REQ_LEN: usize = 4 + 4 + SOCKID_LEN;
const SOCKID_LEN: usize = 2 + 2 + 16 + 16 + 4 + 8;
/// Where `struct inet_diag_msg`'s uid and inode are (after the family, state,
/// timer, retransmits, socket id, expiry and both queues).
const MSG_UID: usize = 4 + SOCKID_LEN + 12;
const MSG_INODE: usize = MSG_UID + 4;

/// The request for the TCP socket whose own address is `local` and whose peer is
/// `remote`. An IPv4 address in IPv4-mapped IPv6 form is asked for as IPv4 (the
/// kernel finds a dual-stack socket's IPv4 connections in its IPv4 table).
fn request(local: SocketAddr, remote: SocketAddr, seq: u32) -> Vec<u8> {
    let canon = |a: SocketAddr| (a.ip().to_canonical(), a.port());
    let ((lip, lport), (rip, rport)) = (canon(local), canon(remote));
    let v6 = lip.is_ipv6() || rip.is_ipv6();
    let octets = |ip: IpAddr| -> [u8; 16] {
        let mut b = [0u8; 16];
        match ip {
            IpAddr::V4(v4) if !v6 => b[..4].copy_from_slice(&v4.octets()),
            IpAddr::V4(v4) => b = v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => b = v6.octets(),
        }
        b
    };
    let mut m = Vec::with_capacity(NLMSG_HDR + REQ_LEN);
    m.extend_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // to the kernel
    m.push(if v6 { libc::AF_INET6 } else { libc::AF_INET } as u8);
    m.push(libc::IPPROTO_TCP as u8);
    m.extend_from_slice(&[0, 0]); // no extensions, pad
    m.extend_from_slice(&u32::MAX.to_ne_bytes()); // any state
    m.extend_from_slice(&lport.to_be_bytes());
    m.extend_from_slice(&rport.to_be_bytes());
    m.extend_from_slice(&octets(lip));
    m.extend_from_slice(&octets(rip));
    m.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    m.extend_from_slice(&[0xff; 8]); // no cookie
    m
}

/// The answer to request `seq`: `Ok(None)` when the kernel has no such socket.
fn answer(b: &[u8], seq: u32) -> std::io::Result<Option<SocketFacts>> {
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_owned());
    let word = |at: usize| -> Option<u32> {
        b.get(at..at + 4)
            .map(|w| u32::from_ne_bytes(w.try_into().expect("4 bytes")))
    };
    let (Some(len), Some(kind), Some(got)) = (
        word(0),
        b.get(4..6).map(|w| u16::from_ne_bytes([w[0], w[1]])),
        word(8),
    ) else {
        return Err(bad("short netlink answer"));
    };
    if got != seq || (len as usize) > b.len() {
        return Err(bad("netlink answer to another request"));
    }
    match kind {
        NLMSG_ERROR => match word(NLMSG_HDR).map(|e| e as i32) {
            Some(e) if e == -libc::ENOENT => Ok(None),
            Some(0) => Ok(None),
            Some(e) => Err(std::io::Error::from_raw_os_error(-e)),
            None => Err(bad("short netlink error")),
        },
        SOCK_DIAG_BY_FAMILY => {
            let msg = NLMSG_HDR;
            match (b.get(msg + 1), word(msg + MSG_UID), word(msg + MSG_INODE)) {
                (Some(&state), Some(uid), Some(inode)) => Ok(Some(SocketFacts {
                    state,
                    uid,
                    inode: u64::from(inode),
                })),
                _ => Err(bad("short socket diagnostics answer")),
            }
        }
        _ => Err(bad("unexpected netlink message")),
    }
}

/// The TCP socket of this network namespace whose own address is `local` and whose
/// peer is `remote`: `Ok(None)` when there is none; an error when the kernel cannot
/// be asked (no `NETLINK_SOCK_DIAG` here).
pub(crate) fn lookup(
    local: SocketAddr,
    remote: SocketAddr,
) -> std::io::Result<Option<SocketFacts>> {
    let s = socket2::Socket::new(
        socket2::Domain::from(libc::AF_NETLINK),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::from(libc::NETLINK_SOCK_DIAG)),
    )?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    let seq = 1;
    s.send(&request(local, remote, seq))?;
    let mut b = [0u8; 512];
    let n = (&s).read(&mut b)?;
    answer(&b[..n], seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_name_the_socket_as_the_kernel_expects() {
        let r = request(
            "10.0.0.1:80".parse().unwrap(),
            "10.0.0.2:4000".parse().unwrap(),
            7,
        );
        assert_eq!(r.len(), 72);
        assert_eq!(&r[..4], &72u32.to_ne_bytes());
        assert_eq!(r[16], libc::AF_INET as u8);
        assert_eq!(&r[24..26], &80u16.to_be_bytes());
        assert_eq!(&r[26..28], &4000u16.to_be_bytes());
        assert_eq!(&r[28..32], &[10, 0, 0, 1]);
        assert_eq!(&r[44..48], &[10, 0, 0, 2]);
        // A dual-stack listener's IPv4 connection is asked for as IPv4.
        let mapped = request(
            "[::ffff:10.0.0.1]:80".parse().unwrap(),
            "[::ffff:10.0.0.2]:4000".parse().unwrap(),
            7,
        );
        assert_eq!(mapped, r);
        let v6 = request(
            "[::1]:80".parse().unwrap(),
            "[::1]:4000".parse().unwrap(),
            7,
        );
        assert_eq!(v6[16], libc::AF_INET6 as u8);
        assert_eq!(v6[28 + 15], 1);
    }

    #[test]
    fn answers_that_do_not_fit_are_errors_not_panics() {
        for len in 0..100 {
            let b = vec![0xA5u8; len];
            let _ = answer(&b, 1);
        }
        let mut err = vec![0u8; 36];
        err[..4].copy_from_slice(&36u32.to_ne_bytes());
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err[8..12].copy_from_slice(&1u32.to_ne_bytes());
        err[16..20].copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert_eq!(answer(&err, 1).unwrap(), None);
        assert!(answer(&err, 2).is_err(), "another request's answer");
    }

    /// On real sockets: both ends of a loopback connection are found, with this
    /// process's user and the inode its descriptors name; a pair no socket has is
    /// not; and a closed end shows a state other than established.
    #[test]
    fn finds_both_ends_of_a_loopback_connection() {
        use std::os::unix::fs::MetadataExt;
        let me = std::fs::metadata("/proc/self").unwrap().uid();
        for at in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = std::net::TcpListener::bind(at) else {
                continue; // no IPv6 loopback here
            };
            let ours = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (theirs, _) = listener.accept().unwrap();
            let (l, r) = (ours.local_addr().unwrap(), ours.peer_addr().unwrap());
            let Ok(Some(a)) = lookup(l, r) else {
                // No socket diagnostics in this sandbox: the /proc fallback serves.
                return;
            };
            assert_eq!((a.state, a.uid), (ESTABLISHED, me));
            let b = lookup(r, l).unwrap().expect("the other end");
            assert_eq!((b.state, b.uid), (ESTABLISHED, me));
            assert_ne!(a.inode, b.inode);
            let fd_inode = |s: &std::net::TcpStream| {
                use std::os::fd::AsRawFd;
                let link = std::fs::read_link(format!("/proc/self/fd/{}", s.as_raw_fd())).unwrap();
                link.to_str().unwrap().to_owned()
            };
            assert_eq!(fd_inode(&ours), format!("socket:[{}]", a.inode));
            assert_eq!(fd_inode(&theirs), format!("socket:[{}]", b.inode));
            let nowhere: SocketAddr = "127.0.0.1:1".parse().unwrap();
            assert_eq!(lookup(l, nowhere).unwrap(), None);
            drop(theirs);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while lookup(l, r)
                .unwrap()
                .is_some_and(|s| s.state == ESTABLISHED)
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the close never showed"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
