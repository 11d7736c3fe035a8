//! nixl errors as Python exceptions that carry the error kind.
//!
//! The classes bear NIXL's names (`nixlBackendError`, `nixlNotFoundError`, ...; NIXL's
//! bindings raise those) and share one base, `NixlError`; each instance has `kind`
//! (ours, e.g. `"OutOfRange"`), `operation` and `context`.

use nixl::ErrorKind;
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

create_exception!(
    _native,
    NixlError,
    PyRuntimeError,
    "Base of every nixl-rs error; `kind`, `operation` and `context` say what failed."
);
create_exception!(_native, nixlInvalidParamError, NixlError, "A bad argument.");
create_exception!(
    _native,
    nixlNotFoundError,
    NixlError,
    "Something named is not there (agent, registration, backend, index)."
);
create_exception!(
    _native,
    nixlMismatchError,
    NixlError,
    "Two things that must agree do not."
);
create_exception!(
    _native,
    nixlNotAllowedError,
    NixlError,
    "Not allowed in the current state."
);
create_exception!(
    _native,
    nixlRepostActiveError,
    nixlNotAllowedError,
    "The previous post of this transfer is still in flight."
);
create_exception!(
    _native,
    nixlNotPostedError,
    NixlError,
    "The transfer was never posted."
);
create_exception!(
    _native,
    nixlNotSupportedError,
    NixlError,
    "Not supported by the agent's backends (or a library they need is missing)."
);
create_exception!(
    _native,
    nixlRemoteDisconnectError,
    NixlError,
    "The peer disconnected or died."
);
create_exception!(
    _native,
    nixlCancelledError,
    NixlError,
    "The operation was canceled."
);
create_exception!(_native, nixlBackendError, NixlError, "The backend failed.");
create_exception!(
    _native,
    nixlUnknownError,
    NixlError,
    "A failure of no other class (NIXL's NIXL_ERR_UNKNOWN)."
);
create_exception!(
    _native,
    nixlNoTelemetryError,
    NixlError,
    "No telemetry: capture_telemetry is off, or the transfer was never posted."
);

/// Our kind's name, as Python sees it in `exc.kind`.
pub(crate) fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument => "InvalidArgument",
        ErrorKind::OutOfRange => "OutOfRange",
        ErrorKind::SpansRegions => "SpansRegions",
        ErrorKind::ZeroLength => "ZeroLength",
        ErrorKind::LengthMismatch => "LengthMismatch",
        ErrorKind::UnknownPeer => "UnknownPeer",
        ErrorKind::StaleGeneration => "StaleGeneration",
        ErrorKind::NotFound => "NotFound",
        ErrorKind::Mismatch => "Mismatch",
        ErrorKind::NotAllowed => "NotAllowed",
        ErrorKind::NotSupported => "NotSupported",
        ErrorKind::Corrupt => "Corrupt",
        ErrorKind::RemoteDisconnected => "RemoteDisconnected",
        ErrorKind::Canceled => "Canceled",
        ErrorKind::TimedOut => "TimedOut",
        ErrorKind::UnavailableLibrary => "UnavailableLibrary",
        ErrorKind::Backend => "Backend",
        ErrorKind::ShutDown => "ShutDown",
        _ => "Other",
    }
}

/// A Python exception of the class for `kind`, with its attributes set.
pub(crate) fn raise(kind: &str, operation: &str, context: &str, message: String) -> PyErr {
    // The message starts with NIXL's status name, as NIXL's exceptions read
    // ("NIXL_ERR_REMOTE_DISCONNECT"): callers match on it.
    let m = |status: &str| format!("{status}: {message}");
    let err = match kind {
        "InvalidArgument" | "OutOfRange" | "SpansRegions" | "ZeroLength" | "LengthMismatch" => {
            nixlInvalidParamError::new_err(m("NIXL_ERR_INVALID_PARAM"))
        }
        "UnknownPeer" | "NotFound" => nixlNotFoundError::new_err(m("NIXL_ERR_NOT_FOUND")),
        "Mismatch" | "StaleGeneration" => nixlMismatchError::new_err(m("NIXL_ERR_MISMATCH")),
        "NotAllowed" if operation == "post transfer" && context.contains("still in flight") => {
            nixlRepostActiveError::new_err(m("NIXL_ERR_REPOST_ACTIVE"))
        }
        "NotAllowed" | "ShutDown" => nixlNotAllowedError::new_err(m("NIXL_ERR_NOT_ALLOWED")),
        "NotPosted" => nixlNotPostedError::new_err(m("NIXL_ERR_NOT_POSTED")),
        "NoTelemetry" => nixlNoTelemetryError::new_err(m("NIXL_ERR_NO_TELEMETRY")),
        "NotSupported" | "UnavailableLibrary" => {
            nixlNotSupportedError::new_err(m("NIXL_ERR_NOT_SUPPORTED"))
        }
        "RemoteDisconnected" => nixlRemoteDisconnectError::new_err(m("NIXL_ERR_REMOTE_DISCONNECT")),
        "Canceled" => nixlCancelledError::new_err(m("NIXL_ERR_CANCELED")),
        "Other" => nixlUnknownError::new_err(m("NIXL_ERR_UNKNOWN")),
        _ => nixlBackendError::new_err(m("NIXL_ERR_BACKEND")),
    };
    Python::with_gil(|py| {
        let v = err.value(py);
        // Setting attributes on a fresh exception instance cannot fail in practice;
        // if it did, the exception still says what went wrong in its message.
        let _ = v.setattr("kind", kind);
        let _ = v.setattr("operation", operation);
        let _ = v.setattr("context", context);
    });
    err
}

/// A nixl error as its Python exception.
pub(crate) fn to_py(e: &nixl::Error) -> PyErr {
    raise(
        kind_name(e.kind()),
        e.operation(),
        e.context(),
        e.to_string(),
    )
}

/// An error of ours that is not a nixl error (bad arguments found here).
pub(crate) fn invalid(operation: &str, context: impl Into<String>) -> PyErr {
    let context = context.into();
    let msg = format!("{operation}: {context}");
    raise("InvalidArgument", operation, &context, msg)
}

/// `Result<T, nixl::Error>` into a Python result.
pub(crate) trait IntoPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for nixl::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| to_py(&e))
    }
}

/// Add the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("NixlError", py.get_type::<NixlError>())?;
    m.add(
        "nixlInvalidParamError",
        py.get_type::<nixlInvalidParamError>(),
    )?;
    m.add("nixlNotFoundError", py.get_type::<nixlNotFoundError>())?;
    m.add("nixlMismatchError", py.get_type::<nixlMismatchError>())?;
    m.add("nixlNotAllowedError", py.get_type::<nixlNotAllowedError>())?;
    m.add(
        "nixlRepostActiveError",
        py.get_type::<nixlRepostActiveError>(),
    )?;
    m.add("nixlNotPostedError", py.get_type::<nixlNotPostedError>())?;
    m.add(
        "nixlNotSupportedError",
        py.get_type::<nixlNotSupportedError>(),
    )?;
    m.add(
        "nixlRemoteDisconnectError",
        py.get_type::<nixlRemoteDisconnectError>(),
    )?;
    m.add("nixlCancelledError", py.get_type::<nixlCancelledError>())?;
    m.add("nixlBackendError", py.get_type::<nixlBackendError>())?;
    m.add("nixlUnknownError", py.get_type::<nixlUnknownError>())?;
    m.add(
        "nixlNoTelemetryError",
        py.get_type::<nixlNoTelemetryError>(),
    )?;
    Ok(())
}
