//! One generation request, start to finish: pick the backend, turn the requested residency into
//! expert slots, open the session, choose how the decode loop is observed (expert prefetch,
//! simulated offloading, automatic depth) and return a serializable report.
//!
//! [`generate`] is what `specter-run generate` (and a server) calls. [`decode_on_session`] is the
//! one place that maps a mode, a backend and a residency onto the decode loop's observers; `bench`,
//! `profile` and `demo`, which reuse open sessions, call it directly.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::arch::ArchConfig;
use crate::backend::cuda::{
    driver_library_present, nvrtc_library_present, CudaDevice, CudaOptions, HostPath, KERNELS,
};
use crate::decode::{self, AutoDepthReport, GenerateOptions, Mode, Sampling};
use crate::depth_profile::{Candidate, DepthProfile};
use crate::offload::{OffloadStats, Policy};
use crate::session::{BackendKind, Session, SessionOptions};
use crate::startup::since_start_ms;
pub use crate::strategy::{
    decode_on_session, AutoDepthStart, DecodePlan, Decoded, DEFAULT_COPY_BANDWIDTH,
};
use crate::verify_mode::VerifyMode;
use crate::{Error, Result};

/// Draft tokens per verify pass when the request names none (Specter mode).
pub const DEFAULT_DEPTH: usize = 8;

/// The backend a caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a usable GPU is found, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// The backend a request runs on, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ResolvedBackend {
    #[serde(serialize_with = "serialize_backend")]
    pub kind: BackendKind,
    pub reason: String,
}

impl ResolvedBackend {
    /// One line for the user, e.g. `backend: cpu (no CUDA driver: libcuda.so.1 not found)`.
    pub fn describe(&self) -> String {
        format!("backend: {} ({})", backend_name(self.kind), self.reason)
    }
}

/// `cpu` or `cuda`.
pub fn backend_name(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Cpu => "cpu",
        BackendKind::Cuda => "cuda",
    }
}

fn serialize_backend<S: serde::Serializer>(
    kind: &BackendKind,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(backend_name(*kind))
}

/// Resolves `choice`: a forced backend as asked (a missing GPU then fails when the session
/// opens, naming what is missing); `Auto` looks for a usable GPU (the driver library, device 0,
/// and NVRTC unless every kernel was embedded as PTX) and falls back to the CPU, saying why.
pub fn resolve_backend(choice: BackendChoice) -> ResolvedBackend {
    resolve_with(choice, usable_gpu)
}

/// [`resolve_backend`] with the GPU probe given (`Ok(description)` or `Err(why not)`).
fn resolve_with(
    choice: BackendChoice,
    probe: impl FnOnce() -> std::result::Result<String, String>,
) -> ResolvedBackend {
    let (kind, reason) = match choice {
        BackendChoice::Cpu => (BackendKind::Cpu, "--backend cpu".to_string()),
        BackendChoice::Cuda => (BackendKind::Cuda, "--backend cuda".to_string()),
        BackendChoice::Auto => match probe() {
            Ok(gpu) => (BackendKind::Cuda, gpu),
            Err(why) => (BackendKind::Cpu, why),
        },
    };
    ResolvedBackend { kind, reason }
}

/// The GPU `Auto` would use, described (`NVIDIA H200, driver 13.0`), or why there is none.
fn usable_gpu() -> std::result::Result<String, String> {
    if !driver_library_present() {
        return Err("no CUDA driver: libcuda.so.1 not found".into());
    }
    let device = CudaDevice::open(0).map_err(|e| format!("CUDA device 0 does not open: {e}"))?;
    if !nvrtc_library_present() && KERNELS.iter().any(|k| k.ptx.is_none()) {
        return Err(format!(
            "{} found, but NVRTC (libnvrtc.so) is missing and the kernels were built without PTX",
            device.name()
        ));
    }
    Ok(match CudaDevice::driver_version() {
        Ok((major, minor)) => format!("{}, driver {major}.{minor}", device.name()),
        Err(_) => device.name().to_string(),
    })
}

/// The prompt of a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Tokenized with the bundle's tokenizer.
    Text(String),
    Ids(Vec<u32>),
}

/// Routed experts kept per MoE layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Residency {
    /// Every expert resident.
    All,
    /// This many per layer: real copies into VRAM slots on CUDA, simulated copies on the CPU.
    Experts(usize),
    /// CUDA: as many per layer as fit this many GB of VRAM ([`slots_for_budget`]).
    VramBudgetGb(f64),
}

/// Everything one generation needs.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// The bundle written by `specter-pack convert`.
    pub bundle: PathBuf,
    pub prompt: Prompt,
    pub max_new_tokens: usize,
    pub mode: Mode,
    /// Draft tokens per verify pass (the most, with automatic depth). `None`: [`DEFAULT_DEPTH`],
    /// or SpecMoEOff's K in that mode.
    pub depth: Option<usize>,
    /// Choose each round's depth from measured cost per committed token (Specter mode).
    pub auto_depth: bool,
    /// With automatic depth: a `specter-run profile` of this bundle and machine to start from.
    pub profile: Option<PathBuf>,
    pub backend: BackendChoice,
    pub residency: Residency,
    /// CUDA: how expert slots are reused.
    pub policy: Policy,
    pub sampling: Sampling,
    /// Stop after the model's end-of-sequence token.
    pub stop_at_eos: bool,
    pub verify: VerifyMode,
    pub cuda: CudaOptions,
    /// Bytes/s: the CPU simulation's copy rate, and the GPU prefetch schedule's first estimate.
    pub copy_bandwidth: f64,
    /// CUDA with offloaded experts: finish registering the bundle's mapping for direct copies
    /// before the first token.
    pub wait_registration: bool,
}

impl GenerationRequest {
    /// Greedy Specter decoding of 64 tokens, every expert resident, the backend chosen
    /// automatically.
    pub fn new(bundle: impl Into<PathBuf>, prompt: Prompt) -> Self {
        GenerationRequest {
            bundle: bundle.into(),
            prompt,
            max_new_tokens: 64,
            mode: Mode::Specter,
            depth: None,
            auto_depth: false,
            profile: None,
            backend: BackendChoice::Auto,
            residency: Residency::All,
            policy: Policy::Lru,
            sampling: Sampling::greedy(),
            stop_at_eos: true,
            verify: VerifyMode::Manifest,
            cuda: CudaOptions::default(),
            copy_bandwidth: DEFAULT_COPY_BANDWIDTH,
            wait_registration: false,
        }
    }
}

/// The tokens committed so far, told to [`GenerationHooks::on_tokens`].
pub struct Committed<'a> {
    /// Every generated token so far (the prompt excluded).
    pub tokens: &'a [u32],
    session: &'a Session,
}

impl Committed<'_> {
    /// The text of [`Self::tokens`] (`None` without a tokenizer). A text ending in U+FFFD may be
    /// a character whose remaining bytes are still to come.
    pub fn text(&self) -> Option<String> {
        self.session.decode(self.tokens).ok()
    }
}

/// What a caller is told while a request runs.
#[derive(Default)]
pub struct GenerationHooks<'a> {
    /// One line each: the backend chosen and why, the residency, a profile's choice.
    pub on_note: Option<&'a mut dyn FnMut(&str)>,
    /// After every committed token; returning false stops generation after it.
    pub on_tokens: Option<&'a mut dyn FnMut(&Committed<'_>) -> bool>,
}

/// What a generation produced and measured.
#[derive(Clone, Debug, Serialize)]
pub struct GenerationReport {
    pub bundle: String,
    pub architecture: String,
    pub backend: &'static str,
    /// Why that backend: the GPU found, why none was usable, or the flag that forced it.
    pub backend_reason: String,
    pub gpu: Option<GpuReport>,
    /// This process's host memory when the report was made (`None` off Linux): the peak
    /// resident set includes the bundle's mapped pages as far as they were read.
    pub host_memory: Option<crate::host_memory::HostMemory>,
    pub auto_depth: Option<AutoDepthReport>,
    /// A profile's plain candidate (no draft, its memory as expert slots) that replaced speculation.
    pub auto_plain: Option<AutoPlain>,
    /// What a profile chose: `draft`, `plain`, `hybrid` or `specter-hybrid` (the last two with
    /// the host path).
    pub profile_choice: Option<&'static str>,
    pub mode: String,
    pub startup: StartupReport,
    pub depth: usize,
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    pub text: Option<String>,
    /// The caller's `on_tokens` ended generation early.
    pub stopped_by_caller: bool,
    pub stats: StatsReport,
}

#[derive(Clone, Debug, Serialize)]
pub struct AutoPlain {
    pub slots: usize,
    pub profiled_tpot_ms: f64,
}

/// Milliseconds since process start at each stage.
#[derive(Clone, Debug, Serialize)]
pub struct StartupReport {
    pub bundle_opened_ms: f64,
    pub device_ready_ms: Option<f64>,
    pub weights_resident_ms: f64,
    pub first_token_ms: Option<f64>,
}

/// The decode loop's figures, and the CPU simulation of expert copies when it ran.
#[derive(Clone, Debug, Serialize)]
pub struct StatsReport {
    #[serde(flatten)]
    pub decode: decode::GenerateStats,
    pub cache: Option<SimulatedCacheReport>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SimulatedCacheReport {
    pub resident_experts: Option<usize>,
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub hit_rate: f64,
    pub prefetched: u64,
    pub prefetched_used: u64,
    pub prefetched_wasted: u64,
    pub demand_loads: u64,
    pub bytes_moved: u64,
    pub simulated_copy_stall_s: f64,
    pub per_layer_hits: Vec<u64>,
    pub per_layer_misses: Vec<u64>,
}

/// The GPU's figures. Timing, graph and load records are kept as the backend reports them.
#[derive(Clone, Debug, Serialize)]
pub struct GpuReport {
    pub device: String,
    pub residency: String,
    pub vram_peak_bytes: u64,
    pub host_timing: serde_json::Value,
    pub graphs: serde_json::Value,
    pub load: serde_json::Value,
    pub offload: Option<GpuOffloadReport>,
}

/// Real expert copies into VRAM slots (and, with the hybrid path, experts computed on the host):
/// the cache's counters and the rates derived from them.
#[derive(Clone, Debug, Serialize)]
pub struct GpuOffloadReport {
    #[serde(flatten)]
    pub stats: OffloadStats,
    pub hit_rate: f64,
    pub copy_gbps: f64,
    pub prefetch_precision: f64,
    pub prefetch_recall: f64,
    /// Mean time of one draft step as the prefetch schedule measured it.
    pub draft_step_ms: Option<f64>,
}

/// The line that says what a profile chose over what.
fn profile_note(p: &DepthProfile, chosen: Candidate) -> String {
    let ms = |c: Candidate| {
        p.candidates()
            .iter()
            .find(|(k, _)| *k == c)
            .map_or("-".to_string(), |(_, t)| format!("{t:.2} ms"))
    };
    let others: Vec<String> = p
        .candidates()
        .iter()
        .filter(|(c, _)| *c != chosen)
        .map(|(c, t)| format!("{} {t:.2} ms", c.name()))
        .collect();
    let what = match chosen {
        Candidate::Draft => "the draft at automatic depth, copying every miss".to_string(),
        Candidate::Plain => format!(
            "plain decoding without the draft at {} slots per layer",
            p.plain.as_ref().map_or(0, |c| c.slots)
        ),
        Candidate::Hybrid => format!(
            "hybrid: plain decoding without the draft at {} slots per layer, part of the misses \
             on host threads",
            p.plain.as_ref().map_or(0, |c| c.slots)
        ),
        Candidate::SpecterHybrid => {
            "specter-hybrid: the draft at automatic depth, part of the misses on host threads"
                .to_string()
        }
    };
    format!(
        "profile: {what} ({}) beats {}",
        ms(chosen),
        others.join(", ")
    )
}

/// What `cuda` asks of the host path and the link that the CPU backend has no use for, one note
/// each. Not errors: the CPU backend already computes every expert on the host and copies
/// nothing, so these ask for nothing it does not do (and `--backend auto` may land there).
pub fn cpu_backend_notes(cuda: &crate::backend::cuda::CudaOptions) -> Vec<&'static str> {
    let mut notes = Vec::new();
    if cuda.host_experts.is_some() {
        notes.push("--host-experts: the CPU backend computes every expert on the host already");
    }
    if cuda.link_pace_bytes_per_s.is_some() {
        notes.push("--link-gbps: the CPU backend copies no experts, so there is nothing to pace");
    }
    notes
}

/// Runs `req`: the backend resolved, the session opened in the requested residency, the prompt
/// decoded. Bad requests fail with [`Error::Request`] naming the option at fault.
pub fn generate(req: &GenerationRequest, hooks: GenerationHooks<'_>) -> Result<GenerationReport> {
    let GenerationHooks {
        mut on_note,
        mut on_tokens,
    } = hooks;
    let mut note = |line: &str| {
        if let Some(f) = on_note.as_mut() {
            f(line)
        }
    };
    let mut mode = req.mode;
    if req.auto_depth && mode != Mode::Specter {
        return Err(Error::Request("--auto-depth needs --mode specter".into()));
    }
    if !(req.copy_bandwidth.is_finite() && req.copy_bandwidth > 0.0) {
        return Err(Error::Request(
            "--bandwidth-gbps must be a positive number".into(),
        ));
    }
    let profile = req.profile.as_deref().map(DepthProfile::load).transpose()?;
    let backend = resolve_backend(req.backend);
    if req.backend == BackendChoice::Auto {
        note(&backend.describe());
    }
    let on_cuda = backend.kind == BackendKind::Cuda;
    // A profile chooses among what it measured: the draft at automatic depth, plain decoding
    // without it (the draft's memory as expert slots, loading no draft) and, where it measured
    // them and the host path is on (`--host-experts auto`), both with the host path, which is
    // then kept or turned off as chosen. Only where experts are offloaded at all: an
    // all-resident run has no cache to give the draft's memory to.
    let with_host = req.cuda.host_experts.is_some();
    let chosen = match (&profile, req.residency) {
        (Some(p), Residency::Experts(_) | Residency::VramBudgetGb(_)) if on_cuda => Some((
            p.choice_with(with_host && p.host.is_some()),
            with_host && p.host.is_some(),
        )),
        _ => None,
    };
    let plain = match (&profile, chosen) {
        (Some(p), Some((c, _))) if !c.draft() => p.plain.clone(),
        _ => None,
    };
    if plain.is_some() {
        mode = Mode::Target;
    }
    let depth = req.depth.unwrap_or(if mode == Mode::SpecMoeOff {
        decode::SPECMOEOFF_DEPTH
    } else {
        DEFAULT_DEPTH
    });
    if depth == 0 {
        return Err(Error::Request("--depth must be at least 1".into()));
    }
    let mut session_opts = SessionOptions::new(backend.kind);
    session_opts.with_draft = mode != Mode::Target;
    session_opts.verify = req.verify;
    session_opts.cuda = req.cuda.clone();
    if let Some((c, true)) = chosen {
        session_opts.cuda.host_experts = req.cuda.host_experts.filter(|_| c.host());
    }
    let mut simulated_slots = None;
    if on_cuda {
        let slots = match req.residency {
            Residency::All => None,
            Residency::Experts(n) => Some(n),
            Residency::VramBudgetGb(gb) => {
                Some(slots_for_budget(&req.bundle, gb, session_opts.with_draft)?)
            }
        };
        session_opts.offload = slots.map(|n| (n, req.policy));
        if let (Some(p), Some((c, measured_host))) = (&profile, chosen) {
            if c != Candidate::Draft || measured_host {
                note(&profile_note(p, c));
            }
        }
        if let Some(p) = &plain {
            session_opts.offload = Some((p.slots, Policy::Lru));
        }
    } else {
        if matches!(req.residency, Residency::VramBudgetGb(_))
            || req.cuda.host_path == HostPath::PinnedStaging
        {
            return Err(Error::Request(
                "--vram-budget and --pinned-staging need --backend cuda".into(),
            ));
        }
        if let Residency::Experts(n) = req.residency {
            simulated_slots = Some(n);
        }
        for line in cpu_backend_notes(&req.cuda) {
            note(line);
        }
    }
    let session = Session::open_with(&req.bundle, &session_opts)?;
    if let Some(gpu) = session.cuda() {
        if req.wait_registration {
            gpu.wait_host_registration()?;
        }
        note(&format!("cuda: {}", gpu.residency_description()?));
    }
    let prompt = match &req.prompt {
        Prompt::Text(text) => session.encode(text)?,
        Prompt::Ids(ids) => ids.clone(),
    };
    let opts = GenerateOptions {
        mode,
        max_new_tokens: req.max_new_tokens,
        depth,
        sampling: req.sampling,
        stop_at_eos: req.stop_at_eos,
    };
    // The profile's measured depths seed automatic control (once it is known to fit).
    let auto_depth = match (&profile, &req.profile) {
        (Some(p), Some(path)) if plain.is_some() => {
            p.check_machine(&session, path)?;
            None
        }
        // With the host path chosen the residency differs from the sweep's by design.
        (Some(p), Some(path))
            if req.auto_depth && matches!(chosen, Some((Candidate::SpecterHybrid, _))) =>
        {
            p.check_machine(&session, path)?;
            Some(AutoDepthStart {
                start: p.best_depth.min(depth),
                seed: p.seconds_per_token(),
            })
        }
        (Some(p), Some(path)) if req.auto_depth => Some(AutoDepthStart {
            start: p.start_depth_for(&session, path)?.min(depth),
            seed: p.seconds_per_token(),
        }),
        _ if req.auto_depth && plain.is_none() => Some(AutoDepthStart {
            start: depth,
            seed: Vec::new(),
        }),
        _ => None,
    };
    let plan = DecodePlan {
        auto_depth,
        simulated_slots,
        copy_bandwidth: req.copy_bandwidth,
    };

    let mut committed = Vec::new();
    let mut first_token_ms = None;
    let mut stopped_by_caller = false;
    let decoded = decode_on_session(&session, &prompt, &opts, &plan, &mut |token| {
        first_token_ms.get_or_insert_with(since_start_ms);
        committed.push(token);
        let keep_going = match on_tokens.as_mut() {
            Some(f) => f(&Committed {
                tokens: &committed,
                session: &session,
            }),
            None => true,
        };
        stopped_by_caller |= !keep_going;
        keep_going
    })?;

    let text = if session.has_tokenizer() {
        Some(session.decode(&decoded.output.tokens)?)
    } else {
        None
    };
    let s = &decoded.output.stats;
    let cache = s.offload.as_ref().map(|o| SimulatedCacheReport {
        resident_experts: simulated_slots,
        lookups: o.lookups,
        hits: o.hits,
        misses: o.misses,
        hit_rate: if o.lookups > 0 {
            o.hits as f64 / o.lookups as f64
        } else {
            0.0
        },
        prefetched: o.prefetched,
        prefetched_used: o.prefetch_used,
        prefetched_wasted: o.prefetch_wasted,
        demand_loads: o.misses,
        bytes_moved: o.bytes_copied,
        simulated_copy_stall_s: o.stall_s,
        per_layer_hits: o.layer_hits.clone(),
        per_layer_misses: o.layer_misses.clone(),
    });
    let stats = StatsReport {
        decode: s.clone(),
        cache,
    };
    Ok(GenerationReport {
        bundle: req.bundle.display().to_string(),
        architecture: session.config.model_type.as_str().to_string(),
        backend: backend_name(backend.kind),
        backend_reason: backend.reason,
        gpu: gpu_report(&session, decoded.draft_step_ms)?,
        host_memory: crate::host_memory::HostMemory::now(),
        auto_depth: decoded.auto_depth,
        auto_plain: plain.map(|p| AutoPlain {
            slots: p.slots,
            profiled_tpot_ms: p.tpot_ms,
        }),
        profile_choice: chosen.map(|(c, _)| c.name()),
        mode: format!("{:?}", opts.mode).to_lowercase(),
        startup: StartupReport {
            bundle_opened_ms: session.startup.bundle_opened_ms,
            device_ready_ms: session.startup.device_ready_ms,
            weights_resident_ms: session.startup.weights_resident_ms,
            first_token_ms,
        },
        depth,
        prompt_tokens: prompt,
        tokens: decoded.output.tokens,
        text,
        stopped_by_caller,
        stats,
    })
}

fn gpu_report(session: &Session, draft_step_ms: Option<f64>) -> Result<Option<GpuReport>> {
    let Some(g) = session.cuda() else {
        return Ok(None);
    };
    let value = |v: std::result::Result<serde_json::Value, serde_json::Error>| {
        v.map_err(|e| Error::Backend(format!("cannot record the GPU's figures: {e}")))
    };
    let offload = g.offload_stats()?.map(|o| GpuOffloadReport {
        hit_rate: o.hit_rate(),
        copy_gbps: o.copy_bandwidth() / 1e9,
        prefetch_precision: o.prefetch_precision(),
        prefetch_recall: o.prefetch_recall(),
        draft_step_ms,
        stats: o,
    });
    Ok(Some(GpuReport {
        device: g.device().name().to_string(),
        residency: g.residency_description()?,
        vram_peak_bytes: g.vram_peak_bytes()?,
        host_timing: value(serde_json::to_value(g.host_timing()?))?,
        graphs: value(serde_json::to_value(g.step_graph_stats()?))?,
        load: value(serde_json::to_value(g.load_report()?))?,
        offload,
    }))
}

/// Expert slots per MoE layer that fit `gb` of VRAM beside the non-expert weights (and the draft
/// when loaded), keeping 1 GiB for activations and the KV cache.
pub fn slots_for_budget(path: &Path, gb: f64, with_draft: bool) -> Result<usize> {
    use specter_format::SectionKind;
    if !(gb.is_finite() && gb > 0.0) {
        return Err(Error::Request(
            "--vram-budget must be a positive number of GB".into(),
        ));
    }
    let bundle = specter_format::Bundle::open(path)?;
    let cfg = ArchConfig::from_config_json(bundle.hyperparameters_json())?;
    let mut fixed: u64 = 1 << 30;
    for i in 0..bundle.section_count() {
        match bundle.section_kind(i) {
            SectionKind::Shared => fixed += bundle.section_bytes(i).len() as u64,
            SectionKind::Draft { .. } if with_draft => {
                fixed += bundle.section_bytes(i).len() as u64
            }
            _ => {}
        }
    }
    let info = cfg.model_info();
    // A slot holds one expert as the bundle stores the target's: FP16 matrices, or a quantized
    // expert's blob (codes and scales) whole.
    let expert_bytes = match bundle.manifest().precision.target_bits.to_native() {
        16 => info.expert_bytes,
        _ => {
            let layer = info.moe_layers.first().copied().unwrap_or(0) as u32;
            bundle
                .expert_blob(layer, 0)
                .map_err(|e| Error::Model(format!("{}: {e}", path.display())))?
                .len()
        }
    };
    let per_slot = (info.moe_layers.len() * expert_bytes) as u64;
    let budget = (gb * 1e9) as u64;
    if budget < fixed + per_slot {
        return Err(Error::Request(format!(
            "--vram-budget {gb} GB is too small: the non-expert weights{} and working memory need {:.2} GB, plus {:.2} GB per resident expert per layer",
            if with_draft { ", the INT4 draft" } else { "" },
            fixed as f64 / 1e9,
            per_slot as f64 / 1e9
        )));
    }
    Ok((((budget - fixed) / per_slot) as usize).min(info.num_experts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_note_names_the_choice_and_what_it_beat() {
        let mut p = crate::depth_profile::sample_profile(vec![0, 4], vec![40.0, 30.0], Some(31.0));
        assert_eq!(
            profile_note(&p, p.choice()),
            "profile: the draft at automatic depth, copying every miss (30.00 ms) beats plain \
             31.00 ms"
        );
        p.host = Some(crate::depth_profile::HostCandidates {
            threads: 8,
            plain_tpot_ms: Some(25.0),
            depth: 4,
            draft_tpot_ms: Some(27.0),
        });
        assert_eq!(p.choice(), Candidate::Hybrid);
        assert_eq!(
            profile_note(&p, p.choice()),
            "profile: hybrid: plain decoding without the draft at 32 slots per layer, part of the \
             misses on host threads (25.00 ms) beats draft 30.00 ms, plain 31.00 ms, \
             specter-hybrid 27.00 ms"
        );
    }

    #[test]
    fn auto_falls_back_to_the_cpu_and_says_why() {
        let resolved = resolve_with(BackendChoice::Auto, || {
            Err("no CUDA driver: libcuda.so.1 not found".into())
        });
        assert_eq!(resolved.kind, BackendKind::Cpu);
        assert_eq!(
            resolved.describe(),
            "backend: cpu (no CUDA driver: libcuda.so.1 not found)"
        );
        let resolved = resolve_with(BackendChoice::Auto, || Ok("GPU X, driver 13.0".into()));
        assert_eq!(resolved.kind, BackendKind::Cuda);
        assert_eq!(resolved.describe(), "backend: cuda (GPU X, driver 13.0)");
    }

    #[test]
    fn a_forced_backend_does_not_probe() {
        for (choice, kind) in [
            (BackendChoice::Cpu, BackendKind::Cpu),
            (BackendChoice::Cuda, BackendKind::Cuda),
        ] {
            let resolved = resolve_with(choice, || panic!("probed a forced backend"));
            assert_eq!(resolved.kind, kind);
        }
    }

    #[test]
    fn without_a_driver_auto_is_the_cpu() {
        if driver_library_present() {
            eprintln!("skipped: this machine has a CUDA driver");
            return;
        }
        let resolved = resolve_backend(BackendChoice::Auto);
        assert_eq!(resolved.kind, BackendKind::Cpu);
        assert!(resolved.reason.contains("libcuda.so.1"), "{resolved:?}");
    }

    #[test]
    fn the_resolved_backend_serializes_by_name() {
        let resolved = resolve_with(BackendChoice::Cpu, || unreachable!());
        assert_eq!(
            serde_json::to_value(&resolved).unwrap(),
            serde_json::json!({"kind": "cpu", "reason": "--backend cpu"})
        );
    }
}
