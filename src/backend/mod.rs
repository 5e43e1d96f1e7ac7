//! (placeholder)
pub mod cuda;
