//! The embedded default: build a small model of a supported architecture with random weights,
//! convert it, verify the bundle, and generate with the speculative loop, saying what each step
//! did. It needs no download and no GPU, so it is the first thing a newcomer runs; on a GPU it
//! decodes there, with real expert copies in its offloaded run.

use std::path::Path;
use std::time::Instant;

use specter::arch::{expected_tensors, ArchConfig};
use specter::backend::cuda::CudaOptions;
use specter::decode::{GenerateOptions, Mode, Sampling};
use specter::offload::Policy;
use specter::session::{BackendKind, Session, SessionOptions};
use specter::strategy::{decode_on_session, DecodePlan, DEFAULT_COPY_BANDWIDTH};
use specter::{Error, Result};
use specter_convert::pack::{convert, ConvertOptions, Silent};
use specter_convert::synth;
use specter_format::Bundle;

#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// A `model_type` from [`specter::arch::SUPPORTED_MODEL_TYPES`].
    pub architecture: String,
    pub max_new_tokens: usize,
    pub depth: usize,
    /// Routed experts resident per MoE layer in the offloaded run (simulated on the CPU).
    pub resident_experts: usize,
    pub seed: u64,
    pub backend: BackendKind,
    pub cuda: CudaOptions,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            architecture: "deepseek_v2".into(),
            max_new_tokens: 32,
            depth: 4,
            resident_experts: 2,
            seed: 7,
            backend: BackendKind::Cpu,
            cuda: CudaOptions::default(),
        }
    }
}

/// What the demo measured.
#[derive(Clone, Debug)]
pub struct DemoSummary {
    pub tokens: Vec<u32>,
    pub lossless: bool,
    pub acceptance_rate: f64,
    pub hits: u64,
    pub misses: u64,
}

/// Runs the demo inside `work_dir`, reporting each step through `say`.
pub fn run(work_dir: &Path, opts: &DemoOptions, say: &mut dyn FnMut(&str)) -> Result<DemoSummary> {
    let hf_dir = work_dir.join("checkpoint");
    let bundle_path = work_dir.join("demo.specter");

    let t = Instant::now();
    let config_json = synth::fixture_config(&opts.architecture)?;
    let cfg = ArchConfig::from_config_json(&config_json)?;
    synth::write_checkpoint(
        &hf_dir,
        &config_json,
        &expected_tensors(&cfg),
        opts.seed,
        1 << 30,
        0.15,
    )?;
    say(&format!(
        "1. synthesized a small {} checkpoint with random weights ({} layers, {} experts of width {}, top-{}) in {:.2} s",
        opts.architecture,
        cfg.num_layers,
        cfg.moe.num_experts,
        cfg.expert_dims().1,
        cfg.moe.top_k,
        t.elapsed().as_secs_f64()
    ));

    let t = Instant::now();
    let report = convert(&hf_dir, &bundle_path, &ConvertOptions::default(), &Silent)?;
    say(&format!(
        "2. converted it into {} ({} bytes): FP16 experts page-aligned per layer, INT4 draft experts (RTN, group 128, Marlin tiled; mean relative weight error {:.4}) in {:.2} s",
        bundle_path.display(),
        report.bundle_bytes,
        report.mean_rel_err,
        t.elapsed().as_secs_f64()
    ));

    let t = Instant::now();
    let bundle = Bundle::open(&bundle_path)?;
    let check = bundle.verify();
    if !check.is_ok() {
        return Err(Error::Model(format!(
            "the demo bundle failed verification: {:?}",
            check.bad_sections()
        )));
    }
    say(&format!(
        "3. verified every section's sha256 ({} sections) in {:.3} s",
        check.sections.len(),
        t.elapsed().as_secs_f64()
    ));

    drop(bundle);
    let mut session_opts = SessionOptions::new(opts.backend);
    session_opts.cuda = opts.cuda.clone();
    let session = Session::open_with(&bundle_path, &session_opts)?;
    let info = session.info().clone();
    let prompt: Vec<u32> = (0..8u32)
        .map(|i| 3 + (i * 37 + opts.seed as u32) % (info.vocab_size as u32 - 3))
        .collect();
    let options = |mode| GenerateOptions {
        mode,
        max_new_tokens: opts.max_new_tokens,
        depth: opts.depth,
        sampling: Sampling::greedy(),
        stop_at_eos: false,
    };
    match session.cuda() {
        None => say("4. backend: cpu (the exact f32 reference; on a GPU, `specter-run generate --backend cuda`)"),
        Some(gpu) => say(&format!(
            "4. backend: cuda ({}; FP16 experts, the INT4 draft on the W4A16 kernel)",
            gpu.device().name()
        )),
    }
    let decode = |session: &Session, mode, plan: &DecodePlan| {
        decode_on_session(session, &prompt, &options(mode), plan, &mut |_| true)
            .map(|decoded| decoded.output)
    };
    let target = decode(&session, Mode::Target, &DecodePlan::default())?;
    say(&format!(
        "   target-only: {} tokens, TPOT {:.2} ms",
        target.tokens.len(),
        target.stats.tpot_ms
    ));
    let slots = opts.resident_experts.clamp(1, info.num_experts);
    // The same speculative run with most experts offloaded: on the CPU the copies are simulated,
    // on the GPU they are real copies into VRAM slots, from a session opened with that residency.
    // The expert cache's figures come as the same stats either way; `how` says which copies.
    let (spec, cache, how) = match session.cuda() {
        None => {
            let plan = DecodePlan {
                simulated_slots: Some(slots),
                ..DecodePlan::default()
            };
            let spec = decode(&session, Mode::Specter, &plan)?;
            let cache = spec.stats.offload.clone().unwrap_or_default();
            let how = format!(
                "copies simulated at {:.0} GB/s",
                DEFAULT_COPY_BANDWIDTH / 1e9
            );
            (spec, cache, how)
        }
        Some(_) => {
            drop(session);
            session_opts.offload = Some((slots, Policy::Lru));
            let offloaded = Session::open_with(&bundle_path, &session_opts)?;
            let spec = decode(&offloaded, Mode::Specter, &DecodePlan::default())?;
            let cache = offloaded
                .cuda()
                .map(|gpu| gpu.offload_stats())
                .transpose()?
                .flatten()
                .unwrap_or_default();
            let how = format!("real copies into VRAM slots, {}", cache.path);
            (spec, cache, how)
        }
    };
    let s = &spec.stats;
    say(&format!(
        "   speculative (depth {}): {} tokens, acceptance {:.1}% ({} of {} drafted), {:.2} accepted per verify pass, TPOT {:.2} ms",
        opts.depth,
        spec.tokens.len(),
        100.0 * s.acceptance_rate,
        s.accepted,
        s.drafted,
        s.mean_accepted_per_round,
        s.tpot_ms
    ));
    say(&format!(
        "   expert cache ({} of {} resident per layer, {}): {} hits, {} misses, {} prefetched by the draft ({} used), {:.2} MB moved",
        slots, info.num_experts, how, cache.hits, cache.misses, cache.prefetched, cache.prefetch_used, cache.bytes_copied as f64 / 1e6
    ));
    let lossless = spec.tokens == target.tokens;
    say(&format!(
        "5. lossless check: speculative tokens {} target-only tokens",
        if lossless { "equal" } else { "DIFFER FROM" }
    ));
    if !lossless {
        return Err(Error::Model(
            "speculative output differs from target-only output".into(),
        ));
    }
    Ok(DemoSummary {
        tokens: spec.tokens,
        lossless,
        acceptance_rate: s.acceptance_rate,
        hits: cache.hits,
        misses: cache.misses,
    })
}
