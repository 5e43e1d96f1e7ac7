//! The expert cache's policy, the one the GPU and the simulator both run: per MoE layer, which
//! routed experts sit in which of the layer's slots, in what recency order, which the current
//! prefetch plan protects, and which were prefetched but not used yet.
//!
//! It holds no memory and moves no bytes. A backend asks it what to do ([`ExpertCache::serve`]
//! for the experts a pass needs, [`ExpertCache::prefetch`] for a plan) and carries the answer out:
//! the CUDA backend copies into slot memory and launches kernels, the simulator advances a clock.
//! Hits, misses, prefetch use and waste are counted here, once, for both.

use super::placement::HostShare;
use super::stats::OffloadStats;
use super::transfer::TransferId;
use crate::model::ModelInfo;
use crate::{Error, Result};

/// How resident experts are chosen and kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Every expert is resident; nothing is ever loaded.
    AllResident,
    /// No reuse: every expert a pass needs is loaded for that pass and dropped after it.
    OnDemand,
    /// Demand loads into free slots, evicting the least recently used expert.
    Lru,
    /// LRU among experts not in the current plan, plus draft-driven prefetch.
    Specter,
}

impl Policy {
    /// The name the command line and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Policy::AllResident => "all-resident",
            Policy::OnDemand => "ondemand",
            Policy::Lru => "lru",
            Policy::Specter => "specter",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ResidencyConfig {
    pub num_moe_layers: usize,
    pub num_experts: usize,
    /// Slots per MoE layer (ignored by [`Policy::AllResident`], which holds every expert).
    pub slots_per_layer: usize,
    /// Bytes one expert copy moves.
    pub expert_bytes: usize,
    pub policy: Policy,
}

impl ResidencyConfig {
    /// The model's MoE layers, experts and expert size with the given slots and policy.
    pub fn for_model(info: &ModelInfo, slots_per_layer: usize, policy: Policy) -> Self {
        ResidencyConfig {
            num_moe_layers: info.moe_layers.len(),
            num_experts: info.num_experts,
            slots_per_layer,
            expert_bytes: info.expert_bytes,
            policy,
        }
    }
}

/// Which experts are resident before the first pass (and again after [`ExpertCache::reset`]).
#[derive(Clone, Debug, PartialEq)]
pub enum InitialResidency {
    Empty,
    /// Experts `0..slots_per_layer` of every layer, expert `i` in slot `i`.
    FirstExperts,
    /// Per MoE layer, the resident experts from least to most recently used (in slots 0, 1, …).
    PerLayer(Vec<Vec<u32>>),
}

/// An expert pushed out of its slot to make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub expert: u32,
    /// It had been prefetched and never used: a wasted copy.
    pub unused_prefetch: bool,
}

/// A needed expert found in a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    /// Its position in the list given to [`ExpertCache::serve`].
    pub index: usize,
    pub expert: u32,
    pub slot: usize,
    /// The copy that brought it in (it may still be in flight).
    pub transfer: Option<TransferId>,
}

/// An expert to copy into a slot (a demand load or a prefetch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// Its position in the list given to [`ExpertCache::serve`] or [`ExpertCache::prefetch`].
    pub index: usize,
    pub expert: u32,
    pub slot: usize,
    pub evicted: Option<Evicted>,
}

/// A needed expert that is not resident and that the caller computes outside the slots (on the
/// host): it takes no slot and changes no recency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Elsewhere {
    /// Its position in the list given to [`ExpertCache::serve_split`].
    pub index: usize,
    pub expert: u32,
}

/// One round of a pass's layer: experts served from their slots, then experts to copy in first.
/// A pass needing more experts than the layer has slots runs in several rounds; the slots a round
/// uses are not reused within it. The first round also lists the misses served elsewhere, whole
/// or split (gate and up elsewhere, the down matrix copied outside the slots).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub hits: Vec<Hit>,
    pub loads: Vec<Load>,
    pub elsewhere: Vec<Elsewhere>,
    pub gate_up_elsewhere: Vec<Elsewhere>,
}

/// Per MoE layer: which expert each slot holds and the slot's marks.
#[derive(Clone, Debug)]
struct LayerState {
    slot_expert: Vec<Option<u32>>,
    expert_slot: Vec<Option<usize>>,
    last_use: Vec<u64>,
    /// Held by the current plan: only a demand load that finds no other slot evicts it.
    planned: Vec<bool>,
    /// Prefetched and not used yet.
    unused_prefetch: Vec<bool>,
    transfer: Vec<Option<TransferId>>,
    /// Per expert, the tick of the last pass that needed it, whichever path served it.
    last_needed: Vec<u64>,
}

impl LayerState {
    fn new(slots: usize, experts: usize) -> Self {
        LayerState {
            slot_expert: vec![None; slots],
            expert_slot: vec![None; experts],
            last_use: vec![0; slots],
            planned: vec![false; slots],
            unused_prefetch: vec![false; slots],
            transfer: vec![None; slots],
            last_needed: vec![0; experts],
        }
    }

    fn clear(&mut self) {
        self.slot_expert.iter_mut().for_each(|s| *s = None);
        self.expert_slot.iter_mut().for_each(|s| *s = None);
        self.last_use.iter_mut().for_each(|t| *t = 0);
        self.planned.iter_mut().for_each(|p| *p = false);
        self.unused_prefetch.iter_mut().for_each(|p| *p = false);
        self.transfer.iter_mut().for_each(|t| *t = None);
        self.last_needed.iter_mut().for_each(|t| *t = 0);
    }

    /// The slot a new expert goes to among those `usable`: a free one, else the least recently
    /// used (unplanned before planned when `planned_too`), the lower index on ties.
    fn victim(&self, usable: impl Fn(usize) -> bool, planned_too: bool) -> Option<usize> {
        (0..self.slot_expert.len())
            .filter(|&s| usable(s) && (planned_too || !self.planned[s]))
            .min_by_key(|&s| {
                (
                    self.planned[s],
                    self.slot_expert[s].is_some(),
                    self.last_use[s],
                    s,
                )
            })
    }

    /// Puts `expert` into `slot`, returning what it held.
    fn place(&mut self, slot: usize, expert: u32, tick: u64, prefetch: bool) -> Option<Evicted> {
        let evicted = self.slot_expert[slot].map(|old| {
            self.expert_slot[old as usize] = None;
            Evicted {
                expert: old,
                unused_prefetch: self.unused_prefetch[slot],
            }
        });
        self.slot_expert[slot] = Some(expert);
        self.expert_slot[expert as usize] = Some(slot);
        self.planned[slot] = prefetch;
        self.unused_prefetch[slot] = prefetch;
        self.transfer[slot] = None;
        if !prefetch {
            // A prefetched slot keeps its old recency until a pass uses it.
            self.last_use[slot] = tick;
        }
        evicted
    }
}

#[derive(Clone, Debug)]
pub struct ExpertCache {
    config: ResidencyConfig,
    slots: usize,
    initial: Vec<Vec<u32>>,
    layers: Vec<LayerState>,
    tick: u64,
    stats: OffloadStats,
}

impl ExpertCache {
    pub fn new(config: ResidencyConfig, initial: &InitialResidency) -> Result<Self> {
        let layers = config.num_moe_layers;
        let experts = config.num_experts;
        if layers == 0 || experts == 0 {
            return Err(Error::Request(format!(
                "expert cache needs at least one MoE layer and one expert (got {layers} layers, {experts} experts)"
            )));
        }
        let slots = match config.policy {
            Policy::AllResident => experts,
            _ => config.slots_per_layer,
        };
        if slots == 0 || slots > experts {
            return Err(Error::Request(format!(
                "resident experts per layer must be in 1..={experts}, got {slots}"
            )));
        }
        let initial_sets: Vec<Vec<u32>> = match (config.policy, initial) {
            (Policy::AllResident, _) => vec![(0..experts as u32).collect(); layers],
            // Nothing survives between passes, so nothing is resident before the first.
            (Policy::OnDemand, _) | (_, InitialResidency::Empty) => vec![Vec::new(); layers],
            (_, InitialResidency::FirstExperts) => vec![(0..slots as u32).collect(); layers],
            (_, InitialResidency::PerLayer(sets)) => {
                check_initial_sets(sets, layers, experts, slots)?;
                sets.clone()
            }
        };
        let mut cache = ExpertCache {
            stats: OffloadStats::new(config.policy.name(), slots, config.expert_bytes, layers),
            config,
            slots,
            initial: initial_sets,
            layers: vec![LayerState::new(slots, experts); layers],
            tick: 0,
        };
        cache.reset();
        Ok(cache)
    }

    pub fn config(&self) -> &ResidencyConfig {
        &self.config
    }

    pub fn policy(&self) -> Policy {
        self.config.policy
    }

    /// Slots per layer in effect (every expert under [`Policy::AllResident`]).
    pub fn slots_per_layer(&self) -> usize {
        self.slots
    }

    /// The counters since the last [`Self::reset`] or [`Self::reset_stats`].
    pub fn stats(&self) -> &OffloadStats {
        &self.stats
    }

    /// The counters, for a backend to add its own figures (bytes, seconds) to.
    pub fn stats_mut(&mut self) -> &mut OffloadStats {
        &mut self.stats
    }

    /// Zeroes the counters, keeping the configuration figures.
    pub fn reset_stats(&mut self) {
        self.stats = OffloadStats::new(
            self.config.policy.name(),
            self.slots,
            self.config.expert_bytes,
            self.config.num_moe_layers,
        );
    }

    /// Restores the initial resident set and its recency order; clears plans, prefetch marks
    /// and the counters.
    pub fn reset(&mut self) {
        self.tick = 0;
        for (layer, state) in self.layers.iter_mut().enumerate() {
            state.clear();
            for (slot, &expert) in self.initial[layer].iter().enumerate() {
                self.tick += 1;
                state.place(slot, expert, self.tick, false);
            }
        }
        self.reset_stats();
    }

    /// Slots of MoE layer `layer` holding no expert (0 for a layer out of range).
    pub fn empty_slots(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .map_or(0, |l| l.slot_expert.iter().filter(|s| s.is_none()).count())
    }

    pub fn is_resident(&self, layer: usize, expert: u32) -> bool {
        self.slot_of(layer, expert).is_some()
    }

    /// The slot holding `expert` of MoE layer `layer`.
    pub fn slot_of(&self, layer: usize, expert: u32) -> Option<usize> {
        *self.layers.get(layer)?.expert_slot.get(expert as usize)?
    }

    pub fn is_planned(&self, layer: usize, expert: u32) -> bool {
        self.slot_of(layer, expert)
            .is_some_and(|s| self.layers[layer].planned[s])
    }

    /// Resident experts of `layer`, least recently used first (slot order on ties).
    pub fn resident(&self, layer: usize) -> Vec<u32> {
        let Some(state) = self.layers.get(layer) else {
            return Vec::new();
        };
        let mut resident: Vec<(u64, usize, u32)> = (0..self.slots)
            .filter_map(|s| state.slot_expert[s].map(|e| (state.last_use[s], s, e)))
            .collect();
        resident.sort_unstable();
        resident.into_iter().map(|(_, _, e)| e).collect()
    }

    pub fn free_slots(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |state| {
            state.slot_expert.iter().filter(|s| s.is_none()).count()
        })
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut LayerState> {
        let layers = self.layers.len();
        self.layers.get_mut(layer).ok_or_else(|| {
            Error::Request(format!(
                "expert cache: MoE layer {layer} out of range ({layers} layers)"
            ))
        })
    }

    /// Decides how one layer of a target pass gets `experts` (distinct ids): rounds of hits
    /// served from their slots and loads into slots, each slot used once per round. A load takes
    /// a free slot, else the least recently used one; a planned slot only when no other is left.
    /// Counts hits, misses, prefetches used and wasted.
    pub fn serve(&mut self, layer: usize, experts: &[u32]) -> Result<Vec<Round>> {
        self.serve_split(layer, experts, &[], 0)
    }

    /// As [`Self::serve`], with up to `elsewhere` of the misses left to the caller to compute
    /// outside the slots: those used by the fewest rows (`rows[i]` for `experts[i]`), so the
    /// experts many rows share get slots; on ties those least recently needed, then the later.
    /// They are counted as `host_experts`, not as misses.
    pub fn serve_split(
        &mut self,
        layer: usize,
        experts: &[u32],
        rows: &[u32],
        elsewhere: usize,
    ) -> Result<Vec<Round>> {
        let share = HostShare {
            full: elsewhere,
            gate_up: 0,
        };
        self.serve_placed(layer, experts, rows, share)
    }

    /// As [`Self::serve_split`] with `share.full` misses left elsewhere whole and, after them in
    /// the same order, `share.gate_up` more split: their gate and up computed elsewhere and their
    /// down matrix copied outside the slots (counted as `split_experts`, two thirds of their
    /// bytes as the host's, one third as copied).
    pub fn serve_placed(
        &mut self,
        layer: usize,
        experts: &[u32],
        rows: &[u32],
        share: HostShare,
    ) -> Result<Vec<Round>> {
        let elsewhere = share.full + share.gate_up;
        let num_experts = self.config.num_experts;
        if let Some(&bad) = experts.iter().find(|&&e| e as usize >= num_experts) {
            return Err(Error::Request(format!(
                "expert cache: expert {bad} out of range ({num_experts} experts)"
            )));
        }
        let on_demand = self.config.policy == Policy::OnDemand;
        let slots = self.slots;
        let mut tick = self.tick;
        let state = self.layers.get_mut(layer).ok_or_else(|| {
            Error::Request(format!("expert cache: MoE layer {layer} out of range"))
        })?;
        if on_demand {
            state.clear();
        }
        let mut rounds = Vec::new();
        let mut pending: Vec<usize> = (0..experts.len()).collect();
        let (mut away, mut split) = (Vec::new(), Vec::new());
        if elsewhere > 0 {
            let mut misses: Vec<usize> = pending
                .iter()
                .copied()
                .filter(|&i| state.expert_slot[experts[i] as usize].is_none())
                .collect();
            // An expert the host computed leaves no copy, so one that keeps being needed (output
            // that loops, a topic's experts) would miss every time: of misses with as many rows,
            // those needed least recently go elsewhere and the recently needed are copied.
            misses.sort_by_key(|&i| {
                (
                    rows.get(i).copied().unwrap_or(1),
                    state.last_needed[experts[i] as usize],
                    std::cmp::Reverse(i),
                )
            });
            misses.truncate(elsewhere);
            let split_off = misses.split_off(misses.len().min(share.full));
            misses.sort_unstable();
            pending.retain(|i| misses.binary_search(i).is_err() && !split_off.contains(i));
            let at = |index: usize| Elsewhere {
                index,
                expert: experts[index],
            };
            away = misses.into_iter().map(at).collect();
            split = split_off.into_iter().map(at).collect();
            split.sort_unstable_by_key(|e| e.index);
        }
        let (mut used_prefetches, mut planned_hits, mut wasted) = (0u64, 0u64, 0u64);
        while !pending.is_empty() {
            tick += 1;
            let mut round = Round::default();
            let mut in_use = vec![false; slots];
            let mut rest = Vec::new();
            for &i in &pending {
                match state.expert_slot[experts[i] as usize] {
                    Some(s) if !in_use[s] => {
                        in_use[s] = true;
                        state.last_use[s] = tick;
                        if std::mem::take(&mut state.unused_prefetch[s]) {
                            used_prefetches += 1;
                        }
                        if state.planned[s] {
                            planned_hits += 1;
                        }
                        round.hits.push(Hit {
                            index: i,
                            expert: experts[i],
                            slot: s,
                            transfer: state.transfer[s],
                        });
                    }
                    _ => rest.push(i),
                }
            }
            let mut deferred = Vec::new();
            for i in rest {
                match state.victim(|s| !in_use[s], true) {
                    Some(s) => {
                        in_use[s] = true;
                        let evicted = state.place(s, experts[i], tick, false);
                        if evicted.is_some_and(|e| e.unused_prefetch) {
                            wasted += 1;
                        }
                        round.loads.push(Load {
                            index: i,
                            expert: experts[i],
                            slot: s,
                            evicted,
                        });
                    }
                    None => deferred.push(i),
                }
            }
            pending = deferred;
            rounds.push(round);
        }
        let split_count = split.len() as u64;
        if !away.is_empty() || !split.is_empty() {
            if rounds.is_empty() {
                rounds.push(Round::default());
            }
            rounds[0].elsewhere = away;
            rounds[0].gate_up_elsewhere = split;
        }
        tick += 1;
        for &e in experts {
            state.last_needed[e as usize] = tick;
        }
        self.tick = tick;
        let hits: u64 = rounds.iter().map(|r| r.hits.len() as u64).sum();
        let misses: u64 = rounds.iter().map(|r| r.loads.len() as u64).sum();
        let host = rounds.first().map_or(0, |r| r.elsewhere.len() as u64);
        let s = &mut self.stats;
        let third = self.config.expert_bytes as u64 / 3;
        s.host_experts += host;
        s.host_bytes += host * self.config.expert_bytes as u64 + split_count * 2 * third;
        s.split_experts += split_count;
        s.bytes_copied += split_count * third;
        s.lookups += experts.len() as u64;
        s.hits += hits;
        s.misses += misses;
        s.experts_copied += misses;
        s.layer_hits[layer] += hits;
        s.layer_misses[layer] += misses;
        s.target_needed += experts.len() as u64;
        s.target_planned += planned_hits;
        s.prefetch_used += used_prefetches;
        s.prefetch_wasted += wasted;
        s.bytes_copied += misses * self.config.expert_bytes as u64;
        Ok(rounds)
    }

    /// Takes `ranked` (most wanted first) as the plan of `layer`: resident ones are protected
    /// from eviction until [`Self::clear_plans`]; missing ones get slots that are free or hold
    /// unplanned experts (least recently used first), until none is left. Returns the loads to
    /// issue; each counts as a prefetch.
    pub fn prefetch(&mut self, layer: usize, ranked: &[u32]) -> Result<Vec<Load>> {
        let num_experts = self.config.num_experts;
        let tick = self.tick;
        let state = self.layer_mut(layer)?;
        let mut loads = Vec::new();
        let mut wasted = 0u64;
        for (i, &e) in ranked.iter().enumerate() {
            if e as usize >= num_experts {
                return Err(Error::Request(format!(
                    "prefetch: expert {e} out of range ({num_experts} experts)"
                )));
            }
            if let Some(s) = state.expert_slot[e as usize] {
                state.planned[s] = true;
                continue;
            }
            let Some(s) = state.victim(|_| true, false) else {
                break;
            };
            let evicted = state.place(s, e, tick, true);
            if evicted.is_some_and(|ev| ev.unused_prefetch) {
                wasted += 1;
            }
            loads.push(Load {
                index: i,
                expert: e,
                slot: s,
                evicted,
            });
        }
        self.stats.prefetched += loads.len() as u64;
        self.stats.experts_copied += loads.len() as u64;
        self.stats.prefetch_wasted += wasted;
        let bytes = loads.len() as u64 * self.config.expert_bytes as u64;
        self.stats.bytes_copied += bytes;
        self.stats.prefetch_bytes += bytes;
        Ok(loads)
    }

    /// Records the copy that is bringing the expert in `slot` of `layer` in.
    pub fn attach_transfer(&mut self, layer: usize, slot: usize, transfer: TransferId) {
        if let Some(t) = self
            .layers
            .get_mut(layer)
            .and_then(|s| s.transfer.get_mut(slot))
        {
            *t = Some(transfer);
        }
    }

    /// Ends the current plan (after the verify pass it was for): its experts become ordinary
    /// LRU residents.
    pub fn clear_plans(&mut self) {
        for state in &mut self.layers {
            state.planned.iter_mut().for_each(|p| *p = false);
        }
    }

    /// Clears the "prefetched, not used yet" mark everywhere and counts those experts as wasted
    /// prefetches; returns how many there were.
    pub fn take_unused_prefetches(&mut self) -> usize {
        let mut n = 0;
        for state in &mut self.layers {
            for (slot, mark) in state.unused_prefetch.iter_mut().enumerate() {
                if state.slot_expert[slot].is_some() && std::mem::take(mark) {
                    n += 1;
                }
            }
        }
        self.stats.prefetch_wasted += n as u64;
        n
    }
}

fn check_initial_sets(
    sets: &[Vec<u32>],
    layers: usize,
    experts: usize,
    slots: usize,
) -> Result<()> {
    if sets.len() != layers {
        return Err(Error::Request(format!(
            "initial residency lists {} layers, the model has {layers} MoE layers",
            sets.len()
        )));
    }
    for (layer, set) in sets.iter().enumerate() {
        if set.len() > slots {
            return Err(Error::Request(format!(
                "initial residency of MoE layer {layer} lists {} experts for {slots} slots",
                set.len()
            )));
        }
        let mut seen = vec![false; experts];
        for &expert in set {
            let index = expert as usize;
            if index >= experts {
                return Err(Error::Request(format!(
                    "initial residency of MoE layer {layer}: expert {expert} is out of range (model has {experts})"
                )));
            }
            if std::mem::replace(&mut seen[index], true) {
                return Err(Error::Request(format!(
                    "initial residency of MoE layer {layer} lists expert {expert} twice"
                )));
            }
        }
    }
    Ok(())
}
