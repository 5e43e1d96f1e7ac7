//! Recording and replaying forward passes on [`CudaBackend`] (the data kept per recording is in
//! src/backend/cuda/graphs/mod.rs): which passes are captured, the step buffer written before each
//! replay, and the buffers a recording keeps.

use std::sync::Arc;

use cudarc::driver::sys;

use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::graphs::*;
use crate::backend::cuda::runtime::act::GpuAct;
use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::runtime::kernels::ptr;
use crate::backend::cuda::runtime::pool::PooledBuf;
use crate::backend::{StepEnd, StepRequest, StepStart};
use crate::{Error, Result};

impl CudaBackend {
    /// Turns recording and replay of forward passes on or off (on unless
    /// [`CudaOptions::graphs`](crate::backend::cuda::CudaOptions) is false); turning it off drops every recording.
    pub fn set_step_graphs(&self, enabled: bool) -> Result<()> {
        let mut g = self.lock(&self.steps)?;
        g.enabled = enabled;
        g.stats.enabled = enabled;
        if !enabled {
            g.recorded.clear();
            g.segments.clear();
        }
        Ok(())
    }

    /// Drops every recording (a buffer they use is about to be replaced).
    pub(in crate::backend::cuda) fn drop_recordings(&self) -> Result<()> {
        self.synchronize()?;
        let mut g = self.lock(&self.steps)?;
        g.recorded.clear();
        g.segments.clear();
        Ok(())
    }

    pub fn step_graph_stats(&self) -> Result<StepGraphStats> {
        Ok(self.lock(&self.steps)?.stats)
    }

    /// The active step's device inputs, when a pass is running in step mode.
    pub(in crate::backend::cuda) fn step_args(&self) -> Result<Option<StepArgs>> {
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
    pub(in crate::backend::cuda) fn step_rope_matches(
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

    pub(in crate::backend::cuda) fn step_tokens_match(&self, ids: &[u32]) -> Result<bool> {
        let g = self.lock(&self.steps)?;
        Ok(g.active.as_ref().is_some_and(|a| a.tokens == ids))
    }

    /// Marks the active pass, if any, as one that waits for the device midway.
    pub(in crate::backend::cuda) fn note_host_sync(&self) -> Result<()> {
        if let Some(a) = self.lock(&self.steps)?.active.as_mut() {
            a.synced = true;
        }
        Ok(())
    }

    /// Whether a pass or a segment of one is being captured now.
    pub(in crate::backend::cuda) fn capturing(&self) -> Result<bool> {
        let g = self.lock(&self.steps)?;
        Ok(g.active.as_ref().is_some_and(|a| a.capturing) || g.segments.capture.is_some())
    }

    /// Keeps `buf` alive as long as the recording being captured.
    pub(in crate::backend::cuda) fn keep_while_recorded(&self, buf: &Arc<PooledBuf>) -> Result<()> {
        let mut g = self.lock(&self.steps)?;
        if let Some(a) = g.active.as_mut().filter(|a| a.capturing) {
            a.keep.push(buf.clone());
        } else if let Some(segment) = g.segments.capture.as_mut() {
            segment.keep.push(buf.clone());
        }
        Ok(())
    }

    pub(in crate::backend::cuda) fn begin_step_impl(
        &self,
        step: &StepRequest,
    ) -> Result<StepStart<GpuAct>> {
        let mut g = self.lock(&self.steps)?;
        g.active = None;
        let rows = step.tokens.len();
        let recorded = g.recorded.iter().position(|r| r.key == step.key);
        if step.fed {
            if !g.enabled
                || rows != 1
                || step.inv_freq.len() > MAX_HALF
                || step.scales.len() != 1
                || g.fed.is_none()
            {
                return Ok(StepStart::Unrecorded);
            }
            let Some(i) = recorded else {
                return Ok(StepStart::Unrecorded);
            };
            self.upload_fed_words(&mut g, step)?;
            return self.replay(&mut g, i);
        }
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
        if let Some(i) = recorded {
            return self.replay(&mut g, i);
        }
        g.clock += 1;
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

    /// Replays recording `i` (its step words are uploaded).
    fn replay(&self, g: &mut StepGraphs, i: usize) -> Result<StepStart<GpuAct>> {
        g.clock += 1;
        g.recorded[i].used = g.clock;
        guarded("cuda: graph launch failed", || {
            g.recorded[i].graph.0.launch()
        })?;
        g.stats.replays += 1;
        Ok(StepStart::Replayed(g.recorded[i].logits.share()))
    }

    /// Uploads a fed one-row pass's step words but its id (the fed choice, already in the step
    /// buffer) from pinned staging, so the host does not wait for the device's queue.
    fn upload_fed_words(&self, g: &mut StepGraphs, step: &StepRequest) -> Result<()> {
        let words = param_words(step);
        let words = &words[1..];
        let dst = ptr(&g.params, &self.stream) + 4;
        let Some(fed) = g.fed.as_mut() else {
            return Err(Error::Backend(
                "cuda: a fed pass without fed choices".into(),
            ));
        };
        let slot = fed.next_staged;
        fed.next_staged = (slot + 1) % FED_SLOTS;
        // The area's last upload must be done before the host writes it again.
        guarded("cuda: waiting for a staged upload", || {
            fed.staged_sent[slot].synchronize()
        })?;
        let area = guarded("cuda: pinned staging", || fed.host.as_mut_slice())?;
        let at = FED_SLOTS + slot * FED_WORDS;
        let area = &mut area[at..at + words.len()];
        area.copy_from_slice(words);
        guarded("cuda: step buffer upload failed", || {
            // SAFETY: `area` is pinned memory of `words.len()` <= FED_WORDS u32, which fits the
            // step buffer after its first word; the host writes it again only once the event
            // recorded below has completed.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, area, self.stream.cu_stream()) }
        })?;
        guarded("cuda: recording a staged upload", || {
            fed.staged_sent[slot].record(&self.stream)
        })?;
        Ok(())
    }

    /// Chooses `logits`' greedy token into the step buffer's id word (a fed pass's input) and
    /// starts its copy to a pinned host slot.
    pub(in crate::backend::cuda) fn feed_choice_impl(&self, logits: &GpuAct) -> Result<bool> {
        if logits.rows != 1 || logits.cols == 0 {
            return Ok(false);
        }
        let mut g = self.lock(&self.steps)?;
        if !g.enabled || g.active.is_some() {
            return Ok(false);
        }
        if g.fed.is_none() {
            g.fed = Some(self.new_fed_choices()?);
        }
        let s = &self.stream;
        let id_word = ptr(&g.params, s);
        let Some(fed) = g.fed.as_mut() else {
            return Ok(false);
        };
        if fed.queue.len() >= FED_SLOTS {
            return Err(Error::Backend(format!(
                "cuda: more than {FED_SLOTS} greedy choices fed and not taken"
            )));
        }
        self.launch_argmax(logits, id_word)?;
        let slot = fed.next_choice;
        fed.next_choice = (slot + 1) % FED_SLOTS;
        let host = guarded("cuda: pinned choices", || fed.host.as_mut_slice())?;
        guarded("cuda: copying a choice to the host", || {
            // SAFETY: one u32 from the step buffer's first word into pinned memory that lives as
            // long as the backend (which synchronises its stream before it is dropped); the host
            // reads it only after the event recorded below.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host[slot..slot + 1],
                    id_word,
                    s.cu_stream(),
                )
            }
        })?;
        guarded("cuda: recording a choice's copy", || {
            fed.choice_copied[slot].record(s)
        })?;
        fed.queue.push_back(slot);
        Ok(true)
    }

    pub(in crate::backend::cuda) fn take_fed_choice_impl(&self) -> Result<u32> {
        let (slot, copied) = {
            let mut g = self.lock(&self.steps)?;
            let fed = g.fed.as_mut();
            match fed.and_then(|f| f.queue.pop_front().map(|s| (s, f.choice_copied[s].clone()))) {
                Some(taken) => taken,
                None => return Err(Error::Backend("cuda: no greedy choice was fed".into())),
            }
        };
        self.wait_timed(|| copied.synchronize())?;
        let g = self.lock(&self.steps)?;
        let Some(fed) = g.fed.as_ref() else {
            return Err(Error::Backend("cuda: the fed choices are gone".into()));
        };
        let host = guarded("cuda: pinned choices", || fed.host.as_slice())?;
        Ok(host[slot])
    }

    pub(in crate::backend::cuda) fn drop_fed_choices_impl(&self) -> Result<()> {
        if let Some(fed) = self.lock(&self.steps)?.fed.as_mut() {
            fed.queue.clear();
        }
        Ok(())
    }

    fn new_fed_choices(&self) -> Result<FedChoices> {
        let ctx = self.stream.context();
        let event = || {
            guarded("cuEventCreate", || {
                ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            })
        };
        let mut host = guarded(
            "cuda: cannot allocate pinned memory for fed choices",
            || {
                // SAFETY: plain (not write-combined: the host reads the choices) page-locked
                // memory; it is zeroed below before any use.
                unsafe { ctx.alloc_pinned_with_flags::<u32>(FED_SLOTS * (1 + FED_WORDS), 0) }
            },
        )?;
        guarded("cuda: pinned choices", || host.as_mut_slice())?.fill(0);
        Ok(FedChoices {
            host,
            choice_copied: (0..FED_SLOTS)
                .map(|_| event().map(Arc::new))
                .collect::<Result<_>>()?,
            staged_sent: (0..FED_SLOTS).map(|_| event()).collect::<Result<_>>()?,
            queue: std::collections::VecDeque::new(),
            next_choice: 0,
            next_staged: 0,
        })
    }

    pub(in crate::backend::cuda) fn end_step_impl(
        &self,
        logits: Option<&GpuAct>,
    ) -> Result<StepEnd> {
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
