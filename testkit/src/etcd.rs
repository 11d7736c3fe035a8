//! A real etcd server for tests: started from the host's `etcd` binary on loopback with
//! a temporary data directory and free ports, stopped by its pid.

use std::net::TcpListener;
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
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
        let Some(bin) = binary() else {
            crate::skip(
                case,
                "no etcd binary (install Debian etcd-server or set NIXL_ETCD_BIN)",
            );
            return None;
        };
        let dir =
            std::env::temp_dir().join(format!("nixl-etcd-{}-{}", std::process::id(), free_port()));
        let mut s = Self {
            child: None,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
        };
        s.spawn(&bin).await;
        Some(s)
    }

    async fn spawn(&mut self, bin: &PathBuf) {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(bin)
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
            if let Ok(mut c) = etcd_client::Client::connect([self.endpoint()], None).await {
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
        format!("http://127.0.0.1:{}", self.client_port)
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
