//! Draft-driven prefetch on the GPU: the decode loop's observer that turns the INT4 draft's
//! routing into copies of the FP16 experts the verify pass will need, issued on the copy stream
//! while the draft keeps running.
//!
//! Per draft window: routing counts per MoE layer accumulate on the GPU as draft steps run (the
//! draft's routing never comes to the host, so a draft pass has no host round trip and can be
//! replayed as a recorded graph); at each chunk
//! boundary of the [`Planner`] (the first after about a fifth of the window, the next once the
//! draft has run long enough to hide the bytes just issued, from the measured draft step time and
//! copy bandwidth) the top experts per layer are prefetched and protected from eviction until the
//! next window starts.

use std::time::Instant;

use super::CudaBackend;
use crate::decode::DecodeObserver;
use crate::model::{ModelInfo, RouteHook, Variant};
use crate::offload::Planner;
use crate::Result;

/// The observer; pass it to [`crate::decode::generate_observed`] in Specter mode.
pub struct CudaPrefetcher<'a> {
    backend: &'a CudaBackend,
    planner: Planner,
    /// Decoder layer of each MoE layer.
    moe_layers: Vec<usize>,
    slots: usize,
    step_started: Option<Instant>,
    /// Exponential average of a draft step's wall time, seconds.
    draft_step_s: f64,
    /// The first error met while prefetching (observers cannot return one).
    error: Option<crate::Error>,
}

impl<'a> CudaPrefetcher<'a> {
    /// `bandwidth_bytes_per_s`: the copy bandwidth the chunk schedule assumes at first.
    pub fn new(
        backend: &'a CudaBackend,
        info: &ModelInfo,
        bandwidth_bytes_per_s: f64,
    ) -> Result<Self> {
        let slots = backend.offload_slots()?.ok_or_else(|| {
            crate::Error::Request(
                "draft-driven prefetch needs offloaded experts (--resident-experts N below the expert count)"
                    .into(),
            )
        })?;
        backend.enable_route_counts(info.moe_layers.len(), info.num_experts)?;
        // A first guess of the draft step time; replaced by measurements after one step.
        let draft_step_s = 2e-3;
        Ok(CudaPrefetcher {
            backend,
            planner: Planner::new(
                info.moe_layers.len(),
                info.num_experts,
                draft_step_s,
                bandwidth_bytes_per_s,
            ),
            moe_layers: info.moe_layers.clone(),
            slots,
            step_started: None,
            draft_step_s,
            error: None,
        })
    }

    /// The first error met while prefetching, if any.
    pub fn take_error(&mut self) -> Option<crate::Error> {
        self.error.take()
    }

    pub fn draft_step_seconds(&self) -> f64 {
        self.draft_step_s
    }

    fn issue(&mut self, steps_done: usize) -> Result<()> {
        let counts = self.backend.route_counts()?;
        if !self.planner.set_counts(&counts) {
            return Err(crate::Error::Backend(format!(
                "prefetch: {} routing counts from the device, the planner expects another shape",
                counts.len()
            )));
        }
        let plan = self.planner.plan(self.slots);
        let mut bytes = 0;
        for (moe_layer, experts) in plan.iter().enumerate() {
            if !experts.is_empty() {
                bytes += self.backend.prefetch(self.moe_layers[moe_layer], experts)?;
            }
        }
        self.planner.issued(steps_done, bytes);
        Ok(())
    }
}

impl RouteHook for CudaPrefetcher<'_> {
    fn on_route(
        &mut self,
        variant: Variant,
        _layer: usize,
        moe_layer: usize,
        _top_k: usize,
        topk: &[u32],
    ) {
        // Draft routing arrives here only where a wrapper hides `counts_routes_on_device`.
        if variant == Variant::Draft {
            self.planner.record(moe_layer, topk);
        }
    }

    /// The draft's routing is counted on the device; the target's is not needed here.
    fn counts_routes_on_device(&self, variant: Variant) -> bool {
        variant == Variant::Draft
    }
}

impl DecodeObserver for CudaPrefetcher<'_> {
    fn on_target_pass(&mut self, _rows: usize) {
        if let Err(e) = self.backend.mark_verify() {
            self.error.get_or_insert(e);
        }
    }

    fn on_draft_window(&mut self, depth: usize) {
        if let Err(e) = self
            .backend
            .clear_plans()
            .and_then(|_| self.backend.reset_route_counts())
        {
            self.error.get_or_insert(e);
        }
        self.planner.begin_window(depth);
        self.step_started = Some(Instant::now());
    }

    fn on_draft_step(&mut self, step: usize) {
        let now = Instant::now();
        if let Some(t) = self.step_started {
            let s = now.duration_since(t).as_secs_f64();
            self.draft_step_s = 0.8 * self.draft_step_s + 0.2 * s;
            self.planner.set_draft_step_seconds(self.draft_step_s);
        }
        let steps_done = step + 1;
        if self.planner.is_boundary(steps_done) {
            if let Err(e) = self.issue(steps_done) {
                self.error.get_or_insert(e);
            }
        }
        self.step_started = Some(Instant::now());
    }
}
