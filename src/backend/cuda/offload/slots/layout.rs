//! Where an expert's tensors lie: in its blob of the bundle (FP16, INT8 or INT4 tensors read in
//! place by the host kernel, a quantized blob copied whole) and in an expert slot (the kernels'
//! pointers).

use std::ops::Range;
use std::sync::Arc;

use half::f16;
use specter_format::Bundle;

use super::ExpertOffload;
use crate::arch::target_tensor_name;
use crate::backend::cuda::moe::experts::{ExpertGroup, ExpertKind};
use crate::host_experts::ExpertWeights;
use crate::quant::Bits;
use crate::{Error, Result};

/// One expert's tensors where they lie in the bundle's mapping, for the host kernel.
pub(crate) struct InPlaceExpert {
    pub bundle: Arc<Bundle>,
    pub tensors: InPlaceTensors,
}

/// File byte ranges of an expert's tensors (see `host_experts::ExpertTensors`).
pub(crate) enum InPlaceTensors {
    F16 {
        gate: Range<usize>,
        up: Range<usize>,
        down: Range<usize>,
    },
    /// Codes in the row layout at `bits` (8 or 4) and their scales.
    Rows {
        bits: Bits,
        gate_up: Range<usize>,
        gate_up_scales: Range<usize>,
        down: Range<usize>,
        down_scales: Range<usize>,
    },
}

impl InPlaceExpert {
    /// The tensors as slices of the mapping (`hidden`, `inter`: the expert's shape).
    pub fn weights(&self, hidden: usize, inter: usize) -> Result<ExpertWeights<'_>> {
        let bytes = self.bundle.as_bytes();
        let half = |r: &Range<usize>| -> Result<&[f16]> {
            bytemuck::try_cast_slice(&bytes[r.clone()]).map_err(|e| {
                Error::Model(format!(
                    "host experts: expert bytes at {}..{} cannot be read in place as FP16 ({e})",
                    r.start, r.end
                ))
            })
        };
        Ok(match &self.tensors {
            InPlaceTensors::F16 { gate, up, down } => {
                ExpertWeights::f16(half(gate)?, half(up)?, half(down)?, hidden, inter)
            }
            InPlaceTensors::Rows {
                bits,
                gate_up,
                gate_up_scales,
                down,
                down_scales,
            } => {
                let expert = if *bits == Bits::EIGHT {
                    ExpertWeights::int8
                } else {
                    ExpertWeights::int4
                };
                expert(
                    (&bytes[gate_up.clone()], half(gate_up_scales)?),
                    (&bytes[down.clone()], half(down_scales)?),
                    hidden,
                    inter,
                )
            }
        })
    }
}

/// Where one expert's tensors sit inside its blob (FP16: gate, up and down; quantized: the
/// blob is copied whole and only its start is read).
#[derive(Clone, Copy, Debug)]
pub(super) struct BlobLayout {
    /// Offset of the blob in the file.
    pub(super) file_offset: usize,
    pub(super) gate: usize,
    pub(super) up: usize,
    pub(super) down: usize,
    /// The blob's length (it ends with its last tensor's last byte).
    pub(super) len: usize,
}

/// Where a slot holds an expert's tensors, the same for every slot: byte offsets from the
/// slot's start of the gate/up matrix, the down matrix and (quantized) their scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotLayout {
    pub(crate) kind: ExpertKind,
    pub(crate) gate_up: u64,
    pub(crate) gate_up_scales: u64,
    pub(crate) down: u64,
    pub(crate) down_scales: u64,
}

impl SlotLayout {
    /// The kernels' pointers of the expert in the slot at `base`.
    pub(crate) fn group(&self, base: u64, first: u32, count: u32) -> ExpertGroup {
        let scales = |off: u64| {
            if self.kind == ExpertKind::F16 {
                0
            } else {
                base + off
            }
        };
        ExpertGroup {
            gate_up: base + self.gate_up,
            gate_up_scales: scales(self.gate_up_scales),
            down: base + self.down,
            down_scales: scales(self.down_scales),
            first,
            count,
        }
    }
}

/// Byte offsets inside expert `e`'s blob of model layer `l` of its quantized target tensors:
/// gate/up codes, gate/up scales, down codes, down scales.
pub(super) fn quantized_offsets(bundle: &Bundle, l: usize, e: usize) -> Result<[u64; 4]> {
    let blob = bundle
        .expert_blob(l as u32, e as u32)
        .map_err(|err| Error::Model(format!("offload: layer {l} expert {e}: {err}")))?;
    let start = blob.as_ptr() as usize;
    let mut offsets = [0u64; 4];
    let parts = [
        ("gate_up", "qweight"),
        ("gate_up", "scales"),
        ("down", "qweight"),
        ("down", "scales"),
    ];
    for (o, (part, kind)) in offsets.iter_mut().zip(parts) {
        let name = target_tensor_name(l, e, part, kind);
        let view = bundle.tensor(&name)?;
        let p = view.bytes.as_ptr() as usize;
        // The kernels read codes and scales with 16-byte loads.
        if p < start || p + view.bytes.len() > start + blob.len() || !(p - start).is_multiple_of(16)
        {
            return Err(Error::Model(format!(
                "offload: {name} does not lie 16-byte aligned inside its expert blob"
            )));
        }
        *o = (p - start) as u64;
    }
    Ok(offsets)
}

/// Reading experts in place, for the host kernel.
impl ExpertOffload {
    /// Expert `expert` of model layer `layer` where it lies in the bundle, for the host kernel.
    pub(crate) fn in_place(&mut self, layer: usize, expert: u32) -> Result<InPlaceExpert> {
        let mb = self.matrix_bytes;
        let (inter, layout) = (self.inter, self.layout);
        let blob = *self
            .layer_mut(layer)?
            .blobs
            .get(expert as usize)
            .ok_or_else(|| Error::Model(format!("offload: no expert {expert} in layer {layer}")))?;
        let at = |off: u64, len: usize| {
            let start = blob.file_offset + off as usize;
            start..start + len
        };
        let tensors = match layout.kind {
            ExpertKind::F16 => InPlaceTensors::F16 {
                gate: at(blob.gate as u64, mb),
                up: at(blob.up as u64, mb),
                down: at(blob.down as u64, mb),
            },
            ExpertKind::Rows(bits) if bits == Bits::EIGHT || bits == Bits::FOUR => {
                // A b-bit matrix is b / 16 of an FP16 one; a scale (2 bytes) serves 128 codes.
                let (codes, scales) = (mb * bits.get() as usize / 16, mb / 128);
                InPlaceTensors::Rows {
                    bits,
                    gate_up: at(layout.gate_up, 2 * codes),
                    gate_up_scales: at(layout.gate_up_scales, 2 * scales),
                    down: at(layout.down, codes),
                    down_scales: at(layout.down_scales, scales),
                }
            }
            other => {
                return Err(Error::Backend(format!(
                    "host experts: no host kernel for {other:?} experts (inter {inter})"
                )))
            }
        };
        Ok(InPlaceExpert {
            bundle: self.bundle.clone(),
            tensors,
        })
    }

    /// The host kernel reads the FP16 tensors where they lie: each must start on an even byte
    /// (the mapping itself is page-aligned).
    pub(super) fn check_in_place(&self) -> Result<()> {
        for (l, layer) in self.layers.iter().enumerate() {
            let Some(layer) = layer else { continue };
            if let Some(e) = layer.blobs.iter().position(|b| {
                [b.gate, b.up, b.down]
                    .iter()
                    .any(|&t| (b.file_offset + t) % 2 != 0)
            }) {
                return Err(Error::Request(format!(
                    "--host-experts: expert {e} of layer {l} cannot be read in place as FP16 \
                     (its tensors start on an odd byte); use --host-experts off"
                )));
            }
        }
        Ok(())
    }
}
