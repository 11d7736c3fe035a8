//! The native agent behind `nixl_rs._api.nixl_agent`.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use nixl::{
    Agent, AgentOptions, Backend, Desc, DescList, Indices, MemKind, NixlListenerOptions,
    Notifications, Op, RegisterOptions, Registration, RequestOptions, SideChannelOptions,
    TelemetryOptions,
};
use nixl_compat::background::Background;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::{invalid, raise, IntoPy};
use crate::handles::{deliver, DlistHandle, XferHandle};
use crate::memory::{caller_memory, file_memory, path_memory, path_mode};
use crate::runtime::rt;
use nixl_compat::backends;
use nixl_compat::etcd::{self, Etcd};

/// How long shutdown waits for this layer's own tasks (asyncio waiters, exchange
/// requests) after cancelling them.
const TASKS_BOUND: Duration = Duration::from_secs(5);

/// How long `deregister_memory` waits for transfers still using the memory (those
/// released in flight are being cancelled) before it raises `nixlNotAllowedError`.
const DEREGISTER_WAIT: Duration = Duration::from_secs(10);

/// A registration's identity as NIXL sees it: (kind, address, length).
type RegKey = (MemKind, u64, u64);

/// One attached backend: its name, the instance, its parameters.
struct Attached {
    name: &'static str,
    backend: Arc<dyn Backend>,
    params: Vec<(String, String)>,
}

struct Listening {
    addr: SocketAddr,
    /// NIXL's listener protocol (the agent has a NIXL-speaking backend), else ours.
    nixl: bool,
}

#[derive(Default)]
struct Requeued {
    queue: Mutex<VecDeque<(String, Vec<u8>)>>,
    added: tokio::sync::Notify,
}

impl Requeued {
    fn pop(&self) -> Option<(String, Vec<u8>)> {
        self.queue.lock().unwrap().pop_front()
    }
}

struct Inner {
    name: String,
    agent: RwLock<Agent>,
    attached: Mutex<Vec<Attached>>,
    telemetry: bool,
    /// Port asked for (`enable_listen_thread`), and what was bound.
    listen_port: Option<u16>,
    listening: Mutex<Option<Listening>>,
    regs: Mutex<HashMap<RegKey, Registration>>,
    notifs: Arc<tokio::sync::Mutex<Option<Notifications>>>,
    /// Notifications an asyncio waiter received after its awaiter went away, and
    /// the wake-up for the waiters after it.
    requeued: Arc<Requeued>,
    /// Something outside may know this agent instance (metadata handed out, peers,
    /// prepared lists): backends can no longer be swapped by rebuilding it.
    used: AtomicBool,
    shut_down: AtomicBool,
    /// This layer's own tasks: asyncio waiters, metadata exchange requests.
    background: Background,
    /// The metadata calls given no IP address (NIXL's etcd).
    etcd: Arc<Etcd>,
}

/// The native agent (`nixl_rs._native.Agent`). Thread-safe: Python threads may share it.
#[pyclass(frozen, module = "nixl_rs._native", name = "Agent")]
pub(crate) struct PyAgent {
    inner: Arc<Inner>,
}

fn mem_kind(mem_type: &str, dev: u64) -> PyResult<MemKind> {
    match mem_type {
        "DRAM" | "cpu" => Ok(MemKind::Dram),
        "VRAM" | "cuda" => Ok(MemKind::Vram {
            device: u32::try_from(dev)
                .map_err(|_| invalid("descriptor", format!("device id {dev} is too large")))?,
        }),
        "FILE" => Ok(MemKind::File {
            fd: u32::try_from(dev)
                .map_err(|_| invalid("descriptor", format!("file descriptor {dev} is not one")))?,
        }),
        "BLOCK" | "OBJ" => Err(raise(
            "NotSupported",
            "descriptor list",
            "memory type",
            format!(
                "memory type {mem_type:?} is not supported by nixl-rs (DRAM, VRAM and FILE are)"
            ),
        )),
        other => Err(invalid(
            "descriptor list",
            format!("unknown memory type {other:?}; expected \"DRAM\", \"VRAM\" or \"FILE\""),
        )),
    }
}

/// Descriptors from Python: a list of (addr, len, dev) or little-endian u64 triples
/// as bytes (a numpy Nx3 array's `tobytes()`).
fn triples(descs: &Bound<'_, PyAny>, width: usize) -> PyResult<Vec<Vec<u64>>> {
    if let Ok(b) = descs.downcast::<PyBytes>() {
        let b = b.as_bytes();
        let row = 8 * width;
        if b.len() % row != 0 {
            return Err(invalid(
                "descriptor list",
                format!("{} bytes are not rows of {width} u64", b.len()),
            ));
        }
        return Ok(b
            .chunks_exact(row)
            .map(|r| {
                r.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect());
    }
    let list = descs.downcast::<PyList>().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "descriptors must be a list of (address, length, device) tuples, not {}",
            descs
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let mut out = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let t: Vec<u64> = item.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "descriptor {i} must be a tuple of {width} non-negative integers, got {}",
                item.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        if t.len() != width {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "descriptor {i} must have {width} elements, got {}",
                t.len()
            )));
        }
        out.push(t);
    }
    Ok(out)
}

/// A descriptor list of `mem_type` from (addr, len, dev) rows, or strided rows
/// (addr, len, dev, stride, count).
fn desc_list(mem_type: &str, descs: &Bound<'_, PyAny>, strided: bool) -> PyResult<DescList> {
    let rows = triples(descs, if strided { 5 } else { 3 })?;
    let kind = mem_kind(mem_type, rows.first().map_or(0, |r| r[2]))?;
    let mut list = DescList::new(kind);
    for r in rows {
        let dev = u32::try_from(r[2]).map_err(|_| {
            invalid(
                "descriptor list",
                format!("device id {} is too large", r[2]),
            )
        })?;
        let d = Desc::new(r[0], r[1], dev);
        if strided {
            let count = usize::try_from(r[4])
                .map_err(|_| invalid("descriptor list", "block count too large"))?;
            list.push_strided(nixl::Strided::new(d, r[3], count));
        } else {
            list.push(d);
        }
    }
    Ok(list)
}

fn nixl_names(names: &[String], op: &str) -> PyResult<Option<Vec<String>>> {
    if names.is_empty() {
        return Ok(None);
    }
    names
        .iter()
        .map(|n| {
            backends::ours(n).map(str::to_owned).ok_or_else(|| {
                raise(
                    "NotFound",
                    op,
                    "backend",
                    format!("{op}: unknown backend {n:?}"),
                )
            })
        })
        .collect::<PyResult<Vec<_>>>()
        .map(Some)
}

fn socket_addr(ip: &str, port: u16, op: &str) -> PyResult<SocketAddr> {
    (ip, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| invalid(op, format!("cannot resolve address {ip:?}:{port}")))
}

impl Inner {
    fn agent(&self) -> Agent {
        self.agent.read().unwrap().clone()
    }

    fn speaks_nixl(&self) -> bool {
        self.attached
            .lock()
            .unwrap()
            .iter()
            .any(|a| a.backend.nixl().is_some())
    }

    async fn build(
        name: &str,
        attached: &[Attached],
        telemetry: bool,
    ) -> nixl::Result<(Agent, Notifications)> {
        let mut b = Agent::builder(name)
            .options(AgentOptions::default())
            .telemetry(TelemetryOptions {
                transfers: telemetry,
                ..TelemetryOptions::default()
            });
        for a in attached {
            b = b.backend_arc(a.backend.clone());
        }
        let agent = b.build().await?;
        let notifs = agent.notifications()?;
        Ok((agent, notifs))
    }

    /// Serve the listener `enable_listen_thread` asked for.
    async fn listen(&self, agent: &Agent) -> nixl::Result<()> {
        let Some(port) = self.listen_port else {
            return Ok(());
        };
        let addr = SocketAddr::from(([0, 0, 0, 0], port));
        let nixl = self.speaks_nixl();
        let bound = if nixl {
            agent
                .listen_nixl(addr, &NixlListenerOptions::default())
                .await?
        } else {
            // NIXL's listener trusts everyone who reaches it (invalidate, reload);
            // the Python API keeps that (README: bind where only peers reach).
            let options = SideChannelOptions {
                accept_peer_updates: true,
                ..SideChannelOptions::default()
            };
            agent.listen(addr, &options).await?
        };
        *self.listening.lock().unwrap() = Some(Listening { addr: bound, nixl });
        Ok(())
    }

    fn registration_for(&self, kind: MemKind, addr: u64, len: u64) -> Option<Registration> {
        let regs = self.regs.lock().unwrap();
        if let Some(r) = regs.get(&(kind, addr, len)) {
            return Some(r.clone());
        }
        regs.values()
            .find(|r| {
                r.kind() == kind
                    && r.addr() <= addr
                    && addr.saturating_add(len) <= r.addr() + r.len() as u64
            })
            .cloned()
    }

    /// An etcd call of the metadata API (no IP address) for `op`, checked before
    /// anything starts; it fixes the agent's backends, as any exchange does.
    fn etcd_call(&self, op: &'static str) -> PyResult<etcd::Call> {
        let call = etcd::Call::new(self.etcd.clone(), self.agent(), self.speaks_nixl(), op).py()?;
        self.used.store(true, Ordering::Release);
        Ok(call)
    }

    fn spawn(
        &self,
        what: &'static str,
        fut: impl std::future::Future<Output = nixl::Result<()>> + Send + 'static,
    ) -> PyResult<()> {
        self.background.spawn_logged(rt()?, what, fut);
        Ok(())
    }
}

#[pymethods]
impl PyAgent {
    /// Make an agent with these backends (NIXL names and string parameters),
    /// recording per-transfer telemetry or not, listening for metadata on
    /// `listen_port` (0: any free port) or not.
    #[new]
    #[pyo3(signature = (name, backends, capture_telemetry=false, listen_port=None))]
    fn new(
        py: Python<'_>,
        name: String,
        backends: Vec<(String, HashMap<String, String>)>,
        capture_telemetry: bool,
        listen_port: Option<u16>,
    ) -> PyResult<Self> {
        let mut attached = Vec::new();
        for (b, params) in backends {
            let Some(ours) = backends::ours(&b) else {
                return Err(raise(
                    "NotFound",
                    "create backend",
                    "backend",
                    format!(
                        "create backend: no backend {b:?} in this build of nixl_rs; available: {}",
                        backends::plugins().join(", ")
                    ),
                ));
            };
            if attached.iter().any(|a: &Attached| a.name == ours) {
                continue;
            }
            let mut params: Vec<_> = params.into_iter().collect();
            params.sort();
            let backend = py.allow_threads(|| backends::make(&b, &params)).py()?;
            attached.push(Attached {
                name: ours,
                backend,
                params,
            });
        }
        let rt = rt()?;
        let (agent, notifs) = py
            .allow_threads(|| rt.block_on(Inner::build(&name, &attached, capture_telemetry)))
            .py()?;
        let inner = Arc::new(Inner {
            name,
            agent: RwLock::new(agent.clone()),
            attached: Mutex::new(attached),
            telemetry: capture_telemetry,
            listen_port,
            listening: Mutex::new(None),
            regs: Mutex::new(HashMap::new()),
            notifs: Arc::new(tokio::sync::Mutex::new(Some(notifs))),
            requeued: Arc::new(Requeued::default()),
            used: AtomicBool::new(false),
            shut_down: AtomicBool::new(false),
            background: Background::default(),
            etcd: Arc::default(),
        });
        py.allow_threads(|| rt.block_on(inner.listen(&agent)))
            .py()?;
        Ok(Self { inner })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }

    /// NIXL's `nixlAgent.getAvailPlugins`: the backends this build offers.
    #[pyo3(name = "getAvailPlugins")]
    fn get_avail_plugins(&self) -> Vec<&'static str> {
        backends::plugins()
    }

    /// NIXL names of the attached backends.
    fn backends(&self) -> Vec<String> {
        self.inner
            .attached
            .lock()
            .unwrap()
            .iter()
            .map(|a| backends::nixl_name(a.name))
            .collect()
    }

    /// Memory types an attached backend supports; None if not attached.
    fn backend_mem_types(&self, backend: &str) -> Option<Vec<&'static str>> {
        let ours = backends::ours(backend)?;
        let attached = self.inner.attached.lock().unwrap();
        let a = attached.iter().find(|a| a.name == ours)?;
        let caps = a.backend.capabilities();
        let mut v = Vec::new();
        if caps.dram {
            v.push("DRAM");
        }
        if caps.vram {
            v.push("VRAM");
        }
        if caps.file {
            v.push("FILE");
        }
        Some(v)
    }

    /// The address the metadata listener is bound to, as (ip, port), if listening.
    #[getter]
    fn listen_addr(&self) -> Option<(String, u16)> {
        self.inner
            .listening
            .lock()
            .unwrap()
            .as_ref()
            .map(|l| (l.addr.ip().to_string(), l.addr.port()))
    }

    /// The metadata listener's protocol: "NIXL" (NIXL's, when a backend speaks
    /// NIXL's protocol) or "nixl-rs" (the side channel); None when not listening.
    #[getter]
    fn listen_protocol(&self) -> Option<&'static str> {
        self.inner
            .listening
            .lock()
            .unwrap()
            .as_ref()
            .map(|l| if l.nixl { "NIXL" } else { "nixl-rs" })
    }

    /// Attach another backend. nixl-rs fixes an agent's backends when it starts, so
    /// this rebuilds the agent, which is allowed only while nothing depends on it yet
    /// (no registrations, peers, prepared lists, metadata handed out).
    fn create_backend(
        &self,
        py: Python<'_>,
        backend: &str,
        params: HashMap<String, String>,
    ) -> PyResult<()> {
        const OP: &str = "create backend";
        let Some(ours) = backends::ours(backend) else {
            return Err(raise(
                "NotFound",
                OP,
                "backend",
                format!(
                    "{OP}: no backend {backend:?} in this build of nixl_rs; available: {}",
                    backends::plugins().join(", ")
                ),
            ));
        };
        let inner = &self.inner;
        if inner
            .attached
            .lock()
            .unwrap()
            .iter()
            .any(|a| a.name == ours)
        {
            return Err(raise(
                "NotAllowed",
                OP,
                "backend",
                format!("{OP}: backend {backend:?} is already instantiated"),
            ));
        }
        if inner.used.load(Ordering::Acquire) || !inner.regs.lock().unwrap().is_empty() {
            return Err(raise(
                "NotSupported",
                OP,
                "agent in use",
                format!(
                    "{OP}: nixl-rs fixes an agent's backends once memory is registered, metadata handed out or peers added; name {backend:?} in nixl_agent_config(backends=[...]) or call create_backend first"
                ),
            ));
        }
        let mut params: Vec<_> = params.into_iter().collect();
        params.sort();
        // Fresh instances of every backend (a backend starts once), the new one last;
        // the old agent goes only once the new one is built.
        let wanted: Vec<(&'static str, Vec<(String, String)>)> = inner
            .attached
            .lock()
            .unwrap()
            .iter()
            .map(|a| (a.name, a.params.clone()))
            .chain(std::iter::once((ours, params)))
            .collect();
        let rt = rt()?;
        let built = py.allow_threads(|| {
            let mut list = Vec::with_capacity(wanted.len());
            for (name, params) in wanted {
                list.push(Attached {
                    name,
                    backend: backends::make(name, &params)?,
                    params,
                });
            }
            rt.block_on(async {
                let (agent, notifs) = Inner::build(&inner.name, &list, inner.telemetry).await?;
                let old = inner.agent();
                let report = old.shutdown().await;
                if !report.is_clean() {
                    tracing::warn!(agent = %inner.name, ?report, "replacing the agent for a new backend");
                }
                *inner.notifs.lock().await = Some(notifs);
                Ok::<_, nixl::Error>((agent, list))
            })
        });
        let (agent, list) = built.py()?;
        *inner.attached.lock().unwrap() = list;
        *inner.agent.write().unwrap() = agent.clone();
        py.allow_threads(|| rt.block_on(inner.listen(&agent))).py()
    }

    /// Register each (addr, len, dev) of `mem_type` (all or none); `metas`, for
    /// FILE, may make a registration path-mode (see `memory::path_mode`).
    #[pyo3(signature = (mem_type, descs, backends, metas=None))]
    fn register(
        &self,
        py: Python<'_>,
        mem_type: &str,
        descs: &Bound<'_, PyAny>,
        backends: Vec<String>,
        metas: Option<Vec<String>>,
    ) -> PyResult<()> {
        const OP: &str = "register memory";
        let rows = triples(descs, 3)?;
        let options = RegisterOptions {
            backends: nixl_names(&backends, OP)?,
        };
        let agent = self.inner.agent();
        let mut kinds = Vec::with_capacity(rows.len());
        // Files are taken (their descriptor duplicated) here, with the GIL held, so no
        // Python thread closes one meanwhile.
        let mut files = Vec::with_capacity(rows.len());
        for (i, r) in rows.iter().enumerate() {
            let kind = mem_kind(mem_type, r[2])?;
            let meta = metas.as_ref().and_then(|m| m.get(i)).map(String::as_str);
            files.push(match kind {
                MemKind::File { fd } => match meta.and_then(path_mode) {
                    Some((options, path)) => Some(
                        py.allow_threads(|| path_memory(r[0], r[1], fd, options, path))
                            .py()?,
                    ),
                    None => Some(file_memory(r[0], r[1], fd).py()?),
                },
                _ => None,
            });
            kinds.push(kind);
        }
        let made = py.allow_threads(|| {
            let mut made: Vec<(RegKey, Registration)> = Vec::new();
            for ((r, kind), file) in rows.iter().zip(kinds).zip(files) {
                let key = (kind, r[0], r[1]);
                let mem = match file {
                    Some(m) => Ok(m),
                    None => caller_memory(r[0], r[1], kind),
                };
                let reg = mem.and_then(|m| agent.register_with(m, &options));
                match reg {
                    Ok(reg) => made.push((key, reg)),
                    Err(e) => {
                        for (_, r) in &made {
                            if let Err(e) = agent.deregister(r) {
                                tracing::warn!(error = %e, "rolling back a registration");
                            }
                        }
                        return Err(e);
                    }
                }
            }
            Ok(made)
        });
        let made = made.py()?;
        self.inner.regs.lock().unwrap().extend(made);
        Ok(())
    }

    /// Deregister each (addr, len, dev) of `mem_type` registered before.
    fn deregister(&self, py: Python<'_>, mem_type: &str, descs: &Bound<'_, PyAny>) -> PyResult<()> {
        const OP: &str = "deregister memory";
        let rows = triples(descs, 3)?;
        let agent = self.inner.agent();
        let mut regs = Vec::with_capacity(rows.len());
        {
            let known = self.inner.regs.lock().unwrap();
            for r in &rows {
                let key = (mem_kind(mem_type, r[2])?, r[0], r[1]);
                match known.get(&key) {
                    Some(reg) => regs.push((key, reg.clone())),
                    None => {
                        return Err(raise(
                            "NotFound",
                            OP,
                            "registration",
                            format!(
                                "{OP}: no {mem_type} registration at address {:#x} of {} bytes",
                                r[0], r[1]
                            ),
                        ))
                    }
                }
            }
        }
        let rt = rt()?;
        // Transfers released while in flight are cancelled by their backend; wait for
        // it to let go (NIXL's releaseXferReq then deregisterMem succeeds), but not
        // for transfers that keep running past the bound. Every region of the list
        // first, under one bound: a refusal then leaves the whole list registered.
        let deadline = std::time::Instant::now() + DEREGISTER_WAIT;
        let busy = py.allow_threads(|| {
            rt.block_on(async {
                for (_, reg) in &regs {
                    while reg.inflight() > 0 {
                        if std::time::Instant::now() >= deadline {
                            return Some(reg.inflight());
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
                None
            })
        });
        if let Some(n) = busy {
            return Err(raise(
                "NotAllowed",
                OP,
                "registration",
                format!("{OP}: memory of this list is used by {n} transfer(s) still in flight after {DEREGISTER_WAIT:?}; nothing was deregistered (release or finish them, then retry)"),
            ));
        }
        for (key, reg) in regs {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            py.allow_threads(|| rt.block_on(agent.deregister_when_idle(&reg, left)))
                .py()?;
            self.inner.regs.lock().unwrap().remove(&key);
        }
        Ok(())
    }

    /// Full metadata: NIXL's format when a backend speaks NIXL's protocol (so NIXL
    /// agents can load it), else nixl-rs' own.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let agent = self.inner.agent();
        self.inner.used.store(true, Ordering::Release);
        let md = if self.inner.speaks_nixl() {
            agent.nixl_metadata()
        } else {
            agent.metadata()
        }
        .py()?;
        Ok(PyBytes::new(py, &md))
    }

    /// nixl-rs' own metadata format, whatever the backends.
    fn native_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.inner.used.store(true, Ordering::Release);
        Ok(PyBytes::new(py, &self.inner.agent().metadata().py()?))
    }

    /// Partial metadata: the registrations holding `descs`, with or without
    /// connection info.
    fn partial_metadata<'py>(
        &self,
        py: Python<'py>,
        mem_type: &str,
        descs: &Bound<'_, PyAny>,
        inc_conn_info: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        const OP: &str = "partial metadata";
        let rows = triples(descs, 3)?;
        let mut picked: Vec<Registration> = Vec::new();
        for r in &rows {
            let kind = mem_kind(mem_type, r[2])?;
            let Some(reg) = self.inner.registration_for(kind, r[0], r[1]) else {
                return Err(raise(
                    "NotFound",
                    OP,
                    "registration",
                    format!("{OP}: {:#x}+{} is not registered", r[0], r[1]),
                ));
            };
            if !picked.iter().any(|p| p.id() == reg.id()) {
                picked.push(reg);
            }
        }
        let agent = self.inner.agent();
        self.inner.used.store(true, Ordering::Release);
        let md = if self.inner.speaks_nixl() {
            agent.nixl_partial_metadata(&picked, inc_conn_info)
        } else {
            agent.partial_metadata(&picked, inc_conn_info)
        }
        .py()?;
        Ok(PyBytes::new(py, &md))
    }

    /// Load a peer's metadata (NIXL's format or ours); its name.
    fn load_metadata(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<String> {
        let agent = self.inner.agent();
        self.inner.used.store(true, Ordering::Release);
        py.allow_threads(|| agent.load_metadata(metadata)).py()
    }

    /// Forget a peer; an unknown name is no error (NIXL's `invalidateRemoteMD`
    /// returns without one).
    fn forget(&self, peer: &str) -> PyResult<()> {
        match self.inner.agent().forget_peer(peer) {
            Err(e) if e.kind() == nixl::ErrorKind::UnknownPeer => Ok(()),
            other => other.py(),
        }
    }

    /// Known peers.
    fn peers(&self) -> Vec<String> {
        self.inner.agent().peers()
    }

    /// Whether `peer` is known and, with `descs`, whether they lie in what it
    /// advertised.
    #[pyo3(signature = (peer, mem_type=None, descs=None))]
    fn has_peer(
        &self,
        peer: &str,
        mem_type: Option<&str>,
        descs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let agent = self.inner.agent();
        if !agent.peers().iter().any(|p| p == peer) {
            return Ok(false);
        }
        match (mem_type, descs) {
            (Some(m), Some(d)) => {
                let list = desc_list(m, d, false)?;
                Ok(list.is_empty() || agent.prep_remote(peer, &list).is_ok())
            }
            _ => Ok(true),
        }
    }

    /// Send this agent's metadata to the listener at ip:port (in the background).
    fn send_metadata(&self, ip: &str, port: u16) -> PyResult<()> {
        const OP: &str = "send local metadata";
        if ip.is_empty() {
            return self.inner.spawn(OP, self.inner.etcd_call(OP)?.publish());
        }
        let addr = socket_addr(ip, port, OP)?;
        let agent = self.inner.agent();
        self.inner.used.store(true, Ordering::Release);
        if self.inner.speaks_nixl() {
            self.inner.spawn(OP, async move {
                agent
                    .send_nixl_metadata(addr, &NixlListenerOptions::default())
                    .await
            })
        } else {
            self.inner.spawn(OP, async move {
                agent
                    .send_metadata(addr, &SideChannelOptions::default())
                    .await
            })
        }
    }

    /// Fetch `peer`'s metadata from the listener at ip:port and load it (in the
    /// background; `has_peer` says when it is there).
    fn fetch_metadata(&self, peer: String, ip: &str, port: u16, label: String) -> PyResult<()> {
        const OP: &str = "fetch remote metadata";
        if ip.is_empty() {
            return self
                .inner
                .spawn(OP, self.inner.etcd_call(OP)?.fetch(peer, label));
        }
        let addr = socket_addr(ip, port, OP)?;
        let agent = self.inner.agent();
        self.inner.used.store(true, Ordering::Release);
        if self.inner.speaks_nixl() {
            if !label.is_empty() {
                return Err(raise(
                    "NotSupported",
                    OP,
                    "label",
                    format!("{OP}: labels are etcd's; NIXL's listener serves full metadata only"),
                ));
            }
            self.inner.spawn(OP, async move {
                agent
                    .fetch_nixl_peer_metadata(addr, &peer, &NixlListenerOptions::default())
                    .await
            })
        } else {
            self.inner.spawn(OP, async move {
                let options = SideChannelOptions::default();
                if label.is_empty() {
                    agent.fetch_peer_metadata(addr, &peer, &options).await
                } else {
                    agent
                        .fetch_peer_partial_metadata(addr, &peer, &label, &options)
                        .await
                }
            })
        }
    }

    /// Tell the listener at ip:port to forget this agent (in the background).
    fn invalidate_metadata(&self, ip: &str, port: u16) -> PyResult<()> {
        const OP: &str = "invalidate local metadata";
        if ip.is_empty() {
            return self.inner.spawn(OP, self.inner.etcd_call(OP)?.invalidate());
        }
        let addr = socket_addr(ip, port, OP)?;
        let agent = self.inner.agent();
        if self.inner.speaks_nixl() {
            self.inner.spawn(OP, async move {
                agent
                    .invalidate_nixl_at(addr, &NixlListenerOptions::default())
                    .await
            })
        } else {
            self.inner.spawn(OP, async move {
                agent
                    .invalidate_at(addr, &SideChannelOptions::default())
                    .await
            })
        }
    }

    /// Connect to a peer now rather than at the first transfer.
    fn connect(&self, py: Python<'_>, peer: &str) -> PyResult<()> {
        let agent = self.inner.agent();
        let rt = rt()?;
        py.allow_threads(|| rt.block_on(agent.connect(peer))).py()
    }

    /// Prepare a descriptor list: local ("NIXL_INIT_AGENT" or ""), loopback (this
    /// agent's name) or a peer's.
    #[pyo3(signature = (agent_name, mem_type, descs, strided=false))]
    fn prep(
        &self,
        agent_name: &str,
        mem_type: &str,
        descs: &Bound<'_, PyAny>,
        strided: bool,
    ) -> PyResult<DlistHandle> {
        let list = desc_list(mem_type, descs, strided)?;
        let agent = self.inner.agent();
        self.inner.used.store(true, Ordering::Release);
        let prepared = if agent_name.is_empty() || agent_name == "NIXL_INIT_AGENT" {
            agent.prep_local(&list)
        } else {
            agent.prep_remote(agent_name, &list)
        }
        .py()?;
        Ok(DlistHandle::new(prepared))
    }

    /// A request from prepared lists by index.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (op, local, local_indices, remote, remote_indices, notif_msg, backends, merge=true))]
    fn make_request(
        &self,
        py: Python<'_>,
        op: &str,
        local: &DlistHandle,
        local_indices: &Bound<'_, PyAny>,
        remote: &DlistHandle,
        remote_indices: &Bound<'_, PyAny>,
        notif_msg: &[u8],
        backends: Vec<String>,
        merge: bool,
    ) -> PyResult<XferHandle> {
        const OP: &str = "make transfer request";
        let op = parse_op(op)?;
        let li = indices(local_indices, "local_indices")?;
        let ri = indices(remote_indices, "remote_indices")?;
        let (l, r) = (local.get()?, remote.get()?);
        let options = RequestOptions {
            backends: nixl_names(&backends, OP)?,
            merge,
        };
        let agent = self.inner.agent();
        let _rt = rt()?.enter();
        let req = py
            .allow_threads(|| {
                agent.make_request(op, &l, Indices::List(&li), &r, Indices::List(&ri), &options)
            })
            .py()?;
        Ok(self.handle(req, notif_msg))
    }

    /// A request from plain lists (NIXL's `initialize_xfer`).
    #[allow(clippy::too_many_arguments)]
    fn create_request(
        &self,
        py: Python<'_>,
        op: &str,
        local_mem_type: &str,
        local: &Bound<'_, PyAny>,
        remote_mem_type: &str,
        remote: &Bound<'_, PyAny>,
        peer: &str,
        notif_msg: &[u8],
        backends: Vec<String>,
    ) -> PyResult<XferHandle> {
        const OP: &str = "initialize transfer";
        let op = parse_op(op)?;
        let l = desc_list(local_mem_type, local, false)?;
        let r = desc_list(remote_mem_type, remote, false)?;
        let options = RequestOptions {
            backends: nixl_names(&backends, OP)?,
            merge: true,
        };
        let agent = self.inner.agent();
        self.inner.used.store(true, Ordering::Release);
        let _rt = rt()?.enter();
        let req = py
            .allow_threads(|| agent.create_request(op, &l, peer, &r, &options))
            .py()?;
        Ok(self.handle(req, notif_msg))
    }

    /// New notifications by peer (NIXL's `get_new_notifs`). Empty while an asyncio
    /// iterator is waiting for the next one.
    fn notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let add = |peer: &str, msg: &[u8]| -> PyResult<()> {
            let msg = PyBytes::new(py, msg);
            match out.get_item(peer)? {
                Some(l) => l.downcast::<PyList>()?.append(msg),
                None => out.set_item(peer, PyList::new(py, [msg])?),
            }
        };
        for (p, m) in self.inner.requeued.queue.lock().unwrap().drain(..) {
            add(&p, &m)?;
        }
        if let Ok(mut g) = self.inner.notifs.try_lock() {
            if let Some(n) = g.as_mut() {
                while let Some(note) = n.try_recv() {
                    add(&note.peer, &note.msg)?;
                }
            }
        }
        Ok(out)
    }

    /// Arrange for `loop.call_soon_threadsafe(cb, (peer, msg))` with the next
    /// notification (`None` once the agent shut down), or return it now if one is
    /// waiting.
    fn next_notif(
        &self,
        py: Python<'_>,
        event_loop: Py<PyAny>,
        cb: Py<PyAny>,
    ) -> PyResult<Option<(String, Py<PyBytes>)>> {
        if let Some((p, m)) = self.inner.requeued.pop() {
            return Ok(Some((p, PyBytes::new(py, &m).unbind())));
        }
        if let Ok(mut g) = self.inner.notifs.try_lock() {
            if let Some(note) = g.as_mut().and_then(Notifications::try_recv) {
                return Ok(Some((note.peer, PyBytes::new(py, &note.msg).unbind())));
            }
        }
        let notifs = self.inner.notifs.clone();
        let requeued = self.inner.requeued.clone();
        let cancel = self.inner.background.token().clone();
        rt()?.spawn(self.inner.background.tracker().track_future(async move {
            // An earlier waiter whose awaiter went away may hold the stream and hand
            // its notification back: take those first, and wake up for them.
            let next = loop {
                let added = requeued.added.notified();
                if let Some(n) = requeued.pop() {
                    break Some(n);
                }
                tokio::select! {
                    n = async {
                        let mut g = notifs.lock().await;
                        match g.as_mut() {
                            Some(n) => n.recv().await.map(|n| (n.peer, n.msg.to_vec())),
                            None => None,
                        }
                    } => break n,
                    () = added => continue,
                    () = cancel.cancelled() => break None,
                }
            };
            deliver(event_loop, cb, move |py| match next {
                Some((peer, msg)) => (peer, PyBytes::new(py, &msg))
                    .into_pyobject(py)
                    .map_or_else(|_| py.None(), |t| t.into_any().unbind()),
                None => py.None(),
            });
        }));
        Ok(None)
    }

    /// Put back a notification whose asyncio awaiter went away.
    fn requeue(&self, peer: String, msg: Vec<u8>) {
        self.inner
            .requeued
            .queue
            .lock()
            .unwrap()
            .push_front((peer, msg));
        self.inner.requeued.added.notify_one();
    }

    /// Send a standalone notification (NIXL's `send_notif`); it is delivered in the
    /// background, a failure logged.
    fn notify(&self, peer: &str, msg: &[u8]) -> PyResult<()> {
        let agent = self.inner.agent();
        let _rt = rt()?.enter();
        let t = agent.notify(peer, Bytes::copy_from_slice(msg)).py()?;
        self.inner.spawn("send notification", t)
    }

    /// Send a standalone notification and wait for it to be delivered (GIL released).
    fn notify_wait(&self, py: Python<'_>, peer: &str, msg: &[u8]) -> PyResult<()> {
        let agent = self.inner.agent();
        let rt = rt()?;
        let _rt = rt.enter();
        let t = agent.notify(peer, Bytes::copy_from_slice(msg)).py()?;
        py.allow_threads(|| rt.block_on(t)).py()
    }

    /// Whether the agent was shut down.
    #[getter]
    fn is_shut_down(&self) -> bool {
        self.inner.shut_down.load(Ordering::Acquire)
    }

    /// Tasks and backend threads still running (0 after a clean shutdown).
    fn running_tasks(&self) -> (usize, usize, Vec<String>) {
        let m = self.inner.agent().task_monitor();
        (m.len(), self.inner.background.tracker().len(), m.threads())
    }

    /// Stop everything the agent started and join it (GIL released). Returns the
    /// shutdown report when something did not stop cleanly, else None.
    fn shutdown(&self, py: Python<'_>) -> PyResult<Option<String>> {
        if self.inner.shut_down.swap(true, Ordering::AcqRel) {
            return Ok(None);
        }
        let inner = self.inner.clone();
        let rt = rt()?;
        let report = py.allow_threads(|| {
            rt.block_on(async {
                let tasks_done = inner.background.stop(TASKS_BOUND).await;
                let report = inner.agent().shutdown().await;
                inner.regs.lock().unwrap().clear();
                inner.notifs.lock().await.take();
                (report, tasks_done)
            })
        });
        let (report, tasks_done) = report;
        let mut msg = None;
        if !report.is_clean() {
            msg = Some(format!("{report:?}"));
        }
        if !tasks_done {
            msg = Some(format!(
                "{}; nixl_rs tasks still running after {TASKS_BOUND:?}",
                msg.unwrap_or_default()
            ));
        }
        Ok(msg)
    }

    fn __repr__(&self) -> String {
        format!(
            "nixl_rs Agent({:?}, backends {:?})",
            self.inner.name,
            self.backends()
        )
    }
}

impl PyAgent {
    fn handle(&self, req: nixl::XferRequest, notif_msg: &[u8]) -> XferHandle {
        let notif = (!notif_msg.is_empty()).then(|| Bytes::copy_from_slice(notif_msg));
        XferHandle::new(
            req,
            notif,
            self.inner.background.tracker().clone(),
            self.inner.background.token().clone(),
        )
    }
}

fn parse_op(op: &str) -> PyResult<Op> {
    match op {
        "READ" => Ok(Op::Read),
        "WRITE" => Ok(Op::Write),
        other => Err(invalid(
            "make transfer request",
            format!("operation must be \"READ\" or \"WRITE\", not {other:?}"),
        )),
    }
}

/// Indices: a list of ints, or little-endian i64 bytes (a numpy array's).
fn indices(v: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<usize>> {
    let neg = |i: i64| {
        invalid(
            "make transfer request",
            format!("{what} holds a negative index ({i})"),
        )
    };
    if let Ok(b) = v.downcast::<PyBytes>() {
        let b = b.as_bytes();
        if b.len() % 8 != 0 {
            return Err(invalid(
                "make transfer request",
                format!("{what}: not i64 values"),
            ));
        }
        return b
            .chunks_exact(8)
            .map(|c| {
                let i = i64::from_le_bytes(c.try_into().expect("8 bytes"));
                usize::try_from(i).map_err(|_| neg(i))
            })
            .collect();
    }
    let list: Vec<i64> = v.extract().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be a list of ints or an integer numpy array"
        ))
    })?;
    list.into_iter()
        .map(|i| usize::try_from(i).map_err(|_| neg(i)))
        .collect()
}
