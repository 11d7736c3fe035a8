//! The authentication exchange (see [`super`]) as two plain state machines, with no
//! sockets and no clocks: each is told the bytes it asked for and says what to send.
//! nixl-tcp embeds them in its own connection machines; [`super::authenticate_client`]
//! and [`super::authenticate_server`] drive them over a `TcpStream` for nixl-verbs and
//! nixl-uccl.

use crate::secret::SharedSecret;

/// What a connection that authenticates starts with. As a little-endian `u32` frame
/// length it is over a gigabyte, so no backend's first frame is mistaken for it.
pub const AUTH_MAGIC: [u8; 4] = *b"NXAU";
/// Length of each side's challenge.
pub const NONCE_LEN: usize = 32;
/// Longest agent name a client may prove.
pub const MAX_NAME: usize = 1024;
const MAC: usize = 32;
const CLIENT_CONTEXT: &str = "nixl control v2 client";
const SERVER_CONTEXT: &str = "nixl control v2 server";
const SESSION_CONTEXT: &str = "nixl control v2 session";
const OK: u8 = 0;
const REFUSED: u8 = 1;

/// A fresh challenge from the OS random source.
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).expect("the OS random source works");
    n
}

/// The exchange failed: send `reply` (if any) to the peer, then close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The bytes that tell the peer it was refused.
    pub reply: Option<Vec<u8>>,
    /// Why, for the error or log.
    pub why: String,
}

impl Refusal {
    fn new(reply: Option<Vec<u8>>, why: impl Into<String>) -> Self {
        Self {
            reply,
            why: why.into(),
        }
    }

    /// What a server without a secret answers a peer that starts with
    /// [`AUTH_MAGIC`]: it cannot check the proof, so it refuses.
    pub fn no_secret_here() -> Self {
        Self::new(
            Some(vec![REFUSED]),
            "the peer authenticates, but no shared secret is configured here",
        )
    }
}

/// What [`feed`] drives: either side's machine.
trait Steps {
    fn need(&self) -> usize;
    fn step(&mut self, bytes: &[u8]) -> Result<Vec<u8>, Refusal>;
}

impl Steps for ClientAuth {
    fn need(&self) -> usize {
        Self::need(self)
    }
    fn step(&mut self, bytes: &[u8]) -> Result<Vec<u8>, Refusal> {
        self.received(bytes)
    }
}

impl Steps for ServerAuth {
    fn need(&self) -> usize {
        Self::need(self)
    }
    fn step(&mut self, bytes: &[u8]) -> Result<Vec<u8>, Refusal> {
        self.received(bytes)
    }
}

/// Feed a whole message of a framed transport to a machine: `bytes` must hold
/// exactly what it asks for up to where it answers or is done (so a message can
/// neither be empty nor stop half way and keep the exchange waiting). Returns what it
/// says to send.
fn feed(m: &mut impl Steps, bytes: &[u8]) -> Result<Vec<u8>, Refusal> {
    let wrong = || {
        Refusal::new(
            Some(vec![REFUSED]),
            "an authentication message of the wrong length",
        )
    };
    let mut at = 0;
    loop {
        let n = m.need();
        if n == 0 || bytes.len() - at < n {
            return Err(wrong());
        }
        let out = m.step(&bytes[at..at + n])?;
        at += n;
        if !out.is_empty() || m.need() == 0 {
            return if at == bytes.len() {
                Ok(out)
            } else {
                Err(wrong())
            };
        }
    }
}

fn check_len(got: usize, need: usize) -> Result<(), Refusal> {
    if got == need {
        Ok(())
    } else {
        Err(Refusal::new(
            Some(vec![REFUSED]),
            format!("{got} bytes given where the exchange reads {need}"),
        ))
    }
}

/// The key that the rest of a connection may authenticate its frames with: both
/// sides derive it, a relay in the middle of the exchange cannot.
fn session_key(
    secret: &SharedSecret,
    protocol: &str,
    client_nonce: &[u8],
    server_nonce: &[u8],
    client: &str,
    server: &str,
) -> SharedSecret {
    let key = secret.sign(
        SESSION_CONTEXT,
        &[
            protocol.as_bytes(),
            client_nonce,
            server_nonce,
            client.as_bytes(),
            server.as_bytes(),
        ],
    );
    SharedSecret::new(key).expect("32 bytes")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientStep {
    Status,
    ServerProof,
    Verdict,
    Done,
}

/// The connecting side. It proves the secret and its own name, and checks that the
/// server proves the secret and the name the client expects it to have.
#[derive(Debug)]
pub struct ClientAuth {
    protocol: &'static str,
    secret: SharedSecret,
    me: String,
    peer: String,
    ours: [u8; NONCE_LEN],
    theirs: [u8; NONCE_LEN],
    step: ClientStep,
}

impl ClientAuth {
    /// Start as agent `me`, connecting over `protocol` (each transport names its
    /// own, so a proof made for one cannot be relayed into another) to the agent
    /// named `peer`; `nonce` is this side's challenge. Returns the machine and the
    /// bytes to send first.
    ///
    /// # Errors
    /// `me` is empty or longer than [`MAX_NAME`], or `peer` is `me` (a peer that
    /// proves our own name is a reflection of our own exchange).
    pub fn start(
        protocol: &'static str,
        secret: SharedSecret,
        me: &str,
        peer: &str,
        nonce: [u8; NONCE_LEN],
    ) -> Result<(Self, Vec<u8>), Refusal> {
        if me.is_empty() || me.len() > MAX_NAME {
            return Err(Refusal::new(
                None,
                format!("an agent name of {} bytes cannot be proven", me.len()),
            ));
        }
        if me == peer {
            return Err(Refusal::new(
                None,
                format!("the peer would prove this agent's own name {me:?}"),
            ));
        }
        let mut first = AUTH_MAGIC.to_vec();
        first.extend_from_slice(&nonce);
        let m = Self {
            protocol,
            secret,
            me: me.to_owned(),
            peer: peer.to_owned(),
            ours: nonce,
            theirs: [0; NONCE_LEN],
            step: ClientStep::Status,
        };
        Ok((m, first))
    }

    /// Once done: the key both sides derived for the rest of the connection.
    pub fn session_key(&self) -> Option<SharedSecret> {
        self.is_done().then(|| {
            session_key(
                &self.secret,
                self.protocol,
                &self.ours,
                &self.theirs,
                &self.me,
                &self.peer,
            )
        })
    }

    /// How many bytes to read next; 0 once done.
    pub fn need(&self) -> usize {
        match self.step {
            ClientStep::Status | ClientStep::Verdict => 1,
            ClientStep::ServerProof => NONCE_LEN + MAC,
            ClientStep::Done => 0,
        }
    }

    /// Whether both sides proved themselves.
    pub fn is_done(&self) -> bool {
        self.step == ClientStep::Done
    }

    /// The [`ClientAuth::need`] bytes arrived: what to send next (maybe nothing).
    ///
    /// # Errors
    /// The server does not authenticate, failed its proof (wrong secret or not the
    /// agent expected), or refused ours: close the connection (nothing to send).
    pub fn received(&mut self, bytes: &[u8]) -> Result<Vec<u8>, Refusal> {
        check_len(bytes.len(), self.need())?;
        match self.step {
            ClientStep::Status => {
                if bytes[0] != OK {
                    return Err(Refusal::new(
                        None,
                        "it does not authenticate, but a shared secret is configured here",
                    ));
                }
                self.step = ClientStep::ServerProof;
                Ok(Vec::new())
            }
            ClientStep::ServerProof => {
                let (theirs, mac) = bytes.split_at(NONCE_LEN);
                let parts: [&[u8]; 4] = [
                    self.protocol.as_bytes(),
                    &self.ours,
                    theirs,
                    self.peer.as_bytes(),
                ];
                if !self.secret.verify(SERVER_CONTEXT, &parts, mac) {
                    return Err(Refusal::new(
                        None,
                        format!(
                            "it failed to prove the shared secret as agent {:?} (another secret, or another agent at that address)",
                            self.peer
                        ),
                    ));
                }
                self.theirs.copy_from_slice(theirs);
                let name = self.me.as_bytes();
                let proof = self.secret.sign(
                    CLIENT_CONTEXT,
                    &[
                        self.protocol.as_bytes(),
                        theirs,
                        &self.ours,
                        name,
                        self.peer.as_bytes(),
                    ],
                );
                let mut out = Vec::with_capacity(2 + name.len() + MAC);
                out.extend_from_slice(&(name.len() as u16).to_le_bytes());
                out.extend_from_slice(name);
                out.extend_from_slice(&proof);
                self.step = ClientStep::Verdict;
                Ok(out)
            }
            ClientStep::Verdict => {
                if bytes[0] != OK {
                    return Err(Refusal::new(None, "it refused our shared secret or name"));
                }
                self.step = ClientStep::Done;
                Ok(Vec::new())
            }
            ClientStep::Done => Ok(Vec::new()),
        }
    }

    /// [`ClientAuth::received`] for a transport that carries each side's message
    /// whole (in one frame): `bytes` must be exactly one message.
    ///
    /// # Errors
    /// As [`ClientAuth::received`]; also a message of the wrong length.
    pub fn received_message(&mut self, bytes: &[u8]) -> Result<Vec<u8>, Refusal> {
        feed(self, bytes)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerStep {
    Nonce,
    NameLen,
    Proof { name_len: usize },
    Done,
}

/// The accepting side, from after the client's [`AUTH_MAGIC`]. It proves the secret
/// and its own name, then requires the client's proof of the secret and of the name
/// it claims ([`ServerAuth::proven`]).
#[derive(Debug)]
pub struct ServerAuth {
    protocol: &'static str,
    secret: SharedSecret,
    me: String,
    ours: [u8; NONCE_LEN],
    theirs: [u8; NONCE_LEN],
    step: ServerStep,
    proven: Option<String>,
}

impl ServerAuth {
    /// This agent is `me`, serving `protocol` (see [`ClientAuth::start`]); `nonce`
    /// is its challenge.
    pub fn new(
        protocol: &'static str,
        secret: SharedSecret,
        me: &str,
        nonce: [u8; NONCE_LEN],
    ) -> Self {
        Self {
            protocol,
            secret,
            me: me.to_owned(),
            ours: nonce,
            theirs: [0; NONCE_LEN],
            step: ServerStep::Nonce,
            proven: None,
        }
    }

    /// How many bytes to read next; 0 once done.
    pub fn need(&self) -> usize {
        match self.step {
            ServerStep::Nonce => NONCE_LEN,
            ServerStep::NameLen => 2,
            ServerStep::Proof { name_len } => name_len + MAC,
            ServerStep::Done => 0,
        }
    }

    /// The name the client proved, once done.
    pub fn proven(&self) -> Option<&str> {
        self.proven.as_deref()
    }

    /// Once done: the key both sides derived for the rest of the connection.
    pub fn session_key(&self) -> Option<SharedSecret> {
        let client = self.proven.as_deref()?;
        Some(session_key(
            &self.secret,
            self.protocol,
            &self.theirs,
            &self.ours,
            client,
            &self.me,
        ))
    }

    /// The [`ServerAuth::need`] bytes arrived: what to send next (maybe nothing).
    ///
    /// # Errors
    /// The client's name is malformed or its proof fails: send the refusal's reply,
    /// then close.
    pub fn received(&mut self, bytes: &[u8]) -> Result<Vec<u8>, Refusal> {
        check_len(bytes.len(), self.need())?;
        match self.step {
            ServerStep::Nonce => {
                self.theirs.copy_from_slice(bytes);
                let proof = self.secret.sign(
                    SERVER_CONTEXT,
                    &[
                        self.protocol.as_bytes(),
                        &self.theirs,
                        &self.ours,
                        self.me.as_bytes(),
                    ],
                );
                let mut out = Vec::with_capacity(1 + NONCE_LEN + MAC);
                out.push(OK);
                out.extend_from_slice(&self.ours);
                out.extend_from_slice(&proof);
                self.step = ServerStep::NameLen;
                Ok(out)
            }
            ServerStep::NameLen => {
                let n = usize::from(u16::from_le_bytes([bytes[0], bytes[1]]));
                if n == 0 || n > MAX_NAME {
                    return Err(Refusal::new(
                        Some(vec![REFUSED]),
                        format!("a claimed agent name of {n} bytes"),
                    ));
                }
                self.step = ServerStep::Proof { name_len: n };
                Ok(Vec::new())
            }
            ServerStep::Proof { name_len } => {
                let (name, mac) = bytes.split_at(name_len);
                let parts: [&[u8]; 5] = [
                    self.protocol.as_bytes(),
                    &self.ours,
                    &self.theirs,
                    name,
                    self.me.as_bytes(),
                ];
                if !self.secret.verify(CLIENT_CONTEXT, &parts, mac) {
                    return Err(Refusal::new(
                        Some(vec![REFUSED]),
                        "the peer failed to prove the shared secret",
                    ));
                }
                let Ok(name) = std::str::from_utf8(name) else {
                    return Err(Refusal::new(
                        Some(vec![REFUSED]),
                        "the claimed agent name is not UTF-8",
                    ));
                };
                self.proven = Some(name.to_owned());
                self.step = ServerStep::Done;
                Ok(vec![OK])
            }
            ServerStep::Done => Ok(Vec::new()),
        }
    }

    /// [`ServerAuth::received`] for a transport that carries each side's message
    /// whole (in one frame): `bytes` must be exactly one message.
    ///
    /// # Errors
    /// As [`ServerAuth::received`]; also a message of the wrong length.
    pub fn received_message(&mut self, bytes: &[u8]) -> Result<Vec<u8>, Refusal> {
        feed(self, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> SharedSecret {
        SharedSecret::new(s).unwrap()
    }

    /// Run both machines against each other; `tamper` may change what the client
    /// sends after its magic. Returns each side's outcome (`"stalled"` where a side
    /// waits for bytes the other never sends).
    fn run(
        client_secret: &str,
        server_secret: &str,
        me: &str,
        expected_server: &str,
        server_name: &str,
        tamper: impl Fn(&mut Vec<u8>),
    ) -> (Result<(), Refusal>, Result<String, Refusal>) {
        run_over(
            ("test", client_secret, me, expected_server),
            ("test", server_secret, server_name),
            tamper,
        )
        .map_or_else(|(c, s)| (c, s), |(c, s, _)| (c, s))
    }

    /// [`run`] with each side's protocol; on success also both session keys' MACs
    /// of the same bytes.
    #[allow(clippy::type_complexity)]
    fn run_over(
        (client_protocol, client_secret, me, expected_server): (&'static str, &str, &str, &str),
        (server_protocol, server_secret, server_name): (&'static str, &str, &str),
        tamper: impl Fn(&mut Vec<u8>),
    ) -> std::result::Result<
        (
            Result<(), Refusal>,
            Result<String, Refusal>,
            ([u8; 32], [u8; 32]),
        ),
        (Result<(), Refusal>, Result<String, Refusal>),
    > {
        let (mut c, first) = ClientAuth::start(
            client_protocol,
            secret(client_secret),
            me,
            expected_server,
            nonce(),
        )
        .unwrap();
        assert_eq!(first[..4], AUTH_MAGIC);
        let mut s = ServerAuth::new(server_protocol, secret(server_secret), server_name, nonce());
        let (mut to_server, mut to_client) = (first[4..].to_vec(), Vec::new());
        let (mut client, mut server) = (None, None);
        for _ in 0..8 {
            while server.is_none() && to_server.len() >= s.need() {
                let bytes: Vec<u8> = to_server.drain(..s.need()).collect();
                match s.received(&bytes) {
                    Ok(out) => to_client.extend(out),
                    Err(r) => {
                        to_client.extend(r.reply.clone().unwrap_or_default());
                        server = Some(Err(r));
                    }
                }
                if server.is_none() && s.need() == 0 {
                    server = Some(Ok(s.proven().unwrap().to_owned()));
                }
            }
            while client.is_none() && to_client.len() >= c.need() {
                let bytes: Vec<u8> = to_client.drain(..c.need()).collect();
                match c.received(&bytes) {
                    Ok(mut out) => {
                        tamper(&mut out);
                        to_server.extend(out);
                    }
                    Err(r) => client = Some(Err(r)),
                }
                if client.is_none() && c.is_done() {
                    client = Some(Ok(()));
                }
            }
        }
        let stalled = Refusal::new(None, "stalled");
        let (client, server) = (
            client.unwrap_or_else(|| Err(stalled.clone())),
            server.unwrap_or(Err(stalled)),
        );
        match (c.session_key(), s.session_key()) {
            (Some(ck), Some(sk)) if client.is_ok() && server.is_ok() => {
                let keys = (ck.sign("t", &[b"x"]), sk.sign("t", &[b"x"]));
                Ok((client, server, keys))
            }
            _ => Err((client, server)),
        }
    }

    #[test]
    fn both_sides_prove_the_secret_and_their_names() {
        let (c, s) = run("k", "k", "prefill-0", "decode-1", "decode-1", |_| {});
        assert_eq!(c, Ok(()));
        assert_eq!(s.unwrap(), "prefill-0");
    }

    #[test]
    fn another_secret_fails_on_the_client_before_it_proves_anything() {
        let (c, s) = run("k", "other", "a", "b", "b", |_| {});
        assert!(c.unwrap_err().why.contains("failed to prove"));
        assert!(s.is_err());
    }

    #[test]
    fn a_server_that_is_not_the_agent_expected_is_refused() {
        let (c, _) = run("k", "k", "a", "decode-1", "decode-2", |_| {});
        assert!(c.unwrap_err().why.contains("\"decode-1\""));
    }

    #[test]
    fn a_claimed_name_other_than_the_one_proven_is_refused() {
        // The client proves "a" but the bytes on the wire claim "b".
        let (_, s) = run("k", "k", "a", "srv", "srv", |sent| {
            if sent.len() > 3 && sent[2] == b'a' {
                sent[2] = b'b';
            }
        });
        let r = s.unwrap_err();
        assert_eq!(r.reply, Some(vec![REFUSED]));
        assert!(r.why.contains("failed to prove"), "{}", r.why);
    }

    #[test]
    fn names_out_of_bounds_are_refused_before_they_are_read() {
        let mut s = ServerAuth::new("test", secret("k"), "srv", nonce());
        s.received(&nonce()).unwrap();
        for n in [0u16, (MAX_NAME + 1) as u16, u16::MAX] {
            let mut t = ServerAuth::new("test", secret("k"), "srv", nonce());
            t.received(&nonce()).unwrap();
            assert!(t.received(&n.to_le_bytes()).is_err(), "{n}");
        }
        assert!(s.received(&(MAX_NAME as u16).to_le_bytes()).is_ok());
        assert_eq!(s.need(), MAX_NAME + MAC);
    }

    #[test]
    fn a_refusing_server_is_reported_by_the_client() {
        let (mut c, _) = ClientAuth::start("test", secret("k"), "a", "b", nonce()).unwrap();
        let r = Refusal::no_secret_here();
        let e = c.received(r.reply.as_ref().unwrap()).unwrap_err();
        assert!(e.why.contains("does not authenticate"));
    }

    #[test]
    fn a_proof_made_for_one_protocol_fails_in_another() {
        let r = run_over(
            ("nixl-tcp", "k", "a", "b"),
            ("side channel", "k", "b"),
            |_| {},
        );
        let (c, _) = r.unwrap_err();
        assert!(c.unwrap_err().why.contains("failed to prove"));
    }

    #[test]
    fn both_sides_derive_the_same_session_key() {
        let (_, _, (ck, sk)) = run_over(("p", "k", "a", "b"), ("p", "k", "b"), |_| {}).unwrap();
        assert_eq!(ck, sk);
        let (_, _, (other, _)) = run_over(("p", "k", "a", "b"), ("p", "k", "b"), |_| {}).unwrap();
        assert_ne!(ck, other, "fresh nonces, another key");
    }

    #[test]
    fn messages_must_end_where_the_other_side_answers() {
        let fresh = || {
            let mut s = ServerAuth::new("p", secret("k"), "srv", nonce());
            s.received_message(&nonce()).unwrap();
            s
        };
        // Empty, cut after the length, or with bytes left over: refused.
        assert!(fresh().received_message(&[]).is_err());
        assert!(fresh().received_message(&3u16.to_le_bytes()).is_err());
        let mut long = 1u16.to_le_bytes().to_vec();
        long.extend_from_slice(&[b'x'; 1 + 32 + 1]);
        assert!(fresh().received_message(&long).is_err());
        // And the steps themselves refuse a wrong length instead of panicking.
        assert!(fresh().received(&[0; 5]).is_err());
        let (mut c, _) = ClientAuth::start("p", secret("k"), "a", "b", nonce()).unwrap();
        assert!(c.received(&[0, 0]).is_err());
    }

    #[test]
    fn names_that_cannot_be_proven_are_refused_at_start() {
        let long = "n".repeat(MAX_NAME + 1);
        for (me, peer) in [("", "b"), (long.as_str(), "b"), ("a", "a")] {
            assert!(ClientAuth::start("p", secret("k"), me, peer, nonce()).is_err());
        }
    }
}
