//! One dot product of an 8-bit weight row in the row layout (docs/FORMAT.md, "Expert
//! encodings"; `crate::quant::rows`) with an activation row, with the bits of the GPU's row
//! kernels (kernels/moe_rows.cu, its numerics contract):
//!
//! - the activation is rounded to f16 and back ([`stage`] does it once per activation row);
//! - 32 lanes; lane `l` takes the 16-input chunks `l, l + 32, ...` in ascending order; per chunk
//!   `p = 0`, then `p = fma(q_i - 128, x_i, p)` over its inputs in ascending order, then
//!   `acc = fma(p, scale, acc)` with the chunk's group scale;
//! - the lanes' sum by the warp's xor butterfly ([`butterfly`]).
//!
//! Eight consecutive chunks make one group of 128 inputs and belong to the eight lanes of octet
//! `group % 4`. The staged activation row keeps, per group and per input `t` of a chunk, the eight
//! lanes' activations side by side in [`LANE_ORDER`]: the order in which the AVX2 path's byte
//! transpose leaves an octet's codes, so one vector load feeds a fused multiply-add for eight
//! lanes. This file's portable path is the definition; `dots_avx2` follows it with vectors.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

use super::lanes::LANES;
use super::KernelPath;

/// Inputs per scale, and per octet of lanes.
pub const GROUP: usize = 128;
/// Inputs per chunk (one lane's run of one fused multiply-add chain).
const CHUNK: usize = 16;
/// Lanes per octet: the chunks of one group.
const OCTET: usize = GROUP / CHUNK;
/// The code that stands for 0.
const ZERO_CODE: f32 = 128.0;
/// Which lane of its octet each of a staged vector's eight places holds.
pub const LANE_ORDER: [usize; OCTET] = [0, 2, 4, 6, 1, 3, 5, 7];

/// An activation as the kernels read it: rounded to f16 and back.
#[inline]
pub fn operand(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Where input `i` of a row lies in its staged form.
#[inline]
pub fn staged_index(i: usize) -> usize {
    let (group, at) = (i / GROUP, i % GROUP);
    let (j, t) = (at / CHUNK, at % CHUNK);
    GROUP * group + OCTET * t + STAGED_PLACE[j]
}

/// For lane `j` of an octet, its place in a staged vector (the inverse of [`LANE_ORDER`]).
const STAGED_PLACE: [usize; OCTET] = [0, 4, 1, 5, 2, 6, 3, 7];

/// The staged form of activation row `x` (its length a multiple of [`GROUP`]) into `out` (as
/// long): each value rounded to f16 and back, placed as the module documentation says.
pub fn stage(x: &[f32], out: &mut [f32]) {
    debug_assert!(x.len() == out.len() && x.len().is_multiple_of(GROUP));
    for (xg, og) in x.chunks_exact(GROUP).zip(out.chunks_exact_mut(GROUP)) {
        for t in 0..CHUNK {
            for (v, &j) in LANE_ORDER.iter().enumerate() {
                og[OCTET * t + v] = operand(xg[CHUNK * j + t]);
            }
        }
    }
}

/// The sum of the 32 lanes' values as the warp's xor butterfly forms it (offsets 16, 8, 4, 2,
/// 1): lane 0's grouping, which every lane's result equals bit for bit (`a + b` is `b + a`).
pub fn butterfly(mut v: [f32; LANES]) -> f32 {
    let mut offset = LANES / 2;
    while offset > 0 {
        for l in 0..offset {
            v[l] += v[l + offset];
        }
        offset /= 2;
    }
    v[0]
}

/// `codes[f] · x` for each weight row `f` (one or two, each `k` codes with `k / 128` scales) into
/// `out[f]`, `staged` being `x` as [`stage`] leaves it.
pub fn dots(path: KernelPath, codes: &[&[u8]], scales: &[&[f16]], staged: &[f32], out: &mut [f32]) {
    debug_assert!(codes.len() == scales.len() && codes.len() == out.len());
    debug_assert!(codes.iter().all(|c| c.len() == staged.len()));
    debug_assert!(scales.iter().all(|s| s.len() == staged.len() / GROUP));
    // SAFETY (of `dots_avx2`'s contract): every row and the staged activations have `k` values,
    // a multiple of 128, and `k / 128` scales (the callers check the expert's shapes).
    row_dots!(dot, dots_avx2).run(path, codes, scales, staged, out);
}

/// The [`RowDots`] of a width's module from its portable `dot` and its `dots_avx2::<F>` (one
/// macro, as the AVX2 fields exist only on x86-64).
macro_rules! row_dots {
    ($dot:ident, $avx2:ident) => {
        super::rows8::RowDots {
            dot: $dot,
            #[cfg(target_arch = "x86_64")]
            one: $avx2::<1>,
            #[cfg(target_arch = "x86_64")]
            two: $avx2::<2>,
        }
    };
}
pub(super) use row_dots;

/// The exponent field of 2^23 as f32 bits: or-ed with an integer below 2^23 it makes the float
/// `2^23 +` that integer, which the AVX2 paths turn into a code's value with one subtraction.
#[cfg(target_arch = "x86_64")]
pub(super) const EXPONENT_2_23: i32 = 0x4B00_0000;

/// Four registers' units (`bytes` for the 8-bit rows, `dwords` for the 4-bit ones) transposed
/// within each 128-bit half by two rounds of unpacks: `$lo` and `$hi` interleave the units of
/// registers 0 and 1 and of 2 and 3, then `$lo2` and `$hi2` (units twice as wide) interleave
/// those results.
#[cfg(target_arch = "x86_64")]
macro_rules! transpose4 {
    (bytes $r:expr) => {
        transpose4!(
            $r,
            _mm256_unpacklo_epi8,
            _mm256_unpackhi_epi8,
            _mm256_unpacklo_epi16,
            _mm256_unpackhi_epi16
        )
    };
    (dwords $r:expr) => {
        transpose4!(
            $r,
            _mm256_unpacklo_epi32,
            _mm256_unpackhi_epi32,
            _mm256_unpacklo_epi64,
            _mm256_unpackhi_epi64
        )
    };
    ($r:expr, $lo:ident, $hi:ident, $lo2:ident, $hi2:ident) => {{
        let r = $r;
        let lo01 = $lo(r[0], r[1]);
        let hi01 = $hi(r[0], r[1]);
        let lo23 = $lo(r[2], r[3]);
        let hi23 = $hi(r[2], r[3]);
        [
            $lo2(lo01, lo23),
            $hi2(lo01, lo23),
            $lo2(hi01, hi23),
            $hi2(hi01, hi23),
        ]
    }};
}
#[cfg(target_arch = "x86_64")]
pub(super) use transpose4;

/// The AVX2 form of a width's dot products for `F` rows at once.
#[cfg(target_arch = "x86_64")]
type DotsAvx2<const F: usize> = unsafe fn([&[u8]; F], [&[f16]; F], &[f32]) -> [f32; F];

/// A row-layout width's dot products: the portable definition and the AVX2 forms for one and
/// two rows, whose safety contract the caller of [`RowDots::run`] meets for its shapes.
pub(super) struct RowDots {
    pub dot: fn(&[u8], &[f16], &[f32]) -> f32,
    #[cfg(target_arch = "x86_64")]
    pub one: DotsAvx2<1>,
    #[cfg(target_arch = "x86_64")]
    pub two: DotsAvx2<2>,
}

impl RowDots {
    /// `codes[f] · x` for one or two rows into `out[f]`, on `path`. The caller has checked the
    /// shapes that `one` and `two` require.
    pub fn run(
        &self,
        path: KernelPath,
        codes: &[&[u8]],
        scales: &[&[f16]],
        staged: &[f32],
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if path == KernelPath::Avx2 {
            // SAFETY: the Avx2 path is chosen only where the processor has AVX2, FMA and F16C
            // (`HostExperts::new`); the shapes are the caller's promise.
            unsafe {
                match codes {
                    [a] => out[0] = (self.one)([a], [scales[0]], staged)[0],
                    [a, b] => {
                        let [x, y] = (self.two)([a, b], [scales[0], scales[1]], staged);
                        out[0] = x;
                        out[1] = y;
                    }
                    _ => unreachable!("one or two rows at a time"),
                }
            }
            return;
        }
        let _ = path;
        for ((c, s), o) in codes.iter().zip(scales).zip(out.iter_mut()) {
            *o = (self.dot)(c, s, staged);
        }
    }
}

/// One row's dot product, portable path (the definition).
pub fn dot(codes: &[u8], scales: &[f16], staged: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (b, (cg, xg)) in codes
        .chunks_exact(GROUP)
        .zip(staged.chunks_exact(GROUP))
        .enumerate()
    {
        let scale = scales[b].to_f32();
        let octet = b % (LANES / OCTET);
        for (v, &j) in LANE_ORDER.iter().enumerate() {
            let mut p = 0.0f32;
            for t in 0..CHUNK {
                let q = cg[CHUNK * j + t] as f32 - ZERO_CODE;
                p = q.mul_add(xg[OCTET * t + v], p);
            }
            let lane = OCTET * octet + j;
            acc[lane] = p.mul_add(scale, acc[lane]);
        }
    }
    butterfly(acc)
}

/// [`dot`] for `F` rows at once with AVX2 and FMA. A group's 128 codes of a row (four 32-byte
/// loads, two chunks each) are transposed by byte and word unpacks so that each of four
/// registers holds four inputs `t` of all eight chunks, one byte per lane in [`LANE_ORDER`];
/// a byte shuffle then widens input `t` of the eight lanes to 32-bit fields, and or-ing the
/// exponent of 2^23 then subtracting 2^23 + 128 makes them `q - 128` exactly. Two groups are
/// taken at a time, so that `2 F` chains of fused multiply-adds hide each other's latency.
///
/// # Safety
/// The processor must have AVX2 and FMA; every row of `codes` and `staged` must hold the same
/// multiple of 128 values, and every row of `scales` a value per 128 of them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2<const F: usize>(
    codes: [&[u8]; F],
    scales: [&[f16]; F],
    staged: &[f32],
) -> [f32; F] {
    let groups = staged.len() / GROUP;
    let mut acc = [[_mm256_setzero_ps(); LANES / OCTET]; F];
    let mut b = 0;
    while b + 2 <= groups {
        // SAFETY: groups b and b + 1 lie in every row and in `staged`.
        unsafe { group_step::<F, 2>(&codes, &scales, staged, b, &mut acc) };
        b += 2;
    }
    if b < groups {
        // SAFETY: group b lies in every row and in `staged`.
        unsafe { group_step::<F, 1>(&codes, &scales, staged, b, &mut acc) };
    }
    // SAFETY: AVX2 implies AVX.
    unsafe { lane_sums(&acc) }
}

/// Each row's sum of its 32 lanes' accumulators, held as four vectors of an octet's eight lanes
/// in [`LANE_ORDER`], by the warp's butterfly.
///
/// # Safety
/// The processor must have AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
pub(super) unsafe fn lane_sums<const F: usize>(acc: &[[__m256; LANES / OCTET]; F]) -> [f32; F] {
    let mut out = [0.0f32; F];
    for (o, a) in out.iter_mut().zip(acc) {
        let mut lanes = [0.0f32; LANES];
        for (octet, v) in a.iter().enumerate() {
            let mut vals = [0.0f32; OCTET];
            // SAFETY: `vals` is 8 floats.
            unsafe { _mm256_storeu_ps(vals.as_mut_ptr(), *v) };
            for (val, &j) in vals.iter().zip(&LANE_ORDER) {
                lanes[OCTET * octet + j] = *val;
            }
        }
        *o = butterfly(lanes);
    }
    out
}

/// Byte shuffle `s`: field d of each 16-byte half takes byte 4s + d of that half; the rest are
/// zeros (index -1).
#[cfg(target_arch = "x86_64")]
const WIDEN: [[i8; 32]; 4] = {
    let mut m = [[-1i8; 32]; 4];
    let mut s = 0;
    while s < 4 {
        let mut d = 0;
        while d < 4 {
            m[s][4 * d] = (4 * s + d) as i8;
            m[s][16 + 4 * d] = (4 * s + d) as i8;
            d += 1;
        }
        s += 1;
    }
    m
};

/// Groups `b .. b + G` of every row into the lanes' accumulators `acc[f][octet]`.
///
/// # Safety
/// As [`dots_avx2`], and groups `b .. b + G` lie in the rows and in `staged`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
// Register blocking reads best with indices: `p[f][g]` pairs with `planes[f][g]`.
#[allow(clippy::needless_range_loop)]
unsafe fn group_step<const F: usize, const G: usize>(
    codes: &[&[u8]; F],
    scales: &[&[f16]; F],
    staged: &[f32],
    b: usize,
    acc: &mut [[__m256; LANES / OCTET]; F],
) {
    let exponent = _mm256_set1_epi32(EXPONENT_2_23);
    let bias = _mm256_set1_ps(8_388_736.0); // 2^23 + 128
                                            // SAFETY: each entry of WIDEN is 32 bytes.
    let widen: [__m256i; 4] =
        std::array::from_fn(|s| unsafe { _mm256_loadu_si256(WIDEN[s].as_ptr() as *const __m256i) });
    let mut planes = [[[_mm256_setzero_si256(); 4]; G]; F];
    for f in 0..F {
        for g in 0..G {
            let c = codes[f].as_ptr().add(GROUP * (b + g));
            // SAFETY: group b + g's 128 bytes lie in the row (the caller's promise).
            let r = unsafe {
                [
                    _mm256_loadu_si256(c as *const __m256i),
                    _mm256_loadu_si256(c.add(32) as *const __m256i),
                    _mm256_loadu_si256(c.add(64) as *const __m256i),
                    _mm256_loadu_si256(c.add(96) as *const __m256i),
                ]
            };
            planes[f][g] = transpose4!(bytes r);
        }
    }
    let mut p = [[_mm256_setzero_ps(); G]; F];
    for t in 0..CHUNK {
        for g in 0..G {
            // SAFETY: float GROUP (b + g) + 8 t + 8 <= GROUP (b + g + 1) lies in `staged`.
            let x = unsafe { _mm256_loadu_ps(staged.as_ptr().add(GROUP * (b + g) + OCTET * t)) };
            for f in 0..F {
                let q = _mm256_shuffle_epi8(planes[f][g][t / 4], widen[t % 4]);
                let q = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(q, exponent)), bias);
                p[f][g] = _mm256_fmadd_ps(q, x, p[f][g]);
            }
        }
    }
    for g in 0..G {
        let octet = (b + g) % (LANES / OCTET);
        for f in 0..F {
            let scale = _mm256_set1_ps(scales[f][b + g].to_f32());
            acc[f][octet] = _mm256_fmadd_ps(p[f][g], scale, acc[f][octet]);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The contract as kernels/moe_rows.cu states it, with no staging: lane by lane, chunk by
    /// chunk of `chunk` inputs, straight from the unrounded activations; `operand(i)` is input
    /// `i`'s code less the zero code.
    pub fn contract_dot(
        operand: impl Fn(usize) -> f32,
        chunk: usize,
        scales: &[f16],
        x: &[f32],
    ) -> f32 {
        let chunks = x.len() / chunk;
        let mut acc = [0.0f32; LANES];
        for (lane, a) in acc.iter_mut().enumerate() {
            for c in (lane..chunks).step_by(LANES) {
                let mut p = 0.0f32;
                for (i, &xi) in x.iter().enumerate().take(chunk * (c + 1)).skip(chunk * c) {
                    let xr = f16::from_f32(xi).to_f32();
                    p = operand(i).mul_add(xr, p);
                }
                *a = p.mul_add(scales[chunk * c / GROUP].to_f32(), *a);
            }
        }
        // The warp: every lane adds its partner's value at each offset.
        for offset in [16, 8, 4, 2, 1] {
            acc = std::array::from_fn(|l| acc[l] + acc[l ^ offset]);
        }
        acc[0]
    }

    pub fn lcg(state: &mut u64) -> u32 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*state >> 33) as u32
    }

    /// The portable path, and AVX2 where this processor has it.
    pub fn paths() -> Vec<KernelPath> {
        let mut paths = vec![KernelPath::Portable];
        if KernelPath::detect() == KernelPath::Avx2 {
            paths.push(KernelPath::Avx2);
        }
        paths
    }

    #[test]
    fn staged_index_places_each_input_where_stage_puts_it() {
        for (v, &j) in LANE_ORDER.iter().enumerate() {
            assert_eq!(STAGED_PLACE[j], v);
        }
        let k = 3 * GROUP;
        let x: Vec<f32> = (0..k).map(|i| i as f32).collect();
        let mut staged = vec![0.0; k];
        stage(&x, &mut staged);
        for (i, &xi) in x.iter().enumerate() {
            assert_eq!(staged[staged_index(i)], operand(xi), "input {i}");
        }
    }

    /// A width's `dots`.
    type Dots = fn(KernelPath, &[&[u8]], &[&[f16]], &[f32], &mut [f32]);

    /// One row-layout width's kernel, as [`check_every_path`] exercises it.
    pub struct WidthUnderTest {
        /// Inputs a chunk, and bits a code.
        pub chunk: usize,
        pub bits: usize,
        /// Floats of a staged row of `k` inputs.
        pub staged_len: fn(usize) -> usize,
        pub stage: fn(&[f32], &mut [f32]),
        pub dots: Dots,
        /// Input `i`'s code less the zero code, from a row's bytes.
        pub operand: fn(&[u8], usize) -> f32,
    }

    /// Random rows of each length in `ks` (codes, scales up to about `scale_max`, activations in
    /// [-3, 3]): every path, one and two rows a call, gives the contract's bits; and the contract's
    /// value is the dequantized row times the rounded activations, in f64.
    pub fn check_every_path(w: &WidthUnderTest, ks: &[usize], seed: u64, scale_max: f32) {
        let mut s = seed;
        for &k in ks {
            let bytes = k * w.bits / 8;
            let codes: Vec<u8> = (0..2 * bytes).map(|_| lcg(&mut s) as u8).collect();
            let scales: Vec<f16> = (0..2 * k / GROUP)
                .map(|_| {
                    let v = (lcg(&mut s) % 1000) as f32 / 1000.0 * scale_max + scale_max / 50.0;
                    f16::from_f32(v)
                })
                .collect();
            let x: Vec<f32> = (0..k)
                .map(|_| (lcg(&mut s) as f32 / u32::MAX as f32 - 0.5) * 6.0)
                .collect();
            let mut staged = vec![f32::NAN; (w.staged_len)(k)];
            (w.stage)(&x, &mut staged);
            let rows = [&codes[..bytes], &codes[bytes..]];
            let sc = [&scales[..k / GROUP], &scales[k / GROUP..]];
            let want =
                [0, 1].map(|r| contract_dot(|i| (w.operand)(rows[r], i), w.chunk, sc[r], &x));
            for path in paths() {
                let mut two = [f32::NAN; 2];
                (w.dots)(path, &rows, &sc, &staged, &mut two);
                let mut one = [f32::NAN];
                (w.dots)(path, &rows[1..], &sc[1..], &staged, &mut one);
                for (got, want) in two.iter().chain(&one).zip(want.iter().chain(&want[1..])) {
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{path:?} k={k}: {got} vs {want}"
                    );
                }
            }
            let q = |i: usize| f64::from((w.operand)(rows[0], i));
            let exact: f64 = (0..k)
                .map(|i| q(i) * sc[0][i / GROUP].to_f64() * f16::from_f32(x[i]).to_f64())
                .sum();
            let norm: f64 = (0..k)
                .map(|i| (q(i) * sc[0][i / GROUP].to_f64() * x[i] as f64).abs())
                .sum();
            assert!((want[0] as f64 - exact).abs() <= 1e-6 * norm, "k={k}");
        }
    }

    #[test]
    fn every_path_follows_the_contract() {
        let width = WidthUnderTest {
            chunk: CHUNK,
            bits: 8,
            staged_len: |k| k,
            stage,
            dots,
            operand: |row, i| row[i] as f32 - ZERO_CODE,
        };
        check_every_path(&width, &[128, 256, 384, 512, 1408, 2048], 7, 0.05);
    }
}
