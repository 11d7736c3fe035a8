//! The conformance cases.

use std::time::Duration;

use bytes::Bytes;
use nixl::metadata::AgentMetadata;
use nixl::{AlignedBuf, DescList, ErrorKind, MemKind, Memory, Op, RequestOptions, Status};

use crate::support::{
    bounded, checksum, checksum_bytes, figure, one, own_thread_count, pattern, remote, skip,
    thread_count, BackendUnderTest,
};

macro_rules! need {
    ($but:expr, $case:literal, $($cap:ident),+) => {{
        let Some(caps) = $but.capabilities($case) else { return };
        $(
            if !caps.$cap {
                skip($case, &format!("backend {} lacks capability `{}`", $but.name, stringify!($cap)));
                return;
            }
        )+
        caps
    }};
}

fn kind<T: std::fmt::Debug>(r: nixl::Result<T>) -> ErrorKind {
    r.expect_err("expected an error").kind()
}

trait WholeDesc {
    fn whole_desc(&self) -> nixl::Desc;
}

impl WholeDesc for nixl::RemoteRegionInfo {
    fn whole_desc(&self) -> nixl::Desc {
        self.desc(0, self.len)
    }
}

/// Five milliseconds into `transfers`, shut down the target `b` (it must leave no
/// task): each transfer then ends within the hang bound, successfully or with
/// `RemoteDisconnected`/`Canceled`. Returns how many failed.
async fn shut_down_under(b: nixl::Agent, transfers: Vec<nixl::Transfer>, what: &str) -> usize {
    tokio::time::sleep(Duration::from_millis(5)).await;
    let report = bounded("target shutdown", b.shutdown()).await;
    assert_eq!(report.tasks_left, 0, "{report:?}");
    let mut failed = 0;
    for t in transfers {
        let bound = format!("in-flight {what} after peer shutdown");
        if let Err(e) = bounded(&bound, t).await {
            assert!(
                matches!(
                    e.kind(),
                    ErrorKind::RemoteDisconnected | ErrorKind::Canceled
                ),
                "{e}"
            );
            failed += 1;
        }
    }
    failed
}

/// Wait (within the hang bound) until nothing is in flight on `reg`.
async fn drained(reg: &nixl::Registration) {
    bounded("in-flight count to drain", async {
        while reg.inflight() > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

mod data;
mod lifecycle;
mod notifications;
mod refusals;
mod vram;

pub use data::*;
pub use lifecycle::*;
pub use notifications::*;
pub use refusals::*;
pub use vram::*;
