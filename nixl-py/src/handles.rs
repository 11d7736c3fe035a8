//! Handles Python holds: prepared descriptor lists and transfer requests.
//!
//! A transfer handle owns its request and its latest post. Posting and polling take
//! one uncontended lock each and never wait; a post large enough that the backend
//! may copy on the caller's thread (nixl-tcp's same-host copies, UCX's inline posts)
//! releases the GIL meanwhile. Releasing a handle drops its post, which cancels an
//! unfinished transfer; the memory it uses stays registered and alive until the
//! backend reports it finished (nixl's `Transfer` contract).

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::FutureExt;
use nixl::{PreparedDescs, Status, Transfer, XferRequest};
use pyo3::prelude::*;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::errors::{kind_name, raise, to_py, IntoPy};
use crate::runtime::{python_alive, rt};

/// From this many bytes a post releases the GIL while it runs.
const RELEASE_GIL_FROM: u64 = 64 << 10;

/// A prepared descriptor list (NIXL's `prep_xfer_dlist` result).
#[pyclass(frozen, module = "nixl_rs._native", name = "nixl_prepped_dlist_handle")]
pub(crate) struct DlistHandle {
    prepared: Mutex<Option<Arc<PreparedDescs>>>,
    len: usize,
}

impl DlistHandle {
    pub(crate) fn new(prepared: PreparedDescs) -> Self {
        let len = prepared.len();
        Self {
            prepared: Mutex::new(Some(Arc::new(prepared))),
            len,
        }
    }

    /// The prepared list, unless released.
    pub(crate) fn get(&self) -> PyResult<Arc<PreparedDescs>> {
        self.prepared.lock().unwrap().clone().ok_or_else(|| {
            raise(
                "NotFound",
                "use prepared descriptor list",
                "the handle was released",
                "use prepared descriptor list: the handle was released".into(),
            )
        })
    }
}

#[pymethods]
impl DlistHandle {
    /// Free the prepared list (requests made from it keep what they need).
    fn release(&self) {
        self.prepared.lock().unwrap().take();
    }

    /// Number of descriptors.
    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        let released = self.prepared.lock().unwrap().is_none();
        format!(
            "nixl_prepped_dlist_handle({} descriptors, released={})",
            self.len,
            if released { "True" } else { "False" }
        )
    }
}

struct XferState {
    req: Option<Arc<XferRequest>>,
    /// The latest post, unless an asyncio waiter took it.
    post: Option<Transfer>,
    /// Cancels the asyncio waiter holding the latest post: releasing the handle
    /// cancels that post as it does one kept here.
    waiter: Option<CancellationToken>,
}

/// A transfer request (NIXL's `make_prepped_xfer` / `initialize_xfer` result).
#[pyclass(frozen, module = "nixl_rs._native", name = "nixl_xfer_handle")]
pub(crate) struct XferHandle {
    state: Mutex<XferState>,
    /// Notification given when the request was made (a post may override it).
    notif: Option<Bytes>,
    /// The agent's tracker and token for asyncio waiters.
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl XferHandle {
    pub(crate) fn new(
        req: XferRequest,
        notif: Option<Bytes>,
        tasks: TaskTracker,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            state: Mutex::new(XferState {
                req: Some(Arc::new(req)),
                post: None,
                waiter: None,
            }),
            notif,
            tasks,
            cancel,
        }
    }

    fn request(&self, op: &str) -> PyResult<Arc<XferRequest>> {
        self.state
            .lock()
            .unwrap()
            .req
            .clone()
            .ok_or_else(|| released(op))
    }

    /// Post, keeping the transfer in the handle; "DONE" or "PROC".
    fn post(&self, py: Python<'_>, notif: Option<&[u8]>) -> PyResult<&'static str> {
        let req = self.request("post transfer")?;
        let notif = match notif {
            Some(m) if !m.is_empty() => Some(Bytes::copy_from_slice(m)),
            _ => self.notif.clone(),
        };
        let _rt = rt()?.enter();
        let t = if req.bytes() >= RELEASE_GIL_FROM {
            py.allow_threads(|| req.post(notif))
        } else {
            req.post(notif)
        }
        .py()?;
        match t.status() {
            Status::Done => Ok("DONE"),
            Status::Failed(_) => Err(outcome(t)),
            _ => {
                self.state.lock().unwrap().post = Some(t);
                Ok("PROC")
            }
        }
    }

    /// Hand the in-flight post to a task that calls `loop.call_soon_threadsafe(cb,
    /// err)` when it ends (`err` None on success). False when nothing is in flight.
    fn wait_with(&self, event_loop: Py<PyAny>, cb: Py<PyAny>) -> PyResult<bool> {
        let Some(mut t) = self.state.lock().unwrap().post.take() else {
            return Ok(false);
        };
        if t.status() != Status::InFlight {
            // Finished since: keep it for check_xfer_state.
            self.state.lock().unwrap().post = Some(t);
            return Ok(false);
        }
        let cancel = self.cancel.clone();
        let released = CancellationToken::new();
        self.state.lock().unwrap().waiter = Some(released.clone());
        rt()?.spawn(self.tasks.track_future(async move {
            let result = tokio::select! {
                r = &mut t => r,
                // Released: dropping the transfer cancels it, as a release of a post
                // kept in the handle does.
                () = released.cancelled() => Err(nixl::Error::new(
                    nixl::ErrorKind::Canceled,
                    "transfer",
                    "the transfer handle was released while the transfer was in flight",
                )),
                // The agent is shutting down (it cancels the transfer): the awaiting
                // coroutine hears so rather than wait forever.
                () = cancel.cancelled() => Err(nixl::Error::new(
                    nixl::ErrorKind::ShutDown,
                    "transfer",
                    "the agent shut down while the transfer was in flight",
                )),
            };
            deliver(event_loop, cb, move |py| match result {
                Ok(()) => py.None(),
                Err(e) => to_py(&e).into_value(py).into_any(),
            });
        }));
        Ok(true)
    }
}

/// Call `loop.call_soon_threadsafe(cb, arg)` from a runtime thread, unless the
/// interpreter is on its way out (or the loop closed: nobody is waiting then).
pub(crate) fn deliver(
    event_loop: Py<PyAny>,
    cb: Py<PyAny>,
    arg: impl FnOnce(Python<'_>) -> Py<PyAny>,
) {
    if !python_alive() {
        return;
    }
    Python::with_gil(|py| {
        let arg = arg(py);
        if let Err(e) = event_loop.call_method1(py, "call_soon_threadsafe", (cb, arg)) {
            tracing::debug!(error = %e, "an asyncio completion found its event loop closed");
        }
    });
}

fn released(op: &str) -> PyErr {
    raise(
        "NotFound",
        op,
        "the transfer handle was released",
        format!("{op}: the transfer handle was released"),
    )
}

/// The error a failed post ended with.
fn outcome(mut t: Transfer) -> PyErr {
    match (&mut t).now_or_never() {
        Some(Err(e)) => to_py(&e),
        _ => raise(
            "Backend",
            "transfer",
            "the transfer failed",
            "transfer failed".into(),
        ),
    }
}

#[pymethods]
impl XferHandle {
    /// Post (NIXL's `transfer`): "DONE" when it finished within the call, else
    /// "PROC". Raises on an error (a nixl-rs exception carrying the error kind).
    #[pyo3(signature = (notif_msg=None))]
    fn _post(&self, py: Python<'_>, notif_msg: Option<&[u8]>) -> PyResult<&'static str> {
        self.post(py, notif_msg)
    }

    /// NIXL's `check_xfer_state`: "DONE" or "PROC"; raises the error a failed
    /// transfer ended with.
    fn _state(&self) -> PyResult<&'static str> {
        let mut st = self.state.lock().unwrap();
        if let Some(t) = &st.post {
            return match t.status() {
                Status::InFlight | Status::Idle => Ok("PROC"),
                Status::Done => {
                    st.post = None;
                    Ok("DONE")
                }
                Status::Failed(_) => {
                    let t = st.post.take().expect("matched above");
                    drop(st);
                    Err(outcome(t))
                }
            };
        }
        let Some(req) = &st.req else {
            return Err(released("check transfer state"));
        };
        match req.status() {
            Status::Idle => Err(raise(
                "NotPosted",
                "check transfer state",
                "the transfer was never posted",
                "check transfer state: the transfer was never posted (call transfer first)".into(),
            )),
            Status::InFlight => Ok("PROC"),
            Status::Done => Ok("DONE"),
            Status::Failed(kind) => Err(raise(
                kind_name(kind),
                "transfer",
                "the transfer failed",
                format!("transfer failed: {kind}"),
            )),
        }
    }

    /// Post and, unless it finished within the call ("DONE"), arrange for
    /// `loop.call_soon_threadsafe(cb, err)` when it ends ("PROC").
    fn _post_async(
        &self,
        py: Python<'_>,
        notif_msg: Option<&[u8]>,
        event_loop: Py<PyAny>,
        cb: Py<PyAny>,
    ) -> PyResult<&'static str> {
        if self.post(py, notif_msg)? == "DONE" {
            return Ok("DONE");
        }
        Ok(if self.wait_with(event_loop, cb)? {
            "PROC"
        } else {
            "DONE"
        })
    }

    /// For a post already in flight: arrange for `loop.call_soon_threadsafe(cb,
    /// err)` when it ends; False when none is in flight (then `_state` says how it
    /// ended).
    fn _wait_async(&self, event_loop: Py<PyAny>, cb: Py<PyAny>) -> PyResult<bool> {
        self.wait_with(event_loop, cb)
    }

    /// Telemetry of the latest post: (startTime µs since the epoch, postDuration µs,
    /// xferDuration µs, totalBytes, descCount, backend).
    fn _telemetry(&self) -> PyResult<(u64, u64, u64, u64, u64, String)> {
        let req = self.request("get transfer telemetry")?;
        let Some(t) = req.telemetry() else {
            return Err(raise(
                "NoTelemetry",
                "get transfer telemetry",
                "no telemetry for this transfer",
                "get transfer telemetry: none recorded (make the agent with capture_telemetry=True and post the transfer first)"
                    .into(),
            ));
        };
        let us = |d: Option<std::time::Duration>| d.map_or(0, |d| d.as_micros() as u64);
        let start = t
            .posted_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Ok((
            start,
            us(t.post_duration),
            us(t.duration),
            t.bytes,
            t.segments as u64,
            nixl_compat::backends::nixl_name(&t.backend),
        ))
    }

    /// NIXL's name of the backend serving this request.
    fn _backend(&self) -> PyResult<String> {
        Ok(nixl_compat::backends::nixl_name(
            self.request("query transfer backend")?.backend(),
        ))
    }

    /// Total bytes one post moves.
    fn _bytes(&self) -> PyResult<u64> {
        Ok(self.request("query transfer size")?.bytes())
    }

    /// Free the request; an unfinished post is cancelled (its memory stays alive
    /// until the backend lets go of it).
    fn release(&self) {
        let mut st = self.state.lock().unwrap();
        st.post = None;
        st.req = None;
        if let Some(w) = st.waiter.take() {
            w.cancel();
        }
    }

    /// Whether it was released.
    #[getter]
    fn released(&self) -> bool {
        self.state.lock().unwrap().req.is_none()
    }

    fn __repr__(&self) -> String {
        let st = self.state.lock().unwrap();
        match &st.req {
            Some(r) => format!(
                "nixl_xfer_handle({} {} bytes via {}, status {:?})",
                r.op(),
                r.bytes(),
                r.backend(),
                r.status()
            ),
            None => "nixl_xfer_handle(released)".into(),
        }
    }
}
