//! Specter: speculative offloading for Mixture-of-Experts models.
//!
//! An INT4 copy of the model's own routed experts runs in VRAM as a speculative draft; the draft's
//! routing forecasts which FP16 experts the target will need, so their copies overlap with drafting;
//! the target verifies every drafted token in one pass. Greedy output equals target-only decoding.
//!
//! Data flows one way: bundle -> model -> decode loop -> tokens, with `offload` fed by the draft's
//! routing and feeding the target's experts.

pub mod arch;
pub mod backend;
pub mod decode;
pub mod depth_profile;
pub mod error;
pub mod generate;
pub mod host_experts;
pub mod host_memory;
pub mod model;
pub mod offload;
pub mod quant;
pub mod session;
pub mod startup;
pub mod strategy;
pub mod verify_mode;
pub mod weights;

pub use error::{Error, Result};
