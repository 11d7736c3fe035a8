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

/// `count` descriptors of `len` bytes each, the first at `addr` and each next one
/// `stride` bytes after the previous: the blocks of a KV cache, kept as one entry.
///
/// `stride` may be smaller than `len` (blocks overlap) or 0 (one block repeated);
/// blocks ascend. A run whose blocks would pass `u64::MAX` can be built; preparing it
/// fails with [`ErrorKind::OutOfRange`] at the first block that does not fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Strided {
    /// Start address of the first block.
    pub addr: u64,
    /// Length of every block in bytes (must be non-zero).
    pub len: u64,
    /// Distance from one block's start to the next block's start.
    pub stride: u64,
    /// Number of blocks.
    pub count: usize,
    /// Device id (0 for DRAM).
    pub dev: u32,
}

impl Strided {
    /// `count` blocks shaped like `first`, each `stride` bytes after the previous.
    pub fn new(first: Desc, stride: u64, count: usize) -> Self {
        Self {
            addr: first.addr,
            len: first.len,
            stride,
            count,
            dev: first.dev,
        }
    }

    /// Block `i` (counting from 0), or `None` when `i >= count` or its address
    /// overflows.
    pub fn block(&self, i: usize) -> Option<Desc> {
        if i >= self.count {
            return None;
        }
        let addr = self.stride.checked_mul(i as u64)?.checked_add(self.addr)?;
        Some(Desc::new(addr, self.len, self.dev))
    }

    /// Block `i`'s address modulo 2^64, and whether computing it overflowed.
    fn raw_addr(&self, i: usize) -> (u64, bool) {
        let (off, o1) = self.stride.overflowing_mul(i as u64);
        let (addr, o2) = self.addr.overflowing_add(off);
        (addr, o1 || o2)
    }

    /// Every block, in order (stops early at an address that overflows).
    pub fn blocks(&self) -> impl Iterator<Item = Desc> + '_ {
        (0..self.count).map_while(|i| self.block(i))
    }
}

/// A list of descriptors of one memory kind, kept as runs of regularly spaced
/// blocks ([`Strided`]).
///
/// Indices count descriptors (blocks), not runs. [`DescList::push`] extends the last
/// run when the new descriptor continues its stride with the same length, so a
/// regular list built one descriptor at a time is stored, checked and transferred as
/// one run; [`DescList::push_strided`] adds a run directly. Either way the cost of
/// preparing a list and of building requests from it grows with the number of runs,
/// not of blocks.
#[derive(Clone, Debug)]
pub struct DescList {
    kind: MemKind,
    runs: Vec<Strided>,
    len: usize,
}

impl DescList {
    /// An empty list of `kind` memory.
    pub fn new(kind: MemKind) -> Self {
        Self {
            kind,
            runs: Vec::new(),
            len: 0,
        }
    }

    /// A list of `kind` memory from descriptors.
    pub fn from_descs(kind: MemKind, descs: impl IntoIterator<Item = Desc>) -> Self {
        let mut l = Self::new(kind);
        for d in descs {
            l.push(d);
        }
        l
    }

    /// A list of one run: `count` blocks shaped like `first`, `stride` bytes apart.
    pub fn strided(kind: MemKind, first: Desc, stride: u64, count: usize) -> Self {
        let mut l = Self::new(kind);
        l.push_strided(Strided::new(first, stride, count));
        l
    }

    /// Append a descriptor (extends the last run when it continues its stride).
    ///
    /// # Panics
    /// When the list would hold more than `usize::MAX` descriptors.
    pub fn push(&mut self, d: Desc) -> &mut Self {
        if let Some(last) = self.runs.last_mut() {
            if last.len == d.len && last.dev == d.dev {
                if last.count == 1 && d.addr >= last.addr {
                    last.stride = d.addr - last.addr;
                    last.count = 2;
                    self.len = self.len.checked_add(1).expect("descriptor count overflows");
                    return self;
                }
                let next = (last.count as u64)
                    .checked_mul(last.stride)
                    .and_then(|o| o.checked_add(last.addr));
                if next == Some(d.addr) {
                    last.count = last
                        .count
                        .checked_add(1)
                        .expect("descriptor count overflows");
                    self.len = self.len.checked_add(1).expect("descriptor count overflows");
                    return self;
                }
            }
        }
        self.push_strided(Strided::new(d, 0, 1))
    }

    /// Append a run of blocks. A run of 0 blocks adds nothing.
    ///
    /// # Panics
    /// When the list would hold more than `usize::MAX` descriptors.
    pub fn push_strided(&mut self, run: Strided) -> &mut Self {
        if run.count > 0 {
            self.len = self
                .len
                .checked_add(run.count)
                .expect("descriptor count overflows");
            self.runs.push(run);
        }
        self
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// Number of descriptors (blocks, not runs).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runs the list is stored as.
    pub fn runs(&self) -> &[Strided] {
        &self.runs
    }

    /// Every descriptor, in order (expands the runs).
    pub fn iter(&self) -> impl Iterator<Item = Desc> + '_ {
        self.runs.iter().flat_map(Strided::blocks)
    }
}

/// Lists are equal when they name the same descriptors in the same order, however
/// they are split into runs (a block whose address overflows equals only a block
/// whose address overflows to the same value). Runs that line up are compared whole; lists split into runs with
/// different strides cost a comparison per descriptor where they differ.
impl PartialEq for DescList {
    fn eq(&self, other: &Self) -> bool {
        if self.kind != other.kind || self.len != other.len {
            return false;
        }
        // Cursors: (run index, block within it) on each side.
        let (mut a, mut b) = ((0usize, 0usize), (0usize, 0usize));
        while a.0 < self.runs.len() && b.0 < other.runs.len() {
            let (x, y) = (&self.runs[a.0], &other.runs[b.0]);
            let n = (x.count - a.1).min(y.count - b.1);
            if x.raw_addr(a.1) != y.raw_addr(b.1) || x.len != y.len || x.dev != y.dev {
                return false;
            }
            // Equal first blocks and strides: the next `n` blocks are equal too.
            let step = if n == 1 || x.stride == y.stride { n } else { 1 };
            a.1 += step;
            b.1 += step;
            if a.1 == x.count {
                a = (a.0 + 1, 0);
            }
            if b.1 == y.count {
                b = (b.0 + 1, 0);
            }
        }
        true
    }
}

impl Eq for DescList {}

/// Something with an address range, for [`RangeIndex`].
pub(crate) trait Ranged {
    fn id(&self) -> u64;
    fn start(&self) -> u64;
    fn len(&self) -> u64;
    fn kind(&self) -> MemKind;
}

/// Non-overlapping ranges keyed by start address: O(log n) lookups.
#[derive(Debug)]
pub(crate) struct RangeIndex<T> {
    /// Keyed by (address space, device id, start): files have an address space of
    /// their own (their offsets start at 0); DRAM and GPU memory share one, where
    /// addresses do not collide.
    map: BTreeMap<(u8, u32, u64), T>,
}

/// The error for a range that overlaps a registered one.
fn overlap<T: Ranged>(t: &T, start: u64, op: &'static str) -> crate::error::Error {
    let context = match t.kind() {
        MemKind::File { fd } => format!(
            "file descriptor {fd} already names a registered file (descriptors name files by fd number: deregister the earlier registration of fd {fd} first)"
        ),
        _ => format!("range {start:#x}+{} overlaps an existing registration", t.len()),
    };
    crate::error::Error::new(ErrorKind::InvalidArgument, op, context)
}

/// The kind a descriptor of a `kind` list names: a list of files holds descriptors of
/// any registered file (each names its file by its device id, as in NIXL); other
/// lists are of one kind.
fn of_descriptor(kind: MemKind, dev: u32) -> MemKind {
    match kind {
        MemKind::File { .. } => MemKind::File { fd: dev },
        k => k,
    }
}

/// The address space of `kind` in a [`RangeIndex`] key.
fn space(kind: MemKind) -> u8 {
    u8::from(kind.is_file())
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

    fn key(t: &T) -> (u8, u32, u64) {
        (space(t.kind()), t.kind().device(), t.start())
    }

    /// Insert a range; refuses one that overlaps an existing range.
    pub(crate) fn insert(&mut self, t: T, op: &'static str) -> Result<()> {
        let (sp, dev, start) = Self::key(&t);
        let end = start.saturating_add(t.len());
        let same = |o: &T| space(o.kind()) == sp && o.kind().device() == dev;
        if let Some((_, prev)) = self.map.range(..=(sp, dev, start)).next_back() {
            if same(prev) && prev.start().saturating_add(prev.len()) > start {
                return Err(overlap(&t, start, op));
            }
        }
        if let Some((_, next)) = self.map.range((sp, dev, start)..).next() {
            if same(next) && next.start() < end {
                return Err(overlap(&t, start, op));
            }
        }
        self.map.insert((sp, dev, start), t);
        Ok(())
    }

    pub(crate) fn remove(&mut self, kind: MemKind, start: u64) -> Option<T> {
        self.map.remove(&(space(kind), kind.device(), start))
    }

    /// Find the range holding all of `d`; returns it with `d`'s offset inside it.
    ///
    /// Errors: [`ErrorKind::ZeroLength`], [`ErrorKind::OutOfRange`] (not inside any
    /// range), [`ErrorKind::SpansRegions`] (starts in one range, runs into the next),
    /// [`ErrorKind::Mismatch`] (memory kind differs).
    #[cfg(test)]
    pub(crate) fn lookup(
        &self,
        kind: MemKind,
        d: &Desc,
        op: &'static str,
        what: impl Fn() -> String,
    ) -> Result<(T, u64)> {
        self.lookup_ref(kind, d, op, what)
            .map(|(r, off)| (r.clone(), off))
    }

    /// [`RangeIndex::lookup`] without cloning the range.
    fn lookup_ref(
        &self,
        kind: MemKind,
        d: &Desc,
        op: &'static str,
        what: impl Fn() -> String,
    ) -> Result<(&T, u64)> {
        if d.len == 0 {
            return err(
                ErrorKind::ZeroLength,
                op,
                format!("{}: descriptor at {:#x} has length 0", what(), d.addr),
            );
        }
        let kind = of_descriptor(kind, d.dev);
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
        let sp = space(kind);
        let found = self
            .map
            .range(..=(sp, d.dev, d.addr))
            .next_back()
            .filter(|(k, r)| {
                k.0 == sp && k.1 == d.dev && r.start().saturating_add(r.len()) > d.addr
            });
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
        let r_end = r.start().saturating_add(r.len());
        if end > r_end {
            // Does it run into an adjacent region, or off the end into nothing?
            let spans = self
                .map
                .range((sp, d.dev, r_end)..)
                .next()
                .is_some_and(|(k, n)| k.0 == sp && k.1 == d.dev && n.start() < end);
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
        Ok((r, d.addr - r.start()))
    }

    /// Check a run of blocks: every block must lie inside one range, as
    /// [`RangeIndex::lookup`] checks a descriptor. Calls `piece(range, offset of the
    /// piece's first block in it, blocks)` for each stretch of blocks that lie in one
    /// range, in order.
    ///
    /// Costs one lookup per range the run touches, not one per block: once a block
    /// fits, every later block up to the last one that ends inside the same range fits
    /// too (blocks ascend). The first block that fails gives the error
    /// [`RangeIndex::lookup`] gives for it; `what(i)` names block `i` of the run.
    pub(crate) fn lookup_run<'a>(
        &'a self,
        kind: MemKind,
        run: &Strided,
        hint: &mut Option<&'a T>,
        op: &'static str,
        what: impl Fn(usize) -> String,
        mut piece: impl FnMut(&T, u64, usize),
    ) -> Result<()> {
        let kind = of_descriptor(kind, run.dev);
        let mut i = 0;
        while i < run.count {
            let Some(d) = run.block(i) else {
                return err(
                    ErrorKind::OutOfRange,
                    op,
                    format!(
                        "{}: block address {:#x}+{i}*{} overflows",
                        what(i),
                        run.addr,
                        run.stride
                    ),
                );
            };
            // Most descriptors land in the range the previous one did: a block that
            // lies wholly inside it with the right kind is what a lookup would find
            // (ranges do not overlap); anything else goes through the lookup and its
            // errors.
            let cached = hint.filter(|r| {
                d.len != 0
                    && d.dev == kind.device()
                    && r.kind() == kind
                    && d.addr >= r.start()
                    && d.end()
                        .is_some_and(|e| e <= r.start().saturating_add(r.len()))
            });
            let (r, offset) = match cached {
                Some(r) => (r, d.addr - r.start()),
                None => self.lookup_ref(kind, &d, op, || what(i))?,
            };
            *hint = Some(r);
            let left = run.count - i;
            let fit = if left == 1 {
                1
            } else {
                // Bytes after this block's end up to the range's end.
                let room = r.start().saturating_add(r.len()) - d.addr - d.len;
                match room.checked_div(run.stride) {
                    Some(more) => {
                        usize::try_from(more).map_or(left, |m| m.saturating_add(1).min(left))
                    }
                    None => left,
                }
            };
            piece(r, offset, fit);
            i += fit;
        }
        Ok(())
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
        fn id(&self) -> u64 {
            self.0
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

    #[derive(Clone, Debug)]
    struct F(u32, u64);
    impl Ranged for F {
        fn start(&self) -> u64 {
            0
        }
        fn len(&self) -> u64 {
            self.1
        }
        fn kind(&self) -> MemKind {
            MemKind::File { fd: self.0 }
        }
        fn id(&self) -> u64 {
            u64::from(self.0)
        }
    }

    #[test]
    fn files_have_their_own_space_and_a_file_list_names_many() {
        let mut i = RangeIndex::default();
        i.insert(F(3, 100), "t").unwrap();
        i.insert(F(4, 50), "t").unwrap();
        let e = i.insert(F(3, 10), "t").unwrap_err();
        assert!(
            e.to_string()
                .contains("file descriptor 3 already names a registered file"),
            "{e}"
        );
        let list = MemKind::File { fd: 3 };
        let (r, off) = i
            .lookup(list, &Desc::new(10, 40, 4), "t", || "d".into())
            .unwrap();
        assert_eq!((r.0, off), (4, 10));
        let e = i
            .lookup(list, &Desc::new(10, 41, 4), "t", || "d".into())
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        // Memory lists never reach files, whatever the device id.
        let e = i
            .lookup(MemKind::Dram, &Desc::new(10, 4, 0), "t", || "d".into())
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        let e = i
            .lookup(
                MemKind::Vram { device: 3 },
                &Desc::new(10, 4, 3),
                "t",
                || "d".into(),
            )
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
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

    #[test]
    fn push_recognizes_strides() {
        let mut l = DescList::new(MemKind::Dram);
        for i in 0..1000u64 {
            l.push(Desc::new(4096 + i * 128, 64, 0));
        }
        l.push(Desc::new(10, 64, 0));
        l.push(Desc::new(10, 64, 0));
        l.push(Desc::new(5, 8, 0));
        assert_eq!(l.len(), 1003);
        assert_eq!(
            l.runs(),
            &[
                Strided::new(Desc::new(4096, 64, 0), 128, 1000),
                Strided::new(Desc::new(10, 64, 0), 0, 2),
                Strided::new(Desc::new(5, 8, 0), 0, 1),
            ]
        );
        assert_eq!(l.iter().nth(999), Some(Desc::new(4096 + 999 * 128, 64, 0)));
        let flat = DescList::from_descs(MemKind::Dram, l.iter());
        assert_eq!(flat, l);
        let mut apart = DescList::new(MemKind::Dram);
        for d in l.iter() {
            apart.push_strided(Strided::new(d, 0, 1));
        }
        assert_eq!(apart.runs().len(), 1003);
        assert_eq!(apart, l, "equality compares descriptors, not runs");
        assert_ne!(
            DescList::strided(MemKind::Dram, Desc::new(0, 8, 0), 8, 2),
            l
        );
        assert!(DescList::strided(MemKind::Dram, Desc::new(0, 8, 0), 8, 0).is_empty());
        // Blocks past u64::MAX are compared, not skipped.
        let high =
            |stride| DescList::strided(MemKind::Dram, Desc::new(u64::MAX - 1, 1, 0), stride, 2);
        assert_ne!(high(10), high(20));
        assert_eq!(high(10), high(10));
        // Huge lists split differently compare run by run.
        let mut halves = DescList::new(MemKind::Dram);
        halves.push_strided(Strided::new(Desc::new(0, 8, 0), 0, 1 << 40));
        halves.push_strided(Strided::new(Desc::new(0, 8, 0), 0, 1 << 40));
        assert_eq!(
            halves,
            DescList::strided(MemKind::Dram, Desc::new(0, 8, 0), 0, 1 << 41)
        );
    }

    /// The first failing block's error kind, or each block's (range start, offset),
    /// checking one block at a time: the reference for [`RangeIndex::lookup_run`].
    fn per_block(
        i: &RangeIndex<R>,
        run: &Strided,
    ) -> std::result::Result<Vec<(u64, u64)>, (usize, ErrorKind)> {
        (0..run.count)
            .map(|b| {
                let Some(d) = run.block(b) else {
                    return Err((b, ErrorKind::OutOfRange));
                };
                i.lookup(MemKind::Dram, &d, "t", || "d".into())
                    .map(|(r, off)| (r.0, off))
                    .map_err(|e| (b, e.kind()))
            })
            .collect()
    }

    /// The run checked by [`RangeIndex::lookup_run`], with its hint left by checking
    /// one byte at `prior` first (a range, or none, the run may or may not touch).
    fn by_run(
        i: &RangeIndex<R>,
        run: &Strided,
        prior: u64,
    ) -> std::result::Result<Vec<(u64, u64)>, (usize, ErrorKind)> {
        let mut out = Vec::new();
        let failed = std::cell::Cell::new(usize::MAX);
        let mut hint = None;
        let one = Strided::new(Desc::new(prior, 1, 0), 0, 1);
        let _ = i.lookup_run(
            MemKind::Dram,
            &one,
            &mut hint,
            "t",
            |_| String::new(),
            |_, _, _| {},
        );
        i.lookup_run(
            MemKind::Dram,
            run,
            &mut hint,
            "t",
            |b| {
                failed.set(b);
                format!("block {b}")
            },
            |r, off, n| {
                for k in 0..n as u64 {
                    out.push((r.0, off + k * run.stride));
                }
            },
        )
        .map_err(|e| (failed.get(), e.kind()))?;
        Ok(out)
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Up to 4 regions, some adjacent, some with gaps, maybe near `u64::MAX`.
        fn regions() -> impl Strategy<Value = (u64, Vec<(u64, u64)>)> {
            (
                prop_oneof![Just(0u64), Just(u64::MAX - 4096), 0u64..1 << 40],
                prop::collection::vec((0u64..64, 1u64..512), 1..5),
            )
                .prop_map(|(base, parts)| {
                    let mut at = base;
                    let mut out = Vec::new();
                    for (gap, len) in parts {
                        let Some(start) = at.checked_add(gap) else {
                            break;
                        };
                        let Some(end) = start.checked_add(len) else {
                            break;
                        };
                        out.push((start, len));
                        at = end;
                    }
                    (base, out)
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]
            /// A run is accepted, piece by piece, exactly when every block would be,
            /// and otherwise fails at the same block with the same kind of error.
            #[test]
            fn run_checks_match_block_checks(
                (base, parts) in regions(),
                start in -64i64..2048,
                len in prop_oneof![Just(0u64), 1u64..200, Just(u64::MAX)],
                stride in prop_oneof![Just(0u64), 1u64..300, Just(u64::MAX / 2)],
                count in 0usize..40,
                prior in -64i64..2048,
            ) {
                let mut i = RangeIndex::default();
                for (s, l) in &parts {
                    i.insert(R(*s, *l), "t").unwrap();
                }
                let addr = base.wrapping_add_signed(start);
                let run = Strided::new(Desc::new(addr, len, 0), stride, count);
                prop_assert_eq!(by_run(&i, &run, base.wrapping_add_signed(prior)), per_block(&i, &run));
            }
        }
    }
}
