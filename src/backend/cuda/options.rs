//! Settings of a CUDA backend that a caller chooses. The library reads no environment variables;
//! the binaries map `SPECTER_LOAD_THREADS` and their flags onto these fields.
//!
//! What the device decides is probed, not chosen: kernels start while the one before them
//! finishes (programmatic dependent launch) and run in thread block clusters on sm_90 and newer.
//! With the `measure` cargo feature, [`MeasureOptions`] leaves launches out of a pass or starts
//! them late, for the step benchmark (examples/bench_step.rs) alone.

use crate::backend::cuda::{HostExpertsConfig, HostPath, LoadIo, SplitExperts};

/// How a [`CudaBackend`](crate::backend::cuda::CudaBackend) runs.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaOptions {
    /// Record forward passes as CUDA graphs and replay them, and the segments of passes that
    /// wait for the device midway (see src/backend/cuda/graphs/mod.rs). Off: every op is launched
    /// as the pass runs. The same bits either way (tests/cuda_placement.rs).
    pub graphs: bool,
    /// Debugging: every op in its plain form: no fused op sequences (the shared experts and a
    /// one-row layer's FP16 experts as launches of their own, a one-row step's add + norm +
    /// products and MLA cache append as separate ops), no thread block clusters, each kernel
    /// launched only after the one before it has finished. The same bits as the fused forms
    /// (tests/cuda_placement.rs, tests/cuda_fixtures.rs check it), which is what it is for.
    pub plain: bool,
    /// Threads that read weights from the bundle at load time; `None`: the cores, at most 8.
    pub load_threads: Option<usize>,
    /// How weights are read from the bundle at load time.
    pub load_io: LoadIo,
    /// Where offloaded experts are copied from.
    pub host_path: HostPath,
    /// With offloaded experts: compute some missing ones on this many host threads instead of
    /// copying them (the hybrid path); `None`: copy every miss.
    pub host_experts: Option<usize>,
    /// The link's rate, bytes per second, that the hybrid split starts from (both paths' rates
    /// are then measured as the run goes). With a pace, the pace is the start instead.
    pub link_bytes_per_s: f64,
    /// With offloaded experts: hold expert copies to this many bytes per second, to emulate a
    /// slower link (25e9: PCIe 4.0 x16) on a faster one; `None`: the link's own rate.
    pub link_pace_bytes_per_s: Option<f64>,
}

#[cfg(feature = "measure")]
mod measure;
#[cfg(feature = "measure")]
pub use measure::{LaunchMatch, MeasureOptions, LAUNCH_LABELS};

/// How a launcher (the backend, the INT4 and row-layout expert kernels) starts each launch: early
/// where the device has programmatic dependent launch (and [`CudaOptions::plain`] is off); with
/// the `measure` feature, not at all or late for the launches [`MeasureOptions`] names.
#[derive(Clone, Debug, Default)]
pub(super) struct LaunchRule {
    overlap: bool,
    #[cfg(feature = "measure")]
    measure: MeasureOptions,
}

impl LaunchRule {
    pub(super) fn new(overlap: bool) -> Self {
        LaunchRule {
            overlap,
            #[cfg(feature = "measure")]
            measure: MeasureOptions::default(),
        }
    }

    #[cfg(feature = "measure")]
    pub(super) fn measuring(mut self, measure: MeasureOptions) -> Self {
        self.measure = measure;
        self
    }

    /// For the launch of `kernel` (its label) over `blocks` blocks: `None` when it is left out,
    /// else whether it starts early.
    #[cfg_attr(not(feature = "measure"), allow(unused_variables))]
    pub(super) fn overlap_for(&self, kernel: &str, blocks: u32) -> Option<bool> {
        #[cfg(feature = "measure")]
        {
            if LaunchMatch::any(&self.measure.skip, kernel, blocks) {
                return None;
            }
            if LaunchMatch::any(&self.measure.serial, kernel, blocks) {
                return Some(false);
            }
        }
        Some(self.overlap)
    }
}

impl CudaOptions {
    /// The host path with `threads` threads, its split starting from the link's rate (the pace,
    /// when set) for both paths: the split corrects the host's after the first layer.
    pub fn host_experts_config(&self, threads: usize) -> HostExpertsConfig {
        let link = self.link_pace_bytes_per_s.unwrap_or(self.link_bytes_per_s);
        HostExpertsConfig {
            threads,
            link_bytes_per_s: link,
            host_bytes_per_s: link,
            split: SplitExperts::Measured,
        }
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            graphs: true,
            plain: false,
            load_threads: None,
            load_io: LoadIo::default(),
            host_path: HostPath::Auto,
            host_experts: None,
            link_bytes_per_s: 54e9,
            link_pace_bytes_per_s: None,
        }
    }
}
