//! Storage mode (`--backend posix`): one agent, its host buffer and its files, READ
//! (file to memory) and WRITE (memory to file) over nixlbench's sweep of block and
//! batch sizes, with the same table.
//!
//! Files are `nixl-bench-<i>.dat` in `--filepath`, `--num-files` of them; descriptor
//! j of a batch is block j of the buffer and lies in file j % N at offset
//! (j / N) x block size. The files are created, and grown to what the largest
//! point needs, before the sweep.

use std::time::Instant;

use nixl::file::FileOptions;
use nixl::{Agent, AlignedBuf, Desc, DescList, MemKind, Memory, Registration, RequestOptions};

use crate::cli::Config;
use crate::error::{fail, Context, Result};
use crate::report::{Output, RunInfo, Transport, Units, Versions};
use crate::stats::{PhaseStats, Row, Samples};

/// Run the storage sweep; returns what the header says and the rows.
pub(crate) async fn run(config: &Config) -> Result<(RunInfo, Vec<Row>)> {
    let Some(dir) = &config.storage.dir else {
        return fail("--backend posix needs --filepath DIR (where its files go)");
    };
    let s = &config.sweep;
    let n_files = config.storage.num_files;
    let backend = crate::backend::make(
        &config.backend,
        &config.backend_params,
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
    )?;
    let agent = Agent::builder("nixl-bench-storage")
        .backend_arc(backend.clone())
        .build()
        .await
        .context("start the agent")?;
    let buf_len = s.max_block_size * s.max_batch_size as u64;
    let buf = agent
        .register(AlignedBuf::try_new(buf_len as usize).context("allocate the buffer")?)
        .context("register the buffer")?;
    let per_file = s.max_batch_size.div_ceil(n_files) as u64 * s.max_block_size;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut files = Vec::with_capacity(n_files);
    for i in 0..n_files {
        let path = dir.join(format!("nixl-bench-{i}.dat"));
        let mem = Memory::open_file(
            &path,
            &FileOptions {
                create: true,
                direct: config.storage.direct,
                len: Some(per_file),
                ..FileOptions::default()
            },
        )
        .with_context(|| format!("open {}", path.display()))?;
        files.push(
            agent
                .register(mem)
                .with_context(|| format!("register {}", path.display()))?,
        );
    }
    let run = RunInfo {
        versions: Versions::current(),
        mode: "storage",
        backend: config.backend.clone(),
        backend_params: config.backend_params.iter().cloned().collect(),
        transport: Transport {
            initiator: format!(
                "{n_files} file(s) in {}{}",
                dir.display(),
                if config.storage.direct {
                    ", O_DIRECT"
                } else {
                    ""
                }
            ),
            target: "this agent's files".to_owned(),
            target_process: "this process".to_owned(),
            loopback: true,
            library: None,
            data_path: backend.data_path(""),
        },
        sweep: s.clone(),
        timeouts_s: config.timeouts,
        units: Units::default(),
        notes: config.notes.clone(),
        baselines: None,
    };
    let points = s.points();
    let mut out = Output::new(config.format, points.len(), s.op_types.len());
    out.begin(&run).context("write results")?;
    for point in points {
        let (block, batch) = (point.block_size, point.batch_size);
        let what = format!("{} {block} B x {batch}", point.op);
        let (warmup, iters) = s.iterations(block);
        let (local, remote) = lists(&buf, &files, block, batch);
        let options = RequestOptions {
            merge: s.merge_descriptors,
            ..RequestOptions::default()
        };
        let req = agent
            .create_request(point.op, &local, agent.name(), &remote, &options)
            .context(what.clone())?;
        out.progress(&format!("{what}: measuring"));
        let mut stats = PhaseStats {
            prep: Samples::with_capacity(0),
            post: Samples::with_capacity(iters),
            tx: Samples::with_capacity(iters),
            elapsed: Default::default(),
            segments: req.segments(),
            runs: req.segment_runs(),
        };
        let mut start = Instant::now();
        for i in 0..warmup + iters {
            if i == warmup {
                start = Instant::now();
            }
            let t0 = Instant::now();
            let xfer = req.post(None).context(what.clone())?;
            let t1 = Instant::now();
            tokio::time::timeout(config.timeouts.xfer, xfer)
                .await
                .map_err(|_| crate::error::BenchError::new(format!("{what}: timed out")))?
                .context(what.clone())?;
            if i >= warmup {
                stats.post.push(t1 - t0);
                stats.tx.push(t0.elapsed());
            }
        }
        stats.elapsed = start.elapsed();
        out.row(Row::new(point.op, block, batch, iters, 1, stats))
            .context("write results")?;
    }
    let rows = out.finish(&run).context("write results")?;
    let report = agent.shutdown().await;
    if !report.is_clean() {
        tracing::warn!(?report, "the agent did not stop cleanly");
    }
    Ok((run, rows))
}

/// Descriptor j: block j of the buffer, and file j % N at offset (j / N) x block.
fn lists(
    buf: &Registration,
    files: &[Registration],
    block: u64,
    batch: usize,
) -> (DescList, DescList) {
    let n = files.len();
    let local = DescList::from_descs(
        MemKind::Dram,
        (0..batch).map(|j| buf.desc(j as u64 * block, block)),
    );
    let fd = |j: usize| files[j % n].kind().device();
    let remote = DescList::from_descs(
        MemKind::File { fd: fd(0) },
        (0..batch).map(|j| Desc::new((j / n) as u64 * block, block, fd(j))),
    );
    (local, remote)
}
