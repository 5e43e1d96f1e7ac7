//! Settings of a CUDA backend that a caller chooses. The library reads no environment variables;
//! the binaries map `SPECTER_CUDA_GRAPHS`, `SPECTER_CUDA_OVERLAP`, `SPECTER_CUDA_FUSE_SHARED` and
//! `SPECTER_LOAD_THREADS` onto these fields.

use super::{HostExpertsConfig, HostPath, LoadIo};

/// How a [`CudaBackend`](super::CudaBackend) runs.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaOptions {
    /// Record forward passes as CUDA graphs and replay them (see src/backend/cuda/graphs.rs).
    pub graphs: bool,
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
    /// Launch each kernel so that it may start while the one before it on the stream finishes
    /// (programmatic dependent launch, Hopper and newer; ignored on older devices). Kernels
    /// wait for their inputs on the device (kernels/common.cuh, `spx_grid_wait`), so the bits
    /// are the same either way; what it saves is the gap between dependent kernels.
    pub overlap_launches: bool,
    /// Run an MoE layer's ungated shared experts inside its routed experts' launches (their
    /// gate/up beside the routing, their down beside the routed down) instead of as separate
    /// ops. The same bits either way; what it saves is two launches per layer and the routing's
    /// latency.
    pub fuse_shared_experts: bool,
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
        }
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            graphs: true,
            load_threads: None,
            load_io: LoadIo::default(),
            host_path: HostPath::Auto,
            host_experts: None,
            link_bytes_per_s: 54e9,
            link_pace_bytes_per_s: None,
            overlap_launches: true,
            fuse_shared_experts: true,
        }
    }
}
