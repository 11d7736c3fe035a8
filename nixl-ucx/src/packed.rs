//! UCX's packed objects from peers' metadata, checked before UCX parses them.
//!
//! A worker address (a peer's connection info) goes to `ucp_ep_create` and a packed
//! remote key (inside a registration's blob) to `ucp_ep_rkey_unpack`; neither call
//! takes a length, so UCX reads as far as the bytes tell it to. Both come from
//! metadata, which anyone may send when no shared secret is set. Before UCX sees
//! them:
//!
//! - **Structure.** What both UCX 1.13 and 1.22 read first is checked exactly: a
//!   worker address's header (version 1 or 2; an unknown version makes UCX abort the
//!   process on `ucs_assertv_always`; version 2's flag byte has only the four flags
//!   UCX defines; the worker id, client id and debug name the flags announce are
//!   there), and a packed key's whole layout (`md_map` as a native `u64`, a memory
//!   type UCX knows (host, CUDA, CUDA managed, ROCm, ROCm managed: the same numbers
//!   in every version), then one length byte and that many bytes per memory domain
//!   in the map). Sizes are bounded ([`MAX_ADDRESS`], [`MAX_RKEY`]).
//! - **Bounds.** UCX is then given a copy followed by zeroed padding large enough
//!   that no parse can leave the buffer, whatever the bytes say:
//!   - A packed key's per-domain keys are read by each transport from its own start,
//!     each at most 255 bytes (UCX packs their sizes in one byte), strings ending at
//!     a NUL: [`RKEY_PAD`] zero bytes cover any of them starting inside the copy.
//!   - A worker address's device list is walked until a byte with its LAST flag. A
//!     length read from the copy moves the walk at most 255 (+ a few) bytes on; once
//!     it is in the zeros every length is 0 and no LAST flag is set, so each entry is
//!     a handful of bytes (device: index and length; transport: checksum, attributes
//!     of at most 64 bytes, length; endpoint address: length and lane) and UCX stops
//!     with an error at its limit of 128 transport entries (64 endpoint addresses
//!     each: `UCP_MAX_RESOURCES`, `UCP_MAX_LANES`), well within [`ADDRESS_PAD`].
//!     Transports then read their device and interface addresses (fixed sizes) from
//!     inside the padded copy too.
//!
//! This bounds every read to our buffer and refuses what makes UCX abort at once; it
//! does not make a hostile address or key *meaningful*: UCX may still refuse it
//! (an error), or connect to, map or write to what it names, as it would for any
//! address or key a peer hands out (see the crate docs, **One-sided**). Metadata with
//! a shared secret comes from holders of the secret only.

use std::fmt;

/// Largest worker address accepted (real ones are hundreds of bytes to a few KiB).
pub(crate) const MAX_ADDRESS: usize = 64 << 10;
/// Zeroed bytes after a worker address handed to UCX (see the module docs).
pub(crate) const ADDRESS_PAD: usize = 64 << 10;
/// Largest packed remote key accepted: the fixed part, 64 domains of 1 + 255 bytes,
/// and room for what UCX 1.14 and later append (the memory's device and distances,
/// which `ucp_ep_rkey_unpack` does not read).
pub(crate) const MAX_RKEY: usize = 9 + 64 * 256 + 4096;
/// Zeroed bytes after a packed remote key handed to UCX (see the module docs).
pub(crate) const RKEY_PAD: usize = 512;

/// `UCS_MEMORY_TYPE_ROCM_MANAGED`: the last memory type both 1.13 and 1.22 define.
const MAX_MEMORY_TYPE: u8 = 4;
/// `UCP_ADDRESS_HEADER_FLAG_*` (debug info, worker uuid, client id, AM only).
const ADDR_FLAG_DEBUG_INFO: u8 = 1 << 0;
const ADDR_FLAG_WORKER_UUID: u8 = 1 << 1;
const ADDR_FLAG_CLIENT_ID: u8 = 1 << 2;
const ADDR_FLAGS_KNOWN: u8 = 0x0f;

/// Why a packed object was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refused(pub(crate) String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

fn refuse<T>(why: impl Into<String>) -> Result<T, Refused> {
    Err(Refused(why.into()))
}

/// Check a worker address's structure (see the module docs).
///
/// # Errors
/// What is wrong with it.
pub(crate) fn check_address(a: &[u8]) -> Result<(), Refused> {
    if a.len() > MAX_ADDRESS {
        return refuse(format!(
            "worker address of {} bytes (at most {MAX_ADDRESS})",
            a.len()
        ));
    }
    let Some(&first) = a.first() else {
        return refuse("empty worker address");
    };
    // ucp_address_unpack_header: the version in the low 4 bits.
    let (flags, mut off) = match first & 0x0f {
        // Version 1: flags in the high 4 bits; the worker id is always read.
        0 => (first >> 4 | ADDR_FLAG_WORKER_UUID, 1),
        1 => {
            let Some(&flags) = a.get(1) else {
                return refuse("worker address of version 2 without its flag byte");
            };
            if flags & !ADDR_FLAGS_KNOWN != 0 {
                return refuse(format!("worker address with unknown flags {flags:#04x}"));
            }
            (flags, 2)
        }
        v => {
            return refuse(format!(
                "worker address of unknown version {v} (UCX knows 1 and 2, as 0 and 1)"
            ))
        }
    };
    let need = |off: usize, n: usize, what: &str| -> Result<usize, Refused> {
        match off.checked_add(n) {
            Some(end) if end <= a.len() => Ok(end),
            _ => refuse(format!(
                "worker address of {} bytes ends inside its {what}",
                a.len()
            )),
        }
    };
    if flags & ADDR_FLAG_WORKER_UUID != 0 {
        off = need(off, 8, "worker id")?;
    }
    if flags & ADDR_FLAG_CLIENT_ID != 0 {
        off = need(off, 8, "client id")?;
    }
    if flags & ADDR_FLAG_DEBUG_INFO != 0 {
        let n = *a.get(off).ok_or_else(|| {
            Refused(format!(
                "worker address of {} bytes ends before its name",
                a.len()
            ))
        })?;
        off = need(off + 1, n as usize, "name")?;
    }
    // The device list, or the one byte saying it is empty.
    need(off, 1, "device list")?;
    Ok(())
}

/// Check a packed remote key's structure (see the module docs).
///
/// # Errors
/// What is wrong with it.
pub(crate) fn check_rkey(k: &[u8]) -> Result<(), Refused> {
    if k.len() > MAX_RKEY {
        return refuse(format!(
            "packed remote key of {} bytes (at most {MAX_RKEY})",
            k.len()
        ));
    }
    if k.len() < 9 {
        return refuse(format!(
            "packed remote key of {} bytes (its fixed part is 9)",
            k.len()
        ));
    }
    let md_map = u64::from_ne_bytes(k[..8].try_into().expect("8 bytes"));
    let mem_type = k[8];
    if mem_type > MAX_MEMORY_TYPE {
        return refuse(format!(
            "packed remote key of unknown memory type {mem_type}"
        ));
    }
    let mut off = 9usize;
    for md in (0..64).filter(|i| md_map & (1u64 << i) != 0) {
        let Some(&n) = k.get(off) else {
            return refuse(format!(
                "packed remote key of {} bytes ends before memory domain {md}'s key",
                k.len()
            ));
        };
        off += 1 + n as usize;
        if off > k.len() {
            return refuse(format!(
                "packed remote key of {} bytes ends inside memory domain {md}'s key",
                k.len()
            ));
        }
    }
    Ok(())
}

/// A checked object, copied with zeroed padding after it: what UCX is given.
#[derive(Debug)]
pub(crate) struct Padded(Vec<u8>);

impl Padded {
    fn new(bytes: &[u8], pad: usize) -> Self {
        let mut v = Vec::with_capacity(bytes.len() + pad);
        v.extend_from_slice(bytes);
        v.resize(bytes.len() + pad, 0);
        Self(v)
    }

    /// A worker address, checked and padded.
    ///
    /// # Errors
    /// As [`check_address`].
    pub(crate) fn address(a: &[u8]) -> Result<Self, Refused> {
        check_address(a)?;
        Ok(Self::new(a, ADDRESS_PAD))
    }

    /// A packed remote key, checked and padded.
    ///
    /// # Errors
    /// As [`check_rkey`].
    pub(crate) fn rkey(k: &[u8]) -> Result<Self, Refused> {
        check_rkey(k)?;
        Ok(Self::new(k, RKEY_PAD))
    }

    /// The object and its padding.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A well-formed packed key: `keys` per domain of `md_map` (cycled), `trailer`
    /// after them.
    fn rkey(md_map: u64, mem_type: u8, keys: &[Vec<u8>], trailer: &[u8]) -> Vec<u8> {
        let mut v = md_map.to_ne_bytes().to_vec();
        v.push(mem_type);
        for (i, _) in (0..64).filter(|i| md_map & (1u64 << i) != 0).enumerate() {
            let k = &keys[i % keys.len()];
            v.push(k.len() as u8);
            v.extend_from_slice(k);
        }
        v.extend_from_slice(trailer);
        v
    }

    /// A well-formed address header (version 1 or 2, with these flags) and `rest`.
    fn address(v2: bool, flags: u8, name: &[u8], rest: &[u8]) -> Vec<u8> {
        let mut v = if v2 { vec![1, flags] } else { vec![flags << 4] };
        if !v2 || flags & ADDR_FLAG_WORKER_UUID != 0 {
            v.extend_from_slice(&7u64.to_ne_bytes());
        }
        if flags & ADDR_FLAG_CLIENT_ID != 0 {
            v.extend_from_slice(&9u64.to_ne_bytes());
        }
        if flags & ADDR_FLAG_DEBUG_INFO != 0 {
            v.push(name.len() as u8);
            v.extend_from_slice(name);
        }
        v.extend_from_slice(rest);
        v
    }

    #[test]
    fn garbage_and_truncated_objects_are_refused() {
        assert!(check_address(&[]).is_err());
        // Unknown versions (UCX would abort on them).
        for v in 2..16u8 {
            assert!(check_address(&address(false, 0, b"", &[0xff])[..]).is_ok());
            let mut a = address(false, 0, b"", &[0xff]);
            a[0] = v;
            assert!(check_address(&a).is_err(), "version nibble {v}");
        }
        // Version 2 with flags UCX does not define.
        assert!(check_address(&[1, 0x10, 0xff]).is_err());
        // Header fields cut short.
        assert!(check_address(&[0, 1, 2, 3]).is_err());
        assert!(check_address(&[1]).is_err());
        let named = address(true, ADDR_FLAG_DEBUG_INFO, b"worker-name", &[0xff]);
        assert!(check_address(&named).is_ok());
        assert!(check_address(&named[..named.len() - 2]).is_err());
        assert!(check_address(&vec![0u8; MAX_ADDRESS + 1]).is_err());

        assert!(check_rkey(&[]).is_err());
        assert!(check_rkey(&[0; 8]).is_err());
        let k = rkey(0b1011, 0, &[vec![1; 40], vec![2; 0], vec![3; 255]], &[]);
        assert!(check_rkey(&k).is_ok());
        for n in 0..k.len() {
            assert!(check_rkey(&k[..n]).is_err(), "cut at {n}");
        }
        assert!(
            check_rkey(&rkey(1, 5, &[vec![0; 8]], &[])).is_err(),
            "memory type 5"
        );
        let most = rkey(u64::MAX, 0, &[vec![0; 255]], &[0; 4096]);
        assert!(check_rkey(&most).is_ok(), "the longest");
        let mut over = most;
        over.push(0);
        assert!(check_rkey(&over).is_err(), "too long");
    }

    #[test]
    fn padding_follows_the_object() {
        let k = rkey(1, 1, &[vec![5; 10]], &[]);
        let p = Padded::rkey(&k).unwrap();
        assert_eq!(&p.bytes()[..k.len()], &k[..]);
        assert_eq!(p.bytes().len(), k.len() + RKEY_PAD);
        assert!(p.bytes()[k.len()..].iter().all(|&b| b == 0));
        let a = address(false, 0, b"", &[0xff]);
        let p = Padded::address(&a).unwrap();
        assert_eq!(p.bytes().len(), a.len() + ADDRESS_PAD);
        assert!(p.bytes()[a.len()..].iter().all(|&b| b == 0));
        assert!(Padded::rkey(&k[..5]).is_err());
    }

    proptest! {
        /// Nothing panics, and what is accepted has its fixed parts inside it.
        #[test]
        fn any_bytes(data in proptest::collection::vec(any::<u8>(), 0..600)) {
            if check_rkey(&data).is_ok() {
                prop_assert!(data.len() >= 9);
                prop_assert!(data[8] <= MAX_MEMORY_TYPE);
            }
            if check_address(&data).is_ok() {
                prop_assert!(data.len() >= 2);
                prop_assert!(data[0] & 0x0f <= 1);
            }
        }

        /// Every well-formed key is accepted, with any trailer; every cut inside its
        /// domains' keys is refused.
        #[test]
        fn well_formed_keys(
            md_map in any::<u64>().prop_map(|m| m & 0xffff),
            mem_type in 0..=MAX_MEMORY_TYPE,
            keys in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..256), 1..4),
            trailer in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let k = rkey(md_map, mem_type, &keys, &[]);
            prop_assert!(check_rkey(&k).is_ok());
            let mut t = k.clone();
            t.extend_from_slice(&trailer);
            prop_assert!(check_rkey(&t).is_ok());
            for n in 0..k.len() {
                prop_assert!(check_rkey(&k[..n]).is_err(), "cut at {}", n);
            }
        }

        /// Every well-formed address header is accepted; every cut inside it refused.
        #[test]
        fn well_formed_addresses(
            v2 in any::<bool>(),
            flags in 0u8..16,
            name in proptest::collection::vec(any::<u8>(), 0..64),
            rest in proptest::collection::vec(any::<u8>(), 1..64),
        ) {
            let a = address(v2, flags, &name, &rest);
            prop_assert!(check_address(&a).is_ok());
            let header = a.len() - rest.len();
            for n in 0..=header {
                prop_assert!(check_address(&a[..n]).is_err(), "cut at {}", n);
            }
        }
    }
}
