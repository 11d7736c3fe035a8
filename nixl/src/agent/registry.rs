//! Memory registration and the agent's own metadata.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::{Agent, RegisterOptions};
use crate::error::{err, Error, ErrorKind, Result};
use crate::interop::{self, NixlConn, NixlDesc, NixlMetadata, NixlSection};
use crate::memory::{AlignedBuf, MemKind, Memory};
use crate::metadata::{AgentMetadata, BackendMeta, RegionBlob, RegionMeta};
use crate::region::{RegionInner, RegionRef, Registration};
use crate::transfer::RequestOwner;

impl Agent {
    /// Zero-filled host memory of `len` bytes, from the first attached backend (in
    /// attach order) that offers memory it reaches faster than ordinary memory
    /// ([`Backend::alloc`](crate::Backend::alloc); nixl-ucx's shared memory, for
    /// example), else an [`AlignedBuf`] that asks for transparent huge pages from
    /// 2 MiB up ([`AlignedBuf::with_huge_pages`]; opt out with
    /// [`AgentBuilder::huge_pages`](crate::AgentBuilder::huge_pages)). Register it as
    /// usual; it works with every backend.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroLength`] for `len == 0`; [`ErrorKind::InvalidArgument`] for
    /// more than this machine's memory ([`host_memory`](crate::host_memory)) or an
    /// allocation the system refuses; the backend's error when its allocation fails
    /// (no silent fallback: the caller asked for the fast path).
    pub fn alloc(&self, len: usize) -> Result<Memory> {
        const OP: &str = "allocate memory";
        self.shared.check_running(OP)?;
        if len == 0 {
            return err(ErrorKind::ZeroLength, OP, "cannot allocate zero bytes");
        }
        crate::system::check_host_len(len as u64, "memory", OP)?;
        for b in &self.shared.backends {
            if let Some(m) = b.alloc(len) {
                return m;
            }
        }
        Ok(if self.shared.huge_pages {
            AlignedBuf::try_with_huge_pages(len)?
        } else {
            AlignedBuf::try_new(len)?
        }
        .into())
    }

    /// Register memory with every attached backend that supports its kind.
    ///
    /// The agent takes ownership of the memory and keeps it alive while any
    /// [`Registration`] handle or in-flight transfer uses it.
    ///
    /// Registration may block for a while (an RDMA backend pins the memory): from
    /// async code, prefer [`Agent::register_async`], which keeps tokio's workers free.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroLength`] for empty memory; [`ErrorKind::NotSupported`] when no
    /// backend supports the memory kind; [`ErrorKind::InvalidArgument`] when it overlaps
    /// an existing registration; backend errors.
    pub fn register(&self, memory: impl Into<Memory>) -> Result<Registration> {
        self.register_with(memory, &RegisterOptions::default())
    }

    /// [`Agent::register_with`] on tokio's blocking pool, so a slow registration
    /// (pinning gigabytes) never holds up a runtime worker.
    ///
    /// # Errors
    /// As [`Agent::register_with`]; [`ErrorKind::Canceled`] if the runtime shut down
    /// before the registration ran.
    pub async fn register_async(
        &self,
        memory: impl Into<Memory>,
        options: &RegisterOptions,
    ) -> Result<Registration> {
        let agent = Self {
            shared: self.shared.clone(),
        };
        let memory = memory.into();
        let options = options.clone();
        tokio::task::spawn_blocking(move || agent.register_with(memory, &options))
            .await
            .unwrap_or_else(|e| {
                Err(Error::new(
                    ErrorKind::Canceled,
                    "register memory",
                    "the blocking registration did not run to completion",
                )
                .with_source(e))
            })
    }

    /// Register memory with options (for example, only some backends).
    ///
    /// # Errors
    /// As [`Agent::register`], and [`ErrorKind::NotFound`] for an unknown backend name.
    pub fn register_with(
        &self,
        memory: impl Into<Memory>,
        options: &RegisterOptions,
    ) -> Result<Registration> {
        const OP: &str = "register memory";
        self.shared.check_running(OP)?;
        let mem = memory.into();
        if mem.is_empty() {
            return err(ErrorKind::ZeroLength, OP, "cannot register zero bytes");
        }
        let kind = mem.kind();
        let order = self.backend_order(options.backends.as_deref(), OP)?;
        let chosen: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&i| self.shared.caps[i].supports(kind))
            .collect();
        if chosen.is_empty() {
            // What the backends say about it, where they know why.
            let why: String = order
                .iter()
                .filter_map(|&i| {
                    let b = &self.shared.backends[i];
                    b.unsupported_reason(kind)
                        .map(|r| format!("; {}: {r}", b.name()))
                })
                .collect();
            return err(
                ErrorKind::NotSupported,
                OP,
                format!(
                    "no attached backend supports {kind} memory (backends: {:?}){why}",
                    self.backends()
                ),
            );
        }
        let region = Arc::new(RegionInner {
            id: self.shared.next_region_id.fetch_add(1, Ordering::Relaxed),
            mem,
            inflight: Default::default(),
            registered: AtomicBool::new(true),
            backends: Mutex::new(Vec::new()),
            gate: Default::default(),
            idle: Default::default(),
        });
        {
            let mut regions = self.shared.regions.write().unwrap();
            regions.index.insert(region.clone(), OP)?;
            regions.by_id.insert(region.id, region.clone());
        }
        if let Some(m) = &self.shared.metrics {
            m.registration(kind, region.mem.len(), true);
        }
        let rref = RegionRef {
            inner: region.clone(),
        };
        for i in chosen {
            match self.shared.backends[i].register(&rref) {
                Ok(blob) => region.backends.lock().unwrap().push((i, blob)),
                Err(e) => {
                    for (b, e) in self.unregister_region(&region) {
                        tracing::warn!(backend = %b, error = %e, "deregistering after a failed registration");
                    }
                    return Err(e);
                }
            }
        }
        tracing::debug!(agent = %self.shared.name, id = region.id, len = region.mem.len(), %kind, "registered memory");
        Ok(Registration { inner: region })
    }

    /// Forget a region and deregister it from every backend that has it; returns the
    /// backends that failed, with their errors.
    pub(super) fn unregister_region(&self, region: &Arc<RegionInner>) -> Vec<(String, Error)> {
        let was = region.registered.swap(false, Ordering::AcqRel);
        if let (true, Some(m)) = (was, &self.shared.metrics) {
            m.registration(region.mem.kind(), region.mem.len(), false);
        }
        {
            let mut regions = self.shared.regions.write().unwrap();
            regions.index.remove(region.mem.kind(), region.mem.addr());
            regions.by_id.remove(&region.id);
        }
        let bs = std::mem::take(&mut *region.backends.lock().unwrap());
        let mut failed = Vec::new();
        for (i, _) in bs {
            let b = &self.shared.backends[i];
            if let Err(e) = b.deregister(region.id) {
                failed.push((b.name().to_owned(), e));
            }
        }
        failed
    }

    /// Deregister memory. Peers can no longer reach it; the memory is freed once no
    /// handle is left.
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] (and nothing changes) while posted transfers that use it
    /// have not finished, including dropped ones the backend has not yet aborted: await
    /// them, then retry. [`ErrorKind::NotFound`] if it is not registered with this agent.
    /// A backend's error when it failed to release the memory (the agent has forgotten
    /// the registration all the same).
    ///
    /// When it returns `Ok`, no backend touches the memory any more: a peer's request
    /// that was already being served (a WRITE arriving slowly into it, a READ being
    /// sent from it) is cut off and fails on that peer's side, so memory handed in by
    /// address ([`Memory::from_raw_parts`](crate::Memory::from_raw_parts)) may be
    /// freed at once.
    pub fn deregister(&self, registration: &Registration) -> Result<()> {
        const OP: &str = "deregister memory";
        let region = &registration.inner;
        let known = self
            .shared
            .regions
            .read()
            .unwrap()
            .by_id
            .get(&region.id)
            .is_some_and(|r| Arc::ptr_eq(r, region));
        if !known {
            return err(
                ErrorKind::NotFound,
                OP,
                format!(
                    "registration {} is not registered with agent {:?}",
                    region.id, self.shared.name
                ),
            );
        }
        // The count is read with the gate held: a backend copy that started before
        // (a staging copy counts in flight) is seen, and none starts while it is
        // read. A refusal reopens the gate before any access saw it closed (they
        // wait for the decision), so refusing changes nothing for any transfer.
        let mut n = 0;
        if !region.gate.close_if(|| {
            n = region.inflight.load(Ordering::Acquire);
            n == 0
        }) {
            return err(
                ErrorKind::NotAllowed,
                OP,
                format!(
                    "registration {} is used by {n} transfer(s) in flight, or operations a backend is still finishing for a failed one; await them (Registration::inflight() reaches 0) and retry",
                    region.id
                ),
            );
        }
        match self.unregister_region(region).into_iter().next() {
            None => Ok(()),
            Some((_, e)) => Err(e),
        }
    }

    /// Deregister memory once the transfers using it have finished: as
    /// [`Agent::deregister`], but while posted transfers use the registration it waits
    /// (up to `timeout`) for them to end instead of refusing. Transfers whose request
    /// was dropped are cancelled by their backend, so this is the deregistration to
    /// call right after dropping requests still in flight (NIXL's
    /// `releaseXferReq` then `deregisterMem`, which vLLM's shutdown does).
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] when transfers still use it after `timeout` (nothing
    /// changes); otherwise those of [`Agent::deregister`].
    pub async fn deregister_when_idle(
        &self,
        registration: &Registration,
        timeout: std::time::Duration,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        let region = &registration.inner;
        loop {
            // Armed before the attempt: a count that falls to zero after the attempt
            // read it wakes this waiter.
            let idle = region.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            match self.deregister(registration) {
                // Refused for transfers in flight (nothing changed): wait. A backend
                // that failed to release it leaves it deregistered all the same.
                Err(e) if e.kind() == ErrorKind::NotAllowed && registration.is_registered() => {
                    if tokio::time::timeout_at(deadline, idle).await.is_err() {
                        return Err(e);
                    }
                }
                done => return done,
            }
        }
    }

    fn build_metadata(
        &self,
        regions: Vec<Arc<RegionInner>>,
        partial: bool,
        with_conn: bool,
    ) -> Result<Bytes> {
        let backends = self
            .shared
            .backends
            .iter()
            .map(|b| BackendMeta {
                name: b.name().to_owned(),
                conn_info: with_conn.then(|| b.connection_info().to_vec()),
            })
            .collect();
        let regions = regions
            .iter()
            // Files are the agent's own: never published.
            .filter(|r| !r.mem.kind().is_file())
            .map(|r| RegionMeta {
                id: r.id,
                kind: r.mem.kind(),
                addr: r.mem.addr(),
                len: r.mem.len() as u64,
                blobs: r
                    .backends
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(i, blob)| RegionBlob {
                        backend: *i as u16,
                        blob: blob.to_vec(),
                    })
                    .collect(),
            })
            .collect();
        let md = AgentMetadata {
            name: self.shared.name.clone(),
            instance: self.shared.instance,
            partial,
            backends,
            regions,
        };
        Ok(Bytes::from(md.encode()?))
    }

    /// This agent's full metadata: connection info of every backend and every
    /// registration. Give it to peers ([`Agent::load_metadata`]).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] if it would exceed the format's limits.
    pub fn metadata(&self) -> Result<Bytes> {
        self.build_metadata(self.all_regions(), false, true)
    }

    /// Partial metadata: only `registrations`, with or without connection info.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] if one of them is not registered here.
    pub fn partial_metadata(
        &self,
        registrations: &[Registration],
        with_conn_info: bool,
    ) -> Result<Bytes> {
        let picked = self.pick(registrations, "partial metadata")?;
        self.build_metadata(picked, true, with_conn_info)
    }

    /// This agent's metadata in NIXL's format ([`crate::interop`]), for NIXL agents
    /// (their `add_remote_agent` / `loadRemoteMD`): the connection info of every
    /// backend that speaks NIXL's dialect ([`Backend::nixl`](crate::Backend::nixl)),
    /// under NIXL's backend type (`"UCX"`), and every registration those backends
    /// hold, one descriptor each, in one section per backend and memory type.
    ///
    /// NIXL's loader adds to what it knows and refuses new connection info for a
    /// name it knows: a NIXL agent must remove this agent (`remove_remote_agent`)
    /// before it loads this agent's metadata after a restart.
    ///
    /// # Errors
    /// [`ErrorKind::NotSupported`] when no backend speaks NIXL's dialect;
    /// [`ErrorKind::InvalidArgument`] if it would exceed the format's limits.
    pub fn nixl_metadata(&self) -> Result<Bytes> {
        self.build_nixl_metadata(&self.all_regions(), true)
    }

    /// Partial metadata in NIXL's format: only `registrations`, with or without
    /// connection info (NIXL's `getLocalPartialMD`).
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`] if one of them is not registered here; otherwise as
    /// [`Agent::nixl_metadata`].
    pub fn nixl_partial_metadata(
        &self,
        registrations: &[Registration],
        with_conn_info: bool,
    ) -> Result<Bytes> {
        let picked = self.pick(registrations, "partial NIXL metadata")?;
        self.build_nixl_metadata(&picked, with_conn_info)
    }

    fn build_nixl_metadata(&self, regions: &[Arc<RegionInner>], with_conn: bool) -> Result<Bytes> {
        const OP: &str = "NIXL metadata";
        if !self.shared.backends.iter().any(|b| b.nixl().is_some()) {
            return err(
                ErrorKind::NotSupported,
                OP,
                "no backend of this agent speaks NIXL's protocol (nixl-ucx does)",
            );
        }
        let mut md = NixlMetadata {
            name: self.shared.name.clone(),
            conns: Vec::new(),
            sections: Vec::new(),
        };
        if with_conn {
            // Says "nixl-rs" to agents of this crate; NIXL skips it.
            md.conns.push(NixlConn {
                backend: interop::BACKEND_NIXL_RS.to_owned(),
                info: interop::NIXL_RS_MARKER.to_vec(),
            });
        }
        for (i, b) in self.shared.backends.iter().enumerate() {
            let Some(d) = b.nixl() else { continue };
            if with_conn {
                md.conns.push(NixlConn {
                    backend: d.backend_type().to_owned(),
                    info: b.connection_info().to_vec(),
                });
            }
            let mut dram = Vec::new();
            let mut vram = Vec::new();
            for r in regions {
                // Files are the agent's own: never published.
                let (device, list) = match r.mem.kind() {
                    MemKind::Dram => (0, &mut dram),
                    MemKind::Vram { device } => (u64::from(device), &mut vram),
                    MemKind::File { .. } => continue,
                };
                let Some(blob) = r
                    .backends
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map(|(_, blob)| blob.clone())
                else {
                    continue;
                };
                let desc = NixlDesc {
                    addr: r.mem.addr(),
                    len: r.mem.len() as u64,
                    device,
                    blob: d.export_blob(&blob)?,
                };
                list.push(desc);
            }
            // NIXL keeps its descriptor lists sorted.
            for (mem_type, mut descs) in [(interop::MEM_DRAM, dram), (interop::MEM_VRAM, vram)] {
                if descs.is_empty() {
                    continue;
                }
                descs.sort_by_key(|d| (d.device, d.addr, d.len));
                md.sections.push(NixlSection {
                    backend: d.backend_type().to_owned(),
                    mem_type,
                    descs,
                });
            }
        }
        Ok(Bytes::from(md.encode()?))
    }

    /// Every registration, by id.
    fn all_regions(&self) -> Vec<Arc<RegionInner>> {
        let mut regions: Vec<_> = self
            .shared
            .regions
            .read()
            .unwrap()
            .by_id
            .values()
            .cloned()
            .collect();
        regions.sort_by_key(|r| r.id);
        regions
    }

    fn pick(
        &self,
        registrations: &[Registration],
        op: &'static str,
    ) -> Result<Vec<Arc<RegionInner>>> {
        let regions = self.shared.regions.read().unwrap();
        let mut picked = Vec::with_capacity(registrations.len());
        for r in registrations {
            match regions.by_id.get(&r.id()) {
                Some(x) if Arc::ptr_eq(x, &r.inner) => picked.push(x.clone()),
                _ => {
                    return err(
                        ErrorKind::NotFound,
                        op,
                        format!("registration {} is not registered here", r.id()),
                    )
                }
            }
        }
        Ok(picked)
    }
}
