//! Speculative rejection sampling must leave the output distribution equal to the target's: the
//! empirical distribution of whole sampled continuations over many seeds is compared with the
//! exact target distribution, computed by enumerating every continuation on a tiny vocabulary.

mod decode_support;

use std::collections::HashMap;

use decode_support::{prompts, ToyModel};
use specter::decode::{generate, GenerateOptions, Mode, Sampling};
use specter::model::{LanguageModel, NoHook, Variant};

const VOCAB: usize = 3;
const NEW_TOKENS: usize = 4;

/// Softmax at `temperature`, then the smallest top-p nucleus, renormalised (written here
/// independently of the library's version).
fn processed(logits: &[f32], temperature: f32, top_p: f32) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::MIN, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| (f64::from(l - max) / f64::from(temperature)).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let probs: Vec<f64> = weights.iter().map(|w| w / total).collect();
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap());
    let mut kept = vec![0.0; probs.len()];
    let mut mass = 0.0;
    for i in order {
        kept[i] = probs[i];
        mass += probs[i];
        if mass >= f64::from(top_p) {
            break;
        }
    }
    kept.iter().map(|p| p / mass).collect()
}

/// Exact probability of every `NEW_TOKENS`-token continuation when `variant` samples alone.
fn exact_joint(
    model: &ToyModel,
    variant: Variant,
    prompt: &[u32],
    sampling: &Sampling,
) -> HashMap<Vec<u32>, f64> {
    let mut joint = HashMap::new();
    let mut stack = vec![(Vec::<u32>::new(), 1.0f64)];
    while let Some((prefix, p)) = stack.pop() {
        if prefix.len() == NEW_TOKENS {
            joint.insert(prefix, p);
            continue;
        }
        let tokens: Vec<u32> = prompt.iter().chain(&prefix).copied().collect();
        let mut kv = model.new_kv(tokens.len()).expect("kv");
        let logits = model
            .forward(variant, &tokens, &mut kv, &mut NoHook)
            .expect("forward");
        let dist = processed(
            &logits[logits.len() - VOCAB..],
            sampling.temperature,
            sampling.top_p,
        );
        for (token, q) in dist.iter().enumerate() {
            if *q > 0.0 {
                let mut next = prefix.clone();
                next.push(token as u32);
                stack.push((next, p * q));
            }
        }
    }
    joint
}

fn total_variation(a: &HashMap<Vec<u32>, f64>, b: &HashMap<Vec<u32>, f64>) -> f64 {
    let keys: std::collections::HashSet<&Vec<u32>> = a.keys().chain(b.keys()).collect();
    0.5 * keys
        .into_iter()
        .map(|k| (a.get(k).copied().unwrap_or(0.0) - b.get(k).copied().unwrap_or(0.0)).abs())
        .sum::<f64>()
}

fn check_distribution(temperature: f32, top_p: f32, model_seed: u64) {
    let mut model = ToyModel::new(VOCAB, 32, model_seed);
    model.logit_scale = 3.0;
    model.draft_noise = 1.5;
    model.disagree_per_mille = 250;
    let prompt = &prompts(model_seed, &[5], VOCAB)[0];
    let base = Sampling {
        temperature,
        top_p,
        seed: 0,
    };
    let target = exact_joint(&model, Variant::Target, prompt, &base);
    let draft = exact_joint(&model, Variant::Draft, prompt, &base);
    assert!((target.values().sum::<f64>() - 1.0).abs() < 1e-9);
    let draft_gap = total_variation(&target, &draft);
    assert!(
        draft_gap > 0.15,
        "the toy draft must differ from the target (TV {draft_gap})"
    );

    let samples = 30_000u64;
    // SpecMoEOff mode samples and verifies the same way, with the draft on its own KV.
    for (mode, depth) in [
        (Mode::Specter, 1),
        (Mode::Specter, 2),
        (Mode::SpecMoeOff, 2),
    ] {
        let mut counts: HashMap<Vec<u32>, f64> = HashMap::new();
        let mut rejected = 0;
        for seed in 0..samples {
            let opts = GenerateOptions {
                mode,
                max_new_tokens: NEW_TOKENS,
                depth,
                sampling: Sampling { seed, ..base },
                stop_at_eos: false,
            };
            let out = generate(&model, prompt, &opts, &mut NoHook, &mut |_| {}).expect("generate");
            rejected += out.stats.drafted - out.stats.accepted;
            *counts.entry(out.tokens).or_default() += 1.0 / samples as f64;
        }
        assert!(
            rejected > 0,
            "no rejection happened: the test would prove nothing"
        );
        let to_target = total_variation(&counts, &target);
        let to_draft = total_variation(&counts, &draft);
        // With 30k samples over at most 81 outcomes the expected TV from sampling noise alone is
        // about 0.02.
        assert!(
            to_target < 0.045,
            "T {temperature} top_p {top_p} {mode:?} depth {depth}: TV to target {to_target} (to draft {to_draft})"
        );
        assert!(
            to_draft > 0.1,
            "{mode:?} depth {depth}: TV to draft only {to_draft}"
        );
    }
}

#[test]
fn rejection_sampling_preserves_the_target_distribution() {
    check_distribution(1.0, 1.0, 21);
}

#[test]
fn rejection_sampling_preserves_the_target_distribution_under_top_p() {
    check_distribution(0.8, 0.75, 34);
}

#[test]
fn sampling_is_reproducible_per_seed() {
    let model = ToyModel::new(50, 64, 3);
    let prompt = &prompts(1, &[4], 50)[0];
    let opts = |seed| GenerateOptions {
        mode: Mode::Specter,
        max_new_tokens: 30,
        depth: 3,
        sampling: Sampling {
            temperature: 1.0,
            top_p: 0.9,
            seed,
        },
        stop_at_eos: false,
    };
    let run = |seed| {
        generate(&model, prompt, &opts(seed), &mut NoHook, &mut |_| {})
            .expect("generate")
            .tokens
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}
