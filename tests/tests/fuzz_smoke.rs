//! The fuzz smoke: every fuzz target of `fuzz/` (their bodies are `fuzz/src/lib.rs`,
//! included here, so this builds on stable without libFuzzer) over its committed
//! seed corpus (`fuzz/corpus/<target>/`) and then a bounded number of random
//! mutations of it, from a fixed seed: a few seconds per target, the same inputs on
//! every run. A panic fails the test with the input saved and shown.
//!
//! `NIXL_FUZZ_SEED=<u64>` picks other mutations; `NIXL_FUZZ_MUTATIONS=<n>` runs `n`
//! per target instead of each target's default. `NIXL_FUZZ_WRITE_CORPUS=1` makes
//! `corpus_holds_the_seeds` write the seeds from the encoders into the corpus
//! instead of checking it holds them.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

#[path = "../../fuzz/src/lib.rs"]
#[allow(unreachable_pub, dead_code)]
mod targets;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("no corpus at {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// xorshift64*: small, fast, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that sit on the edges parsers check.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    7,
    8,
    0x7f,
    0x80,
    0xff,
    0x1000,
    1 << 31,
    u64::MAX - 1,
    u64::MAX,
];

/// One to four random edits of `input`, sometimes spliced with `other`.
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..=rng.below(4) {
        let len = v.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = INTERESTING[rng.below(INTERESTING.len())] as u8;
            }
            2 if len > 0 => {
                // A little-endian field of 2, 4 or 8 bytes set to an edge value, or
                // nudged by a small amount.
                let w = [2, 4, 8][rng.below(3)];
                let i = rng.below(len);
                let end = (i + w).min(len);
                let mut cur = [0u8; 8];
                cur[..end - i].copy_from_slice(&v[i..end]);
                let x = if rng.below(2) == 0 {
                    INTERESTING[rng.below(INTERESTING.len())]
                } else {
                    u64::from_le_bytes(cur)
                        .wrapping_add(rng.below(33) as u64)
                        .wrapping_sub(16)
                };
                v[i..end].copy_from_slice(&x.to_le_bytes()[..end - i]);
            }
            3 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(i..i, bytes);
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                v.drain(i..i + n);
            }
            5 if len > 0 => {
                // Repeat a chunk (a frame, a run entry) somewhere else.
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                let chunk = v[i..i + n].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, chunk);
            }
            6 if !other.is_empty() => {
                let cut = rng.below(len + 1);
                let from = rng.below(other.len());
                v.truncate(cut);
                v.extend_from_slice(&other[from..]);
            }
            7 if len > 0 => v.truncate(rng.below(len)),
            _ => {
                let i = rng.below(len + 1);
                v.insert(i, rng.next() as u8);
            }
        }
    }
    v
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|s| {
        s.parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, not {s:?}"))
    })
}

/// Run `input` through `target`; on a panic, save the input and fail with it.
fn run_one(target: &targets::Target, what: &str, input: &[u8]) {
    if catch_unwind(AssertUnwindSafe(|| (target.run)(input))).is_ok() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("fuzz-crash-{}", target.name));
    let saved = std::fs::write(&path, input).map_or_else(
        |e| format!("(not saved: {e})"),
        |()| format!("saved to {}", path.display()),
    );
    let hex: String = input.iter().take(512).map(|b| format!("{b:02x}")).collect();
    panic!(
        "fuzz target {} panicked on {what} ({} bytes, {saved}; replay with \
         `cargo fuzz run {} <file>` in fuzz/): {hex}{}",
        target.name,
        input.len(),
        target.name,
        if input.len() > 512 { "..." } else { "" }
    );
}

fn smoke(name: &str) {
    let target = targets::TARGETS
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no fuzz target {name}"));
    let seeds = corpus(name);
    assert!(!seeds.is_empty(), "the corpus of {name} is empty");
    for (file, input) in &seeds {
        run_one(target, &format!("corpus file {file}"), input);
    }
    let base = env_u64("NIXL_FUZZ_SEED").unwrap_or(0x006e_6978_6c2d_7273);
    // Each target its own stream, so one target's inputs do not depend on another's.
    let mut rng = Rng(name.bytes().fold(base | 1, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) | 1);
    let n = env_u64("NIXL_FUZZ_MUTATIONS").map_or(target.mutations, |n| n as usize);
    for i in 0..n {
        let a = &seeds[rng.below(seeds.len())].1;
        let b = &seeds[rng.below(seeds.len())].1;
        let input = mutate(&mut rng, a, b);
        run_one(
            target,
            &format!("mutation {i} (NIXL_FUZZ_SEED={base})"),
            &input,
        );
    }
}

macro_rules! smoke_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                smoke(stringify!($name));
            }
        )*

        #[test]
        fn every_target_has_a_smoke_test() {
            let mut tested = vec![$(stringify!($name)),*];
            let mut all: Vec<&str> = targets::TARGETS.iter().map(|t| t.name).collect();
            tested.sort_unstable();
            all.sort_unstable();
            assert_eq!(tested, all);
            // And a cargo-fuzz target of the same name.
            let fuzz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
            let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).unwrap();
            for name in all {
                assert!(fuzz.join(format!("fuzz_targets/{name}.rs")).is_file(), "no fuzz_targets/{name}.rs");
                assert!(manifest.contains(&format!("name = \"{name}\"")), "{name} is not a bin of fuzz/Cargo.toml");
            }
        }
    };
}

smoke_tests!(
    metadata_decode,
    nixl_metadata_decode,
    verbs_wire,
    tcp_initiator,
    tcp_target,
    nixl_listener,
    ucx_am,
    ucx_notif_order,
    uccl_wire,
    side_channel_frames,
    tcp_wire,
);

/// The committed corpus holds every seed the encoders make now (a protocol change
/// that makes seeds stale shows here); `NIXL_FUZZ_WRITE_CORPUS=1` writes them.
#[test]
fn corpus_holds_the_seeds() {
    let write = std::env::var_os("NIXL_FUZZ_WRITE_CORPUS").is_some();
    let mut missing = Vec::new();
    for t in targets::TARGETS {
        let dir = corpus_dir(t.name);
        for (label, bytes) in targets::seeds(t.name) {
            if write {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(dir.join(label), &bytes).unwrap();
            } else if std::fs::read(dir.join(label)).ok().as_deref() != Some(&bytes[..]) {
                missing.push(format!("{}/{label}", t.name));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "seeds missing from fuzz/corpus or stale (rerun with NIXL_FUZZ_WRITE_CORPUS=1): {missing:?}"
    );
}
