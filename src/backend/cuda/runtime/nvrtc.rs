//! Run-time compilation of embedded kernels with NVRTC, with an on-disk PTX cache.

use crate::backend::cuda::KernelSource;
use crate::{Error, Result};
use cudarc::nvrtc::{compile_ptx_with_opts, sys as nvrtc_sys, CompileError, CompileOptions};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where `cuda_fp16.h` and friends are looked up unless `$CUDA_INCLUDE` says otherwise.
const DEFAULT_CUDA_INCLUDE: &str = "/usr/local/cuda/include";

/// Bumped whenever the compile options below change, so stale cache entries are not reused.
const OPTIONS_TAG: &str = "o1";

const NO_NVRTC_MESSAGE: &str = "NVRTC not found (libnvrtc.so): install the CUDA toolkit's NVRTC \
     runtime (e.g. the cuda-nvrtc package) or build with nvcc on PATH so kernels are embedded as PTX";

/// Whether the NVRTC library can be loaded (no NVRTC call is made).
pub fn nvrtc_library_present() -> bool {
    // SAFETY: only tries to dlopen the candidate library names and closes them again.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_library_present() {
        return Err(Error::Backend(NO_NVRTC_MESSAGE.to_string()));
    }
    let (mut major, mut minor): (std::ffi::c_int, std::ffi::c_int) = (0, 0);
    let status = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: both pointers are valid writable c_ints for the duration of the call.
        unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
    }))
    .map_err(|_| Error::Backend("libnvrtc loaded but has no nvrtcVersion symbol".to_string()))?;
    if status != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Backend(format!("nvrtcVersion failed: {status:?}")));
    }
    Ok((major, minor))
}

/// PTX produced for one kernel file.
#[derive(Debug, Clone)]
pub struct CompiledPtx {
    pub ptx: String,
    /// True when read from the on-disk cache rather than compiled now.
    pub from_cache: bool,
    /// Time spent compiling (zero on a cache hit), in seconds.
    pub compile_seconds: f64,
}

/// The cache file name for `kernel` compiled for `arch` by NVRTC `nvrtc`: changes whenever the
/// source, the architecture, the compiler version or our options change.
pub fn cache_key(kernel: &KernelSource, arch: &str, nvrtc: (i32, i32)) -> String {
    let hash = kernel.sha256.get(..16).unwrap_or(kernel.sha256);
    format!(
        "{}-{hash}-{arch}-nvrtc{}.{}-{OPTIONS_TAG}.ptx",
        kernel.name, nvrtc.0, nvrtc.1
    )
}

/// `$XDG_CACHE_HOME/specter/ptx`, else `$HOME/.cache/specter/ptx`.
pub fn ptx_cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".cache"),
    };
    Some(base.join("specter").join("ptx"))
}

/// A directory of compiled PTX files. Failing to read or write it is never fatal: the kernel is
/// compiled again.
#[derive(Debug, Clone)]
pub struct PtxCache {
    dir: PathBuf,
}

impl PtxCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        PtxCache { dir: dir.into() }
    }

    /// The cache under [`ptx_cache_dir`], if a home or cache directory is known.
    pub fn default_location() -> Option<Self> {
        ptx_cache_dir().map(Self::new)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cached PTX under `key`, if present and plausibly PTX.
    pub fn get(&self, key: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.dir.join(key)).ok()?;
        // A truncated or foreign file would only fail later inside the driver; recompile instead.
        looks_like_ptx(&text).then_some(text)
    }

    /// Stores `ptx` under `key`; written to a temporary name and renamed, so a concurrent reader
    /// never sees half a file.
    pub fn put(&self, key: &str, ptx: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self.dir.join(format!(".{key}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, ptx)?;
        std::fs::rename(&tmp, self.dir.join(key)).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }
}

fn looks_like_ptx(text: &str) -> bool {
    text.contains(".version") && text.contains(".target") && text.trim_end().ends_with('}')
}

/// Compiles `kernel` with NVRTC for `arch` (e.g. `"sm_90"`), through `cache` when given.
///
/// Headers come from `$CUDA_INCLUDE` (default `/usr/local/cuda/include`).
pub fn compile_source(
    kernel: &KernelSource,
    arch: &str,
    cache: Option<&PtxCache>,
) -> Result<CompiledPtx> {
    let version = nvrtc_version()?;
    let key = cache_key(kernel, arch, version);
    if let Some(ptx) = cache.and_then(|c| c.get(&key)) {
        return Ok(CompiledPtx {
            ptx,
            from_cache: true,
            compile_seconds: 0.0,
        });
    }

    let include = std::env::var("CUDA_INCLUDE")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| DEFAULT_CUDA_INCLUDE.to_string());
    let mut include_paths = Vec::new();
    // Recent NVRTC releases carry the fp16 headers built in; only pass a directory that exists.
    if Path::new(&include).is_dir() {
        include_paths.push(include.clone());
    }
    let opts = CompileOptions {
        include_paths,
        options: vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".to_string(),
        ],
        name: Some(format!("{}.cu", kernel.name)),
        ..Default::default()
    };
    let started = Instant::now();
    let compiled = catch_unwind(AssertUnwindSafe(|| {
        compile_ptx_with_opts(kernel.source, opts).map(|ptx| ptx.to_src())
    }));
    let ptx = match compiled {
        Ok(Ok(ptx)) => ptx,
        Ok(Err(err)) => return Err(compile_error(kernel, arch, &include, err)),
        Err(_) => {
            return Err(Error::Backend(format!(
                "NVRTC panicked compiling kernels/{}.cu (source with a NUL byte, or a libnvrtc without the expected symbols)",
                kernel.name
            )))
        }
    };
    let compile_seconds = started.elapsed().as_secs_f64();
    if let Some(cache) = cache {
        if let Err(err) = cache.put(&key, &ptx) {
            tracing::warn!("cannot cache PTX in {}: {err}", cache.dir().display());
        }
    }
    Ok(CompiledPtx {
        ptx,
        from_cache: false,
        compile_seconds,
    })
}

fn compile_error(kernel: &KernelSource, arch: &str, include: &str, err: CompileError) -> Error {
    match err {
        CompileError::CompileError { nvrtc, log, .. } => {
            let log = log.to_string_lossy();
            let hint = if log.contains("cuda_fp16.h") {
                format!(
                    " (cuda_fp16.h not found under {include}: set CUDA_INCLUDE to the CUDA toolkit's include directory)"
                )
            } else {
                String::new()
            };
            Error::Backend(format!(
                "NVRTC failed to compile kernels/{}.cu for {arch}: {nvrtc:?}{hint}\n{}",
                kernel.name,
                log.trim_end()
            ))
        }
        other => Error::Backend(format!(
            "NVRTC failed on kernels/{}.cu for {arch}: {other}",
            kernel.name
        )),
    }
}
