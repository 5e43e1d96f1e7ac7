//! [`OffloadStats`]: what an expert cache did, the same type for the GPU and the simulator. The
//! cache policy counts lookups, hits, misses and prefetches; the GPU adds copy times and the copy
//! path, the simulator its simulated clock.

/// Counters since the last reset. Lookups count each (target pass, MoE layer, expert) once.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct OffloadStats {
    /// The cache policy's name.
    pub policy: String,
    /// Where copies come from: `registered-mmap` or `pinned-staging` on a GPU, `simulated` in
    /// the simulator.
    pub path: String,
    pub slots_per_layer: usize,
    /// Bytes of one slot (one expert's gate, up and down).
    pub slot_bytes: usize,
    /// VRAM held by all slots (0 in the simulator).
    pub slot_vram_bytes: usize,
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Bytes copied into slots, demand loads and prefetches together.
    pub bytes_copied: u64,
    /// Time the copy stream spent copying (device events), seconds; 0 in the simulator.
    pub copy_seconds: f64,
    /// Experts copied ahead of the verify pass by the draft-driven plan.
    pub prefetched: u64,
    /// Of those, the ones a target pass then used.
    pub prefetch_used: u64,
    /// Prefetched experts evicted, or left unused by the verify pass they were for.
    pub prefetch_wasted: u64,
    /// Distinct experts target passes needed (summed over passes and layers) ...
    pub target_needed: u64,
    /// ... and how many of them the current plan held.
    pub target_planned: u64,
    /// Bytes copied by prefetches (the rest of `bytes_copied` were demand loads).
    pub prefetch_bytes: u64,
    /// Copy-stream time of the prefetches, seconds.
    pub prefetch_copy_seconds: f64,
    /// Of that, the time before the verify pass that followed started on the compute stream:
    /// copy time hidden behind drafting (device events).
    pub prefetch_hidden_seconds: f64,
    /// Seconds the background registration of the expert sections took (0 until it is done, and
    /// without registration); copies go through staging until then.
    pub registration_seconds: f64,
    /// Needed experts computed on the host instead of copied in (not counted as misses), and
    /// the expert bytes the host read for them.
    pub host_experts: u64,
    pub host_bytes: u64,
    /// Wall-clock seconds of host expert work (inputs down, compute, outputs up).
    pub host_seconds: f64,
    /// Target-pass hits and misses per MoE layer.
    pub layer_hits: Vec<u64>,
    pub layer_misses: Vec<u64>,
    /// Simulator: seconds target passes waited for copies on the simulated clock.
    pub stall_s: f64,
    /// Simulator: simulated compute seconds (draft steps and target passes).
    pub compute_s: f64,
    /// Simulator: the simulated clock at the last commit.
    pub simulated_s: f64,
    /// Simulator: tokens committed.
    pub committed_tokens: u64,
    /// Simulator: `(t_last_commit - t_first_commit) / (committed_tokens - 1)`, milliseconds.
    pub simulated_tpot_ms: f64,
}

impl OffloadStats {
    /// Zeroed counters of a cache with these settings.
    pub fn new(policy: &str, slots_per_layer: usize, slot_bytes: usize, moe_layers: usize) -> Self {
        OffloadStats {
            policy: policy.to_string(),
            slots_per_layer,
            slot_bytes,
            layer_hits: vec![0; moe_layers],
            layer_misses: vec![0; moe_layers],
            ..Default::default()
        }
    }

    /// Prefetched experts that were used, over those prefetched.
    pub fn prefetch_precision(&self) -> f64 {
        ratio(self.prefetch_used, self.prefetched)
    }

    /// Experts target passes needed that the plan held, over those needed.
    pub fn prefetch_recall(&self) -> f64 {
        ratio(self.target_planned, self.target_needed)
    }

    /// Hit rate of each MoE layer (layers without lookups are left out), in layer order.
    pub fn layer_hit_rates(&self) -> Vec<f64> {
        self.layer_hits
            .iter()
            .zip(&self.layer_misses)
            .filter(|(h, m)| **h + **m > 0)
            .map(|(&h, &m)| h as f64 / (h + m) as f64)
            .collect()
    }

    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.hits + self.misses)
    }

    /// Bytes per second while the copy stream was busy.
    pub fn copy_bandwidth(&self) -> f64 {
        if self.copy_seconds > 0.0 {
            self.bytes_copied as f64 / self.copy_seconds
        } else {
            0.0
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}
