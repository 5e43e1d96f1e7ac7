//! `specter-run eval` on bundles converted from one checkpoint made by transformers
//! (tests/fixtures/qwen2_moe) at FP16, INT8 and INT4: a bundle against itself agrees exactly, a
//! quantized target diverges from the FP16 one by less the more bits it keeps, and bad inputs
//! fail cleanly.

#[path = "../../specter-pack/tests/common/cli.rs"]
mod cli;

use std::path::{Path, PathBuf};

use cli::{assert_clean_failure, Run};
use serde_json::Value;
use specter_convert::pack::{convert, ConvertOptions, Silent, TargetPrecision};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

fn bundle(dir: &Path, fixture_name: &str, target: TargetPrecision) -> PathBuf {
    let path = dir.join(format!("{fixture_name}-{}.specter", target.name()));
    let opts = ConvertOptions {
        target,
        ..ConvertOptions::default()
    };
    convert(&fixture(fixture_name), &path, &opts, &Silent).unwrap();
    path
}

fn eval(bundle: &Path, reference: &Path, text: &Path, extra: &[&str]) -> Run {
    let mut args = vec![
        "eval".to_string(),
        bundle.display().to_string(),
        "--reference".into(),
        reference.display().to_string(),
        "--text".into(),
        text.display().to_string(),
        "--backend".into(),
        "cpu".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    cli::run(env!("CARGO_BIN_EXE_specter-run"), &args)
}

fn report(run: &Run) -> Value {
    assert!(run.ok(), "{run:?}");
    serde_json::from_str(&run.stdout).unwrap()
}

fn figure(v: &Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(v, |v, key| &v[key])
        .as_f64()
        .unwrap_or_else(|| panic!("{path:?} in {v}"))
}

#[test]
fn quantized_targets_are_measured_against_the_fp16_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let fp16 = bundle(dir.path(), "qwen2_moe", TargetPrecision::Fp16);
    let int8 = bundle(dir.path(), "qwen2_moe", TargetPrecision::Int8);
    let int4 = bundle(dir.path(), "qwen2_moe", TargetPrecision::Int4);
    // Text the byte-level tokenizer splits into many tokens.
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog, and then it runs away. ".repeat(12),
    )
    .unwrap();
    let args = ["--context", "128", "--json"];

    let same = report(&eval(&fp16, &fp16, &text, &args));
    assert!(figure(&same, &["tokens"]) > 200.0, "{same}");
    assert_eq!(figure(&same, &["target", "mean_kl"]), 0.0);
    assert_eq!(figure(&same, &["target", "top1_agreement"]), 1.0);
    assert_eq!(
        figure(&same, &["target", "perplexity"]),
        figure(&same, &["reference_perplexity"])
    );

    let r8 = report(&eval(&int8, &fp16, &text, &args));
    let r4 = report(&eval(&int4, &fp16, &text, &args));
    let (kl8, kl4) = (
        figure(&r8, &["target", "mean_kl"]),
        figure(&r4, &["target", "mean_kl"]),
    );
    assert!(kl8 > 0.0 && kl8 < 0.05 * kl4, "int8 {kl8} vs int4 {kl4}");
    assert!(
        figure(&r8, &["target", "top1_agreement"]) > figure(&r4, &["target", "top1_agreement"])
    );
    for r in [&same, &r8, &r4] {
        for key in ["draft_acceptance", "route_recall"] {
            let v = figure(r, &[key]);
            assert!((0.0..=1.0).contains(&v), "{key} {v}");
        }
        assert!(figure(r, &["target", "max_kl"]) >= figure(r, &["target", "p99_kl"]));
    }
    // The FP16 bundle's 4-bit draft is an INT4 target's target: the same matrices (RTN, one grid).
    assert_eq!(
        figure(&same, &["draft", "mean_kl"]),
        figure(&r4, &["target", "mean_kl"])
    );

    // Scoring each window's second half, as llama.cpp does, scores fewer positions.
    let half = report(&eval(
        &int8,
        &fp16,
        &text,
        &["--context", "128", "--score-from", "64", "--json"],
    ));
    let (all, second) = (
        figure(&r8, &["target", "positions"]),
        figure(&half, &["target", "positions"]),
    );
    assert!(second < all && second > 0.0, "{second} of {all}");

    // The text report names both bundles and every figure's row.
    let run = eval(&int8, &fp16, &text, &["--context", "128"]);
    assert!(run.ok(), "{run:?}");
    for needle in [
        "mean KL",
        "top-1",
        "perplexity",
        "greedy acceptance",
        "route recall",
    ] {
        assert!(run.stdout.contains(needle), "{needle}: {run:?}");
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let qwen = bundle(dir.path(), "qwen2_moe", TargetPrecision::Int8);
    let mixtral = bundle(dir.path(), "mixtral", TargetPrecision::Fp16);
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "some text to score, long enough for a window or two").unwrap();
    let missing = dir.path().join("missing.txt");

    assert_clean_failure(&eval(&qwen, &mixtral, &text, &[]), &["different models"]);
    assert_clean_failure(
        &eval(&qwen, &qwen, &text, &["--context", "1"]),
        &["--context 1", "2 to"],
    );
    assert_clean_failure(&eval(&qwen, &qwen, &missing, &[]), &["missing.txt"]);
    assert_clean_failure(
        &eval(&qwen, &dir.path().join("nope.specter"), &text, &[]),
        &["nope.specter"],
    );
    assert_clean_failure(
        &eval(&qwen, &qwen, &text, &["--tokens", "1"]),
        &["--tokens", "at least 2"],
    );
    assert_clean_failure(
        &eval(
            &qwen,
            &qwen,
            &text,
            &["--context", "8", "--score-from", "7"],
        ),
        &["--score-from 7"],
    );
}
