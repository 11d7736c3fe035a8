//! nixl-tcp's wire format. Little-endian, fixed-size headers, hard limits.
//!
//! Connection: with a shared secret, the initiator first runs the core's
//! authentication (`nixl::control`, protocol name `"nixl-tcp"`: both sides prove the
//! secret and their agent names; the secret never crosses the wire). Then it sends a hello (`MAGIC`,
//! version u16, name length u16, its agent name: the name it proved, where it
//! authenticated; then the listener id u64 it wants, from the target's connection
//! info, 0 for any); the target answers with `MAGIC`, version and a status byte
//! (`ST_OK`; `ST_AUTH`: this target requires the secret and the initiator did not
//! prove it; `ST_REFUSED`: the hello names another agent than the one proven;
//! `ST_NOT_PEER`: this listener is not the one wanted; anything else: the version
//! differs, and then the target answers right after the name).
//!
//! The listener id is random per backend instance and published in its connection
//! info. A port is reused: by a restarted agent, or by any other process once the
//! agent is gone. Without the id, a peer holding stale metadata would connect to
//! whoever listens there now, with or without a secret, and deliver its WRITEs and
//! notifications to the wrong agent (or wait on it forever).
//! Then the initiator asks for the same-host path (one
//! byte: 1 when both sides reported the same kernel boot id and it wants the path,
//! else 0) and the target answers with one byte (0: no), or 1 and an offer: its pid
//! u32, its grant table's descriptor i32, the table's address u64 and a 16-byte nonce
//! the table carries (see `same_host`). Then the initiator sends requests and the
//! target answers each with an ACK (READs: DATA first).
//!
//! Request header (24 bytes): kind u8, flags u8 (bit 0: carries a notification; bit
//! 1: a piece), 2 zero bytes, entry count u32, request id u64,
//! notification length u32, 4 zero bytes. A piece's header is followed by its byte
//! range (offset u64, length u64) within the request. Then `count` run entries (key
//! u64, addr u64, len u64, stride u64, blocks u64: `blocks` segments of `len` bytes,
//! the first at `addr`, each `stride` bytes after the previous, so a strided request
//! costs one entry per run, not per block), the notification bytes and, for WRITE,
//! the payload (every segment's bytes, in order; for a piece, the bytes of its range).
//!
//! A piece is one of several parts of a large transfer sent over several connections
//! at once: every piece carries the whole request's entries and the target checks
//! all of them, so a request with one bad entry is refused by every piece and no
//! byte of it is written, as for a request sent whole; then only the piece's range
//! moves.
//!
//! Response header (24 bytes): kind u8, status u8, 2 zero bytes, message length u32,
//! request id u64, data length u64. ACK: then `message length` bytes of UTF-8 error
//! text. DATA: then `data length` bytes. PAUSE and RESUME (header only): the target
//! stops reading the connection while its agent's queue of the initiator's
//! notifications is full (back-pressure), and reads it again; in between, the
//! initiator does not take the zero window it sees for a dead peer, for as long as
//! the target answers some request every `TcpOptions::pause_timeout`.

pub(crate) const MAGIC: [u8; 4] = *b"NXTC";
/// 6: authentication (`nixl::control`) before the hello, binding agent names;
/// `RESP_PAUSE`/`RESP_RESUME`. 7: the hello names the listener it wants.
pub(crate) const VERSION: u16 = 7;
pub(crate) const MAX_NAME: usize = 256;
/// Most run entries one request may carry.
pub(crate) const MAX_ENTRIES: u32 = 1 << 20;
/// Longest error message in an ACK.
pub(crate) const MAX_ERROR_MSG: u32 = 4096;
pub(crate) const HEADER_LEN: usize = 24;
/// A piece's byte range, after its header.
pub(crate) const PART_LEN: usize = 16;
pub(crate) const SEG_LEN: usize = 40;

pub(crate) const REQ_WRITE: u8 = 1;
pub(crate) const REQ_READ: u8 = 2;
pub(crate) const REQ_NOTIFY: u8 = 3;
pub(crate) const RESP_ACK: u8 = 0x80;
pub(crate) const RESP_DATA: u8 = 0x81;
/// The target stops reading this connection for a while (its agent's queue of this
/// peer's notifications is full): the initiator is not to count the zero window it
/// will see as a dead peer. Header only, every other field zero.
pub(crate) const RESP_PAUSE: u8 = 0x82;
/// The target reads this connection again (after [`RESP_PAUSE`]).
pub(crate) const RESP_RESUME: u8 = 0x83;

pub(crate) const ST_OK: u8 = 0;
pub(crate) const ST_BAD_KEY: u8 = 1;
pub(crate) const ST_OUT_OF_RANGE: u8 = 2;
pub(crate) const ST_TOO_LARGE: u8 = 3;
/// Hello reply: this target requires its shared secret, which the initiator did not
/// prove.
pub(crate) const ST_AUTH: u8 = 4;
/// Hello reply: the hello names another agent than the one the initiator proved.
pub(crate) const ST_REFUSED: u8 = 5;
/// Hello reply: the hello wants another listener than this one (the agent it was
/// meant for is gone, and another one listens at its address).
pub(crate) const ST_NOT_PEER: u8 = 6;
/// The listener id of a hello that takes whichever listener answers (connection
/// info without one).
pub(crate) const ANY_LISTENER: u64 = 0;
/// This protocol's name in the authentication (`nixl::control`).
pub(crate) const AUTH_PROTOCOL: &str = "nixl-tcp";

/// What the target sent for a same-host connection: its pid, its grant table's
/// descriptor and address, and the nonce the table carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub(crate) pid: u32,
    pub(crate) table_fd: i32,
    pub(crate) table_addr: u64,
    pub(crate) nonce: [u8; crate::shm::NONCE_LEN],
}

/// Length of a same-host offer after its status byte.
pub(crate) const OFFER_LEN: usize = 4 + 4 + 8 + crate::shm::NONCE_LEN;

pub(crate) fn encode_offer(o: &Offer) -> [u8; OFFER_LEN] {
    let mut b = [0u8; OFFER_LEN];
    b[0..4].copy_from_slice(&o.pid.to_le_bytes());
    b[4..8].copy_from_slice(&o.table_fd.to_le_bytes());
    b[8..16].copy_from_slice(&o.table_addr.to_le_bytes());
    b[16..].copy_from_slice(&o.nonce);
    b
}

pub(crate) fn decode_offer(b: &[u8; OFFER_LEN]) -> Offer {
    let mut nonce = [0u8; crate::shm::NONCE_LEN];
    nonce.copy_from_slice(&b[16..]);
    Offer {
        pid: u32_at(b, 0),
        table_fd: u32_at(b, 4) as i32,
        table_addr: u64_at(b, 8),
        nonce,
    }
}

/// A peer's connection info: where it listens, the listener's id, and its kernel
/// boot id when the same-host path is possible.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ConnInfo {
    pub(crate) addr: std::net::SocketAddr,
    /// [`ANY_LISTENER`] where the info carries none.
    pub(crate) listener: u64,
    pub(crate) boot: Option<String>,
}

/// `ip:port;listener=<16 hex digits>`, and `;boot=<id>` when the same-host path is
/// possible.
pub(crate) fn encode_conn_info(info: &ConnInfo) -> String {
    let mut s = format!("{};listener={:016x}", info.addr, info.listener);
    if let Some(b) = &info.boot {
        s.push_str(";boot=");
        s.push_str(b);
    }
    s
}

/// The fields of [`encode_conn_info`]; unknown `;key=value` parts are ignored (newer
/// peers may add some), a missing listener id is [`ANY_LISTENER`].
pub(crate) fn decode_conn_info(s: &str) -> Option<ConnInfo> {
    let mut parts = s.split(';');
    let addr = parts.next()?.parse().ok()?;
    let mut info = ConnInfo {
        addr,
        listener: ANY_LISTENER,
        boot: None,
    };
    for p in parts {
        if let Some(b) = p.strip_prefix("boot=").filter(|b| !b.is_empty()) {
            info.boot.get_or_insert_with(|| b.to_owned());
        } else if let Some(l) = p.strip_prefix("listener=") {
            info.listener = u64::from_str_radix(l, 16).ok()?;
        }
    }
    Some(info)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestHeader {
    pub(crate) kind: u8,
    pub(crate) has_notif: bool,
    /// A piece: its byte range follows the header.
    pub(crate) part: bool,
    pub(crate) segments: u32,
    pub(crate) id: u64,
    pub(crate) notif_len: u32,
}

impl RequestHeader {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind;
        b[1] = u8::from(self.has_notif) | u8::from(self.part) << 1;
        b[4..8].copy_from_slice(&self.segments.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.notif_len.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Self {
        Self {
            kind: b[0],
            has_notif: b[1] & 1 == 1,
            part: b[1] & 2 == 2,
            segments: u32_at(b, 4),
            id: u64_at(b, 8),
            notif_len: u32_at(b, 16),
        }
    }
}

/// A piece's byte range (offset, length) within its request.
pub(crate) fn encode_part(from: u64, len: u64) -> [u8; PART_LEN] {
    let mut b = [0u8; PART_LEN];
    b[..8].copy_from_slice(&from.to_le_bytes());
    b[8..].copy_from_slice(&len.to_le_bytes());
    b
}

pub(crate) fn decode_part(b: &[u8; PART_LEN]) -> (u64, u64) {
    (u64_at(b, 0), u64_at(b, 8))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ResponseHeader {
    pub(crate) kind: u8,
    pub(crate) status: u8,
    pub(crate) msg_len: u32,
    pub(crate) id: u64,
    pub(crate) data_len: u64,
}

impl ResponseHeader {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind;
        b[1] = self.status;
        b[4..8].copy_from_slice(&self.msg_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.data_len.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Self {
        Self {
            kind: b[0],
            status: b[1],
            msg_len: u32_at(b, 4),
            id: u64_at(b, 8),
            data_len: u64_at(b, 16),
        }
    }
}

/// One run entry of a request: `blocks` segments of `len` bytes, `stride` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegEntry {
    pub(crate) key: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) stride: u64,
    pub(crate) blocks: u64,
}

impl SegEntry {
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        for x in [self.key, self.addr, self.len, self.stride, self.blocks] {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }

    /// Decode entries from exactly `count * SEG_LEN` bytes.
    pub(crate) fn decode_all(b: &[u8]) -> impl Iterator<Item = Self> + '_ {
        b.chunks_exact(SEG_LEN).map(|c| Self {
            key: u64_at(c, 0),
            addr: u64_at(c, 8),
            len: u64_at(c, 16),
            stride: u64_at(c, 24),
            blocks: u64_at(c, 32),
        })
    }

    /// Bytes in all blocks, or `None` on overflow.
    pub(crate) fn bytes(&self) -> Option<u64> {
        self.len.checked_mul(self.blocks)
    }

    /// Start address of the last block, or `None` for no blocks or on overflow.
    pub(crate) fn last(&self) -> Option<u64> {
        self.stride
            .checked_mul(self.blocks.checked_sub(1)?)?
            .checked_add(self.addr)
    }
}

/// The hello of agent `name` for the listener with id `listener`.
pub(crate) fn hello(name: &str, listener: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + name.len());
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&listener.to_le_bytes());
    v
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let r = RequestHeader {
            kind: REQ_WRITE,
            has_notif: true,
            part: true,
            segments: 7,
            id: u64::MAX - 3,
            notif_len: 12,
        };
        assert_eq!(RequestHeader::decode(&r.encode()), r);
        let whole = RequestHeader { part: false, ..r };
        assert_eq!(RequestHeader::decode(&whole.encode()), whole);
        assert_eq!(decode_part(&encode_part(1 << 40, 7)), (1 << 40, 7));
        let a = ResponseHeader {
            kind: RESP_DATA,
            status: ST_OUT_OF_RANGE,
            msg_len: 9,
            id: 42,
            data_len: 1 << 40,
        };
        assert_eq!(ResponseHeader::decode(&a.encode()), a);
        let mut v = Vec::new();
        let s = SegEntry {
            key: 1,
            addr: 2,
            len: 3,
            stride: 4,
            blocks: 5,
        };
        assert_eq!((s.bytes(), s.last()), (Some(15), Some(18)));
        let none = SegEntry { blocks: 0, ..s };
        assert_eq!(none.last(), None);
        let big = SegEntry {
            stride: u64::MAX,
            blocks: 3,
            ..s
        };
        assert_eq!(big.last(), None);
        s.encode_into(&mut v);
        s.encode_into(&mut v);
        assert_eq!(SegEntry::decode_all(&v).collect::<Vec<_>>(), vec![s, s]);
    }

    #[test]
    fn offers_and_connection_info_round_trip() {
        let o = Offer {
            pid: 4321,
            table_fd: -1,
            table_addr: 0x7f00_0000_1000,
            nonce: [9; crate::shm::NONCE_LEN],
        };
        assert_eq!(decode_offer(&encode_offer(&o)), o);
        let a: std::net::SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let info = |listener, boot: Option<&str>| ConnInfo {
            addr: a,
            listener,
            boot: boot.map(str::to_owned),
        };
        let plain = info(0x1234, None);
        assert_eq!(
            encode_conn_info(&plain),
            "127.0.0.1:5000;listener=0000000000001234"
        );
        assert_eq!(decode_conn_info(&encode_conn_info(&plain)), Some(plain));
        let with = info(u64::MAX, Some("ab-12"));
        assert_eq!(
            encode_conn_info(&with),
            "127.0.0.1:5000;listener=ffffffffffffffff;boot=ab-12"
        );
        assert_eq!(decode_conn_info(&encode_conn_info(&with)), Some(with));
        // Unknown parts are skipped; info without a listener id takes any listener.
        assert_eq!(
            decode_conn_info("127.0.0.1:5000;future=1;boot=x"),
            Some(info(ANY_LISTENER, Some("x")))
        );
        assert_eq!(
            decode_conn_info("[::1]:7;boot="),
            Some(ConnInfo {
                addr: "[::1]:7".parse().unwrap(),
                listener: ANY_LISTENER,
                boot: None
            })
        );
        assert_eq!(decode_conn_info("127.0.0.1:5000;listener=zz"), None);
        assert_eq!(decode_conn_info("nonsense"), None);
        assert_eq!(decode_conn_info(""), None);
    }
}
