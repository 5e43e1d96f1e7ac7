//! The kernel table: every compiled kernel function the backend launches, loaded once per
//! device, and the helpers that turn launch arguments into the 8-byte slots kernels read.

use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream, DevicePtr};

use crate::backend::cuda::CudaDevice;
use crate::{Error, Result};

pub(in crate::backend::cuda) use crate::backend::cuda::runtime::launch_constants::*;

pub(in crate::backend::cuda) struct Kernels {
    pub(in crate::backend::cuda) embedding: CudaFunction,
    pub(in crate::backend::cuda) rms_norm: CudaFunction,
    pub(in crate::backend::cuda) add_rms_norm: CudaFunction,
    /// add_rms_norm and one or two products of the normed row, for one row.
    pub(in crate::backend::cuda) add_norm_linear: CudaFunction,
    pub(in crate::backend::cuda) mla_latent: CudaFunction,
    pub(in crate::backend::cuda) mla_expand_append: CudaFunction,
    /// mla_latent, kv_b's product and mla_expand_append of one row in one launch.
    pub(in crate::backend::cuda) mla_kv_append: CudaFunction,
    pub(in crate::backend::cuda) linear2: GridStride,
    pub(in crate::backend::cuda) layer_norm: CudaFunction,
    pub(in crate::backend::cuda) copy_cols: CudaFunction,
    pub(in crate::backend::cuda) copy_rows_at: CudaFunction,
    pub(in crate::backend::cuda) clamp: CudaFunction,
    pub(in crate::backend::cuda) add: CudaFunction,
    pub(in crate::backend::cuda) add_sigmoid_gated: CudaFunction,
    pub(in crate::backend::cuda) rope: CudaFunction,
    pub(in crate::backend::cuda) mla_expand_kv: CudaFunction,
    pub(in crate::backend::cuda) argmax: CudaFunction,
    pub(in crate::backend::cuda) moe_combine: CudaFunction,
    pub(in crate::backend::cuda) route_topk: CudaFunction,
    pub(in crate::backend::cuda) route_sparse_mixer: CudaFunction,
    pub(in crate::backend::cuda) count_routes: CudaFunction,
    pub(in crate::backend::cuda) moe_plan: CudaFunction,
    pub(in crate::backend::cuda) route_plan: CudaFunction,
    /// route_plan with the shared experts' gate/up in its other blocks (kernels/gemv_f16.cu).
    pub(in crate::backend::cuda) route_plan_shared: GridStride,
    pub(in crate::backend::cuda) route_plan_shared_1: GridStride,
    pub(in crate::backend::cuda) linear: GridStride,
    pub(in crate::backend::cuda) gate_up_silu: GridStride,
    pub(in crate::backend::cuda) moe_gate_up: GridStride,
    pub(in crate::backend::cuda) moe_down: GridStride,
    /// moe_down with the shared experts' down product in a last row of blocks.
    pub(in crate::backend::cuda) moe_down_shared: GridStride,
    /// The one-row forms (kernels/gemv_f16.cu, `*_1`): the same bits, more loads in flight.
    pub(in crate::backend::cuda) linear_1: GridStride,
    pub(in crate::backend::cuda) linear2_1: GridStride,
    pub(in crate::backend::cuda) moe_gate_up_1: GridStride,
    pub(in crate::backend::cuda) moe_down_1: GridStride,
    pub(in crate::backend::cuda) moe_down_shared_1: GridStride,
    /// A one-row MoE layer's shared down, routed experts and combine in one launch.
    pub(in crate::backend::cuda) moe_experts_1: CudaFunction,
    /// Split-key attention (kernels/attention.cu): each chunk's partial softmax, then the
    /// combine of a (row, head)'s chunks.
    pub(in crate::backend::cuda) attention: CudaFunction,
    pub(in crate::backend::cuda) attention_combine: CudaFunction,
}

impl Kernels {
    pub(in crate::backend::cuda) fn load(dev: &CudaDevice) -> Result<Self> {
        let ops = |f: &str| dev.function("ops", f);
        let routing = |f: &str| dev.function("routing", f);
        let gemv = |f: &str| dev.function("gemv_f16", f);
        Ok(Kernels {
            embedding: ops("embedding")?,
            rms_norm: ops("rms_norm")?,
            add_rms_norm: ops("add_rms_norm")?,
            add_norm_linear: ops("add_norm_linear_1")?,
            mla_latent: ops("mla_latent")?,
            mla_expand_append: ops("mla_expand_append")?,
            mla_kv_append: ops("mla_kv_append_1")?,
            linear2: GridStride::load(dev, gemv("linear2_f16")?)?,
            layer_norm: ops("layer_norm")?,
            copy_cols: ops("copy_cols")?,
            copy_rows_at: ops("copy_rows_at")?,
            clamp: ops("clamp_f32")?,
            add: ops("add_f32")?,
            add_sigmoid_gated: ops("add_sigmoid_gated")?,
            rope: ops("rope")?,
            mla_expand_kv: ops("mla_expand_kv")?,
            argmax: ops("argmax_rows")?,
            moe_combine: ops("moe_combine")?,
            route_topk: routing("route_softmax_topk")?,
            route_sparse_mixer: routing("route_sparse_mixer")?,
            count_routes: routing("count_routes")?,
            moe_plan: routing("moe_plan")?,
            route_plan: routing("route_plan")?,
            route_plan_shared: GridStride::load(dev, gemv("route_plan_shared_f16")?)?,
            route_plan_shared_1: GridStride::load(dev, gemv("route_plan_shared_f16_1")?)?,
            linear: GridStride::load(dev, gemv("linear_f16")?)?,
            gate_up_silu: GridStride::load(dev, gemv("gate_up_silu_f16")?)?,
            moe_gate_up: GridStride::load(dev, gemv("moe_f16_gate_up")?)?,
            moe_down: GridStride::load(dev, gemv("moe_f16_down")?)?,
            moe_down_shared: GridStride::load(dev, gemv("moe_f16_down_shared")?)?,
            linear_1: GridStride::load(dev, gemv("linear_f16_1")?)?,
            linear2_1: GridStride::load(dev, gemv("linear2_f16_1")?)?,
            moe_gate_up_1: GridStride::load(dev, gemv("moe_f16_gate_up_1")?)?,
            moe_down_1: GridStride::load(dev, gemv("moe_f16_down_1")?)?,
            moe_down_shared_1: GridStride::load(dev, gemv("moe_f16_down_shared_1")?)?,
            moe_experts_1: gemv("moe_f16_experts_1")?,
            attention: dev.function("attention", "attention")?,
            attention_combine: dev.function("attention", "attention_combine")?,
        })
    }
}

/// A kernel whose blocks take its work blocks in a grid-stride loop (kernels/gemv_f16.cu): a
/// launch needs no more blocks than fit on the device at once.
pub(in crate::backend::cuda) struct GridStride {
    pub(in crate::backend::cuda) f: CudaFunction,
    /// Blocks of `32 * GEMV_WARPS` threads resident at once: occupancy times multiprocessors.
    resident: u32,
}

impl GridStride {
    fn load(dev: &CudaDevice, f: CudaFunction) -> Result<Self> {
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(32 * GEMV_WARPS as u32, 0, None)
            .map_err(|e| Error::Backend(format!("cuda: occupancy query failed: {e}")))?;
        let sms =
            dev.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let resident = (per_sm.max(1)).saturating_mul(sms.max(1) as u32);
        Ok(GridStride { f, resident })
    }

    /// The grid for `blocks` work blocks of one row each (`one_row`: decode) or of several:
    /// one row, a block per work block (on the H200 the one-row forms, bound by their loads'
    /// latency, ran 5-25% slower as resident loops); several, as many blocks as fit at once
    /// (a 17-row verification window 6% faster).
    pub(in crate::backend::cuda) fn grid(&self, blocks: u32, one_row: bool) -> u32 {
        if one_row {
            blocks.max(1)
        } else {
            blocks.clamp(1, self.resident)
        }
    }
}

/// The link pacing pair of kernels/util.cu (`link_pace_start`, `link_pace_wait`), loaded only
/// when expert copies are paced, so that other runs never load that module.
pub(in crate::backend::cuda) struct PaceKernels {
    pub(in crate::backend::cuda) start: CudaFunction,
    pub(in crate::backend::cuda) wait: CudaFunction,
}

impl PaceKernels {
    pub(in crate::backend::cuda) fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(PaceKernels {
            start: dev.function("util", "link_pace_start")?,
            wait: dev.function("util", "link_pace_wait")?,
        })
    }
}

/// A kernel argument: every argument travels as one 8-byte slot (the driver reads as many bytes as
/// the parameter has, and the target is little-endian).
pub(in crate::backend::cuda) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

pub(in crate::backend::cuda) fn int(v: usize, what: &str) -> Result<u64> {
    i32::try_from(v).map(|v| v as u32 as u64).map_err(|_| {
        Error::Backend(format!(
            "cuda: {what} = {v} exceeds the kernels' 32-bit index"
        ))
    })
}

pub(in crate::backend::cuda) fn float(v: f32) -> u64 {
    v.to_bits() as u64
}

pub(in crate::backend::cuda) fn shape_err(op: &str, detail: String) -> Error {
    Error::Backend(format!("cuda {op}: {detail}"))
}

pub(in crate::backend::cuda) fn grid_for(n: usize, block: u32) -> u32 {
    n.div_ceil(block as usize).clamp(1, 65_535 * 16) as u32
}
