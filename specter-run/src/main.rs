//! specter-run: load a Specter bundle and generate tokens with speculative offloading.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::json;
use specter::decode::{self, GenerateOptions, GenerateOutput, Mode, Sampling};
use specter::model::NoHook;
use specter::offload::{
    ComputeModel, InitialResidency, OffloadSimulator, Policy, ResidencyConfig, SimulatorConfig,
};
use specter::session::{BackendKind, Session};

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
    /// target: the FP16 model alone; draft: the INT4 draft alone (not lossless).
    #[arg(long, value_enum, default_value_t = ModeArg::Specter)]
    mode: ModeArg,
    /// Draft tokens per verify pass.
    #[arg(long, default_value_t = 8)]
    depth: usize,
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// Routed experts kept resident per MoE layer; the rest are copied in when needed. The CPU
    /// backend simulates the copies at --bandwidth-gbps and reports hits, misses and bytes moved.
    #[arg(long)]
    resident_experts: Option<usize>,
    /// Host-to-device bandwidth the CPU simulation of expert copies assumes (GB/s).
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
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Specter,
    Target,
    Draft,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendArg {
    Cpu,
    Cuda,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", error_message(&err));
            ExitCode::FAILURE
        }
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    if args.depth == 0 {
        bail!("--depth must be at least 1");
    }
    let backend = match args.backend {
        BackendArg::Cpu => BackendKind::Cpu,
        BackendArg::Cuda => BackendKind::Cuda,
    };
    let session = Session::open(&args.bundle, backend)
        .with_context(|| format!("loading {}", args.bundle.display()))?;
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => session.encode(text)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give a prompt with --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let opts = GenerateOptions {
        mode: match args.mode {
            ModeArg::Specter => Mode::Specter,
            ModeArg::Target => Mode::Target,
            ModeArg::Draft => Mode::Draft,
        },
        max_new_tokens: args.max_new_tokens,
        depth: args.depth,
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
    let mut on_token = |t: u32| {
        committed.push(t);
        if stream {
            if let Ok(text) = session.decode(&committed) {
                if !text.ends_with(char::REPLACEMENT_CHARACTER) {
                    print_new(text, &mut printed);
                }
            }
        }
    };

    let output: GenerateOutput = match args.resident_experts {
        None => decode::generate(&session.model, &prompt, &opts, &mut NoHook, &mut on_token)?,
        Some(slots) => {
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
            let policy = if opts.mode == Mode::Specter {
                Policy::Specter
            } else {
                Policy::Lru
            };
            let mut sim = OffloadSimulator::new(SimulatorConfig {
                residency: ResidencyConfig::for_model(info, slots, policy),
                initial: InitialResidency::FirstExperts,
                bandwidth_bytes_per_s: args.bandwidth_gbps * 1e9,
                latency_s: 0.0,
                // Compute is not simulated on the CPU: the clock then measures copy time only.
                compute: ComputeModel {
                    draft_step_s: 0.0,
                    target_pass_s: 0.0,
                    target_row_s: 0.0,
                },
            })?;
            decode::generate_with_offload(&session.model, &prompt, &opts, &mut sim, &mut on_token)?
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
                "prefetched": o.prefetched, "prefetched_used": o.prefetched_used,
                "prefetched_wasted": o.prefetched_wasted, "demand_loads": o.demand_loads,
                "bytes_moved": o.bytes_moved, "simulated_copy_stall_s": o.stall_s,
                "per_layer_hits": o.per_layer_hits, "per_layer_misses": o.per_layer_misses,
            })
        });
        let record = json!({
            "bundle": args.bundle.display().to_string(),
            "architecture": session.config.model_type.as_str(),
            "backend": "cpu",
            "mode": format!("{:?}", opts.mode).to_lowercase(),
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
        if opts.mode == Mode::Specter {
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
                o.prefetched_used,
                o.bytes_moved as f64 / 1e6
            );
        }
        eprintln!("]");
    }
    Ok(())
}

/// The error and its causes joined by ": ", each cause printed once: some errors (a bundle error
/// naming its file, for one) already include their cause's text, which `{:#}` would repeat.
fn error_message(err: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if message.contains(&text) {
            continue;
        }
        if !message.is_empty() {
            message.push_str(": ");
        }
        message.push_str(&text);
    }
    message
}
