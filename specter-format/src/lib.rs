//! The Specter bundle: one page-aligned, mmappable file holding a model's tensors, its FP16 routed
//! experts laid out for one-DMA-per-expert copies, its INT4 draft experts, and a checksummed rkyv
//! manifest. This crate knows bytes, not models. docs/FORMAT.md is the specification.

pub mod manifest;

pub use manifest::*;

/// Every section starts on a page boundary so that it can be mapped, registered and DMA'd as is.
pub const PAGE: u64 = 4096;

/// Everything that can be wrong with a bundle or its writing.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{0}")]
    Io(String),
    #[error("{0}")]
    Invalid(String),
}
