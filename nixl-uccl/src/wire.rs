//! Connection info and the control connection's frames.
//!
//! Connection info (in the agent's metadata): `version u8 = 2`, then two
//! length-prefixed (`u16` little-endian) UTF-8 strings: the control listener's address
//! (`ip:port`) and the UCCL engine's own connection string (`ip:port?gpu`).
//!
//! Control frames: `len u32` (little-endian, counting the type byte and the payload),
//! `type u8`, payload. `Hello` and `HelloAck` carry an agent name; `Notif` carries the
//! notification's bytes; `Verify` a request id (`u64`) then (address, length,
//! confirmation key) triples (`u64` each); `Verified` the request id, `ok u8` and a digest (`u64`); the rest
//! carry nothing. Integers are little-endian.

use bytes::{BufMut, Bytes, BytesMut};

/// Connection-info version. 2: the control connection carries `Verify`/`Verified`
/// (an agent of version 1 would drop the connection on them, so its metadata is
/// refused at load instead). 3: `Verify` ranges name their registration's
/// confirmation key, which registration metadata carries after the `FifoItem`.
pub(crate) const INFO_VERSION: u8 = 3;
/// Longest control frame accepted (a notification plus its header).
pub(crate) const MAX_FRAME: usize = crate::MAX_NOTIFICATION + 64;

/// What a peer's metadata says about reaching it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ConnInfo {
    /// The control listener (`ip:port`).
    pub control: String,
    /// UCCL's connection string (`ip:port?gpu`).
    pub engine: String,
}

impl ConnInfo {
    pub(crate) fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(5 + self.control.len() + self.engine.len());
        b.put_u8(INFO_VERSION);
        for s in [&self.control, &self.engine] {
            b.put_u16_le(s.len() as u16);
            b.put_slice(s.as_bytes());
        }
        b.freeze()
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        let (&v, mut rest) = b.split_first()?;
        if v != INFO_VERSION {
            return None;
        }
        let mut take = || -> Option<String> {
            let n = u16::from_le_bytes(rest.get(..2)?.try_into().ok()?) as usize;
            let s = std::str::from_utf8(rest.get(2..2 + n)?).ok()?.to_owned();
            rest = &rest[2 + n..];
            Some(s)
        };
        let control = take()?;
        let engine = take()?;
        if !rest.is_empty() {
            return None;
        }
        Some(Self { control, engine })
    }

    /// The engine string split into (ip, port, gpu): UCCL 0.1 writes `ip:port?gpu`,
    /// with IPv6 addresses in brackets.
    pub(crate) fn engine_endpoint(&self) -> Option<(String, u16, String)> {
        let (addr, gpu) = self.engine.split_once('?')?;
        let (ip, port) = addr.rsplit_once(':')?;
        let ip = ip.trim_start_matches('[').trim_end_matches(']');
        if ip.is_empty() {
            return None;
        }
        Some((ip.to_owned(), port.parse().ok()?, gpu.to_owned()))
    }
}

/// One control frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// Initiator to target, first: who is calling.
    Hello(String),
    /// Target's answer: who answered.
    HelloAck(String),
    /// Target: its engine accepts connections now (it has registered memory).
    Ready,
    /// A notification, sent after the data it follows is complete.
    Notif(Bytes),
    /// Liveness probe, answered by `Pong`.
    Ping,
    /// Answer to `Ping`.
    Pong,
    /// Initiator: digest these ranges of your registered memory (see `verify`).
    Verify {
        id: u64,
        ranges: Vec<(u64, u64, u64)>,
    },
    /// Target: the digest of a `Verify`'s ranges, or `None` when it would not make it
    /// (a range outside its registrations, memory deregistered meanwhile).
    Verified { id: u64, digest: Option<u64> },
}

/// Most ranges one `Verify` frame carries.
pub(crate) const MAX_VERIFY_RANGES: usize = 4096;
/// Bytes of one `Verify` range on the wire.
const RANGE: usize = 24;

const HELLO: u8 = 1;
const HELLO_ACK: u8 = 2;
const READY: u8 = 3;
const NOTIF: u8 = 4;
const PING: u8 = 5;
const PONG: u8 = 6;
const VERIFY: u8 = 7;
const VERIFIED: u8 = 8;

impl Frame {
    pub(crate) fn encode(&self) -> Bytes {
        let owned;
        let (t, body): (u8, &[u8]) = match self {
            Self::Hello(n) => (HELLO, n.as_bytes()),
            Self::HelloAck(n) => (HELLO_ACK, n.as_bytes()),
            Self::Ready => (READY, &[]),
            Self::Notif(m) => (NOTIF, m),
            Self::Ping => (PING, &[]),
            Self::Pong => (PONG, &[]),
            Self::Verify { id, ranges } => {
                let mut b = Vec::with_capacity(8 + RANGE * ranges.len());
                b.extend_from_slice(&id.to_le_bytes());
                for (addr, len, key) in ranges {
                    b.extend_from_slice(&addr.to_le_bytes());
                    b.extend_from_slice(&len.to_le_bytes());
                    b.extend_from_slice(&key.to_le_bytes());
                }
                owned = b;
                (VERIFY, &owned)
            }
            Self::Verified { id, digest } => {
                let mut b = Vec::with_capacity(17);
                b.extend_from_slice(&id.to_le_bytes());
                b.push(u8::from(digest.is_some()));
                b.extend_from_slice(&digest.unwrap_or(0).to_le_bytes());
                owned = b;
                (VERIFIED, &owned)
            }
        };
        let mut b = BytesMut::with_capacity(5 + body.len());
        b.put_u32_le(1 + body.len() as u32);
        b.put_u8(t);
        b.put_slice(body);
        b.freeze()
    }

    /// Decode one frame body (after the length): `None` for an unknown type or a
    /// malformed body.
    pub(crate) fn decode(body: &[u8]) -> Option<Self> {
        let (&t, rest) = body.split_first()?;
        let name = || std::str::from_utf8(rest).ok().map(str::to_owned);
        Some(match t {
            HELLO => Self::Hello(name()?),
            HELLO_ACK => Self::HelloAck(name()?),
            READY if rest.is_empty() => Self::Ready,
            NOTIF => Self::Notif(Bytes::copy_from_slice(rest)),
            PING if rest.is_empty() => Self::Ping,
            PONG if rest.is_empty() => Self::Pong,
            VERIFY if rest.len() >= 8 && (rest.len() - 8) % RANGE == 0 => {
                let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
                if (rest.len() - 8) / RANGE > MAX_VERIFY_RANGES {
                    return None;
                }
                let ranges: Vec<_> = rest[8..]
                    .chunks_exact(RANGE)
                    .map(|c| (word(&c[..8]), word(&c[8..16]), word(&c[16..])))
                    .collect();
                Self::Verify {
                    id: word(&rest[..8]),
                    ranges,
                }
            }
            // No digest: its bytes are zero (one encoding per frame).
            VERIFIED if rest.len() == 17 && (rest[8] == 1 || rest[8..] == [0; 9]) => {
                let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
                Self::Verified {
                    id: word(&rest[..8]),
                    digest: (rest[8] == 1).then(|| word(&rest[9..])),
                }
            }
            _ => return None,
        })
    }
}

/// Read one frame; `Ok(None)` at a clean end of stream.
pub(crate) async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
) -> std::io::Result<Option<Frame>> {
    read_frame_max(r, MAX_FRAME).await
}

/// [`read_frame`] refusing frames longer than `max` (a peer that has not said who it
/// is gets a small limit).
pub(crate) async fn read_frame_max<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> std::io::Result<Option<Frame>> {
    let Some(body) = nixl::control::read_frame(r, max).await? else {
        return Ok(None);
    };
    Frame::decode(&body).map(Some).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed control frame")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn conn_info_round_trip_and_endpoint() {
        let i = ConnInfo {
            control: "127.0.0.1:4000".into(),
            engine: "10.0.0.2:5000?0000:4a:00.0".into(),
        };
        assert_eq!(ConnInfo::decode(&i.encode()), Some(i.clone()));
        assert_eq!(
            i.engine_endpoint(),
            Some(("10.0.0.2".into(), 5000, "0000:4a:00.0".into()))
        );
        let v6 = ConnInfo {
            control: "[::1]:1".into(),
            engine: "[fe80::1]:7?0".into(),
        };
        assert_eq!(
            v6.engine_endpoint(),
            Some(("fe80::1".into(), 7, "0".into()))
        );
        let bad = ConnInfo {
            control: "x".into(),
            engine: "no-port".into(),
        };
        assert_eq!(bad.engine_endpoint(), None);
        // Wrong version, trailing bytes, truncation.
        let mut b = i.encode().to_vec();
        b[0] = 9;
        assert_eq!(ConnInfo::decode(&b), None);
        let mut b = i.encode().to_vec();
        b.push(0);
        assert_eq!(ConnInfo::decode(&b), None);
        assert_eq!(ConnInfo::decode(&i.encode()[..7]), None);
    }

    #[test]
    fn frames_round_trip() {
        for f in [
            Frame::Hello("a".into()),
            Frame::HelloAck("b".into()),
            Frame::Ready,
            Frame::Notif(Bytes::from_static(b"\0\xffpayload")),
            Frame::Notif(Bytes::new()),
            Frame::Ping,
            Frame::Pong,
            Frame::Verify {
                id: 7,
                ranges: vec![(0x7f00_0000_1000, 4096, 9), (u64::MAX, 1, u64::MAX)],
            },
            Frame::Verify {
                id: 0,
                ranges: vec![],
            },
            Frame::Verified {
                id: u64::MAX,
                digest: Some(0x1234_5678_9abc_def0),
            },
            Frame::Verified {
                id: 1,
                digest: None,
            },
        ] {
            let e = f.encode();
            let n = u32::from_le_bytes(e[..4].try_into().unwrap()) as usize;
            assert_eq!(n, e.len() - 4);
            assert_eq!(Frame::decode(&e[4..]), Some(f));
        }
        assert_eq!(Frame::decode(&[READY, 1]), None);
        assert_eq!(Frame::decode(&[99]), None);
        assert_eq!(Frame::decode(&[HELLO, 0xff]), None);
        // A range cut short, a bad flag, too many ranges.
        assert_eq!(Frame::decode(&[&[VERIFY][..], &[0; 8 + 23]].concat()), None);
        assert_eq!(
            Frame::decode(&[&[VERIFIED][..], &[0; 8], &[2], &[0; 8]].concat()),
            None
        );
        assert_eq!(
            Frame::decode(&[&[VERIFIED][..], &[0; 8], &[0], &[1; 8]].concat()),
            None,
            "a digest where the flag says none"
        );
        let many = Frame::Verify {
            id: 1,
            ranges: vec![(0, 1, 2); MAX_VERIFY_RANGES + 1],
        };
        assert_eq!(Frame::decode(&many.encode()[4..]), None);
        assert!(
            many.encode().len() - 4 <= MAX_FRAME,
            "the limit is the decoder's"
        );
    }

    #[tokio::test]
    async fn read_frame_refuses_oversize_and_zero() {
        let mut big = Vec::new();
        big.extend_from_slice(&((MAX_FRAME as u32) + 1).to_le_bytes());
        assert!(read_frame(&mut big.as_slice()).await.is_err());
        let zero = 0u32.to_le_bytes();
        assert!(read_frame(&mut zero.as_slice()).await.is_err());
        let empty: &[u8] = &[];
        assert!(read_frame(&mut &*empty).await.unwrap().is_none());
        // A cut header is not a clean end.
        let cut: &[u8] = &[5, 0];
        assert!(read_frame(&mut &*cut).await.is_err());
        // A small limit holds.
        let hello = Frame::Hello("x".repeat(100)).encode();
        assert!(read_frame_max(&mut &hello[..], 64).await.is_err());
        assert!(read_frame_max(&mut &hello[..], 200)
            .await
            .unwrap()
            .is_some());
    }

    proptest! {
        #[test]
        fn decoders_never_panic(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = ConnInfo::decode(&b);
            let _ = Frame::decode(&b);
            if let Some(i) = ConnInfo::decode(&b) {
                prop_assert_eq!(ConnInfo::decode(&i.encode()), Some(i.clone()));
                let _ = i.engine_endpoint();
            }
        }

        #[test]
        fn notif_payloads_round_trip(m in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let f = Frame::Notif(Bytes::from(m));
            let e = f.encode();
            prop_assert_eq!(Frame::decode(&e[4..]), Some(f));
        }
    }
}
