//! The target as a child process (local mode): this same program re-executed with
//! `--role target --control-socket PATH`.
//!
//! The control channel is a Unix socket of its own, never the child's stdin/stdout:
//! native libraries print there (UCX with `UCX_PROTO_INFO=y`, CUDA, verbs providers), and
//! a line of theirs must not end the run as a bad message. We listen on a socket in a
//! private (0700) directory made for this run, the child connects to it, and we take the
//! one connection whose peer is the child (`SO_PEERCRED`); the directory goes as soon as
//! it has connected. The child's stdin is empty, and what it prints on stdout or stderr
//! goes to our stderr, where it cannot mix into the report on our stdout either.
//!
//! A path and a connection, rather than a socket pair inherited by the child: handing
//! an extra descriptor across `exec` needs `unsafe` (`pre_exec`), and this crate forbids
//! it.
//!
//! The child is always reaped: [`TargetProcess`] kills and waits for it when dropped
//! (errors, Ctrl-C), and [`TargetProcess::wait`] bounds a normal exit. If this process
//! dies first, the child sees the socket close and exits on its own.

use std::fs::DirBuilder;
use std::io::ErrorKind;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::net::{UnixListener, UnixStream};

use crate::cli::Config;
use crate::control::Channel;
use crate::error::{fail, Context, Result};

/// How often the parent looks for a child that died before connecting.
const POLL: Duration = Duration::from_millis(20);

/// A running target child. Dropping it kills and reaps the child.
#[derive(Debug)]
pub(crate) struct TargetProcess {
    child: Option<Child>,
    pid: u32,
}

impl TargetProcess {
    /// Start the target and return it with the control channel to it, once the child
    /// has connected (within the connect timeout).
    ///
    /// # Errors
    /// The control socket cannot be made, this program's path cannot be found, the
    /// child cannot be started, or it exits or does not connect in time.
    pub(crate) async fn spawn(config: &Config) -> Result<(Self, Channel)> {
        let dir = PrivateDir::create()?;
        let path = dir.path().join("control.sock");
        let listener = UnixListener::bind(&path).with_context(|| {
            format!(
                "listen on the control socket {} (a shorter TMPDIR helps if the path is too long)",
                path.display()
            )
        })?;
        let exe = std::env::current_exe().context("find this program to start the target")?;
        let mut cmd = Command::new(exe);
        cmd.args(["--role", "target", "--backend", &config.backend])
            .arg("--control-socket")
            .arg(&path);
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
        // Our stdout is the report: the child's chatter goes to our stderr.
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(std::io::stderr()))
            .stderr(Stdio::inherit());
        // Its own process group: Ctrl-C in a terminal reaches only us, and we stop the
        // child in order instead of racing it.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd.spawn().context("start the target process")?;
        let pid = child.id();
        // From here on, dropping the guard (any early return) stops the child.
        let mut guard = Self {
            child: Some(child),
            pid,
        };
        let stream = guard.accept(&listener, t.connect).await?;
        // Nobody else may connect now; the socket's file goes with its directory.
        drop((listener, dir));
        let (r, w) = stream.into_split();
        let channel = Channel::new(
            r,
            w,
            format!("the target (child process {pid})"),
            t.exchange,
        );
        Ok((guard, channel))
    }

    /// The child's connection on `listener`, within `timeout`. Connections from any
    /// other process are turned away.
    async fn accept(&mut self, listener: &UnixListener, timeout: Duration) -> Result<UnixStream> {
        let deadline = tokio::time::Instant::now() + timeout;
        let pid = i32::try_from(self.pid).ok();
        loop {
            tokio::select! {
                // `accept` is cancel safe: a connection is never lost to the timer.
                accepted = listener.accept() => {
                    let (stream, _) = accepted.context("accept the target's control connection")?;
                    match stream.peer_cred() {
                        Ok(cred) if cred.pid().is_some() && cred.pid() == pid => return Ok(stream),
                        _ => tracing::warn!("turned away a control connection from another process"),
                    }
                }
                () = tokio::time::sleep(POLL) => {
                    if let Some(child) = self.child.as_mut() {
                        if let Some(status) = child.try_wait().context("wait for the target")? {
                            self.child = None;
                            return fail(format!(
                                "the target process exited with {status} before it connected"
                            ));
                        }
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return fail(format!(
                            "the target process did not connect within {timeout:?} (raise --connect-timeout to wait longer)"
                        ));
                    }
                }
            }
        }
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

/// Child side: the control channel to the parent that started us
/// (`--control-socket PATH`).
///
/// # Errors
/// The socket cannot be reached (the parent is gone, or gave up waiting).
pub(crate) async fn connect(path: &Path, write_timeout: Duration) -> Result<Channel> {
    let stream = UnixStream::connect(path).await.with_context(|| {
        format!(
            "connect to the initiator's control socket {}",
            path.display()
        )
    })?;
    let (r, w) = stream.into_split();
    Ok(Channel::new(
        r,
        w,
        "the initiator (parent process)",
        write_timeout,
    ))
}

/// A directory only this user can enter, removed (with what is in it) when dropped.
#[derive(Debug)]
struct PrivateDir(PathBuf);

impl PrivateDir {
    /// A new directory under the system's temporary directory.
    fn create() -> Result<Self> {
        let base = std::env::temp_dir();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        for n in 0..16 {
            let path = base.join(format!(
                "nixl-bench-{}-{:x}",
                std::process::id(),
                nanos.wrapping_add(n)
            ));
            // `create`, not `create_all`: it fails on anything already there (a stale
            // directory, or someone's link), and we try the next name.
            match DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(Self(path)),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("create {}", path.display()));
                }
            }
        }
        fail(format!(
            "could not create a private directory in {} (16 names taken)",
            base.display()
        ))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Set in the target child's environment, makes it print junk to its stdout and stderr
/// before and during the run, as a chatty native library would (`UCX_PROTO_INFO=y`).
/// For tests: the control channel must not care.
pub(crate) const NOISE_ENV: &str = "NIXL_BENCH_TEST_NOISE";

/// Print junk while it lives, if [`NOISE_ENV`] is set (see there).
#[derive(Debug)]
pub(crate) struct Noise(Option<tokio::task::JoinHandle<()>>);

impl Noise {
    /// Start the noise (nothing unless [`NOISE_ENV`] is set).
    pub(crate) fn start() -> Self {
        if std::env::var_os(NOISE_ENV).is_none() {
            return Self(None);
        }
        Self::burst(0);
        Self(Some(tokio::spawn(async {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            for n in 1.. {
                tick.tick().await;
                Self::burst(n);
            }
        })))
    }

    /// Lines that look like control messages, a line cut short, bytes that are not
    /// UTF-8: all a peer reading this stdout as the channel would choke on.
    fn burst(n: u64) {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = write!(
            out,
            "[noise on stdout {n}] ucp_ep proto info\nmetadata zz\nbye\n"
        );
        let _ = out.write_all(b"\xff\xfe partial");
        let _ = out.flush();
        eprintln!("[noise on stderr {n}] ucp_context lane 0");
    }
}

impl Drop for Noise {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}
