//! The shared conformance suite: every nixl backend must pass these cases.
//!
//! Cases are `pub async fn`s over a [`BackendUnderTest`]; a backend's test file runs
//! each of them through [`conformance_tests!`]. Cases pick what they need by
//! [`Capabilities`](nixl::Capabilities), never by backend name, and print a visible
//! `SKIP` line (and return without asserting) when the backend lacks a capability or
//! its native library is absent.
#![deny(unsafe_code)]

pub mod cases;
/// A real etcd server for tests (from the shared test kit).
#[cfg(feature = "etcd")]
pub use nixl_testkit::etcd as etcd_server;
pub mod secret;
pub mod storage;
pub mod support;
#[cfg(feature = "tcp")]
pub mod tcp;
pub mod torture;

pub use support::BackendUnderTest;

/// Generate one `#[tokio::test]` per conformance case for a backend.
///
/// `$but` is an expression of type [`BackendUnderTest`].
#[macro_export]
macro_rules! conformance_tests {
    ($but:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                if let Some(why) = ($but.skip_case)(stringify!($case)) {
                    return $crate::support::skip(stringify!($case), &why);
                }
                $crate::cases::$case(&$but).await;
            }
        )*
    };
    ($but:expr) => {
        $crate::conformance_tests!($but;
            metadata_round_trip,
            write_read_sizes,
            many_descriptors_and_merging,
            strided_lists,
            local_transfers,
            notifications_after_data_in_order,
            standalone_notifications,
            prepared_reposts,
            invalid_inputs_rejected,
            stale_generation_refused,
            one_shot_survives_reloads,
            forged_key_refused,
            wire_out_of_range_refused,
            deregister_in_flight_refused,
            peer_shutdown_mid_transfer,
            drop_in_flight_then_shutdown,
            drop_agent_ends_tasks,
            three_agents_one_process,
            dropped_peers_never_hang,
            moved_peer_closed,
            vram_transfers,
            vram_notifications_after_data,
            vram_lifetime,
            vram_peer_gone_mid_transfer,
        );
    };
}
