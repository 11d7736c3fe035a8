//! Asynchronous copies between registered memory and page-locked buffers: the
//! [`GpuCopy`] future, and what keeps a copy's memory alive when its future is
//! dropped before the copy finished.
#![allow(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use super::access::driver;
use super::driver::{cu_name, Direction};
use super::pinned::PinnedBuf;
use super::reaper::{self, Grave};
use crate::error::{err, ErrorKind, Result};

/// What a copy's completion callback and its future share.
#[derive(Default)]
struct CopyState {
    /// The driver's status once the copy finished.
    status: Option<i32>,
    waker: Option<Waker>,
    /// What the copy holds once its future was dropped unfinished, and where the
    /// callback sends it to be freed.
    orphan: Option<(CopyHold, Grave)>,
}

/// What an in-flight copy keeps alive: its buffer and the memory it copies.
struct CopyHold {
    buf: PinnedBuf,
    _memory: Box<dyn Any + Send + Sync>,
}

/// An asynchronous copy between registered memory and a [`PinnedBuf`], started by
/// [`RegionSlice::copy_to_pinned`](crate::RegionSlice::copy_to_pinned) or
/// [`RegionSlice::copy_from_pinned`](crate::RegionSlice::copy_from_pinned). It
/// resolves to the buffer once the copy has finished. Dropping it does not stop the
/// copy; the buffer and memory stay alive until the copy is over.
#[must_use = "the copy's result and buffer come from awaiting it"]
pub struct GpuCopy {
    state: Arc<Mutex<CopyState>>,
    hold: Option<CopyHold>,
}

impl GpuCopy {
    /// A copy already made (host memory).
    pub(crate) fn finished(buf: PinnedBuf, memory: Box<dyn Any + Send + Sync>) -> Self {
        Self {
            state: Arc::new(Mutex::new(CopyState {
                status: Some(0),
                ..CopyState::default()
            })),
            hold: Some(CopyHold {
                buf,
                _memory: memory,
            }),
        }
    }
}

impl Future for GpuCopy {
    type Output = Result<PinnedBuf>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let status = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match st.status {
                Some(s) => s,
                None => {
                    st.waker = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
        };
        let hold = self.hold.take().expect("GpuCopy polled after it completed");
        Poll::Ready(if status == 0 {
            Ok(hold.buf)
        } else {
            err(
                ErrorKind::Backend,
                "copy GPU memory",
                format!("the asynchronous copy failed: {}", cu_name(status as u32)),
            )
        })
    }
}

impl Drop for GpuCopy {
    fn drop(&mut self) {
        let Some(hold) = self.hold.take() else { return };
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.status.is_some() {
            // Finished: free here, outside the driver's callback.
            drop(st);
            drop(hold);
            return;
        }
        // Still running: the callback hands what it holds to the reaper when the
        // copy has finished (the state lock orders this against the callback).
        match reaper::adopt() {
            Some(grave) => st.orphan = Some((hold, grave)),
            None => {
                tracing::error!("no GPU reaper thread: leaking a cancelled copy's buffers");
                std::mem::forget(hold);
            }
        }
    }
}

impl fmt::Debug for GpuCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .status;
        f.debug_struct("GpuCopy").field("status", &status).finish()
    }
}

/// Start copying `n` bytes between device memory at `dev` on `device` and the start
/// of `buf`; `memory` keeps the device memory alive until the copy has finished.
/// `ended` runs once the device is done with the memory, before the copy's outcome
/// is observable and while `memory` is still held, on the driver's callback thread:
/// it must neither call the driver nor free anything. If the copy cannot start it
/// runs before this returns.
///
/// # Safety
/// `dev..dev+n` is device memory of `device`, kept alive by `memory`; `n <= buf.len()`.
pub(crate) unsafe fn start_copy(
    device: u32,
    dir: Direction,
    dev: u64,
    buf: PinnedBuf,
    n: usize,
    memory: Box<dyn Any + Send + Sync>,
    ended: Box<dyn FnOnce() + Send>,
) -> Result<GpuCopy> {
    debug_assert!(n <= buf.len());
    let gpu = match driver() {
        Ok(g) => g,
        Err(e) => {
            ended();
            return Err(e);
        }
    };
    let state = Arc::new(Mutex::new(CopyState::default()));
    let host = buf.ptr();
    let signal = state.clone();
    let ended = Arc::new(Mutex::new(Some(ended)));
    let end = ended.clone();
    let done = Box::new(move |status: i32| {
        if let Some(f) = end.lock().unwrap_or_else(PoisonError::into_inner).take() {
            f();
        }
        let (waker, orphan) = {
            let mut st = signal.lock().unwrap_or_else(PoisonError::into_inner);
            st.status = Some(status);
            (st.waker.take(), st.orphan.take())
        };
        if let Some(w) = waker {
            w.wake();
        }
        // No CUDA call here (freeing is one): the reaper's thread frees it.
        if let Some((hold, grave)) = orphan {
            grave.bury(Box::new(hold));
        }
    });
    // SAFETY: the caller's contract for the device side; `host..host+n` lies in
    // `buf`'s page-locked block. Both stay alive until `done` ran: the GpuCopy
    // returned holds them, and if dropped first hands them to the callback, which
    // sends them to the reaper only after the copy finished.
    let started = unsafe { gpu.copy_async(device, dir, dev, host, n, done) };
    if let Err(e) = started {
        // The callback will not run (or has run, and taken it already).
        if let Some(f) = ended.lock().unwrap_or_else(PoisonError::into_inner).take() {
            f();
        }
        return Err(e);
    }
    Ok(GpuCopy {
        state,
        hold: Some(CopyHold {
            buf,
            _memory: memory,
        }),
    })
}
