//! NIXL's own metadata format, so a nixl-rs agent can load the metadata of a NIXL
//! agent (the format of NIXL 1.3 to 1.5.x, read from NIXL's source; tested against
//! real 1.5.1 agents) and hand NIXL metadata it accepts.
//!
//! [`Agent::load_metadata`](crate::Agent::load_metadata) picks the format by the first
//! bytes ([`is_nixl_format`]); [`Agent::nixl_metadata`](crate::Agent::nixl_metadata)
//! and [`Agent::nixl_partial_metadata`](crate::Agent::nixl_partial_metadata) export.
//! This module is the codec alone: what the bytes say, checked, with no meaning
//! attached.
//!
//! # Format
//!
//! NIXL's "serdes": the ASCII prefix `nixlSerDes|`, then fields. A field is its tag's
//! raw bytes (no length of its own; some tags are empty), the value's length as a u64
//! little-endian, the value, then `|`. Integers inside values are little-endian. There
//! is no version, no checksum and no size limit in the format itself.
//!
//! ```text
//! "Agent"        agent name
//! "Conns"        u64 count, then per backend:
//!     "t"        backend type ("UCX")
//!     "c"        its connection info (UCX: the worker address)
//! ""             "MemSection"
//! "nixlSecElms"  u64 count, then per section (one backend, one memory type):
//!     "bknd"     backend type
//!     "nixlDList" "nixlSDList"
//!     "t"        u32 memory type (0 DRAM, 1 VRAM, 2 block, 3 object, 4 file)
//!     "n"        u64 descriptor count, then per descriptor:
//!         ""     addr u64 | len u64 | device id u64 | the backend's blob
//!                (UCX: the packed remote key)
//! ```
//!
//! Partial metadata has the same layout; `Conns` may be 0.
//!
//! Decoding treats its input as untrusted, as [`crate::metadata`] does: it never
//! panics, checks every length against the remaining input and [`Limits`] before
//! allocating, and refuses trailing bytes. Every defect is [`ErrorKind::Corrupt`].
//! Encoding is canonical: what decodes within [`Limits::default`] re-encodes to the
//! same bytes.

use crate::error::{Error, ErrorKind, Result};
use crate::metadata::{within, Limits};

/// The bytes every NIXL metadata blob (and every serdes message) starts with.
pub const PREFIX: &[u8] = b"nixlSerDes|";

/// NIXL's memory type of host memory (`DRAM_SEG`).
pub const MEM_DRAM: u32 = 0;
/// NIXL's memory type of GPU memory (`VRAM_SEG`).
pub const MEM_VRAM: u32 = 1;

/// NIXL's backend type of its UCX backend.
pub const BACKEND_UCX: &str = "UCX";

/// The connection entry by which a nixl-rs agent's NIXL-format metadata says that
/// it is nixl-rs: its backends also speak their own protocol (for nixl-ucx: ordered
/// notifications with back-pressure, liveness probes). NIXL skips connection
/// entries of backend types it has not instantiated, so NIXL agents load the
/// metadata as before; a nixl-rs agent that finds it speaks nixl-rs' protocol to
/// the peer ([`NixlDialect::link`](crate::NixlDialect::link)).
pub const BACKEND_NIXL_RS: &str = "NIXL_RS";
/// The marker entry's connection info: the version of that protocol.
pub const NIXL_RS_MARKER: &[u8] = b"1";

const DECODE: &str = "decode NIXL metadata";
const ENCODE: &str = "encode NIXL metadata";
const DESC_FIXED: usize = 24;
/// Smallest encodings: a connection (`t`, `c`, both empty) and a descriptor.
const MIN_CONN: usize = 2 * (1 + 8 + 1);
const MIN_DESC: usize = 8 + DESC_FIXED + 1;
const MIN_SECTION: usize = (4 + 8 + 1) + (9 + 8 + 10 + 1) + (1 + 8 + 4 + 1) + (1 + 8 + 8 + 1);

/// Whether `bytes` are in NIXL's format (rather than this crate's own).
pub fn is_nixl_format(bytes: &[u8]) -> bool {
    bytes.starts_with(PREFIX)
}

/// A NIXL agent's metadata, full or partial, as the bytes say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlMetadata {
    /// The agent's name (UTF-8 here; NIXL allows any bytes, this crate does not).
    pub name: String,
    /// Connection info per backend (empty in partial metadata without it).
    pub conns: Vec<NixlConn>,
    /// Registered memory, one section per backend and memory type.
    pub sections: Vec<NixlSection>,
}

/// One backend's connection info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlConn {
    /// NIXL's backend type (`"UCX"`).
    pub backend: String,
    /// What a peer's backend needs to connect (UCX: the worker address).
    pub info: Vec<u8>,
}

/// The descriptors one backend registered for one memory type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlSection {
    /// NIXL's backend type (`"UCX"`).
    pub backend: String,
    /// NIXL's memory type ([`MEM_DRAM`], [`MEM_VRAM`], ...).
    pub mem_type: u32,
    /// The registered descriptors.
    pub descs: Vec<NixlDesc>,
}

/// One registered descriptor and the backend's data for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlDesc {
    /// Start address in the owning process.
    pub addr: u64,
    /// Length in bytes (non-zero; `addr + len` does not overflow).
    pub len: u64,
    /// Device id (GPU ordinal for VRAM; NIXL writes 0 for DRAM).
    pub device: u64,
    /// The backend's blob (UCX: the packed remote key).
    pub blob: Vec<u8>,
}

impl NixlMetadata {
    /// Encode in NIXL's format.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] if the value breaks [`Limits::default`] or has a
    /// descriptor of length zero or whose end overflows.
    pub fn encode(&self) -> Result<Vec<u8>> {
        self.validate(&Limits::default())?;
        let mut w = Writer(Vec::with_capacity(self.encoded_len()));
        w.0.extend_from_slice(PREFIX);
        w.field(b"Agent", self.name.as_bytes());
        w.field(b"Conns", &(self.conns.len() as u64).to_le_bytes());
        for c in &self.conns {
            w.field(b"t", c.backend.as_bytes());
            w.field(b"c", &c.info);
        }
        w.field(b"", b"MemSection");
        w.field(b"nixlSecElms", &(self.sections.len() as u64).to_le_bytes());
        let mut desc = Vec::new();
        for s in &self.sections {
            w.field(b"bknd", s.backend.as_bytes());
            w.field(b"nixlDList", b"nixlSDList");
            w.field(b"t", &s.mem_type.to_le_bytes());
            w.field(b"n", &(s.descs.len() as u64).to_le_bytes());
            for d in &s.descs {
                desc.clear();
                desc.extend_from_slice(&d.addr.to_le_bytes());
                desc.extend_from_slice(&d.len.to_le_bytes());
                desc.extend_from_slice(&d.device.to_le_bytes());
                desc.extend_from_slice(&d.blob);
                w.field(b"", &desc);
            }
        }
        debug_assert_eq!(w.0.len(), self.encoded_len());
        Ok(w.0)
    }

    /// The exact number of bytes [`encode`](Self::encode) produces.
    #[must_use]
    pub fn encoded_len(&self) -> usize {
        let field = |tag: &str, len: usize| tag.len() + 8 + len + 1;
        let conns: usize = self
            .conns
            .iter()
            .map(|c| field("t", c.backend.len()) + field("c", c.info.len()))
            .sum();
        let sections: usize = self
            .sections
            .iter()
            .map(|s| {
                field("bknd", s.backend.len())
                    + field("nixlDList", 10)
                    + field("t", 4)
                    + field("n", 8)
                    + s.descs
                        .iter()
                        .map(|d| field("", DESC_FIXED + d.blob.len()))
                        .sum::<usize>()
            })
            .sum();
        PREFIX.len()
            + field("Agent", self.name.len())
            + field("Conns", 8)
            + conns
            + field("", 10)
            + field("nixlSecElms", 8)
            + sections
    }

    /// Decode with [`Limits::default`].
    ///
    /// # Errors
    /// As [`decode_with_limits`](Self::decode_with_limits).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        Self::decode_with_limits(bytes, &Limits::default())
    }

    /// Decode untrusted bytes, enforcing `limits` ([`Limits::max_backends`] bounds
    /// both connections and sections, [`Limits::max_regions`] the descriptors of all
    /// sections together). Never panics, whatever the input.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for anything wrong: a missing prefix, an unexpected tag,
    /// a length that disagrees with the input, a missing `|`, trailing bytes, a broken
    /// limit, a name that is empty or not UTF-8, an integer field of the wrong width,
    /// a descriptor shorter than 24 bytes, of length zero or whose end overflows.
    pub fn decode_with_limits(bytes: &[u8], limits: &Limits) -> Result<Self> {
        if bytes.len() > limits.max_total {
            return Err(corrupt(format!(
                "{} bytes > limit {}",
                bytes.len(),
                limits.max_total
            )));
        }
        if !is_nixl_format(bytes) {
            return Err(corrupt("no \"nixlSerDes|\" prefix"));
        }
        let mut r = Reader {
            buf: bytes,
            pos: PREFIX.len(),
        };
        let name = r.name(b"Agent", limits)?;
        let count = r.count(b"Conns", limits.max_backends, MIN_CONN)?;
        let mut conns = Vec::with_capacity(count);
        for i in 0..count {
            let at = |e: Error| within(e, format_args!("connection {i}"));
            let backend = r.name(b"t", limits).map_err(at)?;
            let info = r.field(b"c").map_err(at)?;
            if info.len() > limits.max_conn_info {
                return Err(at(corrupt(format!(
                    "connection info {} bytes > limit {}",
                    info.len(),
                    limits.max_conn_info
                ))));
            }
            conns.push(NixlConn {
                backend,
                info: info.to_vec(),
            });
        }
        r.constant(b"", b"MemSection")?;
        let count = r.count(b"nixlSecElms", limits.max_backends, MIN_SECTION)?;
        let mut sections = Vec::with_capacity(count);
        let mut total = 0usize;
        for i in 0..count {
            let at = |e: Error| within(e, format_args!("section {i}"));
            let backend = r.name(b"bknd", limits).map_err(at)?;
            r.constant(b"nixlDList", b"nixlSDList").map_err(at)?;
            let mem_type = u32::from_le_bytes(r.int::<4>(b"t").map_err(at)?);
            let n = r
                .count(
                    b"n",
                    limits.max_regions - total.min(limits.max_regions),
                    MIN_DESC,
                )
                .map_err(at)?;
            total += n;
            let mut descs = Vec::with_capacity(n);
            for j in 0..n {
                let at = |e: Error| within(e, format_args!("section {i}: descriptor {j}"));
                descs.push(r.desc(limits).map_err(at)?);
            }
            sections.push(NixlSection {
                backend,
                mem_type,
                descs,
            });
        }
        if r.pos != bytes.len() {
            return Err(corrupt(format!(
                "{} trailing bytes from byte {}",
                bytes.len() - r.pos,
                r.pos
            )));
        }
        Ok(Self {
            name,
            conns,
            sections,
        })
    }

    fn validate(&self, limits: &Limits) -> Result<()> {
        let name = |what: &str, n: &str| {
            if n.is_empty() || n.len() > limits.max_name {
                Err(invalid(format!(
                    "{what}: {} bytes (1 to {} allowed)",
                    n.len(),
                    limits.max_name
                )))
            } else {
                Ok(())
            }
        };
        name("agent name", &self.name)?;
        if self.conns.len() > limits.max_backends || self.sections.len() > limits.max_backends {
            return Err(invalid(format!(
                "{} connections and {} sections (limit {} each)",
                self.conns.len(),
                self.sections.len(),
                limits.max_backends
            )));
        }
        for c in &self.conns {
            name("backend type", &c.backend)?;
            if c.info.len() > limits.max_conn_info {
                return Err(invalid(format!(
                    "connection info of {}: {} bytes > limit {}",
                    c.backend,
                    c.info.len(),
                    limits.max_conn_info
                )));
            }
        }
        let mut total = 0usize;
        for s in &self.sections {
            name("backend type", &s.backend)?;
            total += s.descs.len();
            for d in &s.descs {
                check_desc(d, limits).map_err(invalid)?;
            }
        }
        if total > limits.max_regions {
            return Err(invalid(format!(
                "{total} descriptors > limit {}",
                limits.max_regions
            )));
        }
        if self.encoded_len() > limits.max_total {
            return Err(invalid(format!(
                "encoding would be {} bytes > limit {}",
                self.encoded_len(),
                limits.max_total
            )));
        }
        Ok(())
    }
}

fn check_desc(d: &NixlDesc, limits: &Limits) -> std::result::Result<(), String> {
    if d.len == 0 {
        Err(format!("descriptor at {:#x} has length 0", d.addr))
    } else if d.addr.checked_add(d.len).is_none() {
        Err(format!(
            "addr {:#x} + len {:#x} overflows u64",
            d.addr, d.len
        ))
    } else if d.blob.len() > limits.max_blob {
        Err(format!(
            "blob {} bytes > limit {}",
            d.blob.len(),
            limits.max_blob
        ))
    } else {
        Ok(())
    }
}

/// Serdes fields of one notification, as NIXL's UCX backend sends them: the sender's
/// name and the message.
///
/// Layout: [`PREFIX`], `"name"` field, `"msg"` field.
pub fn encode_notification(sender: &str, msg: &[u8]) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(
        PREFIX.len() + 4 + 3 + 18 + sender.len() + msg.len(),
    ));
    w.0.extend_from_slice(PREFIX);
    w.field(b"name", sender.as_bytes());
    w.field(b"msg", msg);
    w.0
}

/// Decode a notification NIXL's UCX backend sent: `(sender, message)`. Never panics.
///
/// # Errors
/// [`ErrorKind::Corrupt`] when the bytes are not exactly a prefix, a `"name"` field of
/// 1 to `max_name` bytes of UTF-8 and a `"msg"` field.
pub fn decode_notification(bytes: &[u8], max_name: usize) -> Result<(String, &[u8])> {
    if !is_nixl_format(bytes) {
        return Err(corrupt("notification: no \"nixlSerDes|\" prefix"));
    }
    let mut r = Reader {
        buf: bytes,
        pos: PREFIX.len(),
    };
    let limits = Limits {
        max_name,
        ..Limits::default()
    };
    let name = r.name(b"name", &limits)?;
    let msg = r.field(b"msg")?;
    if r.pos != bytes.len() {
        return Err(corrupt(format!(
            "notification: {} trailing bytes",
            bytes.len() - r.pos
        )));
    }
    Ok((name, msg))
}

struct Writer(Vec<u8>);

impl Writer {
    fn field(&mut self, tag: &[u8], value: &[u8]) {
        self.0.extend_from_slice(tag);
        self.0
            .extend_from_slice(&(value.len() as u64).to_le_bytes());
        self.0.extend_from_slice(value);
        self.0.push(b'|');
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The value of the field tagged `tag`.
    fn field(&mut self, tag: &[u8]) -> Result<&'a [u8]> {
        let shown = String::from_utf8_lossy(tag);
        let rest = &self.buf[self.pos..];
        if !rest.starts_with(tag) {
            let got = &rest[..rest.len().min(tag.len().max(8))];
            return Err(corrupt(format!(
                "expected field {shown:?} at byte {}, found {:?}",
                self.pos,
                String::from_utf8_lossy(got)
            )));
        }
        let after_tag = self.pos + tag.len();
        let len = self
            .buf
            .get(after_tag..)
            .and_then(<[u8]>::first_chunk::<8>)
            .map(|b| u64::from_le_bytes(*b))
            .ok_or_else(|| corrupt(format!("field {shown:?}: truncated length")))?;
        let start = after_tag + 8;
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .filter(|&e| e < self.buf.len())
            .ok_or_else(|| {
                corrupt(format!(
                    "field {shown:?} at byte {}: {len} bytes, {} left",
                    self.pos,
                    self.buf.len().saturating_sub(start)
                ))
            })?;
        if self.buf[end] != b'|' {
            return Err(corrupt(format!(
                "field {shown:?}: no '|' after its {len} bytes"
            )));
        }
        self.pos = end + 1;
        Ok(&self.buf[start..end])
    }

    fn int<const N: usize>(&mut self, tag: &[u8]) -> Result<[u8; N]> {
        let v = self.field(tag)?;
        v.try_into().map_err(|_| {
            corrupt(format!(
                "field {:?}: {} bytes, expected {N}",
                String::from_utf8_lossy(tag),
                v.len()
            ))
        })
    }

    /// A u64 count of items of at least `min_each` bytes, at most `max`.
    fn count(&mut self, tag: &[u8], max: usize, min_each: usize) -> Result<usize> {
        let n = u64::from_le_bytes(self.int::<8>(tag)?);
        let what = String::from_utf8_lossy(tag);
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= max)
            .ok_or_else(|| corrupt(format!("{what}: {n} > limit {max}")))?;
        if n.checked_mul(min_each)
            .is_none_or(|need| need > self.left())
        {
            return Err(corrupt(format!(
                "{what}: {n} items cannot fit in the {} bytes left",
                self.left()
            )));
        }
        Ok(n)
    }

    fn name(&mut self, tag: &[u8], limits: &Limits) -> Result<String> {
        let v = self.field(tag)?;
        let what = String::from_utf8_lossy(tag);
        if v.is_empty() || v.len() > limits.max_name {
            return Err(corrupt(format!(
                "{what}: {} bytes (1 to {} allowed)",
                v.len(),
                limits.max_name
            )));
        }
        std::str::from_utf8(v)
            .map(str::to_owned)
            .map_err(|e| corrupt(format!("{what}: not UTF-8 ({e})")))
    }

    fn constant(&mut self, tag: &[u8], value: &[u8]) -> Result<()> {
        let v = self.field(tag)?;
        if v != value {
            return Err(corrupt(format!(
                "expected {:?}, found {:?}",
                String::from_utf8_lossy(value),
                String::from_utf8_lossy(&v[..v.len().min(32)])
            )));
        }
        Ok(())
    }

    fn desc(&mut self, limits: &Limits) -> Result<NixlDesc> {
        let v = self.field(b"")?;
        let Some((fixed, blob)) = v.split_first_chunk::<DESC_FIXED>() else {
            return Err(corrupt(format!(
                "{} bytes, fewer than the {DESC_FIXED} of address, length and device",
                v.len()
            )));
        };
        let word =
            |i: usize| u64::from_le_bytes(fixed[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let d = NixlDesc {
            addr: word(0),
            len: word(1),
            device: word(2),
            blob: blob.to_vec(),
        };
        check_desc(&d, limits).map_err(corrupt)?;
        Ok(d)
    }
}

fn corrupt(context: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, DECODE, context)
}

fn invalid(context: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, ENCODE, context)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> NixlMetadata {
        NixlMetadata {
            name: "golden".into(),
            conns: vec![NixlConn {
                backend: "UCX".into(),
                info: vec![1, 2, 3, 4],
            }],
            sections: vec![NixlSection {
                backend: "UCX".into(),
                mem_type: MEM_DRAM,
                descs: vec![
                    NixlDesc {
                        addr: 0x1000,
                        len: 4096,
                        device: 0,
                        blob: vec![9; 11],
                    },
                    NixlDesc {
                        addr: 0x4000,
                        len: 8192,
                        device: 0,
                        blob: vec![],
                    },
                ],
            }],
        }
    }

    #[test]
    fn round_trip_is_canonical() {
        let md = sample();
        let bytes = md.encode().unwrap();
        assert_eq!(bytes.len(), md.encoded_len());
        assert!(is_nixl_format(&bytes));
        let back = NixlMetadata::decode(&bytes).unwrap();
        assert_eq!(back, md);
        assert_eq!(back.encode().unwrap(), bytes);
    }

    #[test]
    fn every_truncation_and_extension_is_corrupt() {
        let bytes = sample().encode().unwrap();
        for n in 0..bytes.len() {
            let e = NixlMetadata::decode(&bytes[..n]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "prefix of {n} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(b'|');
        assert_eq!(
            NixlMetadata::decode(&longer).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
    }

    #[test]
    fn forged_counts_do_not_allocate() {
        let mut md = sample();
        md.sections.clear();
        let mut bytes = md.encode().unwrap();
        // Rewrite the section count (the last 8-byte value before the final '|').
        let at = bytes.len() - 9;
        bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = NixlMetadata::decode(&bytes).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        bytes[at..at + 8].copy_from_slice(&5u64.to_le_bytes());
        let e = NixlMetadata::decode(&bytes).unwrap_err();
        assert!(e.context().contains("cannot fit"), "{e}");
    }

    #[test]
    fn bad_descriptors_are_refused_both_ways() {
        let mut md = sample();
        md.sections[0].descs[0].len = 0;
        assert_eq!(md.encode().unwrap_err().kind(), ErrorKind::InvalidArgument);
        md.sections[0].descs[0].len = 1;
        md.sections[0].descs[0].addr = u64::MAX;
        assert_eq!(md.encode().unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn notifications_round_trip() {
        let b = encode_notification("prefill", b"kv ready");
        let (name, msg) = decode_notification(&b, 256).unwrap();
        assert_eq!((name.as_str(), msg), ("prefill", &b"kv ready"[..]));
        let empty = encode_notification("p", b"");
        assert_eq!(decode_notification(&empty, 256).unwrap().1, b"");
        for n in 0..b.len() {
            assert!(decode_notification(&b[..n], 256).is_err());
        }
        assert!(decode_notification(&encode_notification("", b"x"), 256).is_err());
    }
}
