//! The fuzz targets' bodies as plain functions, and their seeds.
//!
//! `fuzz_targets/*.rs` hand each body to libFuzzer; the workspace's fuzz smoke test
//! (`tests/tests/fuzz_smoke.rs`, which includes this file as a module, so it builds
//! on stable without libFuzzer) runs every one over its committed corpus
//! (`corpus/<target>/`) and random mutations of it. Each body panics when an
//! invariant breaks, never merely because an input is malformed.
//!
//! The seeds come from the real encoders ([`seeds`]); the smoke test checks the
//! committed corpus still holds them, and writes them with `NIXL_FUZZ_WRITE_CORPUS=1`.

use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::Duration;

use nixl::interop::{decode_notification, encode_notification, NixlMetadata, PREFIX};
use nixl::metadata::{AgentMetadata, BackendMeta, RegionBlob, RegionMeta, MAGIC, VERSION};
use nixl::{Agent, MemKind, Registration, SideChannelOptions};
use nixl_verbs::wire::{decode_blob, encode_blob, ConnInfo, Hello, Reply};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A fuzz target: its name (the `fuzz_targets/<name>.rs` file and `corpus/<name>/`
/// folder), its body, and how many mutated inputs the smoke test runs (targets that
/// talk to a live listener cost a connection per input).
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The target's name.
    pub name: &'static str,
    /// Its body.
    pub run: fn(&[u8]),
    /// Mutated inputs per smoke run.
    pub mutations: usize,
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "metadata_decode",
        run: metadata_decode,
        mutations: 20_000,
    },
    Target {
        name: "nixl_metadata_decode",
        run: nixl_metadata_decode,
        mutations: 20_000,
    },
    Target {
        name: "verbs_wire",
        run: verbs_wire,
        mutations: 20_000,
    },
    Target {
        name: "tcp_initiator",
        run: nixl_tcp::fuzzing::initiator_responses,
        mutations: 20_000,
    },
    Target {
        name: "tcp_target",
        run: tcp_target,
        mutations: 20_000,
    },
    Target {
        name: "nixl_listener",
        run: nixl::fuzzing::nixl_listener_frames,
        mutations: 20_000,
    },
    Target {
        name: "ucx_am",
        run: nixl_ucx::fuzzing::am_header,
        mutations: 20_000,
    },
    Target {
        name: "ucx_notif_order",
        run: nixl_ucx::fuzzing::notification_order,
        mutations: 20_000,
    },
    Target {
        name: "uccl_wire",
        run: nixl_uccl::fuzzing::wire_format,
        mutations: 20_000,
    },
    Target {
        name: "side_channel_frames",
        run: side_channel_frames,
        mutations: 300,
    },
    Target {
        name: "tcp_wire",
        run: tcp_wire,
        mutations: 300,
    },
];

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

fn seal(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(12 + body.len() + 4);
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&u16::from(flags & 1).to_le_bytes());
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(body);
    let c = crc32(&v);
    v.extend_from_slice(&c.to_le_bytes());
    v
}

/// The metadata decoder on arbitrary bytes: never panics, never over-allocates (the
/// fuzzer's RSS limit catches that), and whatever decodes re-encodes identically.
///
/// Inputs whose first byte has its top bit set are taken as a body (after that
/// byte) and sealed with a valid header and checksum first, so the fuzzer explores
/// the body parser instead of stopping at the checksum.
pub fn metadata_decode(data: &[u8]) {
    let input = match data.split_first() {
        Some((&mode, body)) if mode & 0x80 != 0 => seal(mode, body),
        _ => data.to_vec(),
    };
    if let Ok(md) = AgentMetadata::decode(&input) {
        let again = md.encode().expect("decoded metadata re-encodes");
        assert_eq!(again, input, "decode/encode is the identity on valid input");
    }
}

/// The NIXL-format metadata and notification decoders on arbitrary bytes: never
/// panic, never over-allocate, and whatever decodes re-encodes identically.
///
/// Inputs are prefixed with `nixlSerDes|` (in place of their first byte) unless
/// that byte's top bit is set, so the fuzzer explores the fields instead of
/// stopping at the prefix.
pub fn nixl_metadata_decode(data: &[u8]) {
    let input = match data.split_first() {
        Some((&mode, rest)) if mode & 0x80 == 0 => [PREFIX, rest].concat(),
        _ => data.to_vec(),
    };
    if let Ok(md) = NixlMetadata::decode(&input) {
        let again = md.encode().expect("decoded metadata re-encodes");
        assert_eq!(again, input, "decode/encode is the identity on valid input");
    }
    if let Ok((name, msg)) = decode_notification(&input, 4096) {
        assert_eq!(encode_notification(&name, msg), input);
    }
}

/// nixl-verbs' decoders on arbitrary bytes: the connection info peers publish in
/// metadata, the handshake hello a control listener reads from any client, its
/// reply, and region blobs. None panics, and whatever decodes re-encodes
/// identically (a refusal's reason is the one lossy field, so only accepted replies
/// are compared).
pub fn verbs_wire(data: &[u8]) {
    if let Ok(i) = ConnInfo::decode(data) {
        assert_eq!(i.encode(), data);
    }
    if let Ok(h) = Hello::decode(data) {
        assert_eq!(h.encode(), data);
    }
    if let Ok(r @ Reply::Accepted { .. }) = Reply::decode(data) {
        assert_eq!(r.encode(), data);
    }
    if let Ok(k) = decode_blob(data) {
        assert_eq!(&encode_blob(k)[..], data);
    }
}

static PLANTED: LazyLock<nixl_tcp::fuzzing::PlantedTarget> =
    LazyLock::new(nixl_tcp::fuzzing::PlantedTarget::new);

/// nixl-tcp's target state machine past the key check: see
/// [`nixl_tcp::fuzzing::PlantedTarget::requests`].
pub fn tcp_target(data: &[u8]) {
    PLANTED.requests(data);
}

struct SideChannelWorld {
    rt: tokio::runtime::Runtime,
    server: Agent,
    client: Agent,
    addr: SocketAddr,
}

static SIDE_CHANNEL: LazyLock<SideChannelWorld> = LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (server, client, addr) = rt.block_on(async {
        let server = Agent::builder("server")
            .backend(nixl_tcp::TcpBackend::new())
            .build()
            .await
            .unwrap();
        server.register(vec![0u8; 4096]).unwrap();
        let opts = SideChannelOptions {
            idle_timeout: Duration::from_millis(200),
            ..Default::default()
        };
        let addr = server
            .listen("127.0.0.1:0".parse().unwrap(), &opts)
            .await
            .unwrap();
        let client = Agent::builder("client")
            .backend(nixl_tcp::TcpBackend::new())
            .build()
            .await
            .unwrap();
        (server, client, addr)
    });
    SideChannelWorld {
        rt,
        server,
        client,
        addr,
    }
});

static SIDE_CHANNEL_INPUTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Arbitrary bytes sent to a live side-channel listener: it never crashes, closes
/// only the offending connection, and keeps serving (checked every 64 inputs).
pub fn side_channel_frames(data: &[u8]) {
    let w = &*SIDE_CHANNEL;
    w.rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
        let _ = s.write_all(data).await;
        let _ = s.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut sink)).await;
        let n = SIDE_CHANNEL_INPUTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n & 63 == 0 {
            let name = w
                .client
                .fetch_metadata(w.addr, &SideChannelOptions::default())
                .await
                .expect("listener still serves");
            assert_eq!(name, w.server.name());
        }
    });
}

struct TcpWorld {
    rt: tokio::runtime::Runtime,
    _agent: Agent,
    mem: Registration,
    expect: Vec<u8>,
    addr: SocketAddr,
}

static TCP: LazyLock<TcpWorld> = LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (agent, mem, addr) = rt.block_on(async {
        let backend = nixl_tcp::TcpBackend::new();
        let agent = Agent::builder("target")
            .backend(backend.clone())
            .build()
            .await
            .unwrap();
        let mem = agent
            .register((0..4096u32).map(|i| i as u8).collect::<Vec<u8>>())
            .unwrap();
        (agent, mem, backend.local_addr().unwrap())
    });
    let expect = mem.to_vec().unwrap();
    TcpWorld {
        rt,
        _agent: agent,
        mem,
        expect,
        addr,
    }
});

/// Arbitrary request bytes after a valid hello, sent to a live nixl-tcp target: it
/// never crashes, and its registered memory never changes (its key is random, so
/// every request is refused; `tcp_target` covers the accepted path).
pub fn tcp_wire(data: &[u8]) {
    let w = &*TCP;
    w.rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
        let mut hello = nixl_tcp::wire_hello("fuzz");
        hello.extend_from_slice(data);
        let _ = s.write_all(&hello).await;
        let _ = s.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut sink)).await;
    });
    assert!(
        w.mem.to_vec().unwrap() == w.expect,
        "registered memory changed"
    );
}

/// A side-channel frame (`NXSC`, version 2, kind, two zero bytes, length, payload).
fn side_channel_frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = b"NXSC".to_vec();
    v.extend_from_slice(&[2, kind, 0, 0]);
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Each target's seeds (name, bytes), from the real encoders.
pub fn seeds(target: &str) -> Vec<(&'static str, Vec<u8>)> {
    let md = AgentMetadata {
        name: "prefill-0".into(),
        instance: 0x1234_5678,
        partial: false,
        backends: vec![BackendMeta {
            name: "tcp".into(),
            conn_info: Some(b"127.0.0.1:5000".to_vec()),
        }],
        regions: vec![RegionMeta {
            id: 1,
            kind: MemKind::Dram,
            addr: 0x7f00_0000_1000,
            len: 4096,
            blobs: vec![RegionBlob {
                backend: 0,
                blob: 0x1122_3344_5566_7788u64.to_le_bytes().to_vec(),
            }],
        }],
    }
    .encode()
    .expect("valid metadata");
    match target {
        "metadata_decode" => vec![
            ("metadata", md.clone()),
            (
                "metadata-sealed-body",
                [&[0x80u8][..], &md[12..md.len() - 4]].concat(),
            ),
        ],
        "nixl_metadata_decode" => {
            let nixl_md = NixlMetadata {
                name: "nixl-peer".into(),
                conns: vec![nixl::interop::NixlConn {
                    backend: "UCX".into(),
                    info: vec![1, 2, 3, 4],
                }],
                sections: vec![nixl::interop::NixlSection {
                    backend: "UCX".into(),
                    mem_type: nixl::interop::MEM_DRAM,
                    descs: vec![nixl::interop::NixlDesc {
                        addr: 0x1000,
                        len: 4096,
                        device: 0,
                        blob: vec![9; 8],
                    }],
                }],
            }
            .encode()
            .expect("valid NIXL metadata");
            let notif = encode_notification("nixl-peer", b"done");
            let unprefixed = |b: &[u8]| [&[0u8][..], b.strip_prefix(PREFIX).unwrap_or(b)].concat();
            vec![
                ("metadata", unprefixed(&nixl_md)),
                ("notification", unprefixed(&notif)),
            ]
        }
        "verbs_wire" => {
            let endpoint = nixl_verbs::wire::Endpoint {
                link_layer: nixl_verbs::api::LinkLayer::Ethernet,
                port: 1,
                mtu: nixl_verbs::api::Mtu(5),
                lid: 0,
                gid_index: 3,
                gid: [0xfe; 16],
                max_msg_sz: 1 << 30,
                max_rd_atomic: 16,
            };
            let qps = vec![nixl_verbs::wire::QpHalf {
                qp_num: 0x123,
                psn: 0x456,
            }];
            vec![
                (
                    "conn-info",
                    ConnInfo {
                        endpoint,
                        control: "127.0.0.1:4000".parse().unwrap(),
                    }
                    .encode(),
                ),
                (
                    "hello",
                    Hello {
                        agent: "prefill-0".into(),
                        endpoint,
                        qps: qps.clone(),
                    }
                    .encode(),
                ),
                (
                    "accepted",
                    Reply::Accepted {
                        max_notification: 4096,
                        qps,
                    }
                    .encode(),
                ),
                ("refused", Reply::Refused("no".into()).encode()),
                ("blob", encode_blob(0xdead_beef).to_vec()),
            ]
        }
        "tcp_initiator" => nixl_tcp::fuzzing::initiator_seeds(),
        "tcp_target" => nixl_tcp::fuzzing::target_seeds(),
        // After the hello tcp_wire sends itself: the same-host byte and requests,
        // which is what tcp_target's inputs are after their mode byte 0.
        "tcp_wire" => nixl_tcp::fuzzing::target_seeds()
            .into_iter()
            .filter(|(_, s)| s[0] == 0)
            .collect(),
        "nixl_listener" => nixl::fuzzing::nixl_listener_seeds(),
        "ucx_am" => nixl_ucx::fuzzing::am_seeds(),
        "ucx_notif_order" => nixl_ucx::fuzzing::order_seeds(),
        "uccl_wire" => nixl_uccl::fuzzing::wire_seeds(),
        "side_channel_frames" => vec![
            ("fetch", side_channel_frame(4, b"")),
            ("fetch-label", side_channel_frame(4, b"partial")),
            ("send", side_channel_frame(5, &md)),
            ("invalidate", side_channel_frame(6, b"prefill-0")),
        ],
        other => panic!("no target {other:?}"),
    }
}
