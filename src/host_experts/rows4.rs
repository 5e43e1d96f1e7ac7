//! One dot product of a 4-bit weight row in the row layout with an activation row, with the bits
//! of the GPU's row kernels (`moe_rows_gate_up_4`, `moe_rows_down_4`; kernels/moe_rows.cu, its
//! numerics contract):
//!
//! - the activation is rounded to f16 and back ([`stage`] does it once per activation row);
//! - 32 lanes; lane `l` takes the 32-input chunks `l, l + 32, ...` in ascending order; per chunk
//!   `p = 0`, then `p = fma(q_i - 8, x_i, p)` over its inputs in ascending order, then
//!   `acc = fma(p, scale, acc)` with the chunk's group scale;
//! - the lanes' sum by the warp's xor butterfly ([`butterfly`]).
//!
//! A row is `k / 2` bytes: byte `j` holds input `2 j`'s code in its low nibble and input
//! `2 j + 1`'s in its high one, so a chunk is 16 bytes, four little-endian words, word `w` holding
//! inputs `8 w + m` at bits `4 m`. Four chunks make a group of 128 inputs; two groups, eight
//! chunks, belong to the eight lanes of octet `(group / 2) % 4`.
//!
//! The staged activation row keeps, per octet (256 inputs) and per input `t` of a chunk, the
//! eight lanes' activations side by side in [`LANE_ORDER`] (the order a dword transpose of an
//! octet's four 32-byte loads leaves its chunks' words), each times `2^-s` where `s` =
//! [`shift`]`(t)` is the bit at which the AVX2 path reads input `t`'s code in its word (the GPU's
//! positions: nibbles 0 to 4 in place, 5 to 7 from the word shifted down 12 bits). The code
//! operand is `(q - 8) 2^s`, so every product is the contract's `(q - 8) x_i` exactly: a nonzero
//! f16 value is at least 2^-24 in magnitude and `s <= 16`, so the scaled activation is exact
//! and normal; zeros, infinities and NaN scale to themselves. A row of an odd number of groups
//! ends in half an octet; its staged form is padded with zeros to a whole one ([`staged_len`]).
//! This file's portable path is the definition; `dots_avx2` follows it with vectors.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

use super::lanes::LANES;
use super::rows8::row_dots;
pub use super::rows8::{butterfly, operand, GROUP, LANE_ORDER};
#[cfg(target_arch = "x86_64")]
use super::rows8::{lane_sums, transpose4, EXPONENT_2_23};
use super::KernelPath;

/// Inputs per chunk (one lane's run of one fused multiply-add chain): 16 bytes of codes.
const CHUNK: usize = 32;
/// Lanes per octet: the chunks of two groups.
const OCTET: usize = 8;
/// Inputs per octet.
const SPAN: usize = OCTET * CHUNK;
/// Code bytes per octet.
const SPAN_BYTES: usize = SPAN / 2;
/// The code that stands for 0.
const ZERO_CODE: f32 = 8.0;

/// For lane `j` of an octet, its place in a staged vector (the inverse of [`LANE_ORDER`]).
const STAGED_PLACE: [usize; OCTET] = {
    let mut place = [0; OCTET];
    let mut v = 0;
    while v < OCTET {
        place[LANE_ORDER[v]] = v;
        v += 1;
    }
    place
};

/// The bit at which the AVX2 path reads the code of input `t` of a chunk in its word: nibble
/// `m = t % 8` in place for `m < 5`, else from the word shifted down 12 bits (every field below
/// the exponent's bit 23).
#[inline]
pub const fn shift(t: usize) -> u32 {
    let m = (t % 8) as u32;
    if m < 5 {
        4 * m
    } else {
        4 * m - 12
    }
}

/// `2^e` for a small integer `e`.
const fn pow2(e: i32) -> f32 {
    f32::from_bits(((127 + e) as u32) << 23)
}

/// Floats of the staged form of a row of `k` inputs: whole octets.
pub fn staged_len(k: usize) -> usize {
    k.next_multiple_of(SPAN)
}

/// Where input `i` of a row lies in its staged form.
#[inline]
pub fn staged_index(i: usize) -> usize {
    let (octet, at) = (i / SPAN, i % SPAN);
    let (j, t) = (at / CHUNK, at % CHUNK);
    SPAN * octet + OCTET * t + STAGED_PLACE[j]
}

/// Input `i`'s activation `v` as its staged form holds it (at [`staged_index`]`(i)`).
#[inline]
pub fn staged_value(i: usize, v: f32) -> f32 {
    operand(v) * pow2(-(shift(i % CHUNK) as i32))
}

/// The staged form of activation row `x` (its length a multiple of [`GROUP`]) into `out`
/// ([`staged_len`] long), as the module documentation says.
pub fn stage(x: &[f32], out: &mut [f32]) {
    debug_assert!(x.len().is_multiple_of(GROUP) && out.len() == staged_len(x.len()));
    if out.len() > x.len() {
        // The half octet's missing chunks lie among its present ones.
        let last = out.len() - SPAN;
        out[last..].fill(0.0);
    }
    for (i, &v) in x.iter().enumerate() {
        out[staged_index(i)] = staged_value(i, v);
    }
}

/// `codes[f] · x` for each weight row `f` (one or two, each `k / 2` bytes with `k / 128` scales)
/// into `out[f]`, `staged` being `x` as [`stage`] leaves it.
pub fn dots(path: KernelPath, codes: &[&[u8]], scales: &[&[f16]], staged: &[f32], out: &mut [f32]) {
    debug_assert!(codes.len() == scales.len() && codes.len() == out.len());
    debug_assert!(codes
        .iter()
        .all(|c| staged.len() == staged_len(2 * c.len())));
    debug_assert!(scales.iter().all(|s| 2 * codes[0].len() == GROUP * s.len()));
    // SAFETY (of `dots_avx2`'s contract): every row has `k / 2` bytes (`k` a multiple of 128),
    // `k / 128` scales, and the staged activations `staged_len(k)` floats (the callers check the
    // expert's shapes and stage with `staged_len`).
    row_dots!(dot, dots_avx2).run(path, codes, scales, staged, out);
}

/// One row's dot product, portable path (the definition).
pub fn dot(codes: &[u8], scales: &[f16], staged: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    // Chunks in ascending order: each lane meets its own in ascending order.
    for (c, bytes) in codes.chunks_exact(CHUNK / 2).enumerate() {
        let (base, place) = (SPAN * (c / OCTET), STAGED_PLACE[c % OCTET]);
        let mut p = 0.0f32;
        for t in 0..CHUNK {
            let q = (bytes[t / 2] >> (4 * (t % 2))) & 0xF;
            // (q - 8) 2^s: exact, and its product with the staged x 2^-s is (q - 8) x exactly.
            let q = (q as f32 - ZERO_CODE) * pow2(shift(t) as i32);
            p = q.mul_add(staged[base + OCTET * t + place], p);
        }
        let lane = c % LANES;
        acc[lane] = p.mul_add(scales[c * CHUNK / GROUP].to_f32(), acc[lane]);
    }
    butterfly(acc)
}

/// [`dot`] for `F` rows at once with AVX2, FMA and F16C, an octet (256 inputs, 128 bytes) at a
/// time. Its four 32-byte loads (two chunks each) are transposed by dword and qword unpacks so
/// that each of four registers holds one word of all eight chunks in [`LANE_ORDER`]. Input `t`'s
/// operand is then one and and one subtraction: the word or-ed once with the exponent of 2^23
/// (in place, or shifted down 12 bits), and-ed with the exponent and the code's field, is
/// `2^23 + q 2^s`; less `2^23 + 8 2^s` it is `(q - 8) 2^s` exactly. Two octets are taken at a
/// time, so that `2 F` chains of fused multiply-adds hide each other's latency.
///
/// # Safety
/// The processor must have AVX2, FMA and F16C; every row of `codes` must hold `k / 2` bytes,
/// every row of `scales` `k / 128` values and `staged` `staged_len(k)`, for one `k`, a multiple
/// of 128.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_avx2<const F: usize>(
    codes: [&[u8]; F],
    scales: [&[f16]; F],
    staged: &[f32],
) -> [f32; F] {
    let groups = scales[0].len();
    let (octets, half) = (groups / 2, groups % 2 == 1);
    let mut acc = [[_mm256_setzero_ps(); LANES / OCTET]; F];
    let mut o = 0;
    while o + 2 <= octets {
        // SAFETY: octets o and o + 1 lie in every row and in `staged`.
        unsafe { octet_step::<F, 2, false>(&codes, &scales, staged, o, &mut acc) };
        o += 2;
    }
    // SAFETY (each arm): the octets named lie in every row and in `staged`, the last one's
    // second group (for a HALF step) only in `staged`, which is padded to whole octets.
    match (octets - o, half) {
        (1, true) => unsafe { octet_step::<F, 2, true>(&codes, &scales, staged, o, &mut acc) },
        (1, false) => unsafe { octet_step::<F, 1, false>(&codes, &scales, staged, o, &mut acc) },
        (_, true) => unsafe { octet_step::<F, 1, true>(&codes, &scales, staged, o, &mut acc) },
        (_, false) => {}
    }
    // SAFETY: AVX2 implies AVX.
    unsafe { lane_sums(&acc) }
}

/// Per nibble `m` of a word: the and-mask that keeps the exponent of 2^23 and the code's field
/// (at bit [`shift`]`(m)`), as 32-bit lanes.
#[cfg(target_arch = "x86_64")]
const FIELD: [i32; 8] = {
    let mut m = [0; 8];
    let mut i = 0;
    while i < 8 {
        m[i] = EXPONENT_2_23 | (0xF << shift(i));
        i += 1;
    }
    m
};

/// Per nibble `m` of a word: `2^23 + 8 2^s`, `s` = [`shift`]`(m)`.
#[cfg(target_arch = "x86_64")]
const BIAS: [f32; 8] = {
    let mut b = [0.0; 8];
    let mut i = 0;
    while i < 8 {
        b[i] = (0x80_0000 + (8 << shift(i))) as f32;
        i += 1;
    }
    b
};

/// Places of a staged vector that hold the first group of an octet (chunks 0 to 3).
#[cfg(target_arch = "x86_64")]
const FIRST_GROUP: i32 = 0b0011_0011;

/// Octets `o .. o + G` of every row into the lanes' accumulators `acc[f][octet]`; with `HALF`,
/// the last of them has only its first group (four lanes), and the other four lanes'
/// accumulators are left as they are.
///
/// # Safety
/// As [`dots_avx2`], and octets `o .. o + G` lie in `staged` and in the rows (all but the last
/// one's second group, with `HALF`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
// Register blocking reads best with indices: `p[f][g]` pairs with `words[f][g]`.
#[allow(clippy::needless_range_loop)]
unsafe fn octet_step<const F: usize, const G: usize, const HALF: bool>(
    codes: &[&[u8]; F],
    scales: &[&[f16]; F],
    staged: &[f32],
    o: usize,
    acc: &mut [[__m256; LANES / OCTET]; F],
) {
    let exponent = _mm256_set1_epi32(EXPONENT_2_23);
    // The octets' words, transposed: words[f][g][w] holds word w of the eight chunks.
    let mut words = [[[_mm256_setzero_si256(); 4]; G]; F];
    for f in 0..F {
        for g in 0..G {
            let c = codes[f][SPAN_BYTES * (o + g)..].as_ptr();
            // SAFETY: the octet's 128 bytes lie in the row, or with HALF, for its last octet,
            // the first 64 (the caller's promise); that one's missing chunks are zeros.
            let r = unsafe {
                let load = |at: usize| _mm256_loadu_si256(c.add(at) as *const __m256i);
                if HALF && g == G - 1 {
                    let zero = _mm256_setzero_si256();
                    [load(0), load(32), zero, zero]
                } else {
                    [load(0), load(32), load(64), load(96)]
                }
            };
            words[f][g] = transpose4!(dwords r);
        }
    }
    let mut p = [[_mm256_setzero_ps(); G]; F];
    for w in 0..4 {
        // Each word with the exponent or-ed in, in place and shifted down 12 bits.
        let mut fields = [[[_mm256_setzero_si256(); 2]; G]; F];
        for f in 0..F {
            for g in 0..G {
                let v = words[f][g][w];
                fields[f][g] = [
                    _mm256_or_si256(v, exponent),
                    _mm256_or_si256(_mm256_srli_epi32::<12>(v), exponent),
                ];
            }
        }
        for m in 0..8 {
            let t = 8 * w + m;
            let field = _mm256_set1_epi32(FIELD[m]);
            let bias = _mm256_set1_ps(BIAS[m]);
            for g in 0..G {
                // SAFETY: floats SPAN (o + g) + 8 t .. + 8 lie in `staged` (whole octets).
                let x = unsafe { _mm256_loadu_ps(staged.as_ptr().add(SPAN * (o + g) + OCTET * t)) };
                for f in 0..F {
                    let q = _mm256_and_si256(fields[f][g][usize::from(m >= 5)], field);
                    let q = _mm256_sub_ps(_mm256_castsi256_ps(q), bias);
                    p[f][g] = _mm256_fmadd_ps(q, x, p[f][g]);
                }
            }
        }
    }
    for g in 0..G {
        let octet = (o + g) % (LANES / OCTET);
        let half = HALF && g == G - 1;
        for f in 0..F {
            // The octet's two scales (a half octet's one: its other lanes are not updated).
            let s = scales[f][2 * (o + g)..].as_ptr() as *const u16;
            // SAFETY: the octet's groups' scales lie in the row (the caller's promise).
            let bits = unsafe {
                if half {
                    i32::from(s.read_unaligned())
                } else {
                    (s as *const i32).read_unaligned()
                }
            };
            // [first, first, second, second] in each half: the places of each group's lanes.
            let two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
            let two = _mm_unpacklo_ps(two, two);
            let scale = _mm256_set_m128(two, two);
            let sum = _mm256_fmadd_ps(p[f][g], scale, acc[f][octet]);
            acc[f][octet] = if half {
                _mm256_blend_ps::<FIRST_GROUP>(acc[f][octet], sum)
            } else {
                sum
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::rows8::tests::{check_every_path, paths, WidthUnderTest};
    use super::*;

    /// The contract at 4 bits from the packed nibbles (see rows8's transcription).
    fn contract_dot(codes: &[u8], scales: &[f16], x: &[f32]) -> f32 {
        let operand = |i: usize| ((codes[i / 2] >> (4 * (i % 2))) & 0xF) as f32 - ZERO_CODE;
        super::super::rows8::tests::contract_dot(operand, CHUNK, scales, x)
    }

    #[test]
    fn stage_places_each_input_once_and_pads_with_zeros() {
        for (v, &j) in LANE_ORDER.iter().enumerate() {
            assert_eq!(STAGED_PLACE[j], v);
        }
        for t in 0..CHUNK {
            assert_eq!((FIELD[t % 8] >> shift(t)) & 0xF, 0xF, "input {t}");
            assert!(shift(t) <= 16);
        }
        for k in [128, 384] {
            let x: Vec<f32> = (0..k).map(|i| i as f32 + 1.0).collect();
            let mut staged = vec![f32::NAN; staged_len(k)];
            stage(&x, &mut staged);
            let mut seen = vec![false; staged.len()];
            for (i, &xi) in x.iter().enumerate() {
                let at = staged_index(i);
                assert!(!seen[at], "input {i}");
                seen[at] = true;
                assert_eq!(staged[at], operand(xi) / (1u32 << shift(i % CHUNK)) as f32);
            }
            let pad = seen.iter().zip(&staged).filter(|(s, _)| !**s);
            assert!(pad.clone().all(|(_, &v)| v == 0.0), "k={k}");
            assert_eq!(pad.count(), staged_len(k) - k);
        }
    }

    #[test]
    fn every_path_follows_the_contract() {
        let width = WidthUnderTest {
            chunk: CHUNK,
            bits: 4,
            staged_len,
            stage,
            dots,
            operand: |row, i| ((row[i / 2] >> (4 * (i % 2))) & 0xF) as f32 - ZERO_CODE,
        };
        // 1, 2, 3, 11 and 16 groups, and 5 (an odd count past two whole octets).
        check_every_path(&width, &[128, 256, 384, 640, 1408, 2048], 11, 0.5);
    }

    #[test]
    fn a_half_octet_leaves_the_other_lanes_alone() {
        // Input past the last group (the staged padding) must not reach the sum, and neither
        // may the lanes whose group is missing: NaN padding and extreme codes elsewhere.
        let k = 384;
        let codes = vec![0xF0u8; k / 2];
        let scales = vec![f16::from_f32(0.5); k / GROUP];
        let x: Vec<f32> = (0..k).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut staged = vec![0.0; staged_len(k)];
        stage(&x, &mut staged);
        let used: std::collections::HashSet<usize> = (0..k).map(staged_index).collect();
        for (i, v) in staged.iter_mut().enumerate() {
            if !used.contains(&i) {
                *v = f32::NAN;
            }
        }
        let want = contract_dot(&codes, &scales, &x);
        assert!(want.is_finite());
        for path in paths() {
            let mut out = [f32::NAN];
            dots(path, &[&codes], &[&scales], &staged, &mut out);
            assert_eq!(out[0].to_bits(), want.to_bits(), "{path:?}");
        }
    }
}
