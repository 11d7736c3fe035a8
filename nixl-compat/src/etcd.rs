//! NIXL's etcd metadata exchange for the drop-in surfaces: the metadata calls given
//! no IP address use etcd, as NIXL's do, at the endpoints `NIXL_ETCD_ENDPOINTS`
//! names (comma-separated), through the core's `nixl::exchange::EtcdExchange`
//! (feature `etcd`).
//!
//! An agent with a NIXL-speaking backend (UCX) uses NIXL's key layout and format under
//! `NIXL_ETCD_NAMESPACE` (NIXL's default when unset), so NIXL agents of the same etcd
//! find it and it finds them; other agents (TCP alone) use this crate's layout, in
//! the namespace `nixl`. The connection is made at the first such call and lasts as
//! long as the agent (its keys go with the agent's lease).

use std::sync::Arc;

use nixl::{Agent, ErrorKind};

/// Where NIXL's agents find etcd.
const ENV_ENDPOINTS: &str = "NIXL_ETCD_ENDPOINTS";
/// NIXL's key namespace (NIXL layout only).
#[cfg(feature = "etcd")]
const ENV_NAMESPACE: &str = "NIXL_ETCD_NAMESPACE";
/// How long a fetch waits for the peer's key to appear.
#[cfg(feature = "etcd")]
const FETCH_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// One agent's etcd exchange, connected at first use.
#[derive(Default, Debug)]
pub struct Etcd {
    #[cfg(feature = "etcd")]
    exchange: tokio::sync::OnceCell<nixl::exchange::EtcdExchange>,
}

/// The endpoints `NIXL_ETCD_ENDPOINTS` names; `NotSupported` when it is unset or
/// this build has no etcd, before anything starts in the background.
fn endpoints(op: &'static str) -> nixl::Result<Vec<String>> {
    let not_supported = |why: String| nixl::Error::new(ErrorKind::NotSupported, op, why);
    if cfg!(not(feature = "etcd")) {
        return Err(not_supported(
            "without an IP address NIXL uses etcd, and this build of nixl-rs has none (build with the feature `etcd`); give the IP address and port of the peer's listener".into(),
        ));
    }
    let list: Vec<String> = std::env::var(ENV_ENDPOINTS)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if list.is_empty() {
        return Err(not_supported(format!(
            "without an IP address NIXL uses etcd, and {ENV_ENDPOINTS} is not set; set it (e.g. http://127.0.0.1:2379) or give ip_addr and port of the peer's listener"
        )));
    }
    Ok(list)
}

/// One metadata call for etcd, ready to run in the background.
#[allow(missing_debug_implementations)]
// Without the feature a call is never made (`Call::new` refuses), so nothing reads it.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub struct Call {
    etcd: Arc<Etcd>,
    agent: Agent,
    /// The agent speaks NIXL (NIXL's layout).
    nixl: bool,
    endpoints: Vec<String>,
}

impl Call {
    /// A call for `op`.
    ///
    /// # Errors
    /// `NotSupported` when etcd is not there (no endpoints, or not in this build).
    pub fn new(etcd: Arc<Etcd>, agent: Agent, nixl: bool, op: &'static str) -> nixl::Result<Self> {
        Ok(Self {
            endpoints: endpoints(op)?,
            etcd,
            agent,
            nixl,
        })
    }
}

#[cfg(feature = "etcd")]
impl Call {
    async fn exchange(self) -> nixl::Result<nixl::exchange::EtcdExchange> {
        use nixl::exchange::{EtcdExchange, EtcdOptions};
        let Self {
            etcd,
            agent,
            nixl,
            endpoints,
        } = self;
        etcd.exchange
            .get_or_try_init(|| async {
                let mut options = EtcdOptions {
                    endpoints,
                    ..EtcdOptions::default()
                };
                if nixl {
                    options = options.nixl_layout();
                    if let Ok(ns) = std::env::var(ENV_NAMESPACE) {
                        options.namespace = ns;
                    }
                }
                EtcdExchange::connect(&agent, options).await
            })
            .await
            .cloned()
    }

    /// Publish the agent's full metadata.
    pub async fn publish(self) -> nixl::Result<()> {
        self.exchange().await?.publish().await
    }

    /// Load `peer`'s full metadata (`label` empty) or its partial metadata under
    /// `label`, waiting up to 30 s for it to appear; a full fetch then
    /// follows the peer (reloaded when it publishes again, forgotten when it goes).
    pub async fn fetch(self, peer: String, label: String) -> nixl::Result<()> {
        let x = self.exchange().await?;
        if label.is_empty() {
            x.fetch(&peer, FETCH_WAIT).await
        } else {
            x.fetch_partial(&peer, &label, FETCH_WAIT).await
        }
    }

    /// Withdraw everything this agent published (peers following it forget it).
    pub async fn invalidate(self) -> nixl::Result<()> {
        self.exchange().await?.invalidate().await
    }
}

/// Without the feature [`Call::new`] refuses, so none of these runs.
#[cfg(not(feature = "etcd"))]
impl Call {
    fn absent() -> nixl::Error {
        nixl::Error::new(
            nixl::ErrorKind::NotSupported,
            "etcd",
            "this build of nixl_rs has no etcd",
        )
    }

    /// Not in this build.
    pub async fn publish(self) -> nixl::Result<()> {
        Err(Self::absent())
    }

    /// Not in this build.
    pub async fn fetch(self, _: String, _: String) -> nixl::Result<()> {
        Err(Self::absent())
    }

    /// Not in this build.
    pub async fn invalidate(self) -> nixl::Result<()> {
        Err(Self::absent())
    }
}
