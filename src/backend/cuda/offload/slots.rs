//! The expert slots in VRAM: `slots_per_layer` FP16 experts per MoE layer, filled from the
//! bundle's mapping on a dedicated copy stream. Which expert goes into which slot is decided by
//! the cache policy shared with the simulator ([`ExpertCache`]); this file holds the slot memory,
//! the copies and the events that order them, and launches no compute kernel.
//!
//! Host side: each layer's Experts section is registered with `cuMemHostRegister(READ_ONLY)`, so
//! an expert is one DMA straight from the page cache; where the driver refuses, blobs go through
//! two pinned staging buffers instead (and [`OffloadStats::path`] says so).
//!
//! Ordering: a batch's copies wait on the compute stream's "released" event of the last kernels
//! that read the slots being overwritten; the compute stream waits on the copies' "ready" event
//! before the kernels that read them. Timing events around each batch of copies give the copy
//! stream's busy time, hence the achieved bandwidth; with a link pace they also enclose the pacing
//! kernels (src/backend/cuda/offload/pace.rs). An event on the compute stream just before it waits for a
//! demand batch gives the time it stalled for that batch.

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use specter_format::Bundle;

mod down_stage;
mod layout;

use crate::arch::{expert_tensor_name, ArchConfig, Proj};
use crate::backend::cuda::moe::experts::ExpertKind;
use crate::backend::cuda::offload::pace::LinkPace;
use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::runtime::host::{PinnedBuffer, RegisteredHost};
use crate::backend::cuda::CudaDevice;
use crate::host_experts::HostExperts;
use crate::offload::{
    ExpertCache, Hit, HostShare, HostSplit, InitialResidency, Load, OffloadStats, Policy,
    ResidencyConfig, Round,
};
use crate::quant::Bits;
use crate::{Error, Result};
use down_stage::DownStage;
use layout::{quantized_offsets, BlobLayout};
pub(crate) use layout::{InPlaceExpert, SlotLayout};

/// Where expert bytes are copied from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPath {
    /// Register the mapping read-only and DMA from it; fall back to staging if refused.
    Auto,
    /// Always copy through pinned staging buffers.
    PinnedStaging,
}

#[derive(Clone)]
pub struct OffloadConfig {
    pub bundle: Arc<Bundle>,
    pub config: ArchConfig,
    pub slots_per_layer: usize,
    /// The cache policy: [`Policy::Lru`], [`Policy::OnDemand`] or [`Policy::Specter`].
    pub policy: Policy,
    pub host_path: HostPath,
    /// Compute some missing experts on the host instead of copying them (see
    /// [`HostExpertsConfig`]); `None`: every miss is copied.
    pub host_experts: Option<HostExpertsConfig>,
    /// Hold expert copies to this many bytes per second, to emulate a slower link (see
    /// src/backend/cuda/offload/pace.rs); `None`: copies run at the link's own rate.
    pub link_pace_bytes_per_s: Option<f64>,
}

/// The host path for missing experts: its threads and the first estimates of both paths' rates
/// (the split then follows the measured ones).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostExpertsConfig {
    pub threads: usize,
    pub link_bytes_per_s: f64,
    pub host_bytes_per_s: f64,
    /// Whether one miss of a layer may be split between the paths (gate and up on the host,
    /// the down matrix copied).
    pub split: SplitExperts,
}

/// Splitting a miss between the host and the link (src/offload/placement.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitExperts {
    /// Whole experts only.
    Never,
    /// One miss a layer when the measured rates say it finishes sooner (the default).
    Measured,
    /// Checks only: every layer with a miss splits one of them, whatever the rates say.
    Always,
}

/// One timed batch of copies on the copy stream.
struct CopyBatch {
    start: CudaEvent,
    end: CudaEvent,
    bytes: usize,
    prefetch: bool,
    /// Demand batches: recorded on the compute stream just before it waits for the batch.
    arrive: Option<CudaEvent>,
}

struct LayerSlots {
    /// The layer's MoE index (the cache policy's layer numbering).
    moe_index: usize,
    slots: CudaSlice<u8>,
    blobs: Vec<BlobLayout>,
    /// Recorded on the copy stream after a prefetch into the slot.
    slot_ready: Vec<CudaEvent>,
    /// A prefetch into the slot may still be in flight: compute waits on `slot_ready` first.
    slot_pending: Vec<bool>,
}

/// The expert sections' registrations, made on a background thread, and how long they took.
type Registered = std::result::Result<(Vec<RegisteredHost<'static>>, f64), String>;

pub struct ExpertOffload {
    // Registrations refer to `bundle`'s mapping, so they are declared (and dropped) first.
    registrations: Vec<RegisteredHost<'static>>,
    /// The background registration, until it reports.
    registering: Option<std::sync::mpsc::Receiver<Registered>>,
    staging: Vec<PinnedBuffer>,
    next_staging: usize,
    bundle: Arc<Bundle>,
    /// Which expert is in which slot: the policy shared with the simulator.
    cache: ExpertCache,
    /// The host path for missing experts and the split between it and the link.
    host: Option<(Arc<HostExperts>, HostSplit)>,
    slots_per_layer: usize,
    inter: usize,
    /// Bytes of one FP16 projection matrix (`inter * hidden` halves): the host path's unit.
    matrix_bytes: usize,
    slot_bytes: usize,
    /// Where a slot holds its expert's tensors.
    layout: SlotLayout,
    /// Indexed by model layer; `None` for dense layers.
    layers: Vec<Option<LayerSlots>>,
    copy_stream: Arc<CudaStream>,
    ready: CudaEvent,
    released: CudaEvent,
    /// Copy batches to time, in issue order.
    timings: Vec<CopyBatch>,
    /// Batches of `timings` whose rate the host split has already learned.
    link_learned: usize,
    /// Holds copies to a set rate; `None`: unpaced.
    pace: Option<LinkPace>,
    /// Per prefetch timing (by index into `timings`), the start of the verify pass after it.
    verify_marks: Vec<(usize, Arc<CudaEvent>)>,
    /// Prefetch timings not yet followed by a verify mark.
    unmarked: Vec<usize>,
    /// `registered-mmap` or `pinned-staging`.
    path: &'static str,
    registration_seconds: f64,
    slot_vram_bytes: usize,
    /// Copy-stream times of the batches timed so far (see [`OffloadStats`]).
    copy_seconds: f64,
    prefetch_copy_seconds: f64,
    prefetch_hidden_seconds: f64,
    /// Compute-stream time spent waiting for demand batches (see [`OffloadStats`]).
    link_stall_seconds: f64,
    /// With the host path: the down matrix of a layer's split expert (gate and up computed on
    /// the host), copied outside the slots.
    down_stage: Option<DownStage>,
}

// SAFETY: the raw registrations and pinned buffers are only touched through `&mut self` (the
// backend holds this behind a Mutex); the driver objects are thread-safe.
unsafe impl Send for ExpertOffload {}

impl ExpertOffload {
    pub(crate) fn new(dev: &CudaDevice, cfg: OffloadConfig) -> Result<Self> {
        let arch = &cfg.config;
        let (hidden, inter) = arch.expert_dims();
        let experts = arch.moe.num_experts;
        if cfg.slots_per_layer == 0 || cfg.slots_per_layer > experts {
            return Err(Error::Request(format!(
                "--resident-experts {} must be in 1..={experts} (experts per layer) when offloading",
                cfg.slots_per_layer
            )));
        }
        if cfg.policy == Policy::AllResident {
            return Err(Error::Request(
                "the all-resident policy keeps every expert in VRAM: it takes no expert slots"
                    .into(),
            ));
        }
        let matrix_bytes = 2 * hidden * inter;
        let widths = crate::weights::WeightStore::expert_widths(cfg.bundle.as_ref())?;
        let kind = ExpertKind::of_target(widths.target);
        let first_layer = arch.moe_layers().first().copied().unwrap_or(0);
        let (slot_bytes, layout) = match kind {
            ExpertKind::F16 => (
                3 * matrix_bytes,
                SlotLayout {
                    kind,
                    gate_up: 0,
                    gate_up_scales: 0,
                    down: 2 * matrix_bytes as u64,
                    down_scales: 0,
                },
            ),
            _ => {
                let [gate_up, gate_up_scales, down, down_scales] =
                    quantized_offsets(&cfg.bundle, first_layer, 0)?;
                let len = cfg
                    .bundle
                    .expert_blob(first_layer as u32, 0)
                    .map_err(|err| Error::Model(format!("offload: layer {first_layer}: {err}")))?
                    .len();
                (
                    len,
                    SlotLayout {
                        kind,
                        gate_up,
                        gate_up_scales,
                        down,
                        down_scales,
                    },
                )
            }
        };
        let ctx = dev.context();
        let copy_stream = guarded("cannot create the expert copy stream", || ctx.new_stream())?;
        let event = |timing: bool| {
            let flags = if timing {
                sys::CUevent_flags::CU_EVENT_DEFAULT
            } else {
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
            };
            guarded("cuEventCreate", || ctx.new_event(Some(flags)))
        };
        let moe_layers = arch.moe_layers();
        let total_slots = moe_layers.len() * cfg.slots_per_layer;
        let need = total_slots * slot_bytes;
        let (free, _) = dev.memory_info()?;
        if need > free {
            return Err(Error::Request(format!(
                "{} expert slots per layer need {:.2} GB of VRAM for {} MoE layers, but only {:.2} GB is free: \
                 lower --resident-experts",
                cfg.slots_per_layer,
                need as f64 / 1e9,
                moe_layers.len(),
                free as f64 / 1e9
            )));
        }
        let mut layers: Vec<Option<LayerSlots>> = (0..arch.num_layers).map(|_| None).collect();
        let base = cfg.bundle.as_bytes().as_ptr() as usize;
        let mut sections: Vec<(usize, usize)> = Vec::new();
        for (moe_index, &l) in moe_layers.iter().enumerate() {
            let mut blobs = Vec::with_capacity(experts);
            for e in 0..experts {
                let blob = cfg
                    .bundle
                    .expert_blob(l as u32, e as u32)
                    .map_err(|err| Error::Model(format!("offload: layer {l} expert {e}: {err}")))?;
                let start = blob.as_ptr() as usize;
                let fp16 = |proj: Proj, shape: [usize; 2]| -> Result<usize> {
                    let name = expert_tensor_name(arch, l, e, proj);
                    let view = cfg.bundle.tensor(&name)?;
                    let p = view.bytes.as_ptr() as usize;
                    if view.shape != shape || p < start || p + view.bytes.len() > start + blob.len()
                    {
                        return Err(Error::Model(format!(
                            "offload: {name} {:?} is not a {shape:?} tensor inside its expert blob",
                            view.shape
                        )));
                    }
                    Ok(p - start)
                };
                let layout = match kind {
                    ExpertKind::F16 => BlobLayout {
                        file_offset: start - base,
                        gate: fp16(Proj::Gate, [inter, hidden])?,
                        up: fp16(Proj::Up, [inter, hidden])?,
                        down: fp16(Proj::Down, [hidden, inter])?,
                        len: blob.len(),
                    },
                    _ => {
                        // Copied whole: every blob of the layer must lay its tensors out alike.
                        let want = [
                            layout.gate_up,
                            layout.gate_up_scales,
                            layout.down,
                            layout.down_scales,
                        ];
                        if quantized_offsets(&cfg.bundle, l, e)? != want || blob.len() > slot_bytes
                        {
                            return Err(Error::Model(format!(
                                "offload: expert {e} of layer {l} does not lay out its quantized \
                                 tensors as expert 0 does, in at most {slot_bytes} bytes"
                            )));
                        }
                        BlobLayout {
                            file_offset: start - base,
                            gate: 0,
                            up: 0,
                            down: 0,
                            len: blob.len(),
                        }
                    }
                };
                blobs.push(layout);
            }
            let lo = blobs.iter().map(|b| b.file_offset).min().unwrap_or(0);
            let hi = blobs
                .iter()
                .map(|b| b.file_offset + b.len)
                .max()
                .unwrap_or(0);
            sections.push((lo, hi));
            let slots = guarded(
                &format!(
                    "cannot allocate {} expert slots of {slot_bytes} bytes for layer {l} (out of VRAM?)",
                    cfg.slots_per_layer
                ),
                || dev.stream().alloc_zeros::<u8>(cfg.slots_per_layer * slot_bytes),
            )?;
            layers[l] = Some(LayerSlots {
                moe_index,
                slots,
                blobs,
                slot_ready: (0..cfg.slots_per_layer)
                    .map(|_| event(false))
                    .collect::<Result<_>>()?,
                slot_pending: vec![false; cfg.slots_per_layer],
            });
        }
        // Registering tens of GB pins (and, from a cold cache, reads) every page: seconds. It
        // runs on another thread so the first token does not wait for it; copies go through the
        // pinned staging buffers until it reports (see `poll_registration`).
        let registering = if cfg.host_path == HostPath::Auto {
            let (tx, rx) = std::sync::mpsc::channel();
            let bundle = cfg.bundle.clone();
            let ctx = dev.context().clone();
            std::thread::Builder::new()
                .name("specter-register".into())
                .spawn(move || {
                    let started = std::time::Instant::now();
                    let mut regs = Vec::new();
                    let mut failure = None;
                    for &(lo, hi) in &sections {
                        // Registration works on whole pages; sections start on one.
                        let lo = lo & !4095;
                        let bytes = bundle.as_bytes();
                        // SAFETY: the slice borrows `bundle`'s mapping. This thread holds an Arc
                        // to it until the registrations are either dropped here (before `bundle`,
                        // declared earlier) or handed to the ExpertOffload, which keeps its own Arc
                        // and drops its registrations first.
                        let slice: &'static [u8] =
                            unsafe { std::mem::transmute::<&[u8], &'static [u8]>(&bytes[lo..hi]) };
                        match RegisteredHost::register_read_only(&ctx, slice) {
                            Ok(r) => regs.push(r),
                            Err(err) => {
                                failure = Some(err.to_string());
                                break;
                            }
                        }
                    }
                    let outcome = match failure {
                        None => Ok((regs, started.elapsed().as_secs_f64())),
                        Some(e) => {
                            drop(regs);
                            Err(e)
                        }
                    };
                    // The receiver is gone when the offload was dropped first: the
                    // registrations are then undone here.
                    let _ = tx.send(outcome);
                    drop(bundle);
                })
                .map_err(|e| {
                    Error::Backend(format!("cannot start the registration thread: {e}"))
                })?;
            Some(rx)
        } else {
            None
        };
        let registrations = Vec::new();
        let staging = vec![dev.alloc_pinned(slot_bytes)?, dev.alloc_pinned(slot_bytes)?];
        let pace = cfg
            .link_pace_bytes_per_s
            .map(|rate| LinkPace::new(dev, &copy_stream, rate))
            .transpose()?;
        let cache = ExpertCache::new(
            ResidencyConfig {
                num_moe_layers: moe_layers.len(),
                num_experts: experts,
                slots_per_layer: cfg.slots_per_layer,
                expert_bytes: slot_bytes,
                policy: cfg.policy,
            },
            &InitialResidency::Empty,
        )?;
        let mut offload = ExpertOffload {
            registrations,
            registering,
            staging,
            next_staging: 0,
            bundle: cfg.bundle,
            cache,
            host: None,
            slots_per_layer: cfg.slots_per_layer,
            inter,
            matrix_bytes,
            slot_bytes,
            layout,
            layers,
            copy_stream,
            ready: event(false)?,
            released: event(false)?,
            timings: Vec::new(),
            link_learned: 0,
            pace,
            verify_marks: Vec::new(),
            unmarked: Vec::new(),
            path: "pinned-staging",
            registration_seconds: 0.0,
            slot_vram_bytes: need,
            copy_seconds: 0.0,
            prefetch_copy_seconds: 0.0,
            prefetch_hidden_seconds: 0.0,
            link_stall_seconds: 0.0,
            down_stage: None,
        };
        offload.set_host(cfg.host_experts)?;
        Ok(offload)
    }

    /// Turns the host path on (its threads and first rate estimates) or off. The residency and
    /// the counters stay: `auto`'s calibration measures one session with and without it.
    pub(crate) fn set_host(&mut self, host: Option<HostExpertsConfig>) -> Result<()> {
        self.host = match host {
            Some(_)
                if !matches!(
                    self.layout.kind,
                    ExpertKind::F16 | ExpertKind::Rows(Bits::EIGHT) | ExpertKind::Rows(Bits::FOUR)
                ) =>
            {
                return Err(Error::Request(format!(
                    "--host-experts: the host path computes FP16, INT8 and INT4 target experts, \
                     not this bundle's {:?} (use --host-experts off)",
                    self.layout.kind
                )))
            }
            Some(h) if self.layout.kind != ExpertKind::F16 && h.split == SplitExperts::Always => {
                return Err(Error::Request(
                    "host experts: splitting an expert between the host and the GPU is for FP16 \
                     targets; a quantized target's host path takes whole experts"
                        .into(),
                ))
            }
            Some(h) => {
                self.check_in_place()?;
                // A quantized target's host path takes whole experts: no split, no down stage.
                if self.down_stage.is_none() && self.layout.kind == ExpertKind::F16 {
                    let ctx = self.copy_stream.context().clone();
                    let event = || guarded("cuEventCreate", || ctx.new_event(None));
                    let buf = guarded("cannot allocate the split expert's down matrix", || {
                        self.copy_stream.alloc_zeros::<u8>(self.matrix_bytes)
                    })?;
                    self.slot_vram_bytes += self.matrix_bytes;
                    self.down_stage = Some(DownStage {
                        buf,
                        ready: event()?,
                        read: event()?,
                        copy: None,
                        split: SplitExperts::Measured,
                    });
                }
                if let Some(stage) = &mut self.down_stage {
                    stage.split = h.split;
                }
                Some((
                    Arc::new(HostExperts::new(h.threads, None)?),
                    HostSplit::new(h.link_bytes_per_s, h.host_bytes_per_s),
                ))
            }
            None => None,
        };
        Ok(())
    }

    pub(crate) fn check_expert(&self, layer: usize, expert: usize) -> Result<()> {
        match self.layers.get(layer).and_then(|l| l.as_ref()) {
            Some(l) if expert < l.blobs.len() => Ok(()),
            _ => Err(Error::Model(format!(
                "offload: no FP16 blob for expert {expert} of layer {layer} in the bundle"
            ))),
        }
    }

    pub(crate) fn inter(&self, layer: usize) -> Result<usize> {
        self.check_expert(layer, 0)?;
        Ok(self.inter)
    }

    pub(crate) fn describe(&self) -> String {
        let host = match &self.host {
            Some((kernel, _)) => format!(
                "; part of the misses computed by {} host threads ({})",
                kernel.threads(),
                kernel.path().name()
            ),
            None => String::new(),
        };
        let pace = match &self.pace {
            Some(p) => format!(", paced to {:.1} GB/s", p.bytes_per_s() / 1e9),
            None => String::new(),
        };
        format!(
            "{} of {} experts per layer in VRAM ({} policy, {:.1} MB slots, copies from {}{pace}{host})",
            self.slots_per_layer,
            self.layers
                .iter()
                .flatten()
                .next()
                .map_or(0, |l| l.blobs.len()),
            self.cache.policy().name(),
            self.slot_bytes as f64 / 1e6,
            self.path
        )
    }

    /// Empties every slot and clears the counters.
    pub(crate) fn reset(&mut self) {
        self.cache.reset();
        for l in self.layers.iter_mut().flatten() {
            l.slot_pending.iter_mut().for_each(|p| *p = false);
        }
        self.timings.clear();
        self.link_learned = 0;
        self.verify_marks.clear();
        self.unmarked.clear();
        self.copy_seconds = 0.0;
        self.prefetch_copy_seconds = 0.0;
        self.prefetch_hidden_seconds = 0.0;
        self.link_stall_seconds = 0.0;
    }

    /// Bytes issued to the copy stream since the last reset (counted at issue: no wait).
    pub(crate) fn bytes_copied(&self) -> u64 {
        self.cache.stats().bytes_copied
    }

    pub(crate) fn stats(&mut self) -> Result<OffloadStats> {
        let marks: std::collections::HashMap<usize, Arc<CudaEvent>> =
            self.verify_marks.drain(..).collect();
        for (i, b) in self.timings.drain(..).enumerate() {
            let ms = guarded("cuEventElapsedTime", || b.start.elapsed_ms(&b.end))?;
            self.copy_seconds += ms as f64 / 1e3;
            if b.prefetch {
                self.prefetch_copy_seconds += ms as f64 / 1e3;
                if let Some(verify) = marks.get(&i) {
                    // The part of the copy before the verify pass began: [0, copy time].
                    let before = guarded("cuEventElapsedTime", || b.start.elapsed_ms(verify))?;
                    self.prefetch_hidden_seconds += before.clamp(0.0, ms) as f64 / 1e3;
                }
            }
            if let Some(arrive) = &b.arrive {
                // Negative when the batch had landed before compute got there: no stall.
                let waited = guarded("cuEventElapsedTime", || arrive.elapsed_ms(&b.end))?;
                self.link_stall_seconds += waited.max(0.0) as f64 / 1e3;
            }
        }
        self.link_learned = 0;
        self.unmarked.clear();
        let mut stats = self.cache.stats().clone();
        stats.path = self.path.to_string();
        stats.slot_vram_bytes = self.slot_vram_bytes;
        stats.registration_seconds = self.registration_seconds;
        stats.copy_seconds = self.copy_seconds;
        stats.prefetch_copy_seconds = self.prefetch_copy_seconds;
        stats.prefetch_hidden_seconds = self.prefetch_hidden_seconds;
        stats.link_stall_seconds = self.link_stall_seconds;
        Ok(stats)
    }

    /// Marks the start of a verify pass on `compute`: the prefetches issued since the last mark
    /// count as hidden up to this point.
    pub(crate) fn mark_verify(&mut self, compute: &CudaStream) -> Result<()> {
        if self.unmarked.is_empty() {
            return Ok(());
        }
        let ctx = compute.context().clone();
        let event = guarded("cuEventCreate", || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        })?;
        guarded("cuEventRecord", || event.record(compute))?;
        let event = Arc::new(event);
        for i in self.unmarked.drain(..) {
            self.verify_marks.push((i, event.clone()));
        }
        Ok(())
    }

    /// The cache policy's rounds for the experts (distinct, ascending) one target pass needs in
    /// model layer `layer`: see [`ExpertCache::serve`]. Without `host_allowed` the host path
    /// takes none of them (a pass whose GPU arithmetic the host kernel does not follow).
    pub(crate) fn serve(
        &mut self,
        layer: usize,
        experts: &[u32],
        rows: &[u32],
        host_allowed: bool,
    ) -> Result<Vec<Round>> {
        let moe_index = self.layer_mut(layer)?.moe_index;
        self.learn_link()?;
        let share = match &mut self.host {
            Some((_, split)) if host_allowed => {
                let misses = experts
                    .iter()
                    .filter(|&&e| !self.cache.is_resident(moe_index, e))
                    .count();
                let mode = self.down_stage.as_ref().map(|s| s.split);
                match mode {
                    Some(SplitExperts::Always) if misses > 0 => HostShare {
                        full: 0,
                        gate_up: 1,
                    },
                    _ => split
                        .place(
                            misses,
                            self.slot_bytes,
                            mode == Some(SplitExperts::Measured),
                        )
                        .leaving_room(misses, self.cache.empty_slots(moe_index)),
                }
            }
            _ => HostShare::default(),
        };
        self.cache.serve_placed(moe_index, experts, rows, share)
    }

    /// The host expert kernel, when missing experts may be computed on the host.
    pub(crate) fn host_kernel(&self) -> Option<Arc<HostExperts>> {
        self.host.as_ref().map(|(k, _)| k.clone())
    }

    /// With the host path: the split learns the link's rate from the copy batches that have
    /// finished since it last looked (event queries, no wait).
    fn learn_link(&mut self) -> Result<()> {
        let Some((_, split)) = &mut self.host else {
            return Ok(());
        };
        while let Some(b) = self.timings.get(self.link_learned) {
            if !guarded("cuEventQuery", || b.end.try_is_complete())? {
                break;
            }
            let ms = guarded("cuEventElapsedTime", || b.start.elapsed_ms(&b.end))?;
            split.record_link(b.bytes as u64, ms as f64 / 1e3);
            self.link_learned += 1;
        }
        Ok(())
    }

    /// The host computed `experts` whole experts and the gate and up of `halves` more in
    /// `seconds` (wall clock, inputs and outputs included): the split learns the host's rate.
    pub(crate) fn record_host(&mut self, experts: usize, halves: usize, seconds: f64) {
        let bytes = (experts * self.slot_bytes + halves * 2 * self.matrix_bytes) as u64;
        if let Some((_, split)) = &mut self.host {
            split.record_host(bytes, seconds);
        }
        self.cache.stats_mut().host_seconds += seconds;
    }

    /// The decode thread waited `seconds` (wall clock) for the host's expert work after it had
    /// issued all of the layer's GPU work.
    pub(crate) fn record_host_stall(&mut self, seconds: f64) {
        self.cache.stats_mut().host_stall_seconds += seconds.max(0.0);
    }

    /// The decode thread spent `dispatch` seconds before a host-served layer's host work and
    /// `finish` after it.
    pub(crate) fn record_host_serial(&mut self, dispatch: f64, finish: f64) {
        let stats = self.cache.stats_mut();
        stats.dispatch_seconds += dispatch.max(0.0);
        stats.finish_seconds += finish.max(0.0);
    }

    /// The decode thread waited `seconds` (wall clock) for a layer's routing to reach the host.
    pub(crate) fn record_route_wait(&mut self, seconds: f64) {
        self.cache.stats_mut().route_wait_seconds += seconds.max(0.0);
    }

    /// The slot pointers of a round's hits, in order; `compute` first waits for any prefetch
    /// still landing in those slots.
    pub(crate) fn hit_slots(
        &mut self,
        layer: usize,
        hits: &[Hit],
        compute: &CudaStream,
    ) -> Result<Vec<u64>> {
        let l = self.layer_mut(layer)?;
        for hit in hits {
            if std::mem::take(&mut l.slot_pending[hit.slot]) {
                guarded("cuStreamWaitEvent", || {
                    compute.wait(&l.slot_ready[hit.slot])
                })?;
            }
        }
        hits.iter()
            .map(|hit| self.slot_ptr(layer, hit.slot, compute))
            .collect()
    }

    /// Starts a timed batch of copies on `copy`, after the kernels that last read the slots:
    /// returns its start (recorded) and end (to record) events.
    fn begin_copy_batch(&self, copy: &CudaStream) -> Result<(CudaEvent, CudaEvent)> {
        guarded("cuStreamWaitEvent", || copy.wait(&self.released))?;
        let (start, end) = (timing_event(copy)?, timing_event(copy)?);
        guarded("cuEventRecord", || start.record(copy))?;
        if let Some(pace) = &self.pace {
            pace.begin(copy)?;
        }
        Ok((start, end))
    }

    /// With a pace: holds `copy` until the batch's first `bytes` have taken as long as the paced
    /// link would take for them.
    fn pace_to(&self, copy: &CudaStream, bytes: usize) -> Result<()> {
        match &self.pace {
            Some(pace) => pace.end(copy, bytes),
            None => Ok(()),
        }
    }

    /// Copies a round's loads into their slots on the copy stream, after the kernels that last
    /// read those slots; `compute` waits for the copies. Returns the slot pointers, in order.
    pub(crate) fn load_slots(
        &mut self,
        layer: usize,
        loads: &[Load],
        compute: &CudaStream,
    ) -> Result<Vec<u64>> {
        let copy = self.copy_stream.clone();
        let (start, end) = self.begin_copy_batch(&copy)?;
        for load in loads {
            // Slot layout: gate, up (together the fused gate/up matrix), down.
            self.layer_mut(layer)?.slot_pending[load.slot] = false;
            self.copy_expert(layer, load.expert as usize, load.slot)?;
        }
        let bytes = loads.len() * self.slot_bytes;
        self.pace_to(&copy, bytes)?;
        guarded("cuEventRecord", || end.record(&copy))?;
        guarded("cuEventRecord", || self.ready.record(&copy))?;
        let arrive = timing_event(compute)?;
        guarded("cuEventRecord", || arrive.record(compute))?;
        guarded("cuStreamWaitEvent", || compute.wait(&self.ready))?;
        self.timings.push(CopyBatch {
            start,
            end,
            bytes,
            prefetch: false,
            arrive: Some(arrive),
        });
        loads
            .iter()
            .map(|load| self.slot_ptr(layer, load.slot, compute))
            .collect()
    }

    /// Records that the kernels issued on `compute` so far are the last readers of the slots:
    /// later copies into them wait for this point.
    pub(crate) fn release(&mut self, compute: &CudaStream) -> Result<()> {
        guarded("cuEventRecord", || self.released.record(compute))
    }

    /// Bytes of one projection matrix in a slot; the down projection starts at twice this.
    /// Where every slot holds its expert's tensors.
    pub(crate) fn layout(&self) -> SlotLayout {
        self.layout
    }

    /// Takes `experts` (ranked, most wanted first) as the plan of model layer `layer`: the cache
    /// policy protects the resident ones and picks slots for the missing ones, which are copied
    /// on the copy stream. Returns the bytes issued. The compute stream does not wait: a later
    /// pass that uses a slot waits on that slot's own event.
    pub(crate) fn prefetch(&mut self, layer: usize, experts: &[u32]) -> Result<usize> {
        let copy = self.copy_stream.clone();
        let moe_index = self.layer_mut(layer)?.moe_index;
        let chosen = self.cache.prefetch(moe_index, experts)?;
        if chosen.is_empty() {
            return Ok(0);
        }
        // The slots may still be read by kernels issued before now.
        let (start, end) = self.begin_copy_batch(&copy)?;
        let mut bytes = 0;
        for load in &chosen {
            self.copy_expert(layer, load.expert as usize, load.slot)?;
            bytes += self.slot_bytes;
            // Paced, each expert lands when the slower link would have delivered it.
            self.pace_to(&copy, bytes)?;
            let l = self.layer_mut(layer)?;
            guarded("cuEventRecord", || l.slot_ready[load.slot].record(&copy))?;
            l.slot_pending[load.slot] = true;
        }
        guarded("cuEventRecord", || end.record(&copy))?;
        self.unmarked.push(self.timings.len());
        self.timings.push(CopyBatch {
            start,
            end,
            bytes,
            prefetch: true,
            arrive: None,
        });
        Ok(bytes)
    }

    /// Ends the current plan: its experts become ordinary LRU residents.
    pub(crate) fn clear_plans(&mut self) {
        self.cache.clear_plans();
    }

    pub(crate) fn slots_per_layer(&self) -> usize {
        self.slots_per_layer
    }

    /// One expert's blob into slot `slot` of `layer` (one DMA when its tensors are contiguous).
    fn copy_expert(&mut self, layer: usize, expert: usize, slot: usize) -> Result<()> {
        let mb = self.matrix_bytes;
        let blob = self.layer_mut(layer)?.blobs[expert];
        if self.layout.kind != ExpertKind::F16 {
            return self.copy_run(layer, slot, blob.file_offset, 0, blob.len);
        }
        let contiguous = blob.up == blob.gate + mb && blob.down == blob.up + mb;
        if contiguous {
            return self.copy_run(layer, slot, blob.file_offset + blob.gate, 0, 3 * mb);
        }
        for (src, dst) in [(blob.gate, 0), (blob.up, mb), (blob.down, 2 * mb)] {
            self.copy_run(layer, slot, blob.file_offset + src, dst, mb)?;
        }
        Ok(())
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut LayerSlots> {
        self.layers
            .get_mut(layer)
            .and_then(|l| l.as_mut())
            .ok_or_else(|| Error::Model(format!("offload: layer {layer} has no expert slots")))
    }

    fn slot_ptr(&self, layer: usize, slot: usize, stream: &CudaStream) -> Result<u64> {
        let l = self
            .layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| Error::Model(format!("offload: layer {layer} has no expert slots")))?;
        let (p, _sync) = l.slots.device_ptr(stream);
        Ok(p + (slot * self.slot_bytes) as u64)
    }

    /// Switches to direct copies from the registered mapping once the background registration
    /// has finished (or stays on staging if it failed); with `block`, waits for it first.
    pub(crate) fn poll_registration(&mut self, block: bool) {
        let Some(rx) = &self.registering else {
            return;
        };
        let outcome = if block {
            rx.recv().map_err(|_| ())
        } else {
            match rx.try_recv() {
                Ok(outcome) => Ok(outcome),
                Err(std::sync::mpsc::TryRecvError::Empty) => return,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => Err(()),
            }
        };
        self.registering = None;
        match outcome {
            Ok(Ok((regs, seconds))) => {
                tracing::info!("expert sections registered in {seconds:.3} s; copying from them");
                self.registrations = regs;
                self.path = "registered-mmap";
                self.registration_seconds = seconds;
            }
            Ok(Err(err)) => {
                tracing::warn!("expert offload: {err}; copying through pinned staging buffers");
            }
            Err(()) => tracing::warn!(
                "expert offload: the registration thread ended without a result; copying through pinned staging buffers"
            ),
        }
    }

    /// One host-to-device copy of `len` bytes at file offset `src` into slot `slot` + `dst`.
    fn copy_run(
        &mut self,
        layer: usize,
        slot: usize,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<()> {
        let at = slot * self.slot_bytes + dst;
        self.copy_bytes(src, len, Some((layer, at)))
    }

    /// Copies `len` bytes at file offset `src` on the copy stream: into `layer`'s slots at byte
    /// `at` (`into`), or to the start of the down stage (`None`).
    fn copy_bytes(&mut self, src: usize, len: usize, into: Option<(usize, usize)>) -> Result<()> {
        self.poll_registration(false);
        let copy = self.copy_stream.clone();
        let source = if self.registrations.is_empty() {
            let which = self.next_staging;
            self.next_staging = (which + 1) % self.staging.len();
            let bytes = &self.bundle.as_bytes()[src..src + len];
            self.staging[which].as_mut_slice()?[..len].copy_from_slice(bytes);
            Err(which)
        } else {
            Ok(self.registration_of(src, len)?)
        };
        let mut view = match into {
            Some((layer, at)) => self
                .layers
                .get_mut(layer)
                .and_then(|l| l.as_mut())
                .ok_or_else(|| Error::Model(format!("offload: layer {layer} has no expert slots")))?
                .slots
                .slice_mut(at..at + len),
            None => self
                .down_stage
                .as_mut()
                .ok_or_else(|| Error::Backend("offload: no down stage".into()))?
                .buf
                .slice_mut(0..len),
        };
        match source {
            Ok((index, offset)) => {
                self.registrations[index].copy_to_device(offset..offset + len, &mut view, &copy)
            }
            Err(which) => self.staging[which].copy_to_device(0..len, &mut view, &copy),
        }
    }

    /// The registration holding file bytes `src..src + len`, and the offset inside it.
    fn registration_of(&self, src: usize, len: usize) -> Result<(usize, usize)> {
        let base = self.bundle.as_bytes().as_ptr() as usize;
        for (i, r) in self.registrations.iter().enumerate() {
            let lo = r.as_slice().as_ptr() as usize - base;
            if src >= lo && src + len <= lo + r.len() {
                return Ok((i, src - lo));
            }
        }
        Err(Error::Backend(format!(
            "offload: file bytes {src}..{} lie outside every registered expert section",
            src + len
        )))
    }
}

/// An event that keeps time, for `stream`'s context.
fn timing_event(stream: &CudaStream) -> Result<CudaEvent> {
    let ctx = stream.context().clone();
    guarded("cuEventCreate", || {
        ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
    })
}
