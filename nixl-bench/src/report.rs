//! Results for people and programs: nixlbench's table (rows printed as they come), one
//! JSON object, or CSV, each with the run's parameters, versions and transport.

use std::collections::BTreeMap;
use std::io::{self, Write};

use nixl::Op;
use serde::Serialize;

use crate::cli::{Format, SegType, Sweep, Timeouts, LARGE_BLOCK_SIZE};
use crate::progress::Progress;
use crate::stats::Row;

/// Versions of what ran.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Versions {
    pub(crate) nixl_bench: &'static str,
    pub(crate) nixl: &'static str,
    /// Present when the tcp backend is compiled in.
    pub(crate) nixl_tcp: Option<&'static str>,
}

impl Versions {
    pub(crate) fn current() -> Self {
        Self {
            nixl_bench: env!("CARGO_PKG_VERSION"),
            nixl: nixl::VERSION,
            #[cfg(feature = "tcp")]
            nixl_tcp: Some(nixl_tcp::VERSION),
            #[cfg(not(feature = "tcp"))]
            nixl_tcp: None,
        }
    }
}

/// How the two agents reached each other.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Transport {
    /// The initiator's backend endpoint (from its connection info).
    pub(crate) initiator: String,
    /// The target's backend endpoint (from its metadata).
    pub(crate) target: String,
    /// Where the target ran ("child process 1234 on this host", "peer at host:port").
    pub(crate) target_process: String,
    /// Whether the backend connection stays on this host's loopback interface.
    pub(crate) loopback: bool,
    /// The native library the backend bound (version, real paths), if any.
    pub(crate) library: Option<String>,
    /// How the backend moves data to the target, as it says once connected (same-host
    /// shared memory, cross-memory attach, TCP, and why a faster path is off).
    pub(crate) data_path: Option<String>,
}

/// Everything about a run except its results.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct RunInfo {
    pub(crate) versions: Versions,
    /// `local` (target in a child process) or `two-host`.
    pub(crate) mode: &'static str,
    pub(crate) backend: String,
    pub(crate) backend_params: BTreeMap<String, String>,
    pub(crate) transport: Transport,
    #[serde(flatten)]
    pub(crate) sweep: Sweep,
    pub(crate) timeouts_s: Timeouts,
    pub(crate) units: Units,
    pub(crate) notes: Vec<String>,
    /// Figures without nixl from this run (`--baselines`).
    pub(crate) baselines: Option<crate::baseline::Baselines>,
}

/// Units of the result fields.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Units {
    pub(crate) bw: &'static str,
    pub(crate) time: &'static str,
}

impl Default for Units {
    fn default() -> Self {
        Self {
            bw: "GB/s, GB = 10^9 bytes",
            time: "microseconds",
        }
    }
}

#[derive(Serialize)]
struct JsonReport<'a> {
    run: &'a RunInfo,
    results: &'a [Row],
}

/// Column titles of the table (nixlbench's) and of CSV/JSON.
const COLUMNS: [(&str, &str, usize); 14] = [
    ("", "op", 0),
    ("Block Size (B)", "block_size", 20),
    ("Batch Size", "batch_size", 15),
    ("B/W (GB/Sec)", "bw_gbps", 15),
    ("Avg Lat. (us)", "avg_lat_us", 15),
    ("Avg Prep (us)", "avg_prep_us", 15),
    ("P99 Prep (us)", "p99_prep_us", 15),
    ("Avg Post (us)", "avg_post_us", 15),
    ("P99 Post (us)", "p99_post_us", 15),
    ("Avg Tx (us)", "avg_tx_us", 15),
    ("P50 Tx (us)", "p50_tx_us", 15),
    ("P99 Tx (us)", "p99_tx_us", 15),
    ("Segments", "segments", 10),
    ("Runs", "segment_runs", 6),
];

fn table_width() -> usize {
    COLUMNS.iter().map(|c| c.2).sum()
}

/// Where results go as the run proceeds.
#[derive(Debug)]
pub(crate) struct Output {
    format: Format,
    progress: Progress,
    rows: Vec<Row>,
    last_op: Option<Op>,
    ops: usize,
}

impl Output {
    pub(crate) fn new(format: Format, points: usize, ops: usize) -> Self {
        Self {
            format,
            progress: Progress::new(points),
            rows: Vec::new(),
            last_op: None,
            ops,
        }
    }

    /// Say on the progress line (a terminal's stderr only) what runs now.
    pub(crate) fn progress(&mut self, what: &str) {
        self.progress.show(self.rows.len(), what);
    }

    /// Print what comes before the rows.
    pub(crate) fn begin(&mut self, run: &RunInfo) -> io::Result<()> {
        let mut out = io::stdout().lock();
        match self.format {
            Format::Table => write_header(&mut out, run)?,
            Format::Csv => writeln!(
                out,
                "{}",
                COLUMNS.iter().map(|c| c.1).collect::<Vec<_>>().join(",")
            )?,
            Format::Json => {}
        }
        out.flush()
    }

    /// Record a row, printing it at once for the table and CSV.
    pub(crate) fn row(&mut self, row: Row) -> io::Result<()> {
        self.progress.clear();
        let mut out = io::stdout().lock();
        match self.format {
            Format::Table => {
                if self.ops > 1 && self.last_op != Some(row.op) {
                    writeln!(out, "{}", row.op)?;
                }
                writeln!(out, "{}", table_row(&row))?;
            }
            Format::Csv => writeln!(out, "{}", csv_row(&row))?,
            Format::Json => {}
        }
        self.last_op = Some(row.op);
        self.rows.push(row);
        out.flush()
    }

    /// Print what comes after the rows; hand back the rows.
    pub(crate) fn finish(mut self, run: &RunInfo) -> io::Result<Vec<Row>> {
        self.progress.clear();
        let mut out = io::stdout().lock();
        match self.format {
            Format::Table => writeln!(out, "{}", "-".repeat(table_width()))?,
            Format::Csv => {}
            Format::Json => {
                serde_json::to_writer_pretty(
                    &mut out,
                    &JsonReport {
                        run,
                        results: &self.rows,
                    },
                )?;
                writeln!(out)?;
            }
        }
        out.flush()?;
        Ok(std::mem::take(&mut self.rows))
    }
}

fn write_header(out: &mut impl Write, run: &RunInfo) -> io::Result<()> {
    let s = &run.sweep;
    let v = &run.versions;
    let t = &run.transport;
    let mut versions = format!("nixl {}", v.nixl);
    if let Some(tcp) = v.nixl_tcp {
        versions.push_str(&format!(", nixl-tcp {tcp}"));
    }
    writeln!(out, "nixl-bench {} ({versions})", v.nixl_bench)?;
    let rule = "-".repeat(table_width());
    writeln!(out, "{rule}")?;
    let params = if run.backend_params.is_empty() {
        String::new()
    } else {
        let kv: Vec<_> = run
            .backend_params
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(" [{}]", kv.join(" "))
    };
    let line = |out: &mut dyn Write, k: &str, v: String| writeln!(out, "{k:<14}{v}");
    line(
        out,
        "Backend",
        format!(
            "{}{params}: initiator {} -> target {}{}",
            run.backend,
            t.initiator,
            t.target,
            if t.loopback { " (loopback)" } else { "" }
        ),
    )?;
    line(out, "Target", t.target_process.clone())?;
    if let Some(path) = &t.data_path {
        line(out, "Data path", path.clone())?;
    }
    if let Some(lib) = &t.library {
        line(out, "Library", lib.clone())?;
    }
    let ops: Vec<_> = s.op_types.iter().map(ToString::to_string).collect();
    line(
        out,
        "Op type",
        format!(
            "{}, initiator {} -> target {}",
            ops.join(", "),
            seg(s.initiator_seg_type),
            seg(s.target_seg_type)
        ),
    )?;
    if [s.initiator_seg_type, s.target_seg_type].contains(&SegType::Vram) {
        line(
            out,
            "GPU",
            format!(
                "device {}; on the initiator's host: {}",
                s.device_id,
                nixl::gpu::status().map_or_else(|e| e.to_string(), |g| g.driver)
            ),
        )?;
    }
    line(
        out,
        "Sweep",
        format!(
            "block size {} to {}, batch size {} to {} (doubling)",
            s.start_block_size, s.max_block_size, s.start_batch_size, s.max_batch_size
        ),
    )?;
    let mut iterations = format!("{} (warmup {}) per point", s.num_iter, s.warmup_iter);
    if s.max_block_size > LARGE_BLOCK_SIZE {
        iterations.push_str(&format!(
            "; blocks above {}: {} (warmup {}), --large-blk-iter-ftr {}",
            human_size(LARGE_BLOCK_SIZE),
            s.num_iter / s.large_blk_iter_ftr,
            s.warmup_iter / s.large_blk_iter_ftr,
            s.large_blk_iter_ftr
        ));
    }
    line(out, "Iterations", iterations)?;
    line(
        out,
        "Threads",
        format!(
            "{} x pipeline depth {}; {}",
            s.num_threads,
            s.pipeline_depth,
            if s.recreate_xfer {
                "a new request for every iteration (--recreate-xfer)"
            } else {
                "prepared requests, reposted"
            }
        ),
    )?;
    line(
        out,
        "Buffer",
        format!(
            "{} per side, {}; consistency check {}; preset {}",
            human_size(s.total_buffer_size),
            match (s.initiator_seg_type, s.target_seg_type, s.memory) {
                (SegType::Vram, SegType::Vram, _) => "GPU memory (cuMemAlloc)",
                (SegType::Vram, SegType::Dram, _) | (SegType::Dram, SegType::Vram, _) =>
                    "GPU memory (cuMemAlloc) on the VRAM side, host memory on the other",
                (_, _, crate::cli::MemSource::Host) if s.huge_pages =>
                    "host memory asking for transparent huge pages",
                (_, _, crate::cli::MemSource::Host) => "host memory, small pages",
                (_, _, crate::cli::MemSource::Backend) => "backend (Agent::alloc) memory",
            },
            if s.check_consistency { "on" } else { "off" },
            s.preset
        ),
    )?;
    line(
        out,
        "Units",
        "GB = 10^9 bytes; times in us; Avg Lat. = elapsed / (iterations per thread x batch)".into(),
    )?;
    line(
        out,
        "Descriptors",
        format!(
            "{} blocks, {}",
            match s.descriptor_layout {
                crate::cli::DescLayout::Consecutive => "consecutive",
                crate::cli::DescLayout::Scattered => "scattered (a gap after every block)",
            },
            if s.merge_descriptors {
                "contiguous ones merged"
            } else {
                "one segment each (not merged)"
            }
        ),
    )?;
    if let Some(b) = &run.baselines {
        let copies: Vec<_> = b
            .memcpy
            .iter()
            .map(|&(n, g)| format!("{} {g:.2}", human_size(n)))
            .collect();
        line(
            out,
            "Baseline",
            format!("memcpy GB/s, one thread: {}", copies.join(", ")),
        )?;
        line(
            out,
            "Baseline",
            format!(
                "loopback TCP: stream {:.2} GB/s; half round trip {:.1} us (64 B), {:.1} us (4 KiB, 24 B reply: a WRITE's shape), {:.1} us (64 B, 4 KiB reply: a READ's shape)",
                b.tcp_stream_gbps, b.tcp_half_rtt_us, b.tcp_half_rtt_4k_us, b.tcp_half_rtt_4k_read_us
            ),
        )?;
    }
    for note in &run.notes {
        line(out, "Note", note.clone())?;
    }
    writeln!(out, "{rule}")?;
    writeln!(out)?;
    let mut head = String::new();
    for (title, _, width) in &COLUMNS[1..] {
        head.push_str(&format!("{title:<width$}"));
    }
    writeln!(out, "{}", head.trim_end())?;
    writeln!(out, "{rule}")
}

fn seg(s: crate::cli::SegType) -> &'static str {
    match s {
        crate::cli::SegType::Dram => "DRAM",
        crate::cli::SegType::Vram => "VRAM",
    }
}

/// nixlbench's row: left-aligned fixed widths; bandwidth with 6 decimals, times with 1.
pub(crate) fn table_row(r: &Row) -> String {
    let line = format!(
        "{:<20}{:<15}{:<15.6}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<10}{:<6}",
        r.block_size,
        r.batch_size,
        r.bw_gbps,
        r.avg_lat_us,
        r.avg_prep_us,
        r.p99_prep_us,
        r.avg_post_us,
        r.p99_post_us,
        r.avg_tx_us,
        r.p50_tx_us,
        r.p99_tx_us,
        r.segments,
        r.segment_runs
    );
    line.trim_end().to_owned()
}

fn csv_row(r: &Row) -> String {
    format!(
        "{},{},{},{:.6},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{},{}",
        r.op,
        r.block_size,
        r.batch_size,
        r.bw_gbps,
        r.avg_lat_us,
        r.avg_prep_us,
        r.p99_prep_us,
        r.avg_post_us,
        r.p99_post_us,
        r.avg_tx_us,
        r.p50_tx_us,
        r.p99_tx_us,
        r.segments,
        r.segment_runs
    )
}

/// `4096` -> `4 KiB`; exact multiples only get a unit.
pub(crate) fn human_size(n: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        Row {
            op: Op::Write,
            block_size: 4096,
            batch_size: 1,
            bw_gbps: 0.123_456_78,
            avg_lat_us: 33.25,
            avg_prep_us: 1.04,
            p99_prep_us: 2.0,
            avg_post_us: 0.5,
            p99_post_us: 0.9,
            avg_tx_us: 30.0,
            p50_tx_us: 29.0,
            p99_tx_us: 50.55,
            segments: 1,
            segment_runs: 1,
        }
    }

    #[test]
    fn table_row_has_nixlbench_widths() {
        let s = table_row(&row());
        assert!(
            s.starts_with("4096                1              0.123457       33.2"),
            "{s:?}"
        );
        assert_eq!(s.split_whitespace().count(), 13);
    }

    #[test]
    fn csv_row_matches_the_header() {
        let s = csv_row(&row());
        assert_eq!(s.split(',').count(), COLUMNS.len());
        assert!(s.starts_with("WRITE,4096,1,0.123457,"), "{s}");
    }

    #[test]
    fn json_row_fields() {
        let v = serde_json::to_value(row()).unwrap();
        for (_, field, _) in COLUMNS {
            assert!(v.get(field).is_some(), "{field} missing in {v}");
        }
        assert_eq!(v["op"], "WRITE");
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(64 << 20), "64 MiB");
        assert_eq!(human_size(8 << 30), "8 GiB");
        assert_eq!(human_size(1000), "1000 B");
    }
}
