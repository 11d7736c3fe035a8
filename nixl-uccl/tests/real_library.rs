//! Checks against the real UCCL library from the PyPI wheel `uccl==0.1.1`.
//!
//! `NIXL_TEST_UCCL_WHEEL_DIR` names a directory holding the extracted wheel
//! (`uccl/lib/libuccl_p2p.so`, `uccl-0.1.1.dist-info/`) and, optionally, the extracted
//! `nvidia-cuda-runtime-cu12` wheel (`nvidia/cuda_runtime/lib/libcudart.so.12`);
//! `.ci/run` prepares it. Without it the wheel checks print a SKIP line.

use std::path::{Path, PathBuf};

use nixl::ErrorKind;
use nixl_uccl::library::{CUDA_DRIVER, CUDA_RUNTIME, SYMBOLS};
use nixl_uccl::{UcclBackend, UcclOptions};
use object::read::elf::ElfFile64;
use object::{Object, ObjectSymbol};

const ENV_WHEEL: &str = "NIXL_TEST_UCCL_WHEEL_DIR";

fn wheel_dir(case: &str) -> Option<PathBuf> {
    match std::env::var_os(ENV_WHEEL) {
        Some(d) if Path::new(&d).join("uccl/lib/libuccl_p2p.so").exists() => Some(d.into()),
        _ => {
            nixl_testkit::skip(
                case,
                format!("{ENV_WHEEL} does not name an extracted uccl==0.1.1 wheel (.ci/run prepares one: pip download --no-deps uccl==0.1.1 --python-version 3.12 --only-binary=:all:)"),
            );
            None
        }
    }
}

fn needed(elf: &ElfFile64<'_>) -> Vec<String> {
    use object::read::elf::{Dyn, FileHeader};
    let endian = elf.endian();
    let data = elf.data();
    let mut out = Vec::new();
    let header = elf.elf_header();
    let sections = header.sections(endian, data).unwrap();
    if let Some((dyns, link)) = sections.dynamic(endian, data).unwrap() {
        let strings = sections.strings(endian, data, link).unwrap();
        for d in dyns {
            if d.tag32(endian) == Some(object::elf::DT_NEEDED) {
                let s = d.string(endian, strings).unwrap();
                out.push(String::from_utf8_lossy(s).into_owned());
            }
        }
    }
    out
}

#[test]
fn every_bound_symbol_is_in_the_real_library() {
    let Some(dir) = wheel_dir("every_bound_symbol_is_in_the_real_library") else {
        return;
    };
    let so = dir.join("uccl/lib/libuccl_p2p.so");
    let bytes = std::fs::read(&so).unwrap();
    let elf = ElfFile64::<object::Endianness>::parse(&*bytes).unwrap();
    let exported: std::collections::HashSet<String> = elf
        .dynamic_symbols()
        .filter(|s| s.is_definition() && s.is_global() && s.kind() == object::SymbolKind::Text)
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .collect();
    for s in SYMBOLS {
        assert!(
            exported.contains(s.mangled),
            "{} ({}) is not an exported function of {}: UCCL's signature changed",
            s.mangled,
            s.declaration,
            so.display()
        );
    }
    // What loading it needs, as the crate docs and the load errors say.
    let needs = needed(&elf);
    for lib in [CUDA_DRIVER, CUDA_RUNTIME] {
        assert!(
            needs.iter().any(|n| n == lib),
            "{} needs {needs:?}",
            so.display()
        );
    }
    // The wheel is the version the declarations were checked against.
    assert!(
        dir.join("uccl-0.1.1.dist-info").exists(),
        "expected the uccl 0.1.1 wheel in {}",
        dir.display()
    );
    nixl_testkit::figure(
        "UCCL symbols checked",
        format!(
            "{} of {} against {}",
            SYMBOLS.len(),
            SYMBOLS.len(),
            so.display()
        ),
    );
}

#[test]
fn missing_driver_is_unavailable_naming_it() {
    let Some(dir) = wheel_dir("missing_driver_is_unavailable_naming_it") else {
        return;
    };
    if nixl::native::NativeLibrary::open(CUDA_DRIVER).is_ok() {
        // A GPU host: the engine may load; that is the hardware suite's business.
        return nixl_testkit::skip(
            "missing_driver_is_unavailable_naming_it",
            format!("{CUDA_DRIVER} is present on this machine"),
        );
    }
    // With the CUDA runtime from its wheel already loaded (when the directory has it),
    // the driver is the one dependency the loader misses.
    let cudart = dir.join("nvidia/cuda_runtime/lib").join(CUDA_RUNTIME);
    if cudart.exists() {
        nixl::native::NativeLibrary::open(cudart.to_str().unwrap()).unwrap();
    }
    let so = dir.join("uccl/lib/libuccl_p2p.so");
    let e = UcclBackend::with_options(UcclOptions {
        library: Some(so.clone()),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnavailableLibrary, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(CUDA_DRIVER), "{msg}");
    if cudart.exists() {
        assert!(
            !msg.contains(&format!("{CUDA_RUNTIME}: cannot open")),
            "{msg}"
        );
    }
    println!("as expected: {msg}");
    // Asking again gives the same answer (nothing half-bound is cached).
    let again = nixl_uccl::probe(&UcclOptions {
        library: Some(so),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(again.kind(), ErrorKind::UnavailableLibrary);
}

#[test]
fn missing_library_is_unavailable_and_other_backends_work() {
    let e = UcclBackend::with_options(UcclOptions {
        library: Some("/nonexistent/libuccl_p2p.so".into()),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnavailableLibrary, "{e}");
    assert!(e.to_string().contains("/nonexistent/libuccl_p2p.so"), "{e}");

    // Another backend in the same process is unaffected.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mk = |n: &'static str| async move {
            nixl::Agent::builder(n)
                .backend(nixl_tcp::TcpBackend::new())
                .build()
                .await
                .unwrap()
        };
        let (a, b) = (mk("a").await, mk("b").await);
        let src = a.register(vec![7u8; 4096]).unwrap();
        let dst = b.register(vec![0u8; 4096]).unwrap();
        a.load_metadata(&b.metadata().unwrap()).unwrap();
        let rd = a
            .remote_regions("b")
            .unwrap()
            .into_iter()
            .find(|r| r.id == dst.id())
            .unwrap();
        let one = |d| nixl::DescList::from_descs(nixl::MemKind::Dram, [d]);
        a.write(&one(src.whole()), "b", &one(rd.desc(0, rd.len)), None)
            .await
            .unwrap();
        assert_eq!(dst.to_vec().unwrap(), vec![7u8; 4096]);
        let _ = a.shutdown().await;
        let _ = b.shutdown().await;
    });
}

/// The default build links nothing of UCCL or CUDA: this test binary (which contains
/// the whole crate) has no `DT_NEEDED` on them.
#[test]
fn nothing_of_uccl_or_cuda_is_linked() {
    let exe = std::fs::read("/proc/self/exe").unwrap();
    let elf = ElfFile64::<object::Endianness>::parse(&*exe).unwrap();
    let needs = needed(&elf);
    for n in &needs {
        assert!(
            !n.contains("uccl") && !n.contains("cuda") && !n.contains("ibverbs"),
            "the test binary needs {n} ({needs:?})"
        );
    }
}
