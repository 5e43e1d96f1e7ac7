//! The quantized layouts of expert weights: codes, scales, round-to-nearest, the Marlin tiled
//! layout the W4A16 kernel reads (4 bits), and the row layouts of 8-bit targets and 2- and 3-bit
//! drafts (rows.rs). GPTQ, which only conversion runs, is specter-convert's; it quantizes with the
//! same scale and code rules (the helpers of rtn.rs exported below).
//!
//! Conventions shared by every function here:
//! - symmetric unsigned codes of [`Bits`] `b` in {2, 3, 4, 8}: a stored code `q` in `0..2^b` means
//!   the weight `(q - 2^(b-1)) * scale` ("uint4b8" at 4 bits, "uint8b128" at 8);
//! - one f16 scale per (group of [`GROUP_SIZE`] input features, output feature);
//! - orientation: `K` = input features, `N` = output features. Hugging Face stores a linear weight
//!   as `[N][K]` ("out, in"); a [`QuantMatrix`] holds codes as `[K][N]`, the orientation Marlin
//!   tiles.
//!
//! Scale choice (see [`rtn`]): `scale = max|w| / (2^(b-1) - 1)` over the group (`/ 7` at 4 bits), rounded to f16 and nudged up
//! to the next f16 if rounding made it too small for the group's largest weight to stay within
//! half a step of a code. Rounding is done against the stored f16 scale, so dequantizing the
//! stored codes and scales reproduces exactly what the quantizer aimed at. The code 0 (`-2^(b-1)`) is
//! valid on load and may be produced by GPTQ (its error feedback can push a weight past the
//! group's original maximum); round-to-nearest never needs it. An all-zero group gets scale 1.0.

mod marlin;
mod rows;
mod rtn;

pub use marlin::{marlin_dequantize_out_in, marlin_pack, marlin_unpack, MarlinWeight};
pub use rows::{row_bytes, rows_dequantize_out_in, rows_pack, rows_unpack, RowsWeight};
pub use rtn::{check_weight, group_scales, quantize_code, rtn};

use half::f16;

use crate::{Error, Result};

/// Input features per quantization group (and the K depth of one Marlin group of tiles).
pub const GROUP_SIZE: usize = 128;

/// Output columns covered by one Marlin 16x64 block of four 16x16 tiles.
pub const MARLIN_TILE_N: usize = 64;

/// Rows of one Marlin tile (input features).
pub const MARLIN_TILE_K: usize = 16;

/// Bits per quantized weight: 2, 3, 4 or 8.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bits(u8);

impl Bits {
    /// The draft's default, and the Marlin layout's width.
    pub const FOUR: Bits = Bits(4);
    pub const EIGHT: Bits = Bits(8);

    /// `bits` when it is one of the supported widths (2, 3, 4, 8).
    pub fn new(bits: u32) -> Result<Bits> {
        match bits {
            2 | 3 | 4 | 8 => Ok(Bits(bits as u8)),
            _ => Err(Error::Quant(format!(
                "{bits}-bit weights are not supported (2, 3, 4 or 8)"
            ))),
        }
    }

    pub fn get(self) -> u32 {
        u32::from(self.0)
    }

    /// The code that stands for zero, `2^(b-1)`.
    #[inline(always)]
    pub fn zero_code(self) -> u8 {
        1 << (self.0 - 1)
    }

    /// The largest code, `2^b - 1`.
    #[inline(always)]
    pub fn max_code(self) -> u8 {
        ((1u16 << self.0) - 1) as u8
    }

    /// The largest positive level, `2^(b-1) - 1`: a group's scale is its largest magnitude over
    /// this.
    #[inline(always)]
    pub fn top_level(self) -> f32 {
        f32::from(self.zero_code()) - 1.0
    }
}

impl std::fmt::Display for Bits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An unpacked quantized matrix.
///
/// `q` is row-major `[k][n]` with values `0..2^bits`; `scales` is row-major `[k / 128][n]`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantMatrix {
    pub k: usize,
    pub n: usize,
    pub bits: Bits,
    pub q: Vec<u8>,
    pub scales: Vec<f16>,
}

impl QuantMatrix {
    /// Builds a matrix after checking the shape rules and the code range.
    pub fn new(
        tensor: &str,
        k: usize,
        n: usize,
        bits: Bits,
        q: Vec<u8>,
        scales: Vec<f16>,
    ) -> Result<Self> {
        let m = QuantMatrix {
            k,
            n,
            bits,
            q,
            scales,
        };
        m.validate(tensor)?;
        Ok(m)
    }

    /// Checks that the fields agree with each other: `k` a multiple of the group size, buffer
    /// lengths matching the shape, every code within `0..2^bits`, every scale finite.
    pub fn validate(&self, tensor: &str) -> Result<()> {
        if self.k == 0 || self.n == 0 || !self.k.is_multiple_of(GROUP_SIZE) {
            return Err(Error::Quant(format!(
                "{tensor}: shape k={} n={} is not quantizable (k must be a positive multiple of \
                 {GROUP_SIZE}, n positive)",
                self.k, self.n
            )));
        }
        let cells = self.k.checked_mul(self.n).ok_or_else(|| {
            Error::Quant(format!(
                "{tensor}: shape k={} n={} overflows",
                self.k, self.n
            ))
        })?;
        if self.q.len() != cells {
            return Err(Error::Quant(format!(
                "{tensor}: {} codes for a {}x{} matrix (expected {cells})",
                self.q.len(),
                self.k,
                self.n
            )));
        }
        let groups = self.k / GROUP_SIZE * self.n;
        if self.scales.len() != groups {
            return Err(Error::Quant(format!(
                "{tensor}: {} scales for a {}x{} matrix (expected {groups})",
                self.scales.len(),
                self.k,
                self.n
            )));
        }
        let max = self.bits.max_code();
        if let Some(pos) = self.q.iter().position(|&v| v > max) {
            return Err(Error::Quant(format!(
                "{tensor}: code {} at index {pos} is outside 0..={max} ({}-bit)",
                self.q[pos], self.bits
            )));
        }
        if let Some(pos) = self.scales.iter().position(|s| !s.is_finite()) {
            return Err(Error::Quant(format!(
                "{tensor}: scale at index {pos} is not finite"
            )));
        }
        Ok(())
    }

    /// Dequantized weights, row-major `[k][n]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.q.len()];
        if self.n == 0 {
            return out;
        }
        let scale_rows = self.scales.chunks_exact(self.n);
        // Each group of 128 code rows shares one row of scales.
        for ((out_group, q_group), scale_row) in out
            .chunks_mut(GROUP_SIZE * self.n)
            .zip(self.q.chunks(GROUP_SIZE * self.n))
            .zip(scale_rows)
        {
            let s: Vec<f32> = scale_row.iter().map(|s| s.to_f32()).collect();
            for (out_row, q_row) in out_group
                .chunks_exact_mut(self.n)
                .zip(q_group.chunks_exact(self.n))
            {
                for ((o, &q), &s) in out_row.iter_mut().zip(q_row).zip(&s) {
                    *o = code_value(q, self.bits) * s;
                }
            }
        }
        out
    }

    /// Dequantized weights in Hugging Face orientation, row-major `[n][k]`.
    pub fn dequantize_out_in(&self) -> Vec<f32> {
        let kn = self.dequantize();
        transpose(&kn, self.k, self.n)
    }

    /// Concatenates output columns: the result's columns are `a`'s followed by `b`'s (gate then
    /// up of one expert, fused into a single matrix). Both must have the same `k`.
    pub fn concat_n(a: &QuantMatrix, b: &QuantMatrix) -> Result<QuantMatrix> {
        a.validate("concat_n: first operand")?;
        b.validate("concat_n: second operand")?;
        if a.k != b.k || a.bits != b.bits {
            return Err(Error::Quant(format!(
                "concat_n: input features ({} vs {}) or widths ({}-bit vs {}-bit) differ",
                a.k, b.k, a.bits, b.bits
            )));
        }
        let n = a.n + b.n;
        let mut q = Vec::with_capacity(a.k * n);
        for (ra, rb) in a.q.chunks_exact(a.n).zip(b.q.chunks_exact(b.n)) {
            q.extend_from_slice(ra);
            q.extend_from_slice(rb);
        }
        let mut scales = Vec::with_capacity(a.k / GROUP_SIZE * n);
        for (ra, rb) in a.scales.chunks_exact(a.n).zip(b.scales.chunks_exact(b.n)) {
            scales.extend_from_slice(ra);
            scales.extend_from_slice(rb);
        }
        Ok(QuantMatrix {
            k: a.k,
            n,
            bits: a.bits,
            q,
            scales,
        })
    }
}

/// The signed value a stored code of width `bits` stands for.
#[inline(always)]
pub fn code_value(q: u8, bits: Bits) -> f32 {
    f32::from(q) - f32::from(bits.zero_code())
}

/// Row-major `[rows][cols]` to row-major `[cols][rows]`, in cache-sized tiles.
pub fn transpose<T: Copy + Default>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    const TILE: usize = 32;
    let mut dst = vec![T::default(); rows * cols];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    dst[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
    dst
}

/// Checks the shape rules of the Marlin tiling: `k % 128 == 0` (one quantization group spans
/// eight 16-row tiles) and `n % 64 == 0` (one 16x64 block of four tiles).
pub fn check_marlin_shape(tensor: &str, k: usize, n: usize) -> Result<()> {
    if k == 0 || !k.is_multiple_of(GROUP_SIZE) {
        return Err(Error::Quant(format!(
            "{tensor}: input features k={k} must be a positive multiple of {GROUP_SIZE} \
             (quantization group and Marlin tile depth)"
        )));
    }
    if n == 0 || !n.is_multiple_of(MARLIN_TILE_N) {
        return Err(Error::Quant(format!(
            "{tensor}: output features n={n} must be a positive multiple of {MARLIN_TILE_N} \
             (one Marlin 16x{MARLIN_TILE_N} tile block)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marlin_shape_rules_are_named() {
        check_marlin_shape("t", 1408, 2816).unwrap();
        let msg = check_marlin_shape("experts.0.down", 1400, 64)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("experts.0.down") && msg.contains("k=1400"),
            "{msg}"
        );
        let msg = check_marlin_shape("experts.0.gate_up", 128, 100)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("experts.0.gate_up") && msg.contains("n=100"),
            "{msg}"
        );
    }
}
