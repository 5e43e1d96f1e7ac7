//! The Specter bundle: one page-aligned, mmappable file holding a model's tensors, its target's
//! routed experts (FP16, INT8 or INT4) laid out for one-DMA-per-expert copies, its quantized draft
//! experts, and a checksummed rkyv manifest. This crate knows bytes, not models. docs/FORMAT.md is the specification.
//!
//! Write with [`BundleWriter`], read with [`Bundle`]; [`Bundle::verify`] checks every byte.
//! [`ship::ship`] and [`ship::unship`] pack a bundle into compressed, checksummed chunks for
//! copying, and back.

mod error;
mod header;
pub mod manifest;
mod precision;
mod reader;
pub mod ship;
mod verify;
mod writer;

pub use error::{FormatError, Result};
pub use header::{Header, HEADER_CHECKSUM_OFFSET, HEADER_LEN, MAGIC};
pub use manifest::*;
pub use precision::Layout;
pub use reader::{Bundle, TensorView};
pub use verify::{SectionCheck, VerifyReport};
pub use writer::BundleWriter;

/// Every section starts on a page boundary so that it can be mapped, registered and DMA'd as is.
pub const PAGE: u64 = 4096;

/// Every tensor starts on a multiple of this many bytes, enough for any element type and for
/// vector loads.
pub const TENSOR_ALIGN: u64 = 64;

/// The format version this crate writes. Readers refuse a newer major and accept a newer minor;
/// they read major 1 too (its manifest lacks the precision, which is then FP16 with a 4-bit draft).
pub const FORMAT_MAJOR: u16 = 2;
pub const FORMAT_MINOR: u16 = 0;

/// Lower-case hex of a sha256.
pub fn sha256_hex(hash: &[u8; 32]) -> String {
    use std::fmt::Write;
    hash.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
