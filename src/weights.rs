//! Where a model's weights come from: a bundle (zero-copy views of the mapping) in production, or a
//! Hugging Face checkpoint directory (converted on read) in tests and during conversion, whose
//! store is specter-convert's `Checkpoint`.

use std::borrow::Cow;

use half::f16;

use crate::Result;

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
    /// A packed u32 tensor (the draft's Marlin-tiled INT4 weights).
    fn u32(&self, name: &str) -> Result<Tensor<'_, u32>>;
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

    fn backing(&self) -> Option<Backing<'_>> {
        Some(Backing {
            bytes: self.as_bytes(),
            file: self.file(),
        })
    }
}
