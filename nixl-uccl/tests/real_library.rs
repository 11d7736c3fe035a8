//! Checks against the real UCCL library from the PyPI wheel `uccl==0.1.1`.
//!
//! `NIXL_TEST_UCCL_WHEEL_DIR` names a directory holding the extracted wheel
//! (`uccl/lib/libuccl_p2p.so`, `uccl-0.1.1.dist-info/`) and, optionally, the extracted
//! `nvidia-cuda-runtime-cu12` wheel (`nvidia/cuda_runtime/lib/libcudart.so.12`);
//! `.ci/run` prepares it. Without it the wheel checks print a SKIP line.

use std::path::{Path, PathBuf};

use nixl::ErrorKind;
use nixl_uccl::host::{PYTHON_STUBS, PYTHON_SYMBOLS};
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

/// The symbols `libuccl_p2p.so` leaves for the process to supply: undefined, not weak,
/// and bound to no version of a declared dependency (libc, libstdc++, libcudart ...
/// version theirs). The CUDA driver's API (`cu*`, unversioned in `libcuda.so.1`) is
/// left out: the driver is a declared dependency.
fn unresolved_unversioned(elf: &ElfFile64<'_>) -> Vec<String> {
    use object::read::elf::{FileHeader, Sym};
    let endian = elf.endian();
    let data = elf.data();
    let sections = elf.elf_header().sections(endian, data).unwrap();
    let versions = sections.versions(endian, data).unwrap();
    let symbols = sections
        .symbols(endian, data, object::elf::SHT_DYNSYM)
        .unwrap();
    let mut out = Vec::new();
    for (index, sym) in symbols.enumerate() {
        if index.0 == 0 || !sym.is_undefined(endian) || sym.st_bind() == object::elf::STB_WEAK {
            continue;
        }
        let versioned = versions.as_ref().is_some_and(|v| {
            v.version(v.version_index(endian, index))
                .ok()
                .flatten()
                .is_some()
        });
        if versioned {
            continue;
        }
        let name = String::from_utf8_lossy(symbols.symbol_name(endian, sym).unwrap()).into_owned();
        let driver =
            name.starts_with("cu") && name[2..].starts_with(|c: char| c.is_ascii_uppercase());
        if !driver {
            out.push(name);
        }
    }
    out.sort();
    out
}

/// A new wheel that needs more than the Python functions we supply is caught here,
/// and so is a stub object that stops defining one of them.
#[test]
fn python_functions_are_the_only_symbols_we_supply() {
    let Some(dir) = wheel_dir("python_functions_are_the_only_symbols_we_supply") else {
        return;
    };
    let so = dir.join("uccl/lib/libuccl_p2p.so");
    let bytes = std::fs::read(&so).unwrap();
    let elf = ElfFile64::<object::Endianness>::parse(&*bytes).unwrap();
    let mut want: Vec<String> = PYTHON_SYMBOLS.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(
        unresolved_unversioned(&elf),
        want,
        "{} needs symbols from the process beyond those nixl-uccl supplies",
        so.display()
    );
    // Our inert definitions define each of them, as global functions.
    // (Copied: the embedded bytes are not aligned as an ELF header must be.)
    let stub_bytes = PYTHON_STUBS.to_vec();
    let stubs = ElfFile64::<object::Endianness>::parse(&*stub_bytes).unwrap();
    let defined: Vec<String> = stubs
        .dynamic_symbols()
        .filter(|s| s.is_definition() && s.is_global() && s.kind() == object::SymbolKind::Text)
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .collect();
    for s in PYTHON_SYMBOLS {
        assert!(
            defined.iter().any(|d| d == s),
            "the stubs lack {s}: {defined:?}"
        );
    }
    // And nothing a real Python would be detected by.
    assert!(
        !defined.iter().any(|d| d == "Py_IsInitialized"),
        "{defined:?}"
    );
}

const CHILD: &str = "NIXL_UCCL_TEST_CHILD";

/// Run in a child process by [`real_library_loads_and_no_rdma_device_is_refused`]
/// (ignored otherwise): load the real library and create the backend.
#[test]
#[ignore = "run in a child process by real_library_loads_and_no_rdma_device_is_refused"]
fn child_loads_and_creates() {
    assert_eq!(
        std::env::var(CHILD).as_deref(),
        Ok("1"),
        "run by its parent"
    );
    let report = nixl_uccl::probe(&UcclOptions::default()).unwrap_or_else(|e| {
        println!("CHILD probe failed: {:?}: {e}", e.kind());
        std::process::exit(3);
    });
    println!("CHILD loaded: {report}");
    let backend = match UcclBackend::new() {
        Ok(b) => b,
        Err(e) => {
            println!("CHILD create failed: {:?}: {e}", e.kind());
            return;
        }
    };
    // Creating the engine is where UCCL would crash later (first registration on a
    // host with no RDMA device): starting an agent with the backend creates it.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r = rt.block_on(async { nixl::Agent::builder("child").backend(backend).build().await });
    match r {
        Ok(a) => {
            println!("CHILD engine created");
            let _ = rt.block_on(a.shutdown());
        }
        Err(e) => println!("CHILD create failed: {:?}: {e}", e.kind()),
    }
}

/// The real uccl 0.1.1 library, loaded by a Rust process (no Python) with the CUDA
/// driver test double as `libcuda.so.1`: it loads, and creating the backend on a host
/// without an RDMA device ends in a clear `NotSupported`, never a signal.
#[test]
fn real_library_loads_and_no_rdma_device_is_refused() {
    const CASE: &str = "real_library_loads_and_no_rdma_device_is_refused";
    let Some(dir) = wheel_dir(CASE) else { return };
    if nixl::native::NativeLibrary::open(CUDA_DRIVER).is_ok() {
        return nixl_testkit::skip(
            CASE,
            format!("a real {CUDA_DRIVER} is present (the GPU check runs the engine)"),
        );
    }
    if matches!(nixl_uccl::host::rdma_devices(), Ok(n) if n > 0) {
        return nixl_testkit::skip(CASE, "this host has an RDMA device");
    }
    let cuda = match nixl_testkit::fake_cuda::library() {
        Ok(p) => p,
        Err(why) => return nixl_testkit::skip(CASE, why),
    };
    let cudart = dir.join("nvidia/cuda_runtime/lib");
    let ld = std::env::join_paths(
        [cuda.parent().unwrap().to_path_buf(), cudart]
            .into_iter()
            .chain(
                std::env::var_os("LD_LIBRARY_PATH")
                    .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                    .unwrap_or_default(),
            ),
    )
    .unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "child_loads_and_creates",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", ld)
        .env("NIXL_UCCL_LIB", dir.join("uccl/lib/libuccl_p2p.so"))
        .env("NIXL_CUDA_LIB", &cuda)
        .env_remove("UCCL_P2P_TRANSPORT")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("child stdout:\n{stdout}\nchild stderr:\n{stderr}");
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            None,
            "the child died of a signal: {:?}",
            out.status
        );
    }
    assert!(out.status.success(), "the child failed: {:?}", out.status);
    assert!(
        stdout.contains("CHILD loaded:"),
        "the real library did not load"
    );
    assert!(
        stdout.contains("Python C API: nixl-uccl's inert definitions"),
        "the child should have supplied the Python functions"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("CHILD create failed: NotSupported"))
        .unwrap_or_else(|| panic!("creating the backend did not end in NotSupported"));
    assert!(
        line.contains("no RDMA device") && line.contains("UCCL_P2P_TRANSPORT=tcp"),
        "{line}"
    );
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
            !n.contains("uccl")
                && !n.contains("cuda")
                && !n.contains("ibverbs")
                && !n.contains("stdc++")
                && !n.contains("python"),
            "the test binary needs {n} ({needs:?})"
        );
    }
}
