//! [`OffloadSimulator`]: a route hook and decode observer that runs the expert cache, the planner
//! and a simulated copy engine alongside a real decode run.
//!
//! Time model: every draft step costs `draft_step_s`; a target pass over `rows` rows costs
//! `target_pass_s + rows * target_row_s`, spread evenly over its MoE layers. At each MoE layer of
//! a target pass, the experts its rows route to (each once: the verify pass is grouped by expert)
//! are looked up; misses are loaded on demand and the layer waits for them and for any prefetch
//! still in flight, which is the stall. Prefetches issued during the draft window overlap with
//! the draft steps that follow.
//!
//! Prefetch follows the [`Planner`]'s chunk schedule over the whole draft window (Specter), or,
//! with [`OffloadSimulator::with_frequency_prefetch`], SpecMoEOff's rule: the Top-M experts per
//! layer by the draft's routing counts over steps 0 and 1, prefetched after each of them.

use super::cache::{
    ExpertCache, InitialResidency, Insert, LoadKind, Lookup, Policy, ResidencyConfig,
};
use super::planner::{Planner, FREQUENCY_STEPS};
use super::transfer::{SimulatedTransfers, TransferEngine, TransferId};
use crate::decode::DecodeObserver;
use crate::model::{ModelInfo, RouteHook, Variant};
use crate::{Error, Result};

/// Simulated compute time per forward pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeModel {
    /// One single-token draft forward pass.
    pub draft_step_s: f64,
    /// A target forward pass's fixed cost.
    pub target_pass_s: f64,
    /// A target forward pass's cost per row.
    pub target_row_s: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SimulatorConfig {
    pub residency: ResidencyConfig,
    pub initial: InitialResidency,
    pub bandwidth_bytes_per_s: f64,
    pub latency_s: f64,
    pub compute: ComputeModel,
}

impl SimulatorConfig {
    /// Copies only: `slots` experts per layer resident from the first ones on, copies at
    /// `bandwidth_bytes_per_s` with no latency, and no compute time, so the simulated clock
    /// measures the time spent copying experts. What the CPU runtime reports when it has no
    /// model of the GPU's compute time.
    pub fn copies_only(
        info: &ModelInfo,
        slots: usize,
        policy: Policy,
        bandwidth_bytes_per_s: f64,
    ) -> Self {
        SimulatorConfig {
            residency: ResidencyConfig::for_model(info, slots, policy),
            initial: InitialResidency::FirstExperts,
            bandwidth_bytes_per_s,
            latency_s: 0.0,
            compute: ComputeModel {
                draft_step_s: 0.0,
                target_pass_s: 0.0,
                target_row_s: 0.0,
            },
        }
    }
}

/// Figures of an offloaded run. Lookups count each (pass, MoE layer, expert) once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffloadStats {
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Experts copied ahead of a verify pass on the planner's word.
    pub prefetched: u64,
    /// Prefetched experts their verify pass used.
    pub prefetched_used: u64,
    /// Prefetched experts evicted or left unused by their verify pass.
    pub prefetched_wasted: u64,
    /// Misses loaded on demand (every miss is one).
    pub demand_loads: u64,
    /// Demand loads that found every slot planned and went through a transient buffer.
    pub streamed_loads: u64,
    pub bytes_moved: u64,
    /// Simulated seconds target passes waited for copies.
    pub stall_s: f64,
    /// Simulated compute seconds (draft steps and target passes).
    pub compute_s: f64,
    /// Simulated clock at the last commit.
    pub simulated_s: f64,
    pub committed_tokens: u64,
    /// `(t_last_commit - t_first_commit) / (committed_tokens - 1)` on the simulated clock.
    pub simulated_tpot_ms: f64,
    pub per_layer_hits: Vec<u64>,
    pub per_layer_misses: Vec<u64>,
}

pub struct OffloadSimulator {
    config: SimulatorConfig,
    cache: ExpertCache,
    planner: Planner,
    transfers: SimulatedTransfers,
    stats: OffloadStats,
    /// Seconds of target compute per MoE layer in the current pass.
    layer_compute_s: f64,
    in_window: bool,
    first_commit_s: Option<f64>,
    routing_error: Option<String>,
    seen: Vec<bool>,
    /// SpecMoEOff's Top-M when prefetching by route frequency at draft steps 0 and 1.
    frequency_top_m: Option<usize>,
    /// Draft steps run in the current window.
    window_steps: usize,
}

impl OffloadSimulator {
    pub fn new(config: SimulatorConfig) -> Result<Self> {
        let compute = config.compute;
        for (name, value) in [
            ("draft_step_s", compute.draft_step_s),
            ("target_pass_s", compute.target_pass_s),
            ("target_row_s", compute.target_row_s),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(Error::Request(format!(
                    "compute model {name} = {value} must be finite and >= 0"
                )));
            }
        }
        let cache = ExpertCache::new(config.residency.clone(), &config.initial)?;
        let transfers = SimulatedTransfers::new(config.bandwidth_bytes_per_s, config.latency_s)?;
        let residency = &config.residency;
        let planner = Planner::new(
            residency.num_moe_layers,
            residency.num_experts,
            compute.draft_step_s,
            config.bandwidth_bytes_per_s,
        );
        let mut simulator = OffloadSimulator {
            seen: vec![false; residency.num_experts],
            config,
            cache,
            planner,
            transfers,
            stats: OffloadStats::default(),
            layer_compute_s: 0.0,
            in_window: false,
            first_commit_s: None,
            routing_error: None,
            frequency_top_m: None,
            window_steps: 0,
        };
        simulator.reset();
        Ok(simulator)
    }

    /// Prefetches by SpecMoEOff's rule instead of the planner's schedule: after draft steps 0
    /// and 1 of each window, the `top_m` experts per layer the draft routed to most in those
    /// steps. Needs [`Policy::Specter`] (plans protected from eviction, prefetch on).
    pub fn with_frequency_prefetch(mut self, top_m: usize) -> Result<Self> {
        if self.cache.policy() != Policy::Specter {
            return Err(Error::Request(format!(
                "route-frequency prefetch needs the Specter cache policy, not {:?}",
                self.cache.policy()
            )));
        }
        if top_m == 0 {
            return Err(Error::Request(
                "route-frequency prefetch needs Top-M of at least 1".into(),
            ));
        }
        self.frequency_top_m = Some(top_m);
        Ok(self)
    }

    pub fn config(&self) -> &SimulatorConfig {
        &self.config
    }

    pub fn cache(&self) -> &ExpertCache {
        &self.cache
    }

    /// Restores the initial residency, empties the copy engine, zeroes the clock and the figures.
    pub fn reset(&mut self) {
        self.cache.reset();
        self.transfers.reset();
        self.planner.begin_window(0);
        let layers = self.config.residency.num_moe_layers;
        self.stats = OffloadStats {
            per_layer_hits: vec![0; layers],
            per_layer_misses: vec![0; layers],
            ..OffloadStats::default()
        };
        self.layer_compute_s = 0.0;
        self.in_window = false;
        self.first_commit_s = None;
        self.routing_error = None;
    }

    pub fn stats(&self) -> OffloadStats {
        let mut stats = self.stats.clone();
        stats.stall_s = self.transfers.stall_s();
        stats
    }

    /// Refuses a model whose MoE layers or expert count differ from the configuration.
    pub fn check_model(&self, info: &ModelInfo) -> Result<()> {
        let residency = &self.config.residency;
        if info.moe_layers.len() != residency.num_moe_layers
            || info.num_experts != residency.num_experts
        {
            return Err(Error::Request(format!(
                "offload is configured for {} MoE layers of {} experts, the model has {} of {}",
                residency.num_moe_layers,
                residency.num_experts,
                info.moe_layers.len(),
                info.num_experts
            )));
        }
        Ok(())
    }

    /// The first malformed routing report (layer or expert out of range), if any.
    pub fn routing_error(&self) -> Option<&str> {
        self.routing_error.as_deref()
    }

    fn note_routing_error(&mut self, variant: Variant, moe_layer: usize, topk: &[u32]) {
        if self.routing_error.is_none() {
            let residency = &self.config.residency;
            self.routing_error = Some(format!(
                "{variant:?} pass routed MoE layer {moe_layer} to {:?}; expected layer < {} and experts < {}",
                topk.iter().take(16).collect::<Vec<_>>(),
                residency.num_moe_layers,
                residency.num_experts
            ));
        }
    }

    fn record_transfer(&mut self) {
        self.stats.bytes_moved += self.config.residency.expert_bytes as u64;
    }

    /// Looks up one target layer's experts, loads the misses, waits, then runs the layer.
    fn target_layer(&mut self, moe_layer: usize, topk: &[u32]) {
        let bytes = self.config.residency.expert_bytes;
        self.seen.iter_mut().for_each(|s| *s = false);
        let mut waits: Vec<TransferId> = Vec::new();
        for &expert in topk {
            if std::mem::replace(&mut self.seen[expert as usize], true) {
                continue;
            }
            self.stats.lookups += 1;
            match self.cache.lookup(moe_layer, expert) {
                Lookup::Hit {
                    transfer,
                    first_use_of_prefetch,
                } => {
                    self.stats.hits += 1;
                    self.stats.per_layer_hits[moe_layer] += 1;
                    if first_use_of_prefetch {
                        self.stats.prefetched_used += 1;
                    }
                    waits.extend(transfer.filter(|&id| !self.transfers.is_complete(id)));
                }
                Lookup::Miss => {
                    self.stats.misses += 1;
                    self.stats.per_layer_misses[moe_layer] += 1;
                    self.stats.demand_loads += 1;
                    self.record_transfer();
                    let id = self.transfers.issue(moe_layer, expert as usize, bytes);
                    match self
                        .cache
                        .insert(moe_layer, expert, LoadKind::Demand, Some(id))
                    {
                        Insert::Inserted { evicted } => {
                            if evicted.is_some_and(|e| e.unused_prefetch) {
                                self.stats.prefetched_wasted += 1;
                            }
                        }
                        Insert::NoSlot => self.stats.streamed_loads += 1,
                        Insert::AlreadyResident => {}
                    }
                    waits.push(id);
                }
            }
        }
        for id in waits {
            self.transfers.wait(id);
        }
        self.transfers.advance(self.layer_compute_s);
        self.stats.compute_s += self.layer_compute_s;
    }

    /// Forms the plan from the window's routing so far and prefetches what is missing.
    fn plan_and_prefetch(&mut self, steps_done: usize) {
        let bytes = self.config.residency.expert_bytes;
        let plan = match self.frequency_top_m {
            Some(m) => self.planner.plan_for_at_most(&self.cache, m),
            None => self.planner.plan_for(&self.cache),
        };
        for (layer, experts) in plan.experts.iter().enumerate() {
            self.cache.set_plan(layer, experts);
        }
        let mut issued_bytes = 0usize;
        for &(layer, expert) in &plan.prefetch {
            match self.cache.insert(layer, expert, LoadKind::Prefetch, None) {
                Insert::Inserted { evicted } => {
                    if evicted.is_some_and(|e| e.unused_prefetch) {
                        self.stats.prefetched_wasted += 1;
                    }
                    let id = self.transfers.issue(layer, expert as usize, bytes);
                    self.cache.attach_transfer(layer, expert, id);
                    self.stats.prefetched += 1;
                    self.record_transfer();
                    issued_bytes += bytes;
                }
                Insert::NoSlot | Insert::AlreadyResident => {}
            }
        }
        self.planner.issued(steps_done, issued_bytes);
    }
}

impl RouteHook for OffloadSimulator {
    fn on_route(
        &mut self,
        variant: Variant,
        _layer: usize,
        moe_layer: usize,
        _top_k: usize,
        topk: &[u32],
    ) {
        let residency = &self.config.residency;
        if moe_layer >= residency.num_moe_layers
            || topk.iter().any(|&e| e as usize >= residency.num_experts)
        {
            self.note_routing_error(variant, moe_layer, topk);
            return;
        }
        match variant {
            Variant::Target => self.target_layer(moe_layer, topk),
            Variant::Draft => {
                let counting =
                    self.frequency_top_m.is_none() || self.window_steps < FREQUENCY_STEPS;
                if self.in_window && self.cache.policy() == Policy::Specter && counting {
                    self.planner.record(moe_layer, topk);
                }
            }
        }
    }
}

impl DecodeObserver for OffloadSimulator {
    fn on_target_pass(&mut self, rows: usize) {
        if self.cache.policy() == Policy::OnDemand {
            self.cache.drop_all();
        }
        let compute = self.config.compute;
        let pass_s = compute.target_pass_s + rows as f64 * compute.target_row_s;
        self.layer_compute_s = pass_s / self.config.residency.num_moe_layers as f64;
    }

    fn on_draft_window(&mut self, depth: usize) {
        self.in_window = true;
        self.window_steps = 0;
        self.planner.begin_window(depth);
    }

    fn on_draft_step(&mut self, step: usize) {
        let step_s = self.config.compute.draft_step_s;
        self.transfers.advance(step_s);
        self.stats.compute_s += step_s;
        let steps_done = step + 1;
        self.window_steps = steps_done;
        let due = match self.frequency_top_m {
            Some(_) => steps_done <= FREQUENCY_STEPS,
            None => self.planner.is_boundary(steps_done),
        };
        if self.in_window && self.cache.policy() == Policy::Specter && due {
            self.plan_and_prefetch(steps_done);
        }
    }

    fn on_commit(&mut self, _accepted: usize, committed: usize) {
        self.in_window = false;
        self.cache.clear_plans();
        self.stats.prefetched_wasted += self.cache.take_unused_prefetches() as u64;
        if self.cache.policy() == Policy::OnDemand {
            self.cache.drop_all();
        }
        if committed > 0 {
            let now = self.transfers.now();
            let first = *self.first_commit_s.get_or_insert(now);
            self.stats.committed_tokens += committed as u64;
            self.stats.simulated_s = now;
            if self.stats.committed_tokens > 1 {
                self.stats.simulated_tpot_ms =
                    (now - first) * 1e3 / (self.stats.committed_tokens - 1) as f64;
            }
        }
    }
}
