//! What an ELF binary links against and exports, for the tests that prove native
//! libraries are loaded at run time, never linked (no `DT_NEEDED` entry, no symbol of
//! theirs defined or imported).

use std::path::Path;

use object::read::elf::{Dyn, ElfFile64, FileHeader};
use object::{Object, ObjectSymbol};

/// Dynamic facts of one ELF file.
#[derive(Debug)]
pub struct Linkage {
    /// Its `DT_NEEDED` entries (the shared libraries the loader maps before `main`).
    pub needed: Vec<String>,
    /// Symbols of its dynamic symbol table: (name, defined here).
    pub dynamic_symbols: Vec<(String, bool)>,
}

/// Read `path`'s linkage.
///
/// # Panics
/// When the file cannot be read or is not a 64-bit ELF file (a test failure).
pub fn linkage(path: &Path) -> Linkage {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let elf = ElfFile64::<object::Endianness>::parse(&*bytes)
        .unwrap_or_else(|e| panic!("{} is not a 64-bit ELF file: {e}", path.display()));
    let endian = elf.endian();
    let data = elf.data();
    let mut needed = Vec::new();
    let sections = elf
        .elf_header()
        .sections(endian, data)
        .expect("section table");
    if let Some((dyns, link)) = sections.dynamic(endian, data).expect("dynamic section") {
        let strings = sections
            .strings(endian, data, link)
            .expect("dynamic strings");
        for d in dyns {
            if d.tag32(endian) == Some(object::elf::DT_NEEDED) {
                let s = d.string(endian, strings).expect("DT_NEEDED string");
                needed.push(String::from_utf8_lossy(s).into_owned());
            }
        }
    }
    let dynamic_symbols = elf
        .dynamic_symbols()
        .filter_map(|s| Some((s.name().ok()?.to_owned(), s.is_definition())))
        .filter(|(n, _)| !n.is_empty())
        .collect();
    Linkage {
        needed,
        dynamic_symbols,
    }
}

impl Linkage {
    /// `DT_NEEDED` entries whose file name starts with one of `prefixes`.
    pub fn needed_matching(&self, prefixes: &[&str]) -> Vec<&str> {
        self.needed
            .iter()
            .map(String::as_str)
            .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
            .collect()
    }

    /// Dynamic symbols (defined or imported) starting with one of `prefixes`.
    pub fn symbols_matching(&self, prefixes: &[&str]) -> Vec<&str> {
        self.dynamic_symbols
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
            .collect()
    }
}
