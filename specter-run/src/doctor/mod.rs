//! `doctor`: what this machine offers Specter, what is missing, and what to do about it.
//!
//! Checks the system (OS, cores, RAM, free disk), the CUDA driver and GPU, whether kernels
//! compile with NVRTC and compute correct results, whether a read-only file mapping can be
//! registered for direct DMA (which decides the host copy path), and measures host-to-device
//! bandwidth from pinned and pageable memory, the host's read bandwidth, and the hybrid path's
//! ceiling (the host expert kernel beside copies, `shared_read.rs`). Every failure is recorded
//! as a [`Problem`] with a fix; `diagnose` itself never fails.

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use half::f16;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use specter::backend::cuda::{
    compile_source, driver_library_present, kernel_source, nvrtc_library_present, nvrtc_version,
    CudaDevice, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use specter::{Error, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

const MIB: usize = 1 << 20;

/// What `diagnose` checks and how hard.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    /// CUDA device ordinal to examine.
    pub device: usize,
    /// Run the CUDA checks at all (false: system facts only).
    pub gpu: bool,
    /// Directory whose free space is reported (where bundles would live).
    pub work_dir: PathBuf,
    /// Directory for the temporary file of the mapping check.
    pub temp_dir: PathBuf,
    /// Size of the file mapped and registered in the mapping check.
    pub mapping_bytes: usize,
    /// Bytes copied per bandwidth measurement.
    pub bandwidth_bytes: usize,
    /// Size of each copy within a measurement (about one expert).
    pub chunk_bytes: usize,
    /// Measurements per path; the median is reported.
    pub repeats: usize,
    /// Seed for the random test data.
    pub seed: u64,
    /// Bytes read by the host read-bandwidth measurement (0: skip it).
    pub host_read_bytes: usize,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        DoctorOptions {
            device: 0,
            gpu: true,
            work_dir: PathBuf::from("."),
            temp_dir: std::env::temp_dir(),
            mapping_bytes: 64 * MIB,
            bandwidth_bytes: 256 * MIB,
            chunk_bytes: 16 * MIB,
            repeats: 3,
            seed: 0x5eec_7e12,
            host_read_bytes: 1024 * MIB,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SystemInfo {
    pub os: String,
    pub kernel: Option<String>,
    pub arch: String,
    pub cpu_model: Option<String>,
    pub cpu_cores: usize,
    pub ram_total_bytes: Option<u64>,
    pub ram_available_bytes: Option<u64>,
    pub work_dir: String,
    pub disk_free_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    /// CUDA version the driver supports, e.g. "13.0".
    pub driver_cuda_version: String,
    pub device_count: usize,
    pub ordinal: usize,
    pub name: String,
    /// e.g. "9.0".
    pub compute_capability: String,
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
    pub read_only_register_supported: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct KernelCheck {
    /// Whether the embedded kernels carry PTX built by nvcc (else they rely on NVRTC).
    pub embedded_ptx: bool,
    pub nvrtc_version: Option<String>,
    /// Whether compiling the util kernels with NVRTC worked.
    pub nvrtc_compiles: bool,
    pub nvrtc_compile_seconds: Option<f64>,
    /// Where the kernels the runtime loads come from: "embedded PTX" or "NVRTC".
    pub runtime_kernels_from: Option<String>,
    /// Elements in the axpy test.
    pub axpy_elements: usize,
    /// Largest |gpu - host| over the axpy test, when it ran.
    pub axpy_max_abs_error: Option<f32>,
    pub axpy_passed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct MappingCheck {
    pub bytes: usize,
    pub register_ms: f64,
    pub copy_gbps: f64,
    pub checksum_host: u64,
    pub checksum_device: u64,
    pub passed: bool,
}

/// How Specter moves expert bytes from the bundle to the GPU on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum HostCopyPath {
    /// The bundle's read-only mapping is registered and copied from directly.
    #[serde(rename = "registered mmap")]
    RegisteredMmap,
    /// Bytes are copied into a pinned staging buffer first.
    #[serde(rename = "pinned staging")]
    PinnedStaging,
}

impl HostCopyPath {
    pub fn as_str(self) -> &'static str {
        match self {
            HostCopyPath::RegisteredMmap => "registered mmap",
            HostCopyPath::PinnedStaging => "pinned staging",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BandwidthReport {
    pub bytes: usize,
    pub chunk_bytes: usize,
    pub pinned_gbps: Vec<f64>,
    pub pinned_median_gbps: f64,
    pub pageable_gbps: Vec<f64>,
    pub pageable_median_gbps: f64,
    /// Whether the bytes that arrived match the host's (checksum on the device).
    pub verified: bool,
}

/// Something missing or broken, and what to do about it.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    pub what: String,
    pub fix: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct DoctorReport {
    pub specter_version: String,
    pub system: SystemInfo,
    pub cuda_driver_library: bool,
    pub nvrtc_library: bool,
    pub gpu: Option<GpuInfo>,
    pub kernels: Option<KernelCheck>,
    pub registered_mmap: Option<MappingCheck>,
    pub host_copy_path: Option<HostCopyPath>,
    pub bandwidth: Option<BandwidthReport>,
    /// How fast the host's threads read memory, one figure per thread count: the ceiling of the
    /// host expert kernel (src/host_experts).
    pub host_read: Vec<specter::host_experts::bandwidth::HostReadBandwidth>,
    /// The host expert kernel and pinned copies reading host memory at once: the hybrid path's
    /// ceiling, measured where a GPU is and the host read measurement is asked for.
    pub shared_read: Option<SharedReadReport>,
    /// The host expert kernel's code path on this processor.
    pub host_expert_path: String,
    pub problems: Vec<Problem>,
}

impl DoctorReport {
    /// True when nothing stands between this machine and the CUDA backend.
    pub fn cuda_ready(&self) -> bool {
        self.gpu.is_some()
            && self.kernels.as_ref().is_some_and(|k| k.axpy_passed)
            && self.host_copy_path.is_some()
    }
}

/// Examines this machine; never fails (failures become [`Problem`]s).
pub fn diagnose(opts: &DoctorOptions) -> DoctorReport {
    let mut problems = Vec::new();
    let system = system_info(&opts.work_dir);
    let mut report = DoctorReport {
        specter_version: env!("CARGO_PKG_VERSION").to_string(),
        system,
        cuda_driver_library: driver_library_present(),
        nvrtc_library: nvrtc_library_present(),
        gpu: None,
        kernels: None,
        registered_mmap: None,
        host_copy_path: None,
        bandwidth: None,
        host_read: Vec::new(),
        shared_read: None,
        host_expert_path: specter::host_experts::KernelPath::detect()
            .name()
            .to_string(),
        problems: Vec::new(),
    };
    if opts.host_read_bytes > 0 {
        let cores = report.system.cpu_cores.max(1);
        let mut counts: Vec<usize> = [1, 4, 8, 16, cores]
            .into_iter()
            .filter(|&t| t <= cores)
            .collect();
        counts.dedup();
        report.host_read = counts
            .into_iter()
            .map(|t| {
                specter::host_experts::bandwidth::measure(t, opts.host_read_bytes, opts.repeats)
            })
            .collect();
    }
    if report.system.ram_total_bytes.is_none() {
        problems.push(Problem {
            what: "cannot read total and available RAM from /proc/meminfo".into(),
            fix: "run on Linux with /proc mounted; Specter sizes its host cache from available RAM"
                .into(),
        });
    }
    if opts.gpu {
        gpu_checks(opts, &mut report, &mut problems);
    }
    report.problems = problems;
    report
}

fn gpu_checks(opts: &DoctorOptions, report: &mut DoctorReport, problems: &mut Vec<Problem>) {
    let device = match CudaDevice::open(opts.device) {
        Ok(device) => device,
        Err(err) => {
            let fix = if report.cuda_driver_library {
                "check nvidia-smi and CUDA_VISIBLE_DEVICES, or run with --backend cpu"
            } else {
                "install the NVIDIA driver (it provides libcuda.so.1), or run with --backend cpu"
            };
            problems.push(Problem {
                what: backend_message(&err),
                fix: fix.into(),
            });
            return;
        }
    };
    match gpu_info(&device) {
        Ok(info) => report.gpu = Some(info),
        Err(err) => {
            problems.push(Problem {
                what: format!(
                    "cannot query CUDA device {}: {}",
                    opts.device,
                    backend_message(&err)
                ),
                fix: "check the NVIDIA driver installation (nvidia-smi)".into(),
            });
            return;
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    report.kernels = Some(kernel_check(&device, &mut rng, problems));
    let checksum = match device.function("util", "byte_checksum") {
        Ok(f) => {
            if let Some(k) = report.kernels.as_mut() {
                let from = if k.embedded_ptx {
                    "embedded PTX"
                } else {
                    "NVRTC (cached on disk)"
                };
                k.runtime_kernels_from = Some(from.to_string());
            }
            Some(f)
        }
        Err(err) => {
            problems.push(Problem {
                what: format!("the runtime cannot load its kernels: {}", backend_message(&err)),
                fix: "install NVRTC (libnvrtc.so, with CUDA headers for CUDA_INCLUDE) or build with nvcc on PATH"
                    .into(),
            });
            None
        }
    };
    let mapping = mapping_check(&device, opts, checksum.as_ref(), &mut rng);
    report.host_copy_path = Some(match &mapping {
        Ok(check) if check.passed => HostCopyPath::RegisteredMmap,
        Ok(check) => {
            problems.push(Problem {
                what: format!(
                    "bytes copied from a registered read-only mapping arrived changed (checksum {:#x} on the host, {:#x} on the device)",
                    check.checksum_host, check.checksum_device
                ),
                fix: "report this with the driver version; Specter falls back to pinned staging".into(),
            });
            HostCopyPath::PinnedStaging
        }
        Err(err) => {
            problems.push(Problem {
                what: format!("registering a read-only file mapping failed: {}", backend_message(err)),
                fix: "Specter will stage copies through pinned buffers (one extra host copy per expert); \
                      a driver with READ_ONLY host registration (CUDA 11.1+) avoids it"
                    .into(),
            });
            HostCopyPath::PinnedStaging
        }
    });
    report.registered_mmap = mapping.ok();
    if opts.host_read_bytes > 0 {
        match shared_read::measure(&device, opts) {
            Ok(shared) => report.shared_read = Some(shared),
            Err(err) => problems.push(Problem {
                what: format!(
                    "measuring host reads beside copies to the GPU failed: {}",
                    backend_message(&err)
                ),
                fix:
                    "free host memory (pinned buffers need page-locked RAM) or GPU memory and retry"
                        .into(),
            }),
        }
    }
    match bandwidth_check(&device, opts, checksum.as_ref(), &mut rng) {
        Ok(bw) => {
            if !bw.verified {
                problems.push(Problem {
                    what: "bytes copied from pinned memory did not arrive intact".into(),
                    fix: "check the GPU and driver (nvidia-smi -q, dmesg for PCIe/Xid errors)"
                        .into(),
                });
            }
            report.bandwidth = Some(bw);
        }
        Err(err) => problems.push(Problem {
            what: format!(
                "measuring host-to-device bandwidth failed: {}",
                backend_message(&err)
            ),
            fix: "free host memory (pinned buffers need page-locked RAM) or GPU memory and retry"
                .into(),
        }),
    }
}

fn backend_message(err: &Error) -> String {
    match err {
        Error::Backend(msg) => msg.clone(),
        other => other.to_string(),
    }
}

fn gpu_info(device: &CudaDevice) -> Result<GpuInfo> {
    let (major, minor) = CudaDevice::driver_version()?;
    let (free, total) = device.memory_info()?;
    let (cc_major, cc_minor) = device.compute_capability();
    let read_only = device
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)?;
    Ok(GpuInfo {
        driver_cuda_version: format!("{major}.{minor}"),
        device_count: CudaDevice::device_count()?,
        ordinal: device.ordinal(),
        name: device.name().to_string(),
        compute_capability: format!("{cc_major}.{cc_minor}"),
        memory_total_bytes: total as u64,
        memory_free_bytes: free as u64,
        read_only_register_supported: read_only != 0,
    })
}

/// Launch shape for the grid-stride util kernels: 256 threads (a multiple of the warp size, which
/// `byte_checksum`'s warp reduction needs) and enough blocks to fill a large GPU.
fn grid_for(n: usize) -> LaunchConfig {
    const THREADS: usize = 256;
    let blocks = n.div_ceil(THREADS).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn driver<T>(what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| Error::Backend(format!("{what}: {e}")))
}

/// Runs `axpy_f16` from `function` on random data and compares with the host; returns the
/// largest absolute error.
fn run_axpy(
    device: &CudaDevice,
    function: &CudaFunction,
    n: usize,
    rng: &mut ChaCha8Rng,
) -> Result<f32> {
    let stream = device.stream();
    let x: Vec<f16> = (0..n)
        .map(|_| f16::from_f32(rng.random_range(-4.0f32..4.0)))
        .collect();
    let y: Vec<f16> = (0..n)
        .map(|_| f16::from_f32(rng.random_range(-4.0f32..4.0)))
        .collect();
    let a: f32 = rng.random_range(-2.0f32..2.0);
    let x_dev = driver("copy axpy input to the device", stream.clone_htod(&x))?;
    let mut y_dev = driver("copy axpy input to the device", stream.clone_htod(&y))?;
    let n_arg = n as u64;
    let mut launch = stream.launch_builder(function);
    launch.arg(&mut y_dev).arg(&x_dev).arg(&a).arg(&n_arg);
    // SAFETY: axpy_f16(half* y, const half* x, float a, unsigned long long n): the arguments
    // match that signature, and both buffers hold n elements.
    driver("launch axpy_f16", unsafe { launch.launch(grid_for(n)) })?;
    let got = driver("copy axpy result to the host", stream.clone_dtoh(&y_dev))?;
    let mut max_err = 0.0f32;
    for ((g, xi), yi) in got.iter().zip(&x).zip(&y) {
        let want = f16::from_f32(a.mul_add(xi.to_f32(), yi.to_f32())).to_f32();
        let err = (g.to_f32() - want).abs();
        // NaN must fail the check, so compare with `!(err <= max)`.
        if err.is_nan() || err > max_err {
            max_err = if err.is_nan() { f32::INFINITY } else { err };
        }
    }
    Ok(max_err)
}

fn kernel_check(
    device: &CudaDevice,
    rng: &mut ChaCha8Rng,
    problems: &mut Vec<Problem>,
) -> KernelCheck {
    const N: usize = 1 << 20;
    let util = kernel_source("util").ok();
    let mut check = KernelCheck {
        embedded_ptx: util.is_some_and(|k| k.ptx.is_some()),
        nvrtc_version: nvrtc_version().ok().map(|(a, b)| format!("{a}.{b}")),
        nvrtc_compiles: false,
        nvrtc_compile_seconds: None,
        runtime_kernels_from: None,
        axpy_elements: N,
        axpy_max_abs_error: None,
        axpy_passed: false,
    };
    let Some(util) = util else {
        problems.push(Problem {
            what: "the util kernels are not embedded in this build".into(),
            fix: "rebuild from a source tree that has kernels/util.cu".into(),
        });
        return check;
    };
    // Always exercise NVRTC itself (no cache), even when PTX is embedded: kernels specialised at
    // run time need it.
    let nvrtc_module = match compile_source(util, &device.arch(), None) {
        Ok(compiled) => {
            check.nvrtc_compiles = true;
            check.nvrtc_compile_seconds = Some(compiled.compile_seconds);
            device.load_ptx("util", compiled.ptx)
        }
        Err(err) => Err(err),
    };
    let nvrtc_axpy = nvrtc_module.and_then(|m| {
        m.load_function("axpy_f16").map_err(|e| {
            Error::Backend(format!(
                "axpy_f16 missing from the NVRTC-compiled util module: {e}"
            ))
        })
    });
    let axpy = match nvrtc_axpy {
        Ok(f) => Some(f),
        Err(err) => {
            check.nvrtc_compiles = false;
            let fix = if !nvrtc_library_present() {
                "install NVRTC (libnvrtc.so from the CUDA toolkit) or build with nvcc on PATH so kernels ship as PTX"
            } else {
                "set CUDA_INCLUDE to the CUDA toolkit's include directory (it must hold cuda_fp16.h)"
            };
            problems.push(Problem {
                what: format!("NVRTC does not work: {}", backend_message(&err)),
                fix: fix.into(),
            });
            // Kernels built into the binary as PTX can still be tested.
            if check.embedded_ptx {
                device.function("util", "axpy_f16").ok()
            } else {
                None
            }
        }
    };
    if let Some(f) = axpy {
        match run_axpy(device, &f, N, rng) {
            Ok(err) => {
                check.axpy_max_abs_error = Some(err);
                // Device and host both fuse the multiply-add in f32 and round once to f16.
                check.axpy_passed = err <= 1e-3;
                if !check.axpy_passed {
                    problems.push(Problem {
                        what: format!(
                            "the axpy_f16 test kernel computed wrong results (max error {err})"
                        ),
                        fix: "report this with the driver and NVRTC versions".into(),
                    });
                }
            }
            Err(err) => problems.push(Problem {
                what: format!(
                    "running the axpy_f16 test kernel failed: {}",
                    backend_message(&err)
                ),
                fix: "check the GPU with nvidia-smi; free GPU memory if it is full".into(),
            }),
        }
    }
    check
}

/// Position-weighted byte checksum; `kernels/util.cu`'s `byte_checksum` computes the same.
pub fn byte_checksum(bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().fold(0u64, |acc, (i, &b)| {
        acc.wrapping_add(u64::from(b).wrapping_mul((i % 251) as u64 + 1))
    })
}

fn device_checksum(
    stream: &std::sync::Arc<CudaStream>,
    f: &CudaFunction,
    data: &CudaSlice<u8>,
) -> Result<u64> {
    let mut out = driver("allocate the checksum result", stream.alloc_zeros::<u64>(1))?;
    let n = data.len() as u64;
    let mut launch = stream.launch_builder(f);
    launch.arg(data).arg(&n).arg(&mut out);
    // SAFETY: byte_checksum(const unsigned char* data, unsigned long long n, unsigned long long*
    // out): `data` holds n bytes, `out` one zeroed u64; the block size is a multiple of 32.
    driver("launch byte_checksum", unsafe {
        launch.launch(grid_for(data.len()))
    })?;
    let host = driver("copy the checksum to the host", stream.clone_dtoh(&out))?;
    host.first()
        .copied()
        .ok_or_else(|| Error::Backend("empty checksum result".into()))
}

/// A file removed on drop.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn timing_events(
    device: &CudaDevice,
) -> Result<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)> {
    let ctx = device.context();
    Ok((
        driver(
            "create a timing event",
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)),
        )?,
        driver(
            "create a timing event",
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)),
        )?,
    ))
}

fn gbps(bytes: usize, ms: f32) -> f64 {
    if ms <= 0.0 {
        return 0.0;
    }
    bytes as f64 / (f64::from(ms) * 1e-3) / 1e9
}

fn mapping_check(
    device: &CudaDevice,
    opts: &DoctorOptions,
    checksum: Option<&CudaFunction>,
    rng: &mut ChaCha8Rng,
) -> Result<MappingCheck> {
    let len = opts.mapping_bytes.max(1);
    let mut data = vec![0u8; len];
    rng.fill_bytes(&mut data);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let path = opts
        .temp_dir
        .join(format!("specter-doctor-{}-{nanos}.bin", std::process::id()));
    let temp = TempFile(path);
    std::fs::write(&temp.0, &data)
        .map_err(|e| Error::io(format!("write test file {}", temp.0.display()), e))?;
    let host_sum = byte_checksum(&data);
    drop(data);
    let file = std::fs::File::open(&temp.0)
        .map_err(|e| Error::io(format!("open {}", temp.0.display()), e))?;
    // SAFETY: the file is private to this check (unique name, removed afterwards) and nothing
    // modifies or truncates it while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| Error::io(format!("mmap {}", temp.0.display()), e))?;

    let started = Instant::now();
    let registered = device.register_read_only(&map)?;
    let register_ms = started.elapsed().as_secs_f64() * 1e3;

    let stream = device.stream();
    let mut dst = driver(
        "allocate device memory for the mapping check",
        stream.alloc_zeros::<u8>(len),
    )?;
    let (start, end) = timing_events(device)?;
    driver("record event", start.record(stream))?;
    registered.copy_to_device(0..len, &mut dst, stream)?;
    driver("record event", end.record(stream))?;
    driver("wait for the copy", end.synchronize())?;
    let copy_ms = driver("read the copy time", start.elapsed_ms(&end))?;
    registered.wait()?;

    let device_sum = match checksum {
        Some(f) => device_checksum(stream, f, &dst)?,
        // Without kernels, read the bytes back and sum on the host.
        None => byte_checksum(&driver(
            "copy back for the checksum",
            stream.clone_dtoh(&dst),
        )?),
    };
    drop(registered);
    Ok(MappingCheck {
        bytes: len,
        register_ms,
        copy_gbps: gbps(len, copy_ms),
        checksum_host: host_sum,
        checksum_device: device_sum,
        passed: host_sum == device_sum,
    })
}

fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

fn bandwidth_check(
    device: &CudaDevice,
    opts: &DoctorOptions,
    checksum: Option<&CudaFunction>,
    rng: &mut ChaCha8Rng,
) -> Result<BandwidthReport> {
    let chunk = opts.chunk_bytes.max(1);
    // Whole chunks only, so every measurement copies the same bytes.
    let len = (opts.bandwidth_bytes / chunk).max(1) * chunk;
    let repeats = opts.repeats.max(1);
    let stream = device.stream();
    let mut pinned = device.alloc_pinned(len)?;
    rng.fill_bytes(pinned.as_mut_slice()?);
    let mut pageable = vec![0u8; len];
    rng.fill_bytes(&mut pageable);
    let mut dst = driver(
        "allocate device memory for the bandwidth test",
        stream.alloc_zeros::<u8>(len),
    )?;
    let (start, end) = timing_events(device)?;

    let mut pinned_gbps = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        driver("record event", start.record(stream))?;
        for offset in (0..len).step_by(chunk) {
            let mut view = dst.slice_mut(offset..offset + chunk);
            pinned.copy_to_device(offset..offset + chunk, &mut view, stream)?;
        }
        driver("record event", end.record(stream))?;
        driver("wait for the copies", end.synchronize())?;
        pinned_gbps.push(gbps(
            len,
            driver("read the copy time", start.elapsed_ms(&end))?,
        ));
    }
    let mut verified = match checksum {
        Some(f) => device_checksum(stream, f, &dst)? == byte_checksum(pinned.as_slice()),
        None => driver("copy back", stream.clone_dtoh(&dst))? == pinned.as_slice(),
    };

    let mut pageable_gbps = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        driver("record event", start.record(stream))?;
        for offset in (0..len).step_by(chunk) {
            let mut view = dst.slice_mut(offset..offset + chunk);
            driver(
                "pageable copy",
                stream.memcpy_htod(&pageable[offset..offset + chunk], &mut view),
            )?;
        }
        driver("record event", end.record(stream))?;
        driver("wait for the copies", end.synchronize())?;
        pageable_gbps.push(gbps(
            len,
            driver("read the copy time", start.elapsed_ms(&end))?,
        ));
    }
    verified &= match checksum {
        Some(f) => device_checksum(stream, f, &dst)? == byte_checksum(&pageable),
        None => driver("copy back", stream.clone_dtoh(&dst))? == pageable,
    };
    Ok(BandwidthReport {
        bytes: len,
        chunk_bytes: chunk,
        pinned_median_gbps: median(&pinned_gbps),
        pinned_gbps,
        pageable_median_gbps: median(&pageable_gbps),
        pageable_gbps,
        verified,
    })
}

// ---- system facts -------------------------------------------------------------------------

fn system_info(work_dir: &Path) -> SystemInfo {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let (ram_total_bytes, ram_available_bytes) = match meminfo.as_deref().map(parse_meminfo) {
        Some(m) => (m.total_bytes, m.available_bytes),
        None => (None, None),
    };
    let work_dir_abs = std::fs::canonicalize(work_dir).unwrap_or_else(|_| work_dir.to_path_buf());
    SystemInfo {
        os: os_name(),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|s| s.trim().to_string()),
        arch: std::env::consts::ARCH.to_string(),
        cpu_model: std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| cpu_model(&s)),
        cpu_cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        ram_total_bytes,
        ram_available_bytes,
        work_dir: work_dir_abs.display().to_string(),
        disk_free_bytes: disk_free_bytes(&work_dir_abs),
    }
}

fn os_name() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim().trim_matches('"').to_string())
        });
    pretty.unwrap_or_else(|| std::env::consts::OS.to_string())
}

fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// The RAM figures of `/proc/meminfo`, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
}

/// Reads `MemTotal` and `MemAvailable` (kB) from `/proc/meminfo` text.
pub fn parse_meminfo(text: &str) -> MemInfo {
    let field = |key: &str| -> Option<u64> {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(key)?.strip_prefix(':')?;
            let mut parts = rest.split_whitespace();
            let value: u64 = parts.next()?.parse().ok()?;
            let scale = match parts.next() {
                Some("kB") => 1024,
                None => 1,
                Some(_) => return None,
            };
            value.checked_mul(scale)
        })
    };
    MemInfo {
        total_bytes: field("MemTotal"),
        available_bytes: field("MemAvailable"),
    }
}

/// Free bytes available to an unprivileged user on the file system holding `dir`.
pub fn disk_free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a valid NUL-terminated path and `stat` points to writable memory of the
    // right type; statvfs fully initialises it when it returns 0.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so `stat` is initialised.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Some((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

// ---- text rendering -----------------------------------------------------------------------

mod render;
mod shared_read;
pub use render::render_text;
pub use shared_read::SharedReadReport;

#[cfg(test)]
mod tests;
