//! Everything that touches libibverbs, and (with the test double) the crate's only
//! `unsafe` code, in three layers:
//!
//! 1. [`sys`]: our own declarations of the libibverbs structs, constants and function
//!    types this crate uses.
//! 2. [`VerbsApi`]: the verbs calls as one crate-internal trait whose calls return
//!    `Result`s, implemented by the host's libibverbs ([`library`], loaded at run
//!    time) and, for tests, by the in-process test double (`crate::test_double`).
//! 3. [`device`]: the safe owners of what those calls make (the device with its
//!    protection domain, completion channel and queue, memory regions, queue pairs),
//!    whose `Drop` releases in verbs' order; the rest of the crate posts, registers
//!    and watches the completion channel only through their safe methods.
#![allow(unsafe_code)]

pub(crate) mod device;
pub mod library;
pub(crate) mod sys;

use std::fmt;
use std::os::fd::BorrowedFd;

use nixl::Result;

use crate::api::{
    Channel, Completion, DeviceInfo, DeviceLimits, GidEntry, Handle, Mr, PortInfo, PostError, Qp,
    QpCaps, QpTransition, RecvWr, SendWr, Sge, WcStatus,
};

/// The verbs calls of this crate. Crate-internal: its safe methods dereference
/// handles, which only this crate's bindings make and only its owners (which destroy
/// each handle last) pass in.
///
/// Thread safety follows libibverbs: every call may be made from any thread; posting
/// to one queue pair and polling one completion queue must not run concurrently with
/// themselves (the backend serializes them).
///
/// # Safety
/// Handles passed in must come from this same implementation and must not have been
/// destroyed; the backend owns each through one owner that destroys it last, after
/// everything made from it.
pub(crate) trait VerbsApi: Send + Sync + fmt::Debug + 'static {
    /// One line saying what this is (the library bound, or the test double).
    fn describe(&self) -> String;

    /// The devices present.
    fn devices(&self) -> Result<Vec<DeviceInfo>>;

    /// Open a device by name.
    fn open(&self, device: &str) -> Result<Handle>;

    /// Its limits.
    fn query_device(&self, ctx: Handle) -> Result<DeviceLimits>;

    /// One port (numbered from 1).
    fn query_port(&self, ctx: Handle, port: u8) -> Result<PortInfo>;

    /// One GID table entry; `None` for an empty one.
    fn query_gid(&self, ctx: Handle, port: u8, index: u32) -> Result<Option<GidEntry>>;

    /// A protection domain.
    fn alloc_pd(&self, ctx: Handle) -> Result<Handle>;

    /// Register `addr..addr + len` with [`access`] flags.
    ///
    /// # Safety
    /// The memory stays mapped until `VerbsApi::dereg_mr` returns; the NIC may read
    /// and write it (as `access` allows) until then.
    unsafe fn reg_mr(&self, pd: Handle, addr: usize, len: usize, access: u32) -> Result<Mr>;

    /// Register `len` bytes at `offset` of the dma-buf `fd` (device memory), addressed
    /// by peers and work requests as `iova..iova + len`, with [`access`] flags.
    ///
    /// # Safety
    /// The memory behind the dma-buf stays allocated until `VerbsApi::dereg_mr`
    /// returns; the NIC may read and write it (as `access` allows) until then.
    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Handle,
        offset: u64,
        len: usize,
        iova: u64,
        fd: BorrowedFd<'_>,
        access: u32,
    ) -> Result<Mr>;

    /// Deregister (no work request may still use it).
    ///
    /// # Safety
    /// `mr` is live and unused from now on.
    unsafe fn dereg_mr(&self, mr: Handle) -> Result<()>;

    /// A completion channel, its descriptor non-blocking.
    fn create_channel(&self, ctx: Handle) -> Result<Channel>;

    /// A completion queue of at least `cqe` entries, reporting to `channel`.
    fn create_cq(&self, ctx: Handle, cqe: u32, channel: Handle) -> Result<Handle>;

    /// Ask for an event on `channel` at the next completion.
    fn req_notify_cq(&self, cq: Handle) -> Result<()>;

    /// Take one pending event from `channel` (non-blocking): the queue it is for, or
    /// `None` when there is none.
    fn get_cq_event(&self, channel: Handle) -> Result<Option<Handle>>;

    /// Acknowledge events taken (all must be before the queue is destroyed).
    fn ack_cq_events(&self, cq: Handle, events: u32);

    /// Take up to `out.len()` completions; returns how many.
    fn poll_cq(&self, cq: Handle, out: &mut [Completion]) -> Result<usize>;

    /// A reliable-connected queue pair whose sends and receives complete on `cq`.
    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> Result<Qp>;

    /// Change its state.
    fn modify_qp(&self, qp: Handle, to: &QpTransition) -> Result<()>;

    /// Post `wrs` as one chain.
    ///
    /// # Safety
    /// Every entry's memory lies in a live region with that key (or, inline, is
    /// readable now) and stays valid until the work request completes.
    unsafe fn post_send(
        &self,
        qp: Handle,
        wrs: &[SendWr],
        sges: &[Sge],
    ) -> std::result::Result<(), PostError>;

    /// Post receives.
    ///
    /// # Safety
    /// Each buffer lies in a live region with that key and stays valid until it
    /// completes.
    unsafe fn post_recv(&self, qp: Handle, wrs: &[RecvWr]) -> std::result::Result<(), PostError>;

    /// Destroy a queue pair (after moving it to ERROR and draining it).
    ///
    /// # Safety
    /// `qp` is live and unused from now on.
    unsafe fn destroy_qp(&self, qp: Handle) -> Result<()>;

    /// Destroy a completion queue (its queue pairs are gone, its events acknowledged).
    ///
    /// # Safety
    /// `cq` is live and unused from now on.
    unsafe fn destroy_cq(&self, cq: Handle) -> Result<()>;

    /// Destroy a completion channel (its queues are gone).
    ///
    /// # Safety
    /// `channel` is live and unused from now on.
    unsafe fn destroy_channel(&self, channel: Handle) -> Result<()>;

    /// Free a protection domain (its regions and queue pairs are gone).
    ///
    /// # Safety
    /// `pd` is live and unused from now on.
    unsafe fn dealloc_pd(&self, pd: Handle) -> Result<()>;

    /// Close a device (everything made from it is gone).
    ///
    /// # Safety
    /// `ctx` is live and unused from now on.
    unsafe fn close(&self, ctx: Handle) -> Result<()>;

    /// The text of a completion status (`ibv_wc_status_str`).
    fn status_str(&self, status: WcStatus) -> String;
}
