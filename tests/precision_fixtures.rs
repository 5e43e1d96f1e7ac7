//! Target and draft precisions on every fixture architecture, converted by the real pipeline and
//! run on the CPU reference: an INT8 or INT4 target with a 4-, 3- or 2-bit draft. Speculative
//! output equals the same bundle's target-only output in every mode and at every simulated
//! residency; the quantized target stays close to the FP16 one; the bundle's expert blobs and the
//! residency's byte counts are the quantized target's size.

mod common;

use common::{fixture_simulator, target_only, Fixture, FIXTURES};
use specter::arch::MoeModel;
use specter::backend::cpu::Cpu;
use specter::decode::{generate, generate_with_offload, Mode};
use specter::model::{LanguageModel, NoHook, Variant};
use specter::offload::Policy;
use specter_convert::pack::{ConvertOptions, TargetPrecision};

use common::greedy_options as options;

/// The precisions under test: (target, draft bits).
const PRECISIONS: [(TargetPrecision, u32); 4] = [
    (TargetPrecision::Int8, 4),
    (TargetPrecision::Int4, 3),
    (TargetPrecision::Int4, 2),
    (TargetPrecision::Fp16, 2),
];

fn load(fixture: &Fixture, target: TargetPrecision, draft_bits: u32) -> MoeModel<Cpu> {
    let opts = ConvertOptions {
        target,
        draft_bits: Some(draft_bits),
        ..ConvertOptions::default()
    };
    let (_dir, bundle) = fixture.bundle_with(&opts);
    let manifest = bundle.to_manifest().unwrap();
    assert_eq!(
        (
            manifest.precision.target_bits,
            manifest.precision.draft_bits
        ),
        (target.bits(), draft_bits)
    );
    let model = MoeModel::load(fixture.cfg.clone(), &bundle, Cpu).expect("load");
    assert!(model.has_draft());
    // Residency counts the stored expert: one blob is exactly the bytes the model reports.
    assert_eq!(
        manifest.experts[0].length as usize,
        model.info().expert_bytes,
        "{}: {} target",
        fixture.name,
        target.name()
    );
    model
}

#[test]
fn speculation_is_lossless_at_every_target_precision_on_every_fixture() {
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        for (target, draft_bits) in PRECISIONS {
            let model = load(&fixture, target, draft_bits);
            let what = format!("{name}: {} target, {draft_bits}-bit draft", target.name());
            let (mut drafted, mut accepted) = (0, 0);
            for prompt in fixture.prompts().iter().take(2) {
                let max_new = 12;
                let reference = target_only(&model, prompt, max_new);
                for (mode, depth) in [
                    (Mode::Specter, 1),
                    (Mode::Specter, 4),
                    (Mode::Specter, 16),
                    (Mode::SpecMoeOff, 3),
                ] {
                    let out = generate(
                        &model,
                        prompt,
                        &options(mode, max_new, depth),
                        &mut NoHook,
                        &mut |_| {},
                    )
                    .expect("speculative");
                    assert_eq!(
                        out.tokens, reference.tokens,
                        "{what}: {mode:?} depth {depth}"
                    );
                    drafted += out.stats.drafted;
                    accepted += out.stats.accepted;
                }
                // The expert cache decides what would be copied, never what is computed.
                for slots in [1, model.info().num_experts / 2] {
                    for (mode, policy) in [
                        (Mode::Specter, Policy::Specter),
                        (Mode::Target, Policy::Lru),
                    ] {
                        let mut sim = fixture_simulator(model.info(), slots, policy);
                        let out = generate_with_offload(
                            &model,
                            prompt,
                            &options(mode, max_new, 4),
                            &mut sim,
                            &mut |_| {},
                        )
                        .expect("offload");
                        let s = out.stats.offload.expect("offload stats");
                        assert_eq!(
                            out.tokens, reference.tokens,
                            "{what}: {mode:?}, {policy:?}, {slots} slots"
                        );
                        assert_eq!(
                            s.bytes_copied,
                            (s.misses + s.prefetched) * model.info().expert_bytes as u64,
                            "{what}: bytes copied count the stored experts"
                        );
                    }
                }
            }
            eprintln!("{what}: drafted {drafted}, accepted {accepted}");
            // A 2-bit draft of random weights may never agree (rejections are what the loop
            // must survive); 3 and 4 bits agree on every fixture.
            if draft_bits >= 3 {
                assert!(
                    accepted > 0,
                    "{what}: the draft never agreed with the target"
                );
            }
        }
    }
}

/// The relative L2 distance between two logit vectors.
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        num += f64::from(a - b).powi(2);
        den += f64::from(*b).powi(2);
    }
    (num / den).sqrt()
}

#[test]
fn quantized_targets_stay_close_to_the_fp16_target() {
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let fp16 = load(&fixture, TargetPrecision::Fp16, 4);
        let prompt = &fixture.prompts()[0];
        let logits = |model: &MoeModel<Cpu>, variant| {
            let mut kv = model.new_kv(prompt.len()).unwrap();
            model
                .forward(variant, prompt, &mut kv, &mut NoHook)
                .unwrap()
        };
        let reference = logits(&fp16, Variant::Target);
        let draft4 = relative_error(&logits(&fp16, Variant::Draft), &reference);
        let int8 = load(&fixture, TargetPrecision::Int8, 4);
        let int4 = load(&fixture, TargetPrecision::Int4, 3);
        let e8 = relative_error(&logits(&int8, Variant::Target), &reference);
        let e4 = relative_error(&logits(&int4, Variant::Target), &reference);
        let d3 = relative_error(&logits(&int4, Variant::Draft), &reference);
        eprintln!("{name}: logits relative error int8 {e8:.2e}, int4 {e4:.2e} (4-bit draft {draft4:.2e}, 3-bit draft {d3:.2e})");
        // Quantized, so not the same bits; 8 bits far closer than 4; an INT4 target is the 4-bit
        // draft's matrices (RTN, same grid), so it reproduces the FP16 model's 4-bit draft.
        assert!(e8 > 0.0 && e8 < 0.1 * e4, "{name}: int8 {e8} vs int4 {e4}");
        assert!(e4 < 0.5, "{name}: int4 {e4}");
        assert_eq!(e4, draft4, "{name}: INT4 target vs the 4-bit draft");
        assert!(d3 > e4, "{name}: 3-bit draft {d3} vs int4 target {e4}");
    }
}

#[test]
fn a_format_1_bundle_still_runs() {
    // Written by format 1.0 (an FP16 target and a 4-bit draft; its manifest has no precision):
    // tests/fixtures/format_v1, with the target's greedy tokens recorded then.
    let path = common::repo_root().join("tests/fixtures/format_v1/tiny_mixtral.specter");
    let bundle = specter_format::Bundle::open(&path).expect("open the 1.0 bundle");
    assert_eq!(bundle.header().major, 1);
    assert!(bundle.verify().is_ok());
    let manifest = bundle.to_manifest().unwrap();
    assert_eq!(manifest.precision, specter_format::Precision::default());
    let cfg = specter::arch::ArchConfig::from_config_json(
        std::str::from_utf8(bundle.config_bytes().unwrap()).unwrap(),
    )
    .unwrap();
    let model = MoeModel::load(cfg, &bundle, Cpu).unwrap();
    for mode in [Mode::Target, Mode::Specter] {
        let out = generate(
            &model,
            &[1, 2, 3],
            &options(mode, 8, 4),
            &mut NoHook,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(out.tokens, [249, 173, 50, 61, 95, 62, 244, 230], "{mode:?}");
    }
}

#[test]
fn a_vram_budget_counts_the_stored_expert() {
    // The same budget holds about twice the INT8 experts it holds FP16 ones: a slot is the
    // stored expert's size, not the FP16 matrices'.
    let fixture = Fixture::load("deepseek_v2");
    let bundle = |target| {
        let (dir, _) = fixture.bundle_with(&ConvertOptions {
            target,
            ..ConvertOptions::default()
        });
        dir
    };
    let (fp16, int8) = (bundle(TargetPrecision::Fp16), bundle(TargetPrecision::Int8));
    let slots = |dir: &tempfile::TempDir, gb: f64| {
        specter::generate::slots_for_budget(&dir.path().join("model.specter"), gb, false).ok()
    };
    let experts = fixture.cfg.moe.num_experts;
    let mut compared = 0;
    for step in 0..4000 {
        let gb = 1.07 + step as f64 * 2e-5;
        let (Some(a), Some(b)) = (slots(&fp16, gb), slots(&int8, gb)) else {
            continue;
        };
        assert!(b >= a, "{gb} GB: {b} INT8 slots, fewer than {a} FP16 ones");
        if (2..experts / 2).contains(&a) {
            assert!(
                b + 1 >= 2 * a - 1,
                "{gb} GB: {b} INT8 slots for {a} FP16 ones"
            );
            compared += 1;
        }
    }
    assert!(
        compared > 0,
        "no budget between 2 and {} FP16 slots",
        experts / 2
    );
}
