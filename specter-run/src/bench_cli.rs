//! `specter-run bench`: the paper's protocol from the command line (the protocol itself is
//! `specter_run::bench`).

use std::io::IsTerminal;

use anyhow::{bail, Context, Result};

use crate::args::{cuda_options_from_env, BenchArgs};

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

pub fn bench(args: BenchArgs) -> Result<()> {
    use specter_run::bench::{self, BenchCase, BenchMode, BenchOptions};
    let mut cuda = cuda_options_from_env()?;
    args.hybrid.apply_bench(&mut cuda)?;
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
    if !args.prompt_tokens.is_empty() && args.plot.is_some() {
        bail!("--plot charts decode TPOT: the prefill protocol (--prompt-tokens) has no chart");
    }
    let backend = crate::args::resolve_backend(args.backend);
    let vocab = || -> Result<usize> {
        let b = specter_format::Bundle::open(&args.bundle)?;
        Ok(specter::arch::ArchConfig::from_config_json(b.hyperparameters_json())?.vocab_size)
    };
    let prompts = match &args.prompts {
        Some(path) => read_bench_prompts(path, &args.bundle)?,
        // The prefill protocol makes its own prompts, one length at a time.
        None if !args.prompt_tokens.is_empty() => Vec::new(),
        None => bench::synthetic_prompts(vocab()?, args.num_prompts, BENCH_PROMPT_TOKENS, 0),
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
        cuda,
        sampling: args.sampling.sampling(),
        auto_host: args.hybrid.host_allowed(),
    };
    let mut progress = |done: usize, total: usize| match &bar {
        Some(bar) => {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        }
        None => eprintln!("bench: {done}/{total} runs"),
    };
    if !args.prompt_tokens.is_empty() {
        let report = bench::prefill::run(
            &args.bundle,
            &opts,
            &args.prompt_tokens,
            vocab()?,
            args.num_prompts,
            &mut progress,
        )?;
        if let Some(bar) = &bar {
            bar.finish_and_clear();
        }
        let table = bench::prefill::render_markdown(&report);
        let json = serde_json::to_string_pretty(&report)? + "\n";
        let runs = report.reports.iter().flat_map(|r| &r.runs);
        let disagreeing = runs.filter(|r| !r.agrees).count();
        return write_reports(&args, &table, &json, None, disagreeing);
    }
    let report = bench::run(&args.bundle, &opts, &mut progress)?;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let table = bench::render_markdown(&report);
    let json = serde_json::to_string_pretty(&report)? + "\n";
    let disagreeing = report.runs.iter().filter(|r| !r.agrees).count();
    write_reports(
        &args,
        &table,
        &json,
        Some(bench::render_svg(&report)),
        disagreeing,
    )
}

/// Prints the table and writes the files asked for; fails when greedy runs (`disagreeing` of
/// them) gave other tokens than target-only decoding.
fn write_reports(
    args: &BenchArgs,
    table: &str,
    json: &str,
    svg: Option<String>,
    disagreeing: usize,
) -> Result<()> {
    print!("{table}");
    let write = |path: &std::path::Path, text: &str| {
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
    };
    if let Some(path) = &args.markdown {
        write(path, table)?;
    }
    if let Some(path) = &args.json {
        write(path, json)?;
    }
    if let (Some(path), Some(svg)) = (&args.plot, svg) {
        write(path, &svg)?;
    }
    // Greedy decoding is lossless token for token; sampled runs agree only in distribution.
    if disagreeing > 0 && args.sampling.sampling().is_greedy() {
        bail!("{disagreeing} run(s) gave tokens different from target-only decoding: see the agreement column");
    }
    Ok(())
}
