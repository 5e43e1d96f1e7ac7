//! [`CudaBackend`]: the forward pass's ops on an NVIDIA GPU.
//!
//! Activations are f32 and weights FP16 (INT4 for the draft's experts), as on the CPU reference,
//! so the two agree to rounding. Every kernel computes a row's outputs with code that does not
//! depend on how many rows the launch holds, which keeps the exactness contract of
//! [`Backend`]: a verification window gives the same bits as decoding its rows one by one, and
//! speculative decoding on the GPU is lossless.
//!
//! Routed experts are either uploaded with the other weights (all resident) or kept in the
//! bundle's mapping and copied on demand into per-layer slots (see [`crate::backend::cuda::offload`]).

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaSlice, CudaStream};
use half::f16;

use crate::backend::cuda::graphs;
use crate::backend::cuda::moe::experts::ExpertGroup;
use crate::backend::cuda::moe::int4::MoeInt4Kernels;
use crate::backend::cuda::moe::rows::MoeRowsKernels;
use crate::backend::cuda::offload::slots::{ExpertOffload, HostExpertsConfig, OffloadConfig};
use crate::backend::cuda::ops::rope::RopeTableGpu;
use crate::backend::cuda::options::LaunchRule;
use crate::backend::cuda::runtime::act::{GpuAct, GpuWeight};
use crate::backend::cuda::runtime::args::*;
use crate::backend::cuda::runtime::driver::{guarded, launch_kernel, LaunchMode, NO_CLUSTER};
use crate::backend::cuda::runtime::host::PinnedBuffer;
use crate::backend::cuda::runtime::kernels::*;
use crate::backend::cuda::runtime::load::{LoadIo, LoadReport, PendingLoad};
use crate::backend::cuda::runtime::pool::{
    bucket, default_mem_pool, pool_attribute, BufferPool, MemPool, PooledBuf,
};
use crate::backend::cuda::{CudaDevice, CudaOptions};
use crate::offload::OffloadStats;
use crate::{Error, Result};

/// Host time spent issuing work versus waiting for the device, split at every synchronisation.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct HostTiming {
    /// Seconds between synchronisations spent issuing work (the host's share of a step).
    pub issue_seconds: f64,
    /// Seconds spent waiting in synchronisations (the device's share beyond the host's).
    pub wait_seconds: f64,
    pub synchronisations: u64,
}

/// Device routing counts (see [`CudaBackend::enable_route_counts`]).
pub(super) struct RouteCounts {
    pub(super) counts: CudaSlice<u32>,
    pub(super) moe_layers: usize,
    pub(super) experts: usize,
}

/// The host copy of an expert pointer table and its device upload.
pub(super) type ExpertTable = (Vec<ExpertGroup>, CudaSlice<u32>);

/// The CUDA backend: one device, one compute stream, and optionally the expert cache.
pub struct CudaBackend {
    pub(super) dev: Arc<CudaDevice>,
    pub(super) stream: Arc<CudaStream>,
    /// The device's default memory pool, which every allocation here comes from.
    pub(super) pool: MemPool,
    pub(super) k: Kernels,
    pub(super) int4: MoeInt4Kernels,
    /// The row-layout expert kernels (8-, 3- and 2-bit).
    pub(super) rows: MoeRowsKernels,
    pub(super) rope_table: Mutex<Option<RopeTableGpu>>,
    /// Per expert list (keyed by its address), the device table of its experts' weight pointers
    /// and the host copy it was built from (compared on every use, so a stale entry is rebuilt).
    pub(super) expert_tables: Mutex<std::collections::HashMap<usize, ExpertTable>>,
    pub(super) offload: Option<Mutex<ExpertOffload>>,
    pub(super) buffers: Arc<BufferPool>,
    /// Routing counts `[moe layers, experts]` of passes whose hook counts them on the device.
    pub(super) route_counts: Mutex<Option<RouteCounts>>,
    /// Recorded forward passes (src/backend/cuda/graphs/mod.rs).
    pub(super) steps: Mutex<graphs::StepGraphs>,
    /// Allocates buffers while the compute stream is being captured, outside the recording.
    pub(super) side_stream: Arc<CudaStream>,
    pub(super) timing: Mutex<(HostTiming, Option<std::time::Instant>)>,
    /// How weights are read at load time, the uploads deferred until `finish_load`, and what the
    /// last batched upload did.
    pub(super) load_io: LoadIo,
    /// Threads that read weights at load time (`None`: the cores, at most 8).
    pub(super) load_threads: Option<usize>,
    pub(super) pending: Mutex<Option<PendingLoad>>,
    pub(super) load_report: Mutex<Option<LoadReport>>,
    /// How each launch starts: overlapping the tail of the kernel before it where the device is
    /// sm_90 or newer (not with [`CudaOptions::plain`]).
    pub(super) launches: LaunchRule,
    /// Thread block clusters: the device is sm_90 or newer (not with [`CudaOptions::plain`]).
    pub(super) clusters: bool,
    /// The fused forms of op sequences (the shared experts in the routed experts' launches, a
    /// one-row layer's FP16 experts in one launch, a one-row step's add + norm + products and
    /// MLA cache append): not with [`CudaOptions::plain`].
    pub(super) fused: bool,
    /// `moe_f16_experts_1`'s counters: `EXPERTS_ONE_SLOTS` slots, zero between launches
    /// (kernels/gemv_f16.cu), and the slot the next launch takes.
    pub(super) experts_counters: CudaSlice<u32>,
    pub(super) experts_slot: std::sync::atomic::AtomicUsize,
    /// A prompt pass is running ([`crate::backend::Backend::prompt_pass`]): dense products of
    /// many rows run on tensor cores.
    pub(super) prompt_pass: std::sync::atomic::AtomicBool,
    /// `attention`'s per-(row, head) chunk counts, zero between launches (kernels/attention.cu):
    /// calls of at most `ATT_COUNTERS` (row, head) pairs combine in the same launch.
    pub(super) attention_counters: CudaSlice<u32>,
    /// `argmax_rows`' per-row merge keys and tickets (`ARGMAX_ROWS` of each), zero between
    /// launches (kernels/ops.cu).
    pub(super) argmax_keys: CudaSlice<u64>,
    pub(super) argmax_counts: CudaSlice<u32>,
    /// Page-locked landing space for reads to the host (src/backend/cuda/moe/mod.rs `read_back`):
    /// several activations arrive with one wait for the device.
    pub(super) readback: Mutex<Option<PinnedBuffer>>,
    /// Marks a read-back's copies done, so work issued after them (the shared experts of an
    /// offloaded layer) runs while the host waits only for the copies.
    pub(super) readback_done: cudarc::driver::CudaEvent,
    /// Page-locked outputs of the host expert kernel, copied up asynchronously.
    pub(super) host_outputs: Mutex<Option<PinnedBuffer>>,
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
        // cross-stream use is ordered by explicit events (src/backend/cuda/offload/slots.rs).
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
        let hopper = dev.compute_capability().0 >= 9;
        let launches = LaunchRule::new(hopper && !options.plain);
        let int4 = MoeInt4Kernels::new(&dev)?.launching(launches.clone());
        let rows = MoeRowsKernels::new(&dev)?.launching(launches.clone());
        let clusters = hopper && !options.plain;
        let offload = offload
            .map(|cfg| ExpertOffload::new(&dev, cfg).map(Mutex::new))
            .transpose()?;
        let side_stream = guarded("cannot create a CUDA stream", || dev.context().new_stream())?;
        let params = guarded("cuda: cannot allocate the step buffer", || {
            stream.alloc_zeros::<u32>(graphs::PARAM_WORDS)
        })?;
        let attention_counters = guarded("cuda: cannot allocate the attention counters", || {
            stream.alloc_zeros::<u32>(ATT_COUNTERS)
        })?;
        let (argmax_keys, argmax_counts) =
            guarded("cuda: cannot allocate the argmax scratch", || {
                Ok((
                    stream.alloc_zeros::<u64>(ARGMAX_ROWS)?,
                    stream.alloc_zeros::<u32>(ARGMAX_ROWS)?,
                ))
            })?;
        let experts_counters = guarded("cuda: cannot allocate the MoE launch counters", || {
            stream.alloc_zeros::<u32>(EXPERTS_ONE_SLOTS * EXPERTS_ONE_SLOT_WORDS)
        })?;
        let readback_done = guarded("cuda: cannot create an event", || {
            dev.context().new_event(None)
        })?;
        Ok(CudaBackend {
            dev,
            stream,
            pool,
            k,
            int4,
            rows,
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
            launches,
            clusters,
            fused: !options.plain,
            experts_counters,
            experts_slot: std::sync::atomic::AtomicUsize::new(0),
            prompt_pass: std::sync::atomic::AtomicBool::new(false),
            attention_counters,
            argmax_keys,
            argmax_counts,
            readback: Mutex::new(None),
            readback_done,
            host_outputs: Mutex::new(None),
        })
    }

    /// Measurement only: leaves the launches `measure` names out of every pass or starts them
    /// late (see [`crate::backend::cuda::MeasureOptions`]).
    #[cfg(feature = "measure")]
    pub fn measuring(mut self, measure: crate::backend::cuda::MeasureOptions) -> Self {
        self.launches = self.launches.clone().measuring(measure);
        self.int4.set_launches(self.launches.clone());
        self.rows.set_launches(self.launches.clone());
        self
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
    pub(super) fn deferred_alloc<T: cudarc::driver::DeviceRepr>(
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

    /// Turns the host path for missing experts on (`Some`: threads and first rate estimates) or
    /// off between generations; refused without offloaded experts. The cache keeps its residency.
    pub fn set_host_experts(&self, host: Option<HostExpertsConfig>) -> Result<()> {
        match &self.offload {
            Some(o) => {
                self.synchronize()?;
                self.lock(o)?.set_host(host)
            }
            None if host.is_none() => Ok(()),
            None => Err(Error::Request(
                "the host path computes offloaded experts: it needs --resident-experts (or a \
                 VRAM budget) below every expert"
                    .into(),
            )),
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
        self.wait_timed(|| self.stream.synchronize())
    }

    /// Runs `wait` (a wait for the device) and counts its time as the host's wait, the time
    /// since the last wait as the host's issue time.
    pub(super) fn wait_timed(
        &self,
        wait: impl FnOnce() -> std::result::Result<(), cudarc::driver::DriverError>,
    ) -> Result<()> {
        let issued = std::time::Instant::now();
        guarded("cuStreamSynchronize", wait)?;
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

    /// Launches `argmax_rows` over `x`, each row's index into the u32 at `out` + 4 * row (a
    /// device address). The merge keys and tickets hold ARGMAX_ROWS rows: larger calls go in
    /// batches.
    pub(super) fn launch_argmax(&self, x: &GpuAct, out: u64) -> Result<()> {
        let s = &self.stream;
        let chunks = x.cols.div_ceil(ARGMAX_CHUNK) as u32;
        for first in (0..x.rows).step_by(ARGMAX_ROWS) {
            let rows = (x.rows - first).min(ARGMAX_ROWS);
            let args = ArgmaxArgs {
                x: DevPtr(ptr(&x.buf, s) + (4 * first * x.cols) as u64),
                cols: int(x.cols, "cols")?,
                keys: dptr(&self.argmax_keys, s),
                counts: dptr(&self.argmax_counts, s),
                out: DevPtr(out + (4 * first) as u64),
            };
            self.launch(
                &self.k.argmax,
                "argmax",
                (chunks, rows as u32, 1),
                ROW_THREADS,
                args,
            )?;
        }
        Ok(())
    }

    pub(super) fn lock<'a, T>(&self, m: &'a Mutex<T>) -> Result<std::sync::MutexGuard<'a, T>> {
        m.lock()
            .map_err(|_| Error::Backend("cuda: a lock was poisoned by an earlier panic".into()))
    }

    pub(super) fn launch<A: KernelArgs>(
        &self,
        k: &Kernel<A>,
        what: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: A,
    ) -> Result<()> {
        self.launch_clustered(k, what, grid, NO_CLUSTER, block, args)
    }

    /// [`launch`](Self::launch) in thread block clusters of `cluster` blocks ([`NO_CLUSTER`]:
    /// none; others only where [`CudaBackend::clusters`] holds, the grid a multiple of it).
    pub(super) fn launch_clustered<A: KernelArgs>(
        &self,
        k: &Kernel<A>,
        what: &str,
        grid: (u32, u32, u32),
        cluster: (u32, u32, u32),
        block: u32,
        mut args: A,
    ) -> Result<()> {
        let failed = |e: &dyn std::fmt::Display| {
            Error::Backend(format!("cuda {what}: kernel launch failed: {e}"))
        };
        let Some(overlap) = self.launches.overlap_for(what, grid.0) else {
            return Ok(());
        };
        // SAFETY: `args` are the arguments of `k`'s signature (its type says so, and
        // tests/kernels_compile.rs checks each struct against its kernels' PTX); pointers
        // address live device buffers of the sizes the kernel reads and writes (each caller's
        // shape checks); every kernel this launches waits in `spx_grid_wait` before it touches
        // anything an earlier kernel writes or reads, and takes no dynamic shared memory.
        unsafe {
            launch_kernel(
                &self.stream,
                &k.f,
                (grid, block, 0),
                &mut args.params(),
                LaunchMode { overlap, cluster },
            )
        }
        .map_err(|e| failed(&e))
    }

    pub(super) fn alloc(&self, rows: usize, cols: usize) -> Result<GpuAct> {
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

    pub(super) fn wrap(&self, slice: CudaSlice<f32>, rows: usize, cols: usize) -> GpuAct {
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

    pub(super) fn upload_u32(&self, data: &[u32]) -> Result<CudaSlice<u32>> {
        let data = if data.is_empty() { &[0u32][..] } else { data };
        guarded("cuda: host-to-device copy failed", || {
            self.stream.clone_htod(data)
        })
    }

    pub(super) fn f16_matrix<'w>(
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

    pub(super) fn f16_vector<'w>(
        &self,
        w: &'w GpuWeight,
        len: usize,
        op: &str,
    ) -> Result<&'w CudaSlice<f16>> {
        match w {
            GpuWeight::F16 { shape, buf, .. } if shape.iter().product::<usize>() == len => Ok(buf),
            other => Err(shape_err(
                op,
                format!("{} is not an FP16 vector of {len}", other.describe()),
            )),
        }
    }

    pub(super) fn elementwise_grid(n: usize) -> (u32, u32, u32) {
        (grid_for(n, 256).min(65_535), 1, 1)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Buffers allocated on the side stream are freed on it: let the compute stream's work
        // that may still use them finish first. Errors cannot be reported from here.
        let _ = self.stream.synchronize();
    }
}
