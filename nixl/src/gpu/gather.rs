//! The gather kernel (`gather.ptx`): a transfer's device-to-device copies as one
//! launch instead of one driver call per block. On an H200 a request of 32 scattered
//! blocks took about 150 µs as 32 `cuMemcpyDtoDAsync` calls (or one
//! `cuMemcpyBatchAsync`) and about 15 µs as one kernel.
//!
//! This module is the launch plan (pure logic); `cuda` loads the PTX and launches.
//! Each launch carries its table by value as the kernel's only parameter, so nothing
//! is uploaded first and nothing must outlive the launch call.

/// The kernel's PTX text, NUL-terminated as `cuModuleLoadData` wants it.
pub(super) const PTX: &str = concat!(include_str!("gather.ptx"), "\0");

/// The kernel's entry point.
pub(super) const ENTRY: &std::ffi::CStr = c"nixl_gather";

/// Entries per launch: the table (8 + 24 x 128 = 3,080 bytes) stays inside the
/// 4 KiB every GPU accepts for kernel parameters.
pub(super) const MAX_ENTRIES: usize = 128;

/// Bytes of one entry a block copies (the grid's y dimension counts them).
pub(super) const SLICE: usize = 64 << 10;

/// Threads per block.
pub(super) const THREADS: u32 = 256;

/// The grid's y dimension may not exceed this.
const MAX_GRID_Y: usize = 65_535;

/// The kernel's parameter, as `gather.ptx` reads it.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub(super) struct Table {
    count: u32,
    _pad: u32,
    /// (destination, source, length) per entry.
    entries: [[u64; 3]; MAX_ENTRIES],
}

/// One launch: its table and grid.
pub(super) struct Launch {
    pub(super) table: Table,
    pub(super) grid_x: u32,
    pub(super) grid_y: u32,
}

/// The launches that perform `copies` (destination, source, length), in order;
/// `None` when the kernel is no better than the copy engine (fewer than two copies)
/// or cannot take them (an entry longer than the grid can cover, about 4 GiB).
/// Empty copies are left out.
pub(super) fn plan(copies: &[(u64, u64, usize)]) -> Option<Vec<Launch>> {
    if copies.len() < 2 || copies.iter().any(|c| c.2 > MAX_GRID_Y * SLICE) {
        return None;
    }
    let live: Vec<_> = copies.iter().filter(|c| c.2 > 0).collect();
    Some(
        live.chunks(MAX_ENTRIES)
            .map(|chunk| {
                let mut table = Table {
                    count: chunk.len() as u32,
                    _pad: 0,
                    entries: [[0; 3]; MAX_ENTRIES],
                };
                let mut longest = 0;
                for (e, &&(dst, src, len)) in table.entries.iter_mut().zip(chunk) {
                    *e = [dst, src, len as u64];
                    longest = longest.max(len);
                }
                Launch {
                    table,
                    grid_x: chunk.len() as u32,
                    grid_y: longest.div_ceil(SLICE) as u32,
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_what_the_ptx_declares() {
        assert_eq!(std::mem::size_of::<Table>(), 3080);
        assert_eq!(std::mem::align_of::<Table>(), 8);
        assert!(PTX.contains(".param .align 8 .b8 nixl_gather_table[3080]"));
        assert!(PTX.contains(&format!(".entry {}(", ENTRY.to_str().unwrap())));
        assert!(PTX.contains(&format!("mul.wide.u32 \t%rd7, %r3, {SLICE};")));
        assert!(PTX.ends_with('\0') && PTX.matches('\0').count() == 1);
    }

    #[test]
    fn plans_cover_every_byte_once_in_order() {
        // 300 copies of assorted lengths, an empty one among them.
        let copies: Vec<_> = (0..300u64)
            .map(|i| {
                let len = if i == 7 {
                    0
                } else {
                    (i as usize * 7919) % (300 << 10) + 1
                };
                (
                    0x1_0000_0000 + i * (1 << 20),
                    0x9_0000_0000 + i * (1 << 20),
                    len,
                )
            })
            .collect();
        let plan = plan(&copies).unwrap();
        assert_eq!(plan.len(), 3, "299 non-empty copies in launches of 128");
        let mut covered = Vec::new();
        for l in &plan {
            assert!(l.grid_x as usize <= MAX_ENTRIES);
            assert_eq!(l.grid_x, l.table.count);
            for e in &l.table.entries[..l.table.count as usize] {
                assert!(
                    e[2] as usize <= l.grid_y as usize * SLICE,
                    "the grid covers it"
                );
                covered.push((e[0], e[1], e[2] as usize));
            }
            // A slice fewer would leave the longest entry's tail uncopied.
            let longest = l.table.entries[..l.table.count as usize]
                .iter()
                .map(|e| e[2] as usize)
                .max()
                .unwrap();
            assert!(longest > (l.grid_y as usize - 1) * SLICE);
        }
        let expect: Vec<_> = copies.iter().copied().filter(|c| c.2 > 0).collect();
        assert_eq!(covered, expect);
    }

    #[test]
    fn single_copies_and_giant_entries_go_to_the_copy_engine() {
        assert!(plan(&[(1, 2, 3)]).is_none());
        assert!(plan(&[(1, 2, 3), (4, 5, MAX_GRID_Y * SLICE + 1)]).is_none());
        assert!(plan(&[(1, 2, 3), (4, 5, MAX_GRID_Y * SLICE)]).is_some());
    }
}
