//! Command line: nixlbench's parameter names (dashes, with the underscore spellings as
//! aliases), value parsers, presets, and the checked [`Config`] the rest of the bench runs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use nixl::Op;
use serde::{Deserialize, Serialize, Serializer};

use crate::error::{fail, BenchError, Result};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Blocks larger than this run `num_iter / large_blk_iter_ftr` iterations (nixlbench's
/// `LARGE_BLOCK_SIZE`).
pub(crate) const LARGE_BLOCK_SIZE: u64 = MIB;

const AFTER_HELP: &str = "\
With no arguments: a quick sweep of WRITEs from this process to a target agent in a child
process, over the embedded tcp backend on loopback: block sizes 4 KiB to 64 MiB, batch 1,
512 iterations and 64 warmup per point (1/16 of that above 1 MiB). `--full` switches to
nixlbench's defaults (1000 iterations, 100 warmup, 8 GiB buffers); explicit flags override
either.

Sizes take binary suffixes: 4K, 64M, 1G (also KiB, MiB, GiB). Durations: 500ms, 30s, 2m.
Bandwidth is in GB/s with GB = 10^9 bytes; times are in microseconds.

Two hosts:
  host A: nixl-bench --role target --listen 0.0.0.0:5555
  host B: nixl-bench --role initiator --peer A:5555 [sweep flags]

Two hosts that find each other through etcd (nixlbench's ETCD runtime; a build with
`--features etcd`), E being any etcd both reach:
  host A: nixl-bench --etcd-endpoints http://E:2379 --benchmark-group g1
  host B: nixl-bench --etcd-endpoints http://E:2379 --benchmark-group g1 [sweep flags]
(the group's first process is the target, the next the initiator; --role picks one)";

/// Benchmark nixl transfers between two agents (nixlbench's counterpart).
#[derive(Debug, Parser)]
#[command(name = "nixl-bench", version, about, after_help = AFTER_HELP)]
pub(crate) struct Cli {
    /// `local`: run the target as a child process on this machine and measure from here.
    /// `target`/`initiator`: one side each, on two hosts (see --listen and --peer, or
    /// --etcd-endpoints).
    /// [default: local; with --etcd-endpoints: the first process of the benchmark group
    /// is the target, the next the initiator]
    #[arg(long, value_enum)]
    pub(crate) role: Option<Role>,

    /// Target's address (HOST:PORT of its --listen), for --role initiator.
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) peer: Option<String>,

    /// What the target is: `nixl-rs` (a nixl-bench target), or `nixl`: an agent of
    /// NVIDIA's NIXL whose listener (`enable_listen_thread`) is at --peer. The
    /// initiator fetches its metadata through NIXL's listener protocol and transfers
    /// to and from its largest DRAM registration (at least --total-buffer-size bytes).
    /// Needs --role initiator --backend ucx, bound to the UCX the NIXL agent uses
    /// (NIXL_UCX_LIB); --check-consistency is not available (a NIXL agent has no
    /// nixl-bench control channel).
    #[arg(long = "peer-kind", value_enum, default_value_t = PeerKind::NixlRs)]
    pub(crate) peer_kind: PeerKind,

    /// Where the target waits for the initiator (--role target); the bound address is
    /// printed on stdout [default: 127.0.0.1:0; with --etcd-endpoints: 0.0.0.0:0,
    /// advertising the address this host reaches etcd from (give an IP here to advertise
    /// that one instead)].
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: Option<SocketAddr>,

    /// Find the peer through etcd (comma-separated client URLs, e.g.
    /// http://10.0.0.1:2379): the target publishes its metadata and control address
    /// there, the initiator waits for them. Needs a build with `--features etcd`.
    #[arg(long = "etcd-endpoints", alias = "etcd_endpoints", value_name = "URLS")]
    pub(crate) etcd_endpoints: Option<String>,

    /// Which target an initiator pairs with in etcd: one target per group at a time
    /// [default: default].
    #[arg(
        long = "benchmark-group",
        alias = "benchmark_group",
        value_name = "NAME"
    )]
    pub(crate) benchmark_group: Option<String>,

    /// etcd over TLS: the CA (PEM file) etcd's certificate must chain to (use
    /// https:// endpoints).
    #[arg(long = "etcd-ca", value_name = "FILE")]
    pub(crate) etcd_ca: Option<PathBuf>,

    /// Client certificate (PEM file) for an etcd that requires one; with --etcd-key.
    #[arg(long = "etcd-cert", value_name = "FILE", requires = "etcd_key")]
    pub(crate) etcd_cert: Option<PathBuf>,

    /// The client certificate's private key (PEM file).
    #[arg(long = "etcd-key", value_name = "FILE", requires = "etcd_cert")]
    pub(crate) etcd_key: Option<PathBuf>,

    /// etcd user for user/password authentication; the password comes from the
    /// NIXL_ETCD_PASSWORD environment variable (not the command line, where other
    /// users of the host could read it).
    #[arg(long = "etcd-user", value_name = "USER")]
    pub(crate) etcd_user: Option<String>,

    /// Internal: serve as the target over the Unix socket at PATH (set when the bench
    /// starts its own child; see `child.rs`).
    #[arg(long = "control-socket", value_name = "PATH", hide = true)]
    pub(crate) control_socket: Option<PathBuf>,

    /// Transport: tcp (built in), verbs (built in; needs an RDMA device), ucx (feature
    /// `ucx`) or uccl (feature `uccl`); or posix (built in): storage mode, one agent
    /// moving between its memory and files in --filepath.
    #[arg(long, default_value = "tcp")]
    pub(crate) backend: String,

    /// Backend parameter KEY=VALUE (repeatable). tcp: listen, advertise,
    /// connect_timeout, dead_peer_timeout, max_notification, same_host
    /// (auto|off|require), inline_copy_max, connections, stripe_min, copy_threads,
    /// split_copy_min. posix: engine (auto|uring|pool), threads, durability
    /// (none|data|full), inline_max.
    #[arg(
        long = "backend-param",
        alias = "backend_param",
        value_name = "KEY=VALUE",
        value_parser = parse_backend_param
    )]
    pub(crate) backend_params: Vec<(String, String)>,

    /// READ or WRITE (case-insensitive); a comma-separated list runs one sweep each.
    #[arg(
        long = "op-type",
        alias = "op_type",
        value_name = "OP",
        value_delimiter = ',',
        default_value = "WRITE",
        value_parser = parse_op
    )]
    pub(crate) op_type: Vec<Op>,

    /// Initiator memory: DRAM, or VRAM (GPU memory on --device-id, through the CUDA
    /// driver; tcp stages it through host memory, ucx needs a UCX with CUDA support).
    #[arg(long = "initiator-seg-type", alias = "initiator_seg_type", value_enum, ignore_case = true, default_value_t = SegType::Dram)]
    pub(crate) initiator_seg_type: SegType,

    /// Target memory: DRAM or VRAM (as --initiator-seg-type).
    #[arg(long = "target-seg-type", alias = "target_seg_type", value_enum, ignore_case = true, default_value_t = SegType::Dram)]
    pub(crate) target_seg_type: SegType,

    /// The GPU (CUDA device ordinal) of VRAM buffers, on each side.
    #[arg(long = "device-id", alias = "device_id", default_value_t = 0)]
    pub(crate) device_id: u32,

    /// First block size [default: 4K].
    #[arg(long = "start-block-size", alias = "start_block_size", value_name = "SIZE", value_parser = parse_size)]
    pub(crate) start_block_size: Option<u64>,

    /// Largest block size; the sweep doubles up to it [default: 64M].
    #[arg(long = "max-block-size", alias = "max_block_size", value_name = "SIZE", value_parser = parse_size)]
    pub(crate) max_block_size: Option<u64>,

    /// First batch size (descriptors per request) [default: 1].
    #[arg(
        long = "start-batch-size",
        alias = "start_batch_size",
        value_name = "N"
    )]
    pub(crate) start_batch_size: Option<usize>,

    /// Largest batch size; the sweep doubles up to it [default: 1].
    #[arg(long = "max-batch-size", alias = "max_batch_size", value_name = "N")]
    pub(crate) max_batch_size: Option<usize>,

    /// Measured iterations per sweep point, across all threads [default: 512; --full: 1000].
    #[arg(long = "num-iter", alias = "num_iter", value_name = "N")]
    pub(crate) num_iter: Option<usize>,

    /// Warmup iterations before each measurement [default: 64; --full: 100].
    #[arg(long = "warmup-iter", alias = "warmup_iter", value_name = "N")]
    pub(crate) warmup_iter: Option<usize>,

    /// Blocks above 1 MiB run num_iter / this many iterations (and warmup likewise)
    /// [default: 16].
    #[arg(
        long = "large-blk-iter-ftr",
        alias = "large_blk_iter_ftr",
        value_name = "N"
    )]
    pub(crate) large_blk_iter_ftr: Option<usize>,

    /// Initiator tasks, each with its own part of the buffer and its own requests.
    #[arg(
        long = "num-threads",
        alias = "num_threads",
        value_name = "N",
        default_value_t = 1
    )]
    pub(crate) num_threads: usize,

    /// Requests in flight per task.
    #[arg(
        long = "pipeline-depth",
        alias = "pipeline_depth",
        value_name = "N",
        default_value_t = 1
    )]
    pub(crate) pipeline_depth: usize,

    /// Create a new request for every iteration instead of reposting prepared ones.
    #[arg(long = "recreate-xfer", alias = "recreate_xfer", num_args = 0..=1, default_missing_value = "true", default_value = "false", value_parser = parse_bool, value_name = "BOOL")]
    pub(crate) recreate_xfer: bool,

    /// Storage (`--backend posix`): the directory of the files the benchmark reads and
    /// writes, `nixl-bench-<i>.dat` (created and sized as needed).
    #[arg(long, alias = "filepath", value_name = "DIR")]
    pub(crate) filepath: Option<PathBuf>,

    /// Storage: how many files; descriptor j of a batch goes to file j % N at offset
    /// (j / N) x block size (1: one large file; the batch size: a file per block).
    #[arg(
        long = "num-files",
        alias = "num_files",
        value_name = "N",
        default_value_t = 1
    )]
    pub(crate) num_files: usize,

    /// Storage: open the files with O_DIRECT (the buffer is page-aligned).
    #[arg(long = "storage-enable-direct", alias = "storage_enable_direct", num_args = 0..=1, default_missing_value = "true", default_value = "false", value_parser = parse_bool, value_name = "BOOL")]
    pub(crate) storage_enable_direct: bool,

    /// Fill a pattern and verify every byte that arrived after each sweep point.
    #[arg(long = "check-consistency", alias = "check_consistency", num_args = 0..=1, default_missing_value = "true", default_value = "false", value_parser = parse_bool, value_name = "BOOL")]
    pub(crate) check_consistency: bool,

    /// Where each side's DRAM buffer comes from: `host`, ordinary zeroed memory (as
    /// nixlbench's malloc), or `backend`, memory the backend reaches fastest
    /// (`Agent::alloc`; with ucx, shared memory the peer maps, allocated up front).
    #[arg(long, value_enum, ignore_case = true, default_value_t = MemSource::Host)]
    pub(crate) memory: MemSource,

    /// Host buffers ask for transparent huge pages (`madvise(MADV_HUGEPAGE)`), as the
    /// numpy and PyTorch buffers NIXL's users register do; `false` for ordinary
    /// pages. Both sides follow the initiator's choice.
    #[arg(long = "huge-pages", alias = "huge_pages", num_args = 0..=1, default_missing_value = "true", default_value = "true", value_parser = parse_bool, value_name = "BOOL")]
    pub(crate) huge_pages: bool,

    /// Where a request's blocks lie: `consecutive` (block after block, as nixlbench)
    /// or `scattered` (a block-sized gap after every block, so no two descriptors can
    /// merge: each block is its own segment, as a KV cache's pages are).
    #[arg(long = "descriptor-layout", alias = "descriptor_layout", value_enum, ignore_case = true, default_value_t = DescLayout::Consecutive)]
    pub(crate) descriptor_layout: DescLayout,

    /// Merge contiguous descriptors into one segment, as NIXL (and so nixlbench) does
    /// by default; `--merge-descriptors false` keeps a batch as `batch_size` segments.
    /// Scattered blocks never merge.
    #[arg(long = "merge-descriptors", alias = "merge_descriptors", num_args = 0..=1, default_missing_value = "true", default_value = "true", value_parser = parse_bool, value_name = "BOOL")]
    pub(crate) merge_descriptors: bool,

    /// Before the sweep, measure in this process what the hardware gives without nixl:
    /// single-thread memcpy of each point's bytes, a plain loopback TCP stream, and a
    /// loopback TCP ping-pong; printed after the results.
    #[arg(long)]
    pub(crate) baselines: bool,

    /// Memory each side registers, split evenly between threads
    /// [default: just enough for the sweep; --full: 8G].
    #[arg(long = "total-buffer-size", alias = "total_buffer_size", value_name = "SIZE", value_parser = parse_size)]
    pub(crate) total_buffer_size: Option<u64>,

    /// Use nixlbench's defaults (1000 iterations, 100 warmup, 8 GiB buffers).
    #[arg(long)]
    pub(crate) full: bool,

    /// Print one JSON object instead of the table.
    #[arg(long, conflicts_with = "csv")]
    pub(crate) json: bool,

    /// Print CSV instead of the table.
    #[arg(long)]
    pub(crate) csv: bool,

    /// Also write bandwidth and latency against block size to this SVG file.
    #[arg(long, value_name = "FILE")]
    pub(crate) plot: Option<PathBuf>,

    /// Serve this process's agent metrics for Prometheus at http://ADDR/metrics
    /// during the run (the metric table is in the `nixl::telemetry` docs). Needs the
    /// `prometheus` feature (on by default).
    #[arg(long = "metrics-addr", value_name = "ADDR")]
    pub(crate) metrics_addr: Option<SocketAddr>,

    /// Limit for starting the target and connecting to it, and for a target to appear in
    /// etcd (the target: for the initiator to arrive).
    #[arg(long = "connect-timeout", value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub(crate) connect_timeout: Duration,

    /// Limit for each exchange with the peer (metadata, fills, checks).
    #[arg(long = "exchange-timeout", value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub(crate) exchange_timeout: Duration,

    /// Limit for each request to complete; the target also gives up on an initiator
    /// silent for this long.
    #[arg(long = "xfer-timeout", value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub(crate) xfer_timeout: Duration,

    /// Limit for shutting agents and the child down.
    #[arg(long = "teardown-timeout", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) teardown_timeout: Duration,
}

/// Which side(s) this process plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Role {
    /// Initiator here, target in a child process.
    Local,
    /// Initiator only; the target runs elsewhere (--peer, or found through etcd).
    Initiator,
    /// Target only; waits for an initiator (--listen, and registered in etcd with
    /// --etcd-endpoints).
    Target,
    /// Through etcd without `--role`: the group's first process is the target, the
    /// next one the initiator.
    #[value(skip)]
    Auto,
}

/// What kind of agent the target is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PeerKind {
    /// A nixl-bench target.
    #[value(name = "nixl-rs")]
    NixlRs,
    /// A NIXL agent's listener.
    Nixl,
}

/// Kind of memory each side transfers from or into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub(crate) enum SegType {
    /// Host memory.
    #[value(name = "DRAM")]
    Dram,
    /// GPU memory.
    #[value(name = "VRAM")]
    Vram,
}

/// Where the blocks of a request lie.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum DescLayout {
    /// Block after block.
    #[default]
    Consecutive,
    /// A block-sized gap after every block: nothing can merge.
    Scattered,
}

impl DescLayout {
    /// Distance from one block's start to the next.
    pub(crate) fn spacing(self, block_size: u64) -> u64 {
        match self {
            Self::Consecutive => block_size,
            Self::Scattered => 2 * block_size,
        }
    }
}

/// Where a side's DRAM buffer comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum MemSource {
    /// Ordinary zeroed host memory.
    #[default]
    Host,
    /// `Agent::alloc`: memory the backend reaches fastest (ordinary memory when it
    /// offers none).
    Backend,
}

/// Limits for every phase, so a dead or hung peer ends the run instead of hanging it.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct Timeouts {
    #[serde(serialize_with = "secs")]
    pub(crate) connect: Duration,
    #[serde(serialize_with = "secs")]
    pub(crate) exchange: Duration,
    #[serde(serialize_with = "secs")]
    pub(crate) xfer: Duration,
    #[serde(serialize_with = "secs")]
    pub(crate) teardown: Duration,
}

/// How results are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Table,
    Json,
    Csv,
}

/// The checked sweep parameters; the same on both sides of a run.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Sweep {
    /// `quick` (the default) or `full` (nixlbench's defaults).
    pub(crate) preset: &'static str,
    #[serde(serialize_with = "op_names")]
    pub(crate) op_types: Vec<Op>,
    pub(crate) initiator_seg_type: SegType,
    pub(crate) target_seg_type: SegType,
    /// GPU of VRAM buffers.
    pub(crate) device_id: u32,
    pub(crate) start_block_size: u64,
    pub(crate) max_block_size: u64,
    pub(crate) start_batch_size: usize,
    pub(crate) max_batch_size: usize,
    /// After rounding up to a multiple of `num_threads * large_blk_iter_ftr`.
    pub(crate) num_iter: usize,
    /// After the same rounding.
    pub(crate) warmup_iter: usize,
    pub(crate) large_blk_iter_ftr: usize,
    pub(crate) num_threads: usize,
    pub(crate) pipeline_depth: usize,
    pub(crate) recreate_xfer: bool,
    pub(crate) check_consistency: bool,
    /// Where both sides' buffers come from.
    pub(crate) memory: MemSource,
    /// Whether host buffers ask for transparent huge pages.
    pub(crate) huge_pages: bool,
    pub(crate) descriptor_layout: DescLayout,
    /// Whether contiguous descriptors are merged (off: a batch is `batch_size` blocks).
    pub(crate) merge_descriptors: bool,
    /// Whether the initiator measures the baselines.
    pub(crate) baselines: bool,
    /// Bytes each side registers.
    pub(crate) total_buffer_size: u64,
}

/// One point of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Point {
    pub(crate) op: Op,
    pub(crate) block_size: u64,
    pub(crate) batch_size: usize,
}

impl Sweep {
    /// Every (op, block size, batch size), in run order.
    pub(crate) fn points(&self) -> Vec<Point> {
        let mut out = Vec::new();
        for &op in &self.op_types {
            let mut block_size = self.start_block_size;
            while block_size <= self.max_block_size {
                let mut batch_size = self.start_batch_size;
                while batch_size <= self.max_batch_size {
                    out.push(Point {
                        op,
                        block_size,
                        batch_size,
                    });
                    batch_size *= 2;
                }
                block_size *= 2;
            }
        }
        out
    }

    /// (warmup, measured) iterations per thread for a block size: nixlbench divides
    /// both by `large_blk_iter_ftr` for blocks above [`LARGE_BLOCK_SIZE`].
    pub(crate) fn iterations(&self, block_size: u64) -> (usize, usize) {
        let ftr = if block_size > LARGE_BLOCK_SIZE {
            self.large_blk_iter_ftr
        } else {
            1
        };
        (
            self.warmup_iter / ftr / self.num_threads,
            self.num_iter / ftr / self.num_threads,
        )
    }

    /// Bytes of the buffer each thread owns (thread buffers start on page boundaries).
    pub(crate) fn thread_buffer_size(&self) -> u64 {
        self.total_buffer_size / self.num_threads as u64 / PAGE * PAGE
    }
}

/// Where two hosts meet in etcd (`--etcd-endpoints`, `--benchmark-group`).
#[cfg(feature = "etcd")]
#[derive(Clone, Debug)]
pub(crate) struct EtcdConfig {
    /// Client URLs, at least one.
    pub(crate) endpoints: Vec<String>,
    /// The benchmark group: letters, digits, `.`, `_`, `-`.
    pub(crate) group: String,
    /// TLS (`--etcd-ca`, `--etcd-cert`, `--etcd-key`).
    pub(crate) tls: Option<nixl::exchange::EtcdTls>,
    /// User and password (`--etcd-user`, `NIXL_ETCD_PASSWORD`).
    pub(crate) auth: Option<nixl::exchange::EtcdAuth>,
}

/// Everything a run needs, checked.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    /// Storage mode's files (`--backend posix`).
    pub(crate) storage: StorageConfig,
    pub(crate) role: Role,
    pub(crate) peer: Option<String>,
    pub(crate) peer_kind: PeerKind,
    pub(crate) listen: SocketAddr,
    /// Two hosts through etcd instead of `--peer`.
    #[cfg(feature = "etcd")]
    pub(crate) etcd: Option<EtcdConfig>,
    /// The local mode's control socket, in its target child (`--control-socket`).
    pub(crate) control_socket: Option<PathBuf>,
    pub(crate) backend: String,
    pub(crate) backend_params: Vec<(String, String)>,
    pub(crate) sweep: Sweep,
    pub(crate) timeouts: Timeouts,
    pub(crate) format: Format,
    pub(crate) plot: Option<PathBuf>,
    /// Where to serve metrics (`--metrics-addr`).
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// Notes for the header (iteration counts rounded up, ...).
    pub(crate) notes: Vec<String>,
}

/// Where the storage mode's files are.
#[derive(Clone, Debug)]
pub(crate) struct StorageConfig {
    pub(crate) dir: Option<PathBuf>,
    pub(crate) num_files: usize,
    pub(crate) direct: bool,
}

struct Preset {
    name: &'static str,
    num_iter: usize,
    warmup_iter: usize,
    /// `None`: just enough for the sweep.
    total_buffer_size: Option<u64>,
}

/// A few seconds on a small machine, and well under 1 GiB of memory.
const QUICK: Preset = Preset {
    name: "quick",
    num_iter: 512,
    warmup_iter: 64,
    total_buffer_size: None,
};

/// nixlbench's defaults.
const FULL: Preset = Preset {
    name: "full",
    num_iter: 1000,
    warmup_iter: 100,
    total_buffer_size: Some(8 * GIB),
};

impl Cli {
    /// Check the arguments and fill in defaults.
    ///
    /// # Errors
    /// A message naming the offending flag.
    pub(crate) fn into_config(self) -> Result<Config> {
        if self.benchmark_group.is_some() && self.etcd_endpoints.is_none() {
            return fail("--benchmark-group is for etcd mode (give --etcd-endpoints too)");
        }
        #[cfg(not(feature = "etcd"))]
        if self.etcd_endpoints.is_some() {
            return fail(ETCD_MISSING);
        }
        #[cfg(feature = "etcd")]
        let etcd = self.etcd_config()?;
        #[cfg(feature = "etcd")]
        let by_etcd = etcd.is_some();
        #[cfg(not(feature = "etcd"))]
        let by_etcd = false;
        let role = self.role.unwrap_or(if self.etcd_endpoints.is_some() {
            Role::Auto
        } else {
            Role::Local
        });
        match (role, &self.peer) {
            (Role::Initiator, None) if !by_etcd => {
                return fail(
                    "--role initiator needs --peer HOST:PORT (the target's --listen address) or --etcd-endpoints URLS",
                )
            }
            (Role::Local | Role::Target | Role::Auto, Some(_)) => {
                return fail("--peer is for --role initiator")
            }
            _ => {}
        }
        if self.peer_kind == PeerKind::Nixl {
            if role != Role::Initiator || self.peer.is_none() {
                return fail("--peer-kind nixl needs --role initiator --peer HOST:PORT (the NIXL agent's listener)");
            }
            if !self.backend.eq_ignore_ascii_case("ucx") {
                return fail("--peer-kind nixl needs --backend ucx (NIXL agents speak UCX)");
            }
            if self.check_consistency {
                return fail("--check-consistency is not available with --peer-kind nixl (a NIXL agent has no nixl-bench control channel)");
            }
        }
        if self.control_socket.is_some() && role != Role::Target {
            return fail("--control-socket is for --role target");
        }
        for (which, seg) in [
            ("--initiator-seg-type", self.initiator_seg_type),
            ("--target-seg-type", self.target_seg_type),
        ] {
            if seg == SegType::Vram && self.memory == MemSource::Backend {
                return fail(format!("{which} VRAM with --memory backend: backend memory is host memory; drop one of them"));
            }
        }
        if (self.initiator_seg_type == SegType::Vram || self.target_seg_type == SegType::Vram)
            && self.peer_kind == PeerKind::Nixl
        {
            return fail("VRAM with --peer-kind nixl: the NIXL target's DRAM registration is used; drop --*-seg-type VRAM");
        }
        let preset = if self.full { &FULL } else { &QUICK };
        let start_block_size = self.start_block_size.unwrap_or(4 * KIB);
        let max_block_size = self.max_block_size.unwrap_or(64 * MIB);
        let start_batch_size = self.start_batch_size.unwrap_or(1);
        let max_batch_size = self.max_batch_size.unwrap_or(1);
        let large_blk_iter_ftr = self.large_blk_iter_ftr.unwrap_or(16);
        let num_threads = self.num_threads;
        let pipeline_depth = self.pipeline_depth;
        for (flag, v) in [
            ("--start-block-size", start_block_size),
            ("--max-block-size", max_block_size),
            ("--start-batch-size", start_batch_size as u64),
            ("--max-batch-size", max_batch_size as u64),
            ("--large-blk-iter-ftr", large_blk_iter_ftr as u64),
            ("--num-threads", num_threads as u64),
            ("--pipeline-depth", pipeline_depth as u64),
        ] {
            if v == 0 {
                return fail(format!("{flag} must be at least 1"));
            }
        }
        if start_block_size > max_block_size {
            return fail(format!("--start-block-size ({start_block_size}) is larger than --max-block-size ({max_block_size})"));
        }
        if start_batch_size > max_batch_size {
            return fail(format!("--start-batch-size ({start_batch_size}) is larger than --max-batch-size ({max_batch_size})"));
        }
        // Each thread needs room for `pipeline_depth` requests of the largest batch.
        let per_thread = self
            .descriptor_layout
            .spacing(max_block_size)
            .checked_mul(max_batch_size as u64)
            .and_then(|v| v.checked_mul(pipeline_depth as u64))
            .ok_or_else(|| BenchError::new("block size x batch size x pipeline depth overflows"))?;
        let needed = per_thread
            .div_ceil(PAGE)
            .checked_mul(PAGE * num_threads as u64)
            .ok_or_else(|| BenchError::new("the sweep's buffer size overflows"))?;
        let total_buffer_size = self
            .total_buffer_size
            .or(preset.total_buffer_size)
            .unwrap_or(needed);
        if total_buffer_size / num_threads as u64 / PAGE * PAGE < per_thread {
            return fail(format!(
                "--total-buffer-size {} is too small: each of {num_threads} thread(s) needs max block size x max batch size x pipeline depth (x 2 when scattered) = {} bytes (give at least {})",
                total_buffer_size, per_thread, needed,
            ));
        }

        // Every size must fit this machine before anything is allocated: the
        // buffers (twice over when the target is a child on this host) and the
        // timing samples.
        if let Some(machine) = nixl::host_memory() {
            // Host buffers in this process and, for a local run, its child target.
            let (init, target) = (
                u64::from(self.initiator_seg_type == SegType::Dram),
                u64::from(self.target_seg_type == SegType::Dram),
            );
            let agents = match role {
                Role::Local => init + target,
                Role::Initiator => init,
                Role::Target => target,
                Role::Auto => init.max(target),
            };
            let buffers = total_buffer_size.saturating_mul(agents);
            if buffers > machine {
                let (flag, why) = match self.total_buffer_size.or(preset.total_buffer_size) {
                    Some(_) => ("--total-buffer-size", format!("{total_buffer_size} bytes")),
                    None => (
                        "--max-block-size",
                        format!(
                            "--max-block-size {max_block_size} x --max-batch-size {max_batch_size} x --pipeline-depth {pipeline_depth} x --num-threads {num_threads}{} = {total_buffer_size} bytes",
                            if self.descriptor_layout.spacing(1) > 1 { " x 2 (scattered)" } else { "" }
                        ),
                    ),
                };
                return fail(format!(
                    "{flag} is too large for this machine: the buffers need {why}{} but it has {machine} bytes of memory (RAM and swap)",
                    if agents == 2 { " in each of the two agents on this host" } else { "" }
                ));
            }
        }

        let mut notes = Vec::new();
        // As nixlbench, iteration counts divide evenly between threads and by the large
        // block factor; unlike it, the factor only counts when the sweep has large blocks.
        let ftr = if max_block_size > LARGE_BLOCK_SIZE {
            large_blk_iter_ftr
        } else {
            1
        };
        let partition = num_threads * ftr;
        let round = |name: &str, v: usize, notes: &mut Vec<String>| {
            let r = v.div_ceil(partition) * partition;
            if r != v {
                notes.push(format!(
                    "{name} rounded up from {v} to {r}, a multiple of {partition} (num_threads{})",
                    if ftr > 1 { " x large_blk_iter_ftr" } else { "" }
                ));
            }
            r
        };
        let num_iter = round(
            "num_iter",
            self.num_iter.unwrap_or(preset.num_iter),
            &mut notes,
        );
        let warmup_iter = round(
            "warmup_iter",
            self.warmup_iter.unwrap_or(preset.warmup_iter),
            &mut notes,
        );
        if num_iter == 0 {
            return fail("--num-iter must be at least 1");
        }
        // Three timing samples (8 bytes each) per iteration are kept for the report.
        if let Some(machine) = nixl::host_memory() {
            for (flag, n) in [("--num-iter", num_iter), ("--warmup-iter", warmup_iter)] {
                if (n as u64).saturating_mul(24) > machine / 2 {
                    return fail(format!(
                        "{flag} {n} is too large for this machine: its timing samples need {} bytes, more than half of its {machine} bytes of memory",
                        (n as u64).saturating_mul(24)
                    ));
                }
            }
        }
        let format = if self.json {
            Format::Json
        } else if self.csv {
            Format::Csv
        } else {
            Format::Table
        };
        let listen = self.listen.unwrap_or(if by_etcd {
            // Any interface: the address to reach it by goes through etcd.
            SocketAddr::from(([0, 0, 0, 0], 0))
        } else {
            SocketAddr::from(([127, 0, 0, 1], 0))
        });
        Ok(Config {
            role,
            peer: self.peer,
            peer_kind: self.peer_kind,
            listen,
            #[cfg(feature = "etcd")]
            etcd,
            control_socket: self.control_socket,
            storage: StorageConfig {
                dir: self.filepath,
                num_files: self.num_files.max(1),
                direct: self.storage_enable_direct,
            },
            backend: self.backend.to_ascii_lowercase(),
            backend_params: self.backend_params,
            sweep: Sweep {
                preset: preset.name,
                op_types: dedup(self.op_type),
                initiator_seg_type: self.initiator_seg_type,
                target_seg_type: self.target_seg_type,
                device_id: self.device_id,
                start_block_size,
                max_block_size,
                start_batch_size,
                max_batch_size,
                num_iter,
                warmup_iter,
                large_blk_iter_ftr,
                num_threads,
                pipeline_depth,
                recreate_xfer: self.recreate_xfer,
                check_consistency: self.check_consistency,
                memory: self.memory,
                huge_pages: self.huge_pages,
                descriptor_layout: self.descriptor_layout,
                merge_descriptors: self.merge_descriptors,
                baselines: self.baselines,
                total_buffer_size,
            },
            timeouts: Timeouts {
                connect: self.connect_timeout,
                exchange: self.exchange_timeout,
                xfer: self.xfer_timeout,
                teardown: self.teardown_timeout,
            },
            format,
            plot: self.plot,
            metrics_addr: self.metrics_addr,
            notes,
        })
    }
}

/// Thread buffers start on page boundaries.
const PAGE: u64 = nixl::PAGE_SIZE as u64;

/// Why `--etcd-endpoints` fails in a build without the `etcd` feature.
#[cfg(not(feature = "etcd"))]
const ETCD_MISSING: &str = "etcd mode needs the `etcd` feature: rebuild with `cargo build --release -p nixl-bench --features etcd` (it needs protoc at build time: apt-get install protobuf-compiler libprotobuf-dev); or run on two hosts with --role target --listen ADDR and --role initiator --peer ADDR";

/// The benchmark group when none is given (nixlbench's default too).
#[cfg(feature = "etcd")]
const DEFAULT_GROUP: &str = "default";

#[cfg(feature = "etcd")]
impl Cli {
    /// `--etcd-endpoints` and `--benchmark-group`, checked; `None` without etcd.
    fn etcd_config(&self) -> Result<Option<EtcdConfig>> {
        let Some(urls) = &self.etcd_endpoints else {
            return Ok(None);
        };
        if self.role == Some(Role::Local) {
            return fail("--etcd-endpoints is for two hosts: give --role target on one and --role initiator on the other");
        }
        if self.peer.is_some() {
            return fail("--peer and --etcd-endpoints both say how to find the target; give one");
        }
        if self.control_socket.is_some() {
            return fail("--control-socket and --etcd-endpoints do not go together");
        }
        let endpoints: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        if endpoints.is_empty() {
            return fail("--etcd-endpoints needs at least one URL, e.g. http://127.0.0.1:2379");
        }
        let group = self
            .benchmark_group
            .clone()
            .unwrap_or_else(|| DEFAULT_GROUP.to_owned());
        let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if group.is_empty() || group.len() > 128 || !group.chars().all(valid) {
            return fail(format!(
                "--benchmark-group {group:?}: use 1 to 128 letters, digits, '.', '_' or '-'"
            ));
        }
        let tls = match (&self.etcd_ca, &self.etcd_cert, &self.etcd_key) {
            (None, None, None) => None,
            (None, ..) => return fail(
                "--etcd-cert and --etcd-key need --etcd-ca (the CA etcd's certificate chains to)",
            ),
            (Some(ca), cert, key) => Some(
                nixl::exchange::EtcdTls::from_files(ca, cert.as_deref().zip(key.as_deref()))
                    .map_err(|e| crate::error::BenchError::new(e.to_string()))?,
            ),
        };
        let auth = match &self.etcd_user {
            None => None,
            Some(user) => match std::env::var("NIXL_ETCD_PASSWORD") {
                Ok(password) => Some(nixl::exchange::EtcdAuth {
                    user: user.clone(),
                    password,
                }),
                Err(_) => return fail(
                    "--etcd-user needs the password in the NIXL_ETCD_PASSWORD environment variable",
                ),
            },
        };
        Ok(Some(EtcdConfig {
            endpoints,
            group,
            tls,
            auth,
        }))
    }
}

fn dedup(ops: Vec<Op>) -> Vec<Op> {
    let mut out: Vec<Op> = Vec::with_capacity(ops.len());
    for op in ops {
        if !out.contains(&op) {
            out.push(op);
        }
    }
    out
}

fn op_names<S: Serializer>(ops: &[Op], s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_seq(ops.iter().map(ToString::to_string))
}

fn secs<S: Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// `READ` or `WRITE`, any case.
pub(crate) fn parse_op(s: &str) -> std::result::Result<Op, String> {
    match s.trim().to_ascii_uppercase().as_str() {
        "READ" => Ok(Op::Read),
        "WRITE" => Ok(Op::Write),
        _ => Err(format!("{s:?} is not an op type; use READ or WRITE")),
    }
}

/// A byte count with an optional binary suffix: `4096`, `4K`, `64M`, `1G`, `8GiB`.
pub(crate) fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "{s:?} is not a size; use a number with an optional K, M, G or T suffix"
        ));
    }
    let mult = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => KIB,
        "M" | "MB" | "MIB" => MIB,
        "G" | "GB" | "GIB" => GIB,
        "T" | "TB" | "TIB" => GIB << 10,
        other => {
            return Err(format!(
                "{s:?}: unknown size suffix {other:?}; use K, M, G or T (powers of 1024)"
            ))
        }
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is too large"))
}

// A duration: `500ms`, `30s`, `2m`, or plain seconds (`30`, `0.5`).
pub(crate) use nixl::control::parse_duration;

/// `true`/`false`/`1`/`0` (gflags-style `--check_consistency=1` works too).
fn parse_bool(s: &str) -> std::result::Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean; use true or false")),
    }
}

/// `KEY=VALUE`.
fn parse_backend_param(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Result<Config> {
        let mut all = vec!["nixl-bench"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all)
            .map_err(|e| BenchError::new(e.to_string()))?
            .into_config()
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("4X").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("3 days").is_err());
    }

    #[test]
    fn defaults_are_the_quick_sweep() {
        let c = config(&[]).unwrap();
        assert_eq!(c.role, Role::Local);
        assert_eq!(c.backend, "tcp");
        let s = &c.sweep;
        assert_eq!(s.op_types, vec![Op::Write]);
        assert_eq!((s.start_block_size, s.max_block_size), (4096, 64 << 20));
        assert_eq!((s.num_iter, s.warmup_iter), (512, 64));
        assert!(c.notes.is_empty(), "{:?}", c.notes);
        assert_eq!(s.total_buffer_size, 64 << 20);
        let points = s.points();
        assert_eq!(points.len(), 15);
        assert_eq!(points[14].block_size, 64 << 20);
        assert_eq!(s.iterations(1 << 20), (64, 512));
        assert_eq!(s.iterations(2 << 20), (4, 32));
    }

    #[test]
    fn full_is_nixlbench_and_flags_override_it() {
        let c = config(&["--full"]).unwrap();
        assert_eq!((c.sweep.num_iter, c.sweep.warmup_iter), (1008, 112));
        assert_eq!(c.sweep.total_buffer_size, 8 << 30);
        let c = config(&["--full", "--num-iter", "32", "--total-buffer-size", "1G"]).unwrap();
        assert_eq!(c.sweep.num_iter, 32);
        assert_eq!(c.sweep.total_buffer_size, 1 << 30);
    }

    #[test]
    fn underscore_spellings_and_lowercase_ops() {
        let c = config(&[
            "--op_type",
            "read,write",
            "--max_block_size=64K",
            "--num_iter",
            "16",
            "--check_consistency=1",
            "--recreate-xfer",
        ])
        .unwrap();
        assert_eq!(c.sweep.op_types, vec![Op::Read, Op::Write]);
        assert_eq!(c.sweep.max_block_size, 64 << 10);
        assert!(c.sweep.check_consistency && c.sweep.recreate_xfer);
        assert_eq!(c.sweep.points().len(), 2 * 5);
    }

    #[test]
    fn threads_and_depth_split_the_buffer() {
        let c = config(&[
            "--num-threads",
            "2",
            "--pipeline-depth",
            "4",
            "--max-block-size",
            "1M",
        ])
        .unwrap();
        assert_eq!(c.sweep.total_buffer_size, 8 << 20);
        assert_eq!(c.sweep.thread_buffer_size(), 4 << 20);
        assert_eq!(c.sweep.num_iter % 32, 0);
        let e = config(&["--num-threads", "2", "--total-buffer-size", "64M"]).unwrap_err();
        assert!(e.to_string().contains("too small"), "{e}");
    }

    #[test]
    fn refusals_say_why() {
        for (args, needle) in [
            (
                &["--initiator-seg-type", "VRAM", "--memory", "backend"][..],
                "backend memory is host memory",
            ),
            (
                &["--target-seg-type", "vram", "--memory", "backend"][..],
                "backend memory is host memory",
            ),
            (&["--role", "initiator"][..], "needs --peer"),
            (
                &["--benchmark-group", "g1"][..],
                "--benchmark-group is for etcd mode",
            ),
            (&["--peer", "h:1"][..], "--peer is for --role initiator"),
            (
                &["--control-socket", "/tmp/s"][..],
                "--control-socket is for --role target",
            ),
            (
                &["--start-block-size", "8K", "--max-block-size", "4K"][..],
                "larger than",
            ),
            (&["--num-threads", "0"][..], "at least 1"),
            (&["--op-type", "copy"][..], "READ or WRITE"),
            (&["--backend-param", "novalue"][..], "KEY=VALUE"),
            (
                &["--peer-kind", "nixl"][..],
                "--peer-kind nixl needs --role initiator",
            ),
            (
                &[
                    "--peer-kind",
                    "nixl",
                    "--role",
                    "initiator",
                    "--peer",
                    "h:1",
                ][..],
                "needs --backend ucx",
            ),
            (
                &[
                    "--peer-kind",
                    "nixl",
                    "--role",
                    "initiator",
                    "--peer",
                    "h:1",
                    "--backend",
                    "ucx",
                    "--check-consistency",
                ][..],
                "not available with --peer-kind nixl",
            ),
        ] {
            let e = config(args).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }

    #[cfg(not(feature = "etcd"))]
    #[test]
    fn etcd_needs_the_feature() {
        let e = config(&["--role", "target", "--etcd-endpoints", "http://x:2379"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rebuild with"), "{e}");
        assert!(e.contains("--features etcd") && e.contains("protoc"), "{e}");
    }

    #[cfg(feature = "etcd")]
    #[test]
    fn etcd_endpoints_and_group() {
        let c = config(&[
            "--role",
            "initiator",
            "--etcd-endpoints",
            "http://a:2379, http://b:2379,",
            "--benchmark_group",
            "g1",
        ])
        .unwrap();
        let e = c.etcd.unwrap();
        assert_eq!(e.endpoints, ["http://a:2379", "http://b:2379"]);
        assert_eq!(e.group, "g1");
        let c = config(&["--role", "target", "--etcd_endpoints", "127.0.0.1:2379"]).unwrap();
        assert_eq!(c.etcd.unwrap().group, "default");
        // The target listens on every interface unless told otherwise.
        assert_eq!(c.listen, "0.0.0.0:0".parse().unwrap());
        let c = config(&["--role", "target"]).unwrap();
        assert!(c.etcd.is_none());
        assert_eq!(c.listen, "127.0.0.1:0".parse().unwrap());
        // Without --role, etcd mode picks the role at run time.
        let c = config(&["--etcd-endpoints", "http://x:2379"]).unwrap();
        assert_eq!(c.role, Role::Auto);
        assert_eq!(c.listen, "0.0.0.0:0".parse().unwrap());
        for (args, needle) in [
            (
                &["--role", "local", "--etcd-endpoints", "http://x:2379"][..],
                "is for two hosts",
            ),
            (
                &[
                    "--role",
                    "initiator",
                    "--etcd-endpoints",
                    "x",
                    "--peer",
                    "h:1",
                ][..],
                "give one",
            ),
            (
                &["--role", "target", "--etcd-endpoints", " , "][..],
                "at least one URL",
            ),
            (
                &[
                    "--role",
                    "target",
                    "--etcd-endpoints",
                    "x",
                    "--benchmark-group",
                    "a/b",
                ][..],
                "--benchmark-group \"a/b\"",
            ),
            (
                &[
                    "--role",
                    "target",
                    "--etcd-endpoints",
                    "x",
                    "--benchmark-group",
                    "",
                ][..],
                "--benchmark-group \"\"",
            ),
        ] {
            let e = config(args).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }
}
