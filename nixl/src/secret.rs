//! The shared secret agents authenticate their channels with (the side channel,
//! backends' connections): HMAC-SHA256 over length-prefixed parts, so the secret
//! never crosses the wire.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{err, ErrorKind, Result};

type HmacSha256 = Hmac<Sha256>;

/// A shared secret for authenticating channels (the side channel, backends'
/// connections; [`AgentBuilder::secret`](crate::AgentBuilder::secret) sets one for
/// all). Its `Debug` output never shows the bytes.
#[derive(Clone)]
pub struct SharedSecret(Arc<[u8]>);

impl SharedSecret {
    /// A secret from bytes (use at least 16 random bytes).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for an empty secret.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Self> {
        let b = bytes.as_ref();
        if b.is_empty() {
            return err(
                ErrorKind::InvalidArgument,
                "make shared secret",
                "the secret is empty",
            );
        }
        Ok(Self(b.into()))
    }

    /// HMAC-SHA256 of `parts` (each length-prefixed) under this secret, for backends
    /// that authenticate their own connections with it. `context` separates uses.
    pub fn sign(&self, context: &str, parts: &[&[u8]]) -> [u8; 32] {
        self.keyed(context, parts).finalize().into_bytes().into()
    }

    /// Check a [`SharedSecret::sign`] MAC in constant time.
    pub fn verify(&self, context: &str, parts: &[&[u8]], mac: &[u8]) -> bool {
        self.keyed(context, parts).verify_slice(mac).is_ok()
    }

    fn keyed(&self, context: &str, parts: &[&[u8]]) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(&(context.len() as u64).to_le_bytes());
        m.update(context.as_bytes());
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedSecret(..)")
    }
}
