//! Driver calls made safe to fail: cudarc turns some driver failures (a symbol missing from an
//! old driver) into panics; [`guarded`] maps those and ordinary errors to [`Error::Backend`].
//! Also the launch every kernel of the backend goes through: [`launch_kernel`], overlapped
//! ([`launch_overlapping`]) or plain.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::result as drv;
use cudarc::driver::{sys, CudaFunction, CudaStream};

use crate::backend::cuda::runtime::args::KernelArgs;

use crate::{Error, Result};

pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Runs a driver call that cudarc might turn into a panic (a symbol missing from an old driver)
/// and maps both failure kinds to [`Error::Backend`] with `what` as context.
pub(crate) fn guarded<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, drv::DriverError>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(err)) => Err(Error::Backend(format!("{what}: {err}"))),
        Err(panic) => Err(Error::Backend(format!("{what}: {}", panic_text(&panic)))),
    }
}

/// Launches `f` on `stream` with programmatic stream serialisation: the kernel may begin once
/// every block of the kernel before it has called `spx_launch_dependents` (or finished), and
/// waits for that kernel's completion on the device, in `spx_grid_wait`. Recorded into a graph,
/// the edge keeps that meaning.
///
/// # Safety
/// As a plain launch: `args` are the arguments of `f`'s signature (tests/kernels_compile.rs
/// checks each struct against its kernels' PTX), pointing at live buffers of the sizes it uses.
/// Also, the kernel calls `spx_grid_wait` before any access to memory that another kernel
/// writes, or reads, on this stream, and `shared_bytes` of dynamic shared memory are what it
/// uses and the function is allowed.
pub unsafe fn launch_overlapping(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    shared_bytes: u32,
    mut args: impl KernelArgs,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let mode = LaunchMode {
        overlap: true,
        cluster: NO_CLUSTER,
    };
    // SAFETY: the caller's promise, as this function's.
    unsafe {
        launch_kernel(
            stream,
            f,
            (grid, block, shared_bytes),
            &mut args.params(),
            mode,
        )
    }
}

/// How a kernel is launched besides its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchMode {
    /// Overlapped with the kernel before it ([`launch_overlapping`]).
    pub overlap: bool,
    /// The thread block cluster's extent in blocks ([`NO_CLUSTER`]: none; sm_90 and newer, the
    /// grid a multiple of it).
    pub cluster: (u32, u32, u32),
}

/// [`LaunchMode::cluster`] for a launch without clusters.
pub const NO_CLUSTER: (u32, u32, u32) = (1, 1, 1);

/// Launches `f` on `stream` with `block`-thread blocks as `mode` says: overlapped
/// ([`launch_overlapping`]) or as a plain launch that starts once the kernel before it has
/// finished; in clusters unless `mode.cluster` is [`NO_CLUSTER`]. `params` are the addresses of
/// the arguments ([`KernelArgs::params`]).
///
/// # Safety
/// As [`launch_overlapping`] (whose waiting condition matters only when `mode.overlap`); every
/// address in `params` stays valid for the call.
pub unsafe fn launch_kernel(
    stream: &CudaStream,
    f: &CudaFunction,
    shape: ((u32, u32, u32), u32, u32),
    params: &mut [*mut std::ffi::c_void],
    mode: LaunchMode,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let (grid, block, shared_bytes) = shape;
    stream.context().bind_to_thread()?;
    let mut attrs = Vec::with_capacity(2);
    if mode.overlap {
        attrs.push(sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        });
    }
    if mode.cluster != NO_CLUSTER {
        attrs.push(sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                    x: mode.cluster.0,
                    y: mode.cluster.1,
                    z: mode.cluster.2,
                },
            },
        });
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared_bytes,
        hStream: stream.cu_stream(),
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: attrs.len() as u32,
    };
    // SAFETY: `cfg`, `attrs` and `params` outlive the call, which copies what it needs; the
    // parameters are as the caller promises.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}
