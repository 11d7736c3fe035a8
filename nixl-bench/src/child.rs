//! The target as a child process (local mode): this same program re-executed with
//! `--role target --stdio`, its stdin/stdout the control channel, its stderr ours.
//!
//! The child is always reaped: [`TargetProcess`] kills and waits for it when dropped
//! (errors, Ctrl-C), and [`TargetProcess::wait`] bounds a normal exit. If this process
//! dies first, the child sees its stdin close and exits on its own.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::cli::Config;
use crate::control::Channel;
use crate::error::{fail, Context, Result};

/// A running target child. Dropping it kills and reaps the child.
#[derive(Debug)]
pub(crate) struct TargetProcess {
    child: Option<Child>,
    pid: u32,
}

impl TargetProcess {
    /// Start the target and return it with the control channel to it.
    ///
    /// # Errors
    /// This program's path cannot be found, or the child cannot be started.
    pub(crate) fn spawn(config: &Config) -> Result<(Self, Channel)> {
        let exe = std::env::current_exe().context("find this program to start the target")?;
        let mut cmd = Command::new(exe);
        cmd.args(["--role", "target", "--stdio", "--backend", &config.backend]);
        for (k, v) in &config.backend_params {
            cmd.arg("--backend-param").arg(format!("{k}={v}"));
        }
        let t = config.timeouts;
        for (flag, d) in [
            ("--connect-timeout", t.connect),
            ("--exchange-timeout", t.exchange),
            ("--xfer-timeout", t.xfer),
            ("--teardown-timeout", t.teardown),
        ] {
            cmd.arg(flag).arg(format!("{}ms", d.as_millis().max(1)));
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Its own process group: Ctrl-C in a terminal reaches only us, and we stop the
        // child in order instead of racing it.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn().context("start the target process")?;
        let pid = child.id();
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        // From here on, dropping the guard (any early return) stops the child.
        let guard = Self {
            child: Some(child),
            pid,
        };
        let (Some(stdin), Some(stdout)) = (stdin, stdout) else {
            return fail("the target process has no stdin/stdout pipe");
        };
        let stdin = tokio::process::ChildStdin::from_std(stdin)?;
        let stdout = tokio::process::ChildStdout::from_std(stdout)?;
        let channel = Channel::new(
            stdout,
            stdin,
            format!("the target (child process {pid})"),
            t.exchange,
        );
        Ok((guard, channel))
    }

    /// The child's process id.
    pub(crate) fn id(&self) -> u32 {
        self.pid
    }

    /// Wait up to `timeout` for the child to exit by itself, then kill it.
    ///
    /// # Errors
    /// It exited unsuccessfully, or had to be killed.
    pub(crate) async fn wait(mut self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        loop {
            if let Some(status) = child.try_wait().context("wait for the target")? {
                self.child = None;
                return if status.success() {
                    Ok(())
                } else {
                    fail(format!("the target process exited with {status}"))
                };
            }
            if tokio::time::Instant::now() >= deadline {
                // Drop kills and reaps it.
                return fail(format!(
                    "the target process did not exit within {timeout:?}; killed it"
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Killing first makes the wait short.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
