//! The offline depth sweep behind `specter-run profile` (and `bench`'s `auto` calibration): decode
//! a short greedy continuation at each candidate draft depth (0 is plain target decoding) on this
//! machine, in the residency the session was opened with, and keep the fastest as the starting
//! depth that automatic depth control then adjusts online. The profile it returns, and what
//! `generate` reads from one, is the runtime's [`specter::depth_profile`].
//!
//! On the GPU with offloaded experts the sweep can also measure plain decoding *without* the
//! draft, its VRAM given to the expert cache as extra slots ([`draft_slot_equivalent`]), and, with
//! the host path available, both again with part of the missing experts computed on host threads
//! ([`measure_with_host`]).

use specter::arch::ArchConfig;
use specter::backend::cuda::HostExpertsConfig;
use specter::decode::{GenerateOptions, GenerateOutput, Mode, Sampling};
use specter::depth_profile::{session_key, DepthProfile};
use specter::session::Session;
use specter::strategy::{decode_on_session, DecodePlan};
use specter::{Error, Result};
use specter_format::{Bundle, SectionKind};

/// How many FP16 expert slots per MoE layer the draft's INT4 experts take the VRAM of (the
/// draft sections' bytes over one expert's bytes times the MoE layers, rounded down).
pub fn draft_slot_equivalent(bundle: &Bundle) -> Result<usize> {
    let cfg = ArchConfig::from_config_json(bundle.hyperparameters_json())?;
    let info = cfg.model_info();
    let draft: u64 = (0..bundle.section_count())
        .filter(|&i| matches!(bundle.section_kind(i), SectionKind::Draft { .. }))
        .map(|i| bundle.section_bytes(i).len() as u64)
        .sum();
    let per_slot = (info.moe_layers.len() * info.expert_bytes) as u64;
    Ok(draft.checked_div(per_slot).unwrap_or(0) as usize)
}

/// Decodes `new_tokens` tokens after `prompt` as `sampling` says (the paper's protocol: greedy)
/// at every depth in `depths` (0: target-only), `repeats` times each, and returns the profile.
/// The session must hold the draft.
pub fn sweep(
    session: &Session,
    prompt: &[u32],
    new_tokens: usize,
    depths: &[usize],
    repeats: usize,
    sampling: Sampling,
) -> Result<DepthProfile> {
    if depths.is_empty() || repeats == 0 || new_tokens < 2 {
        return Err(Error::Request(
            "a depth sweep needs at least one depth, one repeat and two new tokens".into(),
        ));
    }
    let key = session_key(session)?;
    let mut tpot_ms = Vec::with_capacity(depths.len());
    let mut acceptance = Vec::with_capacity(depths.len());
    for &depth in depths {
        let opts = GenerateOptions {
            mode: if depth == 0 {
                Mode::Target
            } else {
                Mode::Specter
            },
            max_new_tokens: new_tokens,
            depth: depth.max(1),
            sampling,
            stop_at_eos: false,
        };
        let mut runs = Vec::with_capacity(repeats);
        let mut accepted = 0.0;
        for _ in 0..repeats {
            let out = timed_run(session, prompt, &opts)?;
            accepted = out.stats.acceptance_rate;
            runs.push(out.stats.tpot_ms);
        }
        runs.sort_by(f64::total_cmp);
        tpot_ms.push(runs[runs.len() / 2]);
        acceptance.push(accepted);
    }
    let best = (0..depths.len())
        .min_by(|&a, &b| tpot_ms[a].total_cmp(&tpot_ms[b]))
        .unwrap_or(0);
    Ok(DepthProfile {
        key,
        prompt_tokens: prompt.len(),
        new_tokens,
        depths: depths.to_vec(),
        tpot_ms,
        acceptance,
        best_depth: depths[best],
        plain: None,
        host: None,
    })
}

/// Median TPOT (ms) of `repeats` plain target-only decodes of `new_tokens` tokens after
/// `prompt` (as `sampling` says), each from the session's initial residency. For
/// [`DepthProfile::plain`], `session` is opened without the draft and with
/// [`draft_slot_equivalent`] more slots.
pub fn measure_plain(
    session: &Session,
    prompt: &[u32],
    new_tokens: usize,
    repeats: usize,
    sampling: Sampling,
) -> Result<f64> {
    if repeats == 0 || new_tokens < 2 {
        return Err(Error::Request(
            "measuring plain decoding needs at least one repeat and two new tokens".into(),
        ));
    }
    let opts = GenerateOptions {
        mode: Mode::Target,
        max_new_tokens: new_tokens,
        depth: 1,
        sampling,
        stop_at_eos: false,
    };
    let mut runs = (0..repeats)
        .map(|_| Ok(timed_run(session, prompt, &opts)?.stats.tpot_ms))
        .collect::<Result<Vec<f64>>>()?;
    runs.sort_by(f64::total_cmp);
    Ok(runs[runs.len() / 2])
}

/// Median TPOT (ms) of `repeats` decodes with the host path turned on in `session` (left on):
/// plain decoding when `depth` is `None`, else the draft at that depth (the session must hold
/// it).
pub fn measure_with_host(
    session: &Session,
    prompt: &[u32],
    new_tokens: usize,
    depth: Option<usize>,
    host: HostExpertsConfig,
    repeats: usize,
    sampling: Sampling,
) -> Result<f64> {
    let gpu = session.cuda().ok_or_else(|| {
        Error::Request("the host path computes offloaded experts: it needs --backend cuda".into())
    })?;
    gpu.set_host_experts(Some(host))?;
    match depth {
        None => measure_plain(session, prompt, new_tokens, repeats, sampling),
        Some(d) => Ok(sweep(session, prompt, new_tokens, &[d], repeats, sampling)?.best_tpot_ms()),
    }
}

/// One decode from the session's initial (empty) expert cache, observed as
/// [`decode_on_session`] decides (the draft-driven prefetcher when speculating over offloaded
/// experts on the GPU).
fn timed_run(session: &Session, prompt: &[u32], opts: &GenerateOptions) -> Result<GenerateOutput> {
    if let Some(gpu) = session.cuda() {
        gpu.reset_offload()?;
    }
    let decoded = decode_on_session(session, prompt, opts, &DecodePlan::default(), &mut |_| true)?;
    Ok(decoded.output)
}
