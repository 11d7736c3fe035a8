//! Hostile requests and pieces on the raw wire; the shared secret gating every
//! connection.

use super::*;

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
