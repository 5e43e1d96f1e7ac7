//! Opening a CUDA device and loading its kernel modules.

use crate::backend::cuda::runtime::driver::{guarded, panic_text};
use crate::backend::cuda::runtime::host::{PinnedBuffer, RegisteredHost};
use crate::backend::cuda::runtime::nvrtc::{compile_source, PtxCache};
use crate::backend::cuda::{kernel_source, KernelSource};
use crate::{Error, Result};
use cudarc::driver::{result as drv, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::panic::catch_unwind;
use std::sync::{Arc, Mutex, OnceLock};

/// What a user sees when the machine has no NVIDIA driver.
pub const NO_DRIVER_MESSAGE: &str =
    "no CUDA driver found (libcuda.so.1): install the NVIDIA driver or use --backend cpu";

/// Whether the CUDA driver library can be loaded at all (no driver call is made).
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen the candidate library names and closes them again; no symbol
    // is looked up or called.
    unsafe { sys::is_culib_present() }
}

/// Loads libcuda and runs `cuInit` once per process; later calls return the first outcome.
///
/// cudarc panics when the library is missing, so presence is probed first. A driver too old
/// for a symbol cudarc needs also panics inside cudarc; that panic is caught and turned into an
/// error here (the panic hook may still print one line to stderr).
fn init_driver() -> Result<()> {
    static OUTCOME: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    OUTCOME
        .get_or_init(|| {
            if !driver_library_present() {
                return Err(NO_DRIVER_MESSAGE.to_string());
            }
            match catch_unwind(drv::init) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(err)) => Err(describe_init_error(err)),
                Err(panic) => Err(format!(
                    "the CUDA driver library loaded but cannot be used ({}): update the NVIDIA driver or use --backend cpu",
                    panic_text(&panic)
                )),
            }
        })
        .clone()
        .map_err(Error::Backend)
}

fn describe_init_error(err: drv::DriverError) -> String {
    match err.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => {
            "the CUDA driver found no GPU (cuInit: CUDA_ERROR_NO_DEVICE): check that a GPU is visible \
             (nvidia-smi, CUDA_VISIBLE_DEVICES) or use --backend cpu"
                .to_string()
        }
        sys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH | sys::CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => {
            format!(
                "the NVIDIA driver cannot serve this GPU (cuInit: {err}): its kernel module and libcuda must match \
                 (reinstall the driver or reboot after an update), or use --backend cpu"
            )
        }
        _ => format!("CUDA driver initialisation failed (cuInit: {err}): check the NVIDIA driver or use --backend cpu"),
    }
}

/// One GPU, its primary context, a stream for work, and the kernel modules loaded so far.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    compute_capability: (i32, i32),
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    ptx_cache: Option<PtxCache>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .finish()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` (0-based, in the driver's order).
    ///
    /// Fails with [`Error::Backend`] when the driver is missing or unusable, no GPU is visible,
    /// or `ordinal` is out of range; never panics.
    pub fn open(ordinal: usize) -> Result<Self> {
        init_driver()?;
        let count = Self::device_count()?;
        if ordinal >= count {
            return Err(Error::Backend(format!(
                "CUDA device {ordinal} does not exist: the driver sees {count} device(s) (valid: 0..{count})"
            )));
        }
        let ctx = guarded(
            &format!("cannot create a context on CUDA device {ordinal}"),
            || CudaContext::new(ordinal),
        )?;
        let name = guarded("cuDeviceGetName", || ctx.name())?;
        let compute_capability = guarded("cannot read the compute capability", || {
            ctx.compute_capability()
        })?;
        // A dedicated stream rather than the legacy default stream, so copies and kernels issued
        // here overlap with work on other streams.
        let stream = guarded("cannot create a CUDA stream", || ctx.new_stream())?;
        Ok(CudaDevice {
            ctx,
            stream,
            name,
            compute_capability,
            modules: Mutex::new(HashMap::new()),
            ptx_cache: PtxCache::default_location(),
        })
    }

    /// How many CUDA devices the driver sees.
    pub fn device_count() -> Result<usize> {
        init_driver()?;
        let count = guarded("cuDeviceGetCount", CudaContext::device_count)?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    /// The driver's CUDA version as (major, minor), e.g. (13, 0).
    pub fn driver_version() -> Result<(i32, i32)> {
        init_driver()?;
        let mut version: std::ffi::c_int = 0;
        guarded("cuDriverGetVersion", || {
            // SAFETY: `version` is a valid, writable c_int for the duration of the call.
            unsafe { sys::cuDriverGetVersion(&mut version) }.result()
        })?;
        Ok((version / 1000, (version % 1000) / 10))
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor), e.g. (9, 0) for Hopper.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// The NVRTC/PTX architecture name for this device, e.g. `"sm_90"`.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        guarded("cuDeviceTotalMem", || self.ctx.total_mem())
    }

    /// (free, total) device memory in bytes, as the driver reports it now.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        guarded("cuMemGetInfo", || self.ctx.mem_get_info())
    }

    /// A device attribute (see `sys::CUdevice_attribute`).
    pub fn attribute(&self, attribute: sys::CUdevice_attribute) -> Result<i32> {
        guarded("cuDeviceGetAttribute", || self.ctx.attribute(attribute))
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream this device's helpers issue work on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all work issued on [`Self::stream`].
    pub fn synchronize(&self) -> Result<()> {
        guarded("cuStreamSynchronize", || self.stream.synchronize())
    }

    /// Replaces the on-disk PTX cache (`None` disables it).
    pub fn set_ptx_cache(&mut self, cache: Option<PtxCache>) {
        self.ptx_cache = cache;
    }

    /// The loaded module for the embedded kernel file `name` (`kernels/<name>.cu`), loading it
    /// on first use.
    ///
    /// Uses the PTX built by `nvcc` when there is some for an architecture this device can run;
    /// otherwise (or if the driver rejects that PTX) compiles the source with NVRTC for this
    /// device's architecture, through the on-disk cache.
    pub fn module(&self, name: &str) -> Result<Arc<CudaModule>> {
        let kernel = kernel_source(name)?;
        let mut modules = self.modules.lock().map_err(|_| {
            Error::Backend("the CUDA module table was poisoned by an earlier panic".into())
        })?;
        if let Some(module) = modules.get(kernel.name) {
            return Ok(module.clone());
        }
        let module = self.load_kernel(kernel)?;
        modules.insert(kernel.name, module.clone());
        Ok(module)
    }

    /// Function `function` of the embedded kernel file `module`.
    pub fn function(&self, module: &str, function: &str) -> Result<CudaFunction> {
        let m = self.module(module)?;
        guarded(
            &format!("kernel {function:?} not found in kernels/{module}.cu"),
            || m.load_function(function),
        )
    }

    fn load_kernel(&self, kernel: &KernelSource) -> Result<Arc<CudaModule>> {
        if let (Some(ptx), Some(ptx_arch)) = (kernel.ptx, kernel.ptx_arch) {
            if self.can_run_ptx_for(ptx_arch) {
                match self.load_ptx(kernel.name, ptx.to_string()) {
                    Ok(module) => return Ok(module),
                    // Typically PTX from a newer nvcc than the driver understands: NVRTC, which
                    // ships with the toolkit the driver supports, can still produce usable PTX.
                    Err(err) => tracing::warn!(
                        "embedded PTX for kernels/{}.cu rejected ({err}); compiling with NVRTC",
                        kernel.name
                    ),
                }
            }
        }
        let compiled = compile_source(kernel, &self.arch(), self.ptx_cache.as_ref())?;
        self.load_ptx(kernel.name, compiled.ptx)
    }

    /// PTX for `sm_XY` runs on devices of that compute capability or newer.
    fn can_run_ptx_for(&self, ptx_arch: &str) -> bool {
        let digits = ptx_arch
            .trim_start_matches("sm_")
            .trim_start_matches("compute_");
        let digits = digits.trim_end_matches(|c: char| c.is_ascii_alphabetic());
        match digits.parse::<i32>() {
            Ok(v) => self.compute_capability.0 * 10 + self.compute_capability.1 >= v,
            Err(_) => false,
        }
    }

    /// Loads PTX text as a module of this device's context.
    pub fn load_ptx(&self, name: &str, ptx: String) -> Result<Arc<CudaModule>> {
        if ptx.contains('\0') {
            return Err(Error::Backend(format!(
                "PTX for kernels/{name}.cu contains a NUL byte"
            )));
        }
        guarded(
            &format!("the driver rejected the PTX for kernels/{name}.cu"),
            || self.ctx.load_module(Ptx::from_src(ptx)),
        )
    }

    /// Page-locks `bytes` for the device to read directly (see [`RegisteredHost`]).
    pub fn register_read_only<'a>(&self, bytes: &'a [u8]) -> Result<RegisteredHost<'a>> {
        RegisteredHost::register_read_only(&self.ctx, bytes)
    }

    /// A page-locked host buffer of `len` bytes (see [`PinnedBuffer`]).
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
        PinnedBuffer::new(&self.ctx, len)
    }
}
