//! The host expert kernel and the link's copies reading host memory at the same time: the
//! ceiling of the hybrid path, which does exactly that. Each alone can be faster than its share
//! of the two together, and the kernel (explicit prefetches, a layer's experts a call) reads
//! faster than the plain read loop of `doctor`'s host read figure, so the ceiling is measured with
//! the kernel itself, not added up from the two figures alone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use half::f16;
use serde::Serialize;
use specter::backend::cuda::CudaDevice;
use specter::host_experts::{default_threads, ExpertJob, ExpertWeights, HostExperts};
use specter::{Error, Result};

use super::{driver, DoctorOptions};

/// The expert shape measured: DeepSeek-V2-Lite's routed experts (17.3 MB of FP16 weights).
const HIDDEN: usize = 2048;
const INTER: usize = 1408;
/// Experts per kernel call: a layer's routed experts, as the runtime batches the host's share.
const PER_CALL: usize = 6;
/// FP16 values of one expert: gate, up and down.
const EXPERT_VALUES: usize = 3 * INTER * HIDDEN;

/// Rates while the host expert kernel runs and pinned copies go to the GPU.
#[derive(Debug, Clone, Serialize)]
pub struct SharedReadReport {
    /// The kernel's threads, as `--host-threads` counts them (the runtime's default: every core
    /// but one; the calling thread works beside them).
    pub threads: usize,
    /// Bytes of FP16 expert weights the kernel read per second meanwhile, one row a call
    /// (decode), median of the repeats.
    pub host_bytes_per_s: f64,
    /// The copies' rate over the same time, bytes per second.
    pub link_bytes_per_s: f64,
}

impl SharedReadReport {
    /// Both together: what the hybrid path can read from host memory per second.
    pub fn total_bytes_per_s(&self) -> f64 {
        self.host_bytes_per_s + self.link_bytes_per_s
    }
}

/// Copies `opts.bandwidth_bytes` from pinned memory to the device in `opts.chunk_bytes` pieces,
/// again and again on a second thread, while the host expert kernel computes one row through
/// about `opts.host_read_bytes` of experts, `opts.repeats` times after a first pass.
pub(super) fn measure(device: &CudaDevice, opts: &DoctorOptions) -> Result<SharedReadReport> {
    let chunk = opts.chunk_bytes.max(1);
    let len = (opts.bandwidth_bytes / chunk).max(1) * chunk;
    let stream = device.stream().clone();
    let mut pinned = device.alloc_pinned(len)?;
    pinned.as_mut_slice()?.fill(0x5a);
    let mut dst = driver(
        "allocate device memory for the shared read test",
        stream.alloc_zeros::<u8>(len),
    )?;
    let mut kernel = KernelPasses::new(opts.host_read_bytes)?;
    let stop = AtomicBool::new(false);
    let (host, copied) = std::thread::scope(|s| {
        let copier = s.spawn(|| -> Result<(usize, f64)> {
            let start = Instant::now();
            let mut bytes = 0;
            // At least one round, so a fast kernel still overlaps some copying.
            while bytes == 0 || !stop.load(Ordering::Relaxed) {
                for offset in (0..len).step_by(chunk) {
                    let mut view = dst.slice_mut(offset..offset + chunk);
                    pinned.copy_to_device(offset..offset + chunk, &mut view, &stream)?;
                }
                pinned.wait()?;
                bytes += len;
            }
            Ok((bytes, start.elapsed().as_secs_f64()))
        });
        let host = kernel.median_rate(opts.repeats);
        stop.store(true, Ordering::Relaxed);
        let copied = copier.join().map_err(|_| {
            Error::Backend("the copying thread of the shared read test panicked".into())
        });
        (host, copied)
    });
    let (bytes, seconds) = copied??;
    Ok(SharedReadReport {
        threads: kernel.kernel.threads(),
        host_bytes_per_s: host?,
        link_bytes_per_s: bytes as f64 / seconds.max(1e-9),
    })
}

/// Expert `e` of `weights` (gate, up and down of each, one after another) over the row `x`.
fn job<'a>(weights: &'a [f16], e: usize, x: &'a [f32]) -> ExpertJob<'a> {
    let w = &weights[e * EXPERT_VALUES..(e + 1) * EXPERT_VALUES];
    let (gate_up, down) = w.split_at(2 * INTER * HIDDEN);
    let (gate, up) = gate_up.split_at(INTER * HIDDEN);
    ExpertJob {
        weights: ExpertWeights::f16(gate, up, down, HIDDEN, INTER),
        x,
        row_weights: &[0.5],
    }
}

/// The host expert kernel computing one row through a set of experts of the measured shape.
struct KernelPasses {
    kernel: HostExperts,
    experts: usize,
    /// `experts` experts' gate, up and down, one after another.
    weights: Vec<f16>,
    x: Vec<f32>,
    outs: Vec<Vec<f32>>,
}

impl KernelPasses {
    /// About `bytes` of experts (at least one call's), on the runtime's default threads.
    fn new(bytes: usize) -> Result<Self> {
        let experts = (bytes / (2 * EXPERT_VALUES)).max(PER_CALL);
        Ok(KernelPasses {
            kernel: HostExperts::new(default_threads(), None)?,
            experts,
            // Small nonzero weights of several values, so no arithmetic takes a shortcut.
            weights: (0..experts * EXPERT_VALUES)
                .map(|i| f16::from_f32(((i % 13) as f32 - 6.0) / 256.0))
                .collect(),
            x: (0..HIDDEN).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect(),
            outs: vec![vec![0.0; HIDDEN]; PER_CALL],
        })
    }

    /// One pass over the experts, a layer's worth a call: bytes of weights read per second.
    fn pass(&mut self) -> Result<f64> {
        let start = Instant::now();
        for first in (0..self.experts).step_by(PER_CALL) {
            let jobs: Vec<ExpertJob> = (first..(first + PER_CALL).min(self.experts))
                .map(|e| job(&self.weights, e, &self.x))
                .collect();
            let mut refs: Vec<&mut [f32]> = self
                .outs
                .iter_mut()
                .take(jobs.len())
                .map(|o| o.as_mut_slice())
                .collect();
            self.kernel.experts(&jobs, &mut refs)?;
        }
        let bytes = self.experts * EXPERT_VALUES * 2;
        Ok(bytes as f64 / start.elapsed().as_secs_f64().max(1e-9))
    }

    /// The median rate of `repeats` passes after a first, untimed one.
    fn median_rate(&mut self, repeats: usize) -> Result<f64> {
        self.pass()?;
        let mut rates = (0..repeats.max(1))
            .map(|_| self.pass())
            .collect::<Result<Vec<f64>>>()?;
        rates.sort_by(f64::total_cmp);
        Ok(rates[rates.len() / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_passes_compute_every_expert_and_report_a_rate() {
        let mut passes = KernelPasses::new(0).unwrap();
        assert_eq!(passes.experts, PER_CALL);
        let rate = passes.median_rate(1).unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
        // Each of the call's outputs is its expert's, as the kernel computes one alone.
        for (e, out) in passes.outs.iter().enumerate() {
            assert!(out.iter().any(|v| *v != 0.0), "expert {e}");
            let alone = job(&passes.weights, e, &passes.x);
            let mut want = vec![0.0; HIDDEN];
            passes
                .kernel
                .expert(&alone.weights, alone.x, alone.row_weights, &mut want)
                .unwrap();
            assert_eq!(out, &want, "expert {e}");
        }
    }
}
