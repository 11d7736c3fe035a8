//! nixl-tcp's target under hostile input, spoken straight over the wire: forged keys,
//! out-of-range and stale requests, oversized frames and random bytes are refused, the
//! target's registered memory stays unchanged (checksummed), and it keeps serving.
//! Also: the shared-secret handshake.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::StreamExt;
use nixl::metadata::AgentMetadata;
use nixl::{Agent, ErrorKind, Registration, SharedSecret};
use nixl_conformance::support::{bounded, checksum, figure, one, pattern, remote};
use nixl_tcp::{TcpBackend, TcpOptions};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// The documented wire format (nixl-tcp/src/wire.rs), written independently here.
const WRITE: u8 = 1;
const READ: u8 = 2;
const ST_OK: u8 = 0;
const ST_BAD_KEY: u8 = 1;
const ST_OUT_OF_RANGE: u8 = 2;
const ST_TOO_LARGE: u8 = 3;

struct Raw {
    s: TcpStream,
    next: u64,
}

impl Raw {
    async fn connect(addr: SocketAddr) -> Self {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&nixl_tcp::wire_hello("mallory")).await.unwrap();
        let mut reply = [0u8; 7];
        s.read_exact(&mut reply).await.unwrap();
        assert_eq!(reply[6], ST_OK, "no secret configured");
        // No same-host path for this client.
        s.write_all(&[0]).await.unwrap();
        Self { s, next: 1 }
    }

    /// Send a request of single blocks (key, address, length); returns the ACK status
    /// and whether DATA came before it.
    async fn request(
        &mut self,
        kind: u8,
        segs: &[(u64, u64, u64)],
        notif: Option<&[u8]>,
        payload: &[u8],
    ) -> (u8, bool) {
        let runs: Vec<_> = segs.iter().map(|&(k, a, l)| (k, a, l, 0, 1)).collect();
        self.request_runs(kind, &runs, notif, payload).await
    }

    /// Send a request of runs (key, address, length, stride, blocks).
    async fn request_runs(
        &mut self,
        kind: u8,
        runs: &[(u64, u64, u64, u64, u64)],
        notif: Option<&[u8]>,
        payload: &[u8],
    ) -> (u8, bool) {
        self.send_raw(
            kind,
            runs.len() as u32,
            notif.map_or(0, |n| n.len() as u32),
            notif.is_some(),
        )
        .await;
        let mut body = Vec::new();
        for &(k, a, l, stride, blocks) in runs {
            for x in [k, a, l, stride, blocks] {
                body.extend_from_slice(&x.to_le_bytes());
            }
        }
        body.extend_from_slice(notif.unwrap_or_default());
        body.extend_from_slice(payload);
        self.s.write_all(&body).await.unwrap();
        self.ack().await
    }

    /// Send bytes `from..from + len` of a request of runs as a piece (flag bit 1, the
    /// range after the header); returns the ACK status and the DATA a READ got.
    async fn piece(
        &mut self,
        kind: u8,
        runs: &[(u64, u64, u64, u64, u64)],
        (from, len): (u64, u64),
        payload: &[u8],
    ) -> (u8, Option<Vec<u8>>) {
        let mut frame = [0u8; 24].to_vec();
        frame[0] = kind;
        frame[1] = 2;
        frame[4..8].copy_from_slice(&(runs.len() as u32).to_le_bytes());
        frame[8..16].copy_from_slice(&self.next.to_le_bytes());
        self.next += 1;
        frame.extend_from_slice(&from.to_le_bytes());
        frame.extend_from_slice(&len.to_le_bytes());
        for &(k, a, l, stride, blocks) in runs {
            for x in [k, a, l, stride, blocks] {
                frame.extend_from_slice(&x.to_le_bytes());
            }
        }
        frame.extend_from_slice(payload);
        self.s.write_all(&frame).await.unwrap();
        let mut data = None;
        loop {
            let mut h = [0u8; 24];
            self.s.read_exact(&mut h).await.unwrap();
            let n = u64::from_le_bytes(h[16..24].try_into().unwrap()) as usize;
            let msg_len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
            match h[0] {
                0x81 => {
                    let mut d = vec![0u8; n];
                    self.s.read_exact(&mut d).await.unwrap();
                    data = Some(d);
                }
                0x80 => {
                    let mut msg = vec![0u8; msg_len];
                    self.s.read_exact(&mut msg).await.unwrap();
                    return (h[1], data);
                }
                k => panic!("unexpected response kind {k:#x}"),
            }
        }
    }

    async fn send_raw(&mut self, kind: u8, segments: u32, notif_len: u32, has_notif: bool) {
        let mut h = [0u8; 24];
        h[0] = kind;
        h[1] = u8::from(has_notif);
        h[4..8].copy_from_slice(&segments.to_le_bytes());
        h[8..16].copy_from_slice(&self.next.to_le_bytes());
        h[16..20].copy_from_slice(&notif_len.to_le_bytes());
        self.next += 1;
        self.s.write_all(&h).await.unwrap();
    }

    async fn ack(&mut self) -> (u8, bool) {
        let mut data = false;
        loop {
            let mut h = [0u8; 24];
            self.s.read_exact(&mut h).await.unwrap();
            match h[0] {
                0x81 => {
                    data = true;
                    let len = u64::from_le_bytes(h[16..24].try_into().unwrap());
                    let mut skip = vec![0u8; len as usize];
                    self.s.read_exact(&mut skip).await.unwrap();
                }
                0x80 => {
                    let msg_len = u32::from_le_bytes(h[4..8].try_into().unwrap());
                    let mut msg = vec![0u8; msg_len as usize];
                    self.s.read_exact(&mut msg).await.unwrap();
                    return (h[1], data);
                }
                k => panic!("unexpected response kind {k:#x}"),
            }
        }
    }

    /// Whether the target closed the connection.
    async fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match bounded("read until close", self.s.read(&mut b)).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    }
}

fn key_of(md: &[u8], region: u64) -> u64 {
    let md = AgentMetadata::decode(md).unwrap();
    let r = md.regions.iter().find(|r| r.id == region).unwrap();
    u64::from_le_bytes(r.blobs[0].blob[..8].try_into().unwrap())
}

async fn target(options: TcpOptions) -> (Agent, SocketAddr) {
    let b = TcpBackend::with_options(options);
    let agent = Agent::builder("target")
        .backend(b.clone())
        .build()
        .await
        .unwrap();
    (agent, b.local_addr().unwrap())
}

fn sums(rs: &[&Registration]) -> Vec<u64> {
    rs.iter().map(|r| checksum(r)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_refused_memory_unchanged() {
    let (b, addr) = target(TcpOptions::default()).await;
    let r = b.register(pattern(1, 4096)).unwrap();
    let guard = b.register(pattern(2, 4096)).unwrap();
    let stale = b.register(pattern(3, 4096)).unwrap();
    let md = b.metadata().unwrap();
    let (key, gkey, skey) = (
        key_of(&md, r.id()),
        key_of(&md, guard.id()),
        key_of(&md, stale.id()),
    );
    b.deregister(&stale).unwrap();
    let before = sums(&[&r, &guard]);
    let base = r.addr();
    let mut c = Raw::connect(addr).await;
    let junk = vec![0xEEu8; 8192];
    let mut tried = 0;
    let mut refuse = |status: u8, expect: u8, what: &str| {
        tried += 1;
        assert_eq!(status, expect, "{what}");
    };
    refuse(
        c.request(WRITE, &[(key ^ 1, base, 16)], None, &junk[..16])
            .await
            .0,
        ST_BAD_KEY,
        "forged key",
    );
    refuse(
        c.request(WRITE, &[(gkey, base, 16)], None, &junk[..16])
            .await
            .0,
        ST_OUT_OF_RANGE,
        "another region's key",
    );
    refuse(
        c.request(WRITE, &[(key, base + 4090, 16)], None, &junk[..16])
            .await
            .0,
        ST_OUT_OF_RANGE,
        "past the end",
    );
    refuse(
        c.request(WRITE, &[(key, base - 8, 16)], None, &junk[..16])
            .await
            .0,
        ST_OUT_OF_RANGE,
        "before the start",
    );
    refuse(
        c.request(WRITE, &[(key, base, 0)], None, &[]).await.0,
        ST_OUT_OF_RANGE,
        "zero length",
    );
    refuse(
        c.request(WRITE, &[(key, u64::MAX - 4, 16)], None, &junk[..16])
            .await
            .0,
        ST_OUT_OF_RANGE,
        "address overflow",
    );
    refuse(
        c.request(
            WRITE,
            &[(key, base, 100), (key, base + 4000, 200)],
            Some(b"n"),
            &junk[..300],
        )
        .await
        .0,
        ST_OUT_OF_RANGE,
        "second segment bad: the first must not be written",
    );
    refuse(
        c.request(WRITE, &[(skey, stale.addr(), 16)], None, &junk[..16])
            .await
            .0,
        ST_BAD_KEY,
        "stale key of a deregistered region",
    );
    refuse(
        c.request_runs(WRITE, &[(key, base, 16, 1024, 5)], None, &junk[..80])
            .await
            .0,
        ST_OUT_OF_RANGE,
        "a run whose last block is past the end",
    );
    refuse(
        c.request_runs(
            WRITE,
            &[(key, base, 16, u64::MAX / 2, 3)],
            None,
            &junk[..48],
        )
        .await
        .0,
        ST_OUT_OF_RANGE,
        "a run whose stride overflows",
    );
    refuse(
        c.request_runs(WRITE, &[(key, base, 16, 16, 0)], None, &[])
            .await
            .0,
        ST_OUT_OF_RANGE,
        "a run of no blocks",
    );
    refuse(
        c.request_runs(
            WRITE,
            &[(key, base, 16, 16, 2), (gkey, base, 16, 16, 2)],
            None,
            &junk[..64],
        )
        .await
        .0,
        ST_OUT_OF_RANGE,
        "second run in another region: the first must not be written",
    );
    let (st, data) = c.request(READ, &[(key, base + 4000, 200)], None, &[]).await;
    refuse(st, ST_OUT_OF_RANGE, "read past the end");
    assert!(!data, "no data for a refused read");
    refuse(
        c.request(READ, &[(key ^ 0xFF00, base, 16)], None, &[])
            .await
            .0,
        ST_BAD_KEY,
        "read with a forged key",
    );
    assert_eq!(sums(&[&r, &guard]), before, "target memory unchanged");
    // The connection still works after refusals.
    let (st, _) = c.request(WRITE, &[(key, base, 4)], None, b"good").await;
    assert_eq!(st, ST_OK);
    assert_eq!(&r.to_vec().unwrap()[..4], b"good");
    // A strided run lands block by block.
    let (st, _) = c
        .request_runs(WRITE, &[(key, base + 100, 4, 8, 3)], None, b"aaaabbbbcccc")
        .await;
    assert_eq!(st, ST_OK);
    let mut want = pattern(1, 4096)[100..120].to_vec();
    for (i, b) in [b"aaaa", b"bbbb", b"cccc"].into_iter().enumerate() {
        want[i * 8..i * 8 + 4].copy_from_slice(b);
    }
    assert_eq!(&r.to_vec().unwrap()[100..120], &want[..]);
    let (st, data) = c
        .request_runs(READ, &[(key, base + 100, 4, 8, 3)], None, &[])
        .await;
    assert_eq!((st, data), (ST_OK, true));
    let before = sums(&[&r, &guard]);
    // Oversized: a segment count the target will not allocate for, then a notification
    // over the limit. Each is refused and closes only that connection.
    let mut big = Raw::connect(addr).await;
    big.send_raw(WRITE, u32::MAX, 0, false).await;
    assert_eq!(big.ack().await.0, ST_TOO_LARGE);
    assert!(big.closed().await);
    let mut big = Raw::connect(addr).await;
    big.send_raw(WRITE, 1, u32::MAX, true).await;
    assert_eq!(big.ack().await.0, ST_TOO_LARGE);
    assert!(big.closed().await);
    // Run lengths whose total overflows: a protocol error, only this connection closes.
    let mut big = Raw::connect(addr).await;
    big.send_raw(WRITE, 1, 0, false).await;
    let mut entry = Vec::new();
    for x in [key, base, 16, 0, u64::MAX] {
        entry.extend_from_slice(&x.to_le_bytes());
    }
    big.s.write_all(&entry).await.unwrap();
    assert!(big.closed().await);
    tried += 1;
    // Unknown request kind: closed.
    let mut odd = Raw::connect(addr).await;
    odd.send_raw(0x42, 0, 0, false).await;
    assert!(odd.closed().await);
    tried += 3;
    assert_eq!(sums(&[&r, &guard]), before, "target memory unchanged");
    // A real agent still works.
    let a = Agent::builder("a")
        .backend(TcpBackend::new())
        .build()
        .await
        .unwrap();
    let src = a.register(vec![1u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    a.write(
        &one(src.whole()),
        "target",
        &one(remote(&a, "target", r.id()).desc(0, 4096)),
        None,
    )
    .await
    .unwrap();
    assert_eq!(r.to_vec().unwrap(), vec![1u8; 4096]);
    figure(
        "hostile nixl-tcp requests sent over the wire",
        format!("{tried} tried, {tried} refused, target memory unchanged"),
    );
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Pieces of a request (a transfer split across connections), spoken by hand: a
/// piece moves exactly its range of the request, and a request with any bad entry is
/// refused by every piece, whatever range the piece covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pieces_move_their_range_and_are_checked_whole() {
    let (b, addr) = target(TcpOptions::default()).await;
    let r = b.register(pattern(1, 4096)).unwrap();
    let key = key_of(&b.metadata().unwrap(), r.id());
    let base = r.addr();
    let mut c = Raw::connect(addr).await;
    // Five blocks of 10 bytes every 20 from offset 100: bytes 13..33 of the request
    // are the last 7 of block 1, all of block 2 and the first 3 of block 3.
    let run = [(key, base + 100, 10, 20, 5)];
    let (st, _) = c.piece(WRITE, &run, (13, 20), &[0xAB; 20]).await;
    assert_eq!(st, ST_OK);
    let mut want = pattern(1, 4096);
    for at in (123..130).chain(140..150).chain(160..163) {
        want[at] = 0xAB;
    }
    assert!(
        r.to_vec().unwrap() == want,
        "exactly the piece's bytes changed"
    );
    let (st, data) = c.piece(READ, &run, (13, 20), &[]).await;
    assert_eq!((st, data), (ST_OK, Some(vec![0xAB; 20])));
    let (st, data) = c.piece(READ, &run, (0, 3), &[]).await;
    assert_eq!((st, data), (ST_OK, Some(want[100..103].to_vec())));
    // A bad second run refuses a piece that lies wholly in the good first one.
    let bad = [(key, base, 16, 16, 2), (key, base + 4090, 16, 16, 1)];
    let before = checksum(&r);
    let (st, _) = c.piece(WRITE, &bad, (0, 16), &[0xCD; 16]).await;
    assert_eq!(st, ST_OUT_OF_RANGE, "checked whole");
    let (st, data) = c.piece(READ, &bad, (0, 16), &[]).await;
    assert_eq!((st, data), (ST_OUT_OF_RANGE, None));
    assert_eq!(checksum(&r), before, "nothing written");
    // A range outside its request: a protocol error, the connection closes.
    let mut frame = [0u8; 24].to_vec();
    frame[0] = WRITE;
    frame[1] = 2;
    frame[4..8].copy_from_slice(&1u32.to_le_bytes());
    for x in [40u64, 20] {
        frame.extend_from_slice(&x.to_le_bytes());
    }
    let (k, a, l, stride, blocks) = run[0];
    for x in [k, a, l, stride, blocks] {
        frame.extend_from_slice(&x.to_le_bytes());
    }
    c.s.write_all(&frame).await.unwrap();
    assert!(c.closed().await);
    assert_eq!(checksum(&r), before, "nothing written");
    let _ = b.shutdown().await;
}

fn with_secret(s: Option<&str>) -> TcpOptions {
    TcpOptions {
        secret: s.map(|s| SharedSecret::new(s).unwrap()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_secret_gates_every_connection() {
    let (b, addr) = target(with_secret(Some("deployment-secret"))).await;
    let mem = b.register(pattern(9, 4096)).unwrap();
    let before = checksum(&mem);
    let md = b.metadata().unwrap();
    for (secret, what) in [(None, "no secret"), (Some("wrong"), "wrong secret")] {
        let a = Agent::builder("a")
            .backend(TcpBackend::with_options(with_secret(secret)))
            .build()
            .await
            .unwrap();
        let src = a.register(vec![0u8; 4096]).unwrap();
        a.load_metadata(&md).unwrap();
        let rd = remote(&a, "target", mem.id());
        let e = bounded(
            what,
            a.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{what}: {e}");
        let e = bounded(
            what,
            a.read(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAllowed, "{what}: {e}");
        assert_eq!(
            src.to_vec().unwrap(),
            vec![0u8; 4096],
            "{what}: nothing was read"
        );
        let _ = a.shutdown().await;
    }
    // A raw client that says hello without authenticating is told the secret is
    // required and closed, before any request is read.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&nixl_tcp::wire_hello("m")).await.unwrap();
    let mut reply = [0u8; 7];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(reply[6], 4, "authentication required");
    assert_eq!(s.read(&mut [0u8; 1]).await.unwrap(), 0, "then closed");
    // One that guesses a proof is refused.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut auth = nixl::control::AUTH_MAGIC.to_vec();
    auth.extend_from_slice(&[7u8; 32]);
    s.write_all(&auth).await.unwrap();
    let mut proof = [0u8; 1 + 32 + 32];
    s.read_exact(&mut proof).await.unwrap();
    assert_eq!(proof[0], 0, "the target proves itself first");
    let mut guess = 1u16.to_le_bytes().to_vec();
    guess.extend_from_slice(b"m");
    guess.extend_from_slice(&[0u8; 32]);
    s.write_all(&guess).await.unwrap();
    let mut status = [0u8; 1];
    s.read_exact(&mut status).await.unwrap();
    assert_eq!(status[0], 1, "refused");
    assert_eq!(checksum(&mem), before);
    // The right secret works; a client with a secret refuses a target without one.
    let a = Agent::builder("a")
        .backend(TcpBackend::with_options(with_secret(Some(
            "deployment-secret",
        ))))
        .build()
        .await
        .unwrap();
    let src = a.register(vec![5u8; 4096]).unwrap();
    a.load_metadata(&md).unwrap();
    a.write(
        &one(src.whole()),
        "target",
        &one(remote(&a, "target", mem.id()).desc(0, 4096)),
        None,
    )
    .await
    .unwrap();
    assert_eq!(mem.to_vec().unwrap(), vec![5u8; 4096]);
    let open = Agent::builder("open")
        .backend(TcpBackend::new())
        .build()
        .await
        .unwrap();
    let om = open.register(vec![0u8; 64]).unwrap();
    a.load_metadata(&open.metadata().unwrap()).unwrap();
    let e = a
        .write(
            &one(src.desc(0, 64)),
            "open",
            &one(remote(&a, "open", om.id()).desc(0, 64)),
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "{e}");
    for x in [a, b, open] {
        let _ = x.shutdown().await;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random bytes after a valid hello never crash the target or touch its memory.
    #[test]
    fn random_wire_bytes(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 1..5)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let (b, addr) = target(TcpOptions::default()).await;
            let mem = b.register(pattern(4, 4096)).unwrap();
            let before = checksum(&mem);
            for c in &chunks {
                let mut raw = Raw::connect(addr).await;
                let _ = raw.s.write_all(c).await;
                let _ = raw.s.shutdown().await;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            assert_eq!(checksum(&mem), before);
            // Still serving.
            let mut ok = Raw::connect(addr).await;
            let key = key_of(&b.metadata().unwrap(), mem.id());
            assert_eq!(ok.request(READ, &[(key, mem.addr(), 8)], None, &[]).await, (ST_OK, true));
            let _ = b.shutdown().await;
        });
    }
}

/// Deregistration cuts off the requests the target is serving from that memory.
mod deregistration {
    use super::*;

    /// Register `mem` filled with 0x11 and start a WRITE of all of it whose payload
    /// comes in two parts; deregister between them. Nothing of the second part may
    /// reach the memory, and the target cuts the connection.
    async fn slow_write_cut_by_deregister(mem: nixl::Memory) {
        let (b, addr) = target(TcpOptions::default()).await;
        let len = mem.len();
        let r = b.register(mem).unwrap();
        r.write_at(0, &vec![0x11; len]).unwrap();
        let key = key_of(&b.metadata().unwrap(), r.id());
        let mut c = Raw::connect(addr).await;
        c.send_raw(WRITE, 1, 0, false).await;
        let mut table = Vec::new();
        for x in [key, r.addr(), len as u64, 0, 1] {
            table.extend_from_slice(&x.to_le_bytes());
        }
        c.s.write_all(&table).await.unwrap();
        // One staging chunk of GPU memory (they move whole).
        let first = 4 << 20;
        c.s.write_all(&vec![0xEE; first]).await.unwrap();
        bounded("the first part lands", async {
            loop {
                let mut b = [0u8; 1];
                r.read_at(first - 1, &mut b).unwrap();
                if b[0] == 0xEE {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await;
        // Refused while a staging copy of the first part still runs (GPU memory).
        bounded("deregister", async {
            loop {
                match b.deregister(&r) {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::NotAllowed => {
                        tokio::time::sleep(Duration::from_millis(1)).await
                    }
                    Err(e) => panic!("deregister: {e}"),
                }
            }
        })
        .await;
        let at_deregistration = r.to_vec().unwrap();
        // The rest of the payload (the target may already have cut the connection).
        let _ = c.s.write_all(&vec![0xEE; len - first]).await;
        let mut reply = [0u8; 24];
        let answered = bounded("the target answers or closes", c.s.read(&mut reply)).await;
        assert!(
            r.to_vec().unwrap() == at_deregistration,
            "bytes were written into the memory after deregister returned"
        );
        assert!(
            at_deregistration.contains(&0x11),
            "the whole payload landed before the cut"
        );
        figure(
            &format!("hostile: slow WRITE cut by deregister ({})", r.kind()),
            format!(
                "{} MiB sent after deregister returned, 0 bytes of it landed; connection cut",
                (len - first) >> 20
            ),
        );
        assert!(
            matches!(answered, Ok(0) | Err(_)),
            "the target answered a request into withdrawn memory instead of cutting it: {answered:?}"
        );
        // The target still serves others.
        let other = b.register(pattern(9, 4096)).unwrap();
        let okey = key_of(&b.metadata().unwrap(), other.id());
        let mut c = Raw::connect(addr).await;
        let (status, _) = c
            .request(WRITE, &[(okey, other.addr(), 16)], None, &[7; 16])
            .await;
        assert_eq!(status, ST_OK);
        assert!(b.shutdown().await.is_clean());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_write_after_deregister_leaves_host_memory_untouched() {
        slow_write_cut_by_deregister(pattern(1, 12 << 20).into()).await;
    }

    /// GPU memory (the CUDA driver test double) goes through staging copies: none
    /// starts after deregistration.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_write_after_deregister_leaves_device_memory_untouched() {
        const CASE: &str = "a_slow_write_after_deregister_leaves_device_memory_untouched";
        match nixl_testkit::fake_cuda::library() {
            Ok(lib) => std::env::set_var(nixl::gpu::ENV_LIB, lib),
            Err(e) => return nixl_testkit::skip(CASE, format!("no CUDA driver double: {e}")),
        }
        slow_write_cut_by_deregister(nixl::Memory::vram(0, 12 << 20).unwrap()).await;
    }

    /// A READ being sent stops sending from the memory at deregistration: bytes
    /// written into it afterwards never reach the peer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_stops_sending_at_deregister() {
        let (b, addr) = target(TcpOptions::default()).await;
        let len = 32 << 20;
        let r = b.register(vec![0x11; len]).unwrap();
        let key = key_of(&b.metadata().unwrap(), r.id());
        let mut c = Raw::connect(addr).await;
        c.send_raw(READ, 1, 0, false).await;
        let mut table = Vec::new();
        for x in [key, r.addr(), len as u64, 0, 1] {
            table.extend_from_slice(&x.to_le_bytes());
        }
        c.s.write_all(&table).await.unwrap();
        let mut head = [0u8; 24];
        c.s.read_exact(&mut head).await.unwrap();
        assert_eq!(head[0], 0x81, "DATA first");
        let mut got = vec![0u8; 1 << 20];
        c.s.read_exact(&mut got).await.unwrap();
        b.deregister(&r).unwrap();
        r.write_at(0, &vec![0xBB; len]).unwrap();
        let mut late = 0usize;
        let mut total = got.len();
        while total < len + 24 {
            match bounded("read until the cut", c.s.read(&mut got)).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    late += got[..n].iter().filter(|&&x| x == 0xBB).count();
                    total += n;
                }
            }
        }
        assert_eq!(
            late, 0,
            "bytes read from the memory after deregister reached the peer"
        );
        assert!(total < len + 24, "the whole READ was sent: {total} bytes");
        figure(
            "hostile: READ being sent when deregistered",
            format!("{} MiB of {} MiB sent (what the socket held at deregistration), 0 bytes of memory written afterwards reached the peer", total >> 20, len >> 20),
        );
        assert!(b.shutdown().await.is_clean());
    }
}

/// A connection is bound to the agent name it proved: a holder of the secret that
/// authenticates as one agent and says hello as another (to send notifications in
/// its name) is refused before anything is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cannot_say_hello_as_another_agent_than_it_proved() {
    let secret = SharedSecret::new("deployment-secret").unwrap();
    let (t, addr) = target(with_secret(Some("deployment-secret"))).await;
    for (proven, hello, accepted) in [
        ("mallory", "prefill-0", false),
        ("prefill-0", "prefill-0", true),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let (mut auth, first) = nixl::control::ClientAuth::start(
            "nixl-tcp",
            secret.clone(),
            proven,
            "target",
            nixl::control::nonce(),
        )
        .unwrap();
        s.write_all(&first).await.unwrap();
        while !auth.is_done() {
            let mut b = vec![0u8; auth.need()];
            s.read_exact(&mut b).await.unwrap();
            let out = auth.received(&b).unwrap();
            s.write_all(&out).await.unwrap();
        }
        s.write_all(&nixl_tcp::wire_hello(hello)).await.unwrap();
        let mut reply = [0u8; 7];
        s.read_exact(&mut reply).await.unwrap();
        if !accepted {
            assert_eq!(reply[6], 5, "proved {proven:?}, said hello as {hello:?}");
            assert_eq!(s.read(&mut [0u8; 1]).await.unwrap(), 0, "then closed");
            continue;
        }
        assert_eq!(reply[6], 0);
        // No same-host path, then a notification: it arrives under the proven name.
        s.write_all(&[0]).await.unwrap();
        let note = b"kv ready";
        let mut req = vec![3u8, 1, 0, 0];
        req.extend_from_slice(&0u32.to_le_bytes());
        req.extend_from_slice(&1u64.to_le_bytes());
        req.extend_from_slice(&(note.len() as u32).to_le_bytes());
        req.extend_from_slice(&[0; 4]);
        req.extend_from_slice(note);
        s.write_all(&req).await.unwrap();
    }
    let mut notes = t.notifications().unwrap();
    let n = bounded("the notification", notes.next()).await.unwrap();
    assert_eq!(
        (n.peer.as_str(), &n.msg[..]),
        ("prefill-0", &b"kv ready"[..])
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(200), notes.next())
            .await
            .is_err(),
        "nothing arrived from the refused connection"
    );
    let _ = t.shutdown().await;
}

/// One agent-level secret (`AgentBuilder::secret`) authenticates nixl-tcp's
/// connections and the side channel alike: an agent without it reaches neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_secret_gates_the_backend_and_the_side_channel() {
    let secret = SharedSecret::new("deployment-secret").unwrap();
    let agent = |name: &'static str, secret: Option<SharedSecret>| async move {
        let b = Agent::builder(name).backend(TcpBackend::with_options(TcpOptions {
            same_host: nixl_tcp::SameHost::Off,
            ..TcpOptions::default()
        }));
        match secret {
            Some(s) => b.secret(s),
            None => b,
        }
        .build()
        .await
        .unwrap()
    };
    let t = agent("target", Some(secret.clone())).await;
    let mem = t.register(vec![0u8; 4096]).unwrap();
    let sc = nixl::SideChannelOptions::default();
    let at = t.listen("127.0.0.1:0".parse().unwrap(), &sc).await.unwrap();

    // Without the secret: the side channel and the backend both refuse.
    let outsider = agent("outsider", None).await;
    let e = bounded("fetch", outsider.fetch_metadata(at, &sc))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "side channel: {e}");
    outsider.load_metadata(&t.metadata().unwrap()).unwrap();
    let src = outsider.register(vec![7u8; 4096]).unwrap();
    let rd = remote(&outsider, "target", mem.id());
    let e = bounded(
        "write",
        outsider.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotAllowed, "nixl-tcp: {e}");
    assert_eq!(mem.to_vec().unwrap(), vec![0u8; 4096]);

    // With it: both work, with no secret in either's own options.
    let insider = agent("insider", Some(secret)).await;
    assert_eq!(
        bounded("fetch", insider.fetch_metadata(at, &sc))
            .await
            .unwrap(),
        "target"
    );
    let src = insider.register(vec![9u8; 4096]).unwrap();
    let rd = remote(&insider, "target", mem.id());
    bounded(
        "write",
        insider.write(&one(src.whole()), "target", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap();
    assert_eq!(mem.to_vec().unwrap(), vec![9u8; 4096]);
    for a in [outsider, insider, t] {
        assert!(bounded("shutdown", a.shutdown()).await.is_clean());
    }
}
