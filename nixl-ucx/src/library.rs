//! Which `libucp` to load, loading it once per process, and the report of what was
//! really bound.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nixl::{Error, ErrorKind, Result};

use crate::ffi::{self, LoadError, Loaded};

/// Default soname of libucp.
pub const DEFAULT_SONAME: &str = "libucp.so.0";
/// Environment variable with an explicit libucp path (or soname).
pub const ENV_LIB: &str = "NIXL_UCX_LIB";
/// Environment variable with the expected libucp: a path (file or directory) or a
/// version prefix (`1.22`, `1.22.0`).
pub const ENV_EXPECT: &str = "NIXL_UCX_EXPECT";
/// Environment variable: `1`/`true`/`yes` makes a mixed installation an error.
pub const ENV_STRICT: &str = "NIXL_UCX_STRICT";
/// Oldest UCX whose ABI our declarations were checked against.
pub const MIN_VERSION: (u32, u32) = (1, 13);

/// Where the libucp request came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibrarySource {
    /// [`UcxOptions::library`](crate::UcxOptions::library).
    Option,
    /// The `NIXL_UCX_LIB` environment variable.
    Env,
    /// The default soname, searched the loader's usual way.
    Default,
}

/// What was loaded, and from where. Logged through `tracing` when first loaded and
/// returned by [`UcxBackend::library_report`](crate::UcxBackend::library_report).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxLibraryReport {
    /// What was handed to `dlopen` (a soname or a path).
    pub requested: String,
    /// Where the request came from.
    pub source: LibrarySource,
    /// Whether `dlopen(requested, RTLD_NOLOAD)` found it already loaded in the process
    /// before we loaded it (then the loader handed us that copy).
    pub requested_was_loaded: bool,
    /// UCX objects (libucp/libucs/libuct/libucm) mapped in the process before we
    /// loaded anything, e.g. by MPI or a Python wheel.
    pub preloaded: Vec<PathBuf>,
    /// `ucp_get_version` of the bound library.
    pub version: (u32, u32, u32),
    /// Real path of the libucp we bound.
    pub libucp: Option<PathBuf>,
    /// Real path of the libucs that libucp is bound to.
    pub libucs: Option<PathBuf>,
    /// Real path of the libuct that libucp is bound to.
    pub libuct: Option<PathBuf>,
    /// Whether libucp, libucs and libuct live in one directory (one installation).
    pub same_installation: bool,
    /// Other UCX objects mapped in the process after loading (a second installation).
    pub other_copies: Vec<PathBuf>,
}

impl UcxLibraryReport {
    /// `major.minor.release`.
    pub fn version_string(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }

    /// Whether more than one UCX installation is involved (bound from several
    /// directories, or other copies mapped in the process).
    pub fn is_mixed(&self) -> bool {
        !self.same_installation || !self.other_copies.is_empty()
    }
}

impl fmt::Display for UcxLibraryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = |p: &Option<PathBuf>| {
            p.as_ref()
                .map_or("<unknown>".to_owned(), |p| p.display().to_string())
        };
        write!(
            f,
            "UCX {} (requested {:?} from {:?}{}): libucp {}, libucs {}, libuct {}; {}",
            self.version_string(),
            self.requested,
            self.source,
            if self.requested_was_loaded {
                ", already loaded in the process"
            } else {
                ""
            },
            p(&self.libucp),
            p(&self.libucs),
            p(&self.libuct),
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
            write!(
                f,
                "; other UCX copies in the process: {:?}",
                self.other_copies
            )?;
        }
        Ok(())
    }
}

/// What to check about the bound library.
#[derive(Clone, Debug, Default)]
pub(crate) struct Expectations {
    pub(crate) expect: Option<String>,
    pub(crate) strict: bool,
}

struct Bound {
    lib: &'static Loaded,
    report: UcxLibraryReport,
}

/// Libraries bound in this process, by request. UCX is never unloaded.
static BOUND: Mutex<Option<HashMap<String, Bound>>> = Mutex::new(None);

const UCX_OBJECTS: [&str; 4] = ["libucp.so", "libucs.so", "libuct.so", "libucm.so"];

/// UCX objects currently mapped in the process (from `/proc/self/maps`).
pub(crate) fn mapped_ucx_objects() -> Vec<PathBuf> {
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
        if UCX_OBJECTS.iter().any(|o| name.starts_with(o)) {
            let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

fn unavailable(requested: &str, source: LibrarySource, detail: String) -> Error {
    let how = match source {
        LibrarySource::Default => format!(
            "{DEFAULT_SONAME} not found; install libucx0 (Debian/Ubuntu: apt-get install libucx0) or set {ENV_LIB} to a libucp.so.0"
        ),
        LibrarySource::Env => format!("{ENV_LIB}={requested} cannot be loaded"),
        LibrarySource::Option => format!("libucp {requested:?} cannot be loaded"),
    };
    Error::new(
        ErrorKind::UnavailableLibrary,
        "load UCX",
        format!("{how}: {detail}"),
    )
}

fn dir_of(p: &Option<PathBuf>) -> Option<&Path> {
    p.as_deref().and_then(Path::parent)
}

/// Load (or reuse) libucp for `requested` and check it.
pub(crate) fn bind(
    requested: &str,
    source: LibrarySource,
    exp: &Expectations,
) -> Result<(&'static Loaded, UcxLibraryReport)> {
    const OP: &str = "load UCX";
    let mut guard = BOUND.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let (lib, report) = if let Some(b) = map.get(requested) {
        (b.lib, b.report.clone())
    } else {
        let preloaded = mapped_ucx_objects();
        let requested_was_loaded = ffi::is_loaded(requested);
        if !preloaded.is_empty() {
            tracing::warn!(
                ?preloaded,
                requested,
                "a UCX is already loaded in this process before nixl-ucx loads one"
            );
        }
        let lib = ffi::open(requested).map_err(|e| match e {
            LoadError::Open(e) => {
                let mut detail = e.to_string();
                if detail.contains("undefined symbol") || detail.contains("version") {
                    detail.push_str(
                        " (libucp was bound to libucs/libuct of another UCX installation already in the process?)",
                    );
                }
                unavailable(requested, source, detail)
            }
            LoadError::Symbol(name, e) => unavailable(
                requested,
                source,
                format!("it lacks {name} (UCX older than {}.{}?): {e}", MIN_VERSION.0, MIN_VERSION.1),
            ),
        })?;
        // Leaked on purpose: UCX is never unloaded, its function pointers live forever.
        let lib: &'static Loaded = Box::leak(Box::new(lib));
        let version = lib.version();
        let [libucp, libucs, libuct] = lib.bound_paths();
        let same_installation = match (dir_of(&libucp), dir_of(&libucs), dir_of(&libuct)) {
            (Some(a), Some(b), Some(c)) => a == b && b == c,
            _ => false,
        };
        let bound: Vec<&PathBuf> = [&libucp, &libucs, &libuct].into_iter().flatten().collect();
        let dirs: Vec<&Path> = bound.iter().filter_map(|p| p.parent()).collect();
        let other_copies: Vec<PathBuf> = mapped_ucx_objects()
            .into_iter()
            .filter(|p| {
                !bound.contains(&p)
                    && !p.parent().is_some_and(|d| dirs.contains(&d))
                    // Transport modules live in a `ucx/` folder under the installation.
                    && !p
                        .parent()
                        .and_then(Path::parent)
                        .is_some_and(|d| dirs.contains(&d))
            })
            .collect();
        let report = UcxLibraryReport {
            requested: requested.to_owned(),
            source,
            requested_was_loaded,
            preloaded,
            version,
            libucp,
            libucs,
            libuct,
            same_installation,
            other_copies,
        };
        if report.is_mixed() {
            tracing::warn!(%report, "UCX libraries come from more than one installation");
        } else {
            tracing::info!(%report, "bound UCX");
        }
        // One UCX per process: a second, different libucp would fight the first.
        if let Some(first) = map.values().next() {
            if first.report.libucp != report.libucp {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    OP,
                    format!(
                        "nixl-ucx already bound {} in this process; refusing to also use {} (one UCX per process)",
                        first.report.libucp.as_deref().map_or("?".into(), |p| p.display().to_string()),
                        report.libucp.as_deref().map_or("?".into(), |p| p.display().to_string()),
                    ),
                ));
            }
        }
        map.insert(
            requested.to_owned(),
            Bound {
                lib,
                report: report.clone(),
            },
        );
        (lib, report)
    };
    drop(guard);
    if (report.version.0, report.version.1) < MIN_VERSION {
        return Err(unavailable(
            requested,
            source,
            format!(
                "UCX {} is older than {}.{}, the oldest this backend supports",
                report.version_string(),
                MIN_VERSION.0,
                MIN_VERSION.1
            ),
        ));
    }
    if exp.strict && report.is_mixed() {
        return Err(Error::new(
            ErrorKind::Mismatch,
            OP,
            format!("strict mode ({ENV_STRICT}): {report}"),
        ));
    }
    if let Some(want) = &exp.expect {
        check_expected(want, &report)?;
    }
    Ok((lib, report))
}

/// Does the bound library match `want` (a path to a file or directory, or a version
/// prefix)?
pub(crate) fn check_expected(want: &str, report: &UcxLibraryReport) -> Result<()> {
    let ok = if want.contains('/') {
        let w = std::fs::canonicalize(want).unwrap_or_else(|_| PathBuf::from(want));
        report
            .libucp
            .as_ref()
            .is_some_and(|p| *p == w || p.parent() == Some(w.as_path()))
    } else {
        let have = report.version_string();
        let want_parts: Vec<&str> = want.trim_start_matches('v').split('.').collect();
        let have_parts: Vec<&str> = have.split('.').collect();
        !want_parts.is_empty()
            && want_parts.len() <= have_parts.len()
            && want_parts.iter().zip(&have_parts).all(|(a, b)| a == b)
    };
    if ok {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::Mismatch,
            "load UCX",
            format!("expected libucp {want:?} ({ENV_EXPECT}), but bound {report}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(dir: &str, v: (u32, u32, u32)) -> UcxLibraryReport {
        let p = |n: &str| Some(PathBuf::from(format!("{dir}/{n}")));
        UcxLibraryReport {
            requested: DEFAULT_SONAME.into(),
            source: LibrarySource::Default,
            requested_was_loaded: false,
            preloaded: vec![],
            version: v,
            libucp: p("libucp.so.0.0.0"),
            libucs: p("libucs.so.0.0.0"),
            libuct: p("libuct.so.0.0.0"),
            same_installation: true,
            other_copies: vec![],
        }
    }

    #[test]
    fn expectations_by_version_and_path() {
        let r = report("/opt/ucx/lib", (1, 22, 0));
        assert!(check_expected("1.22", &r).is_ok());
        assert!(check_expected("1.22.0", &r).is_ok());
        assert!(check_expected("1", &r).is_ok());
        assert_eq!(
            check_expected("1.13", &r).unwrap_err().kind(),
            ErrorKind::Mismatch
        );
        assert_eq!(
            check_expected("1.2", &r).unwrap_err().kind(),
            ErrorKind::Mismatch
        );
        assert!(check_expected("/opt/ucx/lib", &r).is_ok());
        assert!(check_expected("/opt/ucx/lib/libucp.so.0.0.0", &r).is_ok());
        assert_eq!(
            check_expected("/usr/lib/x86_64-linux-gnu", &r)
                .unwrap_err()
                .kind(),
            ErrorKind::Mismatch
        );
    }

    #[test]
    fn mixture_is_reported() {
        let mut r = report("/a", (1, 13, 1));
        assert!(!r.is_mixed());
        r.libucs = Some(PathBuf::from("/b/libucs.so.0"));
        r.same_installation = false;
        assert!(r.is_mixed());
        assert!(r.to_string().contains("MIXED"));
    }

    #[test]
    fn missing_library_is_an_error_value() {
        let e = bind(
            "/nonexistent/libucp.so.0",
            LibrarySource::Option,
            &Expectations::default(),
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnavailableLibrary);
        assert!(e.to_string().contains("/nonexistent/libucp.so.0"), "{e}");
        let e = unavailable(DEFAULT_SONAME, LibrarySource::Default, "x".into());
        assert!(
            e.to_string()
                .contains("libucp.so.0 not found; install libucx0"),
            "{e}"
        );
        assert!(e.to_string().contains(ENV_LIB), "{e}");
    }
}
