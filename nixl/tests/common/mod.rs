//! A test double of a transport shared by the strided-list tests.

use std::sync::Mutex;

use nixl::{Bytes, Completer, PreparedTransfer, RegionRef, Result, Target, TransferPlan};
use nixl_testkit::double::Double;

/// What reached the backend: runs, and every segment as (local registration, local
/// offset, length, target address or offset, target registration).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Runs the plan had.
    pub(crate) runs: usize,
    /// Its segments, when [`Recorder::expand`] is on.
    pub(crate) segments: Vec<(u64, usize, usize, u64, u64)>,
}

/// A test double of a transport: registers anything, records each plan it prepares,
/// keeps the plan as it is (as a backend that sends runs whole does) and completes
/// every post at once without moving data.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    /// Expand the plan's segments into [`Seen::segments`] (off for very large plans).
    pub(crate) expand: bool,
    /// What the last prepared plan was.
    pub(crate) last: Mutex<Seen>,
}

/// A prepared transfer holding its plan.
#[derive(Debug)]
#[allow(dead_code)]
struct Kept(TransferPlan);

impl PreparedTransfer for Kept {
    fn post(&self, _notif: Option<Bytes>, done: Completer) {
        done.complete(Ok(()));
    }
}

impl Double for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    fn register(&self, _region: &RegionRef) -> Result<Bytes> {
        Ok(Bytes::from_static(b"key"))
    }
    fn prepare(&self, plan: TransferPlan) -> Result<Box<dyn PreparedTransfer>> {
        let mut seen = Seen {
            runs: plan.segments.runs().len(),
            segments: Vec::new(),
        };
        if self.expand {
            for s in plan.segments.iter() {
                let (addr, region) = match &s.target {
                    Target::Remote { addr, region, .. } => (*addr, *region),
                    Target::Local(t) => (t.offset() as u64, t.id()),
                };
                seen.segments
                    .push((s.local.id(), s.local.offset(), s.local.len(), addr, region));
            }
        }
        *self.last.lock().unwrap() = seen;
        Ok(Box::new(Kept(plan)))
    }
}
