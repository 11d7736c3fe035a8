//! A one-line progress indicator on stderr, shown only when stderr is a terminal (so
//! logs, pipes and tests stay clean).

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Redraws one line on stderr: `[3/15 12.4s] WRITE 16384 B x 1: measuring`.
#[derive(Debug)]
pub(crate) struct Progress {
    enabled: bool,
    total: usize,
    start: Instant,
    shown: bool,
}

impl Progress {
    pub(crate) fn new(total: usize) -> Self {
        Self {
            enabled: std::io::stderr().is_terminal(),
            total,
            start: Instant::now(),
            shown: false,
        }
    }

    /// Show that point `done + 1` of the total is at `what`.
    pub(crate) fn show(&mut self, done: usize, what: &str) {
        if !self.enabled {
            return;
        }
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r\x1b[2K[{}/{} {:.1}s] {what}",
            (done + 1).min(self.total),
            self.total,
            self.start.elapsed().as_secs_f64()
        );
        let _ = err.flush();
        self.shown = true;
    }

    /// Erase the line (before printing a row, and at the end).
    pub(crate) fn clear(&mut self) {
        if self.shown {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
            self.shown = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}
