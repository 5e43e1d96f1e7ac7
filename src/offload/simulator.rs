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

use super::cache::{ExpertCache, InitialResidency, Policy, ResidencyConfig};
use super::planner::{Planner, FREQUENCY_STEPS};
use super::stats::OffloadStats;
use super::transfer::{SimulatedTransfers, TransferEngine, TransferId};
use crate::decode::DecodeObserver;
use crate::model::{ModelInfo, Route, RouteHook, Variant};
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

pub struct OffloadSimulator {
    config: SimulatorConfig,
    cache: ExpertCache,
    planner: Planner,
    transfers: SimulatedTransfers,
    /// Seconds of target compute per MoE layer in the current pass.
    layer_compute_s: f64,
    in_window: bool,
    first_commit_s: Option<f64>,
    routing_error: Option<String>,
    seen: Vec<bool>,
    /// The simulated clock's figures: the tokens committed and the clock at the last commit.
    committed_tokens: u64,
    simulated_s: f64,
    simulated_tpot_ms: f64,
    compute_s: f64,
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
            committed_tokens: 0,
            simulated_s: 0.0,
            simulated_tpot_ms: 0.0,
            compute_s: 0.0,
            config,
            cache,
            planner,
            transfers,
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
        self.committed_tokens = 0;
        self.simulated_s = 0.0;
        self.simulated_tpot_ms = 0.0;
        self.compute_s = 0.0;
        self.layer_compute_s = 0.0;
        self.in_window = false;
        self.first_commit_s = None;
        self.routing_error = None;
    }

    pub fn stats(&self) -> OffloadStats {
        let mut stats = self.cache.stats().clone();
        stats.path = "simulated".to_string();
        stats.stall_s = self.transfers.stall_s();
        // The simulated link's stall; the simulator has no host path, so its stall stays 0.
        stats.link_stall_seconds = stats.stall_s;
        stats.compute_s = self.compute_s;
        stats.simulated_s = self.simulated_s;
        stats.committed_tokens = self.committed_tokens;
        stats.simulated_tpot_ms = self.simulated_tpot_ms;
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

    /// Serves one target layer's experts by the cache policy, copies what it loads, waits,
    /// then runs the layer.
    fn target_layer(&mut self, moe_layer: usize, topk: &[u32]) {
        let bytes = self.config.residency.expert_bytes;
        self.seen.iter_mut().for_each(|s| *s = false);
        // Each expert once, in ascending order: the verify pass is grouped by expert.
        let mut experts: Vec<u32> = Vec::new();
        for &expert in topk {
            if !std::mem::replace(&mut self.seen[expert as usize], true) {
                experts.push(expert);
            }
        }
        experts.sort_unstable();
        let rounds = match self.cache.serve(moe_layer, &experts) {
            Ok(rounds) => rounds,
            Err(e) => {
                self.routing_error.get_or_insert(e.to_string());
                return;
            }
        };
        let mut waits: Vec<TransferId> = Vec::new();
        for round in rounds {
            for hit in &round.hits {
                waits.extend(hit.transfer.filter(|&id| !self.transfers.is_complete(id)));
            }
            for load in &round.loads {
                let id = self.transfers.issue(moe_layer, load.expert as usize, bytes);
                self.cache.attach_transfer(moe_layer, load.slot, id);
                waits.push(id);
            }
        }
        for id in waits {
            self.transfers.wait(id);
        }
        self.transfers.advance(self.layer_compute_s);
        self.compute_s += self.layer_compute_s;
    }

    /// Forms the plan from the window's routing so far and prefetches what is missing.
    fn plan_and_prefetch(&mut self, steps_done: usize) {
        let bytes = self.config.residency.expert_bytes;
        let limit = self
            .frequency_top_m
            .unwrap_or(usize::MAX)
            .min(self.cache.slots_per_layer());
        let mut issued_bytes = 0usize;
        for (layer, ranked) in self.planner.plan(limit).iter().enumerate() {
            let loads = match self.cache.prefetch(layer, ranked) {
                Ok(loads) => loads,
                Err(e) => {
                    self.routing_error.get_or_insert(e.to_string());
                    return;
                }
            };
            for load in loads {
                let id = self.transfers.issue(layer, load.expert as usize, bytes);
                self.cache.attach_transfer(layer, load.slot, id);
                issued_bytes += bytes;
            }
        }
        self.planner.issued(steps_done, issued_bytes);
    }
}

impl RouteHook for OffloadSimulator {
    fn on_route(&mut self, route: Route<'_>) {
        let (variant, moe_layer, topk) = (route.variant, route.moe_layer, route.topk);
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
        self.compute_s += step_s;
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
        self.cache.take_unused_prefetches();
        if committed > 0 {
            let now = self.transfers.now();
            let first = *self.first_commit_s.get_or_insert(now);
            self.committed_tokens += committed as u64;
            self.simulated_s = now;
            if self.committed_tokens > 1 {
                self.simulated_tpot_ms = (now - first) * 1e3 / (self.committed_tokens - 1) as f64;
            }
        }
    }
}
