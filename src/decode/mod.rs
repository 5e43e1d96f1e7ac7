//! The speculative inference controller: prefill with the target, then rounds of "the draft
//! proposes up to K tokens over the target's committed KV, the target verifies them in one pass,
//! the longest agreeing prefix plus one target token is committed, the KV is cropped back to the
//! committed boundary". Greedy output equals target-only decoding; sampled output follows the
//! target's distribution (speculative rejection sampling).
//!
//! [`Mode::SpecMoeOff`] is the paper's baseline: the same verification, but the draft keeps its
//! own KV cache (its own prefill, rolled back to the accepted prefix after every round) at a
//! fixed depth, as a separate draft model would.

mod depth;
mod prefetch;
// Named by path where a module the decode loop imports needs a greedy choice (no import cycle).
pub(crate) mod sampling;

pub use depth::{candidate_depths, AutoDepth, AutoDepthReport};
pub use prefetch::{DraftPrefetcher, FrequencyPrefetcher};
pub use sampling::{
    accept_or_resample, argmax, argmax_scan, distribution, distribution_by_sort, sample, Sampling,
};

use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::model::{KvCache, LanguageModel, ModelInfo, Route, RouteHook, Variant};
use crate::offload::{OffloadSimulator, OffloadStats};
use crate::{Error, Result};

/// Which model(s) decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The target alone, one token per forward pass.
    Target,
    /// The draft alone (INT4 experts), one token per forward pass: a baseline, not lossless.
    Draft,
    /// Draft proposes, target verifies.
    Specter,
    /// The SpecMoEOff-style baseline: a draft with its own KV cache proposes (depth
    /// [`SPECMOEOFF_DEPTH`] in the paper's protocol), the target verifies exactly as in
    /// [`Mode::Specter`]. SpecMoEOff's draft is a separate quantized model; here it is this
    /// model's INT4 draft variant with a KV cache of its own (its attention, routers and shared
    /// experts are the target's), which if anything gives the baseline better acceptance than
    /// the original's: a conservative comparison for Specter.
    SpecMoeOff,
}

/// The SpecMoEOff baseline's draft depth in the paper's protocol (K = 3).
pub const SPECMOEOFF_DEPTH: usize = 3;

impl Mode {
    /// Whether the mode drafts and verifies (and so needs the draft variant).
    pub fn is_speculative(self) -> bool {
        matches!(self, Mode::Specter | Mode::SpecMoeOff)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    pub mode: Mode,
    pub max_new_tokens: usize,
    /// Draft tokens per round (K >= 1); shrunk near the end so nothing is drafted past
    /// `max_new_tokens`.
    pub depth: usize,
    pub sampling: Sampling,
    /// Stop after committing one of the model's end-of-sequence tokens.
    pub stop_at_eos: bool,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Decode rounds after prefill: verify passes in the speculative modes, forward passes
    /// otherwise.
    pub rounds: usize,
    /// Draft tokens proposed (speculative modes).
    pub drafted: usize,
    /// Draft tokens the target accepted (speculative modes).
    pub accepted: usize,
    /// `accepted / drafted` (0 when nothing was drafted).
    pub acceptance_rate: f64,
    /// `accepted / rounds` (0 without rounds).
    pub mean_accepted_per_round: f64,
    /// From the call to the first committed token.
    pub ttft_ms: f64,
    /// `(t_last_commit - t_first_commit) / (generated_tokens - 1)` (0 below two tokens).
    pub tpot_ms: f64,
    pub total_ms: f64,
    /// Expert residency figures when decoding ran under an [`OffloadSimulator`] (reported
    /// apart, so not serialized with the rest).
    #[serde(skip)]
    pub offload: Option<OffloadStats>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOutput {
    /// The generated tokens (the prompt excluded).
    pub tokens: Vec<u32>,
    pub stats: GenerateStats,
}

/// Told where the decode loop's phases begin and end, so expert prefetch and residency code can
/// follow the draft window and the verify pass. Every method defaults to doing nothing; the
/// routing of each pass still arrives through [`RouteHook`].
pub trait DecodeObserver: RouteHook {
    /// A target forward pass over `rows` rows is about to run (prefill, verify or single step).
    fn on_target_pass(&mut self, _rows: usize) {}
    /// A draft window of `depth` draft steps begins. Each step is one draft forward pass that
    /// proposes one token: a single row in Specter mode; in SpecMoEOff mode step 0 also runs the
    /// committed tokens its own KV has not seen yet (one or two rows).
    fn on_draft_window(&mut self, _depth: usize) {}
    /// Draft step `step` (0-based) of the current window has run.
    fn on_draft_step(&mut self, _step: usize) {}
    /// `committed` tokens were committed, `accepted` of them drafts the target accepted.
    fn on_commit(&mut self, _accepted: usize, _committed: usize) {}
    /// The draft depth of the coming round, given the configured one (the most it may be).
    /// 0 skips drafting: the round is one plain target step. Automatic depth control decides here.
    fn next_depth(&mut self, configured: usize) -> usize {
        configured
    }
    /// Whether the methods above do anything: when not, the decode loop may run greedy passes
    /// back to back on the device ([`LanguageModel::forward_greedy_chain`]) and tell this
    /// observer nothing of them, as the default methods ignore it all.
    fn follows_passes(&self) -> bool {
        true
    }
}

/// Wraps a plain route hook as an observer that ignores phase boundaries.
struct HookOnly<'a>(&'a mut dyn RouteHook);

impl RouteHook for HookOnly<'_> {
    fn on_route(&mut self, route: Route<'_>) {
        self.0.on_route(route);
    }

    fn wants_routes(&self) -> bool {
        self.0.wants_routes()
    }

    fn counts_routes_on_device(&self, variant: Variant) -> bool {
        self.0.counts_routes_on_device(variant)
    }

    fn wants_moe_input(&self) -> bool {
        self.0.wants_moe_input()
    }

    fn on_moe_input(&mut self, variant: Variant, moe_layer: usize, hidden: &[f32], topk: &[u32]) {
        self.0.on_moe_input(variant, moe_layer, hidden, topk);
    }
}

impl DecodeObserver for HookOnly<'_> {
    fn follows_passes(&self) -> bool {
        false
    }
}

impl DecodeObserver for crate::model::NoHook {
    fn follows_passes(&self) -> bool {
        false
    }
}

/// Validates the prompt (non-empty, ids < vocab, prompt + max_new_tokens <= max_context) and the
/// options with [`Error::Request`] naming the problem, then decodes. `on_token` is called for
/// every committed token as soon as it is committed (for streaming).
pub fn generate<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    opts: &GenerateOptions,
    hook: &mut dyn RouteHook,
    on_token: &mut dyn FnMut(u32),
) -> Result<GenerateOutput> {
    generate_observed(model, prompt, opts, &mut HookOnly(hook), on_token)
}

/// [`generate`] with an observer told about draft windows, target passes and commits.
pub fn generate_observed<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    opts: &GenerateOptions,
    observer: &mut dyn DecodeObserver,
    on_token: &mut dyn FnMut(u32),
) -> Result<GenerateOutput> {
    generate_until(model, prompt, opts, observer, &mut |token| {
        on_token(token);
        true
    })
}

/// [`generate_observed`] that the caller can stop: decoding ends after the token for which
/// `on_token` returns false (a closed connection, a cancelled request), as if `max_new_tokens`
/// had been reached there.
pub fn generate_until<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    opts: &GenerateOptions,
    observer: &mut dyn DecodeObserver,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GenerateOutput> {
    let info = model.info();
    validate_request(info, prompt, opts)?;
    let start = Instant::now();
    let mut commits = Commits {
        tokens: Vec::with_capacity(opts.max_new_tokens),
        max_new: opts.max_new_tokens,
        eos: if opts.stop_at_eos {
            info.eos_token_ids.clone()
        } else {
            Vec::new()
        },
        finished: opts.max_new_tokens == 0,
        first: None,
        last: None,
        on_token,
    };
    let counters = if commits.finished {
        Counters::default()
    } else {
        let mut chooser = Chooser::new(opts.sampling);
        let chooser = &mut chooser;
        let commits = &mut commits;
        match opts.mode {
            Mode::Target => {
                decode_single(model, Variant::Target, prompt, chooser, observer, commits)?
            }
            Mode::Draft => {
                decode_single(model, Variant::Draft, prompt, chooser, observer, commits)?
            }
            Mode::Specter => {
                let cache = DraftCache::Shared;
                decode_speculative(model, prompt, opts.depth, cache, chooser, observer, commits)?
            }
            Mode::SpecMoeOff => {
                let cache = DraftCache::Own;
                decode_speculative(model, prompt, opts.depth, cache, chooser, observer, commits)?
            }
        }
    };
    let end = Instant::now();
    let generated = commits.tokens.len();
    let ms = |from: Instant, to: Instant| to.duration_since(from).as_secs_f64() * 1e3;
    let stats = GenerateStats {
        prompt_tokens: prompt.len(),
        generated_tokens: generated,
        rounds: counters.rounds,
        drafted: counters.drafted,
        accepted: counters.accepted,
        acceptance_rate: ratio(counters.accepted, counters.drafted),
        mean_accepted_per_round: ratio(counters.accepted, counters.rounds),
        ttft_ms: commits.first.map_or(0.0, |t| ms(start, t)),
        tpot_ms: match (commits.first, commits.last) {
            (Some(first), Some(last)) if generated > 1 => ms(first, last) / (generated - 1) as f64,
            _ => 0.0,
        },
        total_ms: ms(start, end),
        offload: None,
    };
    Ok(GenerateOutput {
        tokens: commits.tokens,
        stats,
    })
}

/// Decodes with `simulator` observing every pass (draft routing feeds its planner, target routing
/// is looked up in its expert cache), and reports its figures in `stats.offload`.
pub fn generate_with_offload<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    opts: &GenerateOptions,
    simulator: &mut OffloadSimulator,
    on_token: &mut dyn FnMut(u32),
) -> Result<GenerateOutput> {
    simulate_offload(model.info(), simulator, |simulator| {
        generate_observed(model, prompt, opts, simulator, on_token)
    })
}

/// Runs `decode`, which must pass `simulator` to the decode loop as its observer (alone or
/// wrapped, for instance under automatic depth), after checking that the simulator fits the
/// model; reports the simulator's figures in `stats.offload`.
pub fn simulate_offload(
    info: &ModelInfo,
    simulator: &mut OffloadSimulator,
    decode: impl FnOnce(&mut OffloadSimulator) -> Result<GenerateOutput>,
) -> Result<GenerateOutput> {
    simulator.check_model(info)?;
    let mut output = decode(simulator)?;
    if let Some(problem) = simulator.routing_error() {
        return Err(Error::Model(format!(
            "routing reported by the model: {problem}"
        )));
    }
    output.stats.offload = Some(simulator.stats());
    Ok(output)
}

fn ratio(numerator: usize, denominator: usize) -> f64 {
    if denominator == 0 {
        0.0
    } else {
        numerator as f64 / denominator as f64
    }
}

fn validate_request(info: &ModelInfo, prompt: &[u32], opts: &GenerateOptions) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::Request("the prompt is empty".into()));
    }
    if let Some((position, &id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= info.vocab_size)
    {
        return Err(Error::Request(format!(
            "prompt token {id} at position {position} is outside the vocabulary (size {})",
            info.vocab_size
        )));
    }
    let needed = prompt.len().checked_add(opts.max_new_tokens);
    if needed.is_none_or(|n| n > info.max_context) {
        return Err(Error::Request(format!(
            "prompt of {} tokens plus max_new_tokens {} exceeds the model's context of {} positions",
            prompt.len(),
            opts.max_new_tokens,
            info.max_context
        )));
    }
    if opts.depth == 0 {
        return Err(Error::Request("draft depth must be at least 1".into()));
    }
    let t = opts.sampling.temperature;
    if !t.is_finite() || t < 0.0 {
        return Err(Error::Request(format!(
            "temperature {t} must be finite and >= 0"
        )));
    }
    let p = opts.sampling.top_p;
    if !(p > 0.0 && p <= 1.0) {
        return Err(Error::Request(format!("top_p {p} must be in (0, 1]")));
    }
    Ok(())
}

#[derive(Default)]
struct Counters {
    rounds: usize,
    drafted: usize,
    accepted: usize,
}

/// The committed output: streams each token out and decides when generation is over.
struct Commits<'a> {
    tokens: Vec<u32>,
    max_new: usize,
    eos: Vec<u32>,
    finished: bool,
    first: Option<Instant>,
    last: Option<Instant>,
    /// Returns false to end generation after this token.
    on_token: &'a mut dyn FnMut(u32) -> bool,
}

impl Commits<'_> {
    /// Commits `token` unless generation is already over; returns whether it was committed.
    fn push(&mut self, token: u32) -> bool {
        if self.finished {
            return false;
        }
        self.tokens.push(token);
        let keep_going = (self.on_token)(token);
        let now = Instant::now();
        self.first.get_or_insert(now);
        self.last = Some(now);
        if !keep_going || self.tokens.len() >= self.max_new || self.eos.contains(&token) {
            self.finished = true;
        }
        true
    }

    fn remaining(&self) -> usize {
        self.max_new - self.tokens.len()
    }
}

/// Picks tokens from logits rows under one sampling configuration and one seeded RNG stream.
struct Chooser {
    sampling: Sampling,
    rng: ChaCha8Rng,
}

impl Chooser {
    fn new(sampling: Sampling) -> Self {
        Chooser {
            sampling,
            rng: ChaCha8Rng::seed_from_u64(sampling.seed),
        }
    }

    fn distribution(&self, row: &[f32]) -> Vec<f64> {
        distribution(row, self.sampling.temperature, self.sampling.top_p)
    }

    fn choose(&mut self, row: &[f32]) -> u32 {
        if self.sampling.is_greedy() {
            argmax(row)
        } else {
            let probs = self.distribution(row);
            sample(&probs, &mut self.rng)
        }
    }
}

/// Row `row` of a `[rows, vocab]` logits matrix, after checking the model returned that shape.
fn logits_row(logits: &[f32], rows: usize, vocab: usize, row: usize) -> Result<&[f32]> {
    if logits.len() != rows * vocab {
        return Err(Error::Model(format!(
            "forward returned {} logits for {rows} rows of vocabulary {vocab}",
            logits.len()
        )));
    }
    Ok(&logits[row * vocab..(row + 1) * vocab])
}

/// A prompt's pass (prefill: [`LanguageModel::prefill`]) or a decoding one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Prompt,
    Step,
}

/// A verification window's pass.
const VERIFY: (Variant, Pass) = (Variant::Target, Pass::Step);

fn forward<M: LanguageModel>(
    model: &M,
    (variant, pass): (Variant, Pass),
    tokens: &[u32],
    kv: &mut M::Kv,
    observer: &mut dyn DecodeObserver,
) -> Result<Vec<f32>> {
    if variant == Variant::Target {
        observer.on_target_pass(tokens.len());
    }
    // A DecodeObserver is a RouteHook: the model reports routing to it directly.
    match pass {
        Pass::Prompt => model.prefill(variant, tokens, kv, observer),
        Pass::Step => model.forward(variant, tokens, kv, observer),
    }
}

/// [`forward`] reduced to each row's greedy choice (the backend's argmax: a GPU returns the ids,
/// not the logits rows).
fn forward_greedy<M: LanguageModel>(
    model: &M,
    (variant, pass): (Variant, Pass),
    tokens: &[u32],
    kv: &mut M::Kv,
    observer: &mut dyn DecodeObserver,
) -> Result<Vec<u32>> {
    if variant == Variant::Target {
        observer.on_target_pass(tokens.len());
    }
    let ids = match pass {
        Pass::Prompt => model.prefill_greedy(variant, tokens, kv, observer)?,
        Pass::Step => model.forward_greedy(variant, tokens, kv, observer)?,
    };
    if ids.len() != tokens.len() {
        return Err(Error::Model(format!(
            "a greedy forward returned {} ids for {} rows",
            ids.len(),
            tokens.len()
        )));
    }
    Ok(ids)
}

/// Runs `tokens` and chooses the token after the last one: greedy from the backend's ids, sampled
/// from the last logits row (its distribution kept in `dists` when given: the draft's, for the
/// rejection test).
fn forward_choose<M: LanguageModel>(
    model: &M,
    (variant, pass): (Variant, Pass),
    tokens: &[u32],
    kv: &mut M::Kv,
    observer: &mut dyn DecodeObserver,
    chooser: &mut Chooser,
    dists: Option<&mut Vec<Vec<f64>>>,
) -> Result<u32> {
    if chooser.sampling.is_greedy() {
        let ids = forward_greedy(model, (variant, pass), tokens, kv, observer)?;
        return Ok(ids[ids.len() - 1]);
    }
    let vocab = model.info().vocab_size;
    let logits = forward(model, (variant, pass), tokens, kv, observer)?;
    let row = logits_row(&logits, tokens.len(), vocab, tokens.len() - 1)?;
    Ok(match dists {
        // The draft's proposal: its distribution is kept for the rejection test.
        Some(dists) => {
            let q = chooser.distribution(row);
            let token = sample(&q, &mut chooser.rng);
            dists.push(q);
            token
        }
        None => chooser.choose(row),
    })
}

/// Whether greedy one-row passes may run as a chain: greedy choices, and an observer that is
/// told nothing of each pass.
fn chains(chooser: &Chooser, observer: &dyn DecodeObserver) -> bool {
    chooser.sampling.is_greedy() && !observer.follows_passes()
}

/// One model variant alone: prefill, then one token per forward pass.
fn decode_single<M: LanguageModel>(
    model: &M,
    variant: Variant,
    prompt: &[u32],
    chooser: &mut Chooser,
    observer: &mut dyn DecodeObserver,
    commits: &mut Commits<'_>,
) -> Result<Counters> {
    let mut counters = Counters::default();
    let mut kv = model.new_kv(prompt.len() + commits.max_new)?;
    let mut token = forward_choose(
        model,
        (variant, Pass::Prompt),
        prompt,
        &mut kv,
        observer,
        chooser,
        None,
    )?;
    commits.push(token);
    observer.on_commit(0, 1);
    if chains(chooser, observer) && !commits.finished {
        // Greedy, and no observer to tell about each pass: passes may run back to back.
        let steps = commits.remaining();
        model.forward_greedy_chain(variant, token, &mut kv, observer, steps, &mut |id| {
            counters.rounds += 1;
            commits.push(id);
            !commits.finished
        })?;
        return Ok(counters);
    }
    while !commits.finished {
        token = forward_choose(
            model,
            (variant, Pass::Step),
            &[token],
            &mut kv,
            observer,
            chooser,
            None,
        )?;
        counters.rounds += 1;
        commits.push(token);
        observer.on_commit(0, 1);
    }
    Ok(counters)
}

/// Where the draft keeps its keys and values: the one thing in which Specter's rounds and the
/// SpecMoEOff baseline's differ.
#[derive(Clone, Copy)]
enum DraftCache {
    /// Specter: the draft writes past the committed boundary of the target's KV, and those
    /// scratch positions are dropped before the target verifies.
    Shared,
    /// SpecMoEOff: the draft keeps a KV cache of its own, as a separate draft model does.
    Own,
}

/// The draft's KV state over one generation, under a [`DraftCache`] policy.
enum DraftKv<K> {
    Shared,
    Own(OwnDraftKv<K>),
}

/// A draft KV cache apart from the target's. It always holds a prefix of the committed sequence
/// (`sequence`: the prompt and every committed token, `pending` last), written by the draft,
/// never the whole of it: a round's step 0 runs the committed tokens it lacks (ending with
/// `pending`) and proposes the first draft; steps 1.. run one draft each. After verification it
/// is rolled back to the committed tokens it has run: through the accepted drafts, except the
/// last draft of the window, which it never ran.
struct OwnDraftKv<K> {
    kv: K,
    sequence: Vec<u32>,
}

/// A draft window's proposals, and under sampling the draft's distribution for each (for the
/// rejection test).
struct Proposals {
    tokens: Vec<u32>,
    dists: Vec<Vec<f64>>,
}

impl<K: KvCache> DraftKv<K> {
    fn new<M: LanguageModel<Kv = K>>(
        model: &M,
        cache: DraftCache,
        capacity: usize,
    ) -> Result<Self> {
        Ok(match cache {
            DraftCache::Shared => DraftKv::Shared,
            // A round leaves at most `committed + depth - 1` positions in the draft's cache, and
            // drafting stops short of max_new_tokens, so the target's capacity holds.
            DraftCache::Own => DraftKv::Own(OwnDraftKv {
                kv: model.new_kv(capacity)?,
                sequence: Vec::with_capacity(capacity),
            }),
        })
    }

    /// Runs after the target's prefill chose `first`, before it is committed.
    fn prefill<M: LanguageModel<Kv = K>>(
        &mut self,
        model: &M,
        prompt: &[u32],
        first: u32,
        observer: &mut dyn DecodeObserver,
    ) -> Result<()> {
        if let DraftKv::Own(own) = self {
            // Before the first commit: like the target's, the draft's own prefill is part of the
            // time to the first token, not of the per-token time. Its logits are not needed (the
            // first token is the target's), so it returns ids alone.
            let run = (Variant::Draft, Pass::Prompt);
            forward_greedy(model, run, prompt, &mut own.kv, observer)?;
            own.sequence.extend_from_slice(prompt);
            own.sequence.push(first);
        }
        Ok(())
    }

    /// Runs after verification of a window of `k` drafts, `accepted` of them accepted and
    /// `next` the target's own token.
    fn roll_back(&mut self, k: usize, accepted: &[u32], next: u32) {
        if let DraftKv::Own(own) = self {
            if k > 0 {
                // The draft ran `pending` and drafts 1..k-1: keep what the target accepted of them.
                own.kv
                    .truncate(own.sequence.len() + accepted.len().min(k - 1));
            }
            own.sequence.extend_from_slice(accepted);
            own.sequence.push(next);
        }
    }
}

impl<K: KvCache> OwnDraftKv<K> {
    /// Proposes `k` drafts after the committed sequence, over this cache.
    fn propose<M: LanguageModel<Kv = K>>(
        &mut self,
        model: &M,
        k: usize,
        chooser: &mut Chooser,
        observer: &mut dyn DecodeObserver,
        window: &mut Proposals,
    ) -> Result<()> {
        let unseen = self.kv.len();
        if unseen >= self.sequence.len() {
            return Err(Error::Model(format!(
                "draft KV holds {unseen} positions, the committed sequence only {}",
                self.sequence.len()
            )));
        }
        // Step 0: the committed tokens the draft has not run yet (`pending` at least).
        let catch_up = &self.sequence[unseen..];
        for step in 0..k {
            let tokens = if step == 0 {
                catch_up
            } else {
                &window.tokens[step - 1..step]
            };
            let token = forward_choose(
                model,
                (Variant::Draft, Pass::Step),
                tokens,
                &mut self.kv,
                observer,
                chooser,
                Some(&mut window.dists),
            )?;
            window.tokens.push(token);
            observer.on_draft_step(step);
        }
        Ok(())
    }
}

/// Proposes `k` drafts after `pending` over the target's KV, then drops the draft's scratch
/// positions: the target recomputes them.
fn propose_over_target_kv<M: LanguageModel>(
    model: &M,
    kv: &mut M::Kv,
    pending: u32,
    k: usize,
    chooser: &mut Chooser,
    observer: &mut dyn DecodeObserver,
    window: &mut Proposals,
) -> Result<()> {
    let committed_len = kv.len();
    if chains(chooser, observer) {
        model.forward_greedy_chain(Variant::Draft, pending, kv, observer, k, &mut |id| {
            window.tokens.push(id);
            true
        })?;
        if window.tokens.len() != k {
            return Err(Error::Model(format!(
                "a draft window of {k} steps proposed {} tokens",
                window.tokens.len()
            )));
        }
    } else {
        let mut last = pending;
        for step in 0..k {
            let token = forward_choose(
                model,
                (Variant::Draft, Pass::Step),
                &[last],
                kv,
                observer,
                chooser,
                Some(&mut window.dists),
            )?;
            window.tokens.push(token);
            last = token;
            observer.on_draft_step(step);
        }
    }
    kv.truncate(committed_len);
    Ok(())
}

/// Draft-then-verify rounds, the draft's KV kept as `cache` says.
///
/// Invariant between rounds: the target's KV holds its keys and values for every committed token
/// except the newest (`pending`), which the next verify pass runs first.
fn decode_speculative<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    depth: usize,
    cache: DraftCache,
    chooser: &mut Chooser,
    observer: &mut dyn DecodeObserver,
    commits: &mut Commits<'_>,
) -> Result<Counters> {
    let capacity = prompt.len() + commits.max_new;
    let mut kv = model.new_kv(capacity)?;
    let mut draft_kv = DraftKv::new(model, cache, capacity)?;
    let mut pending = forward_choose(
        model,
        (Variant::Target, Pass::Prompt),
        prompt,
        &mut kv,
        observer,
        chooser,
        None,
    )?;
    draft_kv.prefill(model, prompt, pending, observer)?;
    commits.push(pending);
    observer.on_commit(0, 1);

    let mut counters = Counters::default();
    let mut window = Proposals {
        tokens: Vec::with_capacity(depth),
        dists: Vec::with_capacity(depth),
    };
    let mut verify_tokens: Vec<u32> = Vec::with_capacity(depth + 1);
    while !commits.finished {
        // A round commits at most K + 1 tokens; never draft past max_new_tokens (which also keeps
        // the verify pass inside the KV capacity).
        let k = observer
            .next_depth(depth)
            .min(depth)
            .min(commits.remaining() - 1);
        let committed_len = kv.len();
        window.tokens.clear();
        window.dists.clear();
        if k > 0 {
            observer.on_draft_window(k);
            match &mut draft_kv {
                DraftKv::Shared => propose_over_target_kv(
                    model,
                    &mut kv,
                    pending,
                    k,
                    chooser,
                    observer,
                    &mut window,
                )?,
                DraftKv::Own(own) => {
                    // The committed sequence is the target KV plus `pending`.
                    debug_assert_eq!(committed_len + 1, own.sequence.len());
                    own.propose(model, k, chooser, observer, &mut window)?
                }
            }
        }

        verify_tokens.clear();
        verify_tokens.push(pending);
        verify_tokens.extend_from_slice(&window.tokens);
        let (accepted, next) = verify_pass(
            model,
            &verify_tokens,
            &mut kv,
            observer,
            chooser,
            &window.tokens,
            &window.dists,
        )?;
        // Valid target KV: the committed prefix, the pending token and the accepted drafts.
        kv.truncate(committed_len + 1 + accepted);
        draft_kv.roll_back(k, &window.tokens[..accepted], next);
        counters.rounds += 1;
        counters.drafted += k;
        counters.accepted += accepted;
        let committed = commit_round(commits, &window.tokens[..accepted], next);
        observer.on_commit(accepted, committed);
        pending = next;
    }
    Ok(counters)
}

/// Runs the verify pass over `verify_tokens` (the pending token, then every draft) and checks
/// `drafts` against it: returns how many the target accepted and the target's own next token.
fn verify_pass<M: LanguageModel>(
    model: &M,
    verify_tokens: &[u32],
    kv: &mut M::Kv,
    observer: &mut dyn DecodeObserver,
    chooser: &mut Chooser,
    drafts: &[u32],
    dists: &[Vec<f64>],
) -> Result<(usize, u32)> {
    if chooser.sampling.is_greedy() {
        let ids = forward_greedy(model, VERIFY, verify_tokens, kv, observer)?;
        return Ok(verify_greedy(&ids, drafts));
    }
    let vocab = model.info().vocab_size;
    let logits = forward(model, VERIFY, verify_tokens, kv, observer)?;
    verify_sampled(chooser, &logits, vocab, drafts, dists)
}

/// Greedy verification over the target's choices `ids` (one per verify row): the drafts up to
/// the first the target disagrees with are accepted, and the target's choice there (or after
/// the last row, the bonus token) comes next.
fn verify_greedy(ids: &[u32], drafts: &[u32]) -> (usize, u32) {
    match drafts.iter().zip(ids).position(|(draft, id)| draft != id) {
        Some(i) => (i, ids[i]),
        None => (drafts.len(), ids[drafts.len()]),
    }
}

/// Checks `drafts` against the verify pass's logits (rows: the pending token, then every draft)
/// by rejection sampling and returns how many the target accepted and the target's own next
/// token: a resample at the first rejection, or the bonus token after the last row when all
/// were accepted.
fn verify_sampled(
    chooser: &mut Chooser,
    logits: &[f32],
    vocab: usize,
    drafts: &[u32],
    dists: &[Vec<f64>],
) -> Result<(usize, u32)> {
    let rows = drafts.len() + 1;
    for (i, &draft) in drafts.iter().enumerate() {
        let p = chooser.distribution(logits_row(logits, rows, vocab, i)?);
        if let Some(token) = accept_or_resample(&p, &dists[i], draft, &mut chooser.rng) {
            return Ok((i, token));
        }
    }
    let bonus = chooser.choose(logits_row(logits, rows, vocab, drafts.len())?);
    Ok((drafts.len(), bonus))
}

/// Commits the accepted drafts and the target's next token (until generation is over); returns
/// how many were committed.
fn commit_round(commits: &mut Commits<'_>, accepted: &[u32], next: u32) -> usize {
    accepted
        .iter()
        .chain(std::iter::once(&next))
        .filter(|&&token| commits.push(token))
        .count()
}
