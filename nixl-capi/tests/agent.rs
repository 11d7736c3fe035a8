//! NIXL's C API semantics, through the safe layer under the C shims (the same
//! calls `libnixl_capi.so` makes), on the TCP and POSIX backends: no native
//! library, no nixl-sys. nixl-capi/conformance drives the real library through
//! nixl-sys.

use nixl::Op;
use nixl_capi::agent::{CAgent, Config};
use nixl_capi::lists::{mem, DescList, NotifMap, OptArgs, Params, RegDesc};
use nixl_capi::status::{BACKEND, INVALID_PARAM, IN_PROG, NOT_FOUND, SUCCESS};

fn tcp_agent(name: &str) -> CAgent {
    let a = CAgent::new(name, Config::default()).unwrap();
    let mut p = Params::default();
    p.add("listen", "127.0.0.1:0");
    a.create_backend("TCP", &p).unwrap();
    a
}

fn list(mem_type: u32, bufs: &[&[u8]]) -> DescList {
    let mut l = DescList::new(mem_type);
    for b in bufs {
        l.descs.push(RegDesc {
            addr: b.as_ptr() as u64,
            len: b.len() as u64,
            dev: 0,
            meta: Vec::new(),
        });
    }
    l
}

fn wait(req: &nixl_capi::xfer::XferReq, first: i32) {
    let mut st = first;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while st == IN_PROG {
        assert!(
            std::time::Instant::now() < deadline,
            "transfer still running"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
        st = req.status().unwrap();
    }
    assert_eq!(st, SUCCESS);
}

#[test]
fn write_with_a_notification_then_read_back_between_two_agents() {
    let a = tcp_agent("capi-a");
    let b = tcp_agent("capi-b");
    let src: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    let dst = vec![0u8; 65536];
    let back = vec![0u8; 65536];
    a.register(&list(mem::DRAM, &[&src, &back]), &OptArgs::default())
        .unwrap();
    b.register(&list(mem::DRAM, &[&dst]), &OptArgs::default())
        .unwrap();
    assert_eq!(a.load_remote_md(&b.local_md().unwrap()).unwrap(), "capi-b");
    assert_eq!(b.load_remote_md(&a.local_md().unwrap()).unwrap(), "capi-a");
    assert!(a
        .check_remote_md("capi-b", Some(&list(mem::DRAM, &[&dst])))
        .is_ok());
    assert_eq!(
        a.check_remote_md("nobody", None).unwrap_err().status,
        NOT_FOUND
    );

    let opt = OptArgs {
        notif_msg: b"written".to_vec(),
        has_notif: true,
        ..OptArgs::default()
    };
    let req = a
        .create_request(
            Op::Write,
            &list(mem::DRAM, &[&src]),
            &list(mem::DRAM, &[&dst]),
            "capi-b",
            Some(&opt),
        )
        .unwrap();
    assert_eq!(req.status().unwrap_err().status, BACKEND, "never posted");
    wait(&req, req.post(None).unwrap());
    assert_eq!(src, dst);
    assert_eq!(
        req.status().unwrap(),
        SUCCESS,
        "an ended post keeps its answer"
    );
    let mut map = NotifMap::default();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while map.0.is_empty() {
        assert!(std::time::Instant::now() < deadline, "no notification");
        b.get_notifs(&mut map, None).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(map.of(b"capi-a").unwrap(), &vec![b"written".to_vec()]);
    req.release().unwrap();
    assert_eq!(req.release().unwrap_err().status, INVALID_PARAM);

    // Prepared lists by index; out-of-range indices are INVALID_PARAM.
    let local = a.prep("", &list(mem::DRAM, &[&back])).unwrap();
    let remote = a.prep("capi-b", &list(mem::DRAM, &[&dst])).unwrap();
    assert_eq!(
        a.make_request(Op::Read, &local, &[1], &remote, &[0], None)
            .unwrap_err()
            .status,
        INVALID_PARAM
    );
    assert_eq!(
        a.make_request(Op::Read, &remote, &[0], &local, &[0], None)
            .unwrap_err()
            .status,
        INVALID_PARAM,
        "sides swapped"
    );
    let req = a
        .make_request(Op::Read, &local, &[0], &remote, &[0], None)
        .unwrap();
    wait(&req, req.post(None).unwrap());
    assert_eq!(back, src);
    assert_eq!(
        a.prep("nobody", &list(mem::DRAM, &[&dst]))
            .unwrap_err()
            .status,
        NOT_FOUND
    );

    // A one-shot request's failures are all BACKEND, as NIXL's.
    let bad = a.create_request(
        Op::Write,
        &list(mem::DRAM, &[&src]),
        &list(mem::DRAM, &[&dst]),
        "nobody",
        None,
    );
    assert_eq!(bad.unwrap_err().status, BACKEND);

    // The agent is in use: a new backend is refused, saying why.
    let e = a.create_backend("POSIX", &Params::default()).unwrap_err();
    assert_eq!(e.status, BACKEND);
    assert!(e.message.contains("create every backend first"), "{e}");

    // A notification to itself arrives in its own next get_notifs.
    a.gen_notif("capi-a", b"self").unwrap();
    let mut mine = NotifMap::default();
    a.get_notifs(&mut mine, None).unwrap();
    assert_eq!(mine.of(b"capi-a").unwrap(), &vec![b"self".to_vec()]);

    a.invalidate_remote_md("capi-b").unwrap();
    assert_eq!(
        a.invalidate_remote_md("capi-b").unwrap_err().status,
        NOT_FOUND
    );
    assert_eq!(
        a.invalidate_remote_md("capi-a").unwrap_err().status,
        INVALID_PARAM
    );
}

#[test]
fn the_same_descriptor_registered_twice_stays_until_the_last_deregistration() {
    let a = tcp_agent("capi-twice");
    let buf = vec![0u8; 4096];
    let l = list(mem::DRAM, &[&buf]);
    a.register(&l, &OptArgs::default()).unwrap();
    a.register(&l, &OptArgs::default()).unwrap();
    a.deregister(&l).unwrap();
    assert!(a.prep("", &l).is_ok(), "still registered once");
    a.deregister(&l).unwrap();
    assert_eq!(a.prep("", &l).unwrap_err().status, NOT_FOUND);
    assert_eq!(a.deregister(&l).unwrap_err().status, NOT_FOUND);
}

#[test]
fn memory_no_backend_serves_is_not_found() {
    let a = tcp_agent("capi-file");
    let file = list(mem::FILE, &[&[0u8; 16]]);
    assert_eq!(
        a.register(&file, &OptArgs::default()).unwrap_err().status,
        NOT_FOUND
    );
    assert_eq!(
        a.register(&list(mem::OBJECT, &[&[0u8; 16]]), &OptArgs::default())
            .unwrap_err()
            .status,
        NOT_FOUND
    );
    let mut m = NotifMap::default();
    let posix = CAgent::new("capi-posix", Config::default()).unwrap();
    posix.create_backend("POSIX", &Params::default()).unwrap();
    assert_eq!(
        posix.get_notifs(&mut m, None).unwrap_err().status,
        BACKEND,
        "POSIX carries no notifications"
    );
    assert_eq!(
        CAgent::new("capi-x", Config::default())
            .unwrap()
            .create_backend("GDS_MT", &Params::default())
            .unwrap_err()
            .status,
        BACKEND
    );
}

#[test]
fn query_mem_answers_for_files_through_posix_only() {
    let a = CAgent::new("capi-query", Config::default()).unwrap();
    a.create_backend("POSIX", &Params::default()).unwrap();
    let dir = std::env::temp_dir().join(format!("nixl-capi-query-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f.bin");
    std::fs::write(&path, vec![1u8; 123]).unwrap();
    let mut l = DescList::new(mem::FILE);
    for p in [path.clone(), dir.join("missing")] {
        l.descs.push(RegDesc {
            meta: p.to_str().unwrap().as_bytes().to_vec(),
            ..RegDesc::default()
        });
    }
    let only = |names: Vec<&'static str>| OptArgs {
        backends: names,
        ..OptArgs::default()
    };
    let r = a.query_mem(&l, Some(&only(vec!["posix"]))).unwrap();
    assert_eq!(r.0.len(), 2);
    let found = r.0[0].as_ref().unwrap().pairs();
    assert!(found.contains(&("size".into(), "123".into())), "{found:?}");
    assert!(r.0[1].is_none());
    assert_eq!(a.query_mem(&l, None).unwrap_err().status, INVALID_PARAM);
    assert_eq!(
        a.query_mem(&l, Some(&only(vec!["tcp"])))
            .unwrap_err()
            .status,
        BACKEND
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn one_agent_posts_and_polls_from_several_threads() {
    let a = std::sync::Arc::new(tcp_agent("capi-threads-a"));
    let b = tcp_agent("capi-threads-b");
    const THREADS: usize = 4;
    const LEN: usize = 16 << 10;
    let src: Vec<Vec<u8>> = (0..THREADS).map(|t| vec![t as u8 + 1; LEN]).collect();
    let dst: Vec<Vec<u8>> = (0..THREADS).map(|_| vec![0u8; LEN]).collect();
    for s in &src {
        a.register(&list(mem::DRAM, &[s]), &OptArgs::default())
            .unwrap();
    }
    for d in &dst {
        b.register(&list(mem::DRAM, &[d]), &OptArgs::default())
            .unwrap();
    }
    a.load_remote_md(&b.local_md().unwrap()).unwrap();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (a, src, dst) = (a.clone(), &src[t], &dst[t]);
            s.spawn(move || {
                let req = a
                    .create_request(
                        Op::Write,
                        &list(mem::DRAM, &[src]),
                        &list(mem::DRAM, &[dst]),
                        "capi-threads-b",
                        None,
                    )
                    .unwrap();
                for _ in 0..50 {
                    wait(&req, req.post(None).unwrap());
                }
            });
        }
    });
    for (t, d) in dst.iter().enumerate() {
        assert!(
            d.iter().all(|&x| x == t as u8 + 1),
            "thread {t}'s bytes arrived"
        );
    }
}
