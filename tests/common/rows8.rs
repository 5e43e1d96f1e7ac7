//! Random 8-bit routed experts in the row layout, for the host kernel's tests and its
//! comparison with the GPU's row kernels.

use half::f16;
use rand::Rng;
use specter::host_experts::ExpertWeights;

/// One expert: gate/up codes `[2 inter][hidden]` with `[2 inter][hidden / 128]` scales, down
/// codes `[hidden][inter]` with `[hidden][inter / 128]` scales.
pub struct Int8Expert {
    pub gate_up: Vec<u8>,
    pub gate_up_scales: Vec<f16>,
    pub down: Vec<u8>,
    pub down_scales: Vec<f16>,
    pub hidden: usize,
    pub inter: usize,
}

impl Int8Expert {
    /// Uniform codes (never all one value) and scales near `1 / (64 sqrt(k))`, so that products
    /// stay of order one.
    pub fn random(rng: &mut impl Rng, hidden: usize, inter: usize) -> Self {
        let mut codes = |n: usize| -> Vec<u8> { (0..n).map(|_| rng.random()).collect() };
        let (gate_up, down) = (codes(2 * inter * hidden), codes(hidden * inter));
        let mut scales = |n: usize, k: usize| -> Vec<f16> {
            let base = 1.0 / (64.0 * (k as f32).sqrt());
            (0..n)
                .map(|_| f16::from_f32(base * rng.random_range(0.5..1.5f32)))
                .collect()
        };
        Int8Expert {
            gate_up,
            gate_up_scales: scales(2 * inter * hidden / 128, hidden),
            down,
            down_scales: scales(hidden * inter / 128, inter),
            hidden,
            inter,
        }
    }

    pub fn weights(&self) -> ExpertWeights<'_> {
        ExpertWeights::int8(
            (&self.gate_up, &self.gate_up_scales),
            (&self.down, &self.down_scales),
            self.hidden,
            self.inter,
        )
    }

    /// `weight * down(silu(gate x) * (up x))` for one row `x`, in f64 from the dequantized
    /// weights and f16-rounded activations (the value the kernels approximate).
    pub fn reference(&self, x: &[f32], weight: f32) -> Vec<f64> {
        let (h, i) = (self.hidden, self.inter);
        let w = |codes: &[u8], scales: &[f16], row: usize, col: usize, k: usize| {
            (codes[row * k + col] as f64 - 128.0) * scales[row * (k / 128) + col / 128].to_f64()
        };
        let round = |v: f64| f16::from_f64(v).to_f64();
        let act: Vec<f64> = (0..i)
            .map(|j| {
                let dot = |r: usize| -> f64 {
                    (0..h)
                        .map(|c| {
                            w(&self.gate_up, &self.gate_up_scales, r, c, h) * round(x[c] as f64)
                        })
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
                        .map(|j| w(&self.down, &self.down_scales, c, j, i) * round(act[j]))
                        .sum::<f64>()
            })
            .collect()
    }
}
