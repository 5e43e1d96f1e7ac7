//! The row layout of quantized matrices other than a 4-bit draft's (which is Marlin-tiled): 8-
//! and 4-bit targets and 2- and 3-bit drafts. docs/FORMAT.md defines it; in short, codes are
//! stored per output row (Hugging Face orientation, so a row's inputs are contiguous, as a
//! one-row product reads them):
//!
//! - 8 bits: byte `i` of row `c` is the code of input `i`;
//! - 4 bits: byte `i` holds input `2 i`'s code in its low nibble and input `2 i + 1`'s in its
//!   high one;
//! - 2 and 3 bits: each run of 32 inputs of a row is `b` little-endian u32 words, "bit planes":
//!   bit `j` of word `p` is bit `p` of the code of input `32 * run + j`.
//!
//! A row is `k * b / 8` bytes; `scales` are row-major `[n][k / 128]` f16 (one per output row and
//! group of 128 inputs).

use half::f16;
use rayon::prelude::*;

use super::{code_value, transpose, Bits, QuantMatrix, GROUP_SIZE};
use crate::{Error, Result};

/// Inputs per run of bit-plane words.
const PLANE_RUN: usize = 32;

/// A matrix in the row layout.
#[derive(Debug, Clone, PartialEq)]
pub struct RowsWeight {
    pub k: usize,
    pub n: usize,
    pub bits: Bits,
    /// `[n][k * bits / 8]` bytes.
    pub qweight: Vec<u8>,
    /// `[n][k / 128]`.
    pub scales: Vec<f16>,
}

/// Bytes of one output row of codes.
pub fn row_bytes(k: usize, bits: Bits) -> usize {
    k * bits.get() as usize / 8
}

fn check_lengths(what: &str, k: usize, n: usize, bits: Bits, q: usize, s: usize) -> Result<()> {
    if k == 0 || n == 0 || !k.is_multiple_of(GROUP_SIZE) {
        return Err(Error::Quant(format!(
            "{what}: shape k={k} n={n} (k must be a positive multiple of {GROUP_SIZE}, n positive)"
        )));
    }
    let (want_q, want_s) = (n * row_bytes(k, bits), n * (k / GROUP_SIZE));
    if q != want_q || s != want_s {
        return Err(Error::Quant(format!(
            "{what}: {q} code bytes and {s} scales do not fit a {bits}-bit [{n}, {k}] matrix \
             (expected {want_q} and {want_s})"
        )));
    }
    Ok(())
}

/// Packs a quantized matrix of 2, 3, 4 or 8 bits into the row layout.
pub fn rows_pack(m: &QuantMatrix) -> Result<RowsWeight> {
    m.validate("rows_pack")?;
    let (k, n, bits) = (m.k, m.n, m.bits);
    let codes_out_in = transpose(&m.q, k, n);
    let stride = row_bytes(k, bits);
    let mut qweight = vec![0u8; n * stride];
    qweight
        .par_chunks_exact_mut(stride)
        .zip(codes_out_in.par_chunks_exact(k))
        .for_each(|(dst, codes)| pack_row(codes, bits, dst));
    let groups = k / GROUP_SIZE;
    let mut scales = vec![f16::ZERO; n * groups];
    for g in 0..groups {
        for c in 0..n {
            scales[c * groups + g] = m.scales[g * n + c];
        }
    }
    Ok(RowsWeight {
        k,
        n,
        bits,
        qweight,
        scales,
    })
}

fn pack_row(codes: &[u8], bits: Bits, dst: &mut [u8]) {
    if bits == Bits::EIGHT {
        dst.copy_from_slice(codes);
        return;
    }
    if bits == Bits::FOUR {
        for (d, pair) in dst.iter_mut().zip(codes.chunks_exact(2)) {
            *d = (pair[0] & 0xF) | (pair[1] << 4);
        }
        return;
    }
    let planes = bits.get() as usize;
    for (run, words) in codes
        .chunks_exact(PLANE_RUN)
        .zip(dst.chunks_exact_mut(4 * planes))
    {
        for (p, word) in words.chunks_exact_mut(4).enumerate() {
            let mut v = 0u32;
            for (j, &code) in run.iter().enumerate() {
                v |= u32::from((code >> p) & 1) << j;
            }
            word.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// The codes of one output row, from its stored bytes.
fn unpack_row(src: &[u8], bits: Bits, codes: &mut [u8]) {
    if bits == Bits::EIGHT {
        codes.copy_from_slice(src);
        return;
    }
    if bits == Bits::FOUR {
        for (&b, pair) in src.iter().zip(codes.chunks_exact_mut(2)) {
            pair[0] = b & 0xF;
            pair[1] = b >> 4;
        }
        return;
    }
    let planes = bits.get() as usize;
    for (run, words) in codes
        .chunks_exact_mut(PLANE_RUN)
        .zip(src.chunks_exact(4 * planes))
    {
        run.fill(0);
        for (p, word) in words.chunks_exact(4).enumerate() {
            let v = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            for (j, code) in run.iter_mut().enumerate() {
                *code |= (((v >> j) & 1) as u8) << p;
            }
        }
    }
}

/// Unpacks row-layout storage (for example zero-copy views into a bundle) back to a
/// [`QuantMatrix`]; the exact inverse of [`rows_pack`].
pub fn rows_unpack(
    k: usize,
    n: usize,
    bits: Bits,
    qweight: &[u8],
    scales: &[f16],
) -> Result<QuantMatrix> {
    check_lengths("rows_unpack", k, n, bits, qweight.len(), scales.len())?;
    let stride = row_bytes(k, bits);
    let mut codes_out_in = vec![0u8; n * k];
    codes_out_in
        .par_chunks_exact_mut(k)
        .zip(qweight.par_chunks_exact(stride))
        .for_each(|(codes, src)| unpack_row(src, bits, codes));
    let groups = k / GROUP_SIZE;
    let mut plain = vec![f16::ZERO; n * groups];
    for c in 0..n {
        for g in 0..groups {
            plain[g * n + c] = scales[c * groups + g];
        }
    }
    QuantMatrix::new(
        "rows_unpack",
        k,
        n,
        bits,
        transpose(&codes_out_in, n, k),
        plain,
    )
}

/// Dequantizes row-layout storage straight to Hugging Face orientation `[n][k]` f32: equal to
/// `rows_unpack(..)?.dequantize_out_in()`, one output row at a time, in parallel.
pub fn rows_dequantize_out_in(
    k: usize,
    n: usize,
    bits: Bits,
    qweight: &[u8],
    scales: &[f16],
) -> Result<Vec<f32>> {
    check_lengths(
        "rows_dequantize_out_in",
        k,
        n,
        bits,
        qweight.len(),
        scales.len(),
    )?;
    let stride = row_bytes(k, bits);
    let groups = k / GROUP_SIZE;
    let mut out = vec![0.0f32; n * k];
    out.par_chunks_exact_mut(k)
        .zip(qweight.par_chunks_exact(stride))
        .zip(scales.par_chunks_exact(groups))
        .for_each(|((row, src), row_scales)| {
            let mut codes = vec![0u8; k];
            unpack_row(src, bits, &mut codes);
            for ((dst, codes), s) in row
                .chunks_exact_mut(GROUP_SIZE)
                .zip(codes.chunks_exact(GROUP_SIZE))
                .zip(row_scales)
            {
                let s = s.to_f32();
                for (d, &q) in dst.iter_mut().zip(codes) {
                    *d = code_value(q, bits) * s;
                }
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::rtn;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn pack_unpack_and_dequantize_round_trip_at_every_row_width() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let (n, k) = (48, 384);
        for bits in [2, 3, 4, 8] {
            let bits = Bits::new(bits).unwrap();
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.2f32..0.2)).collect();
            let m = rtn("w", &w, n, k, bits).unwrap();
            let packed = rows_pack(&m).unwrap();
            assert_eq!(packed.qweight.len(), n * k * bits.get() as usize / 8);
            assert_eq!(
                rows_unpack(k, n, bits, &packed.qweight, &packed.scales).unwrap(),
                m
            );
            assert_eq!(
                rows_dequantize_out_in(k, n, bits, &packed.qweight, &packed.scales).unwrap(),
                m.dequantize_out_in()
            );
        }
    }

    #[test]
    fn bit_planes_hold_bit_p_of_input_j_in_word_p_bit_j() {
        let bits = Bits::new(3).unwrap();
        let (n, k) = (1, 128);
        // Input i has code i % 8.
        let q: Vec<u8> = (0..k).map(|i| (i % 8) as u8).collect();
        let m = QuantMatrix::new("w", k, n, bits, q, vec![f16::ONE]).unwrap();
        let packed = rows_pack(&m).unwrap();
        let word =
            |i: usize| u32::from_le_bytes(packed.qweight[4 * i..4 * i + 4].try_into().unwrap());
        // Bit 0 set where i is odd; bit 1 where i % 4 >= 2; bit 2 where i % 8 >= 4.
        assert_eq!(word(0), 0xAAAA_AAAA);
        assert_eq!(word(1), 0xCCCC_CCCC);
        assert_eq!(word(2), 0xF0F0_F0F0);
        assert_eq!(packed.qweight.len(), 48);
    }

    #[test]
    fn nibbles_hold_even_inputs_low_and_odd_inputs_high() {
        let (n, k) = (1, 128);
        let q: Vec<u8> = (0..k).map(|i| (i % 16) as u8).collect();
        let m = QuantMatrix::new("w", k, n, Bits::FOUR, q, vec![f16::ONE]).unwrap();
        let packed = rows_pack(&m).unwrap();
        assert_eq!(packed.qweight.len(), 64);
        assert_eq!(
            &packed.qweight[..8],
            &[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
        );
    }

    #[test]
    fn wrong_lengths_are_named() {
        let msg = rows_unpack(128, 64, Bits::EIGHT, &[0u8; 10], &[f16::ONE; 64])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("10 code bytes") && msg.contains("8-bit"),
            "{msg}"
        );
    }
}
