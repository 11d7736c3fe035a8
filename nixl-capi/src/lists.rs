//! The small value types of NIXL's C API behind its opaque handles: parameter
//! maps, memory-type and string lists, optional arguments, descriptor lists,
//! notification maps, query responses. Plain Rust; `ffi` hands them to C.

use std::ffi::CString;

use nixl::MemKind;

use crate::status::{Failure, Outcome};

/// `nixl_capi_mem_type_t` values (NIXL's `nixl_mem_t`, plus UNKNOWN).
pub mod mem {
    /// Host memory.
    pub const DRAM: u32 = 0;
    /// GPU memory.
    pub const VRAM: u32 = 1;
    /// Block devices.
    pub const BLOCK: u32 = 2;
    /// Object stores.
    pub const OBJECT: u32 = 3;
    /// Files.
    pub const FILE: u32 = 4;
    /// Unknown (accepted in lists, as NIXL accepts it; nothing registers it).
    pub const UNKNOWN: u32 = 5;

    /// NUL-terminated names, by value (`nixl_capi_mem_type_to_string`).
    pub const NAMES: [&str; 6] = [
        "DRAM\0",
        "VRAM\0",
        "BLOCK\0",
        "OBJECT\0",
        "FILE\0",
        "UNKNOWN\0",
    ];

    /// The value for a name of [`nixl_compat::backends::mem_types`].
    pub fn by_name(name: &str) -> u32 {
        match name {
            "DRAM" => DRAM,
            "VRAM" => VRAM,
            "BLOCK" => BLOCK,
            "OBJECT" | "OBJ" => OBJECT,
            "FILE" => FILE,
            _ => UNKNOWN,
        }
    }
}

/// A C string from Rust text (an interior NUL, which no name or parameter of ours
/// holds, is cut there).
pub fn cstring(s: &str) -> CString {
    let end = s.find('\0').unwrap_or(s.len());
    CString::new(&s[..end]).expect("no NUL before end")
}

/// `nixl_capi_params_t`: string parameters, in insertion order; adding a key again
/// replaces its value.
#[derive(Debug, Default, Clone)]
pub struct Params(pub Vec<(CString, CString)>);

impl Params {
    /// Set `key` to `value`.
    pub fn add(&mut self, key: &str, value: &str) {
        let value = cstring(value);
        match self
            .0
            .iter_mut()
            .find(|(k, _)| k.to_bytes() == key.as_bytes())
        {
            Some((_, v)) => *v = value,
            None => self.0.push((cstring(key), value)),
        }
    }

    /// As owned pairs, for the backend factory.
    pub fn pairs(&self) -> Vec<(String, String)> {
        self.0
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.to_string_lossy().into_owned(),
                )
            })
            .collect()
    }
}

/// `nixl_capi_opt_args_t`: NIXL's optional arguments.
#[derive(Debug, Clone)]
pub struct OptArgs {
    /// Backends to use (our names), in the order given; empty: any.
    pub backends: Vec<&'static str>,
    /// The notification message (NIXL's `notifMsg`).
    pub notif_msg: Vec<u8>,
    /// Whether to send it (NIXL's `hasNotif`).
    pub has_notif: bool,
    /// NIXL's `skipDescMerge`: keep adjacent descriptors apart.
    pub skip_desc_merge: bool,
    /// Where the metadata calls go (NIXL's `ipAddr`); empty: etcd.
    pub ip_addr: String,
    /// Its port (NIXL's default 8888).
    pub port: u16,
    /// A backend-defined blob (NIXL's `customParam`); no backend of ours reads one.
    pub custom_param: Option<Vec<u8>>,
}

impl Default for OptArgs {
    fn default() -> Self {
        Self {
            backends: Vec::new(),
            notif_msg: Vec::new(),
            has_notif: false,
            skip_desc_merge: false,
            ip_addr: String::new(),
            port: nixl::exchange::NIXL_DEFAULT_PORT,
            custom_param: None,
        }
    }
}

impl OptArgs {
    /// The notification these arguments ask for.
    pub fn notif(&self) -> Option<bytes::Bytes> {
        self.has_notif
            .then(|| bytes::Bytes::copy_from_slice(&self.notif_msg))
    }

    /// The backend hint as nixl-rs options take it.
    pub fn backend_names(&self) -> Option<Vec<String>> {
        (!self.backends.is_empty()).then(|| self.backends.iter().map(|b| (*b).to_owned()).collect())
    }
}

/// One registration descriptor (NIXL's `nixlBlobDesc`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegDesc {
    /// Address (DRAM, VRAM) or file offset (FILE).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device: 0 for DRAM, the GPU for VRAM, the file descriptor (or, path mode,
    /// the name) for FILE.
    pub dev: u64,
    /// Backend-specific bytes: for FILE, a path (`"rw,create:/path"`, path mode).
    pub meta: Vec<u8>,
}

/// A descriptor list of one memory type: transfer lists (`meta` unused), and
/// registration lists.
#[derive(Debug, Clone)]
pub struct DescList {
    /// `nixl_capi_mem_type_t`.
    pub mem: u32,
    /// The descriptors.
    pub descs: Vec<RegDesc>,
}

impl DescList {
    /// An empty list of `mem`.
    pub fn new(mem: u32) -> Self {
        Self {
            mem,
            descs: Vec::new(),
        }
    }

    /// Remove descriptor `index` (NIXL: out of range is a backend error).
    pub fn remove(&mut self, index: i32) -> Outcome {
        match usize::try_from(index) {
            Ok(i) if i < self.descs.len() => {
                self.descs.remove(i);
                Ok(())
            }
            _ => Err(Failure::backend(format!(
                "remove descriptor {index}: the list holds {}",
                self.descs.len()
            ))),
        }
    }

    /// Grow with zeroed descriptors or truncate.
    ///
    /// # Errors
    /// BACKEND when the memory for `n` descriptors cannot be had (NIXL's
    /// `bad_alloc`).
    pub fn resize(&mut self, n: usize) -> Outcome {
        let more = n.saturating_sub(self.descs.len());
        self.descs
            .try_reserve(more)
            .map_err(|e| Failure::backend(format!("resize descriptor list to {n}: {e}")))?;
        self.descs.resize(n, RegDesc::default());
        Ok(())
    }

    /// What `*_dlist_print` writes to stdout.
    pub fn render(&self, what: &str) -> String {
        let mut s = format!(
            "{what} of {} descriptors, type {}\n",
            self.descs.len(),
            mem::NAMES
                .get(self.mem as usize)
                .map_or("?", |n| n.trim_end_matches('\0'))
        );
        for d in &self.descs {
            s.push_str(&format!(
                "  addr {:#x} len {} dev {}{}\n",
                d.addr,
                d.len,
                d.dev,
                if d.meta.is_empty() {
                    String::new()
                } else {
                    format!(" meta {:?}", String::from_utf8_lossy(&d.meta))
                }
            ));
        }
        s
    }

    /// The nixl-rs memory kind of descriptor `dev` in this list.
    pub fn kind(&self, dev: u64) -> Outcome<MemKind> {
        kind(self.mem, dev)
    }

    /// As a nixl-rs descriptor list (DRAM, VRAM, FILE).
    pub fn to_nixl(&self) -> Outcome<nixl::DescList> {
        let mut list = nixl::DescList::new(self.kind(self.descs.first().map_or(0, |d| d.dev))?);
        for d in &self.descs {
            let dev = u32::try_from(d.dev)
                .map_err(|_| Failure::invalid(format!("device id {} is too large", d.dev)))?;
            list.push(nixl::Desc::new(d.addr, d.len, dev));
        }
        Ok(list)
    }
}

/// The nixl-rs memory kind for a C memory type and device id.
pub fn kind(mem: u32, dev: u64) -> Outcome<MemKind> {
    let small = |what: &str| {
        u32::try_from(dev).map_err(|_| Failure::invalid(format!("{what} {dev} is too large")))
    };
    match mem {
        mem::DRAM => Ok(MemKind::Dram),
        mem::VRAM => Ok(MemKind::Vram {
            device: small("device id")?,
        }),
        mem::FILE => Ok(MemKind::File {
            fd: small("file descriptor")?,
        }),
        mem::BLOCK | mem::OBJECT => Err(Failure::not_found(format!(
            "memory type {}: no backend of nixl-rs serves it (DRAM, VRAM and FILE are served)",
            mem::NAMES[mem as usize].trim_end_matches('\0')
        ))),
        other => Err(Failure::invalid(format!("memory type {other} is not one"))),
    }
}

/// A remote descriptor list (for memory views): descriptors with their owners.
#[derive(Debug, Clone)]
pub struct RemoteList {
    /// `nixl_capi_mem_type_t`.
    pub mem: u32,
    /// (addr, len, dev, agent).
    pub descs: Vec<(u64, u64, u64, String)>,
}

/// `nixl_capi_notif_map_t`: notifications by sender, senders in arrival order.
#[derive(Debug, Default)]
pub struct NotifMap(pub Vec<(CString, Vec<Vec<u8>>)>);

impl NotifMap {
    /// Append `msg` from `peer`.
    pub fn push(&mut self, peer: &str, msg: Vec<u8>) {
        match self
            .0
            .iter_mut()
            .find(|(p, _)| p.to_bytes() == peer.as_bytes())
        {
            Some((_, v)) => v.push(msg),
            None => self.0.push((cstring(peer), vec![msg])),
        }
    }

    /// The messages of `peer`.
    pub fn of(&self, peer: &[u8]) -> Outcome<&Vec<Vec<u8>>> {
        self.0
            .iter()
            .find(|(p, _)| p.to_bytes() == peer)
            .map(|(_, v)| v)
            .ok_or_else(|| {
                Failure::invalid(format!(
                    "no notifications from {:?} in the map",
                    String::from_utf8_lossy(peer)
                ))
            })
    }
}

/// `nixl_capi_query_resp_list_t`: per descriptor, what the backend knows of it.
#[derive(Debug, Default)]
pub struct QueryResponses(pub Vec<Option<Params>>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_replace_and_keep_order() {
        let mut p = Params::default();
        p.add("b", "1");
        p.add("a", "2");
        p.add("b", "3");
        assert_eq!(
            p.pairs(),
            vec![("b".into(), "3".into()), ("a".into(), "2".into())]
        );
    }

    #[test]
    fn lists_remove_resize_and_convert() {
        let mut l = DescList::new(mem::DRAM);
        l.descs.push(RegDesc {
            addr: 0x1000,
            len: 64,
            dev: 0,
            meta: Vec::new(),
        });
        l.resize(3).unwrap();
        assert_eq!(l.descs.len(), 3);
        assert!(l.resize(usize::MAX).is_err(), "refused, not an abort");
        assert!(l.remove(5).is_err());
        assert!(l.remove(-1).is_err());
        l.remove(2).unwrap();
        let n = l.to_nixl().unwrap();
        assert_eq!(n.len(), 2);
        assert!(l.render("xfer list").contains("type DRAM"));
        let mut f = DescList::new(mem::FILE);
        f.descs.push(RegDesc {
            dev: 1 << 40,
            ..RegDesc::default()
        });
        assert_eq!(
            f.to_nixl().unwrap_err().status,
            crate::status::INVALID_PARAM
        );
        assert_eq!(
            DescList::new(mem::OBJECT).to_nixl().unwrap_err().status,
            crate::status::NOT_FOUND
        );
    }

    #[test]
    fn notif_map_groups_by_sender_in_arrival_order() {
        let mut m = NotifMap::default();
        m.push("b", b"1".to_vec());
        m.push("a", b"2".to_vec());
        m.push("b", b"3".to_vec());
        assert_eq!(m.0.len(), 2);
        assert_eq!(m.0[0].0.to_bytes(), b"b");
        assert_eq!(m.of(b"b").unwrap(), &vec![b"1".to_vec(), b"3".to_vec()]);
        assert!(m.of(b"c").is_err());
    }

    #[test]
    fn opt_args_notification() {
        let mut o = OptArgs::default();
        assert_eq!(o.port, 8888);
        o.notif_msg = b"x".to_vec();
        assert!(o.notif().is_none());
        o.has_notif = true;
        assert_eq!(o.notif().unwrap(), &b"x"[..]);
    }
}
