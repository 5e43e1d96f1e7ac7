//! Recording and replaying forward passes on [`CudaBackend`] (the data kept per recording is in
//! src/backend/cuda/graphs.rs): which passes are captured, the step buffer written before each
//! replay, and the buffers a recording keeps.

use std::sync::Arc;

use cudarc::driver::sys;

use super::act::GpuAct;
use super::backend::CudaBackend;
use super::driver::guarded;
use super::graphs::*;
use super::kernels::ptr;
use super::pool::PooledBuf;
use crate::backend::{StepEnd, StepRequest, StepStart};
use crate::{Error, Result};

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
            let base = ptr(&g.params, &self.stream);
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
        let dst = ptr(&g.params, &self.stream);
        guarded("cuda: step buffer upload failed", || {
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
            guarded("cuda: graph launch failed", || {
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
        guarded("cuda: graph launch failed", || graph.0.launch())
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
