//! GPTQ (Frantar et al., 2022): quantize one column at a time and spread each column's rounding
//! error over the columns not yet quantized, weighted by the inverse Hessian of the layer's
//! squared output error, `H = 2/N sum x x^T`.
//!
//! This implementation uses the paper's Cholesky reformulation (the rows of the upper Cholesky
//! factor of `H^-1` give every update), lazy batch updates over blocks of columns, and act-order
//! with static groups: every group's scale is fixed up front from the original weights in their
//! original column order, columns are then processed in descending `diag(H)` order, each with its
//! own group's scale. The stored matrix therefore needs no group index: it is an ordinary
//! [`QuantMatrix`] with the same layout as round-to-nearest.

use faer::linalg::matmul::matmul;
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::linalg::triangular_inverse::invert_lower_triangular;
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};
use rayon::prelude::*;

use super::{
    check_weight, code_value, group_scales, quantize_code, transpose, Bits, QuantMatrix, GROUP_SIZE,
};
use crate::{Error, Result};

/// Rows of activations converted to f64 at a time while accumulating a Hessian.
const ACCUMULATE_ROWS: usize = 256;

/// Columns quantized one by one between two matrix-product updates inside a block.
const SUB_BLOCK: usize = 32;

/// Damping retries after a failed Cholesky factorization: each multiplies the damping by this.
const DAMP_GROWTH: f64 = 10.0;
const DAMP_RETRIES: usize = 3;
/// The smallest damping a retry starts from (so a zero damping can still grow).
const RETRY_DAMP_FLOOR: f64 = 1e-3;

/// The running sum `2 X^T X` over calibration activations of one linear layer, in f64.
#[derive(Debug, Clone)]
pub struct Hessian {
    k: usize,
    /// `2 sum x x^T`, k x k; only the lower triangle is kept (the upper one stays zero).
    sum: Mat<f64>,
    rows: u64,
    /// The first malformed input seen (reported by [`gptq`] rather than panicking at the call).
    problem: Option<String>,
}

impl Hessian {
    /// An empty Hessian for a layer with `k` input features.
    pub fn new(k: usize) -> Self {
        Hessian {
            k,
            sum: Mat::zeros(k, k),
            rows: 0,
            problem: None,
        }
    }

    /// Adds `rows` activation rows, `x` row-major `[rows][k]`. A length mismatch is recorded and
    /// reported by [`gptq`]; the rows are then not added.
    pub fn add_rows(&mut self, x: &[f32], rows: usize) {
        if Some(x.len()) != rows.checked_mul(self.k) {
            if self.problem.is_none() {
                self.problem = Some(format!(
                    "add_rows got {} values for {rows} rows of {} features",
                    x.len(),
                    self.k
                ));
            }
            return;
        }
        if self.k == 0 {
            return;
        }
        for chunk in x.chunks(ACCUMULATE_ROWS * self.k) {
            let r = chunk.len() / self.k;
            let xm = Mat::<f64>::from_fn(r, self.k, |i, j| f64::from(chunk[i * self.k + j]));
            // Symmetric: only the lower triangle is accumulated (half the work).
            triangular::matmul(
                self.sum.as_mut(),
                BlockStructure::TriangularLower,
                Accum::Add,
                xm.transpose(),
                BlockStructure::Rectangular,
                xm.as_ref(),
                BlockStructure::Rectangular,
                2.0,
                Par::rayon(0),
            );
        }
        self.rows += rows as u64;
    }

    /// Activation rows accumulated so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Input features.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Adds another Hessian's rows (e.g. one accumulated on another thread or shard).
    pub fn merge(&mut self, other: &Hessian) {
        if other.k != self.k {
            if self.problem.is_none() {
                self.problem = Some(format!(
                    "merged a Hessian of {} features into one of {}",
                    other.k, self.k
                ));
            }
            return;
        }
        if let (None, Some(p)) = (&self.problem, &other.problem) {
            self.problem = Some(p.clone());
        }
        self.sum += &other.sum;
        self.rows += other.rows;
    }

    /// `2 sum x x^T` with both triangles filled in.
    fn full_sum(&self) -> Mat<f64> {
        let mut full = self.sum.clone();
        for j in 0..self.k {
            for i in j + 1..self.k {
                full[(j, i)] = full[(i, j)];
            }
        }
        full
    }

    /// `H = 2/N sum x x^T`.
    #[cfg(test)]
    fn mean(&self) -> Mat<f64> {
        let inv = 1.0 / self.rows as f64;
        let full = self.full_sum();
        Mat::from_fn(self.k, self.k, |i, j| full[(i, j)] * inv)
    }
}

/// GPTQ settings.
#[derive(Debug, Clone, PartialEq)]
pub struct GptqConfig {
    /// Dampening added to the Hessian's diagonal, as a fraction of its mean diagonal.
    pub damp: f64,
    /// Columns per lazy-update block.
    pub block_size: usize,
    /// Process columns in descending `diag(H)` order (scales stay per original group).
    pub act_order: bool,
    /// Width of the codes.
    pub bits: Bits,
}

impl Default for GptqConfig {
    fn default() -> Self {
        GptqConfig {
            damp: 0.01,
            block_size: 128,
            act_order: true,
            bits: Bits::FOUR,
        }
    }
}

/// The quantized matrix and how many input features never saw a non-zero activation (their
/// weights are quantized as zero).
#[derive(Debug, Clone, PartialEq)]
pub struct GptqResult {
    pub q: QuantMatrix,
    pub dead_columns: usize,
}

/// The upper triangular `U` with `(H + damp I)^-1 = U^T U`, row-major `[k][k]` in f32 (zeros below
/// the diagonal), and the damping that made the factorization succeed.
///
/// With `J` the reversal permutation and `J H J = L L^T`, `H = R R^T` for the upper triangular
/// `R = J L J`, so `H^-1 = (R^-1)^T R^-1` and `U = R^-1 = J L^-1 J`: one Cholesky and one
/// triangular inverse, instead of the inverse followed by a second Cholesky.
///
/// On a failed factorization the damping grows tenfold (from at least 0.001 of the mean diagonal)
/// up to three times before giving up with an error.
fn inverse_upper_factor(tensor: &str, h: &Mat<f64>, damp: f64) -> Result<(Vec<f32>, f64)> {
    let k = h.nrows();
    let mean_diag = (0..k).map(|i| h[(i, i)]).sum::<f64>() / k as f64;
    let mut damp_used = damp;
    let mut last_failure = String::new();
    for attempt in 0..=DAMP_RETRIES {
        if attempt > 0 {
            damp_used = damp.max(RETRY_DAMP_FLOOR) * DAMP_GROWTH.powi(attempt as i32);
            tracing::warn!(
                tensor,
                damp = damp_used,
                "GPTQ: Hessian not positive definite, retrying with more damping"
            );
        }
        let add = damp_used * mean_diag;
        let mut reversed = h.as_ref().reverse_rows_and_cols().to_owned();
        for i in 0..k {
            reversed[(i, i)] += add;
        }
        let factored = reversed.llt(Side::Lower);
        drop(reversed);
        let llt = match factored {
            Ok(llt) => llt,
            Err(e) => {
                last_failure = format!("{e:?}");
                continue;
            }
        };
        let mut l_inv = Mat::<f64>::zeros(k, k);
        invert_lower_triangular(l_inv.as_mut(), llt.L(), Par::rayon(0));
        drop(llt);
        let mut upper = vec![0.0f32; k * k];
        let mut finite = true;
        for i in 0..k {
            for j in i..k {
                let v = l_inv[(k - 1 - i, k - 1 - j)];
                finite &= v.is_finite();
                upper[i * k + j] = v as f32;
            }
            finite &= upper[i * k + i] > 0.0;
        }
        if finite {
            return Ok((upper, damp_used));
        }
        last_failure = "inverse factor not finite".to_string();
    }
    Err(Error::Quant(format!(
        "{tensor}: GPTQ Hessian is not positive definite even with damping {damp_used} of its \
         mean diagonal ({last_failure}); quantize this tensor with round-to-nearest instead"
    )))
}

/// `W[:, c1..c2] -= Err[:, e1..e2] @ U[u1..u1 + (e2 - e1), c1..c2]`, with `W` row-major
/// `[n][k]`, `Err` row-major with row stride `err_stride`, and `U` row-major `[k][k]`.
#[allow(clippy::too_many_arguments)]
fn lazy_update(
    w: &mut [f32],
    k: usize,
    c1: usize,
    c2: usize,
    err: &[f32],
    err_stride: usize,
    e1: usize,
    e2: usize,
    upper: &[f32],
    u1: usize,
) {
    let n = w.len() / k;
    let depth = e2 - e1;
    // A row-major view built as the transpose of a column-major one: faer 0.22's
    // `from_row_major_slice_with_stride_mut` sets its strides the column-major way round.
    let dst = MatMut::from_column_major_slice_with_stride_mut(&mut w[c1..], c2 - c1, n, k)
        .transpose_mut();
    let lhs = MatRef::from_row_major_slice_with_stride(&err[e1..], n, depth, err_stride);
    let rhs = MatRef::from_row_major_slice_with_stride(&upper[u1 * k + c1..], depth, c2 - c1, k);
    matmul(dst, Accum::Add, lhs, rhs, -1.0f32, Par::rayon(0));
}

/// GPTQ quantization of a Hugging Face oriented weight `[n][k]` (out, in) against the Hessian of
/// its layer's inputs.
///
/// Errors (naming the tensor) on bad shapes, non-finite weights, a Hessian of another width, with
/// no rows or with non-finite entries, and when the Hessian stays indefinite after extra
/// damping; each of these can be answered by falling back to [`super::rtn()`].
pub fn gptq(
    tensor: &str,
    weight_out_in: &[f32],
    n: usize,
    k: usize,
    h: &Hessian,
    cfg: &GptqConfig,
) -> Result<GptqResult> {
    check_weight(tensor, weight_out_in, n, k)?;
    if let Some(problem) = &h.problem {
        return Err(Error::Quant(format!("{tensor}: GPTQ Hessian: {problem}")));
    }
    if h.k != k {
        return Err(Error::Quant(format!(
            "{tensor}: GPTQ Hessian has {} features but the weight has {k} inputs",
            h.k
        )));
    }
    if h.rows == 0 {
        return Err(Error::Quant(format!(
            "{tensor}: GPTQ Hessian has no calibration rows"
        )));
    }
    if !(cfg.damp.is_finite() && cfg.damp >= 0.0) || cfg.block_size == 0 {
        return Err(Error::Quant(format!(
            "{tensor}: GPTQ settings invalid (damp {} must be finite and >= 0, block size {} \
             positive)",
            cfg.damp, cfg.block_size
        )));
    }

    let sum = h.full_sum();
    if (0..k).any(|j| sum.col_as_slice(j).iter().any(|v| !v.is_finite())) {
        return Err(Error::Quant(format!(
            "{tensor}: GPTQ Hessian has non-finite entries (non-finite activations?)"
        )));
    }
    let inv_rows = 1.0 / h.rows as f64;
    let mut diag: Vec<f64> = (0..k).map(|i| sum[(i, i)] * inv_rows).collect();

    // Inputs that never fire carry no information: their weights become zero (and so cost
    // nothing to quantize), and a unit diagonal keeps H invertible.
    let mut w = weight_out_in.to_vec();
    let dead: Vec<usize> = (0..k).filter(|&i| diag[i] == 0.0).collect();
    for &i in &dead {
        diag[i] = 1.0;
        for row in w.chunks_exact_mut(k) {
            row[i] = 0.0;
        }
    }

    // Static groups: scales from the (dead-zeroed) weight in original column order.
    let bits = cfg.bits;
    let scales = group_scales(tensor, &w, n, k, bits)?;
    let groups = k / GROUP_SIZE;
    // Per output row, its scales as f32 in group order ([n][groups]).
    let row_scales: Vec<f32> = (0..n)
        .flat_map(|c| (0..groups).map(move |g| (g, c)))
        .map(|(g, c)| scales[g * n + c].to_f32())
        .collect();

    let mut perm: Vec<usize> = (0..k).collect();
    if cfg.act_order {
        // Descending diagonal; ties keep the original order so the result is deterministic.
        perm.sort_by(|&a, &b| diag[b].total_cmp(&diag[a]).then(a.cmp(&b)));
    }
    // H = 2/N sum x x^T in processing order, dead diagonals set to one.
    let mut hp = Mat::<f64>::zeros(k, k);
    for (j, &pj) in perm.iter().enumerate() {
        let src = sum.col_as_slice(pj);
        for (dst, &pi) in hp.col_as_slice_mut(j).iter_mut().zip(&perm) {
            *dst = src[pi] * inv_rows;
        }
        hp[(j, j)] = diag[pj];
    }
    // Large k makes these k x k f64 matrices hundreds of MB: keep only one alive at a time.
    drop(sum);
    let (upper, _damp_used) = inverse_upper_factor(tensor, &hp, cfg.damp)?;
    drop(hp);
    let group_of: Vec<usize> = perm.iter().map(|&p| p / GROUP_SIZE).collect();

    // Weights with columns in processing order, [n][k].
    let mut wp = vec![0.0f32; n * k];
    wp.par_chunks_exact_mut(k)
        .zip(w.par_chunks_exact(k))
        .for_each(|(dst, src)| {
            for (d, &p) in dst.iter_mut().zip(&perm) {
                *d = src[p];
            }
        });
    drop(w);

    let mut codes_p = vec![0u8; n * k];
    let block = cfg.block_size.min(k);
    let mut err = vec![0.0f32; n * block];
    for i1 in (0..k).step_by(block) {
        let i2 = (i1 + block).min(k);
        // The block is swept in sub-blocks: column by column inside one (each row
        // independently), then one small product carries the sub-block's errors to the rest of
        // the block, so most of the arithmetic runs as matrix products.
        for j1 in (i1..i2).step_by(SUB_BLOCK) {
            let j2 = (j1 + SUB_BLOCK).min(i2);
            wp.par_chunks_exact_mut(k)
                .zip(codes_p.par_chunks_exact_mut(k))
                .zip(err.par_chunks_exact_mut(block))
                .zip(row_scales.par_chunks_exact(groups))
                .for_each(|(((row, codes), row_err), scales)| {
                    for p in j1..j2 {
                        let s = scales[group_of[p]];
                        let v = row[p];
                        let code = quantize_code(v, s, bits);
                        codes[p] = code;
                        let e = (v - code_value(code, bits) * s) / upper[p * k + p];
                        row_err[p - i1] = e;
                        let u = &upper[p * k + p + 1..p * k + j2];
                        for (x, &uv) in row[p + 1..j2].iter_mut().zip(u) {
                            *x -= e * uv;
                        }
                    }
                });
            if j2 < i2 {
                lazy_update(
                    &mut wp,
                    k,
                    j2,
                    i2,
                    &err,
                    block,
                    j1 - i1,
                    j2 - i1,
                    &upper,
                    j1,
                );
            }
        }
        // Lazy batch update of all later columns: W[:, i2..] -= Err @ U[i1..i2, i2..].
        if i2 < k {
            lazy_update(&mut wp, k, i2, k, &err, block, 0, i2 - i1, &upper, i1);
        }
    }

    // Back to original column order, then to [k][n].
    let mut codes = vec![0u8; n * k];
    codes
        .par_chunks_exact_mut(k)
        .zip(codes_p.par_chunks_exact(k))
        .for_each(|(dst, src)| {
            for (&c, &p) in src.iter().zip(&perm) {
                dst[p] = c;
            }
        });
    Ok(GptqResult {
        q: QuantMatrix {
            k,
            n,
            bits,
            q: transpose(&codes, n, k),
            scales,
        },
        dead_columns: dead.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::{marlin_pack, marlin_unpack, output_rel_error, rtn};
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn normal(rng: &mut ChaCha8Rng) -> f32 {
        // Box-Muller.
        let u1: f32 = rng.random_range(f32::EPSILON..1.0);
        let u2: f32 = rng.random_range(0.0..1.0);
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    /// Activations with strong correlations and uneven channel scales: `X = Z A + noise`, with `Z`
    /// of low width, and a few channels amplified (as real MLP inputs have outlier features).
    struct Activations {
        mix: Vec<f32>,
        channel_scale: Vec<f32>,
        width: usize,
        k: usize,
    }

    impl Activations {
        fn new(rng: &mut ChaCha8Rng, k: usize, width: usize) -> Self {
            let mix = (0..width * k).map(|_| normal(rng)).collect();
            let channel_scale = (0..k)
                .map(|_| {
                    if rng.random_range(0..16) == 0 {
                        8.0
                    } else {
                        1.0
                    }
                })
                .collect();
            Activations {
                mix,
                channel_scale,
                width,
                k,
            }
        }

        fn sample(&self, rng: &mut ChaCha8Rng, rows: usize) -> Vec<f32> {
            let mut x = vec![0.0f32; rows * self.k];
            for row in x.chunks_exact_mut(self.k) {
                let z: Vec<f32> = (0..self.width).map(|_| normal(rng)).collect();
                for (j, v) in row.iter_mut().enumerate() {
                    let mut acc = 0.2 * normal(rng);
                    for (t, &zt) in z.iter().enumerate() {
                        acc += zt * self.mix[t * self.k + j];
                    }
                    *v = acc * self.channel_scale[j];
                }
            }
            x
        }
    }

    fn random_weight(rng: &mut ChaCha8Rng, n: usize, k: usize) -> Vec<f32> {
        (0..n * k).map(|_| 0.02 * normal(rng)).collect()
    }

    /// The Hessian of `rows` rows of [`Activations`] of `width` and a random `[n][k]` weight,
    /// drawn in that order from `seed`.
    fn calibrated_weight(
        seed: u64,
        n: usize,
        k: usize,
        width: usize,
        rows: usize,
    ) -> (Hessian, Vec<f32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let acts = Activations::new(&mut rng, k, width);
        let mut h = Hessian::new(k);
        h.add_rows(&acts.sample(&mut rng, rows), rows);
        (h, random_weight(&mut rng, n, k))
    }

    #[test]
    fn gptq_beats_rtn_on_held_out_correlated_activations() {
        let (n, k) = (128, 256);
        let mut reductions = Vec::new();
        for seed in 0..4u64 {
            let mut rng = ChaCha8Rng::seed_from_u64(100 + seed);
            let acts = Activations::new(&mut rng, k, 24);
            let w = random_weight(&mut rng, n, k);
            let calib = acts.sample(&mut rng, 768);
            let held_out = acts.sample(&mut rng, 256);
            let mut h = Hessian::new(k);
            // Two shards merged, to exercise merge.
            let mut h2 = Hessian::new(k);
            h.add_rows(&calib[..300 * k], 300);
            h2.add_rows(&calib[300 * k..], 468);
            h.merge(&h2);
            assert_eq!(h.rows(), 768);

            let base =
                output_rel_error(&w, &rtn("w", &w, n, k, Bits::FOUR).unwrap(), &held_out, 256);
            for act_order in [true, false] {
                let cfg = GptqConfig {
                    act_order,
                    ..GptqConfig::default()
                };
                let res = gptq("w", &w, n, k, &h, &cfg).unwrap();
                assert_eq!(res.dead_columns, 0);
                res.q.validate("w").unwrap();
                let e = output_rel_error(&w, &res.q, &held_out, 256);
                assert!(
                    e < 0.9 * base,
                    "seed {seed} act_order {act_order}: GPTQ {e:.5} vs RTN {base:.5}"
                );
                reductions.push((act_order, 1.0 - e / base));
            }
        }
        for act_order in [true, false] {
            let picked: Vec<f64> = reductions
                .iter()
                .filter(|(a, _)| *a == act_order)
                .map(|(_, r)| *r)
                .collect();
            let mean = picked.iter().sum::<f64>() / picked.len() as f64;
            eprintln!(
                "GPTQ (act_order {act_order}) held-out output error vs RTN: mean reduction {:.1}%",
                100.0 * mean
            );
        }
    }

    #[test]
    fn lazy_batch_updates_match_unblocked_sweep() {
        // Blocking only reorders the same updates: any block size gives the same codes, up to
        // the odd code flipped by f32 rounding differences near a rounding boundary.
        let (n, k) = (128, 384);
        let (h, w) = calibrated_weight(6, n, k, 24, 600);
        let whole = GptqConfig {
            block_size: k,
            ..GptqConfig::default()
        };
        let reference = gptq("w", &w, n, k, &h, &whole).unwrap().q;
        for block_size in [32, 100, 128] {
            let cfg = GptqConfig {
                block_size,
                ..GptqConfig::default()
            };
            let q = gptq("w", &w, n, k, &h, &cfg).unwrap().q;
            let differing = q.q.iter().zip(&reference.q).filter(|(a, b)| a != b).count();
            assert!(
                differing * 1000 <= q.q.len(),
                "block {block_size}: {differing} of {} codes differ",
                q.q.len()
            );
        }
    }

    /// Textbook GPTQ/OBQ in f64 without the Cholesky reformulation or blocking: after quantizing
    /// column p, the remaining weights move by `-err * Hinv[p, :] / Hinv[p, p]` and column p is
    /// eliminated from the explicit inverse Hessian.
    #[allow(clippy::needless_range_loop)]
    fn reference_gptq(w: &[f32], n: usize, k: usize, h: &Hessian, order: &[usize]) -> Vec<u8> {
        let mut hm = h.mean();
        let mean_diag = (0..k).map(|i| hm[(i, i)]).sum::<f64>() / k as f64;
        for i in 0..k {
            hm[(i, i)] += 0.01 * mean_diag;
        }
        // Gauss-Jordan inverse.
        let mut a: Vec<Vec<f64>> = (0..k)
            .map(|i| (0..k).map(|j| hm[(i, j)]).collect())
            .collect();
        let mut inv: Vec<Vec<f64>> = (0..k)
            .map(|i| (0..k).map(|j| f64::from(u8::from(i == j))).collect())
            .collect();
        for col in 0..k {
            let pivot = a[col][col];
            for j in 0..k {
                a[col][j] /= pivot;
                inv[col][j] /= pivot;
            }
            for row in 0..k {
                if row != col {
                    let f = a[row][col];
                    for j in 0..k {
                        a[row][j] -= f * a[col][j];
                        inv[row][j] -= f * inv[col][j];
                    }
                }
            }
        }
        let scales = rtn("ref", w, n, k, Bits::FOUR).unwrap().scales;
        let mut wd: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
        let mut codes = vec![0u8; k * n];
        let mut remaining = vec![true; k];
        for &p in order {
            let d = inv[p][p];
            for c in 0..n {
                let s = scales[(p / GROUP_SIZE) * n + c].to_f32();
                let code = quantize_code(wd[c * k + p] as f32, s, Bits::FOUR);
                codes[p * n + c] = code;
                let err = (wd[c * k + p] - f64::from(code_value(code, Bits::FOUR) * s)) / d;
                for j in 0..k {
                    if remaining[j] && j != p {
                        wd[c * k + j] -= err * inv[p][j];
                    }
                }
            }
            remaining[p] = false;
            let row_p = inv[p].clone();
            for i in 0..k {
                let f = inv[i][p] / d;
                for j in 0..k {
                    inv[i][j] -= f * row_p[j];
                }
            }
        }
        codes
    }

    #[test]
    fn matches_textbook_gptq() {
        let (n, k) = (32, 256);
        let (h, w) = calibrated_weight(5, n, k, 24, 500);
        for act_order in [false, true] {
            let cfg = GptqConfig {
                act_order,
                block_size: 64,
                ..GptqConfig::default()
            };
            let got = gptq("w", &w, n, k, &h, &cfg).unwrap().q;
            let hm = h.mean();
            let mut order: Vec<usize> = (0..k).collect();
            if act_order {
                order.sort_by(|&a, &b| hm[(b, b)].total_cmp(&hm[(a, a)]).then(a.cmp(&b)));
            }
            let expected = reference_gptq(&w, n, k, &h, &order);
            let differing = got.q.iter().zip(&expected).filter(|(a, b)| a != b).count();
            assert!(
                differing * 200 <= expected.len(),
                "act_order {act_order}: {differing} of {} codes differ from the textbook sweep",
                expected.len()
            );
        }
    }

    #[test]
    fn hessian_is_twice_the_mean_outer_product() {
        let (k, rows) = (48, 600);
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let x: Vec<f32> = (0..rows * k).map(|_| normal(&mut rng)).collect();
        let mut whole = Hessian::new(k);
        whole.add_rows(&x, rows);
        // Shards of uneven size (one spanning several accumulation chunks) merged together.
        let mut merged = Hessian::new(k);
        let mut shard = Hessian::new(k);
        merged.add_rows(&x[..7 * k], 7);
        shard.add_rows(&x[7 * k..], rows - 7);
        merged.merge(&shard);
        assert_eq!(
            (whole.rows(), merged.rows(), whole.k()),
            (rows as u64, rows as u64, k)
        );
        let (hw, hm) = (whole.mean(), merged.mean());
        for i in 0..k {
            for j in 0..k {
                let direct = (0..rows)
                    .map(|r| f64::from(x[r * k + i]) * f64::from(x[r * k + j]))
                    .sum::<f64>()
                    * 2.0
                    / rows as f64;
                assert!((hw[(i, j)] - direct).abs() < 1e-9, "({i},{j})");
                assert!((hm[(i, j)] - direct).abs() < 1e-9, "({i},{j})");
            }
        }
    }

    #[test]
    fn dead_columns_are_zeroed_and_counted() {
        let (n, k) = (64, 256);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let acts = Activations::new(&mut rng, k, 16);
        let mut x = acts.sample(&mut rng, 400);
        let dead = [3usize, 130, 131, 255];
        for row in x.chunks_exact_mut(k) {
            for &d in &dead {
                row[d] = 0.0;
            }
        }
        let mut h = Hessian::new(k);
        h.add_rows(&x, 400);
        let w = random_weight(&mut rng, n, k);
        let res = gptq("moe.down", &w, n, k, &h, &GptqConfig::default()).unwrap();
        assert_eq!(res.dead_columns, dead.len());
        let deq = res.q.dequantize_out_in();
        for c in 0..n {
            for &d in &dead {
                assert_eq!(res.q.q[d * n + c], 8);
                assert_eq!(deq[c * k + d], 0.0);
            }
        }
        // Live columns still carry the weights.
        let live_err = output_rel_error(&w, &res.q, &x, 400);
        assert!(live_err < 0.2, "{live_err}");
    }

    #[test]
    fn gptq_result_round_trips_through_marlin() {
        let (n, k) = (192, 384);
        let (h, w) = calibrated_weight(8, n, k, 20, 500);
        let res = gptq("gate_up", &w, n, k, &h, &GptqConfig::default()).unwrap();
        let packed = marlin_pack(&res.q).unwrap();
        let back = marlin_unpack(k, n, &packed.qweight, &packed.scales).unwrap();
        assert_eq!(back, res.q);
        // Static groups: the scales are exactly round-to-nearest's.
        assert_eq!(
            res.q.scales,
            rtn("gate_up", &w, n, k, Bits::FOUR).unwrap().scales
        );
    }

    #[test]
    fn bad_inputs_are_named_errors() {
        let (n, k) = (64, 128);
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let w = random_weight(&mut rng, n, k);
        let cfg = GptqConfig::default();
        let error = |name: &str, h: &Hessian| {
            gptq(name, &w, n, k, h, &cfg)
                .expect_err("refused")
                .to_string()
        };

        let empty = Hessian::new(k);
        let msg = error("a.weight", &empty);
        assert!(
            msg.contains("a.weight") && msg.contains("no calibration rows"),
            "{msg}"
        );

        let other = Hessian::new(256);
        let msg = error("b.weight", &other);
        assert!(msg.contains("b.weight") && msg.contains("256"), "{msg}");

        let mut short = Hessian::new(k);
        short.add_rows(&w[..k * 3 - 1], 3);
        let msg = error("c.weight", &short);
        assert!(
            msg.contains("c.weight") && msg.contains("add_rows"),
            "{msg}"
        );

        let mut merged = Hessian::new(k);
        merged.add_rows(&w[..k * 4], 4);
        merged.merge(&other);
        assert!(gptq("d.weight", &w, n, k, &merged, &cfg).is_err());

        let mut nan = Hessian::new(k);
        let mut x = w[..k * 4].to_vec();
        x[5] = f32::NAN;
        nan.add_rows(&x, 4);
        let msg = error("e.weight", &nan);
        assert!(
            msg.contains("e.weight") && msg.contains("non-finite"),
            "{msg}"
        );
    }

    #[test]
    fn indefinite_hessian_retries_then_fails() {
        let k = 64;
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        // A Gram matrix (mean diagonal about 1) minus a small multiple of the identity: one
        // negative eigenvalue at least, which the default 1% damping cannot fix but a retry can.
        let a = Mat::<f64>::from_fn(k, 8, |_, _| f64::from(normal(&mut rng)) / 8f64.sqrt());
        let gram = &a * a.transpose();
        let shifted =
            Mat::<f64>::from_fn(k, k, |i, j| gram[(i, j)] - if i == j { 0.05 } else { 0.0 });
        let (upper, damp) = inverse_upper_factor("t", &shifted, 0.01).unwrap();
        assert!(damp > 0.01, "{damp}");
        // U^T U inverts the damped matrix.
        let mean_diag = (0..k).map(|i| shifted[(i, i)]).sum::<f64>() / k as f64;
        let u = Mat::<f64>::from_fn(k, k, |i, j| f64::from(upper[i * k + j]));
        let damped = Mat::<f64>::from_fn(k, k, |i, j| {
            shifted[(i, j)] + if i == j { damp * mean_diag } else { 0.0 }
        });
        let product = &(u.transpose() * &u) * &damped;
        for i in 0..k {
            for j in 0..k {
                let expect = if i == j { 1.0 } else { 0.0 };
                assert!(
                    (product[(i, j)] - expect).abs() < 1e-3,
                    "({i},{j}) {}",
                    product[(i, j)]
                );
            }
        }
        // Far from positive definite: every retry fails and the error names the tensor.
        let negative =
            Mat::<f64>::from_fn(k, k, |i, j| gram[(i, j)] - if i == j { 100.0 } else { 0.0 });
        let msg = inverse_upper_factor("experts.3.up", &negative, 0.01)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("experts.3.up") && msg.contains("round-to-nearest"),
            "{msg}"
        );
    }
}
