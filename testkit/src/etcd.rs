//! A real etcd server for tests: started from the host's `etcd` binary on loopback with
//! a temporary data directory and free ports, stopped by its pid.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running etcd.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    tls: Option<ServerTls>,
    /// How the readiness check connects.
    probe: Option<etcd_client::ConnectOptions>,
}

/// TLS for a test etcd: its certificate and key, and the CA client certificates must
/// chain to (`--client-cert-auth`), all PEM files.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// Server certificate (PEM file).
    pub cert: PathBuf,
    /// Its private key (PEM file).
    pub key: PathBuf,
    /// CA of the client certificates etcd accepts (PEM file).
    pub client_ca: PathBuf,
    /// More etcd flags (e.g. `--auth-token-ttl=1`).
    pub args: Vec<String>,
}

/// The etcd binary: `NIXL_ETCD_BIN`, else `etcd` on `PATH`.
pub fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NIXL_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    })
}

impl EtcdServer {
    /// Start etcd and wait until it answers; `None` (after a SKIP line) when there is
    /// no etcd binary.
    pub async fn start(case: &str) -> Option<Self> {
        Self::start_with(case, None, None).await
    }

    /// Start etcd serving clients over TLS only (`https://`), requiring client
    /// certificates signed by `tls.client_ca`; `probe` connects for the readiness check
    /// (it needs the CA and a client identity). `None` (after a SKIP line) without an
    /// etcd binary.
    pub async fn start_tls(
        case: &str,
        tls: ServerTls,
        probe: etcd_client::ConnectOptions,
    ) -> Option<Self> {
        Self::start_with(case, Some(tls), Some(probe)).await
    }

    async fn start_with(
        case: &str,
        tls: Option<ServerTls>,
        probe: Option<etcd_client::ConnectOptions>,
    ) -> Option<Self> {
        let Some(bin) = binary() else {
            crate::skip(
                case,
                "no etcd binary (install Debian etcd-server or set NIXL_ETCD_BIN)",
            );
            return None;
        };
        let dir = std::env::temp_dir().join(format!(
            "nixl-etcd-{}-{}",
            std::process::id(),
            crate::free_port()
        ));
        let mut s = Self {
            child: None,
            dir,
            client_port: crate::free_port(),
            peer_port: crate::free_port(),
            tls,
            probe,
        };
        s.spawn(&bin).await;
        Some(s)
    }

    async fn spawn(&mut self, bin: &PathBuf) {
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(bin);
        if let Some(t) = &self.tls {
            cmd.arg(format!("--cert-file={}", t.cert.display()))
                .arg(format!("--key-file={}", t.key.display()))
                .arg(format!("--trusted-ca-file={}", t.client_ca.display()))
                .arg("--client-cert-auth")
                .args(&t.args);
        }
        let child = cmd
            .arg("--name=nixl-test")
            .arg(format!("--data-dir={}", self.dir.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=nixl-test={peer}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        for _ in 0..200 {
            if let Ok(mut c) =
                etcd_client::Client::connect([self.endpoint()], self.probe.clone()).await
            {
                if c.get("/ready", None).await.is_ok() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("etcd did not come up on {}", self.endpoint());
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Kill etcd (SIGKILL) and wait for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same ports and data directory.
    pub async fn restart(&mut self) {
        self.stop();
        let bin = binary().expect("etcd binary");
        self.spawn(&bin).await;
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
