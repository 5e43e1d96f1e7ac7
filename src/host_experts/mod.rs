//! The FP16 routed-expert FFN on host threads: a second path for cold experts, reading the
//! bundle's FP16 expert tensors where they lie (in the mapping, no copy).
//!
//! Its output has the bits of the GPU's routed-expert kernels (`moe_f16_gate_up` and
//! `moe_f16_down` in kernels/gemv_f16.cu) for the same inputs: each dot product in the GPU's lane
//! order ([`lanes`]), the same SiLU ([`activation`]), and the same final products. So an expert
//! may run on either side without changing a token. With AVX2, FMA and F16C the lane partials
//! are computed eight lanes at a time (`avx2.rs`); elsewhere a portable path gives the same bits.

pub mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod bandwidth;
pub mod lanes;

use half::f16;
use rayon::prelude::*;

use crate::{Error, Result};

/// Which implementation runs the lane partials.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KernelPath {
    Avx2,
    Portable,
}

impl KernelPath {
    /// The fastest path this processor supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            return KernelPath::Avx2;
        }
        KernelPath::Portable
    }

    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Avx2 => "avx2+fma+f16c",
            KernelPath::Portable => "portable (no AVX2/FMA/F16C: slower, same bits)",
        }
    }
}

/// One routed expert's FP16 weights: `gate` and `up` are `[inter, hidden]`, `down` is
/// `[hidden, inter]` (row-major, as in the bundle).
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    pub gate: &'a [f16],
    pub up: &'a [f16],
    pub down: &'a [f16],
    pub hidden: usize,
    pub inter: usize,
}

impl ExpertWeights<'_> {
    fn check(&self) -> Result<()> {
        if self.gate.len() != self.inter * self.hidden
            || self.up.len() != self.inter * self.hidden
            || self.down.len() != self.hidden * self.inter
            || self.hidden == 0
            || self.inter == 0
        {
            return Err(Error::Request(format!(
                "host expert: gate, up and down have {}, {} and {} halves, expected {} each for hidden {} and inter {}",
                self.gate.len(),
                self.up.len(),
                self.down.len(),
                self.hidden * self.inter,
                self.hidden,
                self.inter
            )));
        }
        Ok(())
    }
}

/// The host expert kernel: a thread pool and the path it runs.
pub struct HostExperts {
    pool: rayon::ThreadPool,
    threads: usize,
    path: KernelPath,
}

/// Features one task computes; small enough to balance 16 threads on 1,408 features.
const FEATURES_PER_TASK: usize = 32;

impl HostExperts {
    /// `threads` host threads (at least 1, at most the machine's), on `path` (or the fastest).
    pub fn new(threads: usize, path: Option<KernelPath>) -> Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if threads == 0 || threads > cores {
            return Err(Error::Request(format!(
                "host threads must be in 1..={cores} (this machine's cores), got {threads}"
            )));
        }
        let path = match path {
            Some(KernelPath::Avx2) if KernelPath::detect() != KernelPath::Avx2 => {
                return Err(Error::Request(
                    "the AVX2 host expert path needs AVX2, FMA and F16C, which this processor lacks"
                        .into(),
                ))
            }
            Some(p) => p,
            None => KernelPath::detect(),
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("specter-host-expert-{i}"))
            .build()
            .map_err(|e| Error::Backend(format!("cannot start host expert threads: {e}")))?;
        Ok(HostExperts {
            pool,
            threads,
            path,
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn path(&self) -> KernelPath {
        self.path
    }

    /// `out[r] = weight[r] * down(silu(gate(x[r])) * up(x[r]))` for each row `r` of `x`
    /// (`rows x hidden`, row-major), into `out` (`rows x hidden`): the GPU's per-item output.
    pub fn expert(
        &self,
        w: &ExpertWeights<'_>,
        x: &[f32],
        weights: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        w.check()?;
        let rows = weights.len();
        if x.len() != rows * w.hidden || out.len() != rows * w.hidden {
            return Err(Error::Request(format!(
                "host expert: {} activations and {} outputs for {rows} rows of {}",
                x.len(),
                out.len(),
                w.hidden
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let (hidden, inter) = (w.hidden, w.inter);
        // Gate and up: h[r][j] = silu(x[r] . gate_j) * (x[r] . up_j).
        let xs: Vec<&[f32]> = x.chunks_exact(hidden).collect();
        let xt = self.transposed(&xs);
        let path = self.path;
        let h_cols: Vec<Vec<f32>> = self.pool.install(|| {
            (0..inter.div_ceil(FEATURES_PER_TASK))
                .into_par_iter()
                .map(|task| {
                    let lo = task * FEATURES_PER_TASK;
                    let hi = (lo + FEATURES_PER_TASK).min(inter);
                    let mut col = Vec::with_capacity((hi - lo) * rows);
                    let mut gate = vec![0.0; rows];
                    let mut up = vec![0.0; rows];
                    for j in lo..hi {
                        let wg = &w.gate[j * hidden..(j + 1) * hidden];
                        let wu = &w.up[j * hidden..(j + 1) * hidden];
                        dots(path, wg, &xt, &xs, &mut gate);
                        dots(path, wu, &xt, &xs, &mut up);
                        col.extend(gate.iter().zip(&up).map(|(&g, &u)| activation::silu(g) * u));
                    }
                    col
                })
                .collect()
        });
        let mut h = vec![0.0f32; rows * inter];
        for (task, col) in h_cols.iter().enumerate() {
            let lo = task * FEATURES_PER_TASK;
            for (n, &v) in col.iter().enumerate() {
                let (j, r) = (lo + n / rows, n % rows);
                h[r * inter + j] = v;
            }
        }
        // Down: out[r][c] = weight[r] * (h[r] . down_c).
        let hs: Vec<&[f32]> = h.chunks_exact(inter).collect();
        let ht = self.transposed(&hs);
        let out_cols: Vec<Vec<f32>> = self.pool.install(|| {
            (0..hidden.div_ceil(FEATURES_PER_TASK))
                .into_par_iter()
                .map(|task| {
                    let lo = task * FEATURES_PER_TASK;
                    let hi = (lo + FEATURES_PER_TASK).min(hidden);
                    let mut col = Vec::with_capacity((hi - lo) * rows);
                    let mut s = vec![0.0; rows];
                    for c in lo..hi {
                        dots(path, &w.down[c * inter..(c + 1) * inter], &ht, &hs, &mut s);
                        col.extend(s.iter().zip(weights).map(|(&v, &wt)| wt * v));
                    }
                    col
                })
                .collect()
        });
        for (task, col) in out_cols.iter().enumerate() {
            let lo = task * FEATURES_PER_TASK;
            for (n, &v) in col.iter().enumerate() {
                let (c, r) = (lo + n / rows, n % rows);
                out[r * hidden + c] = v;
            }
        }
        Ok(())
    }

    /// The rows transposed for the AVX2 path (empty on the portable one).
    fn transposed(&self, rows: &[&[f32]]) -> Vec<Vec<f32>> {
        #[cfg(target_arch = "x86_64")]
        if self.path == KernelPath::Avx2 {
            return rows
                .iter()
                .map(|r| {
                    let mut t = Vec::new();
                    avx2::transpose_x(r, &mut t);
                    t
                })
                .collect();
        }
        let _ = rows;
        Vec::new()
    }
}

/// `out[r] = w . x[r]` in the GPU's order for every row.
fn dots(path: KernelPath, w: &[f16], xt: &[Vec<f32>], xs: &[&[f32]], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if path == KernelPath::Avx2 && w.len() & 7 == 0 {
        let mut partials = [[0.0f32; lanes::LANES]; avx2::ROWS_PER_PASS];
        for start in (0..xs.len()).step_by(avx2::ROWS_PER_PASS) {
            let end = (start + avx2::ROWS_PER_PASS).min(xs.len());
            let xt_rows: Vec<&[f32]> = xt[start..end].iter().map(Vec::as_slice).collect();
            let part = &mut partials[..end - start];
            // SAFETY: the Avx2 path is only chosen when the processor has AVX2, FMA and F16C
            // (`HostExperts::new`); `w.len()` is a multiple of 8 and every row has its length.
            unsafe { avx2::partials(w, &xt_rows, &xs[start..end], part) };
            for (o, p) in out[start..end].iter_mut().zip(part.iter()) {
                *o = lanes::lane_sum(p);
            }
        }
        return;
    }
    let _ = (path, xt);
    for (o, x) in out.iter_mut().zip(xs) {
        *o = lanes::dot(w, x);
    }
}
