//! `--metrics-addr`: this process's agent metrics, served for Prometheus during a run.

use std::net::SocketAddr;

use nixl::TelemetryOptions;

use crate::cli::Config;
#[cfg(not(feature = "prometheus"))]
use crate::error::fail;
use crate::error::Result;

/// Histogram buckets for the `_seconds` metrics: 1 µs to 10 s.
#[cfg(feature = "prometheus")]
const BUCKETS: [f64; 15] = [
    1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 10.0,
];

/// What the bench's agents record: metrics when they are served.
pub(crate) fn telemetry(config: &Config) -> TelemetryOptions {
    TelemetryOptions {
        metrics: config.metrics_addr.is_some(),
        ..TelemetryOptions::default()
    }
}

/// Install the Prometheus recorder and serve it at `addr` (call inside the runtime).
///
/// # Errors
/// The address cannot be bound, or another recorder is installed.
#[cfg(feature = "prometheus")]
pub(crate) fn serve(addr: SocketAddr) -> Result<()> {
    use crate::error::Context;
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(&BUCKETS)
        .context("configure the metrics exporter")?
        .install()
        .with_context(|| format!("serve metrics on {addr}"))?;
    eprintln!("nixl-bench: metrics at http://{addr}/metrics");
    Ok(())
}

/// Without the `prometheus` feature: explain.
#[cfg(not(feature = "prometheus"))]
pub(crate) fn serve(addr: SocketAddr) -> Result<()> {
    fail(format!("--metrics-addr {addr} needs the `prometheus` feature (on by default): rebuild without --no-default-features, or with --features prometheus"))
}
