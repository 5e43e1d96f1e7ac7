//! specter-pack: convert a Hugging Face MoE checkpoint into a Specter bundle, and check bundles.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use specter_convert::pack::{self, ConvertOptions, QuantMethod, TargetPrecision};
use specter_format::ship::{self, ShipOptions, ShipProgress, UnshipOptions};
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
    /// Example: specter-pack convert ./DeepSeek-V2-Lite -o dsv2-lite.specter --quant gptq --calib wiki.txt
    Convert(ConvertArgs),
    /// Write a random-weight Hugging Face checkpoint with a real model's shapes, names and config,
    /// so that benchmarks need no download.
    ///
    /// Example: specter-pack synth --preset deepseek-v2-lite --layers 4 -o ./dsv2-lite-4l
    Synth {
        /// deepseek-v2-lite, qwen1.5-moe-a2.7b or phi-3.5-moe; or a tiny fixture of any supported
        /// architecture with --fixture, or any config.json with --config.
        #[arg(long, required_unless_present_any = ["fixture", "config"], conflicts_with_all = ["fixture", "config"])]
        preset: Option<String>,
        /// A tiny model of this architecture (a Hugging Face model_type), as the tests use.
        #[arg(long, conflicts_with = "config")]
        fixture: Option<String>,
        /// A model of this config.json (any supported architecture and size), written verbatim.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Keep only the first N decoder layers.
        #[arg(long)]
        layers: Option<usize>,
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Standard deviation of the random weights.
        #[arg(long, default_value_t = 0.02)]
        std: f32,
        /// Largest safetensors shard, in MiB.
        #[arg(long, default_value_t = 4096)]
        shard_mib: u64,
    },
    /// Recompute every section's checksum; exit 0 only if all match.
    ///
    /// Example: specter-pack verify dsv2-lite.specter
    Verify { bundle: PathBuf },
    /// Pack a bundle for copying: independently zstd-compressed, checksummed chunks (FP16
    /// sections byte-shuffled), ending with a trailer so that a cut-short copy is detected.
    ///
    /// Example: specter-pack ship dsv2-lite.specter -o dsv2-lite.specter.zst
    Ship {
        bundle: PathBuf,
        /// Output file; written atomically.
        #[arg(short, long)]
        output: PathBuf,
        /// Uncompressed MiB per chunk, at most.
        #[arg(long, default_value_t = ship::DEFAULT_CHUNK_SIZE >> 20)]
        chunk_mib: u64,
        /// zstd compression level.
        #[arg(long, default_value_t = ship::DEFAULT_LEVEL)]
        level: i32,
        /// Do not byte-shuffle FP16 sections (to measure what shuffling gains).
        #[arg(long)]
        no_shuffle: bool,
        /// Skip checking every section's sha256 before shipping (a corrupt bundle is then caught
        /// only by `unship`, which verifies what it rebuilds).
        #[arg(long)]
        no_verify: bool,
        /// Replace the output if it exists.
        #[arg(long)]
        force: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Rebuild a bundle from a shipped file: every chunk's checksums and then every section's
    /// sha256 are checked before the bundle appears under its name.
    ///
    /// Example: specter-pack unship dsv2-lite.specter.zst -o dsv2-lite.specter
    Unship {
        shipped: PathBuf,
        /// Output bundle; written atomically.
        #[arg(short, long)]
        output: PathBuf,
        /// Replace the output if it exists.
        #[arg(long)]
        force: bool,
    },
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

// The convert subcommand's arguments (the variant's doc comment is its help), turned into
// ConvertOptions in one place.
#[derive(Args)]
struct ConvertArgs {
    /// Directory holding config.json, *.safetensors (and model.safetensors.index.json), tokenizer.json.
    hf_dir: PathBuf,
    /// Output bundle path; written atomically (nothing appears there unless conversion succeeds).
    #[arg(short, long)]
    output: PathBuf,
    /// Quantizer for the draft's experts (and a quantized target's).
    #[arg(long, value_enum, default_value_t = Quant::Rtn)]
    quant: Quant,
    /// How the target's routed experts are stored: fp16, int8 or int4 (both in groups of 128,
    /// by output row).
    #[arg(long, default_value = "fp16")]
    target: String,
    /// Bits per weight of the draft's experts: 4, 3 or 2, fewer than the target's (default:
    /// 4 under fp16 and int8 targets, 3 under int4).
    #[arg(long)]
    draft_bits: Option<u32>,
    /// Worker threads for quantization (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// GPTQ calibration data: text (tokenized with the checkpoint's tokenizer.json) or token
    /// ids (integers separated by spaces or commas). Without it, GPTQ calibrates on text the
    /// model samples itself (temperature 1).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Most calibration tokens read or generated (a fifth of the positions is held out to
    /// measure the error).
    #[arg(long, default_value_t = pack::DEFAULT_CALIB_TOKENS)]
    calib_tokens: usize,
    /// Seed of data-free calibration sampling.
    #[arg(long, default_value_t = 0)]
    calib_seed: u64,
    /// GPTQ dampening, as a fraction of the Hessian's mean diagonal.
    #[arg(long, default_value_t = 0.01)]
    damp: f64,
    /// An expert matrix reached by fewer calibration rows than this many per input feature is
    /// quantized against the layer's pooled rows instead of its own.
    #[arg(long, default_value_t = pack::DEFAULT_MIN_ROWS_PER_FEATURE)]
    min_rows_per_feature: usize,
}

impl ConvertArgs {
    fn options(&self) -> Result<ConvertOptions> {
        Ok(ConvertOptions {
            quant: match self.quant {
                Quant::Rtn => QuantMethod::Rtn,
                Quant::Gptq => QuantMethod::Gptq,
            },
            target: TargetPrecision::parse(&self.target)?,
            draft_bits: self.draft_bits,
            threads: self.threads,
            calib: self.calib.clone(),
            calib_tokens: self.calib_tokens,
            calib_seed: self.calib_seed,
            damp: self.damp,
            min_rows_per_feature: self.min_rows_per_feature,
        })
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Quant {
    Rtn,
    Gptq,
}

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`specter-pack inspect B | head`), as command-line tools do,
    // instead of panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert(args) => convert(args),
        Command::Synth {
            preset,
            fixture,
            config,
            layers,
            output,
            seed,
            std,
            shard_mib,
        } => synth(
            SynthModel {
                preset,
                fixture,
                config,
                layers,
            },
            output,
            (seed, std, shard_mib),
        ),
        Command::Verify { bundle } => verify(bundle),
        Command::Inspect {
            bundle,
            json,
            tensors,
        } => inspect(bundle, json, tensors),
        Command::Ship {
            bundle,
            output,
            chunk_mib,
            level,
            no_shuffle,
            no_verify,
            force,
            json,
        } => ship_bundle(
            bundle,
            output,
            ShipOptions {
                chunk_size: chunk_mib.saturating_mul(1 << 20),
                level,
                shuffle: !no_shuffle,
                verify: !no_verify,
                force,
            },
            json,
        ),
        Command::Unship {
            shipped,
            output,
            force,
        } => unship_bundle(shipped, output, force),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
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

impl ShipProgress for Bar {
    fn stage(&self, message: &str, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(0);
        }
        pack::Progress::stage(self, message);
    }
    fn advance(&self, bytes: u64) {
        pack::Progress::advance(self, bytes);
    }
}

fn ship_bundle(
    bundle: PathBuf,
    output: PathBuf,
    opts: ShipOptions,
    json: bool,
) -> Result<ExitCode> {
    let bar = Bar::new();
    let report = ship::ship(&bundle, &output, &opts, &bar)
        .with_context(|| format!("shipping {} to {}", bundle.display(), output.display()))?;
    bar.finish();
    let gbps = |bytes: u64, secs: f64| bytes as f64 / 1e9 / secs.max(1e-9);
    if json {
        let kinds: Vec<serde_json::Value> = report
            .kinds
            .iter()
            .map(|k| {
                serde_json::json!({
                    "kind": k.kind, "bytes": k.bytes, "compressed": k.compressed,
                    "ratio": k.ratio(), "chunks": k.chunks, "shuffled_chunks": k.shuffled,
                })
            })
            .collect();
        let record = serde_json::json!({
            "output": report.output.display().to_string(),
            "bundle_bytes": report.original_len,
            "shipped_bytes": report.shipped_len,
            "ratio": report.ratio(),
            "chunks": report.chunks,
            "chunk_size": opts.chunk_size,
            "level": opts.level,
            "shuffle": opts.shuffle,
            "verified": report.verified,
            "verify_s": report.verify_secs,
            "compress_s": report.compress_secs,
            "kinds": kinds,
        });
        println!("{}", serde_json::to_string_pretty(&record)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "wrote {} ({:.3} GB from {:.3} GB, ratio {:.3}, {} chunks) in {:.1} s ({:.2} GB/s of bundle)",
        report.output.display(),
        report.shipped_len as f64 / 1e9,
        report.original_len as f64 / 1e9,
        report.ratio(),
        report.chunks,
        report.compress_secs,
        gbps(report.original_len, report.compress_secs),
    );
    if report.verified {
        println!(
            "  every section's sha256 checked first in {:.1} s ({:.2} GB/s)",
            report.verify_secs,
            gbps(report.original_len, report.verify_secs)
        );
    } else {
        println!("  sections not verified before shipping (--no-verify); unship verifies them");
    }
    println!(
        "  {:<10} {:>14} {:>14} {:>7} {:>7} {:>9}",
        "kind", "bytes", "compressed", "ratio", "chunks", "shuffled"
    );
    for k in &report.kinds {
        println!(
            "  {:<10} {:>14} {:>14} {:>7.3} {:>7} {:>9}",
            k.kind,
            k.bytes,
            k.compressed,
            k.ratio(),
            k.chunks,
            k.shuffled
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn unship_bundle(shipped: PathBuf, output: PathBuf, force: bool) -> Result<ExitCode> {
    let bar = Bar::new();
    let report = ship::unship(&shipped, &output, &UnshipOptions { force }, &bar)
        .with_context(|| format!("unshipping {} to {}", shipped.display(), output.display()))?;
    bar.finish();
    let secs = report.decompress_secs.max(1e-9);
    println!(
        "wrote {} ({:.3} GB from {:.3} GB, {} chunks checked) in {:.1} s ({:.2} GB/s of bundle); \
         {} sections verified in {:.1} s",
        report.output.display(),
        report.original_len as f64 / 1e9,
        report.shipped_len as f64 / 1e9,
        report.chunks,
        report.decompress_secs,
        report.original_len as f64 / 1e9 / secs,
        report.sections_verified,
        report.verify_secs,
    );
    Ok(ExitCode::SUCCESS)
}

fn convert(args: ConvertArgs) -> Result<ExitCode> {
    let opts = args.options()?;
    let (hf_dir, output) = (args.hf_dir, args.output);
    if opts.threads == Some(0) {
        anyhow::bail!("--threads must be at least 1");
    }
    if matches!(args.quant, Quant::Rtn) && opts.calib.is_some() {
        anyhow::bail!("--calib applies to --quant gptq only");
    }
    if opts.calib_tokens == 0 {
        anyhow::bail!("--calib-tokens must be at least 1");
    }
    if !(opts.damp.is_finite() && opts.damp >= 0.0) {
        anyhow::bail!("--damp must be a finite number >= 0");
    }
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
    let p = &report.precision;
    let target = match p.target_bits {
        16 => "FP16 target".to_string(),
        b => format!("INT{b} target"),
    };
    match opts.quant {
        QuantMethod::Rtn => {
            println!(
                "  {} shared tensors, {} MoE layers x {} experts; {target}, {}-bit draft ({}), \
                 mean relative weight error {:.4}",
                report.shared_tensors,
                report.moe_layers,
                report.experts_per_layer,
                p.draft_bits,
                opts.quant.name(),
                report.mean_rel_err
            );
            if let Some(e) = report.target_rel_err {
                println!("  {target}: mean relative weight error {e:.4}");
            }
        }
        QuantMethod::Gptq => {
            println!(
                "  {} shared tensors, {} MoE layers x {} experts; {target}, {}-bit draft (gptq, \
                 damp {})",
                report.shared_tensors,
                report.moe_layers,
                report.experts_per_layer,
                p.draft_bits,
                opts.damp
            );
            println!(
                "  calibration ({:.1} s, {} tokens): {}",
                report.calibration_secs, report.calib_tokens, report.calibration
            );
            let gptq = match report.mean_rel_err_gptq {
                Some(g) => format!(
                    "{g:.4} ({:+.1}%)",
                    (g / report.mean_rel_err.max(f64::MIN_POSITIVE) - 1.0) * 100.0
                ),
                None => "n/a (no matrix had enough calibration rows)".to_string(),
            };
            println!(
                "  draft held-out mean relative output error: rtn {:.4}, gptq {gptq}; {} matrices \
                 on the layer's pooled rows, {} stored as rtn (too few rows or GPTQ failed)",
                report.mean_rel_err, report.pooled_fallbacks, report.rtn_fallbacks
            );
            if let (Some(rtn), gptq) = (report.target_rel_err, report.target_rel_err_gptq) {
                let gptq = gptq.map_or("n/a".to_string(), |g| format!("{g:.4}"));
                println!(
                    "  {target} held-out mean relative output error: rtn {rtn:.4}, gptq {gptq}"
                );
            }
        }
    }
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
        let p = &bundle.manifest().precision;
        println!(
            "{}: ok, {} target, {}-bit draft, {} sections, {:.2} GB verified in {:.2} s ({:.2} \
             GB/s)",
            path.display(),
            match p.target_bits.to_native() {
                16 => "FP16".to_string(),
                b => format!("INT{b}"),
            },
            p.draft_bits,
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

/// One line on how a copy of the experts was quantized, and one on its mean error.
fn print_quant(label: &str, q: &specter_format::QuantInfo) {
    println!(
        "{label} INT{} {} (group {}, {}symmetric, act-order {}), calibration: {}",
        q.bits,
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
            "{label} mean relative error over {} matrices: rtn {rtn:.4}",
            q.stats.len()
        );
        if !gptq.is_empty() {
            print!(", gptq {:.4}", gptq.iter().sum::<f64>() / gptq.len() as f64);
        }
        println!();
    }
}

fn inspect(path: PathBuf, json: bool, tensors: bool) -> Result<ExitCode> {
    let t0 = Instant::now();
    let bundle = Bundle::open(&path)?;
    let open_us = t0.elapsed().as_secs_f64() * 1e6;
    let manifest = bundle.to_manifest()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("bundle       {}", path.display());
    println!("architecture {}", manifest.architecture);
    let header = bundle.header();
    println!(
        "format       {}.{}{}",
        header.major,
        header.minor,
        if header.major < specter_format::FORMAT_MAJOR {
            " (read as an FP16 target with a 4-bit draft, which it holds)"
        } else {
            ""
        }
    );
    println!(
        "file size    {} bytes ({:.3} GB)",
        bundle.file_len(),
        bundle.file_len() as f64 / 1e9
    );
    println!("opened in    {open_us:.0} us (header and manifest checked; no tensor bytes read)");
    let p = &manifest.provenance;
    println!("written by   {} {}", p.tool, p.tool_version);
    let precision = &manifest.precision;
    if precision.target_bits == 16 {
        println!("target       FP16 experts");
    } else {
        print_quant("target      ", &precision.target_quant);
    }
    print_quant("draft       ", &p.quant);
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
        "\n{} tensors, {} target expert blobs",
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

#[allow(clippy::too_many_arguments)]
/// Which model `synth` writes: a preset (optionally cut to `layers`), a fixture or a config file.
struct SynthModel {
    preset: Option<String>,
    fixture: Option<String>,
    config: Option<PathBuf>,
    layers: Option<usize>,
}

fn synth(
    model: SynthModel,
    output: PathBuf,
    (seed, std, shard_mib): (u64, f32, u64),
) -> Result<ExitCode> {
    if !(std.is_finite() && std > 0.0) {
        anyhow::bail!("--std must be a positive number");
    }
    if shard_mib == 0 {
        anyhow::bail!("--shard-mib must be at least 1");
    }
    let SynthModel {
        preset,
        fixture,
        config,
        layers,
    } = model;
    let config_json = match (&preset, &fixture, &config) {
        (Some(name), _, _) => specter_convert::synth::preset_config_layers(name, layers)?,
        (None, Some(model_type), _) => {
            if layers.is_some() {
                anyhow::bail!("--layers applies to --preset only");
            }
            specter_convert::synth::fixture_config(model_type)?
        }
        (None, None, Some(path)) => {
            if layers.is_some() {
                anyhow::bail!("--layers applies to --preset only");
            }
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the config {}", path.display()))?
        }
        (None, None, None) => {
            anyhow::bail!("give --preset NAME, --fixture MODEL_TYPE or --config config.json")
        }
    };
    let cfg = specter::arch::ArchConfig::from_config_json(&config_json)?;
    let tensors = specter::arch::expected_tensors(&cfg);
    let bytes: u64 = tensors
        .iter()
        .map(|t| t.shape.iter().product::<usize>() as u64 * 2)
        .sum();
    let t0 = Instant::now();
    specter_convert::synth::write_checkpoint(
        &output,
        &config_json,
        &tensors,
        seed,
        shard_mib << 20,
        std,
    )
    .with_context(|| format!("writing {}", output.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "wrote {} ({}, {} layers, {} tensors, {:.2} GB of FP16) in {:.1} s ({:.2} GB/s)",
        output.display(),
        cfg.model_type.as_str(),
        cfg.num_layers,
        tensors.len(),
        bytes as f64 / 1e9,
        secs,
        bytes as f64 / 1e9 / secs.max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}
