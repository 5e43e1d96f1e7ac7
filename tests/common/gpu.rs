//! The one convention of the GPU tests (tests/cuda_*.rs): each is
//! `#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]`, so `cargo test` on a machine
//! without one leaves it out, and when run on purpose (`--ignored`) it opens the GPU through these
//! helpers, which fail the test with the reason when no usable GPU is there: an ignored test that
//! passed without a GPU would prove nothing.

use std::sync::Arc;

use specter::backend::cuda::{CudaBackend, CudaDevice, CudaOptions};

fn no_gpu(what: &str, err: &specter::Error) -> ! {
    panic!(
        "this test needs a usable NVIDIA GPU, and {what} failed: {err}\n\
         It is ignored by default; run it on a GPU machine (scripts/gpu-check.sh run ...)"
    )
}

/// CUDA device 0, or a failed test saying why it could not be opened.
pub fn device() -> CudaDevice {
    CudaDevice::open(0).unwrap_or_else(|err| no_gpu("opening CUDA device 0", &err))
}

/// A CUDA backend on device 0 with every routed expert resident, or a failed test saying why.
pub fn backend() -> CudaBackend {
    CudaBackend::open(0).unwrap_or_else(|err| no_gpu("opening the CUDA backend on device 0", &err))
}

/// A CUDA backend on device 0 with `options`, every routed expert resident, or a failed test
/// saying why.
#[allow(dead_code)]
pub fn backend_with(options: &CudaOptions) -> CudaBackend {
    CudaBackend::with_device(Arc::new(device()), None, options)
        .unwrap_or_else(|err| no_gpu("opening the CUDA backend on device 0", &err))
}
