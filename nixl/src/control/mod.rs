//! What every backend's control connection shares: one set of listener options
//! ([`ListenerOptions`]), one accept loop ([`spawn_accept_loop`]), admission
//! (connection caps that keep legitimate peers served, [`Admission`]), socket settings
//! ([`tune`]), length-prefixed frames ([`write_frame`], [`read_frame`]) and
//! authentication with the agent's shared secret. nixl-tcp, nixl-verbs and nixl-uccl
//! use it; nixl-tcp runs the authentication machines ([`ClientAuth`], [`ServerAuth`])
//! inside its own connection state machines, the others through [`dial`] and
//! [`answer`] (connect or accept, socket settings, then [`authenticate_client`] or
//! [`authenticate_server`]).
//!
//! Authentication uses the agent's shared secret
//! ([`AgentBuilder::secret`](crate::AgentBuilder::secret), handed to backends as
//! [`BackendContext::secret`](crate::BackendContext::secret)), before the backend's
//! own hello: a peer without the secret gets nothing made for it (no queue pair, no
//! engine connection, no access to registered memory). The connecting side speaks
//! first, only when it has a secret:
//!
//! ```text
//! client: "NXAU" client_nonce[32]
//! server: 0, server_nonce[32], HMAC(server context; protocol, client_nonce,
//!         server_nonce, server_name)
//!         or 1 (this side has no secret: refused)
//! client: name_len u16, client_name, HMAC(client context; protocol, server_nonce,
//!         client_nonce, client_name, server_name)
//! server: 0 (accepted) or 1 (refused, then closed)
//! ```
//!
//! `protocol` names the transport (`"nixl-tcp"`, `"nixl side channel"`,
//! `"nixl-verbs control"`, `"nixl-uccl control"`), so a proof made for one cannot be
//! relayed into another. Both sides can then derive a session key
//! ([`ClientAuth::session_key`]) to authenticate the frames that follow; the side
//! channel does.
//!
//! Then the backend's hello follows as without a secret, and must give the name the
//! client proved ([`Authenticated::check_hello`]): the connection is bound to that
//! name, and so is everything that arrives on it (notifications included). The client
//! checks that the server proved the name the client expected to reach (which the
//! backends always know, so a relay that passes one member's exchange through to
//! another agent fails there). A server with
//! a secret refuses a connection whose first four bytes are not [`AUTH_MAGIC`] (the
//! backend answers in its own protocol); one without refuses a connection that starts
//! with them. The secret never crosses the wire, both sides prove it, each run's
//! nonces are fresh, and the contexts keep one side's proof from passing as the
//! other's.
//!
//! A shared secret proves membership: every holder can prove any name, so it keeps
//! out whoever does not hold it, and binds each connection to one name, but does not
//! stop one member from posing as another. The backends' frames after the handshake
//! carry no MAC: an attacker who can read or alter the traffic is not kept out (see
//! the README's threat model).

mod admission;
mod auth;
mod frame;
mod handshake;
mod listener;
mod options;
mod preamble;
mod socket;

pub use admission::{Admission, AdmissionLimits, Ticket, Working};
pub use auth::{authenticate_client, authenticate_server, Authenticated};
pub use frame::{read_frame, write_frame};
pub use handshake::{nonce, ClientAuth, Refusal, ServerAuth, AUTH_MAGIC, MAX_NAME, NONCE_LEN};
pub use listener::{spawn_accept_loop, until_closed, Incoming, ACCEPT_BACKOFF};
pub use options::{
    parse_duration, BoundListener, ListenerOptions, LOOPBACK_ANY_PORT, MIN_DURATION,
};
pub use preamble::{answer, dial, Ends};
pub use socket::{set_user_timeout, tune};
