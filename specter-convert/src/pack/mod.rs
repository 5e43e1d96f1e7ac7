//! Conversion of a Hugging Face checkpoint into a bundle: validate every tensor against the
//! architecture's tensor map, write the shared tensors and each MoE layer's target experts (FP16,
//! or quantized to INT8 or INT4; one page-aligned blob per expert), quantize each routed expert
//! for the draft (4, 3 or 2 bits, group 128; Marlin-tiled at 4 bits), and record checksums,
//! sources, the precision and quantization statistics.
//!
//! With `--quant gptq` the FP16 target is first run over calibration sequences (a file, or text
//! the target generates itself) to record each MoE layer's expert inputs; see [`calibrate`].
//!
//! The writer streams: at most one MoE layer's draft experts are held in memory at a time, so a
//! checkpoint larger than RAM converts. Nothing appears under the output path unless every step
//! succeeded (the bundle writer renames a finished temporary file).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod calibrate;
mod calibration_file;
mod chat_files;
mod encode;

pub use calibrate::{HOLDOUT_BLOCK, HOLDOUT_EVERY};
pub use calibration_file::{parse_token_ids, read_calibration_tokens};
pub use chat_files::{chat_file, CHAT_FILES, CHAT_TEMPLATE, GENERATION_CONFIG, TOKENIZER_CONFIG};
pub use encode::TargetPrecision;

use rayon::prelude::*;
use specter::arch::{self, ArchConfig, Proj, TensorRole, TensorSpec};
use specter::weights::WeightStore;
use specter_format::{
    BundleWriter, DType, Precision, Provenance, QuantInfo, QuantStat, SectionKind, SourceFile,
};

use crate::checkpoint::Checkpoint;
use crate::quant::{self, Bits, QuantMatrix, GROUP_SIZE};
use crate::{Error, Result};
use encode::{Encoding, QuantExpert, Role};

/// Which quantizer makes the quantized experts (the draft's, and a quantized target's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMethod {
    /// Round to nearest: no calibration, the floor of draft quality.
    Rtn,
    /// GPTQ with calibration activations from a forward pass of the target.
    Gptq,
}

impl QuantMethod {
    pub fn name(self) -> &'static str {
        match self {
            QuantMethod::Rtn => "rtn",
            QuantMethod::Gptq => "gptq",
        }
    }
}

/// Calibration tokens used when none are given.
pub const DEFAULT_CALIB_TOKENS: usize = 2048;

/// Fewest fitted calibration rows per input feature (k) an expert matrix needs for its own
/// Hessian; below that it is quantized against the layer's pooled rows. GPTQ fitted to a few
/// rows per feature overfits them: on the fixture models, an expert's own rows at about 3 per
/// feature made the held-out error of `down` 8% worse than round-to-nearest, while the pooled
/// rows made it 1% better; at about 7 per feature both were on par.
pub const DEFAULT_MIN_ROWS_PER_FEATURE: usize = 8;

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub quant: QuantMethod,
    /// How the target's routed experts are stored.
    pub target: TargetPrecision,
    /// The draft's bits per weight (4, 3 or 2, fewer than the target's); `None`: the target's
    /// default ([`TargetPrecision::default_draft_bits`]).
    pub draft_bits: Option<u32>,
    /// Worker threads for quantization (None: all cores).
    pub threads: Option<usize>,
    /// GPTQ calibration file (text, tokenized with the checkpoint's tokenizer, or token ids);
    /// `None`: the target generates its own calibration text.
    pub calib: Option<PathBuf>,
    /// Most calibration tokens read or generated.
    pub calib_tokens: usize,
    /// Seed of data-free calibration sampling.
    pub calib_seed: u64,
    /// GPTQ dampening, a fraction of the Hessian's mean diagonal.
    pub damp: f64,
    /// An expert matrix reached by fewer than this many fitted calibration rows per input
    /// feature is quantized against the layer's pooled rows (recorded as "pooled-hessian").
    pub min_rows_per_feature: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            quant: QuantMethod::Rtn,
            target: TargetPrecision::Fp16,
            draft_bits: None,
            threads: None,
            calib: None,
            calib_tokens: DEFAULT_CALIB_TOKENS,
            calib_seed: 0,
            damp: quant::GptqConfig::default().damp,
            min_rows_per_feature: DEFAULT_MIN_ROWS_PER_FEATURE,
        }
    }
}

/// Progress of a long conversion, in bytes of source tensors processed.
pub trait Progress: Sync {
    fn begin(&self, total_bytes: u64);
    fn advance(&self, bytes: u64);
    fn stage(&self, message: &str);
}

/// A progress sink that reports nothing.
pub struct Silent;

impl Progress for Silent {
    fn begin(&self, _: u64) {}
    fn advance(&self, _: u64) {}
    fn stage(&self, _: &str) {}
}

/// What a conversion did.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    pub output: PathBuf,
    pub architecture: String,
    pub bundle_bytes: u64,
    /// Bytes of source tensors read.
    pub source_tensor_bytes: u64,
    pub shared_tensors: usize,
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    /// What the bundle records: the target's and the draft's widths.
    pub precision: Precision,
    /// Mean over the draft's expert matrices of round-to-nearest's relative error: the weight
    /// error without calibration, the held-out output error with it.
    pub mean_rel_err: f64,
    /// Mean held-out relative output error of the draft's GPTQ matrices (None without GPTQ).
    pub mean_rel_err_gptq: Option<f64>,
    /// The same two for a quantized target's matrices (None for an FP16 target).
    pub target_rel_err: Option<f64>,
    pub target_rel_err_gptq: Option<f64>,
    /// Expert matrices quantized against the layer's pooled rows / with RTN after GPTQ failed.
    pub pooled_fallbacks: usize,
    pub rtn_fallbacks: usize,
    /// How the calibration data was obtained ("none" without GPTQ).
    pub calibration: String,
    pub calib_tokens: usize,
    /// Seconds spent obtaining and recording calibration data.
    pub calibration_secs: f64,
    pub ignored_tensors: Vec<String>,
}

/// Converts the checkpoint in `src` into a bundle at `out`.
pub fn convert(
    src: &Path,
    out: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertReport> {
    let run = || convert_inner(src, out, opts, progress);
    match opts.threads {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build()
            .map_err(|e| Error::Io(format!("cannot start {n} worker threads: {e}")))?
            .install(run),
        None => run(),
    }
}

fn convert_inner(
    src: &Path,
    out: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertReport> {
    // Impossible widths are refused before anything is read.
    let draft_bits = opts.target.draft_bits(opts.draft_bits)?;
    let mut encodings = vec![Encoding {
        role: Role::Draft,
        bits: draft_bits,
    }];
    if let Some(bits) = opts.target.quant_bits() {
        encodings.push(Encoding {
            role: Role::Target,
            bits,
        });
    }
    progress.stage("reading checkpoint");
    let ckpt = Checkpoint::open(src)?;
    refuse_overwriting_input(&ckpt, out)?;
    let cfg = ArchConfig::from_config_json(ckpt.config_json())
        .map_err(|e| Error::Model(format!("{}: {e}", src.join("config.json").display())))?;
    let specs = arch::expected_tensors(&cfg);
    let plan = LayoutPlan::new(&cfg, &specs)?;
    let ignored = validate(&ckpt, &specs)?;
    // The runtime loads the tokenizer with the model; one that does not load makes the bundle
    // unusable, so find out now rather than after writing it.
    if let Some(tok) = ckpt.tokenizer_json() {
        tokenizers::Tokenizer::from_bytes(tok).map_err(|e| {
            Error::Model(format!(
                "{}: does not load as a tokenizer: {e}",
                src.join("tokenizer.json").display()
            ))
        })?;
    }
    let chat_files = chat_files::read_chat_files(ckpt.dir())?;
    let started = std::time::Instant::now();
    let calibration = match opts.quant {
        QuantMethod::Rtn => None,
        QuantMethod::Gptq => {
            if !(opts.damp.is_finite() && opts.damp >= 0.0) {
                return Err(Error::Request(format!(
                    "GPTQ damping {} must be a finite number >= 0",
                    opts.damp
                )));
            }
            if let Some(path) = &opts.calib {
                calibrate::check_calib_file(path)?;
            }
            let calib = calibrate::calibrate(&ckpt, &cfg, opts, progress)?;
            if calib.layers.len() != plan.experts.len() {
                return Err(Error::Model(format!(
                    "calibration recorded {} MoE layers, the checkpoint has {}",
                    calib.layers.len(),
                    plan.experts.len()
                )));
            }
            Some(calib)
        }
    };
    let calibration_secs = started.elapsed().as_secs_f64();

    let total: u64 = specs
        .iter()
        .map(|s| s.shape.iter().product::<usize>() as u64 * 2)
        .sum();
    progress.begin(total);

    let mut writer = BundleWriter::create(out)?;

    progress.stage("shared tensors");
    writer.begin_section("shared", SectionKind::Shared)?;
    for spec in specs.iter().filter(|s| s.role == TensorRole::Shared) {
        let t = ckpt.f16(&spec.name)?;
        writer.write_tensor(
            &spec.name,
            DType::F16,
            &dims(&t.shape),
            bytemuck::cast_slice(&t.data),
        )?;
        progress.advance(t.data.len() as u64 * 2);
    }
    writer.end_section()?;

    let (mut stats, mut target_stats) = (Vec::new(), Vec::new());
    for (moe_index, (&layer, experts)) in plan.experts.iter().enumerate() {
        let quantize = || -> Result<Vec<Vec<QuantExpert>>> {
            match &calibration {
                None => experts
                    .par_iter()
                    .enumerate()
                    .map(|(e, names)| quantize_expert(&ckpt, &plan, layer, e, names, &encodings))
                    .collect(),
                Some(calib) => calibrate::gptq_layer(
                    &ckpt,
                    &plan,
                    layer,
                    experts,
                    &calib.layers[moe_index],
                    opts,
                    &encodings,
                ),
            }
        };
        let section = |writer: &mut BundleWriter, kind: SectionKind| -> Result<()> {
            let name = match kind {
                SectionKind::Draft { .. } => format!("draft.{layer}"),
                _ => format!("experts.{layer}"),
            };
            Ok(writer.begin_section(&name, kind)?)
        };
        let target_kind = SectionKind::Experts {
            layer: layer as u32,
        };
        let quantized = if opts.target == TargetPrecision::Fp16 {
            // The FP16 experts stream into the bundle on this thread while the same experts are
            // quantized on the others: the two read the same source pages and share nothing else.
            progress.stage(&format!(
                "layer {layer}: FP16 experts, {draft_bits}-bit draft"
            ));
            let (written, quantized) = rayon::join(
                || -> Result<()> {
                    section(&mut writer, target_kind.clone())?;
                    for (e, names) in experts.iter().enumerate() {
                        writer.begin_expert(layer as u32, e as u32)?;
                        for name in names {
                            let t = ckpt.f16(name)?;
                            writer.write_tensor(
                                name,
                                DType::F16,
                                &dims(&t.shape),
                                bytemuck::cast_slice(&t.data),
                            )?;
                            progress.advance(t.data.len() as u64 * 2);
                        }
                        writer.end_expert()?;
                    }
                    Ok(writer.end_section()?)
                },
                quantize,
            );
            written?;
            quantized?
        } else {
            progress.stage(&format!(
                "layer {layer}: {} experts, {draft_bits}-bit draft",
                opts.target.name()
            ));
            let quantized = quantize()?;
            section(&mut writer, target_kind)?;
            for (e, copies) in quantized.iter().enumerate() {
                writer.begin_expert(layer as u32, e as u32)?;
                for copy in copies.iter().filter(|c| c.encoding.role == Role::Target) {
                    copy.write(&mut writer, layer, e)?;
                }
                writer.end_expert()?;
                progress.advance(plan.expert_source_bytes());
            }
            writer.end_section()?;
            quantized
        };
        section(
            &mut writer,
            SectionKind::Draft {
                layer: layer as u32,
            },
        )?;
        for (e, copies) in quantized.into_iter().enumerate() {
            for copy in copies {
                match copy.encoding.role {
                    Role::Draft => {
                        copy.write(&mut writer, layer, e)?;
                        stats.extend(copy.stats);
                    }
                    Role::Target => target_stats.extend(copy.stats),
                }
            }
        }
        writer.end_section()?;
    }

    if let Some(tok) = ckpt.tokenizer_json() {
        writer.begin_section("tokenizer.json", SectionKind::Tokenizer)?;
        writer.write_raw(tok)?;
        writer.end_section()?;
    }
    for (name, bytes) in &chat_files {
        writer.begin_section(name, SectionKind::Other)?;
        writer.write_raw(bytes)?;
        writer.end_section()?;
    }
    writer.begin_section("config.json", SectionKind::Config)?;
    writer.write_raw(ckpt.config_json().as_bytes())?;
    writer.end_section()?;

    progress.stage("hashing sources");
    let sources: Vec<SourceFile> = ckpt.source_files()?;
    let mean = |values: Vec<f64>| -> Option<f64> {
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    };
    let errors = |stats: &[QuantStat]| {
        let rtn = mean(stats.iter().map(|s| s.rel_err_rtn as f64).collect());
        let gptq = mean(
            stats
                .iter()
                .map(|s| s.rel_err_gptq as f64)
                .filter(|v| v.is_finite())
                .collect(),
        );
        (rtn, gptq)
    };
    let (mean_rel_err, mean_rel_err_gptq) = errors(&stats);
    let mean_rel_err = mean_rel_err.unwrap_or(0.0);
    let (target_rel_err, target_rel_err_gptq) = errors(&target_stats);
    let count = |what: &str| {
        stats
            .iter()
            .chain(&target_stats)
            .filter(|s| s.fallback == what)
            .count()
    };
    let (pooled_fallbacks, rtn_fallbacks) = (count("pooled-hessian"), count("rtn"));
    let (calib_description, calib_tokens) =
        calibration.as_ref().map_or(("none".to_string(), 0), |c| {
            (c.description.clone(), c.tokens)
        });
    drop(calibration);
    let quant_info = |bits: Bits, stats: Vec<QuantStat>| QuantInfo {
        method: opts.quant.name().into(),
        bits: bits.get(),
        group_size: GROUP_SIZE as u32,
        symmetric: true,
        damp: match opts.quant {
            QuantMethod::Rtn => 0.0,
            QuantMethod::Gptq => opts.damp as f32,
        },
        act_order: opts.quant == QuantMethod::Gptq,
        calibration: calib_description.clone(),
        calib_tokens: calib_tokens as u64,
        stats,
    };
    let precision = Precision {
        target_bits: opts.target.bits(),
        draft_bits: draft_bits.get(),
        group_size: GROUP_SIZE as u32,
        target_quant: match opts.target.quant_bits() {
            None => QuantInfo::unquantized(),
            Some(bits) => quant_info(bits, target_stats),
        },
    };
    writer.set_precision(precision.clone());
    let provenance = Provenance {
        tool: "specter-pack".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        sources,
        quant: quant_info(draft_bits, stats),
        notes: ignored
            .iter()
            .map(|n| {
                format!(
                    "ignored source tensor {n} (not used by {})",
                    cfg.model_type.as_str()
                )
            })
            .collect(),
    };
    progress.stage("writing manifest");
    let bundle_bytes = writer.finish(cfg.model_type.as_str(), ckpt.config_json(), provenance)?;
    Ok(ConvertReport {
        output: out.to_path_buf(),
        architecture: cfg.model_type.as_str().to_string(),
        bundle_bytes,
        source_tensor_bytes: total,
        shared_tensors: specs
            .iter()
            .filter(|s| s.role == TensorRole::Shared)
            .count(),
        moe_layers: plan.experts.len(),
        experts_per_layer: plan.experts.values().next().map_or(0, |v| v.len()),
        precision,
        mean_rel_err,
        mean_rel_err_gptq,
        target_rel_err,
        target_rel_err_gptq,
        pooled_fallbacks,
        rtn_fallbacks,
        calibration: calib_description,
        calib_tokens,
        calibration_secs,
        ignored_tensors: ignored,
    })
}

/// The bundle is renamed over whatever `out` names, so an output path naming one of the
/// checkpoint's input files (or a new shard the reader would pick up) would destroy the input.
fn refuse_overwriting_input(ckpt: &Checkpoint, out: &Path) -> Result<()> {
    let (Some(name), Some(parent)) = (out.file_name().and_then(|n| n.to_str()), out.parent())
    else {
        // Not a file path: the bundle writer says why.
        return Ok(());
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let (Ok(out_dir), Ok(ckpt_dir)) = (parent.canonicalize(), ckpt.dir().canonicalize()) else {
        // The output directory does not exist: the bundle writer says so.
        return Ok(());
    };
    let is_input = name.ends_with(".safetensors")
        || [
            "config.json",
            "tokenizer.json",
            crate::checkpoint::INDEX_FILE,
        ]
        .contains(&name);
    if out_dir == ckpt_dir && is_input {
        return Err(Error::Io(format!(
            "output {} would replace the checkpoint's own {name}; write the bundle to another path \
             (for example model.specter)",
            out.display()
        )));
    }
    Ok(())
}

fn dims(shape: &[usize]) -> Vec<u64> {
    shape.iter().map(|&d| d as u64).collect()
}

/// The routed experts of every MoE layer, each as its [gate, up, down] tensor names, plus the
/// expert widths, checked against the tiling's shape rules before anything is written.
struct LayoutPlan {
    experts: BTreeMap<usize, Vec<[String; 3]>>,
    hidden: usize,
    inter: usize,
}

impl LayoutPlan {
    /// Bytes of one expert's FP16 source tensors.
    fn expert_source_bytes(&self) -> u64 {
        3 * (self.hidden * self.inter) as u64 * 2
    }

    fn new(cfg: &ArchConfig, specs: &[TensorSpec]) -> Result<Self> {
        let mut experts: BTreeMap<usize, Vec<[Option<String>; 3]>> = BTreeMap::new();
        for spec in specs {
            if let TensorRole::RoutedExpert {
                layer,
                expert,
                proj,
            } = spec.role
            {
                let slots = experts.entry(layer).or_default();
                if slots.len() <= expert {
                    slots.resize(expert + 1, [None, None, None]);
                }
                let i = match proj {
                    Proj::Gate => 0,
                    Proj::Up => 1,
                    Proj::Down => 2,
                };
                slots[expert][i] = Some(spec.name.clone());
            }
        }
        let (hidden, inter) = cfg.expert_dims();
        let experts = experts
            .into_iter()
            .map(|(layer, slots)| {
                let named = slots
                    .into_iter()
                    .enumerate()
                    .map(|(e, [g, u, d])| match (g, u, d) {
                        (Some(g), Some(u), Some(d)) => Ok([g, u, d]),
                        _ => Err(Error::Model(format!(
                            "layer {layer} expert {e}: the tensor map lacks one of gate/up/down"
                        ))),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((layer, named))
            })
            .collect::<Result<BTreeMap<_, _>>>()?;
        if let Some(names) = experts.values().next().and_then(|v| v.first()) {
            quant::check_marlin_shape(&names[0], hidden, 2 * inter)?;
            quant::check_marlin_shape(&names[2], inter, hidden)?;
        }
        Ok(LayoutPlan {
            experts,
            hidden,
            inter,
        })
    }
}

/// Every expected tensor must exist with its expected shape; returns the checkpoint's tensors that
/// the architecture does not use.
fn validate(ckpt: &Checkpoint, specs: &[TensorSpec]) -> Result<Vec<String>> {
    for spec in specs {
        if !ckpt.contains(&spec.name) {
            return Err(Error::Model(format!(
                "{}: missing tensor {} (expected shape {:?})",
                ckpt.dir().display(),
                spec.name,
                spec.shape
            )));
        }
        let shape = ckpt.shape(&spec.name)?;
        if shape != spec.shape {
            return Err(Error::Model(format!(
                "{}: tensor {} has shape {:?}, expected {:?} from config.json",
                ckpt.dir().display(),
                spec.name,
                shape,
                spec.shape
            )));
        }
    }
    let expected: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let mut ignored: Vec<String> = ckpt
        .tensor_names()
        .into_iter()
        .filter(|n| !expected.contains(n.as_str()))
        .collect();
    ignored.sort();
    Ok(ignored)
}

/// One expert's FP16 weights in f32, Hugging Face orientation: gate and up `[inter][hidden]`
/// each, down `[hidden][inter]`.
fn load_expert(ckpt: &Checkpoint, names: &[String; 3]) -> Result<[Vec<f32>; 3]> {
    let load = |name: &str| -> Result<Vec<f32>> {
        let t = ckpt.f16(name)?;
        Ok(t.data.iter().map(|v| v.to_f32()).collect())
    };
    Ok([load(&names[0])?, load(&names[1])?, load(&names[2])?])
}

/// Round-to-nearest copies of one routed expert, one per encoding.
fn quantize_expert(
    ckpt: &Checkpoint,
    plan: &LayoutPlan,
    layer: usize,
    expert: usize,
    names: &[String; 3],
    encodings: &[Encoding],
) -> Result<Vec<QuantExpert>> {
    let (h, i) = (plan.hidden, plan.inter);
    let [gate, up, down] = load_expert(ckpt, names)?;
    encodings
        .iter()
        .map(|&encoding| {
            let bits = encoding.bits;
            let qg = quant::rtn(&names[0], &gate, i, h, bits)?;
            let qu = quant::rtn(&names[1], &up, i, h, bits)?;
            let qd = quant::rtn(&names[2], &down, h, i, bits)?;
            let name = |part| encoding.role.tensor_name(layer, expert, part, "qweight");
            let stats = vec![
                stat(name("gate_up"), &[(&gate, &qg), (&up, &qu)]),
                stat(name("down"), &[(&down, &qd)]),
            ];
            QuantExpert::new(encoding, &QuantMatrix::concat_n(&qg, &qu)?, &qd, stats)
        })
        .collect()
}

/// Relative Frobenius error of the dequantized weights: the expected relative output error for
/// isotropic inputs, which is what RTN is judged on before any calibration data exists.
fn stat(tensor: String, parts: &[(&Vec<f32>, &QuantMatrix)]) -> QuantStat {
    let (mut err, mut norm) = (0f64, 0f64);
    for (w, q) in parts {
        let dq = q.dequantize_out_in();
        for (a, b) in w.iter().zip(&dq) {
            err += ((a - b) as f64).powi(2);
            norm += (*a as f64).powi(2);
        }
    }
    let rel = if norm > 0.0 { (err / norm).sqrt() } else { 0.0 };
    QuantStat {
        tensor,
        rel_err_rtn: rel as f32,
        rel_err_gptq: f32::NAN,
        calib_tokens: 0,
        fallback: "none".into(),
    }
}
