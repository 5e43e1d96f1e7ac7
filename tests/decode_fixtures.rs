//! Speculative decoding over the real architectures: every fixture checkpoint, with a draft made
//! by converting it into a bundle (RTN INT4 quantization of its own routed experts, Marlin tiled)
//! and loading the model from the bundle.

mod common;

use std::cell::RefCell;

use common::{fixture_simulator, target_only, Fixture, FIXTURES};
use specter::arch::MoeModel;
use specter::backend::cpu::Cpu;
use specter::decode::{generate, generate_with_offload, Mode};
use specter::model::{KvCache, LanguageModel, ModelInfo, NoHook, RouteHook, Variant};
use specter::offload::{frequency_top_m, Policy};
use specter::Result;

/// A fixture converted into a bundle by the real pipeline (RTN INT4 draft, Marlin tiled), and its
/// model loaded from the bundle's mapping.
fn load(name: &str) -> (Fixture, MoeModel<Cpu>) {
    let fixture = Fixture::load(name);
    let (_dir, bundle) = fixture.bundle();
    let model = MoeModel::load(fixture.cfg.clone(), &bundle, Cpu).expect("load");
    assert!(model.has_draft());
    (fixture, model)
}

/// One recorded pass: where it started in its KV, what it ran, what it returned.
struct Pass {
    start: usize,
    tokens: Vec<u32>,
    logits: Vec<f32>,
}

/// Passes everything through to the model, keeping every pass of one variant.
struct Recording<'m, M: LanguageModel> {
    model: &'m M,
    variant: Variant,
    passes: RefCell<Vec<Pass>>,
}

impl<M: LanguageModel> LanguageModel for Recording<'_, M> {
    type Kv = M::Kv;
    fn info(&self) -> &ModelInfo {
        self.model.info()
    }
    fn new_kv(&self, capacity: usize) -> Result<M::Kv> {
        self.model.new_kv(capacity)
    }
    fn forward(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut M::Kv,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<f32>> {
        let start = kv.len();
        let logits = self.model.forward(variant, tokens, kv, hook)?;
        if variant == self.variant {
            self.passes.borrow_mut().push(Pass {
                start,
                tokens: tokens.to_vec(),
                logits: logits.clone(),
            });
        }
        Ok(logits)
    }
}

use common::greedy_options as options;

/// For every fixture: greedy Specter output equals target-only output at every depth, and
/// every verify pass's logits equal, bit for bit, those of one target pass over the whole
/// committed sequence (so the KV each verify pass read was exactly the committed prefix's).
#[test]
fn greedy_specter_is_lossless_on_every_fixture() {
    for name in FIXTURES {
        let (fixture, model) = load(name);
        let vocab = model.info().vocab_size;
        let mut drafted = 0;
        let mut accepted = 0;
        for prompt in fixture.prompts().iter().take(2) {
            let max_new = 12;
            let target = target_only(&model, prompt, max_new);
            let full: Vec<u32> = prompt.iter().chain(&target.tokens).copied().collect();
            let mut kv = model.new_kv(full.len()).expect("kv");
            let reference = model
                .forward(Variant::Target, &full, &mut kv, &mut NoHook)
                .expect("reference");
            for depth in [1, 2, 4, 16] {
                let recording = Recording {
                    model: &model,
                    variant: Variant::Target,
                    passes: RefCell::new(Vec::new()),
                };
                let out = generate(
                    &recording,
                    prompt,
                    &options(Mode::Specter, max_new, depth),
                    &mut NoHook,
                    &mut |_| {},
                )
                .expect("specter");
                assert_eq!(out.tokens, target.tokens, "{name}: depth {depth}");
                drafted += out.stats.drafted;
                accepted += out.stats.accepted;
                let mut compared = 0;
                for pass in recording.passes.borrow().iter().skip(1) {
                    // Rows whose own and earlier tokens were committed must match the reference.
                    for (i, &token) in pass.tokens.iter().enumerate() {
                        let position = pass.start + i;
                        if full.get(position) != Some(&token) {
                            break;
                        }
                        if position + 1 >= full.len() {
                            break;
                        }
                        let got = &pass.logits[i * vocab..(i + 1) * vocab];
                        let want = &reference[position * vocab..(position + 1) * vocab];
                        assert!(
                            got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{name}: depth {depth}, verify row at position {position} differs from the reference"
                        );
                        compared += 1;
                    }
                }
                assert!(
                    compared >= max_new - 1,
                    "{name}: only {compared} rows compared"
                );
            }
        }
        eprintln!("{name}: drafted {drafted}, accepted {accepted}");
        assert!(
            accepted > 0,
            "{name}: the INT4 draft never agreed with the target"
        );
    }
}

#[test]
fn offload_simulation_runs_on_a_real_model() {
    // Every fixture, every policy, residencies from one slot to all: the expert cache decides what
    // would be copied, never what is computed, so the tokens must equal target-only decoding's.
    for name in FIXTURES {
        let (fixture, model) = load(name);
        let prompt = &fixture.prompts()[0];
        let info = model.info().clone();
        let target = target_only(&model, prompt, 16);
        for slots in [1, info.num_experts / 2, info.num_experts] {
            for (mode, policy) in [
                (Mode::Specter, Policy::Specter),
                (Mode::SpecMoeOff, Policy::Specter),
                (Mode::Specter, Policy::Lru),
                (Mode::Target, Policy::Lru),
                (Mode::Target, Policy::OnDemand),
            ] {
                let mut sim = fixture_simulator(&info, slots, policy);
                if mode == Mode::SpecMoeOff {
                    // SpecMoEOff's own rule: Top-M by route frequency after draft steps 0 and 1.
                    sim = sim
                        .with_frequency_prefetch(frequency_top_m(slots, info.top_k))
                        .expect("frequency prefetch");
                }
                let opts = options(mode, 16, if mode == Mode::SpecMoeOff { 3 } else { 4 });
                let out = generate_with_offload(&model, prompt, &opts, &mut sim, &mut |_| {})
                    .expect("offload");
                let what = format!("{name}: {mode:?} with {policy:?}, {slots} slots");
                assert_eq!(out.tokens, target.tokens, "{what}");
                let s = out.stats.offload.expect("stats");
                assert_eq!(s.hits + s.misses, s.lookups, "{what}");
                assert!(s.lookups > 0, "{what}");
                assert_eq!(
                    s.bytes_copied,
                    (s.misses + s.prefetched) * info.expert_bytes as u64,
                    "{what}"
                );
                assert_eq!(s.prefetched, s.prefetch_used + s.prefetch_wasted, "{what}");
                if policy == Policy::Specter && slots < info.num_experts {
                    assert!(s.prefetched > 0, "{what}: the draft prefetched nothing");
                }
            }
        }
    }
}

/// For every fixture: greedy SpecMoEOff output (the draft with its own KV) equals target-only
/// output, rejections included; and every draft pass returned, bit for bit, what the draft run
/// from scratch over the same tokens returns, so its KV was never left holding anything but the
/// draft's own keys and values of those tokens (a missing or wrong rollback would show).
#[test]
fn specmoeoff_is_lossless_and_its_draft_kv_matches_a_fresh_draft_on_every_fixture() {
    let mut drafted = 0;
    let mut accepted = 0;
    for name in FIXTURES {
        let (fixture, model) = load(name);
        let vocab = model.info().vocab_size;
        for prompt in fixture.prompts().iter().take(2) {
            let max_new = 12;
            let target = target_only(&model, prompt, max_new);
            for depth in [1, 3, 5] {
                let recording = Recording {
                    model: &model,
                    variant: Variant::Draft,
                    passes: RefCell::new(Vec::new()),
                };
                let out = generate(
                    &recording,
                    prompt,
                    &options(Mode::SpecMoeOff, max_new, depth),
                    &mut NoHook,
                    &mut |_| {},
                )
                .expect("specmoeoff");
                assert_eq!(out.tokens, target.tokens, "{name}: depth {depth}");
                drafted += out.stats.drafted;
                accepted += out.stats.accepted;
                if depth != 3 {
                    continue;
                }
                // Every draft pass goes to the draft's own KV, so its contents are the tokens of
                // the passes so far, each cut back to where the next one starts.
                let mut shadow: Vec<u32> = Vec::new();
                let passes = recording.passes.borrow();
                assert_eq!(passes[0].start, 0, "{name}: the draft's prefill");
                assert_eq!(&passes[0].tokens, prompt, "{name}: the draft's prefill");
                for (i, pass) in passes.iter().enumerate() {
                    assert!(
                        pass.start <= shadow.len(),
                        "{name}: pass {i} skips positions"
                    );
                    shadow.truncate(pass.start);
                    shadow.extend_from_slice(&pass.tokens);
                    let mut kv = model.new_kv(shadow.len()).expect("kv");
                    let fresh = model
                        .forward(Variant::Draft, &shadow, &mut kv, &mut NoHook)
                        .expect("fresh draft");
                    let rows = &fresh[pass.start * vocab..];
                    assert!(
                        rows.iter()
                            .zip(&pass.logits)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{name}: draft pass {i} differs from the draft run from scratch"
                    );
                    if i > 0 {
                        // What the draft ran is the committed sequence or drafts on top of a
                        // committed prefix: its KV before the pass is committed tokens only
                        // unless the pass is a later step of a window.
                        let full: Vec<u32> = prompt.iter().chain(&out.tokens).copied().collect();
                        let committed_prefix = shadow[..pass.start]
                            .iter()
                            .zip(&full)
                            .take_while(|(a, b)| a == b)
                            .count();
                        assert!(
                            committed_prefix + 3 > pass.start,
                            "{name}: draft pass {i} keeps {} rejected positions",
                            pass.start - committed_prefix
                        );
                    }
                }
            }
        }
    }
    eprintln!("specmoeoff on the fixtures: drafted {drafted}, accepted {accepted}");
    assert!(accepted > 0, "the INT4 draft never agreed with the target");
    assert!(accepted < drafted, "no rejection was exercised");
}

/// A greedy chain on the CPU backend (which feeds no choices on a device, so it runs the passes
/// one at a time) gives forward_greedy's choices, stops where `accept` says, and leaves the KV
/// holding exactly the passes whose choices were accepted.
#[test]
fn greedy_chain_stops_where_told_and_equals_single_passes() {
    let (fixture, model) = load(FIXTURES[0]);
    let prompt = fixture.prompts()[0].clone();
    for variant in [Variant::Target, Variant::Draft] {
        let mut kv = model.new_kv(prompt.len() + 10).unwrap();
        let ids = model.forward_greedy(variant, &prompt, &mut kv, &mut NoHook);
        let first = *ids.unwrap().last().unwrap();
        let mut want = Vec::new();
        let mut last = first;
        for _ in 0..9 {
            last = model
                .forward_greedy(variant, &[last], &mut kv, &mut NoHook)
                .unwrap()[0];
            want.push(last);
        }

        let mut kv = model.new_kv(prompt.len() + 10).unwrap();
        model
            .forward_greedy(variant, &prompt, &mut kv, &mut NoHook)
            .unwrap();
        let mut got = Vec::new();
        let mut accept = |id: u32| {
            got.push(id);
            got.len() < 4
        };
        model
            .forward_greedy_chain(variant, first, &mut kv, &mut NoHook, 9, &mut accept)
            .unwrap();
        assert_eq!(kv.len(), prompt.len() + 4, "{variant:?}: stopped after 4");
        let last = got[3];
        let mut more = |id: u32| {
            got.push(id);
            true
        };
        model
            .forward_greedy_chain(variant, last, &mut kv, &mut NoHook, 5, &mut more)
            .unwrap();
        assert_eq!(kv.len(), prompt.len() + 9);
        assert_eq!(got, want, "{variant:?}");
    }
}
