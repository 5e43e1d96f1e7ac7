//! Per-layer expert slots: which FP16 experts are resident, in what LRU order, which are protected
//! by the current prefetch plan, and which were prefetched but not used yet.

use super::transfer::TransferId;
use crate::model::ModelInfo;
use crate::{Error, Result};

/// How resident experts are chosen and kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

#[derive(Clone, Debug, PartialEq)]
pub struct ResidencyConfig {
    pub num_moe_layers: usize,
    pub num_experts: usize,
    /// Device slots per MoE layer (ignored by [`Policy::AllResident`], which holds every expert).
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
    /// Experts `0..slots_per_layer` of every layer.
    FirstExperts,
    /// Per MoE layer, the resident experts from least to most recently used.
    PerLayer(Vec<Vec<u32>>),
}

/// What a lookup found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Resident. `transfer` is the copy that brought it in (it may still be in flight);
    /// `first_use_of_prefetch` is set the first time a prefetched expert is used.
    Hit {
        transfer: Option<TransferId>,
        first_use_of_prefetch: bool,
    },
    Miss,
}

/// Why an expert is being inserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadKind {
    Demand,
    Prefetch,
}

/// An expert pushed out to make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub expert: u32,
    /// It had been prefetched and never used: a wasted copy.
    pub unused_prefetch: bool,
}

/// What an insertion did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    Inserted {
        evicted: Option<Evicted>,
    },
    AlreadyResident,
    /// Every slot holds a planned expert: nothing may be evicted, so the expert can only be
    /// streamed through a transient buffer for this use.
    NoSlot,
}

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    resident: bool,
    last_use: u64,
    planned: bool,
    unused_prefetch: bool,
    transfer: Option<TransferId>,
}

#[derive(Clone, Debug)]
pub struct ExpertCache {
    config: ResidencyConfig,
    slots: usize,
    initial: Vec<Vec<u32>>,
    /// `[layer][expert]`.
    entries: Vec<Vec<Entry>>,
    resident_count: Vec<usize>,
    tick: u64,
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
                sets.clone()
            }
        };
        let mut cache = ExpertCache {
            config,
            slots,
            initial: initial_sets,
            entries: vec![vec![Entry::default(); experts]; layers],
            resident_count: vec![0; layers],
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

    /// Restores the initial resident set and its LRU order; clears plans and prefetch marks.
    pub fn reset(&mut self) {
        self.tick = 0;
        for (layer, entries) in self.entries.iter_mut().enumerate() {
            entries.iter_mut().for_each(|e| *e = Entry::default());
            for &expert in &self.initial[layer] {
                self.tick += 1;
                entries[expert as usize] = Entry {
                    resident: true,
                    last_use: self.tick,
                    ..Entry::default()
                };
            }
            self.resident_count[layer] = self.initial[layer].len();
        }
    }

    fn entry(&self, layer: usize, expert: u32) -> Option<&Entry> {
        self.entries.get(layer)?.get(expert as usize)
    }

    pub fn is_resident(&self, layer: usize, expert: u32) -> bool {
        self.entry(layer, expert).is_some_and(|e| e.resident)
    }

    pub fn is_planned(&self, layer: usize, expert: u32) -> bool {
        self.entry(layer, expert).is_some_and(|e| e.planned)
    }

    /// Resident experts of `layer`, least recently used first.
    pub fn resident(&self, layer: usize) -> Vec<u32> {
        let Some(entries) = self.entries.get(layer) else {
            return Vec::new();
        };
        let mut resident: Vec<(u64, u32)> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.resident)
            .map(|(expert, e)| (e.last_use, expert as u32))
            .collect();
        resident.sort_unstable();
        resident.into_iter().map(|(_, expert)| expert).collect()
    }

    pub fn free_slots(&self, layer: usize) -> usize {
        self.resident_count
            .get(layer)
            .map_or(0, |&n| self.slots - n)
    }

    /// Looks `expert` up, marking it most recently used when resident.
    pub fn lookup(&mut self, layer: usize, expert: u32) -> Lookup {
        self.tick += 1;
        let tick = self.tick;
        match self
            .entries
            .get_mut(layer)
            .and_then(|l| l.get_mut(expert as usize))
        {
            Some(entry) if entry.resident => {
                entry.last_use = tick;
                let first_use_of_prefetch = std::mem::take(&mut entry.unused_prefetch);
                Lookup::Hit {
                    transfer: entry.transfer,
                    first_use_of_prefetch,
                }
            }
            _ => Lookup::Miss,
        }
    }

    /// The expert [`ExpertCache::insert`] would evict from a full `layer`: the least recently
    /// used one not protected by the plan.
    pub fn eviction_candidate(&self, layer: usize) -> Option<u32> {
        self.entries
            .get(layer)?
            .iter()
            .enumerate()
            .filter(|(_, e)| e.resident && !e.planned)
            .min_by_key(|(_, e)| e.last_use)
            .map(|(expert, _)| expert as u32)
    }

    /// Makes `expert` resident (most recently used), evicting the LRU unplanned expert when the
    /// layer is full. Out-of-range ids are refused as [`Insert::NoSlot`].
    pub fn insert(
        &mut self,
        layer: usize,
        expert: u32,
        kind: LoadKind,
        transfer: Option<TransferId>,
    ) -> Insert {
        if self.entry(layer, expert).is_none() {
            return Insert::NoSlot;
        }
        if self.is_resident(layer, expert) {
            return Insert::AlreadyResident;
        }
        let mut evicted = None;
        if self.resident_count[layer] >= self.slots {
            let Some(victim) = self.eviction_candidate(layer) else {
                return Insert::NoSlot;
            };
            let entry = &mut self.entries[layer][victim as usize];
            evicted = Some(Evicted {
                expert: victim,
                unused_prefetch: entry.unused_prefetch,
            });
            *entry = Entry::default();
            self.resident_count[layer] -= 1;
        }
        self.tick += 1;
        let entry = &mut self.entries[layer][expert as usize];
        *entry = Entry {
            resident: true,
            last_use: self.tick,
            planned: entry.planned,
            unused_prefetch: kind == LoadKind::Prefetch,
            transfer,
        };
        self.resident_count[layer] += 1;
        Insert::Inserted { evicted }
    }

    /// Evicts `expert` unless it is planned or not resident; returns what was evicted.
    pub fn evict(&mut self, layer: usize, expert: u32) -> Option<Evicted> {
        let entry = self.entries.get_mut(layer)?.get_mut(expert as usize)?;
        if !entry.resident || entry.planned {
            return None;
        }
        let evicted = Evicted {
            expert,
            unused_prefetch: entry.unused_prefetch,
        };
        *entry = Entry::default();
        self.resident_count[layer] -= 1;
        Some(evicted)
    }

    /// Records the copy that is bringing a resident expert in.
    pub fn attach_transfer(&mut self, layer: usize, expert: u32, transfer: TransferId) {
        if let Some(entry) = self
            .entries
            .get_mut(layer)
            .and_then(|l| l.get_mut(expert as usize))
        {
            if entry.resident {
                entry.transfer = Some(transfer);
            }
        }
    }

    /// Replaces the plan of `layer`: these experts are not evicted until the plan changes.
    /// Out-of-range ids are ignored.
    pub fn set_plan(&mut self, layer: usize, experts: &[u32]) {
        let Some(entries) = self.entries.get_mut(layer) else {
            return;
        };
        entries.iter_mut().for_each(|e| e.planned = false);
        for &expert in experts {
            if let Some(entry) = entries.get_mut(expert as usize) {
                entry.planned = true;
            }
        }
    }

    /// Drops every plan (after the verify pass the plan was for).
    pub fn clear_plans(&mut self) {
        self.entries
            .iter_mut()
            .flatten()
            .for_each(|e| e.planned = false);
    }

    /// Clears the "prefetched, not used yet" mark everywhere; returns how many experts had it
    /// (prefetches their verify pass never used).
    pub fn take_unused_prefetches(&mut self) -> usize {
        self.entries
            .iter_mut()
            .flatten()
            .filter(|e| e.resident && e.unused_prefetch)
            .map(|e| e.unused_prefetch = false)
            .count()
    }

    /// Drops every resident expert: [`Policy::OnDemand`] keeps nothing between passes.
    pub fn drop_all(&mut self) {
        self.entries
            .iter_mut()
            .flatten()
            .for_each(|e| *e = Entry::default());
        self.resident_count.iter_mut().for_each(|n| *n = 0);
    }
}
