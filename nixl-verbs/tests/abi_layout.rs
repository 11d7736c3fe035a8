//! Our declarations of libibverbs' ABI (`src/ffi/sys.rs`) against the host's
//! `<infiniband/verbs.h>`: a C program prints the size, alignment and offset of every
//! struct and field declared, and every constant's value; the C compiler checks every
//! function type (`__builtin_types_compatible_p`). Needs `cc` and the header (Debian:
//! `libibverbs-dev`); without them it prints a SKIP line.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const HEADER: &str = "/usr/include/infiniband/verbs.h";
const CASE: &str = "abi_layout";

/// The C expression for one layout row.
fn c_expr(ty: &str, item: &str) -> String {
    // Not in the public header: `struct ibv_port_attr` up to `port_cap_flags2`.
    if ty == "struct _compat_ibv_port_attr" {
        return match item {
            "sizeof" => "offsetof(struct ibv_port_attr, port_cap_flags2)".into(),
            "alignof" => "_Alignof(struct ibv_port_attr)".into(),
            f => format!("offsetof(struct ibv_port_attr, {f})"),
        };
    }
    match (ty, item) {
        ("enum", name) => format!("(long)({name})"),
        (t, "sizeof") => format!("sizeof({t})"),
        (t, "alignof") => format!("_Alignof({t})"),
        (t, f) => format!("offsetof({t}, {f})"),
    }
}

/// The C type expression whose type is the function's.
fn c_fn_expr(name: &str) -> String {
    match name.split_once('.') {
        Some((ty, field)) => format!("((struct {ty} *)0)->{field}"),
        None => format!("&{name}"),
    }
}

fn program() -> String {
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <stdint.h>\n#include <infiniband/verbs.h>\n\n",
    );
    for (name, ty) in nixl_verbs::ffi_signatures() {
        c.push_str(&format!(
            "_Static_assert(__builtin_types_compatible_p(__typeof__({}), {ty}), \"{name} is not {ty}\");\n",
            c_fn_expr(name)
        ));
    }
    c.push_str("\nint main(void) {\n");
    for (ty, item, _) in nixl_verbs::ffi_layout() {
        c.push_str(&format!(
            "    printf(\"%s|%s|%ld\\n\", \"{ty}\", \"{item}\", (long)({}));\n",
            c_expr(ty, item)
        ));
    }
    c.push_str("    return 0;\n}\n");
    c
}

fn have_cc() -> bool {
    Command::new("cc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn scratch_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("nixl-verbs-abi-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn declarations_match_the_host_header() {
    if !Path::new(HEADER).exists() {
        nixl_testkit::skip(
            CASE,
            format!("{HEADER} is absent (Debian/Ubuntu: apt-get install libibverbs-dev)"),
        );
        return;
    }
    if !have_cc() {
        nixl_testkit::skip(CASE, "no C compiler `cc` on PATH");
        return;
    }
    let dir = scratch_dir();
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&src, program()).unwrap();
    let out = Command::new("cc")
        .args(["-std=gnu11", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the C check of ffi/sys.rs against {HEADER} failed to compile (a function type or a name differs):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success(), "{run:?}");
    let stdout = String::from_utf8(run.stdout).unwrap();
    let c: HashMap<(String, String), usize> = stdout
        .lines()
        .map(|l| {
            let mut p = l.split('|');
            let (t, i, v) = (p.next().unwrap(), p.next().unwrap(), p.next().unwrap());
            ((t.to_owned(), i.to_owned()), v.parse().unwrap())
        })
        .collect();
    let rows = nixl_verbs::ffi_layout();
    let mut wrong = Vec::new();
    for (ty, item, rust) in &rows {
        let want = c[&((*ty).to_owned(), (*item).to_owned())];
        if want != *rust {
            wrong.push(format!("{ty} {item}: C {want}, Rust {rust}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "ffi/sys.rs differs from {HEADER}:\n{}",
        wrong.join("\n")
    );
    // Every declared struct is checked whole, and the 128-byte send request with it.
    let sizes = rows.iter().filter(|r| r.1 == "sizeof").count();
    assert!(sizes >= 19, "{sizes} structs checked");
    assert_eq!(c[&("struct ibv_send_wr".into(), "sizeof".into())], 128);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_row_names_a_c_type_or_constant() {
    // Runs everywhere: the rows are well formed and unique, so the C program is too.
    let rows = nixl_verbs::ffi_layout();
    let mut seen = std::collections::HashSet::new();
    for (ty, item, _) in &rows {
        assert!(
            *ty == "enum" || ty.starts_with("struct ") || ty.starts_with("union "),
            "{ty}"
        );
        assert!(seen.insert((*ty, *item)), "{ty} {item} twice");
    }
    assert!(nixl_verbs::ffi_signatures()
        .iter()
        .any(|(n, _)| *n == "ibv_context_ops.post_send"));
}
