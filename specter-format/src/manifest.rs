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
    /// One MoE layer's target routed experts (FP16, or quantized as [`Precision::target_bits`]
    /// says), one page-aligned blob per expert.
    Experts { layer: u32 },
    /// One MoE layer's quantized draft experts ([`Precision::draft_bits`]).
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
    /// Packed INT4: eight 4-bit values per little-endian u32 (Marlin tiling for 4-bit weights).
    U32,
    /// Bytes; 8-bit codes, and 2- and 3-bit codes in bit planes (the row layout).
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

/// One routed expert of the target: its tensors (FP16 gate, up and down, or a quantized target's
/// gate_up and down codes and scales) stored back to back, so that one expert is one DMA.
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

/// Per quantized matrix: how well the quantized copy reproduces the FP16 one.
#[derive(Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct QuantStat {
    /// The quantized tensor's name (for example `draft.layers.1.experts.3.gate_up.qweight`).
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
    /// "rtn" or "gptq" ("none" for an FP16 target).
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

impl QuantInfo {
    /// What an FP16 target records: nothing was quantized.
    pub fn unquantized() -> QuantInfo {
        QuantInfo {
            method: "none".into(),
            bits: 16,
            group_size: 0,
            symmetric: true,
            damp: 0.0,
            act_order: false,
            calibration: "none".into(),
            calib_tokens: 0,
            stats: Vec::new(),
        }
    }
}

/// How the routed experts are encoded: the target's in the `Experts` sections, the draft's in the
/// `Draft` sections. docs/FORMAT.md gives each width's layout.
#[derive(Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Precision {
    /// Bits per weight of the target's routed experts: 16 (FP16), 8 or 4.
    pub target_bits: u32,
    /// Bits per weight of the draft's routed experts: 4, 3 or 2, fewer than the target's.
    pub draft_bits: u32,
    /// Input features per quantization group of every quantized expert matrix: 128.
    pub group_size: u32,
    /// How the target's experts were quantized, with the error of every matrix
    /// ([`QuantInfo::unquantized`] for an FP16 target). The draft's is `Provenance::quant`.
    pub target_quant: QuantInfo,
}

/// The target widths a bundle may hold.
pub const TARGET_BITS: [u32; 3] = [16, 8, 4];
/// The draft widths a bundle may hold.
pub const DRAFT_BITS: [u32; 3] = [4, 3, 2];
/// Input features per quantization group.
pub const QUANT_GROUP: u32 = 128;

impl Default for Precision {
    /// An FP16 target with a 4-bit draft: every format 1.x bundle.
    fn default() -> Self {
        Precision {
            target_bits: 16,
            draft_bits: 4,
            group_size: QUANT_GROUP,
            target_quant: QuantInfo::unquantized(),
        }
    }
}

impl Precision {
    /// The widths as users name them: `fp16`, `int8` or `int4` for the target.
    pub fn target_name(&self) -> String {
        match self.target_bits {
            16 => "fp16".into(),
            b => format!("int{b}"),
        }
    }

    /// Checks the widths against what the format defines.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !TARGET_BITS.contains(&self.target_bits) {
            return Err(format!(
                "target experts of {} bits (the format defines 16, 8 and 4)",
                self.target_bits
            ));
        }
        if !DRAFT_BITS.contains(&self.draft_bits) {
            return Err(format!(
                "draft experts of {} bits (the format defines 4, 3 and 2)",
                self.draft_bits
            ));
        }
        if self.draft_bits >= self.target_bits {
            return Err(format!(
                "a {}-bit draft is no smaller than its {}-bit target",
                self.draft_bits, self.target_bits
            ));
        }
        if self.group_size != QUANT_GROUP {
            return Err(format!(
                "quantization groups of {} inputs (the format defines {QUANT_GROUP})",
                self.group_size
            ));
        }
        Ok(())
    }
}

#[derive(Archive, RSerialize, RDeserialize, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Provenance {
    pub tool: String,
    pub tool_version: String,
    /// Every source file read, with its hash.
    pub sources: Vec<SourceFile>,
    /// How the draft's experts were quantized.
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
    /// How the target's and the draft's experts are encoded.
    pub precision: Precision,
    pub provenance: Provenance,
}

/// The manifest of format 1.x, which had no [`Precision`] (an FP16 target and a 4-bit draft).
/// Readers open such bundles by converting it ([`ManifestV1::upgrade`]).
#[derive(Archive, RSerialize, RDeserialize, Debug, Clone, PartialEq)]
pub struct ManifestV1 {
    pub architecture: String,
    pub hyperparameters_json: String,
    pub sections: Vec<SectionEntry>,
    pub tensors: Vec<TensorEntry>,
    pub experts: Vec<ExpertEntry>,
    pub provenance: Provenance,
}

impl ManifestV1 {
    /// The same bundle described by the current manifest.
    pub fn upgrade(self) -> Manifest {
        Manifest {
            architecture: self.architecture,
            hyperparameters_json: self.hyperparameters_json,
            sections: self.sections,
            tensors: self.tensors,
            experts: self.experts,
            precision: Precision::default(),
            provenance: self.provenance,
        }
    }
}
