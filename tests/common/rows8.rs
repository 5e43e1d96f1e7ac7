//! Random 8- and 4-bit routed experts in the row layout, for the host kernel's tests and its
//! comparison with the GPU's row kernels.

use half::f16;
use rand::Rng;
use specter::host_experts::ExpertWeights;

/// One expert at `bits` (8 or 4): gate/up codes `[2 inter][hidden bits / 8]` bytes with
/// `[2 inter][hidden / 128]` scales, down codes `[hidden][inter bits / 8]` with
/// `[hidden][inter / 128]` scales. At 4 bits byte `j` of a row holds input `2 j`'s code in its
/// low nibble and input `2 j + 1`'s in its high one.
pub struct RowsExpert {
    pub bits: usize,
    pub gate_up: Vec<u8>,
    pub gate_up_scales: Vec<f16>,
    pub down: Vec<u8>,
    pub down_scales: Vec<f16>,
    pub hidden: usize,
    pub inter: usize,
}

impl RowsExpert {
    /// Uniform codes (never all one value) and scales near `1 / (2^(bits - 2) sqrt(k))`, so that
    /// products stay of order one.
    pub fn random(rng: &mut impl Rng, bits: usize, hidden: usize, inter: usize) -> Self {
        assert!(bits == 8 || bits == 4, "{bits}-bit experts");
        let mut codes = |n: usize| -> Vec<u8> { (0..n * bits / 8).map(|_| rng.random()).collect() };
        let (gate_up, down) = (codes(2 * inter * hidden), codes(hidden * inter));
        let mut scales = |n: usize, k: usize| -> Vec<f16> {
            let base = 1.0 / ((1 << (bits - 2)) as f32 * (k as f32).sqrt());
            (0..n)
                .map(|_| f16::from_f32(base * rng.random_range(0.5..1.5f32)))
                .collect()
        };
        RowsExpert {
            bits,
            gate_up,
            gate_up_scales: scales(2 * inter * hidden / 128, hidden),
            down,
            down_scales: scales(hidden * inter / 128, inter),
            hidden,
            inter,
        }
    }

    /// The expert from other tensors of its width (the same shapes, or deliberately not).
    pub fn weights_of<'a>(
        &self,
        gate_up: (&'a [u8], &'a [f16]),
        down: (&'a [u8], &'a [f16]),
        hidden: usize,
        inter: usize,
    ) -> ExpertWeights<'a> {
        match self.bits {
            8 => ExpertWeights::int8(gate_up, down, hidden, inter),
            _ => ExpertWeights::int4(gate_up, down, hidden, inter),
        }
    }

    pub fn weights(&self) -> ExpertWeights<'_> {
        self.weights_of(
            (&self.gate_up, &self.gate_up_scales),
            (&self.down, &self.down_scales),
            self.hidden,
            self.inter,
        )
    }

    /// Input `col`'s dequantized weight in row `row` of a matrix of `k` inputs.
    fn weight(&self, (codes, scales): (&[u8], &[f16]), row: usize, col: usize, k: usize) -> f64 {
        let i = row * k + col;
        let code = match self.bits {
            8 => codes[i],
            _ => (codes[i / 2] >> (4 * (i % 2))) & 0xF,
        };
        let zero = (1u32 << (self.bits - 1)) as f64;
        (code as f64 - zero) * scales[row * (k / 128) + col / 128].to_f64()
    }

    /// `weight * down(silu(gate x) * (up x))` for one row `x`, in f64 from the dequantized
    /// weights and f16-rounded activations (the value the kernels approximate).
    pub fn reference(&self, x: &[f32], weight: f32) -> Vec<f64> {
        let (h, i) = (self.hidden, self.inter);
        let (gate_up, down) = (
            (&self.gate_up[..], &self.gate_up_scales[..]),
            (&self.down[..], &self.down_scales[..]),
        );
        let round = |v: f64| f16::from_f64(v).to_f64();
        let act: Vec<f64> = (0..i)
            .map(|j| {
                let dot = |r: usize| -> f64 {
                    (0..h)
                        .map(|c| self.weight(gate_up, r, c, h) * round(x[c] as f64))
                        .sum()
                };
                let (g, u) = (dot(j), dot(i + j));
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        (0..h)
            .map(|c| {
                weight as f64
                    * (0..i)
                        .map(|j| self.weight(down, c, j, i) * round(act[j]))
                        .sum::<f64>()
            })
            .collect()
    }
}
