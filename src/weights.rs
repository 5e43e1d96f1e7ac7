//! Where a model's weights come from: a bundle (zero-copy views of the mapping) in production, or a
//! Hugging Face checkpoint directory (converted on read) in tests and during conversion, whose
//! store is specter-convert's `Checkpoint`.

use std::borrow::Cow;

use half::f16;

use crate::quant::Bits;
use crate::{Error, Result};

/// Bits per weight of the two copies of the routed experts a store holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertWidths {
    /// `None`: FP16, under the checkpoint's names; otherwise quantized (8 or 4 bits) under
    /// `target.layers.{l}.experts.{e}.{gate_up|down}.{qweight|scales}`.
    pub target: Option<Bits>,
    /// The draft's (4, 3 or 2 bits).
    pub draft: Bits,
}

impl Default for ExpertWidths {
    fn default() -> Self {
        ExpertWidths {
            target: None,
            draft: Bits::FOUR,
        }
    }
}

impl ExpertWidths {
    /// The target's width as users name it: `fp16`, `int8` or `int4`.
    pub fn target_name(&self) -> String {
        match self.target {
            None => "fp16".into(),
            Some(b) => format!("int{b}"),
        }
    }

    /// Bytes of one target expert (gate, up and down) of `hidden` x `inter` weights each: its
    /// codes and scales when quantized.
    pub fn target_expert_bytes(&self, hidden: usize, inter: usize) -> usize {
        let weights = 3 * hidden * inter;
        match self.target {
            None => weights * 2,
            Some(b) => weights * b.get() as usize / 8 + weights / crate::quant::GROUP_SIZE * 2,
        }
    }
}

/// A tensor lent out by a [`WeightStore`]: borrowed when the store can hand out its own bytes (a
/// bundle's mapping), owned when it had to convert them.
pub struct Tensor<'a, T: Clone> {
    pub shape: Vec<usize>,
    pub data: Cow<'a, [T]>,
}

/// Read-only access to named tensors.
///
/// Names are Hugging Face's, with routed experts always under their per-expert names
/// (`model.layers.{l}.mlp.experts.{e}.gate_proj.weight`, or the architecture's equivalent), and
/// the draft's INT4 experts under `draft.layers.{l}.experts.{e}.{gate_up|down}.{qweight|scales}`
/// (see docs/FORMAT.md).
pub trait WeightStore: Send + Sync {
    fn contains(&self, name: &str) -> bool;
    /// An FP16 tensor. Stores holding bf16 or f32 convert, failing on values outside f16's range.
    fn f16(&self, name: &str) -> Result<Tensor<'_, f16>>;
    /// A packed u32 tensor (Marlin-tiled 4-bit weights).
    fn u32(&self, name: &str) -> Result<Tensor<'_, u32>>;
    /// A byte tensor (8-, 3- and 2-bit weights in the row layout). Stores without such tensors
    /// keep the default.
    fn u8(&self, name: &str) -> Result<Tensor<'_, u8>> {
        Err(Error::Model(format!(
            "{name}: this weight store holds no byte tensors"
        )))
    }
    /// How the store's routed experts are encoded (an FP16 target with a 4-bit draft unless the
    /// store says otherwise).
    fn expert_widths(&self) -> Result<ExpertWidths> {
        Ok(ExpertWidths::default())
    }
    /// The bytes that borrowed tensors point into, and the file behind them, when the store is a
    /// file mapping: a backend can then read tensors with large file reads instead of page faults.
    fn backing(&self) -> Option<Backing<'_>> {
        None
    }
}

/// Where a store's borrowed tensors live: a tensor whose slice lies inside `bytes` at offset `o`
/// is the file's bytes at offset `o`.
#[derive(Clone, Copy)]
pub struct Backing<'a> {
    pub bytes: &'a [u8],
    pub file: Option<(&'a std::fs::File, &'a std::path::Path)>,
}

/// A bundle lends its tensors straight from the mapping: no copy, no conversion.
impl WeightStore for specter_format::Bundle {
    fn contains(&self, name: &str) -> bool {
        self.tensor(name).is_ok()
    }

    fn f16(&self, name: &str) -> Result<Tensor<'_, f16>> {
        let view = self.tensor(name)?;
        Ok(Tensor {
            shape: view.shape.clone(),
            data: Cow::Borrowed(view.as_f16()?),
        })
    }

    fn u32(&self, name: &str) -> Result<Tensor<'_, u32>> {
        let view = self.tensor(name)?;
        Ok(Tensor {
            shape: view.shape.clone(),
            data: Cow::Borrowed(view.as_u32()?),
        })
    }

    fn u8(&self, name: &str) -> Result<Tensor<'_, u8>> {
        let view = self.tensor(name)?;
        Ok(Tensor {
            shape: view.shape.clone(),
            data: Cow::Borrowed(view.as_u8()?),
        })
    }

    fn expert_widths(&self) -> Result<ExpertWidths> {
        let p = &self.manifest().precision;
        let target = match p.target_bits.to_native() {
            16 => None,
            b => Some(Bits::new(b)?),
        };
        Ok(ExpertWidths {
            target,
            draft: Bits::new(p.draft_bits.to_native())?,
        })
    }

    fn backing(&self) -> Option<Backing<'_>> {
        Some(Backing {
            bytes: self.as_bytes(),
            file: self.file(),
        })
    }
}
