//! Prepared descriptor lists and transfer requests (`nixl_capi_xfer_dlist_handle_t`,
//! `nixl_capi_xfer_req_t`).
//!
//! A request owns its latest post: dropping it (release) cancels an unfinished
//! transfer, and the memory it uses stays registered and alive until the backend
//! lets go ([`nixl::Transfer`]'s contract). Posting and polling take this
//! request's lock only, and never wait.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::FutureExt;
use nixl::{PreparedDescs, Status as XStatus, Transfer, XferRequest};

use crate::runtime::rt;
use crate::runtime::Locked;
use crate::status::{of_kind, Failure, Outcome, Status, IN_PROG, SUCCESS};

/// A prepared descriptor list (NIXL's `prepXferDlist` result).
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The list, resolved against registrations.
    pub prepared: Arc<PreparedDescs>,
    /// Prepared for the local side (else a remote side: a peer's or this agent's).
    pub local: bool,
}

#[derive(Default)]
struct Slot {
    req: Option<XferRequest>,
    post: Option<Transfer>,
}

/// What `nixl_capi_get_xfer_telemetry` reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Telemetry {
    /// When the post started, µs since the Unix epoch.
    pub start_us: u64,
    /// Time inside the post call, µs.
    pub post_us: u64,
    /// From the post to completion, µs.
    pub xfer_us: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptors after merging.
    pub descs: u64,
}

/// A transfer request.
pub struct XferReq {
    slot: Mutex<Slot>,
    /// The notification given when it was made; a post's optional arguments
    /// replace it.
    notif: Option<Bytes>,
    telemetry: bool,
}

impl std::fmt::Debug for XferReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XferReq").finish_non_exhaustive()
    }
}

fn released() -> Failure {
    Failure::invalid("the transfer request was released")
}

/// The status of a post, as NIXL reports it.
fn of_post(t: &mut Transfer) -> Outcome<Status> {
    match t.status() {
        XStatus::Done => Ok(SUCCESS),
        XStatus::InFlight | XStatus::Idle => Ok(IN_PROG),
        XStatus::Failed(kind) => Err(match (&mut *t).now_or_never() {
            Some(Err(e)) => Failure::from(e),
            _ => Failure::new(of_kind(kind), format!("transfer failed: {kind}")),
        }),
    }
}

impl XferReq {
    /// A request; `notif` goes with each post unless the post names another.
    pub fn new(req: XferRequest, notif: Option<Bytes>, telemetry: bool) -> Self {
        Self {
            slot: Mutex::new(Slot {
                req: Some(req),
                post: None,
            }),
            notif,
            telemetry,
        }
    }

    /// NIXL's `postXferReq`: SUCCESS when it finished within the call, else
    /// IN_PROG. `notif`: `None` keeps the request's notification, `Some(n)` (the
    /// post's optional arguments) replaces it.
    ///
    /// # Errors
    /// The previous post still running (BACKEND, NIXL's REPOST_ACTIVE); a peer
    /// forgotten or reloaded since (NOT_FOUND); the transfer's failure.
    pub fn post(&self, notif: Option<Option<Bytes>>) -> Outcome<Status> {
        let mut slot = self.slot.locked();
        let req = slot.req.as_ref().ok_or_else(released)?;
        let notif = notif.unwrap_or_else(|| self.notif.clone());
        let _rt = rt()?.enter();
        let mut t = req.post(notif)?;
        let st = of_post(&mut t);
        slot.post = Some(t);
        st
    }

    /// NIXL's `getXferStatus`: SUCCESS, IN_PROG, or how it failed; an ended post
    /// keeps its answer.
    pub fn status(&self) -> Outcome<Status> {
        let mut slot = self.slot.locked();
        if slot.req.is_none() {
            return Err(released());
        }
        match slot.post.as_mut() {
            Some(t) => of_post(t),
            None => Err(Failure::backend(
                "get transfer status: the request was never posted",
            )),
        }
    }

    /// The backend serving the request (ours name).
    pub fn backend(&self) -> Outcome<String> {
        let slot = self.slot.locked();
        Ok(slot.req.as_ref().ok_or_else(released)?.backend().to_owned())
    }

    /// NIXL's `getXferTelemetry`: `None` while the post runs.
    ///
    /// # Errors
    /// NO_TELEMETRY when the agent records none; BACKEND before the first post; the
    /// post's failure.
    pub fn telemetry(&self) -> Outcome<Option<Telemetry>> {
        if !self.telemetry {
            return Err(Failure::new(
                crate::status::NO_TELEMETRY,
                "get transfer telemetry: the agent records none (capture_telemetry, or NIXL_TELEMETRY_ENABLE=1)",
            ));
        }
        if self.status()? == IN_PROG {
            return Ok(None);
        }
        let slot = self.slot.locked();
        let req = slot.req.as_ref().ok_or_else(released)?;
        let t = req
            .telemetry()
            .ok_or_else(|| Failure::backend("get transfer telemetry: nothing recorded"))?;
        let us = |d: Option<std::time::Duration>| d.map_or(0, |d| d.as_micros() as u64);
        Ok(Some(Telemetry {
            start_us: t
                .posted_at
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
            post_us: us(t.post_duration),
            xfer_us: us(t.duration),
            bytes: t.bytes,
            descs: t.segments as u64,
        }))
    }

    /// NIXL's `releaseXferReq`: an unfinished post is cancelled.
    ///
    /// # Errors
    /// INVALID_PARAM when already released.
    pub fn release(&self) -> Outcome {
        let mut slot = self.slot.locked();
        if slot.req.is_none() {
            return Err(released());
        }
        *slot = Slot::default();
        Ok(())
    }

    /// Whether it was released (`destroy` frees only released requests).
    pub fn is_released(&self) -> bool {
        self.slot.locked().req.is_none()
    }
}
