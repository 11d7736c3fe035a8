//! A backend's link to one peer, which the agent owns: [`PeerLink`], how a backend
//! takes its own type back ([`link_of`]), and the set of live links a backend closes
//! when it stops ([`LinkSet`]).
//!
//! The agent asks a backend for a link when it learns a peer's connection info
//! ([`Backend::link`](crate::Backend::link)), keeps it while that info stays the same,
//! hands it to every transfer it prepares for that peer ([`TransferPlan::peer`]), and
//! closes it when the peer is forgotten, restarts, or moves to other connection info.
//! So "the connection info changed" means one thing for every backend, and no backend
//! looks a peer up by name to post.
//!
//! [`TransferPlan::peer`]: crate::TransferPlan::peer

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use bytes::Bytes;

use crate::completion::Completer;
use crate::error::{Error, ErrorKind, Result};

/// A backend's link to one peer at one connection info.
///
/// Connecting may be lazy (at the first transfer). Two links to one peer may live at
/// once for a moment (the new one is made before the old one is closed), so a link
/// must not disturb another when it is made.
#[async_trait]
pub trait PeerLink: Send + Sync + fmt::Debug + 'static {
    /// Connect now rather than at the first transfer.
    async fn connect(&self) -> Result<()>;

    /// Send a standalone notification; report through `done`.
    fn notify(&self, msg: Bytes, done: Completer);

    /// Whether the link failed for good: it cannot carry transfers any more and does
    /// not recover by itself (a backend whose connections reconnect at the next use
    /// never says so). The agent then makes a new link at the next load of the
    /// peer's metadata, even with the same connection info.
    fn failed(&self) -> bool;

    /// Close the link: its connections close, its in-flight transfers and queued
    /// notifications fail ([`ErrorKind::RemoteDisconnected`], naming `why`), and so
    /// does every later use. The agent calls it once the link is no longer the peer's
    /// (forgotten, restarted, moved); a second call does nothing.
    fn close(&self, why: &str);

    /// The link as `Any`, for the backend that made it to take its own type back
    /// ([`link_of`]).
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

/// The peer of a transfer to another agent ([`TransferPlan::peer`](crate::TransferPlan::peer)).
#[derive(Clone, Debug)]
pub struct LinkedPeer {
    /// The peer's agent name.
    pub name: String,
    /// The link to it, made by the backend the transfer was planned for.
    pub link: Arc<dyn PeerLink>,
}

/// `link` as the backend's own link type `L`.
///
/// # Errors
/// [`ErrorKind::Backend`] when another backend made it (a bug in the caller).
pub fn link_of<L: PeerLink>(link: &Arc<dyn PeerLink>, op: &'static str) -> Result<Arc<L>> {
    link.clone().as_any().downcast::<L>().map_err(|_| {
        Error::new(
            ErrorKind::Backend,
            op,
            format!(
                "a peer link of another backend (expected {})",
                std::any::type_name::<L>()
            ),
        )
    })
}

/// The links a backend made and that are still alive, to close them all when it
/// stops. Holds them weakly: the agent owns them.
#[derive(Debug)]
pub struct LinkSet<L> {
    links: Mutex<Vec<Weak<L>>>,
}

impl<L> Default for LinkSet<L> {
    fn default() -> Self {
        Self {
            links: Mutex::new(Vec::new()),
        }
    }
}

impl<L> LinkSet<L> {
    /// Keep `link` (and forget links dropped since).
    pub fn add(&self, link: &Arc<L>) {
        let mut links = self.links.lock().unwrap();
        links.retain(|l| l.strong_count() > 0);
        links.push(Arc::downgrade(link));
    }

    /// The links still alive, forgetting them all (for a backend that stops).
    pub fn take(&self) -> Vec<Arc<L>> {
        std::mem::take(&mut *self.links.lock().unwrap())
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// The first `Some` that `f` gives for the live links, newest first (a
    /// backend's description of a peer's current link, for instance). `f` runs
    /// under the set's lock: it must not add to the set.
    pub fn newest<T>(&self, mut f: impl FnMut(&L) -> Option<T>) -> Option<T> {
        let links = self.links.lock().unwrap();
        links.iter().rev().find_map(|l| f(&*l.upgrade()?))
    }

    /// The links still alive.
    pub fn alive(&self) -> Vec<Arc<L>> {
        self.links
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two link types, told apart by `N`.
    #[derive(Debug)]
    struct Link<const N: u8>;
    type Mine = Link<0>;
    type Theirs = Link<1>;

    #[async_trait]
    impl<const N: u8> PeerLink for Link<N> {
        async fn connect(&self) -> Result<()> {
            Ok(())
        }
        fn notify(&self, _msg: Bytes, done: Completer) {
            done.complete(Ok(()));
        }
        fn failed(&self) -> bool {
            false
        }
        fn close(&self, _why: &str) {}
        fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
            self
        }
    }

    #[test]
    fn a_backend_takes_back_only_its_own_links() {
        let mine: Arc<dyn PeerLink> = Arc::new(Mine {});
        let theirs: Arc<dyn PeerLink> = Arc::new(Theirs {});
        assert!(link_of::<Mine>(&mine, "test").is_ok());
        let e = link_of::<Mine>(&theirs, "test").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert!(e.to_string().contains("another backend"), "{e}");
    }

    #[test]
    fn a_link_set_holds_only_live_links() {
        let set = LinkSet::default();
        let (a, b) = (Arc::new(Mine {}), Arc::new(Mine {}));
        set.add(&a);
        set.add(&b);
        drop(a);
        assert_eq!(set.alive().len(), 1);
        let c = Arc::new(Mine {});
        set.add(&c);
        let newest = set.newest(|l| Some(l as *const Mine)).unwrap();
        assert_eq!(newest, Arc::as_ptr(&c));
        drop(c);
        let taken = set.take();
        assert!(taken.len() == 1 && Arc::ptr_eq(&taken[0], &b));
        assert!(set.alive().is_empty());
    }
}
