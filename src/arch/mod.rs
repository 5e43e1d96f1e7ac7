//! Architectures: each one's configuration, tensor names and forward pass over a backend.
//!
//! Interface used by the rest of the crate (the converter, the synthesizer, the runtime):
//! - `ArchConfig::from_config_json(&str) -> Result<ArchConfig>`: a normalized view of config.json;
//!   an unknown `model_type` is an error listing [`SUPPORTED_MODEL_TYPES`].
//! - `expected_tensors(&ArchConfig) -> Vec<TensorSpec>`: every tensor the checkpoint must hold,
//!   with its shape and role.
//! - `MoeModel::load(ArchConfig, &dyn WeightStore, backend) -> Result<MoeModel<B>>`: the forward
//!   pass of every architecture, implementing [`crate::model::LanguageModel`].
//!
//! The tensor name patterns live in code ([`tensors`]), next to the forward pass that reads them,
//! with transformers' config defaults; `manifests/` holds the same maps as data, and tests check
//! both against real checkpoints.

/// Hugging Face `model_type`s this crate runs.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "deepseek_v2",
    "qwen2_moe",
    "phimoe",
    "mixtral",
    "olmoe",
    "qwen3_moe",
];

/// One projection of a routed expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proj {
    Gate,
    Up,
    Down,
}

/// What a tensor is for, as far as the converter cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorRole {
    /// Used by target and draft alike; stored in FP16 in the shared section.
    Shared,
    /// A routed expert's projection: stored in FP16 in its layer's expert section, and quantized to
    /// INT4 for the draft. `layer` is the decoder layer index.
    RoutedExpert {
        layer: usize,
        expert: usize,
        proj: Proj,
    },
}

/// A tensor a checkpoint must hold: Hugging Face name, shape (as stored: `[out, in]` for linear
/// weights) and role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

pub mod config;
pub mod model;
pub mod rope;
pub mod tensors;

pub use config::{
    ArchConfig, AttentionKind, ModelType, MoeConfig, NormKind, QkNorm, RopeConfig, RopeScaling,
    RopeStyle, RouterKind, SharedExperts,
};
pub use model::{MoeKv, MoeModel};
pub use rope::RopeTable;
pub use tensors::{
    draft_tensor_name, expected_tensors, expert_tensor_name, router_tensor_name,
    shared_expert_gate_name, shared_expert_prefix, target_tensor_name,
};
