//! No thread of nixl-rs' libnixl_capi.so spins while agents are idle. Its own
//! test binary: the process's CPU time is the measure, and other tests would add
//! theirs.

use std::time::Duration;

use nixl_sys::{Agent, SystemStorage};

fn worker(name: &str, backend: &str) -> Agent {
    let agent = Agent::new(name).expect("create agent");
    let (_, params) = agent.get_plugin_params(backend).expect("plugin params");
    agent
        .create_backend(backend, &params)
        .expect("create backend");
    agent
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Connected agents with registered memory and nothing to do use no CPU: no
/// thread of the library spins (NIXL's C API default starts a progress thread;
/// nixl-rs' backends wait on events). A spinning thread would use most of a core
/// over the 2 s; the bound is a quarter of one.
#[test]
fn idle_agents_do_not_spin() {
    if nixl_sys::is_stub() {
        println!("SKIP nixl-capi conformance idle_agents_do_not_spin: libnixl_capi.so not found");
        return;
    }
    for backend in ["TCP", "UCX"] {
        let a = worker(&format!("idle-a-{backend}"), backend);
        let b = worker(&format!("idle-b-{backend}"), backend);
        let (sa, sb) = (
            SystemStorage::new(1 << 20).unwrap(),
            SystemStorage::new(1 << 20).unwrap(),
        );
        let _ra = a.register_memory(&sa, None).unwrap();
        let _rb = b.register_memory(&sb, None).unwrap();
        let peer = a.load_remote_md(&b.get_local_md().unwrap()).unwrap();
        a.make_connection(&peer, None).unwrap();
        let before = cpu_seconds();
        std::thread::sleep(Duration::from_secs(2));
        let used = cpu_seconds() - before;
        println!("FIGURE nixl-capi idle CPU over 2 s, two {backend} agents: {used:.3} s");
        assert!(
            used < 0.5,
            "{backend}: {used:.3} s of CPU while idle for 2 s"
        );
    }
}
