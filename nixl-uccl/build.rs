//! Builds nixl-uccl's two small native objects as shared objects in `OUT_DIR`; the
//! crate embeds their bytes and loads them at run time (never linked, so binaries
//! keep no `DT_NEEDED` on them or on libstdc++):
//! - `python_stubs.so` (C): inert definitions of the Python C-API functions UCCL's
//!   library references, for processes without Python. Always built.
//! - `catch.so` (C++, feature `exception-shim`): the exception boundary every call
//!   into UCCL goes through. Needs a C++ compiler (`g++`).

use std::path::{Path, PathBuf};

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    shared(
        &cc::Build::new(),
        Path::new("native/python_stubs.c"),
        &out.join("python_stubs.so"),
        "a C compiler (gcc)",
    );
    if std::env::var_os("CARGO_FEATURE_EXCEPTION_SHIM").is_some() {
        shared(
            cc::Build::new().cpp(true),
            Path::new("native/catch.cc"),
            &out.join("catch.so"),
            "a C++ compiler (apt-get install g++), or build nixl-uccl without its default feature `exception-shim` (the real UCCL engine is then refused)",
        );
    }
}

fn shared(build: &cc::Build, src: &Path, out: &Path, needs: &str) {
    println!("cargo:rerun-if-changed={}", src.display());
    let compiler = build.clone().opt_level(2).get_compiler();
    let mut cmd = compiler.to_command();
    cmd.args(["-shared", "-fPIC", "-O2", "-Wall", "-o"])
        .arg(out)
        .arg(src);
    match cmd.output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "nixl-uccl: building {} failed ({cmd:?}): {}\nit needs {needs}",
            src.display(),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!(
            "nixl-uccl: cannot run the compiler for {} ({cmd:?}: {e}); it needs {needs}",
            src.display()
        ),
    }
}
