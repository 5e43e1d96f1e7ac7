//! Automatic draft depth: an observer that picks each round's depth from what rounds cost.
//!
//! Speculation pays when a round's draft steps and verify pass cost less per committed token than
//! plain decoding does; with offloaded experts that depends on acceptance, on how many distinct
//! experts a verify window touches and on copy bandwidth, none of which is known in advance (a
//! model with nearly uniform routing touches most experts in a long window). So the controller
//! measures: for every candidate depth (0, plain target decoding, then powers of two up to the
//! configured depth) it keeps moving sums of its rounds' wall time and committed tokens, whose
//! ratio is its cost per token, runs the best one, and re-tries a neighbour now and then so that
//! a change in conditions is noticed. Exploration is a bounded share of the decode's time (not of
//! its rounds: a short generation at a deep window has few rounds, and one of eight spent on a
//! dearer depth cost it several percent), and depth 0 is always a candidate, so once measured the
//! controller is never slower than plain decoding by more than that share.

use std::time::Instant;

use super::DecodeObserver;
use crate::model::{Route, RouteHook, Variant};

/// Most of the decode's time that rounds re-trying a neighbour of the best depth may take.
const EXPLORE_SHARE: f64 = 0.05;
/// Weight of the newest round in a depth's moving sums of seconds and committed tokens.
const EMA_WEIGHT: f64 = 0.15;

/// The depths automatic control chooses among: 0 (plain target decoding), then powers of two up
/// to `max_depth`, and `max_depth` itself.
pub fn candidate_depths(max_depth: usize) -> Vec<usize> {
    let mut depths = vec![0];
    let mut d = 1;
    while d <= max_depth {
        depths.push(d);
        d *= 2;
    }
    if *depths.last().unwrap_or(&0) != max_depth && max_depth > 0 {
        depths.push(max_depth);
    }
    depths
}

/// How the rounds went, per candidate depth.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct AutoDepthReport {
    /// Candidate depths, ascending (0 is plain target decoding).
    pub depths: Vec<usize>,
    /// Rounds run at each depth.
    pub rounds: Vec<usize>,
    /// Seconds per committed token at each depth, the ratio of moving sums (0 where never
    /// measured).
    pub seconds_per_token: Vec<f64>,
    /// The depth the controller would run next.
    pub chosen: usize,
}

/// Wraps another observer (which sees every call) and decides each round's depth.
pub struct AutoDepth<'a> {
    inner: &'a mut dyn DecodeObserver,
    depths: Vec<usize>,
    /// Per depth, moving sums of a round's seconds and of the tokens it committed. A depth's
    /// cost is their ratio, not a moving average of each round's seconds per token: when
    /// sampling, a round commits anywhere from 1 to depth + 1 tokens, and averaging per-round
    /// ratios weighs its unlucky rounds most (the mean of t / c exceeds t / mean c), so deep
    /// windows, whose commits vary most, would look dearer than they are. The third value
    /// counts the samples: the first rounds are a plain mean, later ones a moving one.
    sums: Vec<Option<(f64, f64, usize)>>,
    rounds: Vec<usize>,
    /// Per depth, a moving average of its measured rounds' seconds (seeds are per token, not per
    /// round): what an exploration round there is expected to take.
    round_seconds: Vec<Option<f64>>,
    /// Seconds of all measured rounds, and of those that re-tried a measured neighbour.
    spent: f64,
    explored: f64,
    /// Exploration rounds so far (equally measured neighbours take turns).
    explorations: usize,
    /// The round in flight re-tries a neighbour (a candidate's first measurement is not counted).
    exploring: bool,
    current: usize,
    round: usize,
    /// Index of the depth the round in flight runs.
    running: usize,
    round_started: Option<f64>,
    clock: Box<dyn FnMut() -> f64 + 'a>,
}

impl<'a> AutoDepth<'a> {
    /// Candidate depths 0, 1, 2, 4, ... up to `max_depth`, starting at `start` (rounded down to a
    /// candidate), timed with the wall clock.
    pub fn new(inner: &'a mut dyn DecodeObserver, max_depth: usize, start: usize) -> Self {
        let origin = Instant::now();
        Self::with_clock(
            inner,
            max_depth,
            start,
            Box::new(move || origin.elapsed().as_secs_f64()),
        )
    }

    /// As [`Self::new`] with a clock in seconds (tests drive it by hand).
    pub fn with_clock(
        inner: &'a mut dyn DecodeObserver,
        max_depth: usize,
        start: usize,
        clock: Box<dyn FnMut() -> f64 + 'a>,
    ) -> Self {
        let depths = candidate_depths(max_depth);
        let current = depths.iter().rposition(|&d| d <= start).unwrap_or(0);
        let n = depths.len();
        AutoDepth {
            inner,
            depths,
            sums: vec![None; n],
            rounds: vec![0; n],
            round_seconds: vec![None; n],
            spent: 0.0,
            explored: 0.0,
            explorations: 0,
            exploring: false,
            current,
            round: 0,
            running: current,
            round_started: None,
            clock,
        }
    }

    /// Takes measured seconds per committed token of some candidates (an offline profile's) as
    /// their starting costs, so a short generation does not spend its rounds re-measuring them;
    /// the cheapest measured candidate becomes the current one.
    pub fn seed(&mut self, measured: &[(usize, f64)]) {
        for &(depth, seconds) in measured {
            if let Some(i) = self.depths.iter().position(|&d| d == depth) {
                if seconds.is_finite() && seconds > 0.0 {
                    // One token's worth: a measured round weighs more.
                    self.sums[i] = Some((seconds, 1.0, 1));
                }
            }
        }
        self.settle();
    }

    /// The cheapest measured candidate becomes the current one.
    fn settle(&mut self) {
        if let Some(best) = (0..self.depths.len())
            .filter(|&j| self.sums[j].is_some())
            .min_by(|&a, &b| {
                self.cost(a)
                    .unwrap_or(f64::MAX)
                    .total_cmp(&self.cost(b).unwrap_or(f64::MAX))
            })
        {
            self.current = best;
        }
    }

    /// Seconds per committed token at candidate `i`, once measured.
    fn cost(&self, i: usize) -> Option<f64> {
        self.sums[i].map(|(seconds, tokens, _)| seconds / tokens)
    }

    pub fn report(&self) -> AutoDepthReport {
        AutoDepthReport {
            depths: self.depths.clone(),
            rounds: self.rounds.clone(),
            seconds_per_token: (0..self.depths.len())
                .map(|i| self.cost(i).unwrap_or(0.0))
                .collect(),
            chosen: self.depths[self.current],
        }
    }

    /// The candidate to run this round: the best measured one, except on exploration rounds,
    /// which try an unmeasured or a neighbouring depth.
    fn pick(&mut self) -> usize {
        self.round += 1;
        // Never measured candidates first (cheapest to learn: one round each), nearest first.
        if let Some(i) = self.nearest_unmeasured() {
            if self.round.is_multiple_of(2) || self.sums[self.current].is_none() {
                return i;
            }
        }
        // The neighbour with fewer measured rounds, whose cost is the less certain (one
        // unlucky round can price a depth out); on a tie they alternate.
        let up = (self.current + 1).min(self.depths.len() - 1);
        let down = self.current.saturating_sub(1);
        let neighbour = match (up == self.current, down == self.current) {
            (true, _) => down,
            (_, true) => up,
            _ if self.rounds[up] != self.rounds[down] => {
                if self.rounds[up] < self.rounds[down] {
                    up
                } else {
                    down
                }
            }
            _ if self.explorations.is_multiple_of(2) => up,
            _ => down,
        };
        if neighbour != self.current && self.may_explore(neighbour) {
            self.explorations += 1;
            self.exploring = true;
            return neighbour;
        }
        self.current
    }

    /// Whether a round at candidate `i` keeps exploration within its share of the time so far.
    /// Its length is expected from its own measured rounds, else from the current depth's, as
    /// many times longer as its window is; with neither measured there is nothing to go on.
    fn may_explore(&self, i: usize) -> bool {
        let expected = match (self.round_seconds[i], self.round_seconds[self.current]) {
            (Some(s), _) => s,
            (None, Some(s)) => {
                s * (self.depths[i] + 1) as f64 / (self.depths[self.current] + 1) as f64
            }
            (None, None) => return false,
        };
        self.explored + expected <= EXPLORE_SHARE * (self.spent + expected)
    }

    fn nearest_unmeasured(&self) -> Option<usize> {
        (0..self.depths.len())
            .filter(|&i| self.sums[i].is_none())
            .min_by_key(|&i| i.abs_diff(self.current))
    }
}

impl RouteHook for AutoDepth<'_> {
    fn on_route(&mut self, route: Route<'_>) {
        self.inner.on_route(route);
    }

    fn wants_routes(&self) -> bool {
        self.inner.wants_routes()
    }

    fn counts_routes_on_device(&self, variant: Variant) -> bool {
        self.inner.counts_routes_on_device(variant)
    }

    fn wants_moe_input(&self) -> bool {
        self.inner.wants_moe_input()
    }

    fn on_moe_input(&mut self, variant: Variant, moe_layer: usize, hidden: &[f32], topk: &[u32]) {
        self.inner.on_moe_input(variant, moe_layer, hidden, topk);
    }
}

impl DecodeObserver for AutoDepth<'_> {
    fn on_target_pass(&mut self, rows: usize) {
        self.inner.on_target_pass(rows);
    }

    fn on_draft_window(&mut self, depth: usize) {
        self.inner.on_draft_window(depth);
    }

    fn on_draft_step(&mut self, step: usize) {
        self.inner.on_draft_step(step);
    }

    fn next_depth(&mut self, configured: usize) -> usize {
        let inner = self.inner.next_depth(configured);
        self.running = self.pick();
        self.round_started = Some((self.clock)());
        self.depths[self.running].min(inner)
    }

    fn on_commit(&mut self, accepted: usize, committed: usize) {
        self.inner.on_commit(accepted, committed);
        // The prefill's commit has no round in flight.
        let Some(started) = self.round_started.take() else {
            return;
        };
        if committed == 0 {
            return;
        }
        let seconds = ((self.clock)() - started).max(0.0);
        let tokens = committed as f64;
        let i = self.running;
        self.rounds[i] += 1;
        self.spent += seconds;
        if std::mem::take(&mut self.exploring) {
            self.explored += seconds;
        }
        self.round_seconds[i] = Some(match self.round_seconds[i] {
            None => seconds,
            Some(s) => (1.0 - EMA_WEIGHT) * s + EMA_WEIGHT * seconds,
        });
        self.sums[i] = Some(match self.sums[i] {
            None => (seconds, tokens, 1),
            Some((s, t, n)) => {
                let w = EMA_WEIGHT.max(1.0 / (n + 1) as f64);
                (
                    (1.0 - w) * s + w * seconds,
                    (1.0 - w) * t + w * tokens,
                    n + 1,
                )
            }
        });
        self.settle();
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    struct Quiet;
    impl RouteHook for Quiet {
        fn on_route(&mut self, _: Route<'_>) {}
    }
    impl DecodeObserver for Quiet {}

    /// Runs `rounds` rounds where a round at depth d takes `round_s(d)` seconds and commits
    /// `committed(d)` tokens; returns the controller's report and the depth of every round.
    fn drive(
        rounds: usize,
        start: usize,
        round_s: impl Fn(usize) -> f64,
        committed: impl Fn(usize) -> usize,
    ) -> (AutoDepthReport, Vec<usize>) {
        let now = Cell::new(0.0f64);
        let mut inner = Quiet;
        let mut auto = AutoDepth::with_clock(&mut inner, 16, start, Box::new(|| now.get()));
        let mut seq = Vec::new();
        for _ in 0..rounds {
            let d = auto.next_depth(16);
            seq.push(d);
            now.set(now.get() + round_s(d));
            auto.on_commit(0, committed(d));
        }
        (auto.report(), seq)
    }

    #[test]
    fn falls_back_to_plain_decoding_when_speculation_does_not_pay() {
        // Every round costs 10 ms plus 9 ms per draft step and commits 1 + d/2 tokens: plain
        // decoding (10 ms per token) beats every depth.
        let (r, _) = drive(200, 8, |d| 0.010 + 0.009 * d as f64, |d| 1 + d / 2);
        assert_eq!(r.chosen, 0, "{r:?}");
        // Exploration stays a small share of rounds.
        let plain = r.rounds[0];
        assert!(plain >= 150, "only {plain} of 200 rounds ran plain: {r:?}");
    }

    #[test]
    fn settles_on_the_cheapest_depth_per_token() {
        // Verify costs 40 ms (copies), a draft step 2 ms, and about 0.8 of drafts are accepted up
        // to depth 4 but few beyond: depth 4 is cheapest per token.
        let committed = |d: usize| 1 + (d.min(4) * 8) / 10;
        let (r, _) = drive(300, 1, |d| 0.040 + 0.002 * d as f64, committed);
        assert_eq!(r.chosen, 4, "{r:?}");
        assert_eq!(r.depths, vec![0, 1, 2, 4, 8, 16]);
    }

    #[test]
    fn a_depth_whose_rounds_commit_unevenly_is_judged_by_its_tokens_per_second() {
        // As when sampling: a depth-16 round (12 ms) commits 1 or 17 tokens, alternately, 9 on
        // average (1.33 ms a token); a depth-8 round (8 ms) always commits 5 (1.6 ms). Averaging
        // each round's seconds per token would price depth 16 at (12 + 0.7) / 2 = 6.4 ms.
        let flip = Cell::new(false);
        let committed = |d: usize| match d {
            16 => {
                flip.set(!flip.get());
                if flip.get() {
                    1
                } else {
                    17
                }
            }
            8 => 5,
            d => 1 + d / 2,
        };
        let (r, seq) = drive(300, 16, |d| 0.004 + 0.0005 * d as f64, committed);
        assert_eq!(r.chosen, 16, "{r:?}");
        // Its first round committed one token, which priced it out until a re-try (exploration
        // is a small share of the time); once settled it stays.
        let late = seq[200..].iter().filter(|&&d| d == 16).count();
        assert!(
            late >= 85,
            "only {late} of the last 100 rounds at depth 16: {r:?}"
        );
    }

    #[test]
    fn a_seeded_controller_starts_at_the_profiled_best_and_rarely_leaves_it() {
        // Depth 16 is cheapest (as profiled); the others cost more per token.
        let cost = |d: usize| if d == 16 { 0.010 } else { 0.030 };
        let now = Cell::new(0.0f64);
        let mut inner = Quiet;
        let mut auto = AutoDepth::with_clock(&mut inner, 16, 0, Box::new(|| now.get()));
        let profile: Vec<(usize, f64)> =
            candidate_depths(16).iter().map(|&d| (d, cost(d))).collect();
        auto.seed(&profile);
        assert_eq!(auto.report().chosen, 16);
        let mut at_best = 0;
        for _ in 0..16 {
            let d = auto.next_depth(16);
            at_best += usize::from(d == 16);
            now.set(now.get() + cost(d));
            auto.on_commit(0, 1);
        }
        // Only the periodic exploration rounds leave depth 16: nothing is re-measured first.
        assert!(at_best >= 14, "{at_best} of 16 rounds at the best depth");
        assert_eq!(auto.report().chosen, 16);
    }

    #[test]
    fn exploration_takes_a_bounded_share_of_the_time_not_of_the_rounds() {
        // As the trained-routing model at a deep window: every draft is accepted, so a 128-token
        // generation is 8 rounds at depth 16 (17 tokens, 34 ms), and depth 8 costs a third more
        // per token. Seeded with the profile, the controller re-tries no neighbour in so short a
        // run: one round in eight at depth 8 would have cost it 4%.
        let round_s = |d: usize| 0.002 * (d + 1) as f64 * if d == 16 { 1.0 } else { 1.33 };
        let now = Cell::new(0.0f64);
        let mut inner = Quiet;
        let mut auto = AutoDepth::with_clock(&mut inner, 16, 16, Box::new(|| now.get()));
        let profile: Vec<(usize, f64)> = candidate_depths(16)
            .iter()
            .map(|&d| (d, round_s(d) / (d + 1) as f64))
            .collect();
        auto.seed(&profile);
        let mut depths_run = Vec::new();
        for _ in 0..8 {
            let d = auto.next_depth(16);
            depths_run.push(d);
            now.set(now.get() + round_s(d));
            auto.on_commit(d, d + 1);
        }
        assert_eq!(depths_run, vec![16; 8]);
        // A long generation still re-tries its neighbours, within the share.
        let mut other = 0.0;
        for _ in 0..2000 {
            let d = auto.next_depth(16);
            now.set(now.get() + round_s(d));
            if d != 16 {
                other += round_s(d);
            }
            auto.on_commit(d, d + 1);
        }
        let r = auto.report();
        assert_eq!(r.chosen, 16, "{r:?}");
        let share = other / now.get();
        assert!(
            share > 0.01 && share <= EXPLORE_SHARE,
            "{:.1}% of the time off the best depth: {r:?}",
            share * 100.0
        );
    }

    #[test]
    fn the_prefill_commit_is_not_a_round_and_depth_never_exceeds_the_configured_one() {
        let mut inner = Quiet;
        let mut auto = AutoDepth::with_clock(&mut inner, 6, 6, Box::new(|| 0.0));
        auto.on_commit(0, 1);
        assert_eq!(auto.report().rounds.iter().sum::<usize>(), 0);
        assert_eq!(auto.report().depths, vec![0, 1, 2, 4, 6]);
        for _ in 0..20 {
            assert!(auto.next_depth(3) <= 3);
            auto.on_commit(0, 1);
        }
    }
}
