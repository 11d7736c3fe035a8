//! NIXL's metadata exchange calls of an agent: to the listener at an address
//! (NIXL's listener protocol when a backend speaks NIXL's, else nixl-rs' side
//! channel), or through etcd when no address is given; all in the background, as
//! NIXL's return at once.

use std::net::{SocketAddr, ToSocketAddrs};

use nixl::exchange::{NixlListenerOptions, SideChannelOptions};
use nixl_compat::etcd;

use super::CAgent;
use crate::lists::{DescList, OptArgs};
use crate::status::{Failure, Outcome};

fn socket_addr(ip: &str, port: u16) -> Outcome<SocketAddr> {
    (ip, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Failure::invalid(format!("cannot resolve address {ip:?}:{port}")))
}

impl CAgent {
    /// An etcd call for a metadata call given no address (NIXL's etcd exchange at
    /// `NIXL_ETCD_ENDPOINTS`).
    ///
    /// # Errors
    /// INVALID_PARAM (as NIXL's) when there is no etcd: no endpoints, or a build
    /// without the `etcd` feature.
    fn etcd(&self, op: &'static str) -> Outcome<etcd::Call> {
        let agent = self.agent()?;
        etcd::Call::new(self.etcd.clone(), agent, self.speaks_nixl(), op)
            .map_err(|e| Failure::invalid(e.to_string()))
    }

    /// NIXL's `sendLocalMD` / `sendLocalPartialMD`: to the listener at the
    /// arguments' address, else to etcd; in the background.
    pub fn send_local_md(&self, partial: Option<&DescList>, opt: &OptArgs) -> Outcome {
        const OP: &str = "send local metadata";
        if opt.ip_addr.is_empty() {
            if partial.is_some() {
                return Err(Failure::invalid(
                    "send local partial metadata: through etcd it needs a label, which NIXL's C API cannot give; give the peer's address",
                ));
            }
            return self.spawn(OP, self.etcd(OP)?.publish());
        }
        let addr = socket_addr(&opt.ip_addr, opt.port)?;
        let agent = self.agent()?;
        let picked = partial.map(|l| self.picked(l)).transpose()?;
        if self.speaks_nixl() {
            self.spawn(OP, async move {
                let o = NixlListenerOptions::default();
                match picked {
                    Some(p) => {
                        agent
                            .send_nixl_partial_metadata(addr, &p, p.is_empty(), &o)
                            .await
                    }
                    None => agent.send_nixl_metadata(addr, &o).await,
                }
            })
        } else {
            self.spawn(OP, async move {
                let o = SideChannelOptions::default();
                match picked {
                    Some(p) => {
                        agent
                            .send_partial_metadata(addr, &p, p.is_empty(), &o)
                            .await
                    }
                    None => agent.send_metadata(addr, &o).await,
                }
            })
        }
    }

    /// NIXL's `fetchRemoteMD`: fetch `peer`'s metadata from the listener at the
    /// arguments' address, else from etcd, and load it, in the background
    /// (`check_remote_md` says when it is there).
    pub fn fetch_remote_md(&self, peer: &str, opt: &OptArgs) -> Outcome {
        const OP: &str = "fetch remote metadata";
        if opt.ip_addr.is_empty() {
            return self.spawn(OP, self.etcd(OP)?.fetch(peer.to_owned(), String::new()));
        }
        let addr = socket_addr(&opt.ip_addr, opt.port)?;
        let agent = self.agent()?;
        let peer = peer.to_owned();
        if self.speaks_nixl() {
            self.spawn(OP, async move {
                agent
                    .fetch_nixl_peer_metadata(addr, &peer, &NixlListenerOptions::default())
                    .await
            })
        } else {
            self.spawn(OP, async move {
                agent
                    .fetch_peer_metadata(addr, &peer, &SideChannelOptions::default())
                    .await
            })
        }
    }

    /// NIXL's `invalidateLocalMD`: tell the listener at the arguments' address to
    /// forget this agent, else withdraw it from etcd; in the background.
    pub fn invalidate_local_md(&self, opt: &OptArgs) -> Outcome {
        const OP: &str = "invalidate local metadata";
        if opt.ip_addr.is_empty() {
            return self.spawn(OP, self.etcd(OP)?.invalidate());
        }
        let addr = socket_addr(&opt.ip_addr, opt.port)?;
        let agent = self.agent()?;
        if self.speaks_nixl() {
            self.spawn(OP, async move {
                agent
                    .invalidate_nixl_at(addr, &NixlListenerOptions::default())
                    .await
            })
        } else {
            self.spawn(OP, async move {
                agent
                    .invalidate_at(addr, &SideChannelOptions::default())
                    .await
            })
        }
    }
}
