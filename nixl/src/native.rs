//! Native libraries loaded at run time: one loader and one report type for every
//! native backend (UCX's `libucp`, rdma-core's `libibverbs.so.1`, UCCL's
//! `libuccl_p2p.so`, CUDA's `libcuda.so.1`).
//!
//! Nothing is linked at build time. A backend opens its library with
//! [`NativeLibrary::open`] (every symbol resolved at once, `RTLD_LOCAL` so it never
//! interposes on another copy in the process), resolves its functions with
//! [`NativeLibrary::symbol`], and describes what it bound in a [`LibraryReport`]: what
//! was asked for and why, what was already in the process ([`mapped_objects`]), the
//! real path of each object it is bound to ([`path_of`], through `dladdr`), whether
//! they come from one installation, and what an [`Expectations`] check (an expected
//! path or version, a strict mode for mixtures) says. The bench and applications print
//! every backend's report the same way.
//!
//! Libraries are never unloaded: native transport libraries do not support it, and
//! the function pointers taken from them live as long as the process.
//!
//! This is the core's second module with `unsafe` code (after `memory`): `dlopen`,
//! `dlsym` and `dladdr`, each with its reason.
#![allow(unsafe_code)]

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use crate::error::{Error, ErrorKind, Result};

/// Where a library request came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibrarySource {
    /// The backend's options.
    Option,
    /// An environment variable.
    Env,
    /// The default soname, searched the loader's usual way.
    Default,
}

/// One object a backend is bound to, and the file it really came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundObject {
    /// Short name (`libucp`, `libibverbs`, `libmlx5`).
    pub name: String,
    /// Canonical path, when the loader could tell.
    pub path: Option<PathBuf>,
}

/// What a native backend loaded, and from where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryReport {
    /// What the library is (`UCX`, `libibverbs`, `UCCL p2p`).
    pub library: String,
    /// What was handed to `dlopen` (a soname or a path).
    pub requested: String,
    /// Where the request came from.
    pub source: LibrarySource,
    /// Whether `dlopen(requested, RTLD_NOLOAD)` found it already loaded in the process
    /// before the backend loaded it (then the loader handed over that copy).
    pub requested_was_loaded: bool,
    /// Objects of this library mapped in the process before the backend loaded
    /// anything (by MPI, a Python wheel, NCCL).
    pub preloaded: Vec<PathBuf>,
    /// The version the library reports, when it reports one.
    pub version: Option<String>,
    /// The objects the backend is bound to, in the backend's order.
    pub objects: Vec<BoundObject>,
    /// Whether the bound objects live in one installation.
    pub same_installation: bool,
    /// Other copies of the library's objects mapped in the process after loading.
    pub other_copies: Vec<PathBuf>,
    /// Anything else worth knowing (providers found, transports present, warnings).
    pub notes: Vec<String>,
}

impl LibraryReport {
    /// The version, or `?`.
    pub fn version_string(&self) -> String {
        self.version.clone().unwrap_or_else(|| "?".to_owned())
    }

    /// The real path of the bound object `name`.
    pub fn object(&self, name: &str) -> Option<&Path> {
        self.objects
            .iter()
            .find(|o| o.name == name)
            .and_then(|o| o.path.as_deref())
    }

    /// Whether more than one installation is involved (bound from several places, or
    /// other copies mapped in the process).
    pub fn is_mixed(&self) -> bool {
        !self.same_installation || !self.other_copies.is_empty()
    }
}

impl fmt::Display for LibraryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} (requested {:?} from {:?}{})",
            self.library,
            self.version_string(),
            self.requested,
            self.source,
            if self.requested_was_loaded {
                ", already loaded in the process"
            } else {
                ""
            },
        )?;
        for (i, o) in self.objects.iter().enumerate() {
            let path = o
                .path
                .as_ref()
                .map_or("<unknown>".to_owned(), |p| p.display().to_string());
            write!(f, "{} {} {path}", if i == 0 { ":" } else { "," }, o.name)?;
        }
        write!(
            f,
            "; {}",
            if self.same_installation {
                "one installation"
            } else {
                "MIXED installations"
            }
        )?;
        if !self.preloaded.is_empty() {
            write!(f, "; mapped before loading: {:?}", self.preloaded)?;
        }
        if !self.other_copies.is_empty() {
            write!(f, "; other copies in the process: {:?}", self.other_copies)?;
        }
        for n in &self.notes {
            write!(f, "; {n}")?;
        }
        Ok(())
    }
}

/// What to check about a bound library: an expected path or version, and whether a
/// mixture of installations is an error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expectations {
    /// A path (the library file or its directory) or a version prefix (`1.22`).
    pub expect: Option<String>,
    /// Refuse a mixture of installations instead of warning.
    pub strict: bool,
}

impl Expectations {
    /// From an option, else the environment variables `expect_var` (a path or version
    /// prefix) and `strict_var` (`1`, `true` or `yes`).
    pub fn resolve(
        expect: Option<String>,
        strict: Option<bool>,
        expect_var: &str,
        strict_var: &str,
    ) -> Self {
        let expect = expect.or_else(|| std::env::var(expect_var).ok().filter(|v| !v.is_empty()));
        let strict = strict.unwrap_or_else(|| {
            std::env::var(strict_var)
                .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
                .unwrap_or(false)
        });
        Self { expect, strict }
    }

    /// Check `report` (whose first object is the library itself).
    ///
    /// # Errors
    /// [`ErrorKind::Mismatch`] naming `how` (the setting that asked for it) when strict
    /// mode meets a mixture or the expectation is not met.
    pub fn check(&self, report: &LibraryReport, op: &'static str, how: &str) -> Result<()> {
        if self.strict && report.is_mixed() {
            return Err(Error::new(
                ErrorKind::Mismatch,
                op,
                format!("strict mode ({how}): {report}"),
            ));
        }
        match &self.expect {
            Some(want) if !matches_expected(want, report) => Err(Error::new(
                ErrorKind::Mismatch,
                op,
                format!(
                    "expected {} {want:?} ({how}), but bound {report}",
                    report.library
                ),
            )),
            _ => Ok(()),
        }
    }
}

/// Whether the bound library (the report's first object) matches `want`: a path to
/// the file or its directory, or a version prefix compared component by component.
pub fn matches_expected(want: &str, report: &LibraryReport) -> bool {
    if want.contains('/') {
        let w = std::fs::canonicalize(want).unwrap_or_else(|_| PathBuf::from(want));
        report
            .objects
            .first()
            .and_then(|o| o.path.as_ref())
            .is_some_and(|p| *p == w || p.parent() == Some(w.as_path()))
    } else {
        let Some(have) = &report.version else {
            return false;
        };
        let want_parts: Vec<&str> = want.trim_start_matches('v').split('.').collect();
        let have_parts: Vec<&str> = have.split('.').collect();
        !want_parts.is_empty()
            && want_parts.len() <= have_parts.len()
            && want_parts.iter().zip(&have_parts).all(|(a, b)| a == b)
    }
}

/// Whether the bound objects' directories are one.
pub fn one_directory(objects: &[BoundObject]) -> bool {
    let mut dirs = objects
        .iter()
        .map(|o| o.path.as_deref().and_then(Path::parent));
    match dirs.next() {
        Some(Some(first)) => dirs.all(|d| d == Some(first)),
        _ => false,
    }
}

/// Objects mapped in this process (from `/proc/self/maps`) whose file name starts with
/// one of `prefixes` (`libucp.so`), canonical and without duplicates.
pub fn mapped_objects(prefixes: &[&str]) -> Vec<PathBuf> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let p = Path::new(path);
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if prefixes.iter().any(|o| name.starts_with(o)) {
            let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// The canonical path of the loaded object that contains `addr` (a function or data
/// address), through `dladdr`.
// dladdr never dereferences `addr`: it only looks the address up in the loader's tables.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn path_of(addr: *const c_void) -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data; all-zero is a valid value for it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables and writes `info`; any address is
    // acceptable (an unknown one returns 0).
    let ok = unsafe { libc::dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname points to the loader's NUL-terminated copy of the object's
    // name, valid while the object stays loaded; we copy it out at once.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let p = PathBuf::from(name.to_string_lossy().into_owned());
    Some(std::fs::canonicalize(&p).unwrap_or(p))
}

/// Whether an object matching `name` (a soname or path) is already loaded in this
/// process, without loading it.
pub fn is_loaded(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a valid C string; RTLD_NOLOAD never loads (so no initialisers
    // run); a non-null handle holds a reference we give back right away.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}

/// Why a library or a symbol could not be had.
#[derive(Debug)]
pub struct LoadError {
    /// The symbol, when the library loaded but lacks it.
    pub symbol: Option<String>,
    /// The loader's message.
    pub message: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.symbol {
            Some(s) => write!(f, "it lacks {s}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for LoadError {}

/// A native library opened for the life of the process.
pub struct NativeLibrary {
    lib: &'static Library,
    name: String,
}

impl fmt::Debug for NativeLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NativeLibrary")
            .field("name", &self.name)
            .finish()
    }
}

impl NativeLibrary {
    /// Open `name` (a soname searched the usual way, or a path) with every symbol
    /// resolved now (`RTLD_NOW`, so a broken mixture fails here rather than at a later
    /// call) and kept out of the global scope (`RTLD_LOCAL`, so it never interposes on
    /// another copy already in the process). Never unloaded.
    ///
    /// Loading runs the library's initialisers; native transport libraries are made to
    /// be loaded this way in any process.
    ///
    /// # Errors
    /// The loader's message (missing file, wrong architecture, a dependency missing,
    /// unresolved symbols).
    pub fn open(name: &str) -> std::result::Result<Self, LoadError> {
        // SAFETY: see above: loading runs the library's own initialisers, which are
        // designed to run at dlopen time; RTLD_NOW|RTLD_LOCAL as explained.
        let lib =
            unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| LoadError {
                symbol: None,
                message: e.to_string(),
            })?;
        Ok(Self {
            lib: Box::leak(Box::new(lib)),
            name: name.to_owned(),
        })
    }

    /// What was opened (the soname or path given to [`NativeLibrary::open`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address of symbol `name` as a `T` (a function pointer type).
    ///
    /// # Safety
    /// `T` must be exactly the type of the symbol: a function pointer with the
    /// symbol's real signature and calling convention, or a pointer for data. The
    /// value stays valid for the life of the process (the library is never unloaded).
    ///
    /// # Errors
    /// When the library lacks the symbol.
    pub unsafe fn symbol<T: Copy>(&self, name: &str) -> std::result::Result<T, LoadError> {
        let c = CString::new(name).map_err(|_| LoadError {
            symbol: Some(name.to_owned()),
            message: "a symbol name with a NUL byte".to_owned(),
        })?;
        // SAFETY: the caller promises `T` is the symbol's type; the library is live
        // for the process (leaked), so the value never dangles.
        let s = unsafe { self.lib.get::<T>(c.as_bytes_with_nul()) }.map_err(|e| LoadError {
            symbol: Some(name.to_owned()),
            message: e.to_string(),
        })?;
        Ok(*s)
    }

    /// The address of symbol `name`, looked up through this library's own dependency
    /// scope (so it names the copy this library itself uses, whatever else the process
    /// holds), or `None`.
    pub fn address(&self, name: &str) -> Option<*const c_void> {
        // SAFETY: a `*const c_void` is the right type for any symbol's address, and it
        // is only compared or handed to dladdr, never dereferenced here.
        unsafe { self.symbol::<*const c_void>(name) }.ok()
    }

    /// The real path of the object that defines the first of `symbols` found (see
    /// [`NativeLibrary::address`] and [`path_of`]).
    pub fn path_of_symbol(&self, symbols: &[&str]) -> Option<PathBuf> {
        symbols
            .iter()
            .find_map(|s| self.address(s).and_then(path_of))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(dir: &str, version: &str) -> LibraryReport {
        let o = |n: &str| BoundObject {
            name: n.into(),
            path: Some(PathBuf::from(format!("{dir}/{n}.so.0.0.0"))),
        };
        LibraryReport {
            library: "UCX".into(),
            requested: "libucp.so.0".into(),
            source: LibrarySource::Default,
            requested_was_loaded: false,
            preloaded: vec![],
            version: Some(version.into()),
            objects: vec![o("libucp"), o("libucs")],
            same_installation: true,
            other_copies: vec![],
            notes: vec![],
        }
    }

    #[test]
    fn expectations_by_version_and_path() {
        let r = report("/opt/ucx/lib", "1.22.0");
        for ok in [
            "1.22",
            "1.22.0",
            "1",
            "/opt/ucx/lib",
            "/opt/ucx/lib/libucp.so.0.0.0",
        ] {
            assert!(matches_expected(ok, &r), "{ok}");
        }
        for bad in ["1.13", "1.2", "/usr/lib/x86_64-linux-gnu"] {
            assert!(!matches_expected(bad, &r), "{bad}");
        }
        let e = Expectations {
            expect: Some("1.13".into()),
            strict: false,
        };
        let err = e.check(&r, "load UCX", "NIXL_UCX_EXPECT").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Mismatch);
        assert!(err.to_string().contains("NIXL_UCX_EXPECT"), "{err}");
    }

    #[test]
    fn mixture_is_reported_and_strict_refuses_it() {
        let mut r = report("/a", "1.13.1");
        assert!(!r.is_mixed());
        assert!(one_directory(&r.objects));
        r.objects[1].path = Some(PathBuf::from("/b/libucs.so.0"));
        assert!(!one_directory(&r.objects));
        r.same_installation = false;
        assert!(r.is_mixed());
        assert!(r.to_string().contains("MIXED"), "{r}");
        let strict = Expectations {
            expect: None,
            strict: true,
        };
        assert_eq!(
            strict.check(&r, "load", "X").unwrap_err().kind(),
            ErrorKind::Mismatch
        );
        assert_eq!(r.object("libucs"), Some(Path::new("/b/libucs.so.0")));
    }

    #[test]
    fn missing_library_is_an_error_value() {
        let e = NativeLibrary::open("/nonexistent/libnothing.so.1").unwrap_err();
        assert!(
            e.to_string().contains("/nonexistent/libnothing.so.1"),
            "{e}"
        );
        assert!(!is_loaded("/nonexistent/libnothing.so.1"));
    }

    #[test]
    fn the_c_library_is_found_and_named() {
        // libc is in every process: its path comes from dladdr on one of its functions.
        let lib = NativeLibrary::open("libc.so.6").expect("libc.so.6 loads");
        assert!(is_loaded("libc.so.6"));
        let p = lib
            .path_of_symbol(&["nonexistent_symbol", "malloc"])
            .unwrap();
        assert!(
            p.file_name().unwrap().to_string_lossy().starts_with("libc"),
            "{p:?}"
        );
        assert!(!mapped_objects(&["libc.so", "libc-"]).is_empty());
        // SAFETY: getpid's real type.
        let getpid: extern "C" fn() -> i32 = unsafe { lib.symbol("getpid") }.unwrap();
        assert_eq!(getpid() as u32, std::process::id());
        // SAFETY: never called.
        let missing = unsafe { lib.symbol::<extern "C" fn()>("no_such_function_here") };
        assert_eq!(
            missing.unwrap_err().symbol.as_deref(),
            Some("no_such_function_here")
        );
    }
}
