//! Where a layer's missing experts are computed: copied over the link into slots, or read in
//! place by the host expert kernel. The two paths run at once, so the split that finishes both
//! together is the one whose shares are proportional to their rates; the rates are measured as the
//! run goes (the host's per expert call, the link's from the copies' device timings).

/// The measured rates of both paths and the split they give.
#[derive(Clone, Debug)]
pub struct HostSplit {
    link_bytes_per_s: f64,
    host_bytes_per_s: f64,
}

/// Weight of a new measurement in the running rate.
const SMOOTHING: f64 = 0.25;

impl HostSplit {
    /// Starts from estimates of both rates (bytes per second, positive).
    pub fn new(link_bytes_per_s: f64, host_bytes_per_s: f64) -> Self {
        HostSplit {
            link_bytes_per_s: link_bytes_per_s.max(1.0),
            host_bytes_per_s: host_bytes_per_s.max(1.0),
        }
    }

    /// Of `misses` experts of equal size, how many the host should compute so that it and the
    /// link finish together.
    pub fn host_share(&self, misses: usize) -> usize {
        let share = self.host_bytes_per_s / (self.host_bytes_per_s + self.link_bytes_per_s);
        ((misses as f64 * share).round() as usize).min(misses)
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
    old + SMOOTHING * (new - old)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
