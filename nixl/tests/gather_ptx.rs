//! The gather kernel nixl ships as hand-written PTX (`src/gpu/gather.ptx`) assembles
//! for the GPU generations nixl supports, checked with NVIDIA's `ptxas` (it runs on
//! the CPU: `NIXL_TEST_PTXAS` names it, `.ci/run` takes it from the
//! `nvidia-cuda-nvcc-cu12` wheel; on `PATH` otherwise). The driver compiles the same
//! text at load time. This checks the text is valid PTX that uses no stack or spills;
//! it does not run it. The CUDA driver test double performs the copies a launch asks
//! for (its grid and table, not the PTX), and only `scripts/gpu-check` on a GPU runs
//! the kernel itself.

use std::path::PathBuf;
use std::process::Command;

const PTX: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/gpu/gather.ptx");

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NIXL_TEST_PTXAS") {
        return Some(p.into());
    }
    Command::new("ptxas")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| "ptxas".into())
}

#[test]
fn the_gather_kernel_assembles_for_volta_ampere_and_hopper() {
    let Some(ptxas) = ptxas() else {
        return nixl_testkit::skip(
            "the_gather_kernel_assembles_for_volta_ampere_and_hopper",
            "no ptxas (set NIXL_TEST_PTXAS, or pip download nvidia-cuda-nvcc-cu12 and take nvidia/cuda_nvcc/bin/ptxas)",
        );
    };
    let out_dir = std::env::temp_dir().join(format!("nixl-gather-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    for arch in ["sm_70", "sm_80", "sm_90"] {
        let out = Command::new(&ptxas)
            .args(["-v", "-arch", arch, "-o"])
            .arg(out_dir.join(format!("{arch}.cubin")))
            .arg(PTX)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", ptxas.display()));
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ptxas -arch {arch}: {log}");
        assert!(
            log.contains("Compiling entry function 'nixl_gather'"),
            "{log}"
        );
        assert!(
            log.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
            "{arch}: {log}"
        );
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}
