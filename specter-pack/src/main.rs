//! specter-pack: convert a Hugging Face MoE checkpoint into a Specter bundle, and check bundles.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use specter::pack::{self, ConvertOptions, QuantMethod};
use specter_format::{sha256_hex, Bundle};

#[derive(Parser)]
#[command(
    name = "specter-pack",
    version,
    about = "Convert Hugging Face MoE checkpoints into Specter bundles; verify and inspect bundles."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a Hugging Face checkpoint directory into one bundle.
    ///
    /// Example: specter-pack convert ./DeepSeek-V2-Lite -o dsv2-lite.specter --quant rtn
    Convert {
        /// Directory holding config.json, *.safetensors (and model.safetensors.index.json), tokenizer.json.
        hf_dir: PathBuf,
        /// Output bundle path; written atomically (nothing appears there unless conversion succeeds).
        #[arg(short, long)]
        output: PathBuf,
        /// Quantizer for the INT4 draft experts.
        #[arg(long, value_enum, default_value_t = Quant::Rtn)]
        quant: Quant,
        /// Worker threads for quantization (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Recompute every section's checksum; exit 0 only if all match.
    ///
    /// Example: specter-pack verify dsv2-lite.specter
    Verify { bundle: PathBuf },
    /// Print a bundle's architecture, sections and tensors.
    ///
    /// Example: specter-pack inspect dsv2-lite.specter --json
    Inspect {
        bundle: PathBuf,
        /// Print the whole manifest as JSON.
        #[arg(long)]
        json: bool,
        /// Also list every tensor (the table can be long).
        #[arg(long)]
        tensors: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Quant {
    Rtn,
    Gptq,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert {
            hf_dir,
            output,
            quant,
            threads,
        } => convert(hf_dir, output, quant, threads),
        Command::Verify { bundle } => verify(bundle),
        Command::Inspect {
            bundle,
            json,
            tensors,
        } => inspect(bundle, json, tensors),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", error_message(&err));
            ExitCode::FAILURE
        }
    }
}

/// A progress bar with bytes per second on a terminal; plain stage lines otherwise.
struct Bar {
    bar: Option<ProgressBar>,
    started: Instant,
    last_stage: Mutex<String>,
}

impl Bar {
    fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:32} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar
        });
        Bar {
            bar,
            started: Instant::now(),
            last_stage: Mutex::new(String::new()),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl pack::Progress for Bar {
    fn begin(&self, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
        }
    }
    fn advance(&self, bytes: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
        }
    }
    fn stage(&self, message: &str) {
        match &self.bar {
            Some(bar) => bar.set_message(message.to_string()),
            None => {
                let mut last = self.last_stage.lock().unwrap_or_else(|p| p.into_inner());
                if *last != message {
                    eprintln!("[{:7.1}s] {message}", self.started.elapsed().as_secs_f64());
                    *last = message.to_string();
                }
            }
        }
    }
}

fn convert(
    hf_dir: PathBuf,
    output: PathBuf,
    quant: Quant,
    threads: Option<usize>,
) -> Result<ExitCode> {
    if threads == Some(0) {
        anyhow::bail!("--threads must be at least 1");
    }
    let opts = ConvertOptions {
        quant: match quant {
            Quant::Rtn => QuantMethod::Rtn,
            Quant::Gptq => QuantMethod::Gptq,
        },
        threads,
    };
    let bar = Bar::new();
    let t0 = Instant::now();
    let report = pack::convert(&hf_dir, &output, &opts, &bar)
        .with_context(|| format!("converting {} into {}", hf_dir.display(), output.display()))?;
    bar.finish();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "wrote {} ({}, {:.2} GB) from {:.2} GB of source tensors in {:.1} s ({:.2} GB/s of input)",
        report.output.display(),
        report.architecture,
        report.bundle_bytes as f64 / 1e9,
        report.source_tensor_bytes as f64 / 1e9,
        secs,
        report.source_tensor_bytes as f64 / 1e9 / secs.max(1e-9),
    );
    println!(
        "  {} shared tensors, {} MoE layers x {} experts; INT4 draft ({}), mean relative weight error {:.4}",
        report.shared_tensors,
        report.moe_layers,
        report.experts_per_layer,
        opts.quant.name(),
        report.mean_rel_err
    );
    if !report.ignored_tensors.is_empty() {
        println!("  ignored {} source tensors the architecture does not use (listed in the manifest's notes)", report.ignored_tensors.len());
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(path: PathBuf) -> Result<ExitCode> {
    let t0 = Instant::now();
    let bundle = Bundle::open(&path)?;
    let bar = Bar::new();
    pack::Progress::begin(&bar, bundle.file_len());
    pack::Progress::stage(&bar, "verifying sections");
    let report = bundle.verify_with_progress(&|bytes| pack::Progress::advance(&bar, bytes));
    bar.finish();
    let secs = t0.elapsed().as_secs_f64();
    let bad = report.bad_sections();
    if !report.manifest_ok {
        println!("{}: manifest checksum mismatch", path.display());
    }
    for s in &bad {
        println!(
            "{}: section {} ({} bytes) checksum mismatch",
            path.display(),
            s.name,
            s.length
        );
    }
    if report.is_ok() {
        println!(
            "{}: ok, {} sections, {:.2} GB verified in {:.2} s ({:.2} GB/s)",
            path.display(),
            report.sections.len(),
            report.bytes as f64 / 1e9,
            secs,
            report.bytes as f64 / 1e9 / secs.max(1e-9)
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "{}: FAILED: {} of {} sections are corrupt; re-pack or re-download the bundle",
            path.display(),
            bad.len(),
            report.sections.len()
        );
        Ok(ExitCode::FAILURE)
    }
}

fn inspect(path: PathBuf, json: bool, tensors: bool) -> Result<ExitCode> {
    let bundle = Bundle::open(&path)?;
    let manifest = bundle.to_manifest()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("bundle       {}", path.display());
    println!("architecture {}", manifest.architecture);
    println!(
        "file size    {} bytes ({:.3} GB)",
        bundle.file_len(),
        bundle.file_len() as f64 / 1e9
    );
    let p = &manifest.provenance;
    println!("written by   {} {}", p.tool, p.tool_version);
    let q = &p.quant;
    println!(
        "draft        INT4 {} (group {}, {}symmetric, act-order {}), calibration: {}",
        q.method,
        q.group_size,
        if q.symmetric { "" } else { "a" },
        q.act_order,
        q.calibration
    );
    if !q.stats.is_empty() {
        let n = q.stats.len() as f64;
        let rtn = q.stats.iter().map(|s| s.rel_err_rtn as f64).sum::<f64>() / n;
        let gptq: Vec<f64> = q
            .stats
            .iter()
            .map(|s| s.rel_err_gptq as f64)
            .filter(|v| v.is_finite())
            .collect();
        print!(
            "quant error  mean relative error over {} matrices: rtn {rtn:.4}",
            q.stats.len()
        );
        if !gptq.is_empty() {
            print!(", gptq {:.4}", gptq.iter().sum::<f64>() / gptq.len() as f64);
        }
        println!();
    }
    println!("\nsections ({}):", manifest.sections.len());
    println!(
        "  {:<20} {:<14} {:>14} {:>14}  sha256",
        "name", "kind", "offset", "bytes"
    );
    for s in &manifest.sections {
        println!(
            "  {:<20} {:<14} {:>14} {:>14}  {}",
            s.name,
            kind_name(&s.kind),
            s.offset,
            s.length,
            &sha256_hex(&s.sha256)[..16]
        );
    }
    println!(
        "\n{} tensors, {} FP16 expert blobs",
        manifest.tensors.len(),
        manifest.experts.len()
    );
    if tensors {
        println!(
            "  {:<64} {:<5} {:<20} {:>12}",
            "name", "dtype", "shape", "bytes"
        );
        for t in &manifest.tensors {
            println!(
                "  {:<64} {:<5} {:<20} {:>12}",
                t.name,
                t.dtype.name(),
                format!("{:?}", t.shape),
                t.length
            );
        }
    }
    println!("\nsources:");
    for s in &p.sources {
        println!(
            "  {:<40} {:>14} bytes  sha256 {}",
            s.name,
            s.length,
            &sha256_hex(&s.sha256)[..16]
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn kind_name(kind: &specter_format::SectionKind) -> String {
    use specter_format::SectionKind::*;
    match kind {
        Shared => "shared".into(),
        Experts { layer } => format!("experts[{layer}]"),
        Draft { layer } => format!("draft[{layer}]"),
        Tokenizer => "tokenizer".into(),
        Config => "config".into(),
        Other => "other".into(),
    }
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
