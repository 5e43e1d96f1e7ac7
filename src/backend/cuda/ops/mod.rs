//! [`Backend`] for [`CudaBackend`]: weights, elementwise ops, norms and products here;
//! attention (src/backend/cuda/ops/attention.rs) and routed experts (src/backend/cuda/moe/mod.rs) in
//! their own files.

pub(in crate::backend::cuda) mod attention;
pub(in crate::backend::cuda) mod fused;
pub(in crate::backend::cuda) mod gemm;
pub(in crate::backend::cuda) mod rope;

use cudarc::driver::CudaSlice;
use half::f16;

use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::runtime::act::{GpuAct, GpuWeight};
use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::runtime::kernels::*;
use crate::backend::cuda::runtime::load::{LoadIo, PendingLoad};
use crate::backend::{
    check, AttentionSpec, Backend, GatedMlp, MlaAppend, MlaShape, NormedProducts, RopeSpec,
    RouteSpec, Routing,
};
use crate::backend::{SegmentEnd, SegmentStart, StepEnd, StepRequest, StepStart};
use crate::{Error, Result};

impl Backend for CudaBackend {
    type Act = GpuAct;
    type Weight = GpuWeight;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn weight_f16(&self, name: &str, shape: &[usize], data: &[f16]) -> Result<GpuWeight> {
        check::weight(name, shape, data.len(), false).map_err(|d| shape_err("weight", d))?;
        let n: usize = shape.iter().product();
        let buf = match self.deferred_alloc(name, &[data])? {
            Some(buf) => buf,
            None => guarded(
                &format!("cuda: cannot upload {name} ({} bytes; out of VRAM?)", 2 * n),
                || self.stream.clone_htod(data),
            )?,
        };
        Ok(GpuWeight::F16 {
            name: name.to_string(),
            shape: shape.to_vec(),
            buf,
        })
    }

    fn weight_f16_parts(&self, name: &str, shape: &[usize], parts: &[&[f16]]) -> Result<GpuWeight> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        check::weight(name, shape, total, false).map_err(|d| shape_err("weight", d))?;
        match self.deferred_alloc(name, parts)? {
            Some(buf) => Ok(GpuWeight::F16 {
                name: name.to_string(),
                shape: shape.to_vec(),
                buf,
            }),
            None => self.weight_f16(name, shape, &parts.concat()),
        }
    }

    fn begin_load(&self, backing: Option<crate::weights::Backing<'_>>) -> Result<()> {
        let pending = match (self.load_io, backing) {
            (LoadIo::PerTensor, _) | (_, None) => None,
            (_, Some(b)) => match b.file {
                Some((file, path)) => Some(PendingLoad::new(b.bytes, file, path)?),
                None => None,
            },
        };
        *self.lock(&self.pending)? = pending;
        Ok(())
    }

    fn finish_load(&self) -> Result<()> {
        let Some(pending) = self.lock(&self.pending)?.take() else {
            return Ok(());
        };
        if pending.is_empty() {
            return Ok(());
        }
        // The weights' allocations were queued on the compute stream; the copies run on other
        // streams.
        guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        let report = crate::backend::cuda::runtime::load::upload(
            self.dev.context(),
            pending,
            self.load_io,
            self.load_threads,
        )?;
        tracing::info!(
            "uploaded {:.2} GB of weights in {:.3} s ({} I/O, {} threads)",
            report.bytes as f64 / 1e9,
            report.seconds,
            report.io,
            report.threads
        );
        *self.lock(&self.load_report)? = Some(report);
        Ok(())
    }

    fn weight_int4(
        &self,
        name: &str,
        k: usize,
        n: usize,
        qweight: &[u32],
        scales: &[f16],
    ) -> Result<GpuWeight> {
        crate::quant::check_marlin_shape(name, k, n)
            .map_err(|e| Error::Model(format!("{name}: {e}")))?;
        if qweight.len() != k * n / 8 || scales.len() != (k / 128) * n {
            return Err(shape_err(
                "weight_int4",
                format!(
                    "{name}: {} words and {} scales do not fit k {k}, n {n}",
                    qweight.len(),
                    scales.len()
                ),
            ));
        }
        let up = self.upload_quantized(name, qweight, scales)?;
        Ok(GpuWeight::Int4 {
            name: name.to_string(),
            k,
            n,
            qweight: up.0,
            scales: up.1,
        })
    }

    fn weight_rows(
        &self,
        name: &str,
        bits: crate::quant::Bits,
        k: usize,
        n: usize,
        qweight: &[u8],
        scales: &[f16],
    ) -> Result<GpuWeight> {
        if k == 0 || n == 0 || !k.is_multiple_of(128) {
            return Err(shape_err(
                "weight_rows",
                format!("{name}: a {bits}-bit [{n}, {k}] matrix has no row layout"),
            ));
        }
        let row = crate::quant::row_bytes(k, bits);
        if qweight.len() != n * row || scales.len() != n * (k / 128) {
            return Err(shape_err(
                "weight_rows",
                format!(
                    "{name}: {} code bytes and {} scales do not fit a {bits}-bit [{n}, {k}] matrix",
                    qweight.len(),
                    scales.len()
                ),
            ));
        }
        let (qweight, scales) = self.upload_quantized(name, qweight, scales)?;
        Ok(GpuWeight::Rows {
            name: name.to_string(),
            bits,
            k,
            n,
            qweight,
            scales,
        })
    }

    fn routed_expert(
        &self,
        layer: usize,
        expert: usize,
        load: &mut dyn FnMut() -> Result<GatedMlp<Self>>,
    ) -> Result<GatedMlp<Self>> {
        match &self.offload {
            Some(o) => {
                self.lock(o)?.check_expert(layer, expert)?;
                Ok(GatedMlp {
                    gate_up: GpuWeight::Offloaded { layer, expert },
                    down: GpuWeight::Offloaded { layer, expert },
                })
            }
            None => load(),
        }
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<GpuAct> {
        let buf = guarded(
            &format!("cuda: cannot allocate a [{rows}, {cols}] f32 buffer (out of VRAM?)"),
            || self.stream.alloc_zeros::<f32>((rows * cols).max(1)),
        )?;
        Ok(self.wrap(buf, rows, cols))
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<GpuAct> {
        if data.len() != rows * cols {
            return Err(shape_err(
                "upload",
                format!("{} values for [{rows}, {cols}]", data.len()),
            ));
        }
        if data.is_empty() {
            return self.alloc(rows, cols);
        }
        let mut a = self.alloc(rows, cols)?;
        let dst = ptr(&a.buf, &self.stream);
        guarded("cuda: host-to-device copy failed", || {
            // SAFETY: `dst` addresses at least `data.len()` f32 (the bucket is never smaller);
            // pageable source memory is staged by the driver before this call returns.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
        })?;
        a.rows = rows;
        Ok(a)
    }

    fn to_host(&self, x: &GpuAct) -> Result<Vec<f32>> {
        Ok(self.read_back(&[x])?.pop().unwrap_or_default())
    }

    fn shape(&self, x: &GpuAct) -> (usize, usize) {
        x.shape()
    }

    fn embedding(&self, table: &GpuWeight, ids: &[u32]) -> Result<GpuAct> {
        let (buf, vocab, hidden) = self.f16_matrix(table, "embedding")?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(shape_err(
                "embedding",
                format!("token id {bad} >= {vocab} rows of {}", table.describe()),
            ));
        }
        let y = self.alloc(ids.len(), hidden)?;
        if ids.is_empty() {
            return Ok(y);
        }
        // In a recorded pass the ids come from the step buffer, rewritten at every replay.
        let step_ids = match self.step_args()? {
            Some(a) if self.step_tokens_match(ids)? => Some(a.ids),
            _ => None,
        };
        let d_ids = match step_ids {
            Some(_) => None,
            None => Some(self.upload_u32(ids)?),
        };
        let s = &self.stream;
        self.launch(
            &self.k.embedding,
            "embedding",
            (ids.len() as u32, 1, 1),
            ROW_THREADS,
            EmbeddingArgs {
                table: dptr(buf, s),
                ids: DevPtr(match (&d_ids, step_ids) {
                    (Some(d), _) => ptr(d, s),
                    (None, Some(p)) => p,
                    (None, None) => unreachable!("ids are uploaded when not in the step buffer"),
                }),
                hidden: int(hidden, "hidden")?,
                y: dptr(&y.buf, s),
            },
        )?;
        Ok(y)
    }

    fn rms_norm(&self, x: &GpuAct, weight: &GpuWeight, eps: f32, group: usize) -> Result<GpuAct> {
        if group == 0 || !x.cols.is_multiple_of(group) {
            return Err(shape_err(
                "rms_norm",
                format!("group {group} does not divide width {}", x.cols),
            ));
        }
        let w = self.f16_vector(weight, group, "rms_norm")?;
        let y = self.alloc(x.rows, x.cols)?;
        let blocks = x.rows * (x.cols / group);
        if blocks > 0 {
            let s = &self.stream;
            self.launch(
                &self.k.rms_norm,
                "rms_norm",
                (
                    u32::try_from(blocks)
                        .map_err(|_| shape_err("rms_norm", "too many rows".into()))?,
                    1,
                    1,
                ),
                ROW_THREADS,
                RmsNormArgs {
                    x: dptr(&x.buf, s),
                    w: dptr(w, s),
                    eps,
                    group: int(group, "group")?,
                    y: dptr(&y.buf, s),
                },
            )?;
        }
        Ok(y)
    }

    fn layer_norm(
        &self,
        x: &GpuAct,
        weight: &GpuWeight,
        bias: &GpuWeight,
        eps: f32,
    ) -> Result<GpuAct> {
        let w = self.f16_vector(weight, x.cols, "layer_norm")?;
        let b = self.f16_vector(bias, x.cols, "layer_norm")?;
        let y = self.alloc(x.rows, x.cols)?;
        if x.rows > 0 {
            let s = &self.stream;
            self.launch(
                &self.k.layer_norm,
                "layer_norm",
                (x.rows as u32, 1, 1),
                ROW_THREADS,
                LayerNormArgs {
                    x: dptr(&x.buf, s),
                    w: dptr(w, s),
                    b: dptr(b, s),
                    eps,
                    cols: int(x.cols, "cols")?,
                    y: dptr(&y.buf, s),
                },
            )?;
        }
        Ok(y)
    }

    fn linear(&self, x: &GpuAct, w: &GpuWeight, bias: Option<&GpuWeight>) -> Result<GpuAct> {
        let (wb, out, inp) = self.f16_matrix(w, "linear")?;
        if inp != x.cols {
            return Err(shape_err(
                "linear",
                format!(
                    "{} does not take an input of {} columns",
                    w.describe(),
                    x.cols
                ),
            ));
        }
        let bias_ptr = match bias {
            Some(b) => ptr(self.f16_vector(b, out, "linear bias")?, &self.stream),
            None => 0,
        };
        if self.tensor_core_product(x.rows, inp) {
            return self.linear_tensor_cores(x, wb, out, bias_ptr);
        }
        let y = self.alloc(x.rows, out)?;
        if x.rows > 0 {
            let s = &self.stream;
            let f = if x.rows == 1 {
                &self.k.linear_1
            } else {
                &self.k.linear
            };
            self.launch(
                &f.f,
                "linear",
                (
                    f.grid(
                        grid_for(out, (GEMV_WARPS * GEMV_FEATURES) as u32)
                            * gemv_row_groups(x.rows),
                        x.rows == 1,
                    ),
                    1,
                    1,
                ),
                32 * GEMV_WARPS as u32,
                LinearArgs {
                    x: dptr(&x.buf, s),
                    rows: int(x.rows, "rows")?,
                    k: int(inp, "in")?,
                    w: dptr(wb, s),
                    n: int(out, "out")?,
                    bias: DevPtr(bias_ptr),
                    y: dptr(&y.buf, s),
                },
            )?;
        }
        Ok(y)
    }

    fn add_rms_norm(
        &self,
        x: &mut GpuAct,
        y: &GpuAct,
        weight: &GpuWeight,
        eps: f32,
    ) -> Result<GpuAct> {
        self.add_rms_norm_op(x, y, weight, eps)
    }

    fn add_rms_norm_linear(
        &self,
        x: &mut GpuAct,
        y: &GpuAct,
        norm: &GpuWeight,
        eps: f32,
        a: &GpuWeight,
        b: Option<&GpuWeight>,
    ) -> Result<NormedProducts<GpuAct>> {
        self.add_rms_norm_linear_op((x, y), (norm, eps), (a, b))
    }

    fn linear_pair(&self, x: &GpuAct, a: &GpuWeight, b: &GpuWeight) -> Result<(GpuAct, GpuAct)> {
        self.linear_pair_op(x, a, b)
    }

    fn mla_latent(
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
        self.mla_latent_op(
            compressed, norm, eps, rank, rope, inv_freq, positions, scales,
        )
    }

    fn mla_expand_append(
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
        self.mla_expand_append_op(
            kv, k_pe, mla, keys, values, start, q, q_rope, inv_freq, positions, scales,
        )
    }

    fn mla_kv_append(
        &self,
        compressed: &GpuAct,
        step: &MlaAppend<'_, GpuWeight>,
        keys: &mut GpuAct,
        values: &mut GpuAct,
        q: &mut GpuAct,
    ) -> Result<()> {
        self.mla_kv_append_op(compressed, step, keys, values, q)
    }

    fn split_cols(&self, x: &GpuAct, widths: &[usize]) -> Result<Vec<GpuAct>> {
        check::split(widths, x.cols).map_err(|d| shape_err("split_cols", d))?;
        let outs = widths
            .iter()
            .map(|&w| self.alloc(x.rows, w))
            .collect::<Result<Vec<_>>>()?;
        // One launch per four pieces (copy_cols in kernels/ops.cu).
        let mut col0 = 0;
        for (ws, ys) in widths.chunks(4).zip(outs.chunks(4)) {
            let width: usize = ws.iter().sum();
            let total = x.rows * width;
            if total > 0 {
                let s = &self.stream;
                // Up to four outputs: (y, width) of each, a null pointer past the last.
                let mut to = [(DevPtr(0), 0i32); 4];
                for (slot, (&w, y)) in to.iter_mut().zip(ws.iter().zip(ys)) {
                    *slot = (dptr(&y.buf, s), int(w, "width")?);
                }
                let args = CopyColsArgs {
                    x: dptr(&x.buf, s),
                    x_cols: int(x.cols, "cols")?,
                    col0: int(col0, "col")?,
                    width: int(width, "width")?,
                    total: total as u64,
                    y0: to[0].0,
                    w0: to[0].1,
                    y1: to[1].0,
                    w1: to[1].1,
                    y2: to[2].0,
                    w2: to[2].1,
                    y3: to[3].0,
                    w3: to[3].1,
                };
                self.launch(
                    &self.k.copy_cols,
                    "split_cols",
                    Self::elementwise_grid(total),
                    256,
                    args,
                )?;
            }
            col0 += width;
        }
        Ok(outs)
    }

    fn clamp(&self, x: &mut GpuAct, limit: f32) -> Result<()> {
        let n = x.rows * x.cols;
        if n > 0 {
            let p = ptr(&x.buf, &self.stream);
            self.launch(
                &self.k.clamp,
                "clamp",
                Self::elementwise_grid(n),
                256,
                ClampArgs {
                    x: DevPtr(p),
                    limit,
                    n: n as u64,
                },
            )?;
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut GpuAct, y: &GpuAct) -> Result<()> {
        check::same(x.shape(), y.shape()).map_err(|d| shape_err("add", d))?;
        let n = x.rows * x.cols;
        if n > 0 {
            let s = &self.stream;
            let (px, py) = (ptr(&x.buf, s), ptr(&y.buf, s));
            self.launch(
                &self.k.add,
                "add",
                Self::elementwise_grid(n),
                256,
                AddArgs {
                    x: DevPtr(px),
                    y: DevPtr(py),
                    n: n as u64,
                },
            )?;
        }
        Ok(())
    }

    fn add_sigmoid_gated(&self, x: &mut GpuAct, y: &GpuAct, gate: &GpuAct) -> Result<()> {
        check::sigmoid_gated(x.shape(), y.shape(), gate.shape())
            .map_err(|d| shape_err("add_sigmoid_gated", d))?;
        let n = x.rows * x.cols;
        if n > 0 {
            let s = &self.stream;
            let args = AddSigmoidGatedArgs {
                x: dptr(&x.buf, s),
                y: dptr(&y.buf, s),
                gate: dptr(&gate.buf, s),
                cols: int(x.cols, "cols")?,
                n: n as u64,
            };
            self.launch(
                &self.k.add_sigmoid_gated,
                "add_sigmoid_gated",
                Self::elementwise_grid(n),
                256,
                args,
            )?;
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut GpuAct,
        spec: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        self.rope_op(x, spec, inv_freq, positions, scales)
    }

    fn write_rows(&self, dst: &mut GpuAct, row: usize, src: &GpuAct) -> Result<()> {
        check::write_rows(dst.shape(), row, src.shape()).map_err(|d| shape_err("write_rows", d))?;
        let n = src.rows * src.cols;
        if let Some(a) = self
            .step_args()?
            .filter(|a| a.start == row && a.rows == src.rows)
        {
            // A recorded pass appends at the position the step buffer holds at replay.
            if n == 0 {
                return Ok(());
            }
            let s = &self.stream;
            return self.launch(
                &self.k.copy_rows_at,
                "write_rows",
                (grid_for(src.cols, 256), src.rows as u32, 1),
                256,
                CopyRowsAtArgs {
                    src: dptr(&src.buf, s),
                    dst: dptr(&dst.buf, s),
                    cols: int(src.cols, "cols")?,
                    row_at: DevPtr(a.positions),
                },
            );
        }
        if n > 0 {
            let from = ptr(&src.buf, &self.stream);
            let to = ptr(&dst.buf, &self.stream) + (4 * row * dst.cols) as u64;
            guarded("cuda write_rows: device copy failed", || {
                // SAFETY: both ranges lie inside their buffers (checked above: `row + src.rows`
                // rows fit in `dst`), and distinct activations never share a buffer except
                // through `head_rows` views, which only read.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        to,
                        from,
                        4 * n,
                        self.stream.cu_stream(),
                    )
                }
            })?;
        }
        Ok(())
    }

    fn head_rows(&self, x: &GpuAct, rows: usize) -> Result<GpuAct> {
        if rows > x.rows {
            return Err(shape_err("head_rows", format!("{rows} of {} rows", x.rows)));
        }
        // A view: same buffer, fewer rows.
        Ok(GpuAct {
            buf: x.buf.clone(),
            rows,
            cols: x.cols,
        })
    }

    fn mla_expand_kv(
        &self,
        kv: &GpuAct,
        k_pe: &GpuAct,
        heads: usize,
        nope: usize,
        v_dim: usize,
    ) -> Result<(GpuAct, GpuAct)> {
        self.mla_expand_kv_op(kv, k_pe, heads, nope, v_dim)
    }

    fn attention(
        &self,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        kv_len: usize,
        spec: AttentionSpec,
    ) -> Result<GpuAct> {
        self.attention_op(q, k, v, kv_len, spec)
    }

    fn route(&self, logits: &GpuAct, spec: RouteSpec) -> Result<Routing> {
        self.route_op(logits, spec)
    }

    fn route_beside_shared(
        &self,
        logits: &GpuAct,
        spec: RouteSpec,
        x: &GpuAct,
        shared: Option<&GatedMlp<Self>>,
    ) -> Result<(Routing, Option<GpuAct>)> {
        // The MLP is issued after the read-back's copies: it runs while the host routes.
        let (routing, _, out) = self.route_on_host(logits, spec, None, || {
            shared.map(|mlp| self.gated_mlp(x, mlp)).transpose()
        })?;
        Ok((routing, out))
    }

    fn routed_moe(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        host_routing: bool,
        count_as: Option<usize>,
    ) -> Result<(GpuAct, Option<Routing>)> {
        self.routed_moe_op(x, logits, spec, experts, host_routing, count_as)
    }

    fn routed_moe_plus(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        plus: &GpuAct,
    ) -> Result<GpuAct> {
        self.routed_moe_plus_op(x, logits, spec, experts, count_as, plus)
    }

    fn routed_moe_shared(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        shared: &GatedMlp<Self>,
    ) -> Result<GpuAct> {
        self.routed_moe_shared_op(x, logits, spec, experts, count_as, shared)
    }

    fn gated_mlp(&self, x: &GpuAct, mlp: &GatedMlp<Self>) -> Result<GpuAct> {
        let (wb, two_inter, inp) = self.f16_matrix(&mlp.gate_up, "gated_mlp")?;
        if inp != x.cols || two_inter % 2 != 0 {
            return Err(shape_err(
                "gated_mlp",
                format!(
                    "{} is not a gate/up pair for an input of {} columns",
                    mlp.gate_up.describe(),
                    x.cols
                ),
            ));
        }
        let inter = two_inter / 2;
        if self.tensor_core_product(x.rows, inp) && inter.is_multiple_of(GEMM_BK) {
            return self.gated_mlp_tensor_cores(x, ptr(wb, &self.stream), inter, &mlp.down);
        }
        let h = self.alloc(x.rows, inter)?;
        if x.rows > 0 && inter > 0 {
            // Gate/up product and silu(gate) * up in one kernel: the same bits as `linear`
            // followed by `silu_mul`.
            let s = &self.stream;
            let args = GateUpSiluArgs {
                x: dptr(&x.buf, s),
                rows: int(x.rows, "rows")?,
                k: int(inp, "in")?,
                w: dptr(wb, s),
                inter: int(inter, "inter")?,
                h: dptr(&h.buf, s),
            };
            let f = &self.k.gate_up_silu;
            self.launch(
                &f.f,
                "gate/up silu",
                (
                    f.grid(
                        grid_for(inter, GEMV_WARPS as u32) * gemv_row_groups(x.rows),
                        x.rows == 1,
                    ),
                    1,
                    1,
                ),
                32 * GEMV_WARPS as u32,
                args,
            )?;
        }
        self.linear(&h, &mlp.down, None)
    }

    fn moe_experts(
        &self,
        x: &GpuAct,
        routing: &Routing,
        experts: &[GatedMlp<Self>],
    ) -> Result<GpuAct> {
        self.moe_experts_op(x, routing, experts)
    }

    fn argmax(&self, x: &GpuAct) -> Result<Vec<u32>> {
        if x.cols == 0 {
            return Err(shape_err("argmax", "rows have no columns".into()));
        }
        if x.rows == 0 {
            return Ok(Vec::new());
        }
        let out = guarded("cuda argmax: allocation failed", || {
            self.stream.alloc_zeros::<u32>(x.rows)
        })?;
        self.launch_argmax(x, ptr(&out, &self.stream))?;
        // Wait first, as `to_host` does, so the host timing counts the device's time as a wait.
        self.synchronize()?;
        let mut host = vec![0u32; x.rows];
        guarded("cuda argmax: device-to-host copy failed", || {
            self.stream.memcpy_dtoh(&out, &mut host)
        })?;
        guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        Ok(host)
    }

    fn begin_step(&self, step: &StepRequest) -> Result<StepStart<GpuAct>> {
        self.begin_step_impl(step)
    }

    fn end_step(&self, logits: Option<&GpuAct>) -> Result<StepEnd> {
        self.end_step_impl(logits)
    }

    fn begin_segment(
        &self,
        index: usize,
        inputs: &[(&GpuAct, bool)],
    ) -> Result<SegmentStart<GpuAct>> {
        self.begin_segment_impl(index, inputs)
    }

    fn end_segment(&self, outputs: Option<&[&GpuAct]>) -> Result<SegmentEnd<GpuAct>> {
        self.end_segment_impl(outputs)
    }

    fn feed_choice(&self, logits: &GpuAct) -> Result<bool> {
        self.feed_choice_impl(logits)
    }

    fn take_fed_choice(&self) -> Result<u32> {
        self.take_fed_choice_impl()
    }

    fn drop_fed_choices(&self) -> Result<()> {
        self.drop_fed_choices_impl()
    }

    fn storage_id(&self, x: &GpuAct) -> u64 {
        ptr(&x.buf, &self.stream)
    }

    fn prompt_pass(&self, on: bool) {
        self.prompt_pass
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

impl CudaBackend {
    /// A quantized matrix's codes and scales on the device: queued with the load's file reads
    /// when both lie in its file, otherwise copied now.
    fn upload_quantized<T: cudarc::driver::DeviceRepr>(
        &self,
        name: &str,
        qweight: &[T],
        scales: &[f16],
    ) -> Result<(CudaSlice<T>, CudaSlice<f16>)> {
        let deferred = match self.deferred_alloc(name, &[qweight])? {
            Some(q) => match self.deferred_alloc(&format!("{name} scales"), &[scales])? {
                Some(s) => Some((q, s)),
                // A load that fails is dropped with its backend, so `q`'s queued copy never runs.
                None => {
                    return Err(Error::Backend(format!(
                        "{name}: the weights and their scales do not come from the same file"
                    )))
                }
            },
            None => None,
        };
        match deferred {
            Some(up) => Ok(up),
            None => guarded(
                &format!("cuda: cannot upload {name} (out of VRAM?)"),
                || {
                    Ok((
                        self.stream.clone_htod(qweight)?,
                        self.stream.clone_htod(scales)?,
                    ))
                },
            ),
        }
    }
}
