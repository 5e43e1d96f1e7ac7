//! Link pacing on the GPU (`--link-gbps`): expert copies held to 25 GB/s are measured at 25 GB/s
//! (within 20%) by the copy stream's own events, the compute stream's stall for them grows, and
//! the tokens stay those of the unpaced run.
//!
//! Needs an NVIDIA GPU, so ignored by default (see tests/common/gpu.rs); `scripts/gpu-check.sh run
//! pace` runs it there with `--ignored`.

mod common;

use std::sync::Arc;

use specter::arch::{expected_tensors, ArchConfig, MoeModel};
use specter::backend::cuda::{CudaBackend, CudaOptions, HostPath, OffloadConfig};
use specter::decode::{generate, GenerateOptions, Mode, Sampling};
use specter::model::NoHook;
use specter::offload::{OffloadStats, Policy};
use specter_convert::pack::{convert, ConvertOptions, Silent};
use specter_convert::synth::{preset_config_layers, write_checkpoint};
use specter_format::Bundle;

/// The pace under test: PCIe 4.0 x16.
const PACE: f64 = 25e9;

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn paced_copies_run_at_the_pace_and_change_no_token() {
    let device = Arc::new(common::gpu::device());
    // DeepSeek-V2-Lite's widths (17.3 MB experts, so that a batch's copies dwarf the pacing
    // kernels' microseconds) in two layers, one of them MoE, and a small vocabulary.
    let mut config: serde_json::Value =
        serde_json::from_str(&preset_config_layers("deepseek-v2-lite", Some(2)).unwrap()).unwrap();
    config["vocab_size"] = serde_json::json!(4096);
    // The preset's special tokens sit past that vocabulary.
    config["bos_token_id"] = serde_json::json!(0);
    config["eos_token_id"] = serde_json::json!(1);
    let config = config.to_string();
    let cfg = ArchConfig::from_config_json(&config).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("checkpoint");
    write_checkpoint(
        &checkpoint,
        &config,
        &expected_tensors(&cfg),
        7,
        1 << 32,
        0.02,
    )
    .expect("synth");
    let path = dir.path().join("model.specter");
    convert(&checkpoint, &path, &ConvertOptions::default(), &Silent).expect("convert");
    let bundle = Arc::new(Bundle::open(&path).expect("open"));
    let top_k = cfg.moe.top_k;
    let prompt: Vec<u32> = (5..21).collect();

    let run = |pace: Option<f64>| -> (Vec<u32>, OffloadStats) {
        // On demand: every pass copies every expert it needs, 6 x 17.3 MB per token.
        let offload = OffloadConfig {
            bundle: bundle.clone(),
            config: cfg.clone(),
            slots_per_layer: top_k,
            policy: Policy::OnDemand,
            host_path: HostPath::Auto,
            host_experts: None,
            link_pace_bytes_per_s: pace,
        };
        let backend =
            CudaBackend::with_device(device.clone(), Some(offload), &CudaOptions::default())
                .expect("backend");
        // Staging copies are slower than the pace: copy straight from the registered mapping.
        backend.wait_host_registration().unwrap();
        let model = MoeModel::load(cfg.clone(), bundle.as_ref(), backend).expect("load");
        let opts = GenerateOptions {
            mode: Mode::Target,
            max_new_tokens: 24,
            depth: 1,
            sampling: Sampling::greedy(),
            stop_at_eos: false,
        };
        let tokens = generate(&model, &prompt, &opts, &mut NoHook, &mut |_| {})
            .expect("generate")
            .tokens;
        let stats = model.backend().offload_stats().unwrap().expect("offloaded");
        (tokens, stats)
    };

    let (free_tokens, free) = run(None);
    let link = free.copy_bandwidth();
    eprintln!(
        "unpaced: {:.2} GB copied at {:.2} GB/s, compute stalled {:.1} ms",
        free.bytes_copied as f64 / 1e9,
        link / 1e9,
        free.link_stall_seconds * 1e3
    );
    // A link no faster than the pace would prove nothing: pace at half of it instead.
    let pace = if link > 1.2 * PACE { PACE } else { link / 2.0 };
    let (paced_tokens, paced) = run(Some(pace));
    let measured = paced.copy_bandwidth();
    eprintln!(
        "paced to {:.2} GB/s: {:.2} GB copied at {:.2} GB/s, compute stalled {:.1} ms",
        pace / 1e9,
        paced.bytes_copied as f64 / 1e9,
        measured / 1e9,
        paced.link_stall_seconds * 1e3
    );
    assert_eq!(paced_tokens, free_tokens, "pacing changed the tokens");
    assert!(
        paced.bytes_copied >= 256_000_000,
        "only {} bytes copied: too few to measure a rate",
        paced.bytes_copied
    );
    assert_eq!(paced.bytes_copied, free.bytes_copied);
    assert_eq!(
        paced.experts_copied * paced.slot_bytes as u64,
        paced.bytes_copied
    );
    assert!(
        (0.8 * pace..=1.2 * pace).contains(&measured),
        "paced to {:.2} GB/s, measured {:.2} GB/s",
        pace / 1e9,
        measured / 1e9
    );
    // Every pass waits for its demand copies: the slower link shows as a longer stall.
    assert!(
        paced.link_stall_seconds > free.link_stall_seconds && paced.link_stall_seconds > 0.0,
        "stall {:.4} s paced vs {:.4} s unpaced",
        paced.link_stall_seconds,
        free.link_stall_seconds
    );
}
