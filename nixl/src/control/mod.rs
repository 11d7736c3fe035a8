//! What backends' control connections share: admission (connection caps that keep
//! legitimate peers served, [`Admission`]) and authentication with the agent's
//! shared secret.
//!
//! Authentication of a backend's control connection with the agent's shared secret
//! ([`AgentBuilder::secret`](crate::AgentBuilder::secret), handed to backends as
//! [`BackendContext::secret`](crate::BackendContext::secret)), before the backend's
//! own hello: a peer without the secret gets nothing made for it (no queue pair, no
//! engine connection).
//!
//! The connecting side speaks first, only when it has a secret:
//!
//! ```text
//! client: "NXAU" client_nonce[32]
//! server: 0, server_nonce[32], HMAC(server context, client_nonce, server_nonce)[32]
//!         or 1 (this side has no secret: refused)
//! client: HMAC(client context, server_nonce, client_nonce)[32]
//! server: 0 (accepted) or 1 (refused, then closed)
//! ```
//!
//! Then the backend's hello follows as without a secret. A server with a secret
//! refuses a connection whose first four bytes are not `"NXAU"` (the backend answers
//! in its own protocol); one without refuses a connection that starts with them. The
//! secret never crosses the wire, both sides prove it, and each run's nonces are
//! fresh. A shared secret proves membership, not a name.

mod admission;
mod auth;

pub use admission::{Admission, Ticket};
pub use auth::{authenticate_client, authenticate_server, Authenticated, AUTH_MAGIC};
