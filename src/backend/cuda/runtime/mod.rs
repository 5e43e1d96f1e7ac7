//! What every op stands on: the device and its driver calls, run-time kernel compilation, the
//! kernel table and its launch arguments, device memory (the pool, activations and weights),
//! pinned and registered host memory, reading weights at load time, and reading results back.

pub(in crate::backend::cuda) mod act;
pub mod args;
pub(in crate::backend::cuda) mod device;
pub(in crate::backend::cuda) mod driver;
pub(in crate::backend::cuda) mod host;
pub(in crate::backend::cuda) mod kernel_defines;
pub(in crate::backend::cuda) mod kernels;
pub(in crate::backend::cuda) mod launch_constants;
pub mod load;
pub(in crate::backend::cuda) mod nvrtc;
pub(in crate::backend::cuda) mod pool;
pub(in crate::backend::cuda) mod readback;
