//! specter-run: load a Specter bundle and generate tokens with speculative offloading.

//!
//! This file is the command line's shape and dispatch; what each subcommand does lives in the
//! runtime (`specter::generate`) or in this package's library (`specter_run::bench`,
//! `specter_run::profile`, ...), and its printing in the modules below.

mod args;
mod bench_cli;
mod generate;
mod serve;
mod tools;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use args::{BackendArg, BenchArgs, GenerateArgs, ProfileArgs};

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
        #[arg(long, default_value_t = specter_run::probe::DEFAULT_CALIBRATION_TOKENS)]
        max_tokens: usize,
        /// Verify-window depth for the window figures.
        #[arg(long, default_value_t = specter_run::probe::DEFAULT_WINDOW)]
        depth: usize,
        /// auto: CUDA when a usable GPU is found, else the CPU (stderr says which and why).
        #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
        backend: BackendArg,
        #[arg(long)]
        json: bool,
    },
    /// Measure a bundle's quality against a reference bundle of the same model (normally its FP16
    /// target): mean and tail KL divergence, top-1 agreement and perplexity of the target and of
    /// the draft over a text, teacher-forced, and the draft's greedy acceptance and route recall
    /// against its own target.
    ///
    /// Example: specter-run eval int4.specter --reference fp16.specter --text wiki.txt
    Eval(tools::EvalArgs),
    /// Build a small random-weight model, convert, verify and generate with it: the whole product
    /// in one command, with no download and no GPU needed (on a GPU it runs there).
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
        /// auto: CUDA when a usable GPU is found, else the CPU (stderr says which and why).
        #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
        backend: BackendArg,
    },
    /// The paper's protocol on one bundle: every mode on the same prompts and weights, TPOT and
    /// TTFT per run, every mode's tokens checked against target-only, a markdown table, JSON and
    /// an SVG plot.
    ///
    /// Example: specter-run bench model.specter --backend cuda --case ds_high --modes resident,lru,ondemand,specter,auto --json ds_high.json --plot ds_high.svg
    Bench(BenchArgs),
    /// Serve the bundle over HTTP with the OpenAI API: completions and chat completions (the
    /// checkpoint's own chat template), streamed as server-sent events or whole.
    ///
    /// Example: specter-run serve model.specter --port 8080 --mode specter --depth 8
    Serve(serve::ServeArgs),
    /// Measure TPOT at every draft depth (0 is plain target decoding) on this machine and in this
    /// residency, and write the fastest as a profile that `generate --auto-depth --profile FILE`
    /// starts from.
    ///
    /// Example: specter-run profile model.specter --backend cuda --resident-experts 16 -o model.profile.json
    Profile(ProfileArgs),
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
        Command::Generate(args) => generate::generate(args),
        Command::Probe {
            bundle,
            prompt,
            prompt_ids,
            calib,
            max_tokens,
            depth,
            backend,
            json,
        } => tools::probe(
            bundle,
            tools::ProbeInput {
                prompt,
                prompt_ids,
                calib,
                max_tokens,
            },
            depth,
            backend,
            json,
        ),
        Command::Eval(args) => tools::eval(args),
        Command::Demo {
            arch,
            dir,
            max_new_tokens,
            depth,
            backend,
        } => tools::demo(arch, dir, max_new_tokens, depth, backend),
        Command::Profile(args) => tools::profile(args),
        Command::Bench(args) => bench_cli::bench(args),
        Command::Serve(args) => serve::serve(args),
        Command::Doctor {
            json,
            device,
            no_gpu,
            work_dir,
        } => tools::doctor(json, device, no_gpu, work_dir),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
