//! The FP16 routed-expert FFN on host threads: a second path for cold experts, reading the
//! bundle's FP16 expert tensors where they lie (in the mapping, no copy).
//!
//! Its output has the bits of the GPU's routed-expert kernels (`moe_f16_gate_up` and
//! `moe_f16_down` in kernels/gemv_f16.cu) for the same inputs: each dot product in the GPU's lane
//! order ([`lanes`]), the same SiLU ([`activation`]), and the same final products. So an expert
//! may run on either side without changing a token. With AVX2, FMA and F16C a lane's eight
//! partials are one vector fed by plain loads (`avx2.rs`); elsewhere a portable path gives the
//! same bits. A layer's host experts run as one call ([`HostExperts::experts`]) on the kernel's
//! own thread pool.

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

/// The host path's threads when the user names none: every core but one, which the decode
/// thread keeps (it launches the GPU's share of a layer and waits on it while the pool computes).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
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

/// Features one task computes: small enough to balance 16 threads over a layer's experts, large
/// enough that a task's weights (16 rows of 2,048 halves per matrix) dwarf its scheduling.
const FEATURES_PER_TASK: usize = 16;

/// One expert's work for the host: its weights, its rows' activations (`rows x hidden`,
/// row-major) and each row's combine weight.
#[derive(Clone, Copy, Debug)]
pub struct ExpertJob<'a> {
    pub weights: ExpertWeights<'a>,
    pub x: &'a [f32],
    pub row_weights: &'a [f32],
}

impl ExpertJob<'_> {
    fn rows(&self) -> usize {
        self.row_weights.len()
    }

    fn check(&self) -> Result<()> {
        self.weights.check()?;
        if self.x.len() != self.rows() * self.weights.hidden {
            return Err(Error::Request(format!(
                "host expert: {} activations for {} rows of {}",
                self.x.len(),
                self.rows(),
                self.weights.hidden
            )));
        }
        Ok(())
    }
}

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

    /// The thread pool, for callers that overlap host expert work with their own
    /// ([`rayon::ThreadPool::in_place_scope`]).
    pub fn pool(&self) -> &rayon::ThreadPool {
        &self.pool
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
        let job = ExpertJob {
            weights: *w,
            x,
            row_weights: weights,
        };
        self.experts(&[job], &mut [out])
    }

    /// Every job's output (`rows x hidden`) into the matching `outs` entry, the features of all
    /// jobs shared among the threads: one parallel pass for gate and up, one for down.
    pub fn experts(&self, jobs: &[ExpertJob<'_>], outs: &mut [&mut [f32]]) -> Result<()> {
        self.experts_and_gate_ups(jobs, outs, &[], &mut [])
    }

    /// As [`Self::experts`], and for each of `halves` only the activations the down projection
    /// reads, `h[r][j] = silu(gate_j . x[r]) * (up_j . x[r])` (`rows x inter`, the GPU's bits),
    /// into the matching `hs` entry: those experts' down products run elsewhere. The halves'
    /// gate and up share the first parallel pass with the whole experts'.
    pub fn experts_and_gate_ups(
        &self,
        jobs: &[ExpertJob<'_>],
        outs: &mut [&mut [f32]],
        halves: &[ExpertJob<'_>],
        hs_out: &mut [&mut [f32]],
    ) -> Result<()> {
        let hidden_of: fn(&ExpertWeights<'_>) -> usize = |w| w.hidden;
        let inter_of: fn(&ExpertWeights<'_>) -> usize = |w| w.inter;
        for (what, jobs, outs, width) in [
            ("outputs", jobs, &*outs, hidden_of),
            ("activations", halves, &*hs_out, inter_of),
        ] {
            if jobs.len() != outs.len() {
                return Err(Error::Request(format!(
                    "host expert: {} jobs and {} {what}",
                    jobs.len(),
                    outs.len()
                )));
            }
            for (job, out) in jobs.iter().zip(outs.iter()) {
                job.check()?;
                if out.len() != job.rows() * width(&job.weights) {
                    return Err(Error::Request(format!(
                        "host expert: {} {what} for {} rows of {}",
                        out.len(),
                        job.rows(),
                        width(&job.weights)
                    )));
                }
            }
        }
        let whole = jobs.len();
        let all: Vec<ExpertJob<'_>> = jobs.iter().chain(halves).copied().collect();
        let jobs = &all[..];
        let path = self.path;
        // Gate and up: h[r][j] = silu(x[r] . gate_j) * (x[r] . up_j).
        let inputs: Vec<Vec<&[f32]>> = jobs
            .iter()
            .map(|j| j.x.chunks_exact(j.weights.hidden).collect())
            .collect();
        let tasks = feature_tasks(jobs, |w| w.inter);
        let h_cols: Vec<Vec<f32>> = self.pool.install(|| {
            tasks
                .par_iter()
                .map(|&(job, lo, hi)| {
                    let w = &jobs[job].weights;
                    let xs = &inputs[job];
                    let rows = xs.len();
                    let hidden = w.hidden;
                    let mut col = Vec::with_capacity((hi - lo) * rows);
                    // Gate's products for every row, then up's.
                    let mut gate_up = vec![0.0; 2 * rows];
                    for j in lo..hi {
                        let wg = &w.gate[j * hidden..(j + 1) * hidden];
                        let wu = &w.up[j * hidden..(j + 1) * hidden];
                        if j + 1 < hi {
                            prefetch(path, &w.gate[(j + 1) * hidden..(j + 2) * hidden]);
                            prefetch(path, &w.up[(j + 1) * hidden..(j + 2) * hidden]);
                        }
                        dots(path, &[wg, wu], xs, &mut gate_up);
                        let (gate, up) = gate_up.split_at(rows);
                        col.extend(gate.iter().zip(up).map(|(&g, &u)| activation::silu(g) * u));
                    }
                    col
                })
                .collect()
        });
        let mut hs: Vec<Vec<f32>> = jobs
            .iter()
            .map(|j| vec![0.0f32; j.rows() * j.weights.inter])
            .collect();
        for (&(job, lo, _), col) in tasks.iter().zip(&h_cols) {
            scatter(
                col,
                lo,
                jobs[job].rows(),
                jobs[job].weights.inter,
                &mut hs[job],
            );
        }
        for (h, out) in hs[whole..].iter().zip(hs_out.iter_mut()) {
            out.copy_from_slice(h);
        }
        // Down: out[r][c] = weight[r] * (h[r] . down_c), for the whole experts.
        let jobs = &all[..whole];
        let h_rows: Vec<Vec<&[f32]>> = jobs
            .iter()
            .zip(&hs)
            .map(|(j, h)| h.chunks_exact(j.weights.inter).collect())
            .collect();
        let tasks = feature_tasks(jobs, |w| w.hidden);
        let out_cols: Vec<Vec<f32>> = self.pool.install(|| {
            tasks
                .par_iter()
                .map(|&(job, lo, hi)| {
                    let w = &jobs[job].weights;
                    let hr = &h_rows[job];
                    let inter = w.inter;
                    let mut col = Vec::with_capacity((hi - lo) * hr.len());
                    let rows = hr.len();
                    let mut s = vec![0.0; 2 * rows];
                    let row = |c: usize| &w.down[c * inter..(c + 1) * inter];
                    // Features in pairs (one activation load serves both), the odd one alone.
                    for c in (lo..hi).step_by(2) {
                        let pair = c + 1 < hi;
                        if c + 2 < hi {
                            prefetch(path, &w.down[(c + 2) * inter..(c + 4).min(hi) * inter]);
                        }
                        let n = if pair {
                            dots(path, &[row(c), row(c + 1)], hr, &mut s);
                            2 * rows
                        } else {
                            dots(path, &[row(c)], hr, &mut s[..rows]);
                            rows
                        };
                        let weights = jobs[job].row_weights.iter().cycle();
                        col.extend(s[..n].iter().zip(weights).map(|(&v, &wt)| wt * v));
                    }
                    col
                })
                .collect()
        });
        for (&(job, lo, _), col) in tasks.iter().zip(&out_cols) {
            scatter(
                col,
                lo,
                jobs[job].rows(),
                jobs[job].weights.hidden,
                outs[job],
            );
        }
        Ok(())
    }
}

/// `(job, first feature, end)` for every job with rows, `FEATURES_PER_TASK` features each.
fn feature_tasks(
    jobs: &[ExpertJob<'_>],
    features: impl Fn(&ExpertWeights<'_>) -> usize,
) -> Vec<(usize, usize, usize)> {
    let mut tasks = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        if job.rows() == 0 {
            continue;
        }
        let n = features(&job.weights);
        for lo in (0..n).step_by(FEATURES_PER_TASK) {
            tasks.push((j, lo, (lo + FEATURES_PER_TASK).min(n)));
        }
    }
    tasks
}

/// Writes a task's feature-major column block (`features x rows`, starting at feature `lo`)
/// into the row-major `rows x width` matrix `m`.
fn scatter(col: &[f32], lo: usize, rows: usize, width: usize, m: &mut [f32]) {
    for (n, &v) in col.iter().enumerate() {
        let (f, r) = (lo + n / rows, n % rows);
        m[r * width + f] = v;
    }
}

/// Asks the cache for the next weight row while this one is computed (the AVX2 path's passes
/// over a row leave the hardware prefetcher an irregular stream).
#[inline]
fn prefetch(path: KernelPath, w: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    if path == KernelPath::Avx2 {
        avx2::prefetch(w);
    }
    let _ = (path, w);
}

/// `out[f * rows + r] = w[f] . x[r]` in the GPU's order for one or two weight rows `w[f]` of
/// equal length and every row.
fn dots(path: KernelPath, w: &[&[f16]], xs: &[&[f32]], out: &mut [f32]) {
    let rows = xs.len();
    #[cfg(target_arch = "x86_64")]
    if path == KernelPath::Avx2 && w[0].len() & 7 == 0 {
        let mut partials = [[[0.0f32; lanes::POSITIONS]; lanes::LANES]; 2 * avx2::ROWS_PER_PASS];
        for start in (0..rows).step_by(avx2::ROWS_PER_PASS) {
            let end = (start + avx2::ROWS_PER_PASS).min(rows);
            let n = end - start;
            let part = &mut partials[..w.len() * n];
            // SAFETY: the Avx2 path is only chosen when the processor has AVX2, FMA and F16C
            // (`HostExperts::new`); every weight row's length is a multiple of 8 and every
            // activation row has it.
            unsafe { avx2::partials(w, &xs[start..end], part) };
            for (f, feature) in part.chunks_exact(n).enumerate() {
                for (r, p) in feature.iter().enumerate() {
                    // SAFETY: as above.
                    out[f * rows + start + r] = unsafe { avx2::combine(p) };
                }
            }
        }
        return;
    }
    let _ = path;
    for (f, wf) in w.iter().enumerate() {
        for (r, x) in xs.iter().enumerate() {
            out[f * rows + r] = lanes::dot(wf, x);
        }
    }
}
