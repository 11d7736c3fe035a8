//! nixl-verbs' encodings: the connection info peers find in metadata, and the
//! handshake on the control connection that pairs queue pairs. Little-endian,
//! fixed layouts, hard limits; decoding untrusted bytes never panics and never
//! allocates beyond the limits.
//!
//! **Connection info** (the static half of RC setup): magic `NXVB`, version u8, then
//! the endpoint: link layer u8 (0 InfiniBand, 1 Ethernet), port u8, MTU u8 (`enum
//! ibv_mtu`), LID u16, GID index u8, GID 16 bytes, largest message u32, READs served
//! at once u8; then the control address: family u8 (4 or 6), the address (4 or 16
//! bytes), port u16.
//!
//! **Handshake** (the dynamic half, per connection): the initiator connects to the
//! target's control address and sends a hello: magic `NXVH`, version u16, its agent
//! name (u16 length, UTF-8), its endpoint (link layer, port, MTU, LID, GID index, GID:
//! as in the connection info), the queue-pair count u8, then per queue pair its
//! number u32 and first packet sequence number u32. The target creates as many queue
//! pairs, brings them to ready-to-send, and answers: status u8 (0 ok), then on success
//! the longest notification it receives u32 and per queue pair its number and PSN; on
//! failure a u16 length and UTF-8 reason. The initiator then brings its queue pairs to
//! ready-to-send. The connection stays open: its end tells either side the other is
//! gone.

use std::net::{IpAddr, SocketAddr};

use nixl::{Error, ErrorKind, Result};

use crate::api::{LinkLayer, Mtu};

/// Magic of the connection info.
pub const INFO_MAGIC: [u8; 4] = *b"NXVB";
/// Version of the connection info.
pub const INFO_VERSION: u8 = 1;
/// Magic of the handshake hello.
pub const HELLO_MAGIC: [u8; 4] = *b"NXVH";
/// Version of the handshake.
pub const HELLO_VERSION: u16 = 1;
/// Longest agent name in a hello.
pub const MAX_NAME: usize = 256;
/// Most queue pairs per connection.
pub const MAX_QPS: usize = 16;
/// Longest reason in a refusal.
pub const MAX_REASON: usize = 1024;

/// Handshake status: the target made its queue pairs.
pub const ST_OK: u8 = 0;
/// Handshake status: refused (the reason follows).
pub const ST_REFUSED: u8 = 1;

/// Where an agent's queue pairs are: one port of one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// Port number on the device.
    pub port: u8,
    /// The port's active MTU.
    pub mtu: Mtu,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// Index of `gid` in the port's table.
    pub gid_index: u8,
    /// The GID peers address (the RoCE v2 GID on Ethernet).
    pub gid: [u8; 16],
    /// The port's largest message: requests to this side stay within it.
    pub max_msg_sz: u32,
    /// RDMA READs this side serves at once per queue pair (its device's
    /// `max_qp_rd_atom`): a peer issues no more.
    pub max_rd_atomic: u8,
}

/// What peers find in this backend's metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// Where the queue pairs are.
    pub endpoint: Endpoint,
    /// Where the control listener is.
    pub control: SocketAddr,
}

/// One queue pair's dynamic half: its number and first packet sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpHalf {
    /// Queue pair number (24 bits).
    pub qp_num: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
}

/// The initiator's hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The initiator's agent name.
    pub agent: String,
    /// Where its queue pairs are.
    pub endpoint: Endpoint,
    /// Its queue pairs.
    pub qps: Vec<QpHalf>,
}

/// The target's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Queue pairs made and ready.
    Accepted {
        /// The longest notification the target's receive buffers hold.
        max_notification: u32,
        /// Its queue pairs, in the hello's order.
        qps: Vec<QpHalf>,
    },
    /// Refused, with the reason.
    Refused(String),
}

fn corrupt(what: &str) -> Error {
    Error::new(ErrorKind::Corrupt, "verbs decode", what.to_owned())
}

/// A reader over untrusted bytes: every take is bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(corrupt(&format!("{} is truncated", self.what)));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn end(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(corrupt(&format!(
                "{} has {} trailing bytes",
                self.what,
                self.b.len()
            )))
        }
    }

    fn endpoint(&mut self) -> Result<Endpoint> {
        let link_layer = match self.u8()? {
            0 => LinkLayer::InfiniBand,
            1 => LinkLayer::Ethernet,
            x => return Err(corrupt(&format!("unknown link layer {x}"))),
        };
        let port = self.u8()?;
        let mtu = Mtu(self.u8()?);
        if mtu.bytes() == 0 || port == 0 {
            return Err(corrupt("port 0 or an MTU outside 256..4096"));
        }
        let lid = self.u16()?;
        let gid_index = self.u8()?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(self.take(16)?);
        let max_msg_sz = self.u32()?;
        let max_rd_atomic = self.u8()?;
        if max_msg_sz == 0 {
            return Err(corrupt("a largest message of 0 bytes"));
        }
        Ok(Endpoint {
            link_layer,
            port,
            mtu,
            lid,
            gid_index,
            gid,
            max_msg_sz,
            max_rd_atomic,
        })
    }

    fn qp_half(&mut self) -> Result<QpHalf> {
        let h = QpHalf {
            qp_num: self.u32()?,
            psn: self.u32()?,
        };
        if h.qp_num > 0xFF_FFFF || h.psn > 0xFF_FFFF {
            return Err(corrupt("a queue pair number or PSN over 24 bits"));
        }
        Ok(h)
    }

    fn qp_halves(&mut self) -> Result<Vec<QpHalf>> {
        let n = self.u8()? as usize;
        if n == 0 || n > MAX_QPS {
            return Err(corrupt(&format!(
                "{n} queue pairs (1 to {MAX_QPS} allowed)"
            )));
        }
        (0..n).map(|_| self.qp_half()).collect()
    }
}

fn put_endpoint(out: &mut Vec<u8>, e: &Endpoint) {
    out.push(match e.link_layer {
        LinkLayer::Ethernet => 1,
        LinkLayer::InfiniBand | LinkLayer::Unspecified => 0,
    });
    out.push(e.port);
    out.push(e.mtu.0);
    out.extend_from_slice(&e.lid.to_le_bytes());
    out.push(e.gid_index);
    out.extend_from_slice(&e.gid);
    out.extend_from_slice(&e.max_msg_sz.to_le_bytes());
    out.push(e.max_rd_atomic);
}

fn put_qps(out: &mut Vec<u8>, qps: &[QpHalf]) {
    out.push(qps.len() as u8);
    for q in qps {
        out.extend_from_slice(&q.qp_num.to_le_bytes());
        out.extend_from_slice(&q.psn.to_le_bytes());
    }
}

impl ConnInfo {
    /// Encode for metadata.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48);
        out.extend_from_slice(&INFO_MAGIC);
        out.push(INFO_VERSION);
        put_endpoint(&mut out, &self.endpoint);
        match self.control.ip() {
            IpAddr::V4(a) => {
                out.push(4);
                out.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                out.push(6);
                out.extend_from_slice(&a.octets());
            }
        }
        out.extend_from_slice(&self.control.port().to_le_bytes());
        out
    }

    /// Decode a peer's connection info.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for anything but an exact encoding of this version.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader {
            b,
            what: "verbs connection info",
        };
        if r.take(4)? != INFO_MAGIC {
            return Err(corrupt("verbs connection info has the wrong magic"));
        }
        let v = r.u8()?;
        if v != INFO_VERSION {
            return Err(Error::new(
                ErrorKind::Mismatch,
                "verbs decode",
                format!("verbs connection info version {v}; this build speaks {INFO_VERSION}"),
            ));
        }
        let endpoint = r.endpoint()?;
        let ip = match r.u8()? {
            4 => IpAddr::from(<[u8; 4]>::try_from(r.take(4)?).expect("4 bytes")),
            6 => IpAddr::from(<[u8; 16]>::try_from(r.take(16)?).expect("16 bytes")),
            x => return Err(corrupt(&format!("unknown address family {x}"))),
        };
        let port = r.u16()?;
        r.end()?;
        Ok(Self {
            endpoint,
            control: SocketAddr::new(ip, port),
        })
    }
}

impl Hello {
    /// Encode (the caller keeps the name and queue pairs within the limits).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(40 + self.agent.len() + 8 * self.qps.len());
        out.extend_from_slice(&HELLO_MAGIC);
        out.extend_from_slice(&HELLO_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.agent.len() as u16).to_le_bytes());
        out.extend_from_slice(self.agent.as_bytes());
        put_endpoint(&mut out, &self.endpoint);
        put_qps(&mut out, &self.qps);
        out
    }

    /// Decode a hello.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for anything malformed or over the limits;
    /// [`ErrorKind::Mismatch`] for another handshake version.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader {
            b,
            what: "verbs hello",
        };
        if r.take(4)? != HELLO_MAGIC {
            return Err(corrupt("not a nixl-verbs hello"));
        }
        let v = r.u16()?;
        if v != HELLO_VERSION {
            return Err(Error::new(
                ErrorKind::Mismatch,
                "verbs handshake",
                format!("handshake version {v}; this build speaks {HELLO_VERSION}"),
            ));
        }
        let n = r.u16()? as usize;
        if n == 0 || n > MAX_NAME {
            return Err(corrupt(&format!("an agent name of {n} bytes")));
        }
        let agent = std::str::from_utf8(r.take(n)?)
            .map_err(|_| corrupt("the agent name is not UTF-8"))?
            .to_owned();
        let endpoint = r.endpoint()?;
        let qps = r.qp_halves()?;
        r.end()?;
        Ok(Self {
            agent,
            endpoint,
            qps,
        })
    }

    /// Bytes of a hello with an `name_len`-byte name and `qps` queue pairs (the
    /// reader knows how much to read once it has the first 8 bytes and the name).
    pub fn len(name_len: usize, qps: usize) -> usize {
        4 + 2 + 2 + name_len + ENDPOINT_LEN + 1 + 8 * qps
    }
}

/// Bytes of an encoded [`Endpoint`].
pub const ENDPOINT_LEN: usize = 1 + 1 + 1 + 2 + 1 + 16 + 4 + 1;

impl Reply {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Self::Accepted {
                max_notification,
                qps,
            } => {
                out.push(ST_OK);
                out.extend_from_slice(&max_notification.to_le_bytes());
                put_qps(&mut out, qps);
            }
            Self::Refused(why) => {
                out.push(ST_REFUSED);
                let why = &why.as_bytes()[..why.len().min(MAX_REASON)];
                // Cut on a character boundary.
                let why = match std::str::from_utf8(why) {
                    Ok(s) => s,
                    Err(e) => std::str::from_utf8(&why[..e.valid_up_to()]).expect("valid prefix"),
                };
                out.extend_from_slice(&(why.len() as u16).to_le_bytes());
                out.extend_from_slice(why.as_bytes());
            }
        }
        out
    }

    /// Decode an answer.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for anything malformed or over the limits.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader {
            b,
            what: "verbs handshake reply",
        };
        let reply = match r.u8()? {
            ST_OK => Self::Accepted {
                max_notification: r.u32()?,
                qps: r.qp_halves()?,
            },
            ST_REFUSED => {
                let n = r.u16()? as usize;
                if n > MAX_REASON {
                    return Err(corrupt(&format!("a reason of {n} bytes")));
                }
                Self::Refused(String::from_utf8_lossy(r.take(n)?).into_owned())
            }
            x => return Err(corrupt(&format!("unknown handshake status {x}"))),
        };
        r.end()?;
        Ok(reply)
    }
}

/// The public blob of a registration: its remote key.
pub fn encode_blob(rkey: u32) -> [u8; 4] {
    rkey.to_le_bytes()
}

/// The remote key of a peer's blob.
///
/// # Errors
/// [`ErrorKind::Corrupt`] unless the blob is exactly 4 bytes.
pub fn decode_blob(b: &[u8]) -> Result<u32> {
    <[u8; 4]>::try_from(b)
        .map(u32::from_le_bytes)
        .map_err(|_| corrupt(&format!("a verbs region blob of {} bytes, not 4", b.len())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn endpoint() -> Endpoint {
        Endpoint {
            link_layer: LinkLayer::Ethernet,
            port: 1,
            mtu: Mtu(5),
            lid: 0,
            gid_index: 3,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7],
            max_msg_sz: 1 << 30,
            max_rd_atomic: 16,
        }
    }

    #[test]
    fn round_trips() {
        for control in ["10.1.2.3:4791", "[fe80::1]:9"] {
            let i = ConnInfo {
                endpoint: endpoint(),
                control: control.parse().unwrap(),
            };
            assert_eq!(ConnInfo::decode(&i.encode()).unwrap(), i);
        }
        let h = Hello {
            agent: "prefill-0".into(),
            endpoint: Endpoint {
                link_layer: LinkLayer::InfiniBand,
                lid: 17,
                ..endpoint()
            },
            qps: vec![
                QpHalf {
                    qp_num: 0x1234,
                    psn: 0xFF_FFFF,
                },
                QpHalf { qp_num: 9, psn: 0 },
            ],
        };
        let b = h.encode();
        assert_eq!(b.len(), Hello::len(h.agent.len(), 2));
        assert_eq!(Hello::decode(&b).unwrap(), h);
        let r = Reply::Accepted {
            max_notification: 4096,
            qps: h.qps.clone(),
        };
        assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        let r = Reply::Refused("no".into());
        assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        // A long reason is cut on a character boundary, within the limit.
        let long = Reply::Refused("é".repeat(MAX_REASON));
        match Reply::decode(&long.encode()).unwrap() {
            Reply::Refused(s) => assert!(s.len() <= MAX_REASON && s.chars().all(|c| c == 'é')),
            other => panic!("{other:?}"),
        }
        assert_eq!(decode_blob(&encode_blob(0xDEAD_BEEF)).unwrap(), 0xDEAD_BEEF);
        assert_eq!(
            decode_blob(&[1, 2, 3]).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
    }

    #[test]
    fn refuses_what_is_not_an_exact_encoding() {
        let i = ConnInfo {
            endpoint: endpoint(),
            control: "10.1.2.3:4791".parse().unwrap(),
        }
        .encode();
        for cut in 0..i.len() {
            assert_eq!(
                ConnInfo::decode(&i[..cut]).unwrap_err().kind(),
                ErrorKind::Corrupt
            );
        }
        let mut longer = i.clone();
        longer.push(0);
        assert_eq!(
            ConnInfo::decode(&longer).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
        let mut v2 = i.clone();
        v2[4] = 2;
        assert_eq!(
            ConnInfo::decode(&v2).unwrap_err().kind(),
            ErrorKind::Mismatch
        );
        let mut mtu = i.clone();
        mtu[7] = 6;
        assert_eq!(
            ConnInfo::decode(&mtu).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
        let h = Hello {
            agent: "a".into(),
            endpoint: endpoint(),
            qps: vec![QpHalf { qp_num: 1, psn: 2 }],
        };
        let mut too_many = h.encode();
        let at = too_many.len() - 9;
        too_many[at] = (MAX_QPS + 1) as u8;
        assert_eq!(
            Hello::decode(&too_many).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
        let mut wide = h.encode();
        let n = wide.len();
        wide[n - 1] = 1; // PSN bit 24
        assert_eq!(Hello::decode(&wide).unwrap_err().kind(), ErrorKind::Corrupt);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Arbitrary bytes: decoding never panics, and whatever decodes re-encodes to
        /// exactly the same bytes.
        #[test]
        fn decoders_never_panic_and_are_exact(b in proptest::collection::vec(any::<u8>(), 0..128)) {
            if let Ok(i) = ConnInfo::decode(&b) {
                prop_assert_eq!(i.encode(), b.clone());
            }
            if let Ok(h) = Hello::decode(&b) {
                prop_assert_eq!(h.encode(), b.clone());
            }
            if let Ok(r) = Reply::decode(&b) {
                if let Reply::Accepted { .. } = r {
                    prop_assert_eq!(r.encode(), b.clone());
                }
            }
        }

        /// Valid messages with one byte changed: decode to something that re-encodes
        /// to those bytes, or fail cleanly.
        #[test]
        fn mutated_hellos(
            name in "[a-z]{1,20}",
            qps in proptest::collection::vec((0u32..0x100_0000, 0u32..0x100_0000), 1..4),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let h = Hello {
                agent: name,
                endpoint: endpoint(),
                qps: qps.into_iter().map(|(qp_num, psn)| QpHalf { qp_num, psn }).collect(),
            };
            let mut b = h.encode();
            let i = at.index(b.len());
            b[i] = byte;
            match Hello::decode(&b) {
                Ok(d) => prop_assert_eq!(d.encode(), b),
                Err(e) => prop_assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Mismatch)),
            }
        }
    }
}
