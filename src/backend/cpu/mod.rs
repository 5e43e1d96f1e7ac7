//! The CPU reference backend: f32 arithmetic over FP16 weights, threaded with rayon.
//!
//! Weights are converted to f32 once, when loaded, and kept: every op then streams plain f32 (no
//! per-use conversion in inner loops), at twice the memory of the FP16 source. This backend is the
//! exact reference that tests run on small models, so speed per call matters more than footprint.
//!
//! Quantized weights (the draft's, a quantized target's) are held dequantized; products with them
//! round their input rows to f16 first, as the W4A16 kernels do (kernels/moe_int4.cu,
//! "Numerics").
//!
//! Every output element is computed by the same sequential code whatever the number of rows, and
//! threads only split independent elements: results are bit-identical between batched and
//! one-row-at-a-time calls, and between runs.

use half::f16;
use rayon::prelude::*;

use super::{check, AttentionSpec, Backend, GatedMlp, RopeSpec, RouteSpec, Routing};
use crate::arch::RopeStyle;
use crate::{Error, Result};

/// A row-major `[rows, cols]` f32 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Mat {
    /// `(rows, cols)`, as the shape checks take it.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A weight converted to f32: `shape` is `[out, in]` for a matrix, `[len]` for a vector.
#[derive(Clone, Debug)]
pub struct CpuWeight {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    /// Products with this weight first round their input rows to f16 (set for INT4 weights): the
    /// W4A16 kernels compute in FP16 with f32 accumulation, and this reference matches them.
    pub f16_input: bool,
}

impl CpuWeight {
    /// A quantized `[n][k]` matrix from its dequantizer's output (`data`, out-major), with the
    /// f16 input rounding of the kernels that compute with it.
    fn dequantized(name: &str, k: usize, n: usize, data: Result<Vec<f32>>) -> Result<CpuWeight> {
        let data = data.map_err(|e| Error::Model(format!("{name}: {e}")))?;
        Ok(CpuWeight {
            name: name.to_string(),
            shape: vec![n, k],
            data,
            f16_input: true,
        })
    }

    /// `(out, in)` of a matrix (a vector counts as one row).
    fn dims(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [n] => (1, *n),
            [o, i] => (*o, *i),
            _ => (0, 0),
        }
    }
}

/// The CPU backend. Threads come from rayon's global pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// Work (multiply-adds) below which an op runs on the calling thread: splitting tiny ops across
/// threads costs more than it saves.
const PAR_THRESHOLD: usize = 1 << 15;

/// Dot product with eight independent accumulators, combined in a fixed tree, then the tail: one
/// fixed summation order for a given length.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let chunks = n / 8;
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for i in chunks * 8..n {
        s += a[i] * b[i];
    }
    s
}

/// Sum with the same fixed order as [`dot`].
#[inline]
fn sum(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in a.chunks_exact(8) {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for v in &a[chunks * 8..] {
        s += v;
    }
    s
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x [rows, in] @ w[out, in]^T (+ bias)` into a new `[rows, out]` matrix.
fn matmul_t(
    x: &[f32],
    rows: usize,
    inp: usize,
    w: &[f32],
    out: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    // Computed transposed (`[out, rows]`): one task per block of output features reuses each
    // weight row for every input row; then transposed back.
    let mut yt = vec![0.0f32; out * rows];
    let kernel = |o: usize, col: &mut [f32]| {
        let wr = &w[o * inp..(o + 1) * inp];
        let b = bias.map_or(0.0, |b| b[o]);
        for (r, y) in col.iter_mut().enumerate() {
            let d = dot(&x[r * inp..(r + 1) * inp], wr);
            *y = if bias.is_some() { d + b } else { d };
        }
    };
    if rows * inp * out >= PAR_THRESHOLD && rows > 0 {
        yt.par_chunks_mut(rows)
            .enumerate()
            .with_min_len(8)
            .for_each(|(o, col)| kernel(o, col));
    } else if rows > 0 {
        yt.chunks_mut(rows)
            .enumerate()
            .for_each(|(o, col)| kernel(o, col));
    }
    if rows == 1 {
        return yt;
    }
    let mut y = vec![0.0f32; rows * out];
    for o in 0..out {
        for r in 0..rows {
            y[r * out + o] = yt[o * rows + r];
        }
    }
    y
}

fn shape_err(op: &str, detail: String) -> Error {
    Error::Backend(format!("cpu {op}: {detail}"))
}

/// `x` as the input of a product with `w`: rounded to f16 and back when `w` asks for it.
fn product_input<'a>(x: &'a [f32], w: &CpuWeight) -> std::borrow::Cow<'a, [f32]> {
    if w.f16_input {
        x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
    } else {
        std::borrow::Cow::Borrowed(x)
    }
}

impl Cpu {
    fn check_linear(
        &self,
        x: &Mat,
        w: &CpuWeight,
        bias: Option<&CpuWeight>,
    ) -> Result<(usize, usize)> {
        let (out, inp) = w.dims();
        if w.shape.len() != 2 || inp != x.cols {
            return Err(shape_err(
                "linear",
                format!(
                    "{} has shape {:?}, input has {} columns",
                    w.name, w.shape, x.cols
                ),
            ));
        }
        if let Some(b) = bias {
            if b.data.len() != out {
                return Err(shape_err(
                    "linear",
                    format!(
                        "bias {} has {} entries, expected {out}",
                        b.name,
                        b.data.len()
                    ),
                ));
            }
        }
        Ok((out, inp))
    }

    /// `silu(gate) * up` from a fused `[rows, 2 * inter]` activation.
    fn silu_mul(gu: &[f32], rows: usize, inter: usize) -> Vec<f32> {
        let mut h = vec![0.0f32; rows * inter];
        for r in 0..rows {
            let g = &gu[r * 2 * inter..r * 2 * inter + inter];
            let u = &gu[r * 2 * inter + inter..(r + 1) * 2 * inter];
            for i in 0..inter {
                h[r * inter + i] = silu(g[i]) * u[i];
            }
        }
        h
    }

    fn mlp_rows(x: &[f32], rows: usize, mlp: &GatedMlp<Cpu>) -> Result<Vec<f32>> {
        let (two_inter, hidden) = mlp.gate_up.dims();
        let (d_out, inter) = mlp.down.dims();
        if two_inter != 2 * inter || x.len() != rows * hidden {
            return Err(shape_err(
                "gated_mlp",
                format!(
                    "{} {:?} / {} {:?} do not fit an input of {} columns",
                    mlp.gate_up.name,
                    mlp.gate_up.shape,
                    mlp.down.name,
                    mlp.down.shape,
                    x.len() / rows.max(1)
                ),
            ));
        }
        let x = product_input(x, &mlp.gate_up);
        let gu = matmul_t(&x, rows, hidden, &mlp.gate_up.data, two_inter, None);
        let h = Self::silu_mul(&gu, rows, inter);
        let h = product_input(&h, &mlp.down);
        Ok(matmul_t(&h, rows, inter, &mlp.down.data, d_out, None))
    }
}

impl Backend for Cpu {
    type Act = Mat;
    type Weight = CpuWeight;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn weight_f16(&self, name: &str, shape: &[usize], data: &[f16]) -> Result<CpuWeight> {
        check::weight(name, shape, data.len(), true).map_err(|d| shape_err("weight", d))?;
        let n: usize = shape.iter().product();
        let mut out = vec![0.0f32; n];
        out.par_chunks_mut(1 << 16)
            .zip(data.par_chunks(1 << 16))
            .for_each(|(o, i)| o.iter_mut().zip(i).for_each(|(o, i)| *o = i.to_f32()));
        Ok(CpuWeight {
            name: name.to_string(),
            shape: shape.to_vec(),
            data: out,
            f16_input: false,
        })
    }

    fn weight_int4(
        &self,
        name: &str,
        k: usize,
        n: usize,
        qweight: &[u32],
        scales: &[f16],
    ) -> Result<CpuWeight> {
        CpuWeight::dequantized(
            name,
            k,
            n,
            crate::quant::marlin_dequantize_out_in(k, n, qweight, scales),
        )
    }

    fn weight_rows(
        &self,
        name: &str,
        bits: crate::quant::Bits,
        k: usize,
        n: usize,
        qweight: &[u8],
        scales: &[f16],
    ) -> Result<CpuWeight> {
        CpuWeight::dequantized(
            name,
            k,
            n,
            crate::quant::rows_dequantize_out_in(k, n, bits, qweight, scales),
        )
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<Mat> {
        Ok(Mat {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        })
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Mat> {
        if data.len() != rows * cols {
            return Err(shape_err(
                "from_host",
                format!("{} values for [{rows}, {cols}]", data.len()),
            ));
        }
        Ok(Mat {
            rows,
            cols,
            data: data.to_vec(),
        })
    }

    fn to_host(&self, x: &Mat) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn shape(&self, x: &Mat) -> (usize, usize) {
        x.shape()
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32]) -> Result<Mat> {
        let (vocab, hidden) = table.dims();
        let mut data = Vec::with_capacity(ids.len() * hidden);
        for &id in ids {
            let id = id as usize;
            if id >= vocab {
                return Err(shape_err(
                    "embedding",
                    format!("token id {id} >= {vocab} rows of {}", table.name),
                ));
            }
            data.extend_from_slice(&table.data[id * hidden..(id + 1) * hidden]);
        }
        Ok(Mat {
            rows: ids.len(),
            cols: hidden,
            data,
        })
    }

    fn rms_norm(&self, x: &Mat, weight: &CpuWeight, eps: f32, group: usize) -> Result<Mat> {
        if group == 0 || !x.cols.is_multiple_of(group) || weight.data.len() != group {
            return Err(shape_err(
                "rms_norm",
                format!(
                    "{} has {} entries; input width {}, group {group}",
                    weight.name,
                    weight.data.len(),
                    x.cols
                ),
            ));
        }
        let mut out = x.clone();
        for seg in out.data.chunks_mut(group) {
            let mut sq = [0.0f32; 8];
            let chunks = group / 8;
            for c in seg.chunks_exact(8) {
                for l in 0..8 {
                    sq[l] += c[l] * c[l];
                }
            }
            let mut ss = ((sq[0] + sq[1]) + (sq[2] + sq[3])) + ((sq[4] + sq[5]) + (sq[6] + sq[7]));
            for v in &seg[chunks * 8..] {
                ss += v * v;
            }
            let inv = 1.0 / (ss / group as f32 + eps).sqrt();
            for (v, w) in seg.iter_mut().zip(&weight.data) {
                *v = w * (*v * inv);
            }
        }
        Ok(out)
    }

    fn layer_norm(&self, x: &Mat, weight: &CpuWeight, bias: &CpuWeight, eps: f32) -> Result<Mat> {
        if weight.data.len() != x.cols || bias.data.len() != x.cols {
            return Err(shape_err(
                "layer_norm",
                format!(
                    "{} / {} do not match width {}",
                    weight.name, bias.name, x.cols
                ),
            ));
        }
        let mut out = x.clone();
        let n = x.cols as f32;
        for row in out.data.chunks_mut(x.cols) {
            let mean = sum(row) / n;
            let mut var_acc = [0.0f32; 8];
            let chunks = row.len() / 8;
            for c in row.chunks_exact(8) {
                for l in 0..8 {
                    let d = c[l] - mean;
                    var_acc[l] += d * d;
                }
            }
            let mut var = ((var_acc[0] + var_acc[1]) + (var_acc[2] + var_acc[3]))
                + ((var_acc[4] + var_acc[5]) + (var_acc[6] + var_acc[7]));
            for v in &row[chunks * 8..] {
                var += (v - mean) * (v - mean);
            }
            let inv = 1.0 / (var / n + eps).sqrt();
            for ((v, w), b) in row.iter_mut().zip(&weight.data).zip(&bias.data) {
                *v = (*v - mean) * inv * w + b;
            }
        }
        Ok(out)
    }

    fn linear(&self, x: &Mat, w: &CpuWeight, bias: Option<&CpuWeight>) -> Result<Mat> {
        let (out, inp) = self.check_linear(x, w, bias)?;
        let data = matmul_t(
            &product_input(&x.data, w),
            x.rows,
            inp,
            &w.data,
            out,
            bias.map(|b| b.data.as_slice()),
        );
        Ok(Mat {
            rows: x.rows,
            cols: out,
            data,
        })
    }

    fn split_cols(&self, x: &Mat, widths: &[usize]) -> Result<Vec<Mat>> {
        check::split(widths, x.cols).map_err(|d| shape_err("split_cols", d))?;
        let mut outs: Vec<Mat> = widths
            .iter()
            .map(|&w| Mat {
                rows: x.rows,
                cols: w,
                data: Vec::with_capacity(w * x.rows),
            })
            .collect();
        for r in 0..x.rows {
            let mut start = 0;
            let row = x.row(r);
            for (m, &w) in outs.iter_mut().zip(widths) {
                m.data.extend_from_slice(&row[start..start + w]);
                start += w;
            }
        }
        Ok(outs)
    }

    fn clamp(&self, x: &mut Mat, limit: f32) -> Result<()> {
        x.data.iter_mut().for_each(|v| *v = v.clamp(-limit, limit));
        Ok(())
    }

    fn add_assign(&self, x: &mut Mat, y: &Mat) -> Result<()> {
        check::same(x.shape(), y.shape()).map_err(|d| shape_err("add", d))?;
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn add_sigmoid_gated(&self, x: &mut Mat, y: &Mat, gate: &Mat) -> Result<()> {
        check::sigmoid_gated(x.shape(), y.shape(), gate.shape())
            .map_err(|d| shape_err("add_sigmoid_gated", d))?;
        for r in 0..x.rows {
            let g = sigmoid(gate.data[r]);
            let yr = &y.data[r * y.cols..(r + 1) * y.cols];
            x.data[r * x.cols..(r + 1) * x.cols]
                .iter_mut()
                .zip(yr)
                .for_each(|(a, b)| *a += g * b);
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Mat,
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
        let mut cos = vec![0.0f32; half];
        let mut sin = vec![0.0f32; half];
        for r in 0..x.rows {
            let p = positions[r] as f32;
            for i in 0..half {
                // The angle is rounded to f32 first (as transformers computes it), then cos/sin
                // are evaluated exactly and rounded.
                let a = (inv_freq[i] * p) as f64;
                cos[i] = (a.cos() as f32) * scales[r];
                sin[i] = (a.sin() as f32) * scales[r];
            }
            let row = &mut x.data[r * x.cols..(r + 1) * x.cols];
            for h in 0..spec.heads {
                let seg = &mut row[h * spec.head_stride + spec.offset..][..spec.rot_dim];
                match spec.style {
                    RopeStyle::Half => {
                        for i in 0..half {
                            let (a, b) = (seg[i], seg[i + half]);
                            seg[i] = a * cos[i] - b * sin[i];
                            seg[i + half] = b * cos[i] + a * sin[i];
                        }
                    }
                    RopeStyle::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (seg[2 * i], seg[2 * i + 1]);
                            seg[2 * i] = a * cos[i] - b * sin[i];
                            seg[2 * i + 1] = a * sin[i] + b * cos[i];
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn write_rows(&self, dst: &mut Mat, row: usize, src: &Mat) -> Result<()> {
        check::write_rows(dst.shape(), row, src.shape()).map_err(|d| shape_err("write_rows", d))?;
        dst.data[row * dst.cols..(row + src.rows) * dst.cols].copy_from_slice(&src.data);
        Ok(())
    }

    fn head_rows(&self, x: &Mat, rows: usize) -> Result<Mat> {
        if rows > x.rows {
            return Err(shape_err("head_rows", format!("{rows} of {} rows", x.rows)));
        }
        Ok(Mat {
            rows,
            cols: x.cols,
            data: x.data[..rows * x.cols].to_vec(),
        })
    }

    fn mla_expand_kv(
        &self,
        kv: &Mat,
        k_pe: &Mat,
        heads: usize,
        nope: usize,
        v_dim: usize,
    ) -> Result<(Mat, Mat)> {
        let rope = k_pe.cols;
        check::mla_expand(kv.shape(), k_pe.shape(), heads, nope, v_dim)
            .map_err(|d| shape_err("mla_expand_kv", d))?;
        let len = kv.rows;
        let kw = heads * (nope + rope);
        let mut k = Mat {
            rows: len,
            cols: kw,
            data: Vec::with_capacity(len * kw),
        };
        let mut v = Mat {
            rows: len,
            cols: heads * v_dim,
            data: Vec::with_capacity(len * heads * v_dim),
        };
        for r in 0..len {
            let row = kv.row(r);
            for h in 0..heads {
                let hs = &row[h * (nope + v_dim)..(h + 1) * (nope + v_dim)];
                k.data.extend_from_slice(&hs[..nope]);
                k.data.extend_from_slice(k_pe.row(r));
                v.data.extend_from_slice(&hs[nope..]);
            }
        }
        Ok((k, v))
    }

    fn attention(
        &self,
        q: &Mat,
        k: &Mat,
        v: &Mat,
        kv_len: usize,
        spec: AttentionSpec,
    ) -> Result<Mat> {
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
        let group = heads / kv_heads;
        let mut out = vec![0.0f32; q.rows * heads * v_dim];
        // One task per (row, head): each computes its scores, softmax and weighted sum in key order.
        let task = |idx: usize, o: &mut [f32]| {
            let (r, h) = (idx / heads, idx % heads);
            let pos = start + r;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let kh = h / group;
            let qh = &q.row(r)[h * qk_dim..(h + 1) * qk_dim];
            let mut scores: Vec<f32> = (lo..=pos)
                .map(|j| dot(qh, &k.data[j * k.cols + kh * qk_dim..][..qk_dim]) * scale)
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            o.iter_mut().for_each(|x| *x = 0.0);
            for (s, j) in scores.iter().zip(lo..=pos) {
                let p = s / total;
                let vj = &v.data[j * v.cols + kh * v_dim..][..v_dim];
                o.iter_mut().zip(vj).for_each(|(x, vv)| *x += p * vv);
            }
        };
        let work = q.rows * heads * kv_len * (qk_dim + v_dim);
        if work >= PAR_THRESHOLD {
            out.par_chunks_mut(v_dim)
                .enumerate()
                .for_each(|(i, o)| task(i, o));
        } else {
            out.chunks_mut(v_dim)
                .enumerate()
                .for_each(|(i, o)| task(i, o));
        }
        Ok(Mat {
            rows: q.rows,
            cols: heads * v_dim,
            data: out,
        })
    }

    fn route(&self, logits: &Mat, spec: RouteSpec) -> Result<Routing> {
        let n = logits.cols;
        match spec {
            RouteSpec::SoftmaxTopK {
                top_k,
                renormalize,
                scale,
            } => {
                if top_k == 0 || top_k > n {
                    return Err(shape_err("route", format!("top_k {top_k} of {n} experts")));
                }
                let mut ids = Vec::with_capacity(logits.rows * top_k);
                let mut weights = Vec::with_capacity(logits.rows * top_k);
                for r in 0..logits.rows {
                    let row = logits.row(r);
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = row.iter().map(|x| (x - max).exp()).collect();
                    let total = sum(&e);
                    let probs: Vec<f32> = e.iter().map(|x| x / total).collect();
                    let mut order: Vec<usize> = (0..n).collect();
                    // Largest first, ties to the lower id; a total order, so NaN cannot upset it.
                    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
                    let top = &order[..top_k];
                    let mut w: Vec<f32> = top.iter().map(|&i| probs[i]).collect();
                    if renormalize {
                        let s: f32 = w.iter().fold(0.0, |a, b| a + b);
                        w.iter_mut().for_each(|x| *x /= s);
                    }
                    if scale != 1.0 {
                        w.iter_mut().for_each(|x| *x *= scale);
                    }
                    ids.extend(top.iter().map(|&i| i as u32));
                    weights.extend(w);
                }
                Ok(Routing {
                    top_k,
                    ids,
                    weights,
                })
            }
            RouteSpec::SparseMixer { jitter_eps } => {
                if n < 2 {
                    return Err(shape_err(
                        "route",
                        format!("SparseMixer needs at least 2 experts, got {n}"),
                    ));
                }
                let mut ids = Vec::with_capacity(logits.rows * 2);
                let mut weights = Vec::with_capacity(logits.rows * 2);
                for r in 0..logits.rows {
                    let scores = logits.row(r);
                    let argmax = |xs: &[f32]| {
                        let mut best = 0;
                        for (i, &x) in xs.iter().enumerate() {
                            if x > xs[best] {
                                best = i;
                            }
                        }
                        best
                    };
                    // Softmax over the logits kept by the threshold, evaluated at `pick`.
                    let masked_softmax_at = |candidates: &[f32], threshold: f32, pick: usize| {
                        let kept: Vec<f32> = candidates
                            .iter()
                            .zip(scores)
                            .map(|(&c, &s)| {
                                let factor = s.abs().max(threshold);
                                if (threshold - s) / factor > 2.0 * jitter_eps {
                                    f32::NEG_INFINITY
                                } else {
                                    c
                                }
                            })
                            .collect();
                        let max = kept.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let e: Vec<f32> = kept.iter().map(|x| (x - max).exp()).collect();
                        e[pick] / sum(&e)
                    };
                    let first = argmax(scores);
                    let w1 = masked_softmax_at(scores, scores[first], first);
                    let mut rest = scores.to_vec();
                    rest[first] = f32::NEG_INFINITY;
                    let second = argmax(&rest);
                    let w2 = masked_softmax_at(&rest, rest[second], second);
                    ids.extend([first as u32, second as u32]);
                    weights.extend([w1, w2]);
                }
                Ok(Routing {
                    top_k: 2,
                    ids,
                    weights,
                })
            }
        }
    }

    fn gated_mlp(&self, x: &Mat, mlp: &GatedMlp<Self>) -> Result<Mat> {
        let data = Self::mlp_rows(&x.data, x.rows, mlp)?;
        Ok(Mat {
            rows: x.rows,
            cols: x.cols,
            data,
        })
    }

    fn moe_experts(&self, x: &Mat, routing: &Routing, experts: &[GatedMlp<Self>]) -> Result<Mat> {
        let k = routing.top_k;
        if routing.ids.len() != x.rows * k || routing.weights.len() != x.rows * k {
            return Err(shape_err(
                "moe_experts",
                format!(
                    "routing for {} rows, input has {}",
                    routing.ids.len() / k.max(1),
                    x.rows
                ),
            ));
        }
        // Rows (and top-k slot) routed to each expert.
        let mut assigned: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts.len()];
        for (i, &e) in routing.ids.iter().enumerate() {
            let e = e as usize;
            if e >= experts.len() {
                return Err(shape_err(
                    "moe_experts",
                    format!("expert id {e} >= {}", experts.len()),
                ));
            }
            assigned[e].push((i / k, i % k));
        }
        let hit: Vec<usize> = (0..experts.len())
            .filter(|&e| !assigned[e].is_empty())
            .collect();
        let hidden = x.cols;
        let run = |&e: &usize| -> Result<(usize, Vec<f32>)> {
            let rows = &assigned[e];
            let mut xs = Vec::with_capacity(rows.len() * hidden);
            for &(r, _) in rows {
                xs.extend_from_slice(x.row(r));
            }
            Ok((e, Self::mlp_rows(&xs, rows.len(), &experts[e])?))
        };
        let outputs: Vec<(usize, Vec<f32>)> = if hit.len() > 1 {
            hit.par_iter().map(run).collect::<Result<_>>()?
        } else {
            hit.iter().map(run).collect::<Result<_>>()?
        };
        let mut out = vec![0.0f32; x.rows * hidden];
        // Ascending expert id (the order of `hit`): each row's sum has a fixed order.
        for (e, y) in outputs {
            for (i, &(r, slot)) in assigned[e].iter().enumerate() {
                let w = routing.weights[r * k + slot];
                let dst = &mut out[r * hidden..(r + 1) * hidden];
                dst.iter_mut()
                    .zip(&y[i * hidden..(i + 1) * hidden])
                    .for_each(|(o, v)| *o += v * w);
            }
        }
        Ok(Mat {
            rows: x.rows,
            cols: hidden,
            data: out,
        })
    }

    fn argmax(&self, x: &Mat) -> Result<Vec<u32>> {
        Ok((0..x.rows)
            .map(|r| crate::decode::sampling::argmax(x.row(r)))
            .collect())
    }
}

#[cfg(test)]
mod tests;
