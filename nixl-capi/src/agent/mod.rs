//! NIXL's agent, as its C API sees it, over [`nixl::Agent`].
//!
//! A NIXL agent is made first and given backends afterwards
//! (`create_backend`); a nixl-rs agent fixes its backends when it starts. So the
//! nixl-rs agent is started at the first call that needs it (registering memory,
//! metadata, transfers, notifications) with the backends created so far; a backend
//! created after that is refused with a message saying so. Dynamo's order (agent,
//! then its backends, then registrations) never meets that.
//!
//! Locks: one per agent for its setup (taken once per call that needs the
//! nixl-rs agent, for a clone), one for the registrations table, one held by one
//! registration or deregistration at a time, one for the notification stream
//! (`get_notifs`). Posting and polling a request take only that request's lock.
//! The metadata exchange calls are in `exchange`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use nixl::exchange::{NixlListenerOptions, SideChannelOptions};
use nixl::{
    Agent, AgentOptions, Backend, Indices, Notifications, Op, Registration, RequestOptions,
    TelemetryOptions,
};
use nixl_compat::backends;
use nixl_compat::background::Background;
use nixl_compat::etcd::Etcd;

use crate::lists::{mem, DescList, NotifMap, OptArgs, Params, QueryResponses, RegDesc};
use crate::runtime::Locked;
use crate::runtime::{block_on, rt};
use crate::status::{Failure, Outcome, NOT_FOUND};
use crate::xfer::{Prepared, XferReq};

mod exchange;
mod registry;

/// How long `deregister_mem` waits for transfers still using the memory (those
/// released in flight are being cancelled) before it fails.
const DEREGISTER_WAIT: Duration = Duration::from_secs(10);

/// How long destroying an agent waits for its own background calls (metadata
/// exchange, notification sends) after cancelling them.
const TASKS_BOUND: Duration = Duration::from_secs(5);

/// `nixl_capi_agent_config_t`, as the agent keeps it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Config {
    /// NIXL's `enable_listen_thread` with its `listen_port` (0: any free port).
    pub listen: Option<u16>,
    /// NIXL's `capture_telemetry` (the `NIXL_TELEMETRY_ENABLE` environment wins).
    pub capture_telemetry: bool,
}

/// Whether per-transfer telemetry is on: `NIXL_TELEMETRY_ENABLE` when set (y, yes,
/// on, 1, true, any case; anything else is off), else the agent's config.
pub fn telemetry_enabled(config: bool, env: Option<&str>) -> bool {
    match env {
        Some(v) => matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "y" | "yes" | "on" | "1" | "true"
        ),
        None => config,
    }
}

struct Attached {
    /// Our name (`Backend::name`).
    name: &'static str,
    backend: Arc<dyn Backend>,
    params: Vec<(String, String)>,
}

#[derive(Default)]
struct Setup {
    attached: Vec<Attached>,
    /// Started at first use.
    agent: Option<Agent>,
    /// The listener `enable_listen_thread` asked for, once bound.
    listening: Option<SocketAddr>,
}

/// One registered descriptor.
struct Reg {
    mem: u32,
    desc: RegDesc,
    reg: Registration,
    /// A repeat of a descriptor registered before (same registration).
    again: bool,
}

/// A NIXL agent (`nixl_capi_agent_t`).
pub struct CAgent {
    name: String,
    config: Config,
    telemetry: bool,
    setup: Mutex<Setup>,
    regs: Mutex<Vec<Reg>>,
    /// Held by one registration or deregistration at a time: a deregistration
    /// waits for the memory's transfers with `regs` unlocked, and a registration of
    /// the same descriptor meanwhile must not count on what is going away.
    reg_op: Mutex<()>,
    notifs: Mutex<Option<Notifications>>,
    /// Notifications this agent sent itself, for its next `get_notifs`.
    to_self: Mutex<Vec<Vec<u8>>>,
    background: Background,
    /// The metadata calls given no address (NIXL's etcd).
    etcd: Arc<Etcd>,
}

impl std::fmt::Debug for CAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CAgent").field("name", &self.name).finish()
    }
}

/// Our backend name for NIXL's (or ours).
pub fn backend_name(nixl_name: &str) -> Outcome<&'static str> {
    backends::ours(nixl_name).ok_or_else(|| {
        Failure::backend(format!(
            "no backend {nixl_name:?} in nixl-rs' libnixl_capi.so; available: {}",
            backends::plugins().join(", ")
        ))
    })
}

impl CAgent {
    /// A new agent; nothing starts until it is used.
    ///
    /// # Errors
    /// An empty name (NIXL refuses it too).
    pub fn new(name: &str, config: Config) -> Outcome<Self> {
        if name.is_empty() {
            return Err(Failure::backend("an agent needs a name"));
        }
        let env = std::env::var("NIXL_TELEMETRY_ENABLE").ok();
        if std::env::var_os("NIXL_TELEMETRY_DIR").is_some() {
            tracing::warn!(
                "NIXL_TELEMETRY_DIR is set: nixl-rs records per-transfer telemetry \
                 (nixl_capi_get_xfer_telemetry) but writes no telemetry files"
            );
        }
        Ok(Self {
            name: name.to_owned(),
            config,
            telemetry: telemetry_enabled(config.capture_telemetry, env.as_deref()),
            setup: Mutex::new(Setup::default()),
            regs: Mutex::new(Vec::new()),
            reg_op: Mutex::new(()),
            notifs: Mutex::new(None),
            to_self: Mutex::new(Vec::new()),
            background: Background::default(),
            etcd: Arc::default(),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether per-transfer telemetry is recorded.
    pub fn telemetry(&self) -> bool {
        self.telemetry
    }

    /// The running nixl-rs agent, started now if this is the first call that needs it.
    ///
    /// A start that fails leaves fresh instances of the backends (a backend starts
    /// once), so a later call tries again. A listener that cannot bind fails the
    /// call that started the agent; the agent runs on without it.
    fn agent(&self) -> Outcome<Agent> {
        let mut setup = self.setup.locked();
        if let Some(a) = &setup.agent {
            return Ok(a.clone());
        }
        let mut b = Agent::builder(&self.name)
            .options(AgentOptions::default())
            .telemetry(TelemetryOptions {
                transfers: self.telemetry,
                ..TelemetryOptions::default()
            });
        for a in &setup.attached {
            b = b.backend_arc(a.backend.clone());
        }
        let agent = match block_on(b.build())? {
            Ok(agent) => agent,
            Err(e) => {
                for a in &mut setup.attached {
                    match backends::make(a.name, &a.params) {
                        Ok(fresh) => a.backend = fresh,
                        Err(e) => {
                            tracing::warn!(backend = a.name, error = %e, "remaking a backend after a failed start")
                        }
                    }
                }
                return Err(e.into());
            }
        };
        *self.notifs.locked() = Some(agent.notifications()?);
        setup.agent = Some(agent.clone());
        if let Some(port) = self.config.listen {
            let addr = SocketAddr::from(([0, 0, 0, 0], port));
            let nixl = speaks_nixl(&setup.attached);
            let a = agent.clone();
            let bound = block_on(async move {
                if nixl {
                    a.listen_nixl(addr, &NixlListenerOptions::default()).await
                } else {
                    // NIXL's listener trusts everyone who reaches it (loads,
                    // invalidations); so does this one (README: bind where only
                    // peers reach).
                    let options = SideChannelOptions {
                        accept_peer_updates: true,
                        ..SideChannelOptions::default()
                    };
                    a.listen(addr, &options).await
                }
            })?
            .map_err(|e| {
                Failure::backend(format!(
                    "agent {:?} started, but its metadata listener (enable_listen_thread, port {port}) did not: {e}",
                    self.name
                ))
            })?;
            tracing::info!(agent = %self.name, %bound, nixl, "metadata listener");
            setup.listening = Some(bound);
        }
        Ok(agent)
    }

    /// Whether metadata goes in NIXL's format (a backend speaks NIXL's protocol).
    fn speaks_nixl(&self) -> bool {
        speaks_nixl(&self.setup.locked().attached)
    }

    /// The address the metadata listener is bound to, once started.
    pub fn listening(&self) -> Option<SocketAddr> {
        self.setup.locked().listening
    }

    /// NIXL's `createBackend`: make backend `name` with `params` for this agent.
    ///
    /// # Errors
    /// (All reported as BACKEND, as NIXL does.) An unknown name, a second backend of
    /// a name, a bad parameter, a missing native library, or an agent already in use.
    pub fn create_backend(&self, name: &str, params: &Params) -> Outcome<&'static str> {
        let ours = backend_name(name)?;
        let mut setup = self.setup.locked();
        if setup.attached.iter().any(|a| a.name == ours) {
            return Err(Failure::backend(format!(
                "backend {name:?} is already created for agent {:?}",
                self.name
            )));
        }
        if setup.agent.is_some() {
            return Err(Failure::backend(format!(
                "agent {:?} is in use (memory registered, metadata or transfers made): \
                 nixl-rs fixes an agent's backends when it starts; create every backend first",
                self.name
            )));
        }
        let params = params.pairs();
        let backend = backends::make(name, &params).map_err(|e| Failure::from(e).collapsed())?;
        setup.attached.push(Attached {
            name: ours,
            backend,
            params,
        });
        Ok(ours)
    }

    /// NIXL's `getBackendParams`: the memory types a created backend serves and its
    /// parameters (defaults, overridden by those it was made with).
    ///
    /// # Errors
    /// A backend this agent did not create.
    pub fn backend_params(&self, ours: &str) -> Outcome<(Vec<u32>, Params)> {
        let setup = self.setup.locked();
        let a = setup
            .attached
            .iter()
            .find(|a| a.name == ours)
            .ok_or_else(|| Failure::backend(format!("backend {ours:?} is not this agent's")))?;
        let caps = a.backend.capabilities();
        let mut mems = Vec::new();
        if caps.dram {
            mems.push(mem::DRAM);
        }
        if caps.vram {
            mems.push(mem::VRAM);
        }
        if caps.file {
            mems.push(mem::FILE);
        }
        let mut params = Params::default();
        for (k, v) in backends::params(ours) {
            params.add(k, v);
        }
        for (k, v) in &a.params {
            params.add(k, v);
        }
        Ok((mems, params))
    }

    /// Full metadata: NIXL's format when a backend speaks NIXL's protocol (NIXL
    /// agents load it), else nixl-rs' own.
    pub fn local_md(&self) -> Outcome<Bytes> {
        let agent = self.agent()?;
        Ok(if self.speaks_nixl() {
            agent.nixl_metadata()
        } else {
            agent.metadata()
        }?)
    }

    /// The registrations holding `list`'s descriptors (NIXL's partial metadata).
    fn picked(&self, list: &DescList) -> Outcome<Vec<Registration>> {
        let mut picked: Vec<Registration> = Vec::new();
        for d in &list.descs {
            let reg = self.registration_for(list.mem, d).ok_or_else(|| {
                Failure::not_found(format!(
                    "partial metadata: {:#x}+{} is not registered",
                    d.addr, d.len
                ))
            })?;
            if !picked.iter().any(|p| p.id() == reg.id()) {
                picked.push(reg);
            }
        }
        Ok(picked)
    }

    /// NIXL's `getLocalPartialMD`: an empty list gives the connection info alone;
    /// otherwise the registrations holding the descriptors, without it.
    pub fn local_partial_md(&self, list: &DescList) -> Outcome<Bytes> {
        let agent = self.agent()?;
        let picked = self.picked(list)?;
        let conn = picked.is_empty();
        Ok(if self.speaks_nixl() {
            agent.nixl_partial_metadata(&picked, conn)
        } else {
            agent.partial_metadata(&picked, conn)
        }?)
    }

    /// NIXL's `loadRemoteMD`: the peer's name.
    ///
    /// # Errors
    /// Malformed metadata, this agent's own, or no backend in common (BACKEND).
    pub fn load_remote_md(&self, md: &[u8]) -> Outcome<String> {
        if md.is_empty() {
            return Err(Failure::invalid("load remote metadata: no bytes"));
        }
        let agent = self.agent()?;
        agent.load_metadata(md).map_err(|e| {
            let f = Failure::from(e);
            if f.status == NOT_FOUND {
                f.collapsed()
            } else {
                f
            }
        })
    }

    /// NIXL's `invalidateRemoteMD`.
    ///
    /// # Errors
    /// NOT_FOUND for an unknown peer, INVALID_PARAM for this agent's own name.
    pub fn invalidate_remote_md(&self, peer: &str) -> Outcome {
        if peer == self.name {
            return Err(Failure::invalid(
                "invalidate remote metadata: that is this agent's own name",
            ));
        }
        match self.agent()?.forget_peer(peer) {
            Err(e) if e.kind() == nixl::ErrorKind::UnknownPeer => Err(Failure::not_found(format!(
                "invalidate remote metadata: no peer {peer:?} is loaded"
            ))),
            other => Ok(other?),
        }
    }

    /// NIXL's `checkRemoteMD`: the peer is loaded and, given descriptors, they lie
    /// in what it advertised.
    pub fn check_remote_md(&self, peer: &str, list: Option<&DescList>) -> Outcome {
        let agent = self.agent()?;
        let missing = || Failure::not_found(format!("no metadata of {peer:?} covers that"));
        if peer != self.name && !agent.peers().iter().any(|p| p == peer) {
            return Err(missing());
        }
        match list {
            Some(l) if !l.descs.is_empty() => {
                agent
                    .prep_remote(peer, &l.to_nixl()?)
                    .map_err(|_| missing())?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// NIXL's `makeConnection`.
    pub fn make_connection(&self, peer: &str) -> Outcome {
        let agent = self.agent()?;
        Ok(block_on(async move { agent.connect(peer).await })??)
    }

    /// Run `what` in the background (NIXL's metadata calls return at once); a
    /// failure is logged.
    fn spawn(
        &self,
        what: &'static str,
        fut: impl std::future::Future<Output = nixl::Result<()>> + Send + 'static,
    ) -> Outcome {
        self.background.spawn_logged(rt()?, what, fut);
        Ok(())
    }

    /// NIXL's `prepXferDlist`: `peer` empty for the local side, this agent's name
    /// for its own memory as the remote side, else a loaded peer's.
    pub fn prep(&self, peer: &str, list: &DescList) -> Outcome<Prepared> {
        let agent = self.agent()?;
        let l = list.to_nixl()?;
        let local = peer.is_empty() || peer == "NIXL_INIT_AGENT";
        let p = if local {
            agent.prep_local(&l)
        } else {
            agent.prep_remote(peer, &l)
        }
        .map_err(|e| {
            // NIXL: an unknown peer, or descriptors no backend covers, is
            // NOT_FOUND; malformed descriptors are INVALID_PARAM.
            let f = Failure::from(e);
            if f.status == crate::status::BACKEND {
                Failure::not_found(f.message)
            } else {
                f
            }
        })?;
        Ok(Prepared {
            prepared: Arc::new(p),
            local,
        })
    }

    /// NIXL's `makeXferReq`.
    pub fn make_request(
        &self,
        op: Op,
        local: &Prepared,
        local_idx: &[usize],
        remote: &Prepared,
        remote_idx: &[usize],
        opt: Option<&OptArgs>,
    ) -> Outcome<XferReq> {
        if !local.local || remote.local {
            return Err(Failure::invalid(
                "make transfer request: give a local prepared list, then a remote one",
            ));
        }
        if local_idx.is_empty() || local_idx.len() != remote_idx.len() {
            return Err(Failure::invalid(format!(
                "make transfer request: {} local and {} remote indices",
                local_idx.len(),
                remote_idx.len()
            )));
        }
        for (idx, list, side) in [(local_idx, local, "local"), (remote_idx, remote, "remote")] {
            if let Some(i) = idx.iter().find(|&&i| i >= list.prepared.len()) {
                return Err(Failure::invalid(format!(
                    "make transfer request: {side} index {i} is out of range ({} descriptors)",
                    list.prepared.len()
                )));
            }
        }
        let options = RequestOptions {
            backends: opt.and_then(OptArgs::backend_names),
            merge: !opt.is_some_and(|o| o.skip_desc_merge),
        };
        let agent = self.agent()?;
        let _rt = rt()?.enter();
        let req = agent.make_request(
            op,
            &local.prepared,
            Indices::List(local_idx),
            &remote.prepared,
            Indices::List(remote_idx),
            &options,
        )?;
        Ok(XferReq::new(
            req,
            opt.and_then(OptArgs::notif),
            self.telemetry,
        ))
    }

    /// NIXL's `createXferReq`: `peer` may be this agent's own name (local moves:
    /// host, device, files).
    ///
    /// # Errors
    /// Every failure is BACKEND, as NIXL reports them.
    pub fn create_request(
        &self,
        op: Op,
        local: &DescList,
        remote: &DescList,
        peer: &str,
        opt: Option<&OptArgs>,
    ) -> Outcome<XferReq> {
        let make = || -> Outcome<XferReq> {
            if local.descs.len() != remote.descs.len() {
                return Err(Failure::invalid(format!(
                    "create transfer request: {} local and {} remote descriptors",
                    local.descs.len(),
                    remote.descs.len()
                )));
            }
            let options = RequestOptions {
                backends: opt.and_then(OptArgs::backend_names),
                merge: true,
            };
            let (l, r) = (local.to_nixl()?, remote.to_nixl()?);
            let agent = self.agent()?;
            let _rt = rt()?.enter();
            let req = agent.create_request(op, &l, peer, &r, &options)?;
            Ok(XferReq::new(
                req,
                opt.and_then(OptArgs::notif),
                self.telemetry,
            ))
        };
        make().map_err(Failure::collapsed)
    }

    /// NIXL's `getNotifs`: append every notification received since the last call.
    ///
    /// # Errors
    /// BACKEND when no backend of the agent carries notifications.
    pub fn get_notifs(&self, map: &mut NotifMap, opt: Option<&OptArgs>) -> Outcome {
        let hint = opt.map(|o| o.backends.clone()).unwrap_or_default();
        let any = {
            let setup = self.setup.locked();
            setup
                .attached
                .iter()
                .filter(|a| hint.is_empty() || hint.contains(&a.name))
                .any(|a| a.backend.capabilities().notifications)
        };
        if !any {
            return Err(Failure::backend(format!(
                "get notifications: no backend of agent {:?} carries notifications",
                self.name
            )));
        }
        self.agent()?;
        let mut g = self.notifs.locked();
        if let Some(n) = g.as_mut() {
            while let Some(note) = n.try_recv() {
                map.push(&note.peer, note.msg.to_vec());
            }
        }
        for msg in std::mem::take(&mut *self.to_self.locked()) {
            map.push(&self.name, msg);
        }
        Ok(())
    }

    /// Whether a created backend carries notifications.
    fn notifies(&self) -> bool {
        self.setup
            .locked()
            .attached
            .iter()
            .any(|a| a.backend.capabilities().notifications)
    }

    /// NIXL's `genNotif`: a notification to `peer`, sent in the background.
    pub fn gen_notif(&self, peer: &str, msg: &[u8]) -> Outcome {
        let agent = self.agent()?;
        if peer == self.name {
            // To itself (NIXL delivers these through a backend that serves local
            // transfers and carries notifications): straight to its own queue.
            if !self.notifies() {
                return Err(Failure::backend(format!(
                    "send notification: no backend of agent {:?} carries notifications",
                    self.name
                )));
            }
            self.to_self.locked().push(msg.to_vec());
            return Ok(());
        }
        let _rt = rt()?.enter();
        let t = agent
            .notify(peer, Bytes::copy_from_slice(msg))
            .map_err(|e| match e.kind() {
                nixl::ErrorKind::UnknownPeer => Failure::not_found(e.to_string()),
                _ => Failure::backend(e.to_string()),
            })?;
        self.spawn("send notification", t)
    }

    /// NIXL's `queryMem`: one backend (POSIX) answers for each descriptor's file
    /// (the descriptor's metadata is its path): its size, mode and modification
    /// time, or nothing when it does not exist.
    pub fn query_mem(&self, list: &DescList, opt: Option<&OptArgs>) -> Outcome<QueryResponses> {
        let hint = opt.map(|o| o.backends.as_slice()).unwrap_or_default();
        let [b] = hint else {
            return Err(Failure::invalid(
                "query memory: name exactly one backend in the optional arguments",
            ));
        };
        if *b != "posix" {
            return Err(Failure::backend(format!(
                "query memory: backend {} does not answer it (POSIX does)",
                backends::nixl_name(b)
            )));
        }
        let mut out = QueryResponses::default();
        for d in &list.descs {
            let meta = String::from_utf8_lossy(&d.meta);
            let path = nixl_compat::memory::path_mode(&meta).map_or(&*meta, |(_, p)| p);
            out.0.push(std::fs::metadata(path).ok().map(|m| {
                use std::os::unix::fs::MetadataExt;
                let mut p = Params::default();
                p.add("size", &m.len().to_string());
                p.add("mode", &m.mode().to_string());
                p.add("mtime", &m.mtime().to_string());
                p
            }));
        }
        Ok(out)
    }

    /// Stop everything the agent started (NIXL's agent destructor).
    pub fn shutdown(&self) {
        let agent = self.setup.locked().agent.take();
        if agent.is_none() && self.background.tracker().is_empty() {
            // Never started: nothing runs (and no runtime needs starting).
            return;
        }
        let done = block_on(async {
            if !self.background.stop(TASKS_BOUND).await {
                tracing::warn!(agent = %self.name, "background calls still running at destroy");
            }
            if let Some(a) = agent {
                let report = a.shutdown().await;
                if !report.is_clean() {
                    tracing::warn!(agent = %self.name, ?report, "agent shut down uncleanly");
                }
            }
        });
        if let Err(e) = done {
            tracing::warn!(agent = %self.name, error = %e, "shutting down");
        }
        self.regs.locked().clear();
        self.notifs.locked().take();
    }
}

fn speaks_nixl(attached: &[Attached]) -> bool {
    attached.iter().any(|a| a.backend.nixl().is_some())
}

/// NIXL's transfer operation values.
pub fn op(value: u32) -> Outcome<Op> {
    match value {
        0 => Ok(Op::Read),
        1 => Ok(Op::Write),
        other => Err(Failure::invalid(format!(
            "transfer operation {other} is neither READ (0) nor WRITE (1)"
        ))),
    }
}

impl Drop for CAgent {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn telemetry_env_wins_over_config() {
        assert!(telemetry_enabled(true, None));
        assert!(!telemetry_enabled(false, None));
        assert!(telemetry_enabled(false, Some("1")));
        assert!(telemetry_enabled(false, Some("Yes")));
        assert!(!telemetry_enabled(true, Some("0")));
        assert!(!telemetry_enabled(true, Some("false")));
    }

    #[test]
    fn ops() {
        assert_eq!(op(0).unwrap(), Op::Read);
        assert_eq!(op(1).unwrap(), Op::Write);
        assert_eq!(op(2).unwrap_err().status, crate::status::INVALID_PARAM);
    }
}
