//! Greedy speculative decoding against target-only decoding on a toy model whose output depends
//! on every KV position (see decode_support).

mod decode_support;

use decode_support::{prompts, ToyModel};
use specter::decode::{generate, GenerateOptions, GenerateOutput, Mode, Sampling};
use specter::model::{LanguageModel, NoHook, Variant};
use specter::Error;

fn options(mode: Mode, max_new_tokens: usize, depth: usize) -> GenerateOptions {
    GenerateOptions {
        mode,
        max_new_tokens,
        depth,
        sampling: Sampling::greedy(),
        stop_at_eos: false,
    }
}

fn run(model: &ToyModel, prompt: &[u32], opts: &GenerateOptions) -> GenerateOutput {
    let mut streamed = Vec::new();
    let out =
        generate(model, prompt, opts, &mut NoHook, &mut |t| streamed.push(t)).expect("generate");
    assert_eq!(
        streamed, out.tokens,
        "streamed tokens differ from the output"
    );
    assert_eq!(out.stats.generated_tokens, out.tokens.len());
    out
}

/// Greedy speculative decoding in `mode` at every depth of `depths` gives the target's tokens, on
/// workloads with both rejected and fully accepted windows.
fn greedy_speculation_equals_target(mode: Mode, depths: &[usize]) {
    let mut saw_rejection = false;
    let mut saw_full_acceptance = false;
    for (seed, disagree) in [(1u64, 300u64), (2, 100), (3, 700)] {
        let mut model = ToyModel::new(64, 128, seed);
        model.disagree_per_mille = disagree;
        for prompt in prompts(seed * 10, &[1, 3, 8, 17], 64) {
            for max_new in [1, 2, 7, 40] {
                let target = run(&model, &prompt, &options(Mode::Target, max_new, 1));
                assert_eq!(target.tokens.len(), max_new);
                assert_eq!(target.stats.rounds, max_new - 1);
                for &depth in depths {
                    let out = run(&model, &prompt, &options(mode, max_new, depth));
                    assert_eq!(
                        out.tokens, target.tokens,
                        "{mode:?}: seed {seed} prompt {prompt:?} max_new {max_new} depth {depth}"
                    );
                    let stats = &out.stats;
                    assert!(stats.accepted <= stats.drafted);
                    // Every round commits its accepted drafts plus one token; the prefill one more.
                    assert_eq!(stats.accepted + stats.rounds + 1, max_new);
                    saw_rejection |= stats.accepted < stats.drafted;
                    saw_full_acceptance |= stats.drafted > 0 && stats.accepted == stats.drafted;
                }
            }
        }
    }
    assert!(
        saw_rejection && saw_full_acceptance,
        "the workload must exercise both outcomes"
    );
}

#[test]
fn greedy_specter_equals_target_for_every_depth() {
    greedy_speculation_equals_target(Mode::Specter, &[1, 2, 4, 16]);
}

#[test]
fn greedy_specter_equals_target_with_eos_stop() {
    // A small vocabulary makes the EOS token (the last id) come up within a few dozen tokens.
    let model = ToyModel::new(6, 200, 9);
    let mut stopped_early = 0;
    for prompt in prompts(77, &[2, 5, 9, 4, 6, 3], 6) {
        let mut target_opts = options(Mode::Target, 60, 1);
        target_opts.stop_at_eos = true;
        let target = run(&model, &prompt, &target_opts);
        if target.tokens.len() < 60 {
            stopped_early += 1;
            assert_eq!(target.tokens.last(), Some(&5));
        }
        assert!(!target.tokens[..target.tokens.len() - 1].contains(&5));
        for depth in [1, 3, 8] {
            let mut opts = options(Mode::Specter, 60, depth);
            opts.stop_at_eos = true;
            assert_eq!(
                run(&model, &prompt, &opts).tokens,
                target.tokens,
                "depth {depth}"
            );
        }
    }
    assert!(stopped_early > 0);
}

/// Every target pass of a speculative run must see exactly the KV a target-only run over the
/// committed tokens would have built: the committed prefix, all written by the target. Every
/// draft window must start on that KV and only extend it.
#[test]
fn kv_after_any_accept_lengths_matches_target_only_kv() {
    let depth = 5;
    let mut accept_lengths = vec![0usize; depth + 1];
    for seed in 0..6u64 {
        let mut model = ToyModel::new(48, 160, 100 + seed);
        model.disagree_per_mille = 150 * (seed % 3) + 50;
        for prompt in prompts(seed, &[4, 11], 48) {
            model.take_calls();
            let out = run(&model, &prompt, &options(Mode::Specter, 90, depth));
            let committed: Vec<u32> = prompt.iter().chain(&out.tokens).copied().collect();
            let calls = model.take_calls();
            let target_calls: Vec<_> = calls
                .iter()
                .filter(|c| c.variant == Variant::Target)
                .collect();
            assert_eq!(target_calls.len(), out.stats.rounds + 1);
            for (i, call) in target_calls.iter().enumerate() {
                let len = call.kv_before.len();
                let expected: Vec<(u32, Variant)> = committed[..len]
                    .iter()
                    .map(|&t| (t, Variant::Target))
                    .collect();
                assert_eq!(
                    call.kv_before, expected,
                    "target pass {i}: KV is not the committed prefix"
                );
                // The pass starts at the first committed token without KV.
                assert_eq!(call.tokens[0], committed[len], "target pass {i}");
                if i > 0 && i + 1 < target_calls.len() {
                    // Verify passes: the next one starts past the accepted drafts plus one.
                    let next = target_calls[i + 1].kv_before.len();
                    accept_lengths[next - len - 1] += 1;
                }
            }
            let mut window_start = None;
            for call in &calls {
                match call.variant {
                    Variant::Target => window_start = None,
                    Variant::Draft => {
                        let start = *window_start.get_or_insert(call.kv_before.len());
                        let (base, scratch) = call.kv_before.split_at(start);
                        assert!(base.iter().all(|&(_, v)| v == Variant::Target));
                        assert!(scratch.iter().all(|&(_, v)| v == Variant::Draft));
                        assert_eq!(call.tokens.len(), 1);
                    }
                }
            }
        }
    }
    // Every accept length 0..=K must have occurred for the check above to mean something.
    assert!(
        accept_lengths.iter().all(|&n| n > 0),
        "accept lengths {accept_lengths:?}"
    );
}

#[test]
fn depth_shrinks_at_the_end_of_the_context() {
    let model = ToyModel::new(32, 24, 5);
    for prompt in prompts(8, &[1, 7, 23], 32) {
        let max_new = 24 - prompt.len();
        let target = run(&model, &prompt, &options(Mode::Target, max_new, 1));
        for depth in [1, 4, 16, 64] {
            let specter = run(&model, &prompt, &options(Mode::Specter, max_new, depth));
            assert_eq!(specter.tokens, target.tokens);
        }
    }
}

#[test]
fn draft_mode_is_the_draft_alone() {
    let mut model = ToyModel::new(40, 64, 12);
    model.disagree_per_mille = 500;
    let prompt = &prompts(3, &[6], 40)[0];
    let out = run(&model, prompt, &options(Mode::Draft, 20, 4));
    // Reference: greedy decoding with the draft variant by hand.
    let mut kv = model.new_kv(26).expect("kv");
    let mut logits = model
        .forward(Variant::Draft, prompt, &mut kv, &mut NoHook)
        .expect("prefill");
    let mut expected = Vec::new();
    for _ in 0..20 {
        let row = &logits[logits.len() - 40..];
        let token = decode_support::argmax(row) as u32;
        expected.push(token);
        logits = model
            .forward(Variant::Draft, &[token], &mut kv, &mut NoHook)
            .expect("step");
    }
    assert_eq!(out.tokens, expected);
    let target = run(&model, prompt, &options(Mode::Target, 20, 4));
    assert_ne!(
        out.tokens, target.tokens,
        "the toy draft should drift from the target"
    );
    assert!(
        model
            .take_calls()
            .iter()
            .filter(|c| c.variant == Variant::Target)
            .count()
            > 0
    );
}

#[test]
fn bad_requests_are_refused() {
    let model = ToyModel::new(16, 32, 1);
    let good = options(Mode::Specter, 8, 2);
    let refuse = |prompt: &[u32], opts: &GenerateOptions, needle: &str| match generate(
        &model,
        prompt,
        opts,
        &mut NoHook,
        &mut |_| {},
    ) {
        Err(Error::Request(message)) => assert!(message.contains(needle), "{message}"),
        other => panic!("expected a request error mentioning {needle:?}, got {other:?}"),
    };
    refuse(&[], &good, "empty");
    refuse(&[3, 16, 2], &good, "token 16 at position 1");
    refuse(&[1; 25], &good, "context");
    refuse(&[1], &options(Mode::Specter, usize::MAX, 2), "context");
    refuse(&[1, 2], &options(Mode::Specter, 8, 0), "depth");
    let mut hot = good.clone();
    hot.sampling.temperature = -1.0;
    refuse(&[1], &hot, "temperature");
    let mut nucleus = good.clone();
    nucleus.sampling = Sampling {
        temperature: 1.0,
        top_p: 0.0,
        seed: 1,
    };
    refuse(&[1], &nucleus, "top_p");
    // The boundary itself is fine.
    assert!(generate(&model, &[1; 24], &good, &mut NoHook, &mut |_| {}).is_ok());
    let none = generate(
        &model,
        &[1; 4],
        &options(Mode::Specter, 0, 2),
        &mut NoHook,
        &mut |_| {},
    )
    .expect("empty");
    assert!(none.tokens.is_empty());
}

#[test]
fn greedy_specmoeoff_equals_target_for_every_depth() {
    greedy_speculation_equals_target(Mode::SpecMoeOff, &[1, 2, 3, 4, 16]);
}

#[test]
fn greedy_specmoeoff_equals_target_with_eos_stop_and_at_the_end_of_the_context() {
    let model = ToyModel::new(6, 200, 9);
    for prompt in prompts(77, &[2, 5, 9], 6) {
        let mut target_opts = options(Mode::Target, 60, 1);
        target_opts.stop_at_eos = true;
        let target = run(&model, &prompt, &target_opts);
        let mut opts = options(Mode::SpecMoeOff, 60, 3);
        opts.stop_at_eos = true;
        assert_eq!(run(&model, &prompt, &opts).tokens, target.tokens);
    }
    let model = ToyModel::new(32, 24, 5);
    for prompt in prompts(8, &[1, 7, 23], 32) {
        let max_new = 24 - prompt.len();
        let target = run(&model, &prompt, &options(Mode::Target, max_new, 1));
        for depth in [1, 3, 64] {
            let out = run(&model, &prompt, &options(Mode::SpecMoeOff, max_new, depth));
            assert_eq!(out.tokens, target.tokens, "depth {depth}");
        }
    }
}

/// SpecMoEOff's draft has a KV of its own: every draft pass runs on a cache the draft alone wrote,
/// never the target's. A window's step 0 starts on a prefix of the committed sequence (so a
/// rejected draft never survives the rollback) and runs the committed tokens it lacks, ending at
/// the newest; later steps extend the window one draft at a time. The target's KV stays exactly
/// the committed prefix, as in Specter mode.
#[test]
fn specmoeoff_draft_kv_is_its_own_and_rolled_back_to_the_committed_prefix() {
    let depth = 3;
    let mut accept_lengths = vec![0usize; depth + 1];
    let mut catch_up_rows = [0usize; 3];
    for seed in 0..6u64 {
        let mut model = ToyModel::new(48, 160, 200 + seed);
        model.disagree_per_mille = 150 * (seed % 3) + 50;
        for prompt in prompts(seed, &[4, 11], 48) {
            model.take_calls();
            let out = run(&model, &prompt, &options(Mode::SpecMoeOff, 90, depth));
            let committed: Vec<u32> = prompt.iter().chain(&out.tokens).copied().collect();
            let calls = model.take_calls();
            let tokens_of = |kv: &[(u32, Variant)]| kv.iter().map(|&(t, _)| t).collect::<Vec<_>>();
            let target_calls: Vec<_> = calls
                .iter()
                .filter(|c| c.variant == Variant::Target)
                .collect();
            assert_eq!(target_calls.len(), out.stats.rounds + 1);
            for (i, call) in target_calls.iter().enumerate() {
                let len = call.kv_before.len();
                assert!(call.kv_before.iter().all(|&(_, v)| v == Variant::Target));
                assert_eq!(
                    tokens_of(&call.kv_before),
                    committed[..len],
                    "target pass {i}"
                );
                assert_eq!(call.tokens[0], committed[len], "target pass {i}");
                if i > 0 && i + 1 < target_calls.len() {
                    let next = target_calls[i + 1].kv_before.len();
                    accept_lengths[next - len - 1] += 1;
                }
            }
            // The draft's own prefill comes right after the target's.
            assert_eq!(calls[1].variant, Variant::Draft);
            assert!(calls[1].kv_before.is_empty());
            assert_eq!(calls[1].tokens, prompt);
            // What the draft KV holds after the previous draft pass of the window; None before
            // a window's step 0 (after the prefill and after every verify pass).
            let mut in_window: Option<Vec<u32>> = None;
            for (index, call) in calls.iter().enumerate().skip(2) {
                if call.variant == Variant::Target {
                    in_window = None;
                    continue;
                }
                assert!(
                    call.kv_before.iter().all(|&(_, v)| v == Variant::Draft),
                    "a draft pass ran on a KV the target wrote"
                );
                let before = tokens_of(&call.kv_before);
                match &in_window {
                    None => {
                        // Step 0: a committed prefix (nothing rejected left in it), then the
                        // committed tokens it lacks up to the newest, which the coming verify
                        // pass runs first: one, or two after a fully accepted window.
                        let verify = calls[index..]
                            .iter()
                            .find(|c| c.variant == Variant::Target)
                            .expect("a verify pass follows every window");
                        let newest = verify.kv_before.len();
                        let len = before.len();
                        assert_eq!(before, committed[..len], "stale draft KV");
                        assert_eq!(len + call.tokens.len(), newest + 1);
                        assert_eq!(call.tokens, committed[len..=newest]);
                        assert!((1..=2).contains(&call.tokens.len()));
                        catch_up_rows[call.tokens.len()] += 1;
                    }
                    Some(window) => {
                        assert_eq!(&before, window);
                        assert_eq!(call.tokens.len(), 1);
                    }
                }
                let mut after = before;
                after.extend_from_slice(&call.tokens);
                in_window = Some(after);
            }
        }
    }
    assert!(
        accept_lengths.iter().all(|&n| n > 0),
        "accept lengths {accept_lengths:?}"
    );
    assert!(
        catch_up_rows[1] > 0 && catch_up_rows[2] > 0,
        "step 0 must have run one and two rows: {catch_up_rows:?}"
    );
}

use specter::model::KvCache;

/// A model that records every prompt pass ([`LanguageModel::prefill`]) it is asked for.
struct PromptSpy<'m> {
    model: &'m ToyModel,
    /// (variant, first position, rows) of each prompt pass.
    prompts: std::cell::RefCell<Vec<(Variant, usize, usize)>>,
}

impl LanguageModel for PromptSpy<'_> {
    type Kv = <ToyModel as LanguageModel>::Kv;

    fn info(&self) -> &specter::model::ModelInfo {
        self.model.info()
    }

    fn new_kv(&self, capacity: usize) -> specter::Result<Self::Kv> {
        self.model.new_kv(capacity)
    }

    fn forward(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn specter::model::RouteHook,
    ) -> specter::Result<Vec<f32>> {
        self.model.forward(variant, tokens, kv, hook)
    }

    fn prefill(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn specter::model::RouteHook,
    ) -> specter::Result<Vec<f32>> {
        self.prompts
            .borrow_mut()
            .push((variant, kv.len(), tokens.len()));
        self.model.prefill(variant, tokens, kv, hook)
    }
}

/// Every mode runs its prompt, and nothing else, as a prompt pass (where a backend may use
/// other arithmetic than for decoding passes): the target's once from position 0, and the
/// draft's own cache's once where it has one. Greedy and sampled alike.
#[test]
fn only_the_prompt_runs_as_a_prompt_pass() {
    let model = ToyModel::new(64, 128, 5);
    let prompt = prompts(50, &[9], 64).remove(0);
    let sampled = Sampling {
        temperature: 0.8,
        top_p: 1.0,
        seed: 7,
    };
    for sampling in [Sampling::greedy(), sampled] {
        for (mode, depth, draft_prompt) in [
            (Mode::Target, 1, false),
            (Mode::Draft, 1, false),
            (Mode::Specter, 4, false),
            (Mode::SpecMoeOff, 3, true),
        ] {
            let spy = PromptSpy {
                model: &model,
                prompts: Default::default(),
            };
            let mut opts = options(mode, 12, depth);
            opts.sampling = sampling;
            generate(&spy, &prompt, &opts, &mut NoHook, &mut |_| ()).expect("generate");
            let first = if mode == Mode::Draft {
                Variant::Draft
            } else {
                Variant::Target
            };
            let mut want = vec![(first, 0, prompt.len())];
            if draft_prompt {
                want.push((Variant::Draft, 0, prompt.len()));
            }
            assert_eq!(*spy.prompts.borrow(), want, "{mode:?} {sampling:?}");
            // The spy's KV type is the toy's: a prompt pass leaves it as a decoding pass would.
            let mut kv = spy.new_kv(prompt.len()).unwrap();
            spy.prefill(Variant::Target, &prompt, &mut kv, &mut NoHook)
                .unwrap();
            assert_eq!(kv.len(), prompt.len());
        }
    }
}
