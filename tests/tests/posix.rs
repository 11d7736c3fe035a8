//! The storage cases of the suite on nixl-posix, once per I/O engine (io_uring, and
//! the thread pool forced) with everything on the engine, once more with small
//! buffered transfers run on the posting thread (the default), then property tests of random descriptor lists against a
//! plain model of memory and file.

use std::sync::Arc;

use nixl::{Desc, ErrorKind, MemKind, Memory, Op};
use nixl_conformance::storage::{shut_down_clean, storage_xfer, Scratch};
use nixl_conformance::{storage_tests, BackendUnderTest};
use nixl_posix::{Durability, Engine, PosixBackend, PosixOptions};

/// The backend on `engine`; `inline` keeps small buffered transfers on the posting
/// thread (the default), off sends everything to the engine.
fn backend_with(
    engine: Engine,
    durability: Durability,
    inline: bool,
) -> nixl::Result<Arc<dyn nixl::Backend>> {
    if engine == Engine::Uring {
        PosixBackend::probe_uring()?;
    }
    let mut o = PosixOptions {
        engine,
        durability,
        ..PosixOptions::default()
    };
    if !inline {
        o.inline_max = 0;
    }
    Ok(Arc::new(PosixBackend::new(o)))
}

fn backend(engine: Engine, durability: Durability) -> nixl::Result<Arc<dyn nixl::Backend>> {
    backend_with(engine, durability, false)
}

mod inline {
    use super::*;
    const POSIX: BackendUnderTest = BackendUnderTest {
        name: "posix (small buffered transfers inline, io_uring behind)",
        make: || backend_with(Engine::Uring, Durability::None, true),
        skip_case: |_| None,
    };
    storage_tests!(POSIX);
    const POOL: BackendUnderTest = BackendUnderTest {
        name: "posix (small buffered transfers inline, fdatasync by the pool)",
        make: || backend_with(Engine::Pool, Durability::Data, true),
        skip_case: |_| None,
    };
    mod pool {
        use super::*;
        storage_tests!(POOL; storage_round_trip, storage_truncated_file, storage_no_space);
    }
}

mod uring {
    use super::*;
    const POSIX: BackendUnderTest = BackendUnderTest {
        name: "posix (io_uring)",
        make: || backend(Engine::Uring, Durability::None),
        skip_case: |_| None,
    };
    storage_tests!(POSIX);
}

mod pool {
    use super::*;
    const POSIX: BackendUnderTest = BackendUnderTest {
        name: "posix (thread pool)",
        make: || backend(Engine::Pool, Durability::None),
        skip_case: |_| None,
    };
    storage_tests!(POSIX);
}

mod durable {
    use super::*;
    const POSIX: BackendUnderTest = BackendUnderTest {
        name: "posix (io_uring, fdatasync)",
        make: || backend(Engine::Uring, Durability::Data),
        skip_case: |_| None,
    };
    storage_tests!(POSIX; storage_round_trip, storage_layouts, storage_no_space);
    const POOL: BackendUnderTest = BackendUnderTest {
        name: "posix (thread pool, fsync)",
        make: || backend(Engine::Pool, Durability::Full),
        skip_case: |_| None,
    };
    mod pool {
        use super::*;
        storage_tests!(POOL; storage_round_trip, storage_no_space);
    }
}

/// Random lists of (memory offset, file offset, length) against a model: the file
/// after a WRITE and the memory after a READ hold exactly what plain copies give.
fn model_check(engine: Engine, inline: bool, cases: &[Vec<(u64, u64, u64)>]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let agent = nixl::Agent::builder("model")
            .backend_arc(backend_with(engine, Durability::None, inline).unwrap())
            .build()
            .await
            .unwrap();
        let dir = Scratch::new("model");
        const MEM: u64 = 1 << 20;
        const FILE: u64 = 1 << 20;
        let path = dir.file("m.bin");
        let file = agent
            .register(
                Memory::open_file(
                    &path,
                    &nixl::file::FileOptions {
                        create: true,
                        len: Some(FILE),
                        ..Default::default()
                    },
                )
                .unwrap(),
            )
            .unwrap();
        let fd = file.kind().device();
        let src_bytes = nixl_testkit::pattern(42, MEM as usize);
        let src = agent.register(src_bytes.clone()).unwrap();
        let dst = agent.register(vec![0u8; MEM as usize]).unwrap();
        let mut model_file = vec![0u8; FILE as usize];
        for (k, list) in cases.iter().enumerate() {
            let mem: Vec<Desc> = list.iter().map(|&(m, _, l)| src.desc(m, l)).collect();
            let files: Vec<Desc> = list.iter().map(|&(_, f, l)| Desc::new(f, l, fd)).collect();
            storage_xfer(&agent, Op::Write, &mem, MemKind::File { fd }, &files)
                .await
                .unwrap();
            // Overlapping file ranges in one request: the model cannot know which
            // write lands last, so lists overlapping on the file side only READ.
            for &(m, f, l) in list {
                model_file[f as usize..(f + l) as usize]
                    .copy_from_slice(&src_bytes[m as usize..(m + l) as usize]);
            }
            assert_eq!(
                std::fs::read(&path).unwrap(),
                model_file,
                "case {k}: file after WRITE {list:?}"
            );
            dst.write_at(0, &vec![0u8; MEM as usize]).unwrap();
            let back: Vec<Desc> = list.iter().map(|&(m, _, l)| dst.desc(m, l)).collect();
            // Memory overlapping on the READ side has the same problem: READ into
            // disjoint places only (the list's memory side is disjoint by construction).
            storage_xfer(&agent, Op::Read, &back, MemKind::File { fd }, &files)
                .await
                .unwrap();
            let got = dst.to_vec().unwrap();
            for &(m, f, l) in list {
                assert_eq!(
                    &got[m as usize..(m + l) as usize],
                    &model_file[f as usize..(f + l) as usize],
                    "case {k}: memory after READ"
                );
            }
        }
        shut_down_clean(&agent).await;
    });
}

/// Disjoint (memory, file) ranges: each list's pieces are cut from shuffled slots so
/// neither side overlaps.
fn lists() -> impl proptest::strategy::Strategy<Value = Vec<(u64, u64, u64)>> {
    use proptest::prelude::*;
    // 64 slots of 16 KiB on each side; a piece uses part of one slot.
    proptest::collection::vec((0u64..64, 0u64..64, 0u64..8192, 1u64..8192), 1..24).prop_map(|raw| {
        let (mut used_m, mut used_f) = (vec![false; 64], vec![false; 64]);
        raw.into_iter()
            .filter_map(|(ms, fs, skew, len)| {
                if used_m[ms as usize] || used_f[fs as usize] {
                    return None;
                }
                used_m[ms as usize] = true;
                used_f[fs as usize] = true;
                Some((ms * 16384 + skew, fs * 16384 + (8191 - skew), len))
            })
            .collect()
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(6))]
    #[test]
    fn random_lists_match_the_model_uring(cases in proptest::collection::vec(lists(), 8)) {
        if let Err(e) = PosixBackend::probe_uring() {
            nixl_testkit::skip("random_lists_match_the_model_uring", e);
            return Ok(());
        }
        model_check(Engine::Uring, false, &cases);
    }

    #[test]
    fn random_lists_match_the_model_inline(cases in proptest::collection::vec(lists(), 8)) {
        model_check(Engine::Pool, true, &cases);
    }

    #[test]
    fn random_lists_match_the_model_pool(cases in proptest::collection::vec(lists(), 8)) {
        model_check(Engine::Pool, false, &cases);
    }
}

#[tokio::test]
async fn the_engine_in_use_is_reported() {
    for engine in [Engine::Pool, Engine::Uring] {
        if engine == Engine::Uring && PosixBackend::probe_uring().is_err() {
            nixl_testkit::skip("the_engine_in_use_is_reported", "io_uring refused here");
            continue;
        }
        let b = Arc::new(PosixBackend::new(PosixOptions {
            engine,
            ..PosixOptions::default()
        }));
        assert!(b.engine().is_none(), "no engine before start");
        let a = nixl::Agent::builder("engine")
            .backend_arc(b.clone())
            .build()
            .await
            .unwrap();
        let report = b.engine().unwrap().to_owned();
        let want = if engine == Engine::Pool {
            "thread pool"
        } else {
            "io_uring"
        };
        assert!(report.starts_with(want), "{engine:?}: {report}");
        shut_down_clean(&a).await;
    }
    let _ = ErrorKind::Io;
}
