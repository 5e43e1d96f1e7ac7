//! A prompt pass's dense products on tensor cores (kernels/gemm_f16.cu): the activation rounded
//! to f16 once, then `mma.sync` tiles accumulated in f32. Only while
//! [`Backend::prompt_pass`](crate::backend::Backend::prompt_pass) is on, for products of at least
//! [`GEMM_MIN_ROWS`] rows: a decoding step, a verification window and a short prompt keep the
//! gemv kernels, whose bits do not depend on the row count. Built with the `prompt-tensor-cores`
//! feature alone until its GPU checks have passed.

use std::sync::atomic::Ordering;

use cudarc::driver::CudaSlice;
use half::f16;

use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::moe::experts::{ExpertGroup, MoeLaunch, SharedDown};
use crate::backend::cuda::runtime::act::{GpuAct, GpuWeight};
use crate::backend::cuda::runtime::kernels::*;
use crate::{Error, Result};

/// Fewest rows a prompt pass's product takes to tensor cores: below it the tile's unused rows
/// cost more than the gemv kernels' repeated weight reads.
pub const GEMM_MIN_ROWS: usize = 32;

impl CudaBackend {
    /// Whether a product of `rows` rows over `k` inputs runs on tensor cores: a prompt pass, at
    /// least [`GEMM_MIN_ROWS`] rows, `k` a multiple of the kernel's step. `mma.sync` of f16
    /// operands and `cp.async` need sm_80, which every device the kernels build for has.
    pub(in crate::backend::cuda) fn tensor_core_product(&self, rows: usize, k: usize) -> bool {
        cfg!(feature = "prompt-tensor-cores")
            && self.prompt_pass.load(Ordering::Relaxed)
            && rows >= GEMM_MIN_ROWS
            && k > 0
            && k.is_multiple_of(GEMM_BK)
    }

    /// The tensor-core attention kernel for a prompt pass of `rows` query rows at these widths
    /// per head, where one is built for them; `None` runs attention.cu's kernel. A recorded pass
    /// never comes here (prompt passes are not recorded), so its start is the host's.
    pub(in crate::backend::cuda) fn prompt_attention(
        &self,
        rows: usize,
        qk_dim: usize,
        v_dim: usize,
    ) -> Option<&Kernel<AttentionPromptArgs>> {
        if !self.tensor_core_product(rows, GEMM_BK) {
            return None;
        }
        let i = ATTENTION_PROMPT_WIDTHS
            .iter()
            .position(|&w| w == (qk_dim, v_dim))?;
        self.k.attention_prompt.get(i)
    }

    /// Whether a grouped launch of FP16 experts runs on tensor cores: a prompt pass whose items
    /// (rows times top-k, the same in every placement) reach [`GEMM_MIN_ROWS`], both widths
    /// multiples of the kernel's step.
    pub(in crate::backend::cuda) fn experts_on_tensor_cores(&self, l: &MoeLaunch) -> bool {
        self.tensor_core_product(l.items, l.hidden) && l.inter.is_multiple_of(GEMM_BK)
    }

    /// `n` f32 values at `x` rounded to f16, in a buffer of at least `n` halves (an f32
    /// activation's storage of half as many values, from the same pool).
    fn to_f16(&self, x: u64, rows: usize, cols: usize) -> Result<GpuAct> {
        let halves = rows * cols;
        let a = self.alloc(rows, cols.div_ceil(2))?;
        self.launch(
            &self.k.to_f16_rows,
            "to f16",
            (spread_blocks(halves), 1, 1),
            SPREAD_THREADS,
            ToF16RowsArgs {
                x: DevPtr(x),
                a: dptr(&a.buf, &self.stream),
                n: halves as u64,
            },
        )?;
        Ok(a)
    }

    /// `y = a @ w^T (+ bias)` on tensor cores, all device addresses: `a` f16 `[m, k]`, `w` f16
    /// `[n, k]`, `bias` `n` halves or 0, `y` f32 `[m, n]`.
    fn gemm(
        &self,
        a: u64,
        w: u64,
        bias: u64,
        y: u64,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        let grid = (tiles(n, GEMM_BN)?, tiles(m, GEMM_BM)?, 1);
        self.launch(
            &self.k.gemm,
            "gemm",
            grid,
            GEMM_THREADS,
            GemmArgs {
                a: DevPtr(a),
                w: DevPtr(w),
                bias: DevPtr(bias),
                y: DevPtr(y),
                m: int(m, "rows")?,
                n: int(n, "out")?,
                k: int(k, "in")?,
            },
        )
    }

    /// `x @ w^T (+ bias)` on tensor cores: `w` is `[n, x.cols]`, `bias` a device address of `n`
    /// halves or 0. The caller has checked the shapes and [`Self::tensor_core_product`].
    pub(in crate::backend::cuda) fn linear_tensor_cores(
        &self,
        x: &GpuAct,
        w: &CudaSlice<f16>,
        n: usize,
        bias: u64,
    ) -> Result<GpuAct> {
        let s = &self.stream;
        let a = self.to_f16(ptr(&x.buf, s), x.rows, x.cols)?;
        let y = self.alloc(x.rows, n)?;
        self.gemm(
            ptr(&a.buf, s),
            ptr(w, s),
            bias,
            ptr(&y.buf, s),
            (x.rows, n, x.cols),
        )?;
        Ok(y)
    }

    /// A gated MLP on tensor cores: `gate_up` (the device address of its `[2 inter, x.cols]`
    /// f16 weight) as the routed experts' gate/up kernel takes one group of every row, then
    /// `down` over the f16 activations.
    pub(in crate::backend::cuda) fn gated_mlp_tensor_cores(
        &self,
        x: &GpuAct,
        gate_up: u64,
        inter: usize,
        down: &GpuWeight,
    ) -> Result<GpuAct> {
        let (wd, out, k) = self.f16_matrix(down, "gated_mlp")?;
        if k != inter {
            return Err(shape_err(
                "gated_mlp",
                format!("{} does not take {inter} activations", down.describe()),
            ));
        }
        let s = &self.stream;
        let x16 = self.to_f16(ptr(&x.buf, s), x.rows, x.cols)?;
        let group = ExpertGroup {
            gate_up,
            down: ptr(wd, s),
            count: u32::try_from(x.rows)
                .map_err(|_| Error::Backend(format!("cuda: {} rows exceed a group", x.rows)))?,
            ..ExpertGroup::default()
        };
        let table = self.upload_groups(&[group])?;
        let h16 = self.alloc(x.rows, inter.div_ceil(2))?;
        self.launch(
            &self.k.moe_gemm_gate_up,
            "moe gemm gate/up",
            (tiles(inter, GEMM_BN / 2)?, tiles(x.rows, GEMM_BM)?, 1),
            GEMM_THREADS,
            MoeGemmGateUpArgs {
                x16: dptr(&x16.buf, s),
                hidden: int(x.cols, "in")?,
                inter: int(inter, "inter")?,
                groups: dptr(&table, s),
                h16: dptr(&h16.buf, s),
            },
        )?;
        let y = self.alloc(x.rows, out)?;
        self.gemm(
            ptr(&h16.buf, s),
            ptr(wd, s),
            0,
            ptr(&y.buf, s),
            (x.rows, out, inter),
        )?;
        // The group table must outlive the kernel that reads it.
        self.defer_free(table);
        Ok(y)
    }

    /// Two products of one input on tensor cores (`linear_pair`), the input rounded to f16 once:
    /// `x @ wa^T` (`na` features) and `x @ wb^T` (`nb`).
    pub(in crate::backend::cuda) fn linear_pair_tensor_cores(
        &self,
        x: &GpuAct,
        (wa, na): (&CudaSlice<f16>, usize),
        (wb, nb): (&CudaSlice<f16>, usize),
    ) -> Result<(GpuAct, GpuAct)> {
        let s = &self.stream;
        let a = self.to_f16(ptr(&x.buf, s), x.rows, x.cols)?;
        let product = |w: &CudaSlice<f16>, n: usize| -> Result<GpuAct> {
            let y = self.alloc(x.rows, n)?;
            let shape = (x.rows, n, x.cols);
            self.gemm(ptr(&a.buf, s), ptr(w, s), 0, ptr(&y.buf, s), shape)?;
            Ok(y)
        };
        Ok((product(wa, na)?, product(wb, nb)?))
    }

    /// [`Self::launch_moe_f16`] on tensor cores: each item's input row gathered as f16, the
    /// gate/up product and activation into `l.h` (as f16: half its bytes), the down product into
    /// `l.out`. With `shared`, the shared experts' down product too: on tensor cores where its
    /// width allows, else by the gemv down kernel with no routed group.
    pub(in crate::backend::cuda) fn launch_moe_f16_tensor_cores(
        &self,
        l: &MoeLaunch,
        shared: Option<&SharedDown>,
    ) -> Result<()> {
        let s = &self.stream;
        let x16 = self.alloc(l.items, l.hidden.div_ceil(2))?;
        let (hidden, inter) = (int(l.hidden, "hidden")?, int(l.inter, "inter")?);
        self.launch(
            &self.k.moe_gather,
            "moe gather",
            (spread_blocks(l.items * l.hidden), 1, 1),
            SPREAD_THREADS,
            MoeGatherArgs {
                x: DevPtr(l.x),
                item_row: DevPtr(l.item_row),
                items: int(l.items, "items")?,
                hidden,
                x16: dptr(&x16.buf, s),
            },
        )?;
        // A block per (column tile, row tile of the largest group, group).
        let row_tiles = tiles(l.max_count, GEMM_BM)?;
        let groups = u32::try_from(l.num_groups).unwrap_or(u32::MAX);
        self.launch(
            &self.k.moe_gemm_gate_up,
            "moe gemm gate/up",
            (tiles(l.inter, GEMM_BN / 2)?, row_tiles, groups),
            GEMM_THREADS,
            MoeGemmGateUpArgs {
                x16: dptr(&x16.buf, s),
                hidden,
                inter,
                groups: DevPtr(l.groups),
                h16: DevPtr(l.h),
            },
        )?;
        self.launch(
            &self.k.moe_gemm_down,
            "moe gemm down",
            (tiles(l.hidden, GEMM_BN)?, row_tiles, groups),
            GEMM_THREADS,
            MoeGemmDownArgs {
                h16: DevPtr(l.h),
                hidden,
                inter,
                groups: DevPtr(l.groups),
                item_weight: DevPtr(l.item_weight),
                out: DevPtr(l.out),
            },
        )?;
        let Some(sd) = shared else {
            return Ok(());
        };
        if self.tensor_core_product(sd.rows, sd.inter) {
            let h16 = self.to_f16(sd.h, sd.rows, sd.inter)?;
            self.gemm(
                ptr(&h16.buf, s),
                sd.down,
                0,
                sd.y,
                (sd.rows, l.hidden, sd.inter),
            )
        } else {
            self.launch_moe_f16_down(
                &MoeLaunch {
                    num_groups: 0,
                    ..*l
                },
                Some(sd),
            )
        }
    }
}

/// Threads of a block of the element-wise conversions, and their grid: one thread an element up
/// to [`SPREAD_MAX_BLOCKS`] blocks, which then loop over the rest.
const SPREAD_THREADS: u32 = 256;
const SPREAD_MAX_BLOCKS: u32 = 4096;

fn spread_blocks(n: usize) -> u32 {
    grid_for(n, SPREAD_THREADS).min(SPREAD_MAX_BLOCKS)
}

/// Tiles of `size` covering `n` (at least one), as a grid extent.
fn tiles(n: usize, size: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(size).max(1))
        .map_err(|_| Error::Backend(format!("cuda: {n} rows or columns exceed a grid's extent")))
}
