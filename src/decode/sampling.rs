//! Token selection: greedy argmax, temperature + nucleus (top-p) distributions, and the
//! speculative accept/reject step that keeps the output distribution equal to the target's.

use rand::Rng;
use rayon::prelude::*;

/// How a token is chosen from a row of logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 selects greedy decoding (argmax); otherwise logits are divided by it before softmax.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]: only the most likely tokens whose probabilities sum to at least
    /// this are kept. 1 keeps every token.
    pub top_p: f32,
    /// Seed of the sampling RNG, so a sampled generation is reproducible.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Self::greedy()
    }
}

/// Index of the largest logit; the lowest index wins a tie, and NaN never wins (0 when no logit
/// is above -inf). The definition: one scan in order, taking an index when its value is
/// strictly larger than the best so far. [`argmax`] gives the same index faster.
pub fn argmax_scan(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (index, &value) in logits.iter().enumerate() {
        if value > best_value {
            best = index;
            best_value = value;
        }
    }
    best as u32
}

/// [`argmax_scan`]'s index, in two passes the compiler can vectorise: the largest value, in
/// independent lanes that each keep their value unless a strictly larger one comes (so NaN never
/// enters), then the first index holding it. A greedy step takes this over the whole vocabulary
/// (102,400 logits for DeepSeek-V2-Lite) on the host between two device steps
/// (`examples/bench_sampling.rs` times both).
pub fn argmax(logits: &[f32]) -> u32 {
    let max = lane_fold(logits, |a, x| if x > a { x } else { a });
    if max == f32::NEG_INFINITY {
        return 0;
    }
    // `==` also finds a zero of the other sign, as the scan (to which -0 and +0 are equal) does.
    let mut base = 0;
    for chunk in logits.chunks(LANES) {
        if chunk.iter().fold(false, |found, &x| found | (x == max)) {
            let at = chunk.iter().position(|&x| x == max).unwrap_or(0);
            return (base + at) as u32;
        }
        base += chunk.len();
    }
    0
}

/// The distribution a sampler draws from: softmax of `logits / temperature`, restricted to the
/// top-p nucleus and renormalised. Applied identically to the target's and the draft's rows, so
/// speculative sampling reproduces sampling from the target's processed distribution.
/// `temperature` must be > 0.
///
/// The nucleus is the first tokens of the order by probability (descending; ties by index) whose
/// running sum, taken in that order, first reaches `top_p`. A sampled step runs this over the
/// whole vocabulary on the host between two device steps, so the exponentials of a large
/// vocabulary run on rayon's threads (each the same operation as alone) and the nucleus sorts
/// only the tokens at or above a selected threshold (see [`nucleus`]): the same probabilities,
/// bit for bit, as exponentiating in order and sorting the whole vocabulary.
pub fn distribution(logits: &[f32], temperature: f32, top_p: f32) -> Vec<f64> {
    let inv_t = 1.0 / f64::from(temperature);
    let max = finite_max(logits);
    let weight = |v: f32| {
        if v.is_finite() {
            ((f64::from(v) - f64::from(max)) * inv_t).exp()
        } else {
            0.0
        }
    };
    let mut probs = vec![0.0f64; logits.len()];
    if logits.len() >= PARALLEL_LOGITS {
        probs
            .par_chunks_mut(PARALLEL_CHUNK)
            .zip(logits.par_chunks(PARALLEL_CHUNK))
            .for_each(|(p, l)| p.iter_mut().zip(l).for_each(|(p, &v)| *p = weight(v)));
    } else {
        probs
            .iter_mut()
            .zip(logits)
            .for_each(|(p, &v)| *p = weight(v));
    }
    if !normalise(&mut probs, logits) {
        return probs;
    }
    if top_p < 1.0 {
        let keep = nucleus(&probs, f64::from(top_p));
        restrict(&mut probs, &keep);
    }
    probs
}

/// [`distribution`] as defined: the exponentials in order, the nucleus by sorting every token.
/// The same bits as `distribution`, which is faster on large vocabularies.
pub fn distribution_by_sort(logits: &[f32], temperature: f32, top_p: f32) -> Vec<f64> {
    let inv_t = 1.0 / f64::from(temperature);
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f64> = logits
        .iter()
        .map(|&v| {
            if v.is_finite() {
                ((f64::from(v) - f64::from(max)) * inv_t).exp()
            } else {
                0.0
            }
        })
        .collect();
    if !normalise(&mut probs, logits) {
        return probs;
    }
    if top_p < 1.0 {
        let mut order: Vec<usize> = (0..probs.len()).collect();
        // Stable sort: equal probabilities keep index order, so the nucleus is deterministic.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let mut kept = 0.0;
        let mut keep = vec![false; probs.len()];
        for &index in &order {
            keep[index] = true;
            kept += probs[index];
            if kept >= f64::from(top_p) {
                break;
            }
        }
        restrict(&mut probs, &keep);
    }
    probs
}

/// Divides the weights by their sum, taken in index order; when no logit was finite (sum 0),
/// gives all the mass to the argmax rule's choice instead, so sampling stays defined, and says
/// so (false).
fn normalise(probs: &mut [f64], logits: &[f32]) -> bool {
    let total: f64 = probs.iter().sum();
    if total <= 0.0 {
        probs.iter_mut().for_each(|p| *p = 0.0);
        if let Some(p) = probs.get_mut(argmax(logits) as usize) {
            *p = 1.0;
        }
        return false;
    }
    probs.iter_mut().for_each(|p| *p /= total);
    true
}

/// Zeroes the tokens the nucleus leaves out and renormalises the rest (the sum in index order).
fn restrict(probs: &mut [f64], keep: &[bool]) {
    let mut total = 0.0;
    for (p, &keep) in probs.iter_mut().zip(keep) {
        if !keep {
            *p = 0.0;
        }
        total += *p;
    }
    probs.iter_mut().for_each(|p| *p /= total);
}

/// Logits from which `distribution` computes its exponentials on rayon's threads, in chunks of
/// `PARALLEL_CHUNK`: below it a thread hand-off costs more than it saves.
const PARALLEL_LOGITS: usize = 16_384;
const PARALLEL_CHUNK: usize = 4_096;

/// The largest finite logit (-inf when there is none). A maximum of 0 may come out as -0 or +0,
/// as `f32::max` may give either; `distribution` only subtracts it, where both give the same
/// differences.
fn finite_max(logits: &[f32]) -> f32 {
    lane_fold(logits, |a, x| if x.is_finite() && x > a { x } else { a })
}

/// Lanes of the vectorisable folds below.
const LANES: usize = 16;

/// `pick` folded over `logits` from -inf in LANES independent lanes, which the compiler can
/// vectorise, then over the lanes. `pick(a, x)` keeps `a` or takes `x`; for a maximum under a
/// strict comparison the grouping changes nothing but which zero (-0 or +0) a zero maximum is.
fn lane_fold(logits: &[f32], pick: impl Fn(f32, f32) -> f32) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| pick(a, x));
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = pick(*lane, x);
        }
    }
    lanes.iter().fold(rest, |a, &x| pick(a, x))
}

/// Which tokens the top-p nucleus keeps (see [`distribution`]). A nucleus is usually far smaller
/// than the vocabulary, so instead of sorting every token this takes the tokens whose
/// probability is at least the k-th largest, which are exactly the first ones of the full order,
/// sorts them (stably, from index order, so ties keep index order) and sums in that order; when
/// they do not reach `top_p` it tries again with more, up to the whole vocabulary.
fn nucleus(probs: &[f64], top_p: f64) -> Vec<bool> {
    let n = probs.len();
    let mut keep = vec![false; n];
    let mut k = n.min(256);
    loop {
        let threshold = if k >= n {
            f64::NEG_INFINITY
        } else {
            let mut scratch = probs.to_vec();
            *scratch
                .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a))
                .1
        };
        let mut order: Vec<usize> = (0..n)
            .filter(|&i| probs[i].total_cmp(&threshold).is_ge())
            .collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let mut kept = 0.0;
        for &index in &order {
            keep[index] = true;
            kept += probs[index];
            if kept >= top_p {
                return keep;
            }
        }
        if k >= n {
            return keep;
        }
        keep.iter_mut().for_each(|kept| *kept = false);
        // Enough tokens for twice the mass still missing at the density seen so far.
        let wanted = (order.len() as f64 * 2.0 * top_p / kept.max(f64::MIN_POSITIVE)).ceil();
        k = n.min(8 * k).max(n.min(wanted.min(n as f64) as usize));
    }
}

/// Draws an index from a normalised distribution.
pub fn sample(probs: &[f64], rng: &mut impl Rng) -> u32 {
    let total: f64 = probs.iter().sum();
    let r = rng.random::<f64>() * total;
    let mut cumulative = 0.0;
    let mut last_nonzero = 0usize;
    for (index, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cumulative += p;
            last_nonzero = index;
            if r < cumulative {
                return index as u32;
            }
        }
    }
    // Rounding left r at the very top of the range.
    last_nonzero as u32
}

/// The speculative sampling decision for one drafted token `x` drawn from the draft's `q`:
/// accepted with probability min(1, p(x)/q(x)); otherwise the replacement is drawn from
/// norm(max(0, p - q)). Returns `None` when `x` is accepted, `Some(token)` on rejection.
pub fn accept_or_resample(p: &[f64], q: &[f64], x: u32, rng: &mut impl Rng) -> Option<u32> {
    let index = x as usize;
    let px = p.get(index).copied().unwrap_or(0.0);
    let qx = q.get(index).copied().unwrap_or(0.0);
    let u = rng.random::<f64>();
    if qx > 0.0 && u * qx < px {
        return None;
    }
    let residual: Vec<f64> = p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect();
    if residual.iter().sum::<f64>() > 0.0 {
        Some(sample(&residual, rng))
    } else {
        // p <= q everywhere means p == q (both normalised), where rejection has probability
        // zero; reaching here is rounding, and p itself is the right distribution.
        Some(sample(p, rng))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn argmax_takes_lowest_index_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.2]), 1);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[-0.0, 0.0, -1.0]), 0);
        assert_eq!(argmax(&[-1.0, 0.0, -0.0]), 1);
    }

    #[test]
    fn argmax_equals_the_in_order_scan() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // Values from a small set, so ties, signed zeros, infinities and NaN come often, at
        // lengths around the lane width and a vocabulary's.
        let pool = [
            -2.0f32,
            -0.0,
            0.0,
            1.5,
            3.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for len in (0..70).chain([1000, 102_400]) {
            for _ in 0..20 {
                let kinds = rng.random_range(1..=pool.len());
                let logits: Vec<f32> = (0..len)
                    .map(|_| {
                        if rng.random_bool(0.5) {
                            pool[rng.random_range(0..kinds)]
                        } else {
                            rng.random_range(-4.0f32..4.0)
                        }
                    })
                    .collect();
                assert_eq!(argmax(&logits), argmax_scan(&logits), "{logits:?}");
            }
        }
    }

    #[test]
    fn distribution_equals_its_definition_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let bits = |p: &[f64]| p.iter().map(|v| v.to_bits()).collect::<Vec<u64>>();
        // Flat rows (a nucleus of most tokens), peaked ones (a few tokens), Zipf-like ones (a
        // nucleus found only after several tries), rows of repeated values (ties at the
        // threshold), rows with non-finite logits, and rows with none.
        let shapes = ["flat", "peaked", "zipf", "ties", "non-finite", "no finite"];
        for len in [1usize, 2, 7, 255, 256, 257, 3000, 40_000] {
            for shape in shapes {
                let logits: Vec<f32> = (0..len)
                    .map(|i| match shape {
                        "flat" => rng.random_range(-0.5f32..0.5),
                        "peaked" if i % 97 == 3 => rng.random_range(8.0f32..12.0),
                        "peaked" => rng.random_range(-6.0f32..0.0),
                        "zipf" => -((i % 7919 * 5 % len + 1) as f32).ln(),
                        "ties" => [-1.0f32, 0.0, -0.0, 2.0, 2.0][rng.random_range(0..5)],
                        "non-finite" => [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0, -3.0]
                            [rng.random_range(0..5)],
                        _ => [f32::NAN, f32::NEG_INFINITY][rng.random_range(0..2)],
                    })
                    .collect();
                for (t, p) in [(1.0, 1.0), (0.8, 0.95), (0.8, 0.9), (1.5, 0.5), (0.3, 0.1)] {
                    assert_eq!(
                        bits(&distribution(&logits, t, p)),
                        bits(&distribution_by_sort(&logits, t, p)),
                        "{shape} row of {len}, temperature {t}, top-p {p}"
                    );
                }
            }
        }
    }

    #[test]
    fn top_p_keeps_smallest_nucleus() {
        // Probabilities proportional to 4, 3, 2, 1 at temperature 1 (f32 logits: 1e-6 slack).
        let logits: Vec<f32> = [4.0f32, 3.0, 2.0, 1.0].iter().map(|v| v.ln()).collect();
        let full = distribution(&logits, 1.0, 1.0);
        assert!((full[0] - 0.4).abs() < 1e-6 && (full[3] - 0.1).abs() < 1e-6);
        let nucleus = distribution(&logits, 1.0, 0.65);
        // 0.4 < 0.65 <= 0.7: the two most likely tokens survive.
        assert!((nucleus[0] - 4.0 / 7.0).abs() < 1e-6);
        assert!((nucleus[1] - 3.0 / 7.0).abs() < 1e-6);
        assert_eq!(nucleus[2], 0.0);
        assert_eq!(nucleus[3], 0.0);
    }

    #[test]
    fn sample_matches_distribution() {
        let probs = [0.1, 0.0, 0.6, 0.3];
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut counts = [0usize; 4];
        let n = 40_000;
        for _ in 0..n {
            counts[sample(&probs, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        for (count, p) in counts.iter().zip(probs) {
            assert!((*count as f64 / n as f64 - p).abs() < 0.01, "{counts:?}");
        }
    }
}
