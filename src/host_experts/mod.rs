//! The routed-expert FFN on host threads: a second path for cold experts, reading the bundle's
//! expert tensors where they lie (in the mapping, no copy), FP16, 8-bit or 4-bit.
//!
//! Its output has the bits of the GPU's routed-expert kernels for the same inputs: FP16 experts
//! those of `moe_f16_gate_up` and `moe_f16_down` (kernels/gemv_f16.cu), each dot product in the
//! GPU's lane order ([`lanes`]); 8- and 4-bit experts those of `moe_rows_gate_up_<B>` and
//! `moe_rows_down_<B>` (kernels/moe_rows.cu), by its numerics contract ([`rows8`], [`rows4`]);
//! all with the same SiLU ([`activation`]) and final products. So an expert may run on either
//! side without changing a token. With AVX2, FMA and F16C the lanes' work is vectors (`avx2.rs`,
//! [`rows8`], [`rows4`]); elsewhere a portable path gives the same bits. A layer's host experts
//! run as one call ([`HostExperts::experts`]) on the kernel's own team of threads, which stay
//! awake between a decode step's layers (`team.rs`).

pub mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod bandwidth;
pub mod lanes;
pub mod rows4;
pub mod rows8;
mod team;

use half::f16;

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
/// thread keeps (it launches the GPU's share of a layer, then joins the team's threads).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
}

/// One routed expert's tensors, as the bundle holds them.
#[derive(Clone, Copy, Debug)]
pub enum ExpertTensors<'a> {
    /// FP16: `gate` and `up` are `[inter, hidden]`, `down` is `[hidden, inter]` (row-major).
    F16 {
        gate: &'a [f16],
        up: &'a [f16],
        down: &'a [f16],
    },
    /// 8-bit codes in the row layout: `gate_up` is `[2 inter][hidden]` (gate rows, then up
    /// rows) with `[2 inter][hidden / 128]` scales, `down` is `[hidden][inter]` with
    /// `[hidden][inter / 128]` scales.
    Int8 {
        gate_up: &'a [u8],
        gate_up_scales: &'a [f16],
        down: &'a [u8],
        down_scales: &'a [f16],
    },
    /// 4-bit codes in the row layout, two a byte (input `2 j` in byte `j`'s low nibble, `2 j + 1`
    /// in its high one): `gate_up` is `[2 inter][hidden / 2]` bytes (gate rows, then up rows)
    /// with `[2 inter][hidden / 128]` scales, `down` is `[hidden][inter / 2]` bytes with
    /// `[hidden][inter / 128]` scales.
    Int4 {
        gate_up: &'a [u8],
        gate_up_scales: &'a [f16],
        down: &'a [u8],
        down_scales: &'a [f16],
    },
}

impl<'a> ExpertTensors<'a> {
    /// The codes and scales of an expert in a row layout, and the kernel that reads them.
    fn row_layout(self) -> Option<RowTensors<'a>> {
        let (kernel, gate_up, gate_up_scales, down, down_scales) = match self {
            ExpertTensors::F16 { .. } => return None,
            ExpertTensors::Int8 {
                gate_up,
                gate_up_scales,
                down,
                down_scales,
            } => (RowKernel::Eight, gate_up, gate_up_scales, down, down_scales),
            ExpertTensors::Int4 {
                gate_up,
                gate_up_scales,
                down,
                down_scales,
            } => (RowKernel::Four, gate_up, gate_up_scales, down, down_scales),
        };
        Some(RowTensors {
            kernel,
            gate_up: (gate_up, gate_up_scales),
            down: (down, down_scales),
        })
    }
}

/// The row-layout kernels: 8-bit ([`rows8`]) and 4-bit ([`rows4`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowKernel {
    Eight,
    Four,
}

impl RowKernel {
    /// Bits per code.
    fn bits(self) -> usize {
        match self {
            RowKernel::Eight => 8,
            RowKernel::Four => 4,
        }
    }

    /// Floats of a staged activation row of `k` inputs.
    fn staged_len(self, k: usize) -> usize {
        match self {
            RowKernel::Eight => k,
            RowKernel::Four => rows4::staged_len(k),
        }
    }

    /// Activation row `x` staged for the kernel into `out` (`staged_len` long).
    fn stage(self, x: &[f32], out: &mut [f32]) {
        match self {
            RowKernel::Eight => rows8::stage(x, out),
            RowKernel::Four => rows4::stage(x, out),
        }
    }

    /// Where input `i` of a staged row lies, and its value `v` staged.
    fn staged_at(self, i: usize, v: f32) -> (usize, f32) {
        match self {
            RowKernel::Eight => (rows8::staged_index(i), rows8::operand(v)),
            RowKernel::Four => (rows4::staged_index(i), rows4::staged_value(i, v)),
        }
    }

    /// `codes[f] · x` for one or two rows into `out[f]`, `x` staged.
    fn dots(
        self,
        path: KernelPath,
        codes: &[&[u8]],
        scales: &[&[f16]],
        x: &[f32],
        out: &mut [f32],
    ) {
        match self {
            RowKernel::Eight => rows8::dots(path, codes, scales, x, out),
            RowKernel::Four => rows4::dots(path, codes, scales, x, out),
        }
    }
}

/// A row-layout expert's matrices, each its codes and scales.
#[derive(Clone, Copy, Debug)]
struct RowTensors<'a> {
    kernel: RowKernel,
    gate_up: (&'a [u8], &'a [f16]),
    down: (&'a [u8], &'a [f16]),
}

impl<'a> RowTensors<'a> {
    /// Rows `lo..hi` of `matrix` (`k` inputs a row): their codes and scales.
    fn rows(
        &self,
        matrix: (&'a [u8], &'a [f16]),
        lo: usize,
        hi: usize,
        k: usize,
    ) -> (&'a [u8], &'a [f16]) {
        let (bytes, groups) = (k * self.kernel.bits() / 8, k / rows8::GROUP);
        (
            &matrix.0[lo * bytes..hi * bytes],
            &matrix.1[lo * groups..hi * groups],
        )
    }

    /// The four tensors' lengths, and what they must be for `hidden` and `inter`.
    fn lengths(&self, hidden: usize, inter: usize) -> (Vec<usize>, Vec<usize>) {
        let (codes, scales) = (
            hidden * inter * self.kernel.bits() / 8,
            hidden * inter / rows8::GROUP,
        );
        (
            vec![
                self.gate_up.0.len(),
                self.gate_up.1.len(),
                self.down.0.len(),
                self.down.1.len(),
            ],
            vec![2 * codes, 2 * scales, codes, scales],
        )
    }
}

/// One routed expert: its tensors and shape.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    pub tensors: ExpertTensors<'a>,
    pub hidden: usize,
    pub inter: usize,
}

impl<'a> ExpertWeights<'a> {
    /// An FP16 expert (see [`ExpertTensors::F16`]).
    pub fn f16(
        gate: &'a [f16],
        up: &'a [f16],
        down: &'a [f16],
        hidden: usize,
        inter: usize,
    ) -> Self {
        ExpertWeights {
            tensors: ExpertTensors::F16 { gate, up, down },
            hidden,
            inter,
        }
    }

    /// An 8-bit expert in the row layout (see [`ExpertTensors::Int8`]).
    pub fn int8(
        gate_up: (&'a [u8], &'a [f16]),
        down: (&'a [u8], &'a [f16]),
        hidden: usize,
        inter: usize,
    ) -> Self {
        Self::quantized(RowKernel::Eight, gate_up, down, hidden, inter)
    }

    /// A 4-bit expert in the row layout (see [`ExpertTensors::Int4`]).
    pub fn int4(
        gate_up: (&'a [u8], &'a [f16]),
        down: (&'a [u8], &'a [f16]),
        hidden: usize,
        inter: usize,
    ) -> Self {
        Self::quantized(RowKernel::Four, gate_up, down, hidden, inter)
    }

    /// An expert of `kernel`'s width in the row layout.
    fn quantized(
        kernel: RowKernel,
        (gate_up, gate_up_scales): (&'a [u8], &'a [f16]),
        (down, down_scales): (&'a [u8], &'a [f16]),
        hidden: usize,
        inter: usize,
    ) -> Self {
        let tensors = match kernel {
            RowKernel::Eight => ExpertTensors::Int8 {
                gate_up,
                gate_up_scales,
                down,
                down_scales,
            },
            RowKernel::Four => ExpertTensors::Int4 {
                gate_up,
                gate_up_scales,
                down,
                down_scales,
            },
        };
        ExpertWeights {
            tensors,
            hidden,
            inter,
        }
    }

    fn check(&self) -> Result<()> {
        let (h, i) = (self.hidden, self.inter);
        let (lens, want): (Vec<usize>, Vec<usize>) = match self.tensors {
            ExpertTensors::F16 { gate, up, down } => {
                (vec![gate.len(), up.len(), down.len()], vec![i * h; 3])
            }
            ExpertTensors::Int8 { .. } | ExpertTensors::Int4 { .. } => {
                let r = self.tensors.row_layout().expect("a row layout");
                if !h.is_multiple_of(rows8::GROUP) || !i.is_multiple_of(rows8::GROUP) {
                    return Err(Error::Request(format!(
                        "host expert: {}-bit experts need hidden and inter in multiples of {}, got {h} and {i}",
                        r.kernel.bits(),
                        rows8::GROUP
                    )));
                }
                r.lengths(h, i)
            }
        };
        if lens != want || h == 0 || i == 0 {
            return Err(Error::Request(format!(
                "host expert: tensors of {lens:?} values, expected {want:?} for hidden {h} and inter {i}"
            )));
        }
        Ok(())
    }
}

/// The host expert kernel: a team of threads and the path it runs.
pub struct HostExperts {
    team: team::Team,
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
    /// The thread that calls the kernel works beside them, so at most `cores - 1` are started.
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
        let team = team::Team::new(threads.min(cores - 1), "specter-host-expert")?;
        Ok(HostExperts {
            team,
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
        self.experts_and_gate_ups_while(jobs, outs, halves, hs_out, || ())
            .map(|_| ())
    }

    /// As [`Self::experts_and_gate_ups`], while the calling thread first runs `side` (the
    /// team's threads start on the experts at once; the caller joins them when `side` returns).
    pub fn experts_and_gate_ups_while<R>(
        &self,
        jobs: &[ExpertJob<'_>],
        outs: &mut [&mut [f32]],
        halves: &[ExpertJob<'_>],
        hs_out: &mut [&mut [f32]],
        side: impl FnOnce() -> R,
    ) -> Result<HostRun<R>> {
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
        let path = self.path;
        let inputs: Vec<Vec<&[f32]>> = all
            .iter()
            .map(|j| j.x.chunks_exact(j.weights.hidden).collect())
            .collect();
        // The activations: the whole experts' here, the halves' straight into `hs_out`.
        let mut own: Vec<Vec<f32>> = all[..whole]
            .iter()
            .map(|j| vec![0.0f32; j.rows() * j.weights.inter])
            .collect();
        let hs: Vec<Disjoint> = own
            .iter_mut()
            .map(|h| Disjoint::new(h))
            .chain(hs_out.iter_mut().map(|h| Disjoint::new(h)))
            .collect();
        let outs: Vec<Disjoint> = outs.iter_mut().map(|o| Disjoint::new(o)).collect();
        let layouts: Vec<Option<RowTensors<'_>>> =
            all.iter().map(|j| j.weights.tensors.row_layout()).collect();
        // The whole row-layout experts' activations as their down products read them (staged,
        // see rows8 and rows4; zeros where a 4-bit row pads its last octet), written by the
        // gate/up phase beside `hs` so that no down task stages them again.
        let mut own_staged: Vec<Vec<f32>> = all[..whole]
            .iter()
            .zip(&layouts)
            .map(|(j, l)| match l {
                Some(l) => vec![0.0f32; j.rows() * l.kernel.staged_len(j.weights.inter)],
                None => Vec::new(),
            })
            .collect();
        let hs_staged: Vec<Disjoint> = own_staged.iter_mut().map(|h| Disjoint::new(h)).collect();
        let gate_up_tasks = feature_tasks(&all, |w| w.inter);
        let down_tasks = feature_tasks(&all[..whole], |w| w.hidden);
        // Row-layout experts read their inputs staged (rounded to f16, in the lanes' order).
        let staged: Vec<Vec<f32>> = all
            .iter()
            .zip(&layouts)
            .map(|(j, l)| match l {
                Some(l) => stage_rows(l.kernel, j.x, j.weights.hidden),
                None => Vec::new(),
            })
            .collect();
        // Gate and up: h[r][j] = silu(x[r] . gate_j) * (x[r] . up_j).
        let gate_up = |&(job, lo, hi): &(usize, usize, usize)| {
            let w = &all[job].weights;
            let xs = &inputs[job];
            let rows = xs.len();
            let (hidden, inter) = (w.hidden, w.inter);
            // Gate's products for every row, then up's.
            let mut gate_up = vec![0.0; 2 * rows];
            for j in lo..hi {
                match (w.tensors, layouts[job]) {
                    (_, Some(l)) => {
                        let row = |f: usize| l.rows(l.gate_up, f, f + 1, hidden);
                        if j + 1 < hi {
                            prefetch(path, row(j + 1).0);
                            prefetch(path, row(inter + j + 1).0);
                        }
                        let ((g, gs), (u, us)) = (row(j), row(inter + j));
                        let width = l.kernel.staged_len(hidden);
                        for (r, x) in staged[job].chunks_exact(width).enumerate() {
                            let mut two = [0.0; 2];
                            l.kernel.dots(path, &[g, u], &[gs, us], x, &mut two);
                            (gate_up[r], gate_up[rows + r]) = (two[0], two[1]);
                        }
                    }
                    (ExpertTensors::F16 { gate, up, .. }, None) => {
                        let wg = &gate[j * hidden..(j + 1) * hidden];
                        let wu = &up[j * hidden..(j + 1) * hidden];
                        if j + 1 < hi {
                            prefetch(path, &gate[(j + 1) * hidden..(j + 2) * hidden]);
                            prefetch(path, &up[(j + 1) * hidden..(j + 2) * hidden]);
                        }
                        dots(path, &[wg, wu], xs, &mut gate_up);
                    }
                    (_, None) => unreachable!("only FP16 experts have no row layout"),
                }
                let (gate, up) = gate_up.split_at(rows);
                for (r, (&g, &u)) in gate.iter().zip(up).enumerate() {
                    let h = activation::silu(g) * u;
                    hs[job].set(r * inter + j, h);
                    if let (Some(staged), Some(l)) = (hs_staged.get(job), layouts[job]) {
                        let (at, v) = l.kernel.staged_at(j, h);
                        staged.set(r * l.kernel.staged_len(inter) + at, v);
                    }
                }
            }
        };
        // Down: out[r][c] = weight[r] * (h[r] . down_c), for the whole experts.
        let down = |&(job, lo, hi): &(usize, usize, usize)| {
            let w = &all[job].weights;
            let inter = w.inter;
            // SAFETY: the gate/up phase, which wrote these activations, has ended; nothing
            // writes them during this phase.
            let h = unsafe { hs[job].values() };
            let hr: Vec<&[f32]> = h.chunks_exact(inter).collect();
            let rows = hr.len();
            // SAFETY: as above, for the staged activations the gate/up phase wrote beside them.
            let h_staged = unsafe { hs_staged[job].values() };
            let mut s = vec![0.0; 2 * rows];
            // Features in pairs (one activation load serves both), the odd one alone.
            for c in (lo..hi).step_by(2) {
                let n = if c + 1 < hi { 2 } else { 1 };
                match (w.tensors, layouts[job]) {
                    (_, Some(l)) => {
                        if c + 2 < hi {
                            prefetch(path, l.rows(l.down, c + 2, (c + 4).min(hi), inter).0);
                        }
                        let ((a, sa), (b, sb)) = (
                            l.rows(l.down, c, c + 1, inter),
                            l.rows(l.down, c + n - 1, c + n, inter),
                        );
                        let (features, sc) = ([a, b], [sa, sb]);
                        let width = l.kernel.staged_len(inter);
                        for (r, x) in h_staged.chunks_exact(width).enumerate() {
                            let mut two = [0.0; 2];
                            l.kernel
                                .dots(path, &features[..n], &sc[..n], x, &mut two[..n]);
                            for (f, v) in two[..n].iter().enumerate() {
                                s[f * rows + r] = *v;
                            }
                        }
                    }
                    (ExpertTensors::F16 { down, .. }, None) => {
                        let row = |c: usize| &down[c * inter..(c + 1) * inter];
                        if c + 2 < hi {
                            prefetch(path, &down[(c + 2) * inter..(c + 4).min(hi) * inter]);
                        }
                        let features = [row(c), row(c + n - 1)];
                        dots(path, &features[..n], &hr, &mut s[..n * rows]);
                    }
                    (_, None) => unreachable!("only FP16 experts have no row layout"),
                }
                for (i, &v) in s[..n * rows].iter().enumerate() {
                    let (f, r) = (c + i / rows, i % rows);
                    outs[job].set(r * w.hidden + f, all[job].row_weights[r] * v);
                }
            }
        };
        let task = |phase: usize, i: usize| match phase {
            0 => gate_up(&gate_up_tasks[i]),
            _ => down(&down_tasks[i]),
        };
        let started = std::time::Instant::now();
        let mut side_done = started;
        let side = self
            .team
            .run(&[gate_up_tasks.len(), down_tasks.len()], &task, || {
                let r = side();
                side_done = std::time::Instant::now();
                r
            })?;
        Ok(HostRun {
            side,
            seconds: started.elapsed().as_secs_f64(),
            stall_seconds: side_done.elapsed().as_secs_f64(),
        })
    }
}

/// What [`HostExperts::experts_and_gate_ups_while`] returns: the side work's value, the host
/// work's wall time (from its start to its last task), and how long the caller waited for the
/// host work after its side work (it takes tasks meanwhile).
#[derive(Debug)]
pub struct HostRun<R> {
    pub side: R,
    pub seconds: f64,
    pub stall_seconds: f64,
}

/// A slice that a phase's tasks write at disjoint places (each task owns some features of every
/// row), read whole by the next phase.
struct Disjoint {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint indices (each feature of a job belongs to one task) and read only
// after the phase that wrote has ended (the team orders its phases), so sharing the pointer
// among the team's threads races on nothing.
unsafe impl Sync for Disjoint {}
// SAFETY: as above.
unsafe impl Send for Disjoint {}

impl Disjoint {
    fn new(values: &mut [f32]) -> Self {
        Disjoint {
            ptr: values.as_mut_ptr(),
            len: values.len(),
        }
    }

    /// Writes value `i`; tasks of one phase write disjoint indices.
    fn set(&self, i: usize, v: f32) {
        assert!(i < self.len, "host expert output {i} past {}", self.len);
        // SAFETY: `i` is in bounds (checked); the slice outlives the job (borrowed by the
        // caller of the team's run); no other task writes or reads index `i` in this phase.
        unsafe { *self.ptr.add(i) = v };
    }

    /// The whole slice.
    ///
    /// # Safety
    /// No task may write it while the returned slice lives (the phase that wrote it has ended).
    unsafe fn values(&self) -> &[f32] {
        // SAFETY: `ptr` and `len` come from a live `&mut [f32]` borrowed for the job; the caller
        // vouches that no write overlaps this read.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// `x` (`rows x width`) staged row by row for a row-layout kernel ([`rows8::stage`],
/// [`rows4::stage`]).
fn stage_rows(kernel: RowKernel, x: &[f32], width: usize) -> Vec<f32> {
    let staged = kernel.staged_len(width);
    let mut out = vec![0.0; x.len() / width * staged];
    for (xr, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(staged)) {
        kernel.stage(xr, o);
    }
    out
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

/// Asks the cache for the next weight row while this one is computed (the AVX2 path's passes
/// over a row leave the hardware prefetcher an irregular stream).
#[inline]
fn prefetch<T>(path: KernelPath, w: &[T]) {
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
