//! A target whose completion loop failed for good (a device error: nothing polls
//! its completion queue any more) refuses new connections, so an initiator's
//! notification fails naming the failure instead of landing in a buffer nobody
//! reads. On the verbs **test double**, whose fault is process-wide: this file
//! holds one test.

use std::time::Duration;

use nixl_testkit::bounded;

use common::agent;

mod common;

/// A target whose completion loop failed for good (nothing polls its completion
/// queue any more) refuses new connections: an initiator's notification fails,
/// naming the failure, instead of landing in a buffer nobody reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_whose_completions_stopped_refuses_new_peers() {
    let a = agent("a2").await;
    let b = agent("b2").await;
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let mut notes = b.notifications().unwrap();
    bounded("a first notification", a.notify("b2", "one").unwrap())
        .await
        .unwrap();
    bounded("its delivery", notes.recv()).await.unwrap();

    // The next receive completion's poll fails: b2's loop stops for good and closes
    // its queue pairs.
    nixl_verbs::test_double::fail_receive_poll();
    let _ = bounded(
        "the notification that breaks it",
        a.notify("b2", "two").unwrap(),
    )
    .await;
    // What a2 sends before b2's loop noticed lands unread, as on a NIC (the sender
    // saw it placed); once its link fails, a2 connects again and is refused.
    let e = bounded("a refused notification", async {
        loop {
            match a.notify("b2", "three").unwrap().await {
                Err(e) if e.to_string().contains("device error") => break e,
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    })
    .await;
    assert!(e.to_string().contains("could not accept"), "{e}");
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
