//! Which `libucp` to load, loading it once per process, and the report of what was
//! really bound.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nixl::native::{self, BoundObject, Expectations};
pub use nixl::native::{LibraryReport, LibrarySource};
use nixl::{Error, ErrorKind, Result};

use crate::ffi::{self, Loaded};

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

/// What was loaded, and from where: the core's shared [`LibraryReport`], with the
/// objects `libucp`, `libucs` and `libuct` in that order. Logged through `tracing`
/// when first loaded and returned by
/// [`UcxBackend::library_report`](crate::UcxBackend::library_report).
pub type UcxLibraryReport = LibraryReport;

struct Bound {
    lib: &'static Loaded,
    report: UcxLibraryReport,
    version: (u32, u32, u32),
}

/// Libraries bound in this process, by request. UCX is never unloaded.
static BOUND: Mutex<Option<HashMap<String, Bound>>> = Mutex::new(None);

const UCX_OBJECTS: [&str; 4] = ["libucp.so", "libucs.so", "libuct.so", "libucm.so"];

/// UCX objects currently mapped in the process (from `/proc/self/maps`).
pub(crate) fn mapped_ucx_objects() -> Vec<PathBuf> {
    native::mapped_objects(&UCX_OBJECTS)
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

/// Load (or reuse) libucp for `requested` and check it.
pub(crate) fn bind(
    requested: &str,
    source: LibrarySource,
    exp: &Expectations,
) -> Result<(&'static Loaded, UcxLibraryReport)> {
    const OP: &str = "load UCX";
    let mut guard = BOUND.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let (lib, report, version) = if let Some(b) = map.get(requested) {
        (b.lib, b.report.clone(), b.version)
    } else {
        let preloaded = mapped_ucx_objects();
        let requested_was_loaded = native::is_loaded(requested);
        if !preloaded.is_empty() {
            tracing::warn!(
                ?preloaded,
                requested,
                "a UCX is already loaded in this process before nixl-ucx loads one"
            );
        }
        let lib = ffi::open(requested).map_err(|e| match &e.symbol {
            None => {
                let mut detail = e.message.clone();
                if detail.contains("undefined symbol") || detail.contains("version") {
                    detail.push_str(
                        " (libucp was bound to libucs/libuct of another UCX installation already in the process?)",
                    );
                }
                unavailable(requested, source, detail)
            }
            Some(name) => unavailable(
                requested,
                source,
                format!("it lacks {name} (UCX older than {}.{}?): {}", MIN_VERSION.0, MIN_VERSION.1, e.message),
            ),
        })?;
        // Leaked on purpose: UCX is never unloaded, its function pointers live forever.
        let lib: &'static Loaded = Box::leak(Box::new(lib));
        let version = lib.version();
        let [libucp, libucs, libuct] = lib.bound_paths();
        let objects = vec![
            BoundObject {
                name: "libucp".into(),
                path: libucp,
            },
            BoundObject {
                name: "libucs".into(),
                path: libucs,
            },
            BoundObject {
                name: "libuct".into(),
                path: libuct,
            },
        ];
        let same_installation = native::one_directory(&objects);
        let bound: Vec<&PathBuf> = objects.iter().filter_map(|o| o.path.as_ref()).collect();
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
        let (a, b, c) = version;
        let report = UcxLibraryReport {
            library: "UCX".into(),
            requested: requested.to_owned(),
            source,
            requested_was_loaded,
            preloaded,
            version: Some(format!("{a}.{b}.{c}")),
            objects,
            same_installation,
            other_copies,
            notes: Vec::new(),
        };
        if report.is_mixed() {
            tracing::warn!(%report, "UCX libraries come from more than one installation");
        } else {
            tracing::info!(%report, "bound UCX");
        }
        // One UCX per process: a second, different libucp would fight the first.
        if let Some(first) = map.values().next() {
            if first.report.object("libucp") != report.object("libucp") {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    OP,
                    format!(
                        "nixl-ucx already bound {} in this process; refusing to also use {} (one UCX per process)",
                        first.report.object("libucp").map_or("?".into(), |p| p.display().to_string()),
                        report.object("libucp").map_or("?".into(), |p| p.display().to_string()),
                    ),
                ));
            }
        }
        map.insert(
            requested.to_owned(),
            Bound {
                lib,
                report: report.clone(),
                version,
            },
        );
        (lib, report, version)
    };
    drop(guard);
    if (version.0, version.1) < MIN_VERSION {
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
    exp.check(&report, OP, &format!("{ENV_EXPECT} / {ENV_STRICT}"))?;
    Ok((lib, report))
}

#[cfg(test)]
mod tests {
    use super::*;

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
