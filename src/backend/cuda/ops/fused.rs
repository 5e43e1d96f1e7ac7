//! Fused forms of op sequences the forward pass runs back to back (see the [`Backend`] defaults
//! they replace): the residual add with the next RMSNorm, and for one row with the products that
//! read the norm, MLA's two projections of one input, its
//! latent step (split, norm, rope), its cache append (expand, two row writes, query rope), and
//! for one row both with kv_b's product between them.
//! Each kernel does the same per-element arithmetic as the ops it replaces, so the bits are the
//! same; what it saves is launches and the round trips of intermediates through memory.
//!
//! [`Backend`]: crate::backend::Backend

use cudarc::driver::CudaSlice;
use half::f16;

use crate::arch::RopeStyle;
use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::runtime::act::{GpuAct, GpuWeight};
use crate::backend::cuda::runtime::kernels::*;
use crate::backend::{
    add_rms_norm_linear_ops, check, mla_kv_append_ops, MlaAppend, MlaShape, NormedProducts,
    RopeSpec,
};
use crate::Result;

impl CudaBackend {
    /// The rotation tables of `positions`: the step buffer's in a recorded pass, else the table
    /// rebuilt for these positions.
    pub(in crate::backend::cuda) fn rope_tables(
        &self,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<(u64, u64)> {
        let s = &self.stream;
        match self.step_args()? {
            Some(a) if self.step_rope_matches(inv_freq, positions, scales)? => Ok((a.cos, a.sin)),
            _ => {
                let table = self.rope_table(inv_freq, positions, scales)?;
                let t = table
                    .as_ref()
                    .ok_or_else(|| shape_err("rope", "no table".into()))?;
                Ok((ptr(&t.cos, s), ptr(&t.sin, s)))
            }
        }
    }

    /// Where `mla_expand_append` writes new rows at `start`: in a recorded pass, the position
    /// the step buffer holds at replay (a device pointer); else 0, and the kernel takes `start`.
    fn append_position(&self, start: usize, rows: usize) -> Result<u64> {
        Ok(self
            .step_args()?
            .filter(|a| a.start == start && a.rows == rows)
            .map_or(0, |a| a.positions))
    }

    pub(in crate::backend::cuda) fn add_rms_norm_op(
        &self,
        x: &mut GpuAct,
        y: &GpuAct,
        weight: &GpuWeight,
        eps: f32,
    ) -> Result<GpuAct> {
        check::same(x.shape(), y.shape()).map_err(|d| shape_err("add_rms_norm", d))?;
        let w = self.f16_vector(weight, x.cols, "add_rms_norm")?;
        let out = self.alloc(x.rows, x.cols)?;
        if x.rows > 0 && x.cols > 0 {
            let s = &self.stream;
            self.launch(
                &self.k.add_rms_norm,
                "add_rms_norm",
                (rows_grid(x.rows, "add_rms_norm")?, 1, 1),
                ROW_THREADS,
                AddRmsNormArgs {
                    x: dptr(&x.buf, s),
                    a: dptr(&y.buf, s),
                    w: dptr(w, s),
                    eps,
                    cols: int(x.cols, "cols")?,
                    y: dptr(&out.buf, s),
                },
            )?;
        }
        Ok(out)
    }

    pub(in crate::backend::cuda) fn linear_pair_op(
        &self,
        x: &GpuAct,
        a: &GpuWeight,
        b: &GpuWeight,
    ) -> Result<(GpuAct, GpuAct)> {
        let (wa, na, ka) = self.f16_matrix(a, "linear_pair")?;
        let (wb, nb, kb) = self.f16_matrix(b, "linear_pair")?;
        if ka != x.cols || kb != x.cols {
            return Err(shape_err(
                "linear_pair",
                format!(
                    "{} and {} do not both take an input of {} columns",
                    a.describe(),
                    b.describe(),
                    x.cols
                ),
            ));
        }
        if self.tensor_core_product(x.rows, x.cols) {
            return self.linear_pair_tensor_cores(x, (wa, na), (wb, nb));
        }
        let (ya, yb) = (self.alloc(x.rows, na)?, self.alloc(x.rows, nb)?);
        if x.rows > 0 {
            let s = &self.stream;
            let per_block = (GEMV_WARPS * GEMV_FEATURES) as u32;
            let blocks_a = grid_for(na, per_block);
            let f = if x.rows == 1 {
                &self.k.linear2_1
            } else {
                &self.k.linear2
            };
            self.launch(
                &f.f,
                "linear_pair",
                (
                    f.grid(
                        (blocks_a + grid_for(nb, per_block)) * gemv_row_groups(x.rows),
                        x.rows == 1,
                    ),
                    1,
                    1,
                ),
                32 * GEMV_WARPS as u32,
                Linear2Args {
                    a: LinearArgs {
                        x: dptr(&x.buf, s),
                        rows: int(x.rows, "rows")?,
                        k: int(x.cols, "in")?,
                        w: dptr(wa, s),
                        n: int(na, "out")?,
                        bias: DevPtr(0),
                        y: dptr(&ya.buf, s),
                    },
                    wb: dptr(wb, s),
                    nb: int(nb, "out")?,
                    bb: DevPtr(0),
                    yb: dptr(&yb.buf, s),
                    blocks_a: int(blocks_a as usize, "blocks")?,
                },
            )?;
        }
        Ok((ya, yb))
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend::cuda) fn mla_latent_op(
        &self,
        compressed: &GpuAct,
        norm: &GpuWeight,
        eps: f32,
        rank: usize,
        rope: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<(GpuAct, GpuAct)> {
        let rot = rope.rot_dim;
        check_latent(compressed, rank, &rope, inv_freq, positions, scales)?;
        let w = self.f16_vector(norm, rank, "mla_latent")?;
        let latent = self.alloc(compressed.rows, rank)?;
        let pe = self.alloc(compressed.rows, rot)?;
        if compressed.rows > 0 {
            let (cos, sin) = self.rope_tables(inv_freq, positions, scales)?;
            let s = &self.stream;
            self.launch(
                &self.k.mla_latent,
                "mla_latent",
                (rows_grid(compressed.rows, "mla_latent")?, 1, 1),
                ROW_THREADS,
                MlaLatentArgs {
                    c: dptr(&compressed.buf, s),
                    cols: int(compressed.cols, "cols")?,
                    rank: int(rank, "rank")?,
                    w: dptr(w, s),
                    eps,
                    cos_t: DevPtr(cos),
                    sin_t: DevPtr(sin),
                    rope: int(rot, "rope")?,
                    interleaved: i32::from(rope.style == RopeStyle::Interleaved),
                    latent: dptr(&latent.buf, s),
                    pe: dptr(&pe.buf, s),
                },
            )?;
        }
        Ok((latent, pe))
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend::cuda) fn mla_expand_append_op(
        &self,
        kv: &GpuAct,
        k_pe: &GpuAct,
        mla: MlaShape,
        keys: &mut GpuAct,
        values: &mut GpuAct,
        start: usize,
        q: &mut GpuAct,
        q_rope: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        let heads = mla.heads;
        let rope = k_pe.cols;
        let new = ExpandShape {
            kv: kv.shape(),
            k_pe: k_pe.shape(),
            mla,
            start,
        };
        check_expand(&new, keys, values, q, &q_rope, inv_freq, positions, scales)?;
        if kv.rows == 0 {
            return Ok(());
        }
        let start_at = self.append_position(start, kv.rows)?;
        let (cos, sin) = self.rope_tables(inv_freq, positions, scales)?;
        let s = &self.stream;
        let h = u32::try_from(heads)
            .map_err(|_| shape_err("mla_expand_append", "too many heads".into()))?;
        let rotation = (cos, sin, q_rope.style);
        let t = self.append_args(mla, rope, keys, values, (start, start_at), q, rotation)?;
        let args = MlaExpandAppendArgs {
            kv: dptr(&kv.buf, s),
            k_pe: dptr(&k_pe.buf, s),
            tail: t,
        };
        self.launch(
            &self.k.mla_expand_append,
            "mla_expand_append",
            (rows_grid(kv.rows, "mla_expand_append")?, h, 1),
            MLA_THREADS,
            args,
        )
    }

    /// The arguments `mla_expand_append` and `mla_kv_append_1` end with.
    #[allow(clippy::too_many_arguments)]
    fn append_args(
        &self,
        mla: MlaShape,
        rope: usize,
        keys: &GpuAct,
        values: &GpuAct,
        (start, start_at): (usize, u64),
        q: &GpuAct,
        (cos, sin, style): (u64, u64, RopeStyle),
    ) -> Result<MlaAppendTail> {
        let s = &self.stream;
        Ok(MlaAppendTail {
            caches: mla_caches(mla, rope, keys, values, s)?,
            start: int(start, "start")?,
            start_at: DevPtr(start_at),
            q: dptr(&q.buf, s),
            cos_t: DevPtr(cos),
            sin_t: DevPtr(sin),
            interleaved: i32::from(style == RopeStyle::Interleaved),
        })
    }
}

impl CudaBackend {
    /// `add_rms_norm_linear` in one launch (`add_norm_linear_1`, kernels/ops.cu) where it
    /// applies: one row of a width the kernel takes, FP16 norm and products over that width,
    /// aligned rows. Else the ops. The sum goes to a new buffer that then replaces `x`: the
    /// kernel's blocks all read the old one.
    pub(in crate::backend::cuda) fn add_rms_norm_linear_op(
        &self,
        (x, y): (&mut GpuAct, &GpuAct),
        (norm, eps): (&GpuWeight, f32),
        (a, b): (&GpuWeight, Option<&GpuWeight>),
    ) -> Result<NormedProducts<GpuAct>> {
        let cols = x.cols;
        let s = &self.stream;
        let (wa, wb) = (
            self.product_over(a, cols),
            b.map(|b| self.product_over(b, cols)),
        );
        let w_norm = self.f16_vector(norm, cols, "add_rms_norm_linear").ok();
        let takes = self.fused
            && x.rows == 1
            && (y.rows, y.cols) == (1, cols)
            && cols.is_multiple_of(8)
            && (ADD_NORM_MIN_COLS..=ADD_NORM_MAX_COLS).contains(&cols)
            && ptr(&x.buf, s).is_multiple_of(16)
            && ptr(&y.buf, s).is_multiple_of(16)
            && w_norm.is_some_and(|w| ptr(w, s).is_multiple_of(8));
        let (Some((wa, na)), Some(w_norm), true) = (wa, w_norm, takes) else {
            return add_rms_norm_linear_ops(self, x, y, norm, eps, a, b);
        };
        let wb = match wb {
            None => None,
            Some(Some(w)) => Some(w),
            Some(None) => return add_rms_norm_linear_ops(self, x, y, norm, eps, a, b),
        };
        let per_block = (GEMV_WARPS * GEMV_FEATURES) as u32;
        let blocks_a = grid_for(na, per_block);
        let blocks_b = wb.map_or(0, |(_, nb)| grid_for(nb, per_block));
        let sum = self.alloc(1, cols)?;
        let h = self.alloc(1, cols)?;
        let ya = self.alloc(1, na)?;
        let yb = match wb {
            Some((_, nb)) => Some(self.alloc(1, nb)?),
            None => None,
        };
        self.launch(
            &self.k.add_norm_linear,
            "add_rms_norm_linear",
            (blocks_a + blocks_b, 1, 1),
            32 * GEMV_WARPS as u32,
            AddNormLinearArgs {
                x: dptr(&x.buf, s),
                a: dptr(&y.buf, s),
                w_norm: dptr(w_norm, s),
                eps,
                cols: int(cols, "cols")?,
                x_out: dptr(&sum.buf, s),
                h_out: dptr(&h.buf, s),
                wa: dptr(wa, s),
                na: int(na, "out")?,
                ya: dptr(&ya.buf, s),
                wb: DevPtr(wb.map_or(0, |(w, _)| ptr(w, s))),
                nb: int(wb.map_or(0, |(_, n)| n), "out")?,
                yb: DevPtr(yb.as_ref().map_or(0, |y| ptr(&y.buf, s))),
                blocks_a: int(blocks_a as usize, "blocks")?,
            },
        )?;
        *x = sum;
        Ok(NormedProducts { h, a: ya, b: yb })
    }

    /// `w` as an FP16 matrix of `cols` columns: its buffer and rows.
    fn product_over<'w>(
        &self,
        w: &'w GpuWeight,
        cols: usize,
    ) -> Option<(&'w CudaSlice<f16>, usize)> {
        match self.f16_matrix(w, "add_rms_norm_linear") {
            Ok((buf, n, k)) if k == cols => Some((buf, n)),
            _ => None,
        }
    }

    /// `mla_kv_append` in one launch (`mla_kv_append_1`, kernels/ops.cu) where it applies: one
    /// row, FP16 `kv_b` and norm, a rank the kernel takes, one rotation style. Else the three
    /// ops.
    pub(in crate::backend::cuda) fn mla_kv_append_op(
        &self,
        compressed: &GpuAct,
        step: &MlaAppend<'_, GpuWeight>,
        keys: &mut GpuAct,
        values: &mut GpuAct,
        q: &mut GpuAct,
    ) -> Result<()> {
        let MlaShape { heads, nope, v_dim } = step.shape;
        let (rank, n) = (step.rank, heads * (nope + v_dim));
        let s = &self.stream;
        let w_kv = self
            .f16_matrix(step.kv_b, "mla_kv_append")
            .ok()
            .filter(|&(_, rows, cols)| rows == n && cols == rank);
        let w_norm = self.f16_vector(step.norm, rank, "mla_kv_append").ok();
        let takes = self.fused
            && compressed.rows == 1
            && rank.is_multiple_of(8)
            && (MLA_APPEND_MIN_RANK..=MLA_APPEND_MAX_RANK).contains(&rank)
            && step.k_rope.style == step.q_rope.style
            && ptr(&compressed.buf, s).is_multiple_of(16)
            && w_norm.is_some_and(|w| ptr(w, s).is_multiple_of(8));
        let (Some((w_kv, _, _)), Some(w_norm), true) = (w_kv, w_norm, takes) else {
            return mla_kv_append_ops(self, compressed, step, keys, values, q);
        };
        let (inv_freq, positions, scales) = (step.inv_freq, step.positions, step.scales);
        check_latent(compressed, rank, &step.k_rope, inv_freq, positions, scales)?;
        let rot = step.k_rope.rot_dim;
        let new = ExpandShape {
            kv: (1, n),
            k_pe: (1, rot),
            mla: step.shape,
            start: step.start,
        };
        check_expand(
            &new,
            keys,
            values,
            q,
            &step.q_rope,
            inv_freq,
            positions,
            scales,
        )?;
        let start_at = self.append_position(step.start, 1)?;
        let (cos, sin) = self.rope_tables(inv_freq, positions, scales)?;
        let blocks = 1 + grid_for(n, (GEMV_WARPS * GEMV_FEATURES) as u32);
        let rotation = (cos, sin, step.q_rope.style);
        let at = (step.start, start_at);
        let t = self.append_args(step.shape, rot, keys, values, at, q, rotation)?;
        let args = MlaKvAppendArgs {
            c: dptr(&compressed.buf, s),
            rank: int(rank, "rank")?,
            w_norm: dptr(w_norm, s),
            eps: step.eps,
            w_kv: dptr(w_kv, s),
            tail: t,
        };
        self.launch(
            &self.k.mla_kv_append,
            "mla_kv_append",
            (blocks, 1, 1),
            32 * GEMV_WARPS as u32,
            args,
        )
    }
}

/// The shapes of the rows `mla_expand_append` writes: `kv` and `k_pe` of the new rows, and the
/// cache row they go to.
struct ExpandShape {
    kv: (usize, usize),
    k_pe: (usize, usize),
    mla: MlaShape,
    start: usize,
}

/// `mla_latent`'s checks: `compressed` splits into a latent of `rank` and one rotated head.
fn check_latent(
    compressed: &GpuAct,
    rank: usize,
    rope: &RopeSpec,
    inv_freq: &[f32],
    positions: &[usize],
    scales: &[f32],
) -> Result<()> {
    let rot = rope.rot_dim;
    if rope.heads != 1
        || rope.offset != 0
        || rope.head_stride != rot
        || rank + rot != compressed.cols
    {
        return Err(shape_err(
            "mla_latent",
            format!(
                "a [{}, {}] input does not split into a latent of {rank} and one rotated head of {rot}",
                compressed.rows, compressed.cols
            ),
        ));
    }
    check::rope(
        rope,
        (compressed.rows, rot),
        inv_freq.len(),
        positions.len(),
        scales.len(),
    )
    .map_err(|d| shape_err("mla_latent", d))
}

/// `mla_expand_append`'s checks: the new rows fit the caches at `start`, and the query rotates
/// as the keys do.
#[allow(clippy::too_many_arguments)]
fn check_expand(
    new: &ExpandShape,
    keys: &GpuAct,
    values: &GpuAct,
    q: &GpuAct,
    q_rope: &RopeSpec,
    inv_freq: &[f32],
    positions: &[usize],
    scales: &[f32],
) -> Result<()> {
    let MlaShape { heads, nope, v_dim } = new.mla;
    let (rows, rope) = (new.kv.0, new.k_pe.1);
    check::mla_expand(new.kv, new.k_pe, heads, nope, v_dim)
        .map_err(|d| shape_err("mla_expand_append", d))?;
    check::write_rows(keys.shape(), new.start, (rows, heads * (nope + rope)))
        .map_err(|d| shape_err("mla_expand_append keys", d))?;
    check::write_rows(values.shape(), new.start, (rows, heads * v_dim))
        .map_err(|d| shape_err("mla_expand_append values", d))?;
    check::rope(
        q_rope,
        q.shape(),
        inv_freq.len(),
        positions.len(),
        scales.len(),
    )
    .map_err(|d| shape_err("mla_expand_append query", d))?;
    let fits = q_rope.heads == heads
        && q_rope.head_stride == nope + rope
        && q_rope.offset == nope
        && q_rope.rot_dim == rope
        && q.rows == rows
        && q.cols == heads * (nope + rope);
    if !fits {
        return Err(shape_err(
            "mla_expand_append",
            format!(
                "the query [{}, {}] does not rotate as the keys do",
                q.rows, q.cols
            ),
        ));
    }
    Ok(())
}

fn rows_grid(rows: usize, op: &str) -> Result<u32> {
    u32::try_from(rows).map_err(|_| shape_err(op, "too many rows".into()))
}
