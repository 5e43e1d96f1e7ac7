//! [`OffloadStats`]: what an expert cache did, the same type for the GPU and the simulator. The
//! cache policy counts lookups, hits, misses and prefetches; the GPU adds copy times and the copy
//! path, the simulator its simulated clock.
//!
//! A missing expert takes one of two paths, each with its experts, bytes, seconds and stalls:
//!
//! | path | experts | bytes | busy seconds | stall seconds |
//! |---|---|---|---|---|
//! | link (copied into a slot) | `experts_copied` | `bytes_copied` | `copy_seconds` | `link_stall_seconds` |
//! | host (computed in place) | `host_experts` | `host_bytes` | `host_seconds` | `host_stall_seconds` |
//!
//! Busy seconds are the path's own time (copy stream, host threads); stall seconds are the part of
//! it the decode waited for: what overlapping the two paths with the GPU's work did not hide.

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
    /// Experts copied into slots (the link path): demand loads (`misses`) and prefetches.
    pub experts_copied: u64,
    /// Bytes copied into slots, demand loads and prefetches together.
    pub bytes_copied: u64,
    /// Time the copy stream spent copying (device events), seconds; 0 in the simulator. With a
    /// link pace, the paced time.
    pub copy_seconds: f64,
    /// Time the compute stream waited for demand copies to land (device events: from when it
    /// reached the wait to the copies' end, where positive), seconds; prefetches still landing
    /// are not counted. In the simulator: `stall_s`, prefetches included.
    pub link_stall_seconds: f64,
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
    /// Needed experts split between the paths: their gate and up computed on the host, their
    /// down matrix copied (two thirds of their bytes are in `host_bytes`, one third in
    /// `bytes_copied`).
    pub split_experts: u64,
    /// Seconds the host expert kernel ran (its own wall time, per layer summed).
    pub host_seconds: f64,
    /// Wall-clock seconds the decode thread waited for host expert work after it had issued all
    /// of the layer's GPU work; 0 in the simulator.
    pub host_stall_seconds: f64,
    /// Wall-clock seconds the decode thread waited for MoE layers' routing to reach the host
    /// (the device's work before each layer's router included), for every pass that routes on
    /// the host (target passes of offloaded layers; draft passes whose routing a prefetcher
    /// counts on the host); 0 in the simulator.
    pub route_wait_seconds: f64,
    /// Wall-clock seconds the decode thread spent on layers the host path served between their
    /// routing and the host work's start (placement, the experts' inputs gathered) and after the
    /// host work (its outputs sent up, the split experts' down launched): the layers' serial
    /// host-side cost beside `route_wait_seconds`; 0 in the simulator.
    pub dispatch_seconds: f64,
    pub finish_seconds: f64,
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

/// One path's share of the missing experts (see the table at the top of this file).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PathFigures {
    pub experts: u64,
    pub bytes: u64,
    /// The path's busy time, seconds.
    pub seconds: f64,
    /// The time the decode waited for it, seconds.
    pub stall_seconds: f64,
}

/// Both paths of the missing experts side by side.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PathTelemetry {
    pub link: PathFigures,
    pub host: PathFigures,
}

impl OffloadStats {
    /// The link's and the host's experts, bytes, seconds and stalls.
    pub fn paths(&self) -> PathTelemetry {
        PathTelemetry {
            link: PathFigures {
                experts: self.experts_copied,
                bytes: self.bytes_copied,
                seconds: self.copy_seconds,
                stall_seconds: self.link_stall_seconds,
            },
            host: PathFigures {
                experts: self.host_experts,
                bytes: self.host_bytes,
                seconds: self.host_seconds,
                stall_seconds: self.host_stall_seconds,
            },
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paths_gather_each_sides_figures() {
        let s = OffloadStats {
            experts_copied: 3,
            bytes_copied: 300,
            copy_seconds: 0.5,
            link_stall_seconds: 0.25,
            host_experts: 2,
            host_bytes: 200,
            host_seconds: 0.75,
            host_stall_seconds: 0.125,
            ..OffloadStats::new("lru", 4, 100, 2)
        };
        let p = s.paths();
        assert_eq!(
            p.link,
            PathFigures {
                experts: 3,
                bytes: 300,
                seconds: 0.5,
                stall_seconds: 0.25
            }
        );
        assert_eq!(
            p.host,
            PathFigures {
                experts: 2,
                bytes: 200,
                seconds: 0.75,
                stall_seconds: 0.125
            }
        );
        assert_eq!(s.copy_bandwidth(), 600.0);
    }
}
