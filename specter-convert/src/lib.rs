//! Conversion of a Hugging Face checkpoint into a Specter bundle, kept apart from the runtime
//! (`specter`), which only reads bundles: a checkpoint is conversion's input.
//!
//! - [`checkpoint`]: the safetensors checkpoint reader, a [`specter::weights::WeightStore`];
//! - [`pack`]: the conversion itself, with GPTQ calibration on the CPU reference;
//! - [`quant`]: GPTQ, beside the runtime's INT4 layout and round-to-nearest;
//! - [`synth`]: random-weight checkpoints of every architecture (the demo, tests, benchmarks).
//!
//! Errors are the runtime's [`Error`]: conversion fails for the same reasons a model does (a
//! tensor missing, a shape wrong, a file unreadable), and the checkpoint's [`WeightStore`]
//! implementation must return them.
//!
//! [`WeightStore`]: specter::weights::WeightStore

pub mod checkpoint;
pub mod pack;
pub mod quant;
pub mod synth;

pub use specter::{Error, Result};
