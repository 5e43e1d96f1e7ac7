//! Position and attention ops: rotary embeddings (with their per-step cos/sin table), the MLA
//! key/value expansion, and decode/verify attention over the KV cache.

use crate::arch::RopeStyle;
use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::ops::rope::{rope_cos_sin, RopeTableGpu};
use crate::backend::cuda::runtime::act::GpuAct;
use crate::backend::cuda::runtime::driver::{guarded, NO_CLUSTER};
use crate::backend::cuda::runtime::kernels::*;
use crate::backend::{check, AttentionSpec, MlaShape, RopeSpec};
use crate::Result;

impl CudaBackend {
    pub(in crate::backend::cuda) fn rope_table(
        &self,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<std::sync::MutexGuard<'_, Option<RopeTableGpu>>> {
        let mut table = self.lock(&self.rope_table)?;
        let fresh = table.as_ref().is_some_and(|t| {
            t.inv_freq == inv_freq && t.positions == positions && t.scales == scales
        });
        if !fresh {
            let (cos, sin) = rope_cos_sin(inv_freq, positions, scales);
            let up = |v: &[f32]| {
                let v = if v.is_empty() { &[0.0f32][..] } else { v };
                guarded("cuda rope: host-to-device copy failed", || {
                    self.stream.clone_htod(v)
                })
            };
            *table = Some(RopeTableGpu {
                inv_freq: inv_freq.to_vec(),
                positions: positions.to_vec(),
                scales: scales.to_vec(),
                cos: up(&cos)?,
                sin: up(&sin)?,
            });
        }
        Ok(table)
    }

    pub(in crate::backend::cuda) fn rope_op(
        &self,
        x: &mut GpuAct,
        spec: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        let half = spec.rot_dim / 2;
        check::rope(
            &spec,
            x.shape(),
            inv_freq.len(),
            positions.len(),
            scales.len(),
        )
        .map_err(|d| shape_err("rope", d))?;
        if x.rows == 0 || half == 0 {
            return Ok(());
        }
        let s = &self.stream;
        // In a recorded pass cos/sin come from the step buffer, rewritten at every replay.
        let (cos, sin) = match self.step_args()? {
            Some(a) if self.step_rope_matches(inv_freq, positions, scales)? => (a.cos, a.sin),
            _ => {
                let table = self.rope_table(inv_freq, positions, scales)?;
                let t = table
                    .as_ref()
                    .ok_or_else(|| shape_err("rope", "no table".into()))?;
                (ptr(&t.cos, s), ptr(&t.sin, s))
            }
        };
        let args = RopeArgs {
            x: dptr(&x.buf, s),
            cos_t: DevPtr(cos),
            sin_t: DevPtr(sin),
            cols: int(x.cols, "cols")?,
            heads: int(spec.heads, "heads")?,
            head_stride: int(spec.head_stride, "head_stride")?,
            offset: int(spec.offset, "offset")?,
            rot_dim: int(spec.rot_dim, "rot_dim")?,
            interleaved: i32::from(spec.style == RopeStyle::Interleaved),
        };
        self.launch(
            &self.k.rope,
            "rope",
            (x.rows as u32, 1, 1),
            ROW_THREADS,
            args,
        )
    }

    pub(in crate::backend::cuda) fn mla_expand_kv_op(
        &self,
        kv: &GpuAct,
        k_pe: &GpuAct,
        heads: usize,
        nope: usize,
        v_dim: usize,
    ) -> Result<(GpuAct, GpuAct)> {
        let rope = k_pe.cols;
        check::mla_expand(kv.shape(), k_pe.shape(), heads, nope, v_dim)
            .map_err(|d| shape_err("mla_expand_kv", d))?;
        let keys = self.alloc(kv.rows, heads * (nope + rope))?;
        let values = self.alloc(kv.rows, heads * v_dim)?;
        if kv.rows > 0 {
            let s = &self.stream;
            let shape = MlaShape { heads, nope, v_dim };
            let args = MlaExpandKvArgs {
                kv: dptr(&kv.buf, s),
                k_pe: dptr(&k_pe.buf, s),
                caches: mla_caches(shape, rope, &keys, &values, s)?,
            };
            let h = u32::try_from(heads)
                .map_err(|_| shape_err("mla_expand_kv", "too many heads".into()))?;
            self.launch(
                &self.k.mla_expand_kv,
                "mla_expand_kv",
                (kv.rows as u32, h, 1),
                MLA_THREADS,
                args,
            )?;
        }
        Ok((keys, values))
    }

    pub(in crate::backend::cuda) fn attention_op(
        &self,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        kv_len: usize,
        spec: AttentionSpec,
    ) -> Result<GpuAct> {
        let AttentionSpec {
            heads,
            kv_heads,
            qk_dim,
            v_dim,
            scale,
            start,
            window,
        } = spec;
        check::attention(&spec, q.shape(), k.shape(), v.shape(), kv_len)
            .map_err(|d| shape_err("attention", d))?;
        let out = self.alloc(q.rows, heads * v_dim)?;
        if q.rows == 0 {
            return Ok(out);
        }
        if let Some(kernel) = self.prompt_attention(q.rows, qk_dim, v_dim) {
            let s = &self.stream;
            self.launch(
                kernel,
                "attention prompt",
                (
                    u32::try_from(q.rows.div_ceil(ATTP_ROWS)).map_err(|_| {
                        shape_err("attention", format!("{} rows exceed a grid", q.rows))
                    })?,
                    u32::try_from(heads).map_err(|_| shape_err("attention", "heads".into()))?,
                    1,
                ),
                ATTP_THREADS,
                AttentionPromptArgs {
                    q: dptr(&q.buf, s),
                    k: dptr(&k.buf, s),
                    v: dptr(&v.buf, s),
                    out: dptr(&out.buf, s),
                    rows: int(q.rows, "rows")?,
                    heads: int(heads, "heads")?,
                    kv_heads: int(kv_heads, "kv_heads")?,
                    scale,
                    start: int(start, "start")?,
                    window: int(window.unwrap_or(0), "window")?,
                },
            )?;
            return Ok(out);
        }
        let pairs = q.rows * heads;
        // A recorded pass reads its start on the device and may be replayed at any length the
        // cache holds: its score rows are sized for the whole cache.
        let step = self
            .step_args()?
            .filter(|a| a.start == start && a.rows == q.rows);
        let stride = match step {
            Some(_) => k.rows.min(v.rows).max(1),
            None => kv_len.max(1),
        };
        let scratch = self.alloc(pairs, stride)?;
        let start_at = step.map_or(0, |a| a.positions);
        // No row sees more than `stride` keys, so no pair has more chunks than this: the grid
        // leaves out blocks that would only find their chunk empty.
        let splits = ATT_SPLITS.min(stride.div_ceil(ATT_CHUNK_MIN));
        // A pair's chunks combine in its cluster's shared memory where the device has clusters
        // (and the values fit); else, up to ATT_COUNTERS pairs, the last chunk block of each
        // pair combines; past it (long prompts) a second launch does. The same arithmetic.
        let cluster = self.clusters && v_dim <= ATT_CLUSTER_MAX_V;
        let fused = cluster || pairs <= ATT_COUNTERS;
        let part = match cluster {
            true => None,
            false => Some(self.alloc(pairs * ATT_SPLITS, 2 + v_dim)?),
        };
        let s = &self.stream;
        let args = AttentionArgs {
            q: dptr(&q.buf, s),
            k: dptr(&k.buf, s),
            v: dptr(&v.buf, s),
            part: DevPtr(part.as_ref().map_or(0, |p| ptr(&p.buf, s))),
            scratch: dptr(&scratch.buf, s),
            heads: int(heads, "heads")?,
            kv_heads: int(kv_heads, "kv_heads")?,
            qk_dim: int(qk_dim, "qk_dim")?,
            v_dim: int(v_dim, "v_dim")?,
            scale,
            start: int(start, "start")?,
            window: int(window.unwrap_or(0), "window")?,
            score_stride: int(stride, "kv_len")?,
            start_at: DevPtr(start_at),
            counters: DevPtr(if fused && !cluster {
                ptr(&self.attention_counters, s)
            } else {
                0
            }),
            out: dptr(&out.buf, s),
            splits: int(splits, "splits")?,
            cluster: i32::from(cluster),
        };
        let too_many = || shape_err("attention", "too many rows".into());
        let grid = pairs
            .checked_mul(splits)
            .and_then(|b| u32::try_from(b).ok())
            .ok_or_else(too_many)?;
        self.launch_clustered(
            &self.k.attention,
            "attention",
            (grid, 1, 1),
            if cluster {
                (u32::try_from(splits).map_err(|_| too_many())?, 1, 1)
            } else {
                NO_CLUSTER
            },
            ATT_THREADS,
            args,
        )?;
        if let (false, Some(part)) = (fused, &part) {
            let args = AttentionCombineArgs {
                part: dptr(&part.buf, s),
                out: dptr(&out.buf, s),
                heads: int(heads, "heads")?,
                v_dim: int(v_dim, "v_dim")?,
                start: int(start, "start")?,
                window: int(window.unwrap_or(0), "window")?,
                start_at: DevPtr(start_at),
            };
            self.launch(
                &self.k.attention_combine,
                "attention combine",
                (u32::try_from(pairs).map_err(|_| too_many())?, 1, 1),
                ATT_COMBINE_THREADS,
                args,
            )?;
        }
        Ok(out)
    }
}
