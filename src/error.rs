//! The runtime library's error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Format(#[from] specter_format::FormatError),
    #[error("{0}")]
    Io(String),
    /// A checkpoint or bundle does not hold what the architecture needs.
    #[error("model: {0}")]
    Model(String),
    /// A request the model cannot serve (token out of vocabulary, context too long, ...).
    #[error("invalid request: {0}")]
    Request(String),
    #[error("quantization: {0}")]
    Quant(String),
    #[error("backend: {0}")]
    Backend(String),
}

impl Error {
    pub fn io(context: impl std::fmt::Display, err: std::io::Error) -> Self {
        Error::Io(format!("{context}: {err}"))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
