//! The expert cache in VRAM: `slots_per_layer` FP16 experts per MoE layer, filled from the
//! bundle's mapping on a dedicated copy stream.
//!
//! Host side: each layer's Experts section is registered with `cuMemHostRegister(READ_ONLY)`, so
//! an expert is one DMA straight from the page cache; where the driver refuses, blobs go through
//! two pinned staging buffers instead (and [`OffloadStats::path`] says so).
//!
//! Ordering: a batch's copies wait on the compute stream's "released" event of the last kernels
//! that read the slots being overwritten; the compute stream waits on the copies' "ready" event
//! before the kernels that read them. Timing events around each batch of copies give the copy
//! stream's busy time, hence the achieved bandwidth.

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use specter_format::Bundle;

use super::backend::{CudaBackend, MoePlan};
use super::device::guarded;
use super::experts::{ExpertGroup, MoeLaunch};
use super::host::{PinnedBuffer, RegisteredHost};
use super::CudaDevice;
use crate::arch::{expert_tensor_name, ArchConfig, Proj};
use crate::{Error, Result};

/// How slots are reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotPolicy {
    /// No reuse: every expert a pass needs is copied for that pass.
    OnDemand,
    /// Keep experts; evict the least recently used.
    Lru,
}

impl SlotPolicy {
    pub fn name(self) -> &'static str {
        match self {
            SlotPolicy::OnDemand => "ondemand",
            SlotPolicy::Lru => "lru",
        }
    }
}

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
    pub policy: SlotPolicy,
    pub host_path: HostPath,
}

/// Counters since the last reset.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct OffloadStats {
    pub policy: String,
    /// `registered-mmap` or `pinned-staging`.
    pub path: String,
    pub slots_per_layer: usize,
    /// Bytes of one slot (one expert's gate, up and down).
    pub slot_bytes: usize,
    /// VRAM held by all slots.
    pub slot_vram_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    pub bytes_copied: u64,
    /// Time the copy stream spent copying (device events), seconds.
    pub copy_seconds: f64,
    /// Experts copied ahead of the verify pass by the draft-driven plan.
    pub prefetched: u64,
    /// Of those, the ones a target pass then used.
    pub prefetch_used: u64,
    /// Distinct experts target passes needed (summed over passes and layers) ...
    pub target_needed: u64,
    /// ... and how many of them the current plan held.
    pub target_planned: u64,
    /// Bytes copied by prefetches (the rest of `bytes_copied` were demand loads).
    pub prefetch_bytes: u64,
    /// Copy-stream time of the prefetches, seconds.
    pub prefetch_copy_seconds: f64,
    /// Of that, the time before the verify pass that followed started on the compute stream:
    /// copy time hidden behind drafting (device events; needs [`ExpertOffload::mark_verify`]).
    pub prefetch_hidden_seconds: f64,
    /// Seconds the background registration of the expert sections took (0 until it is done, and
    /// without registration); copies go through staging until then.
    pub registration_seconds: f64,
    /// Target-pass hits and misses per model layer (0 for layers without routed experts).
    pub layer_hits: Vec<u64>,
    pub layer_misses: Vec<u64>,
}

impl OffloadStats {
    /// Prefetched experts that were used, over those prefetched.
    pub fn prefetch_precision(&self) -> f64 {
        ratio(self.prefetch_used, self.prefetched)
    }

    /// Experts target passes needed that the plan held, over those needed.
    pub fn prefetch_recall(&self) -> f64 {
        ratio(self.target_planned, self.target_needed)
    }

    /// Hit rate of each MoE layer (layers without lookups are left out), in layer order.
    pub fn layer_hit_rates(&self) -> Vec<f64> {
        self.layer_hits
            .iter()
            .zip(&self.layer_misses)
            .filter(|(h, m)| **h + **m > 0)
            .map(|(&h, &m)| h as f64 / (h + m) as f64)
            .collect()
    }

    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }

    /// Bytes per second while the copy stream was busy.
    pub fn copy_bandwidth(&self) -> f64 {
        if self.copy_seconds > 0.0 {
            self.bytes_copied as f64 / self.copy_seconds
        } else {
            0.0
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Where one expert's tensors sit inside its blob.
#[derive(Clone, Copy, Debug)]
struct BlobLayout {
    /// Offset of the blob in the file.
    file_offset: usize,
    gate: usize,
    up: usize,
    down: usize,
}

struct LayerSlots {
    slots: CudaSlice<u8>,
    slot_expert: Vec<Option<u32>>,
    expert_slot: Vec<Option<usize>>,
    last_use: Vec<u64>,
    blobs: Vec<BlobLayout>,
    /// Recorded on the copy stream after a prefetch into the slot.
    slot_ready: Vec<CudaEvent>,
    /// A prefetch into the slot may still be in flight: compute waits on `slot_ready` first.
    slot_pending: Vec<bool>,
    /// Held by the current plan: not evicted by demand loads or later prefetches of the window.
    planned: Vec<bool>,
    /// Prefetched and not used yet.
    unused_prefetch: Vec<bool>,
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
    policy: SlotPolicy,
    slots_per_layer: usize,
    inter: usize,
    /// Bytes of one projection matrix (`inter * hidden` halves).
    matrix_bytes: usize,
    slot_bytes: usize,
    /// Indexed by model layer; `None` for dense layers.
    layers: Vec<Option<LayerSlots>>,
    copy_stream: Arc<CudaStream>,
    ready: CudaEvent,
    released: CudaEvent,
    /// Copy batches to time: start, end, and whether it was a prefetch.
    timings: Vec<(CudaEvent, CudaEvent, bool)>,
    /// Per prefetch timing (by index into `timings`), the start of the verify pass after it.
    verify_marks: Vec<(usize, Arc<CudaEvent>)>,
    /// Prefetch timings not yet followed by a verify mark.
    unmarked: Vec<usize>,
    stats: OffloadStats,
    tick: u64,
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
        let matrix_bytes = 2 * hidden * inter;
        let slot_bytes = 3 * matrix_bytes;
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
        for &l in &moe_layers {
            let mut blobs = Vec::with_capacity(experts);
            for e in 0..experts {
                let blob = cfg
                    .bundle
                    .expert_blob(l as u32, e as u32)
                    .map_err(|err| Error::Model(format!("offload: layer {l} expert {e}: {err}")))?;
                let start = blob.as_ptr() as usize;
                let offset_of = |proj: Proj, shape: [usize; 2]| -> Result<usize> {
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
                blobs.push(BlobLayout {
                    file_offset: start - base,
                    gate: offset_of(Proj::Gate, [inter, hidden])?,
                    up: offset_of(Proj::Up, [inter, hidden])?,
                    down: offset_of(Proj::Down, [hidden, inter])?,
                });
            }
            let lo = blobs.iter().map(|b| b.file_offset).min().unwrap_or(0);
            let hi = blobs
                .iter()
                .map(|b| b.file_offset + b.down + matrix_bytes)
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
                slots,
                slot_expert: vec![None; cfg.slots_per_layer],
                expert_slot: vec![None; experts],
                last_use: vec![0; cfg.slots_per_layer],
                blobs,
                slot_ready: (0..cfg.slots_per_layer)
                    .map(|_| event(false))
                    .collect::<Result<_>>()?,
                slot_pending: vec![false; cfg.slots_per_layer],
                planned: vec![false; cfg.slots_per_layer],
                unused_prefetch: vec![false; cfg.slots_per_layer],
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
        let path = "pinned-staging";
        let staging = vec![dev.alloc_pinned(slot_bytes)?, dev.alloc_pinned(slot_bytes)?];
        let stats = OffloadStats {
            policy: cfg.policy.name().to_string(),
            path: path.to_string(),
            slots_per_layer: cfg.slots_per_layer,
            slot_bytes,
            slot_vram_bytes: need,
            layer_hits: vec![0; arch.num_layers],
            layer_misses: vec![0; arch.num_layers],
            ..Default::default()
        };
        Ok(ExpertOffload {
            registrations,
            registering,
            staging,
            next_staging: 0,
            bundle: cfg.bundle,
            policy: cfg.policy,
            slots_per_layer: cfg.slots_per_layer,
            inter,
            matrix_bytes,
            slot_bytes,
            layers,
            copy_stream,
            ready: event(false)?,
            released: event(false)?,
            timings: Vec::new(),
            verify_marks: Vec::new(),
            unmarked: Vec::new(),
            stats,
            tick: 0,
        })
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
        format!(
            "{} of {} experts per layer in VRAM ({} policy, {:.1} MB slots, copies from {})",
            self.slots_per_layer,
            self.layers
                .iter()
                .flatten()
                .next()
                .map_or(0, |l| l.blobs.len()),
            self.policy.name(),
            self.slot_bytes as f64 / 1e6,
            self.stats.path
        )
    }

    /// Empties every slot and clears the counters.
    pub(crate) fn reset(&mut self) {
        for l in self.layers.iter_mut().flatten() {
            l.slot_expert.iter_mut().for_each(|s| *s = None);
            l.expert_slot.iter_mut().for_each(|s| *s = None);
            l.last_use.iter_mut().for_each(|t| *t = 0);
            l.planned.iter_mut().for_each(|p| *p = false);
            l.unused_prefetch.iter_mut().for_each(|p| *p = false);
        }
        self.timings.clear();
        self.verify_marks.clear();
        self.unmarked.clear();
        let keep = OffloadStats {
            policy: self.stats.policy.clone(),
            path: self.stats.path.clone(),
            slots_per_layer: self.stats.slots_per_layer,
            slot_bytes: self.stats.slot_bytes,
            slot_vram_bytes: self.stats.slot_vram_bytes,
            registration_seconds: self.stats.registration_seconds,
            layer_hits: vec![0; self.stats.layer_hits.len()],
            layer_misses: vec![0; self.stats.layer_misses.len()],
            ..Default::default()
        };
        self.stats = keep;
        self.tick = 0;
    }

    /// Bytes issued to the copy stream since the last reset (counted at issue: no wait).
    pub(crate) fn bytes_copied(&self) -> u64 {
        self.stats.bytes_copied
    }

    pub(crate) fn stats(&mut self) -> Result<OffloadStats> {
        let marks: std::collections::HashMap<usize, Arc<CudaEvent>> =
            self.verify_marks.drain(..).collect();
        for (i, (start, end, prefetch)) in self.timings.drain(..).enumerate() {
            let ms = guarded("cuEventElapsedTime", || start.elapsed_ms(&end))?;
            self.stats.copy_seconds += ms as f64 / 1e3;
            if prefetch {
                self.stats.prefetch_copy_seconds += ms as f64 / 1e3;
                if let Some(verify) = marks.get(&i) {
                    // The part of the copy before the verify pass began: [0, copy time].
                    let before = guarded("cuEventElapsedTime", || start.elapsed_ms(verify))?;
                    self.stats.prefetch_hidden_seconds += before.clamp(0.0, ms) as f64 / 1e3;
                }
            }
        }
        self.unmarked.clear();
        Ok(self.stats.clone())
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

    /// Runs the routed experts of one layer: resident ones first, then the missing ones once
    /// their copies land. When a pass needs more experts than there are slots, it runs in
    /// rounds of at most `slots_per_layer` experts.
    pub(crate) fn run_layer(
        &mut self,
        be: &CudaBackend,
        layer: usize,
        plan: &MoePlan,
        launch: &mut MoeLaunch,
    ) -> Result<()> {
        let stream = be.stream().clone();
        let slots_n = self.slots_per_layer;
        if self.policy == SlotPolicy::OnDemand {
            let l = self.layer_mut(layer)?;
            l.slot_expert.iter_mut().for_each(|s| *s = None);
            l.expert_slot.iter_mut().for_each(|s| *s = None);
        }
        let mut pending: Vec<usize> = (0..plan.hit.len()).collect();
        let mut used_prefetches = 0u64;
        let mut planned_hits = 0u64;
        self.stats.target_needed += plan.hit.len() as u64;
        while !pending.is_empty() {
            self.tick += 1;
            let tick = self.tick;
            // This round: hits first (they need no slot), then misses while slots remain.
            let mut hits = Vec::new();
            let mut misses = Vec::new();
            let mut used = vec![false; slots_n];
            let mut rest = Vec::new();
            {
                let l = self.layer_mut(layer)?;
                for &g in &pending {
                    let e = plan.hit[g] as usize;
                    match l.expert_slot[e] {
                        Some(s) if !used[s] => {
                            used[s] = true;
                            l.last_use[s] = tick;
                            hits.push((g, s));
                        }
                        _ => rest.push(g),
                    }
                }
                for &(_, s) in &hits {
                    if l.slot_pending[s] {
                        // A prefetch may still be landing in this slot.
                        guarded("cuStreamWaitEvent", || stream.wait(&l.slot_ready[s]))?;
                        l.slot_pending[s] = false;
                    }
                    if l.unused_prefetch[s] {
                        l.unused_prefetch[s] = false;
                        used_prefetches += 1;
                    }
                    if l.planned[s] {
                        planned_hits += 1;
                    }
                }
                let mut deferred = Vec::new();
                for g in rest {
                    let e = plan.hit[g] as usize;
                    // A free slot, else the least recently used one this round does not use.
                    let victim = (0..slots_n).filter(|&s| !used[s]).min_by_key(|&s| {
                        (l.planned[s], l.slot_expert[s].is_some(), l.last_use[s], s)
                    });
                    match victim {
                        Some(s) => {
                            if let Some(old) = l.slot_expert[s] {
                                l.expert_slot[old as usize] = None;
                            }
                            l.planned[s] = false;
                            l.unused_prefetch[s] = false;
                            l.slot_pending[s] = false;
                            l.slot_expert[s] = Some(e as u32);
                            l.expert_slot[e] = Some(s);
                            l.last_use[s] = tick;
                            used[s] = true;
                            misses.push((g, s));
                        }
                        None => deferred.push(g),
                    }
                }
                pending = deferred;
            }
            self.stats.hits += hits.len() as u64;
            self.stats.misses += misses.len() as u64;
            if let Some(n) = self.stats.layer_hits.get_mut(layer) {
                *n += hits.len() as u64;
            }
            if let Some(n) = self.stats.layer_misses.get_mut(layer) {
                *n += misses.len() as u64;
            }
            if !hits.is_empty() {
                self.launch_groups(be, layer, plan, &hits, launch)?;
            }
            if !misses.is_empty() {
                self.copy_in(layer, &misses, plan)?;
                guarded("cuStreamWaitEvent", || stream.wait(&self.ready))?;
                self.launch_groups(be, layer, plan, &misses, launch)?;
            }
            // Later copies into these slots wait for the kernels just issued.
            guarded("cuEventRecord", || self.released.record(&stream))?;
        }
        self.stats.prefetch_used += used_prefetches;
        self.stats.target_planned += planned_hits;
        Ok(())
    }

    /// Copies the planned experts of model layer `layer` that are not resident into slots not
    /// held by the plan, on the copy stream, and marks every planned expert protected until
    /// [`Self::clear_plans`]. Returns the bytes issued. The compute stream does not wait: a
    /// later pass that uses a slot waits on that slot's own event.
    pub(crate) fn prefetch(&mut self, layer: usize, experts: &[u32]) -> Result<usize> {
        let copy = self.copy_stream.clone();
        let slots_n = self.slots_per_layer;
        let mut chosen = Vec::new();
        {
            let l = self.layer_mut(layer)?;
            for &e in experts {
                let e = e as usize;
                if e >= l.expert_slot.len() {
                    return Err(Error::Request(format!("prefetch: expert {e} out of range")));
                }
                if let Some(s) = l.expert_slot[e] {
                    l.planned[s] = true;
                    continue;
                }
                let victim = (0..slots_n)
                    .filter(|&s| !l.planned[s])
                    .min_by_key(|&s| (l.slot_expert[s].is_some(), l.last_use[s], s));
                let Some(s) = victim else { break };
                if let Some(old) = l.slot_expert[s] {
                    l.expert_slot[old as usize] = None;
                }
                l.slot_expert[s] = Some(e as u32);
                l.expert_slot[e] = Some(s);
                l.planned[s] = true;
                l.unused_prefetch[s] = true;
                l.slot_pending[s] = true;
                chosen.push((e, s));
            }
        }
        if chosen.is_empty() {
            return Ok(0);
        }
        // The slots may still be read by kernels issued before now.
        guarded("cuStreamWaitEvent", || copy.wait(&self.released))?;
        let ctx = copy.context().clone();
        let timing = |_: ()| {
            guarded("cuEventCreate", || {
                ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            })
        };
        let (start, end) = (timing(())?, timing(())?);
        guarded("cuEventRecord", || start.record(&copy))?;
        let mb = self.matrix_bytes;
        for &(e, s) in &chosen {
            self.copy_expert(layer, e, s)?;
            let l = self.layer_mut(layer)?;
            guarded("cuEventRecord", || l.slot_ready[s].record(&copy))?;
            self.stats.bytes_copied += 3 * mb as u64;
            self.stats.prefetch_bytes += 3 * mb as u64;
            self.stats.prefetched += 1;
        }
        guarded("cuEventRecord", || end.record(&copy))?;
        self.unmarked.push(self.timings.len());
        self.timings.push((start, end, true));
        Ok(chosen.len() * 3 * mb)
    }

    /// Ends the current plan: its experts become ordinary LRU residents.
    pub(crate) fn clear_plans(&mut self) {
        for l in self.layers.iter_mut().flatten() {
            l.planned.iter_mut().for_each(|p| *p = false);
        }
    }

    pub(crate) fn slots_per_layer(&self) -> usize {
        self.slots_per_layer
    }

    /// One expert's blob into slot `slot` of `layer` (one DMA when its tensors are contiguous).
    fn copy_expert(&mut self, layer: usize, expert: usize, slot: usize) -> Result<()> {
        let mb = self.matrix_bytes;
        let blob = self.layer_mut(layer)?.blobs[expert];
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

    fn launch_groups(
        &self,
        be: &CudaBackend,
        layer: usize,
        plan: &MoePlan,
        chosen: &[(usize, usize)],
        launch: &mut MoeLaunch,
    ) -> Result<()> {
        let stream = be.stream();
        let mut groups = Vec::with_capacity(chosen.len());
        for &(g, s) in chosen {
            let base = self.slot_ptr(layer, s, stream)?;
            let (first, count) = plan.range(g);
            groups.push(ExpertGroup {
                gate_up: base,
                gate_up_scales: 0,
                down: base + 2 * self.matrix_bytes as u64,
                down_scales: 0,
                first,
                count,
            });
        }
        let d_groups = be.upload_groups(&groups)?;
        launch.groups = d_groups.device_ptr(stream).0;
        launch.num_groups = groups.len();
        launch.max_count = chosen
            .iter()
            .map(|&(g, _)| plan.range(g).1 as usize)
            .max()
            .unwrap_or(0);
        be.launch_moe(launch, false)?;
        be.defer_free(d_groups);
        Ok(())
    }

    /// Copies the chosen experts into their slots on the copy stream and records `ready`.
    fn copy_in(&mut self, layer: usize, chosen: &[(usize, usize)], plan: &MoePlan) -> Result<()> {
        let copy = self.copy_stream.clone();
        guarded("cuStreamWaitEvent", || copy.wait(&self.released))?;
        let ctx = copy.context().clone();
        let start = guarded("cuEventCreate", || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        })?;
        let end = guarded("cuEventCreate", || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        })?;
        guarded("cuEventRecord", || start.record(&copy))?;
        let mb = self.matrix_bytes;
        for &(g, s) in chosen {
            // Slot layout: gate, up (together the fused gate/up matrix), down.
            self.copy_expert(layer, plan.hit[g] as usize, s)?;
            self.stats.bytes_copied += 3 * mb as u64;
        }
        guarded("cuEventRecord", || end.record(&copy))?;
        guarded("cuEventRecord", || self.ready.record(&copy))?;
        self.timings.push((start, end, false));
        Ok(())
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
                self.stats.path = "registered-mmap".to_string();
                self.stats.registration_seconds = seconds;
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
        self.poll_registration(false);
        let copy = self.copy_stream.clone();
        let slot_bytes = self.slot_bytes;
        let at = slot * slot_bytes + dst;
        if !self.registrations.is_empty() {
            let (index, offset) = self.registration_of(src, len)?;
            let l = self
                .layers
                .get_mut(layer)
                .and_then(|l| l.as_mut())
                .ok_or_else(|| {
                    Error::Model(format!("offload: layer {layer} has no expert slots"))
                })?;
            let mut view = l.slots.slice_mut(at..at + len);
            return self.registrations[index].copy_to_device(
                offset..offset + len,
                &mut view,
                &copy,
            );
        }
        let bytes = &self.bundle.as_bytes()[src..src + len];
        let which = self.next_staging;
        self.next_staging = (which + 1) % self.staging.len();
        let buf = &mut self.staging[which];
        buf.as_mut_slice()?[..len].copy_from_slice(bytes);
        let l = self
            .layers
            .get_mut(layer)
            .and_then(|l| l.as_mut())
            .ok_or_else(|| Error::Model(format!("offload: layer {layer} has no expert slots")))?;
        let mut view = l.slots.slice_mut(at..at + len);
        self.staging[which].copy_to_device(0..len, &mut view, &copy)
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
