//! NIXL's metadata format: golden blobs captured from a real NIXL 1.5.1 agent, the
//! codec's properties, and what an agent does with NIXL metadata, against a test
//! double of a backend that speaks NIXL's dialect.
//!
//! The golden blobs (`tests/data/nixl-1.5.1/`) come from the `nixl-cu12` 1.5.1 wheel's
//! Python API: an agent named `golden` with UCX (`UCX_NET_DEVICES=lo UCX_MODULES=^ib`)
//! registered two DRAM buffers of 4096 and 8192 bytes; `full.bin` is
//! `get_agent_metadata()`, `partial.bin` and `partial_conn.bin` are
//! `get_partial_agent_metadata` of the 8192-byte buffer without and with connection
//! info.

use std::sync::{Arc, Mutex};

use nixl::interop::{self, NixlConn, NixlDesc, NixlMetadata, NixlSection};
use nixl::{
    Agent, Bytes, Capabilities, Completer, DescList, ErrorKind, Indices, MemKind, NixlDialect, Op,
    PeerLink, PreparedTransfer, RegionRef, RequestOptions, Result, TransferPlan,
};
use nixl_testkit::double::{shared, Double, NullLink};
use proptest::prelude::*;

const FULL: &[u8] = include_bytes!("data/nixl-1.5.1/full.bin");
const PARTIAL: &[u8] = include_bytes!("data/nixl-1.5.1/partial.bin");
const PARTIAL_CONN: &[u8] = include_bytes!("data/nixl-1.5.1/partial_conn.bin");

#[test]
fn golden_full_metadata_decodes_and_reencodes_byte_for_byte() {
    let md = NixlMetadata::decode(FULL).unwrap();
    assert_eq!(md.name, "golden");
    assert_eq!(md.conns.len(), 1);
    assert_eq!(md.conns[0].backend, "UCX");
    assert_eq!(md.conns[0].info.len(), 184, "UCX worker address");
    assert_eq!(md.sections.len(), 1);
    let s = &md.sections[0];
    assert_eq!((s.backend.as_str(), s.mem_type), ("UCX", interop::MEM_DRAM));
    let mut lens: Vec<u64> = s.descs.iter().map(|d| d.len).collect();
    lens.sort();
    assert_eq!(lens, [4096, 8192]);
    assert!(s.descs.windows(2).all(|w| w[0].addr < w[1].addr), "sorted");
    for d in &s.descs {
        assert_eq!(d.device, 0);
        assert!(!d.blob.is_empty(), "a packed remote key");
    }
    assert_eq!(md.encode().unwrap(), FULL);
    assert_eq!(md.encoded_len(), FULL.len());
}

#[test]
fn golden_partial_metadata_decodes_and_reencodes_byte_for_byte() {
    let full = NixlMetadata::decode(FULL).unwrap();
    let big = full.sections[0]
        .descs
        .iter()
        .find(|d| d.len == 8192)
        .unwrap()
        .clone();
    let p = NixlMetadata::decode(PARTIAL).unwrap();
    assert_eq!(p.name, "golden");
    assert!(p.conns.is_empty());
    assert_eq!(p.sections.len(), 1);
    assert_eq!(p.sections[0].descs, vec![big.clone()]);
    assert_eq!(p.encode().unwrap(), PARTIAL);

    let pc = NixlMetadata::decode(PARTIAL_CONN).unwrap();
    assert_eq!(pc.conns, full.conns);
    assert_eq!(pc.sections[0].descs, vec![big]);
    assert_eq!(pc.encode().unwrap(), PARTIAL_CONN);
}

#[test]
fn golden_blobs_truncated_anywhere_are_corrupt() {
    for bytes in [FULL, PARTIAL, PARTIAL_CONN] {
        for n in 0..bytes.len() {
            let e = NixlMetadata::decode(&bytes[..n]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{n}: {e}");
        }
    }
}

/// A test double of a backend that speaks NIXL's dialect: blobs are `b"K" + NIXL's`,
/// and it records which peers were added in which dialect. It moves no data.
#[derive(Debug, Default)]
struct NixlSpeakerDouble {
    added: Mutex<Vec<(String, Vec<u8>, bool)>>,
    /// For each peer added in NIXL's dialect: whether it said it is nixl-rs.
    nixl_rs: Mutex<Vec<bool>>,
}

#[derive(Debug)]
struct Nothing;

impl PreparedTransfer for Nothing {
    fn post(&self, _notif: Option<Bytes>, done: Completer) {
        done.complete(Ok(()));
    }
}

impl Double for NixlSpeakerDouble {
    fn name(&self) -> &str {
        "speaker"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: true,
            notifications: true,
            dram: true,
            ..Capabilities::default()
        }
    }
    fn connection_info(&self) -> Bytes {
        Bytes::from_static(b"speaker-address")
    }
    fn register(&self, region: &RegionRef) -> Result<Bytes> {
        Ok(Bytes::from(format!("Kkey{}", region.id())))
    }
    fn nixl(&self) -> Option<&dyn NixlDialect> {
        Some(self)
    }
    fn link(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn PeerLink>> {
        self.added
            .lock()
            .unwrap()
            .push((peer.into(), conn_info.into(), false));
        Ok(Arc::new(NullLink))
    }
    fn prepare(&self, _plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        Ok(Box::new(Nothing))
    }
}

impl NixlDialect for NixlSpeakerDouble {
    fn backend_type(&self) -> &str {
        "UCX"
    }
    fn export_blob(&self, blob: &[u8]) -> Result<Vec<u8>> {
        Ok(blob.strip_prefix(b"K").unwrap().to_vec())
    }
    fn import_blob(&self, _addr: u64, _len: u64, blob: &[u8]) -> Result<Bytes> {
        Ok(Bytes::from([b"K".as_slice(), blob].concat()))
    }
    fn link(&self, peer: &str, conn_info: &[u8], nixl_rs: bool) -> Result<Arc<dyn PeerLink>> {
        self.added
            .lock()
            .unwrap()
            .push((peer.into(), conn_info.into(), true));
        self.nixl_rs.lock().unwrap().push(nixl_rs);
        Ok(Arc::new(NullLink))
    }
}

async fn speaker(name: &str) -> (Agent, std::sync::Arc<NixlSpeakerDouble>) {
    let b = std::sync::Arc::new(NixlSpeakerDouble::default());
    let a = Agent::builder(name)
        .backend(shared(b.clone()))
        .build()
        .await
        .unwrap();
    (a, b)
}

fn remote_list(agent: &Agent, peer: &str) -> DescList {
    DescList::from_descs(
        MemKind::Dram,
        agent
            .remote_regions(peer)
            .unwrap()
            .iter()
            .map(|r| r.desc(0, r.len)),
    )
}

#[tokio::test]
async fn a_nixl_agents_metadata_loads_a_nixl_peer() {
    let (a, b) = speaker("rust").await;
    assert_eq!(a.load_metadata(FULL).unwrap(), "golden");
    assert!(a.is_nixl_peer("golden").unwrap());
    let added = b.added.lock().unwrap().clone();
    assert_eq!(added.len(), 1);
    assert_eq!(added[0].0, "golden");
    assert_eq!(added[0].1.len(), 184);
    assert!(added[0].2, "added in NIXL's dialect");
    assert_eq!(
        *b.nixl_rs.lock().unwrap(),
        [false],
        "a NIXL agent, not nixl-rs"
    );
    let full = NixlMetadata::decode(FULL).unwrap();
    let mut want: Vec<(u64, u64)> = full.sections[0]
        .descs
        .iter()
        .map(|d| (d.addr, d.len))
        .collect();
    want.sort();
    let got: Vec<(u64, u64)> = {
        let mut v: Vec<_> = a
            .remote_regions("golden")
            .unwrap()
            .iter()
            .map(|r| (r.addr, r.len))
            .collect();
        v.sort();
        v
    };
    assert_eq!(got, want);
}

#[tokio::test]
async fn nixl_loads_add_and_new_connection_info_replaces() {
    let (a, _b) = speaker("rust").await;
    // Partial metadata without connection info of an unknown agent: refused.
    assert_eq!(
        a.load_metadata(PARTIAL).unwrap_err().kind(),
        ErrorKind::UnknownPeer
    );
    a.load_metadata(PARTIAL_CONN).unwrap();
    assert_eq!(a.remote_regions("golden").unwrap().len(), 1);
    let before = a.prep_remote("golden", &remote_list(&a, "golden")).unwrap();
    // Same connection info: NIXL's loads add, and prepared lists stay valid.
    a.load_metadata(FULL).unwrap();
    a.load_metadata(PARTIAL).unwrap();
    assert_eq!(a.remote_regions("golden").unwrap().len(), 2);
    let local = a.register(vec![0u8; 8192]).unwrap();
    let l = a
        .prep_local(&DescList::from_descs(MemKind::Dram, [local.whole()]))
        .unwrap();
    a.make_request(
        Op::Write,
        &l,
        Indices::All,
        &before,
        Indices::All,
        &RequestOptions::default(),
    )
    .expect("the generation was kept");

    // New connection info under the same name: a restarted NIXL agent; everything
    // known is replaced and requests prepared before are stale.
    let mut restarted = NixlMetadata::decode(PARTIAL_CONN).unwrap();
    restarted.conns[0].info = b"another worker".to_vec();
    restarted.sections[0].descs[0].addr += 1 << 20;
    a.load_metadata(&restarted.encode().unwrap()).unwrap();
    let regions = a.remote_regions("golden").unwrap();
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].addr, restarted.sections[0].descs[0].addr);
    let e = a
        .make_request(
            Op::Write,
            &l,
            Indices::All,
            &before,
            Indices::All,
            &RequestOptions::default(),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::StaleGeneration, "{e}");
}

#[tokio::test]
async fn unknown_backends_and_memory_types_are_skipped() {
    let (a, b) = speaker("rust").await;
    let md = NixlMetadata {
        name: "mixed".into(),
        conns: vec![
            NixlConn {
                backend: "LIBFABRIC".into(),
                info: b"fabric".to_vec(),
            },
            NixlConn {
                backend: "UCX".into(),
                info: b"worker".to_vec(),
            },
        ],
        sections: vec![
            NixlSection {
                backend: "LIBFABRIC".into(),
                mem_type: interop::MEM_DRAM,
                descs: vec![desc(0x1000, 64)],
            },
            NixlSection {
                backend: "UCX".into(),
                mem_type: 4, // FILE_SEG
                descs: vec![desc(0x2000, 64)],
            },
            NixlSection {
                backend: "UCX".into(),
                mem_type: interop::MEM_VRAM,
                descs: vec![NixlDesc {
                    device: 3,
                    ..desc(0x3000, 64)
                }],
            },
        ],
    };
    a.load_metadata(&md.encode().unwrap()).unwrap();
    let r = a.remote_regions("mixed").unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].addr, r[0].kind),
        (0x3000, MemKind::Vram { device: 3 })
    );
    let added = b.added.lock().unwrap().clone();
    assert_eq!(added, vec![("mixed".into(), b"worker".to_vec(), true)]);
}

fn desc(addr: u64, len: u64) -> NixlDesc {
    NixlDesc {
        addr,
        len,
        device: 0,
        blob: vec![1, 2, 3],
    }
}

#[tokio::test]
async fn overlapping_nixl_descriptors_are_corrupt() {
    let (a, _b) = speaker("rust").await;
    let md = NixlMetadata {
        name: "overlap".into(),
        conns: vec![NixlConn {
            backend: "UCX".into(),
            info: b"w".to_vec(),
        }],
        sections: vec![NixlSection {
            backend: "UCX".into(),
            mem_type: interop::MEM_DRAM,
            descs: vec![desc(0x1000, 4096), desc(0x1800, 4096)],
        }],
    };
    let e = a.load_metadata(&md.encode().unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(a.peers().is_empty());
}

#[tokio::test]
async fn our_nixl_metadata_is_what_nixl_reads() {
    let (a, _b) = speaker("rust").await;
    let r1 = a.register(vec![1u8; 4096]).unwrap();
    let r2 = a.register(vec![2u8; 100]).unwrap();
    let md = NixlMetadata::decode(&a.nixl_metadata().unwrap()).unwrap();
    assert_eq!(md.name, "rust");
    // The nixl-rs marker (NIXL skips backend types it has not instantiated), then
    // the UCX connection info.
    assert_eq!(
        md.conns,
        vec![
            NixlConn {
                backend: interop::BACKEND_NIXL_RS.into(),
                info: interop::NIXL_RS_MARKER.to_vec()
            },
            NixlConn {
                backend: "UCX".into(),
                info: b"speaker-address".to_vec()
            }
        ]
    );
    assert_eq!(md.sections.len(), 1);
    let s = &md.sections[0];
    assert_eq!(s.mem_type, interop::MEM_DRAM);
    let mut want = vec![
        NixlDesc {
            addr: r1.addr(),
            len: 4096,
            device: 0,
            blob: format!("key{}", r1.id()).into_bytes(),
        },
        NixlDesc {
            addr: r2.addr(),
            len: 100,
            device: 0,
            blob: format!("key{}", r2.id()).into_bytes(),
        },
    ];
    want.sort_by_key(|d| d.addr);
    assert_eq!(s.descs, want);

    let p = NixlMetadata::decode(
        &a.nixl_partial_metadata(std::slice::from_ref(&r2), false)
            .unwrap(),
    )
    .unwrap();
    assert!(p.conns.is_empty());
    assert_eq!(p.sections[0].descs.len(), 1);
    assert_eq!(p.sections[0].descs[0].addr, r2.addr());
    let pc = NixlMetadata::decode(&a.nixl_partial_metadata(&[], true).unwrap()).unwrap();
    assert_eq!(pc.conns.len(), 2);
    assert!(pc.sections.is_empty());

    // Another agent of this crate loads it as a NIXL-format peer, told it is nixl-rs
    // (its backend then speaks its own protocol to it).
    let (b, bb) = speaker("other").await;
    b.load_metadata(&a.nixl_metadata().unwrap()).unwrap();
    assert!(b.is_nixl_peer("rust").unwrap());
    assert_eq!(b.remote_regions("rust").unwrap().len(), 2);
    assert_eq!(*bb.nixl_rs.lock().unwrap(), [true]);
    assert_eq!(bb.added.lock().unwrap()[0].1, b"speaker-address");

    // Its partial metadata without connection info (what NIXL's
    // sendLocalPartialMD sends) carries no marker: it adds the region and keeps the
    // link it has, made for nixl-rs (before, it relinked it as a plain NIXL agent).
    let r3 = a.register(vec![3u8; 64]).unwrap();
    b.load_metadata(
        &a.nixl_partial_metadata(std::slice::from_ref(&r3), false)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(b.remote_regions("rust").unwrap().len(), 3);
    assert_eq!(*bb.nixl_rs.lock().unwrap(), [true], "no new link");
}

#[tokio::test]
async fn agents_without_a_nixl_speaking_backend_say_so() {
    let a = Agent::builder("plain").build().await.unwrap();
    let e = a.load_metadata(FULL).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    assert!(e.to_string().contains("NIXL"), "{e}");
    assert_eq!(
        a.nixl_metadata().unwrap_err().kind(),
        ErrorKind::NotSupported
    );
}

fn nixl_metadata() -> impl Strategy<Value = NixlMetadata> {
    let conn = ("[A-Z]{1,10}", prop::collection::vec(any::<u8>(), 0..64))
        .prop_map(|(backend, info)| NixlConn { backend, info });
    let desc = (
        0u64..1 << 48,
        1u64..1 << 32,
        0u64..8,
        prop::collection::vec(any::<u8>(), 0..48),
    )
        .prop_map(|(addr, len, device, blob)| NixlDesc {
            addr,
            len,
            device,
            blob,
        });
    let section = ("[A-Z]{1,10}", 0u32..6, prop::collection::vec(desc, 0..12)).prop_map(
        |(backend, mem_type, descs)| NixlSection {
            backend,
            mem_type,
            descs,
        },
    );
    (
        "[a-zA-Z0-9_|-]{1,40}",
        prop::collection::vec(conn, 0..4),
        prop::collection::vec(section, 0..4),
    )
        .prop_map(|(name, conns, sections)| NixlMetadata {
            name,
            conns,
            sections,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn round_trips_canonically(md in nixl_metadata()) {
        let bytes = md.encode().unwrap();
        prop_assert_eq!(bytes.len(), md.encoded_len());
        let back = NixlMetadata::decode(&bytes).unwrap();
        prop_assert_eq!(&back, &md);
        prop_assert_eq!(back.encode().unwrap(), bytes);
    }

    #[test]
    fn arbitrary_bytes_never_panic(tail in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut bytes = interop::PREFIX.to_vec();
        bytes.extend_from_slice(&tail);
        if let Ok(md) = NixlMetadata::decode(&bytes) {
            prop_assert_eq!(md.encode().unwrap(), bytes);
        }
    }

    #[test]
    fn mutated_encodings_never_panic_and_stay_canonical(
        md in nixl_metadata(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut bytes = md.encode().unwrap();
        for (at, v) in edits {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        match NixlMetadata::decode(&bytes) {
            Ok(back) => prop_assert_eq!(back.encode().unwrap(), bytes),
            Err(e) => prop_assert_eq!(e.kind(), ErrorKind::Corrupt),
        }
    }

    #[test]
    fn notifications_round_trip(name in "[a-z|]{1,20}", msg in prop::collection::vec(any::<u8>(), 0..300)) {
        let b = interop::encode_notification(&name, &msg);
        let (n, m) = interop::decode_notification(&b, 256).unwrap();
        prop_assert_eq!(n, name);
        prop_assert_eq!(m, &msg[..]);
    }
}

fn one_desc_md(name: &str, info: &[u8], addr: u64, len: u64) -> Vec<u8> {
    NixlMetadata {
        name: name.into(),
        conns: vec![NixlConn {
            backend: "UCX".into(),
            info: info.to_vec(),
        }],
        sections: vec![NixlSection {
            backend: "UCX".into(),
            mem_type: interop::MEM_DRAM,
            descs: vec![desc(addr, len)],
        }],
    }
    .encode()
    .unwrap()
}

#[tokio::test]
async fn a_new_nixl_descriptor_replaces_the_known_ones_it_overlaps() {
    let (a, _b) = speaker("rust").await;
    a.load_metadata(&one_desc_md("n", b"w", 0x1000, 4096))
        .unwrap();
    a.load_metadata(&one_desc_md("n", b"w", 0x9000, 64))
        .unwrap();
    // NIXL deregistered 0x1000 and registered an overlapping, larger buffer.
    a.load_metadata(&one_desc_md("n", b"w", 0x1800, 8192))
        .unwrap();
    let mut got: Vec<(u64, u64)> = a
        .remote_regions("n")
        .unwrap()
        .iter()
        .map(|r| (r.addr, r.len))
        .collect();
    got.sort();
    assert_eq!(got, vec![(0x1800, 8192), (0x9000, 64)]);
}

#[tokio::test]
async fn empty_nixl_connection_info_is_no_connection_info() {
    let (a, b) = speaker("rust").await;
    let e = a
        .load_metadata(&one_desc_md("n", b"", 0x1000, 64))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownPeer, "{e}");
    a.load_metadata(&one_desc_md("n", b"w", 0x1000, 64))
        .unwrap();
    // Known: the empty connection info leaves the connection alone.
    a.load_metadata(&one_desc_md("n", b"", 0x2000, 64)).unwrap();
    assert_eq!(a.remote_regions("n").unwrap().len(), 2);
    assert_eq!(b.added.lock().unwrap().len(), 1, "connected once");
}

/// Frames of NIXL's listener protocol, by hand.
async fn frame(s: &mut tokio::net::TcpStream, body: &[u8]) {
    use tokio::io::AsyncWriteExt;
    s.write_all(&(body.len() as u64).to_le_bytes())
        .await
        .unwrap();
    s.write_all(body).await.unwrap();
}

/// Send `bodies`, then `SEND`, and wait for the answer: every earlier frame on the
/// connection has been handled by then.
async fn frames_then_fetch(at: std::net::SocketAddr, bodies: &[Vec<u8>]) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut s = tokio::net::TcpStream::connect(at).await.unwrap();
    for b in bodies {
        frame(&mut s, b).await;
    }
    frame(&mut s, b"NIXLCOMM:SEND").await;
    let mut len = [0u8; 8];
    s.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut body).await.unwrap();
    body
}

#[tokio::test]
async fn the_nixl_listener_follows_nixls_rules() {
    let (a, _b) = speaker("rust").await;
    let at = a
        .listen_nixl(
            ([127, 0, 0, 1], 0).into(),
            &nixl::NixlListenerOptions::default(),
        )
        .await
        .unwrap();
    // A peer of this crate, known through an authenticated channel.
    let (native, _nb) = speaker("native").await;
    a.load_metadata(&native.metadata().unwrap()).unwrap();
    let load = |md: &[u8]| [b"NIXLCOMM:LOAD".as_slice(), md].concat();

    let answer = frames_then_fetch(
        at,
        &[
            // Our own format is refused, even for a new name.
            load(
                &nixl::Agent::builder("x")
                    .build()
                    .await
                    .unwrap()
                    .metadata()
                    .unwrap(),
            ),
            // NIXL's format over a peer of this crate is refused.
            load(&one_desc_md("native", b"evil", 0x1000, 64)),
            // Invalidating a peer of this crate is refused.
            b"NIXLCOMM:INVLnative".to_vec(),
            // A NIXL agent is introduced...
            load(&one_desc_md("n", b"w", 0x1000, 64)),
            // ...but not moved to new connection info.
            load(&one_desc_md("n", b"elsewhere", 0x2000, 64)),
        ],
    )
    .await;
    assert!(answer.starts_with(b"NIXLCOMM:LOADnixlSerDes|"));
    let md = NixlMetadata::decode(&answer[13..]).unwrap();
    assert_eq!(md.name, "rust");
    assert_eq!(a.peers(), vec!["n".to_string(), "native".to_string()]);
    assert!(!a.is_nixl_peer("native").unwrap());
    let n = a.remote_regions("n").unwrap();
    assert_eq!((n.len(), n[0].addr), (1, 0x1000));
    // INVL of the NIXL agent works.
    frames_then_fetch(at, &[b"NIXLCOMM:INVLn".to_vec()]).await;
    assert_eq!(a.peers(), vec!["native".to_string()]);
    assert!(a.shutdown().await.is_clean());
}
