//! Dynamo calls NIXL from `async fn`s on its tokio runtime's worker threads. The
//! library blocks on its own runtime at some calls (the agent's start, deregistering,
//! connecting, destroying); from inside another runtime that must neither panic nor
//! deadlock. Its own test binary: the whole test runs inside a tokio runtime.

use nixl_sys::{Agent, MemoryRegion, OptArgs, SystemStorage, XferDescList, XferOp, XferStatus};

fn list(s: &SystemStorage) -> XferDescList<'static> {
    let mut l = XferDescList::new(nixl_sys::MemType::Dram).unwrap();
    // SAFETY: the storage outlives every request made from this list here.
    l.add_desc(unsafe { s.as_ptr() } as usize, s.size(), 0);
    l
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_from_inside_a_tokio_runtime() {
    if nixl_sys::is_stub() {
        println!("SKIP nixl-capi conformance calls_from_inside_a_tokio_runtime: libnixl_capi.so not found");
        return;
    }
    for backend in ["TCP", "UCX"] {
        let a = Agent::new(&format!("async-a-{backend}")).unwrap();
        let b = Agent::new(&format!("async-b-{backend}")).unwrap();
        for x in [&a, &b] {
            let (_, p) = x.get_plugin_params(backend).unwrap();
            x.create_backend(backend, &p).unwrap();
        }
        let src = SystemStorage::new(4096).unwrap();
        let dst = SystemStorage::new(4096).unwrap();
        // The first registration starts the agent (the library blocks on its runtime).
        let ra = a
            .register_memory(&src, None)
            .expect("register from async code");
        let rb = b
            .register_memory(&dst, None)
            .expect("register from async code");
        let peer = a.load_remote_md(&b.get_local_md().unwrap()).unwrap();
        a.make_connection(&peer, None)
            .expect("connect from async code");
        let req = a
            .create_xfer_req(
                XferOp::Write,
                &list(&src),
                &list(&dst),
                &peer,
                Some(&OptArgs::new().unwrap()),
            )
            .unwrap();
        let mut running = a.post_xfer_req(&req, None).unwrap();
        while running {
            tokio::task::yield_now().await;
            running = matches!(a.get_xfer_status(&req).unwrap(), XferStatus::InProgress);
        }
        drop(req);
        // Deregistration and destruction block too.
        drop(ra);
        drop(rb);
        assert!(a.check_remote_metadata(&peer, None));
        drop(a);
        drop(b);
    }
}
