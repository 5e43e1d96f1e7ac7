//! Properties of the forward pass every architecture must hold: batch/sequential bit-exactness,
//! KV cropping, routing reports, request validation and the INT4 draft variant.

mod common;

use common::{random_tokens, DraftExperts, Fixture, GridStore, FIXTURES};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specter::arch::{expected_tensors, MoeModel, TensorRole};
use specter::backend::cpu::Cpu;
use specter::model::{KvCache, LanguageModel, NoHook, Route, RouteHook, Variant};
use specter::{Error, Result};

/// Runs `tokens` in calls of the given sizes (cycled) and returns all logits.
fn run_chunked<M: LanguageModel>(
    model: &M,
    variant: Variant,
    tokens: &[u32],
    sizes: &[usize],
) -> Vec<f32> {
    let mut kv = model.new_kv(tokens.len()).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    for &s in sizes.iter().cycle() {
        if at >= tokens.len() {
            break;
        }
        let end = (at + s).min(tokens.len());
        out.extend(
            model
                .forward(variant, &tokens[at..end], &mut kv, &mut NoHook)
                .unwrap(),
        );
        at = end;
    }
    assert_eq!(kv.len(), tokens.len());
    out
}

fn assert_bitwise(name: &str, what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    let differing = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    assert_eq!(
        differing, 0,
        "{name}: {what}: {differing} logits differ bitwise"
    );
}

#[test]
fn batched_forward_is_bitwise_equal_to_sequential() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0001);
    for name in FIXTURES {
        let fx = Fixture::load(name);
        let model = fx.model();
        let tokens = random_tokens(&mut rng, 21, fx.cfg.vocab_size);
        let all_at_once = run_chunked(&model, Variant::Target, &tokens, &[tokens.len()]);
        let one_by_one = run_chunked(&model, Variant::Target, &tokens, &[1]);
        let mixed = run_chunked(&model, Variant::Target, &tokens, &[6, 1, 5, 2]);
        assert_bitwise(
            name,
            "one call vs one token per call",
            &all_at_once,
            &one_by_one,
        );
        assert_bitwise(name, "one call vs mixed call sizes", &all_at_once, &mixed);
    }
}

#[test]
fn truncated_cache_continues_like_a_fresh_one() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0002);
    for name in FIXTURES {
        let fx = Fixture::load(name);
        let model = fx.model();
        let vocab = fx.cfg.vocab_size;
        let prompt = random_tokens(&mut rng, 9, vocab);
        let rejected = random_tokens(&mut rng, 5, vocab);
        let continuation = random_tokens(&mut rng, 4, vocab);

        let mut kv = model.new_kv(32).unwrap();
        model
            .forward(Variant::Target, &prompt, &mut kv, &mut NoHook)
            .unwrap();
        model
            .forward(Variant::Target, &rejected, &mut kv, &mut NoHook)
            .unwrap();
        assert_eq!(kv.len(), prompt.len() + rejected.len());
        kv.truncate(prompt.len());
        assert_eq!(kv.len(), prompt.len());
        let after_crop = model
            .forward(Variant::Target, &continuation, &mut kv, &mut NoHook)
            .unwrap();

        let mut fresh = model.new_kv(32).unwrap();
        model
            .forward(Variant::Target, &prompt, &mut fresh, &mut NoHook)
            .unwrap();
        let expected = model
            .forward(Variant::Target, &continuation, &mut fresh, &mut NoHook)
            .unwrap();
        assert_bitwise(name, "continuation after crop", &after_crop, &expected);
    }
}

#[derive(Default)]
struct Recorder {
    calls: Vec<(Variant, usize, usize, usize, Vec<u32>)>,
}

impl RouteHook for Recorder {
    fn on_route(&mut self, r: Route<'_>) {
        self.calls
            .push((r.variant, r.layer, r.moe_layer, r.top_k, r.topk.to_vec()));
    }
}

#[test]
fn every_moe_layer_reports_its_routing() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0003);
    for name in FIXTURES {
        let fx = Fixture::load(name);
        let model = fx.model();
        let info = model.info().clone();
        let tokens = random_tokens(&mut rng, 3, fx.cfg.vocab_size);
        let mut kv = model.new_kv(8).unwrap();
        let mut hook = Recorder::default();
        model
            .forward(Variant::Target, &tokens, &mut kv, &mut hook)
            .unwrap();
        assert_eq!(hook.calls.len(), info.moe_layers.len(), "{name}");
        for (i, (variant, layer, moe_layer, top_k, ids)) in hook.calls.iter().enumerate() {
            assert_eq!(*variant, Variant::Target);
            assert_eq!(
                (*layer, *moe_layer, *top_k),
                (info.moe_layers[i], i, info.top_k),
                "{name}"
            );
            assert_eq!(ids.len(), tokens.len() * info.top_k, "{name}");
            for row in ids.chunks(info.top_k) {
                assert!(
                    row.iter().all(|&e| (e as usize) < info.num_experts),
                    "{name}: {row:?}"
                );
                let mut distinct = row.to_vec();
                distinct.sort_unstable();
                distinct.dedup();
                assert_eq!(
                    distinct.len(),
                    row.len(),
                    "{name}: repeated expert in {row:?}"
                );
            }
        }
    }
}

#[test]
fn invalid_requests_are_rejected() {
    let fx = Fixture::load("mixtral");
    let model = specter_convert::checkpoint::open_cpu_model(&fx.dir).unwrap();
    let vocab = fx.cfg.vocab_size as u32;
    let mut kv = model.new_kv(4).unwrap();
    let request_err = |r: Result<Vec<f32>>| match r {
        Err(Error::Request(m)) => m,
        other => panic!("expected a request error, got {:?}", other.map(|v| v.len())),
    };
    let m = request_err(model.forward(Variant::Target, &[], &mut kv, &mut NoHook));
    assert!(m.contains("at least one token"), "{m}");
    let m = request_err(model.forward(Variant::Target, &[1, vocab], &mut kv, &mut NoHook));
    assert!(
        m.contains(&vocab.to_string()) && m.contains("vocabulary"),
        "{m}"
    );
    assert_eq!(kv.len(), 0);
    let m = request_err(model.forward(Variant::Target, &[1, 2, 3, 4, 5], &mut kv, &mut NoHook));
    assert!(m.contains("capacity 4"), "{m}");
    model
        .forward(Variant::Target, &[1, 2, 3], &mut kv, &mut NoHook)
        .unwrap();
    let m = request_err(model.forward(Variant::Target, &[4, 5], &mut kv, &mut NoHook));
    assert!(m.contains("position 3"), "{m}");
    match model.new_kv(model.info().max_context + 1) {
        Err(Error::Request(m)) => assert!(m.contains("max context"), "{m}"),
        _ => panic!("a cache longer than the context must be refused"),
    }
}

#[test]
fn draft_without_int4_experts_names_the_missing_tensor() {
    let fx = Fixture::load("olmoe");
    let model = fx.model();
    assert!(!model.has_draft());
    let mut kv = model.new_kv(4).unwrap();
    match model.forward(Variant::Draft, &[1, 2], &mut kv, &mut NoHook) {
        Err(Error::Model(m)) => assert!(
            m.contains("draft.layers.0.experts.0.gate_up.qweight"),
            "{m}"
        ),
        other => panic!("expected a model error, got {:?}", other.map(|v| v.len())),
    }
    assert_eq!(kv.len(), 0);
}

#[test]
fn draft_int4_experts_equal_target_experts_on_the_int4_grid() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0004);
    for name in FIXTURES {
        let fx = Fixture::load(name);
        let store = GridStore::new(&fx, DraftExperts::Exact);
        let model = MoeModel::load(fx.cfg.clone(), &store, Cpu).unwrap();
        assert!(model.has_draft());
        let tokens = random_tokens(&mut rng, 10, fx.cfg.vocab_size);
        let target = run_chunked(&model, Variant::Target, &tokens, &[10]);
        let draft = run_chunked(&model, Variant::Draft, &tokens, &[1, 3]);
        // Same expert values through two paths (FP16 and Marlin INT4). The INT4 path computes
        // with activations rounded to f16 (W4A16; src/backend/cpu checks that bit for bit), so
        // the logits agree to that rounding, not bitwise.
        assert_eq!(target.len(), draft.len());
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (&t, &d) in target.iter().zip(&draft) {
            num += (f64::from(t) - f64::from(d)).powi(2);
            den += f64::from(t).powi(2);
        }
        let rel = (num / den).sqrt();
        println!("{name}: draft vs target on grid experts: relative difference {rel:.2e}");
        assert!(
            rel > 0.0 && rel < 2e-3,
            "{name}: draft vs target: {rel:.2e}"
        );
        // The grid experts are not the fixture's: the comparison is not vacuous.
        let original = run_chunked(&fx.model(), Variant::Target, &tokens, &[10]);
        assert!(original.iter().zip(&target).any(|(a, b)| a != b), "{name}");

        let mut hook = Recorder::default();
        let mut kv = model.new_kv(4).unwrap();
        model
            .forward(Variant::Draft, &tokens[..2], &mut kv, &mut hook)
            .unwrap();
        assert!(!hook.calls.is_empty() && hook.calls.iter().all(|c| c.0 == Variant::Draft));
    }
}

#[test]
fn expected_tensors_are_exactly_the_checkpoint_tensors() {
    for name in FIXTURES {
        let fx = Fixture::load(name);
        let ck = fx.checkpoint();
        let mut want: Vec<(String, Vec<usize>)> = expected_tensors(&fx.cfg)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        let mut got: Vec<(String, Vec<usize>)> = ck
            .tensor_names()
            .into_iter()
            .map(|n| (n.clone(), ck.shape(&n).unwrap()))
            .collect();
        want.sort();
        got.sort();
        assert_eq!(want, got, "{name}");
        let routed = expected_tensors(&fx.cfg)
            .iter()
            .filter(|s| matches!(s.role, TensorRole::RoutedExpert { .. }))
            .count();
        assert_eq!(
            routed,
            3 * fx.cfg.moe.num_experts * fx.cfg.moe_layers().len(),
            "{name}"
        );
    }
}
