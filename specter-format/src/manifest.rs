//! The manifest: everything a reader needs to find, check and describe the bytes of a bundle.
//!
//! Stored with rkyv and validated (bytecheck) on every open; serde is derived too so that
//! `inspect --json` can print it. Offsets are absolute file offsets.

use rkyv::{Archive, Deserialize as RDeserialize, Serialize as RSerialize};
use serde::{Deserialize, Serialize};

/// What a section holds. The runtime uses the kind to decide what to register for DMA and what to
/// load eagerly; the verifier only uses the checksum.
#[derive(
    Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq, Eq,
)]
#[rkyv(derive(Debug))]
pub enum SectionKind {
    /// FP16 tensors used by both target and draft: embeddings, attention, norms, routers, shared
    /// experts, dense MLPs, lm_head.
    Shared,
    /// One MoE layer's FP16 routed experts, one page-aligned blob per expert.
    Experts { layer: u32 },
    /// One MoE layer's INT4 draft experts in Marlin tiling, with permuted FP16 group scales.
    Draft { layer: u32 },
    /// The source tokenizer.json, byte for byte.
    Tokenizer,
    /// The source config.json, byte for byte.
    Config,
    /// Anything else a writer chooses to store (named by the section's name).
    Other,
}

#[derive(
    Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq,
)]
#[rkyv(derive(Debug))]
pub enum DType {
    F16,
    BF16,
    F32,
    I32,
    /// Packed INT4: eight 4-bit values per little-endian u32 (Marlin tiling for draft weights).
    U32,
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::U8 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
        }
    }
}

#[derive(
    Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq, Eq,
)]
#[rkyv(derive(Debug))]
pub struct SectionEntry {
    pub name: String,
    pub kind: SectionKind,
    /// Absolute, a multiple of 4096.
    pub offset: u64,
    /// Bytes covered by `sha256` (the section's trailing padding to the next page is not counted).
    pub length: u64,
    pub sha256: [u8; 32],
}

#[derive(
    Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq, Eq,
)]
#[rkyv(derive(Debug))]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Index into `Manifest::sections`.
    pub section: u32,
    /// Absolute file offset, inside the section's range.
    pub offset: u64,
    pub length: u64,
}

/// One FP16 routed expert: gate, up and down stored back to back, so that one expert is one DMA.
#[derive(
    Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq, Eq,
)]
#[rkyv(derive(Debug))]
pub struct ExpertEntry {
    pub layer: u32,
    pub expert: u32,
    pub section: u32,
    /// Absolute, a multiple of 4096.
    pub offset: u64,
    pub length: u64,
}

#[derive(
    Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq, Eq,
)]
#[rkyv(derive(Debug))]
pub struct SourceFile {
    pub name: String,
    pub length: u64,
    pub sha256: [u8; 32],
}

/// Per quantized matrix: how well the INT4 copy reproduces the FP16 one.
#[derive(Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct QuantStat {
    /// The draft tensor's name (for example `draft.layers.1.experts.3.gate_up`).
    pub tensor: String,
    /// ||W x - Q x|| / ||W x|| over calibration activations (or over random inputs for plain RTN).
    pub rel_err_rtn: f32,
    /// The same for GPTQ; NaN when GPTQ was not run for this matrix.
    pub rel_err_gptq: f32,
    /// Calibration tokens that reached this expert.
    pub calib_tokens: u64,
    /// "none", "pooled-hessian" or "rtn": what was done when too few tokens reached the expert.
    pub fallback: String,
}

#[derive(Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct QuantInfo {
    /// "rtn" or "gptq".
    pub method: String,
    pub bits: u32,
    pub group_size: u32,
    pub symmetric: bool,
    /// GPTQ dampening as a fraction of the mean Hessian diagonal (0 for RTN).
    pub damp: f32,
    pub act_order: bool,
    /// Where calibration data came from ("none", "file:NAME sha256:...", "self-generated ...").
    pub calibration: String,
    pub calib_tokens: u64,
    pub stats: Vec<QuantStat>,
}

#[derive(Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Provenance {
    pub tool: String,
    pub tool_version: String,
    /// Every source file read, with its hash.
    pub sources: Vec<SourceFile>,
    pub quant: QuantInfo,
    /// Free-form notes (for example which tensor names were mapped how).
    pub notes: Vec<String>,
}

#[derive(Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Manifest {
    /// The Hugging Face `model_type` (for example `deepseek_v2`).
    pub architecture: String,
    /// The model's hyper-parameters as JSON (the runtime's normalized view of config.json).
    pub hyperparameters_json: String,
    pub sections: Vec<SectionEntry>,
    pub tensors: Vec<TensorEntry>,
    pub experts: Vec<ExpertEntry>,
    pub provenance: Provenance,
}
