//! One grouped expert kernel function, typed by its arguments, allowed all the dynamic shared
//! memory the device offers a block: the INT4 and row-layout launchers keep their warps' rings and
//! staged activations there, sized per launch.

use std::marker::PhantomData;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};

use crate::backend::cuda::options::LaunchRule;
use crate::backend::cuda::runtime::args::KernelArgs;
use crate::backend::cuda::runtime::driver::{guarded, launch_kernel, LaunchMode};
use crate::backend::cuda::{CudaDevice, CudaFunction, CudaStream};
use crate::{Error, Result};

/// One kernel function, typed by its arguments, and the most dynamic shared memory a launch of
/// it may ask for.
pub(super) struct Kernel<A> {
    pub(super) func: CudaFunction,
    pub(super) max_dynamic_shared: usize,
    args: PhantomData<fn(A)>,
}

impl<A: KernelArgs> Kernel<A> {
    /// Loads `name` of kernel file `module` (one of the kernels `A` is for) and allows it all the
    /// dynamic shared memory the device offers a block beside the function's static shared memory.
    pub(super) fn load(device: &CudaDevice, module: &str, name: &str) -> Result<Self> {
        if !A::KERNELS.contains(&name) {
            return Err(Error::Backend(format!(
                "cuda: kernel {name} does not take the arguments of {:?}",
                A::KERNELS
            )));
        }
        let func = device.function(module, name)?;
        let optin = device
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let fixed = guarded(&format!("static shared memory of {name}"), || {
            func.shared_size_bytes()
        })?;
        let max = optin.saturating_sub(fixed).max(0);
        guarded(
            &format!("allowing {max} bytes of dynamic shared memory to {name}"),
            || {
                func.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    max,
                )
            },
        )?;
        Ok(Kernel {
            func,
            max_dynamic_shared: usize::try_from(max).unwrap_or(0),
            args: PhantomData,
        })
    }

    /// Launches this kernel on `stream` as `rule` says for launches labelled `what` (overlapped
    /// with the one before, started late, or left out): `dims` is (grid, threads a block, bytes of
    /// dynamic shared memory), in thread block clusters of `cluster` blocks.
    ///
    /// # Safety
    /// `args` must hold valid device buffers of the sizes the kernel reads and writes,
    /// the shared memory bytes must be within [`Self::max_dynamic_shared`], and, where `rule` may overlap
    /// launches, the kernel must wait before it touches anything an earlier kernel writes.
    pub(super) unsafe fn issue(
        &self,
        stream: &CudaStream,
        rule: &LaunchRule,
        what: &str,
        dims: ((u32, u32, u32), u32, u32),
        cluster: (u32, u32, u32),
        mut args: A,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        let Some(overlap) = rule.overlap_for(what, dims.0 .0) else {
            return Ok(());
        };
        // SAFETY: the caller's promise above; `args` are this kernel's parameters in order (its
        // type says so).
        unsafe {
            launch_kernel(
                stream,
                &self.func,
                dims,
                &mut args.params(),
                LaunchMode { overlap, cluster },
            )
        }
    }
}
