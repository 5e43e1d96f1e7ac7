//! Recorded forward passes: a pass over a few tokens is captured once as a CUDA graph and then
//! replayed with new tokens and positions, which the host writes into one small device buffer
//! before each replay. A decode step is about 27 launches per layer; replaying them as one graph
//! removes the host's per-launch cost and the gaps between kernels on the device.
//!
//! A pass can be replayed only if nothing in its launches depends on the position or tokens
//! except through that buffer: while a step is active, the embedding reads its ids there, rope
//! its cos/sin, the KV-cache append and attention their start position; attention's score scratch
//! is sized for the whole cache. The rest (weights, the KV cache, activation buffers) is named by
//! the step's key or owned by the recording: every buffer allocated while capturing stays with
//! the graph, so no later op can reuse it.
//!
//! A key runs once op by op before it is captured (lazily built tables, such as the device expert
//! lists, are made outside the capture), and a capture that fails is run again op by op and never
//! retried. A pass that waits for the device midway (host routing, which the expert cache's
//! target passes need to decide their copies) is never captured: its first run notes the wait.
//! With an expert cache, the draft's passes (resident INT4 experts, routing counted on the
//! device) are recorded and the target's are not.

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph, CudaSlice};

use super::{CudaBackend, GpuAct, PooledBuf};
use crate::backend::{StepEnd, StepRequest, StepStart};
use crate::{Error, Result};

/// Most rows a recorded pass may have (decode steps and verification windows).
const MAX_ROWS: usize = 32;
/// Most rope frequencies (half the rotated width) a recorded pass may have.
const MAX_HALF: usize = 256;
/// Words of the step buffer: ids and positions, then cos and sin per row.
pub(super) const PARAM_WORDS: usize = 2 * MAX_ROWS + 2 * MAX_ROWS * MAX_HALF;
/// Recordings kept at most (least recently used dropped first).
const MAX_RECORDED: usize = 8;

/// Counters of the recorded-pass machinery, for reports.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct StepGraphStats {
    pub enabled: bool,
    /// Passes captured as graphs.
    pub captures: u64,
    /// Passes replayed from a graph.
    pub replays: u64,
    /// Captures that failed (those keys run op by op from then on).
    pub failures: u64,
}

/// A captured graph. cudarc's graph is not `Send`: it is only touched under the backend's lock.
struct Graph(CudaGraph);
// SAFETY: the graph and its executable are driver objects used from one thread at a time (every
// access holds `CudaBackend::steps`' lock), which is what the driver requires of them.
unsafe impl Send for Graph {}

struct Recorded {
    key: u64,
    graph: Graph,
    logits: GpuAct,
    /// Every buffer the recorded kernels use besides weights and the KV cache.
    _keep: Vec<Arc<PooledBuf>>,
    used: u64,
}

/// The step now running op by op, maybe being captured.
pub(super) struct ActiveStep {
    key: u64,
    pub start: usize,
    pub rows: usize,
    pub tokens: Vec<u32>,
    pub inv_freq: Vec<f32>,
    pub scales: Vec<f32>,
    pub capturing: bool,
    /// The pass waited for the device (host routing, say): it cannot be recorded.
    synced: bool,
    pub keep: Vec<Arc<PooledBuf>>,
}

/// Where the active step's inputs lie in the step buffer.
#[derive(Clone, Copy)]
pub(super) struct StepArgs {
    pub start: usize,
    pub rows: usize,
    pub ids: u64,
    pub positions: u64,
    pub cos: u64,
    pub sin: u64,
}

pub(super) struct StepGraphs {
    enabled: bool,
    /// The step buffer (see [`PARAM_WORDS`]).
    params: CudaSlice<u32>,
    warmed: HashSet<u64>,
    failed: HashSet<u64>,
    recorded: Vec<Recorded>,
    clock: u64,
    pub active: Option<ActiveStep>,
    stats: StepGraphStats,
}

impl StepGraphs {
    pub fn new(params: CudaSlice<u32>, enabled: bool) -> Self {
        StepGraphs {
            enabled,
            params,
            warmed: HashSet::new(),
            failed: HashSet::new(),
            recorded: Vec::new(),
            clock: 0,
            active: None,
            stats: StepGraphStats {
                enabled,
                ..Default::default()
            },
        }
    }
}

/// The step buffer's words for `step`: ids, positions, cos, sin (f32 bits).
fn param_words(step: &StepRequest) -> Vec<u32> {
    let rows = step.tokens.len();
    let positions: Vec<usize> = (step.start..step.start + rows).collect();
    let (cos, sin) = super::rope_cos_sin(step.inv_freq, &positions, step.scales);
    let mut words = Vec::with_capacity(2 * rows + cos.len() + sin.len());
    words.extend_from_slice(step.tokens);
    words.extend(positions.iter().map(|&p| p as u32));
    words.extend(cos.iter().chain(&sin).map(|v| v.to_bits()));
    words
}

impl CudaBackend {
    /// Turns recording and replay of forward passes on or off (on unless
    /// [`CudaOptions::graphs`](super::CudaOptions) is false); turning it off drops every recording.
    pub fn set_step_graphs(&self, enabled: bool) -> Result<()> {
        let mut g = self.lock(&self.steps)?;
        g.enabled = enabled;
        g.stats.enabled = enabled;
        if !enabled {
            g.recorded.clear();
        }
        Ok(())
    }

    /// Drops every recording (a buffer they use is about to be replaced).
    pub(super) fn drop_recordings(&self) -> Result<()> {
        self.synchronize()?;
        self.lock(&self.steps)?.recorded.clear();
        Ok(())
    }

    pub fn step_graph_stats(&self) -> Result<StepGraphStats> {
        Ok(self.lock(&self.steps)?.stats)
    }

    /// The active step's device inputs, when a pass is running in step mode.
    pub(super) fn step_args(&self) -> Result<Option<StepArgs>> {
        let g = self.lock(&self.steps)?;
        Ok(g.active.as_ref().map(|a| {
            let base = super::ptr(&g.params, &self.stream);
            let half = a.inv_freq.len();
            StepArgs {
                start: a.start,
                rows: a.rows,
                ids: base,
                positions: base + 4 * a.rows as u64,
                cos: base + 4 * (2 * a.rows) as u64,
                sin: base + 4 * (2 * a.rows + a.rows * half) as u64,
            }
        }))
    }

    /// Whether `tokens`, `inv_freq` and `scales` at `start` are the active step's, so an op may
    /// read them from the step buffer.
    pub(super) fn step_rope_matches(
        &self,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<bool> {
        let g = self.lock(&self.steps)?;
        Ok(g.active.as_ref().is_some_and(|a| {
            a.inv_freq == inv_freq
                && a.scales == scales
                && positions.len() == a.rows
                && positions.iter().enumerate().all(|(i, &p)| p == a.start + i)
        }))
    }

    pub(super) fn step_tokens_match(&self, ids: &[u32]) -> Result<bool> {
        let g = self.lock(&self.steps)?;
        Ok(g.active.as_ref().is_some_and(|a| a.tokens == ids))
    }

    /// Marks the active pass, if any, as one that waits for the device midway.
    pub(super) fn note_host_sync(&self) -> Result<()> {
        if let Some(a) = self.lock(&self.steps)?.active.as_mut() {
            a.synced = true;
        }
        Ok(())
    }

    /// Whether a pass is being captured now.
    pub(super) fn capturing(&self) -> Result<bool> {
        let g = self.lock(&self.steps)?;
        Ok(g.active.as_ref().is_some_and(|a| a.capturing))
    }

    /// Keeps `buf` alive as long as the recording being captured.
    pub(super) fn keep_while_recorded(&self, buf: &Arc<PooledBuf>) -> Result<()> {
        let mut g = self.lock(&self.steps)?;
        if let Some(a) = g.active.as_mut().filter(|a| a.capturing) {
            a.keep.push(buf.clone());
        }
        Ok(())
    }

    pub(super) fn begin_step_impl(&self, step: &StepRequest) -> Result<StepStart<GpuAct>> {
        let mut g = self.lock(&self.steps)?;
        g.active = None;
        let rows = step.tokens.len();
        if !g.enabled
            || rows == 0
            || rows > MAX_ROWS
            || step.inv_freq.len() > MAX_HALF
            || step.scales.len() != rows
        {
            return Ok(StepStart::Run);
        }
        let words = param_words(step);
        let dst = super::ptr(&g.params, &self.stream);
        super::guarded("cuda: step buffer upload failed", || {
            // SAFETY: `words` holds at most PARAM_WORDS u32 (rows and half bounded above), the
            // size of the step buffer; pageable source memory is staged before the call returns.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, &words, self.stream.cu_stream())
            }
        })?;
        g.clock += 1;
        let clock = g.clock;
        if let Some(i) = g.recorded.iter().position(|r| r.key == step.key) {
            g.recorded[i].used = clock;
            super::guarded("cuda: graph launch failed", || {
                g.recorded[i].graph.0.launch()
            })?;
            g.stats.replays += 1;
            let logits = g.recorded[i].logits.share();
            return Ok(StepStart::Replayed(logits));
        }
        let mut capturing = g.warmed.contains(&step.key) && !g.failed.contains(&step.key);
        if capturing {
            let begun = self
                .stream
                .begin_capture(sys::CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_RELAXED);
            if begun.is_err() {
                g.failed.insert(step.key);
                g.stats.failures += 1;
                capturing = false;
            }
        }
        g.warmed.insert(step.key);
        g.active = Some(ActiveStep {
            key: step.key,
            start: step.start,
            rows,
            tokens: step.tokens.to_vec(),
            inv_freq: step.inv_freq.to_vec(),
            scales: step.scales.to_vec(),
            capturing,
            synced: false,
            keep: Vec::new(),
        });
        Ok(StepStart::Run)
    }

    pub(super) fn end_step_impl(&self, logits: Option<&GpuAct>) -> Result<StepEnd> {
        let mut g = self.lock(&self.steps)?;
        let Some(active) = g.active.take() else {
            return Ok(StepEnd::Done);
        };
        if !active.capturing {
            if active.synced {
                // Not recordable: never try.
                g.failed.insert(active.key);
            }
            return Ok(StepEnd::Done);
        }
        let ended = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let graph = match (ended, logits) {
            (Ok(Some(graph)), Some(logits)) => (graph, logits.share()),
            _ => {
                // Nothing of the pass ran: run it again op by op, and never capture this key.
                g.failed.insert(active.key);
                g.stats.failures += 1;
                return Ok(StepEnd::Rerun);
            }
        };
        super::guarded("cuda: graph launch failed", || graph.0.launch())
            .map_err(|e| Error::Backend(format!("{e} (first replay of a recorded pass)")))?;
        g.stats.captures += 1;
        if g.recorded.len() >= MAX_RECORDED {
            if let Some(oldest) = (0..g.recorded.len()).min_by_key(|&i| g.recorded[i].used) {
                g.recorded.swap_remove(oldest);
            }
        }
        let used = g.clock;
        g.recorded.push(Recorded {
            key: active.key,
            graph: Graph(graph.0),
            logits: graph.1,
            _keep: active.keep,
            used,
        });
        Ok(StepEnd::Done)
    }
}
