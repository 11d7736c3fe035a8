//! A backend's control connection authenticated with a shared secret, for backends
//! whose options may name a secret of their own (nixl-verbs, nixl-uccl).

use std::sync::Arc;

use nixl::{Agent, Backend, SharedSecret};

use crate::support::{bounded, one, remote};

/// The target proves "deployment-secret": as its agent's secret, or, with
/// `target_own`, as its backend's own (made by `make(Some(secret))`) while its agent
/// has another. Peers without it or with another are refused (`refused` checks the
/// error of their write) and reach no memory; a peer with it moves data.
pub async fn secret_authenticates_the_control_connection(
    make: impl Fn(Option<SharedSecret>) -> Arc<dyn Backend>,
    target_own: bool,
    refused: fn(&nixl::Error) -> bool,
) {
    let agent = |name: &'static str, secret: Option<&'static str>, own: Option<&'static str>| {
        let b = Agent::builder(name).backend_arc(make(own.map(|s| SharedSecret::new(s).unwrap())));
        let b = match secret {
            Some(s) => b.secret(SharedSecret::new(s).unwrap()),
            None => b,
        };
        async move { b.build().await.unwrap() }
    };
    let t = if target_own {
        agent("target", Some("the-agents-own"), Some("deployment-secret")).await
    } else {
        agent("target", Some("deployment-secret"), None).await
    };
    let mem = t.register(vec![0u8; 4096]).unwrap();
    let md = t.metadata().unwrap();
    for (name, secret) in [("none", None), ("wrong", Some("another-secret"))] {
        let a = agent(name, secret, None).await;
        let src = a.register(vec![7u8; 4096]).unwrap();
        a.load_metadata(&md).unwrap();
        let rd = remote(&a, "target", mem.id());
        let r = bounded(
            "write",
            a.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
        )
        .await;
        match r {
            Ok(()) => panic!("{name}: an unauthenticated peer's write succeeded"),
            Err(e) => assert!(refused(&e), "{name}: {e}"),
        }
        let _ = bounded("shutdown", a.shutdown()).await;
    }
    assert_eq!(
        mem.to_vec().unwrap(),
        vec![0u8; 4096],
        "nothing reached the memory"
    );
    let a = agent("insider", Some("deployment-secret"), None).await;
    let src = a.register(vec![9u8; 4096]).unwrap();
    a.load_metadata(&md).unwrap();
    let rd = remote(&a, "target", mem.id());
    bounded(
        "write",
        a.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap();
    assert_eq!(mem.to_vec().unwrap(), vec![9u8; 4096]);
    for x in [a, t] {
        assert!(bounded("shutdown", x.shutdown()).await.is_clean());
    }
}
