//! A post the device refuses (out of resources) destroys that queue pair; the
//! peer's next transfer and notification connect anew instead of failing with the
//! old error for as long as the control connection lasts. On the verbs **test
//! double**, whose fault is process-wide: this file holds one test.

use nixl_testkit::{bounded, double::one, remote};
use nixl_verbs::test_double::refuse_sends;

use common::agent;

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_post_costs_one_transfer_and_the_link_connects_anew() {
    let a = agent("a").await;
    let b = agent("b").await;
    let src = a.register(vec![5u8; 4096]).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let far = remote(&a, "b", dst.id());
    let (from, to) = (one(src.desc(0, 4096)), one(far.desc(0, 4096)));
    let write = || a.write(&from, "b", &to, None);
    bounded("the first write", write()).await.unwrap();

    refuse_sends(1);
    let e = bounded("the refused write", write()).await.unwrap_err();
    assert!(e.to_string().contains("out of resources"), "{e}");

    dst.write_at(0, &[0u8; 4096]).unwrap();
    bounded("the write after", write())
        .await
        .expect("the next write connects anew");
    assert_eq!(dst.to_vec().unwrap(), vec![5u8; 4096]);
    bounded("a notification after", a.notify("b", "after").unwrap())
        .await
        .expect("notifications connect anew too");
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
