//! A worker on a UCX without CUDA transports prints no warning of ours.
//!
//! nixl-ucx turns cuda_ipc's one-sided gets on by default. UCX 1.13 takes that key
//! whether or not a transport reads it, and then warns at every worker creation
//! (`UCX  WARN  invalid configuration: CUDA_IPC_ENABLE_GET_ZCOPY=y`), as every worker
//! on Debian's 1.13 (no CUDA) did. The backend now gives it only to a UCX whose
//! cuda_ipc transport is there. UCX prints to the process's stdout, so each case runs
//! in a child (this binary re-run on one ignored test) whose output is read whole.
//!
//! Needs libucp at run time; without it the test prints a SKIP line.

use std::process::Command;

use nixl_ucx::{UcxBackend, UcxOptions};

mod common;
use common::skip;

/// Run the child with `explicit` (a user's own setting of the key, through the
/// options) or without; returns its whole output and whether it made a worker.
fn child(explicit: bool) -> (String, Option<String>) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_worker", "--ignored", "--nocapture"])
        .env("NIXL_TEST_CHILD", "1")
        .env("NIXL_TEST_EXPLICIT", if explicit { "1" } else { "0" })
        // UCX's warnings must be printed for the test to see them.
        .env("UCX_LOG_LEVEL", "warn")
        .env_remove("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
        .output()
        .expect("child runs");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let result = all
        .lines()
        .find_map(|l| l.strip_prefix("RESULT\t"))
        .map(str::to_owned);
    (all, result)
}

#[test]
fn no_invalid_configuration_warning_without_cuda_ipc() {
    const TEST: &str = "no_invalid_configuration_warning_without_cuda_ipc";
    let (out, result) = child(false);
    let Some(result) = result else {
        panic!("the child printed no result:\n{out}");
    };
    if let Some(why) = result.strip_prefix("skip\t") {
        skip(TEST, why);
        return;
    }
    let fields: Vec<&str> = result.split('\t').collect();
    assert_eq!(fields[0], "ok", "{out}");
    let version = fields[1];
    let cuda_ipc = fields[2] == "cuda_ipc=true";
    println!("UCX {version}, cuda_ipc transport: {cuda_ipc}");
    if !cuda_ipc {
        assert!(
            !out.contains("invalid configuration"),
            "UCX {version} without cuda_ipc warned:\n{out}"
        );
    }
    // The control: the same key set by the user reaches UCX, and UCX 1.13 (which takes
    // any key) warns about it where nothing reads it; so the capture above works.
    let (out2, result2) = child(true);
    assert!(result2.is_some_and(|r| r.starts_with("ok")), "{out2}");
    if !cuda_ipc && version.starts_with("1.13.") {
        assert!(
            out2.contains("invalid configuration: CUDA_IPC_ENABLE_GET_ZCOPY=y"),
            "UCX {version}: the user's own setting was not warned about:\n{out2}"
        );
    }
}

/// The child side (run only through `child`): one backend (one worker).
#[test]
#[ignore = "run by the other test in a child process"]
fn child_worker() {
    if std::env::var_os("NIXL_TEST_CHILD").is_none() {
        return;
    }
    let mut o = UcxOptions::default();
    if std::env::var("NIXL_TEST_EXPLICIT").as_deref() == Ok("1") {
        o.ucx_config
            .push(("CUDA_IPC_ENABLE_GET_ZCOPY".into(), "y".into()));
    }
    match UcxBackend::with_options(o) {
        Ok(b) => {
            let r = b.library_report();
            let cuda_ipc = r
                .notes
                .iter()
                .any(|n| n.starts_with("cuda_ipc transport: present"));
            println!("RESULT\tok\t{}\tcuda_ipc={cuda_ipc}", r.version_string());
        }
        Err(e) if e.kind() == nixl::ErrorKind::UnavailableLibrary => {
            println!("RESULT\tskip\t{}", e.to_string().replace(['\t', '\n'], " "));
        }
        Err(e) => println!("RESULT\terr\t{}", e.to_string().replace(['\t', '\n'], " ")),
    }
}
