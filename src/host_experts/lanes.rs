//! One dot product of an FP16 weight row with an f32 activation row, in the order the GPU's
//! routed-expert kernels use (kernels/gemv_f16.cu, `lane_dot2_split` then `split_sum`), so the
//! host and the device give the same bits:
//!
//! - 32 lanes of 8 partials each, all starting at 0. When the length is a multiple of 8, lane `l`
//!   takes the 8-element chunks `c = l, l + 32, l + 64, …` in ascending order, and its partial `e`
//!   adds element `8c + e` by a fused multiply-add. Otherwise lane `l` adds elements
//!   `l, l + 32, …` into its partial 0 and the other partials stay 0.
//! - The combine: for each position `e`, the warp's butterfly over lanes (offsets 16, 8, 4, 2, 1:
//!   lane `l` adds the partial of lane `l ^ offset`), giving `S[e]`; then the pairwise tree
//!   `((S0 + S1) + (S2 + S3)) + ((S4 + S5) + (S6 + S7))`.
//!
//! Eight contiguous weights feed eight different partials, so a vector unit computes a lane's
//! partials with one load and one fused multiply-add per 8 weights (`avx2.rs`). This file is the
//! portable path and the definition.

use half::f16;

pub const LANES: usize = 32;
/// Partials per lane: the elements of one 16-byte chunk of FP16 weights.
pub const POSITIONS: usize = 8;

/// A dot product's partials: `[lane][position]`.
pub type Partials = [[f32; POSITIONS]; LANES];

/// The GPU's combine of the partials (see the module documentation).
#[inline]
pub fn combine(p: &Partials) -> f32 {
    let mut v = *p;
    let mut offset = LANES / 2;
    // The butterfly's grouping: lane 0 after offset o holds the sum over lanes 0..2o, which is
    // all any later level reads; `a + b` and `b + a` are the same bits, so this equals every
    // lane's result.
    while offset > 0 {
        let (low, high) = v.split_at_mut(offset);
        for (a, b) in low.iter_mut().zip(high.iter()) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += *y;
            }
        }
        offset /= 2;
    }
    let s = v[0];
    ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
}

/// Adds lane `lane`'s products for chunks `first..end` (its own ones: `first ≡ lane` mod 32) of
/// `w · x` into its partials `acc`.
#[inline]
pub fn lane_chunks(
    w: &[f16],
    x: &[f32],
    lane: usize,
    first: usize,
    end: usize,
    acc: &mut [f32; POSITIONS],
) {
    let mut c = first;
    debug_assert_eq!(c % LANES, lane);
    while c < end {
        for (e, a) in acc.iter_mut().enumerate() {
            *a = w[8 * c + e].to_f32().mul_add(x[8 * c + e], *a);
        }
        c += LANES;
    }
}

/// The partials of `w · x` (equal lengths), portable path.
pub fn partials(w: &[f16], x: &[f32]) -> Partials {
    let k = w.len();
    let mut acc = [[0.0f32; POSITIONS]; LANES];
    if k & 7 == 0 {
        let chunks = k / 8;
        for (lane, a) in acc.iter_mut().enumerate() {
            lane_chunks(w, x, lane, lane, chunks, a);
        }
    } else {
        for (lane, a) in acc.iter_mut().enumerate() {
            let mut i = lane;
            while i < k {
                a[0] = w[i].to_f32().mul_add(x[i], a[0]);
                i += LANES;
            }
        }
    }
    acc
}

/// `w · x` as the GPU computes it, portable path.
pub fn dot(w: &[f16], x: &[f32]) -> f32 {
    combine(&partials(w, x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU's combine written as the kernel computes it: three halving exchange steps, two
    /// butterfly steps, then the positions' tree by shuffles (kernels/gemv_f16.cu, `split_sum`),
    /// simulated lane by lane. Every lane must end with the same bits as [`combine`].
    fn split_sum_like_the_warp(p: &Partials) -> [f32; LANES] {
        // One `split_step`: each lane sends one half of its values and adds the partner's
        // value of the half it keeps.
        fn step(vals: &[Vec<f32>], offset: usize) -> Vec<Vec<f32>> {
            let n = vals[0].len();
            let half = |l: usize, upper_half: bool| -> Vec<f32> {
                let lo = if upper_half { n / 2 } else { 0 };
                vals[l][lo..lo + n / 2].to_vec()
            };
            let upper = |l: usize| l & offset != 0;
            let send: Vec<Vec<f32>> = (0..LANES).map(|l| half(l, !upper(l))).collect();
            (0..LANES)
                .map(|l| {
                    let keep = half(l, upper(l));
                    let recv = &send[l ^ offset];
                    keep.iter().zip(recv).map(|(k, r)| k + r).collect()
                })
                .collect()
        }
        let mut v: Vec<Vec<f32>> = p.iter().map(|l| l.to_vec()).collect();
        for offset in [16, 8, 4] {
            v = step(&v, offset);
        }
        let mut s: Vec<f32> = v.iter().map(|l| l[0]).collect();
        for offset in [2, 1, 4, 8, 16] {
            s = (0..LANES).map(|l| s[l] + s[l ^ offset]).collect();
        }
        std::array::from_fn(|l| s[l])
    }

    fn random_partials(seed: u64) -> Partials {
        let mut state = seed;
        std::array::from_fn(|_| {
            std::array::from_fn(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 10.0
            })
        })
    }

    #[test]
    fn the_combine_adds_in_the_warps_order() {
        for seed in 1..20 {
            let p = random_partials(seed);
            let warp = split_sum_like_the_warp(&p);
            let c = combine(&p);
            for (l, w) in warp.iter().enumerate() {
                assert_eq!(w.to_bits(), c.to_bits(), "seed {seed} lane {l}");
            }
            let exact: f64 = p.iter().flatten().map(|&v| v as f64).sum();
            assert!((c as f64 - exact).abs() < 1e-3, "seed {seed}");
        }
    }

    #[test]
    fn both_layouts_compute_the_dot_product() {
        for k in [8usize, 24, 64, 200, 256, 1408, 2048, 13, 100] {
            let w: Vec<f16> = (0..k)
                .map(|i| f16::from_f32(((i * 7 % 13) as f32 - 6.0) / 8.0))
                .collect();
            let x: Vec<f32> = (0..k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0).collect();
            let exact: f64 = w.iter().zip(&x).map(|(a, b)| a.to_f64() * *b as f64).sum();
            assert!((dot(&w, &x) as f64 - exact).abs() < 1e-3, "k = {k}");
        }
    }
}
