//! `convert --quant gptq` end to end on the fixture checkpoints: calibration (self-generated and
//! from a file of token ids), per-expert GPTQ against held-out rows, the pooled fallback for
//! starved experts, valid Marlin INT4 tensors, and a draft that decodes losslessly.

// The root crate's test helpers: fixtures, found from the repository root.
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;

use common::Fixture;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::arch::MoeModel;
use specter::backend::cpu::Cpu;
use specter::decode::{generate, GenerateOptions, Mode, Sampling};
use specter::model::NoHook;
use specter::quant::{marlin_pack, marlin_unpack};
use specter::weights::WeightStore;
use specter_convert::pack::{
    convert, ConvertOptions, ConvertReport, QuantMethod, Silent, TargetPrecision,
};
use specter_format::{Bundle, QuantInfo};

const FIXTURES: [&str; 3] = ["deepseek_v2", "qwen2_moe", "mixtral"];

fn gptq_options(calib_tokens: usize) -> ConvertOptions {
    ConvertOptions {
        quant: QuantMethod::Gptq,
        calib_tokens,
        ..ConvertOptions::default()
    }
}

fn convert_to(fixture: &Fixture, dir: &Path, opts: &ConvertOptions) -> (Bundle, ConvertReport) {
    let path = dir.join(format!("{}.specter", fixture.name));
    let report = convert(&fixture.dir, &path, opts, &Silent)
        .unwrap_or_else(|e| panic!("{}: convert: {e}", fixture.name));
    let bundle = Bundle::open(&path).expect("open bundle");
    assert!(bundle.verify().is_ok(), "{}: checksums", fixture.name);
    (bundle, report)
}

fn quant_info(bundle: &Bundle) -> QuantInfo {
    bundle.to_manifest().expect("manifest").provenance.quant
}

/// Every draft tensor decodes to valid INT4 codes and packs back to exactly the stored words.
fn assert_marlin_round_trip(fixture: &Fixture, bundle: &Bundle) -> usize {
    let (hidden, inter) = fixture.cfg.expert_dims();
    let mut matrices = 0;
    for layer in fixture.cfg.moe_layers() {
        for e in 0..fixture.cfg.moe.num_experts {
            for (part, k, n) in [("gate_up", hidden, 2 * inter), ("down", inter, hidden)] {
                let q = bundle
                    .u32(&specter::arch::draft_tensor_name(layer, e, part, "qweight"))
                    .expect("qweight");
                let s = bundle
                    .f16(&specter::arch::draft_tensor_name(layer, e, part, "scales"))
                    .expect("scales");
                let m = marlin_unpack(k, n, &q.data, &s.data).expect("valid INT4");
                assert!(m.q.iter().all(|&c| c <= 15));
                let again = marlin_pack(&m).expect("repack");
                assert_eq!(again.qweight, q.data.as_ref(), "{part} of {layer}.{e}");
                assert_eq!(again.scales, s.data.as_ref(), "{part} of {layer}.{e}");
                matrices += 1;
            }
        }
    }
    matrices
}

/// Specter decoding with the GPTQ draft commits exactly the target's greedy tokens.
fn assert_draft_is_lossless(fixture: &Fixture, bundle: &Bundle) {
    let model = MoeModel::load(fixture.cfg.clone(), bundle, Cpu).expect("load bundle");
    assert!(model.has_draft());
    let prompt = &fixture.prompts()[0];
    let run = |mode| {
        let opts = GenerateOptions {
            mode,
            max_new_tokens: 12,
            depth: 4,
            sampling: Sampling::greedy(),
            stop_at_eos: false,
        };
        generate(&model, prompt, &opts, &mut NoHook, &mut |_| {}).expect("generate")
    };
    let target = run(Mode::Target);
    let specter = run(Mode::Specter);
    assert_eq!(specter.tokens, target.tokens, "{}", fixture.name);
    assert!(specter.stats.drafted > 0);
}

/// Held-out error figures of one kind of matrix (gate_up or down).
#[derive(Default, Debug)]
struct PartFigures {
    matrices: usize,
    improved: usize,
    rtn: f64,
    gptq: f64,
}

impl PartFigures {
    fn share_improved(&self) -> f64 {
        self.improved as f64 / self.matrices.max(1) as f64
    }
    fn reduction(&self) -> f64 {
        1.0 - self.gptq / self.rtn
    }
}

/// Checks the stats of a conversion; returns the figures of the matrices fitted to their own
/// rows and of those on the pooled rows, each as [gate_up, down].
fn check_stats(fixture: &Fixture, info: &QuantInfo) -> [[PartFigures; 2]; 2] {
    assert_eq!(info.method, "gptq");
    assert!(info.act_order);
    assert!(info.damp > 0.0);
    let expected = 2 * fixture.cfg.moe_layers().len() * fixture.cfg.moe.num_experts;
    assert_eq!(info.stats.len(), expected, "{}", fixture.name);
    let (hidden, inter) = fixture.cfg.expert_dims();
    let per_feature = ConvertOptions::default().min_rows_per_feature as u64;
    let mut figures: [[PartFigures; 2]; 2] = Default::default();
    for s in &info.stats {
        assert!(s.rel_err_rtn.is_finite() && s.rel_err_rtn > 0.0, "{s:?}");
        assert!(s.calib_tokens <= info.calib_tokens * 4 / 5, "{s:?}");
        let (part, k) = if s.tensor.contains(".gate_up.") {
            (0, hidden as u64)
        } else {
            (1, inter as u64)
        };
        let own = match s.fallback.as_str() {
            "none" => true,
            "pooled-hessian" => false,
            "rtn" => {
                // Not even the layer had enough rows: GPTQ was not run.
                assert!(s.rel_err_gptq.is_nan(), "{s:?}");
                assert!(s.calib_tokens < per_feature * k, "{s:?}");
                continue;
            }
            other => panic!("{}: unexpected fallback {other}: {s:?}", fixture.name),
        };
        assert!(s.rel_err_gptq.is_finite() && s.rel_err_gptq > 0.0, "{s:?}");
        assert_eq!(own, s.calib_tokens >= per_feature * k, "{s:?}");
        let f = &mut figures[usize::from(!own)][part];
        f.matrices += 1;
        f.improved += usize::from(s.rel_err_gptq < s.rel_err_rtn);
        f.rtn += f64::from(s.rel_err_rtn);
        f.gptq += f64::from(s.rel_err_gptq);
    }
    figures
}

fn print_figures(label: &str, figures: &[[PartFigures; 2]; 2]) {
    for (kind, parts) in ["own rows", "pooled rows"].iter().zip(figures) {
        for (part, f) in ["gate_up", "down"].iter().zip(parts) {
            if f.matrices > 0 {
                eprintln!(
                    "{label}: {kind:11} {part:7} {:3} matrices, GPTQ better on {:5.1}%, mean \
                     held-out error rtn {:.4} -> gptq {:.4} ({:+.1}%)",
                    f.matrices,
                    100.0 * f.share_improved(),
                    f.rtn / f.matrices as f64,
                    f.gptq / f.matrices as f64,
                    -100.0 * f.reduction()
                );
            }
        }
    }
}

fn random_token_file(fixture: &Fixture, path: &Path, count: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ids: Vec<String> = (0..count)
        .map(|_| {
            rng.random_range(3..fixture.cfg.vocab_size as u32)
                .to_string()
        })
        .collect();
    std::fs::write(path, ids.join(" ")).expect("write calibration file");
}

/// With enough calibration rows every expert gets its own Hessians; GPTQ then lowers the
/// held-out error of gate_up for (nearly) every expert. The fixtures' down inputs are close to
/// uncorrelated (random weights), which leaves GPTQ little to gain there: it must not lose.
#[test]
fn gptq_with_a_calibration_file_beats_rtn_on_held_out_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let calib = dir.path().join("calib_ids.txt");
        random_token_file(&fixture, &calib, 9000, 11);
        let opts = ConvertOptions {
            calib: Some(calib.clone()),
            ..gptq_options(8192)
        };
        let (bundle, report) = convert_to(&fixture, dir.path(), &opts);
        let info = quant_info(&bundle);
        assert!(
            info.calibration
                .starts_with("file calib_ids.txt: 8192 tokens in 16 sequences"),
            "{}",
            info.calibration
        );
        assert_eq!(info.calib_tokens, 8192);
        assert_eq!(report.calib_tokens, 8192);
        let figures = check_stats(&fixture, &info);
        print_figures(name, &figures);
        let [gate_up, down] = &figures[0];
        assert_eq!(
            gate_up.matrices + down.matrices,
            info.stats.len(),
            "{name}: every matrix has its own rows"
        );
        assert!(gate_up.share_improved() >= 0.95, "{name}: {gate_up:?}");
        assert!(gate_up.reduction() > 0.05, "{name}: {gate_up:?}");
        assert!(down.reduction() > 0.0, "{name}: {down:?}");
        assert_marlin_round_trip(&fixture, &bundle);
        if name == "qwen2_moe" {
            assert_draft_is_lossless(&fixture, &bundle);
        }
    }

    // An id outside the vocabulary is named with its file.
    let fixture = Fixture::load("mixtral");
    let calib = dir.path().join("calib_ids.txt");
    std::fs::write(&calib, format!("5 6 {}", fixture.cfg.vocab_size)).expect("write calib");
    let opts = ConvertOptions {
        calib: Some(calib),
        ..gptq_options(500)
    };
    let err = convert(
        &fixture.dir,
        &dir.path().join("bad.specter"),
        &opts,
        &Silent,
    )
    .expect_err("out-of-vocabulary id");
    let msg = err.to_string();
    assert!(
        msg.contains("calib_ids.txt") && msg.contains("vocabulary"),
        "{msg}"
    );
}

/// Data-free calibration: the target samples its own text. Few rows per expert, so the matrices
/// fall back to the layer's pooled rows, and that is recorded.
#[test]
fn data_free_gptq_falls_back_to_pooled_rows_and_decodes_losslessly() {
    let dir = tempfile::tempdir().expect("tempdir");
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let (bundle, report) = convert_to(&fixture, dir.path(), &gptq_options(1600));
        let info = quant_info(&bundle);
        assert!(
            info.calibration
                .starts_with("self-generated: 7 sequences x 256 tokens, seed 0, temperature 1"),
            "{}",
            info.calibration
        );
        assert_eq!(info.calib_tokens, 1600);
        let figures = check_stats(&fixture, &info);
        print_figures(name, &figures);
        let [[own_gu, own_d], [pooled_gu, pooled_d]] = &figures;
        assert_eq!(
            own_gu.matrices + own_d.matrices + pooled_gu.matrices + pooled_d.matrices,
            info.stats.len()
        );
        assert_eq!(
            report.pooled_fallbacks,
            pooled_gu.matrices + pooled_d.matrices
        );
        assert!(pooled_gu.matrices > 0, "{name}: no starved expert");
        let top_k = fixture.cfg.moe.top_k as u64;
        let fitted = 1280; // 1600 positions, every fifth block of 32 held out
        for layer in fixture.cfg.moe_layers() {
            let prefix = format!("draft.layers.{layer}.");
            let reached: u64 = info
                .stats
                .iter()
                .filter(|s| s.tensor.starts_with(&prefix) && s.tensor.contains(".gate_up."))
                .map(|s| s.calib_tokens)
                .sum();
            // Every fitted row reached top_k experts.
            assert_eq!(reached, fitted * top_k, "{name} layer {layer}");
        }
        assert!(pooled_gu.share_improved() >= 0.95, "{name}: {pooled_gu:?}");
        assert!(pooled_gu.reduction() > 0.0, "{name}: {pooled_gu:?}");
        assert_marlin_round_trip(&fixture, &bundle);
        assert_draft_is_lossless(&fixture, &bundle);
    }
}

/// 192 positions leave 160 fitted rows per layer, fewer than 8 per input feature even pooled:
/// every matrix is stored as round-to-nearest, recorded as such, and the draft still works.
#[test]
fn too_few_rows_store_rtn_and_record_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = Fixture::load("mixtral");
    let (bundle, report) = convert_to(&fixture, dir.path(), &gptq_options(192));
    let info = quant_info(&bundle);
    check_stats(&fixture, &info);
    assert_eq!(report.rtn_fallbacks, info.stats.len());
    assert_eq!(report.mean_rel_err_gptq, None);
    assert!(info.stats.iter().all(|s| s.fallback == "rtn"));
    assert_marlin_round_trip(&fixture, &bundle);
    assert_draft_is_lossless(&fixture, &bundle);
}

#[test]
fn too_little_calibration_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = Fixture::load("mixtral");
    let out = dir.path().join("m.specter");
    let err =
        convert(&fixture.dir, &out, &gptq_options(100), &Silent).expect_err("no held-out rows");
    assert!(err.to_string().contains("held-out"), "{err}");
    assert!(!out.exists());
    let missing = ConvertOptions {
        calib: Some(dir.path().join("absent.txt")),
        ..gptq_options(500)
    };
    let err = convert(&fixture.dir, &out, &missing, &Silent).expect_err("missing file");
    assert!(err.to_string().contains("absent.txt"), "{err}");
}

/// A text calibration file is tokenized with the checkpoint's tokenizer.
#[test]
fn text_calibration_is_tokenized_with_the_checkpoint_tokenizer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = Fixture::load("qwen2_moe");
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let words = [
        "the",
        "router",
        "expert",
        "draft",
        "quantized",
        "layer",
        "token",
        "cache",
    ];
    let text: Vec<&str> = (0..600)
        .map(|_| words[rng.random_range(0..words.len())])
        .collect();
    let calib = dir.path().join("calib.txt");
    std::fs::write(&calib, text.join(" ")).expect("write calib");
    let tokenizer =
        tokenizers::Tokenizer::from_file(fixture.dir.join("tokenizer.json")).expect("tokenizer");
    let expected = tokenizer
        .encode(text.join(" "), true)
        .expect("encode")
        .get_ids()
        .len()
        .min(400);
    assert!(expected >= 160, "{expected}");
    let opts = ConvertOptions {
        calib: Some(calib),
        ..gptq_options(400)
    };
    let (bundle, report) = convert_to(&fixture, dir.path(), &opts);
    let info = quant_info(&bundle);
    assert!(
        info.calibration
            .starts_with(&format!("file calib.txt: {expected} tokens")),
        "{}",
        info.calibration
    );
    assert_eq!(report.calib_tokens, expected);
    check_stats(&fixture, &info);
}

/// A quantized target is fitted with GPTQ to the same calibration rows as the draft, and its
/// error is recorded per matrix beside the draft's: with its own rows for every expert, GPTQ
/// lowers the target's held-out error of gate_up as it does the draft's, and 8 bits sit far below
/// 4. The bundle decodes losslessly.
#[test]
fn gptq_quantizes_int8_and_int4_targets_against_the_draft_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = Fixture::load("qwen2_moe");
    let calib = dir.path().join("calib_ids.txt");
    random_token_file(&fixture, &calib, 9000, 12);
    let mean = |stats: &[specter_format::QuantStat], part: &str, gptq: bool| {
        let values: Vec<f64> = stats
            .iter()
            .filter(|s| s.tensor.contains(part))
            .map(|s| f64::from(if gptq { s.rel_err_gptq } else { s.rel_err_rtn }))
            .collect();
        assert!(values.iter().all(|v| v.is_finite()), "{part}: {values:?}");
        values.iter().sum::<f64>() / values.len() as f64
    };
    let mut gate_up_error = Vec::new();
    for (target, draft_bits) in [(TargetPrecision::Int8, 4), (TargetPrecision::Int4, 3)] {
        let opts = ConvertOptions {
            calib: Some(calib.clone()),
            target,
            draft_bits: Some(draft_bits),
            ..gptq_options(8192)
        };
        let (bundle, report) = convert_to(&fixture, dir.path(), &opts);
        let manifest = bundle.to_manifest().expect("manifest");
        let (t, d) = (&manifest.precision.target_quant, &manifest.provenance.quant);
        assert_eq!((t.method.as_str(), t.bits), ("gptq", target.bits()));
        assert_eq!(d.bits, draft_bits);
        assert_eq!(t.stats.len(), d.stats.len());
        assert!(t
            .stats
            .iter()
            .all(|s| s.tensor.starts_with("target.layers.")));
        assert!(
            t.stats.iter().all(|s| s.fallback == "none"),
            "{:?}",
            t.stats
        );
        let (rtn, gptq) = (
            mean(&t.stats, "gate_up", false),
            mean(&t.stats, "gate_up", true),
        );
        eprintln!(
            "{} target gate_up held-out error: rtn {rtn:.5}, gptq {gptq:.5}; {draft_bits}-bit \
             draft gptq {:.5}",
            target.name(),
            mean(&d.stats, "gate_up", true)
        );
        assert!(gptq < rtn, "{}: gptq {gptq} vs rtn {rtn}", target.name());
        assert!(gptq < mean(&d.stats, "gate_up", true));
        assert!(report.target_rel_err_gptq.is_some());
        gate_up_error.push(gptq);
        assert_draft_is_lossless(&fixture, &bundle);
    }
    assert!(
        gate_up_error[0] < 0.1 * gate_up_error[1],
        "int8 {} vs int4 {}",
        gate_up_error[0],
        gate_up_error[1]
    );
}
