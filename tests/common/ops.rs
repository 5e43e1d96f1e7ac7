//! The harness of the GPU op tests (tests/cuda_ops.rs, tests/cuda_ops_fused.rs): one op
//! family's run, its random inputs, and the comparisons against the CPU reference.

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::backend::cpu::Cpu;
use specter::backend::cuda::CudaBackend;
use specter::backend::Backend;

pub type CpuAct = <Cpu as Backend>::Act;
pub type GpuAct = <CudaBackend as Backend>::Act;
pub type CpuWeight = <Cpu as Backend>::Weight;
pub type GpuWeight = <CudaBackend as Backend>::Weight;

/// f32 arithmetic in a different order than the CPU: far below this.
pub const TOLERANCE: f64 = 2e-5;

/// ‖gpu − cpu‖ / ‖cpu‖, or why the outputs cannot be compared.
pub fn rel_err(gpu: &[f32], cpu: &[f32]) -> Result<f64, String> {
    if gpu.len() != cpu.len() {
        return Err(format!(
            "{} values from the GPU, {} from the CPU",
            gpu.len(),
            cpu.len()
        ));
    }
    if let Some(i) = gpu.iter().position(|v| !v.is_finite()) {
        return Err(format!("non-finite GPU output {} at {i}", gpu[i]));
    }
    let num: f64 = gpu
        .iter()
        .zip(cpu)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = cpu.iter().map(|b| (*b as f64).powi(2)).sum();
    Ok((num / den.max(1e-30)).sqrt())
}

/// One op family's run: the GPU backend, the random source of its inputs, and every failed case.
pub struct Family {
    pub name: &'static str,
    pub gpu: CudaBackend,
    pub rng: ChaCha8Rng,
    pub checks: usize,
    pub worst: f64,
    pub failures: Vec<String>,
}

impl Family {
    pub fn new(name: &'static str, seed: u64) -> Family {
        Family {
            name,
            gpu: super::gpu::backend(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            checks: 0,
            worst: 0.0,
            failures: Vec::new(),
        }
    }

    pub fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| self.rng.random_range(-scale..scale))
            .collect()
    }

    /// The same random `[rows, cols]` activation on both backends, and its values.
    pub fn act(&mut self, rows: usize, cols: usize) -> (CpuAct, GpuAct, Vec<f32>) {
        let v = self.values(rows * cols, 1.0);
        (
            Cpu.upload(rows, cols, &v).unwrap(),
            self.gpu.upload(rows, cols, &v).expect("GPU upload"),
            v,
        )
    }

    /// The same random f16 weight on both backends.
    pub fn weight(&mut self, name: &str, shape: &[usize], scale: f32) -> (CpuWeight, GpuWeight) {
        let n: usize = shape.iter().product();
        let v: Vec<f16> = self
            .values(n, scale)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        (
            Cpu.weight_f16(name, shape, &v).unwrap(),
            self.gpu.weight_f16(name, shape, &v).expect("GPU weight"),
        )
    }

    pub fn fail(&mut self, case: &str, why: String) {
        eprintln!("{case:<52} FAILED: {why}");
        self.failures.push(format!("{case}: {why}"));
    }

    /// Checks the GPU's values for `case` (or its error) against the CPU's; returns the GPU's
    /// values when it produced any, for further checks.
    pub fn compare(
        &mut self,
        case: &str,
        gpu: specter::Result<Vec<f32>>,
        cpu: &[f32],
    ) -> Option<Vec<f32>> {
        self.compare_within(case, gpu, cpu, TOLERANCE)
    }

    /// [`Family::compare`] with a bound of its own: for ops whose GPU arithmetic rounds its
    /// operands (a prompt pass's tensor cores).
    pub fn compare_within(
        &mut self,
        case: &str,
        gpu: specter::Result<Vec<f32>>,
        cpu: &[f32],
        bound: f64,
    ) -> Option<Vec<f32>> {
        self.checks += 1;
        let gpu = match gpu {
            Ok(gpu) => gpu,
            Err(err) => {
                self.fail(case, format!("GPU error: {err}"));
                return None;
            }
        };
        match rel_err(&gpu, cpu) {
            Ok(e) if e < bound => {
                eprintln!("{case:<52} rel err {e:.2e}");
                self.worst = self.worst.max(e);
            }
            Ok(e) => {
                self.worst = self.worst.max(e);
                self.fail(case, format!("relative error {e:.3e} exceeds {bound:e}"));
            }
            Err(why) => self.fail(case, why),
        }
        Some(gpu)
    }

    /// [`Family::compare`] for an op's output activation.
    pub fn check(
        &mut self,
        case: &str,
        gpu: specter::Result<GpuAct>,
        cpu: &CpuAct,
    ) -> Option<Vec<f32>> {
        let gpu = gpu.and_then(|g| self.gpu.to_host(&g));
        let cpu = Cpu.to_host(cpu).unwrap();
        self.compare(case, gpu, &cpu)
    }

    /// [`Family::compare`] for an op that updates `gpu_out` in place and returned `result`.
    pub fn check_in_place(
        &mut self,
        case: &str,
        result: specter::Result<()>,
        gpu_out: &GpuAct,
        cpu_out: &CpuAct,
    ) {
        let gpu = result.and_then(|()| self.gpu.to_host(gpu_out));
        let cpu = Cpu.to_host(cpu_out).unwrap();
        self.compare(case, gpu, &cpu);
    }

    /// A case that passes when `ok`; `why` says what went wrong otherwise.
    pub fn expect(&mut self, case: &str, ok: bool, why: impl FnOnce() -> String) {
        self.checks += 1;
        if ok {
            eprintln!("{case:<52} ok");
        } else {
            let why = why();
            self.fail(case, why);
        }
    }

    /// Batch invariance: `alone` (GPU values computed for a part of a batch on its own, or the
    /// error doing so) equals `in_batch` bit for bit.
    pub fn same_bits(&mut self, case: &str, alone: specter::Result<Vec<f32>>, in_batch: &[f32]) {
        match alone {
            Ok(alone) => {
                let first_difference = if alone.len() != in_batch.len() {
                    Some(alone.len().min(in_batch.len()))
                } else {
                    alone
                        .iter()
                        .zip(in_batch)
                        .position(|(a, b)| a.to_bits() != b.to_bits())
                };
                self.expect(case, first_difference.is_none(), || {
                    format!(
                        "alone differs from the batch from element {} on",
                        first_difference.unwrap_or_default()
                    )
                });
            }
            Err(err) => {
                self.checks += 1;
                self.fail(case, format!("GPU error: {err}"));
            }
        }
    }

    /// Ends the family: passes only if every case did, and lists every failed one otherwise.
    pub fn finish(self) {
        eprintln!(
            "{}: {} checks, {} failed, worst relative error {:.2e}",
            self.name,
            self.checks,
            self.failures.len(),
            self.worst
        );
        assert!(self.checks > 0, "{}: no check ran", self.name);
        assert!(
            self.failures.is_empty(),
            "{}: {} of {} checks failed:\n  {}",
            self.name,
            self.failures.len(),
            self.checks,
            self.failures.join("\n  ")
        );
    }
}
