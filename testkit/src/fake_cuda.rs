//! A **test double of the CUDA driver library** (`libcuda.so.1`), compiled from C at
//! test time (`data/fake_cuda.c`): device memory is host memory, copies are
//! `memcpy`, asynchronous copies and stream callbacks run later on a thread per
//! stream, and misuse (a driver call from a stream callback, an asynchronous copy
//! whose memory was freed before it ran, staging through memory that is not
//! page-locked, touching freed memory, which is never reused) aborts, faults or fails
//! loudly. Pointed at by `NIXL_CUDA_LIB`, it lets nixl's
//! real CUDA code path (the driver check, the binding, contexts, allocations, streams,
//! callbacks, dma-buf export) run on machines without a GPU. It proves how nixl uses
//! the driver API, not that a GPU does what the double does.
//!
//! The calls nixl does not make are stubs returning `CUDA_ERROR_NOT_SUPPORTED`, one
//! per name in `data/cuda-driver-symbols.txt` (the names cudarc 0.19's binding
//! resolves; regenerate with
//! `grep -o 'get(b"[A-Za-z0-9_]*\\0")' <cudarc>/src/driver/sys/mod.rs | sed 's/get(b"//; s/\\0")//' | sort -u`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

const SOURCE: &str = include_str!("../data/fake_cuda.c");
const SYMBOLS: &str = include_str!("../data/cuda-driver-symbols.txt");

/// The double, built once per process: the path of its `libcuda.so.1`, or why it
/// could not be built (no C compiler).
pub fn library() -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT.get_or_init(build).clone()
}

fn build() -> Result<PathBuf, String> {
    // One build per version of the sources, shared by the test processes (nextest
    // runs each test in its own): built in a private directory, then renamed into
    // place, which is atomic.
    let hash = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (SOURCE, SYMBOLS).hash(&mut h);
        h.finish()
    };
    let shared = std::env::temp_dir().join(format!("nixl-fake-cuda-{hash:016x}"));
    let lib = shared.join("libcuda.so.1");
    if lib.exists() {
        return Ok(lib);
    }
    let dir = shared.join(format!("build-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Stubs for every name the C file does not implement.
    let implemented: Vec<&str> = SOURCE
        .lines()
        .filter_map(|l| l.strip_prefix("CUresult "))
        .filter_map(|l| l.split('(').next())
        .collect();
    let mut stubs = String::from("/* Generated: driver calls nixl does not make. */\n");
    for name in SYMBOLS.lines().map(str::trim).filter(|n| !n.is_empty()) {
        if !implemented.contains(&name) {
            stubs.push_str(&format!("int {name}(void) {{ return 801; }}\n"));
        }
    }
    let (src, gen) = (dir.join("fake_cuda.c"), dir.join("stubs.c"));
    std::fs::write(&src, SOURCE).map_err(|e| e.to_string())?;
    std::fs::write(&gen, stubs).map_err(|e| e.to_string())?;
    let built = dir.join("libcuda.so.1");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-pthread", "-w", "-o"])
        .arg(&built)
        .arg(&src)
        .arg(&gen)
        .output()
        .map_err(|e| format!("no C compiler to build the CUDA driver test double (cc: {e})"))?;
    if !out.status.success() {
        return Err(format!(
            "building the CUDA driver test double failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(&built, &lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(lib)
}
