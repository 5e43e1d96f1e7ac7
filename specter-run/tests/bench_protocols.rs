//! `specter-run bench`'s protocols on the CPU beside the paper's greedy decode (tests/generate.rs):
//! the sampled one, where every mode samples with the same seed (speculative rejection sampling
//! keeps the target's distribution, so tokens need not agree run by run) and every run reports
//! the share of its output's 4-grams that repeat; and the prefill one (`--prompt-tokens`), each
//! mode's time to first token at each prompt length and the prefill rate it implies, tokens
//! checked against target-only decoding; bad settings fail before any run.

#[path = "../../specter-pack/tests/common/cli.rs"]
mod cli;

use std::path::Path;

use cli::assert_clean_failure;
use serde_json::Value;
use specter_convert::pack::{convert, ConvertOptions, Silent};

/// A fixture converted into `dir`, and `specter-run bench` on it on the CPU.
struct Bench {
    bundle: String,
}

impl Bench {
    fn new(dir: &Path, fixture: &str) -> Bench {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(fixture);
        let bundle = dir.join(format!("{fixture}.specter"));
        convert(&src, &bundle, &ConvertOptions::default(), &Silent).unwrap();
        Bench {
            bundle: bundle.display().to_string(),
        }
    }

    /// `bench BUNDLE --case ds_high --backend cpu` and `extra`.
    fn run(&self, extra: &[&str]) -> cli::Run {
        let mut all = vec![
            "bench",
            &self.bundle,
            "--case",
            "ds_high",
            "--backend",
            "cpu",
        ];
        all.extend(extra);
        let all: Vec<String> = all.iter().map(|s| s.to_string()).collect();
        cli::run(env!("CARGO_BIN_EXE_specter-run"), &all)
    }
}

#[test]
fn bench_samples_when_asked_and_reports_repeated_4grams() {
    let dir = tempfile::tempdir().unwrap();
    let bench = Bench::new(dir.path(), "qwen2_moe");
    let out = |name: &str| dir.path().join(name).display().to_string();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "5,6,7,8\n9 10 11\n").unwrap();
    let sampled = bench.run(&[
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
        &bench.run(&["--modes", "resident", "--temperature=-1"]),
        &["temperature"],
    );
}

#[test]
fn bench_measures_prefill_at_each_prompt_length() {
    let dir = tempfile::tempdir().unwrap();
    let bench = Bench::new(dir.path(), "olmoe");
    let out = |name: &str| dir.path().join(name).display().to_string();
    let run = bench.run(&[
        "--modes",
        "resident,specter",
        "--prompt-tokens",
        "8,40",
        "--num-prompts",
        "2",
        "--repeats",
        "2",
        "--json",
        &out("p.json"),
        "--markdown",
        &out("p.md"),
    ]);
    assert!(run.ok(), "{run:?}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out("p.json")).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    // Two modes at each of two lengths, lengths in the order asked.
    let cells: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            let mode = r["mode"].as_str().unwrap().to_string();
            (mode, r["prompt_tokens"].as_u64().unwrap())
        })
        .collect();
    let want = [
        ("resident", 8),
        ("specter", 8),
        ("resident", 40),
        ("specter", 40),
    ];
    let want: Vec<(String, u64)> = want.iter().map(|&(m, n)| (m.to_string(), n)).collect();
    assert_eq!(cells, want);
    for r in rows {
        let (ttft, rate) = (
            r["median_ttft_ms"].as_f64().unwrap(),
            r["prefill_tokens_per_s"].as_f64().unwrap(),
        );
        let n = r["prompt_tokens"].as_f64().unwrap();
        assert!(
            ttft > 0.0 && r["min_ttft_ms"].as_f64().unwrap() <= ttft,
            "{r}"
        );
        assert!((rate - n / (ttft / 1e3)).abs() <= 1e-6 * rate, "{r}");
        assert_eq!(r["agreement"], 1.0, "{r}");
    }
    // Each length's decode report holds its runs: 2 modes x 2 prompts x 2 repeats.
    let reports = report["reports"].as_array().unwrap();
    assert_eq!(reports.len(), 2);
    for r in reports {
        assert_eq!(r["runs"].as_array().unwrap().len(), 8);
        assert_eq!(
            (&r["prompts"], &r["new_tokens"]),
            (&Value::from(2), &Value::from(2))
        );
    }
    let table = std::fs::read_to_string(out("p.md")).unwrap();
    assert!(
        table.contains("| prompt tokens |") && table.contains("| specter | all | 40 |"),
        "{table}"
    );
    assert!(run.stdout.contains("prefill tokens/s"), "{run:?}");

    // Bad settings: a zero length, a prompt file beside generated prompts, a chart of decode TPOT.
    let run = bench.run(&["--modes", "resident", "--prompt-tokens", "0,16"]);
    assert_clean_failure(&run, &["--prompt-tokens", "at least one token"]);
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "5,6,7\n").unwrap();
    let run = bench.run(&[
        "--prompt-tokens",
        "16",
        "--prompts",
        prompts.to_str().unwrap(),
    ]);
    assert_clean_failure(&run, &["--prompts"]);
    let run = bench.run(&["--prompt-tokens", "16", "--plot", &out("p.svg")]);
    assert_clean_failure(&run, &["--plot", "prefill"]);
    assert!(!Path::new(&out("p.svg")).exists());
}
