//! Turning checked descriptor pairs into backend segments, merging neighbours.

use std::sync::Arc;

use super::request::Resolved;
use crate::backend::{Segment, Target};
use crate::region::{RegionInner, RegionRef, RegionSlice};

fn slice(region: &Arc<RegionInner>, offset: u64, len: u64) -> RegionSlice {
    RegionRef {
        inner: region.clone(),
    }
    .slice(offset as usize, len as usize)
    .expect("descriptors were checked against the region")
}

fn grow(s: &RegionSlice, len: usize) -> RegionSlice {
    s.region()
        .slice(s.offset(), len)
        .expect("merged descriptors were checked against the region")
}

/// Turn checked pairs into backend segments. With `merge`, a pair that continues the
/// previous one in the same region on both sides extends it instead.
pub(super) fn build_segments(
    pairs: &[(&Resolved, &Resolved)],
    backend: &str,
    merge: bool,
) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::with_capacity(pairs.len());
    // (local region id, local end offset, target region id, target end offset) of the
    // last segment.
    let mut last: Option<(u64, u64, u64, u64)> = None;
    for (l, r) in pairs {
        let Resolved::Local {
            region: lr,
            offset: lo,
            len,
        } = l
        else {
            unreachable!("the local side is always local")
        };
        let (rid, ro) = match r {
            Resolved::Local { region, offset, .. } => (region.id, *offset),
            Resolved::Remote { region, offset, .. } => (region.id, *offset),
        };
        if let (true, Some((a, ae, b, be)), Some(seg)) = (merge, last, out.last_mut()) {
            if a == lr.id && ae == *lo && b == rid && be == ro {
                let new_len = seg.local.len() + *len as usize;
                seg.local = grow(&seg.local, new_len);
                match &mut seg.target {
                    Target::Local(t) => *t = grow(t, new_len),
                    Target::Remote { len: l, .. } => *l = new_len as u64,
                }
                last = Some((a, ae + len, b, be + len));
                continue;
            }
        }
        let target = match r {
            Resolved::Local {
                region,
                offset,
                len,
            } => Target::Local(slice(region, *offset, *len)),
            Resolved::Remote {
                region,
                offset,
                len,
            } => Target::Remote {
                addr: region.addr + offset,
                len: *len,
                region: region.id,
                blob: region.blob(backend).cloned().unwrap_or_default(),
            },
        };
        out.push(Segment {
            local: slice(lr, *lo, *len),
            target,
        });
        last = Some((lr.id, lo + len, rid, ro + len));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemKind, Memory};
    use crate::region::RemoteRegion;
    use bytes::Bytes;
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    fn local_region(id: u64, len: usize) -> Arc<RegionInner> {
        Arc::new(RegionInner {
            id,
            mem: Memory::from(vec![0u8; len]),
            inflight: Default::default(),
            registered: AtomicBool::new(true),
            backends: Mutex::new(Vec::new()),
        })
    }

    fn remote_region(id: u64, addr: u64, len: u64) -> Arc<RemoteRegion> {
        Arc::new(RemoteRegion {
            id,
            kind: MemKind::Dram,
            addr,
            len,
            blobs: vec![("tcp".into(), Bytes::from_static(b"key"))],
        })
    }

    fn l(region: &Arc<RegionInner>, offset: u64, len: u64) -> Resolved {
        Resolved::Local {
            region: region.clone(),
            offset,
            len,
        }
    }

    fn r(region: &Arc<RemoteRegion>, offset: u64, len: u64) -> Resolved {
        Resolved::Remote {
            region: region.clone(),
            offset,
            len,
        }
    }

    fn remote_len(t: &Target) -> (u64, u64) {
        match t {
            Target::Remote { addr, len, .. } => (*addr, *len),
            Target::Local(_) => panic!("expected a remote target"),
        }
    }

    #[test]
    fn contiguous_pairs_merge_and_gaps_split() {
        let a = local_region(1, 4096);
        let p = remote_region(9, 0x10_000, 4096);
        let descs = [
            (l(&a, 0, 100), r(&p, 0, 100)),
            (l(&a, 100, 100), r(&p, 100, 100)),
            // A gap on the remote side only: no merge.
            (l(&a, 200, 50), r(&p, 300, 50)),
            (l(&a, 250, 50), r(&p, 350, 50)),
        ];
        let pairs: Vec<_> = descs.iter().map(|(a, b)| (a, b)).collect();
        let segs = build_segments(&pairs, "tcp", true);
        assert_eq!(segs.len(), 2);
        assert_eq!((segs[0].local.offset(), segs[0].local.len()), (0, 200));
        assert_eq!(remote_len(&segs[0].target), (0x10_000, 200));
        assert_eq!((segs[1].local.offset(), segs[1].local.len()), (200, 100));
        assert_eq!(remote_len(&segs[1].target), (0x10_000 + 300, 100));
        assert_eq!(segs[0].local.id(), 1);
        match &segs[0].target {
            Target::Remote { region, blob, .. } => {
                assert_eq!((*region, &blob[..]), (9, &b"key"[..]));
            }
            Target::Local(_) => unreachable!(),
        }
    }

    #[test]
    fn no_merge_keeps_every_pair() {
        let a = local_region(1, 4096);
        let p = remote_region(9, 0x10_000, 4096);
        let descs = [
            (l(&a, 0, 100), r(&p, 0, 100)),
            (l(&a, 100, 100), r(&p, 100, 100)),
        ];
        let pairs: Vec<_> = descs.iter().map(|(a, b)| (a, b)).collect();
        assert_eq!(build_segments(&pairs, "tcp", false).len(), 2);
    }

    #[test]
    fn different_regions_never_merge() {
        let a = local_region(1, 4096);
        let b = local_region(2, 4096);
        let descs = [
            (l(&a, 0, 64), l(&b, 0, 64)),
            (l(&a, 64, 64), l(&b, 64, 64)),
            // Continues in `a` but the target jumps back into `a` itself.
            (l(&a, 128, 64), l(&a, 1024, 64)),
        ];
        let pairs: Vec<_> = descs.iter().map(|(a, b)| (a, b)).collect();
        let segs = build_segments(&pairs, "tcp", true);
        assert_eq!(segs.len(), 2);
        match &segs[0].target {
            Target::Local(t) => assert_eq!((t.id(), t.offset(), t.len()), (2, 0, 128)),
            Target::Remote { .. } => unreachable!(),
        }
        match &segs[1].target {
            Target::Local(t) => assert_eq!((t.id(), t.offset(), t.len()), (1, 1024, 64)),
            Target::Remote { .. } => unreachable!(),
        }
    }
}
