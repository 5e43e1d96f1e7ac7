//! End to end on the GPU: every fixture model, converted into a bundle by the real pipeline, gives
//! the CPU reference's greedy tokens on the CUDA backend (all experts resident, with forward
//! passes recorded as CUDA graphs and replayed, or run op by op; and offloaded under every slot
//! policy and host path), and speculative decoding on the GPU gives exactly the
//! GPU's target-only tokens.
//!
//! These need an NVIDIA GPU, so they are ignored by default (see tests/common/gpu.rs);
//! `scripts/gpu-check.sh` runs them on the GPU machine with `--ignored`.

mod common;

use std::sync::Arc;

use common::{Fixture, FIXTURES};
use specter::arch::MoeModel;
use specter::backend::cpu::Cpu;
use specter::backend::cuda::{
    CudaBackend, CudaOptions, HostExpertsConfig, HostPath, OffloadConfig, SplitExperts,
};
use specter::decode::{
    generate, generate_observed, DraftPrefetcher, FrequencyPrefetcher, GenerateOptions, Mode,
    Sampling,
};
use specter::model::{KvCache, LanguageModel, NoHook, Variant};
use specter::offload::Policy;
use specter_convert::pack::{ConvertOptions, TargetPrecision};

fn options(mode: Mode, max_new_tokens: usize, depth: usize) -> GenerateOptions {
    GenerateOptions {
        mode,
        max_new_tokens,
        depth,
        sampling: Sampling::greedy(),
        stop_at_eos: false,
    }
}

fn greedy<M: LanguageModel>(model: &M, prompt: &[u32], mode: Mode, depth: usize) -> Vec<u32> {
    generate(
        model,
        prompt,
        &options(mode, 16, depth),
        &mut NoHook,
        &mut |_| {},
    )
    .expect("generate")
    .tokens
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_target_tokens_equal_the_cpu_on_every_fixture() {
    every_fixture_every_residency(false, None);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_speculative_decoding_is_lossless_on_every_fixture() {
    every_fixture_every_residency(true, None);
}

/// Quantized targets with their drafts: an INT8 target (row-layout kernels) with a 4-bit draft
/// (Marlin), and an INT4 target (row layout) with 3- and 2-bit drafts (row layout).
const PRECISIONS: [(TargetPrecision, u32); 3] = [
    (TargetPrecision::Int8, 4),
    (TargetPrecision::Int4, 3),
    (TargetPrecision::Int4, 2),
];

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_target_tokens_equal_the_cpu_at_every_target_precision() {
    for precision in PRECISIONS {
        every_fixture_every_residency(false, Some(precision));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_speculative_decoding_is_lossless_at_every_target_precision() {
    for precision in PRECISIONS {
        every_fixture_every_residency(true, Some(precision));
    }
}

/// Target-only greedy tokens on the GPU equal the CPU's; with `speculative`, Specter mode on the
/// GPU at depths 1, 4 and 16 also equals the GPU's target-only tokens, and so does SpecMoEOff
/// mode (the draft with a KV cache of its own), with route-frequency prefetch when offloaded.
/// `precision`: the bundle's target precision and draft width (default: FP16 with a 4-bit
/// draft); the host path splits FP16 experts only, so quantized targets skip the forced split.
fn every_fixture_every_residency(speculative: bool, precision: Option<(TargetPrecision, u32)>) {
    let device = Arc::new(common::gpu::device());
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let opts = match precision {
            Some((target, draft_bits)) => ConvertOptions {
                target,
                draft_bits: Some(draft_bits),
                ..ConvertOptions::default()
            },
            None => ConvertOptions::default(),
        };
        let name = match precision {
            Some((target, bits)) => format!("{name} ({} target, {bits}-bit draft)", target.name()),
            None => name.to_string(),
        };
        let (_dir, bundle) = fixture.bundle_with(&opts);
        let bundle = Arc::new(bundle);
        let cpu = MoeModel::load(fixture.cfg.clone(), bundle.as_ref(), Cpu).unwrap();
        let experts = fixture.cfg.moe.num_experts;
        let mut variants: Vec<(String, Option<OffloadConfig>)> = vec![
            ("resident, recorded passes".into(), None),
            ("resident, op by op".into(), None),
        ];
        // The hybrid path: the split starts half and half, or (a link a billion times slower than
        // the host) sends every miss to the host.
        let half = HostExpertsConfig {
            threads: 2,
            link_bytes_per_s: 50e9,
            host_bytes_per_s: 50e9,
            split: SplitExperts::Measured,
        };
        let all = HostExpertsConfig {
            link_bytes_per_s: 50.0,
            ..half
        };
        // Every layer with a miss splits one (gate and up on the host, its down copied).
        let split = HostExpertsConfig {
            split: SplitExperts::Always,
            ..half
        };
        for (policy, slots, host_path, host_experts) in [
            (Policy::Lru, 2, HostPath::Auto, None),
            (Policy::OnDemand, experts / 2, HostPath::Auto, None),
            (Policy::Lru, 3, HostPath::PinnedStaging, None),
            (Policy::Lru, 2, HostPath::Auto, Some(half)),
            (Policy::Lru, 1, HostPath::Auto, Some(all)),
            (Policy::Lru, 2, HostPath::Auto, Some(split)),
        ] {
            // The host path splits FP16 experts only.
            if precision.is_some() && host_experts.is_some_and(|h| h.split == SplitExperts::Always)
            {
                continue;
            }
            let hybrid = match host_experts {
                Some(h) if h.split == SplitExperts::Always => {
                    ", a miss a layer split with the host"
                }
                Some(h) if h.link_bytes_per_s < 1e3 => ", every miss on the host",
                Some(_) => ", misses split with the host",
                None => "",
            };
            variants.push((
                format!("{} {slots} slots {host_path:?}{hybrid}", policy.name()),
                Some(OffloadConfig {
                    bundle: bundle.clone(),
                    config: fixture.cfg.clone(),
                    slots_per_layer: slots,
                    policy,
                    host_path,
                    host_experts,
                    link_pace_bytes_per_s: None,
                }),
            ));
        }
        for (label, offload) in variants {
            // With an expert cache only the draft's passes are recordable (the target's route on
            // the host); they are recorded there too.
            let recorded = label.contains("recorded");
            let op_by_op = label.contains("op by op");
            let backend =
                CudaBackend::with_device(device.clone(), offload, &CudaOptions::default())
                    .expect("backend");
            backend.set_step_graphs(!op_by_op).unwrap();
            let gpu = MoeModel::load(fixture.cfg.clone(), bundle.as_ref(), backend).unwrap();
            for prompt in fixture.prompts().iter().take(2) {
                let want = greedy(&cpu, prompt, Mode::Target, 1);
                let got = greedy(&gpu, prompt, Mode::Target, 1);
                assert_eq!(
                    got, want,
                    "{name} ({label}): GPU target tokens differ from the CPU"
                );
                if speculative && gpu.backend().offload_slots().unwrap().is_some() {
                    // Draft-driven prefetch into the expert cache changes what is resident, never
                    // the tokens.
                    let mut prefetcher = DraftPrefetcher::new(
                        gpu.backend(),
                        gpu.info(),
                        specter::generate::DEFAULT_COPY_BANDWIDTH,
                    )
                    .unwrap();
                    let out = generate_observed(
                        &gpu,
                        prompt,
                        &options(Mode::Specter, 16, 8),
                        &mut prefetcher,
                        &mut |_| {},
                    )
                    .expect("specter with prefetch");
                    assert!(
                        prefetcher.take_error().is_none(),
                        "{name} ({label}): prefetch failed"
                    );
                    assert_eq!(
                        out.tokens, got,
                        "{name} ({label}): GPU specter with prefetch is not lossless"
                    );
                    // The SpecMoEOff baseline: the draft with its own KV, K = 3, route-frequency
                    // Top-M prefetch after draft steps 0 and 1.
                    let mut frequency =
                        FrequencyPrefetcher::new(gpu.backend(), gpu.info()).unwrap();
                    let out = generate_observed(
                        &gpu,
                        prompt,
                        &options(Mode::SpecMoeOff, 16, 3),
                        &mut frequency,
                        &mut |_| {},
                    )
                    .expect("specmoeoff with frequency prefetch");
                    assert!(
                        frequency.take_error().is_none(),
                        "{name} ({label}): frequency prefetch failed"
                    );
                    assert_eq!(
                        out.tokens, got,
                        "{name} ({label}): GPU specmoeoff with prefetch is not lossless"
                    );
                }
                if speculative {
                    for depth in [1, 4, 16] {
                        let spec = greedy(&gpu, prompt, Mode::Specter, depth);
                        assert_eq!(
                            spec, got,
                            "{name} ({label}): GPU specter depth {depth} is not lossless"
                        );
                        let own_kv = greedy(&gpu, prompt, Mode::SpecMoeOff, depth);
                        assert_eq!(
                            own_kv, got,
                            "{name} ({label}): GPU specmoeoff depth {depth} is not lossless"
                        );
                    }
                }
            }
            if label.contains("host") {
                let stats = gpu.backend().offload_stats().unwrap().expect("offloaded");
                eprintln!(
                    "{name} {label}: {} experts on the host, {} hits, {} copied",
                    stats.host_experts, stats.hits, stats.misses
                );
                let on_host = if label.contains("a miss a layer split") {
                    stats.split_experts
                } else {
                    stats.host_experts
                };
                assert!(on_host > 0, "{name} ({label}): no expert ran on the host");
            }
            let graphs = gpu.backend().step_graph_stats().unwrap();
            eprintln!("{name} {label}: {graphs:?}");
            assert_eq!(graphs.failures, 0, "{name} ({label}): a capture failed");
            if recorded {
                assert!(
                    graphs.captures > 0 && graphs.replays > graphs.captures,
                    "{name} ({label}): decode steps were not replayed: {graphs:?}"
                );
            } else if op_by_op {
                assert_eq!(graphs.replays, 0, "{name} ({label}): replayed while off");
            }
            if label.contains("slots") {
                // The target's passes wait for their routing on the host; the ops between the
                // waits are recorded and replayed (src/backend/cuda/graphs/segments.rs).
                assert!(
                    graphs.segment_captures > 0 && graphs.segment_replays > graphs.segment_captures,
                    "{name} ({label}): the target's segments were not replayed: {graphs:?}"
                );
            }
            if let Some(stats) = gpu.backend().offload_stats().unwrap() {
                eprintln!(
                    "{name} {label}: hits {} misses {} copied {} B via {}; prefetched {} (used {})",
                    stats.hits,
                    stats.misses,
                    stats.bytes_copied,
                    stats.path,
                    stats.prefetched,
                    stats.prefetch_used
                );
                if speculative && stats.policy == "lru" {
                    assert!(
                        stats.prefetched > 0,
                        "{name} ({label}): the plan never prefetched"
                    );
                }
                assert!(
                    stats.misses + stats.host_experts > 0,
                    "{name} ({label}): no expert was ever copied in or computed on the host"
                );
            }
        }
        eprintln!("{name}: GPU tokens equal the CPU's in every residency");
    }
}

/// The fused kernels (an MoE layer's shared experts inside its routed experts' launches, a
/// one-row layer's FP16 experts in one launch, thread block clusters: attention's chunks combined
/// in shared memory, a draft step's combine in its INT4 down launch; early launches) change no
/// bit: the target's and the draft's logits for a prompt (one window of rows) and four decode
/// steps after it equal those of the plain ops (`CudaOptions::plain`), with passes recorded and
/// op by op.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_logits_do_not_depend_on_fusing_the_shared_experts_or_clusters() {
    let device = Arc::new(common::gpu::device());
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let (_dir, bundle) = fixture.bundle();
        let prompt = fixture.prompts()[0].clone();
        let logits = |plain: bool, graphs: bool| {
            let options = CudaOptions {
                plain,
                graphs,
                ..CudaOptions::default()
            };
            let backend =
                CudaBackend::with_device(device.clone(), None, &options).expect("backend");
            let model = MoeModel::load(fixture.cfg.clone(), &bundle, backend).unwrap();
            let vocab = model.info().vocab_size;
            let mut passes = Vec::new();
            for variant in [Variant::Target, Variant::Draft] {
                let mut kv = model.new_kv(prompt.len() + 8).unwrap();
                let mut tokens = prompt.clone();
                for _ in 0..5 {
                    let out = model
                        .forward(variant, &tokens, &mut kv, &mut NoHook)
                        .expect("forward");
                    let last = &out[out.len() - vocab..];
                    let next =
                        (0..vocab).fold(0, |best, i| if last[i] > last[best] { i } else { best });
                    passes.push(out.iter().map(|v| v.to_bits()).collect());
                    tokens = vec![next as u32];
                }
            }
            passes
        };
        let separate: Vec<Vec<u32>> = logits(true, true);
        for (plain, graphs) in [(false, true), (false, false), (true, false)] {
            let got = logits(plain, graphs);
            for (pass, (a, b)) in got.iter().zip(&separate).enumerate() {
                let variant = if pass < 5 { "target" } else { "draft" };
                let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
                assert!(
                    a.len() == b.len() && differ == 0,
                    "{name}: {variant} pass {} (plain {plain}, graphs {graphs}): {differ} logits differ from the plain ops'",
                    pass % 5
                );
            }
        }
        eprintln!("{name}: the same logits with the fused kernels and the plain ones");
    }
}

/// Greedy passes chained on the device (each queued before the host has the choice it runs
/// from) give the CPU's choices, one pass at a time, for both variants; a chain stopped early
/// drops the pass it ran ahead (the KV holds exactly the accepted passes), and decoding goes on
/// from there with the same tokens.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_chained_greedy_passes_equal_the_cpu_one_at_a_time() {
    let device = Arc::new(common::gpu::device());
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let (_dir, bundle) = fixture.bundle();
        let prompt = fixture.prompts()[0].clone();
        let cpu = MoeModel::load(fixture.cfg.clone(), &bundle, Cpu).unwrap();
        let backend = CudaBackend::with_device(device.clone(), None, &CudaOptions::default())
            .expect("backend");
        let gpu = MoeModel::load(fixture.cfg.clone(), &bundle, backend).unwrap();
        const STEPS: usize = 12;
        const STOP: usize = 5;
        for variant in [Variant::Target, Variant::Draft] {
            let mut kv = cpu.new_kv(prompt.len() + STEPS + 1).unwrap();
            let ids = cpu.forward_greedy(variant, &prompt, &mut kv, &mut NoHook);
            let first = *ids.unwrap().last().unwrap();
            let mut want = vec![first];
            for _ in 0..STEPS {
                let last = *want.last().unwrap();
                let id = cpu.forward_greedy(variant, &[last], &mut kv, &mut NoHook);
                want.push(id.unwrap()[0]);
            }

            let mut kv = gpu.new_kv(prompt.len() + STEPS + 1).unwrap();
            let ids = gpu.forward_greedy(variant, &prompt, &mut kv, &mut NoHook);
            let mut got = vec![*ids.unwrap().last().unwrap()];
            // Stop after STOP choices (the chain has run one pass ahead by then), then go on.
            let mut accept = |id: u32| {
                got.push(id);
                got.len() <= STOP
            };
            gpu.forward_greedy_chain(variant, first, &mut kv, &mut NoHook, STEPS, &mut accept)
                .expect("chain");
            assert_eq!(
                kv.len(),
                prompt.len() + STOP,
                "{name} {variant:?}: the KV after a chain stopped at {STOP} choices"
            );
            let last = *got.last().unwrap();
            let rest = STEPS - STOP;
            let mut more = |id: u32| {
                got.push(id);
                true
            };
            gpu.forward_greedy_chain(variant, last, &mut kv, &mut NoHook, rest, &mut more)
                .expect("chain");
            assert_eq!(kv.len(), prompt.len() + STEPS);
            assert_eq!(
                got, want,
                "{name} {variant:?}: chained GPU choices differ from the CPU's"
            );
        }
        let graphs = gpu.backend().step_graph_stats().unwrap();
        assert!(
            graphs.replays > 0,
            "{name}: no chained pass was replayed: {graphs:?}"
        );
        eprintln!("{name}: chained greedy passes equal the CPU's ({graphs:?})");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn impossible_residency_is_a_clear_error() {
    let device = Arc::new(common::gpu::device());
    let fixture = Fixture::load("mixtral");
    let (_dir, bundle) = fixture.bundle();
    let bundle = Arc::new(bundle);
    for slots in [0, fixture.cfg.moe.num_experts + 1] {
        let cfg = OffloadConfig {
            bundle: bundle.clone(),
            config: fixture.cfg.clone(),
            slots_per_layer: slots,
            policy: Policy::Lru,
            host_path: HostPath::Auto,
            host_experts: None,
            link_pace_bytes_per_s: None,
        };
        match CudaBackend::with_device(device.clone(), Some(cfg), &CudaOptions::default()) {
            Err(e) => assert!(e.to_string().contains("--resident-experts"), "{e}"),
            Ok(_) => panic!("{slots} slots per layer must be refused"),
        }
    }
}
