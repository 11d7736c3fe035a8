//! # nixl-ucx
//!
//! A [`nixl`] backend over UCX, with `libucp` loaded at run time (never linked at build
//! time, no C headers needed to build).
//!
//! - **Loading.** An explicit library ([`UcxOptions::library`] or `NIXL_UCX_LIB`), else
//!   the soname `libucp.so.0`. Before loading, UCX objects already in the process (MPI,
//!   a Python wheel) are detected; after loading, the real paths of the libucp, libucs
//!   and libuct actually bound are found with `dladdr` and checked to come from one
//!   installation. The outcome is logged and kept in [`UcxBackend::library_report`].
//!   A mixture warns, or fails in strict mode (`NIXL_UCX_STRICT=1`); an expected library
//!   (`NIXL_UCX_EXPECT` = path or version) that is not met refuses to start. A missing
//!   library is an [`ErrorKind::UnavailableLibrary`] error, never a panic.
//! - **Data path.** One UCP context (RMA, active messages, wakeup) and one worker.
//!   Each registration is mapped with `ucp_mem_map`; its packed remote key travels in
//!   the registration's metadata blob and is unpacked once per (peer, region). The
//!   connection info is the worker address; endpoints are made when the agent asks
//!   for a link. WRITE and READ are one `ucp_put_nbx`/`ucp_get_nbx` per segment, then an endpoint flush; the
//!   transfer completes when the flush does. A notification is an active message sent
//!   after that flush, so the target sees the data first; it names the sender and
//!   carries a sequence number so the target delivers notifications in posting order.
//! - **Shared memory.** Between processes of one host, where the transfer lands
//!   decides the speed. Memory from [`UcxBackend::alloc`] is shared memory UCX
//!   allocated, which the peer maps: a put or get is a plain copy by the initiator
//!   (a 4 KiB WRITE completes in about 1 µs here). Ordinary memory is reached by CMA
//!   (`process_vm_writev`, one system call per segment) on UCX 1.14 and later: the
//!   backend sets `RNDV_THRESH=inf` (it sends eager active messages only), without
//!   which UCX refuses CMA to peer-failure endpoints and emulates put/get with
//!   active messages. UCX 1.13 always refuses it there (it requires memory
//!   invalidation of such lanes), so on 1.13 ordinary memory goes by those active
//!   messages, which the target's driver must serve (tens of microseconds). On 1.22,
//!   UCX's protocol selection then also prefers CMA for allocated memory from 16 KiB
//!   up (~10 GB/s here, as `ucx_perftest` gets); `UCX_RNDV_THRESH=auto` in the
//!   environment restores the plain copy for WRITEs into allocated memory (~30-38
//!   GB/s here) at the price of READs and of ordinary memory (active messages again).
//! - **Progress.** A driver owns UCX progress: by default a tokio task that sleeps on
//!   the worker's event fd when idle (`ucp_worker_arm`), and spins briefly
//!   ([`UcxOptions::spin`]) while transfers are in flight; optionally a dedicated
//!   thread ([`ProgressMode::Thread`]) that the agent owns
//!   ([`nixl::BackendContext::spawn_thread`]): stopped, woken through an event fd and
//!   joined within the agent's bound at shutdown and when the agent is dropped. Posting
//!   queues the transfer and, when the driver is not in UCX at that moment, issues it
//!   on the caller's thread ([`UcxOptions::post_inline`]): a transfer UCX finishes at
//!   once (shared memory) completes before `post` returns, with no thread hop. All
//!   UCX calls are serialised by one mutex.
//! - **Failures.** Endpoints use `UCP_ERR_HANDLING_MODE_PEER`; a peer that fails (UCX's
//!   error handler, its goodbye message at shutdown, or a missed liveness probe) fails
//!   its in-flight transfers with [`ErrorKind::RemoteDisconnected`], and later posts
//!   fail fast. UCX's keepalive ([`UcxOptions::keepalive_interval`], 5 s) notices a
//!   dead process, a broken link, or a connection the peer closed on its side, within
//!   about two intervals. It cannot notice a peer *worker* destroyed in a
//!   process that lives on (an agent dropped or shut down before it said goodbye to
//!   us, for example another agent of this process), nor a peer gone before it
//!   answered UCX's connection handshake: on shared memory UCX only checks that the
//!   peer's process exists, and operations that need the peer (the handshake, RMA
//!   emulated over active messages) would wait forever. So while transfers to a peer
//!   make no progress, the driver probes the peer (a PING its progress loop answers,
//!   on the connection, then on a separate endpoint); a peer that does not answer
//!   fails its transfers within [`UcxOptions::dead_peer_timeout`] (5 s by default).
//! - **Hostile senders.** Anyone who reaches the worker can send active messages.
//!   Notifications over [`UcxOptions::max_notification`] are dropped before they are
//!   copied; rendezvous offers (`UCP_AM_SEND_FLAG_RNDV`; this backend and NIXL send
//!   every message eagerly, whatever its size) are declined unread, through UCX's
//!   own path (UCX drops the descriptor and the sender's send fails with
//!   `UCS_ERR_REJECTED`); and the reorder buffer is bounded
//!   per stream, per sender and in all, with a gap timeout (the limits are in the
//!   `reorder` module and the README's security section); refusals are counted and
//!   logged. Without a shared secret nothing in a message is authenticated: anyone
//!   who reaches the worker can deliver a notification in any agent's name.
//! - **Peers' UCX objects.** A peer's worker address (its connection info) and packed
//!   remote keys (in its registrations' blobs) go to UCX parsers that take no length.
//!   Before UCX sees one, its structure is checked (an address's header: version 1 or
//!   2, known flags, the ids and name its flags announce; a key's whole layout: a
//!   known memory type, each memory domain's key inside it; sizes bounded), a bad
//!   one is refused with [`ErrorKind::Corrupt`] naming what is wrong, and UCX gets a
//!   copy followed by enough zeroed padding that no parse can read past it. This
//!   stops reads past the buffer and UCX's abort on an unknown address version
//!   (both seen in tests before the check). It cannot check what the bytes *mean*:
//!   an address or key changed inside (a transport's attributes, a memory domain's
//!   key) can still trip UCX's own assertions (lane selection's `score >= 0.0`, the
//!   tcp transport's, 1.13's `ucp_rkey_destroy` after a failed key), so metadata from
//!   untrusted senders needs the shared secret.
//! - **A full notification queue.** The progress loop cannot wait for room in the
//!   agent's queue ([`nixl::NotificationLimits`]) and UCX cannot stop a sender, so
//!   notifications between agents of this crate are flow-controlled by credit: a
//!   sender stream may have a window (1024 notifications, 4 MiB) beyond what the
//!   receiving agent took in; the sender asks (CREDIT_ASK) at half its window and,
//!   while notifications wait, again with back-off, and the receiver answers on UCX's
//!   reply endpoint (as PING is answered: it never dials anyone). The receiver holds
//!   what does not fit its agent's queue yet, in arrival order, and the sender holds
//!   what is beyond its window (the transfers those belong to stay in flight). NIXL agents' notifications, which
//!   cannot be held back, and a sender ignoring its grant are held up to a bound,
//!   then dropped, counted and logged ([`nixl::NotificationSink::deliver`]); a known
//!   peer of ours is told with a DROPPED message on its own connection (naming the
//!   sender's stream, so only that sender takes it), and its next transfer or
//!   notification to this agent fails with [`nixl::ErrorKind::NotAllowed`] saying
//!   how many were dropped. A flood under fresh names without HELLO fills only the
//!   unknown names' pool. Agents of this crate that exchanged NIXL's metadata format
//!   find each other by its [`nixl::interop::BACKEND_NIXL_RS`] entry and speak this
//!   protocol, flow control included.
//! - **Shared secret.** With the agent's secret ([`nixl::AgentBuilder::secret`], or
//!   [`UcxOptions::secret`], which overrides it), every message of this backend's
//!   own protocol (notification, HELLO, BYE, PING, PONG, DROPPED, CREDIT_ASK, CREDIT) carries an HMAC-SHA256 over
//!   the receiving agent's name, its kind, stream, sequence number, the sender's name
//!   and its whole payload (header version 2, see the `wire` module). The receiver
//!   checks it in the message handler, after the size limits and before anything
//!   else: a message without a MAC, with one under another secret, made for another
//!   agent or altered is dropped, counted and logged (nothing delivered, no HELLO
//!   remembered, no PONG answered, no BYE acted on); so is a MAC'd message at an
//!   agent without a secret (a configuration mismatch, never accepted unchecked).
//!   The name a notification is delivered under is the one its sender signed. This
//!   stops processes that reach the worker without the secret, as nixl-tcp's secret
//!   does; like nixl-tcp's, it is not encryption, and there is no replay protection:
//!   someone who can read the traffic can send a captured message again to the same
//!   agent (a repeated stream and sequence number is delivered again, or replaces a
//!   held one), though never altered, to another agent, or under another name. Without
//!   a secret the header (version 1) and behaviour are as before. The cost is one
//!   HMAC-SHA256 per message sent and one per message received, over its payload.
//!   One-sided READs and WRITEs are not covered: they are UCX's, checked by UCX's
//!   remote keys only (see **One-sided**).
//! - **Teardown.** [`nixl::Backend::shutdown`] says goodbye to known peers (loaded
//!   from metadata; an address heard only in a HELLO is never dialled), fails what is
//!   left and closes every endpoint; UCX's memory mappings, worker and context stay
//!   until the agent has deregistered every region, and [`nixl::Backend::destroy`]
//!   then destroys the worker and (once no allocation holds it) the context.
//! - **UCX's tcp transport and peers that go away.** UCX before 1.14 aborts the
//!   process on an assertion when a peer goes away during the tcp transport's
//!   connection handshake; UCX 1.22 and 1.23 can crash on a freed tcp endpoint when a
//!   peer shuts down mid-transfer. No setting avoids either. The backend warns once
//!   when it binds a UCX with tcp allowed; see [`teardown_abort_risk`].
//! - **Deregistration.** nixl's promise that nothing touches memory once
//!   [`nixl::Agent::deregister`] returned holds on nixl-ucx only where UCX's transport
//!   checks remote keys in hardware (RDMA): deregistering unmaps the region
//!   (`ucp_mem_unmap`), and a peer's later WRITE or READ with the old key fails. It
//!   does **not** hold on shared memory or tcp, for any memory: with the metadata it
//!   loaded before, a peer's WRITE after deregistration completes and its bytes land
//!   (measured on UCX 1.13 and 1.22, `UCX_TLS=shm,self` and `tcp,self`, ordinary and
//!   [`UcxBackend::alloc`] memory: `tests/after_deregister.rs`). Nothing at the target
//!   can revoke it: CMA writes the target's addresses with a system call, UCX 1.13's
//!   software RMA (what peer-failure endpoints use there) writes any address it is
//!   sent, and an allocation's shared segment stays mapped in every peer that mapped
//!   it. Until peers are told (reload or invalidate the metadata at every peer that
//!   loaded it, and wait for their transfers), keep deregistered memory alive and
//!   unused, and do not free memory handed in by address after deregistering it.
//! - **One-sided.** The target does not see requests, so it cannot refuse forged keys
//!   or out-of-range access itself: [`Capabilities::target_checks`] is `false`; the
//!   initiating agent checks every descriptor, and the transport checks keys and
//!   bounds as far as it can (shared memory via CMA checks neither).
//! - **NIXL agents.** Peers loaded from NIXL's metadata
//!   ([`nixl::NixlDialect`], [`nixl::interop`]) are spoken to as NIXL's UCX backend
//!   speaks: the same worker address as connection info, the packed remote key alone
//!   as a registration's blob, notifications as UCX active message 0 carrying NIXL's
//!   serdes of the sender's name and the message (sent eagerly, after the transfer's
//!   flush; received from any sender, unordered, as NIXL delivers them), and none of
//!   this backend's own messages (no HELLO, BYE or liveness probes: a NIXL peer's
//!   failure is noticed by UCX's peer-failure handling and keepalive alone). Both
//!   sides must bind the same UCX build (`NIXL_UCX_LIB` at the NIXL agents' libucp):
//!   an endpoint to a NIXL agent is only ever made with peer-failure handling, and a
//!   NIXL agent unreachable that way fails its transfers with an error naming the
//!   UCX bound here, rather than connecting without it (which ends in an assertion
//!   inside UCX 1.13). NIXL's protocol has no authentication, so with a shared secret
//!   this backend does not talk to NIXL agents: loading a NIXL agent's metadata fails
//!   with [`ErrorKind::NotAllowed`] (nothing is loaded), so does exporting this
//!   agent's registrations in NIXL's format ([`nixl::Agent::nixl_metadata`]), and
//!   NIXL notifications that arrive are dropped, counted and logged.
//! - **VRAM** ([`nixl::gpu`]) is mapped with `UCS_MEMORY_TYPE_CUDA` when the bound UCX
//!   supports CUDA memory ([`UcxBackend::cuda_supported`]: its `cuda_copy` transport
//!   loaded and sees a GPU; the PyPI `libucx-cu12` build can, Debian's 1.13 cannot),
//!   and refused with [`ErrorKind::NotSupported`] saying why otherwise. Once GPU
//!   memory is mapped, every round of UCX calls (the driver's, and posting on a
//!   caller's thread) runs with that GPU's primary context current, as UCX before 1.19
//!   needs. **Not yet run on a GPU.**
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod driver;
mod ffi;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(test)]
mod hostile_tests;
mod library;
#[cfg(test)]
mod notif_bound_tests;
mod packed;
mod protocol;
mod reorder;
mod wire;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nixl::{
    Attachment, Backend, BackendContext, Capabilities, Completer, Error, ErrorKind, MemKind,
    NixlDialect, Op, PeerLink, PreparedTransfer, RegionRef, Result, TargetRegion, TransferPlan,
};
use tokio_util::sync::CancellationToken;

use driver::{Cmd, Core, Liveness, RemoteXfer, Shared, Wake};
use ffi::{RmaSeg, Ucx, UcxInit};
pub use library::{
    LibraryReport, LibrarySource, UcxLibraryReport, DEFAULT_SONAME, ENV_EXPECT, ENV_LIB,
    ENV_STRICT, MIN_VERSION,
};

/// Environment variable giving the default [`UcxOptions::progress`]: `task` or `thread`.
pub const ENV_PROGRESS: &str = "NIXL_UCX_PROGRESS";
/// Environment variable giving the default [`UcxOptions::spin`] in microseconds.
pub const ENV_SPIN_US: &str = "NIXL_UCX_SPIN_US";
/// Environment variable giving the default [`UcxOptions::dead_peer_timeout`] in
/// milliseconds (`0` disables probing).
pub const ENV_LIVENESS_MS: &str = "NIXL_UCX_LIVENESS_MS";

/// Environment variable giving the default [`UcxOptions::post_inline`] (`0` turns it
/// off).
pub const ENV_POST_INLINE: &str = "NIXL_UCX_POST_INLINE";

/// UCX's setting for one-sided gets over CUDA IPC (see `UcxBackend::with_options`).
const CUDA_IPC_GET: &str = "CUDA_IPC_ENABLE_GET_ZCOPY";
const ENV_UCX_CUDA_IPC_GET: &str = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY";

/// Whether a `UCX_TLS` value may allow the `cuda_ipc` transport: `all`, a list that
/// names it or its alias `cuda`, or an exclusion list (`^...`) that names neither.
/// (`sm`/`shm` do not include it.)
fn tls_may_include_cuda_ipc(tls: &str) -> bool {
    let (exclude, list) = match tls.trim().strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, tls.trim()),
    };
    let named = list
        .split(',')
        .map(|t| t.trim().split(':').next().unwrap_or(""))
        .any(|t| matches!(t, "cuda" | "cuda_ipc" | "all"));
    named != exclude
}

/// Who drives UCX progress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProgressMode {
    /// A tokio task on the agent's runtime, woken by the worker's event fd.
    #[default]
    Task,
    /// A dedicated OS thread (`nixl-ucx-progress`) owned by the agent: stopped, woken
    /// (through an event fd) and joined within the agent's shutdown bound, from
    /// shutdown and from dropping the agent alike.
    Thread,
}

/// Options for [`UcxBackend`].
#[derive(Clone, Debug)]
pub struct UcxOptions {
    /// libucp to load: a path or a soname. Default: `NIXL_UCX_LIB`, else
    /// [`DEFAULT_SONAME`].
    pub library: Option<PathBuf>,
    /// Refuse to start unless the bound libucp matches: a path (the file or its
    /// directory) or a version prefix (`"1.22"`). Default: `NIXL_UCX_EXPECT`.
    pub expect: Option<String>,
    /// Fail (instead of warning) when UCX libraries come from more than one
    /// installation. Default: `NIXL_UCX_STRICT` is `1`, `true` or `yes`.
    pub strict: Option<bool>,
    /// UCX configuration settings (`("TLS", "shm,self")`), applied over the `UCX_*`
    /// environment variables.
    pub ucx_config: Vec<(String, String)>,
    /// UCX keepalive interval: how often UCX checks the transports of a connected
    /// peer (a dead process, a broken link, a connection the peer closed on its side;
    /// noticed within about two intervals). `None` keeps UCX's default (20 s in 1.13).
    /// It cannot see a peer worker destroyed in a live process; see
    /// [`UcxOptions::dead_peer_timeout`].
    pub keepalive_interval: Option<Duration>,
    /// Bound on how long transfers and notifications wait on a peer that is gone
    /// without UCX noticing (an agent dropped or shut down in a process that lives on,
    /// including agents of one process, on shared memory; or a peer gone before it
    /// answered UCX's connection handshake). While work to a peer makes no progress
    /// for a fifth of this, the driver probes the peer (on the connection, then on a
    /// separate endpoint); no answer within the rest fails the connection: its
    /// transfers end with [`ErrorKind::RemoteDisconnected`].
    ///
    /// A live peer's progress loop answers within milliseconds, and each answer
    /// restarts the clock, so a long transfer to a live peer is not failed by this,
    /// unless the peer's worker does not get to the answer within two fifths of the
    /// bound (a peer that stops progressing UCX; or, on UCX's TCP transport, a single
    /// transfer of many gigabytes can delay it: raise the bound for such workloads).
    /// `None` disables probing (then such a peer leaves its transfers pending until it
    /// is forgotten or the agent shuts down). Default: `NIXL_UCX_LIVENESS_MS` (`0`
    /// disables), else 5 s.
    pub dead_peer_timeout: Option<Duration>,
    /// Progress driver.
    pub progress: ProgressMode,
    /// How long the driver keeps polling (instead of sleeping on the event fd) while
    /// transfers are in flight.
    pub spin: Duration,
    /// Whether posting may issue the transfer on the caller's thread when the driver
    /// is not in UCX at that moment (otherwise the driver issues it). On shared memory
    /// this completes a small transfer before `post` returns, without waking another
    /// thread; a large one is copied (by CMA) on the caller's thread, just as the
    /// driver would copy it on a runtime thread. Default: `true`, or
    /// `NIXL_UCX_POST_INLINE=0` to turn it off.
    pub post_inline: bool,
    /// Bound on saying goodbye to peers at shutdown and on closing endpoints.
    pub teardown_bound: Duration,
    /// Longest notification accepted.
    pub max_notification: usize,
    /// Create endpoints with UCX's peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`,
    /// the default, as NIXL's `ucx_error_handling_mode=peer`): a failed peer fails
    /// its transfers at once. `false` (NIXL's `none`) lets UCX choose transports that
    /// cannot report peer failure; a dead peer is then found by the liveness probes
    /// ([`UcxOptions::dead_peer_timeout`]) instead.
    pub peer_error_handling: bool,
    /// When set, every message of this backend's own protocol (notifications, HELLO,
    /// BYE, liveness probes, credit requests and their answers, DROPPED reports) carries an HMAC-SHA256 under this
    /// secret, made for the receiving agent's name, and every incoming one must
    /// carry a valid one: a process that reaches the worker without the secret can
    /// neither deliver a notification nor name a sender (see the crate docs, "Shared
    /// secret"). NIXL agents cannot prove a secret, so with one this backend does not
    /// talk to them. Set the same secret on every agent of a deployment. `None`: the
    /// agent's ([`nixl::AgentBuilder::secret`]), if it has one.
    pub secret: Option<nixl::SharedSecret>,
}

impl Default for UcxOptions {
    fn default() -> Self {
        Self {
            library: None,
            expect: None,
            strict: None,
            ucx_config: Vec::new(),
            keepalive_interval: Some(Duration::from_secs(5)),
            dead_peer_timeout: match std::env::var(ENV_LIVENESS_MS)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
            {
                Some(0) => None,
                Some(ms) => Some(Duration::from_millis(ms)),
                None => Some(Duration::from_secs(5)),
            },
            progress: match std::env::var(ENV_PROGRESS).as_deref() {
                Ok("thread") => ProgressMode::Thread,
                _ => ProgressMode::Task,
            },
            spin: std::env::var(ENV_SPIN_US)
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(Duration::from_micros(50), Duration::from_micros),
            post_inline: !matches!(
                std::env::var(ENV_POST_INLINE).as_deref(),
                Ok("0" | "false" | "no")
            ),
            teardown_bound: Duration::from_millis(500),
            max_notification: 1 << 20,
            peer_error_handling: true,
            secret: None,
        }
    }
}

impl UcxOptions {
    fn request(&self) -> (String, LibrarySource) {
        if let Some(p) = &self.library {
            return (p.display().to_string(), LibrarySource::Option);
        }
        match std::env::var(ENV_LIB) {
            Ok(v) if !v.is_empty() => (v, LibrarySource::Env),
            _ => (DEFAULT_SONAME.to_owned(), LibrarySource::Default),
        }
    }

    fn expectations(&self) -> nixl::native::Expectations {
        nixl::native::Expectations::resolve(
            self.expect.clone(),
            self.strict,
            ENV_EXPECT,
            ENV_STRICT,
        )
    }
}

/// Why UCX itself may abort or crash this process when a peer goes away, given the
/// bound UCX and the transports `options` and the environment allow; `None` when
/// neither is known to happen.
///
/// Both need UCX's tcp transport:
/// - UCX 1.13 (Debian 12's `libucx0`), built with assertions, aborts on an assertion
///   in `ucp_request_send_state_ff` ("got REP message") when a peer's worker or
///   process goes away while the tcp transport is still completing the endpoint
///   handshake to it. UCX 1.14 removed the assertion.
/// - UCX 1.22 and 1.23 (PyPI's `libucx-cu12`, NIXL 1.5.1's wheel) can crash in
///   `uct_tcp_iface_handle_events`, on an event of a tcp endpoint already freed, when
///   a peer shuts down while transfers to it are in flight: 4 to 25 of 100 runs of
///   the conformance case `peer_shutdown_mid_transfer` on this crate's 2-core test
///   VM (`UCX_TLS=tcp,self`; 1 of 40 on 1.23). No setting tried (one lane per peer
///   among them) avoided it.
///
/// No UCX setting avoids either; `UCX_TLS` (or `TLS` in [`UcxOptions::ucx_config`])
/// without `tcp`, such as `shm,self` for peers on one host, rules both out. The
/// backend logs this once, as a warning, when it binds a UCX with tcp allowed.
///
/// # Errors
/// As [`probe`].
pub fn teardown_abort_risk(options: &UcxOptions) -> Result<Option<String>> {
    let report = probe(options)?;
    Ok(abort_risk(&report, options))
}

/// The transports UCX may use: the last `TLS` of `config` (applied over the
/// environment), else `UCX_TLS`; `None` when neither says (UCX's `all`).
fn tls_setting(config: &[(String, String)]) -> Option<String> {
    (config.iter().rev())
        .find(|(k, _)| k == "TLS")
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var("UCX_TLS").ok())
}

fn abort_risk(report: &UcxLibraryReport, options: &UcxOptions) -> Option<String> {
    let v = report.version.as_deref().unwrap_or("");
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let tls = tls_setting(&options.ucx_config).unwrap_or_else(|| "all".to_owned());
    let allows_tcp = match tls.strip_prefix('^') {
        // An exclusion list: tcp stays unless excluded.
        Some(excluded) => !excluded.split(',').any(|t| t.trim() == "tcp"),
        None => tls.split(',').any(|t| matches!(t.trim(), "all" | "tcp")),
    };
    allows_tcp.then(|| {
        if (major, minor) < (1, 14) {
            format!(
                "UCX {v} with the tcp transport allowed (UCX_TLS={tls}): UCX < 1.14 aborts the process on an assertion (\"got REP message\") when a peer goes away during the tcp connection handshake; use UCX >= 1.14, or UCX_TLS without tcp (e.g. shm,self) for peers on one host"
            )
        } else {
            format!(
                "UCX {v} with the tcp transport allowed (UCX_TLS={tls}): UCX's tcp transport can handle an event of an endpoint it already freed when a peer goes away mid-transfer (SIGSEGV in uct_tcp_iface_handle_events; seen on UCX 1.22 and 1.23); for peers on one host use UCX_TLS=shm,self, across hosts an RDMA transport or nixl-tcp"
            )
        }
    })
}

/// Load libucp as `options` say and report what was bound, without creating a UCX
/// context. The library stays loaded (UCX is never unloaded).
///
/// # Errors
/// [`ErrorKind::UnavailableLibrary`] when it cannot be loaded or is too old;
/// [`ErrorKind::Mismatch`] when the expectation or strict mode is not met, or another
/// libucp is already bound by this crate in the process.
pub fn probe(options: &UcxOptions) -> Result<UcxLibraryReport> {
    let (req, src) = options.request();
    library::bind(&req, src, &options.expectations()).map(|(_, r)| r)
}

#[derive(Debug)]
struct Started {
    cancel: CancellationToken,
    /// [`UcxOptions::secret`], or else the agent's.
    secret: Option<nixl::SharedSecret>,
}

#[derive(Debug)]
struct Inner {
    options: UcxOptions,
    report: UcxLibraryReport,
    address: Bytes,
    cuda: bool,
    shared: Arc<Shared>,
    started: Attachment<Started>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(s) = self.started.try_get() {
            s.cancel.cancel();
        }
        // Requests may keep the driver's state alive; UCX itself goes now (or as soon
        // as the driver's teardown finishes).
        let mut parked = self.shared.parked.lock().unwrap();
        parked.destroyed = true;
        let ucx = parked.ucx.take();
        drop(parked);
        drop(ucx);
    }
}

/// The UCX backend. Attach it to an agent with
/// [`AgentBuilder::backend`](nixl::AgentBuilder::backend).
#[derive(Debug, Clone)]
pub struct UcxBackend {
    inner: Arc<Inner>,
}

impl UcxBackend {
    /// Load UCX (as the environment says) and create a context and a worker.
    ///
    /// # Errors
    /// As [`UcxBackend::with_options`].
    pub fn new() -> Result<Self> {
        Self::with_options(UcxOptions::default())
    }

    /// Load UCX and create a context and a worker.
    ///
    /// UCX's settings come from its `UCX_*` environment variables and
    /// [`UcxOptions::ucx_config`], over two defaults of nixl-ucx: no rendezvous
    /// (`RNDV_THRESH=inf`) and, where the bound UCX has the `cuda_ipc` transport (its
    /// module loaded and sees a GPU) and `UCX_TLS` allows it, one-sided gets over
    /// CUDA IPC (`CUDA_IPC_ENABLE_GET_ZCOPY=y`; UCX turns them off without NVLink, and
    /// READs of GPU memory on one host then run hundreds of times slower). Elsewhere
    /// the key is not given at all (UCX 1.13 would warn about it at every worker
    /// creation). Either is left alone when the environment or the options set it;
    /// [`UcxBackend::library_report`]'s notes say whether `cuda_ipc` is present.
    ///
    /// # Errors
    /// [`ErrorKind::UnavailableLibrary`] when libucp cannot be loaded (the message
    /// names the library and how to get it); [`ErrorKind::Mismatch`] when
    /// [`UcxOptions::expect`] or strict mode is not met; [`ErrorKind::Backend`] when
    /// UCX fails to initialise.
    pub fn with_options(options: UcxOptions) -> Result<Self> {
        const OP: &str = "create ucx backend";
        let (req, src) = options.request();
        let (lib, report) = library::bind(&req, src, &options.expectations())?;
        let mut init = UcxInit {
            config: options.ucx_config.clone(),
            optional: Vec::new(),
        };
        // We send eager active messages only, so rendezvous is never used; and with
        // it enabled, UCX 1.14+ gives peer-failure endpoints no RMA lane on memory
        // it cannot invalidate (CMA), falling back to emulating put/get with active
        // messages the target must serve.
        let user_rndv = std::env::var_os("UCX_RNDV_THRESH").is_some()
            || init.config.iter().any(|(k, _)| k == "RNDV_THRESH");
        if !user_rndv {
            init.config.push(("RNDV_THRESH".into(), "inf".into()));
        }
        // UCX turns cuda_ipc's one-sided get off when it finds no NVLink (one GPU, or
        // GPUs on PCIe), and READs of GPU memory on one host then crawl through
        // staged copies (0.5 GB/s instead of 1.5 TB/s at 64 MiB on an H200, NIXL
        // 1.5.1 and nixl-ucx alike). The get is a device copy like the put: on.
        let cuda_ipc = lib.has_transport("cuda_ipc");
        // Only where the bound UCX has the cuda_ipc transport, with a GPU, and the
        // transports allowed include it: UCX 1.13 takes the key whether or not a
        // transport reads it, and warns at every worker creation about one nothing
        // read (`UCX WARN invalid configuration`), as Debian's 1.13 (no CUDA) did.
        if std::env::var_os(ENV_UCX_CUDA_IPC_GET).is_none()
            && !init.config.iter().any(|(k, _)| k == CUDA_IPC_GET)
        {
            let tls = tls_setting(&init.config);
            match cuda_ipc {
                Some(true) if tls.as_deref().is_none_or(tls_may_include_cuda_ipc) => {
                    init.optional.push((CUDA_IPC_GET.into(), "y".into()));
                }
                // libuct cannot be asked: as before (UCX 1.14 and later refuse the
                // key of a transport that is not loaded, and `optional` skips it).
                None => init.optional.push((CUDA_IPC_GET.into(), "y".into())),
                Some(_) => {
                    tracing::debug!("ucx: no cuda_ipc transport here (or not allowed by UCX_TLS); {CUDA_IPC_GET} left unset");
                }
            }
        }
        if let Some(why) = abort_risk(&report, &options) {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| tracing::warn!("{why}"));
        }
        if let Some(k) = options.keepalive_interval {
            init.config.push((
                "KEEPALIVE_INTERVAL".into(),
                format!("{}ms", k.as_millis().max(1)),
            ));
        }
        let mut ucx = Ucx::new(lib, &init).map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                OP,
                format!("UCX {} failed to initialise", report.version_string()),
            )
            .with_source(e)
        })?;
        ucx.teardown_bound = options.teardown_bound;
        let address = Bytes::copy_from_slice(ucx.address());
        let cuda = ucx.cuda_supported();
        let mut report = report;
        report.notes.push(
            match cuda_ipc {
                Some(true) => "cuda_ipc transport: present (its module loaded and sees a GPU)",
                Some(false) => "cuda_ipc transport: absent (no module, or no GPU)",
                None => "cuda_ipc transport: unknown (libuct's component query is missing)",
            }
            .to_owned(),
        );
        // (UCX 1.13 takes any key; the note needs its CUDA transports too.)
        if cuda && ucx.optional_applied.iter().any(|k| k == CUDA_IPC_GET) {
            report.notes.push(format!(
                "cuda_ipc one-sided READs: on ({CUDA_IPC_GET}=y, nixl-ucx's default; {ENV_UCX_CUDA_IPC_GET} or UcxOptions::ucx_config overrides it)"
            ));
        }
        report.notes.push(if cuda {
            "CUDA memory: supported (the cuda_copy transport loaded and sees a GPU)".to_owned()
        } else {
            "CUDA memory: not supported by this UCX here (no cuda_copy transport, or no GPU)"
                .to_owned()
        });
        let (tx, rx) = mpsc::channel();
        let liveness = options.dead_peer_timeout.map(Liveness::within);
        let mut core = Core::new(ucx, rx, options.max_notification, liveness)
            .map_err(|e| Error::new(ErrorKind::Backend, OP, "UCX setup failed").with_source(e))?;
        core.ucx_version = report.version_string();
        core.peer_error_handling = options.peer_error_handling;
        let wake = match options.progress {
            ProgressMode::Task => Wake::Task(tokio::sync::Notify::new()),
            ProgressMode::Thread => Wake::Thread {
                fd: ffi::WakeFd::new().map_err(|e| {
                    Error::new(ErrorKind::Backend, OP, "cannot create an eventfd").with_source(e)
                })?,
                sleeping: AtomicBool::new(false),
            },
        };
        let shared = Arc::new(Shared {
            core: Mutex::new(Some(core)),
            parked: Mutex::new(driver::Parked::default()),
            tx,
            wake,
            stopped: AtomicBool::new(false),
            stopped_notify: tokio::sync::Notify::new(),
            spin: options.spin,
            bye_bound: options.teardown_bound,
            inline: options.post_inline,
        });
        Ok(Self {
            inner: Arc::new(Inner {
                options,
                report,
                address,
                cuda,
                shared,
                started: Attachment::new("ucx"),
            }),
        })
    }

    /// Which UCX was loaded, from where, and whether it is one installation.
    pub fn library_report(&self) -> &UcxLibraryReport {
        &self.inner.report
    }

    /// Allocate `len` bytes of host memory through UCX, zero-filled, to register with
    /// an agent (`agent.register(backend.alloc(len)?)`; [`nixl::Agent::alloc`] gives
    /// the same when this backend is the first attached that offers memory).
    ///
    /// UCX places it in shared memory (SysV or POSIX, by `UCX_ALLOC_PRIO`), which a
    /// peer on the same host maps directly: a WRITE into it, or a READ from it, is then
    /// a plain copy by the initiator (no system call, no help from this process), the
    /// fastest path UCX has between processes, and the one `ucx_perftest` measures.
    /// Ordinary memory (`Vec<u8>`, [`nixl::AlignedBuf`]) is reached through CMA
    /// (`process_vm_writev`, one system call per segment) on UCX 1.14 and later, or
    /// through active messages the target's driver must serve on 1.13 (see the crate
    /// docs). Over the network it makes no difference.
    ///
    /// The memory stays valid for as long as the returned value, or any registration
    /// made from it, lives, even after the backend shut down. Registering it with
    /// another backend (nixl-tcp) works as for any memory.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroLength`] for `len == 0`; [`ErrorKind::ShutDown`] after
    /// shutdown; [`ErrorKind::Backend`] when UCX cannot allocate it.
    pub fn alloc(&self, len: usize) -> Result<nixl::Memory> {
        const OP: &str = "ucx alloc";
        if len == 0 {
            return Err(Error::new(
                ErrorKind::ZeroLength,
                OP,
                "cannot allocate zero bytes",
            ));
        }
        let a = self.with_core(OP, |core| {
            core.ucx.alloc(len).map_err(|e| {
                Error::new(
                    ErrorKind::Backend,
                    OP,
                    format!("UCX could not allocate {len} bytes"),
                )
                .with_source(e)
            })
        })?;
        ffi::allocation_memory(a)
    }

    /// Whether the bound UCX reports CUDA memory support. VRAM registration is still
    /// refused (see the crate docs).
    pub fn cuda_supported(&self) -> bool {
        self.inner.cuda
    }

    fn started(&self, op: &'static str) -> Result<&Started> {
        self.inner.started.get(op)
    }

    /// Refuse to talk to NIXL agents (`what`: which, or what for) when this agent has
    /// a shared secret.
    fn nixl_allowed(&self, what: &str) -> Result<()> {
        let secret = match self.inner.started.try_get() {
            Some(s) => s.secret.is_some(),
            None => self.inner.options.secret.is_some(),
        };
        if secret {
            return Err(driver::nixl_refused(what));
        }
        Ok(())
    }

    /// A link to `peer` at worker address `address` (checked): a new connection in the
    /// driver, named by its epoch.
    fn new_link(
        &self,
        op: &'static str,
        peer: &str,
        address: &[u8],
        nixl: bool,
    ) -> Result<Arc<dyn PeerLink>> {
        let epoch = self.with_core(op, |core| Ok(core.add_peer(peer, address, nixl)))?;
        Ok(Arc::new(UcxLink {
            backend: self.clone(),
            peer: Arc::from(peer),
            epoch,
        }))
    }

    fn with_core<T>(&self, op: &'static str, f: impl FnOnce(&mut Core) -> Result<T>) -> Result<T> {
        let mut g = self.inner.shared.core.lock().unwrap();
        match g.as_mut() {
            Some(core) => f(core),
            None => Err(Error::new(
                ErrorKind::ShutDown,
                op,
                "the ucx backend has shut down",
            )),
        }
    }
}

#[async_trait]
impl Backend for UcxBackend {
    fn name(&self) -> &str {
        "ucx"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            vram: self.inner.cuda,
            ..Capabilities::between_agents(self.inner.options.max_notification)
        }
    }

    async fn start(&self, ctx: BackendContext) -> Result<()> {
        const OP: &str = "start ucx backend";
        let cancel = ctx.cancel.child_token();
        let secret = self.inner.options.secret.clone().or(ctx.secret.clone());
        let started = Started {
            cancel: cancel.clone(),
            secret: secret.clone(),
        };
        self.inner.started.attach(OP, async { Ok(started) }).await?;
        self.with_core(OP, |core| {
            core.attach(driver::Identity {
                agent: ctx.agent_name.clone(),
                secret,
            });
            core.sink = Some(ctx.notifications.clone());
            // Reads make room for held notifications: wake the driver then.
            let holding = core.backlogs.holding.clone();
            let shared = Arc::downgrade(&self.inner.shared);
            ctx.notifications.on_room(move || {
                if holding.load(std::sync::atomic::Ordering::Acquire) {
                    if let Some(s) = shared.upgrade() {
                        s.wake_driver();
                    }
                }
            });
            Ok(())
        })?;
        let shared = self.inner.shared.clone();
        match self.inner.options.progress {
            ProgressMode::Task => {
                ctx.tracker.spawn(driver::run_task(shared, cancel));
            }
            ProgressMode::Thread => {
                let waker = shared.clone();
                ctx.spawn_thread(
                    "nixl-ucx-progress",
                    move |stop| driver::run_thread(shared, stop),
                    move || {
                        if let Wake::Thread { fd, .. } = &waker.wake {
                            fd.wake();
                        }
                    },
                )
                .map_err(|e| {
                    Error::new(ErrorKind::Backend, OP, "cannot start the progress thread")
                        .with_source(e)
                })?;
            }
        }
        tracing::debug!(agent = %ctx.agent_name, report = %self.inner.report, "ucx backend started");
        Ok(())
    }

    fn connection_info(&self) -> Bytes {
        self.inner.address.clone()
    }

    fn unsupported_reason(&self, kind: MemKind) -> Option<String> {
        match kind {
            MemKind::Vram { .. } if !self.inner.cuda => Some(format!(
                "the bound UCX ({}) has no CUDA support (its cuda_copy transport did not load, or no GPU is visible to it); Debian's UCX has none, the PyPI wheel libucx-cu12 has (NIXL_UCX_LIB)",
                self.inner.report.version_string()
            )),
            _ => None,
        }
    }

    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        const OP: &str = "ucx register";
        if let MemKind::Vram { device } = region.kind() {
            if let Some(why) = self.unsupported_reason(region.kind()) {
                return Err(Error::new(
                    ErrorKind::NotSupported,
                    OP,
                    format!("VRAM on device {device}: {why}"),
                ));
            }
            // ucp_mem_map queries the pointer in the context current on this thread;
            // the thread's own context comes back afterwards.
            let seg = region.segment();
            return nixl::gpu::with_context(device, || {
                self.with_core(OP, |core| {
                if core.gpu.is_some_and(|d| d != device) {
                    tracing::warn!(first = ?core.gpu, device, "ucx: GPU memory of a second device; UCX before 1.19 copies it in the first device's context");
                }
                core.gpu.get_or_insert(device);
                let packed = core.ucx.mem_map(region, true).map_err(|e| {
                    Error::new(
                        ErrorKind::Backend,
                        OP,
                        format!("mapping {} bytes of VRAM on device {device} failed", seg.len()),
                    )
                    .with_source(e)
                })?;
                Ok(wire::encode_blob(seg.addr(), seg.len() as u64, &packed))
            })
            });
        }
        let seg = region.segment();
        self.with_core(OP, |core| {
            let packed = core.ucx.mem_map(region, false).map_err(|e| {
                Error::new(
                    ErrorKind::Backend,
                    OP,
                    format!("mapping {} bytes failed", seg.len()),
                )
                .with_source(e)
            })?;
            Ok(wire::encode_blob(seg.addr(), seg.len() as u64, &packed))
        })
    }

    fn data_path(&self, peer: &str) -> Option<String> {
        let version = self
            .inner
            .report
            .version
            .as_deref()
            .unwrap_or("(version unknown)");
        let tls = tls_setting(&self.inner.options.ucx_config).unwrap_or_else(|| "all".to_owned());
        let state = self
            .with_core("ucx data path", |core| Ok(core.connection_state(peer)))
            .ok()?;
        Some(format!(
            "UCX {version} RMA (one put or get per segment, then a flush), transports UCX_TLS={tls}{state}"
        ))
    }

    fn alloc(&self, len: usize) -> Option<Result<nixl::Memory>> {
        Some(Self::alloc(self, len))
    }

    fn deregister(&self, region_id: u64) -> Result<()> {
        // Unmapping revokes the region's key only on transports that check keys in
        // hardware; see the crate docs, "Deregistration".
        // While running, the driver's UCX; after shutdown, the parked one (the agent
        // deregisters between closing connections and destroying the context); after
        // destroy, nothing is left to unmap.
        let mut core = self.inner.shared.core.lock().unwrap();
        if let Some(core) = core.as_mut() {
            core.ucx.mem_unmap(region_id);
            return Ok(());
        }
        drop(core);
        if let Some(ucx) = self.inner.shared.parked.lock().unwrap().ucx.as_mut() {
            ucx.mem_unmap(region_id);
        }
        Ok(())
    }

    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        // Checked before UCX parses it (see the `packed` module).
        packed::check_address(conn_info).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                "ucx link",
                format!("peer {peer:?}: malformed worker address: {e}"),
            )
        })?;
        self.new_link("ucx link", peer, conn_info, false)
    }

    fn nixl(&self) -> Option<&dyn NixlDialect> {
        Some(self)
    }

    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        const OP: &str = "ucx prepare";
        self.started(OP)?;
        let write = plan.op == Op::Write;
        let Some(peer) = plan.peer else {
            return Err(Error::new(
                ErrorKind::NotSupported,
                OP,
                "the ucx backend serves transfers between agents only (the agent copies between its own DRAM regions)",
            ));
        };
        let link = nixl::kit::link_of::<UcxLink>(&peer.link, OP)?;
        let (peer, epoch) = (link.peer.clone(), link.epoch);
        let plan_segs = &plan.segments;
        let mut segs = Vec::with_capacity(plan_segs.runs().len());
        self.with_core(OP, |core| {
            // Each target registration's blob is decoded and its key unpacked once.
            let mut keys = Vec::with_capacity(plan_segs.targets().len());
            for t in plan_segs.targets() {
                let TargetRegion::Remote {
                    region,
                    addr,
                    blob,
                    ..
                } = t
                else {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        OP,
                        "remote transfer with a local target",
                    ));
                };
                let Some(b) = wire::decode_blob(blob) else {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        OP,
                        format!("peer {peer:?} region {region}: malformed ucx blob"),
                    ));
                };
                let rkey = core.rkey(&peer, epoch, *region, blob, b.rkey)?;
                keys.push((*region, *addr, b, rkey));
            }
            for s in plan_segs.runs() {
                let (region, base, b, rkey) = &keys[s.target as usize];
                let addr = base + s.target_offset;
                // The agent checked this against the peer's advertised region; the
                // blob's own bounds are a second, independent check, of the run's
                // first and last segment (segments ascend).
                let end = (s.count as u64 - 1)
                    .checked_mul(s.target_stride)
                    .and_then(|o| o.checked_add(addr))
                    .and_then(|last| last.checked_add(s.len));
                if addr < b.base || end.is_none_or(|e| e > b.base.saturating_add(b.len)) {
                    return Err(Error::new(
                        ErrorKind::OutOfRange,
                        OP,
                        format!(
                            "peer {peer:?} region {region}: {} segments of {addr:#x}+{} every {} bytes are outside the mapped range",
                            s.count, s.len, s.target_stride
                        ),
                    ));
                }
                let region = &plan_segs.locals()[s.local as usize];
                let local = region
                    .segment()
                    .slice(s.local_offset as usize, s.len as usize)
                    .expect("the agent checked every segment");
                segs.push(RmaSeg {
                    max_piece: ffi::piece_limit(region.kind()),
                    local,
                    remote: addr,
                    local_stride: s.local_stride as usize,
                    remote_stride: s.target_stride,
                    count: s.count,
                    rkey: *rkey,
                });
            }
            Ok(())
        })?;
        Ok(Box::new(RemotePrepared {
            shared: self.inner.shared.clone(),
            xfer: Arc::new(RemoteXfer {
                peer,
                epoch,
                write,
                segs,
            }),
        }))
    }

    async fn shutdown(&self, timeout: Duration) -> Result<()> {
        match self.inner.started.try_get() {
            Some(s) => {
                s.cancel.cancel();
                if tokio::time::timeout(timeout, self.inner.shared.wait_stopped())
                    .await
                    .is_err()
                {
                    return Err(Error::new(
                        ErrorKind::TimedOut,
                        "ucx shutdown",
                        format!("the progress driver did not stop within {timeout:?}"),
                    ));
                }
            }
            None => driver::teardown(&self.inner.shared),
        }
        Ok(())
    }

    fn destroy(&self) -> Result<()> {
        // Memory was deregistered; now the worker and (unless allocations still hold
        // it) the context.
        let mut parked = self.inner.shared.parked.lock().unwrap();
        parked.destroyed = true;
        let ucx = parked.ucx.take();
        drop(parked);
        drop(ucx);
        Ok(())
    }
}

/// NIXL's UCX backend: the same worker address as connection info, the packed remote
/// key alone as a registration's blob, and NIXL's notifications (see the crate docs,
/// "NIXL agents").
impl NixlDialect for UcxBackend {
    fn backend_type(&self) -> &str {
        nixl::interop::BACKEND_UCX
    }

    fn export_blob(&self, blob: &[u8]) -> Result<Vec<u8>> {
        // What NIXL agents would load to reach us; they could not talk to us.
        self.nixl_allowed("metadata in NIXL's format")?;
        wire::decode_blob(blob)
            .map(|b| b.rkey.to_vec())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    "ucx NIXL metadata",
                    "not a blob of this backend",
                )
            })
    }

    fn import_blob(&self, addr: u64, len: u64, blob: &[u8]) -> Result<Bytes> {
        packed::check_rkey(blob).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                "ucx load NIXL metadata",
                format!("descriptor {addr:#x}+{len}: malformed packed remote key: {e}"),
            )
        })?;
        Ok(wire::encode_blob(addr, len, blob))
    }

    fn link(&self, peer: &str, conn_info: &[u8], nixl_rs: bool) -> Result<Arc<dyn PeerLink>> {
        self.nixl_allowed(&format!("NIXL agent {peer:?}"))?;
        packed::check_address(conn_info).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                "ucx link NIXL peer",
                format!("NIXL agent {peer:?}: malformed worker address: {e}"),
            )
        })?;
        // An agent of this crate in NIXL's format speaks our protocol (ordered
        // notifications with back-pressure, liveness); a NIXL agent, NIXL's.
        self.new_link("ucx link NIXL peer", peer, conn_info, !nixl_rs)
    }
}

/// nixl-ucx's link to a peer: the driver's connection of this epoch. Transfers are
/// prepared against it (their commands carry the epoch); notifications and connects
/// go to the peer's current connection.
#[derive(Debug)]
struct UcxLink {
    backend: UcxBackend,
    peer: Arc<str>,
    epoch: u64,
}

#[async_trait]
impl PeerLink for UcxLink {
    async fn connect(&self) -> Result<()> {
        const OP: &str = "ucx connect";
        self.backend.started(OP)?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.backend.inner.shared.submit(Cmd::Connect {
            peer: self.peer.to_string(),
            epoch: self.epoch,
            tx,
        });
        rx.await.unwrap_or_else(|_| {
            Err(Error::new(
                ErrorKind::ShutDown,
                OP,
                "the ucx backend stopped",
            ))
        })
    }

    fn notify(&self, msg: Bytes, done: Completer) {
        if let Err(e) = self.backend.started("ucx notify") {
            return done.complete(Err(e));
        }
        self.backend.inner.shared.submit(Cmd::Notify {
            peer: self.peer.to_string(),
            epoch: self.epoch,
            msg,
            done,
        });
    }

    fn failed(&self) -> bool {
        // A failed connection stays failed (its peer is gone, or did not answer the
        // liveness probe): a load of the peer's metadata makes a new one.
        match self.backend.inner.shared.core.lock().unwrap().as_ref() {
            Some(core) => core.link_failed(&self.peer, self.epoch),
            None => true,
        }
    }

    fn close(&self, why: &str) {
        // After shutdown every connection is closed already.
        if let Some(core) = self.backend.inner.shared.core.lock().unwrap().as_mut() {
            core.close_link(&self.peer, self.epoch, why);
        }
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// A transfer to a peer: keys resolved, segments listed; posting enqueues one command.
#[derive(Debug)]
struct RemotePrepared {
    shared: Arc<Shared>,
    xfer: Arc<RemoteXfer>,
}

impl PreparedTransfer for RemotePrepared {
    fn post(&self, notif: Option<Bytes>, done: Completer) {
        // The agent refused notifications over `max_notification` already.
        self.shared.submit(Cmd::Transfer {
            xfer: self.xfer.clone(),
            notif,
            done,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::tls_may_include_cuda_ipc as may;

    #[test]
    fn cuda_ipc_allowed_by_tls() {
        for yes in [
            "all",
            "cuda",
            "cuda_ipc",
            "shm,cuda",
            "tcp, cuda_ipc:aux",
            "^tcp",
            "^",
        ] {
            assert!(may(yes), "{yes}");
        }
        for no in [
            "shm,self",
            "sm",
            "tcp",
            "cuda_copy",
            "^cuda",
            "^tcp,cuda_ipc",
            "^all",
        ] {
            assert!(!may(no), "{no}");
        }
    }
}
