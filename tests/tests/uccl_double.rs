//! The conformance suite on nixl-uccl over its engine **test double**
//! (`nixl_uccl::test_double`): in-process engines that reproduce UCCL's blocking
//! behaviour (accept deaf to stop-accept until the first registration, connect that
//! blocks until accepted, transfers to a vanished peer that are never done) and copy
//! bytes between registrations of this process.
//!
//! This proves nixl-uccl's structure (handshake, ordering of notifications after data,
//! liveness, teardown order) on any machine. It does not exercise UCCL's data path:
//! `tests/uccl.rs` runs the same suite against the real engine where one loads.

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};
use nixl_uccl::test_double::TestDouble;
use nixl_uccl::{UcclBackend, UcclOptions};

const UCCL_DOUBLE: BackendUnderTest = BackendUnderTest {
    name: "uccl (test double)",
    make: || {
        Ok(Arc::new(UcclBackend::with_api(
            TestDouble::api(),
            UcclOptions::default(),
        )))
    },
    skip_case: |_| None,
};

conformance_tests!(UCCL_DOUBLE);

/// Nothing the suite did misused the engine (a call on a destroyed engine or
/// connection, an engine destroyed with connections or registrations open, accept
/// entered before the first registration), and nothing went through UCCL's
/// process-wide notification list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zz_no_engine_misuse() {
    // The world is process-wide: under `cargo test` this sees every case of the
    // file; under nextest (a process per case) only its own, and nixl-uccl's
    // lifecycle and stress tests check theirs.
    nixl_conformance::cases::three_agents_one_process(&UCCL_DOUBLE).await;
    assert_eq!(nixl_uccl::test_double::violations(), Vec::<String>::new());
    assert_eq!(nixl_uccl::test_double::notifications_sent(), 0);
}

/// The VRAM cases on the test double with the core's **host stand-in** for GPU memory
/// (`nixl::gpu::use_host_stand_in`, a test double too: device memory is host memory).
/// It proves nixl-uccl hands GPU registrations to the engine and keeps the suite's
/// ordering and lifetime rules for them; UCCL's own GPU path runs only on hardware
/// (`tests/uccl.rs`).
mod gpu_stand_in {
    use super::*;

    const UCCL_DOUBLE_GPU: BackendUnderTest = BackendUnderTest {
        name: "uccl (test double, GPU host stand-in)",
        make: || {
            nixl::gpu::use_host_stand_in();
            (UCCL_DOUBLE.make)()
        },
        skip_case: |_| None,
    };

    conformance_tests!(UCCL_DOUBLE_GPU;
        vram_transfers,
        vram_notifications_after_data,
        vram_lifetime,
        vram_peer_gone_mid_transfer,
    );
}

/// The agent's secret (`AgentBuilder::secret`) authenticates nixl-uccl's control
/// connection: a peer without it (or with another) gets no answer to its hello and
/// moves nothing; with it, transfers work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_secret_authenticates_the_control_connection() {
    nixl_conformance::secret::secret_authenticates_the_control_connection(
        with_own_secret,
        false,
        |_| true,
    )
    .await;
}

/// The backend's own secret (its options' `secret`) wins over the agent's: a target
/// whose agent has another secret still admits only peers with the backend's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backends_own_secret_wins_over_the_agents() {
    nixl_conformance::secret::secret_authenticates_the_control_connection(
        with_own_secret,
        true,
        |_| true,
    )
    .await;
}

/// A uccl backend (its test double) with its own secret, if any.
fn with_own_secret(own: Option<nixl::SharedSecret>) -> Arc<dyn nixl::Backend> {
    Arc::new(nixl_uccl::UcclBackend::with_api(
        nixl_uccl::test_double::TestDouble::api(),
        nixl_uccl::UcclOptions {
            listener: nixl::control::ListenerOptions {
                secret: own,
                ..nixl::control::ListenerOptions::default()
            },
            ..nixl_uccl::UcclOptions::default()
        },
    ))
}

/// UCCL 0.1.1 reports a failed operation as done ([`lose_data`] makes the double do
/// that while the peer stays healthy). With confirmation (the default) such a WRITE
/// or READ fails instead of succeeding, and a WRITE's notification is never
/// delivered; with `confirm: false` the loss goes unseen, which is why it is on.
///
/// [`lose_data`]: nixl_uccl::test_double::lose_data
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_operations_are_never_reported_done() {
    use bytes::Bytes;
    use nixl::{Agent, ErrorKind};
    use nixl_conformance::support::{bounded, one, remote};
    const LEN: usize = 1 << 20;
    for confirm in [true, false] {
        let tb = UcclBackend::with_api(TestDouble::api(), UcclOptions::default());
        let t = Agent::builder("target")
            .backend(tb.clone())
            .build()
            .await
            .unwrap();
        let mem = t.register(vec![0u8; LEN]).unwrap();
        let mut notes = t.notifications().unwrap();
        let a = Agent::builder("initiator")
            .backend(UcclBackend::with_api(
                TestDouble::api(),
                UcclOptions {
                    confirm,
                    ..Default::default()
                },
            ))
            .build()
            .await
            .unwrap();
        let src = a.register(vec![7u8; LEN]).unwrap();
        let back = a.register(vec![0u8; 4096]).unwrap();
        a.load_metadata(&t.metadata().unwrap()).unwrap();
        let rd = remote(&a, "target", mem.id());
        let note = |m: &'static str| Some(Bytes::from_static(m.as_bytes()));

        // Healthy: confirmed, delivered.
        bounded(
            "write",
            a.write(
                &one(src.desc(0, 4096)),
                "target",
                &one(rd.desc(0, 4096)),
                note("first"),
            ),
        )
        .await
        .unwrap();
        let n = bounded("notification", notes.recv()).await.unwrap();
        assert_eq!(&n.msg[..], b"first");

        // The engine now loses every operation towards the target.
        nixl_uccl::test_double::lose_data(&tb.engine_metadata().unwrap(), true);
        let w = bounded(
            "lost write",
            a.write(
                &one(src.desc(4096, (LEN - 4096) as u64)),
                "target",
                &one(rd.desc(4096, (LEN - 4096) as u64)),
                note("lost"),
            ),
        )
        .await;
        let r = bounded(
            "lost read",
            a.read(&one(back.whole()), "target", &one(rd.desc(0, 4096)), None),
        )
        .await;
        assert!(
            mem.to_vec().unwrap()[4096..].iter().all(|&b| b == 0),
            "the double really lost the write"
        );
        assert_eq!(back.to_vec().unwrap(), vec![0u8; 4096], "and the read");
        if confirm {
            let e = w.expect_err("a lost write reported done");
            assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
            assert!(e.to_string().contains("differ"), "{e}");
            let e = r.expect_err("a lost read reported done");
            assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
        } else {
            assert!(w.is_ok() && r.is_ok(), "unconfirmed, the loss goes unseen");
        }
        nixl_uccl::test_double::lose_data(&tb.engine_metadata().unwrap(), false);
        bounded("notify", a.notify("target", "after").unwrap())
            .await
            .unwrap();
        let n = bounded("notification", notes.recv()).await.unwrap();
        if confirm {
            assert_eq!(
                &n.msg[..],
                b"after",
                "the lost write's notification never went"
            );
        } else {
            assert_eq!(&n.msg[..], b"lost");
        }
        drop(notes);
        assert!(bounded("shutdown", a.shutdown()).await.is_clean());
        assert!(bounded("shutdown", t.shutdown()).await.is_clean());
    }
}
