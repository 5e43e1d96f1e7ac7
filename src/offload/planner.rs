//! The prefetch planner: counts the draft's routing per MoE layer during a draft window and, at
//! chunk boundaries, ranks the experts the verify pass will most likely need.
//!
//! Chunking: the first plan comes after about a fifth of the window (enough routing to rank on,
//! early enough for the copies to hide behind the rest); each later boundary is placed so that the
//! draft steps until then take as long as the bytes just issued take to copy. The last draft step
//! always closes a chunk, so the verify pass sees a plan built from the whole window.

use super::cache::ExpertCache;

/// SpecMoEOff's prefetch rule counts the draft's routing over this many draft steps of a window
/// (steps 0 and 1) and prefetches after each of them.
pub const FREQUENCY_STEPS: usize = 2;

/// SpecMoEOff's Top-M: the experts per layer prefetched after draft steps 0 and 1, given the
/// layer's cache slots and the model's top-k. Two single-row draft steps route to at most
/// `2 * top_k` distinct experts, so a larger M adds nothing (experts never routed are never
/// planned); and a plan is protected from eviction, so it may not exceed the slots.
pub fn frequency_top_m(slots_per_layer: usize, top_k: usize) -> usize {
    slots_per_layer.min(2 * top_k.max(1))
}

/// A plan for the coming verify pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Per MoE layer, the experts to hold (most likely first): protected from eviction.
    pub experts: Vec<Vec<u32>>,
    /// `(moe_layer, expert)` pairs of planned experts not resident yet, layer by layer (the
    /// order the verify pass needs them in).
    pub prefetch: Vec<(usize, u32)>,
}

/// Per-layer routing counts of one draft window, and the chunk schedule.
#[derive(Clone, Debug)]
pub struct Planner {
    num_moe_layers: usize,
    num_experts: usize,
    /// `[layer * num_experts + expert]`.
    counts: Vec<u32>,
    depth: usize,
    next_boundary: usize,
    draft_step_s: f64,
    bandwidth_bytes_per_s: f64,
}

impl Planner {
    /// `draft_step_s` and `bandwidth_bytes_per_s` are the estimates the chunk schedule uses.
    pub fn new(
        num_moe_layers: usize,
        num_experts: usize,
        draft_step_s: f64,
        bandwidth_bytes_per_s: f64,
    ) -> Self {
        Planner {
            num_moe_layers,
            num_experts,
            counts: vec![0; num_moe_layers * num_experts],
            depth: 0,
            next_boundary: 0,
            draft_step_s,
            bandwidth_bytes_per_s,
        }
    }

    /// A new estimate of a draft step's time (measured as decoding runs).
    pub fn set_draft_step_seconds(&mut self, draft_step_s: f64) {
        self.draft_step_s = draft_step_s;
    }

    /// Starts a window of `depth` draft steps: counts restart from zero.
    pub fn begin_window(&mut self, depth: usize) {
        self.counts.iter_mut().for_each(|c| *c = 0);
        self.depth = depth;
        self.next_boundary = depth.div_ceil(5).max(1);
    }

    /// Counts one draft pass's routing at MoE layer `moe_layer` (`topk` is `[rows, top_k]`).
    /// Returns false, counting nothing, when the layer or an expert id is out of range.
    pub fn record(&mut self, moe_layer: usize, topk: &[u32]) -> bool {
        if moe_layer >= self.num_moe_layers || topk.iter().any(|&e| e as usize >= self.num_experts)
        {
            return false;
        }
        let row =
            &mut self.counts[moe_layer * self.num_experts..(moe_layer + 1) * self.num_experts];
        for &expert in topk {
            row[expert as usize] += 1;
        }
        true
    }

    /// Replaces the window's counts with `counts` (`[moe layers, experts]`, as counted on a
    /// device). Returns false, changing nothing, when the length does not match.
    pub fn set_counts(&mut self, counts: &[u32]) -> bool {
        if counts.len() != self.counts.len() {
            return false;
        }
        self.counts.copy_from_slice(counts);
        true
    }

    /// How often the current window's draft routed `moe_layer` to `expert`.
    pub fn count(&self, moe_layer: usize, expert: u32) -> u32 {
        if moe_layer >= self.num_moe_layers || expert as usize >= self.num_experts {
            return 0;
        }
        self.counts[moe_layer * self.num_experts + expert as usize]
    }

    /// Whether a plan is due once `steps_done` draft steps of the window have run.
    pub fn is_boundary(&self, steps_done: usize) -> bool {
        steps_done > 0 && (steps_done == self.next_boundary || steps_done == self.depth)
    }

    /// Per MoE layer, the routed experts ranked by count (most first, lower id on ties), at most
    /// `limit_per_layer` of them.
    pub fn plan(&self, limit_per_layer: usize) -> Vec<Vec<u32>> {
        (0..self.num_moe_layers)
            .map(|layer| {
                let row = &self.counts[layer * self.num_experts..(layer + 1) * self.num_experts];
                let mut ranked: Vec<u32> = (0..self.num_experts as u32)
                    .filter(|&e| row[e as usize] > 0)
                    .collect();
                ranked.sort_by_key(|&e| std::cmp::Reverse(row[e as usize]));
                ranked.truncate(limit_per_layer);
                ranked
            })
            .collect()
    }

    /// The plan against `cache`: per layer the top-ranked experts, as many as the layer has
    /// slots (planned experts replace the previous plan, so every slot is free or evictable for
    /// them), and the missing ones to prefetch.
    pub fn plan_for(&self, cache: &ExpertCache) -> Plan {
        self.plan_for_at_most(cache, cache.slots_per_layer())
    }

    /// As [`Self::plan_for`] with at most `limit_per_layer` experts per layer (never more than
    /// the layer's slots).
    pub fn plan_for_at_most(&self, cache: &ExpertCache, limit_per_layer: usize) -> Plan {
        let experts = self.plan(limit_per_layer.min(cache.slots_per_layer()));
        let prefetch = experts
            .iter()
            .enumerate()
            .flat_map(|(layer, planned)| {
                planned
                    .iter()
                    .filter(move |&&e| !cache.is_resident(layer, e))
                    .map(move |&e| (layer, e))
            })
            .collect();
        Plan { experts, prefetch }
    }

    /// Records that a plan at `steps_done` issued `bytes` of copies; the next boundary comes once
    /// the draft has run long enough to hide them (at least one step later).
    pub fn issued(&mut self, steps_done: usize, bytes: usize) {
        let copy_s = bytes as f64 / self.bandwidth_bytes_per_s;
        let steps = if self.draft_step_s > 0.0 && copy_s.is_finite() {
            // The small slack keeps an exact fit from rounding up to an extra step.
            (copy_s / self.draft_step_s - 1e-9).ceil().max(1.0)
        } else {
            1.0
        };
        // Saturating: a huge copy just means no further boundary before the window's end.
        self.next_boundary = steps_done.saturating_add(steps.min(usize::MAX as f64) as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_by_count_and_schedules_chunks() {
        let mut planner = Planner::new(2, 6, 1e-3, 1e9);
        planner.begin_window(10);
        assert!(!planner.is_boundary(1));
        assert!(planner.is_boundary(2)); // ceil(10 / 5)
        assert!(planner.record(0, &[3, 1, 3, 5]));
        assert!(planner.record(1, &[2, 2]));
        assert!(!planner.record(1, &[6]));
        assert!(!planner.record(2, &[0]));
        assert_eq!(planner.plan(2), vec![vec![3, 1], vec![2]]);
        // 3 MB at 1 GB/s is 3 ms: three 1 ms draft steps hide it.
        planner.issued(2, 3_000_000);
        assert!(!planner.is_boundary(3) && !planner.is_boundary(4));
        assert!(planner.is_boundary(5));
        assert!(planner.is_boundary(10));
        planner.begin_window(3);
        assert_eq!(planner.count(0, 3), 0);
        assert!(planner.is_boundary(1));
    }
}
