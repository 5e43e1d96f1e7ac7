//! Round-to-nearest quantization and the scale and code rules GPTQ (in specter-convert) shares.

use half::f16;
use rayon::prelude::*;

use super::{transpose, Bits, QuantMatrix, GROUP_SIZE};
use crate::{Error, Result};

/// The f16 scale of a group whose largest magnitude is `max_abs` (finite, non-negative).
///
/// `max_abs / top` rounded to f16, `top` being the largest positive level (`2^(b-1) - 1`: 7 at 4
/// bits); an all-zero group gets 1.0 (any positive value dequantizes its zero codes to exactly
/// zero); a group so small its scale would underflow f16 gets the smallest positive subnormal, and
/// a scale that f16 rounding left too small for `max_abs` to be within half a step of the top code
/// is moved up one f16 step at a time. Returns `None` when the scale overflows f16 (weights beyond
/// about 458000 in magnitude at 4 bits).
pub(crate) fn group_scale(max_abs: f32, bits: Bits) -> Option<f16> {
    if max_abs == 0.0 {
        return Some(f16::ONE);
    }
    let top = bits.top_level();
    let mut s = f16::from_f32(max_abs / top);
    if s.to_f32() == 0.0 {
        s = f16::from_bits(1);
    }
    // Positive f16 values are ordered like their bit patterns, so +1 is the next value up.
    while s.is_finite() && max_abs / s.to_f32() > top + 0.5 {
        s = f16::from_bits(s.to_bits() + 1);
    }
    s.is_finite().then_some(s)
}

/// Adding and subtracting 1.5 * 2^23 rounds an f32 of magnitude below 2^22 to an integer, ties to
/// even, without a call into libm (the baseline x86-64 target has no rounding instruction).
const ROUNDING_MAGIC: f32 = 12_582_912.0;

/// The code of width `bits` nearest to `w` at scale `s` (positive, finite):
/// `clamp(round(w / s) + 2^(b-1), 0, 2^b - 1)`, ties rounding to even (at 4 bits,
/// `clamp(round(w / s) + 8, 0, 15)`).
#[inline(always)]
pub fn quantize_code(w: f32, s: f32, bits: Bits) -> u8 {
    let zero = f32::from(bits.zero_code());
    // Clamping first keeps the magic-number rounding in range; it cannot change the result.
    let x = (w / s).clamp(-zero - 1.0, zero + 1.0);
    let rounded = (x + ROUNDING_MAGIC) - ROUNDING_MAGIC;
    (rounded + zero).clamp(0.0, f32::from(bits.max_code())) as u8
}

/// Checks the inputs every quantizer shares: the buffer length, `k` a positive multiple of the
/// group size, `n` positive, and every weight finite.
pub fn check_weight(tensor: &str, weight_out_in: &[f32], n: usize, k: usize) -> Result<()> {
    if n == 0 || k == 0 || !k.is_multiple_of(GROUP_SIZE) {
        return Err(Error::Quant(format!(
            "{tensor}: shape [{n}, {k}] (out, in) is not quantizable: input features must be a \
             positive multiple of {GROUP_SIZE} and output features positive"
        )));
    }
    let expected = n
        .checked_mul(k)
        .ok_or_else(|| Error::Quant(format!("{tensor}: shape [{n}, {k}] overflows")))?;
    if weight_out_in.len() != expected {
        return Err(Error::Quant(format!(
            "{tensor}: {} weights for shape [{n}, {k}] (out, in), expected {expected}",
            weight_out_in.len()
        )));
    }
    if let Some(pos) = weight_out_in.iter().position(|w| !w.is_finite()) {
        return Err(Error::Quant(format!(
            "{tensor}: weight at out {} in {} is not finite ({})",
            pos / k,
            pos % k,
            weight_out_in[pos]
        )));
    }
    Ok(())
}

/// Scales for every (group, output row) of an HF-oriented weight `[n][k]` at width `bits`,
/// returned row-major `[k / 128][n]`.
pub fn group_scales(
    tensor: &str,
    weight_out_in: &[f32],
    n: usize,
    k: usize,
    bits: Bits,
) -> Result<Vec<f16>> {
    let groups = k / GROUP_SIZE;
    // Computed per output row (contiguous in the HF layout), then transposed to [groups][n].
    let per_row: Vec<Vec<f16>> = weight_out_in
        .par_chunks_exact(k)
        .enumerate()
        .map(|(row, w)| {
            w.chunks_exact(GROUP_SIZE)
                .enumerate()
                .map(|(g, group)| {
                    let max_abs = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    group_scale(max_abs, bits).ok_or_else(|| {
                        Error::Quant(format!(
                            "{tensor}: out {row} group {g}: max |w| = {max_abs} needs a scale \
                             beyond the f16 range"
                        ))
                    })
                })
                .collect::<Result<Vec<f16>>>()
        })
        .collect::<Result<_>>()?;
    let mut scales = vec![f16::ZERO; groups * n];
    for (c, row) in per_row.iter().enumerate() {
        for (g, &s) in row.iter().enumerate() {
            scales[g * n + c] = s;
        }
    }
    Ok(scales)
}

/// Round-to-nearest quantization of a Hugging Face oriented weight `[n][k]` (out, in) to codes of
/// width `bits`.
///
/// Every weight is rounded to the nearest code at its group's f16 scale, so each dequantized
/// weight is within half a scale of the original.
pub fn rtn(
    tensor: &str,
    weight_out_in: &[f32],
    n: usize,
    k: usize,
    bits: Bits,
) -> Result<QuantMatrix> {
    check_weight(tensor, weight_out_in, n, k)?;
    let scales = group_scales(tensor, weight_out_in, n, k, bits)?;
    // Codes in HF orientation first (rows contiguous), then transposed to [k][n].
    let mut codes_out_in = vec![0u8; n * k];
    codes_out_in
        .par_chunks_exact_mut(k)
        .zip(weight_out_in.par_chunks_exact(k))
        .enumerate()
        .for_each(|(c, (codes, w))| {
            for (g, (cg, wg)) in codes
                .chunks_exact_mut(GROUP_SIZE)
                .zip(w.chunks_exact(GROUP_SIZE))
                .enumerate()
            {
                let s = scales[g * n + c].to_f32();
                for (q, &v) in cg.iter_mut().zip(wg) {
                    *q = quantize_code(v, s, bits);
                }
            }
        });
    Ok(QuantMatrix {
        k,
        n,
        bits,
        q: transpose(&codes_out_in, n, k),
        scales,
    })
}

#[cfg(test)]
mod tests {
    use super::super::code_value;
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random_weight(rng: &mut ChaCha8Rng, n: usize, k: usize) -> Vec<f32> {
        (0..n * k)
            .map(|_| rng.random_range(-1.0f32..1.0) * 0.05)
            .collect()
    }

    #[test]
    fn rtn_error_within_half_a_scale_and_codes_in_range() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for &(n, k) in &[(64, 128), (96, 256), (128, 384)] {
            let mut w = random_weight(&mut rng, n, k);
            // One group per shape with a wide dynamic range, one with a tiny one.
            w[0] = 3.0;
            for v in &mut w[k..k + GROUP_SIZE] {
                *v *= 1e-6;
            }
            let m = rtn("test.weight", &w, n, k, Bits::FOUR).unwrap();
            assert_eq!((m.k, m.n), (k, n));
            m.validate("test.weight").unwrap();
            assert!(m.q.iter().all(|&q| q <= 15));
            let deq = m.dequantize_out_in();
            for c in 0..n {
                for r in 0..k {
                    let s = m.scales[(r / GROUP_SIZE) * n + c].to_f32();
                    assert!(s > 0.0 && s.is_finite());
                    let err = (w[c * k + r] - deq[c * k + r]).abs();
                    assert!(
                        err <= s * 0.5 * (1.0 + 1e-5),
                        "out {c} in {r}: error {err} exceeds half the scale {s}"
                    );
                }
            }
            // The scale is the group maximum over 7, to f16 precision.
            for c in 0..n {
                for g in 0..k / GROUP_SIZE {
                    let max = w[c * k + g * GROUP_SIZE..c * k + (g + 1) * GROUP_SIZE]
                        .iter()
                        .fold(0.0f32, |a, v| a.max(v.abs()));
                    let s = m.scales[g * n + c].to_f32();
                    let ideal = max / 7.0;
                    assert!(
                        (s - ideal).abs() <= ideal * 2e-3 + 1.2e-7,
                        "scale {s} vs max/7 {ideal}"
                    );
                }
            }
        }
    }

    #[test]
    fn quantize_code_rounds_to_nearest_even_and_clamps() {
        let cases = [
            (0.0, 8),
            (0.49, 8),
            (0.5, 8),
            (0.51, 9),
            (1.5, 10),
            (2.5, 10),
            (-0.5, 8),
            (-1.5, 6),
            (-2.5, 6),
            (6.9, 15),
            (7.5, 15),
            (100.0, 15),
            (-8.0, 0),
            (-7.6, 0),
            (-7.4, 1),
            (-1e9, 0),
        ];
        for (x, code) in cases {
            assert_eq!(quantize_code(x * 0.25, 0.25, Bits::FOUR), code, "{x}");
        }
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        for _ in 0..10_000 {
            let x: f32 = rng.random_range(-8.4f32..7.4);
            let q = quantize_code(x, 1.0, Bits::FOUR);
            assert!((x - code_value(q, Bits::FOUR)).abs() <= 0.5, "{x} -> {q}");
        }
    }

    #[test]
    fn every_width_rounds_within_half_a_step_and_uses_its_top_code() {
        let mut rng = ChaCha8Rng::seed_from_u64(14);
        let (n, k) = (64, 256);
        for bits in [2, 3, 4, 8] {
            let bits = Bits::new(bits).unwrap();
            let w = random_weight(&mut rng, n, k);
            let m = rtn("w", &w, n, k, bits).unwrap();
            m.validate("w").unwrap();
            assert_eq!(
                m.q.iter().copied().max(),
                Some(bits.max_code()),
                "{bits}-bit"
            );
            let deq = m.dequantize_out_in();
            let mut err2 = 0f64;
            let mut norm2 = 0f64;
            for c in 0..n {
                for r in 0..k {
                    let s = m.scales[(r / GROUP_SIZE) * n + c].to_f32();
                    let err = (w[c * k + r] - deq[c * k + r]).abs();
                    assert!(err <= s * 0.5 * (1.0 + 1e-5), "{bits}-bit: {err} vs {s}");
                    err2 += f64::from(err).powi(2);
                    norm2 += f64::from(w[c * k + r]).powi(2);
                }
            }
            // Each bit halves the step: the relative error falls with the width.
            let rel = (err2 / norm2).sqrt();
            let bound = [0.0, 0.0, 0.75, 0.35, 0.16, 0.0, 0.0, 0.0, 0.011][bits.get() as usize];
            assert!(rel < bound, "{bits}-bit relative error {rel}");
        }
        assert!(Bits::new(5).is_err() && Bits::new(16).is_err());
        assert_eq!(quantize_code(-1e9, 1.0, Bits::EIGHT), 0);
        assert_eq!(quantize_code(1e9, 1.0, Bits::EIGHT), 255);
        assert_eq!(quantize_code(0.0, 1.0, Bits::new(2).unwrap()), 2);
    }

    #[test]
    fn rtn_zero_group_gets_unit_scale_and_zero_codes() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let (n, k) = (64, 256);
        let mut w = random_weight(&mut rng, n, k);
        for v in &mut w[5 * k + GROUP_SIZE..5 * k + 2 * GROUP_SIZE] {
            *v = 0.0;
        }
        let m = rtn("zero.weight", &w, n, k, Bits::FOUR).unwrap();
        assert_eq!(m.scales[n + 5], f16::ONE);
        for r in GROUP_SIZE..2 * GROUP_SIZE {
            assert_eq!(m.q[r * n + 5], 8);
        }
        let deq = m.dequantize_out_in();
        assert!(deq[5 * k + GROUP_SIZE..5 * k + 2 * GROUP_SIZE]
            .iter()
            .all(|&v| v == 0.0));
    }

    #[test]
    fn tiny_and_huge_groups() {
        // A magnitude whose scale underflows f16 and one whose scale is a coarse subnormal.
        for &max in &[1e-12f32, 3e-7, 1e-3, 400.0, 60000.0] {
            let s = group_scale(max, Bits::FOUR).unwrap();
            assert!(s.to_f32() > 0.0);
            assert!(max / s.to_f32() <= 7.5, "max {max} scale {s}");
        }
        assert!(group_scale(1e6, Bits::FOUR).is_none());
    }

    #[test]
    fn rtn_shape_errors_name_the_tensor() {
        let w = vec![0.5f32; 64 * 100];
        let err = rtn(
            "layers.3.mlp.experts.7.up_proj.weight",
            &w,
            64,
            100,
            Bits::FOUR,
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("layers.3.mlp.experts.7.up_proj.weight"),
            "{msg}"
        );
        assert!(msg.contains("multiple of 128"), "{msg}");

        let err = rtn("short.weight", &w[..10], 64, 128, Bits::FOUR).unwrap_err();
        assert!(err.to_string().contains("short.weight"));

        let mut w = vec![0.5f32; 64 * 128];
        w[130] = f32::NAN;
        let msg = rtn("nan.weight", &w, 64, 128, Bits::FOUR)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("nan.weight") && msg.contains("out 1 in 2"),
            "{msg}"
        );
    }
}
