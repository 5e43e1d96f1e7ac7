//! The kernel table: every compiled kernel function the backend launches, loaded once per
//! device, each typed by its argument struct (src/backend/cuda/runtime/args.rs), and the helpers
//! that turn sizes and buffers into those arguments.

use std::marker::PhantomData;

use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream, DevicePtr};

use crate::backend::cuda::runtime::act::GpuAct;
pub(in crate::backend::cuda) use crate::backend::cuda::runtime::args::*;
use crate::backend::cuda::CudaDevice;
use crate::backend::MlaShape;
use crate::{Error, Result};

pub(in crate::backend::cuda) use crate::backend::cuda::runtime::launch_constants::*;

/// The (query/key, value) widths per head the prompt's tensor-core attention is built for
/// (kernels/attention_prompt.cu), in the order of [`Kernels::attention_prompt`].
pub(in crate::backend::cuda) const ATTENTION_PROMPT_WIDTHS: [(usize, usize); 3] =
    [(64, 64), (128, 128), (192, 128)];

pub(in crate::backend::cuda) struct Kernels {
    pub(in crate::backend::cuda) embedding: Kernel<EmbeddingArgs>,
    pub(in crate::backend::cuda) rms_norm: Kernel<RmsNormArgs>,
    pub(in crate::backend::cuda) add_rms_norm: Kernel<AddRmsNormArgs>,
    /// add_rms_norm and one or two products of the normed row, for one row.
    pub(in crate::backend::cuda) add_norm_linear: Kernel<AddNormLinearArgs>,
    pub(in crate::backend::cuda) mla_latent: Kernel<MlaLatentArgs>,
    pub(in crate::backend::cuda) mla_expand_append: Kernel<MlaExpandAppendArgs>,
    /// mla_latent, kv_b's product and mla_expand_append of one row in one launch.
    pub(in crate::backend::cuda) mla_kv_append: Kernel<MlaKvAppendArgs>,
    pub(in crate::backend::cuda) linear2: GridStride<Linear2Args>,
    pub(in crate::backend::cuda) layer_norm: Kernel<LayerNormArgs>,
    pub(in crate::backend::cuda) copy_cols: Kernel<CopyColsArgs>,
    pub(in crate::backend::cuda) copy_rows_at: Kernel<CopyRowsAtArgs>,
    pub(in crate::backend::cuda) clamp: Kernel<ClampArgs>,
    pub(in crate::backend::cuda) add: Kernel<AddArgs>,
    pub(in crate::backend::cuda) add_sigmoid_gated: Kernel<AddSigmoidGatedArgs>,
    pub(in crate::backend::cuda) rope: Kernel<RopeArgs>,
    pub(in crate::backend::cuda) mla_expand_kv: Kernel<MlaExpandKvArgs>,
    pub(in crate::backend::cuda) argmax: Kernel<ArgmaxArgs>,
    pub(in crate::backend::cuda) moe_combine: Kernel<MoeCombineArgs>,
    pub(in crate::backend::cuda) route_topk: Kernel<RouteTopkArgs>,
    pub(in crate::backend::cuda) route_sparse_mixer: Kernel<RouteSparseMixerArgs>,
    pub(in crate::backend::cuda) count_routes: Kernel<CountRoutesArgs>,
    pub(in crate::backend::cuda) moe_plan: Kernel<MoePlanArgs>,
    pub(in crate::backend::cuda) route_plan: Kernel<RoutePlanArgs>,
    /// route_plan with the shared experts' gate/up in its other blocks (kernels/gemv_f16.cu).
    pub(in crate::backend::cuda) route_plan_shared: GridStride<RoutePlanSharedArgs>,
    pub(in crate::backend::cuda) route_plan_shared_1: GridStride<RoutePlanSharedArgs>,
    pub(in crate::backend::cuda) linear: GridStride<LinearArgs>,
    pub(in crate::backend::cuda) gate_up_silu: GridStride<GateUpSiluArgs>,
    pub(in crate::backend::cuda) moe_gate_up: GridStride<MoeGateUpArgs>,
    pub(in crate::backend::cuda) moe_down: GridStride<MoeDownArgs>,
    /// moe_down with the shared experts' down product in a last row of blocks.
    pub(in crate::backend::cuda) moe_down_shared: GridStride<MoeDownSharedArgs>,
    /// The one-row forms (kernels/gemv_f16.cu, `*_1`): the same bits, more loads in flight.
    pub(in crate::backend::cuda) linear_1: GridStride<LinearArgs>,
    pub(in crate::backend::cuda) linear2_1: GridStride<Linear2Args>,
    pub(in crate::backend::cuda) moe_gate_up_1: GridStride<MoeGateUpArgs>,
    pub(in crate::backend::cuda) moe_down_1: GridStride<MoeDownArgs>,
    pub(in crate::backend::cuda) moe_down_shared_1: GridStride<MoeDownSharedArgs>,
    /// A one-row MoE layer's shared down, routed experts and combine in one launch.
    pub(in crate::backend::cuda) moe_experts_1: Kernel<MoeExpertsOneArgs>,
    /// Split-key attention (kernels/attention.cu): each chunk's partial softmax, then the
    /// combine of a (row, head)'s chunks.
    pub(in crate::backend::cuda) attention: Kernel<AttentionArgs>,
    pub(in crate::backend::cuda) attention_combine: Kernel<AttentionCombineArgs>,
    /// Prompt passes' dense products on tensor cores (kernels/gemm_f16.cu): the activation
    /// rounded to f16 once, then the product.
    pub(in crate::backend::cuda) to_f16_rows: Kernel<ToF16RowsArgs>,
    pub(in crate::backend::cuda) gemm: Kernel<GemmArgs>,
    /// Prompt passes' attention on tensor cores, per (qk, v) width of [`ATTENTION_PROMPT_WIDTHS`].
    pub(in crate::backend::cuda) attention_prompt: Vec<Kernel<AttentionPromptArgs>>,
    /// Prompt passes' routed FP16 experts on tensor cores.
    pub(in crate::backend::cuda) moe_gather: Kernel<MoeGatherArgs>,
    pub(in crate::backend::cuda) moe_gemm_gate_up: Kernel<MoeGemmGateUpArgs>,
    pub(in crate::backend::cuda) moe_gemm_down: Kernel<MoeGemmDownArgs>,
}

impl Kernels {
    pub(in crate::backend::cuda) fn load(dev: &CudaDevice) -> Result<Self> {
        fn ops<A: KernelArgs>(dev: &CudaDevice, f: &str) -> Result<Kernel<A>> {
            Kernel::load(dev, "ops", f)
        }
        fn routing<A: KernelArgs>(dev: &CudaDevice, f: &str) -> Result<Kernel<A>> {
            Kernel::load(dev, "routing", f)
        }
        fn gemv<A: KernelArgs>(dev: &CudaDevice, f: &str) -> Result<GridStride<A>> {
            GridStride::load(dev, Kernel::load(dev, "gemv_f16", f)?)
        }
        Ok(Kernels {
            embedding: ops(dev, "embedding")?,
            rms_norm: ops(dev, "rms_norm")?,
            add_rms_norm: ops(dev, "add_rms_norm")?,
            add_norm_linear: ops(dev, "add_norm_linear_1")?,
            mla_latent: ops(dev, "mla_latent")?,
            mla_expand_append: ops(dev, "mla_expand_append")?,
            mla_kv_append: ops(dev, "mla_kv_append_1")?,
            linear2: gemv(dev, "linear2_f16")?,
            layer_norm: ops(dev, "layer_norm")?,
            copy_cols: ops(dev, "copy_cols")?,
            copy_rows_at: ops(dev, "copy_rows_at")?,
            clamp: ops(dev, "clamp_f32")?,
            add: ops(dev, "add_f32")?,
            add_sigmoid_gated: ops(dev, "add_sigmoid_gated")?,
            rope: ops(dev, "rope")?,
            mla_expand_kv: ops(dev, "mla_expand_kv")?,
            argmax: ops(dev, "argmax_rows")?,
            moe_combine: ops(dev, "moe_combine")?,
            route_topk: routing(dev, "route_softmax_topk")?,
            route_sparse_mixer: routing(dev, "route_sparse_mixer")?,
            count_routes: routing(dev, "count_routes")?,
            moe_plan: routing(dev, "moe_plan")?,
            route_plan: routing(dev, "route_plan")?,
            route_plan_shared: gemv(dev, "route_plan_shared_f16")?,
            route_plan_shared_1: gemv(dev, "route_plan_shared_f16_1")?,
            linear: gemv(dev, "linear_f16")?,
            gate_up_silu: gemv(dev, "gate_up_silu_f16")?,
            moe_gate_up: gemv(dev, "moe_f16_gate_up")?,
            moe_down: gemv(dev, "moe_f16_down")?,
            moe_down_shared: gemv(dev, "moe_f16_down_shared")?,
            linear_1: gemv(dev, "linear_f16_1")?,
            linear2_1: gemv(dev, "linear2_f16_1")?,
            moe_gate_up_1: gemv(dev, "moe_f16_gate_up_1")?,
            moe_down_1: gemv(dev, "moe_f16_down_1")?,
            moe_down_shared_1: gemv(dev, "moe_f16_down_shared_1")?,
            moe_experts_1: Kernel::load(dev, "gemv_f16", "moe_f16_experts_1")?,
            attention: Kernel::load(dev, "attention", "attention")?,
            attention_combine: Kernel::load(dev, "attention", "attention_combine")?,
            to_f16_rows: Kernel::load(dev, "gemm_f16", "to_f16_rows")?,
            gemm: Kernel::load(dev, "gemm_f16", "gemm_f16")?,
            attention_prompt: ATTENTION_PROMPT_WIDTHS
                .iter()
                .map(|(qk, v)| {
                    Kernel::load(
                        dev,
                        "attention_prompt",
                        &format!("attention_prompt_{qk}_{v}"),
                    )
                })
                .collect::<Result<_>>()?,
            moe_gather: Kernel::load(dev, "gemm_f16", "moe_gather_f16")?,
            moe_gemm_gate_up: Kernel::load(dev, "gemm_f16", "moe_gemm_gate_up_f16")?,
            moe_gemm_down: Kernel::load(dev, "gemm_f16", "moe_gemm_down_f16")?,
        })
    }
}

/// A loaded kernel that takes the arguments `A`: the only kind of handle a launch accepts, so a
/// launch cannot pass one kernel another's arguments.
pub(in crate::backend::cuda) struct Kernel<A> {
    pub(in crate::backend::cuda) f: CudaFunction,
    args: PhantomData<fn(A)>,
}

impl<A: KernelArgs> Kernel<A> {
    /// Kernel `name` of the kernel file `module`, which must be one of those `A` is for.
    pub(in crate::backend::cuda) fn load(
        dev: &CudaDevice,
        module: &str,
        name: &str,
    ) -> Result<Self> {
        if !A::KERNELS.contains(&name) {
            return Err(Error::Backend(format!(
                "cuda: kernel {name} does not take the arguments of {:?}",
                A::KERNELS
            )));
        }
        Ok(Kernel {
            f: dev.function(module, name)?,
            args: PhantomData,
        })
    }
}

/// A kernel whose blocks take its work blocks in a grid-stride loop (kernels/gemv_f16.cu): a
/// launch needs no more blocks than fit on the device at once.
pub(in crate::backend::cuda) struct GridStride<A> {
    pub(in crate::backend::cuda) f: Kernel<A>,
    /// Blocks of `32 * GEMV_WARPS` threads resident at once: occupancy times multiprocessors.
    resident: u32,
}

impl<A> GridStride<A> {
    fn load(dev: &CudaDevice, f: Kernel<A>) -> Result<Self> {
        let per_sm =
            f.f.occupancy_max_active_blocks_per_multiprocessor(32 * GEMV_WARPS as u32, 0, None)
                .map_err(|e| Error::Backend(format!("cuda: occupancy query failed: {e}")))?;
        let sms =
            dev.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let resident = (per_sm.max(1)).saturating_mul(sms.max(1) as u32);
        Ok(GridStride { f, resident })
    }

    /// The grid for `blocks` work blocks of one row each (`one_row`: decode) or of several:
    /// one row, a block per work block (the one-row forms are bound by their loads' latency,
    /// which more blocks in flight hide); several, as many blocks as fit at once (each block's
    /// next weights are asked of L2 while it computes).
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
    pub(in crate::backend::cuda) start: Kernel<LinkPaceStartArgs>,
    pub(in crate::backend::cuda) wait: Kernel<LinkPaceWaitArgs>,
}

impl PaceKernels {
    pub(in crate::backend::cuda) fn load(dev: &CudaDevice) -> Result<Self> {
        Ok(PaceKernels {
            start: Kernel::load(dev, "util", "link_pace_start")?,
            wait: Kernel::load(dev, "util", "link_pace_wait")?,
        })
    }
}

/// The device address of a buffer.
pub(in crate::backend::cuda) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// The device address of a buffer, as a kernel argument.
pub(in crate::backend::cuda) fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> DevPtr {
    DevPtr(ptr(s, stream))
}

/// The MLA caches' arguments: `mla`'s heads, `rope` rotated key dimensions, and the buffers.
pub(in crate::backend::cuda) fn mla_caches(
    mla: MlaShape,
    rope: usize,
    keys: &GpuAct,
    values: &GpuAct,
    s: &CudaStream,
) -> Result<MlaCaches> {
    Ok(MlaCaches {
        heads: int(mla.heads, "heads")?,
        nope: int(mla.nope, "nope")?,
        rope: int(rope, "rope")?,
        v_dim: int(mla.v_dim, "v_dim")?,
        keys: dptr(&keys.buf, s),
        values: dptr(&values.buf, s),
    })
}

/// A size or index as a kernel's 32-bit `int`, or an error naming it when it does not fit.
pub(in crate::backend::cuda) fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::Backend(format!(
            "cuda: {what} = {v} exceeds the kernels' 32-bit index"
        ))
    })
}

pub(in crate::backend::cuda) fn shape_err(op: &str, detail: String) -> Error {
    Error::Backend(format!("cuda {op}: {detail}"))
}

pub(in crate::backend::cuda) fn grid_for(n: usize, block: u32) -> u32 {
    n.div_ceil(block as usize).clamp(1, 65_535 * 16) as u32
}
