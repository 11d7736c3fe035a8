//! Metadata exchange through etcd (cargo feature `etcd`).
//!
//! Keys: `/<namespace>/<agent>/full` for full metadata and `/<namespace>/<agent>/<label>`
//! for labelled partial metadata, all attached to one lease that a tracked task keeps
//! alive. A crashed agent stops renewing, its lease expires and etcd deletes its keys;
//! peers that fetched it watch its keys and forget it when they go, which fails their
//! in-flight transfers to it. When etcd is unreachable, operations fail with clear
//! errors after their timeout and the background tasks retry with backoff; when the
//! lease was lost meanwhile, a new one is granted and everything published is put
//! again.
//!
//! # Securing etcd
//! [`EtcdOptions::tls`] connects over TLS (`https://` endpoints), verifying etcd's
//! certificate against a CA you give and presenting a client certificate where etcd
//! asks for one (`--client-cert-auth`); [`EtcdOptions::auth`] logs in with etcd's
//! user/password authentication. Refused credentials fail [`EtcdExchange::connect`]
//! with [`ErrorKind::NotAllowed`]; a certificate that does not verify fails it with
//! [`ErrorKind::Backend`] naming the TLS error. Nothing is read or published then.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{
    Certificate, Client, ConnectOptions, DeleteOptions, EventType, Identity, PutOptions,
    TlsOptions, WatchOptions,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::side_channel::check_label;
use super::FULL_LABEL;
use crate::agent::WeakAgent;
use crate::agent::{Agent, Trust};
use crate::error::{err, Error, ErrorKind, Result};
use crate::region::Registration;

/// Options for [`EtcdExchange`].
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// etcd client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Key namespace (default `nixl`): keys are `/<namespace>/<agent>/<label>`.
    pub namespace: String,
    /// Lease TTL: how long a crashed agent's keys outlive it.
    pub lease_ttl: Duration,
    /// Bound for each etcd operation.
    pub timeout: Duration,
    /// Longest wait between retries while etcd is unreachable.
    pub max_backoff: Duration,
    /// TLS for the connection (endpoints must then be `https://`). Default: none.
    pub tls: Option<EtcdTls>,
    /// etcd user/password authentication. Default: none.
    pub auth: Option<EtcdAuth>,
    /// Whose key layout and metadata format to use. Default: this crate's.
    pub layout: EtcdLayout,
}

/// Key layout and metadata format of an [`EtcdExchange`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EtcdLayout {
    /// This crate's: `/<namespace>/<agent>/full` (and `/<label>`), this crate's format.
    #[default]
    Native,
    /// NIXL's (its `NIXL_ETCD_ENDPOINTS` metadata backend), so NIXL agents and this
    /// crate's agents find each other through one etcd: `<namespace>/<agent>/metadata`
    /// for full metadata and `<namespace>/<agent>/<label>` for partial metadata, with
    /// the namespace as NIXL's `NIXL_ETCD_NAMESPACE` gives it (NIXL's default
    /// `/nixl/agents/` makes keys such as `/nixl/agents//prefill/metadata`), values in
    /// NIXL's format ([`Agent::nixl_metadata`]). Fetching loads either format.
    ///
    /// Keys go under this agent's lease, as in the native layout (NIXL puts its own
    /// without one): they vanish when this agent stops. As NIXL does, the exchange
    /// announces the agent with an empty key `<namespace>/<agent>/` when it connects;
    /// NIXL agents that loaded this agent watch that key and forget the agent when it
    /// goes (at [`EtcdExchange::invalidate`], at shutdown, or when the lease expires;
    /// [`EtcdExchange::publish`] announces it again). NIXL agents do not fetch again
    /// by themselves: after an outage longer than the lease, which makes them forget
    /// this agent, they must fetch it anew.
    Nixl,
}

/// NIXL's default etcd namespace (`NIXL_ETCD_NAMESPACE` unset).
pub const NIXL_ETCD_NAMESPACE: &str = "/nixl/agents/";
/// The label NIXL keeps full metadata under.
pub const NIXL_FULL_LABEL: &str = "metadata";

/// TLS for the etcd connection.
#[derive(Clone, Default)]
pub struct EtcdTls {
    /// PEM of the CA(s) etcd's server certificate must chain to.
    pub ca_pem: Vec<u8>,
    /// Client certificate and its private key (both PEM), for an etcd that requires
    /// client certificates (`--client-cert-auth`).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Name to verify the server certificate against, instead of the endpoint's host.
    pub domain: Option<String>,
}

impl EtcdTls {
    /// Read the CA and, optionally, a client certificate and key from PEM files.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming a file that cannot be read.
    pub fn from_files(
        ca: &std::path::Path,
        identity: Option<(&std::path::Path, &std::path::Path)>,
    ) -> Result<Self> {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    "etcd TLS",
                    format!("cannot read {}", p.display()),
                )
                .with_source(e)
            })
        };
        Ok(Self {
            ca_pem: read(ca)?,
            identity: match identity {
                Some((c, k)) => Some((read(c)?, read(k)?)),
                None => None,
            },
            domain: None,
        })
    }
}

impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem", &format_args!("{} bytes", self.ca_pem.len()))
            .field("client_certificate", &self.identity.is_some())
            .field("domain", &self.domain)
            .finish()
    }
}

/// etcd user/password authentication.
#[derive(Clone)]
pub struct EtcdAuth {
    /// The etcd user.
    pub user: String,
    /// Its password (never printed by `Debug`).
    pub password: String,
}

impl fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl EtcdOptions {
    /// An etcd client connected as these options say (endpoints, TLS, authentication,
    /// timeouts), for applications that also keep keys of their own in etcd.
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] when etcd refuses the credentials;
    /// [`ErrorKind::TimedOut`] or [`ErrorKind::Backend`] when it cannot be reached (a
    /// certificate that does not verify is a [`ErrorKind::Backend`] error).
    pub async fn client(&self) -> Result<Client> {
        const OP: &str = "connect to etcd";
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(self.timeout)
            .with_timeout(self.timeout);
        if let Some(t) = &self.tls {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(&t.ca_pem));
            if let Some((cert, key)) = &t.identity {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            if let Some(d) = &t.domain {
                tls = tls.domain_name(d.clone());
            }
            connect = connect.with_tls(tls);
        }
        if let Some(a) = &self.auth {
            // etcd's simple tokens expire (5 minutes by default): log in again when one
            // has, rather than failing every request after that.
            connect = connect
                .with_user(a.user.clone(), a.password.clone())
                .with_auto_token_refresh(true);
        }
        bounded(
            self.timeout,
            OP,
            Client::connect(&self.endpoints, Some(connect)),
        )
        .await
    }
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            namespace: "nixl".into(),
            lease_ttl: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            max_backoff: Duration::from_secs(2),
            tls: None,
            auth: None,
            layout: EtcdLayout::Native,
        }
    }
}

impl EtcdOptions {
    /// These options with NIXL's key layout and format ([`EtcdLayout::Nixl`]) and
    /// NIXL's default namespace ([`NIXL_ETCD_NAMESPACE`]); set
    /// [`EtcdOptions::namespace`] afterwards to what the NIXL agents'
    /// `NIXL_ETCD_NAMESPACE` says.
    #[must_use]
    pub fn nixl_layout(mut self) -> Self {
        self.layout = EtcdLayout::Nixl;
        self.namespace = NIXL_ETCD_NAMESPACE.to_owned();
        self
    }
}

/// An agent's connection to etcd: publishes its metadata under a lease, fetches peers
/// and watches them. Cheap to clone.
#[derive(Clone)]
pub struct EtcdExchange {
    inner: Arc<Inner>,
}

struct Inner {
    agent: WeakAgent,
    name: String,
    prefix: String,
    options: EtcdOptions,
    client: Client,
    lease: Mutex<i64>,
    /// label -> bytes, for re-publishing under a new lease.
    published: Mutex<BTreeMap<String, Bytes>>,
    /// key -> value of keys claimed under the lease, for claiming again under a new one.
    claims: Mutex<BTreeMap<String, Bytes>>,
    /// Peers a watch follows (one watch per peer, however often it is fetched; the
    /// watch takes its peer out when it stops following it).
    watching: Mutex<std::collections::HashSet<String>>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl fmt::Debug for EtcdExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdExchange")
            .field("agent", &self.inner.name)
            .field("prefix", &self.inner.prefix)
            .field("lease", &self.lease_id())
            .finish()
    }
}

fn etcd_err(op: &'static str, e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    // etcd says "authentication failed" and "user name is empty" with InvalidArgument,
    // a bad or missing token with Unauthenticated, a missing permission with
    // PermissionDenied.
    let refused = matches!(&e, E::GRpcStatus(s) if match s.code() {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => true,
        tonic::Code::InvalidArgument => {
            let m = s.message();
            m.contains("authentication failed") || m.contains("user name is empty")
        }
        _ => false,
    });
    if refused {
        return Error::new(ErrorKind::NotAllowed, op, "etcd refused the credentials")
            .with_source(e);
    }
    Error::new(ErrorKind::Backend, op, "etcd request failed").with_source(e)
}

/// Whether `e` came from an etcd error for which `f` holds.
fn source_is(e: &Error, f: impl Fn(&etcd_client::Error) -> bool) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<etcd_client::Error>())
        .is_some_and(f)
}

async fn bounded<T>(
    timeout: Duration,
    op: &'static str,
    f: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(|e| etcd_err(op, e)),
        Err(_) => err(
            ErrorKind::TimedOut,
            op,
            format!("etcd did not answer within {timeout:?}"),
        ),
    }
}

fn normalize_namespace(ns: &str) -> Result<String> {
    let ns = ns.trim_matches('/');
    if ns.is_empty() || ns.contains("//") {
        return err(
            ErrorKind::InvalidArgument,
            "etcd namespace",
            format!("namespace {ns:?} must be non-empty without empty segments"),
        );
    }
    Ok(ns.to_owned())
}

impl EtcdExchange {
    /// Connect `agent` to etcd and grant its lease. The lease keeper runs through the
    /// agent's task tracker; the agent's shutdown revokes the lease (deleting every key
    /// published through this exchange).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a bad namespace or name; [`ErrorKind::TimedOut`]
    /// or [`ErrorKind::Backend`] when etcd cannot be reached.
    pub async fn connect(agent: &Agent, options: EtcdOptions) -> Result<Self> {
        const OP: &str = "connect to etcd";
        if agent.name().contains('/') {
            return err(
                ErrorKind::InvalidArgument,
                OP,
                "agent names used with etcd must not contain '/'",
            );
        }
        let prefix = match options.layout {
            EtcdLayout::Native => format!("/{}/", normalize_namespace(&options.namespace)?),
            // NIXL joins namespace, agent and label with '/', as given.
            EtcdLayout::Nixl if !options.namespace.is_empty() => {
                format!("{}/", options.namespace)
            }
            EtcdLayout::Nixl => {
                return err(
                    ErrorKind::InvalidArgument,
                    OP,
                    "the etcd namespace is empty",
                )
            }
        };
        let mut client = options.client().await?;
        // With authentication on, any user may grant a lease: check that this one may
        // read the namespace now, so missing rights fail here, clearly, and not at the
        // first publish or fetch.
        bounded(
            options.timeout,
            OP,
            client.get(
                prefix.as_bytes(),
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            ),
        )
        .await?;
        let ttl = options.lease_ttl.as_secs().max(1) as i64;
        let lease = bounded(options.timeout, OP, client.lease_grant(ttl, None))
            .await?
            .id();
        let inner = Arc::new(Inner {
            agent: agent.downgrade(),
            name: agent.name().to_owned(),
            prefix,
            options,
            client,
            lease: Mutex::new(lease),
            published: Mutex::new(BTreeMap::new()),
            claims: Mutex::new(BTreeMap::new()),
            watching: Mutex::default(),
            cancel: agent.child_token(),
            tracker: agent.tracker().clone(),
        });
        tracing::info!(agent = %inner.name, lease, "etcd: connected");
        if inner.options.layout == EtcdLayout::Nixl {
            // NIXL announces an agent with an empty key, `<namespace>/<agent>/`: NIXL
            // agents that loaded it watch that key and forget the agent when it goes.
            // (Before the lease keeper starts: a failure here leaves the lease to expire.)
            inner.put("", Bytes::new()).await?;
        }
        let keeper = inner.clone();
        inner.tracker.spawn(async move {
            let cancel = keeper.cancel.clone();
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = keeper.keep_lease() => {}
            }
        });
        let revoker = inner.clone();
        agent.on_shutdown(Box::new(move || {
            Box::pin(async move { revoker.revoke().await })
        }));
        Ok(Self { inner })
    }

    /// The current lease id.
    pub fn lease_id(&self) -> i64 {
        *self.inner.lease.lock().unwrap()
    }

    /// The key for `agent` and `label`.
    pub fn key(&self, agent: &str, label: &str) -> String {
        format!("{}{agent}/{label}", self.inner.prefix)
    }

    /// Create `key` (any key, in the namespace or not) holding `value` under this
    /// agent's lease, only if nobody holds it: `Ok(None)` once created, `Ok(Some(value
    /// there))` when the key exists. A claimed key goes with the lease (at shutdown, or
    /// within the TTL when the agent dies) and, when the lease was lost (etcd out of
    /// reach for longer than the TTL), is created again under the new one if it is
    /// still free. For a role only one process may hold, such as a benchmark group's
    /// target.
    ///
    /// # Errors
    /// etcd errors.
    pub async fn claim(&self, key: &str, value: impl Into<Bytes>) -> Result<Option<Bytes>> {
        let value = value.into();
        let held = self.inner.create_if_absent(key, value.clone()).await?;
        if held.is_none() {
            self.inner
                .claims
                .lock()
                .unwrap()
                .insert(key.to_owned(), value);
        }
        Ok(held)
    }

    /// Publish the agent's full metadata (again, after registering more memory).
    ///
    /// # Errors
    /// [`ErrorKind::ShutDown`] when the agent is gone; etcd errors.
    pub async fn publish(&self) -> Result<()> {
        let agent = self.inner.agent()?;
        let md = match self.inner.options.layout {
            EtcdLayout::Native => agent.metadata()?,
            EtcdLayout::Nixl => {
                // Announce again (after an invalidate), before the metadata.
                self.inner.put("", Bytes::new()).await?;
                agent.nixl_metadata()?
            }
        };
        self.inner.put(self.inner.full(), md).await
    }

    /// Publish partial metadata (only `registrations`) under `label`; the side channel
    /// serves it too.
    ///
    /// # Errors
    /// As [`Agent::publish_partial`]; etcd errors.
    pub async fn publish_partial(
        &self,
        label: &str,
        registrations: &[Registration],
        with_conn_info: bool,
    ) -> Result<()> {
        let agent = self.inner.agent()?;
        let md = match self.inner.options.layout {
            EtcdLayout::Native => {
                agent.publish_partial(label, registrations, with_conn_info)?;
                agent.partial_metadata(registrations, with_conn_info)?
            }
            EtcdLayout::Nixl => {
                self.inner.check_label(label, "etcd publish")?;
                agent.nixl_partial_metadata(registrations, with_conn_info)?
            }
        };
        self.inner.put(label, md).await
    }

    /// Load `peer`'s full metadata, waiting (up to `timeout`) for it to appear; then
    /// watch the peer: when its keys are deleted or expire it is forgotten, and when it
    /// publishes again it is reloaded (a restarted peer, wherever it now is: whoever
    /// may write the peer's keys in etcd is trusted with them). Metadata under the
    /// peer's keys that names another agent is refused, fetched or watched, and
    /// nothing is loaded from it.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] when it did not appear in time; [`ErrorKind::Mismatch`]
    /// when the metadata under `peer`'s key names another agent; etcd and load errors.
    pub async fn fetch(&self, peer: &str, timeout: Duration) -> Result<()> {
        self.fetch_label(peer, self.inner.full(), timeout).await
    }

    /// Load `peer`'s partial metadata published under `label` (waiting up to `timeout`).
    ///
    /// # Errors
    /// As [`EtcdExchange::fetch`].
    pub async fn fetch_partial(&self, peer: &str, label: &str, timeout: Duration) -> Result<()> {
        self.inner.check_label(label, "etcd fetch")?;
        self.fetch_label(peer, label, timeout).await
    }

    async fn fetch_label(&self, peer: &str, label: &str, timeout: Duration) -> Result<()> {
        const OP: &str = "etcd fetch";
        let key = self.key(peer, label);
        let (value, revision) = match tokio::time::timeout(timeout, self.inner.wait_for(&key)).await
        {
            Ok(r) => r?,
            Err(_) => {
                return err(
                    ErrorKind::TimedOut,
                    OP,
                    format!("{key} did not appear within {timeout:?}"),
                )
            }
        };
        let agent = self.inner.agent()?;
        // The key names the peer: metadata there naming another agent is refused.
        agent.load_metadata_from(&value, Some(peer), Trust::Full)?;
        // A peer fetched again (a caller retrying) is already followed.
        if label == self.inner.full() && self.inner.watching.lock().unwrap().insert(peer.to_owned())
        {
            let watcher = self.inner.clone();
            let peer = peer.to_owned();
            self.inner.tracker.spawn(async move {
                let cancel = watcher.cancel.clone();
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = watcher.watch_peer(peer, revision + 1) => {}
                }
            });
        }
        Ok(())
    }

    /// Delete every key this agent published (peers forget it).
    ///
    /// # Errors
    /// etcd errors.
    pub async fn invalidate(&self) -> Result<()> {
        self.inner.published.lock().unwrap().clear();
        let prefix = format!("{}{}/", self.inner.prefix, self.inner.name);
        let mut c = self.inner.client.clone();
        bounded(
            self.inner.options.timeout,
            "etcd invalidate",
            c.delete(prefix, Some(DeleteOptions::new().with_prefix())),
        )
        .await?;
        Ok(())
    }
}

impl Inner {
    fn check_label(&self, label: &str, op: &'static str) -> Result<()> {
        check_label(label, op)?;
        if self.options.layout == EtcdLayout::Nixl && label == NIXL_FULL_LABEL {
            return err(
                ErrorKind::InvalidArgument,
                op,
                "the label \"metadata\" is NIXL's full metadata",
            );
        }
        Ok(())
    }

    fn agent(&self) -> Result<Agent> {
        self.agent
            .upgrade()
            .ok_or_else(|| Error::new(ErrorKind::ShutDown, "etcd", "the agent is gone"))
    }

    /// The label of full metadata in this layout.
    fn full(&self) -> &'static str {
        match self.options.layout {
            EtcdLayout::Native => FULL_LABEL,
            EtcdLayout::Nixl => NIXL_FULL_LABEL,
        }
    }

    async fn put(&self, label: &str, value: Bytes) -> Result<()> {
        let key = format!("{}{}/{label}", self.prefix, self.name);
        self.published
            .lock()
            .unwrap()
            .insert(label.to_owned(), value.clone());
        let lease = *self.lease.lock().unwrap();
        let mut c = self.client.clone();
        bounded(
            self.options.timeout,
            "etcd publish",
            c.put(
                key,
                value.to_vec(),
                Some(PutOptions::new().with_lease(lease)),
            ),
        )
        .await?;
        Ok(())
    }

    /// Create `key` under the lease if it is absent; the value there otherwise.
    async fn create_if_absent(&self, key: &str, value: Bytes) -> Result<Option<Bytes>> {
        let lease = *self.lease.lock().unwrap();
        let txn = etcd_client::Txn::new()
            .when([etcd_client::Compare::create_revision(
                key,
                etcd_client::CompareOp::Equal,
                0,
            )])
            .and_then([etcd_client::TxnOp::put(
                key,
                value.to_vec(),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([etcd_client::TxnOp::get(key, None)]);
        let mut c = self.client.clone();
        let reply = bounded(self.options.timeout, "etcd claim", c.txn(txn)).await?;
        if reply.succeeded() {
            return Ok(None);
        }
        Ok(Some(
            reply
                .op_responses()
                .into_iter()
                .find_map(|r| match r {
                    etcd_client::TxnOpResponse::Get(g) => {
                        g.kvs().first().map(|kv| Bytes::copy_from_slice(kv.value()))
                    }
                    _ => None,
                })
                .unwrap_or_default(),
        ))
    }

    /// The value of `key` and the revision it was read at, waiting for it to appear.
    async fn wait_for(&self, key: &str) -> Result<(Vec<u8>, i64)> {
        const OP: &str = "etcd fetch";
        let mut c = self.client.clone();
        let got = bounded(self.options.timeout, OP, c.get(key, None)).await?;
        let revision = got.header().map_or(0, |h| h.revision());
        if let Some(kv) = got.kvs().first().filter(|kv| !kv.value().is_empty()) {
            return Ok((kv.value().to_vec(), revision));
        }
        let mut stream = bounded(
            self.options.timeout,
            OP,
            c.watch(
                key,
                Some(WatchOptions::new().with_start_revision(revision + 1)),
            ),
        )
        .await?;
        loop {
            let msg = stream.message().await.map_err(|e| etcd_err(OP, e))?;
            let Some(msg) = msg else {
                return err(ErrorKind::Backend, OP, "etcd closed the watch");
            };
            for ev in msg.events() {
                if ev.event_type() == EventType::Put {
                    if let Some(kv) = ev.kv().filter(|kv| !kv.value().is_empty()) {
                        return Ok((kv.value().to_vec(), kv.mod_revision()));
                    }
                }
            }
        }
    }

    /// Watch a peer's keys from `revision`; forget it when its full metadata goes,
    /// reload it when it is published again. Retries with backoff while etcd is away.
    async fn watch_peer(&self, peer: String, mut revision: i64) {
        let full = format!("{}{peer}/{}", self.prefix, self.full());
        let prefix = format!("{}{peer}/", self.prefix);
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut c = self.client.clone();
            let watched = bounded(
                self.options.timeout,
                "etcd watch",
                c.watch(
                    prefix.as_str(),
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(revision),
                    ),
                ),
            )
            .await;
            let mut stream = match watched {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "etcd: cannot watch peer; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.options.max_backoff);
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            loop {
                let msg = match stream.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) | Err(_) => break,
                };
                if msg.compact_revision() > 0 {
                    revision = msg.compact_revision();
                }
                for ev in msg.events() {
                    let Some(kv) = ev.kv() else { continue };
                    revision = revision.max(kv.mod_revision() + 1);
                    let Some(agent) = self.agent.upgrade() else {
                        return;
                    };
                    match ev.event_type() {
                        EventType::Delete if kv.key() == full.as_bytes() => {
                            tracing::info!(%peer, "etcd: peer's metadata is gone; forgetting it");
                            // Not followed from here: a fetch from now on follows anew.
                            self.watching.lock().unwrap().remove(&peer);
                            let _ = agent.forget_peer(&peer);
                            return;
                        }
                        // NIXL announces an agent with an empty key.
                        EventType::Put if kv.value().is_empty() => {}
                        EventType::Put => {
                            if let Err(e) =
                                agent.load_metadata_from(kv.value(), Some(&peer), Trust::Full)
                            {
                                tracing::warn!(%peer, error = %e, "etcd: could not reload peer metadata");
                            }
                        }
                        EventType::Delete => {}
                    }
                }
            }
            // The watch broke (etcd restarted?): resume from the last revision seen, or
            // forget the peer if its key is gone meanwhile.
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(self.options.max_backoff);
            let mut c = self.client.clone();
            if let Ok(got) = bounded(
                self.options.timeout,
                "etcd watch",
                c.get(full.as_str(), None),
            )
            .await
            {
                if got.kvs().is_empty() {
                    self.watching.lock().unwrap().remove(&peer);
                    if let Some(agent) = self.agent.upgrade() {
                        tracing::info!(%peer, "etcd: peer's metadata is gone; forgetting it");
                        let _ = agent.forget_peer(&peer);
                    }
                    return;
                }
            }
        }
    }

    /// Keep the lease alive; after losing it (etcd away longer than the TTL), grant a
    /// new one and publish everything again.
    async fn keep_lease(&self) {
        let period = (self.options.lease_ttl / 3).max(Duration::from_millis(200));
        let mut backoff = Duration::from_millis(100);
        loop {
            let lease = *self.lease.lock().unwrap();
            match self.renew(lease).await {
                Ok(true) => {
                    backoff = Duration::from_millis(100);
                    tokio::time::sleep(period).await;
                }
                Ok(false) => {
                    tracing::warn!(agent = %self.name, lease, "etcd: lease lost; granting a new one and publishing again");
                    if let Err(e) = self.regrant().await {
                        tracing::warn!(agent = %self.name, error = %e, "etcd: could not restore publication; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(self.options.max_backoff);
                    }
                }
                Err(e) => {
                    tracing::warn!(agent = %self.name, error = %e, "etcd: lease keep-alive failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.options.max_backoff);
                }
            }
        }
    }

    /// One keep-alive round trip; `Ok(false)` when the lease no longer exists.
    async fn renew(&self, lease: i64) -> Result<bool> {
        const OP: &str = "etcd keep-alive";
        let mut c = self.client.clone();
        // An expired or revoked lease is answered with TTL 0, or with "lease not found"
        // (a NotFound status, which etcd-client reports as a keep-alive error): all
        // mean it is gone.
        let gone = |e: &etcd_client::Error| match e {
            etcd_client::Error::GRpcStatus(s) => s.code() == tonic::Code::NotFound,
            etcd_client::Error::LeaseKeepAliveError(m) => m.contains("not found"),
            _ => false,
        };
        let (mut keeper, mut stream) =
            match bounded(self.options.timeout, OP, c.lease_keep_alive(lease)).await {
                Err(e) if source_is(&e, gone) => return Ok(false),
                r => r?,
            };
        bounded(self.options.timeout, OP, keeper.keep_alive()).await?;
        match bounded(self.options.timeout, OP, stream.message()).await {
            Ok(Some(r)) => Ok(r.ttl() > 0),
            Ok(None) => err(ErrorKind::Backend, OP, "etcd closed the keep-alive stream"),
            Err(e) if source_is(&e, gone) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn regrant(&self) -> Result<()> {
        let mut c = self.client.clone();
        let ttl = self.options.lease_ttl.as_secs().max(1) as i64;
        let lease = bounded(self.options.timeout, "etcd lease", c.lease_grant(ttl, None))
            .await?
            .id();
        *self.lease.lock().unwrap() = lease;
        let published: Vec<(String, Bytes)> = self
            .published
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (label, value) in published {
            self.put(&label, value).await?;
        }
        let claims: Vec<(String, Bytes)> = self
            .claims
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, value) in claims {
            if self.create_if_absent(&key, value).await?.is_some() {
                tracing::warn!(agent = %self.name, key, "etcd: a claimed key was taken by another holder while the lease was lost");
                self.claims.lock().unwrap().remove(&key);
            }
        }
        Ok(())
    }

    /// Revoke the lease: every key published through it is deleted at once.
    async fn revoke(&self) {
        let lease = *self.lease.lock().unwrap();
        let mut c = self.client.clone();
        match bounded(self.options.timeout, "etcd revoke", c.lease_revoke(lease)).await {
            Ok(_) => tracing::info!(agent = %self.name, lease, "etcd: lease revoked"),
            Err(e) => {
                tracing::warn!(agent = %self.name, error = %e, "etcd: could not revoke the lease; keys expire with its TTL")
            }
        }
    }
}
