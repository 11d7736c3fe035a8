//! A backend test double to build other doubles from, and the fixtures most agent
//! tests start with.
//!
//! [`Double`] is the whole [`Backend`] trait with a null behaviour for every method:
//! it registers anything (an empty blob), links to every peer ([`NullLink`]),
//! completes every post and notification at once and moves no data. A test's double implements [`Double`] and
//! overrides only what the test observes; [`backend`] (or [`shared`], for a double the
//! test keeps a handle on) makes it a
//! [`Backend`]. The product trait has no defaults: a real backend states every part of
//! its lifecycle, a double only the part its test is about.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nixl::{
    Agent, Backend, BackendContext, Capabilities, Completer, DescList, ErrorKind, MemKind, Memory,
    NixlDialect, PeerLink, PreparedTransfer, RegionRef, Result, TransferPlan,
};

/// A backend test double: every method has the null behaviour described in the
/// [module docs](self); override what the test observes.
#[async_trait]
pub trait Double: Send + Sync + fmt::Debug + 'static {
    /// Default `"null"`.
    fn name(&self) -> &str {
        "null"
    }
    /// Default: local and remote transfers of host memory, with notifications.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            remote: true,
            notifications: true,
            dram: true,
            ..Capabilities::default()
        }
    }
    /// Default: nothing to start.
    async fn start(&self, ctx: BackendContext) -> Result<()> {
        let _ = ctx;
        Ok(())
    }
    /// Default: empty.
    fn connection_info(&self) -> Bytes {
        Bytes::new()
    }
    /// Default: an empty blob.
    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        let _ = region;
        Ok(Bytes::new())
    }
    /// Default: forgets nothing.
    fn deregister(&self, region_id: u64) -> Result<()> {
        let _ = region_id;
        Ok(())
    }
    /// Default: no faster memory.
    fn alloc(&self, len: usize) -> Option<Result<Memory>> {
        let _ = len;
        None
    }
    /// Default: does not speak NIXL's protocol.
    fn nixl(&self) -> Option<&dyn NixlDialect> {
        None
    }
    /// Default: accepts any info, with a [`NullLink`].
    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        let _ = (peer, conn_info);
        Ok(Arc::new(NullLink))
    }
    /// Default: a transfer whose every post completes at once, moving nothing.
    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        let _ = plan;
        Ok(Box::new(Completes))
    }
    /// Default: nothing to stop.
    async fn shutdown(&self, timeout: Duration) -> Result<()> {
        let _ = timeout;
        Ok(())
    }
    /// Default: nothing to release.
    fn destroy(&self) -> Result<()> {
        Ok(())
    }
}

/// The null double: every method as [`Double`]'s defaults.
#[derive(Debug, Default, Clone, Copy)]
pub struct Null;

impl Double for Null {}

/// A link that is connected at once, completes every notification at once
/// (delivering nothing) and has nothing to close.
#[derive(Debug, Default, Clone, Copy)]
pub struct NullLink;

#[async_trait]
impl PeerLink for NullLink {
    async fn connect(&self) -> Result<()> {
        Ok(())
    }
    fn notify(&self, _msg: Bytes, done: Completer) {
        done.complete(Ok(()));
    }
    fn failed(&self) -> bool {
        false
    }
    fn close(&self, _why: &str) {}
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// A prepared transfer whose every post completes at once.
#[derive(Debug)]
pub struct Completes;

impl PreparedTransfer for Completes {
    fn post(&self, _notif: Option<Bytes>, done: Completer) {
        done.complete(Ok(()));
    }
}

/// A [`Double`] as a [`Backend`]; derefs to the double.
#[derive(Debug)]
pub struct Doubled<D>(Arc<D>);

impl<D> std::ops::Deref for Doubled<D> {
    type Target = D;
    fn deref(&self) -> &D {
        &self.0
    }
}

/// `double` as a [`Backend`].
pub fn backend<D: Double>(double: D) -> Doubled<D> {
    Doubled(Arc::new(double))
}

/// A double the test keeps a handle on, as a [`Backend`].
pub fn shared<D: Double>(double: Arc<D>) -> Doubled<D> {
    Doubled(double)
}

#[async_trait]
impl<D: Double> Backend for Doubled<D> {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    fn unsupported_reason(&self, _kind: MemKind) -> Option<String> {
        None
    }
    async fn start(&self, ctx: BackendContext) -> Result<()> {
        self.0.start(ctx).await
    }
    fn connection_info(&self) -> Bytes {
        self.0.connection_info()
    }
    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        self.0.register(region)
    }
    fn deregister(&self, region_id: u64) -> Result<()> {
        self.0.deregister(region_id)
    }
    fn alloc(&self, len: usize) -> Option<Result<Memory>> {
        self.0.alloc(len)
    }
    fn data_path(&self, _peer: &str) -> Option<String> {
        None
    }
    fn nixl(&self) -> Option<&dyn NixlDialect> {
        self.0.nixl()
    }
    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        self.0.link(peer, conn_info)
    }
    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        self.0.prepare(plan)
    }
    async fn shutdown(&self, timeout: Duration) -> Result<()> {
        self.0.shutdown(timeout).await
    }
    fn destroy(&self) -> Result<()> {
        self.0.destroy()
    }
}

/// An agent named `name` with `backend` as its only backend.
pub async fn agent(name: &str, backend: impl Backend) -> Agent {
    Agent::builder(name)
        .backend(backend)
        .build()
        .await
        .expect("agent builds")
}

/// Load each agent's metadata into the other: `a` knows `b` and `b` knows `a`.
pub fn introduce(a: &Agent, b: &Agent) {
    a.load_metadata(&b.metadata().expect("metadata of b"))
        .expect("a loads b");
    b.load_metadata(&a.metadata().expect("metadata of a"))
        .expect("b loads a");
}

/// A one-descriptor host-memory list.
pub fn one(d: nixl::Desc) -> DescList {
    DescList::from_descs(MemKind::Dram, [d])
}

/// `result` failed with `kind` and a message containing `says`; the error, for more
/// checks. Panics, naming what happened instead, otherwise.
#[track_caller]
pub fn refused<T: fmt::Debug>(result: Result<T>, kind: ErrorKind, says: &str) -> nixl::Error {
    match result {
        Ok(v) => panic!("expected {kind:?} ({says:?}), got Ok({v:?})"),
        Err(e) => {
            assert_eq!(e.kind(), kind, "wrong kind: {e}");
            assert!(e.to_string().contains(says), "{e:?} does not say {says:?}");
            e
        }
    }
}
