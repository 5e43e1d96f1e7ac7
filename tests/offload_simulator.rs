//! OffloadSimulator driven by real decode runs of the toy model: counter consistency per policy,
//! the time model, reset, and draft-driven prefetch beating LRU when the draft routes like the
//! target.

#[path = "decode_support/mod.rs"]
mod decode_support;

use decode_support::{prompts, ToyModel};
use specter::decode::{
    generate, generate_with_offload, GenerateOptions, GenerateOutput, Mode, Sampling,
};
use specter::model::{LanguageModel, Route, RouteHook, Variant};
use specter::offload::{
    ComputeModel, InitialResidency, OffloadSimulator, OffloadStats, Policy, ResidencyConfig,
    SimulatorConfig,
};
use specter::Error;

const BANDWIDTH: f64 = 2.0e9;

fn model() -> ToyModel {
    let mut model = ToyModel::new(64, 256, 17).with_experts(16, 2);
    model.route_skew = 1.6;
    model.disagree_per_mille = 200;
    model
}

fn simulator(model: &ToyModel, policy: Policy, slots: usize) -> OffloadSimulator {
    OffloadSimulator::new(SimulatorConfig {
        residency: ResidencyConfig::for_model(model.info(), slots, policy),
        initial: InitialResidency::FirstExperts,
        bandwidth_bytes_per_s: BANDWIDTH,
        latency_s: 5e-6,
        compute: ComputeModel {
            draft_step_s: 1.5e-3,
            target_pass_s: 4e-3,
            target_row_s: 0.2e-3,
        },
    })
    .expect("simulator")
}

fn options(mode: Mode) -> GenerateOptions {
    GenerateOptions {
        mode,
        max_new_tokens: 48,
        depth: 6,
        sampling: Sampling::greedy(),
        stop_at_eos: false,
    }
}

fn run(
    model: &ToyModel,
    sim: &mut OffloadSimulator,
    prompt: &[u32],
    mode: Mode,
) -> (GenerateOutput, OffloadStats) {
    let out =
        generate_with_offload(model, prompt, &options(mode), sim, &mut |_| {}).expect("generate");
    let stats = out.stats.offload.clone().expect("offload stats");
    (out, stats)
}

/// Counts target lookups independently: distinct experts per target pass and MoE layer.
#[derive(Default)]
struct LookupCounter(u64);

impl RouteHook for LookupCounter {
    fn on_route(&mut self, Route { variant, topk, .. }: Route<'_>) {
        if variant == Variant::Target {
            let mut distinct = topk.to_vec();
            distinct.sort_unstable();
            distinct.dedup();
            self.0 += distinct.len() as u64;
        }
    }
}

#[test]
fn counters_are_consistent_under_every_policy() {
    let model = model();
    let bytes = model.info().expert_bytes as u64;
    for prompt in prompts(4, &[3, 9], 64) {
        for mode in [Mode::Target, Mode::Specter] {
            let mut counter = LookupCounter::default();
            let reference = generate(&model, &prompt, &options(mode), &mut counter, &mut |_| {})
                .expect("generate");
            for policy in [
                Policy::AllResident,
                Policy::OnDemand,
                Policy::Lru,
                Policy::Specter,
            ] {
                let mut sim = simulator(&model, policy, 5);
                let (out, s) = run(&model, &mut sim, &prompt, mode);
                let what = format!("{policy:?} {mode:?}: {s:?}");
                assert_eq!(
                    out.tokens, reference.tokens,
                    "offloading must not change the output"
                );
                assert_eq!(s.lookups, counter.0, "{what}");
                assert_eq!(s.hits + s.misses, s.lookups, "{what}");
                assert_eq!(s.layer_hits.iter().sum::<u64>(), s.hits, "{what}");
                assert_eq!(s.layer_misses.iter().sum::<u64>(), s.misses, "{what}");
                assert_eq!(s.misses, s.misses, "{what}");
                assert_eq!(s.prefetched, s.prefetch_used + s.prefetch_wasted, "{what}");
                assert_eq!(s.bytes_copied, (s.misses + s.prefetched) * bytes, "{what}");
                assert_eq!(s.committed_tokens, out.tokens.len() as u64);
                // The clock only moves by compute and by waiting for copies.
                assert!(
                    (s.simulated_s - (s.compute_s + s.stall_s)).abs() < 1e-9,
                    "{what}"
                );
                match policy {
                    Policy::AllResident => {
                        assert_eq!((s.misses, s.bytes_copied), (0, 0), "{what}");
                        assert_eq!(s.stall_s, 0.0);
                    }
                    Policy::OnDemand => {
                        assert_eq!(s.hits, 0, "OnDemand reused an expert: {what}");
                        assert!(s.stall_s > 0.0);
                    }
                    Policy::Lru => assert!(s.hits > 0 && s.misses > 0, "{what}"),
                    Policy::Specter => {}
                }
                if policy != Policy::Specter || mode == Mode::Target {
                    assert_eq!(s.prefetched, 0, "{what}");
                } else {
                    assert!(s.prefetched > 0 && s.prefetch_used > 0, "{what}");
                }
            }
        }
    }
}

#[test]
fn draft_driven_prefetch_stalls_less_than_lru() {
    let model = model();
    // With 16 experts, top-2 and 7-row verify passes, a layer touches about 8 experts per pass;
    // prefetch pays off once a useful part of them fits.
    for slots in [6, 8, 12] {
        let mut totals = [(0.0f64, 0u64, 0.0f64); 2];
        for prompt in prompts(21, &[2, 6, 12], 64) {
            for (i, policy) in [Policy::Lru, Policy::Specter].into_iter().enumerate() {
                let mut sim = simulator(&model, policy, slots);
                let (_, s) = run(&model, &mut sim, &prompt, Mode::Specter);
                totals[i].0 += s.stall_s;
                totals[i].1 += s.hits;
                totals[i].2 += s.simulated_tpot_ms;
            }
        }
        let [(lru_stall, lru_hits, lru_tpot), (spec_stall, spec_hits, spec_tpot)] = totals;
        // Under the GPU's cache rules (plans accumulate over a window's chunks; a demand load
        // takes a planned slot when nothing else is left) the stall ratio measured 0.80, 0.68
        // and 0.41 at 6, 8 and 12 slots.
        assert!(
            spec_stall < 0.85 * lru_stall,
            "slots {slots}: Specter stalls {spec_stall} s vs LRU {lru_stall} s"
        );
        assert!(
            spec_hits > lru_hits,
            "slots {slots}: hits {spec_hits} vs {lru_hits}"
        );
        assert!(
            spec_tpot < lru_tpot,
            "slots {slots}: TPOT {spec_tpot} vs {lru_tpot}"
        );
    }
}

#[test]
fn prefetch_is_wasted_when_the_draft_routes_elsewhere() {
    let mut faithful = model();
    faithful.route_noise_per_mille = 0;
    let mut erratic = model();
    erratic.route_noise_per_mille = 1000;
    let prompt = &prompts(2, &[5], 64)[0];
    let waste = |m: &ToyModel| {
        let mut sim = simulator(m, Policy::Specter, 4);
        let (_, s) = run(m, &mut sim, prompt, Mode::Specter);
        s.prefetch_wasted as f64 / s.prefetched as f64
    };
    let (good, bad) = (waste(&faithful), waste(&erratic));
    assert!(
        bad > good + 0.2,
        "wasted fraction: faithful draft {good}, erratic draft {bad}"
    );
}

#[test]
fn reset_restores_residency_and_reproduces_a_run() {
    let model = model();
    let prompt = &prompts(8, &[7], 64)[0];
    let initial = InitialResidency::PerLayer(vec![vec![4, 0, 9], vec![1], vec![15, 14, 2, 3]]);
    let mut sim = OffloadSimulator::new(SimulatorConfig {
        initial: initial.clone(),
        ..simulator(&model, Policy::Specter, 4).config().clone()
    })
    .expect("simulator");
    let (_, first) = run(&model, &mut sim, prompt, Mode::Specter);
    assert_ne!(sim.cache().resident(1), vec![1]);
    sim.reset();
    let InitialResidency::PerLayer(sets) = &initial else {
        unreachable!()
    };
    for (layer, set) in sets.iter().enumerate() {
        assert_eq!(&sim.cache().resident(layer), set);
    }
    assert_eq!(sim.stats().lookups, 0);
    assert_eq!(sim.stats().stall_s, 0.0);
    let (_, second) = run(&model, &mut sim, prompt, Mode::Specter);
    assert_eq!(first, second);
}

#[test]
fn mismatched_models_are_refused() {
    let model = model();
    let other = ToyModel::new(64, 256, 17).with_experts(8, 2);
    let mut sim = simulator(&other, Policy::Lru, 4);
    match generate_with_offload(
        &model,
        &[1, 2],
        &options(Mode::Specter),
        &mut sim,
        &mut |_| {},
    ) {
        Err(Error::Request(message)) => assert!(message.contains("experts"), "{message}"),
        other => panic!(
            "expected a request error, got {:?}",
            other.map(|o| o.tokens)
        ),
    }
}

/// SpecMoEOff's rule in the simulator: Top-M by the draft's routing over steps 0 and 1 only,
/// prefetched after each of them; the tokens are the target's.
#[test]
fn route_frequency_prefetch_plans_only_after_draft_steps_zero_and_one() {
    let model = model();
    let info = model.info().clone();
    let prompt = &prompts(5, &[9], 64)[0];
    let target = generate(
        &model,
        prompt,
        &options(Mode::Target),
        &mut specter::model::NoHook,
        &mut |_| {},
    )
    .expect("target");
    let slots = 4;
    let top_m = specter::offload::frequency_top_m(slots, info.top_k);
    assert_eq!(top_m, 4);
    let mut sim = simulator(&model, Policy::Specter, slots)
        .with_frequency_prefetch(top_m)
        .expect("frequency prefetch");
    let mut opts = options(Mode::SpecMoeOff);
    opts.depth = 3;
    let out = generate_with_offload(&model, prompt, &opts, &mut sim, &mut |_| {}).expect("run");
    assert_eq!(out.tokens, target.tokens);
    let s = out.stats.offload.expect("stats");
    assert!(s.prefetched > 0, "{s:?}");
    assert_eq!(s.prefetched, s.prefetch_used + s.prefetch_wasted);
    // Two plans per window, each at most Top-M per layer.
    let layers = info.moe_layers.len() as u64;
    assert!(s.prefetched <= out.stats.rounds as u64 * 2 * layers * top_m as u64);

    // A depth-1 window has only step 0: its routing alone decides, one row (or two) of top-k.
    let mut sim = simulator(&model, Policy::Specter, slots)
        .with_frequency_prefetch(1)
        .expect("frequency prefetch");
    opts.depth = 1;
    let out = generate_with_offload(&model, prompt, &opts, &mut sim, &mut |_| {}).expect("run");
    assert_eq!(out.tokens, target.tokens);
    let s = out.stats.offload.expect("stats");
    assert!(s.prefetched <= out.stats.rounds as u64 * layers);

    // The rule needs plan protection and prefetch: the Specter cache policy.
    match simulator(&model, Policy::Lru, slots).with_frequency_prefetch(top_m) {
        Err(Error::Request(message)) => assert!(message.contains("Specter"), "{message}"),
        other => panic!("expected a request error, got {:?}", other.map(|_| ())),
    }
    assert!(simulator(&model, Policy::Specter, slots)
        .with_frequency_prefetch(0)
        .is_err());
}
