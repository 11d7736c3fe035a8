//! Helpers shared by this crate's integration tests: SKIP and FIGURE lines, on stderr
//! and appended to `NIXL_SKIP_LOG` / `NIXL_FIGURE_LOG` when set, so `scripts/test`
//! lists them at the end of the run (nextest hides a passing test's stderr). The
//! conformance crate has the same two functions in `tests/src/support.rs`; it depends
//! on this crate, so this crate's tests cannot use them.
#![allow(dead_code)]

fn emit(var: &str, line: &str) {
    eprintln!("{line}");
    if let Some(path) = std::env::var_os(var) {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// Record a visible skip of `case`, with the reason.
pub(crate) fn skip(case: &str, why: impl std::fmt::Display) {
    emit("NIXL_SKIP_LOG", &format!("SKIP {case}: {why}"));
}

/// Record a measured figure.
pub(crate) fn figure(name: &str, value: impl std::fmt::Display) {
    emit("NIXL_FIGURE_LOG", &format!("FIGURE {name}: {value}"));
}
