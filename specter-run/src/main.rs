//! specter-run: load a Specter bundle and generate tokens with speculative offloading.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::json;
use specter::backend::cuda::{CudaPrefetcher, FrequencyPrefetcher, HostPath, LoadIo};
use specter::decode::{self, AutoDepth, GenerateOptions, GenerateOutput, Mode, Sampling};
use specter::model::{LanguageModel, NoHook};
use specter::offload::{OffloadSimulator, Policy, SimulatorConfig};
use specter::session::{BackendKind, Session, SessionModel, SessionOptions};
use specter::verify_mode::VerifyMode;
use specter::with_session_model;

mod serve;

#[derive(Parser)]
#[command(
    name = "specter-run",
    version,
    about = "Run a Specter bundle: speculative decoding with an INT4 draft of the model's own experts."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate tokens from a prompt.
    ///
    /// Example: specter-run generate model.specter --prompt "def fib(n):" --max-new-tokens 64 --mode specter --depth 8
    Generate(GenerateArgs),
    /// Measure how well the INT4 draft's routing forecasts the FP16 target's (teacher-forced):
    /// per-layer top-k recall and exact-set match, next-token agreement, and per verify window
    /// the union of experts the target needs versus what the draft routed to.
    ///
    /// Example: specter-run probe model.specter --calib calibration.txt --depth 16 --json
    Probe {
        bundle: PathBuf,
        /// Text to probe on, tokenized with the bundle's tokenizer.
        #[arg(long, conflicts_with_all = ["prompt_ids", "calib"])]
        prompt: Option<String>,
        /// Token ids, comma separated.
        #[arg(long, value_delimiter = ',', conflicts_with = "calib")]
        prompt_ids: Option<Vec<u32>>,
        /// A file of text or of token ids (integers separated by spaces, commas or newlines).
        #[arg(long)]
        calib: Option<PathBuf>,
        /// Most tokens read from --calib.
        #[arg(long, default_value_t = specter::probe::DEFAULT_CALIBRATION_TOKENS)]
        max_tokens: usize,
        /// Verify-window depth for the window figures.
        #[arg(long, default_value_t = specter::probe::DEFAULT_WINDOW)]
        depth: usize,
        #[arg(long)]
        json: bool,
    },
    /// Build a small random-weight model, convert, verify and generate with it: the whole product
    /// in one command, with no download and no GPU needed.
    ///
    /// Example: specter-run demo --arch qwen2_moe
    Demo {
        /// Architecture of the demo model (a Hugging Face model_type).
        #[arg(long, default_value = "deepseek_v2")]
        arch: String,
        /// Where to write the demo checkpoint and bundle (default: a temporary directory, removed after).
        #[arg(long)]
        dir: Option<PathBuf>,
        #[arg(long, default_value_t = 32)]
        max_new_tokens: usize,
        #[arg(long, default_value_t = 4)]
        depth: usize,
    },
    /// The paper's protocol on one bundle: every mode on the same prompts and weights, TPOT and
    /// TTFT per run, every mode's tokens checked against target-only, a markdown table, JSON and
    /// an SVG plot.
    ///
    /// Example: specter-run bench model.specter --backend cuda --case ds_high --modes resident,lru,ondemand,specter,auto --json ds_high.json --plot ds_high.svg
    Bench(BenchArgs),
    /// Measure TPOT at every draft depth (0 is plain target decoding) on this machine and in this
    /// residency, and write the fastest as a profile that `generate --auto-depth --profile FILE`
    /// starts from.
    ///
    /// Example: specter-run profile model.specter --backend cuda --resident-experts 16 -o model.profile.json
    Profile(ProfileArgs),
    /// Serve the bundle over HTTP with the OpenAI API: completions and chat completions (the
    /// checkpoint's own chat template), streamed as server-sent events or whole.
    ///
    /// Example: specter-run serve model.specter --port 8080 --mode specter --depth 8
    Serve(serve::ServeArgs),
    /// Report what this machine offers and what Specter will use: driver, GPU, NVRTC, the host copy
    /// path, measured host-to-device bandwidth, free RAM and disk.
    ///
    /// Example: specter-run doctor --json
    Doctor {
        #[arg(long)]
        json: bool,
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Skip the GPU checks.
        #[arg(long)]
        no_gpu: bool,
        /// Directory whose free space matters (where bundles live).
        #[arg(long, default_value = ".")]
        work_dir: PathBuf,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// The bundle written by `specter-pack convert`.
    bundle: PathBuf,
    /// Prompt text, tokenized with the bundle's tokenizer.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (for example 1,2,3).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// specter: the INT4 draft proposes, the FP16 target verifies (output equals target's);
    /// target: the FP16 model alone; draft: the INT4 draft alone (not lossless); specmoeoff: the
    /// SpecMoEOff-style baseline (the INT4 draft with its own KV cache, K = 3, route-frequency
    /// Top-M prefetch after draft steps 0 and 1; output equals target's).
    #[arg(long, value_enum, default_value_t = ModeArg::Specter)]
    mode: ModeArg,
    /// Draft tokens per verify pass (with --auto-depth, the most it may use). Default: 8, or 3
    /// (the protocol's K) with --mode specmoeoff.
    #[arg(long)]
    depth: Option<usize>,
    /// Choose each round's depth from measured cost per committed token, down to plain target
    /// decoding when speculation does not pay (Specter mode).
    #[arg(long)]
    auto_depth: bool,
    /// With --auto-depth: start from the depth a `specter-run profile` measured for this bundle
    /// and machine.
    #[arg(long, requires = "auto_depth")]
    profile: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// Routed experts kept resident per MoE layer; the rest are copied in when needed. On CUDA
    /// they are real copies from the bundle's mapping into VRAM slots under --policy; the CPU
    /// backend simulates the copies at --bandwidth-gbps and reports hits, misses and bytes moved.
    #[arg(long, conflicts_with = "vram_budget")]
    resident_experts: Option<usize>,
    /// CUDA: derive --resident-experts from a VRAM budget in GB (weights, draft, expert slots,
    /// and 1 GiB for activations and the KV cache).
    #[arg(long)]
    vram_budget: Option<f64>,
    /// CUDA: how expert slots are reused: lru keeps experts and evicts the least recently used,
    /// ondemand copies every expert a pass needs for that pass.
    #[arg(long, value_enum, default_value_t = PolicyArg::Lru)]
    policy: PolicyArg,
    /// CUDA: copy offloaded experts through pinned staging buffers even where the bundle's
    /// mapping can be registered for direct DMA.
    #[arg(long)]
    pinned_staging: bool,
    /// CUDA: how weights are read from the bundle at load time: read (large pread calls into
    /// pinned buffers), mmap (copies out of a mapping: page faults), direct (O_DIRECT, bypassing
    /// the page cache), or per-tensor (one synchronous copy per tensor, the unbatched path).
    #[arg(long, default_value = "read")]
    load_io: String,
    /// CUDA with offloaded experts: wait for the host registration of the expert sections before
    /// the first token, instead of copying through pinned staging until it finishes.
    #[arg(long)]
    wait_registration: bool,
    /// Host-to-device bandwidth the CPU simulation of expert copies assumes (GB/s); on CUDA, the
    /// first estimate the prefetch schedule uses.
    #[arg(long, default_value_t = 55.0)]
    bandwidth_gbps: f64,
    /// Sampling temperature; 0 is greedy (the default).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object (tokens, text, stats) instead of streaming text.
    #[arg(long)]
    json: bool,
    /// How much of the bundle to check first. manifest: the header and manifest checksums and
    /// every range the manifest names, no tensor bytes read. full: also every section's sha256,
    /// hashed while the model loads; a mismatch names the section and nothing is generated.
    /// none: no checksum at all (skips only the header and manifest sha256, which guard
    /// integrity; the manifest's structure and ranges are always checked, since reading tensors
    /// through an unchecked manifest could read outside the file).
    #[arg(long, value_enum, default_value_t = VerifyArg::Manifest)]
    verify: VerifyArg,
}

#[derive(Clone, Copy, ValueEnum)]
enum VerifyArg {
    Full,
    Manifest,
    None,
}

impl From<VerifyArg> for VerifyMode {
    fn from(arg: VerifyArg) -> VerifyMode {
        match arg {
            VerifyArg::Full => VerifyMode::Full,
            VerifyArg::Manifest => VerifyMode::Manifest,
            VerifyArg::None => VerifyMode::None,
        }
    }
}

#[derive(clap::Args)]
struct BenchArgs {
    bundle: PathBuf,
    /// ds_high, ds_low, qwen_high, qwen_low, phi_high, phi_low, or custom (with --depth,
    /// --resident-experts and --matched-experts).
    #[arg(long)]
    case: String,
    /// Comma-separated modes: resident, lru, ondemand, specter, auto, specmoeoff (the
    /// SpecMoEOff-style baseline: the INT4 draft with its own KV cache, K = 3, route-frequency
    /// Top-M prefetch, the case's SpecMoEOff residency).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "resident,lru,ondemand,specter"
    )]
    modes: Vec<String>,
    #[arg(long, value_enum, default_value_t = BackendArg::Cuda)]
    backend: BackendArg,
    /// A file of prompts, one per line: token ids (comma or space separated) or text, each cut
    /// to its first 16 tokens. Default: --num-prompts seeded random prompts of 16 ids.
    #[arg(long)]
    prompts: Option<PathBuf>,
    #[arg(long, default_value_t = 10)]
    num_prompts: usize,
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// custom case: draft depth.
    #[arg(long)]
    depth: Option<usize>,
    /// custom case: experts per layer in VRAM for the modes with a draft.
    #[arg(long)]
    resident_experts: Option<usize>,
    /// custom case: experts per layer in VRAM for target-only lru and ondemand.
    #[arg(long)]
    matched_experts: Option<usize>,
    /// custom case: experts per layer in VRAM for specmoeoff (needed with that mode).
    #[arg(long)]
    specmoeoff_experts: Option<usize>,
    /// Write the JSON record (every run and every mode's summary) here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the markdown table here too (it is always printed).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write an SVG bar chart of mean TPOT per mode here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ProfileArgs {
    bundle: PathBuf,
    /// Where to write the profile (JSON).
    #[arg(short, long)]
    output: PathBuf,
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// CUDA: routed experts kept in VRAM per MoE layer (the rest are copied in).
    #[arg(long)]
    resident_experts: Option<usize>,
    #[arg(long, value_enum, default_value_t = PolicyArg::Lru)]
    policy: PolicyArg,
    /// Prompt as comma-separated token ids.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20"
    )]
    prompt_ids: Vec<u32>,
    /// New tokens per measurement.
    #[arg(long, default_value_t = 48)]
    new_tokens: usize,
    /// Depths to measure, comma separated; 0 is plain target decoding.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4,8,16")]
    depths: Vec<usize>,
    /// Runs per depth (the median TPOT is kept).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// With --resident-experts: expert slots per layer for the plain candidate (target-only,
    /// no draft). Default: --resident-experts plus the slots the draft's VRAM is worth.
    #[arg(long, requires = "resident_experts")]
    plain_experts: Option<usize>,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Specter,
    Target,
    Draft,
    Specmoeoff,
}

#[derive(Clone, Copy, ValueEnum)]
enum PolicyArg {
    Lru,
    Ondemand,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendArg {
    Cpu,
    Cuda,
}

fn main() -> ExitCode {
    // Start-up times in --json are measured from here.
    specter::startup::mark_process_start();
    // Die quietly on a closed pipe (`specter-pack inspect B | head`), as command-line tools do,
    // instead of panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(args),
        Command::Probe {
            bundle,
            prompt,
            prompt_ids,
            calib,
            max_tokens,
            depth,
            json,
        } => probe(bundle, prompt, prompt_ids, calib, max_tokens, depth, json),
        Command::Demo {
            arch,
            dir,
            max_new_tokens,
            depth,
        } => demo(arch, dir, max_new_tokens, depth),
        Command::Profile(args) => profile(args),
        Command::Bench(args) => bench(args),
        Command::Serve(args) => serve::serve(args),
        Command::Doctor {
            json,
            device,
            no_gpu,
            work_dir,
        } => doctor(json, device, no_gpu, work_dir),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    let backend = match args.backend {
        BackendArg::Cpu => BackendKind::Cpu,
        BackendArg::Cuda => BackendKind::Cuda,
    };
    let mut mode = match args.mode {
        ModeArg::Specter => Mode::Specter,
        ModeArg::Target => Mode::Target,
        ModeArg::Draft => Mode::Draft,
        ModeArg::Specmoeoff => Mode::SpecMoeOff,
    };
    if args.auto_depth && mode != Mode::Specter {
        bail!("--auto-depth needs --mode specter");
    }
    // A profile that measured plain decoding (the draft's memory as expert slots) faster than
    // every depth turns automatic depth into plain decoding without loading the draft.
    let profile = match &args.profile {
        Some(path) => Some(specter::depth_profile::DepthProfile::load(path)?),
        None => None,
    };
    // Only where experts are offloaded at all: an all-resident run has no cache to give it to.
    let offloading = args.resident_experts.is_some() || args.vram_budget.is_some();
    let plain = match (&profile, args.backend) {
        (Some(p), BackendArg::Cuda) if offloading => p.prefers_plain().cloned(),
        _ => None,
    };
    if plain.is_some() {
        mode = Mode::Target;
    }
    let depth = args.depth.unwrap_or(if mode == Mode::SpecMoeOff {
        decode::SPECMOEOFF_DEPTH
    } else {
        8
    });
    if depth == 0 {
        bail!("--depth must be at least 1");
    }
    let mut session_opts = SessionOptions::new(backend);
    session_opts.with_draft = mode != Mode::Target;
    session_opts.verify = args.verify.into();
    if backend == BackendKind::Cuda {
        let slots = match (args.resident_experts, args.vram_budget) {
            (Some(n), _) => Some(n),
            (None, Some(gb)) => Some(slots_for_budget(&args.bundle, gb, session_opts.with_draft)?),
            (None, None) => None,
        };
        let policy = match args.policy {
            PolicyArg::Lru => Policy::Lru,
            PolicyArg::Ondemand => Policy::OnDemand,
        };
        session_opts.offload = slots.map(|n| (n, policy));
        if let Some(p) = &plain {
            eprintln!(
                "profile: plain decoding without the draft at {} slots per layer ({:.2} ms) beats speculation ({:.2} ms)",
                p.slots,
                p.tpot_ms,
                profile.as_ref().map_or(0.0, |f| f.best_tpot_ms())
            );
            session_opts.offload = Some((p.slots, Policy::Lru));
        }
        if args.pinned_staging {
            session_opts.cuda.host_path = HostPath::PinnedStaging;
        }
        session_opts.cuda.load_io = LoadIo::parse(&args.load_io)?;
    } else if args.vram_budget.is_some() || args.pinned_staging {
        bail!("--vram-budget and --pinned-staging need --backend cuda");
    }
    let session = Session::open_with(&args.bundle, &session_opts)?;
    if let Some(gpu) = session.cuda() {
        if args.wait_registration {
            gpu.wait_host_registration()?;
        }
        eprintln!("cuda: {}", gpu.residency_description()?);
    }
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => session.encode(text)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give a prompt with --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let opts = GenerateOptions {
        mode,
        max_new_tokens: args.max_new_tokens,
        depth,
        sampling: Sampling {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop_at_eos: !args.ignore_eos,
    };

    // Stream text as tokens commit: decode everything so far and print what is new, so that
    // multi-token characters come out whole. Text ending in U+FFFD may be a character whose
    // remaining bytes are still to come (its decoding then changes), so it is held back.
    let stream = !args.json && session.has_tokenizer();
    let mut committed: Vec<u32> = Vec::new();
    let mut printed = String::new();
    let mut stdout = std::io::stdout();
    let mut print_new = |text: String, printed: &mut String| {
        if let Some(new) = text.strip_prefix(printed.as_str()) {
            let _ = write!(stdout, "{new}");
            let _ = stdout.flush();
            *printed = text;
        }
    };
    let mut first_token_ms = None;
    let mut on_token = |t: u32| {
        if first_token_ms.is_none() {
            first_token_ms = Some(specter::startup::since_start_ms());
        }
        committed.push(t);
        if stream {
            if let Ok(text) = session.decode(&committed) {
                if !text.ends_with(char::REPLACEMENT_CHARACTER) {
                    print_new(text, &mut printed);
                }
            }
        }
    };

    let simulate = match (&session.model, args.resident_experts) {
        (SessionModel::Cpu(_), Some(slots)) => Some(slots),
        _ => None,
    };
    // On the GPU with offloaded experts, the speculative modes prefetch what the draft forecasts.
    let prefetch_model = match (&session.model, opts.mode.is_speculative()) {
        (SessionModel::Cuda(m), true) if m.backend().offload_slots()?.is_some() => Some(m.as_ref()),
        _ => None,
    };
    let auto_depth = args.auto_depth && plain.is_none();
    // The profile's measured depths seed automatic control (once it is known to fit).
    let mut seed = Vec::new();
    let start_depth = match (&profile, &args.profile) {
        (Some(p), Some(path)) if plain.is_some() => {
            p.check_machine(&session, path)?;
            0
        }
        (Some(p), Some(path)) => {
            let start = p.start_depth_for(&session, path)?.min(opts.depth);
            seed = p.seconds_per_token();
            start
        }
        _ => opts.depth,
    };
    let mut draft_step_ms = None;
    let mut auto_report = None;
    let output: GenerateOutput = match (simulate, prefetch_model) {
        (None, Some(m)) if opts.mode == Mode::SpecMoeOff => {
            let mut prefetcher = FrequencyPrefetcher::new(m.backend(), m.info())?;
            let out = decode::generate_observed(m, &prompt, &opts, &mut prefetcher, &mut on_token)?;
            if let Some(e) = prefetcher.take_error() {
                return Err(e.into());
            }
            out
        }
        (None, Some(m)) => {
            let mut prefetcher =
                CudaPrefetcher::new(m.backend(), m.info(), args.bandwidth_gbps * 1e9)?;
            let out = if auto_depth {
                let mut auto = AutoDepth::new(&mut prefetcher, opts.depth, start_depth);
                auto.seed(&seed);
                let out = decode::generate_observed(m, &prompt, &opts, &mut auto, &mut on_token)?;
                auto_report = Some(auto.report());
                out
            } else {
                decode::generate_observed(m, &prompt, &opts, &mut prefetcher, &mut on_token)?
            };
            if let Some(e) = prefetcher.take_error() {
                return Err(e.into());
            }
            draft_step_ms = Some(prefetcher.draft_step_seconds() * 1e3);
            out
        }
        (None, None) if auto_depth => with_session_model!(session, |m| {
            let mut quiet = NoHook;
            let mut auto = AutoDepth::new(&mut quiet, opts.depth, start_depth);
            auto.seed(&seed);
            let out = decode::generate_observed(m, &prompt, &opts, &mut auto, &mut on_token);
            auto_report = Some(auto.report());
            out
        })?,
        (None, None) => with_session_model!(session, |m| decode::generate(
            m,
            &prompt,
            &opts,
            &mut NoHook,
            &mut on_token
        ))?,
        (Some(slots), _) => {
            let info = session.info();
            if slots == 0 || slots > info.num_experts {
                bail!(
                    "--resident-experts must be between 1 and {} (experts per layer)",
                    info.num_experts
                );
            }
            if !(args.bandwidth_gbps.is_finite() && args.bandwidth_gbps > 0.0) {
                bail!("--bandwidth-gbps must be a positive number");
            }
            let policy = if opts.mode.is_speculative() {
                Policy::Specter
            } else {
                Policy::Lru
            };
            // Compute is not simulated on the CPU: the clock measures copy time only.
            let mut sim = OffloadSimulator::new(SimulatorConfig::copies_only(
                info,
                slots,
                policy,
                args.bandwidth_gbps * 1e9,
            ))?;
            if opts.mode == Mode::SpecMoeOff {
                sim = sim.with_frequency_prefetch(specter::offload::frequency_top_m(
                    slots, info.top_k,
                ))?;
            }
            decode::generate_with_offload(
                session.cpu_model()?,
                &prompt,
                &opts,
                &mut sim,
                &mut on_token,
            )?
        }
    };

    let s = &output.stats;
    let text = if session.has_tokenizer() {
        Some(session.decode(&output.tokens)?)
    } else {
        None
    };
    if stream {
        // Whatever was held back at the end.
        if let Some(text) = &text {
            print_new(text.clone(), &mut printed);
        }
        println!();
    }
    if args.json {
        let offload = s.offload.as_ref().map(|o| {
            json!({
                "resident_experts": args.resident_experts,
                "lookups": o.lookups, "hits": o.hits, "misses": o.misses,
                "hit_rate": if o.lookups > 0 { o.hits as f64 / o.lookups as f64 } else { 0.0 },
                "prefetched": o.prefetched, "prefetch_used": o.prefetch_used,
                "prefetch_wasted": o.prefetch_wasted, "misses": o.misses,
                "bytes_copied": o.bytes_copied, "simulated_copy_stall_s": o.stall_s,
                "layer_hits": o.layer_hits, "layer_misses": o.layer_misses,
            })
        });
        let gpu = match session.cuda() {
            None => serde_json::Value::Null,
            Some(g) => json!({
                "device": g.device().name(),
                "residency": g.residency_description()?,
                "vram_peak_bytes": g.vram_peak_bytes()?,
                "host_timing": g.host_timing()?,
                "graphs": g.step_graph_stats()?,
                "load": g.load_report()?,
                "offload": g.offload_stats()?.map(|o| json!({
                    "policy": o.policy, "path": o.path, "slots_per_layer": o.slots_per_layer,
                    "slot_vram_bytes": o.slot_vram_bytes, "hits": o.hits, "misses": o.misses,
                    "hit_rate": o.hit_rate(), "bytes_copied": o.bytes_copied,
                    "copy_seconds": o.copy_seconds, "copy_gbps": o.copy_bandwidth() / 1e9,
                    "prefetched": o.prefetched, "prefetch_used": o.prefetch_used,
                    "prefetch_precision": o.prefetch_precision(), "prefetch_recall": o.prefetch_recall(),
                    "prefetch_bytes": o.prefetch_bytes, "prefetch_copy_seconds": o.prefetch_copy_seconds,
                    "prefetch_hidden_seconds": o.prefetch_hidden_seconds,
                    "draft_step_ms": draft_step_ms,
                    "registration_seconds": o.registration_seconds,
                })),
            }),
        };
        let record = json!({
            "bundle": args.bundle.display().to_string(),
            "architecture": session.config.model_type.as_str(),
            "backend": if session.cuda().is_some() { "cuda" } else { "cpu" },
            "gpu": gpu,
            "auto_depth": auto_report,
            "auto_plain": plain.as_ref().map(|p| json!({"slots": p.slots, "profiled_tpot_ms": p.tpot_ms})),
            "mode": format!("{:?}", opts.mode).to_lowercase(),
            "startup": {
                "bundle_opened_ms": session.startup.bundle_opened_ms,
                "device_ready_ms": session.startup.device_ready_ms,
                "weights_resident_ms": session.startup.weights_resident_ms,
                "first_token_ms": first_token_ms,
            },
            "depth": opts.depth,
            "prompt_tokens": prompt,
            "tokens": output.tokens,
            "text": text,
            "stats": {
                "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
                "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                "acceptance_rate": s.acceptance_rate,
                "mean_accepted_per_round": s.mean_accepted_per_round,
                "ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "total_ms": s.total_ms,
                "cache": offload,
            },
        });
        println!("{}", serde_json::to_string_pretty(&record)?);
    } else {
        if !stream {
            println!(
                "{}",
                output
                    .tokens
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        eprint!(
            "[{} tokens, TTFT {:.1} ms, TPOT {:.2} ms",
            s.generated_tokens, s.ttft_ms, s.tpot_ms
        );
        if opts.mode.is_speculative() {
            eprint!(
                ", acceptance {:.1}% ({} of {} drafted), {:.2} accepted per round",
                100.0 * s.acceptance_rate,
                s.accepted,
                s.drafted,
                s.mean_accepted_per_round
            );
        }
        if let Some(o) = &s.offload {
            eprint!(
                ", experts: {} hits / {} misses, {} prefetched ({} used), {:.1} MB moved",
                o.hits,
                o.misses,
                o.prefetched,
                o.prefetch_used,
                o.bytes_copied as f64 / 1e6
            );
        }
        eprintln!("]");
    }
    Ok(())
}

fn demo(arch: String, dir: Option<PathBuf>, max_new_tokens: usize, depth: usize) -> Result<()> {
    if depth == 0 {
        bail!("--depth must be at least 1");
    }
    let temp;
    let work_dir = match dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            dir
        }
        None => {
            temp = tempfile::tempdir().context("creating a temporary directory")?;
            temp.path().to_path_buf()
        }
    };
    let opts = specter::demo::DemoOptions {
        architecture: arch,
        max_new_tokens,
        depth,
        ..Default::default()
    };
    println!(
        "Specter demo: {} (random weights, so the tokens mean nothing; the mechanics are real)",
        opts.architecture
    );
    specter::demo::run(&work_dir, &opts, &mut |line| println!("{line}"))?;
    println!("done. Next: convert a real checkpoint with `specter-pack convert HF_DIR -o model.specter`.");
    Ok(())
}

fn doctor(json: bool, device: usize, no_gpu: bool, work_dir: PathBuf) -> Result<()> {
    let opts = specter::doctor::DoctorOptions {
        device,
        gpu: !no_gpu,
        work_dir,
        ..Default::default()
    };
    let report = specter::doctor::diagnose(&opts);
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", specter::doctor::render_text(&report));
    }
    Ok(())
}

fn probe(
    path: PathBuf,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    calib: Option<PathBuf>,
    max_tokens: usize,
    depth: usize,
    json: bool,
) -> Result<()> {
    let session = Session::open(&path, BackendKind::Cpu)?;
    let tokens = match (prompt, prompt_ids, calib) {
        (Some(text), _, _) => session.encode(&text)?,
        (None, Some(ids), _) => ids,
        (None, None, Some(file)) => {
            specter::probe::read_calibration_tokens(&file, session.tokenizer.as_ref(), max_tokens)?
        }
        (None, None, None) => {
            bail!("give tokens to probe with --prompt, --prompt-ids or --calib FILE")
        }
    };
    let report = specter::probe::probe(
        session.cpu_model()?,
        &tokens,
        &specter::probe::ProbeOptions { window: depth },
    )?;
    if json {
        println!("{}", specter::probe::render_json(&report)?);
    } else {
        print!("{}", specter::probe::render_text(&report));
    }
    Ok(())
}

/// Expert slots per MoE layer that fit `gb` of VRAM beside the non-expert weights (and the draft
/// when loaded), keeping 1 GiB for activations and the KV cache.
fn slots_for_budget(path: &std::path::Path, gb: f64, with_draft: bool) -> Result<usize> {
    use specter_format::SectionKind;
    if !(gb.is_finite() && gb > 0.0) {
        bail!("--vram-budget must be a positive number of GB");
    }
    let bundle = specter_format::Bundle::open(path)?;
    let cfg = specter::arch::ArchConfig::from_config_json(bundle.hyperparameters_json())?;
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
    let per_slot = (info.moe_layers.len() * info.expert_bytes) as u64;
    let budget = (gb * 1e9) as u64;
    if budget < fixed + per_slot {
        bail!(
            "--vram-budget {gb} GB is too small: the non-expert weights{} and working memory need {:.2} GB, plus {:.2} GB per resident expert per layer",
            if with_draft { ", the INT4 draft" } else { "" },
            fixed as f64 / 1e9,
            per_slot as f64 / 1e9
        );
    }
    Ok((((budget - fixed) / per_slot) as usize).min(info.num_experts))
}

fn profile(args: ProfileArgs) -> Result<()> {
    let backend = match args.backend {
        BackendArg::Cpu => BackendKind::Cpu,
        BackendArg::Cuda => BackendKind::Cuda,
    };
    let mut opts = SessionOptions::new(backend);
    if let Some(n) = args.resident_experts {
        if backend != BackendKind::Cuda {
            bail!(
                "--resident-experts needs --backend cuda when profiling (real copies are measured)"
            );
        }
        let policy = match args.policy {
            PolicyArg::Lru => Policy::Lru,
            PolicyArg::Ondemand => Policy::OnDemand,
        };
        opts.offload = Some((n, policy));
    }
    let mut report = {
        let session = Session::open_with(&args.bundle, &opts)?;
        specter::depth_profile::sweep(
            &session,
            &args.prompt_ids,
            args.new_tokens,
            &args.depths,
            args.repeats,
        )?
    };
    if let Some((resident, policy)) = opts.offload {
        // Plain decoding with the draft's memory as slots: what auto depth falls back to.
        let bundle = specter_format::Bundle::open(&args.bundle)?;
        let experts = specter::arch::ArchConfig::from_config_json(bundle.hyperparameters_json())?
            .moe
            .num_experts;
        let slots = match args.plain_experts {
            Some(n) => n,
            None => {
                (resident + specter::depth_profile::draft_slot_equivalent(&bundle)?).min(experts)
            }
        };
        drop(bundle);
        let mut plain_opts = opts.clone();
        plain_opts.with_draft = false;
        plain_opts.offload = Some((slots, policy));
        let session = Session::open_with(&args.bundle, &plain_opts)?;
        let tpot_ms = specter::depth_profile::measure_plain(
            &session,
            &args.prompt_ids,
            args.new_tokens,
            args.repeats,
        )?;
        report.plain = Some(specter::depth_profile::PlainCandidate { slots, tpot_ms });
    }
    report.save(&args.output)?;
    println!("depth  tpot_ms  acceptance");
    for ((d, t), a) in report
        .depths
        .iter()
        .zip(&report.tpot_ms)
        .zip(&report.acceptance)
    {
        println!("{d:>5}  {t:>7.3}  {a:>10.3}");
    }
    if let Some(p) = &report.plain {
        println!(
            "plain, no draft, {} slots per layer: {:.3} ms",
            p.slots, p.tpot_ms
        );
    }
    match report.prefers_plain() {
        Some(p) => println!(
            "best: plain decoding without the draft at {} slots per layer, written to {}",
            p.slots,
            args.output.display()
        ),
        None => println!(
            "best depth {} ({}), written to {}",
            report.best_depth,
            report.key.residency,
            args.output.display()
        ),
    }
    Ok(())
}

/// Prompt length of the paper's protocol.
const BENCH_PROMPT_TOKENS: usize = 16;

fn read_bench_prompts(path: &std::path::Path, bundle: &std::path::Path) -> Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the prompts file {}", path.display()))?;
    let mut tokenizer = None;
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let ids: std::result::Result<Vec<u32>, _> = line
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|t| !t.is_empty())
            .map(str::parse::<u32>)
            .collect();
        let mut ids = match ids {
            Ok(ids) => ids,
            Err(_) => {
                if tokenizer.is_none() {
                    let b = specter_format::Bundle::open(bundle)?;
                    let bytes = b.tokenizer_bytes().with_context(|| {
                        format!(
                            "{} line {}: text prompts need the bundle's tokenizer, and {} has none (use token ids)",
                            path.display(),
                            n + 1,
                            bundle.display()
                        )
                    })?;
                    tokenizer = Some(tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| {
                        anyhow::anyhow!("the bundle's tokenizer does not load: {e}")
                    })?);
                }
                let t = tokenizer.as_ref().context("tokenizer")?;
                t.encode(line, true)
                    .map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), n + 1))?
                    .get_ids()
                    .to_vec()
            }
        };
        ids.truncate(BENCH_PROMPT_TOKENS);
        if ids.is_empty() {
            bail!(
                "{} line {}: the prompt has no tokens",
                path.display(),
                n + 1
            );
        }
        prompts.push(ids);
    }
    if prompts.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(prompts)
}

fn bench(args: BenchArgs) -> Result<()> {
    use specter::bench::{self, BenchCase, BenchMode, BenchOptions};
    let modes = args
        .modes
        .iter()
        .map(|m| BenchMode::parse(m))
        .collect::<specter::Result<Vec<_>>>()?;
    let case = if args.case == "custom" {
        let specmoeoff = match args.specmoeoff_experts {
            Some(0) => bail!("--specmoeoff-experts must be at least 1"),
            Some(n) => n,
            None if modes.contains(&BenchMode::SpecMoeOff) => {
                bail!("--case custom with mode specmoeoff needs --specmoeoff-experts")
            }
            // Unused without that mode.
            None => args.resident_experts.unwrap_or(0),
        };
        match (args.depth, args.resident_experts, args.matched_experts) {
            (Some(depth), Some(resident), Some(matched)) if depth > 0 && resident > 0 && matched > 0 => BenchCase {
                name: "custom",
                depth,
                resident,
                matched,
                specmoeoff,
            },
            _ => bail!("--case custom needs --depth, --resident-experts and --matched-experts, each at least 1"),
        }
    } else {
        if args.depth.is_some()
            || args.resident_experts.is_some()
            || args.matched_experts.is_some()
            || args.specmoeoff_experts.is_some()
        {
            bail!("--depth, --resident-experts, --matched-experts and --specmoeoff-experts only go with --case custom");
        }
        bench::case(&args.case)?
    };
    let backend = match args.backend {
        BackendArg::Cpu => BackendKind::Cpu,
        BackendArg::Cuda => BackendKind::Cuda,
    };
    let prompts = match &args.prompts {
        Some(path) => read_bench_prompts(path, &args.bundle)?,
        None => {
            let b = specter_format::Bundle::open(&args.bundle)?;
            let cfg = specter::arch::ArchConfig::from_config_json(b.hyperparameters_json())?;
            bench::synthetic_prompts(cfg.vocab_size, args.num_prompts, BENCH_PROMPT_TOKENS, 0)
        }
    };
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("bench [{bar:30}] {pos}/{len} runs, eta {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar
    });
    let opts = BenchOptions {
        backend,
        case,
        modes,
        prompts,
        new_tokens: args.new_tokens,
        repeats: args.repeats,
    };
    let report = bench::run(&args.bundle, &opts, &mut |done, total| match &bar {
        Some(bar) => {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        }
        None => eprintln!("bench: {done}/{total} runs"),
    })?;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let table = bench::render_markdown(&report);
    print!("{table}");
    if let Some(path) = &args.markdown {
        std::fs::write(path, &table).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, bench::render_svg(&report))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let disagreeing = report.runs.iter().filter(|r| !r.agrees).count();
    if disagreeing > 0 {
        bail!("{disagreeing} run(s) gave tokens different from target-only decoding: see the agreement column");
    }
    Ok(())
}
