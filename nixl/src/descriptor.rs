//! Descriptors, descriptor lists and the interval index that checks them.

use std::collections::BTreeMap;

use crate::error::{err, ErrorKind, Result};
use crate::memory::MemKind;

/// A range of memory: start address, length and device id.
///
/// Local descriptors are addresses in this process; remote ones are addresses in the
/// peer's process as its metadata advertises them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Desc {
    /// Start address.
    pub addr: u64,
    /// Length in bytes (must be non-zero).
    pub len: u64,
    /// Device id (0 for DRAM).
    pub dev: u32,
}

impl Desc {
    /// A descriptor of `len` bytes at `addr` on device `dev`.
    pub fn new(addr: u64, len: u64, dev: u32) -> Self {
        Self { addr, len, dev }
    }

    /// End address (exclusive), or `None` on overflow.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }
}

/// A list of descriptors of one memory kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescList {
    kind: MemKind,
    descs: Vec<Desc>,
}

impl DescList {
    /// An empty list of `kind` memory.
    pub fn new(kind: MemKind) -> Self {
        Self {
            kind,
            descs: Vec::new(),
        }
    }

    /// A list of `kind` memory from descriptors.
    pub fn from_descs(kind: MemKind, descs: impl IntoIterator<Item = Desc>) -> Self {
        Self {
            kind,
            descs: descs.into_iter().collect(),
        }
    }

    /// Append a descriptor.
    pub fn push(&mut self, d: Desc) -> &mut Self {
        self.descs.push(d);
        self
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// The descriptors.
    pub fn descs(&self) -> &[Desc] {
        &self.descs
    }
}

/// Something with an address range, for [`RangeIndex`].
pub(crate) trait Ranged {
    fn start(&self) -> u64;
    fn len(&self) -> u64;
    fn kind(&self) -> MemKind;
}

/// Non-overlapping ranges keyed by start address: O(log n) lookups.
#[derive(Debug)]
pub(crate) struct RangeIndex<T> {
    map: BTreeMap<(u32, u64), T>,
}

impl<T> Default for RangeIndex<T> {
    fn default() -> Self {
        Self {
            map: BTreeMap::new(),
        }
    }
}

impl<T: Ranged + Clone> RangeIndex<T> {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    fn key(t: &T) -> (u32, u64) {
        (t.kind().device(), t.start())
    }

    /// Insert a range; refuses one that overlaps an existing range.
    pub(crate) fn insert(&mut self, t: T, op: &'static str) -> Result<()> {
        let (dev, start) = Self::key(&t);
        let end = start.saturating_add(t.len());
        if let Some((_, prev)) = self.map.range(..=(dev, start)).next_back() {
            if prev.kind().device() == dev && prev.start().saturating_add(prev.len()) > start {
                return err(
                    ErrorKind::InvalidArgument,
                    op,
                    format!(
                        "range {start:#x}+{} overlaps an existing registration",
                        t.len()
                    ),
                );
            }
        }
        if let Some((_, next)) = self.map.range((dev, start)..).next() {
            if next.kind().device() == dev && next.start() < end {
                return err(
                    ErrorKind::InvalidArgument,
                    op,
                    format!(
                        "range {start:#x}+{} overlaps an existing registration",
                        t.len()
                    ),
                );
            }
        }
        self.map.insert((dev, start), t);
        Ok(())
    }

    pub(crate) fn remove(&mut self, kind: MemKind, start: u64) -> Option<T> {
        self.map.remove(&(kind.device(), start))
    }

    /// Find the range holding all of `d`; returns it with `d`'s offset inside it.
    ///
    /// Errors: [`ErrorKind::ZeroLength`], [`ErrorKind::OutOfRange`] (not inside any
    /// range), [`ErrorKind::SpansRegions`] (starts in one range, runs into the next),
    /// [`ErrorKind::Mismatch`] (memory kind differs).
    pub(crate) fn lookup(
        &self,
        kind: MemKind,
        d: &Desc,
        op: &'static str,
        what: impl Fn() -> String,
    ) -> Result<(T, u64)> {
        if d.len == 0 {
            return err(
                ErrorKind::ZeroLength,
                op,
                format!("{}: descriptor at {:#x} has length 0", what(), d.addr),
            );
        }
        if d.dev != kind.device() {
            return err(
                ErrorKind::Mismatch,
                op,
                format!("{}: descriptor device {} in a {kind} list", what(), d.dev),
            );
        }
        let Some(end) = d.end() else {
            return err(
                ErrorKind::OutOfRange,
                op,
                format!("{}: {:#x}+{} overflows", what(), d.addr, d.len),
            );
        };
        let found = self
            .map
            .range(..=(d.dev, d.addr))
            .next_back()
            .filter(|(k, r)| k.0 == d.dev && r.start().saturating_add(r.len()) > d.addr);
        let Some((_, r)) = found else {
            return err(
                ErrorKind::OutOfRange,
                op,
                format!(
                    "{}: {:#x}+{} is not inside any registered region",
                    what(),
                    d.addr,
                    d.len
                ),
            );
        };
        if r.kind() != kind {
            return err(
                ErrorKind::Mismatch,
                op,
                format!("{}: region is {}, list is {kind}", what(), r.kind()),
            );
        }
        let r_end = r.start() + r.len();
        if end > r_end {
            // Does it run into an adjacent region, or off the end into nothing?
            let spans = self
                .map
                .range((d.dev, r_end)..)
                .next()
                .is_some_and(|(k, n)| k.0 == d.dev && n.start() < end);
            let kind = if spans {
                ErrorKind::SpansRegions
            } else {
                ErrorKind::OutOfRange
            };
            return err(
                kind,
                op,
                format!(
                    "{}: {:#x}+{} runs past the end of region {:#x}+{}{}",
                    what(),
                    d.addr,
                    d.len,
                    r.start(),
                    r.len(),
                    if spans { " into another region" } else { "" }
                ),
            );
        }
        Ok((r.clone(), d.addr - r.start()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug)]
    struct R(u64, u64);
    impl Ranged for R {
        fn start(&self) -> u64 {
            self.0
        }
        fn len(&self) -> u64 {
            self.1
        }
        fn kind(&self) -> MemKind {
            MemKind::Dram
        }
    }

    fn idx() -> RangeIndex<R> {
        let mut i = RangeIndex::default();
        i.insert(R(100, 100), "t").unwrap();
        i.insert(R(200, 50), "t").unwrap();
        i.insert(R(1000, 10), "t").unwrap();
        i
    }

    fn kind_of(i: &RangeIndex<R>, a: u64, l: u64) -> std::result::Result<u64, ErrorKind> {
        i.lookup(MemKind::Dram, &Desc::new(a, l, 0), "t", || "d".into())
            .map(|(_, off)| off)
            .map_err(|e| e.kind())
    }

    #[test]
    fn lookups() {
        let i = idx();
        assert_eq!(kind_of(&i, 100, 100), Ok(0));
        assert_eq!(kind_of(&i, 150, 10), Ok(50));
        assert_eq!(kind_of(&i, 249, 1), Ok(49));
        assert_eq!(kind_of(&i, 150, 100), Err(ErrorKind::SpansRegions));
        assert_eq!(kind_of(&i, 240, 20), Err(ErrorKind::OutOfRange));
        assert_eq!(kind_of(&i, 50, 10), Err(ErrorKind::OutOfRange));
        assert_eq!(kind_of(&i, 99, 10), Err(ErrorKind::OutOfRange));
        assert_eq!(kind_of(&i, 150, 0), Err(ErrorKind::ZeroLength));
        assert_eq!(kind_of(&i, u64::MAX - 1, 10), Err(ErrorKind::OutOfRange));
        assert_eq!(
            i.lookup(MemKind::Dram, &Desc::new(100, 1, 3), "t", || "d".into())
                .map_err(|e| e.kind())
                .err(),
            Some(ErrorKind::Mismatch)
        );
    }

    #[test]
    fn overlapping_insert_refused() {
        let mut i = idx();
        assert!(i.insert(R(150, 10), "t").is_err());
        assert!(i.insert(R(90, 20), "t").is_err());
        assert!(i.insert(R(250, 10), "t").is_ok());
        assert_eq!(i.len(), 4);
    }
}
