//! Timing samples and the figures nixlbench reports from them.

use std::time::Duration;

use nixl::Op;
use serde::Serialize;

/// Durations in microseconds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Samples(Vec<f64>);

impl Samples {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self(Vec::with_capacity(n))
    }

    pub(crate) fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64() * 1e6);
    }

    pub(crate) fn append(&mut self, other: &mut Self) {
        self.0.append(&mut other.0);
    }

    /// Mean (0 when empty).
    pub(crate) fn avg(&self) -> f64 {
        if self.0.is_empty() {
            0.0
        } else {
            self.0.iter().sum::<f64>() / self.0.len() as f64
        }
    }

    /// The median: element `n / 2` of the sorted samples (0 when empty). Next to the
    /// mean and the 99th percentile it shows whether times are bimodal.
    pub(crate) fn p50(&mut self) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        self.0.sort_by(f64::total_cmp);
        self.0[self.0.len() / 2]
    }

    /// The 99th percentile as nixlbench takes it: element `floor(n * 0.99)` of the
    /// sorted samples (0 when empty).
    pub(crate) fn p99(&mut self) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        self.0.sort_by(f64::total_cmp);
        let i = ((self.0.len() as f64 * 0.99) as usize).min(self.0.len() - 1);
        self.0[i]
    }
}

/// What one measured phase of a sweep point produced, all threads together.
#[derive(Debug, Default)]
pub(crate) struct PhaseStats {
    pub(crate) prep: Samples,
    pub(crate) post: Samples,
    pub(crate) tx: Samples,
    /// From starting the threads until the last one finished.
    pub(crate) elapsed: Duration,
    /// Segments per request after merging, and the runs of them the backend got
    /// (the most any thread's request had).
    pub(crate) segments: usize,
    pub(crate) runs: usize,
}

/// One line of results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Row {
    #[serde(serialize_with = "op_name")]
    pub(crate) op: Op,
    pub(crate) block_size: u64,
    pub(crate) batch_size: usize,
    /// GB/s, GB = 10^9 bytes.
    pub(crate) bw_gbps: f64,
    /// Elapsed time / (iterations per thread x batch size), nixlbench's "Avg Lat.".
    pub(crate) avg_lat_us: f64,
    pub(crate) avg_prep_us: f64,
    pub(crate) p99_prep_us: f64,
    pub(crate) avg_post_us: f64,
    pub(crate) p99_post_us: f64,
    pub(crate) avg_tx_us: f64,
    pub(crate) p50_tx_us: f64,
    pub(crate) p99_tx_us: f64,
    /// Segments per request after merging.
    pub(crate) segments: usize,
    /// Runs of segments the backend got per request (regularly spaced segments count
    /// once).
    pub(crate) segment_runs: usize,
}

fn op_name<S: serde::Serializer>(op: &Op, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(op)
}

impl Row {
    /// nixlbench's figures: bytes moved by all threads over the elapsed time, and the
    /// elapsed time per block of one thread.
    pub(crate) fn new(
        op: Op,
        block_size: u64,
        batch_size: usize,
        iters_per_thread: usize,
        threads: usize,
        mut phase: PhaseStats,
    ) -> Self {
        let elapsed_us = phase.elapsed.as_secs_f64() * 1e6;
        let bytes = block_size as f64 * batch_size as f64 * (iters_per_thread * threads) as f64;
        let per = |x: f64| if elapsed_us > 0.0 { x } else { 0.0 };
        Self {
            op,
            block_size,
            batch_size,
            bw_gbps: per(bytes / 1e9 / (elapsed_us / 1e6)),
            avg_lat_us: per(elapsed_us / (iters_per_thread * batch_size) as f64),
            avg_prep_us: phase.prep.avg(),
            p99_prep_us: phase.prep.p99(),
            avg_post_us: phase.post.avg(),
            p99_post_us: phase.post.p99(),
            avg_tx_us: phase.tx.avg(),
            p50_tx_us: phase.tx.p50(),
            p99_tx_us: phase.tx.p99(),
            segments: phase.segments,
            segment_runs: phase.runs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(v: &[f64]) -> Samples {
        Samples(v.to_vec())
    }

    #[test]
    fn avg_and_p99() {
        let mut s = samples(&(1..=100).rev().map(f64::from).collect::<Vec<_>>());
        assert_eq!(s.avg(), 50.5);
        // floor(100 * 0.99) = 99 -> the largest of 100.
        assert_eq!(s.p99(), 100.0);
        let mut one = samples(&[3.0]);
        assert_eq!((one.avg(), one.p99()), (3.0, 3.0));
        let mut none = Samples::default();
        assert_eq!((none.avg(), none.p99(), none.p50()), (0.0, 0.0, 0.0));
        let mut odd = samples(&[5.0, 1.0, 3.0]);
        assert_eq!(odd.p50(), 3.0);
    }

    #[test]
    fn row_follows_nixlbench() {
        let phase = PhaseStats {
            prep: samples(&[1.0]),
            post: samples(&[2.0, 4.0]),
            tx: samples(&[10.0, 30.0]),
            elapsed: Duration::from_millis(2),
            segments: 4,
            runs: 1,
        };
        // 2 threads x 10 iterations x 4 blocks of 1000 bytes in 2 ms = 40 MB/s... in GB/s.
        let r = Row::new(Op::Write, 1000, 4, 10, 2, phase);
        assert!((r.bw_gbps - 0.04).abs() < 1e-12, "{}", r.bw_gbps);
        // 2000 us / (10 x 4).
        assert!((r.avg_lat_us - 50.0).abs() < 1e-9);
        assert_eq!((r.avg_post_us, r.p99_post_us), (3.0, 4.0));
        assert_eq!((r.avg_tx_us, r.p50_tx_us, r.p99_tx_us), (20.0, 30.0, 30.0));
    }
}
