//! The arguments of the subcommands with more than a few, and how they map onto library types.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::ValueEnum;
use specter::backend::cuda::CudaOptions;
use specter::decode::Mode;
use specter::generate::{resolve_backend as resolve, BackendChoice};
use specter::offload::Policy;
use specter::session::BackendKind;
use specter::verify_mode::VerifyMode;

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// The bundle written by `specter-pack convert`.
    pub bundle: PathBuf,
    /// Prompt text, tokenized with the bundle's tokenizer.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids (for example 1,2,3).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// specter: the INT4 draft proposes, the FP16 target verifies (output equals target's);
    /// target: the FP16 model alone; draft: the INT4 draft alone (not lossless); specmoeoff: the
    /// SpecMoEOff-style baseline (the INT4 draft with its own KV cache, K = 3, route-frequency
    /// Top-M prefetch after draft steps 0 and 1; output equals target's).
    #[arg(long, value_enum, default_value_t = ModeArg::Specter)]
    pub mode: ModeArg,
    /// Draft tokens per verify pass (with --auto-depth, the most it may use). Default: 8, or 3
    /// (the protocol's K) with --mode specmoeoff.
    #[arg(long)]
    pub depth: Option<usize>,
    /// Choose each round's depth from measured cost per committed token, down to plain target
    /// decoding when speculation does not pay (Specter mode).
    #[arg(long)]
    pub auto_depth: bool,
    /// With --auto-depth: start from the depth a `specter-run profile` measured for this bundle
    /// and machine.
    #[arg(long, requires = "auto_depth")]
    pub profile: Option<PathBuf>,
    /// auto: CUDA when a usable GPU is found, else the CPU (stderr says which and why).
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// Routed experts kept resident per MoE layer; the rest are copied in when needed. On CUDA
    /// they are real copies from the bundle's mapping into VRAM slots under --policy; the CPU
    /// backend simulates the copies at --bandwidth-gbps and reports hits, misses and bytes moved.
    #[arg(long, conflicts_with = "vram_budget")]
    pub resident_experts: Option<usize>,
    /// CUDA: derive --resident-experts from a VRAM budget in GB (weights, draft, expert slots,
    /// and 1 GiB for activations and the KV cache).
    #[arg(long)]
    pub vram_budget: Option<f64>,
    /// CUDA: how expert slots are reused: lru keeps experts and evicts the least recently used,
    /// ondemand copies every expert a pass needs for that pass.
    #[arg(long, value_enum, default_value_t = PolicyArg::Lru)]
    pub policy: PolicyArg,
    /// CUDA: copy offloaded experts through pinned staging buffers even where the bundle's
    /// mapping can be registered for direct DMA.
    #[arg(long)]
    pub pinned_staging: bool,
    /// CUDA: how weights are read from the bundle at load time: read (large pread calls into
    /// pinned buffers), mmap (copies out of a mapping: page faults), direct (O_DIRECT, bypassing
    /// the page cache), or per-tensor (one synchronous copy per tensor, the unbatched path).
    #[arg(long, default_value = "read")]
    pub load_io: String,
    /// CUDA with offloaded experts: wait for the host registration of the expert sections before
    /// the first token, instead of copying through pinned staging until it finishes.
    #[arg(long)]
    pub wait_registration: bool,
    #[command(flatten)]
    pub hybrid: HybridArgs,
    /// Host-to-device bandwidth the CPU simulation of expert copies assumes (GB/s); on CUDA, the
    /// first estimate the prefetch schedule uses.
    #[arg(long, default_value_t = specter::generate::DEFAULT_COPY_BANDWIDTH / 1e9)]
    pub bandwidth_gbps: f64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object (tokens, text, stats) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// How much of the bundle to check first. manifest: the header and manifest checksums and
    /// every range the manifest names, no tensor bytes read. full: also every section's sha256,
    /// hashed while the model loads; a mismatch names the section and nothing is generated.
    /// none: no checksum at all (skips only the header and manifest sha256, which guard
    /// integrity; the manifest's structure and ranges are always checked, since reading tensors
    /// through an unchecked manifest could read outside the file).
    #[arg(long, value_enum, default_value_t = VerifyArg::Manifest)]
    pub verify: VerifyArg,
}

/// Sampling of `generate` and `bench`: sampled runs use speculative rejection sampling, so every
/// mode keeps the target's distribution.
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (the default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1] when sampling.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampling RNG.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn sampling(&self) -> specter::decode::Sampling {
        specter::decode::Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
        }
    }
}

/// The host path for cold experts and the link's pace (CUDA with offloaded experts).
#[derive(clap::Args, Clone, Debug)]
pub struct HybridArgs {
    /// auto: compute part of the missing experts on host threads from the bundle's mapping while
    /// the rest are copied (the split follows both paths' measured rates); off (the default):
    /// copy every miss. bench: its hybrid modes take the host path anyway, and its auto mode
    /// measures the host path as a candidate unless this is off.
    #[arg(long, value_enum)]
    pub host_experts: Option<HostExpertsArg>,
    /// Host threads of the host path (default: every core but one, which the decode thread keeps).
    #[arg(long)]
    pub host_threads: Option<usize>,
    /// Paces expert copies to X GB/s to emulate a slower link (25: PCIe 4.0 x16); the hybrid
    /// split starts from it too. Default: unpaced, the split starting from 54 GB/s (a PCIe 5.0
    /// x16 link's pinned copies).
    #[arg(long, value_parser = positive_gbps, value_name = "X")]
    pub link_gbps: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum HostExpertsArg {
    Auto,
    Off,
}

fn positive_gbps(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{text:?} is not a positive number of GB/s")),
    }
}

impl HybridArgs {
    /// Sets the host path and the link's pace in `cuda` as these arguments ask.
    pub fn apply(&self, cuda: &mut CudaOptions) -> Result<()> {
        if self.host_threads.is_some() && self.host_experts != Some(HostExpertsArg::Auto) {
            bail!("--host-threads needs --host-experts auto");
        }
        self.apply_threads_and_pace(cuda)
    }

    /// For bench, whose hybrid modes take the host path themselves: `--host-threads` alone sets
    /// their threads (the modes without the host path ignore it), and the pace applies to all.
    pub fn apply_bench(&self, cuda: &mut CudaOptions) -> Result<()> {
        self.apply_threads_and_pace(cuda)?;
        if let Some(t) = self.host_threads {
            cuda.host_experts = Some(t);
        }
        Ok(())
    }

    fn apply_threads_and_pace(&self, cuda: &mut CudaOptions) -> Result<()> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let Some(t) = self.host_threads {
            if t == 0 || t > cores {
                bail!("--host-threads {t}: this machine has {cores} cores (use 1 to {cores})");
            }
        }
        if let Some(gbps) = self.link_gbps {
            cuda.link_pace_bytes_per_s = Some(gbps * 1e9);
            cuda.link_bytes_per_s = gbps * 1e9;
        }
        cuda.host_experts = match self.host_experts {
            Some(HostExpertsArg::Auto) => Some(
                self.host_threads
                    .unwrap_or_else(specter::host_experts::default_threads),
            ),
            Some(HostExpertsArg::Off) | None => None,
        };
        Ok(())
    }

    /// Whether an automatic choice may take the host path (the user did not turn it off).
    pub fn host_allowed(&self) -> bool {
        self.host_experts != Some(HostExpertsArg::Off)
    }
}

#[derive(clap::Args)]
pub struct BenchArgs {
    pub bundle: PathBuf,
    /// ds_high, ds_low, qwen_high, qwen_low, phi_high, phi_low, or custom (with --depth,
    /// --resident-experts and --matched-experts).
    #[arg(long)]
    pub case: String,
    /// Comma-separated modes: resident, lru, ondemand, specter, auto, specmoeoff (the
    /// SpecMoEOff-style baseline: the INT4 draft with its own KV cache, K = 3, route-frequency
    /// Top-M prefetch, the case's SpecMoEOff residency), hybrid and specter-hybrid (lru and
    /// specter with part of the missing experts computed on host threads; `--host-threads`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "resident,lru,ondemand,specter"
    )]
    pub modes: Vec<String>,
    /// auto: CUDA when a usable GPU is found, else the CPU (stderr says which and why).
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// A file of prompts, one per line: token ids (comma or space separated) or text, each cut
    /// to its first 16 tokens. Default: --num-prompts seeded random prompts of 16 ids.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    #[arg(long, default_value_t = 10)]
    pub num_prompts: usize,
    /// The prefill protocol instead of decode's: for each of these prompt lengths (comma
    /// separated, e.g. 512,2048,8192), --num-prompts random prompts of that many ids, and each
    /// mode's time to first token and prefill tokens a second. Not with --prompts.
    #[arg(long, value_delimiter = ',', conflicts_with = "prompts")]
    pub prompt_tokens: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// custom case: draft depth.
    #[arg(long)]
    pub depth: Option<usize>,
    /// custom case: experts per layer in VRAM for the modes with a draft.
    #[arg(long)]
    pub resident_experts: Option<usize>,
    /// custom case: experts per layer in VRAM for target-only lru and ondemand.
    #[arg(long)]
    pub matched_experts: Option<usize>,
    /// custom case: experts per layer in VRAM for specmoeoff (needed with that mode).
    #[arg(long)]
    pub specmoeoff_experts: Option<usize>,
    /// Write the JSON record (every run and every mode's summary) here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the markdown table here too (it is always printed).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write an SVG bar chart of mean TPOT per mode here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Every run's sampling; temperature 0 (the default) is the paper's greedy protocol.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub hybrid: HybridArgs,
}

#[derive(clap::Args)]
pub struct ProfileArgs {
    pub bundle: PathBuf,
    /// Where to write the profile (JSON).
    #[arg(short, long)]
    pub output: PathBuf,
    /// auto: CUDA when a usable GPU is found, else the CPU (stderr says which and why).
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// CUDA: routed experts kept in VRAM per MoE layer (the rest are copied in).
    #[arg(long)]
    pub resident_experts: Option<usize>,
    #[arg(long, value_enum, default_value_t = PolicyArg::Lru)]
    pub policy: PolicyArg,
    /// Prompt as comma-separated token ids.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20"
    )]
    pub prompt_ids: Vec<u32>,
    /// New tokens per measurement.
    #[arg(long, default_value_t = 48)]
    pub new_tokens: usize,
    /// Depths to measure, comma separated; 0 is plain target decoding.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4,8,16")]
    pub depths: Vec<usize>,
    /// Runs per depth (the median TPOT is kept).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// With --resident-experts: expert slots per layer for the plain candidate (target-only,
    /// no draft). Default: --resident-experts plus the slots the draft's VRAM is worth.
    #[arg(long, requires = "resident_experts")]
    pub plain_experts: Option<usize>,
    /// With --resident-experts, `--host-experts auto` also measures the plain candidate and the
    /// draft at its fastest depth with the host path, for `generate --profile` to choose from.
    #[command(flatten)]
    pub hybrid: HybridArgs,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ModeArg {
    Specter,
    Target,
    Draft,
    Specmoeoff,
}

impl From<ModeArg> for Mode {
    fn from(arg: ModeArg) -> Mode {
        match arg {
            ModeArg::Specter => Mode::Specter,
            ModeArg::Target => Mode::Target,
            ModeArg::Draft => Mode::Draft,
            ModeArg::Specmoeoff => Mode::SpecMoeOff,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum PolicyArg {
    Lru,
    Ondemand,
}

/// The expert-slot policy a `--policy` names (the one place the CLI's names meet the library's).
pub fn slot_policy(arg: PolicyArg) -> Policy {
    match arg {
        PolicyArg::Lru => Policy::Lru,
        PolicyArg::Ondemand => Policy::OnDemand,
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BackendArg {
    Auto,
    Cpu,
    Cuda,
}

impl From<BackendArg> for BackendChoice {
    fn from(arg: BackendArg) -> BackendChoice {
        match arg {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cpu => BackendChoice::Cpu,
            BackendArg::Cuda => BackendChoice::Cuda,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum VerifyArg {
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

/// The backend `arg` names; `auto` is resolved here and says on stderr which it chose and why.
pub fn resolve_backend(arg: BackendArg) -> BackendKind {
    let choice = BackendChoice::from(arg);
    let resolved = resolve(choice);
    if choice == BackendChoice::Auto {
        eprintln!("{}", resolved.describe());
    }
    resolved.kind
}

/// The CUDA options that scripts set through the environment: `SPECTER_LOAD_THREADS=N` sets the
/// threads that read weights at load time. (No variable chooses between forms of a kernel that
/// give the same bits: the measured winners are the only paths.)
pub fn cuda_options_from_env() -> Result<CudaOptions> {
    cuda_options_from(|name| std::env::var(name).ok())
}

fn cuda_options_from(var: impl Fn(&str) -> Option<String>) -> Result<CudaOptions> {
    let mut opts = CudaOptions::default();
    if let Some(value) = var("SPECTER_LOAD_THREADS") {
        match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => opts.load_threads = Some(n),
            _ => bail!("SPECTER_LOAD_THREADS={value:?} is not a number of threads (1 or more)"),
        }
    }
    Ok(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<CudaOptions> {
        cuda_options_from(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn the_environment_maps_onto_the_cuda_options() {
        assert_eq!(from(&[]).unwrap(), CudaOptions::default());
        assert_eq!(
            from(&[("SPECTER_LOAD_THREADS", "3")]).unwrap().load_threads,
            Some(3)
        );
        let err = from(&[("SPECTER_LOAD_THREADS", "0")]).unwrap_err();
        assert!(err.to_string().contains("SPECTER_LOAD_THREADS"), "{err}");
        // Variables that once chose between forms giving the same bits are not read.
        let ignored = from(&[
            ("SPECTER_CUDA_FUSE_SHARED", "0"),
            ("SPECTER_CUDA_GRAPHS", "0"),
        ]);
        assert_eq!(ignored.unwrap(), CudaOptions::default());
    }

    #[derive(clap::Parser)]
    struct Generate {
        #[command(flatten)]
        args: GenerateArgs,
    }

    #[derive(clap::Parser)]
    struct Bench {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn hybrid(words: &[&str]) -> std::result::Result<HybridArgs, clap::Error> {
        use clap::Parser;
        let argv = ["generate", "m.specter", "--prompt", "x"];
        Generate::try_parse_from(argv.iter().chain(words)).map(|g| g.args.hybrid)
    }

    #[test]
    fn host_experts_are_off_unless_asked_for() {
        use clap::Parser;
        let mut cuda = CudaOptions::default();
        hybrid(&[]).unwrap().apply(&mut cuda).unwrap();
        assert_eq!(cuda, CudaOptions::default());
        assert_eq!(cuda.host_experts, None);
        let bench = Bench::try_parse_from(["bench", "m.specter", "--case", "ds_high"]).unwrap();
        bench.args.hybrid.apply(&mut cuda).unwrap();
        assert_eq!(cuda.host_experts, None);
        assert!(bench.args.hybrid.host_allowed());
        let auto = hybrid(&["--host-experts", "auto", "--host-threads", "1"]).unwrap();
        auto.apply(&mut cuda).unwrap();
        assert_eq!(cuda.host_experts, Some(1));
        let off = hybrid(&["--host-experts", "off"]).unwrap();
        assert!(!off.host_allowed());
        off.apply(&mut cuda).unwrap();
        assert_eq!(cuda.host_experts, None);
        let err = hybrid(&["--host-threads", "1"])
            .unwrap()
            .apply(&mut cuda)
            .unwrap_err();
        assert!(err.to_string().contains("--host-experts auto"), "{err}");
    }

    #[test]
    fn bench_takes_host_threads_alone_for_its_hybrid_modes() {
        use clap::Parser;
        let bench_hybrid = |extra: &[&str]| {
            let argv = ["bench", "m.specter", "--case", "ds_high"];
            Bench::try_parse_from(argv.iter().chain(extra))
                .unwrap()
                .args
                .hybrid
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut cuda = CudaOptions::default();
        bench_hybrid(&["--host-threads", "1", "--link-gbps", "25"])
            .apply_bench(&mut cuda)
            .unwrap();
        assert_eq!(cuda.host_experts, Some(1));
        assert_eq!(cuda.link_pace_bytes_per_s, Some(25e9));
        let too_many = (cores + 1).to_string();
        let err = bench_hybrid(&["--host-threads", &too_many])
            .apply_bench(&mut cuda)
            .unwrap_err();
        assert!(err.to_string().contains("cores"), "{err}");
    }

    #[test]
    fn link_gbps_paces_the_copies_and_seeds_the_split() {
        let mut cuda = CudaOptions::default();
        hybrid(&["--link-gbps", "25"])
            .unwrap()
            .apply(&mut cuda)
            .unwrap();
        assert_eq!(cuda.link_pace_bytes_per_s, Some(25e9));
        assert_eq!(cuda.link_bytes_per_s, 25e9);
        assert_eq!(cuda.host_experts_config(2).link_bytes_per_s, 25e9);
        for bad in ["0", "-3", "inf", "NaN", "fast"] {
            let flag = format!("--link-gbps={bad}");
            let err = hybrid(&[&flag]).expect_err(bad);
            assert!(
                err.to_string().contains("not a positive number of GB/s"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_bad_thread_count_is_named() {
        for bad in ["0", "many", "-2"] {
            let err = from(&[("SPECTER_LOAD_THREADS", bad)]).unwrap_err();
            assert!(err.to_string().contains("SPECTER_LOAD_THREADS"), "{err}");
        }
    }
}
