//! Hostile hellos on nixl-verbs' control listener, on the verbs **test double** (no
//! NIC): the queue pairs a hello asks for are made only within a budget per source
//! and a share of the completion queue, so a flood of hellos (each asking for the
//! most queue pairs a hello may) neither locks other peers out nor leaves this agent
//! unable to connect to anyone.
//!
//! The double's device is given a real NIC's room here (a 65,536-entry completion
//! queue, 1,024-entry queues), so the backend runs with its default options as on
//! hardware: 64 entries per inbound queue pair, 512 per outgoing one. The limits are
//! process-wide: every case of this file sets the same ones.
//!
//! The hostile clients connect from another loopback address (127.0.0.2 and up) than
//! the legitimate peers (127.0.0.1), as hosts of their own would.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use nixl::{Agent, AgentOptions, Backend, DescList, ErrorKind, MemKind, SharedSecret};
use nixl_verbs::test_double::{set_limits, Limits};
use nixl_verbs::wire::{ConnInfo, Hello, QpHalf, Reply, MAX_QPS};
use nixl_verbs::{VerbsBackend, VerbsOptions};
use tokio::net::{TcpSocket, TcpStream};

/// Hostile hellos per case.
const HELLOS: usize = 100;
/// A bound that only a hang reaches.
const HANG: Duration = Duration::from_secs(30);

/// A real NIC's room on the double (its defaults are small to exercise splitting).
fn nic_sized() {
    let mut l = Limits::DEFAULT;
    l.device.max_cqe = 65536;
    l.device.max_qp_wr = 1024;
    set_limits(l);
}

fn options() -> VerbsOptions {
    VerbsOptions {
        // Small notification buffers: up to a thousand inbound queue pairs are made
        // on the old code, each with 64 of them.
        max_notification: 256,
        ..VerbsOptions::default()
    }
}

async fn agent(name: &str, secret: Option<&str>) -> (Agent, VerbsBackend) {
    let vb = VerbsBackend::with_test_double(options()).unwrap();
    let mut b = Agent::builder(name)
        .backend(vb.clone())
        .options(AgentOptions {
            drain_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(5),
        });
    if let Some(s) = secret {
        b = b.secret(SharedSecret::new(s).unwrap());
    }
    (b.build().await.unwrap(), vb)
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for {HANG:?}"))
}

/// `from` writes 4 KiB into a fresh registration of `to` and the bytes land.
async fn write_lands(from: &Agent, to: &Agent, seed: u8) -> nixl::Result<()> {
    from.load_metadata(&to.metadata()?)?;
    let src = from.register(vec![seed; 4096])?;
    let dst = to.register(vec![0u8; 4096])?;
    from.load_metadata(&to.metadata()?)?;
    let r = from
        .remote_regions(to.name())?
        .into_iter()
        .find(|r| r.id == dst.id())
        .expect("the target's new region is in its metadata");
    bounded(
        "write",
        from.write(
            &DescList::from_descs(MemKind::Dram, [src.whole()]),
            to.name(),
            &DescList::from_descs(MemKind::Dram, [r.desc(0, 4096)]),
            None,
        ),
    )
    .await?;
    assert_eq!(dst.to_vec().unwrap(), vec![seed; 4096], "the bytes landed");
    Ok(())
}

/// A raw control connection from `source`: optionally authenticated as `name` with
/// `secret`, then a hello for the most queue pairs a hello may ask; what the target
/// answered (`None`: it closed without an answer). The stream stays open, so the
/// target keeps whatever it made for it.
async fn hostile_hello(
    target: &ConnInfo,
    source: Ipv4Addr,
    name: &str,
    secret: Option<&SharedSecret>,
) -> (TcpStream, Option<Reply>) {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(IpAddr::V4(source), 0)).unwrap();
    let mut s = sock.connect(target.control).await.unwrap();
    if let Some(secret) = secret {
        nixl::control::authenticate_client(
            &mut s,
            "nixl-verbs control",
            Some(secret),
            name,
            "target",
            "the target",
            HANG,
        )
        .await
        .unwrap();
    }
    let hello = Hello {
        agent: name.to_owned(),
        // The target's own endpoint: a valid one that reaches nothing of ours.
        endpoint: target.endpoint,
        qps: (0..MAX_QPS as u32)
            .map(|i| QpHalf {
                qp_num: 0x10_0000 + i,
                psn: i,
            })
            .collect(),
    };
    nixl::control::write_frame(&mut s, &hello.encode())
        .await
        .unwrap();
    let reply = match nixl::control::read_frame(&mut s, 64 * 1024).await {
        Ok(Some(f)) => Some(Reply::decode(&f).unwrap()),
        Ok(None) | Err(_) => None,
    };
    (s, reply)
}

fn conn_info(vb: &VerbsBackend) -> ConnInfo {
    ConnInfo::decode(&vb.connection_info()).unwrap()
}

fn count(replies: &[Option<Reply>]) -> (usize, usize) {
    let ok = replies
        .iter()
        .filter(|r| matches!(r, Some(Reply::Accepted { .. })))
        .count();
    (ok, replies.len() - ok)
}

/// A hundred hellos from one address, each asking for the most queue pairs (16):
/// that address gets its budget (32 queue pairs) and no more, a legitimate peer then
/// connects to the agent and WRITEs, and the agent itself still connects out and
/// WRITEs. Before the budget, about 64 such hellos took the whole completion queue
/// (65,536 entries, 64 per inbound queue pair) and both failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_hostile_hellos_from_one_address_lock_no_one_out() {
    nic_sized();
    let (target, tb) = agent("target", None).await;
    let (initiator, _) = agent("initiator", None).await;
    let (other, _) = agent("other", None).await;
    let info = conn_info(&tb);
    let mut held = Vec::new();
    let mut replies = Vec::new();
    for i in 0..HELLOS {
        let (s, r) = bounded(
            "hostile hello",
            hostile_hello(&info, Ipv4Addr::new(127, 0, 0, 2), &format!("h{i}"), None),
        )
        .await;
        held.push(s);
        replies.push(r);
    }
    // The peer on another address connects in, and the agent connects out.
    write_lands(&initiator, &target, 7)
        .await
        .expect("a legitimate peer connects after the flood");
    write_lands(&target, &other, 9)
        .await
        .expect("the flooded agent still connects out");
    let (accepted, refused) = count(&replies);
    let budget = VerbsOptions::default().max_qps_per_source;
    assert!(
        accepted * MAX_QPS <= budget,
        "{accepted} hellos of {MAX_QPS} queue pairs accepted from one address; its budget is {budget}"
    );
    nixl_testkit::figure(
        "hostile: nixl-verbs, 100 hellos of 16 queue pairs from one address (test double, 65,536-entry completion queue)",
        format!("{accepted} accepted ({} queue pairs, the address's budget {budget}), {refused} refused; a peer then connected in and its WRITE landed, and the agent connected out and its WRITE landed"
        , accepted * MAX_QPS),
    );
    drop(held);
    for a in [initiator, target, other] {
        assert!(bounded("shutdown", a.shutdown()).await.is_clean());
    }
}

/// A hundred hellos of 16 queue pairs from a hundred addresses: together they get at
/// most the completion queue's inbound share, so the agent still connects out and
/// WRITEs; a legitimate peer is refused while the share is full (with a reason that
/// names the limit, at once, not a hang), and served once the hostile connections
/// close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_hostile_addresses_leave_room_for_outgoing_connections() {
    nic_sized();
    let (target, tb) = agent("target", None).await;
    let (initiator, _) = agent("initiator", None).await;
    let (other, _) = agent("other", None).await;
    let info = conn_info(&tb);
    let mut held = Vec::new();
    let mut replies = Vec::new();
    for i in 0..HELLOS {
        let from = Ipv4Addr::new(127, 0, 0, 2 + i as u8);
        let (s, r) = bounded(
            "hostile hello",
            hostile_hello(&info, from, &format!("h{i}"), None),
        )
        .await;
        held.push(s);
        replies.push(r);
    }
    write_lands(&target, &other, 9)
        .await
        .expect("the flooded agent still connects out");
    let (accepted, refused) = count(&replies);
    // Half of the 65,536 entries stay for outgoing queue pairs: 512 inbound ones.
    assert!(
        accepted * MAX_QPS * 64 <= 65536 / 2,
        "{accepted} hellos of {MAX_QPS} queue pairs accepted; more than half the completion queue"
    );
    let e = write_lands(&initiator, &target, 7)
        .await
        .expect_err("the inbound share is full");
    assert!(e.to_string().contains("outgoing_cq_reserve"), "{e}");
    drop(held);
    // The target sees the hostile connections end and lets their queue pairs go.
    let mut served = Err(e);
    for _ in 0..100 {
        served = write_lands(&initiator, &target, 7).await;
        if served.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    served.expect("a legitimate peer connects once the flood is gone");
    nixl_testkit::figure(
        "hostile: nixl-verbs, 100 hellos of 16 queue pairs from 100 addresses (test double, 65,536-entry completion queue)",
        format!("{accepted} accepted ({} queue pairs, {} entries: the inbound half), {refused} refused; the agent connected out and its WRITE landed; a peer was refused while they stayed and served once they left", accepted * MAX_QPS, accepted * MAX_QPS * 64),
    );
    for a in [initiator, target, other] {
        assert!(bounded("shutdown", a.shutdown()).await.is_clean());
    }
}

/// With a secret: a hundred hellos without authentication make nothing, and a
/// hundred that authenticate (a client that knows the secret) as one agent get that
/// agent's budget and no more; another peer then connects in and the agent connects
/// out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_unauthenticated_hellos_make_nothing_and_a_peer_has_a_budget() {
    nic_sized();
    const KEY: &str = "a shared secret for the hostile hellos";
    let (target, tb) = agent("target", Some(KEY)).await;
    let (initiator, _) = agent("initiator", Some(KEY)).await;
    let (other, _) = agent("other", Some(KEY)).await;
    let info = conn_info(&tb);
    let secret = SharedSecret::new(KEY).unwrap();
    let mut held = Vec::new();
    let mut plain = Vec::new();
    let mut proven = Vec::new();
    for i in 0..HELLOS {
        let from = Ipv4Addr::new(127, 0, 0, 2);
        let (s, r) = bounded(
            "hostile hello",
            hostile_hello(&info, from, &format!("h{i}"), None),
        )
        .await;
        held.push(s);
        plain.push(r);
        let (s, r) = bounded(
            "authenticated hello",
            hostile_hello(&info, from, "mallory", Some(&secret)),
        )
        .await;
        held.push(s);
        proven.push(r);
    }
    write_lands(&initiator, &target, 7)
        .await
        .expect("another peer connects after the flood");
    write_lands(&target, &other, 9)
        .await
        .expect("the flooded agent still connects out");
    assert_eq!(count(&plain).0, 0, "no unauthenticated hello was accepted");
    let (accepted, refused) = count(&proven);
    let budget = VerbsOptions::default().max_qps_per_source;
    assert!(
        accepted * MAX_QPS <= budget,
        "{accepted} hellos of {MAX_QPS} queue pairs accepted for one agent; its budget is {budget}"
    );
    nixl_testkit::figure(
        "hostile: nixl-verbs with a secret, 100 unauthenticated and 100 authenticated hellos of 16 queue pairs (test double)",
        format!("unauthenticated: 0 accepted of {HELLOS}; authenticated as one agent: {accepted} accepted, {refused} refused; another peer then connected in and the agent connected out, both WRITEs landed"),
    );
    drop(held);
    for a in [initiator, target, other] {
        assert!(bounded("shutdown", a.shutdown()).await.is_clean());
    }
}

/// A budget that cannot admit one connection is refused before anything opens.
#[test]
fn a_zero_budget_is_refused() {
    let e = VerbsBackend::with_test_double(VerbsOptions {
        max_qps_per_source: 0,
        ..VerbsOptions::default()
    })
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("max_qps_per_source"), "{e}");
}
