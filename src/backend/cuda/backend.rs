//! [`CudaBackend`]: the forward pass's ops on an NVIDIA GPU.
//!
//! Activations are f32 and weights FP16 (INT4 for the draft's experts), as on the CPU reference,
//! so the two agree to rounding. Every kernel computes a row's outputs with code that does not
//! depend on how many rows the launch holds, which keeps the exactness contract of
//! [`Backend`]: a verification window gives the same bits as decoding its rows one by one, and
//! speculative decoding on the GPU is lossless.
//!
//! Routed experts are either uploaded with the other weights (all resident) or kept in the
//! bundle's mapping and copied on demand into per-layer slots (see [`super::offload`]).

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use half::f16;

use super::device::guarded;
use super::experts::{ExpertGroup, MoeLaunch};
use super::launch_constants::{
    ATT_THREADS, GEMV_FEATURES, GEMV_WARPS, MAX_TOP_K, MLA_THREADS, PLAN_MAX_EXPERTS,
    ROUTE_PLAN_MAX_ROWS, ROUTE_PLAN_THREADS, ROW_THREADS,
};
use super::load::{LoadIo, LoadReport, PendingLoad};
use super::moe_int4::MoeInt4Kernels;
use super::offload::{ExpertOffload, OffloadConfig, OffloadStats};
use super::{CudaDevice, CudaOptions};
use crate::arch::RopeStyle;
use crate::backend::cpu::{Cpu, Mat};
use crate::backend::{check, AttentionSpec, Backend, GatedMlp, RopeSpec, RouteSpec, Routing};
use crate::backend::{StepEnd, StepRequest, StepStart};
use crate::{Error, Result};

#[path = "graphs.rs"]
mod graphs;
pub use graphs::StepGraphStats;

/// Bytes of freed activation buffers kept for reuse at most.
const POOL_LIMIT_BYTES: usize = 2 << 30;

/// Freed activation buffers by element count, reused by later allocations. Every use is on the
/// one compute stream, so a buffer handed out again is only written after the kernels that read
/// it before (the same guarantee `cuMemFreeAsync` gives); reuse avoids an allocate/free pair of
/// driver calls per op, dozens per layer.
#[derive(Default)]
struct BufferPool {
    free: Mutex<std::collections::HashMap<usize, Vec<CudaSlice<f32>>>>,
    cached_bytes: std::sync::atomic::AtomicUsize,
}

/// Element count handed out for a request of `n`: rounded up to one of eight steps per power of
/// two (at most 12.5% waste), so buffers of nearby sizes (attention scores grow by one key per
/// step) are shared.
fn bucket(n: usize) -> usize {
    if n <= 256 {
        return 256;
    }
    let step = 1usize << (usize::BITS - 1 - n.leading_zeros()).saturating_sub(3);
    n.div_ceil(step) * step
}

impl BufferPool {
    fn take(&self, n: usize) -> Option<CudaSlice<f32>> {
        let mut free = self.free.lock().ok()?;
        let s = free.get_mut(&n)?.pop()?;
        self.cached_bytes
            .fetch_sub(4 * n, std::sync::atomic::Ordering::Relaxed);
        Some(s)
    }

    fn give(&self, s: CudaSlice<f32>) {
        let n = s.len();
        if bucket(n) != n
            || self.cached_bytes.load(std::sync::atomic::Ordering::Relaxed) + 4 * n
                > POOL_LIMIT_BYTES
        {
            return;
        }
        if let Ok(mut free) = self.free.lock() {
            free.entry(n).or_default().push(s);
            self.cached_bytes
                .fetch_add(4 * n, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// A device buffer that returns to its pool when the last activation using it is dropped.
pub struct PooledBuf {
    slice: Option<CudaSlice<f32>>,
    pool: Arc<BufferPool>,
}

impl std::ops::Deref for PooledBuf {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        // Only `Drop` takes the slice out.
        self.slice
            .as_ref()
            .expect("pooled buffer used after release")
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            self.pool.give(s);
        }
    }
}

/// Host time spent issuing work versus waiting for the device, split at every synchronisation.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct HostTiming {
    /// Seconds between synchronisations spent issuing work (the host's share of a step).
    pub issue_seconds: f64,
    /// Seconds spent waiting in synchronisations (the device's share beyond the host's).
    pub wait_seconds: f64,
    pub synchronisations: u64,
}

/// A row-major `[rows, cols]` f32 activation in device memory.
///
/// The buffer is shared: [`Backend::head_rows`] hands out a view of the first rows without a copy
/// (the MLA path reads the whole latent cache every step). Writes go through device pointers on
/// the one compute stream, which orders them after every earlier read.
pub struct GpuAct {
    buf: Arc<PooledBuf>,
    rows: usize,
    cols: usize,
}

impl GpuAct {
    /// Another handle on the same buffer.
    fn share(&self) -> GpuAct {
        GpuAct {
            buf: self.buf.clone(),
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// A weight in device memory, or a routed expert that lives in host memory until a pass needs it.
pub enum GpuWeight {
    F16 {
        name: String,
        shape: Vec<usize>,
        buf: CudaSlice<f16>,
    },
    /// Marlin-tiled INT4 `[k inputs, n outputs]` with its group scales (docs/MARLIN.md).
    Int4 {
        name: String,
        k: usize,
        n: usize,
        qweight: CudaSlice<u32>,
        scales: CudaSlice<f16>,
    },
    /// Part of routed expert `expert` of model layer `layer`, copied in by the expert cache.
    Offloaded { layer: usize, expert: usize },
}

impl GpuWeight {
    fn describe(&self) -> String {
        match self {
            GpuWeight::F16 { name, shape, .. } => format!("{name} {shape:?}"),
            GpuWeight::Int4 { name, k, n, .. } => format!("{name} (INT4, k {k}, n {n})"),
            GpuWeight::Offloaded { layer, expert } => {
                format!("offloaded expert {expert} of layer {layer}")
            }
        }
    }
}

struct Kernels {
    embedding: CudaFunction,
    rms_norm: CudaFunction,
    layer_norm: CudaFunction,
    copy_cols: CudaFunction,
    copy_rows_at: CudaFunction,
    clamp: CudaFunction,
    add: CudaFunction,
    add_sigmoid_gated: CudaFunction,
    rope: CudaFunction,
    mla_expand_kv: CudaFunction,
    argmax: CudaFunction,
    moe_combine: CudaFunction,
    route_topk: CudaFunction,
    route_sparse_mixer: CudaFunction,
    count_routes: CudaFunction,
    moe_plan: CudaFunction,
    route_plan: CudaFunction,
    linear: CudaFunction,
    gate_up_silu: CudaFunction,
    moe_gate_up: CudaFunction,
    moe_down: CudaFunction,
    attention: CudaFunction,
}

impl Kernels {
    fn load(dev: &CudaDevice) -> Result<Self> {
        let ops = |f: &str| dev.function("ops", f);
        let routing = |f: &str| dev.function("routing", f);
        let gemv = |f: &str| dev.function("gemv_f16", f);
        Ok(Kernels {
            embedding: ops("embedding")?,
            rms_norm: ops("rms_norm")?,
            layer_norm: ops("layer_norm")?,
            copy_cols: ops("copy_cols")?,
            copy_rows_at: ops("copy_rows_at")?,
            clamp: ops("clamp_f32")?,
            add: ops("add_f32")?,
            add_sigmoid_gated: ops("add_sigmoid_gated")?,
            rope: ops("rope")?,
            mla_expand_kv: ops("mla_expand_kv")?,
            argmax: ops("argmax_rows")?,
            moe_combine: ops("moe_combine")?,
            route_topk: routing("route_softmax_topk")?,
            route_sparse_mixer: routing("route_sparse_mixer")?,
            count_routes: routing("count_routes")?,
            moe_plan: routing("moe_plan")?,
            route_plan: routing("route_plan")?,
            linear: gemv("linear_f16")?,
            gate_up_silu: gemv("gate_up_silu_f16")?,
            moe_gate_up: gemv("moe_f16_gate_up")?,
            moe_down: gemv("moe_f16_down")?,
            attention: dev.function("attention", "attention")?,
        })
    }
}

/// cos/sin of the last rope call's rows, kept on the device: every layer of one forward rotates
/// the same positions, so the table is uploaded once per forward.
struct RopeTableGpu {
    inv_freq: Vec<f32>,
    positions: Vec<usize>,
    scales: Vec<f32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// Device routing counts (see [`CudaBackend::enable_route_counts`]).
struct RouteCounts {
    counts: CudaSlice<u32>,
    moe_layers: usize,
    experts: usize,
}

/// The host copy of an expert pointer table and its device upload.
type ExpertTable = (Vec<ExpertGroup>, CudaSlice<u32>);

/// The CUDA backend: one device, one compute stream, and optionally the expert cache.
pub struct CudaBackend {
    dev: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    /// The device's default memory pool, which every allocation here comes from.
    pool: MemPool,
    k: Kernels,
    int4: MoeInt4Kernels,
    rope_table: Mutex<Option<RopeTableGpu>>,
    /// Per expert list (keyed by its address), the device table of its experts' weight pointers
    /// and the host copy it was built from (compared on every use, so a stale entry is rebuilt).
    expert_tables: Mutex<std::collections::HashMap<usize, ExpertTable>>,
    offload: Option<Mutex<ExpertOffload>>,
    buffers: Arc<BufferPool>,
    /// Routing counts `[moe layers, experts]` of passes whose hook counts them on the device.
    route_counts: Mutex<Option<RouteCounts>>,
    /// Recorded forward passes (src/backend/cuda/graphs.rs).
    steps: Mutex<graphs::StepGraphs>,
    /// Allocates buffers while the compute stream is being captured, outside the recording.
    side_stream: Arc<CudaStream>,
    timing: Mutex<(HostTiming, Option<std::time::Instant>)>,
    /// How weights are read at load time, the uploads deferred until `finish_load`, and what the
    /// last batched upload did.
    load_io: LoadIo,
    /// Threads that read weights at load time (`None`: the cores, at most 8).
    load_threads: Option<usize>,
    pending: Mutex<Option<PendingLoad>>,
    load_report: Mutex<Option<LoadReport>>,
}

/// A kernel argument: every argument travels as one 8-byte slot (the driver reads as many bytes as
/// the parameter has, and the target is little-endian).
fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// Row-major `[positions, inv_freq]` cos and sin, scaled per row: as the CPU reference, the angle
/// rounded to f32, then cos/sin in f64.
fn rope_cos_sin(inv_freq: &[f32], positions: &[usize], scales: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0.0f32; positions.len() * half];
    let mut sin = vec![0.0f32; positions.len() * half];
    for (r, (&p, &s)) in positions.iter().zip(scales).enumerate() {
        for i in 0..half {
            let a = (inv_freq[i] * p as f32) as f64;
            cos[r * half + i] = (a.cos() as f32) * s;
            sin[r * half + i] = (a.sin() as f32) * s;
        }
    }
    (cos, sin)
}

/// A device's default memory pool handle.
#[derive(Clone, Copy)]
struct MemPool(sys::CUmemoryPool);

// SAFETY: a pool handle is a driver object usable from any thread of the process; the default
// pool lives as long as the device.
unsafe impl Send for MemPool {}
// SAFETY: as above; the attribute calls made through it are thread-safe in the driver.
unsafe impl Sync for MemPool {}

fn default_mem_pool(dev: &CudaDevice) -> Result<MemPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    guarded("cuDeviceGetDefaultMemPool", || {
        dev.context().bind_to_thread()?;
        // SAFETY: `pool` is a valid out-pointer; the device handle comes from the live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev.context().cu_device()) }.result()
    })?;
    Ok(MemPool(pool))
}

/// Sets (`Some`) or reads (`None`) a 64-bit attribute of a memory pool.
fn pool_attribute(pool: MemPool, attr: sys::CUmemPool_attribute, set: Option<u64>) -> Result<u64> {
    let mut value: u64 = set.unwrap_or(0);
    guarded("cuMemPool attribute", || {
        let p = &mut value as *mut u64 as *mut std::ffi::c_void;
        // SAFETY: the pool is the device's default pool (never destroyed); both attributes used
        // here are 64-bit values, and `p` points at a live u64.
        unsafe {
            if set.is_some() {
                sys::cuMemPoolSetAttribute(pool.0, attr, p)
            } else {
                sys::cuMemPoolGetAttribute(pool.0, attr, p)
            }
        }
        .result()
    })?;
    Ok(value)
}

fn int(v: usize, what: &str) -> Result<u64> {
    i32::try_from(v).map(|v| v as u32 as u64).map_err(|_| {
        Error::Backend(format!(
            "cuda: {what} = {v} exceeds the kernels' 32-bit index"
        ))
    })
}

fn float(v: f32) -> u64 {
    v.to_bits() as u64
}

fn shape_err(op: &str, detail: String) -> Error {
    Error::Backend(format!("cuda {op}: {detail}"))
}

fn grid_for(n: usize, block: u32) -> u32 {
    n.div_ceil(block as usize).clamp(1, 65_535 * 16) as u32
}

impl CudaBackend {
    /// Opens GPU `ordinal` with every routed expert resident once loaded.
    pub fn open(ordinal: usize) -> Result<Self> {
        Self::with_device(
            Arc::new(CudaDevice::open(ordinal)?),
            None,
            &CudaOptions::default(),
        )
    }

    /// A backend on an opened device; with `offload`, routed experts stay in host memory and are
    /// copied into per-layer slots when a pass needs them.
    pub fn with_device(
        dev: Arc<CudaDevice>,
        offload: Option<OffloadConfig>,
        options: &CudaOptions,
    ) -> Result<Self> {
        // One compute stream plus the expert cache's copy stream, fenced by our own events:
        // cudarc's per-buffer event tracking would only add a record per launch.
        // SAFETY: no buffer of this context exists yet that relies on tracking; every later
        // cross-stream use is ordered by explicit events (src/backend/cuda/offload.rs).
        unsafe { dev.context().disable_event_tracking() };
        let stream = dev.stream().clone();
        let pool = default_mem_pool(&dev)?;
        // Keep freed blocks in the pool instead of returning them at every synchronisation:
        // activations are allocated per op, and the pool's high-water mark is then the peak VRAM.
        pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            Some(u64::MAX),
        )?;
        let k = Kernels::load(&dev)?;
        let int4 = MoeInt4Kernels::new(&dev)?;
        let offload = offload
            .map(|cfg| ExpertOffload::new(&dev, cfg).map(Mutex::new))
            .transpose()?;
        let side_stream = guarded("cannot create a CUDA stream", || dev.context().new_stream())?;
        let params = guarded("cuda: cannot allocate the step buffer", || {
            stream.alloc_zeros::<u32>(graphs::PARAM_WORDS)
        })?;
        Ok(CudaBackend {
            dev,
            stream,
            pool,
            k,
            int4,
            rope_table: Mutex::new(None),
            expert_tables: Mutex::new(std::collections::HashMap::new()),
            offload,
            buffers: Arc::new(BufferPool::default()),
            route_counts: Mutex::new(None),
            steps: Mutex::new(graphs::StepGraphs::new(params, options.graphs)),
            side_stream,
            timing: Mutex::new((HostTiming::default(), None)),
            load_io: options.load_io,
            load_threads: options.load_threads,
            pending: Mutex::new(None),
            load_report: Mutex::new(None),
        })
    }

    /// How the next model load reads its weights (see [`LoadIo`]).
    pub fn set_load_io(&mut self, io: LoadIo) {
        self.load_io = io;
    }

    /// What the last batched weight upload did (`None` when weights went one by one).
    pub fn load_report(&self) -> Result<Option<LoadReport>> {
        Ok(self.lock(&self.load_report)?.clone())
    }

    /// Allocates `n` uninitialised elements for a weight whose bytes (`data`, borrowed from the
    /// store being loaded) are copied in by `finish_load`; `None` when `data` is not from the
    /// store's file, or no batched load is in progress.
    fn deferred_alloc<T: cudarc::driver::DeviceRepr>(
        &self,
        name: &str,
        parts: &[&[T]],
    ) -> Result<Option<CudaSlice<T>>> {
        let mut pending = self.lock(&self.pending)?;
        let Some(p) = pending.as_mut() else {
            return Ok(None);
        };
        let Some(offsets) = parts
            .iter()
            .map(|d| p.offset_of(d))
            .collect::<Option<Vec<u64>>>()
        else {
            return Ok(None);
        };
        let n: usize = parts.iter().map(|d| d.len()).sum();
        let buf = guarded(
            &format!(
                "cuda: cannot allocate {name} ({} bytes; out of VRAM?)",
                n * std::mem::size_of::<T>()
            ),
            // SAFETY: the contents are written by `finish_load` before any kernel reads them
            // (it synchronises the copies before the model is returned).
            || unsafe { self.stream.alloc::<T>(n.max(1)) },
        )?;
        let base = ptr(&buf, &self.stream);
        let mut at = 0u64;
        for (d, off) in parts.iter().zip(offsets) {
            let len = std::mem::size_of_val(*d);
            p.push(off, len, base + at);
            at += len as u64;
        }
        Ok(Some(buf))
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// The expert cache's counters, when routed experts are offloaded.
    pub fn offload_stats(&self) -> Result<Option<OffloadStats>> {
        match &self.offload {
            None => Ok(None),
            Some(o) => Ok(Some(self.lock(o)?.stats()?)),
        }
    }

    /// Bytes of experts issued for copying since the last reset, without waiting for the device
    /// (`None` without offloading). Cheap enough to call between tokens.
    pub fn offload_bytes_copied(&self) -> Result<Option<u64>> {
        match &self.offload {
            None => Ok(None),
            Some(o) => Ok(Some(self.lock(o)?.bytes_copied())),
        }
    }

    /// Copies `experts` of model layer `layer` into the expert cache ahead of use and protects
    /// them until [`Self::clear_plans`]; returns the bytes issued (0 without offloading).
    pub fn prefetch(&self, layer: usize, experts: &[u32]) -> Result<usize> {
        match &self.offload {
            None => Ok(0),
            Some(o) => self.lock(o)?.prefetch(layer, experts),
        }
    }

    /// Marks the start of a verify pass, for the share of prefetch copy time hidden behind
    /// drafting ([`OffloadStats::prefetch_hidden_seconds`]).
    pub fn mark_verify(&self) -> Result<()> {
        match &self.offload {
            None => Ok(()),
            Some(o) => self.lock(o)?.mark_verify(&self.stream),
        }
    }

    /// Waits until the offloaded experts' host registration (made in the background at load)
    /// has finished, so that copies go straight from the mapping from now on.
    pub fn wait_host_registration(&self) -> Result<()> {
        if let Some(o) = &self.offload {
            self.lock(o)?.poll_registration(true);
        }
        Ok(())
    }

    /// Ends the current prefetch plan.
    pub fn clear_plans(&self) -> Result<()> {
        if let Some(o) = &self.offload {
            self.lock(o)?.clear_plans();
        }
        Ok(())
    }

    /// Expert slots per MoE layer, when routed experts are offloaded.
    pub fn offload_slots(&self) -> Result<Option<usize>> {
        match &self.offload {
            None => Ok(None),
            Some(o) => Ok(Some(self.lock(o)?.slots_per_layer())),
        }
    }

    /// Restores the expert cache's initial residency and clears its counters.
    pub fn reset_offload(&self) -> Result<()> {
        if let Some(o) = &self.offload {
            self.synchronize()?;
            self.lock(o)?.reset();
        }
        Ok(())
    }

    /// A short description of how routed experts are held ("all resident", or the cache).
    pub fn residency_description(&self) -> Result<String> {
        Ok(match &self.offload {
            None => "all routed experts resident in VRAM".to_string(),
            Some(o) => self.lock(o)?.describe(),
        })
    }

    /// The most device memory the allocation pool has held in use since the last
    /// [`Self::reset_vram_peak`] (weights, expert slots, activations, KV caches).
    pub fn vram_peak_bytes(&self) -> Result<u64> {
        self.synchronize()?;
        pool_attribute(
            self.pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            None,
        )
    }

    /// Restarts the peak at the memory in use now.
    pub fn reset_vram_peak(&self) -> Result<()> {
        self.synchronize()?;
        pool_attribute(
            self.pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            Some(0),
        )
        .map(|_| ())
    }

    /// Waits for all work issued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.note_host_sync()?;
        let issued = std::time::Instant::now();
        guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        let done = std::time::Instant::now();
        let mut t = self.lock(&self.timing)?;
        if let Some(last) = t.1 {
            t.0.issue_seconds += issued.duration_since(last).as_secs_f64();
        }
        t.0.wait_seconds += done.duration_since(issued).as_secs_f64();
        t.0.synchronisations += 1;
        t.1 = Some(done);
        Ok(())
    }

    fn lock<'a, T>(&self, m: &'a Mutex<T>) -> Result<std::sync::MutexGuard<'a, T>> {
        m.lock()
            .map_err(|_| Error::Backend("cuda: a lock was poisoned by an earlier panic".into()))
    }

    fn launch(
        &self,
        f: &CudaFunction,
        what: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[u64],
    ) -> Result<()> {
        let mut b = self.stream.launch_builder(f);
        for a in args {
            b.arg(a);
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every kernel's parameters are pointers and 32-bit scalars passed in 8-byte
        // slots in the order its signature declares (checked by the callers below); pointers
        // address live device buffers of the sizes the kernel reads and writes.
        // SAFETY: as above.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| Error::Backend(format!("cuda {what}: kernel launch failed: {e}")))
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<GpuAct> {
        let n = bucket((rows * cols).max(1));
        let what =
            || format!("cuda: cannot allocate a [{rows}, {cols}] f32 activation (out of VRAM?)");
        let capturing = self.capturing()?;
        let slice = match self.buffers.take(n) {
            Some(s) => s,
            // An allocation on a capturing stream would belong to the graph: make it on the side
            // stream, complete before any recorded kernel can run.
            None if capturing => guarded(&what(), || {
                // SAFETY: every caller writes all `rows * cols` elements before they are read.
                let s = unsafe { self.side_stream.alloc::<f32>(n) }?;
                self.side_stream.synchronize()?;
                Ok(s)
            })?,
            None => guarded(
                &what(),
                // SAFETY: as above. Stream-ordered: made on the stream whose ops will use it.
                || unsafe { self.stream.alloc::<f32>(n) },
            )?,
        };
        let act = self.wrap(slice, rows, cols);
        if capturing {
            self.keep_while_recorded(&act.buf)?;
        }
        Ok(act)
    }

    fn wrap(&self, slice: CudaSlice<f32>, rows: usize, cols: usize) -> GpuAct {
        GpuAct {
            buf: Arc::new(PooledBuf {
                slice: Some(slice),
                pool: self.buffers.clone(),
            }),
            rows,
            cols,
        }
    }

    /// Host issue and wait times since the backend was made (or [`Self::reset_host_timing`]).
    pub fn host_timing(&self) -> Result<HostTiming> {
        Ok(self.lock(&self.timing)?.0)
    }

    pub fn reset_host_timing(&self) -> Result<()> {
        *self.lock(&self.timing)? = (HostTiming::default(), None);
        Ok(())
    }

    fn upload_u32(&self, data: &[u32]) -> Result<CudaSlice<u32>> {
        let data = if data.is_empty() { &[0u32][..] } else { data };
        guarded("cuda: host-to-device copy failed", || {
            self.stream.clone_htod(data)
        })
    }

    fn f16_matrix<'w>(
        &self,
        w: &'w GpuWeight,
        op: &str,
    ) -> Result<(&'w CudaSlice<f16>, usize, usize)> {
        match w {
            GpuWeight::F16 { shape, buf, .. } if shape.len() == 2 => Ok((buf, shape[0], shape[1])),
            other => Err(shape_err(
                op,
                format!("{} is not an FP16 matrix", other.describe()),
            )),
        }
    }

    fn f16_vector<'w>(&self, w: &'w GpuWeight, len: usize, op: &str) -> Result<&'w CudaSlice<f16>> {
        match w {
            GpuWeight::F16 { shape, buf, .. } if shape.iter().product::<usize>() == len => Ok(buf),
            other => Err(shape_err(
                op,
                format!("{} is not an FP16 vector of {len}", other.describe()),
            )),
        }
    }

    fn elementwise_grid(n: usize) -> (u32, u32, u32) {
        (grid_for(n, 256).min(65_535), 1, 1)
    }

    /// Launches the grouped FP16 expert kernels (gate/up then down) for one work list.
    fn launch_moe_f16(&self, l: &MoeLaunch) -> Result<()> {
        let (h, i) = (int(l.hidden, "hidden")?, int(l.inter, "inter")?);
        let gy = u32::try_from(l.num_groups).unwrap_or(u32::MAX);
        self.launch(
            &self.k.moe_gate_up,
            "moe gate/up",
            (grid_for(l.inter, GEMV_WARPS as u32), gy, 1),
            32 * GEMV_WARPS as u32,
            &[l.x, h, i, l.groups, l.item_row, l.h],
        )?;
        self.launch(
            &self.k.moe_down,
            "moe down",
            (
                grid_for(l.hidden, (GEMV_WARPS * GEMV_FEATURES) as u32),
                gy,
                1,
            ),
            32 * GEMV_WARPS as u32,
            &[l.h, h, i, l.groups, l.item_weight, l.out],
        )
    }

    fn rope_table(
        &self,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<std::sync::MutexGuard<'_, Option<RopeTableGpu>>> {
        let mut table = self.lock(&self.rope_table)?;
        let fresh = table.as_ref().is_some_and(|t| {
            t.inv_freq == inv_freq && t.positions == positions && t.scales == scales
        });
        if !fresh {
            let (cos, sin) = rope_cos_sin(inv_freq, positions, scales);
            let up = |v: &[f32]| {
                let v = if v.is_empty() { &[0.0f32][..] } else { v };
                guarded("cuda rope: host-to-device copy failed", || {
                    self.stream.clone_htod(v)
                })
            };
            *table = Some(RopeTableGpu {
                inv_freq: inv_freq.to_vec(),
                positions: positions.to_vec(),
                scales: scales.to_vec(),
                cos: up(&cos)?,
                sin: up(&sin)?,
            });
        }
        Ok(table)
    }
}

impl Backend for CudaBackend {
    type Act = GpuAct;
    type Weight = GpuWeight;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn weight_f16(&self, name: &str, shape: &[usize], data: &[f16]) -> Result<GpuWeight> {
        let n: usize = shape.iter().product();
        if n != data.len() || shape.is_empty() || shape.len() > 2 || n == 0 {
            return Err(shape_err(
                "weight",
                format!(
                    "{name}: shape {shape:?} does not hold {} values",
                    data.len()
                ),
            ));
        }
        let buf = match self.deferred_alloc(name, &[data])? {
            Some(buf) => buf,
            None => guarded(
                &format!("cuda: cannot upload {name} ({} bytes; out of VRAM?)", 2 * n),
                || self.stream.clone_htod(data),
            )?,
        };
        Ok(GpuWeight::F16 {
            name: name.to_string(),
            shape: shape.to_vec(),
            buf,
        })
    }

    fn weight_f16_parts(&self, name: &str, shape: &[usize], parts: &[&[f16]]) -> Result<GpuWeight> {
        let n: usize = shape.iter().product();
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if n != total || shape.is_empty() || shape.len() > 2 || n == 0 {
            return Err(shape_err(
                "weight",
                format!("{name}: shape {shape:?} does not hold {total} values"),
            ));
        }
        match self.deferred_alloc(name, parts)? {
            Some(buf) => Ok(GpuWeight::F16 {
                name: name.to_string(),
                shape: shape.to_vec(),
                buf,
            }),
            None => self.weight_f16(name, shape, &parts.concat()),
        }
    }

    fn begin_load(&self, backing: Option<crate::weights::Backing<'_>>) -> Result<()> {
        let pending = match (self.load_io, backing) {
            (LoadIo::PerTensor, _) | (_, None) => None,
            (_, Some(b)) => match b.file {
                Some((file, path)) => Some(PendingLoad::new(b.bytes, file, path)?),
                None => None,
            },
        };
        *self.lock(&self.pending)? = pending;
        Ok(())
    }

    fn finish_load(&self) -> Result<()> {
        let Some(pending) = self.lock(&self.pending)?.take() else {
            return Ok(());
        };
        if pending.is_empty() {
            return Ok(());
        }
        // The weights' allocations were queued on the compute stream; the copies run on other
        // streams.
        guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        let report =
            super::load::upload(self.dev.context(), pending, self.load_io, self.load_threads)?;
        tracing::info!(
            "uploaded {:.2} GB of weights in {:.3} s ({} I/O, {} threads)",
            report.bytes as f64 / 1e9,
            report.seconds,
            report.io,
            report.threads
        );
        *self.lock(&self.load_report)? = Some(report);
        Ok(())
    }

    fn weight_int4(
        &self,
        name: &str,
        k: usize,
        n: usize,
        qweight: &[u32],
        scales: &[f16],
    ) -> Result<GpuWeight> {
        crate::quant::check_marlin_shape(name, k, n)
            .map_err(|e| Error::Model(format!("{name}: {e}")))?;
        if qweight.len() != k * n / 8 || scales.len() != (k / 128) * n {
            return Err(shape_err(
                "weight_int4",
                format!(
                    "{name}: {} words and {} scales do not fit k {k}, n {n}",
                    qweight.len(),
                    scales.len()
                ),
            ));
        }
        let deferred = match self.deferred_alloc(name, &[qweight])? {
            Some(q) => match self.deferred_alloc(&format!("{name} scales"), &[scales])? {
                Some(s) => Some((q, s)),
                // A load that fails is dropped with its backend, so `q`'s queued copy never runs.
                None => {
                    return Err(Error::Backend(format!(
                        "{name}: the weights and their scales do not come from the same file"
                    )))
                }
            },
            None => None,
        };
        let up = match deferred {
            Some(up) => up,
            None => guarded(
                &format!("cuda: cannot upload {name} (out of VRAM?)"),
                || {
                    Ok((
                        self.stream.clone_htod(qweight)?,
                        self.stream.clone_htod(scales)?,
                    ))
                },
            )?,
        };
        Ok(GpuWeight::Int4 {
            name: name.to_string(),
            k,
            n,
            qweight: up.0,
            scales: up.1,
        })
    }

    fn routed_expert(
        &self,
        layer: usize,
        expert: usize,
        load: &mut dyn FnMut() -> Result<GatedMlp<Self>>,
    ) -> Result<GatedMlp<Self>> {
        match &self.offload {
            Some(o) => {
                self.lock(o)?.check_expert(layer, expert)?;
                Ok(GatedMlp {
                    gate_up: GpuWeight::Offloaded { layer, expert },
                    down: GpuWeight::Offloaded { layer, expert },
                })
            }
            None => load(),
        }
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<GpuAct> {
        let buf = guarded(
            &format!("cuda: cannot allocate a [{rows}, {cols}] f32 buffer (out of VRAM?)"),
            || self.stream.alloc_zeros::<f32>((rows * cols).max(1)),
        )?;
        Ok(self.wrap(buf, rows, cols))
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<GpuAct> {
        if data.len() != rows * cols {
            return Err(shape_err(
                "upload",
                format!("{} values for [{rows}, {cols}]", data.len()),
            ));
        }
        if data.is_empty() {
            return self.alloc(rows, cols);
        }
        let mut a = self.alloc(rows, cols)?;
        let dst = ptr(&a.buf, &self.stream);
        guarded("cuda: host-to-device copy failed", || {
            // SAFETY: `dst` addresses at least `data.len()` f32 (the bucket is never smaller);
            // pageable source memory is staged by the driver before this call returns.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
        })?;
        a.rows = rows;
        Ok(a)
    }

    fn to_host(&self, x: &GpuAct) -> Result<Vec<f32>> {
        // Wait first: a copy into pageable memory would otherwise wait for the queued kernels
        // inside the copy, and the host timing would count the device's time as the host's.
        self.synchronize()?;
        let mut out = vec![0.0f32; x.rows * x.cols];
        if !out.is_empty() {
            let view = x.buf.slice(..out.len());
            guarded("cuda: device-to-host copy failed", || {
                self.stream.memcpy_dtoh(&view, &mut out)
            })?;
            guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        }
        Ok(out)
    }

    fn shape(&self, x: &GpuAct) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embedding(&self, table: &GpuWeight, ids: &[u32]) -> Result<GpuAct> {
        let (buf, vocab, hidden) = self.f16_matrix(table, "embedding")?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(shape_err(
                "embedding",
                format!("token id {bad} >= {vocab} rows of {}", table.describe()),
            ));
        }
        let y = self.alloc(ids.len(), hidden)?;
        if ids.is_empty() {
            return Ok(y);
        }
        // In a recorded pass the ids come from the step buffer, rewritten at every replay.
        let step_ids = match self.step_args()? {
            Some(a) if self.step_tokens_match(ids)? => Some(a.ids),
            _ => None,
        };
        let d_ids = match step_ids {
            Some(_) => None,
            None => Some(self.upload_u32(ids)?),
        };
        let s = &self.stream;
        self.launch(
            &self.k.embedding,
            "embedding",
            (ids.len() as u32, 1, 1),
            ROW_THREADS,
            &[
                ptr(buf, s),
                match (&d_ids, step_ids) {
                    (Some(d), _) => ptr(d, s),
                    (None, Some(p)) => p,
                    (None, None) => unreachable!("ids are uploaded when not in the step buffer"),
                },
                int(hidden, "hidden")?,
                ptr(&y.buf, s),
            ],
        )?;
        Ok(y)
    }

    fn rms_norm(&self, x: &GpuAct, weight: &GpuWeight, eps: f32, group: usize) -> Result<GpuAct> {
        if group == 0 || !x.cols.is_multiple_of(group) {
            return Err(shape_err(
                "rms_norm",
                format!("group {group} does not divide width {}", x.cols),
            ));
        }
        let w = self.f16_vector(weight, group, "rms_norm")?;
        let y = self.alloc(x.rows, x.cols)?;
        let blocks = x.rows * (x.cols / group);
        if blocks > 0 {
            let s = &self.stream;
            self.launch(
                &self.k.rms_norm,
                "rms_norm",
                (
                    u32::try_from(blocks)
                        .map_err(|_| shape_err("rms_norm", "too many rows".into()))?,
                    1,
                    1,
                ),
                ROW_THREADS,
                &[
                    ptr(&x.buf, s),
                    ptr(w, s),
                    float(eps),
                    int(group, "group")?,
                    ptr(&y.buf, s),
                ],
            )?;
        }
        Ok(y)
    }

    fn layer_norm(
        &self,
        x: &GpuAct,
        weight: &GpuWeight,
        bias: &GpuWeight,
        eps: f32,
    ) -> Result<GpuAct> {
        let w = self.f16_vector(weight, x.cols, "layer_norm")?;
        let b = self.f16_vector(bias, x.cols, "layer_norm")?;
        let y = self.alloc(x.rows, x.cols)?;
        if x.rows > 0 {
            let s = &self.stream;
            self.launch(
                &self.k.layer_norm,
                "layer_norm",
                (x.rows as u32, 1, 1),
                ROW_THREADS,
                &[
                    ptr(&x.buf, s),
                    ptr(w, s),
                    ptr(b, s),
                    float(eps),
                    int(x.cols, "cols")?,
                    ptr(&y.buf, s),
                ],
            )?;
        }
        Ok(y)
    }

    fn linear(&self, x: &GpuAct, w: &GpuWeight, bias: Option<&GpuWeight>) -> Result<GpuAct> {
        let (wb, out, inp) = self.f16_matrix(w, "linear")?;
        if inp != x.cols {
            return Err(shape_err(
                "linear",
                format!(
                    "{} does not take an input of {} columns",
                    w.describe(),
                    x.cols
                ),
            ));
        }
        let bias_ptr = match bias {
            Some(b) => ptr(self.f16_vector(b, out, "linear bias")?, &self.stream),
            None => 0,
        };
        let y = self.alloc(x.rows, out)?;
        if x.rows > 0 {
            let s = &self.stream;
            self.launch(
                &self.k.linear,
                "linear",
                (grid_for(out, (GEMV_WARPS * GEMV_FEATURES) as u32), 1, 1),
                32 * GEMV_WARPS as u32,
                &[
                    ptr(&x.buf, s),
                    int(x.rows, "rows")?,
                    int(inp, "in")?,
                    ptr(wb, s),
                    int(out, "out")?,
                    bias_ptr,
                    ptr(&y.buf, s),
                ],
            )?;
        }
        Ok(y)
    }

    fn split_cols(&self, x: &GpuAct, widths: &[usize]) -> Result<Vec<GpuAct>> {
        check::split(widths, x.cols).map_err(|d| shape_err("split_cols", d))?;
        let outs = widths
            .iter()
            .map(|&w| self.alloc(x.rows, w))
            .collect::<Result<Vec<_>>>()?;
        // One launch per four pieces (copy_cols in kernels/ops.cu).
        let mut col0 = 0;
        for (ws, ys) in widths.chunks(4).zip(outs.chunks(4)) {
            let width: usize = ws.iter().sum();
            let total = x.rows * width;
            if total > 0 {
                let s = &self.stream;
                let mut args = vec![
                    ptr(&x.buf, s),
                    int(x.cols, "cols")?,
                    int(col0, "col")?,
                    int(width, "width")?,
                    total as u64,
                ];
                for j in 0..4 {
                    match (ws.get(j), ys.get(j)) {
                        (Some(&w), Some(y)) => args.extend([ptr(&y.buf, s), int(w, "width")?]),
                        _ => args.extend([0, 0]),
                    }
                }
                self.launch(
                    &self.k.copy_cols,
                    "split_cols",
                    Self::elementwise_grid(total),
                    256,
                    &args,
                )?;
            }
            col0 += width;
        }
        Ok(outs)
    }

    fn clamp(&self, x: &mut GpuAct, limit: f32) -> Result<()> {
        let n = x.rows * x.cols;
        if n > 0 {
            let p = ptr(&x.buf, &self.stream);
            self.launch(
                &self.k.clamp,
                "clamp",
                Self::elementwise_grid(n),
                256,
                &[p, float(limit), n as u64],
            )?;
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut GpuAct, y: &GpuAct) -> Result<()> {
        check::same((x.rows, x.cols), (y.rows, y.cols)).map_err(|d| shape_err("add", d))?;
        let n = x.rows * x.cols;
        if n > 0 {
            let s = &self.stream;
            let (px, py) = (ptr(&x.buf, s), ptr(&y.buf, s));
            self.launch(
                &self.k.add,
                "add",
                Self::elementwise_grid(n),
                256,
                &[px, py, n as u64],
            )?;
        }
        Ok(())
    }

    fn add_sigmoid_gated(&self, x: &mut GpuAct, y: &GpuAct, gate: &GpuAct) -> Result<()> {
        check::sigmoid_gated((x.rows, x.cols), (y.rows, y.cols), (gate.rows, gate.cols))
            .map_err(|d| shape_err("add_sigmoid_gated", d))?;
        let n = x.rows * x.cols;
        if n > 0 {
            let s = &self.stream;
            let args = [
                ptr(&x.buf, s),
                ptr(&y.buf, s),
                ptr(&gate.buf, s),
                int(x.cols, "cols")?,
                n as u64,
            ];
            self.launch(
                &self.k.add_sigmoid_gated,
                "add_sigmoid_gated",
                Self::elementwise_grid(n),
                256,
                &args,
            )?;
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut GpuAct,
        spec: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        let half = spec.rot_dim / 2;
        check::rope(
            &spec,
            (x.rows, x.cols),
            inv_freq.len(),
            positions.len(),
            scales.len(),
        )
        .map_err(|d| shape_err("rope", d))?;
        if x.rows == 0 || half == 0 {
            return Ok(());
        }
        let s = &self.stream;
        // In a recorded pass cos/sin come from the step buffer, rewritten at every replay.
        let (cos, sin) = match self.step_args()? {
            Some(a) if self.step_rope_matches(inv_freq, positions, scales)? => (a.cos, a.sin),
            _ => {
                let table = self.rope_table(inv_freq, positions, scales)?;
                let t = table
                    .as_ref()
                    .ok_or_else(|| shape_err("rope", "no table".into()))?;
                (ptr(&t.cos, s), ptr(&t.sin, s))
            }
        };
        let args = [
            ptr(&x.buf, s),
            cos,
            sin,
            int(x.cols, "cols")?,
            int(spec.heads, "heads")?,
            int(spec.head_stride, "head_stride")?,
            int(spec.offset, "offset")?,
            int(spec.rot_dim, "rot_dim")?,
            u64::from(spec.style == RopeStyle::Interleaved),
        ];
        self.launch(
            &self.k.rope,
            "rope",
            (x.rows as u32, 1, 1),
            ROW_THREADS,
            &args,
        )
    }

    fn write_rows(&self, dst: &mut GpuAct, row: usize, src: &GpuAct) -> Result<()> {
        check::write_rows((dst.rows, dst.cols), row, (src.rows, src.cols))
            .map_err(|d| shape_err("write_rows", d))?;
        let n = src.rows * src.cols;
        if let Some(a) = self
            .step_args()?
            .filter(|a| a.start == row && a.rows == src.rows)
        {
            // A recorded pass appends at the position the step buffer holds at replay.
            if n == 0 {
                return Ok(());
            }
            let s = &self.stream;
            return self.launch(
                &self.k.copy_rows_at,
                "write_rows",
                (grid_for(src.cols, 256), src.rows as u32, 1),
                256,
                &[
                    ptr(&src.buf, s),
                    ptr(&dst.buf, s),
                    int(src.cols, "cols")?,
                    a.positions,
                ],
            );
        }
        if n > 0 {
            let from = ptr(&src.buf, &self.stream);
            let to = ptr(&dst.buf, &self.stream) + (4 * row * dst.cols) as u64;
            guarded("cuda write_rows: device copy failed", || {
                // SAFETY: both ranges lie inside their buffers (checked above: `row + src.rows`
                // rows fit in `dst`), and distinct activations never share a buffer except
                // through `head_rows` views, which only read.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        to,
                        from,
                        4 * n,
                        self.stream.cu_stream(),
                    )
                }
            })?;
        }
        Ok(())
    }

    fn head_rows(&self, x: &GpuAct, rows: usize) -> Result<GpuAct> {
        if rows > x.rows {
            return Err(shape_err("head_rows", format!("{rows} of {} rows", x.rows)));
        }
        // A view: same buffer, fewer rows.
        Ok(GpuAct {
            buf: x.buf.clone(),
            rows,
            cols: x.cols,
        })
    }

    fn mla_expand_kv(
        &self,
        kv: &GpuAct,
        k_pe: &GpuAct,
        heads: usize,
        nope: usize,
        v_dim: usize,
    ) -> Result<(GpuAct, GpuAct)> {
        let rope = k_pe.cols;
        check::mla_expand(
            (kv.rows, kv.cols),
            (k_pe.rows, k_pe.cols),
            heads,
            nope,
            v_dim,
        )
        .map_err(|d| shape_err("mla_expand_kv", d))?;
        let keys = self.alloc(kv.rows, heads * (nope + rope))?;
        let values = self.alloc(kv.rows, heads * v_dim)?;
        if kv.rows > 0 {
            let s = &self.stream;
            let args = [
                ptr(&kv.buf, s),
                ptr(&k_pe.buf, s),
                int(heads, "heads")?,
                int(nope, "nope")?,
                int(rope, "rope")?,
                int(v_dim, "v_dim")?,
                ptr(&keys.buf, s),
                ptr(&values.buf, s),
            ];
            let h = u32::try_from(heads)
                .map_err(|_| shape_err("mla_expand_kv", "too many heads".into()))?;
            self.launch(
                &self.k.mla_expand_kv,
                "mla_expand_kv",
                (kv.rows as u32, h, 1),
                MLA_THREADS,
                &args,
            )?;
        }
        Ok((keys, values))
    }

    fn attention(
        &self,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        kv_len: usize,
        spec: AttentionSpec,
    ) -> Result<GpuAct> {
        let AttentionSpec {
            heads,
            kv_heads,
            qk_dim,
            v_dim,
            scale,
            start,
            window,
        } = spec;
        check::attention(
            &spec,
            (q.rows, q.cols),
            (k.rows, k.cols),
            (v.rows, v.cols),
            kv_len,
        )
        .map_err(|d| shape_err("attention", d))?;
        let out = self.alloc(q.rows, heads * v_dim)?;
        if q.rows == 0 {
            return Ok(out);
        }
        let blocks = q.rows * heads;
        // A recorded pass reads its start on the device and may be replayed at any length the
        // cache holds: its score rows are sized for the whole cache.
        let step = self
            .step_args()?
            .filter(|a| a.start == start && a.rows == q.rows);
        let stride = match step {
            Some(_) => k.rows.min(v.rows).max(1),
            None => kv_len.max(1),
        };
        let scratch = self.alloc(blocks, stride)?;
        let s = &self.stream;
        let args = [
            ptr(&q.buf, s),
            ptr(&k.buf, s),
            ptr(&v.buf, s),
            ptr(&out.buf, s),
            ptr(&scratch.buf, s),
            int(heads, "heads")?,
            int(kv_heads, "kv_heads")?,
            int(qk_dim, "qk_dim")?,
            int(v_dim, "v_dim")?,
            float(scale),
            int(start, "start")?,
            int(window.unwrap_or(0), "window")?,
            int(stride, "kv_len")?,
            step.map_or(0, |a| a.positions),
        ];
        let grid =
            u32::try_from(blocks).map_err(|_| shape_err("attention", "too many rows".into()))?;
        self.launch(
            &self.k.attention,
            "attention",
            (grid, 1, 1),
            ATT_THREADS,
            &args,
        )?;
        Ok(out)
    }

    fn route(&self, logits: &GpuAct, spec: RouteSpec) -> Result<Routing> {
        // The routing decides which experts are copied, so the host needs it anyway; computing
        // it with the CPU reference's code keeps top-k ties and SparseMixer identical.
        let data = self.to_host(logits)?;
        Cpu.route(
            &Mat {
                rows: logits.rows,
                cols: logits.cols,
                data,
            },
            spec,
        )
    }

    fn routed_moe(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        host_routing: bool,
        count_as: Option<usize>,
    ) -> Result<(GpuAct, Option<Routing>)> {
        let resident = experts
            .iter()
            .all(|m| !matches!(m.gate_up, GpuWeight::Offloaded { .. }));
        let top_k = match spec {
            RouteSpec::SoftmaxTopK { top_k, .. } => top_k,
            RouteSpec::SparseMixer { .. } => 2,
        };
        let fits = (1..=MAX_TOP_K).contains(&top_k)
            && top_k <= experts.len()
            && experts.len() <= PLAN_MAX_EXPERTS;
        if !host_routing
            && resident
            && fits
            && logits.cols == experts.len()
            && x.rows == logits.rows
            && x.rows > 0
        {
            return Ok((
                self.routed_moe_on_device(x, logits, spec, top_k, experts, count_as)?,
                None,
            ));
        }
        let routing = self.route(logits, spec)?;
        if let Some(layer) = count_as {
            let ids = self.upload_u32(&routing.ids)?;
            self.count_routes(ptr(&ids, &self.stream), routing.ids.len(), layer)?;
        }
        let out = self.moe_experts(x, &routing, experts)?;
        Ok((out, Some(routing)))
    }

    fn gated_mlp(&self, x: &GpuAct, mlp: &GatedMlp<Self>) -> Result<GpuAct> {
        let (wb, two_inter, inp) = self.f16_matrix(&mlp.gate_up, "gated_mlp")?;
        if inp != x.cols || two_inter % 2 != 0 {
            return Err(shape_err(
                "gated_mlp",
                format!(
                    "{} is not a gate/up pair for an input of {} columns",
                    mlp.gate_up.describe(),
                    x.cols
                ),
            ));
        }
        let inter = two_inter / 2;
        let h = self.alloc(x.rows, inter)?;
        if x.rows > 0 && inter > 0 {
            // Gate/up product and silu(gate) * up in one kernel: the same bits as `linear`
            // followed by `silu_mul`.
            let s = &self.stream;
            let args = [
                ptr(&x.buf, s),
                int(x.rows, "rows")?,
                int(inp, "in")?,
                ptr(wb, s),
                int(inter, "inter")?,
                ptr(&h.buf, s),
            ];
            self.launch(
                &self.k.gate_up_silu,
                "gate/up silu",
                (grid_for(inter, GEMV_WARPS as u32), 1, 1),
                32 * GEMV_WARPS as u32,
                &args,
            )?;
        }
        self.linear(&h, &mlp.down, None)
    }

    fn moe_experts(
        &self,
        x: &GpuAct,
        routing: &Routing,
        experts: &[GatedMlp<Self>],
    ) -> Result<GpuAct> {
        let k = routing.top_k;
        if k == 0 || routing.ids.len() != x.rows * k || routing.weights.len() != x.rows * k {
            return Err(shape_err(
                "moe_experts",
                format!(
                    "routing of {} ids (top {k}) for {} rows",
                    routing.ids.len(),
                    x.rows
                ),
            ));
        }
        if let Some(&bad) = routing.ids.iter().find(|&&e| e as usize >= experts.len()) {
            return Err(shape_err(
                "moe_experts",
                format!("expert id {bad} >= {}", experts.len()),
            ));
        }
        let hidden = x.cols;
        let y = self.alloc(x.rows, hidden)?;
        if x.rows == 0 {
            return Ok(y);
        }
        let plan = MoePlan::new(routing, experts.len());
        let first = &experts[plan.hit[0] as usize];
        let inter = match (&first.gate_up, &first.down) {
            (GpuWeight::F16 { shape, .. }, _) if shape.len() == 2 => shape[0] / 2,
            (GpuWeight::Int4 { n, .. }, _) => n / 2,
            (GpuWeight::Offloaded { layer, .. }, _) => match &self.offload {
                Some(o) => self.lock(o)?.inter(*layer)?,
                None => {
                    return Err(shape_err(
                        "moe_experts",
                        "offloaded expert without a cache".into(),
                    ))
                }
            },
            (other, _) => {
                return Err(shape_err(
                    "moe_experts",
                    format!("{} is not an expert", other.describe()),
                ))
            }
        };
        let h = self.alloc(plan.items(), inter)?;
        let out = self.alloc(plan.items(), hidden)?;
        let d_items = self.upload_u32(&plan.item_words())?;
        let s = &self.stream;
        let items_base = ptr(&d_items, s);
        let mut launch = MoeLaunch {
            x: ptr(&x.buf, s),
            hidden,
            inter,
            groups: 0,
            num_groups: 0,
            max_count: 0,
            item_row: items_base,
            item_weight: items_base + 4 * plan.items() as u64,
            items: plan.items(),
            h: ptr(&h.buf, s),
            out: ptr(&out.buf, s),
        };
        match &first.gate_up {
            GpuWeight::Offloaded { layer, .. } => {
                let o = self.offload.as_ref().ok_or_else(|| {
                    shape_err("moe_experts", "offloaded expert without a cache".into())
                })?;
                let mut cache = self.lock(o)?;
                cache.run_layer(self, *layer, &plan, &mut launch)?;
            }
            _ => {
                let mut groups = Vec::with_capacity(plan.hit.len());
                let int4 = matches!(first.gate_up, GpuWeight::Int4 { .. });
                for (g, &e) in plan.hit.iter().enumerate() {
                    let (mut group, q) = expert_pointers(&experts[e as usize], e as usize, s)?;
                    if q != int4 {
                        return Err(shape_err(
                            "moe_experts",
                            format!(
                                "expert {e} is not of the same kind (FP16 or INT4) as expert {}",
                                plan.hit[0]
                            ),
                        ));
                    }
                    (group.first, group.count) = plan.range(g);
                    groups.push(group);
                }
                let d_groups = self.upload_groups(&groups)?;
                launch.groups = ptr(&d_groups, s);
                launch.num_groups = groups.len();
                launch.max_count = plan.max_count();
                self.launch_moe(&launch, int4)?;
                // The uploaded group table must outlive the kernels that read it.
                self.defer_free(d_groups);
            }
        }
        let d_row_items = self.upload_u32(&plan.row_items)?;
        let args = [
            launch.out,
            ptr(&d_row_items, s),
            int(k, "top_k")?,
            int(hidden, "hidden")?,
            ptr(&y.buf, s),
        ];
        self.launch(
            &self.k.moe_combine,
            "moe combine",
            (x.rows as u32, grid_for(hidden, ROW_THREADS), 1),
            ROW_THREADS,
            &args,
        )?;
        drop(d_items);
        drop(h);
        drop(out);
        Ok(y)
    }

    fn argmax(&self, x: &GpuAct) -> Result<Vec<u32>> {
        if x.cols == 0 {
            return Err(shape_err("argmax", "rows have no columns".into()));
        }
        if x.rows == 0 {
            return Ok(Vec::new());
        }
        let out = guarded("cuda argmax: allocation failed", || {
            self.stream.alloc_zeros::<u32>(x.rows)
        })?;
        let s = &self.stream;
        let args = [ptr(&x.buf, s), int(x.cols, "cols")?, ptr(&out, s)];
        self.launch(
            &self.k.argmax,
            "argmax",
            (x.rows as u32, 1, 1),
            ROW_THREADS,
            &args,
        )?;
        self.synchronize()?;
        let mut host = vec![0u32; x.rows];
        guarded("cuda argmax: device-to-host copy failed", || {
            self.stream.memcpy_dtoh(&out, &mut host)
        })?;
        guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        Ok(host)
    }

    fn begin_step(&self, step: &StepRequest) -> Result<StepStart<GpuAct>> {
        self.begin_step_impl(step)
    }

    fn end_step(&self, logits: Option<&GpuAct>) -> Result<StepEnd> {
        self.end_step_impl(logits)
    }

    fn storage_id(&self, x: &GpuAct) -> u64 {
        ptr(&x.buf, &self.stream)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Buffers allocated on the side stream are freed on it: let the compute stream's work
        // that may still use them finish first. Errors cannot be reported from here.
        let _ = self.stream.synchronize();
    }
}

/// Which rows go to which expert in one MoE call: items are (row, slot) pairs grouped by
/// ascending expert id.
pub(crate) struct MoePlan {
    /// Experts hit, ascending.
    pub hit: Vec<u32>,
    /// `hit[g]`'s items are `starts[g]..starts[g + 1]`.
    pub starts: Vec<u32>,
    pub item_row: Vec<u32>,
    pub item_weight: Vec<f32>,
    /// `[rows, top_k]`: each row's items in ascending expert id.
    pub row_items: Vec<u32>,
}

impl MoePlan {
    pub(crate) fn new(routing: &Routing, num_experts: usize) -> Self {
        let k = routing.top_k;
        let rows = routing.ids.len() / k;
        let mut per_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); num_experts];
        for (i, (&e, &w)) in routing.ids.iter().zip(&routing.weights).enumerate() {
            per_expert[e as usize].push(((i / k) as u32, w));
        }
        let mut plan = MoePlan {
            hit: Vec::new(),
            starts: vec![0],
            item_row: Vec::with_capacity(rows * k),
            item_weight: Vec::with_capacity(rows * k),
            row_items: Vec::with_capacity(rows * k),
        };
        let mut row_lists: Vec<Vec<u32>> = vec![Vec::with_capacity(k); rows];
        for (e, list) in per_expert.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            plan.hit.push(e as u32);
            for &(r, w) in list {
                row_lists[r as usize].push(plan.item_row.len() as u32);
                plan.item_row.push(r);
                plan.item_weight.push(w);
            }
            plan.starts.push(plan.item_row.len() as u32);
        }
        for list in row_lists {
            plan.row_items.extend(list);
        }
        plan
    }

    pub(crate) fn items(&self) -> usize {
        self.item_row.len()
    }

    /// `(first, count)` of group `g`.
    pub(crate) fn range(&self, g: usize) -> (u32, u32) {
        (self.starts[g], self.starts[g + 1] - self.starts[g])
    }

    pub(crate) fn max_count(&self) -> usize {
        (0..self.hit.len())
            .map(|g| self.range(g).1 as usize)
            .max()
            .unwrap_or(0)
    }

    /// `item_row` then the bits of `item_weight`, one upload.
    fn item_words(&self) -> Vec<u32> {
        let mut words = self.item_row.clone();
        words.extend(self.item_weight.iter().map(|w| w.to_bits()));
        words
    }
}

/// The weight pointers of a resident expert (first/count left 0), and whether it is INT4.
fn expert_pointers(
    mlp: &GatedMlp<CudaBackend>,
    e: usize,
    stream: &CudaStream,
) -> Result<(ExpertGroup, bool)> {
    match (&mlp.gate_up, &mlp.down) {
        (GpuWeight::F16 { buf: gu, .. }, GpuWeight::F16 { buf: dn, .. }) => Ok((
            ExpertGroup {
                gate_up: ptr(gu, stream),
                down: ptr(dn, stream),
                ..Default::default()
            },
            false,
        )),
        (
            GpuWeight::Int4 {
                qweight: gq,
                scales: gs,
                ..
            },
            GpuWeight::Int4 {
                qweight: dq,
                scales: ds,
                ..
            },
        ) => Ok((
            ExpertGroup {
                gate_up: ptr(gq, stream),
                gate_up_scales: ptr(gs, stream),
                down: ptr(dq, stream),
                down_scales: ptr(ds, stream),
                ..Default::default()
            },
            true,
        )),
        (a, b) => Err(shape_err(
            "moe_experts",
            format!(
                "expert {e}: {} / {} is not a resident expert",
                a.describe(),
                b.describe()
            ),
        )),
    }
}

impl CudaBackend {
    /// Routing, work list and expert kernels all on the device: no host round trip.
    fn routed_moe_on_device(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        top_k: usize,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
    ) -> Result<GpuAct> {
        let s = &self.stream;
        let rows = x.rows;
        let hidden = x.cols;
        let n_experts = experts.len();
        let mut templates = Vec::with_capacity(n_experts);
        let int4 = matches!(experts[0].gate_up, GpuWeight::Int4 { .. });
        for (e, mlp) in experts.iter().enumerate() {
            let (t, q) = expert_pointers(mlp, e, s)?;
            if q != int4 {
                return Err(shape_err(
                    "moe_experts",
                    format!("expert {e} is not of the same kind (FP16 or INT4) as expert 0"),
                ));
            }
            templates.push(t);
        }
        let inter = match &experts[0].gate_up {
            GpuWeight::F16 { shape, .. } => shape[0] / 2,
            GpuWeight::Int4 { n, .. } => n / 2,
            other => {
                return Err(shape_err(
                    "moe_experts",
                    format!("{} is not an expert", other.describe()),
                ))
            }
        };
        let mut tables = self.lock(&self.expert_tables)?;
        let key = experts.as_ptr() as usize;
        let fresh = tables.get(&key).is_some_and(|(host, _)| *host == templates);
        if !fresh {
            let dev = self.upload_groups(&templates)?;
            tables.insert(key, (templates, dev));
        }
        let table = ptr(
            &tables
                .get(&key)
                .ok_or_else(|| shape_err("moe_experts", "no table".into()))?
                .1,
            s,
        );
        drop(tables);

        let n_items = rows * top_k;
        let max_groups = n_items.min(n_experts);
        // 32-bit scratch from the activation pool (kernels see raw pointers); the routing and
        // plan kernels write every element before anything reads it.
        let alloc_u32 = |n: usize| self.alloc(n.max(1), 1).map(|a| a.buf);
        let ids = alloc_u32(n_items)?;
        let weights = alloc_u32(n_items)?;
        let item_row = alloc_u32(n_items)?;
        let item_weight = alloc_u32(n_items)?;
        let row_items = alloc_u32(n_items)?;
        let groups = alloc_u32(max_groups * std::mem::size_of::<ExpertGroup>() / 4)?;
        let plan_args = [
            int(rows, "rows")?,
            table,
            int(max_groups, "groups")?,
            ptr(&groups, s),
            ptr(&item_row, s),
            ptr(&item_weight, s),
            ptr(&row_items, s),
        ];
        let plan_separately = |this: &Self| -> Result<()> {
            let mut args = vec![
                ptr(&ids, s),
                ptr(&weights, s),
                int(rows, "rows")?,
                int(top_k, "top_k")?,
                int(n_experts, "experts")?,
            ];
            args.extend_from_slice(&plan_args[1..]);
            this.launch(&this.k.moe_plan, "moe plan", (1, 1, 1), 32, &args)
        };
        match spec {
            RouteSpec::SoftmaxTopK {
                renormalize, scale, ..
            } => {
                let route_args = [
                    ptr(&logits.buf, s),
                    int(n_experts, "experts")?,
                    int(top_k, "top_k")?,
                    u64::from(renormalize),
                    float(scale),
                    ptr(&ids, s),
                    ptr(&weights, s),
                ];
                if rows <= ROUTE_PLAN_MAX_ROWS {
                    // Few rows: routing and work list in one launch.
                    let args: Vec<u64> = route_args.iter().chain(&plan_args).copied().collect();
                    self.launch(
                        &self.k.route_plan,
                        "route + plan",
                        (1, 1, 1),
                        ROUTE_PLAN_THREADS,
                        &args,
                    )?;
                } else {
                    self.launch(
                        &self.k.route_topk,
                        "route top-k",
                        (rows as u32, 1, 1),
                        32,
                        &route_args,
                    )?;
                    plan_separately(self)?;
                }
            }
            RouteSpec::SparseMixer { jitter_eps } => {
                self.launch(
                    &self.k.route_sparse_mixer,
                    "route sparse mixer",
                    (rows as u32, 1, 1),
                    32,
                    &[
                        ptr(&logits.buf, s),
                        int(n_experts, "experts")?,
                        float(jitter_eps),
                        ptr(&ids, s),
                        ptr(&weights, s),
                    ],
                )?;
                plan_separately(self)?;
            }
        }
        if let Some(layer) = count_as {
            self.count_routes(ptr(&ids, s), n_items, layer)?;
        }
        let h = self.alloc(n_items, inter)?;
        let out = self.alloc(n_items, hidden)?;
        let launch = MoeLaunch {
            x: ptr(&x.buf, s),
            hidden,
            inter,
            groups: ptr(&groups, s),
            num_groups: max_groups,
            max_count: rows,
            item_row: ptr(&item_row, s),
            item_weight: ptr(&item_weight, s),
            items: n_items,
            h: ptr(&h.buf, s),
            out: ptr(&out.buf, s),
        };
        self.launch_moe(&launch, int4)?;
        let y = self.alloc(rows, hidden)?;
        self.launch(
            &self.k.moe_combine,
            "moe combine",
            (rows as u32, grid_for(hidden, ROW_THREADS), 1),
            ROW_THREADS,
            &[
                launch.out,
                ptr(&row_items, s),
                int(top_k, "top_k")?,
                int(hidden, "hidden")?,
                ptr(&y.buf, s),
            ],
        )?;
        Ok(y)
    }

    /// Adds `n` expert ids at device address `ids` to MoE layer `layer`'s routing counts, when
    /// counting is on.
    fn count_routes(&self, ids: u64, n: usize, layer: usize) -> Result<()> {
        let counts = self.lock(&self.route_counts)?;
        let Some(c) = counts.as_ref() else {
            return Ok(());
        };
        if layer >= c.moe_layers || n == 0 {
            return Ok(());
        }
        let row = ptr(&c.counts, &self.stream) + (4 * layer * c.experts) as u64;
        self.launch(
            &self.k.count_routes,
            "count routes",
            (1, 1, 1),
            128,
            &[ids, int(n, "items")?, row],
        )
    }

    /// Starts counting, per MoE layer and expert, the routings of passes whose hook asks for
    /// device counts (from zero). A buffer of another shape replaces the old one and drops every
    /// recorded pass (they may write to the old one).
    pub fn enable_route_counts(&self, moe_layers: usize, experts: usize) -> Result<()> {
        let same = self
            .lock(&self.route_counts)?
            .as_ref()
            .is_some_and(|c| c.moe_layers == moe_layers && c.experts == experts);
        if same {
            // Keep the buffer: recorded draft passes write to its address.
            return self.reset_route_counts();
        }
        let counts = guarded("cuda: cannot allocate routing counts", || {
            self.stream
                .alloc_zeros::<u32>((moe_layers * experts).max(1))
        })?;
        self.drop_recordings()?;
        *self.lock(&self.route_counts)? = Some(RouteCounts {
            counts,
            moe_layers,
            experts,
        });
        Ok(())
    }

    /// Sets every routing count to zero (ordered after the passes already issued).
    pub fn reset_route_counts(&self) -> Result<()> {
        let mut counts = self.lock(&self.route_counts)?;
        if let Some(c) = counts.as_mut() {
            guarded("cuda: cannot reset routing counts", || {
                self.stream.memset_zeros(&mut c.counts)
            })?;
        }
        Ok(())
    }

    /// The routing counts `[moe layers, experts]` so far (waits for the passes issued).
    pub fn route_counts(&self) -> Result<Vec<u32>> {
        self.synchronize()?;
        let counts = self.lock(&self.route_counts)?;
        let Some(c) = counts.as_ref() else {
            return Err(Error::Request(
                "routing counts were never enabled on this backend".into(),
            ));
        };
        let mut host = vec![0u32; c.moe_layers * c.experts];
        if !host.is_empty() {
            let view = c.counts.slice(..host.len());
            guarded("cuda: routing counts device-to-host copy failed", || {
                self.stream.memcpy_dtoh(&view, &mut host)
            })?;
            guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        }
        Ok(host)
    }

    pub(crate) fn upload_groups(&self, groups: &[ExpertGroup]) -> Result<CudaSlice<u32>> {
        let words: &[u32] = bytemuck::cast_slice(groups);
        self.upload_u32(words)
    }

    /// Buffers freed while kernels may still read them: with stream-ordered allocation
    /// (cuMemFreeAsync on this stream) the free itself is ordered after those kernels.
    pub(crate) fn defer_free<T>(&self, buf: CudaSlice<T>) {
        drop(buf);
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn launch_moe(&self, l: &MoeLaunch, int4: bool) -> Result<()> {
        if int4 {
            self.launch_moe_int4(l)
        } else {
            self.launch_moe_f16(l)
        }
    }

    fn launch_moe_int4(&self, l: &MoeLaunch) -> Result<()> {
        self.int4.launch(&self.stream, l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up_by_at_most_an_eighth() {
        for n in [
            1usize,
            255,
            256,
            257,
            1000,
            4096,
            4097,
            100_000,
            102_400 * 17,
        ] {
            let b = bucket(n);
            assert!(b >= n, "{n} -> {b}");
            assert!(
                n <= 256 || (b - n) * 8 <= n,
                "{n} -> {b} wastes more than an eighth"
            );
            assert_eq!(bucket(b), b, "a bucket size is its own bucket");
        }
    }

    #[test]
    fn the_work_list_groups_rows_by_ascending_expert() {
        // 3 rows, top 2: row 0 -> experts 4, 1; row 1 -> 1, 0; row 2 -> 4, 0.
        let routing = Routing {
            top_k: 2,
            ids: vec![4, 1, 1, 0, 4, 0],
            weights: vec![0.6, 0.4, 0.7, 0.3, 0.9, 0.1],
        };
        let plan = MoePlan::new(&routing, 6);
        assert_eq!(plan.hit, vec![0, 1, 4]);
        assert_eq!(plan.starts, vec![0, 2, 4, 6]);
        // Each expert's items in ascending row order.
        assert_eq!(plan.item_row, vec![1, 2, 0, 1, 0, 2]);
        assert_eq!(plan.item_weight, vec![0.3, 0.1, 0.4, 0.7, 0.6, 0.9]);
        // Each row's items in ascending expert id: row 0 has expert 1 (item 2) then 4 (item 4).
        assert_eq!(plan.row_items, vec![2, 4, 0, 3, 1, 5]);
        assert_eq!(plan.range(2), (4, 2));
        assert_eq!(plan.max_count(), 2);
    }
}
