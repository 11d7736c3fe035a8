//! The one place that maps NIXL's backend names to the transports compiled in, and a
//! backend's init parameters (NIXL's `create_backend(name, params)`) to its options.

use std::sync::Arc;

use nixl::{Backend, ErrorKind};

/// NIXL's names of the backends compiled in, in the order `get_plugin_list` shows.
pub fn plugins() -> Vec<&'static str> {
    let mut v = Vec::new();
    if cfg!(feature = "tcp") {
        v.push("TCP");
    }
    if cfg!(feature = "ucx") {
        v.push("UCX");
    }
    if cfg!(feature = "verbs") {
        v.push("VERBS");
    }
    if cfg!(feature = "uccl") {
        v.push("UCCL");
    }
    if cfg!(feature = "posix") {
        v.push("POSIX");
    }
    v
}

/// Our backend name (`Backend::name`) for a NIXL name; ours are accepted too.
pub fn ours(nixl_name: &str) -> Option<&'static str> {
    match nixl_name {
        "TCP" | "tcp" => Some("tcp"),
        "UCX" | "ucx" => Some("ucx"),
        "VERBS" | "verbs" => Some("verbs"),
        "UCCL" | "uccl" => Some("uccl"),
        "POSIX" | "posix" => Some("posix"),
        _ => None,
    }
}

/// NIXL's name for one of ours (`"agent"`, the agent's own same-process copies, stays).
pub fn nixl_name(ours: &str) -> String {
    match ours {
        "tcp" | "ucx" | "verbs" | "uccl" | "posix" => ours.to_ascii_uppercase(),
        other => other.to_owned(),
    }
}

/// The listener's keys ([`nixl::control::ListenerOptions::KEYS`]) with their
/// defaults, which nixl-tcp, nixl-verbs and nixl-uccl take alike (`listen` and
/// `advertise` are the backend's choice by default).
const LISTENER_PARAMS: [(&str, &str); 7] = [
    ("listen", ""),
    ("advertise", ""),
    ("connect_timeout", "10s"),
    ("handshake_timeout", "10s"),
    ("dead_peer_timeout", "10s"),
    ("max_incoming_handshakes", "256"),
    ("max_incoming_connections", "4096"),
];

/// Set `key` of a listening backend's listener options, where it is one; `None`
/// for the backend's own keys.
#[cfg_attr(
    not(any(feature = "tcp", feature = "verbs", feature = "uccl")),
    allow(dead_code)
)]
fn listener_param(
    backend: &str,
    o: &mut nixl::control::ListenerOptions,
    key: &str,
    value: &str,
) -> Option<nixl::Result<()>> {
    o.set(key, value).map(|r| {
        r.map_err(|why| {
            nixl::Error::new(
                ErrorKind::InvalidArgument,
                "create backend",
                format!("{backend} backend parameter {why}"),
            )
        })
    })
}

/// Parameter keys each backend takes (NIXL's `get_plugin_params`), with their
/// defaults as strings ("" where the default is computed).
pub fn params(nixl_name: &str) -> Vec<(&'static str, &'static str)> {
    match ours(nixl_name) {
        Some("tcp") => [
            LISTENER_PARAMS.as_slice(),
            &[
                ("max_notification", "1048576"),
                ("connections", ""),
                ("same_host", "auto"),
            ],
        ]
        .concat(),
        Some("ucx") => vec![
            ("lib", ""),
            ("tls", ""),
            ("progress", "task"),
            ("max_notification", "1048576"),
            // NIXL's UCX parameters, with NIXL's defaults.
            ("device_list", ""),
            ("engine_config", ""),
            ("ucx_error_handling_mode", "peer"),
            ("num_threads", "0"),
            ("num_workers", "1"),
        ],
        Some("verbs") => [LISTENER_PARAMS.as_slice(), &[("lib", ""), ("device", "")]].concat(),
        Some("uccl") => [
            LISTENER_PARAMS.as_slice(),
            &[("lib", ""), ("num_cpus", "0")],
        ]
        .concat(),
        // NIXL's queue choices (use_uring; use_aio and use_posix_aio take the thread
        // pool, the engine for where io_uring is not wanted), and our own.
        Some("posix") => vec![
            ("use_uring", "false"),
            ("use_aio", "false"),
            ("use_posix_aio", "false"),
            ("engine", "auto"),
            ("threads", "8"),
            ("durability", "none"),
        ],
        _ => Vec::new(),
    }
}

/// Memory types a backend serves (NIXL's `get_plugin_params` mems), by NIXL's
/// name: what its [`nixl::Capabilities`] say once made, known before loading it.
pub fn mem_types(nixl_name: &str) -> Vec<&'static str> {
    match ours(nixl_name) {
        Some("tcp" | "ucx" | "verbs" | "uccl") => vec!["DRAM", "VRAM"],
        Some("posix") => vec!["DRAM", "FILE"],
        _ => Vec::new(),
    }
}

/// NIXL's `device_list` ("mlx5_0, mlx5_1") as a UCX_NET_DEVICES value: each
/// device on port 1 unless it names its port (NIXL appends ":1" to each).
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
fn device_list(v: &str) -> String {
    v.split([',', ' '])
        .filter(|d| !d.is_empty())
        .map(|d| {
            if d.contains(':') {
                d.to_owned()
            } else {
                format!("{d}:1")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// NIXL's `engine_config`: UCX settings `KEY=VALUE`, separated by commas (a piece
/// without `=` continues the previous value, so `TLS=rc,cuda_copy` keeps its list),
/// keys with or without the `UCX_` prefix. As in NIXL, a setting whose `UCX_KEY`
/// is in the environment is left to the environment.
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
fn engine_config(v: &str) -> nixl::Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    for piece in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match piece.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                let key = key.trim();
                let key = key.strip_prefix("UCX_").unwrap_or(key);
                out.push((key.to_owned(), value.trim().to_owned()));
            }
            Some(_) => return Err(bad("UCX", "engine_config", v, "KEY=VALUE settings")),
            None => match out.last_mut() {
                Some((_, value)) => {
                    value.push(',');
                    value.push_str(piece);
                }
                None => return Err(bad("UCX", "engine_config", v, "KEY=VALUE settings")),
            },
        }
    }
    out.retain(|(k, _)| {
        let env = std::env::var_os(format!("UCX_{k}")).is_some();
        if env {
            tracing::info!(key = %k, "engine_config: UCX_{k} is set in the environment, which wins");
        }
        !env
    });
    Ok(out)
}

/// A parameter error.
#[cfg_attr(
    not(any(feature = "tcp", feature = "ucx", feature = "verbs")),
    allow(dead_code)
)]
fn bad(backend: &str, key: &str, value: &str, what: &str) -> nixl::Error {
    nixl::Error::new(
        ErrorKind::InvalidArgument,
        "create backend",
        format!("{backend} backend parameter {key}={value:?}: expected {what}"),
    )
}

#[cfg_attr(
    not(any(feature = "tcp", feature = "ucx", feature = "verbs", feature = "uccl")),
    allow(dead_code)
)]
fn unknown(backend: &str, key: &str) {
    // NIXL's plugins ignore parameters they do not know (vLLM passes some to all).
    tracing::warn!(backend, key, "ignoring unknown backend parameter");
}

#[cfg_attr(not(any(feature = "tcp", feature = "ucx")), allow(dead_code))]
fn size(backend: &str, key: &str, v: &str) -> nixl::Result<usize> {
    v.parse().map_err(|_| bad(backend, key, v, "a byte count"))
}

/// Build backend `name` (NIXL's or our name) from NIXL-style string parameters.
///
/// # Errors
/// [`ErrorKind::NotFound`] for a name that is not compiled in; `InvalidArgument` for a
/// bad parameter value; the backend's own error (a missing native library is
/// `UnavailableLibrary`, naming it and how to get it).
#[cfg_attr(
    not(any(feature = "tcp", feature = "ucx", feature = "verbs", feature = "uccl")),
    allow(unused_variables)
)]
pub fn make(name: &str, params: &[(String, String)]) -> nixl::Result<Arc<dyn Backend>> {
    // An empty value for a key whose default is computed ("" in `params`) means
    // that default: callers hand `get_plugin_params`' defaults back unchanged
    // (NIXL's C API users do), and "lib" = "" is not a library to load.
    let computed = self::params(name);
    let given: Vec<(String, String)> = params
        .iter()
        .filter(|(k, v)| {
            !(v.is_empty() && computed.iter().any(|(ck, cv)| ck == k && cv.is_empty()))
        })
        .cloned()
        .collect();
    let params = given.as_slice();
    match ours(name) {
        #[cfg(feature = "tcp")]
        Some("tcp") => {
            let mut o = nixl_tcp::TcpOptions::default();
            for (k, v) in params {
                if let Some(set) = listener_param("TCP", &mut o.listener, k, v) {
                    set?;
                    continue;
                }
                match k.as_str() {
                    "max_notification" => o.max_notification = size("TCP", k, v)?,
                    "connections" => {
                        o.connections = v
                            .parse()
                            .ok()
                            .filter(|&n| n >= 1)
                            .ok_or_else(|| bad("TCP", k, v, "a count of at least 1"))?
                    }
                    "same_host" => {
                        o.same_host = v
                            .parse()
                            .map_err(|_| bad("TCP", k, v, "auto, off or require"))?
                    }
                    _ => unknown("TCP", k),
                }
            }
            Ok(Arc::new(nixl_tcp::TcpBackend::with_options(o)))
        }
        #[cfg(feature = "ucx")]
        Some("ucx") => {
            let mut o = nixl_ucx::UcxOptions::default();
            for (k, v) in params {
                match k.as_str() {
                    "lib" => o.library = Some(v.into()),
                    "tls" => o.ucx_config.push(("TLS".into(), v.clone())),
                    "progress" => {
                        o.progress = match v.as_str() {
                            "task" => nixl_ucx::ProgressMode::Task,
                            "thread" => nixl_ucx::ProgressMode::Thread,
                            _ => return Err(bad("UCX", k, v, "task or thread")),
                        }
                    }
                    "max_notification" => o.max_notification = size("UCX", k, v)?,
                    // NIXL: the network devices UCX may use (UCX_NET_DEVICES).
                    "device_list" if !v.trim().is_empty() => {
                        o.ucx_config.push(("NET_DEVICES".into(), device_list(v)))
                    }
                    "device_list" => {}
                    // NIXL: UCX configuration settings for the context, applied over
                    // the UCX_* environment.
                    "engine_config" => o.ucx_config.extend(engine_config(v)?),
                    "ucx_error_handling_mode" => {
                        o.peer_error_handling = match v.as_str() {
                            "peer" | "" => true,
                            "none" => false,
                            _ => return Err(bad("UCX", k, v, "peer or none")),
                        }
                    }
                    // NIXL: threads that progress the workers besides the caller's
                    // posts. nixl-ucx drives its one worker from a tokio task (0) or
                    // from a dedicated progress thread (1 or more: one thread, since
                    // a UCX worker progresses on one thread at a time).
                    "num_threads" => {
                        let n: usize = v
                            .parse()
                            .map_err(|_| bad("UCX", k, v, "a count of threads"))?;
                        if n > 0 {
                            o.progress = nixl_ucx::ProgressMode::Thread;
                        }
                    }
                    // NIXL: UCX workers per agent. nixl-ucx drives one.
                    "num_workers" => match v.parse::<usize>() {
                        Ok(1) => {}
                        _ => {
                            return Err(bad(
                                "UCX",
                                k,
                                v,
                                "1 (nixl-ucx drives one UCX worker per agent)",
                            ))
                        }
                    },
                    _ => unknown("UCX", k),
                }
            }
            Ok(Arc::new(nixl_ucx::UcxBackend::with_options(o)?))
        }
        #[cfg(feature = "verbs")]
        Some("verbs") => {
            let mut o = nixl_verbs::VerbsOptions::default();
            for (k, v) in params {
                if let Some(set) = listener_param("VERBS", &mut o.listener, k, v) {
                    set?;
                    continue;
                }
                match k.as_str() {
                    "lib" => o.library = Some(v.clone()),
                    "device" => o.device = Some(v.clone()),
                    _ => unknown("VERBS", k),
                }
            }
            Ok(Arc::new(nixl_verbs::VerbsBackend::with_options(o)?))
        }
        #[cfg(feature = "uccl")]
        Some("uccl") => {
            let mut o = nixl_uccl::UcclOptions::default();
            for (k, v) in params {
                if let Some(set) = listener_param("UCCL", &mut o.listener, k, v) {
                    set?;
                    continue;
                }
                match k.as_str() {
                    "lib" => o.library = Some(v.into()),
                    // NIXL's UCCL: CPUs for its engine; nixl-uccl's engine sizes
                    // itself.
                    "num_cpus" => tracing::info!(
                        value = %v,
                        "UCCL backend parameter num_cpus: the engine sizes itself; not applied"
                    ),
                    _ => unknown("UCCL", k),
                }
            }
            Ok(Arc::new(nixl_uccl::UcclBackend::with_options(o)?))
        }
        #[cfg(feature = "posix")]
        Some("posix") => {
            use nixl_posix::Engine;
            let mut o = nixl_posix::PosixOptions::default();
            let on = |k: &str, v: &str| match v {
                "true" | "1" | "yes" => Ok(true),
                "false" | "0" | "no" | "" => Ok(false),
                _ => Err(bad("POSIX", k, v, "true or false")),
            };
            let mut chosen: Option<&str> = None;
            for (k, v) in params {
                let engine = match k.as_str() {
                    "use_uring" if on(k, v)? => Some(Engine::Uring),
                    "use_aio" | "use_posix_aio" if on(k, v)? => Some(Engine::Pool),
                    "use_uring" | "use_aio" | "use_posix_aio" => None,
                    // The default, "auto", chooses nothing.
                    "engine" if v.is_empty() => None,
                    "engine" => match v.parse() {
                        Ok(Engine::Auto) => None,
                        Ok(e) => Some(e),
                        Err(want) => return Err(bad("POSIX", k, v, want)),
                    },
                    "threads" => {
                        o.threads = v
                            .parse()
                            .ok()
                            .filter(|&n| n >= 1)
                            .ok_or_else(|| bad("POSIX", k, v, "a count of at least 1"))?;
                        None
                    }
                    "durability" => {
                        o.durability = v.parse().map_err(|want| bad("POSIX", k, v, want))?;
                        None
                    }
                    // NIXL's request-pool and kernel-queue sizes: the ring and the
                    // pool size themselves (4096 operations in flight).
                    "ios_pool_size" | "kernel_queue_size" => None,
                    _ => {
                        unknown("POSIX", k);
                        None
                    }
                };
                if let Some(e) = engine {
                    // NIXL refuses more than one queue type; so do we.
                    if let Some(first) = chosen {
                        return Err(nixl::Error::new(
                            ErrorKind::InvalidArgument,
                            "create backend",
                            format!("POSIX backend parameters {first} and {k} both choose the queue: give one"),
                        ));
                    }
                    chosen = Some(k.as_str());
                    o.engine = e;
                }
            }
            Ok(Arc::new(nixl_posix::PosixBackend::new(o)))
        }
        _ => Err(nixl::Error::new(
            ErrorKind::NotFound,
            "create backend",
            format!(
                "no backend {name:?} in this build of nixl_rs; available: {}",
                plugins().join(", ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "tcp")]
    #[test]
    fn defaults_handed_back_unchanged_make_the_backend() {
        // What NIXL's C API users do: get_plugin_params, then create_backend with
        // those values (computed defaults are "").
        let defaults: Vec<(String, String)> = params("TCP")
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let b = make("TCP", &defaults).expect("defaults make a backend");
        assert_eq!(b.name(), "tcp");
        // An empty value where the default is not computed is still checked.
        let bad = [("max_notification".to_owned(), String::new())];
        assert!(make("TCP", &bad).is_err());
    }

    #[test]
    fn listener_defaults_listed_are_the_defaults() {
        let mut o = nixl::control::ListenerOptions::default();
        let keys: Vec<&str> = LISTENER_PARAMS.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, nixl::control::ListenerOptions::KEYS);
        for (k, v) in LISTENER_PARAMS.iter().filter(|(_, v)| !v.is_empty()) {
            assert!(matches!(o.set(k, v), Some(Ok(()))), "{k}={v}");
        }
        let d = nixl::control::ListenerOptions::default();
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
        let e = listener_param("TCP", &mut o, "listen", "nowhere")
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(
            e.to_string().contains("TCP backend parameter listen="),
            "{e}"
        );
    }

    #[test]
    fn names_and_memory_types() {
        assert_eq!(ours("UCX"), Some("ucx"));
        assert_eq!(ours("GDS_MT"), None);
        assert_eq!(nixl_name("posix"), "POSIX");
        assert_eq!(mem_types("POSIX"), vec!["DRAM", "FILE"]);
        assert!(mem_types("OBJ").is_empty());
    }
}
