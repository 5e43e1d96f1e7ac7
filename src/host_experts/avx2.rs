//! The GPU-order partials (see `lanes.rs`) with AVX2, FMA and F16C.
//!
//! A lane's 8 partials are one vector: chunk `c`'s 8 weights are loaded, widened to f32 and added
//! into lane `c % 32`'s vector by one fused multiply-add per row, with the row's 8 activations at
//! the same place. The 32 lanes are visited a few at a time (as many as keep `rows x lanes`
//! accumulators in registers), each group in one pass over the weight row; the row stays in the
//! L1 cache between passes, so memory sees it once.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

use super::lanes::{Partials, LANES};

/// Rows one call computes at most: four rows' activations (32 KB at 2,048 wide) stay in the L1
/// cache across a weight row's passes; more rows would stream them from L2 once per pass.
pub const ROWS_PER_PASS: usize = 4;

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

/// Partials of `w[f] · x[r]` for each of one or two weight rows `w[f]` (features of equal length)
/// and each row `r` (at most [`ROWS_PER_PASS`]) into `out[f * rows + r]`. Two features share each
/// activation load. Lengths must be multiples of 8 and every row as long as the weights.
///
/// # Safety
/// The processor must have AVX2, FMA and F16C ([`available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn partials(w: &[&[f16]], x: &[&[f32]], out: &mut [Partials]) {
    let k = w[0].len();
    let rows = x.len();
    debug_assert!(k & 7 == 0 && rows <= ROWS_PER_PASS && out.len() == w.len() * rows);
    debug_assert!(w.iter().all(|f| f.len() == k) && x.iter().all(|r| r.len() == k));
    let chunks = k / 8;
    // SAFETY (every arm): the caller guarantees the features, the lengths and the row count.
    // F * R * G <= 8 accumulators stay in registers.
    match (w.len(), rows) {
        (_, 0) => {}
        (1, 1) => lane_groups::<1, 1, 8>(w, x, chunks, out),
        (1, 2) => lane_groups::<1, 2, 4>(w, x, chunks, out),
        (1, 3) => lane_groups::<1, 3, 2>(w, x, chunks, out),
        (1, _) => lane_groups::<1, 4, 2>(w, x, chunks, out),
        (_, 1) => lane_groups::<2, 1, 4>(w, x, chunks, out),
        (_, 2) => lane_groups::<2, 2, 2>(w, x, chunks, out),
        (_, 3) => lane_groups::<2, 3, 1>(w, x, chunks, out),
        (_, _) => lane_groups::<2, 4, 1>(w, x, chunks, out),
    }
}

/// `F` features, `R` rows, `G` lanes per pass.
#[cfg(target_arch = "x86_64")]
// Register blocking reads best with indices: `acc[f][r][g]` pairs with chunk `base + l0 + g`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_groups<const F: usize, const R: usize, const G: usize>(
    w: &[&[f16]],
    x: &[&[f32]],
    chunks: usize,
    out: &mut [Partials],
) {
    let wp: [*const f16; F] = std::array::from_fn(|f| w[f].as_ptr());
    let xp: [*const f32; R] = std::array::from_fn(|r| x[r].as_ptr());
    for l0 in (0..LANES).step_by(G) {
        let mut acc = [[[_mm256_setzero_ps(); G]; R]; F];
        let mut base = 0;
        // Rounds where all G lanes have a chunk, then the last, partial round.
        loop {
            let full = base + l0 + G <= chunks;
            for g in 0..G {
                let c = base + l0 + g;
                if !full && c >= chunks {
                    break;
                }
                // SAFETY: c < chunks, so halves 8c..8c + 8 lie inside every feature and floats
                // 8c..8c + 8 inside every row.
                let wv: [__m256; F] = std::array::from_fn(|f| unsafe {
                    _mm256_cvtph_ps(_mm_loadu_si128(wp[f].add(8 * c) as *const __m128i))
                });
                for r in 0..R {
                    let xv = _mm256_loadu_ps(xp[r].add(8 * c));
                    for f in 0..F {
                        acc[f][r][g] = _mm256_fmadd_ps(wv[f], xv, acc[f][r][g]);
                    }
                }
            }
            if !full {
                break;
            }
            base += LANES;
        }
        for f in 0..F {
            for r in 0..R {
                for g in 0..G {
                    // SAFETY: out[f * R + r][l0 + g] is 8 floats (l0 + g < LANES).
                    _mm256_storeu_ps(out[f * R + r][l0 + g].as_mut_ptr(), acc[f][r][g]);
                }
            }
        }
    }
}

/// Asks the cache for the lines of `w` ahead of their use.
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn prefetch<T>(w: &[T]) {
    let bytes = std::mem::size_of_val(w);
    let p = w.as_ptr() as *const i8;
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults; the address lies inside `w`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
    }
}

/// [`super::lanes::combine`] with vector adds: the butterfly adds the 8 positions of two lanes
/// at once (the same additions, so the same bits), then the positions' tree by two in-register
/// swaps.
///
/// # Safety
/// The processor must have AVX2 ([`available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub unsafe fn combine(p: &Partials) -> f32 {
    // SAFETY: each p[l] is 8 floats.
    let mut v: [__m256; LANES] = std::array::from_fn(|l| unsafe { _mm256_loadu_ps(p[l].as_ptr()) });
    let mut offset = LANES / 2;
    while offset > 0 {
        for l in 0..offset {
            v[l] = _mm256_add_ps(v[l], v[l + offset]);
        }
        offset /= 2;
    }
    let s = v[0];
    // t = [s0 + s1, _, s2 + s3, _, s4 + s5, _, s6 + s7, _]
    let t = _mm256_add_ps(s, _mm256_permute_ps::<0xB1>(s));
    // u[0] = (s0 + s1) + (s2 + s3), u[4] = (s4 + s5) + (s6 + s7)
    let u = _mm256_add_ps(t, _mm256_permute_ps::<0x4E>(t));
    let lo = _mm256_castps256_ps128(u);
    let hi = _mm256_extractf128_ps::<1>(u);
    _mm_cvtss_f32(_mm_add_ss(lo, hi))
}
