//! The one place that maps backend names to the transports compiled into this binary
//! (one cargo feature per transport crate), and turns `--backend-param KEY=VALUE` into
//! each backend's options.

use std::net::IpAddr;
use std::sync::Arc;

use nixl::Backend;

use crate::error::{fail, Result};

/// Every backend name the bench knows, built in or not.
pub(crate) const NAMES: &[&str] = &["tcp", "ucx", "uccl", "verbs", "posix"];

/// Build backend `name` from its parameters. `host` is the address peers reach this
/// machine on, for backends that listen (tcp's default `listen` is `host:0`).
///
/// # Errors
/// An unknown name, a backend that is not compiled in (saying how to get it), or a bad
/// or unknown parameter.
#[cfg_attr(not(feature = "tcp"), allow(unused_variables))]
pub(crate) fn make(
    name: &str,
    params: &[(String, String)],
    host: IpAddr,
) -> Result<Arc<dyn Backend>> {
    match name {
        #[cfg(feature = "tcp")]
        "tcp" => tcp::make(params, host),
        #[cfg(not(feature = "tcp"))]
        "tcp" => fail("backend tcp is not compiled in; rebuild nixl-bench with `--features tcp` (a default feature)"),
        #[cfg(feature = "ucx")]
        "ucx" => ucx::make(params),
        #[cfg(not(feature = "ucx"))]
        "ucx" => fail("backend ucx is not compiled in; rebuild nixl-bench with `--features ucx` (it loads libucp from the host at run time: apt-get install libucx0, or set NIXL_UCX_LIB)"),
        #[cfg(feature = "uccl")]
        "uccl" => uccl::make(params),
        #[cfg(not(feature = "uccl"))]
        "uccl" => fail("backend uccl is not compiled in; rebuild nixl-bench with `--features uccl` (it loads libuccl_p2p.so from the PyPI wheel `uccl` at run time, with the CUDA driver and runtime: set NIXL_UCCL_LIB)"),
        #[cfg(feature = "verbs")]
        "verbs" => verbs::make(params, host),
        #[cfg(not(feature = "verbs"))]
        "verbs" => fail("backend verbs is not compiled in; rebuild nixl-bench with `--features verbs` (a default feature; it loads the host's libibverbs.so.1 at run time)"),
        #[cfg(feature = "posix")]
        "posix" => posix::make(params),
        #[cfg(not(feature = "posix"))]
        "posix" => fail("backend posix is not compiled in; rebuild nixl-bench with `--features posix` (a default feature)"),
        _ => fail(format!(
            "unknown backend {name:?}; known backends: {}",
            NAMES.join(", ")
        )),
    }
}

/// A one-line report of the native library a backend bound (version and real paths),
/// for the header and JSON; `None` for pure-Rust backends.
#[cfg_attr(
    not(any(feature = "ucx", feature = "uccl", feature = "verbs")),
    allow(unused_variables)
)]
pub(crate) fn library_report(name: &str, params: &[(String, String)]) -> Option<String> {
    match name {
        #[cfg(feature = "verbs")]
        "verbs" => verbs::report(params),
        #[cfg(feature = "ucx")]
        "ucx" => ucx::report(params),
        #[cfg(feature = "uccl")]
        "uccl" => uccl::report(params),
        _ => None,
    }
}

/// Whether `params` pin the backend to a fixed port, which two agents on one machine
/// cannot share.
pub(crate) fn fixed_port(name: &str, params: &[(String, String)]) -> Option<String> {
    match name {
        "tcp" => params
            .iter()
            .filter(|(k, _)| k == "listen")
            .find(|(_, v)| {
                v.parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.port() != 0)
            })
            .map(|(_, v)| v.clone()),
        _ => None,
    }
}

/// Set `key` of a listening backend's [`nixl::control::ListenerOptions`], where it is
/// one of theirs; `None` for the backend's own keys.
#[cfg(any(feature = "tcp", feature = "verbs", feature = "uccl"))]
fn listener_param(
    backend: &str,
    o: &mut nixl::control::ListenerOptions,
    key: &str,
    value: &str,
) -> Option<Result<()>> {
    o.set(key, value)
        .map(|r| r.or_else(|why| fail(format!("{backend} backend parameter {why}"))))
}

/// A listening backend's keys: the listener's, then its own.
#[cfg(any(feature = "tcp", feature = "verbs", feature = "uccl"))]
fn listener_keys(own: &[&str]) -> String {
    let mut keys = nixl::control::ListenerOptions::KEYS.to_vec();
    keys.extend_from_slice(own);
    keys.join(", ")
}

#[cfg(feature = "tcp")]
mod tcp {
    use std::net::{IpAddr, SocketAddr};
    use std::sync::Arc;

    use nixl::Backend;
    use nixl_tcp::{TcpBackend, TcpOptions};

    use crate::cli::parse_size;
    use crate::error::{fail, Result};

    const KEYS: &[&str] = &[
        "max_notification",
        "same_host",
        "inline_copy_max",
        "connections",
        "stripe_min",
        "copy_threads",
        "split_copy_min",
    ];

    pub(super) fn make(params: &[(String, String)], host: IpAddr) -> Result<Arc<dyn Backend>> {
        let mut o = TcpOptions {
            listener: nixl::control::ListenerOptions {
                listen: Some(SocketAddr::new(host, 0)),
                ..nixl::control::ListenerOptions::default()
            },
            ..TcpOptions::default()
        };
        for (i, (key, value)) in params.iter().enumerate() {
            if params[..i].iter().any(|(k, _)| k == key) {
                return fail(format!("tcp backend parameter {key:?} given twice"));
            }
            if let Some(set) = super::listener_param("tcp", &mut o.listener, key, value) {
                set?;
                continue;
            }
            let bad = |what: &str| {
                fail(format!(
                    "tcp backend parameter {key}={value:?}: expected {what}"
                ))
            };
            match key.as_str() {
                "max_notification" => match parse_size(value).map(usize::try_from) {
                    Ok(Ok(n)) => o.max_notification = n,
                    _ => return bad("a size such as 1M"),
                },
                "same_host" => match value.parse() {
                    Ok(m) => o.same_host = m,
                    Err(_) => return bad("auto, off or require"),
                },
                "inline_copy_max" => match parse_size(value).map(usize::try_from) {
                    Ok(Ok(n)) => o.inline_copy_max = n,
                    _ => return bad("a size such as 4M"),
                },
                "connections" => match value.parse() {
                    Ok(n) if n >= 1 => o.connections = n,
                    _ => return bad("a number of connections, at least 1"),
                },
                "stripe_min" => match parse_size(value).map(usize::try_from) {
                    Ok(Ok(n)) => o.stripe_min = n,
                    _ => return bad("a size such as 1M"),
                },
                "copy_threads" => match value.parse() {
                    Ok(n) if n >= 1 => o.copy_threads = n,
                    _ => return bad("a number of threads, at least 1"),
                },
                "split_copy_min" => match parse_size(value).map(usize::try_from) {
                    Ok(Ok(n)) => o.split_copy_min = n,
                    _ => return bad("a size such as 16M"),
                },
                _ => {
                    return fail(format!(
                        "unknown tcp backend parameter {key:?}; known: {}",
                        super::listener_keys(KEYS)
                    ))
                }
            }
        }
        Ok(Arc::new(TcpBackend::with_options(o)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const LO: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[cfg(feature = "tcp")]
    #[test]
    fn tcp_takes_its_options() {
        let b = make(
            "tcp",
            &p(&[
                ("listen", "127.0.0.1:0"),
                ("connect_timeout", "2s"),
                ("max_notification", "4K"),
                ("same_host", "off"),
                ("inline_copy_max", "1M"),
                ("copy_threads", "2"),
                ("split_copy_min", "32M"),
            ]),
            LO,
        )
        .unwrap();
        assert_eq!(b.name(), "tcp");
        assert!(b.capabilities().remote);
    }

    #[cfg(feature = "tcp")]
    #[test]
    fn bad_tcp_parameters_are_refused() {
        for (params, needle) in [
            (
                p(&[("bogus", "1")]),
                "unknown tcp backend parameter \"bogus\"",
            ),
            (p(&[("listen", "nowhere")]), "expected an IP:PORT"),
            (
                p(&[("same_host", "maybe")]),
                "expected auto, off or require",
            ),
            (
                p(&[("listen", "127.0.0.1:0"), ("listen", "127.0.0.1:0")]),
                "given twice",
            ),
        ] {
            let e = make("tcp", &params, LO).unwrap_err().to_string();
            assert!(e.contains(needle), "{params:?}: {e}");
        }
    }

    #[test]
    fn unavailable_backends_say_why_and_how() {
        let mut cases = vec![(
            "gds",
            "unknown backend \"gds\"; known backends: tcp, ucx, uccl, verbs",
        )];
        if cfg!(not(feature = "ucx")) {
            cases.push(("ucx", "rebuild nixl-bench with `--features ucx`"));
        }
        if cfg!(not(feature = "uccl")) {
            cases.push(("uccl", "rebuild nixl-bench with `--features uccl`"));
        }
        if cfg!(not(feature = "verbs")) {
            cases.push(("verbs", "rebuild nixl-bench with `--features verbs`"));
        }
        for (name, needle) in cases {
            let e = make(name, &[], LO).unwrap_err().to_string();
            assert!(e.contains(needle), "{name}: {e}");
        }
    }

    #[test]
    fn fixed_ports_are_spotted() {
        assert_eq!(fixed_port("tcp", &p(&[("listen", "127.0.0.1:0")])), None);
        assert_eq!(
            fixed_port("tcp", &p(&[("listen", "127.0.0.1:7000")])).as_deref(),
            Some("127.0.0.1:7000")
        );
    }
}

#[cfg(feature = "ucx")]
mod ucx {
    use std::sync::Arc;

    use nixl::Backend;
    use nixl_ucx::{ProgressMode, UcxBackend, UcxOptions};

    use crate::error::{fail, Result};

    const KEYS: &[&str] = &["lib", "expect", "strict", "progress", "spin_us", "tls"];

    fn options(params: &[(String, String)]) -> Result<UcxOptions> {
        let mut o = UcxOptions::default();
        for (k, v) in params {
            match k.as_str() {
                "lib" => o.library = Some(v.into()),
                "expect" => o.expect = Some(v.clone()),
                "strict" => o.strict = Some(matches!(v.as_str(), "1" | "true" | "yes")),
                "progress" => {
                    o.progress = match v.as_str() {
                        "task" => ProgressMode::Task,
                        "thread" => ProgressMode::Thread,
                        _ => return fail(format!("ucx progress={v}: expected task or thread")),
                    }
                }
                "spin_us" => match v.parse::<u64>() {
                    Ok(us) => o.spin = std::time::Duration::from_micros(us),
                    Err(_) => return fail(format!("ucx spin_us={v}: expected microseconds")),
                },
                "tls" => o.ucx_config.push(("TLS".into(), v.clone())),
                _ => {
                    return fail(format!(
                        "unknown ucx backend parameter {k:?}; known: {}",
                        KEYS.join(", ")
                    ))
                }
            }
        }
        Ok(o)
    }

    pub(super) fn make(params: &[(String, String)]) -> Result<Arc<dyn Backend>> {
        let o = options(params)?;
        match UcxBackend::with_options(o) {
            Ok(b) => Ok(Arc::new(b)),
            Err(e) => fail(format!("backend ucx is unavailable: {e}")),
        }
    }

    pub(super) fn report(params: &[(String, String)]) -> Option<String> {
        let o = options(params).ok()?;
        nixl_ucx::probe(&o).ok().map(|r| r.to_string())
    }
}

#[cfg(feature = "uccl")]
mod uccl {
    use std::sync::Arc;

    use nixl::Backend;
    use nixl_uccl::{UcclBackend, UcclOptions};

    use crate::error::{fail, Result};

    const KEYS: &[&str] = &["lib", "window", "confirm"];

    fn options(params: &[(String, String)]) -> Result<UcclOptions> {
        let mut o = UcclOptions::default();
        for (k, v) in params {
            if let Some(set) = super::listener_param("uccl", &mut o.listener, k, v) {
                set?;
                continue;
            }
            match k.as_str() {
                "lib" => o.library = Some(v.into()),
                "window" => match v.parse::<usize>() {
                    Ok(n) if n > 0 => o.window = n,
                    _ => return fail(format!("uccl window={v}: expected a count > 0")),
                },
                // End-to-end confirmation of every transfer (UcclOptions::confirm).
                "confirm" => match v.as_str() {
                    "true" | "on" => o.confirm = true,
                    "false" | "off" => o.confirm = false,
                    _ => return fail(format!("uccl confirm={v}: expected true or false")),
                },
                _ => {
                    return fail(format!(
                        "unknown uccl backend parameter {k:?}; known: {}",
                        super::listener_keys(KEYS)
                    ))
                }
            }
        }
        Ok(o)
    }

    pub(super) fn make(params: &[(String, String)]) -> Result<Arc<dyn Backend>> {
        let o = options(params)?;
        match UcclBackend::with_options(o) {
            Ok(b) => Ok(Arc::new(b)),
            Err(e) => fail(format!("backend uccl is unavailable: {e}")),
        }
    }

    pub(super) fn report(params: &[(String, String)]) -> Option<String> {
        let o = options(params).ok()?;
        nixl_uccl::probe(&o).ok().map(|r| r.to_string())
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn missing_engine_says_why() {
            let p = vec![("lib".to_string(), "/nonexistent/libuccl_p2p.so".to_string())];
            let e = super::make(&p).unwrap_err().to_string();
            assert!(
                e.contains("backend uccl is unavailable")
                    && e.contains("/nonexistent/libuccl_p2p.so"),
                "{e}"
            );
            let p = vec![("bogus".to_string(), "1".to_string())];
            assert!(super::make(&p)
                .unwrap_err()
                .to_string()
                .contains("unknown uccl backend parameter"));
        }
    }
}

#[cfg(feature = "verbs")]
mod verbs {
    use std::net::{IpAddr, SocketAddr};
    use std::sync::Arc;

    use nixl::Backend;
    use nixl_verbs::{VerbsBackend, VerbsOptions};

    use crate::error::{fail, Result};

    const KEYS: &[&str] = &[
        "lib",
        "device",
        "port",
        "gid_index",
        "mtu",
        "qps_per_peer",
        "send_queue_depth",
        "max_notification",
    ];

    fn options(params: &[(String, String)], host: IpAddr) -> Result<VerbsOptions> {
        let mut o = VerbsOptions {
            listener: nixl::control::ListenerOptions {
                listen: Some(SocketAddr::new(host, 0)),
                ..nixl::control::ListenerOptions::default()
            },
            ..VerbsOptions::default()
        };
        for (k, v) in params {
            if let Some(set) = super::listener_param("verbs", &mut o.listener, k, v) {
                set?;
                continue;
            }
            let bad = |what: &str| {
                fail(format!(
                    "verbs backend parameter {k}={v:?}: expected {what}"
                ))
            };
            match k.as_str() {
                "lib" => o.library = Some(v.clone()),
                "device" => o.device = Some(v.clone()),
                "port" => match v.parse() {
                    Ok(p) => o.port = Some(p),
                    Err(_) => return bad("a port number"),
                },
                "gid_index" => match v.parse() {
                    Ok(g) => o.gid_index = Some(g),
                    Err(_) => return bad("a GID index"),
                },
                "mtu" => match v.parse() {
                    Ok(m) => o.mtu = m,
                    Err(_) => return bad("256, 512, 1024, 2048 or 4096"),
                },
                "qps_per_peer" => match v.parse() {
                    Ok(n) => o.qps_per_peer = n,
                    Err(_) => return bad("a count"),
                },
                "send_queue_depth" => match v.parse() {
                    Ok(n) => o.send_queue_depth = n,
                    Err(_) => return bad("a count"),
                },
                "max_notification" => match crate::cli::parse_size(v).map(usize::try_from) {
                    Ok(Ok(n)) => o.max_notification = n,
                    _ => return bad("a size such as 4K"),
                },
                _ => {
                    return fail(format!(
                        "unknown verbs backend parameter {k:?}; known: {}",
                        super::listener_keys(KEYS)
                    ))
                }
            }
        }
        Ok(o)
    }

    pub(super) fn make(params: &[(String, String)], host: IpAddr) -> Result<Arc<dyn Backend>> {
        let o = options(params, host)?;
        match VerbsBackend::with_options(o) {
            Ok(b) => {
                tracing::info!(device = %b.device_summary(), "verbs backend ready");
                Ok(Arc::new(b))
            }
            Err(e) => fail(format!("backend verbs is unavailable: {e}")),
        }
    }

    pub(super) fn report(params: &[(String, String)]) -> Option<String> {
        let lib = params.iter().find(|(k, _)| k == "lib").map(|(_, v)| v);
        match lib {
            Some(l) => nixl_verbs::library::Libibverbs::load_from(l),
            None => nixl_verbs::library::Libibverbs::load(),
        }
        .ok()
        .map(|l| l.report().to_string())
    }

    #[cfg(test)]
    mod tests {
        use std::net::Ipv4Addr;

        #[test]
        fn missing_library_says_which() {
            let p = vec![(
                "lib".to_string(),
                "/nonexistent/libibverbs.so.1".to_string(),
            )];
            let e = super::make(&p, Ipv4Addr::LOCALHOST.into())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("backend verbs is unavailable")
                    && e.contains("/nonexistent/libibverbs.so.1"),
                "{e}"
            );
        }

        #[test]
        fn bad_parameters_are_refused() {
            let p = vec![("bogus".to_string(), "1".to_string())];
            assert!(super::make(&p, Ipv4Addr::LOCALHOST.into())
                .unwrap_err()
                .to_string()
                .contains("unknown verbs backend parameter"));
            let p = vec![("port".to_string(), "x".to_string())];
            assert!(super::make(&p, Ipv4Addr::LOCALHOST.into())
                .unwrap_err()
                .to_string()
                .contains("expected a port number"));
        }
    }
}

#[cfg(feature = "posix")]
mod posix {
    use std::sync::Arc;

    use nixl::Backend;
    use nixl_posix::{PosixBackend, PosixOptions};

    use crate::error::{fail, Result};

    const KEYS: &[&str] = &["engine", "threads", "durability", "inline_max"];

    pub(super) fn make(params: &[(String, String)]) -> Result<Arc<dyn Backend>> {
        let mut o = PosixOptions::default();
        for (i, (key, value)) in params.iter().enumerate() {
            if params[..i].iter().any(|(k, _)| k == key) {
                return fail(format!("posix backend parameter {key:?} given twice"));
            }
            let bad = |what: &str| {
                fail(format!(
                    "posix backend parameter {key}={value:?}: expected {what}"
                ))
            };
            match key.as_str() {
                "engine" => match value.parse() {
                    Ok(e) => o.engine = e,
                    Err(want) => return bad(want),
                },
                "threads" => match value.parse() {
                    Ok(n) if n > 0 => o.threads = n,
                    _ => return bad("a positive number"),
                },
                "inline_max" => match crate::cli::parse_size(value) {
                    Ok(n) => o.inline_max = n,
                    Err(_) => return bad("a size (0: never)"),
                },
                "durability" => match value.parse() {
                    Ok(d) => o.durability = d,
                    Err(want) => return bad(want),
                },
                _ => {
                    return fail(format!(
                        "unknown posix backend parameter {key:?}; known: {}",
                        KEYS.join(", ")
                    ))
                }
            }
        }
        Ok(Arc::new(PosixBackend::new(o)))
    }
}
