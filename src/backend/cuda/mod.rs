//! CUDA device access: driver loading, kernel modules and host-memory helpers.
//!
//! The driver (`libcuda.so.1`) and NVRTC (`libnvrtc.so`) are loaded at run time, so the crate
//! builds and runs on machines without CUDA; there every entry point returns
//! [`Error::Backend`](crate::Error::Backend) naming what is missing instead of panicking.
//!
//! Kernels live in `kernels/*.cu` and are embedded by `build.rs` (see [`KERNELS`]): as PTX when
//! `nvcc` was available at build time, and always as source, which [`CudaDevice::module`]
//! compiles with NVRTC for the device's architecture and caches on disk.

// The backend's parts by concern. Each file of a part is visible to the whole backend and no
// further; what callers use is re-exported below.
mod backend;
mod graphs;
mod moe;
mod offload;
mod ops;
mod options;
mod runtime;

pub use backend::{CudaBackend, HostTiming};
pub use graphs::StepGraphStats;
pub use moe::experts;
pub use moe::int4::{check_int4_launch, MoeInt4Kernels};
pub use moe::rows::{check_rows_launch, MoeRowsKernels};
pub use offload::slots::{HostExpertsConfig, HostPath, OffloadConfig, SplitExperts};
pub use options::CudaOptions;

/// Whether this build runs prompt passes' products, routed experts and attention on tensor cores
/// (the `prompt-tensor-cores` feature; src/backend/cuda/ops/gemm.rs).
pub const PROMPT_TENSOR_CORES: bool = cfg!(feature = "prompt-tensor-cores");
#[cfg(feature = "measure")]
pub use options::{LaunchMatch, MeasureOptions, LAUNCH_LABELS};
pub use runtime::act::{GpuAct, GpuWeight};
pub use runtime::args;
pub use runtime::args::{kernel_param_names, kernel_signatures};
pub use runtime::device::{driver_library_present, CudaDevice, NO_DRIVER_MESSAGE};
pub use runtime::driver::launch_overlapping;
pub use runtime::host::{PinnedBuffer, RegisteredHost};
pub use runtime::load;
pub use runtime::load::{LoadIo, LoadReport};
pub use runtime::nvrtc::{
    cache_key, compile_source, nvrtc_library_present, nvrtc_version, ptx_cache_dir, CompiledPtx,
    PtxCache,
};

// Re-exported so callers launch kernels and hold device buffers without naming cudarc themselves.
pub use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

/// One embedded kernel file from `kernels/`.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File stem: `kernels/util.cu` is `"util"`.
    pub name: &'static str,
    /// The CUDA C++ source text, byte for byte, with each `#include "NAME.cuh"` of a header in
    /// `kernels/` replaced by that header's text (see build.rs).
    pub source: &'static str,
    /// PTX compiled by `nvcc` at build time, when it was available.
    pub ptx: Option<&'static str>,
    /// The architecture `ptx` targets (e.g. `"sm_90"`).
    pub ptx_arch: Option<&'static str>,
    /// Lower-case hex SHA-256 of `source`.
    pub sha256: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The embedded kernel file called `name`.
pub fn kernel_source(name: &str) -> crate::Result<&'static KernelSource> {
    KERNELS.iter().find(|k| k.name == name).ok_or_else(|| {
        let known: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
        crate::Error::Backend(format!(
            "no CUDA kernel file named {name:?} is embedded (known: {})",
            known.join(", ")
        ))
    })
}
