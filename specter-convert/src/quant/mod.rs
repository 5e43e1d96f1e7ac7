//! Quantization as conversion runs it: GPTQ (gptq.rs) and the output error that compares it
//! with round-to-nearest. The INT4 layout itself (codes, scales, Marlin tiles) and round-to-nearest
//! belong to the runtime, which reads them, and are re-exported here: conversion names one module.

mod gptq;

pub use gptq::{gptq, GptqConfig, GptqResult, Hessian};
pub use specter::quant::*;

/// Relative output error of a quantized matrix: `||X W^T - X Q^T||_F / ||X W^T||_F`, where `W` is
/// the original weight in HF orientation `[n][k]`, `Q` the dequantized `q`, and `X` activations
/// row-major `[rows][k]`.
///
/// Returns NaN when the buffer lengths do not match the shapes, 0 when both norms are zero, and
/// infinity when only the reference output is zero.
pub fn output_rel_error(weight_out_in: &[f32], q: &QuantMatrix, x: &[f32], rows: usize) -> f64 {
    let (k, n) = (q.k, q.n);
    if weight_out_in.len() != n * k
        || x.len() != rows * k
        || q.q.len() != n * k
        || q.scales.len() != k / GROUP_SIZE * n
    {
        return f64::NAN;
    }
    let deq = q.dequantize_out_in();
    // The error term is formed from the weight difference (not as a difference of two nearly
    // equal outputs), so f32 products keep about six significant digits of the ratio.
    let w = faer::MatRef::from_column_major_slice(weight_out_in, k, n);
    let diff: Vec<f32> = weight_out_in.iter().zip(&deq).map(|(a, b)| a - b).collect();
    let d = faer::MatRef::from_column_major_slice(&diff, k, n);
    let xm = faer::MatRef::from_row_major_slice(x, rows, k);
    let reference = xm * w;
    let error = xm * d;
    let sum_sq = |m: &faer::Mat<f32>| -> f64 {
        (0..m.ncols())
            .map(|j| {
                m.col_as_slice(j)
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
            })
            .sum()
    };
    let num = sum_sq(&error).sqrt();
    let den = sum_sq(&reference).sqrt();
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        num / den
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn output_rel_error_matches_direct_computation() {
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        let (n, k, rows) = (64, 256, 9);
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let q = rtn("w", &w, n, k, Bits::FOUR).unwrap();
        let deq = q.dequantize_out_in();
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for r in 0..rows {
            for c in 0..n {
                let (mut y, mut yq) = (0.0f64, 0.0f64);
                for i in 0..k {
                    y += f64::from(x[r * k + i]) * f64::from(w[c * k + i]);
                    yq += f64::from(x[r * k + i]) * f64::from(deq[c * k + i]);
                }
                num += (y - yq).powi(2);
                den += y * y;
            }
        }
        let expected = (num / den).sqrt();
        let got = output_rel_error(&w, &q, &x, rows);
        assert!(
            got > 0.0 && (got - expected).abs() <= 1e-5 * expected,
            "{got} vs {expected}"
        );
        // A weight that is exactly its own dequantization has no error.
        assert_eq!(output_rel_error(&deq, &q, &x, rows), 0.0);
        assert!(output_rel_error(&w, &q, &x[1..], rows).is_nan());
    }
}
