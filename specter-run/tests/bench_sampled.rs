//! `specter-run bench`'s sampled protocol on the CPU: every mode samples with the same seed
//! (speculative rejection sampling keeps the target's distribution, so tokens need not agree run
//! by run), and every run reports the share of its output's 4-grams that repeat.

#[path = "../../specter-pack/tests/common/cli.rs"]
mod cli;

use std::path::Path;

use cli::assert_clean_failure;
use serde_json::Value;
use specter_convert::pack::{convert, ConvertOptions, Silent};

#[test]
fn bench_samples_when_asked_and_reports_repeated_4grams() {
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2_moe");
    let bundle_path = dir.path().join("qwen2_moe.specter");
    convert(&src, &bundle_path, &ConvertOptions::default(), &Silent).unwrap();
    let bundle = bundle_path.display().to_string();
    let out = |name: &str| dir.path().join(name).display().to_string();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "5,6,7,8\n9 10 11\n").unwrap();
    let bench = |extra: &[&str]| {
        let mut all = vec!["bench".to_string(), bundle.clone()];
        all.extend(extra.iter().map(|s| s.to_string()));
        cli::run(env!("CARGO_BIN_EXE_specter-run"), &all)
    };
    let sampled = bench(&[
        "--case",
        "ds_high",
        "--backend",
        "cpu",
        "--modes",
        "resident,specter",
        "--prompts",
        prompts.to_str().unwrap(),
        "--new-tokens",
        "12",
        "--repeats",
        "1",
        "--temperature",
        "0.8",
        "--seed",
        "7",
        "--json",
        &out("s.json"),
    ]);
    assert!(sampled.ok(), "{sampled:?}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out("s.json")).unwrap()).unwrap();
    assert!((report["temperature"].as_f64().unwrap() - 0.8).abs() < 1e-6);
    assert_eq!(report["seed"], 7);
    for r in report["runs"].as_array().unwrap() {
        let share = r["repeated_4gram_share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&share), "{r}");
    }
    assert!(
        sampled
            .stdout
            .contains("sampled at temperature 0.8 (seed 7)"),
        "{sampled:?}"
    );
    assert_clean_failure(
        &bench(&[
            "--case",
            "ds_high",
            "--backend",
            "cpu",
            "--modes",
            "resident",
            "--temperature=-1",
        ]),
        &["temperature"],
    );
}
