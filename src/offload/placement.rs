//! Where a layer's missing experts are computed: copied over the link into slots, or read in
//! place by the host expert kernel. The two paths run at once, so the split that finishes both
//! together is the one whose shares are proportional to their rates; the rates are measured as the
//! run goes (the host's per expert call, the link's from the copies' device timings).
//!
//! Whole experts split a layer's few misses coarsely (three misses at equal rates give one path
//! twice the other's bytes), so one miss may also be split between the paths: the host computes
//! its gate and up (two thirds of its bytes) and the link copies its down matrix, which the GPU
//! applies to the host's activations. Shares then move in thirds of an expert.

/// How a layer's misses are divided: `full` experts computed on the host, and `gate_up` (0 or 1)
/// more whose gate and up the host computes while the link copies their down matrix; the rest
/// are copied whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostShare {
    pub full: usize,
    pub gate_up: usize,
}

impl HostShare {
    /// This share of a layer's `misses`, leaving at least `empty_slots` of them to the link: an
    /// expert the host computes leaves no copy behind, while a copy into an empty slot evicts
    /// nothing and serves every later use, so a layer's empty slots are filled first (a cold
    /// cache warms as plain LRU's would) and the host takes only misses beyond them.
    pub fn leaving_room(self, misses: usize, empty_slots: usize) -> HostShare {
        let room = misses.saturating_sub(empty_slots);
        let full = self.full.min(room);
        HostShare {
            full,
            gate_up: self.gate_up.min(room - full),
        }
    }
}

/// What splitting an expert costs beyond its bytes: the down product's launch after the host's
/// activations arrive, and their copy up (seconds).
const SPLIT_OVERHEAD_S: f64 = 10e-6;

/// The measured rates of both paths and the split they give.
#[derive(Clone, Debug)]
pub struct HostSplit {
    link_bytes_per_s: f64,
    host_bytes_per_s: f64,
    /// Layers with misses since each path last got a share of them.
    layers_without_host: usize,
    layers_without_link: usize,
}

/// Weight of a new measurement in the running rate.
const SMOOTHING: f64 = 0.25;

/// A measurement moves the running rate as if it were at most this factor away from it: one
/// layer whose host threads were descheduled (or whose copies waited behind another process's)
/// must not teach the split that a path is ten times slower, while a path that really is slower
/// still reaches its rate within a few dozen layers.
const MAX_STEP: f64 = 2.0;

/// A path left without work for this many layers with misses gets a share again, so its rate is
/// measured anew: a rate learned low would otherwise never be corrected.
const PROBE_AFTER_LAYERS: usize = 16;

impl HostSplit {
    /// Starts from estimates of both rates (bytes per second, positive).
    pub fn new(link_bytes_per_s: f64, host_bytes_per_s: f64) -> Self {
        HostSplit {
            link_bytes_per_s: link_bytes_per_s.max(1.0),
            host_bytes_per_s: host_bytes_per_s.max(1.0),
            layers_without_host: 0,
            layers_without_link: 0,
        }
    }

    /// The division of a layer's `misses` ([`Self::host_share_split`]), except that a path
    /// left without work for [`PROBE_AFTER_LAYERS`] layers gets some: the smallest share the
    /// placement allows (a split expert's gate and up or down, else a whole expert).
    pub fn place(&mut self, misses: usize, expert_bytes: usize, may_split: bool) -> HostShare {
        let mut share = self.host_share_split(misses, expert_bytes, may_split);
        if misses == 0 {
            return share;
        }
        let host_works = |s: &HostShare| s.full + s.gate_up > 0;
        // The link copies whole experts the host leaves, and a split expert's down.
        let link_works = |s: &HostShare| s.full < misses;
        if !host_works(&share) && self.layers_without_host >= PROBE_AFTER_LAYERS {
            share = match may_split {
                true => HostShare {
                    full: 0,
                    gate_up: 1,
                },
                false => HostShare {
                    full: 1,
                    gate_up: 0,
                },
            };
        } else if !link_works(&share) && self.layers_without_link >= PROBE_AFTER_LAYERS {
            share = match (may_split, misses) {
                (true, _) => HostShare {
                    full: misses - 1,
                    gate_up: 1,
                },
                (false, 1) => HostShare::default(),
                (false, _) => HostShare {
                    full: misses - 1,
                    gate_up: 0,
                },
            };
        }
        self.layers_without_host = match host_works(&share) {
            true => 0,
            false => self.layers_without_host + 1,
        };
        self.layers_without_link = match link_works(&share) {
            true => 0,
            false => self.layers_without_link + 1,
        };
        share
    }

    /// Of `misses` experts of equal size, how many the host should compute so that it and the
    /// link finish together.
    pub fn host_share(&self, misses: usize) -> usize {
        let share = self.host_bytes_per_s / (self.host_bytes_per_s + self.link_bytes_per_s);
        ((misses as f64 * share).round() as usize).min(misses)
    }

    /// Of `misses` experts of `expert_bytes` each, the division that finishes both paths soonest
    /// at the current rates, shares moving in thirds of an expert when `may_split`.
    pub fn host_share_split(
        &self,
        misses: usize,
        expert_bytes: usize,
        may_split: bool,
    ) -> HostShare {
        let e = expert_bytes as f64;
        let time = |host_thirds: usize| {
            let host = host_thirds as f64 * e / 3.0;
            let link = misses as f64 * e - host;
            (host / self.host_bytes_per_s).max(link / self.link_bytes_per_s)
        };
        let mut best = (HostShare::default(), time(0));
        for full in 0..=misses {
            let whole = (HostShare { full, gate_up: 0 }, time(3 * full));
            let split = (full < misses && may_split).then(|| {
                (
                    HostShare { full, gate_up: 1 },
                    time(3 * full + 2) + SPLIT_OVERHEAD_S,
                )
            });
            for (share, t) in std::iter::once(whole).chain(split) {
                if t < best.1 {
                    best = (share, t);
                }
            }
        }
        best.0
    }

    /// The host computed `bytes` of expert weights in `seconds`.
    pub fn record_host(&mut self, bytes: u64, seconds: f64) {
        if bytes > 0 && seconds > 0.0 {
            self.host_bytes_per_s = blend(self.host_bytes_per_s, bytes as f64 / seconds);
        }
    }

    /// The link copied `bytes` in `seconds` of copy-stream time.
    pub fn record_link(&mut self, bytes: u64, seconds: f64) {
        if bytes > 0 && seconds > 0.0 {
            self.link_bytes_per_s = blend(self.link_bytes_per_s, bytes as f64 / seconds);
        }
    }

    pub fn host_bytes_per_s(&self) -> f64 {
        self.host_bytes_per_s
    }

    pub fn link_bytes_per_s(&self) -> f64 {
        self.link_bytes_per_s
    }
}

fn blend(old: f64, new: f64) -> f64 {
    let new = new.clamp(old / MAX_STEP, old * MAX_STEP);
    old + SMOOTHING * (new - old)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_slots_are_filled_over_the_link_before_the_host_takes_misses() {
        let share = HostShare {
            full: 3,
            gate_up: 1,
        };
        // Six misses and no empty slot: the share as it was.
        assert_eq!(share.leaving_room(6, 0), share);
        // Two empty slots leave four misses the host may take: still the whole share.
        assert_eq!(share.leaving_room(6, 2), share);
        // Three: whole experts first, the split one goes.
        assert_eq!(
            share.leaving_room(6, 3),
            HostShare {
                full: 3,
                gate_up: 0
            }
        );
        assert_eq!(
            share.leaving_room(6, 4),
            HostShare {
                full: 2,
                gate_up: 0
            }
        );
        // As many empty slots as misses, or more: every miss is copied.
        assert_eq!(share.leaving_room(6, 6), HostShare::default());
        assert_eq!(share.leaving_room(1, 40), HostShare::default());
    }

    #[test]
    fn the_split_follows_the_rates() {
        let mut split = HostSplit::new(50e9, 50e9);
        assert_eq!(split.host_share(6), 3);
        assert_eq!(split.host_share(0), 0);
        // A host twice as fast as the link takes two thirds.
        for _ in 0..60 {
            split.record_host(100, 1e-9);
        }
        assert_eq!(split.host_share(6), 4);
        // A link ten times faster than a slow host leaves it almost nothing.
        let slow = HostSplit::new(100e9, 5e9);
        assert_eq!(slow.host_share(6), 0);
        assert_eq!(slow.host_share(30), 1);
    }

    #[test]
    fn one_slow_layer_does_not_starve_a_path() {
        let mb = 17_301_504;
        let mut split = HostSplit::new(50e9, 60e9);
        // One layer whose host threads stalled for 50 ms: the rate moves by a bounded step.
        split.record_host(mb as u64, 0.05);
        assert!(
            split.host_bytes_per_s() > 0.8 * 60e9,
            "{}",
            split.host_bytes_per_s()
        );
        assert!(split.place(3, mb, true).full + split.place(3, mb, true).gate_up > 0);
        // A host that really is slow is learned within a few dozen layers.
        for _ in 0..40 {
            split.record_host(mb as u64, mb as f64 / 5e9);
        }
        assert!(
            split.host_bytes_per_s() < 6e9,
            "{}",
            split.host_bytes_per_s()
        );
    }

    #[test]
    fn a_path_without_work_is_probed_again() {
        let mb = 17_301_504;
        // A host the split thinks 20x slower than the link gets nothing of two misses...
        let mut split = HostSplit::new(100e9, 5e9);
        let shares: Vec<HostShare> = (0..40).map(|_| split.place(2, mb, true)).collect();
        let probes: Vec<usize> = (0..40)
            .filter(|&i| shares[i].full + shares[i].gate_up > 0)
            .collect();
        // ...but a split expert's gate and up every PROBE_AFTER_LAYERS + 1 layers.
        assert_eq!(probes, vec![16, 33]);
        assert_eq!(
            shares[16],
            HostShare {
                full: 0,
                gate_up: 1
            }
        );
        // Layers without misses neither probe nor count.
        let mut split = HostSplit::new(100e9, 5e9);
        for _ in 0..40 {
            assert_eq!(split.place(0, mb, true), HostShare::default());
        }
        assert_eq!(split.place(1, mb, false), HostShare::default());
        // The link, learned slow, is probed the same way.
        let mut split = HostSplit::new(1e9, 100e9);
        let shares: Vec<HostShare> = (0..20).map(|_| split.place(3, mb, false)).collect();
        assert!(shares[..16].iter().all(|s| s.full == 3), "{shares:?}");
        assert_eq!(
            shares[16],
            HostShare {
                full: 2,
                gate_up: 0
            }
        );
    }

    #[test]
    fn one_expert_splits_where_whole_experts_divide_unevenly() {
        let mb = 17_301_504; // a DeepSeek-V2-Lite expert
        let even = HostSplit::new(50e9, 50e9);
        let share = |full, gate_up| HostShare { full, gate_up };
        // Three misses at equal rates: 1.5 each is ideal; 1 + 2/3 on the host beats 1 or 2.
        assert_eq!(even.host_share_split(3, mb, true), share(1, 1));
        assert_eq!(even.host_share_split(3, mb, false), share(1, 0));
        // Even counts divide whole.
        assert_eq!(even.host_share_split(4, mb, true), share(2, 0));
        assert_eq!(even.host_share_split(0, mb, true), share(0, 0));
        // One miss: 2/3 on the host and 1/3 over the link beat either path alone.
        assert_eq!(even.host_share_split(1, mb, true), share(0, 1));
        // A tiny expert is not worth the split's fixed cost.
        assert_eq!(even.host_share_split(1, 3_000, true), share(0, 0));
        // A host four times slower than the link takes nothing of one miss, a third of six.
        let slow = HostSplit::new(100e9, 25e9);
        assert_eq!(slow.host_share_split(1, mb, true), share(0, 0));
        assert_eq!(slow.host_share_split(6, mb, true), share(1, 0));
        // Both paths' time never exceeds the whole-expert choice's.
        for misses in 0..12 {
            for (link, host) in [(54e9, 60e9), (25e9, 70e9), (54e9, 20e9)] {
                let s = HostSplit::new(link, host);
                let t = |h: HostShare| {
                    let host_b = (3 * h.full + 2 * h.gate_up) as f64 * mb as f64 / 3.0;
                    (host_b / host).max((misses as f64 * mb as f64 - host_b) / link)
                };
                let split = s.host_share_split(misses, mb, true);
                assert!(split.full + split.gate_up <= misses);
                assert!(t(split) <= t(s.host_share_split(misses, mb, false)) + 1e-12);
            }
        }
    }
}
