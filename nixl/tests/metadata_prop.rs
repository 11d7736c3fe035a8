//! Property tests of the metadata codec: round trips, and arbitrary bytes never panic.

use nixl::metadata::{AgentMetadata, BackendMeta, RegionBlob, RegionMeta};
use nixl::MemKind;
use proptest::prelude::*;

fn kind() -> impl Strategy<Value = MemKind> {
    prop_oneof![
        Just(MemKind::Dram),
        any::<u32>().prop_map(|device| MemKind::Vram { device })
    ]
}

fn metadata() -> impl Strategy<Value = AgentMetadata> {
    let backends = prop::collection::vec(
        (
            "[a-z]{1,12}",
            prop::option::of(prop::collection::vec(any::<u8>(), 0..64)),
        ),
        1..4,
    );
    let region = (
        any::<u64>(),
        kind(),
        0u64..1 << 40,
        1u64..1 << 30,
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..3),
    );
    (
        "[a-zA-Z0-9_-]{1,40}",
        any::<u64>(),
        any::<bool>(),
        backends,
        prop::collection::vec(region, 0..20),
    )
        .prop_map(|(name, instance, partial, backends, regions)| {
            let nb = backends.len() as u16;
            AgentMetadata {
                name,
                instance,
                partial,
                backends: backends
                    .into_iter()
                    .map(|(name, conn_info)| BackendMeta { name, conn_info })
                    .collect(),
                regions: regions
                    .into_iter()
                    .map(|(id, kind, addr, len, blobs)| RegionMeta {
                        id,
                        kind,
                        addr,
                        len,
                        blobs: blobs
                            .into_iter()
                            .enumerate()
                            .map(|(i, blob)| RegionBlob {
                                backend: i as u16 % nb,
                                blob,
                            })
                            .collect(),
                    })
                    .collect(),
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn round_trip(md in metadata()) {
        let bytes = md.encode().unwrap();
        prop_assert_eq!(bytes.len(), md.encoded_len());
        prop_assert_eq!(AgentMetadata::decode(&bytes).unwrap(), md);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = AgentMetadata::decode(&bytes);
    }

    #[test]
    fn mutated_encodings_never_panic(
        md in metadata(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = md.encode().unwrap();
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x | 1;
        }
        // Flipped bytes must be caught (checksum, structure): never a panic, never
        // silently accepted as the original.
        if let Ok(decoded) = AgentMetadata::decode(&bytes) {
            prop_assert_ne!(decoded, md);
        }
        let n = cut.index(bytes.len());
        prop_assert!(AgentMetadata::decode(&bytes[..n]).is_err(), "a strict prefix never decodes");
    }
}
