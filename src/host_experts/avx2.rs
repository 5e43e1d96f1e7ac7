//! The GPU-order lane partials (see `lanes.rs`) eight lanes at a time with AVX2, FMA and F16C.
//!
//! Eight consecutive 8-element chunks (64 weights) belong to eight consecutive lanes. Their
//! halves are widened to f32 and transposed, so vector `e` holds element `e` of each lane's chunk;
//! eight fused multiply-adds in `e` order then advance those eight lanes exactly as the GPU's
//! eight lanes advance. The activations are transposed the same way once per row ([`transpose_x`]),
//! and each weight block serves every row before the next is read.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

use super::lanes::{lane_chunks, LANES};

/// Rows whose accumulators one pass over the weights keeps live.
pub const ROWS_PER_PASS: usize = 8;

/// Whether this processor has what the fast path needs.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x` with each full block of 64 elements stored transposed (element `e` of chunk `i` of the
/// block at `8 * e + i`); the tail (fewer than 8 chunks) as it is.
pub fn transpose_x(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(x);
    let blocks = x.len() / 64;
    for b in 0..blocks {
        for i in 0..8 {
            for e in 0..8 {
                out[64 * b + 8 * e + i] = x[64 * b + 8 * i + e];
            }
        }
    }
}

/// Lane partials of `w · x[r]` for each row `r` (at most [`ROWS_PER_PASS`]): `xt[r]` is row `r`
/// transposed by [`transpose_x`], `x[r]` the row itself. `w.len()` must be a multiple of 8.
///
/// # Safety
/// The processor must have AVX2, FMA and F16C ([`available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn partials(w: &[f16], xt: &[&[f32]], x: &[&[f32]], out: &mut [[f32; LANES]]) {
    let k = w.len();
    let rows = out.len();
    debug_assert!(k & 7 == 0 && rows <= ROWS_PER_PASS && xt.len() == rows && x.len() == rows);
    let chunks = k / 8;
    let blocks = chunks / 8;
    let mut acc = [[_mm256_setzero_ps(); 4]; ROWS_PER_PASS];
    let wp = w.as_ptr() as *const __m128i;
    for b in 0..blocks {
        // SAFETY: block b's 8 chunks of 8 halves lie inside `w` (b < chunks / 8).
        let r: [__m256; 8] =
            std::array::from_fn(|i| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(wp.add(8 * b + i))) });
        let c = transpose8(r);
        let g = b % 4;
        for (row, a) in acc.iter_mut().enumerate().take(rows) {
            let xp = xt[row].as_ptr().add(64 * b);
            let mut s = a[g];
            for (e, ce) in c.iter().enumerate() {
                // SAFETY: xt[row] has the length of w, and 64 * b + 8 * e + 8 <= 64 * blocks.
                s = _mm256_fmadd_ps(*ce, _mm256_loadu_ps(xp.add(8 * e)), s);
            }
            a[g] = s;
        }
    }
    for (row, o) in out.iter_mut().enumerate() {
        for (g, a) in acc[row].iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * g), *a);
        }
        // Chunks past the last full block: each its lane's last, added in ascending order.
        for c in 8 * blocks..chunks {
            let lane = c % LANES;
            lane_chunks(w, x[row], lane, c, c + 1, &mut o[lane]);
        }
    }
}

/// `c[e][i] = r[i][e]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}
