//! NIXL's C status codes, and how nixl-rs' error kinds map onto them.
//!
//! NIXL's own library maps its C++ statuses to a few C codes (invalid parameter,
//! not found, no telemetry; everything else "backend error"), and some calls
//! collapse every failure to "backend error". The same mapping here, from
//! [`nixl::ErrorKind`]: what a caller branches on (`nixl-sys` turns -1 into
//! `InvalidParam`, -6 into `NotFound`, -5 into `NoTelemetry`) means the same.

use std::fmt;

/// `nixl_capi_status_t`.
pub type Status = i32;

/// `NIXL_CAPI_SUCCESS`.
pub const SUCCESS: Status = 0;
/// `NIXL_CAPI_IN_PROG`: a transfer is still running.
pub const IN_PROG: Status = 1;
/// `NIXL_CAPI_ERROR_INVALID_PARAM`: a null or malformed argument, an index out of
/// range, mismatched lists.
pub const INVALID_PARAM: Status = -1;
/// `NIXL_CAPI_ERROR_BACKEND`: every other failure.
pub const BACKEND: Status = -2;
/// `NIXL_CAPI_ERROR_INVALID_STATE`: a request destroyed before it was released.
pub const INVALID_STATE: Status = -3;
/// `NIXL_CAPI_ERROR_EXCEPTION`: never returned (a panic is reported as BACKEND, as
/// NIXL reports a C++ exception).
pub const EXCEPTION: Status = -4;
/// `NIXL_CAPI_ERROR_NO_TELEMETRY`: the agent records no telemetry.
pub const NO_TELEMETRY: Status = -5;
/// `NIXL_CAPI_ERROR_NOT_FOUND`: the peer's metadata is not loaded, or no backend
/// serves the request.
pub const NOT_FOUND: Status = -6;

/// A failed call: its status code and what went wrong (logged at the boundary).
#[derive(Debug, Clone)]
pub struct Failure {
    /// The code the C caller gets.
    pub status: Status,
    /// Why, for the log.
    pub message: String,
}

impl Failure {
    /// A failure with this status.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// [`INVALID_PARAM`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(INVALID_PARAM, message)
    }

    /// [`NOT_FOUND`].
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(NOT_FOUND, message)
    }

    /// [`BACKEND`].
    pub fn backend(message: impl Into<String>) -> Self {
        Self::new(BACKEND, message)
    }

    /// The same failure reported as [`BACKEND`], for the calls where NIXL collapses
    /// every failure to it (`create_backend`, `get_plugin_params`,
    /// `create_xfer_req`, ...).
    #[must_use]
    pub fn collapsed(self) -> Self {
        Self {
            status: BACKEND,
            ..self
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, name(self.status))
    }
}

/// The C status for one of nixl-rs' error kinds.
pub fn of_kind(kind: nixl::ErrorKind) -> Status {
    use nixl::ErrorKind as K;
    match kind {
        K::InvalidArgument | K::ZeroLength | K::LengthMismatch => INVALID_PARAM,
        // Descriptors outside every registration (or across two): NIXL finds no
        // backend that covers them.
        K::UnknownPeer | K::StaleGeneration | K::NotFound | K::SpansRegions | K::OutOfRange => {
            NOT_FOUND
        }
        _ => BACKEND,
    }
}

impl From<nixl::Error> for Failure {
    fn from(e: nixl::Error) -> Self {
        Self::new(of_kind(e.kind()), e.to_string())
    }
}

/// The enumerator's name, for messages.
pub fn name(status: Status) -> &'static str {
    match status {
        SUCCESS => "NIXL_CAPI_SUCCESS",
        IN_PROG => "NIXL_CAPI_IN_PROG",
        INVALID_PARAM => "NIXL_CAPI_ERROR_INVALID_PARAM",
        BACKEND => "NIXL_CAPI_ERROR_BACKEND",
        INVALID_STATE => "NIXL_CAPI_ERROR_INVALID_STATE",
        EXCEPTION => "NIXL_CAPI_ERROR_EXCEPTION",
        NO_TELEMETRY => "NIXL_CAPI_ERROR_NO_TELEMETRY",
        NOT_FOUND => "NIXL_CAPI_ERROR_NOT_FOUND",
        _ => "unknown status",
    }
}

/// A call's result: a status on success (SUCCESS or IN_PROG), a failure otherwise.
pub type Outcome<T = ()> = Result<T, Failure>;

#[cfg(test)]
mod tests {
    use super::*;
    use nixl::ErrorKind as K;

    #[test]
    fn kinds_map_as_nixl_maps_its_statuses() {
        assert_eq!(of_kind(K::InvalidArgument), INVALID_PARAM);
        assert_eq!(of_kind(K::LengthMismatch), INVALID_PARAM);
        assert_eq!(of_kind(K::UnknownPeer), NOT_FOUND);
        assert_eq!(of_kind(K::StaleGeneration), NOT_FOUND);
        assert_eq!(of_kind(K::SpansRegions), NOT_FOUND);
        assert_eq!(of_kind(K::OutOfRange), NOT_FOUND);
        assert_eq!(of_kind(K::RemoteDisconnected), BACKEND);
        assert_eq!(of_kind(K::NotSupported), BACKEND);
        assert_eq!(of_kind(K::Canceled), BACKEND);
        assert_eq!(Failure::not_found("x").collapsed().status, BACKEND);
        assert!(Failure::invalid("bad")
            .to_string()
            .contains("INVALID_PARAM"));
    }
}
