//! The convert pipeline as a library: checkpoints written by transformers convert into bundles
//! holding the reader's FP16 view of every tensor; output is reproducible whatever the thread
//! count; unused tensors are reported, not packed; progress adds up; and a failed conversion
//! leaves an existing bundle at the output path untouched.

// The root crate's test helpers: fixtures, found from the repository root.
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use half::f16;
use specter::arch::{self, ArchConfig, TensorRole};
use specter::weights::WeightStore;
use specter_convert::checkpoint::Checkpoint;
use specter_convert::pack::{convert, ConvertOptions, Progress, QuantMethod, Silent};
use specter_format::{Bundle, DType};

use common::FIXTURES;

fn fixture_dir(name: &str) -> PathBuf {
    common::repo_root().join("tests/fixtures").join(name)
}

fn options(threads: Option<usize>) -> ConvertOptions {
    ConvertOptions {
        quant: QuantMethod::Rtn,
        threads,
        ..ConvertOptions::default()
    }
}

#[test]
fn transformers_checkpoints_convert_into_the_readers_fp16_view() {
    for name in FIXTURES {
        let src = fixture_dir(name);
        let ckpt = Checkpoint::open(&src).unwrap();
        let cfg = ArchConfig::from_config_json(ckpt.config_json()).unwrap();
        let specs = arch::expected_tensors(&cfg);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("model.specter");
        let report = convert(&src, &out, &options(None), &Silent).unwrap();

        assert_eq!(report.output, out);
        assert_eq!(report.architecture, cfg.model_type.as_str());
        assert_eq!(report.bundle_bytes, std::fs::metadata(&out).unwrap().len());
        let shared = specs
            .iter()
            .filter(|s| s.role == TensorRole::Shared)
            .count();
        assert_eq!(report.shared_tensors, shared, "{name}");
        let routed = specs.len() - shared;
        assert_eq!(
            report.moe_layers * report.experts_per_layer * 3,
            routed,
            "{name}"
        );
        assert!(
            report.mean_rel_err > 0.0 && report.mean_rel_err < 0.3,
            "{name}: {}",
            report.mean_rel_err
        );

        let bundle = Bundle::open(&out).unwrap();
        for spec in &specs {
            let want = ckpt.f16(&spec.name).unwrap();
            let got = bundle.tensor(&spec.name).unwrap();
            assert_eq!(got.dtype, DType::F16);
            assert_eq!(got.shape, want.shape, "{name}: {}", spec.name);
            assert!(
                got.as_f16().unwrap() == &want.data[..],
                "{name}: {} differs",
                spec.name
            );
        }
        // Tensors the architecture does not use are listed, in the report and the manifest's
        // notes, and not packed.
        let manifest = bundle.to_manifest().unwrap();
        for ignored in &report.ignored_tensors {
            assert!(!bundle.has_tensor(ignored), "{name}: {ignored}");
            assert!(
                manifest
                    .provenance
                    .notes
                    .iter()
                    .any(|n| n.contains(ignored)),
                "{name}: {ignored}"
            );
        }
        assert_eq!(
            report.ignored_tensors.len() + specs.len(),
            ckpt.tensor_names().len()
        );
        assert!(bundle.verify().is_ok());
    }
}

#[test]
fn output_does_not_depend_on_the_thread_count() {
    let src = fixture_dir("qwen3_moe");
    let dir = tempfile::tempdir().unwrap();
    let mut bundles = Vec::new();
    for threads in [Some(1), Some(2), None] {
        let out = dir.path().join(format!("t{threads:?}.specter"));
        convert(&src, &out, &options(threads), &Silent).unwrap();
        bundles.push(std::fs::read(&out).unwrap());
    }
    assert!(bundles[0] == bundles[1], "1 and 2 threads differ");
    assert!(bundles[0] == bundles[2], "1 thread and the default differ");
}

#[test]
fn an_unused_tensor_is_reported_and_left_out() {
    let config = specter_convert::synth::fixture_config("mixtral").unwrap();
    let cfg = ArchConfig::from_config_json(&config).unwrap();
    let mut specs = arch::expected_tensors(&cfg);
    let extra = "model.layers.0.self_attn.rotary_emb.inv_freq";
    specs.push(arch::TensorSpec {
        name: extra.into(),
        shape: vec![16],
        role: TensorRole::Shared,
    });
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    specter_convert::synth::write_checkpoint(&src, &config, &specs, 41, u64::MAX, 0.05).unwrap();
    let out = dir.path().join("model.specter");
    let report = convert(&src, &out, &options(Some(2)), &Silent).unwrap();
    assert_eq!(report.ignored_tensors, vec![extra.to_string()]);
    let bundle = Bundle::open(&out).unwrap();
    assert!(!bundle.has_tensor(extra));
    let notes = bundle.to_manifest().unwrap().provenance.notes;
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].contains(extra) && notes[0].contains("mixtral"),
        "{notes:?}"
    );
}

/// Records what a conversion reports.
#[derive(Default)]
struct Recorder {
    total: AtomicU64,
    begun: AtomicU64,
    advanced: AtomicU64,
    stages: Mutex<Vec<String>>,
}

impl Progress for Recorder {
    fn begin(&self, total_bytes: u64) {
        self.total.store(total_bytes, Ordering::SeqCst);
        self.begun.fetch_add(1, Ordering::SeqCst);
    }
    fn advance(&self, bytes: u64) {
        self.advanced.fetch_add(bytes, Ordering::SeqCst);
    }
    fn stage(&self, message: &str) {
        self.stages.lock().unwrap().push(message.to_string());
    }
}

#[test]
fn progress_adds_up_to_the_total() {
    let src = fixture_dir("olmoe");
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::default();
    let report = convert(
        &src,
        &dir.path().join("m.specter"),
        &options(Some(2)),
        &recorder,
    )
    .unwrap();
    assert_eq!(recorder.begun.load(Ordering::SeqCst), 1);
    let total = recorder.total.load(Ordering::SeqCst);
    assert_eq!(total, report.source_tensor_bytes);
    assert_eq!(recorder.advanced.load(Ordering::SeqCst), total);
    let stages = recorder.stages.lock().unwrap();
    assert_eq!(
        stages.first().map(String::as_str),
        Some("reading checkpoint")
    );
    assert_eq!(stages.last().map(String::as_str), Some("writing manifest"));
}

#[test]
fn a_failed_conversion_leaves_an_existing_bundle_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model.specter");
    convert(&fixture_dir("mixtral"), &out, &options(None), &Silent).unwrap();
    let before = std::fs::read(&out).unwrap();

    // A checkpoint whose last expert tensor holds an infinity: found halfway through writing.
    let config = specter_convert::synth::fixture_config("mixtral").unwrap();
    let cfg = ArchConfig::from_config_json(&config).unwrap();
    let specs = arch::expected_tensors(&cfg);
    let src = dir.path().join("bad");
    specter_convert::synth::write_checkpoint(&src, &config, &specs, 42, u64::MAX, 0.05).unwrap();
    let last_expert = specs
        .iter()
        .rev()
        .find(|s| matches!(s.role, TensorRole::RoutedExpert { .. }))
        .unwrap();
    poison(&src.join("model.safetensors"), &last_expert.name);

    let err = convert(&src, &out, &options(None), &Silent).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&last_expert.name) && message.contains("not a finite number"),
        "{message}"
    );
    assert!(
        std::fs::read(&out).unwrap() == before,
        "the old bundle changed"
    );
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec!["bad", "model.specter"]);
}

/// Sets the first element of tensor `name` in the FP16 safetensors file at `path` to infinity.
fn poison(path: &Path, name: &str) {
    let mut bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header[name]["dtype"], "F16");
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize + 8 + header_len;
    bytes[start..start + 2].copy_from_slice(&f16::INFINITY.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}
