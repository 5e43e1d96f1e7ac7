//! `specter-run bench`: the paper's protocol on one bundle, every mode measured in one run on the
//! same weights and prompts. Every greedy run must give all-resident target-only tokens (the GPU's
//! where the model fits, else the CPU reference's: reference.rs); one that does not is an error.
//!
//! Protocol (docs/BENCHMARKS.md and the paper's): single request, greedy, 16-token prompts, 128
//! new tokens; TPOT = (last commit - first commit) / (N - 1) and TTFT per run; the expert cache
//! is emptied and its counters cleared before every input, outside the timed region. Modes:
//!
//! - `resident`: target-only, every expert in VRAM (on the CPU backend: the CPU reference);
//! - `lru`, `ondemand`: target-only, plain autoregressive, with the case's matched number of
//!   resident experts per layer (the draft's memory given to the cache, as the paper's baselines);
//! - `specter`: the INT4 draft proposes at the case's depth, draft-driven prefetch;
//! - `auto`: the fastest of `specter` at automatic depth, plain `lru` without the draft and, where
//!   the host path may run, `hybrid` and `specter-hybrid`, by a calibration on the first prompt
//!   (auto.rs);
//! - `specmoeoff`: the SpecMoEOff-style baseline: a draft with its own KV cache at K = 3,
//!   route-frequency Top-M prefetch after draft steps 0 and 1 ([`FrequencyPrefetcher`]), with the
//!   case's SpecMoEOff residency (12 of 64 for ds_high, 2 of 64 for ds_low). Its draft is this
//!   bundle's INT4 experts with a KV of their own, not a separate smaller model (see
//!   [`Mode::SpecMoeOff`]): if anything that makes its acceptance better than the original's.

mod auto;
pub mod prefill;
mod reference;

use std::time::Instant;

use serde::Serialize;

pub use auto::{calibrate_auto, AutoChoice};

use specter::backend::cuda::CudaOptions;
use specter::decode::{GenerateOptions, GenerateOutput, Mode, Sampling, SPECMOEOFF_DEPTH};
use specter::depth_profile::DepthProfile;
use specter::offload::{PathTelemetry, Policy};
use specter::session::{BackendKind, Session, SessionOptions};
use specter::strategy::{decode_on_session, AutoDepthStart, DecodePlan};
use specter::{Error, Result};

/// A protocol case: draft depth and experts per layer in VRAM.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BenchCase {
    pub name: &'static str,
    pub depth: usize,
    /// Resident experts per layer for the modes that hold the draft.
    pub resident: usize,
    /// Resident experts per layer for target-only baselines at matched memory.
    pub matched: usize,
    /// Resident experts per layer for the SpecMoEOff baseline (its separate draft and that
    /// draft's KV take memory the experts then do not get).
    pub specmoeoff: usize,
}

/// The paper's cases (protocol.md). Matched counts for Qwen and Phi give the baselines the
/// draft's memory the same way DeepSeek's 16/32 and 4/20 do (a quarter of all experts more).
/// SpecMoEOff's counts are the paper's for DeepSeek (12 and 2 of 64: a sixteenth and a
/// thirty-second of all experts fewer than Specter's 16 and 4); Qwen and Phi take the same
/// shares of their experts off, rounded (60: 4 and 2; 16: 1 and 1), keeping at least one slot.
pub const CASES: &[BenchCase] = &[
    BenchCase {
        name: "ds_high",
        depth: 16,
        resident: 16,
        matched: 32,
        specmoeoff: 12,
    },
    BenchCase {
        name: "ds_low",
        depth: 16,
        resident: 4,
        matched: 20,
        specmoeoff: 2,
    },
    BenchCase {
        name: "qwen_high",
        depth: 8,
        resident: 15,
        matched: 30,
        specmoeoff: 11,
    },
    BenchCase {
        name: "qwen_low",
        depth: 8,
        resident: 8,
        matched: 23,
        specmoeoff: 6,
    },
    BenchCase {
        name: "phi_high",
        depth: 16,
        resident: 2,
        matched: 6,
        specmoeoff: 1,
    },
    BenchCase {
        name: "phi_low",
        depth: 16,
        resident: 1,
        matched: 5,
        specmoeoff: 1,
    },
];

pub fn case(name: &str) -> Result<BenchCase> {
    CASES
        .iter()
        .copied()
        .find(|c| c.name == name)
        .ok_or_else(|| {
            let known: Vec<&str> = CASES.iter().map(|c| c.name).collect();
            Error::Request(format!(
                "unknown case {name:?} (known: {}, or custom with --depth and --resident-experts)",
                known.join(", ")
            ))
        })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchMode {
    Resident,
    Lru,
    Ondemand,
    Specter,
    Auto,
    SpecMoeOff,
    /// lru's residency with the host path: part of the misses computed on host threads.
    Hybrid,
    /// specter's residency and depth with the host path.
    SpecterHybrid,
}

impl BenchMode {
    pub fn parse(name: &str) -> Result<BenchMode> {
        Ok(match name {
            "resident" => BenchMode::Resident,
            "lru" => BenchMode::Lru,
            "ondemand" => BenchMode::Ondemand,
            "specter" => BenchMode::Specter,
            "auto" => BenchMode::Auto,
            "specmoeoff" => BenchMode::SpecMoeOff,
            "hybrid" => BenchMode::Hybrid,
            "specter-hybrid" => BenchMode::SpecterHybrid,
            other => {
                return Err(Error::Request(format!(
                    "unknown mode {other:?} (resident, lru, ondemand, specter, auto, specmoeoff, hybrid, specter-hybrid)"
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            BenchMode::Resident => "resident",
            BenchMode::Lru => "lru",
            BenchMode::Ondemand => "ondemand",
            BenchMode::Specter => "specter",
            BenchMode::Auto => "auto",
            BenchMode::SpecMoeOff => "specmoeoff",
            BenchMode::Hybrid => "hybrid",
            BenchMode::SpecterHybrid => "specter-hybrid",
        }
    }

    /// Whether this mode computes part of the missing experts on the host.
    fn hybrid(self) -> bool {
        matches!(self, BenchMode::Hybrid | BenchMode::SpecterHybrid)
    }

    /// The draft depth this mode runs at in `case`: the case's, SpecMoEOff's fixed K = 3, or
    /// none for target-only modes.
    pub fn depth(self, case: &BenchCase) -> Option<usize> {
        match self {
            BenchMode::Resident | BenchMode::Lru | BenchMode::Ondemand | BenchMode::Hybrid => None,
            BenchMode::Specter | BenchMode::Auto | BenchMode::SpecterHybrid => Some(case.depth),
            BenchMode::SpecMoeOff => Some(SPECMOEOFF_DEPTH),
        }
    }

    fn target_only(self) -> bool {
        matches!(
            self,
            BenchMode::Resident | BenchMode::Lru | BenchMode::Ondemand | BenchMode::Hybrid
        )
    }
}

/// One generation.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRun {
    pub mode: &'static str,
    pub prompt: usize,
    pub repeat: usize,
    pub tpot_ms: f64,
    pub ttft_ms: f64,
    pub acceptance_rate: f64,
    pub hit_rate: Option<f64>,
    pub copy_gbps: Option<f64>,
    pub prefetch_precision: Option<f64>,
    pub prefetch_recall: Option<f64>,
    /// Expert bytes copied over PCIe per token after the first (the TPOT window), GB.
    pub decode_gb_per_token: Option<f64>,
    /// Those bytes at the run's measured copy bandwidth, ms: the copy floor TPOT cannot go below
    /// unless copies overlap compute.
    pub floor_ms: Option<f64>,
    /// Share of the prefetch copies' time that ran before the verify pass they served started
    /// (hidden behind drafting).
    pub prefetch_hidden_share: Option<f64>,
    /// Hit rate of each MoE layer over the run.
    pub layer_hit_rates: Vec<f64>,
    /// The missing experts' two paths over the whole run: copied over the link, computed on the
    /// host (offloaded CUDA runs).
    pub paths: Option<PathTelemetry>,
    /// Their stalls over the whole run per generated token, ms.
    pub link_stall_ms_per_token: Option<f64>,
    pub host_stall_ms_per_token: Option<f64>,
    /// Equal to the reference (target-only) tokens for this prompt.
    pub agrees: bool,
    /// See [`repeated_4gram_share`].
    pub repeated_4gram_share: f64,
}

/// Per mode, over all its runs.
#[derive(Clone, Debug, Serialize)]
pub struct ModeSummary {
    pub mode: &'static str,
    pub resident_experts: Option<usize>,
    pub depth: Option<usize>,
    pub mean_tpot_ms: f64,
    pub median_tpot_ms: f64,
    pub mean_ttft_ms: f64,
    /// Mean draft acceptance over the runs (0 for target-only modes).
    pub mean_acceptance: f64,
    /// Mean prefetch precision and recall over the runs (offloaded CUDA runs only).
    pub mean_prefetch_precision: Option<f64>,
    pub mean_prefetch_recall: Option<f64>,
    /// Means over the runs of the [`BenchRun`] fields of the same names.
    pub mean_copy_gbps: Option<f64>,
    pub mean_decode_gb_per_token: Option<f64>,
    pub mean_floor_ms: Option<f64>,
    /// Mean TPOT over mean floor.
    pub tpot_over_floor: Option<f64>,
    pub mean_prefetch_hidden_share: Option<f64>,
    pub mean_link_stall_ms_per_token: Option<f64>,
    pub mean_host_stall_ms_per_token: Option<f64>,
    /// Per MoE layer, the mean hit rate over the runs.
    pub layer_hit_rates: Vec<f64>,
    pub peak_vram_bytes: Option<u64>,
    pub agreement: f64,
    /// Mean over the runs of [`repeated_4gram_share`].
    pub mean_repeated_4gram_share: f64,
    /// `auto` with offloaded experts: what its calibration chose (see [`calibrate_auto`]) ...
    pub auto_choice: Option<String>,
    /// ... and what it measured: every depth with the draft, and plain decoding without it.
    pub auto_calibration: Option<DepthProfile>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub bundle: String,
    pub backend: &'static str,
    pub device: String,
    pub case: BenchCase,
    pub prompts: usize,
    pub new_tokens: usize,
    pub repeats: usize,
    /// The sampling temperature (0: greedy) and seed of every run.
    pub temperature: f32,
    pub seed: u64,
    pub modes: Vec<ModeSummary>,
    /// The paper's headline figure: SpecMoEOff's mean TPOT over Specter's (and over auto depth's),
    /// when both ran.
    pub specter_over_specmoeoff: Option<f64>,
    pub auto_over_specmoeoff: Option<f64>,
    pub runs: Vec<BenchRun>,
}

pub struct BenchOptions {
    pub backend: BackendKind,
    pub case: BenchCase,
    pub modes: Vec<BenchMode>,
    pub prompts: Vec<Vec<u32>>,
    pub new_tokens: usize,
    pub repeats: usize,
    /// How the CUDA backend runs (recorded passes, load threads and I/O, copy path).
    pub cuda: CudaOptions,
    /// Greedy (the paper's protocol) or sampled: speculative rejection sampling keeps the
    /// target's distribution, so modes then agree in distribution, not token by token.
    pub sampling: Sampling,
    /// `auto` may choose the host path (measure `hybrid` and `specter-hybrid` too); false when
    /// the user turned the host path off.
    pub auto_host: bool,
}

/// The share of an output's 4-grams that repeat an earlier one: looping output inflates expert
/// cache hit rates, so every run reports it.
pub fn repeated_4gram_share(tokens: &[u32]) -> f64 {
    if tokens.len() < 4 {
        return 0.0;
    }
    let mut seen = std::collections::HashSet::new();
    let grams = tokens.windows(4);
    let total = grams.len();
    let repeats = grams.filter(|g| !seen.insert(*g)).count();
    repeats as f64 / total as f64
}

/// `count` prompts of `len` token ids drawn from the vocabulary with a fixed seed.
pub fn synthetic_prompts(vocab: usize, count: usize, len: usize, seed: u64) -> Vec<Vec<u32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            (0..len)
                .map(|_| rng.random_range(1..vocab as u32))
                .collect()
        })
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// Runs every mode over every prompt and repeat; `progress(done, total)` after each run.
pub fn run(
    path: &std::path::Path,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BenchReport> {
    if opts.modes.is_empty() || opts.prompts.is_empty() || opts.repeats == 0 || opts.new_tokens < 2
    {
        return Err(Error::Request(
            "bench needs at least one mode, one prompt, one repeat and two new tokens".into(),
        ));
    }
    // All-resident target-only decoding, where it is one of the modes, runs first and is the
    // reference every greedy run must match.
    let reference_mode = opts
        .modes
        .iter()
        .copied()
        .find(|&m| m == BenchMode::Resident)
        .or_else(|| opts.modes.iter().copied().find(|m| m.target_only()))
        .ok_or_else(|| {
        Error::Request(
            "include a target-only mode (resident, lru or ondemand): every mode's tokens are checked against it"
                .into(),
        )
    })?;
    if opts.backend == BackendKind::Cpu {
        if let Some(m) = opts
            .modes
            .iter()
            .find(|m| m.hybrid() || matches!(m, BenchMode::Lru | BenchMode::Ondemand))
        {
            return Err(Error::Request(format!(
                "mode {} copies experts into VRAM and needs --backend cuda",
                m.name()
            )));
        }
    }
    // The reference runs first so every other mode can be checked as it goes.
    let mut order = vec![reference_mode];
    order.extend(opts.modes.iter().copied().filter(|&m| m != reference_mode));
    let total = order.len() * opts.prompts.len() * opts.repeats;
    let mut done = 0;
    // Greedy runs must give all-resident target-only tokens; without that mode they are
    // computed first, untimed (sampled runs agree in distribution, not token by token).
    let greedy = opts.sampling.is_greedy();
    let (mut reference, reference_source) = match greedy && reference_mode != BenchMode::Resident {
        true => {
            let r = reference::compute(path, opts)?;
            (r.tokens, r.source)
        }
        false => (Vec::new(), "target-only, every expert resident".to_string()),
    };
    let mut runs = Vec::new();
    let mut summaries = Vec::new();
    let mut device = String::new();
    for mode in order {
        let mut session_opts = SessionOptions::new(opts.backend);
        session_opts.with_draft = !mode.target_only();
        session_opts.cuda = opts.cuda.clone();
        // Only the hybrid modes take the host path (with `--host-threads`, else every core);
        // `auto` turns it on if its calibration chooses it.
        session_opts.cuda.host_experts = mode.hybrid().then(|| auto::host_threads(&opts.cuda));
        let mut resident = match (mode, opts.backend) {
            (_, BackendKind::Cpu) | (BenchMode::Resident, _) => None,
            (BenchMode::Lru | BenchMode::Hybrid, _) => Some((opts.case.matched, Policy::Lru)),
            (BenchMode::Ondemand, _) => Some((opts.case.matched, Policy::OnDemand)),
            (BenchMode::Specter | BenchMode::Auto | BenchMode::SpecterHybrid, _) => {
                Some((opts.case.resident, Policy::Lru))
            }
            (BenchMode::SpecMoeOff, _) => Some((opts.case.specmoeoff, Policy::Lru)),
        };
        session_opts.offload = resident;
        let mut gen = GenerateOptions {
            mode: match mode {
                BenchMode::Resident | BenchMode::Lru | BenchMode::Ondemand | BenchMode::Hybrid => {
                    Mode::Target
                }
                BenchMode::Specter | BenchMode::Auto | BenchMode::SpecterHybrid => Mode::Specter,
                BenchMode::SpecMoeOff => Mode::SpecMoeOff,
            },
            max_new_tokens: opts.new_tokens,
            depth: mode.depth(&opts.case).unwrap_or(1),
            sampling: opts.sampling,
            stop_at_eos: false,
        };
        // Automatic depth starts from the case's depth, or from what its calibration measured.
        let mut auto_start = (mode == BenchMode::Auto).then(|| AutoDepthStart {
            start: gen.depth,
            seed: Vec::new(),
        });
        let mut auto_choice = None;
        let mut auto_calibration = None;
        let session = if mode == BenchMode::Auto
            && opts.backend == BackendKind::Cuda
            && opts.case.resident < opts.case.matched
        {
            let (session, choice, profile) = calibrate_auto(path, opts, &session_opts)?;
            auto_choice = Some(choice.describe());
            auto_calibration = Some(profile);
            match choice {
                AutoChoice::Plain { slots, .. } => {
                    resident = Some((slots, Policy::Lru));
                    gen.mode = Mode::Target;
                    auto_start = None;
                }
                AutoChoice::Draft { profile, .. } => {
                    auto_start = Some(AutoDepthStart {
                        start: gen.depth,
                        seed: profile,
                    })
                }
            }
            session
        } else {
            auto::open_settled(path, &session_opts)?
        };
        if let Some(g) = session.cuda() {
            device = g.device().name().to_string();
            g.reset_vram_peak()?;
        }
        let mut tpots = Vec::new();
        let mut ttfts = Vec::new();
        let mut acceptances = Vec::new();
        let mut agree = 0usize;
        let first_run = runs.len();
        for (p, prompt) in opts.prompts.iter().enumerate() {
            for repeat in 0..opts.repeats {
                if let Some(g) = session.cuda() {
                    // The initial (empty) residency and zeroed counters, outside the timed region.
                    g.reset_offload()?;
                }
                let (out, bytes_at_first) = run_one(&session, prompt, &gen, auto_start.as_ref())?;
                if mode == reference_mode && repeat == 0 && reference.len() == p {
                    reference.push(out.tokens.clone());
                }
                if greedy {
                    let want = reference.get(p).map_or(&[][..], |r| &r[..]);
                    if let Some(e) =
                        reference::mismatch(mode, p, repeat, &out.tokens, want, &reference_source)
                    {
                        return Err(e);
                    }
                }
                let agrees = reference.get(p) == Some(&out.tokens);
                agree += usize::from(agrees);
                let stats = session
                    .cuda()
                    .map(|g| g.offload_stats())
                    .transpose()?
                    .flatten();
                let decode_tokens = out.tokens.len().saturating_sub(1).max(1) as f64;
                let decode_bytes = stats
                    .as_ref()
                    .zip(bytes_at_first)
                    .map(|(s, first)| s.bytes_copied.saturating_sub(first) as f64 / decode_tokens);
                let copy_rate = stats.as_ref().map(|s| s.copy_bandwidth());
                let tokens = out.tokens.len().max(1) as f64;
                let paths = stats.as_ref().map(|s| s.paths());
                runs.push(BenchRun {
                    mode: mode.name(),
                    prompt: p,
                    repeat,
                    tpot_ms: out.stats.tpot_ms,
                    ttft_ms: out.stats.ttft_ms,
                    acceptance_rate: out.stats.acceptance_rate,
                    hit_rate: stats.as_ref().map(|s| s.hit_rate()),
                    copy_gbps: copy_rate.map(|b| b / 1e9),
                    prefetch_precision: stats.as_ref().map(|s| s.prefetch_precision()),
                    prefetch_recall: stats.as_ref().map(|s| s.prefetch_recall()),
                    decode_gb_per_token: decode_bytes.map(|b| b / 1e9),
                    floor_ms: decode_bytes.zip(copy_rate).map(|(b, rate)| {
                        if rate > 0.0 {
                            b / rate * 1e3
                        } else {
                            0.0
                        }
                    }),
                    prefetch_hidden_share: stats
                        .as_ref()
                        .filter(|s| s.prefetch_copy_seconds > 0.0)
                        .map(|s| s.prefetch_hidden_seconds / s.prefetch_copy_seconds),
                    layer_hit_rates: stats
                        .as_ref()
                        .map(|s| s.layer_hit_rates())
                        .unwrap_or_default(),
                    paths,
                    link_stall_ms_per_token: paths.map(|p| p.link.stall_seconds * 1e3 / tokens),
                    host_stall_ms_per_token: paths.map(|p| p.host.stall_seconds * 1e3 / tokens),
                    agrees,
                    repeated_4gram_share: repeated_4gram_share(&out.tokens),
                });
                tpots.push(out.stats.tpot_ms);
                ttfts.push(out.stats.ttft_ms);
                acceptances.push(out.stats.acceptance_rate);
                done += 1;
                progress(done, total);
            }
        }
        let mine = &runs[first_run..];
        let mean_of = |f: fn(&BenchRun) -> Option<f64>| {
            let v: Vec<f64> = mine.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| mean(&v))
        };
        let mean_floor = mean_of(|r| r.floor_ms);
        let layers = mine
            .iter()
            .map(|r| r.layer_hit_rates.len())
            .max()
            .unwrap_or(0);
        summaries.push(ModeSummary {
            mode: mode.name(),
            resident_experts: resident.map(|(n, _)| n),
            depth: if gen.mode == Mode::Target {
                None
            } else {
                mode.depth(&opts.case)
            },
            mean_tpot_ms: mean(&tpots),
            median_tpot_ms: median(&tpots),
            mean_ttft_ms: mean(&ttfts),
            mean_acceptance: mean(&acceptances),
            mean_prefetch_precision: mean_of(|r| r.prefetch_precision),
            mean_prefetch_recall: mean_of(|r| r.prefetch_recall),
            mean_copy_gbps: mean_of(|r| r.copy_gbps),
            mean_decode_gb_per_token: mean_of(|r| r.decode_gb_per_token),
            mean_floor_ms: mean_floor,
            tpot_over_floor: mean_floor.filter(|&f| f > 0.0).map(|f| mean(&tpots) / f),
            mean_prefetch_hidden_share: mean_of(|r| r.prefetch_hidden_share),
            mean_link_stall_ms_per_token: mean_of(|r| r.link_stall_ms_per_token),
            mean_host_stall_ms_per_token: mean_of(|r| r.host_stall_ms_per_token),
            layer_hit_rates: (0..layers)
                .map(|l| {
                    let v: Vec<f64> = mine
                        .iter()
                        .filter_map(|r| r.layer_hit_rates.get(l).copied())
                        .collect();
                    mean(&v)
                })
                .collect(),
            peak_vram_bytes: session.cuda().map(|g| g.vram_peak_bytes()).transpose()?,
            agreement: agree as f64 / tpots.len().max(1) as f64,
            mean_repeated_4gram_share: mean(
                &mine
                    .iter()
                    .map(|r| r.repeated_4gram_share)
                    .collect::<Vec<_>>(),
            ),
            auto_choice,
            auto_calibration,
        });
    }
    let over_specmoeoff = |name: &str| {
        let tpot = |n: &str| {
            summaries
                .iter()
                .find(|m: &&ModeSummary| m.mode == n)
                .map(|m| m.mean_tpot_ms)
        };
        match (tpot("specmoeoff"), tpot(name)) {
            (Some(baseline), Some(ours)) if ours > 0.0 => Some(baseline / ours),
            _ => None,
        }
    };
    let specter_over_specmoeoff = over_specmoeoff("specter");
    let auto_over_specmoeoff = over_specmoeoff("auto");
    Ok(BenchReport {
        bundle: path.display().to_string(),
        backend: specter::generate::backend_name(opts.backend),
        device,
        case: opts.case,
        prompts: opts.prompts.len(),
        new_tokens: opts.new_tokens,
        repeats: opts.repeats,
        temperature: opts.sampling.temperature,
        seed: opts.sampling.seed,
        modes: summaries,
        specter_over_specmoeoff,
        auto_over_specmoeoff,
        runs,
    })
}

/// One generation; also returns the expert bytes the copy stream had been given when the first
/// token committed (offloaded CUDA runs), so that the TPOT window's copies can be told apart.
/// `auto`: run under automatic depth control.
fn run_one(
    session: &Session,
    prompt: &[u32],
    gen: &GenerateOptions,
    auto: Option<&AutoDepthStart>,
) -> Result<(GenerateOutput, Option<u64>)> {
    let started = Instant::now();
    let mut bytes_at_first = None;
    let mut first = true;
    let plan = DecodePlan {
        auto_depth: auto.cloned(),
        ..DecodePlan::default()
    };
    let decoded = decode_on_session(session, prompt, gen, &plan, &mut |_| {
        if std::mem::take(&mut first) {
            bytes_at_first = session
                .cuda()
                .and_then(|gpu| gpu.offload_bytes_copied().ok().flatten());
        }
        true
    })?;
    tracing::debug!(
        "bench run in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok((decoded.output, bytes_at_first))
}

/// A markdown table of the modes.
pub fn render_markdown(r: &BenchReport) -> String {
    let reference = r
        .modes
        .iter()
        .find(|m| m.mode == "lru")
        .or_else(|| r.modes.first())
        .map_or(0.0, |m| m.mean_tpot_ms);
    let mut s = format!(
        "case {} ({} backend{}), {} prompts x {} repeats, {} new tokens, {}\n\n\
         | mode | resident/layer | depth | mean TPOT ms | median TPOT ms | TTFT ms | speedup vs {} | acceptance | prefetch P/R | hidden | copied GB/token | floor ms | TPOT/floor | stalls link/host ms/token | peak VRAM GB | agreement | repeated 4-grams |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        r.case.name,
        r.backend,
        if r.device.is_empty() { String::new() } else { format!(", {}", r.device) },
        r.prompts,
        r.repeats,
        r.new_tokens,
        if r.temperature > 0.0 {
            format!("sampled at temperature {} (seed {})", r.temperature, r.seed)
        } else {
            "greedy".to_string()
        },
        if r.modes.iter().any(|m| m.mode == "lru") { "lru" } else { "the first mode" },
    );
    for m in &r.modes {
        s += &format!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.2}x | {} | {} | {} | {} | {} | {} | {} | {} | {:.0}% | {:.0}% |\n",
            m.mode,
            m.resident_experts
                .map_or("all".to_string(), |n| n.to_string()),
            m.depth.map_or("-".to_string(), |d| d.to_string()),
            m.mean_tpot_ms,
            m.median_tpot_ms,
            m.mean_ttft_ms,
            if m.mean_tpot_ms > 0.0 {
                reference / m.mean_tpot_ms
            } else {
                0.0
            },
            if m.depth.is_some() {
                format!("{:.0}%", 100.0 * m.mean_acceptance)
            } else {
                "-".to_string()
            },
            match (m.mean_prefetch_precision, m.mean_prefetch_recall) {
                (Some(p), Some(r)) if m.depth.is_some() => format!("{p:.2}/{r:.2}"),
                _ => "-".to_string(),
            },
            m.mean_prefetch_hidden_share
                .filter(|_| m.depth.is_some())
                .map_or("-".to_string(), |h| format!("{:.0}%", 100.0 * h)),
            m.mean_decode_gb_per_token
                .map_or("-".to_string(), |b| format!("{b:.3}")),
            m.mean_floor_ms
                .map_or("-".to_string(), |f| format!("{f:.2}")),
            m.tpot_over_floor
                .map_or("-".to_string(), |x| format!("{x:.2}")),
            match (m.mean_link_stall_ms_per_token, m.mean_host_stall_ms_per_token) {
                (Some(l), Some(h)) => format!("{l:.2}/{h:.2}"),
                _ => "-".to_string(),
            },
            m.peak_vram_bytes
                .map_or("-".to_string(), |b| format!("{:.2}", b as f64 / 1e9)),
            100.0 * m.agreement,
            100.0 * m.mean_repeated_4gram_share,
        );
    }
    s +=
        "\nhidden: share of prefetch copy time before the verify pass it served began. floor: the \
          expert bytes copied per token after the first, at the run's measured copy bandwidth. \
          stalls: per generated token, the time the compute stream waited for demand copies and \
          the decode thread for host experts. agreement: runs whose tokens equal target-only's \
          (sampled runs agree in distribution, not token by token). repeated 4-grams: share of the output's 4-grams that repeat an \
          earlier one (looping output inflates hit rates).\n";
    for m in &r.modes {
        if let Some(choice) = &m.auto_choice {
            s += &format!(
                "\n{} calibration (first prompt, untimed) chose: {choice}.\n",
                m.mode
            );
        }
        if let Some(p) = &m.auto_calibration {
            s += &calibration_line(p);
        }
    }
    let with_layers: Vec<&ModeSummary> = r
        .modes
        .iter()
        .filter(|m| !m.layer_hit_rates.is_empty())
        .collect();
    if !with_layers.is_empty() {
        s += "\nPer-layer hit rate (MoE layers in order):\n\n";
        for m in with_layers {
            let rates: Vec<String> = m
                .layer_hit_rates
                .iter()
                .map(|h| format!("{h:.2}"))
                .collect();
            s += &format!("- {}: {}\n", m.mode, rates.join(" "));
        }
    }
    if r.modes.iter().any(|m| m.mode == "specmoeoff") {
        for (name, ratio) in [
            ("specter", r.specter_over_specmoeoff),
            ("auto", r.auto_over_specmoeoff),
        ] {
            if let Some(x) = ratio {
                s += &format!("\n{name} over specmoeoff (mean TPOT): {x:.2}x");
            }
        }
        s += "\n\nspecmoeoff: SpecMoEOff-style baseline, K = 3 with route-frequency Top-M prefetch \
              after draft steps 0 and 1. Its draft is this bundle's INT4 experts with a KV cache of \
              their own rather than a separate smaller model, which if anything raises its acceptance \
              above the original's: a conservative baseline for Specter.\n";
    }
    s
}

/// What `auto`'s calibration measured, as one markdown line.
fn calibration_line(p: &DepthProfile) -> String {
    let depths: Vec<String> = p
        .depths
        .iter()
        .zip(&p.tpot_ms)
        .map(|(d, t)| format!("depth {d} {t:.2}"))
        .collect();
    let plain = p.plain.as_ref().map_or(String::new(), |plain| {
        format!(
            "; plain without it at {} slots: {:.2}",
            plain.slots, plain.tpot_ms
        )
    });
    let host = p.host.as_ref().map_or(String::new(), |h| {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |t| format!("{t:.2}"));
        format!(
            "; with the host path ({} threads): plain {}, draft at depth {} {}",
            h.threads,
            ms(h.plain_tpot_ms),
            h.depth,
            ms(h.draft_tpot_ms)
        )
    });
    format!(
        "Calibration TPOT ms with the draft: {}{plain}{host}.\n",
        depths.join(", ")
    )
}

/// An SVG bar chart of mean TPOT per mode.
pub fn render_svg(r: &BenchReport) -> String {
    let (w, bar_h, gap, left, top) = (640.0, 28.0, 10.0, 110.0, 40.0);
    let max = r
        .modes
        .iter()
        .map(|m| m.mean_tpot_ms)
        .fold(0.0, f64::max)
        .max(1e-9);
    let h = top + r.modes.len() as f64 * (bar_h + gap) + 20.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"13\">\n\
         <text x=\"10\" y=\"22\" font-size=\"15\">{} - mean TPOT per mode (ms, lower is better)</text>\n",
        r.case.name
    );
    for (i, m) in r.modes.iter().enumerate() {
        let y = top + i as f64 * (bar_h + gap);
        let len = (w - left - 80.0) * m.mean_tpot_ms / max;
        s += &format!(
            "<text x=\"10\" y=\"{:.0}\">{}</text>\n<rect x=\"{left}\" y=\"{y:.0}\" width=\"{len:.1}\" height=\"{bar_h}\" fill=\"{}\"/>\n<text x=\"{:.1}\" y=\"{:.0}\">{:.2}</text>\n",
            y + bar_h * 0.7,
            m.mode,
            if m.mode == "specter" || m.mode == "auto" { "#c0392b" } else { "#7f8c8d" },
            left + len + 6.0,
            y + bar_h * 0.7,
            m.mean_tpot_ms,
        );
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use specter::depth_profile::{sample_profile, HostCandidates};

    use super::*;

    #[test]
    fn repeated_4grams_are_counted_against_earlier_ones() {
        assert_eq!(repeated_4gram_share(&[1, 2, 3]), 0.0);
        assert_eq!(repeated_4gram_share(&[1, 2, 3, 4, 5, 6]), 0.0);
        // A loop of period 2: after the first 4-gram (1 2 1 2) and the second (2 1 2 1) every
        // 4-gram repeats: 5 of 7.
        assert_eq!(
            repeated_4gram_share(&[1, 2, 1, 2, 1, 2, 1, 2, 1, 2]),
            5.0 / 7.0
        );
        assert_eq!(repeated_4gram_share(&[7; 10]), 6.0 / 7.0);
    }

    #[test]
    fn the_calibration_line_names_every_depth_and_the_plain_candidate() {
        let profile = sample_profile(vec![0, 4, 16], vec![38.9, 44.7, 42.0], Some(23.7));
        assert_eq!(
            calibration_line(&profile),
            "Calibration TPOT ms with the draft: depth 0 38.90, depth 4 44.70, depth 16 42.00; \
             plain without it at 32 slots: 23.70.\n"
        );
        let mut with_host = profile;
        with_host.host = Some(HostCandidates {
            threads: 16,
            plain_tpot_ms: Some(21.5),
            depth: 16,
            draft_tpot_ms: None,
        });
        assert!(calibration_line(&with_host).ends_with(
            "plain without it at 32 slots: 23.70; with the host path (16 threads): plain 21.50, \
             draft at depth 16 -.\n"
        ));
    }
}
