//! The metadata an agent publishes so peers can reach it: a versioned, checksummed,
//! size-limited binary format.
//!
//! # Format, version 1
//!
//! All integers are little-endian.
//!
//! ```text
//! header   MAGIC "NXMD" (4) | version u16 | flags u16 | body_len u32
//! body     name           u16 len + UTF-8 bytes
//!          instance       u64
//!          backend count  u16, then per backend:
//!              name       u16 len + UTF-8 bytes
//!              has_conn   u8 (0 or 1), if 1: u32 len + bytes
//!          region count   u32, then per region:
//!              id         u64
//!              kind       u8 tag: 0 = DRAM, 1 = VRAM followed by device u32
//!              addr       u64
//!              len        u64
//!              blob count u16, then per blob: backend u16, u32 len + bytes
//! trailer  CRC-32 (IEEE, reflected polynomial 0xEDB88320) u32 over header + body
//! ```
//!
//! Flags: bit 0 is [`AgentMetadata::partial`]; every other bit must be zero.
//!
//! Decoding treats its input as untrusted: it never panics, checks every length against
//! the remaining input before allocating, and enforces [`Limits`]. An unknown version is
//! [`ErrorKind::NotSupported`]; every other defect is [`ErrorKind::Corrupt`].
//! Encodings are canonical: every value has exactly one encoding, and decoding then
//! re-encoding gives back the same bytes.

use std::fmt;

use crate::error::{Error, ErrorKind, Result};
use crate::memory::MemKind;

/// The four bytes every encoding starts with.
pub const MAGIC: [u8; 4] = *b"NXMD";

/// The format version this module writes and the only one it reads.
pub const VERSION: u16 = 1;

const HEADER_LEN: usize = 4 + 2 + 2 + 4;
const TRAILER_LEN: usize = 4;
const FLAG_PARTIAL: u16 = 1;

/// Smallest possible encodings of the repeated items, used to reject counts the
/// remaining input cannot hold before allocating for them.
const MIN_BACKEND_LEN: usize = 2 + 1;
const MIN_REGION_LEN: usize = 8 + 1 + 8 + 8 + 2;
const MIN_BLOB_LEN: usize = 2 + 4;

const TAG_DRAM: u8 = 0;
const TAG_VRAM: u8 = 1;

const DECODE: &str = "decode metadata";
const ENCODE: &str = "encode metadata";

/// Hard limits applied when decoding (and, with the defaults, when encoding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest whole encoding (header, body and checksum), in bytes. Default 64 MiB.
    pub max_total: usize,
    /// Longest agent or backend name, in bytes. Default 256.
    pub max_name: usize,
    /// Most backends. Default 32.
    pub max_backends: usize,
    /// Longest backend connection info, in bytes. Default 64 KiB.
    pub max_conn_info: usize,
    /// Most regions. Default 4,000,000.
    pub max_regions: usize,
    /// Longest per-region backend blob, in bytes. Default 4 KiB.
    pub max_blob: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_total: 64 << 20,
            max_name: 256,
            max_backends: 32,
            max_conn_info: 64 << 10,
            max_regions: 4_000_000,
            max_blob: 4 << 10,
        }
    }
}

/// Everything a peer needs to reach an agent and address its registered memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentMetadata {
    /// The agent's name: 1 to [`Limits::max_name`] bytes of UTF-8.
    pub name: String,
    /// Random id of this agent instance; a restart changes it.
    pub instance: u64,
    /// `true` when this carries only some regions, and backends may lack connection info.
    pub partial: bool,
    /// The agent's backends; [`RegionBlob::backend`] indexes into this list.
    pub backends: Vec<BackendMeta>,
    /// The agent's registered memory regions.
    pub regions: Vec<RegionMeta>,
}

/// One backend of an agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendMeta {
    /// The backend's name: 1 to [`Limits::max_name`] bytes of UTF-8.
    pub name: String,
    /// What a peer's backend needs to connect to this one, if published.
    pub conn_info: Option<Vec<u8>>,
}

/// One registered memory region of an agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionMeta {
    /// The registration's id.
    pub id: u64,
    /// Kind of memory.
    pub kind: MemKind,
    /// Start address in the owning process.
    pub addr: u64,
    /// Length in bytes; non-zero, and `addr + len` must not overflow.
    pub len: u64,
    /// Per-backend data peers need to access the region (remote keys, handles, ...).
    pub blobs: Vec<RegionBlob>,
}

/// One backend's data for a region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionBlob {
    /// Index into [`AgentMetadata::backends`].
    pub backend: u16,
    /// The backend-specific bytes, at most [`Limits::max_blob`] long.
    pub blob: Vec<u8>,
}

impl AgentMetadata {
    /// Encode as format version [`VERSION`].
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidArgument`] if the value breaks [`Limits::default`] (an empty
    /// or over-long name, too many backends or regions, over-long connection info or
    /// blob, an over-large total), has a region of length zero or whose end overflows
    /// `u64`, or has a blob whose backend index is out of range.
    pub fn encode(&self) -> Result<Vec<u8>> {
        self.validate(&Limits::default())?;
        let total = self.encoded_len();
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&MAGIC);
        put_u16(&mut out, VERSION);
        put_u16(&mut out, if self.partial { FLAG_PARTIAL } else { 0 });
        put_u32(
            &mut out,
            narrow(total - HEADER_LEN - TRAILER_LEN, "body length")?,
        );

        put_name(&mut out, &self.name)?;
        put_u64(&mut out, self.instance);
        put_u16(&mut out, narrow(self.backends.len(), "backend count")?);
        for backend in &self.backends {
            put_name(&mut out, &backend.name)?;
            match &backend.conn_info {
                None => out.push(0),
                Some(info) => {
                    out.push(1);
                    put_bytes32(&mut out, info, "connection info")?;
                }
            }
        }
        put_u32(&mut out, narrow(self.regions.len(), "region count")?);
        for region in &self.regions {
            put_u64(&mut out, region.id);
            match region.kind {
                MemKind::Dram => out.push(TAG_DRAM),
                MemKind::Vram { device } => {
                    out.push(TAG_VRAM);
                    put_u32(&mut out, device);
                }
                MemKind::File { .. } => {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        "encode metadata",
                        format!("region {}: files are never published", region.id),
                    ))
                }
            }
            put_u64(&mut out, region.addr);
            put_u64(&mut out, region.len);
            put_u16(&mut out, narrow(region.blobs.len(), "blob count")?);
            for blob in &region.blobs {
                put_u16(&mut out, blob.backend);
                put_bytes32(&mut out, &blob.blob, "blob")?;
            }
        }

        let crc = crc32(&out);
        put_u32(&mut out, crc);
        debug_assert_eq!(out.len(), total);
        Ok(out)
    }

    /// Decode with [`Limits::default`].
    ///
    /// # Errors
    ///
    /// As [`decode_with_limits`](Self::decode_with_limits).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        Self::decode_with_limits(bytes, &Limits::default())
    }

    /// Decode untrusted bytes, enforcing `limits`. Never panics, whatever the input.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::NotSupported`] for a version other than [`VERSION`];
    /// [`ErrorKind::Corrupt`] for anything else wrong: bad magic, unknown flags, a
    /// length that disagrees with the input (including trailing bytes), a checksum
    /// mismatch, a broken limit, invalid UTF-8 or empty names, an unknown memory kind,
    /// a zero-length or overflowing region, or a blob naming a backend that is not there.
    pub fn decode_with_limits(bytes: &[u8], limits: &Limits) -> Result<Self> {
        let mut header = Reader::new(bytes, 0);
        let magic = header.array::<4>().map_err(|e| within(e, "header"))?;
        if magic != MAGIC {
            return Err(corrupt(format!(
                "bad magic {magic:02x?}, expected {MAGIC:02x?}"
            )));
        }
        let version = header.u16().map_err(|e| within(e, "header"))?;
        if version != VERSION {
            return Err(Error::new(
                ErrorKind::NotSupported,
                DECODE,
                format!("format version {version} (this build reads version {VERSION})"),
            ));
        }
        let flags = header.u16().map_err(|e| within(e, "header"))?;
        let body_len = header.u32().map_err(|e| within(e, "header"))?;
        if flags & !FLAG_PARTIAL != 0 {
            return Err(corrupt(format!(
                "unknown flag bits {:#06x}",
                flags & !FLAG_PARTIAL
            )));
        }

        let expected = usize::try_from(body_len)
            .ok()
            .and_then(|n| n.checked_add(HEADER_LEN + TRAILER_LEN))
            .filter(|&n| n <= limits.max_total)
            .ok_or_else(|| {
                corrupt(format!(
                    "body length {body_len} exceeds the {}-byte limit on the whole encoding",
                    limits.max_total
                ))
            })?;
        if bytes.len() < expected {
            return Err(corrupt(format!(
                "truncated: header says {expected} bytes in all, got {}",
                bytes.len()
            )));
        }
        if bytes.len() > expected {
            return Err(corrupt(format!(
                "{} trailing bytes after the {expected}-byte encoding",
                bytes.len() - expected
            )));
        }

        let (signed, stored) = bytes
            .split_last_chunk::<TRAILER_LEN>()
            .ok_or_else(|| corrupt("truncated: no checksum"))?;
        let stored = u32::from_le_bytes(*stored);
        let actual = crc32(signed);
        if stored != actual {
            return Err(corrupt(format!(
                "checksum mismatch: stored {stored:#010x}, computed {actual:#010x}"
            )));
        }

        let mut r = Reader::new(signed, HEADER_LEN);
        let meta = Self::decode_body(&mut r, flags & FLAG_PARTIAL != 0, limits)?;
        if r.remaining() != 0 {
            return Err(corrupt(format!(
                "{} unread bytes at the end of the body (from byte {})",
                r.remaining(),
                r.pos
            )));
        }
        Ok(meta)
    }

    /// The exact number of bytes [`encode`](Self::encode) produces for this value.
    #[must_use]
    pub fn encoded_len(&self) -> usize {
        let backends: usize = self
            .backends
            .iter()
            .map(|b| 2 + b.name.len() + 1 + b.conn_info.as_ref().map_or(0, |c| 4 + c.len()))
            .sum();
        let regions: usize = self
            .regions
            .iter()
            .map(|r| {
                let kind = match r.kind {
                    MemKind::Dram => 1,
                    MemKind::Vram { .. } | MemKind::File { .. } => 1 + 4,
                };
                let blobs: usize = r.blobs.iter().map(|b| MIN_BLOB_LEN + b.blob.len()).sum();
                8 + kind + 8 + 8 + 2 + blobs
            })
            .sum();
        let body = 2 + self.name.len() + 8 + 2 + backends + 4 + regions;
        HEADER_LEN + body + TRAILER_LEN
    }

    fn decode_body(r: &mut Reader<'_>, partial: bool, limits: &Limits) -> Result<Self> {
        let name = decode_name(r, limits).map_err(|e| within(e, "agent name"))?;
        let instance = r.u64().map_err(|e| within(e, "instance"))?;

        let count = usize::from(r.u16().map_err(|e| within(e, "backend count"))?);
        check_count("backends", count, limits.max_backends).map_err(corrupt)?;
        r.ensure_room(count, MIN_BACKEND_LEN, "backends")?;
        let mut backends = Vec::with_capacity(count);
        for i in 0..count {
            backends.push(
                decode_backend(r, limits).map_err(|e| within(e, format_args!("backend {i}")))?,
            );
        }

        let count = r.u32().map_err(|e| within(e, "region count"))?;
        let count = usize::try_from(count).unwrap_or(usize::MAX);
        check_count("regions", count, limits.max_regions).map_err(corrupt)?;
        r.ensure_room(count, MIN_REGION_LEN, "regions")?;
        let mut regions = Vec::with_capacity(count);
        for i in 0..count {
            regions.push(
                decode_region(r, backends.len(), limits)
                    .map_err(|e| within(e, format_args!("region {i}")))?,
            );
        }

        Ok(Self {
            name,
            instance,
            partial,
            backends,
            regions,
        })
    }

    /// Check everything [`encode`](Self::encode) promises to reject.
    fn validate(&self, limits: &Limits) -> Result<()> {
        check_name(&self.name, limits).map_err(|m| invalid(format!("agent name: {m}")))?;
        check_count("backends", self.backends.len(), limits.max_backends).map_err(invalid)?;
        for (i, backend) in self.backends.iter().enumerate() {
            check_name(&backend.name, limits)
                .map_err(|m| invalid(format!("backend {i}: name: {m}")))?;
            if let Some(info) = &backend.conn_info {
                check_conn_info(info.len(), limits)
                    .map_err(|m| invalid(format!("backend {i}: {m}")))?;
            }
        }
        check_count("regions", self.regions.len(), limits.max_regions).map_err(invalid)?;
        for (i, region) in self.regions.iter().enumerate() {
            check_span(region.addr, region.len).map_err(|m| invalid(format!("region {i}: {m}")))?;
            check_count("blobs", region.blobs.len(), usize::from(u16::MAX))
                .map_err(|m| invalid(format!("region {i}: {m}")))?;
            for (j, blob) in region.blobs.iter().enumerate() {
                check_blob(blob.backend, self.backends.len(), blob.blob.len(), limits)
                    .map_err(|m| invalid(format!("region {i}: blob {j}: {m}")))?;
            }
        }
        let total = self.encoded_len();
        if total > limits.max_total {
            return Err(invalid(format!(
                "encoding would be {total} bytes > limit {}",
                limits.max_total
            )));
        }
        Ok(())
    }
}

fn decode_name(r: &mut Reader<'_>, limits: &Limits) -> Result<String> {
    let len = usize::from(r.u16()?);
    check_name_len(len, limits).map_err(corrupt)?;
    let raw = r.bytes(len)?;
    let name = std::str::from_utf8(raw).map_err(|e| corrupt(format!("not valid UTF-8 ({e})")))?;
    Ok(name.to_owned())
}

fn decode_backend(r: &mut Reader<'_>, limits: &Limits) -> Result<BackendMeta> {
    let name = decode_name(r, limits).map_err(|e| within(e, "name"))?;
    let conn_info = match r.u8()? {
        0 => None,
        1 => {
            let len = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
            check_conn_info(len, limits).map_err(corrupt)?;
            Some(r.bytes(len)?.to_vec())
        }
        other => {
            return Err(corrupt(format!(
                "connection info flag {other} is neither 0 nor 1"
            )))
        }
    };
    Ok(BackendMeta { name, conn_info })
}

fn decode_region(r: &mut Reader<'_>, backends: usize, limits: &Limits) -> Result<RegionMeta> {
    let id = r.u64()?;
    let kind = match r.u8()? {
        TAG_DRAM => MemKind::Dram,
        TAG_VRAM => MemKind::Vram { device: r.u32()? },
        other => return Err(corrupt(format!("unknown memory kind tag {other}"))),
    };
    let addr = r.u64()?;
    let len = r.u64()?;
    check_span(addr, len).map_err(corrupt)?;

    let count = usize::from(r.u16()?);
    r.ensure_room(count, MIN_BLOB_LEN, "blobs")?;
    let mut blobs = Vec::with_capacity(count);
    for j in 0..count {
        blobs.push(
            decode_blob(r, backends, limits).map_err(|e| within(e, format_args!("blob {j}")))?,
        );
    }
    Ok(RegionMeta {
        id,
        kind,
        addr,
        len,
        blobs,
    })
}

fn decode_blob(r: &mut Reader<'_>, backends: usize, limits: &Limits) -> Result<RegionBlob> {
    let backend = r.u16()?;
    let len = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
    check_blob(backend, backends, len, limits).map_err(corrupt)?;
    let blob = r.bytes(len)?.to_vec();
    Ok(RegionBlob { backend, blob })
}

// Checks shared by encode (which reports them as InvalidArgument) and decode (Corrupt).

fn check_name_len(len: usize, limits: &Limits) -> Result<(), String> {
    if len == 0 {
        Err("empty".to_owned())
    } else if len > limits.max_name {
        Err(format!("{len} bytes > limit {}", limits.max_name))
    } else {
        Ok(())
    }
}

fn check_name(name: &str, limits: &Limits) -> Result<(), String> {
    check_name_len(name.len(), limits)
}

fn check_count(what: &str, count: usize, max: usize) -> Result<(), String> {
    if count > max {
        Err(format!("{count} {what} > limit {max}"))
    } else {
        Ok(())
    }
}

fn check_conn_info(len: usize, limits: &Limits) -> Result<(), String> {
    if len > limits.max_conn_info {
        Err(format!(
            "connection info {len} bytes > limit {}",
            limits.max_conn_info
        ))
    } else {
        Ok(())
    }
}

fn check_span(addr: u64, len: u64) -> Result<(), String> {
    if len == 0 {
        Err("length 0".to_owned())
    } else if addr.checked_add(len).is_none() {
        Err(format!("addr {addr:#x} + len {len:#x} overflows u64"))
    } else {
        Ok(())
    }
}

fn check_blob(backend: u16, backends: usize, len: usize, limits: &Limits) -> Result<(), String> {
    if usize::from(backend) >= backends {
        Err(format!("backend index {backend} >= {backends} backends"))
    } else if len > limits.max_blob {
        Err(format!("{len} bytes > limit {}", limits.max_blob))
    } else {
        Ok(())
    }
}

fn corrupt(context: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, DECODE, context)
}

fn invalid(context: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, ENCODE, context)
}

/// Prefix an error's context with where it happened.
pub(crate) fn within(e: Error, place: impl fmt::Display) -> Error {
    Error::new(e.kind(), e.operation(), format!("{place}: {}", e.context()))
}

/// Bounds-checked little-endian reads over untrusted bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], pos: usize) -> Self {
        Self { buf, pos }
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn truncated(&self, need: usize) -> Error {
        corrupt(format!(
            "truncated at byte {}: need {need} bytes, {} left",
            self.pos,
            self.remaining()
        ))
    }

    /// Fail unless the rest of the input can hold `count` items of at least
    /// `min_each` bytes, so a forged count cannot force a huge allocation.
    fn ensure_room(&self, count: usize, min_each: usize, what: &str) -> Result<()> {
        match count.checked_mul(min_each) {
            Some(need) if need <= self.remaining() => Ok(()),
            _ => Err(corrupt(format!(
                "{count} {what} cannot fit in the {} bytes left at byte {}",
                self.remaining(),
                self.pos
            ))),
        }
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let slice = self
            .pos
            .checked_add(n)
            .and_then(|end| self.buf.get(self.pos..end))
            .ok_or_else(|| self.truncated(n))?;
        self.pos += n; // Cannot overflow: `pos + n` was just checked to be in bounds.
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let array = self
            .buf
            .get(self.pos..)
            .and_then(<[u8]>::first_chunk::<N>)
            .ok_or_else(|| self.truncated(N))?;
        self.pos += N; // Cannot overflow: `pos + N <= buf.len()`.
        Ok(*array)
    }

    fn u8(&mut self) -> Result<u8> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Result<u16> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_name(out: &mut Vec<u8>, name: &str) -> Result<()> {
    put_u16(out, narrow(name.len(), "name length")?);
    out.extend_from_slice(name.as_bytes());
    Ok(())
}

fn put_bytes32(out: &mut Vec<u8>, bytes: &[u8], what: &str) -> Result<()> {
    put_u32(out, narrow(bytes.len(), what)?);
    out.extend_from_slice(bytes);
    Ok(())
}

/// Convert a length for the wire. `validate` already guarantees it fits; this keeps
/// `encode` from ever writing a silently truncated length.
fn narrow<T: TryFrom<usize>>(n: usize, what: &str) -> Result<T> {
    T::try_from(n).map_err(|_| invalid(format!("{what} {n} does not fit its wire field")))
}

/// CRC-32 (IEEE, reflected polynomial 0xEDB88320), the zlib checksum.
fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "prefill-0".to_owned(),
            instance: 0x0123_4567_89ab_cdef,
            partial: false,
            backends: vec![
                BackendMeta {
                    name: "tcp".to_owned(),
                    conn_info: Some(b"10.0.0.1:7000".to_vec()),
                },
                BackendMeta {
                    name: "ucx".to_owned(),
                    conn_info: Some(vec![]),
                },
            ],
            regions: vec![
                RegionMeta {
                    id: 1,
                    kind: MemKind::Dram,
                    addr: 0x7f00_0000_1000,
                    len: 4096,
                    blobs: vec![
                        RegionBlob {
                            backend: 0,
                            blob: vec![1, 2, 3],
                        },
                        RegionBlob {
                            backend: 1,
                            blob: vec![],
                        },
                    ],
                },
                RegionMeta {
                    id: 2,
                    kind: MemKind::Vram { device: 3 },
                    addr: 0xdead_0000,
                    len: 1 << 30,
                    blobs: vec![RegionBlob {
                        backend: 1,
                        blob: vec![0xaa; 40],
                    }],
                },
                RegionMeta {
                    id: 3,
                    kind: MemKind::Dram,
                    addr: u64::MAX - 1,
                    len: 1,
                    blobs: vec![],
                },
            ],
        }
    }

    fn partial() -> AgentMetadata {
        AgentMetadata {
            name: "décode-ü".to_owned(),
            instance: 7,
            partial: true,
            backends: vec![BackendMeta {
                name: "tcp".to_owned(),
                conn_info: None,
            }],
            regions: vec![RegionMeta {
                id: 9,
                kind: MemKind::Vram { device: u32::MAX },
                addr: 0,
                len: u64::MAX,
                blobs: vec![RegionBlob {
                    backend: 0,
                    blob: b"rkey".to_vec(),
                }],
            }],
        }
    }

    fn empty() -> AgentMetadata {
        AgentMetadata {
            name: "x".to_owned(),
            instance: 0,
            partial: false,
            backends: vec![],
            regions: vec![],
        }
    }

    fn samples() -> Vec<AgentMetadata> {
        vec![sample(), partial(), empty()]
    }

    fn round_trip(meta: &AgentMetadata) {
        let bytes = meta.encode().unwrap();
        assert_eq!(bytes.len(), meta.encoded_len());
        let back = AgentMetadata::decode(&bytes).unwrap();
        assert_eq!(&back, meta);
        assert_eq!(back.encode().unwrap(), bytes, "encoding is canonical");
    }

    /// Frame a raw body (valid header, correct length and checksum).
    fn frame(version: u16, flags: u16, body: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        put_u16(&mut out, version);
        put_u16(&mut out, flags);
        put_u32(&mut out, u32::try_from(body.len()).unwrap());
        out.extend_from_slice(body);
        let crc = crc32(&out);
        put_u32(&mut out, crc);
        out
    }

    /// Fix `bytes`' header length and checksum so the body parser gets to see it.
    fn reseal(bytes: &mut [u8]) {
        if bytes.len() < HEADER_LEN + TRAILER_LEN {
            return;
        }
        let body = u32::try_from(bytes.len() - HEADER_LEN - TRAILER_LEN).unwrap();
        bytes[8..12].copy_from_slice(&body.to_le_bytes());
        let n = bytes.len() - TRAILER_LEN;
        let crc = crc32(&bytes[..n]);
        bytes[n..].copy_from_slice(&crc.to_le_bytes());
    }

    fn kind_of(bytes: &[u8]) -> ErrorKind {
        AgentMetadata::decode(bytes).unwrap_err().kind()
    }

    /// Body start: agent name "x", instance 0.
    fn body_prefix() -> Vec<u8> {
        let mut b = Vec::new();
        put_u16(&mut b, 1);
        b.push(b'x');
        put_u64(&mut b, 0);
        b
    }

    #[test]
    fn crc32_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        assert_eq!(
            crc32(b"The quick brown fox jumps over the lazy dog"),
            0x414F_A339
        );
    }

    #[test]
    fn round_trips() {
        for meta in samples() {
            round_trip(&meta);
        }
    }

    #[test]
    fn layout_is_as_documented() {
        let bytes = empty().encode().unwrap();
        let mut expected = MAGIC.to_vec();
        expected.extend_from_slice(&[1, 0, 0, 0]);
        expected.extend_from_slice(&17u32.to_le_bytes());
        expected.extend_from_slice(&[1, 0, b'x']);
        expected.extend_from_slice(&[0; 8]);
        expected.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        let crc = crc32(&expected);
        expected.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(bytes, expected);

        let bytes = partial().encode().unwrap();
        assert_eq!(&bytes[6..8], &[1, 0], "partial flag");
    }

    #[test]
    fn bad_magic() {
        let mut bytes = sample().encode().unwrap();
        bytes[0] = b'X';
        assert_eq!(kind_of(&bytes), ErrorKind::Corrupt);
        assert_eq!(kind_of(b"NXM"), ErrorKind::Corrupt);
        assert_eq!(kind_of(b""), ErrorKind::Corrupt);
    }

    #[test]
    fn unsupported_version() {
        for version in [0, 2, u16::MAX] {
            let mut bytes = sample().encode().unwrap();
            bytes[4..6].copy_from_slice(&version.to_le_bytes());
            assert_eq!(kind_of(&bytes), ErrorKind::NotSupported);
            // Even when the rest is not a v1 layout at all.
            assert_eq!(
                kind_of(&frame(version, 0xffff, b"future")),
                ErrorKind::NotSupported
            );
        }
    }

    #[test]
    fn unknown_flags() {
        let mut bytes = sample().encode().unwrap();
        bytes[6] |= 0x2;
        reseal(&mut bytes);
        let err = AgentMetadata::decode(&bytes).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.context().contains("flag"), "{err}");
    }

    #[test]
    fn bad_checksum() {
        let bytes = sample().encode().unwrap();
        for i in [HEADER_LEN, bytes.len() / 2, bytes.len() - 1] {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            let err = AgentMetadata::decode(&b).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt);
            assert!(err.context().contains("checksum"), "{err}");
        }
    }

    #[test]
    fn every_truncation_is_corrupt() {
        for meta in samples() {
            let bytes = meta.encode().unwrap();
            for n in 0..bytes.len() {
                assert_eq!(kind_of(&bytes[..n]), ErrorKind::Corrupt, "prefix {n}");
                // And with a consistent header and checksum, so the body parser sees it.
                let mut cut = bytes[..n].to_vec();
                reseal(&mut cut);
                assert_eq!(kind_of(&cut), ErrorKind::Corrupt, "resealed prefix {n}");
            }
        }
    }

    #[test]
    fn trailing_bytes() {
        let mut bytes = sample().encode().unwrap();
        bytes.push(0);
        let err = AgentMetadata::decode(&bytes).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.context().contains("trailing"), "{err}");

        // Extra bytes inside a correctly framed body are caught too.
        let mut bytes = sample().encode().unwrap();
        bytes.insert(bytes.len() - TRAILER_LEN, 0);
        reseal(&mut bytes);
        let err = AgentMetadata::decode(&bytes).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.context().contains("unread"), "{err}");
    }

    #[test]
    fn huge_counts_fail_fast() {
        let unlimited = Limits {
            max_total: usize::MAX,
            max_name: usize::MAX,
            max_backends: usize::MAX,
            max_conn_info: usize::MAX,
            max_regions: usize::MAX,
            max_blob: usize::MAX,
        };

        // Region count 0xFFFF_FFFF with nothing after it.
        let mut body = body_prefix();
        put_u16(&mut body, 0);
        put_u32(&mut body, u32::MAX);
        let bytes = frame(VERSION, 0, &body);
        for limits in [Limits::default(), unlimited] {
            let err = AgentMetadata::decode_with_limits(&bytes, &limits).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        }

        // Backend count 0xFFFF.
        let mut body = body_prefix();
        put_u16(&mut body, u16::MAX);
        let err =
            AgentMetadata::decode_with_limits(&frame(VERSION, 0, &body), &unlimited).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.context().contains("cannot fit"), "{err}");

        // Connection info of 4 GiB.
        let mut body = body_prefix();
        put_u16(&mut body, 1);
        put_u16(&mut body, 1);
        body.extend_from_slice(b"t\x01");
        put_u32(&mut body, u32::MAX);
        let err =
            AgentMetadata::decode_with_limits(&frame(VERSION, 0, &body), &unlimited).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);

        // Blob count 0xFFFF and a 4 GiB blob.
        for (blobs, blob_len) in [(u16::MAX, 0), (1, u32::MAX)] {
            let mut body = body_prefix();
            put_u16(&mut body, 1);
            put_u16(&mut body, 1);
            body.extend_from_slice(b"t\x00");
            put_u32(&mut body, 1);
            put_u64(&mut body, 1);
            body.push(TAG_DRAM);
            put_u64(&mut body, 0x1000);
            put_u64(&mut body, 0x1000);
            put_u16(&mut body, blobs);
            put_u16(&mut body, 0);
            put_u32(&mut body, blob_len);
            let err = AgentMetadata::decode_with_limits(&frame(VERSION, 0, &body), &unlimited)
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        }

        // A body length of 4 GiB.
        let mut bytes = empty().encode().unwrap();
        bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        for limits in [Limits::default(), unlimited] {
            let err = AgentMetadata::decode_with_limits(&bytes, &limits).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt);
        }
    }

    #[test]
    fn semantic_errors_are_corrupt_and_located() {
        let cases: Vec<(AgentMetadata, &str)> = vec![
            (
                {
                    let mut m = sample();
                    m.regions[1].blobs[0].backend = 7;
                    m
                },
                "region 1: blob 0: backend index 7 >= 2 backends",
            ),
            (
                {
                    let mut m = sample();
                    m.regions[2].len = 0;
                    m
                },
                "region 2: length 0",
            ),
            (
                {
                    let mut m = sample();
                    m.regions[2].len = 2;
                    m
                },
                "region 2: addr 0xfffffffffffffffe + len 0x2 overflows u64",
            ),
            (
                {
                    let mut m = sample();
                    m.name.clear();
                    m
                },
                "agent name: empty",
            ),
            (
                {
                    let mut m = sample();
                    m.backends[1].name.clear();
                    m
                },
                "backend 1: name: empty",
            ),
        ];
        for (meta, message) in cases {
            let err = meta.encode().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument);
            assert_eq!(err.context(), message);
            let bytes = encode_unchecked(&meta);
            let err = AgentMetadata::decode(&bytes).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt);
            assert_eq!(err.context(), message);
        }
    }

    /// Encode without validation, to produce invalid-but-well-framed input.
    fn encode_unchecked(meta: &AgentMetadata) -> Vec<u8> {
        let mut body = Vec::new();
        put_u16(&mut body, u16::try_from(meta.name.len()).unwrap());
        body.extend_from_slice(meta.name.as_bytes());
        put_u64(&mut body, meta.instance);
        put_u16(&mut body, u16::try_from(meta.backends.len()).unwrap());
        for b in &meta.backends {
            put_u16(&mut body, u16::try_from(b.name.len()).unwrap());
            body.extend_from_slice(b.name.as_bytes());
            match &b.conn_info {
                None => body.push(0),
                Some(c) => {
                    body.push(1);
                    put_u32(&mut body, u32::try_from(c.len()).unwrap());
                    body.extend_from_slice(c);
                }
            }
        }
        put_u32(&mut body, u32::try_from(meta.regions.len()).unwrap());
        for r in &meta.regions {
            put_u64(&mut body, r.id);
            match r.kind {
                MemKind::Dram => body.push(0),
                MemKind::Vram { device } | MemKind::File { fd: device } => {
                    body.push(1);
                    put_u32(&mut body, device);
                }
            }
            put_u64(&mut body, r.addr);
            put_u64(&mut body, r.len);
            put_u16(&mut body, u16::try_from(r.blobs.len()).unwrap());
            for b in &r.blobs {
                put_u16(&mut body, b.backend);
                put_u32(&mut body, u32::try_from(b.blob.len()).unwrap());
                body.extend_from_slice(&b.blob);
            }
        }
        frame(VERSION, u16::from(meta.partial), &body)
    }

    #[test]
    fn encode_unchecked_matches_encode() {
        for meta in samples() {
            assert_eq!(encode_unchecked(&meta), meta.encode().unwrap());
        }
    }

    #[test]
    fn malformed_fields_are_corrupt() {
        let meta = sample();
        let bytes = meta.encode().unwrap();
        let name_at = HEADER_LEN + 2;
        let backends_at = name_at + meta.name.len() + 8;
        let has_conn_at = backends_at + 2 + 2 + meta.backends[0].name.len();
        let mut head = meta.clone();
        head.regions.clear();
        let regions_at = head.encoded_len() - TRAILER_LEN - 4;
        let tag_at = regions_at + 4 + 8;
        assert_eq!(bytes[tag_at], TAG_DRAM);

        for (at, value, needle) in [
            (name_at, 0xff, "UTF-8"),
            (has_conn_at, 2, "neither 0 nor 1"),
            (tag_at, 7, "unknown memory kind tag 7"),
        ] {
            let mut b = bytes.clone();
            b[at] = value;
            reseal(&mut b);
            let err = AgentMetadata::decode(&b).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt);
            assert!(err.context().contains(needle), "{err}");
        }
    }

    #[test]
    fn decode_limits_respected() {
        let bytes = sample().encode().unwrap();
        let base = Limits::default();
        let tight = [
            Limits {
                max_total: bytes.len() - 1,
                ..base
            },
            Limits {
                max_name: "prefill-0".len() - 1,
                ..base
            },
            Limits {
                max_backends: 1,
                ..base
            },
            Limits {
                max_conn_info: 12,
                ..base
            },
            Limits {
                max_regions: 2,
                ..base
            },
            Limits {
                max_blob: 39,
                ..base
            },
        ];
        for limits in tight {
            let err = AgentMetadata::decode_with_limits(&bytes, &limits).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{limits:?}");
            assert!(
                err.context().contains("limit") || err.context().contains("fit"),
                "{err}"
            );
        }
        let exact = Limits {
            max_total: bytes.len(),
            max_name: 9,
            max_backends: 2,
            max_conn_info: 13,
            max_regions: 3,
            max_blob: 40,
        };
        assert_eq!(
            AgentMetadata::decode_with_limits(&bytes, &exact).unwrap(),
            sample()
        );
    }

    #[test]
    fn encode_limits_respected() {
        let limits = Limits::default();
        let mut cases = Vec::new();

        let mut m = empty();
        m.name = "n".repeat(limits.max_name + 1);
        cases.push(m);

        let mut m = sample();
        m.backends[0].name = "b".repeat(limits.max_name + 1);
        cases.push(m);

        let mut m = empty();
        m.backends = (0..=limits.max_backends)
            .map(|i| BackendMeta {
                name: format!("b{i}"),
                conn_info: None,
            })
            .collect();
        cases.push(m);

        let mut m = sample();
        m.backends[0].conn_info = Some(vec![0; limits.max_conn_info + 1]);
        cases.push(m);

        let mut m = sample();
        m.regions[0].blobs[0].blob = vec![0; limits.max_blob + 1];
        cases.push(m);

        let mut m = sample();
        m.regions[0].blobs = (0..=u32::from(u16::MAX))
            .map(|_| RegionBlob {
                backend: 0,
                blob: vec![],
            })
            .collect();
        cases.push(m);

        for m in cases {
            assert_eq!(m.encode().unwrap_err().kind(), ErrorKind::InvalidArgument);
        }

        // At the limits, everything still round-trips.
        let mut m = sample();
        m.name = "n".repeat(limits.max_name);
        m.backends[0].conn_info = Some(vec![1; limits.max_conn_info]);
        m.regions[0].blobs[0].blob = vec![2; limits.max_blob];
        m.backends
            .extend((2..limits.max_backends).map(|i| BackendMeta {
                name: format!("b{i}"),
                conn_info: None,
            }));
        round_trip(&m);
    }

    #[test]
    fn total_limit_on_encode() {
        // 2,400 regions each with 7 full 4 KiB blobs is just over 64 MiB.
        let limits = Limits::default();
        let blobs: Vec<RegionBlob> = (0..7)
            .map(|_| RegionBlob {
                backend: 0,
                blob: vec![0; limits.max_blob],
            })
            .collect();
        let mut m = sample();
        m.regions = (0..2400)
            .map(|i| RegionMeta {
                id: i,
                kind: MemKind::Dram,
                addr: 0,
                len: 1,
                blobs: blobs.clone(),
            })
            .collect();
        assert!(m.encoded_len() > limits.max_total);
        let err = m.encode().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.context().contains("limit"), "{err}");
    }

    #[test]
    fn many_regions_round_trip() {
        let mut m = empty();
        m.backends.push(BackendMeta {
            name: "tcp".to_owned(),
            conn_info: None,
        });
        m.partial = true;
        m.regions = (0..10_000)
            .map(|i| RegionMeta {
                id: i,
                kind: if i % 2 == 0 {
                    MemKind::Dram
                } else {
                    MemKind::Vram { device: 1 }
                },
                addr: i << 20,
                len: 1 << 20,
                blobs: vec![RegionBlob {
                    backend: 0,
                    blob: i.to_le_bytes().to_vec(),
                }],
            })
            .collect();
        round_trip(&m);
    }

    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        fn below(&mut self, n: usize) -> usize {
            usize::try_from(self.next() % u64::try_from(n.max(1)).unwrap()).unwrap()
        }
    }

    #[test]
    fn mini_fuzz_never_panics() {
        let seeds: Vec<Vec<u8>> = samples().iter().map(|m| m.encode().unwrap()).collect();
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let mut accepted = 0;
        for _ in 0..20_000 {
            let mut bytes = seeds[rng.below(seeds.len())].clone();
            for _ in 0..=rng.below(4) {
                match rng.below(6) {
                    0 => {
                        let i = rng.below(bytes.len());
                        if let Some(b) = bytes.get_mut(i) {
                            *b ^= 1 << rng.below(8);
                        }
                    }
                    1 => {
                        let i = rng.below(bytes.len());
                        if let Some(b) = bytes.get_mut(i) {
                            *b = rng.next() as u8;
                        }
                    }
                    2 => {
                        let n = rng.below(bytes.len() + 1);
                        bytes.truncate(n);
                    }
                    3 => {
                        let i = rng.below(bytes.len() + 1);
                        bytes.insert(i, rng.next() as u8);
                    }
                    4 => {
                        if !bytes.is_empty() {
                            let i = rng.below(bytes.len());
                            bytes.remove(i);
                        }
                    }
                    _ => {
                        // Plant a large little-endian value (a forged length or count).
                        let i = rng.below(bytes.len());
                        for (k, v) in [0xff, 0xff, 0xff, 0x7f].into_iter().enumerate() {
                            if let Some(b) = bytes.get_mut(i + k) {
                                *b = v;
                            }
                        }
                    }
                }
            }
            // Usually fix up the framing so the mutation reaches the body parser.
            if rng.below(4) != 0 {
                reseal(&mut bytes);
            }
            match AgentMetadata::decode(&bytes) {
                Ok(meta) => {
                    accepted += 1;
                    assert_eq!(
                        meta.encode().unwrap(),
                        bytes,
                        "accepted input must be canonical"
                    );
                }
                Err(e) => assert!(
                    matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::NotSupported),
                    "{e}"
                ),
            }
        }
        // Some mutations (e.g. of an id or address) keep the input valid.
        assert!(accepted > 0);
    }
}
