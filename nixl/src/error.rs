//! The SDK's one error type.

use std::fmt;

/// What went wrong, for callers that want to react to it.
///
/// Non-exhaustive: new kinds may be added in minor releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument is malformed (bad option, empty name, ...).
    InvalidArgument,
    /// A descriptor falls (partly) outside every registered region.
    OutOfRange,
    /// A descriptor starts in one registered region and runs into another.
    SpansRegions,
    /// A descriptor has length zero.
    ZeroLength,
    /// The local and remote descriptor lists differ in length or per-entry size.
    LengthMismatch,
    /// The named peer is not known (its metadata was never loaded, or it was forgotten).
    UnknownPeer,
    /// A request was prepared against an older copy of a peer's metadata.
    StaleGeneration,
    /// Something named does not exist (registration, backend, index, ...).
    NotFound,
    /// Two things that must agree do not (memory kinds, agent instance, ...).
    Mismatch,
    /// The operation is not allowed in the current state (request still in flight,
    /// memory still in use, agent shutting down, authentication refused, ...).
    NotAllowed,
    /// No attached backend (or not this one) supports the operation or memory kind.
    NotSupported,
    /// Bytes that should be a valid encoding are not (bad magic, checksum, limits).
    Corrupt,
    /// The peer disconnected or died while the operation needed it.
    RemoteDisconnected,
    /// The operation was canceled (dropped future, shutdown).
    Canceled,
    /// The operation did not finish in time.
    TimedOut,
    /// A native library the backend needs could not be found or loaded.
    UnavailableLibrary,
    /// The backend failed (I/O error, library error, ...).
    Backend,
    /// The agent is shutting down or has shut down.
    ShutDown,
    /// A storage operation on a file failed or moved fewer bytes than asked: the
    /// context names the descriptor and the bytes that did move, the source holds
    /// the OS error where there is one (ENOSPC, EIO, ...).
    Io,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::InvalidArgument => "invalid argument",
            Self::OutOfRange => "out of range",
            Self::SpansRegions => "spans two regions",
            Self::ZeroLength => "zero length",
            Self::LengthMismatch => "length mismatch",
            Self::UnknownPeer => "unknown peer",
            Self::StaleGeneration => "stale generation",
            Self::NotFound => "not found",
            Self::Mismatch => "mismatch",
            Self::NotAllowed => "not allowed",
            Self::NotSupported => "not supported",
            Self::Corrupt => "corrupt",
            Self::RemoteDisconnected => "remote disconnected",
            Self::Canceled => "canceled",
            Self::TimedOut => "timed out",
            Self::UnavailableLibrary => "unavailable library",
            Self::Backend => "backend error",
            Self::ShutDown => "shut down",
            Self::Io => "I/O error",
        };
        f.write_str(s)
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The SDK's error: a [`ErrorKind`], the operation that failed, human context and an
/// optional source error.
pub struct Error {
    kind: ErrorKind,
    op: &'static str,
    context: String,
    source: Option<Source>,
}

/// `Result` with the SDK's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Make an error of `kind` for operation `op` with a context message.
    pub fn new(kind: ErrorKind, op: &'static str, context: impl Into<String>) -> Self {
        Self {
            kind,
            op,
            context: context.into(),
            source: None,
        }
    }

    /// Attach the underlying error.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The kind, to match on.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The operation that failed (`"register"`, `"post"`, ...).
    pub fn operation(&self) -> &'static str {
        self.op
    }

    /// The human-readable context.
    pub fn context(&self) -> &str {
        &self.context
    }

    /// A copy of this error without its source (the source is rendered into the
    /// context), for reporting one failure to several waiters.
    pub fn cloned(&self) -> Self {
        let context = match &self.source {
            Some(s) => format!("{}: {s}", self.context),
            None => self.context.clone(),
        };
        Self::new(self.kind, self.op, context)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind)
            .field("op", &self.op)
            .field("context", &self.context);
        if let Some(s) = &self.source {
            d.field("source", s);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed ({}): {}", self.op, self.kind, self.context)?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|s| &**s as &(dyn std::error::Error + 'static))
    }
}

/// Shorthand for `Err(Error::new(..))`.
pub(crate) fn err<T>(kind: ErrorKind, op: &'static str, context: impl Into<String>) -> Result<T> {
    Err(Error::new(kind, op, context))
}
