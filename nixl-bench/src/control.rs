//! The control channel between initiator and target: one text line per message, over
//! a Unix socket to the child (local mode, see `child.rs`) or a small TCP connection (two
//! hosts).
//!
//! ```text
//! initiator -> target                   target -> initiator
//! setup {json}                          metadata <hex>     (the target's agent metadata)
//! fill {json}                           ok
//! verify {json}                         verified {json}
//! ping                                  (no answer: a heartbeat while the sweep runs)
//! done                                  bye
//!                                       error <text>       (the target failed)
//! ```
//!
//! Every receive has a deadline, so a dead or hung peer ends the run with an error.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::buffer::{Pattern, VerifyReport};
use crate::cli::{MemSource, SegType};
use crate::error::{fail, BenchError, Context, Result};

/// Bumped when the messages change; both sides must agree.
pub(crate) const PROTOCOL: u32 = 1;

/// Longest line accepted (metadata of one region is far smaller).
const MAX_LINE: u64 = 16 << 20;

/// What the initiator asks of the target before anything else.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Setup {
    pub(crate) protocol: u32,
    /// The initiator's nixl-bench version.
    pub(crate) version: String,
    /// The initiator's backend; the target must run the same one.
    pub(crate) backend: String,
    /// Bytes the target registers.
    pub(crate) buffer_size: u64,
    pub(crate) seg_type: SegType,
    /// The GPU of a VRAM buffer (absent from older initiators: 0).
    #[serde(default)]
    pub(crate) device_id: u32,
    /// Where the target's buffer comes from (absent from older initiators: host).
    #[serde(default)]
    pub(crate) memory: MemSource,
    /// Whether host buffers ask for transparent huge pages (absent from older
    /// initiators: yes).
    #[serde(default = "yes")]
    pub(crate) huge_pages: bool,
    /// The initiator's agent metadata, hex (for backends that need both sides').
    pub(crate) initiator_metadata: String,
}

fn yes() -> bool {
    true
}

/// Messages to the target.
#[derive(Clone, Debug)]
pub(crate) enum ToTarget {
    Setup(Box<Setup>),
    /// Write the check pattern into these bytes.
    Fill(Pattern),
    /// Check that these bytes hold the pattern.
    Verify(Pattern),
    Ping,
    Done,
}

/// Messages to the initiator.
#[derive(Clone, Debug)]
pub(crate) enum ToInitiator {
    Metadata(Vec<u8>),
    Ok,
    Verified(VerifyReport),
    Bye,
    Error(String),
}

/// A message as one line of text.
pub(crate) trait Message: Sized + fmt::Debug {
    fn encode(&self) -> String;
    fn decode(line: &str) -> Result<Self>;
}

fn json<T: Serialize>(verb: &str, v: &T) -> String {
    format!(
        "{verb} {}",
        serde_json::to_string(v).expect("bench messages serialize")
    )
}

fn parse<T: for<'de> Deserialize<'de>>(verb: &str, arg: &str) -> Result<T> {
    serde_json::from_str(arg).with_context(|| format!("malformed {verb} message"))
}

fn split(line: &str) -> (&str, &str) {
    line.split_once(' ').unwrap_or((line, ""))
}

impl Message for ToTarget {
    fn encode(&self) -> String {
        match self {
            Self::Setup(s) => json("setup", s),
            Self::Fill(r) => json("fill", r),
            Self::Verify(r) => json("verify", r),
            Self::Ping => "ping".into(),
            Self::Done => "done".into(),
        }
    }

    fn decode(line: &str) -> Result<Self> {
        match split(line) {
            ("setup", a) => Ok(Self::Setup(Box::new(parse("setup", a)?))),
            ("fill", a) => Ok(Self::Fill(parse("fill", a)?)),
            ("verify", a) => Ok(Self::Verify(parse("verify", a)?)),
            ("ping", "") => Ok(Self::Ping),
            ("done", "") => Ok(Self::Done),
            _ => fail(format!("unexpected message {:?}", clip(line))),
        }
    }
}

impl Message for ToInitiator {
    fn encode(&self) -> String {
        match self {
            Self::Metadata(md) => format!("metadata {}", hex(md)),
            Self::Ok => "ok".into(),
            Self::Verified(r) => json("verified", r),
            Self::Bye => "bye".into(),
            // One line, whatever the error said.
            Self::Error(e) => format!("error {}", e.replace(['\r', '\n'], " ")),
        }
    }

    fn decode(line: &str) -> Result<Self> {
        match split(line) {
            ("metadata", a) => Ok(Self::Metadata(unhex(a)?)),
            ("ok", "") => Ok(Self::Ok),
            ("verified", a) => Ok(Self::Verified(parse("verified", a)?)),
            ("bye", "") => Ok(Self::Bye),
            ("error", a) => Ok(Self::Error(a.to_owned())),
            _ => fail(format!("unexpected message {:?}", clip(line))),
        }
    }
}

fn clip(s: &str) -> &str {
    match s.char_indices().nth(80) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Bytes from hex (either case).
pub(crate) fn unhex(s: &str) -> Result<Vec<u8>> {
    let s = s.trim();
    if s.len() % 2 != 0 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return fail("metadata is not a hex string");
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).context("bad hex"))
        .collect()
}

type Reader = BufReader<Box<dyn AsyncRead + Unpin + Send>>;
type Writer = Arc<Mutex<Box<dyn AsyncWrite + Unpin + Send>>>;

/// One end of the control channel.
pub(crate) struct Channel {
    reader: Reader,
    writer: Writer,
    /// Who is at the other end, for messages ("the target (child process 1234)").
    peer: String,
    /// Bound on writing one line (a peer that stopped reading must not hang us).
    write_timeout: Duration,
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel").field("peer", &self.peer).finish()
    }
}

impl Channel {
    pub(crate) fn new(
        reader: impl AsyncRead + Unpin + Send + 'static,
        writer: impl AsyncWrite + Unpin + Send + 'static,
        peer: impl Into<String>,
        write_timeout: Duration,
    ) -> Self {
        Self {
            reader: BufReader::new(Box::new(reader)),
            writer: Arc::new(Mutex::new(Box::new(writer))),
            peer: peer.into(),
            write_timeout,
        }
    }

    /// A channel over a TCP connection.
    pub(crate) fn tcp(stream: TcpStream, peer: impl Into<String>, write_timeout: Duration) -> Self {
        let (r, w) = stream.into_split();
        Self::new(r, w, peer, write_timeout)
    }

    /// Who is at the other end.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    /// Send one message.
    pub(crate) async fn send(&self, msg: &impl Message) -> Result<()> {
        send_line(&self.writer, msg.encode(), self.write_timeout)
            .await
            .with_context(|| format!("send to {}", self.peer))
    }

    /// Receive one message; fail after `timeout` (while waiting for `what`).
    pub(crate) async fn recv<M: Message>(&mut self, timeout: Duration, what: &str) -> Result<M> {
        let mut line = String::new();
        let mut limited = (&mut self.reader).take(MAX_LINE);
        match tokio::time::timeout(timeout, limited.read_line(&mut line)).await {
            Err(_) => fail(format!(
                "{} sent no {what} within {timeout:?} (hung or unreachable?)",
                self.peer
            )),
            Ok(Err(e)) => Err(e).with_context(|| format!("read {what} from {}", self.peer)),
            Ok(Ok(0)) => fail(format!(
                "{} closed the control channel while we waited for {what} (it exited or crashed)",
                self.peer
            )),
            Ok(Ok(_)) if !line.ends_with('\n') => fail(format!(
                "{} sent a line longer than {MAX_LINE} bytes",
                self.peer
            )),
            Ok(Ok(_)) => M::decode(line.trim_end())
                .with_context(|| format!("{} sent a bad {what}", self.peer)),
        }
    }

    /// Send `ping` every `every` until the returned guard is dropped.
    pub(crate) fn heartbeat(&self, every: Duration) -> Heartbeat {
        let writer = self.writer.clone();
        let timeout = self.write_timeout;
        Heartbeat(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let ping = ToTarget::Ping.encode();
                if send_line(&writer, ping, timeout).await.is_err() {
                    // The main flow notices the broken channel at its next exchange.
                    break;
                }
            }
        }))
    }
}

async fn send_line(writer: &Writer, mut line: String, timeout: Duration) -> Result<()> {
    line.push('\n');
    let write = async {
        let mut w = writer.lock().await;
        w.write_all(line.as_bytes()).await?;
        w.flush().await
    };
    match tokio::time::timeout(timeout, write).await {
        Ok(r) => r.map_err(BenchError::from),
        Err(_) => fail(format!(
            "could not write within {timeout:?} (peer not reading)"
        )),
    }
}

/// Stops the heartbeat task when dropped.
#[derive(Debug)]
pub(crate) struct Heartbeat(JoinHandle<()>);

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keep a control connection alive across silent networks: a peer host that vanishes
/// is noticed in seconds, not hours.
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(2))
        .with_retries(3);
    let _ = socket2::SockRef::from(stream).set_tcp_keepalive(&ka);
}

/// Target side: bind `listen`, report the bound address, accept one initiator.
pub(crate) async fn accept(
    listen: SocketAddr,
    timeout: Duration,
    on_bound: impl FnOnce(SocketAddr),
) -> Result<(TcpStream, SocketAddr)> {
    let listener = bind(listen).await?;
    on_bound(listener.local_addr()?);
    accept_one(listener, timeout).await
}

/// Target side: the control listener, bound before anyone is told where it is.
pub(crate) async fn bind(listen: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(listen)
        .await
        .with_context(|| format!("listen on {listen}"))
}

/// Target side: accept one initiator on `listener` within `timeout`, then stop
/// listening.
pub(crate) async fn accept_one(
    listener: TcpListener,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr)> {
    match tokio::time::timeout(timeout, listener.accept()).await {
        Ok(Ok((stream, from))) => {
            tune(&stream);
            Ok((stream, from))
        }
        Ok(Err(e)) => Err(e).context("accept an initiator"),
        Err(_) => fail(format!(
            "no initiator connected within {timeout:?} (raise --connect-timeout to wait longer)"
        )),
    }
}

/// Initiator side: connect to the target, retrying until `timeout` so either side may
/// start first.
pub(crate) async fn connect(peer: &str, timeout: Duration) -> Result<TcpStream> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last: Option<std::io::Error> = None;
    loop {
        let attempt = async {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host(peer).await?.collect();
            let mut err = None;
            for a in addrs {
                match TcpStream::connect(a).await {
                    Ok(s) => return Ok(s),
                    Err(e) => err = Some(e),
                }
            }
            Err(err
                .unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))
        };
        match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(stream)) => {
                tune(&stream);
                return Ok(stream);
            }
            // A malformed address will not get better by waiting.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidInput => {
                return Err(e).with_context(|| format!("resolve the target address {peer:?}"));
            }
            Ok(Err(e)) => last = Some(e),
            Err(_) => {}
        }
        if tokio::time::Instant::now() + Duration::from_millis(200) >= deadline {
            let why = last.map_or_else(|| "timed out".to_owned(), |e| e.to_string());
            return fail(format!(
                "could not reach the target at {peer} within {timeout:?}: {why}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex(&b), "0001abff");
        assert_eq!(unhex("0001ABff").unwrap(), b);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
    }

    #[test]
    fn messages_round_trip() {
        let setup = ToTarget::Setup(Box::new(Setup {
            protocol: PROTOCOL,
            version: "0.1.0".into(),
            backend: "tcp".into(),
            buffer_size: 4096,
            seg_type: SegType::Dram,
            device_id: 0,
            memory: MemSource::Backend,
            huge_pages: false,
            initiator_metadata: "00ff".into(),
        }));
        let line = setup.encode();
        assert!(line.starts_with("setup {"));
        match ToTarget::decode(&line).unwrap() {
            ToTarget::Setup(s) => assert_eq!((s.buffer_size, s.backend.as_str()), (4096, "tcp")),
            other => panic!("{other:?}"),
        }
        let md = ToInitiator::Metadata(vec![1, 2, 3]);
        assert_eq!(md.encode(), "metadata 010203");
        assert!(
            matches!(ToInitiator::decode("metadata 010203").unwrap(), ToInitiator::Metadata(v) if v == [1, 2, 3])
        );
        assert_eq!(ToInitiator::Error("a\nb".into()).encode(), "error a b");
        assert!(ToTarget::decode("launch missiles").is_err());
        assert!(ToInitiator::decode("ok extra").is_err());
    }

    #[tokio::test]
    async fn recv_times_out_and_reports_eof() {
        let (a, b) = tokio::io::duplex(1024);
        let (ar, aw) = tokio::io::split(a);
        let mut ch = Channel::new(ar, aw, "peer", Duration::from_secs(1));
        let e = ch
            .recv::<ToInitiator>(Duration::from_millis(50), "metadata")
            .await
            .unwrap_err();
        assert!(e.to_string().contains("sent no metadata within"), "{e}");
        drop(b);
        let e = ch
            .recv::<ToInitiator>(Duration::from_secs(5), "metadata")
            .await
            .unwrap_err();
        assert!(e.to_string().contains("closed the control channel"), "{e}");
    }
}
