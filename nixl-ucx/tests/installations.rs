//! Two UCX installations in one process: the report names the library really bound.
//!
//! Uses Debian's `libucx0` (1.13, found by soname) and the `libucx-cu12` wheel (1.22),
//! installed with `pip install --target "$NIXL_TEST_UCX_WHEEL_DIR" libucx-cu12`. Each
//! scenario runs in a child process (this binary re-run on one ignored test), because
//! what a process has loaded cannot be undone. A missing installation prints a SKIP line.
#![allow(unsafe_code)] // dlopen of a second UCX, as an application would

use std::path::{Path, PathBuf};
use std::process::Command;

use nixl_ucx::{UcxOptions, DEFAULT_SONAME};

const WHEEL_ENV: &str = "NIXL_TEST_UCX_WHEEL_DIR";

mod common;
use common::skip;

/// The wheel's libucp, if the wheel is installed where the environment says.
fn wheel_lib() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os(WHEEL_ENV)?);
    [
        dir.join("libucx/lib/libucp.so.0"),
        dir.join("lib/libucp.so.0"),
        dir.join("libucp.so.0"),
    ]
    .into_iter()
    .find(|p| p.exists())
}

/// What a child reported.
#[derive(Debug)]
struct Outcome {
    ok: bool,
    fields: Vec<(String, String)>,
}

impl Outcome {
    fn get(&self, k: &str) -> &str {
        self.fields
            .iter()
            .find(|(a, _)| a == k)
            .map_or("", |(_, b)| b.as_str())
    }
}

/// Run one scenario in a child: optionally preload `preload` (as another library in
/// the process would, RTLD_LOCAL), then probe `request`.
fn run_child(preload: Option<&str>, request: &str, strict: bool) -> Outcome {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_probe", "--ignored", "--nocapture"])
        .env("NIXL_TEST_CHILD", "1")
        .env("NIXL_TEST_PRELOAD", preload.unwrap_or(""))
        .env("NIXL_TEST_REQUEST", request)
        .env("NIXL_TEST_STRICT", if strict { "1" } else { "0" })
        .env_remove("NIXL_UCX_LIB")
        .env_remove("NIXL_UCX_EXPECT")
        .env_remove("NIXL_UCX_STRICT")
        .output()
        .expect("child runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT\t"))
        .unwrap_or_else(|| {
            panic!(
                "child printed no result:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let mut parts = line.split('\t');
    let ok = parts.next() == Some("ok");
    let fields = parts
        .filter_map(|kv| kv.split_once('='))
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .collect();
    Outcome { ok, fields }
}

/// The child side (run only through `run_child`).
#[test]
#[ignore = "run by the other tests in a child process"]
fn child_probe() {
    if std::env::var_os("NIXL_TEST_CHILD").is_none() {
        return;
    }
    let preload = std::env::var("NIXL_TEST_PRELOAD").unwrap_or_default();
    let _held = (!preload.is_empty()).then(|| {
        use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
        // SAFETY: loading a UCX library runs its initialisers, which are meant to run
        // at dlopen in any process; this simulates another component (MPI, a Python
        // wheel) that loaded UCX before us. Nothing is called through the handle.
        unsafe { Library::open(Some(&preload), RTLD_NOW | RTLD_LOCAL) }
            .unwrap_or_else(|e| panic!("preloading {preload}: {e}"))
    });
    let request = std::env::var("NIXL_TEST_REQUEST").unwrap();
    let opts = UcxOptions {
        library: Some(PathBuf::from(&request)),
        strict: Some(std::env::var("NIXL_TEST_STRICT").as_deref() == Ok("1")),
        ..Default::default()
    };
    let p = |p: Option<&std::path::Path>| p.map_or(String::new(), |p| p.display().to_string());
    match nixl_ucx::probe(&opts) {
        Ok(r) => println!(
            "RESULT\tok\tversion={}\tlibucp={}\tlibucs={}\tlibuct={}\tmixed={}\twas_loaded={}\tpreloaded={}",
            r.version_string(),
            p(r.object("libucp")),
            p(r.object("libucs")),
            p(r.object("libuct")),
            r.is_mixed(),
            r.requested_was_loaded,
            r.preloaded.len()
        ),
        Err(e) => println!(
            "RESULT\terr\tkind={:?}\tmsg={}",
            e.kind(),
            e.to_string().replace(['\t', '\n'], " ")
        ),
    }
}

fn system_available() -> bool {
    run_child(None, DEFAULT_SONAME, false).ok
}

fn under(path: &str, dir: &Path) -> bool {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    Path::new(path).starts_with(dir)
}

#[test]
fn each_installation_alone_is_one_installation() {
    const T: &str = "each_installation_alone_is_one_installation";
    let mut ran = false;
    if system_available() {
        let o = run_child(None, DEFAULT_SONAME, true);
        assert!(o.ok, "{o:?}");
        assert_eq!(o.get("mixed"), "false", "{o:?}");
        assert!(
            !o.get("libucp").is_empty()
                && !o.get("libucs").is_empty()
                && !o.get("libuct").is_empty(),
            "{o:?}"
        );
        println!("system UCX: {o:?}");
        ran = true;
    } else {
        skip(T, "no system libucp.so.0 (apt-get install libucx0)");
    }
    match wheel_lib() {
        Some(w) => {
            let o = run_child(None, w.to_str().unwrap(), true);
            assert!(o.ok, "{o:?}");
            assert_eq!(o.get("mixed"), "false", "{o:?}");
            let dir = w.parent().unwrap();
            assert!(under(o.get("libucp"), dir), "{o:?}");
            assert!(under(o.get("libucs"), dir), "{o:?}");
            assert!(o.get("version").starts_with("1.22"), "{o:?}");
            println!("wheel UCX: {o:?}");
            ran = true;
        }
        None => skip(
            T,
            format!("{WHEEL_ENV} does not point at a libucx-cu12 install"),
        ),
    }
    if !ran {
        skip(T, "no UCX at all");
    }
}

/// Another component loaded the wheel's UCX first; asking for the plain soname binds
/// that copy (the loader matches the soname), and the report says so instead of
/// naming the system library that was "requested".
#[test]
fn preloaded_wheel_wins_the_soname() {
    const T: &str = "preloaded_wheel_wins_the_soname";
    let Some(w) = wheel_lib() else {
        return skip(
            T,
            format!("{WHEEL_ENV} does not point at a libucx-cu12 install"),
        );
    };
    let o = run_child(Some(w.to_str().unwrap()), DEFAULT_SONAME, false);
    assert!(o.ok, "{o:?}");
    assert!(under(o.get("libucp"), w.parent().unwrap()), "{o:?}");
    assert!(o.get("version").starts_with("1.22"), "{o:?}");
    assert_eq!(o.get("was_loaded"), "true", "{o:?}");
    assert_ne!(o.get("preloaded"), "0", "{o:?}");
    if system_available() {
        assert!(
            !o.get("libucp").starts_with("/usr/lib"),
            "the report must name the wheel, not the system library: {o:?}"
        );
    }
}

/// The system UCX is loaded first; asking for the wheel by path loads the wheel's
/// libucp, whose libucs/libuct dependencies resolve (by soname) to the system copies
/// already loaded. That is either refused by the loader (symbols the old libucs lacks)
/// or bound as a mixture: both are reported, and strict mode refuses it.
#[test]
fn system_then_wheel_is_a_reported_mixture() {
    const T: &str = "system_then_wheel_is_a_reported_mixture";
    let Some(w) = wheel_lib() else {
        return skip(
            T,
            format!("{WHEEL_ENV} does not point at a libucx-cu12 install"),
        );
    };
    if !system_available() {
        return skip(T, "no system libucp.so.0 (apt-get install libucx0)");
    }
    let o = run_child(Some(DEFAULT_SONAME), w.to_str().unwrap(), false);
    println!("system preloaded, wheel requested: {o:?}");
    if o.ok {
        assert_eq!(o.get("mixed"), "true", "{o:?}");
        assert!(under(o.get("libucp"), w.parent().unwrap()), "{o:?}");
        assert!(!under(o.get("libucs"), w.parent().unwrap()), "{o:?}");
        let s = run_child(Some(DEFAULT_SONAME), w.to_str().unwrap(), true);
        assert!(!s.ok, "strict mode must refuse a mixture: {s:?}");
        assert_eq!(s.get("kind"), "Mismatch", "{s:?}");
    } else {
        assert_eq!(o.get("kind"), "UnavailableLibrary", "{o:?}");
        assert!(o.get("msg").contains(w.to_str().unwrap()), "{o:?}");
        assert!(o.get("msg").contains("another UCX installation"), "{o:?}");
    }
}
