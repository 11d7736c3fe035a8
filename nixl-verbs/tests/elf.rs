//! rdma-core comes from the host, at run time (DESIGN.md's first lesson): the binaries
//! that contain nixl-verbs have no `DT_NEEDED` entry for libibverbs, librdmacm or any
//! provider, and neither define nor import any `ibv_*`, `rdma_*` or `mlx5dv_*`
//! symbol that could shadow or bind the host's. nixl-bench is checked the same way in
//! its own tests (`nixl-bench/tests/cli.rs`).

use nixl_testkit::elf::linkage;

/// Libraries of rdma-core (and providers) that must never be linked.
const RDMA_LIBS: &[&str] = &[
    "libibverbs",
    "librdmacm",
    "libmlx4",
    "libmlx5",
    "libefa",
    "libbnxt_re",
    "liberdma",
    "libirdma",
    "libhns",
    "librxe",
    "libsiw",
    "libmana",
    "libionic",
];

/// Symbol prefixes of rdma-core's libraries.
const RDMA_SYMBOLS: &[&str] = &["ibv_", "_ibv_", "rdma_", "mlx5dv_", "mlx4dv_", "efadv_"];

#[test]
fn this_test_binary_links_no_rdma_library() {
    let exe = std::env::current_exe().unwrap();
    // The binary does contain nixl-verbs: it names the library it loads.
    let bytes = std::fs::read(&exe).unwrap();
    assert!(
        bytes
            .windows(nixl_verbs::library::DEFAULT_SONAME.len())
            .any(|w| w == nixl_verbs::library::DEFAULT_SONAME.as_bytes()),
        "the test binary should contain nixl-verbs' loader"
    );
    let l = linkage(&exe);
    assert!(
        l.needed_matching(RDMA_LIBS).is_empty(),
        "{} links {:?}",
        exe.display(),
        l.needed
    );
    assert_eq!(
        l.symbols_matching(RDMA_SYMBOLS),
        Vec::<&str>::new(),
        "{} has rdma-core symbols in its dynamic table",
        exe.display()
    );
    // The check can see both kinds: the binary does import libc.
    assert!(
        l.needed.iter().any(|n| n.starts_with("libc.so")),
        "{:?}",
        l.needed
    );
}
