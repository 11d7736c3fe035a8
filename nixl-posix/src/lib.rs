//! # nixl-posix
//!
//! File storage for [`nixl`] (NIXL's POSIX backend): storage transfers between an
//! agent's host memory and files it registered ([`nixl::Memory::file`],
//! [`nixl::Memory::open_file`]), as futures like every other transfer.
//!
//! ```no_run
//! # async fn demo() -> nixl::Result<()> {
//! use nixl::{Agent, DescList, Desc, MemKind, Memory, Op, RequestOptions};
//! use nixl::file::FileOptions;
//! let agent = Agent::builder("kv").backend(nixl_posix::PosixBackend::new(Default::default())).build().await?;
//! let mem = agent.register(vec![7u8; 1 << 20])?;
//! let file = agent.register(Memory::open_file("/tmp/kv.bin", &FileOptions {
//!     create: true, len: Some(1 << 20), ..FileOptions::default()
//! })?)?;
//! let fd = file.kind().device();
//! let local = DescList::from_descs(MemKind::Dram, [mem.whole()]);
//! let files = DescList::from_descs(MemKind::File { fd }, [Desc::new(0, 1 << 20, fd)]);
//! // WRITE stores memory into the file; READ loads it back. The agent names itself.
//! agent.create_request(Op::Write, &local, agent.name(), &files, &RequestOptions::default())?
//!     .post(None)?
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! - **Engines.** io_uring where the kernel allows it: a whole descriptor list goes
//!   onto the ring and is submitted in the posting call (the ring holds 4096
//!   operations in flight; more wait their turn); what completes there is taken in
//!   the same call, the rest by one reaper thread blocked in the kernel (no polling).
//!   Buffered transfers larger than [`PosixOptions::inline_max`] go to a pool of
//!   [`PosixOptions::threads`] workers instead: they are page-cache copies, which
//!   the ring would run on the posting thread, one after another, and which several
//!   threads share out. Where io_uring is refused
//!   (container seccomp filters answer EPERM, `kernel.io_uring_disabled`, old
//!   kernels), a pool of worker threads running `pread`/`pwrite`.
//! - **Small buffered transfers run in `post`.** Up to [`PosixOptions::inline_max`]
//!   (4 MiB) of files without O_DIRECT, the posting thread copies to and from the page
//!   cache itself (reads with `RWF_NOWAIT`: what is not cached goes to the engine), as
//!   the agent copies between its own memory regions: handing a 4 KiB copy to
//!   another thread costs more than the copy. With io_uring, reads of more than four
//!   blocks go to the ring instead, which serves cached blocks in the posting call
//!   too, a batch per system call. [`PosixOptions::engine`] chooses (or the
//!   `NIXL_POSIX_ENGINE` environment variable, `uring` or `pool`, for
//!   [`Engine::Auto`]); [`PosixBackend::engine`] reports the choice and why.
//! - **O_DIRECT.** A file opened with `O_DIRECT` keeps it; every segment's file
//!   offset, length and memory address is checked against the file's alignment
//!   (`statx` DIO alignment, else 4096) when the request is made, and a misaligned one
//!   is refused naming the segment, before anything moves.
//! - **Nothing silently wrong.** A transfer reports done only when every byte is in
//!   place: a read past the end of a file (truncated under its registration), a
//!   write the file does not take, ENOSPC, EIO end it with [`nixl::ErrorKind::Io`]
//!   naming the segment (file, offset, length; segments count after contiguous
//!   descriptors were merged, [`nixl::RequestOptions::merge`] off to count
//!   descriptors) and the bytes of the transfer that did move, the OS error as its
//!   source. Files opened with `O_APPEND` are refused at registration (Linux would
//!   write them at their end whatever the offset). Short reads and writes continue where they
//!   stopped. With [`PosixOptions::durability`], a WRITE reports done only after
//!   `fdatasync`/`fsync` of every file it wrote.
//! - **Cancellation.** Dropping a transfer's future skips its operations not yet
//!   handed to the kernel (the thread pool's queue, or what waits for room in the
//!   ring); what the kernel has runs to its end, and the memory stays registered
//!   until it has.
//! - **Not here yet.** GPU memory (to be staged through pinned host buffers, or
//!   GPUDirect Storage through cuFile) is refused with
//!   [`nixl::ErrorKind::NotSupported`]; io_uring registered buffers and files are not
//!   used. Notifications on storage transfers are refused, as in NIXL.
#![deny(unsafe_code)]

mod batch;
mod plan;
mod pool;
mod sys;
mod uring;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nixl::{
    Attachment, Backend, BackendContext, Capabilities, Completer, Error, ErrorKind, Op, PeerLink,
    PreparedTransfer, RegionRef, Result, Segments, TransferPlan,
};

use crate::batch::{Batch, Next};
use crate::plan::Plan;

/// Which I/O engine runs the transfers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Engine {
    /// io_uring when the kernel allows it, else the thread pool (the
    /// `NIXL_POSIX_ENGINE` environment variable, `uring` or `pool`, forces one).
    #[default]
    Auto,
    /// io_uring (starting fails when the kernel refuses it); buffered transfers
    /// over [`PosixOptions::inline_max`] still go to the thread pool.
    Uring,
    /// The thread pool of positional reads and writes.
    Pool,
}

/// Whether a WRITE waits for its data to reach the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Done once the data is in the file (the page cache, for buffered files).
    #[default]
    None,
    /// Done after `fdatasync` of every file written.
    Data,
    /// Done after `fsync` of every file written.
    Full,
}

impl std::str::FromStr for Engine {
    /// What the name should have been.
    type Err = &'static str;

    /// `auto`, `uring` or `pool`.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "uring" => Ok(Self::Uring),
            "pool" => Ok(Self::Pool),
            _ => Err("auto, uring or pool"),
        }
    }
}

impl std::str::FromStr for Durability {
    /// What the name should have been.
    type Err = &'static str;

    /// `none`, `data` (fdatasync) or `full` (fsync).
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "none" => Ok(Self::None),
            "data" => Ok(Self::Data),
            "full" => Ok(Self::Full),
            _ => Err("none, data (fdatasync) or full (fsync)"),
        }
    }
}

/// Options of [`PosixBackend`].
#[derive(Clone, Debug)]
pub struct PosixOptions {
    /// The I/O engine. Default: [`Engine::Auto`].
    pub engine: Engine,
    /// Worker threads of the thread-pool engine (its queue depth). Default: 8.
    pub threads: usize,
    /// Whether WRITEs wait for the device. Default: [`Durability::None`].
    pub durability: Durability,
    /// Transfers of buffered files up to this many bytes run on the posting thread
    /// first, as positional reads and writes of the page cache (reads with
    /// `RWF_NOWAIT`: a block not cached goes to the engine instead of waiting);
    /// larger ones, and O_DIRECT, go to the engine at once. Page-cache I/O is a memory
    /// copy, and handing a small one to another thread costs more than the copy.
    /// A write into the page cache can still wait (dirty-page throttling, a network
    /// filesystem): that wait is the posting thread's. 0: never. Default: 4 MiB.
    pub inline_max: u64,
}

impl Default for PosixOptions {
    fn default() -> Self {
        Self {
            engine: Engine::Auto,
            threads: 8,
            durability: Durability::None,
            inline_max: 4 << 20,
        }
    }
}

/// The file storage backend. See the [crate docs](crate).
#[derive(Debug)]
pub struct PosixBackend {
    options: PosixOptions,
    started: Attachment<Started>,
    /// What runs the transfers, and why (set at start).
    report: OnceLock<String>,
}

#[derive(Debug)]
struct Started {
    engine: Arc<Io>,
}

/// The engines chosen at start: the ring where io_uring runs, and the pool, which
/// takes large buffered transfers (page-cache copies that gain from several threads,
/// and that the ring would run on the posting thread) and everything where there is
/// no ring.
#[derive(Debug)]
struct Io {
    ring: Option<uring::Uring>,
    pool: pool::Pool,
}

impl Io {
    /// Run what can run on this thread (a small transfer of buffered files), hand the
    /// rest to the ring or the pool.
    fn post(&self, batch: Arc<Batch>) {
        let n = batch.plan.ops.len();
        // io_uring serves cached reads inline too, a whole batch per system call:
        // a small read of more than a few blocks goes there.
        let ring_reads = self.ring.is_some()
            && batch.plan.inline
            && batch.plan.op == Op::Read
            && n > INLINE_READS_MAX;
        if !batch.plan.inline || ring_reads {
            let all = (0..n as u32).map(|op| (op, 0));
            return self.submit(&batch, all);
        }
        let rest = inline(&batch);
        let finished = n - rest.len();
        if finished > 0 && batch.finished(finished) {
            return match batch.end() {
                Next::Flush(files) => self.flush(&batch, files),
                Next::Report => batch.report(),
            };
        }
        self.submit(&batch, rest.into_iter());
    }

    /// Hand operations (index, bytes already moved) to the ring or the pool.
    fn submit(&self, batch: &Arc<Batch>, ops: impl Iterator<Item = (u32, u32)>) {
        match self.ring_for(batch) {
            Some(u) => u.submit(batch, ops),
            None => self.pool.submit(batch, ops),
        }
    }

    /// The ring, for a transfer it serves: anything with O_DIRECT, and small
    /// transfers of buffered files (what `inline` left of them); large buffered
    /// transfers go to the pool.
    fn ring_for(&self, batch: &Batch) -> Option<&uring::Uring> {
        self.ring
            .as_ref()
            .filter(|_| batch.plan.inline || !batch.plan.buffered)
    }

    fn flush(&self, batch: &Arc<Batch>, files: usize) {
        match self.ring_for(batch) {
            Some(u) => u.flush(batch, files),
            None => self.pool.flush(batch, files),
        }
    }
}

/// The most reads run on the posting thread with the io_uring engine (one system
/// call each); more go to the ring in one.
const INLINE_READS_MAX: usize = 4;

/// Run `batch`'s operations on this thread: writes into the page cache, reads of
/// what it holds (`RWF_NOWAIT`). Returns the operations left for the engine (index,
/// bytes already moved); every other one finished (moved or failed).
fn inline(batch: &Batch) -> Vec<(u32, u32)> {
    let nowait = batch.plan.op == Op::Read;
    (0..batch.plan.ops.len() as u32)
        .filter_map(|op| pool::run_op(batch, op, 0, nowait).map(|done| (op, done)))
        .collect()
}

pub(crate) fn shut_down() -> Error {
    Error::new(
        ErrorKind::ShutDown,
        "storage transfer",
        "the posix backend is shutting down",
    )
}

impl PosixBackend {
    /// A backend with these options (the engine is chosen when it is attached).
    pub fn new(options: PosixOptions) -> Self {
        Self {
            options,
            started: Attachment::new("posix"),
            report: OnceLock::new(),
        }
    }

    /// Which engine runs the transfers and why (`None` before it is attached): for
    /// example "io_uring (one ring, ...; buffered transfers over 4194304 B on 8 pool
    /// threads)" or "thread pool of 8 positional I/O workers (io_uring refused:
    /// Operation not permitted (os error 1))".
    pub fn engine(&self) -> Option<&str> {
        self.report.get().map(String::as_str)
    }

    /// Whether this kernel gives this process an io_uring that runs (a ring is set
    /// up, runs a no-op, and is closed again).
    ///
    /// # Errors
    /// [`ErrorKind::NotSupported`] with the kernel's answer.
    pub fn probe_uring() -> Result<()> {
        uring::Uring::new().map(drop).map_err(|e| {
            Error::new(
                ErrorKind::NotSupported,
                "probe io_uring",
                format!("io_uring is not available here: {e}"),
            )
            .with_source(e)
        })
    }

    fn choose(&self) -> Result<(Io, String)> {
        let forced = std::env::var("NIXL_POSIX_ENGINE").ok();
        let engine = match (self.options.engine, forced.as_deref()) {
            (Engine::Auto, Some(name)) if !name.is_empty() => name.parse().map_err(|want| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    "start posix backend",
                    format!("NIXL_POSIX_ENGINE={name:?}: expected {want}"),
                )
            })?,
            (e, _) => e,
        };
        let threads = self.options.threads.max(1);
        let pool = |why: String| {
            (
                Io {
                    ring: None,
                    pool: pool::Pool::default(),
                },
                format!("thread pool of {threads} positional I/O workers{why}"),
            )
        };
        Ok(match engine {
            Engine::Pool => pool(String::new()),
            Engine::Uring | Engine::Auto => match uring::Uring::new() {
                Ok(u) => (
                    Io {
                        ring: Some(u),
                        pool: pool::Pool::default(),
                    },
                    format!(
                        "io_uring (one ring, submitted by the posting call, one reaper thread; buffered transfers over {} B on {threads} pool threads)",
                        self.options.inline_max
                    ),
                ),
                Err(e) if engine == Engine::Auto => pool(format!(" (io_uring refused: {e})")),
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::NotSupported,
                        "start posix backend",
                        format!("io_uring is not available here: {e} (a seccomp filter or kernel.io_uring_disabled?); use Engine::Pool or Engine::Auto"),
                    )
                    .with_source(e))
                }
            },
        })
    }
}

#[async_trait]
impl Backend for PosixBackend {
    fn name(&self) -> &str {
        "posix"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: true,
            dram: true,
            file: true,
            ..Capabilities::default()
        }
    }

    fn unsupported_reason(&self, kind: nixl::MemKind) -> Option<String> {
        matches!(kind, nixl::MemKind::Vram { .. }).then(|| {
            "the posix backend moves files to and from host memory (GPU memory goes through a GPU storage backend)".to_owned()
        })
    }

    fn alloc(&self, _len: usize) -> Option<Result<nixl::Memory>> {
        // The kernel reads into and writes from any host memory alike.
        None
    }

    fn nixl(&self) -> Option<&dyn nixl::NixlDialect> {
        // Files never reach peers: no protocol to speak.
        None
    }

    async fn start(&self, ctx: BackendContext) -> Result<()> {
        const OP: &str = "start posix backend";
        let threads = self.options.threads.max(1);
        self.started
            .attach(OP, async {
                let (io, report) = self.choose()?;
                let io = Arc::new(io);
                if io.ring.is_some() {
                    let (run, wake) = (io.clone(), io.clone());
                    ctx.spawn_thread(
                        "nixl-posix-uring",
                        move |token| {
                            if let Some(u) = &run.ring {
                                u.run(&|| token.is_cancelled());
                            }
                        },
                        move || {
                            if let Some(u) = &wake.ring {
                                u.wake();
                            }
                        },
                    )?;
                }
                for i in 0..threads {
                    let (run, wake) = (io.clone(), io.clone());
                    ctx.spawn_thread(
                        &format!("nixl-posix-{i}"),
                        move |token| run.pool.run(&|| token.is_cancelled()),
                        move || wake.pool.wake(),
                    )?;
                }
                tracing::info!(agent = %ctx.agent_name, engine = %report, "posix backend started");
                let _ = self.report.set(report);
                Ok(Started { engine: io })
            })
            .await?;
        Ok(())
    }

    fn connection_info(&self) -> Bytes {
        Bytes::new()
    }

    fn register(&self, _region: &RegionRef) -> Result<Bytes> {
        // Nothing to set up: the core holds the file, and host memory is used as is.
        Ok(Bytes::new())
    }

    fn deregister(&self, _region_id: u64) -> Result<()> {
        Ok(())
    }

    fn data_path(&self, _peer: &str) -> Option<String> {
        self.engine().map(str::to_owned)
    }

    fn link(&self, peer: &str, _conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        // Files are local: peers are never reached through this backend.
        Ok(Arc::new(NoPeers(peer.to_owned())))
    }

    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        let started = self.started.get("prepare storage transfer")?;
        if let Some(peer) = &plan.peer {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "prepare storage transfer",
                format!(
                    "files are reached only by their own agent, not from {:?}",
                    peer.name
                ),
            ));
        }
        let io_plan = Arc::new(Plan::new(plan.op, &plan.segments, self.options.inline_max)?);
        Ok(Box::new(Prepared {
            plan: io_plan,
            durability: self.options.durability,
            io: started.engine.clone(),
            _segments: plan.segments,
        }))
    }

    async fn shutdown(&self, _timeout: Duration) -> Result<()> {
        // The agent stops the engine's threads after this: they refuse new work and
        // end once the kernel returned every operation in flight.
        Ok(())
    }

    fn destroy(&self) -> Result<()> {
        Ok(())
    }
}

/// A prepared storage transfer.
#[derive(Debug)]
struct Prepared {
    plan: Arc<Plan>,
    durability: Durability,
    io: Arc<Io>,
    /// Keeps the registrations the plan names alive while the request exists.
    _segments: Segments,
}

impl PreparedTransfer for Prepared {
    fn post(&self, notif: Option<Bytes>, done: Completer) {
        if notif.is_some() {
            return done.complete(Err(Error::new(
                ErrorKind::NotSupported,
                "post storage transfer",
                "a storage transfer carries no notification (there is no peer to tell)",
            )));
        }
        if self.plan.op == Op::Write {
            // One fcntl per file and post: a descriptor registered by number shares
            // its flags with the caller, who may have set O_APPEND since.
            let refused = (self.plan.files.iter())
                .find_map(|f| f.check_positional_writes("post storage transfer").err());
            if let Some(e) = refused {
                return done.complete(Err(e));
            }
        }
        self.io
            .post(Batch::new(self.plan.clone(), self.durability, done));
    }
}

/// The posix backend's link to a peer it never reaches: files are local.
#[derive(Debug)]
struct NoPeers(String);

#[async_trait]
impl PeerLink for NoPeers {
    async fn connect(&self) -> Result<()> {
        Err(Error::new(
            ErrorKind::NotSupported,
            "connect",
            format!(
                "the posix backend moves data between this agent's memory and files; it does not reach peers ({:?})",
                self.0
            ),
        ))
    }

    fn notify(&self, _msg: Bytes, done: Completer) {
        done.complete(Err(Error::new(
            ErrorKind::NotSupported,
            "notify",
            format!("the posix backend has no peers to notify ({:?})", self.0),
        )));
    }

    fn failed(&self) -> bool {
        false
    }

    fn close(&self, _why: &str) {}

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
