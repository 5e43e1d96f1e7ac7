//! The prefill protocol (`bench --prompt-tokens 512,2048,8192`): for each prompt length, each
//! mode's time to first token over random prompts of that many ids, and the prefill rate it
//! implies (prompt tokens over TTFT). The decode protocol's machinery runs it: every mode, its
//! residency and its token check against target-only decoding are the same; each run generates
//! two tokens, the least the protocol takes, and only the first one's time is read.

use serde::Serialize;

use super::{median, synthetic_prompts, BenchCase, BenchOptions, BenchReport};
use specter::{Error, Result};

/// New tokens per prefill run: the decode protocol's least.
const NEW_TOKENS: usize = 2;

/// One mode at one prompt length.
#[derive(Clone, Debug, Serialize)]
pub struct PrefillRow {
    pub mode: &'static str,
    pub resident_experts: Option<usize>,
    pub prompt_tokens: usize,
    /// Over every prompt and repeat.
    pub median_ttft_ms: f64,
    pub min_ttft_ms: f64,
    /// `prompt_tokens` over the median TTFT.
    pub prefill_tokens_per_s: f64,
    pub peak_vram_bytes: Option<u64>,
    /// The share of runs whose tokens equal target-only decoding's.
    pub agreement: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PrefillReport {
    pub bundle: String,
    pub backend: &'static str,
    pub device: String,
    pub case: BenchCase,
    /// Prompts per length, and runs per prompt.
    pub prompts: usize,
    pub repeats: usize,
    /// How a CUDA backend runs prompt passes: "tensor cores" or "gemv" (the decode kernels).
    pub prompt_passes: &'static str,
    pub rows: Vec<PrefillRow>,
    /// The decode protocol's whole report at each length, in `rows`' order of lengths.
    pub reports: Vec<BenchReport>,
}

/// Runs `opts`' modes on `count` random prompts of each length in `lengths` (ids below
/// `vocab`); `progress(done, total)` after each run.
pub fn run(
    path: &std::path::Path,
    opts: &BenchOptions,
    lengths: &[usize],
    vocab: usize,
    count: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<PrefillReport> {
    if lengths.is_empty() || lengths.contains(&0) {
        return Err(Error::Request(
            "--prompt-tokens needs one or more prompt lengths of at least one token".into(),
        ));
    }
    let per_length = opts.modes.len() * count * opts.repeats;
    let total = per_length * lengths.len();
    let mut rows = Vec::new();
    let mut reports = Vec::new();
    for (i, &n) in lengths.iter().enumerate() {
        let at = BenchOptions {
            backend: opts.backend,
            case: opts.case,
            modes: opts.modes.clone(),
            prompts: synthetic_prompts(vocab, count, n, n as u64),
            new_tokens: NEW_TOKENS,
            repeats: opts.repeats,
            cuda: opts.cuda.clone(),
            sampling: opts.sampling,
            auto_host: opts.auto_host,
        };
        let report = super::run(path, &at, &mut |done, _| {
            progress(i * per_length + done, total)
        })?;
        for m in &report.modes {
            let ttfts: Vec<f64> = report
                .runs
                .iter()
                .filter(|r| r.mode == m.mode)
                .map(|r| r.ttft_ms)
                .collect();
            let median_ttft_ms = median(&ttfts);
            rows.push(PrefillRow {
                mode: m.mode,
                resident_experts: m.resident_experts,
                prompt_tokens: n,
                median_ttft_ms,
                min_ttft_ms: ttfts.iter().copied().fold(f64::INFINITY, f64::min),
                prefill_tokens_per_s: if median_ttft_ms > 0.0 {
                    n as f64 / (median_ttft_ms / 1e3)
                } else {
                    0.0
                },
                peak_vram_bytes: m.peak_vram_bytes,
                agreement: m.agreement,
            });
        }
        reports.push(report);
    }
    let first = &reports[0];
    Ok(PrefillReport {
        bundle: first.bundle.clone(),
        backend: first.backend,
        device: first.device.clone(),
        case: opts.case,
        prompts: count,
        repeats: opts.repeats,
        prompt_passes: if specter::backend::cuda::PROMPT_TENSOR_CORES {
            "tensor cores"
        } else {
            "gemv"
        },
        rows,
        reports,
    })
}

/// A markdown table of the rows, modes grouped by prompt length.
pub fn render_markdown(r: &PrefillReport) -> String {
    let mut s = format!(
        "prefill: {} ({} backend{}), case {}: {} random prompt(s) a length, {} run(s) each; TTFT \
         from the call to the first token, prefill rate = prompt tokens / median TTFT; prompt \
         passes on {}\n\n",
        r.bundle,
        r.backend,
        if r.device.is_empty() {
            String::new()
        } else {
            format!(", {}", r.device)
        },
        r.case.name,
        r.prompts,
        r.repeats,
        r.prompt_passes
    );
    s.push_str(
        "| mode | experts in VRAM | prompt tokens | TTFT ms (median) | TTFT ms (min) | prefill \
         tokens/s | peak VRAM GiB | agreement |\n|---|---|---|---|---|---|---|---|\n",
    );
    for row in &r.rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.0} | {} | {:.0}% |\n",
            row.mode,
            row.resident_experts
                .map_or("all".to_string(), |n| n.to_string()),
            row.prompt_tokens,
            row.median_ttft_ms,
            row.min_ttft_ms,
            row.prefill_tokens_per_s,
            row.peak_vram_bytes.map_or("-".to_string(), |b| format!(
                "{:.2}",
                b as f64 / (1u64 << 30) as f64
            )),
            row.agreement * 100.0
        ));
    }
    s
}
