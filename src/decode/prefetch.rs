//! Draft-driven prefetch: the decode loop's observer that turns the INT4 draft's routing into
//! copies of the FP16 experts the verify pass will need, issued through the backend's expert
//! cache ([`ExpertCopies`]; on the GPU, on the copy stream while the draft keeps running).
//!
//! Per draft window: routing counts per MoE layer accumulate on the GPU as draft steps run (the
//! draft's routing never comes to the host, so a draft pass has no host round trip and can be
//! replayed as a recorded graph); at each chunk
//! boundary of the [`Planner`] (the first after about a fifth of the window, the next once the
//! draft has run long enough to hide the bytes just issued, from the measured draft step time and
//! copy bandwidth) the top experts per layer are prefetched and protected from eviction until the
//! next window starts.
//!
//! [`FrequencyPrefetcher`] is the SpecMoEOff baseline's rule instead: route-frequency Top-M
//! after draft steps 0 and 1 only.

use std::time::Instant;

use super::DecodeObserver;
use crate::model::{ModelInfo, Route, RouteHook, Variant};
use crate::offload::{ExpertCopies, Planner};
use crate::Result;

/// A draft window starts: the previous plan's protection ends and the device counts restart.
fn new_window<C: ExpertCopies + ?Sized>(backend: &C) -> Result<()> {
    backend.clear_plans()?;
    backend.reset_route_counts()
}

/// The draft's routing counts so far, from the device into the planner.
fn load_counts<C: ExpertCopies + ?Sized>(backend: &C, planner: &mut Planner) -> Result<()> {
    let counts = backend.route_counts()?;
    if !planner.set_counts(&counts) {
        return Err(crate::Error::Backend(format!(
            "prefetch: {} routing counts from the device, the planner expects another shape",
            counts.len()
        )));
    }
    Ok(())
}

/// The observer; pass it to [`crate::decode::generate_observed`] in Specter mode.
pub struct DraftPrefetcher<'a, C: ExpertCopies + ?Sized> {
    backend: &'a C,
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

impl<'a, C: ExpertCopies + ?Sized> DraftPrefetcher<'a, C> {
    /// `bandwidth_bytes_per_s`: the copy bandwidth the chunk schedule assumes at first.
    pub fn new(backend: &'a C, info: &ModelInfo, bandwidth_bytes_per_s: f64) -> Result<Self> {
        let slots = backend.offload_slots()?.ok_or_else(|| {
            crate::Error::Request(
                "draft-driven prefetch needs offloaded experts (--resident-experts N below the expert count)"
                    .into(),
            )
        })?;
        backend.enable_route_counts(info.moe_layers.len(), info.num_experts)?;
        // A first guess of the draft step time; replaced by measurements after one step.
        let draft_step_s = 2e-3;
        Ok(DraftPrefetcher {
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
        load_counts(self.backend, &mut self.planner)?;
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

impl<C: ExpertCopies + ?Sized> RouteHook for DraftPrefetcher<'_, C> {
    fn on_route(&mut self, r: Route<'_>) {
        // Draft routing arrives here only where a wrapper hides `counts_routes_on_device`.
        if r.variant == Variant::Draft {
            self.planner.record(r.moe_layer, r.topk);
        }
    }

    /// The draft's routing is counted on the device; the target's is not needed here.
    fn counts_routes_on_device(&self, variant: Variant) -> bool {
        variant == Variant::Draft
    }
}

impl<C: ExpertCopies + ?Sized> DecodeObserver for DraftPrefetcher<'_, C> {
    fn on_target_pass(&mut self, _rows: usize) {
        if let Err(e) = self.backend.mark_verify() {
            self.error.get_or_insert(e);
        }
    }

    fn on_draft_window(&mut self, depth: usize) {
        if let Err(e) = new_window(self.backend) {
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

/// SpecMoEOff's prefetch rule, for [`crate::decode::Mode::SpecMoeOff`]: per draft
/// window, the draft's routing counts per MoE layer over draft steps 0 and 1 only; right after
/// step 0 and again after step 1, the Top-M experts per layer by count are prefetched (and
/// protected from eviction until the next window starts).
pub struct FrequencyPrefetcher<'a, C: ExpertCopies + ?Sized> {
    backend: &'a C,
    /// Counting and ranking only: this rule has no chunk schedule.
    planner: Planner,
    /// Decoder layer of each MoE layer.
    moe_layers: Vec<usize>,
    top_m: usize,
    in_window: bool,
    /// Draft steps run in the current window.
    steps_done: usize,
    /// The first error met while prefetching (observers cannot return one).
    error: Option<crate::Error>,
}

impl<'a, C: ExpertCopies + ?Sized> FrequencyPrefetcher<'a, C> {
    /// Top-M from [`crate::offload::frequency_top_m`]: the slots per layer, at most the
    /// `2 * top_k` experts two draft steps can route to.
    pub fn new(backend: &'a C, info: &ModelInfo) -> Result<Self> {
        let slots = backend.offload_slots()?.ok_or_else(|| {
            crate::Error::Request(
                "route-frequency prefetch needs offloaded experts (--resident-experts N below the expert count)"
                    .into(),
            )
        })?;
        Self::with_top_m(
            backend,
            info,
            crate::offload::frequency_top_m(slots, info.top_k),
        )
    }

    /// With an explicit Top-M (at least 1; more than the slots per layer is cut to them).
    pub fn with_top_m(backend: &'a C, info: &ModelInfo, top_m: usize) -> Result<Self> {
        let slots = backend.offload_slots()?.ok_or_else(|| {
            crate::Error::Request("route-frequency prefetch needs offloaded experts".into())
        })?;
        if top_m == 0 {
            return Err(crate::Error::Request(
                "route-frequency prefetch needs Top-M of at least 1".into(),
            ));
        }
        // Counted on the device as Specter's prefetcher does, so that the baseline pays no host
        // round trips Specter does not.
        backend.enable_route_counts(info.moe_layers.len(), info.num_experts)?;
        Ok(FrequencyPrefetcher {
            backend,
            // The planner's timing estimates are unused: only its counts and ranking are.
            planner: Planner::new(info.moe_layers.len(), info.num_experts, 0.0, 1.0),
            moe_layers: info.moe_layers.clone(),
            top_m: top_m.min(slots),
            in_window: false,
            steps_done: 0,
            error: None,
        })
    }

    pub fn top_m(&self) -> usize {
        self.top_m
    }

    /// The first error met while prefetching, if any.
    pub fn take_error(&mut self) -> Option<crate::Error> {
        self.error.take()
    }

    fn issue(&mut self) -> Result<()> {
        // The window's counts so far: steps 0 .. steps_done (at most FREQUENCY_STEPS).
        load_counts(self.backend, &mut self.planner)?;
        for (moe_layer, experts) in self.planner.plan(self.top_m).iter().enumerate() {
            if !experts.is_empty() {
                self.backend.prefetch(self.moe_layers[moe_layer], experts)?;
            }
        }
        Ok(())
    }
}

impl<C: ExpertCopies + ?Sized> RouteHook for FrequencyPrefetcher<'_, C> {
    fn on_route(&mut self, r: Route<'_>) {
        // Reached only where a wrapper hides `counts_routes_on_device`: the draft's prefill and
        // steps 2.. do not count.
        if r.variant == Variant::Draft
            && self.in_window
            && self.steps_done < crate::offload::FREQUENCY_STEPS
        {
            self.planner.record(r.moe_layer, r.topk);
        }
    }

    /// The draft's routing is counted on the device (zeroed at each window, read after steps 0
    /// and 1, so the prefill and later steps do not count).
    fn counts_routes_on_device(&self, variant: Variant) -> bool {
        variant == Variant::Draft
    }
}

impl<C: ExpertCopies + ?Sized> DecodeObserver for FrequencyPrefetcher<'_, C> {
    fn on_draft_window(&mut self, depth: usize) {
        if let Err(e) = new_window(self.backend) {
            self.error.get_or_insert(e);
        }
        self.planner.begin_window(depth);
        self.in_window = true;
        self.steps_done = 0;
    }

    fn on_draft_step(&mut self, step: usize) {
        self.steps_done = step + 1;
        if self.in_window && self.steps_done <= crate::offload::FREQUENCY_STEPS {
            if let Err(e) = self.issue() {
                self.error.get_or_insert(e);
            }
        }
    }

    fn on_target_pass(&mut self, _rows: usize) {
        self.in_window = false;
        if let Err(e) = self.backend.mark_verify() {
            self.error.get_or_insert(e);
        }
    }
}
