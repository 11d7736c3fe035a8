//! The conformance suite on nixl-verbs over its verbs **test double**
//! (`nixl_verbs::test_double`): software queue pairs in this process that follow verbs
//! semantics (state machine, keys and bounds, send-queue capacity, completion
//! channels armed for the next completion, receive-not-ready waits, flushes) and
//! copy bytes between registrations.
//!
//! This proves nixl-verbs' structure (handshake, posting within the send queue,
//! selective signalling, notifications after data and in order, failures, teardown
//! order) on any machine. It does not exercise a NIC: `tests/verbs.rs` runs the same
//! suite on a real device where one exists.

use std::sync::Arc;

use nixl_conformance::{conformance_tests, BackendUnderTest};
use nixl_verbs::{VerbsBackend, VerbsOptions};

const VERBS_DOUBLE: BackendUnderTest = BackendUnderTest {
    name: "verbs (test double)",
    make: || {
        Ok(Arc::new(VerbsBackend::with_test_double(
            VerbsOptions::default(),
        )?))
    },
    skip_case: |_| None,
};

conformance_tests!(VERBS_DOUBLE);

/// Two queue pairs per peer: transfers are spread over both, and notifications still
/// follow their data in posting order.
mod two_queue_pairs {
    use super::*;

    const VERBS_DOUBLE_2QP: BackendUnderTest = BackendUnderTest {
        name: "verbs (test double, 2 queue pairs per peer)",
        make: || {
            Ok(Arc::new(VerbsBackend::with_test_double(VerbsOptions {
                qps_per_peer: 2,
                ..VerbsOptions::default()
            })?))
        },
        skip_case: |_| None,
    };

    conformance_tests!(VERBS_DOUBLE_2QP;
        write_read_sizes,
        many_descriptors_and_merging,
        strided_lists,
        notifications_after_data_in_order,
        standalone_notifications,
        prepared_reposts,
        peer_shutdown_mid_transfer,
        drop_in_flight_then_shutdown,
        dropped_peers_never_hang,
    );
}

/// Nothing the suite did misused the verbs API (a destroyed handle used, a
/// completion queue destroyed with events unacknowledged or queue pairs on it, a
/// protection domain freed with regions or queue pairs left, a device closed with
/// anything open), and every object was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zz_no_verbs_misuse() {
    // The world is process-wide: under `cargo test` this sees every case of the
    // file; under nextest (a process per case) only its own.
    nixl_conformance::cases::three_agents_one_process(&VERBS_DOUBLE).await;
    assert_eq!(nixl_verbs::test_double::violations(), Vec::<String>::new());
    // Leaks are counted where this case has the process (and the world) to itself.
    if nixl_conformance::support::own_thread_count("zz_no_verbs_misuse (leak count)").is_some() {
        assert_eq!(
            nixl_verbs::test_double::live_objects(),
            0,
            "every verbs object released: {:?}",
            nixl_verbs::test_double::live_details()
        );
    }
}

/// The VRAM cases with the core's **host stand-in** for GPU memory
/// (`nixl::gpu::use_host_stand_in`, a test double too: device memory is host memory,
/// registered through the double's `ibv_reg_dmabuf_mr`). It proves the ordering and
/// lifetime rules hold for GPU registrations; GPUDirect RDMA runs only on hardware.
mod gpu_stand_in {
    use super::*;

    const VERBS_DOUBLE_GPU: BackendUnderTest = BackendUnderTest {
        name: "verbs (test double, GPU host stand-in)",
        make: || {
            nixl::gpu::use_host_stand_in();
            (VERBS_DOUBLE.make)()
        },
        skip_case: |_| None,
    };

    conformance_tests!(VERBS_DOUBLE_GPU;
        vram_transfers,
        vram_notifications_after_data,
        vram_lifetime,
        vram_peer_gone_mid_transfer,
    );
}

/// The agent's secret (`AgentBuilder::secret`) authenticates nixl-verbs' control
/// connection before any queue pair is made: a peer without it (or with another)
/// is refused and reaches no memory; with it, transfers work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_secret_authenticates_the_control_connection() {
    nixl_conformance::secret::secret_authenticates_the_control_connection(
        with_own_secret,
        false,
        refused,
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
        refused,
    )
    .await;
}

/// A verbs backend (its test double) with its own secret, if any.
fn with_own_secret(own: Option<nixl::SharedSecret>) -> Arc<dyn nixl::Backend> {
    Arc::new(
        VerbsBackend::with_test_double(VerbsOptions {
            listener: nixl::control::ListenerOptions {
                secret: own,
                ..nixl::control::ListenerOptions::default()
            },
            ..VerbsOptions::default()
        })
        .unwrap(),
    )
}

/// A refusal of the secret, as nixl-verbs reports it.
fn refused(e: &nixl::Error) -> bool {
    e.kind() == nixl::ErrorKind::NotAllowed || e.to_string().contains("shared secret")
}
