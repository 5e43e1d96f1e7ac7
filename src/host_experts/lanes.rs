//! One dot product of an FP16 weight row with an f32 activation row, in the order the GPU's
//! FP16 kernels use (kernels/gemv_f16.cu, `lane_dot2` then `warp_sum`), so the host and the
//! device give the same bits:
//!
//! - 32 lane partials, each starting at 0. When the length is a multiple of 8, lane `l` takes the
//!   8-element chunks `l, l + 32, l + 64, …` in ascending order, each chunk's 8 products added by
//!   fused multiply-adds in element order; otherwise lane `l` takes elements `l, l + 32, …`.
//! - The partials are combined by the warp's butterfly: for offsets 16, 8, 4, 2, 1, each lane adds
//!   the partial of the lane `offset` away; lane 0's sum is the result.
//!
//! This file is the portable path; `avx2.rs` computes the same partials eight lanes at a time.

use half::f16;

pub const LANES: usize = 32;

/// The warp's butterfly over 32 lane partials: lane 0's result. At offset `o` lane `l` adds lane
/// `l ^ o`; lane 0's result needs only lanes `0..o` at each offset, where `l ^ o = l + o`.
#[inline]
pub fn lane_sum(partials: &[f32; LANES]) -> f32 {
    let mut v = *partials;
    let mut offset = LANES / 2;
    while offset > 0 {
        for l in 0..offset {
            v[l] += v[l + offset];
        }
        offset /= 2;
    }
    v[0]
}

/// Adds lane `lane`'s products for chunks `first..end` (its own ones: `first ≡ lane` mod 32) of
/// `w · x` into `acc`.
#[inline]
pub fn lane_chunks(w: &[f16], x: &[f32], lane: usize, first: usize, end: usize, acc: &mut f32) {
    let mut c = first;
    debug_assert_eq!(c % LANES, lane);
    while c < end {
        for e in 0..8 {
            *acc = w[8 * c + e].to_f32().mul_add(x[8 * c + e], *acc);
        }
        c += LANES;
    }
}

/// The 32 lane partials of `w · x` (equal lengths), portable path.
pub fn partials(w: &[f16], x: &[f32]) -> [f32; LANES] {
    let k = w.len();
    let mut acc = [0.0f32; LANES];
    if k & 7 == 0 {
        let chunks = k / 8;
        for (lane, a) in acc.iter_mut().enumerate() {
            lane_chunks(w, x, lane, lane, chunks, a);
        }
    } else {
        for (lane, a) in acc.iter_mut().enumerate() {
            let mut i = lane;
            while i < k {
                *a = w[i].to_f32().mul_add(x[i], *a);
                i += LANES;
            }
        }
    }
    acc
}

/// `w · x` as the GPU computes it, portable path.
pub fn dot(w: &[f16], x: &[f32]) -> f32 {
    lane_sum(&partials(w, x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_butterfly_adds_in_the_warps_order() {
        let mut p = [0.0f32; LANES];
        for (i, v) in p.iter_mut().enumerate() {
            *v = (i as f32 + 1.0) * 0.1;
        }
        // Lane 0 after offset 16: p0 + p16; after 8: (p0 + p16) + (p8 + p24); and so on.
        let mut level: Vec<f32> = p.to_vec();
        for offset in [16, 8, 4, 2, 1] {
            level = (0..LANES).map(|l| level[l] + level[l ^ offset]).collect();
        }
        assert_eq!(lane_sum(&p).to_bits(), level[0].to_bits());
        let exact: f64 = p.iter().map(|&v| v as f64).sum();
        assert!((lane_sum(&p) as f64 - exact).abs() < 1e-4);
    }

    #[test]
    fn both_layouts_compute_the_dot_product() {
        for k in [8usize, 24, 64, 200, 256, 1408, 13, 100] {
            let w: Vec<f16> = (0..k)
                .map(|i| f16::from_f32(((i * 7 % 13) as f32 - 6.0) / 8.0))
                .collect();
            let x: Vec<f32> = (0..k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0).collect();
            let exact: f64 = w.iter().zip(&x).map(|(a, b)| a.to_f64() * *b as f64).sum();
            assert!((dot(&w, &x) as f64 - exact).abs() < 1e-3, "k = {k}");
        }
    }
}
