//! The routed experts' SiLU, written out operation by operation so the host kernel and the GPU
//! kernel (`spx_silu` in kernels/common.cuh) compute it with the same bits: every step is one
//! IEEE single-precision operation (a fused multiply-add where written so), and the GPU side
//! spells each one with its round-to-nearest intrinsic so the compiler fuses nothing else. Math
//! libraries' `expf` differ in their last bit between host and device; this one is ours.

// The constants as bit patterns, the same ones kernels/common.cuh spells, so no decimal
// conversion on either side can differ.
/// log2(e).
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
/// ln(2) split in a part with trailing zero bits and the rest, for an exact `n * ln2_hi`.
const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// 1.5 * 2^23: adding and subtracting it rounds a float of magnitude < 2^22 to an integer.
const ROUND: f32 = 12_582_912.0;
/// Taylor coefficients 1/7! .. 1/3! of e^r on |r| <= ln2 / 2 (then 1/2, 1, 1; under 2 ulp).
const C7: f32 = f32::from_bits(0x3950_0d01);
const C6: f32 = f32::from_bits(0x3ab6_0b61);
const C5: f32 = f32::from_bits(0x3c08_8889);
const C4: f32 = f32::from_bits(0x3d2a_aaab);
const C3: f32 = f32::from_bits(0x3e2a_aaab);
const C2: f32 = 0.5;

/// e^x: 0 below -87 (where SiLU no longer sees it), +inf above 88, NaN for NaN.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < -87.0 {
        return 0.0;
    }
    if x > 88.0 {
        return f32::INFINITY;
    }
    let n = x.mul_add(LOG2E, ROUND) - ROUND;
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = C7;
    for c in [C6, C5, C4, C3, C2, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    // n is an integer in [-126, 127]: 2^n is a normal float.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// silu(g) = g / (1 + e^-g).
#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_library_on_its_range() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp(x);
            let want = (x as f64).exp() as f32;
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32;
            worst = worst.max(ulps);
            x += 0.013_7;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn constants_are_what_they_name() {
        assert_eq!(LOG2E, std::f32::consts::LOG2_E);
        assert_eq!(LN2_HI + LN2_LO, std::f32::consts::LN_2);
        for (c, n) in [
            (C7, 5040.0f32),
            (C6, 720.0),
            (C5, 120.0),
            (C4, 24.0),
            (C3, 6.0),
        ] {
            assert_eq!(c, 1.0 / n);
        }
    }

    #[test]
    fn silu_matches_its_definition() {
        for g in [-30.0f32, -3.5, -1.0, -0.25, 0.0, 0.25, 1.0, 3.5, 30.0] {
            let want = g as f64 / (1.0 + (-(g as f64)).exp());
            let got = silu(g) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-30),
                "{g}: {got} vs {want}"
            );
        }
        assert_eq!(silu(-200.0), -0.0);
        assert_eq!(silu(200.0), 200.0);
    }
}
