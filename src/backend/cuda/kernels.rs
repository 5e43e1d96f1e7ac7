//! The kernel table: every compiled kernel function the backend launches, loaded once per
//! device, and the helpers that turn launch arguments into the 8-byte slots kernels read.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};

use super::CudaDevice;
use crate::{Error, Result};

pub(super) use super::launch_constants::*;

pub(super) struct Kernels {
    pub(super) embedding: CudaFunction,
    pub(super) rms_norm: CudaFunction,
    pub(super) add_rms_norm: CudaFunction,
    pub(super) mla_latent: CudaFunction,
    pub(super) mla_expand_append: CudaFunction,
    pub(super) linear2: CudaFunction,
    pub(super) layer_norm: CudaFunction,
    pub(super) copy_cols: CudaFunction,
    pub(super) copy_rows_at: CudaFunction,
    pub(super) clamp: CudaFunction,
    pub(super) add: CudaFunction,
    pub(super) add_sigmoid_gated: CudaFunction,
    pub(super) rope: CudaFunction,
    pub(super) mla_expand_kv: CudaFunction,
    pub(super) argmax: CudaFunction,
    pub(super) moe_combine: CudaFunction,
    pub(super) route_topk: CudaFunction,
    pub(super) route_sparse_mixer: CudaFunction,
    pub(super) count_routes: CudaFunction,
    pub(super) moe_plan: CudaFunction,
    pub(super) route_plan: CudaFunction,
    /// route_plan with the shared experts' gate/up in its other blocks (kernels/gemv_f16.cu).
    pub(super) route_plan_shared: CudaFunction,
    pub(super) linear: CudaFunction,
    pub(super) gate_up_silu: CudaFunction,
    pub(super) moe_gate_up: CudaFunction,
    pub(super) moe_down: CudaFunction,
    /// moe_down with the shared experts' down product in a last row of blocks.
    pub(super) moe_down_shared: CudaFunction,
    /// The one-row forms (kernels/gemv_f16.cu, `*_1`): the same bits, more loads in flight.
    pub(super) linear_1: CudaFunction,
    pub(super) linear2_1: CudaFunction,
    pub(super) moe_gate_up_1: CudaFunction,
    pub(super) moe_down_1: CudaFunction,
    pub(super) moe_down_shared_1: CudaFunction,
    pub(super) attention: CudaFunction,
}

impl Kernels {
    pub(super) fn load(dev: &CudaDevice) -> Result<Self> {
        let ops = |f: &str| dev.function("ops", f);
        let routing = |f: &str| dev.function("routing", f);
        let gemv = |f: &str| dev.function("gemv_f16", f);
        Ok(Kernels {
            embedding: ops("embedding")?,
            rms_norm: ops("rms_norm")?,
            add_rms_norm: ops("add_rms_norm")?,
            mla_latent: ops("mla_latent")?,
            mla_expand_append: ops("mla_expand_append")?,
            linear2: gemv("linear2_f16")?,
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
            route_plan_shared: gemv("route_plan_shared_f16")?,
            linear: gemv("linear_f16")?,
            gate_up_silu: gemv("gate_up_silu_f16")?,
            moe_gate_up: gemv("moe_f16_gate_up")?,
            moe_down: gemv("moe_f16_down")?,
            moe_down_shared: gemv("moe_f16_down_shared")?,
            linear_1: gemv("linear_f16_1")?,
            linear2_1: gemv("linear2_f16_1")?,
            moe_gate_up_1: gemv("moe_f16_gate_up_1")?,
            moe_down_1: gemv("moe_f16_down_1")?,
            moe_down_shared_1: gemv("moe_f16_down_shared_1")?,
            attention: dev.function("attention", "attention")?,
        })
    }
}

/// The link pacing pair of kernels/util.cu (`link_pace_start`, `link_pace_wait`), loaded only
/// when expert copies are paced, so that other runs never load that module.
pub(super) struct PaceKernels {
    pub(super) start: CudaFunction,
    pub(super) wait: CudaFunction,
}

impl PaceKernels {
    pub(super) fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(PaceKernels {
            start: dev.function("util", "link_pace_start")?,
            wait: dev.function("util", "link_pace_wait")?,
        })
    }
}

/// A kernel argument: every argument travels as one 8-byte slot (the driver reads as many bytes as
/// the parameter has, and the target is little-endian).
pub(super) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

pub(super) fn int(v: usize, what: &str) -> Result<u64> {
    i32::try_from(v).map(|v| v as u32 as u64).map_err(|_| {
        Error::Backend(format!(
            "cuda: {what} = {v} exceeds the kernels' 32-bit index"
        ))
    })
}

pub(super) fn float(v: f32) -> u64 {
    v.to_bits() as u64
}

pub(super) fn shape_err(op: &str, detail: String) -> Error {
    Error::Backend(format!("cuda {op}: {detail}"))
}

pub(super) fn grid_for(n: usize, block: u32) -> u32 {
    n.div_ceil(block as usize).clamp(1, 65_535 * 16) as u32
}
