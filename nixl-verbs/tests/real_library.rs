//! The binding against the host's real `libibverbs.so.1` (Debian/Ubuntu: `libibverbs1`
//! and `ibverbs-providers`). Without the library these checks print a SKIP line; the
//! error for a missing library is checked everywhere.
//!
//! A machine without RDMA devices (most CI hosts) lists none: that is checked too.

use std::path::Path;

use nixl::ErrorKind;
use nixl_verbs::api::WcStatus;
use nixl_verbs::library::{Libibverbs, DEFAULT_SONAME, ENV_LIB};

fn library(case: &str) -> Option<std::sync::Arc<Libibverbs>> {
    match Libibverbs::load_from(DEFAULT_SONAME) {
        Ok(lib) => Some(lib),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::UnavailableLibrary, "{e}");
            nixl_testkit::skip(
                case,
                format!("{DEFAULT_SONAME} does not load here (apt-get install libibverbs1 ibverbs-providers): {e}"),
            );
            None
        }
    }
}

#[test]
fn a_missing_library_is_an_error_naming_it() {
    let path = "/nonexistent/nixl-verbs/libibverbs.so.1";
    let e = Libibverbs::load_from(path).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnavailableLibrary);
    assert!(e.to_string().contains(path), "{e}");
    // A file that is not a library at all.
    let e = Libibverbs::load_from("/etc/hostname").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnavailableLibrary, "{e}");
    // A library that is not libibverbs: the first symbol it lacks is named.
    let e = Libibverbs::load_from("libc.so.6").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnavailableLibrary, "{e}");
    assert!(e.to_string().contains("ibv_get_device_list"), "{e}");
    assert!(!ENV_LIB.is_empty());
}

#[test]
fn devices_are_listed_and_the_report_names_the_real_library() {
    let Some(lib) = library("devices_are_listed_and_the_report_names_the_real_library") else {
        return;
    };
    let devices = lib.rdma_devices().expect("ibv_get_device_list");
    let kernel_has_rdma = Path::new("/sys/class/infiniband_verbs").exists();
    if !kernel_has_rdma {
        assert!(devices.is_empty(), "{devices:?}");
    }
    for d in &devices {
        assert!(!d.name.is_empty(), "{d:?}");
    }

    let r = lib.report();
    let path = r.object("libibverbs").expect("the real path of libibverbs");
    assert!(path.is_absolute() && path.exists(), "{path:?}");
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(file.starts_with("libibverbs.so.1"), "{file}");
    if file.split('.').count() >= 6 {
        // libibverbs.so.1.14.44.0 carries the rdma-core release.
        assert!(r.version.is_some(), "{r}");
        assert!(file.ends_with(r.version.as_deref().unwrap()), "{file} {r}");
    }
    // Every provider plugin next to the library is listed.
    let pdir = path.parent().unwrap().join("libibverbs");
    let installed: Vec<String> = std::fs::read_dir(&pdir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().into_string().ok()?;
            let stem = n.strip_prefix("lib")?.strip_suffix(".so")?;
            Some(stem.rsplit_once("-rdmav")?.0.to_owned())
        })
        .collect();
    let line = r
        .notes
        .iter()
        .find(|n| n.starts_with("providers in ") || n.starts_with("no provider plugins"))
        .unwrap_or_else(|| panic!("no provider note in {r}"));
    if installed.is_empty() {
        assert!(line.starts_with("no provider plugins"), "{line}");
    } else {
        for p in &installed {
            assert!(line.contains(p.as_str()), "{p} missing from {line}");
        }
    }
    assert!(
        r.notes.iter().any(|n| n.contains("/etc/libibverbs.d")),
        "{r}"
    );
    assert!(r.to_string().contains(&path.display().to_string()), "{r}");
    eprintln!("{r}");

    // Loading again hands back the same binding.
    let again = Libibverbs::load_from(DEFAULT_SONAME).unwrap();
    assert!(std::sync::Arc::ptr_eq(&lib, &again));
}

#[test]
fn completion_statuses_have_the_libraries_text() {
    let Some(lib) = library("completion_statuses_have_the_libraries_text") else {
        return;
    };
    assert_eq!(lib.status_text(WcStatus::SUCCESS), "success");
    assert!(
        lib.status_text(WcStatus::RETRY_EXC_ERR).contains("retry"),
        "{}",
        lib.status_text(WcStatus::RETRY_EXC_ERR)
    );
    assert!(!lib.status_text(WcStatus(u32::MAX)).is_empty());
}
