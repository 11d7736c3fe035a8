//! Bandwidth and latency against block size as a small hand-written SVG: two panels,
//! log2 block-size axis, labelled ticks, a legend, one line per op/backend (and batch
//! size, when the sweep has several).

use std::fmt::Write;
use std::path::Path;

use nixl::Op;

use crate::error::{Context, Result};
use crate::report::RunInfo;
use crate::stats::Row;

const WIDTH: f64 = 960.0;
const PANEL_H: f64 = 330.0;
const TITLE_H: f64 = 44.0;
const LEFT: f64 = 84.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 26.0;
const BOTTOM: f64 = 52.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Write the plot of `rows` to `path`.
///
/// # Errors
/// The file cannot be written.
pub(crate) fn write(path: &Path, run: &RunInfo, rows: &[Row]) -> Result<()> {
    std::fs::write(path, render(run, rows))
        .with_context(|| format!("write the plot to {}", path.display()))
}

/// One line of the plot.
struct Series {
    label: String,
    /// (block size, value), in block-size order.
    points: Vec<(u64, f64)>,
}

fn series(run: &RunInfo, rows: &[Row], value: fn(&Row) -> f64) -> Vec<Series> {
    let mut keys: Vec<(Op, usize)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.op, r.batch_size)) {
            keys.push((r.op, r.batch_size));
        }
    }
    let batches = {
        let mut b: Vec<_> = keys.iter().map(|k| k.1).collect();
        b.sort_unstable();
        b.dedup();
        b.len()
    };
    keys.into_iter()
        .map(|(op, batch)| {
            let mut points: Vec<(u64, f64)> = rows
                .iter()
                .filter(|r| r.op == op && r.batch_size == batch)
                .map(|r| (r.block_size, value(r)))
                .collect();
            points.sort_by_key(|p| p.0);
            let mut label = format!("{op} {}", run.backend);
            if batches > 1 {
                let _ = write!(label, " batch {batch}");
            }
            Series { label, points }
        })
        .collect()
}

/// The SVG document.
pub(crate) fn render(run: &RunInfo, rows: &[Row]) -> String {
    let height = TITLE_H + 2.0 * PANEL_H;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
"#
    );
    let s = &run.sweep;
    let title = format!(
        "nixl-bench {}: {} backend, {} thread{} x pipeline depth {}, {}",
        run.versions.nixl_bench,
        run.backend,
        s.num_threads,
        if s.num_threads == 1 { "" } else { "s" },
        s.pipeline_depth,
        if run.transport.loopback {
            "loopback"
        } else {
            run.mode
        }
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
        WIDTH / 2.0,
        esc(&title)
    );
    panel(
        &mut svg,
        TITLE_H,
        "Bandwidth (GB/s, GB = 10^9 bytes)",
        &series(run, rows, |r| r.bw_gbps),
        Scale::Linear,
    );
    panel(
        &mut svg,
        TITLE_H + PANEL_H,
        "Avg latency (us, log scale)",
        &series(run, rows, |r| r.avg_lat_us),
        Scale::Log,
    );
    svg.push_str("</svg>\n");
    svg
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scale {
    Linear,
    Log,
}

/// A y axis: ticks (value, label) and a mapping to [0, 1].
struct Axis {
    lo: f64,
    hi: f64,
    scale: Scale,
    ticks: Vec<(f64, String)>,
    minor: Vec<f64>,
}

impl Axis {
    fn new(values: &[f64], scale: Scale) -> Self {
        match scale {
            Scale::Linear => {
                let max = values.iter().copied().fold(0.0_f64, f64::max);
                let max = if max > 0.0 { max } else { 1.0 };
                let step = nice_step(max / 5.0);
                let decimals = (-step.log10().floor()).max(0.0) as usize;
                let n = (max / step).ceil().max(1.0) as usize;
                let ticks = (0..=n)
                    .map(|i| {
                        let v = i as f64 * step;
                        (v, format!("{v:.decimals$}"))
                    })
                    .collect();
                Self {
                    lo: 0.0,
                    hi: n as f64 * step,
                    scale,
                    ticks,
                    minor: Vec::new(),
                }
            }
            Scale::Log => {
                let pos: Vec<f64> = values.iter().copied().filter(|v| *v > 0.0).collect();
                let min = pos.iter().copied().fold(f64::INFINITY, f64::min);
                let max = pos.iter().copied().fold(0.0_f64, f64::max);
                let (d0, mut d1) = if pos.is_empty() {
                    (0, 1)
                } else {
                    (min.log10().floor() as i32, max.log10().ceil() as i32)
                };
                if d1 <= d0 {
                    d1 = d0 + 1;
                }
                let ticks = (d0..=d1)
                    .map(|d| (10f64.powi(d), decade_label(d)))
                    .collect();
                let minor = (d0..d1)
                    .flat_map(|d| (2..10).map(move |m| m as f64 * 10f64.powi(d)))
                    .collect();
                Self {
                    lo: 10f64.powi(d0),
                    hi: 10f64.powi(d1),
                    scale,
                    ticks,
                    minor,
                }
            }
        }
    }

    /// Position in [0, 1] from the bottom.
    fn frac(&self, v: f64) -> f64 {
        match self.scale {
            Scale::Linear => (v - self.lo) / (self.hi - self.lo),
            Scale::Log => (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10()),
        }
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn decade_label(d: i32) -> String {
    match d {
        i32::MIN..=-1 => format!("{}", 10f64.powi(d)),
        0..=2 => format!("{}", 10u64.pow(d as u32)),
        3..=5 => format!("{}k", 10u64.pow(d as u32 - 3)),
        _ => format!("{}M", 10u64.pow((d - 6) as u32)),
    }
}

/// `4096` -> `4K`, `1048576` -> `1M`.
fn size_label(n: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

fn panel(svg: &mut String, top: f64, ytitle: &str, series: &[Series], scale: Scale) {
    let x0 = LEFT;
    let x1 = WIDTH - RIGHT;
    let y0 = top + TOP;
    let y1 = top + PANEL_H - BOTTOM;
    let (pw, ph) = (x1 - x0, y1 - y0);

    let blocks: Vec<u64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|b| *b > 0)
        .collect();
    let lmin = blocks
        .iter()
        .map(|b| (*b as f64).log2())
        .fold(f64::INFINITY, f64::min);
    let lmax = blocks
        .iter()
        .map(|b| (*b as f64).log2())
        .fold(f64::NEG_INFINITY, f64::max);
    let (lmin, lmax) = if blocks.is_empty() {
        (12.0, 13.0)
    } else if lmax - lmin < 1e-9 {
        (lmin - 0.5, lmax + 0.5)
    } else {
        (lmin, lmax)
    };
    let xpos = |b: u64| x0 + ((b as f64).log2() - lmin) / (lmax - lmin) * pw;
    let values: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .collect();
    let axis = Axis::new(&values, scale);
    let ypos = |v: f64| y1 - axis.frac(v) * ph;

    let _ = writeln!(svg, r#"<g class="panel">"#);
    // Grid and y ticks.
    for &m in &axis.minor {
        let y = ypos(m);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{x1:.1}" y2="{y:.1}" stroke="#f0f0f0"/>"##
        );
    }
    for (v, label) in &axis.ticks {
        let y = ypos(*v);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{x1:.1}" y2="{y:.1}" stroke="#dddddd"/>"##
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            x0 - 6.0,
            y + 4.0,
            esc(label)
        );
    }
    // X ticks: every power of two in range (every other one when crowded).
    let (k0, k1) = (lmin.ceil() as i64, lmax.floor() as i64);
    let every = if k1 - k0 > 14 { 2 } else { 1 };
    for k in (k0..=k1).filter(|k| (k - k0) % every == 0) {
        let b = 1u64 << k.clamp(0, 62);
        let x = xpos(b);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{y0:.1}" x2="{x:.1}" y2="{y1:.1}" stroke="#eeeeee"/>"##
        );
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{y1:.1}" x2="{x:.1}" y2="{:.1}" stroke="#333333"/>"##,
            y1 + 5.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            y1 + 19.0,
            size_label(b)
        );
    }
    // Frame and axis titles.
    let _ = writeln!(
        svg,
        r##"<rect x="{x0:.1}" y="{y0:.1}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#333333"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">Block size (bytes, log2 scale)</text>"#,
        x0 + pw / 2.0,
        y1 + 40.0
    );
    let (tx, ty) = (22.0, y0 + ph / 2.0);
    let _ = writeln!(
        svg,
        r#"<text text-anchor="middle" transform="translate({tx:.1},{ty:.1}) rotate(-90)">{}</text>"#,
        esc(ytitle)
    );
    // Lines, markers and legend.
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = s
            .points
            .iter()
            .filter(|p| scale == Scale::Linear || p.1 > 0.0)
            .map(|&(b, v)| format!("{:.1},{:.1}", xpos(b), ypos(v)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        for &(b, v) in &s.points {
            if scale == Scale::Log && v <= 0.0 {
                continue;
            }
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                xpos(b),
                ypos(v),
            );
        }
        let ly = y0 + 12.0 + i as f64 * 20.0;
        let lx = x1 + 16.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/>"#,
            lx + 24.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 30.0,
            ly + 4.0,
            esc(&s.label)
        );
    }
    let _ = writeln!(svg, "</g>");
}

/// Escape text for XML.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_nice() {
        assert_eq!(nice_step(0.23), 0.5);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(0.1), 0.1);
        let a = Axis::new(&[0.3, 2.7], Scale::Linear);
        let labels: Vec<_> = a.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(labels, ["0", "1", "2", "3"]);
        let a = Axis::new(&[0.3, 0.9], Scale::Linear);
        assert_eq!(a.ticks[1].1, "0.2");
        assert!(a.hi >= 0.9);
        let l = Axis::new(&[12.0, 4000.0], Scale::Log);
        let labels: Vec<_> = l.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(labels, ["10", "100", "1k", "10k"]);
        assert!((l.frac(100.0) - 1.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn labels_and_escaping() {
        assert_eq!(size_label(4096), "4K");
        assert_eq!(size_label(64 << 20), "64M");
        assert_eq!(size_label(1000), "1000");
        assert_eq!(esc("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
