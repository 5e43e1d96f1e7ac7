//! `specter-run generate` on a bundle converted from a checkpoint made by transformers
//! (tests/fixtures/qwen2_moe): speculative decoding gives the target's tokens at every depth and
//! residency, text prompts and streaming work, and bad requests or bundles fail cleanly.

#[path = "../../specter-pack/tests/common/cli.rs"]
mod cli;
#[path = "../../specter-pack/tests/common/damage.rs"]
mod damage;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cli::{assert_clean_failure, Run};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use specter_convert::pack::{convert, ConvertOptions, Silent};

/// Experts per MoE layer and vocabulary of the fixture.
const EXPERTS: usize = 8;
const VOCAB: u32 = 512;

struct Converted {
    dir: tempfile::TempDir,
    bundle: PathBuf,
}

/// The fixture converted once per test binary.
fn converted() -> &'static Converted {
    static ONCE: OnceLock<Converted> = OnceLock::new();
    ONCE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2_moe");
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("qwen2_moe.specter");
        convert(&src, &bundle, &ConvertOptions::default(), &Silent).unwrap();
        Converted { dir, bundle }
    })
}

/// `generate` on the CPU backend unless `args` name one (these tests check the CPU reference and
/// its simulated offloading, whatever the machine has).
fn generate_on(bundle: &Path, args: &[String]) -> Run {
    let mut all = vec!["generate".to_string(), bundle.display().to_string()];
    all.extend(args.iter().cloned());
    if !args.iter().any(|a| a.starts_with("--backend")) {
        all.extend(["--backend".to_string(), "cpu".to_string()]);
    }
    cli::run(env!("CARGO_BIN_EXE_specter-run"), &all)
}

fn generate(args: &[&str]) -> Run {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    generate_on(&converted().bundle, &args)
}

/// Runs with `--json` and returns the record.
fn generate_json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let run = generate(&all);
    assert!(run.ok(), "{args:?}: {run:?}");
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {run:?}"))
}

fn tokens(record: &Value, key: &str) -> Vec<u32> {
    record[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {record}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// `base` followed by `extra`.
fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

fn ids(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn specter_mode_gives_the_target_tokens_at_every_depth_and_residency() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let new_tokens = "24";
    for prompt_len in [1usize, 9] {
        // Ids from 3 up: 0..=2 are the pad, BOS and EOS tokens.
        let prompt: Vec<u32> = (0..prompt_len)
            .map(|_| rng.random_range(3..VOCAB))
            .collect();
        let prompt = ids(&prompt);
        let base = [
            "--prompt-ids",
            prompt.as_str(),
            "--max-new-tokens",
            new_tokens,
            "--ignore-eos",
        ];
        let reference = generate_json(&with(&base, &["--mode", "target"]));
        let want = tokens(&reference, "tokens");
        assert_eq!(want.len(), 24);
        assert_eq!(reference["mode"], "target");
        assert!(reference["stats"]["cache"].is_null());

        let all = EXPERTS.to_string();
        for resident in [None, Some("1"), Some("2"), Some(all.as_str())] {
            for depth in ["1", "4", "16"] {
                let mut extra = vec!["--mode", "specter", "--depth", depth];
                if let Some(r) = resident {
                    extra.extend(["--resident-experts", r]);
                }
                let record = generate_json(&with(&base, &extra));
                let what = format!("prompt {prompt} depth {depth} resident {resident:?}");
                assert_eq!(tokens(&record, "tokens"), want, "{what}");
                assert_eq!(tokens(&record, "prompt_tokens").len(), prompt_len);
                assert_eq!(record["mode"], "specter");
                assert_eq!(record["depth"], depth.parse::<u64>().unwrap());
                let stats = &record["stats"];
                assert_eq!(stats["generated_tokens"], 24);
                assert!(stats["drafted"].as_u64().unwrap() > 0, "{what}");
                assert!(stats["accepted"].as_u64() <= stats["drafted"].as_u64());
                let cache = &stats["cache"];
                match resident {
                    None => assert!(cache.is_null(), "{what}"),
                    Some(r) => {
                        let (hits, misses) = (
                            cache["hits"].as_u64().unwrap(),
                            cache["misses"].as_u64().unwrap(),
                        );
                        assert_eq!(hits + misses, cache["lookups"].as_u64().unwrap());
                        assert!(hits + misses > 0);
                        if r == all {
                            // Every expert resident from the start: nothing is ever copied.
                            assert_eq!(misses, 0, "{what}");
                            assert_eq!(cache["bytes_moved"], 0, "{what}");
                        }
                    }
                }
            }
        }
        // Offloading in target mode does not change the output either.
        for resident in ["1", "3"] {
            let record = generate_json(&with(
                &base,
                &["--mode", "target", "--resident-experts", resident],
            ));
            assert_eq!(
                tokens(&record, "tokens"),
                want,
                "target, {resident} resident"
            );
            assert!(record["stats"]["cache"]["misses"].as_u64().unwrap() > 0);
        }
    }
}

#[test]
fn a_text_prompt_is_tokenized_and_the_stream_prints_the_text() {
    let text = "The quick brown fox";
    let args = [
        "--prompt",
        text,
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--depth",
        "3",
    ];
    let record = generate_json(&args);
    let prompt = tokens(&record, "prompt_tokens");
    assert!(prompt.len() >= 2, "{record}");
    let generated = tokens(&record, "tokens");
    assert_eq!(generated.len(), 16);
    let decoded = record["text"].as_str().unwrap().to_string();

    // The same ids given directly give the same continuation.
    let prompt_ids = ids(&prompt);
    let by_ids = generate_json(&[
        "--prompt-ids",
        &prompt_ids,
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--depth",
        "3",
    ]);
    assert_eq!(tokens(&by_ids, "tokens"), generated);

    // Without --json the text is streamed to stdout (and a summary goes to stderr).
    let run = generate(&args);
    assert!(run.ok(), "{run:?}");
    assert_eq!(run.stdout, format!("{decoded}\n"), "{run:?}");
    assert!(run.stderr.contains("[16 tokens"), "{run:?}");
    assert!(!run.stderr.contains("error"), "{run:?}");
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused() {
    let run = generate(&["--prompt-ids", "5,17,512"]);
    assert_clean_failure(&run, &["512", "outside the vocabulary", "512)"]);
    let run = generate(&["--prompt-ids", "4294967295"]);
    assert_clean_failure(&run, &["4294967295", "outside the vocabulary"]);
    // Not a number at all: refused by the argument parser.
    let run = generate(&["--prompt-ids", "5,-3"]);
    assert_clean_failure(&run, &["--prompt-ids"]);
    assert_eq!(run.code, Some(2));
}

#[test]
fn an_empty_prompt_is_refused() {
    let run = generate(&["--prompt", ""]);
    assert_clean_failure(&run, &["prompt is empty"]);
    let run = generate(&["--prompt-ids", ""]);
    assert_clean_failure(&run, &["--prompt-ids", "empty"]);
    // No prompt at all.
    let run = generate(&[]);
    assert_clean_failure(&run, &["required arguments were not provided"]);
    assert!(run.stderr.contains("--prompt <PROMPT>"), "{run:?}");
    assert_eq!(run.code, Some(2));
}

#[test]
fn more_tokens_than_the_context_are_refused() {
    let run = generate(&["--prompt-ids", "5,6,7", "--max-new-tokens", "1000000"]);
    assert_clean_failure(&run, &["1000000", "context of 4096"]);
    let run = generate(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "18446744073709551615",
        "--mode",
        "target",
    ]);
    assert_clean_failure(&run, &["context"]);
}

#[test]
fn an_unknown_mode_is_a_usage_error() {
    let run = generate(&["--prompt-ids", "5", "--mode", "fastest"]);
    assert_clean_failure(&run, &["fastest", "--mode"]);
    assert_eq!(run.code, Some(2));
    assert!(run.stderr.contains("specter, target, draft"), "{run:?}");
}

#[test]
fn depth_zero_is_refused() {
    let run = generate(&["--prompt-ids", "5", "--depth", "0"]);
    assert_clean_failure(&run, &["--depth", "at least 1"]);
}

#[test]
fn resident_experts_outside_one_to_all_are_refused() {
    let too_many = (EXPERTS + 1).to_string();
    for bad in ["0", too_many.as_str()] {
        let run = generate(&["--prompt-ids", "5", "--resident-experts", bad]);
        assert_clean_failure(&run, &["--resident-experts", "between 1 and 8"]);
    }
    let run = generate(&[
        "--prompt-ids",
        "5",
        "--resident-experts",
        "2",
        "--bandwidth-gbps",
        "0",
    ]);
    assert_clean_failure(&run, &["--bandwidth-gbps", "positive"]);
}

#[test]
fn bad_sampling_parameters_are_refused() {
    let run = generate(&["--prompt-ids", "5", "--temperature", "NaN"]);
    assert_clean_failure(&run, &["temperature", "NaN"]);
    let run = generate(&["--prompt-ids", "5", "--temperature", "1", "--top-p", "1.5"]);
    assert_clean_failure(&run, &["top_p", "1.5"]);
}

#[test]
fn the_cuda_backend_without_a_gpu_is_refused_clearly() {
    if specter::backend::cuda::driver_library_present() {
        eprintln!(
            "skipped: this machine has a CUDA driver (scripts/gpu-check.sh runs the GPU path)"
        );
        return;
    }
    let run = generate(&["--prompt-ids", "5", "--backend", "cuda"]);
    assert_clean_failure(&run, &["libcuda.so.1", "--backend cpu"]);
    let run = generate(&[
        "--prompt-ids",
        "5",
        "--backend",
        "cuda",
        "--resident-experts",
        "2",
    ]);
    assert_clean_failure(&run, &["libcuda.so.1", "--backend cpu"]);
}

#[test]
fn the_default_backend_is_chosen_and_named_on_stderr() {
    let bundle = converted().bundle.display().to_string();
    let run = cli::run(
        env!("CARGO_BIN_EXE_specter-run"),
        &[
            "generate",
            &bundle,
            "--prompt-ids",
            "5,6",
            "--max-new-tokens",
            "2",
            "--json",
        ],
    );
    assert!(run.ok(), "{run:?}");
    let record: Value = serde_json::from_str(&run.stdout).unwrap();
    let line = run
        .stderr
        .lines()
        .find(|l| l.starts_with("backend: "))
        .unwrap_or_else(|| panic!("no backend line: {run:?}"));
    if !specter::backend::cuda::driver_library_present() {
        assert_eq!(
            line,
            "backend: cpu (no CUDA driver: libcuda.so.1 not found)"
        );
    }
    let backend = record["backend"].as_str().unwrap();
    let reason = record["backend_reason"].as_str().unwrap();
    assert_eq!(line, format!("backend: {backend} ({reason})"));
    // A forced backend prints no such line.
    let run = generate(&["--prompt-ids", "5", "--max-new-tokens", "1"]);
    assert!(run.ok(), "{run:?}");
    assert!(!run.stderr.contains("backend: "), "{run:?}");
}

#[test]
fn host_path_options_on_the_cpu_backend_are_noted_not_refused() {
    let run = generate(&[
        "--prompt-ids",
        "5,6",
        "--max-new-tokens",
        "2",
        "--host-experts",
        "auto",
        "--link-gbps",
        "25",
    ]);
    assert!(run.ok(), "{}", run.stderr);
    assert!(
        run.stderr.contains("--host-experts: the CPU backend"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("--link-gbps: the CPU backend"),
        "{}",
        run.stderr
    );
}

#[test]
fn gpu_only_options_need_the_cuda_backend() {
    let run = generate(&["--prompt-ids", "5", "--vram-budget", "24"]);
    assert_clean_failure(&run, &["--vram-budget", "--backend cuda"]);
    let run = generate(&["--prompt-ids", "5", "--pinned-staging"]);
    assert_clean_failure(&run, &["--pinned-staging", "--backend cuda"]);
    let run = generate(&["--prompt-ids", "5", "--backend", "cuda", "--vram-budget=-3"]);
    assert_clean_failure(&run, &["--vram-budget", "positive"]);
}

/// `specter-run generate` on `bytes` written as a file fails mentioning `needles` and the path.
fn assert_bundle_refused(name: &str, bytes: &[u8], needles: &[&str]) {
    let path = converted().dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    let run = generate_on(&path, &["--prompt-ids".to_string(), "5,6".to_string()]);
    let mut all = vec![path.to_str().unwrap()];
    all.extend(needles);
    assert_clean_failure(&run, &all);
    assert!(run.stdout.is_empty(), "{run:?}");
}

#[test]
fn damaged_or_foreign_bundles_are_refused() {
    let good = std::fs::read(&converted().bundle).unwrap();
    assert_bundle_refused(
        "v3.specter",
        &damage::newer_major(&good),
        &["version 3.x", "newer than this build supports"],
    );
    assert_bundle_refused(
        "magic.specter",
        &damage::wrong_magic(&good),
        &["not a Specter bundle"],
    );
    assert_bundle_refused(
        "cut.specter",
        &damage::truncated(&good, good.len() - 4096),
        &["truncated"],
    );
    assert_bundle_refused(
        "out.specter",
        &damage::section_outside_file(&good, "experts.1"),
        &["experts.1", "lies outside"],
    );
    let config = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2_moe/config.json"),
    )
    .unwrap();
    assert_bundle_refused("config.json", &config, &["not a Specter bundle"]);
    let missing = converted().dir.path().join("missing.specter");
    let run = generate_on(&missing, &["--prompt-ids".to_string(), "5".to_string()]);
    assert_clean_failure(&run, &["missing.specter", "No such file"]);
}

/// The good bundle with its manifest edited by `edit` (header re-sealed to match).
fn with_edited_manifest(edit: impl FnOnce(&mut specter_format::Manifest)) -> Vec<u8> {
    let good = std::fs::read(&converted().bundle).unwrap();
    let mut manifest = damage::manifest(&good);
    edit(&mut manifest);
    damage::with_manifest(&good, &manifest)
}

#[test]
fn a_bundle_lacking_a_tensor_names_it() {
    let name = "model.layers.1.self_attn.k_proj.weight";
    let bytes = with_edited_manifest(|m| m.tensors.retain(|t| t.name != name));
    assert_bundle_refused("no-tensor.specter", &bytes, &[name]);
}

#[test]
fn a_bundle_of_an_unsupported_architecture_lists_the_supported_ones() {
    let bytes = with_edited_manifest(|m| {
        m.architecture = "gpt2".into();
        m.hyperparameters_json = m.hyperparameters_json.replace("\"qwen2_moe\"", "\"gpt2\"");
    });
    let mut needles = vec!["gpt2"];
    needles.extend(specter::arch::SUPPORTED_MODEL_TYPES);
    assert_bundle_refused("gpt2.specter", &bytes, &needles);
}

#[test]
fn a_bundle_without_the_draft_runs_the_target_and_refuses_to_draft() {
    let bytes = with_edited_manifest(|m| m.tensors.retain(|t| !t.name.starts_with("draft.")));
    let path = converted().dir.path().join("no-draft.specter");
    std::fs::write(&path, bytes).unwrap();
    let args = |mode: &str| -> Vec<String> {
        [
            "--prompt-ids",
            "5,6,7",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "--mode",
            mode,
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = generate_on(&path, &args("target"));
    assert!(run.ok(), "{run:?}");
    let reference = generate_json(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--mode",
        "target",
    ]);
    assert_eq!(tokens(&reference, "tokens").len(), 4);
    let record: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(tokens(&record, "tokens"), tokens(&reference, "tokens"));
    for mode in ["specter", "draft"] {
        let run = generate_on(&path, &args(mode));
        assert_clean_failure(&run, &["no draft tensor", "draft.layers.0.experts.0"]);
    }
}

#[test]
fn draft_mode_runs_the_int4_draft_alone() {
    let record = generate_json(&[
        "--prompt-ids",
        "11,12,13",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--mode",
        "draft",
    ]);
    assert_eq!(record["mode"], "draft");
    let got = tokens(&record, "tokens");
    assert_eq!(got.len(), 12);
    assert!(got.iter().all(|&t| t < VOCAB));
}

#[test]
fn specmoeoff_mode_gives_the_target_tokens_with_and_without_simulated_offload() {
    let base = [
        "--prompt-ids",
        "11,12,13,200,7",
        "--max-new-tokens",
        "20",
        "--ignore-eos",
    ];
    let want = tokens(
        &generate_json(&with(&base, &["--mode", "target"])),
        "tokens",
    );
    let record = generate_json(&with(&base, &["--mode", "specmoeoff"]));
    assert_eq!(record["mode"], "specmoeoff");
    // The protocol's K = 3 unless --depth says otherwise.
    assert_eq!(record["depth"], 3);
    assert_eq!(tokens(&record, "tokens"), want);
    assert!(record["stats"]["drafted"].as_u64().unwrap() > 0);
    for resident in ["1", "3"] {
        let record = generate_json(&with(
            &base,
            &[
                "--mode",
                "specmoeoff",
                "--depth",
                "5",
                "--resident-experts",
                resident,
            ],
        ));
        assert_eq!(record["depth"], 5);
        assert_eq!(tokens(&record, "tokens"), want, "{resident} resident");
        let cache = &record["stats"]["cache"];
        assert!(
            cache["prefetched"].as_u64().unwrap() > 0,
            "{resident} resident: route-frequency prefetch copied nothing: {cache}"
        );
    }
    let run = generate(&with(&base, &["--mode", "specmoeoff", "--auto-depth"]));
    assert_clean_failure(&run, &["--auto-depth", "--mode specter"]);
}

#[test]
fn a_bundle_without_a_tokenizer_takes_ids_and_refuses_text() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/olmoe");
    let work = tempfile::tempdir().unwrap();
    let hf = work.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(name), hf.join(name)).unwrap();
    }
    let bundle = work.path().join("no-tokenizer.specter");
    convert(&hf, &bundle, &ConvertOptions::default(), &Silent).unwrap();

    let run = generate_on(&bundle, &["--prompt".into(), "hello".into()]);
    assert_clean_failure(&run, &["no tokenizer.json", "--prompt-ids"]);
    // Ids work; without a tokenizer the tokens are printed as ids, not streamed as text.
    let args: Vec<String> = [
        "--prompt-ids",
        "7,8,9",
        "--max-new-tokens",
        "5",
        "--ignore-eos",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let run = generate_on(&bundle, &args);
    assert!(run.ok(), "{run:?}");
    let printed: Vec<u32> = run
        .stdout
        .trim()
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(printed.len(), 5, "{run:?}");
    let mut json_args = args.clone();
    json_args.push("--json".into());
    let run = generate_on(&bundle, &json_args);
    let record: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(tokens(&record, "tokens"), printed);
    assert!(record["text"].is_null());
}

#[test]
fn automatic_depth_is_lossless_and_reports_its_rounds() {
    let target = generate_json(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "24",
        "--mode",
        "target",
        "--ignore-eos",
    ]);
    let auto = generate_json(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "24",
        "--mode",
        "specter",
        "--depth",
        "8",
        "--auto-depth",
        "--ignore-eos",
    ]);
    assert_eq!(
        auto["tokens"], target["tokens"],
        "auto depth changed the greedy tokens"
    );
    let report = &auto["auto_depth"];
    assert_eq!(report["depths"], serde_json::json!([0, 1, 2, 4, 8]));
    let rounds: u64 = report["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .sum();
    assert_eq!(
        rounds,
        auto["stats"]["rounds"].as_u64().unwrap(),
        "{report}"
    );
    let run = generate(&["--prompt-ids", "5", "--mode", "target", "--auto-depth"]);
    assert_clean_failure(&run, &["--auto-depth", "--mode specter"]);
}

#[test]
fn a_depth_profile_is_measured_used_and_refused_for_another_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let bundle = converted().bundle.display().to_string();
    let run = cli::run(
        env!("CARGO_BIN_EXE_specter-run"),
        &[
            "profile".to_string(),
            bundle.clone(),
            "-o".to_string(),
            profile.display().to_string(),
            "--new-tokens".to_string(),
            "8".to_string(),
            "--depths".to_string(),
            "0,1,4".to_string(),
            "--repeats".to_string(),
            "1".to_string(),
            "--backend".to_string(),
            "cpu".to_string(),
        ],
    );
    assert!(run.ok(), "{run:?}");
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    assert_eq!(written["depths"], serde_json::json!([0, 1, 4]));
    assert_eq!(written["key"]["backend"], "cpu");
    let best = written["best_depth"].as_u64().unwrap();
    assert!([0, 1, 4].contains(&best), "{written}");
    assert!(run.stdout.contains("best depth"), "{run:?}");
    // Without offloading there is no plain candidate (the draft's memory has nowhere to go).
    assert_eq!(written["plain"], Value::Null);
    // The draft's INT4 experts (4 bits a weight plus f16 scales per 128) take the VRAM of about
    // a quarter of the FP16 experts, rounded down.
    let b = specter_format::Bundle::open(&converted().bundle).unwrap();
    let slots = specter_run::profile::draft_slot_equivalent(&b).unwrap();
    assert!((1..=EXPERTS / 4).contains(&slots), "{slots}");

    let p = profile.display().to_string();
    let target = generate_json(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "12",
        "--mode",
        "target",
        "--ignore-eos",
    ]);
    let auto = generate_json(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "12",
        "--mode",
        "specter",
        "--depth",
        "4",
        "--auto-depth",
        "--profile",
        &p,
        "--ignore-eos",
    ]);
    assert_eq!(auto["tokens"], target["tokens"]);

    // A profile of another bundle (its manifest checksum differs) is refused by name.
    let mut other = written.clone();
    other["key"]["manifest_sha256"] = Value::String("00".repeat(32));
    let other_path = dir.path().join("other.json");
    std::fs::write(&other_path, other.to_string()).unwrap();
    let o = other_path.display().to_string();
    let run = generate(&[
        "--prompt-ids",
        "5",
        "--mode",
        "specter",
        "--auto-depth",
        "--profile",
        &o,
    ]);
    assert_clean_failure(&run, &["profile", "another bundle"]);

    // A plain candidate faster than every depth only applies to offloaded CUDA runs: here the
    // profile's depths seed automatic control and the draft still runs.
    let mut with_plain = written.clone();
    with_plain["plain"] = serde_json::json!({"slots": 8, "tpot_ms": 1e-9});
    let plain_path = dir.path().join("plain.json");
    std::fs::write(&plain_path, with_plain.to_string()).unwrap();
    let record = generate_json(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "12",
        "--mode",
        "specter",
        "--ignore-eos",
        "--auto-depth",
        "--profile",
        &plain_path.display().to_string(),
    ]);
    assert_eq!(record["auto_plain"], Value::Null, "{record}");
    assert_eq!(record["mode"], "specter");
    assert_eq!(tokens(&record, "tokens"), tokens(&target, "tokens"));

    // The plain candidate's slot count only makes sense with offloaded experts.
    let run = cli::run(
        env!("CARGO_BIN_EXE_specter-run"),
        &[
            "profile".to_string(),
            bundle,
            "-o".to_string(),
            dir.path().join("p2.json").display().to_string(),
            "--plain-experts".to_string(),
            "4".to_string(),
        ],
    );
    assert_clean_failure(&run, &["required arguments"]);
    assert!(run.stderr.contains("--resident-experts"), "{run:?}");
}

#[test]
fn bench_runs_the_protocol_on_the_cpu_and_refuses_what_it_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = converted().bundle.display().to_string();
    let out = |name: &str| dir.path().join(name).display().to_string();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "5,6,7,8\n\n9 10 11\n").unwrap();
    let bench = |extra: &[&str]| {
        let mut all = vec!["bench".to_string(), bundle.clone()];
        all.extend(extra.iter().map(|s| s.to_string()));
        cli::run(env!("CARGO_BIN_EXE_specter-run"), &all)
    };
    let run = bench(&[
        "--case",
        "ds_high",
        "--backend",
        "cpu",
        "--modes",
        "resident,specter,auto,specmoeoff",
        "--prompts",
        prompts.to_str().unwrap(),
        "--new-tokens",
        "12",
        "--repeats",
        "2",
        "--json",
        &out("b.json"),
        "--markdown",
        &out("b.md"),
        "--plot",
        &out("b.svg"),
    ]);
    assert!(run.ok(), "{run:?}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out("b.json")).unwrap()).unwrap();
    assert_eq!(report["prompts"], 2);
    assert_eq!(report["runs"].as_array().unwrap().len(), 4 * 2 * 2);
    for m in report["modes"].as_array().unwrap() {
        assert_eq!(m["agreement"], 1.0, "{m}");
        assert!(m["mean_tpot_ms"].as_f64().unwrap() > 0.0, "{m}");
    }
    assert_eq!(report["modes"][1]["depth"], 16);
    // SpecMoEOff: its own row at the protocol's K = 3, with its case residency and the headline
    // ratio against Specter.
    let specmoeoff = &report["modes"][3];
    assert_eq!(specmoeoff["mode"], "specmoeoff");
    assert_eq!(specmoeoff["depth"], 3);
    assert!(
        specmoeoff["mean_acceptance"].as_f64().unwrap() > 0.0,
        "{specmoeoff}"
    );
    assert_eq!(report["case"]["specmoeoff"], 12);
    assert!(report["specter_over_specmoeoff"].as_f64().unwrap() > 0.0);
    assert!(report["auto_over_specmoeoff"].as_f64().unwrap() > 0.0);
    let specmoeoff_runs: Vec<&Value> = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["mode"] == "specmoeoff")
        .collect();
    assert_eq!(specmoeoff_runs.len(), 2 * 2);
    assert!(specmoeoff_runs.iter().all(|r| r["agrees"] == true));
    let table = std::fs::read_to_string(out("b.md")).unwrap();
    assert!(
        table.contains("| specter |")
            && table.contains("| auto |")
            && table.contains("| specmoeoff |")
            && table.contains("specter over specmoeoff")
            && table.contains("KV cache of their own")
            && table.contains("| floor ms | TPOT/floor |"),
        "{table}"
    );
    assert!(run.stdout.contains("| resident |"), "{run:?}");
    assert!(
        table.contains("greedy") && table.contains("repeated 4-grams"),
        "{table}"
    );
    assert!(std::fs::read_to_string(out("b.svg"))
        .unwrap()
        .starts_with("<svg"));

    // Modes that copy experts need the GPU; a target-only reference is required; custom cases
    // need their numbers (SpecMoEOff's residency too, when it runs).
    let run = bench(&[
        "--case",
        "ds_low",
        "--backend",
        "cpu",
        "--modes",
        "resident,lru",
    ]);
    assert_clean_failure(&run, &["lru", "--backend cuda"]);
    let run = bench(&[
        "--case",
        "custom",
        "--backend",
        "cpu",
        "--modes",
        "resident,specmoeoff",
        "--depth",
        "4",
        "--resident-experts",
        "2",
        "--matched-experts",
        "4",
    ]);
    assert_clean_failure(&run, &["specmoeoff", "--specmoeoff-experts"]);
    let run = bench(&[
        "--case",
        "ds_low",
        "--backend",
        "cpu",
        "--modes",
        "resident,specmoeoff",
        "--specmoeoff-experts",
        "3",
    ]);
    assert_clean_failure(&run, &["only go with --case custom"]);
    let run = bench(&["--case", "ds_low", "--backend", "cpu", "--modes", "specter"]);
    assert_clean_failure(&run, &["target-only mode"]);
    let run = bench(&["--case", "custom", "--backend", "cpu", "--depth", "4"]);
    assert_clean_failure(&run, &["--case custom", "--resident-experts"]);
    let run = bench(&["--case", "nope", "--backend", "cpu"]);
    assert_clean_failure(&run, &["nope", "ds_high"]);
}

#[test]
fn json_reports_the_start_up_times_in_order() {
    let record = generate_json(&[
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "2",
        "--mode",
        "target",
    ]);
    let s = &record["startup"];
    let ms = |key: &str| {
        s[key]
            .as_f64()
            .unwrap_or_else(|| panic!("no startup.{key} in {record}"))
    };
    let (opened, resident, first) = (
        ms("bundle_opened_ms"),
        ms("weights_resident_ms"),
        ms("first_token_ms"),
    );
    assert!(
        0.0 <= opened && opened <= resident && resident <= first,
        "{s}"
    );
    // No GPU on the CPU backend.
    assert!(s["device_ready_ms"].is_null(), "{s}");
    // The fields that were there before are unchanged.
    assert!(record["stats"]["ttft_ms"].as_f64().is_some());
    // Host memory, in bytes, on Linux: the peak resident set holds the current one.
    let host = &record["host_memory"];
    let bytes = |key: &str| {
        host[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {host}"))
    };
    assert!(bytes("peak_rss_bytes") >= bytes("rss_bytes") && bytes("rss_bytes") > 0);
}

#[test]
fn an_unknown_load_io_method_is_a_clean_error() {
    let run = generate(&[
        "--prompt-ids",
        "5",
        "--backend",
        "cuda",
        "--load-io",
        "fast",
    ]);
    // Checked before any device is opened, so with or without a GPU.
    assert_clean_failure(&run, &["unknown load I/O method", "fast"]);
}

#[test]
fn the_library_entry_point_streams_and_stops_when_told() {
    use specter::generate::{generate, BackendChoice, GenerationHooks, GenerationRequest, Prompt};
    let mut request = GenerationRequest::new(&converted().bundle, Prompt::Ids(vec![5, 6, 7]));
    request.backend = BackendChoice::Cpu;
    request.max_new_tokens = 12;
    request.stop_at_eos = false;
    request.depth = Some(4);
    let full = generate(&request, GenerationHooks::default()).unwrap();
    assert_eq!(full.tokens.len(), 12);
    assert!(!full.stopped_by_caller);

    // Stop after the third token: the speculative loop may have verified more in that round,
    // but only what the caller saw is committed.
    let mut seen = Vec::new();
    let mut notes = Vec::new();
    let mut on_tokens = |c: &specter::generate::Committed<'_>| {
        seen.push(c.tokens.to_vec());
        c.tokens.len() < 3
    };
    let mut on_note = |line: &str| notes.push(line.to_string());
    let stopped = generate(
        &request,
        GenerationHooks {
            on_note: Some(&mut on_note),
            on_tokens: Some(&mut on_tokens),
        },
    )
    .unwrap();
    assert!(stopped.stopped_by_caller);
    assert_eq!(stopped.tokens, full.tokens[..3]);
    assert_eq!(stopped.stats.decode.generated_tokens, 3);
    assert_eq!(
        seen,
        vec![
            full.tokens[..1].to_vec(),
            full.tokens[..2].to_vec(),
            full.tokens[..3].to_vec()
        ]
    );
    // A forced backend is not announced.
    assert!(
        notes.iter().all(|n| !n.starts_with("backend:")),
        "{notes:?}"
    );
    // The report serializes with the fields `generate --json` prints.
    let json = serde_json::to_value(&stopped).unwrap();
    for key in [
        "bundle",
        "architecture",
        "backend",
        "gpu",
        "mode",
        "startup",
        "depth",
        "prompt_tokens",
        "tokens",
        "text",
        "stats",
    ] {
        assert!(json.get(key).is_some(), "no {key} in {json}");
    }
}
