//! The bench's error: a message for people, with the chain of causes behind it.

use std::fmt;

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong, said as "what we were doing: why it failed".
#[derive(Debug)]
pub(crate) struct BenchError {
    message: String,
    source: Option<Source>,
}

/// `Result` with [`BenchError`].
pub(crate) type Result<T, E = BenchError> = std::result::Result<T, E>;

impl BenchError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        // Print the whole chain on one line: the bench reports errors once, at exit.
        let mut next = self.source.as_deref().map(|s| s as &dyn std::error::Error);
        while let Some(s) = next {
            write!(f, ": {s}")?;
            next = match s.downcast_ref::<Self>() {
                // A BenchError already printed its own chain.
                Some(_) => None,
                None => s.source(),
            };
        }
        Ok(())
    }
}

impl std::error::Error for BenchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

impl From<nixl::Error> for BenchError {
    fn from(e: nixl::Error) -> Self {
        Self::new(e.to_string())
    }
}

impl From<std::io::Error> for BenchError {
    fn from(e: std::io::Error) -> Self {
        Self::new(e.to_string())
    }
}

/// Shorthand for `Err(BenchError::new(..))`.
pub(crate) fn fail<T>(message: impl Into<String>) -> Result<T> {
    Err(BenchError::new(message))
}

/// Adds what the bench was doing to an error.
pub(crate) trait Context<T> {
    /// Wrap the error under `message`.
    fn context(self, message: impl Into<String>) -> Result<T>;
    /// Wrap the error under a message built only on failure.
    fn with_context<M: Into<String>>(self, message: impl FnOnce() -> M) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, message: impl Into<String>) -> Result<T> {
        self.with_context(|| message)
    }

    fn with_context<M: Into<String>>(self, message: impl FnOnce() -> M) -> Result<T> {
        self.map_err(|e| BenchError {
            message: message().into(),
            source: Some(Box::new(e)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_shows_the_whole_chain_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Err::<(), _>(io)
            .context("connect to 127.0.0.1:1")
            .context("start initiator")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "start initiator: connect to 127.0.0.1:1: refused"
        );
    }
}
