//! The smaller subcommands: `probe`, `profile`, `demo` and `doctor`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use specter::decode::Sampling;
use specter::depth_profile::Candidate;
use specter::session::{BackendKind, Session, SessionOptions};
use specter::with_session_model;

use crate::args::{cuda_options_from_env, slot_policy, BackendArg, ProfileArgs};

/// What `probe` reads its tokens from.
pub struct ProbeInput {
    pub prompt: Option<String>,
    pub prompt_ids: Option<Vec<u32>>,
    pub calib: Option<PathBuf>,
    pub max_tokens: usize,
}

pub fn probe(
    path: PathBuf,
    input: ProbeInput,
    depth: usize,
    backend: BackendArg,
    json: bool,
) -> Result<()> {
    let mut opts = SessionOptions::new(crate::args::resolve_backend(backend));
    opts.cuda = cuda_options_from_env()?;
    let session = Session::open_with(&path, &opts)?;
    let tokens = match (input.prompt, input.prompt_ids, input.calib) {
        (Some(text), _, _) => session.encode(&text)?,
        (None, Some(ids), _) => ids,
        (None, None, Some(file)) => specter_convert::pack::read_calibration_tokens(
            &file,
            session.tokenizer.as_ref(),
            input.max_tokens,
        )?,
        (None, None, None) => {
            bail!("give tokens to probe with --prompt, --prompt-ids or --calib FILE")
        }
    };
    let probe_opts = specter_run::probe::ProbeOptions { window: depth };
    let report = with_session_model!(session, |m| specter_run::probe::probe(
        m,
        &tokens,
        &probe_opts
    ))?;
    if json {
        println!("{}", specter_run::probe::render_json(&report)?);
    } else {
        print!("{}", specter_run::probe::render_text(&report));
    }
    Ok(())
}

/// What `eval` compares, on what.
#[derive(clap::Args)]
pub struct EvalArgs {
    pub bundle: PathBuf,
    /// The bundle to compare with (the same model, same tokenizer).
    #[arg(long)]
    pub reference: PathBuf,
    /// A file of text (tokenized with the bundle's tokenizer) or of token ids.
    #[arg(long)]
    pub text: PathBuf,
    /// Most tokens read from --text.
    #[arg(long, default_value_t = specter_run::eval::DEFAULT_TOKENS)]
    pub tokens: usize,
    /// Tokens per teacher-forced window.
    #[arg(long, default_value_t = specter_run::eval::DEFAULT_CONTEXT)]
    pub context: usize,
    /// Leave each window's first N positions unscored (llama.cpp's `perplexity` scores only the
    /// second half of each window: `--score-from` half of `--context` does the same).
    #[arg(long, default_value_t = 0)]
    pub score_from: usize,
    /// auto: CUDA when a usable GPU is found, else the CPU (stderr says which and why). Both
    /// bundles are loaded at once.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    #[arg(long)]
    pub json: bool,
}

pub fn eval(input: EvalArgs) -> Result<()> {
    if input.tokens < 2 {
        bail!("--tokens must be at least 2");
    }
    let mut opts = SessionOptions::new(crate::args::resolve_backend(input.backend));
    opts.cuda = cuda_options_from_env()?;
    let tested = Session::open_with(&input.bundle, &opts)?;
    let reference = Session::open_with(&input.reference, &opts)?;
    let differs = if tested.bundle.architecture() != reference.bundle.architecture()
        || tested.bundle.hyperparameters_json() != reference.bundle.hyperparameters_json()
    {
        Some("models (architecture or shapes)")
    } else if tested.bundle.tokenizer_bytes() != reference.bundle.tokenizer_bytes() {
        Some("tokenizers")
    } else {
        None
    };
    if let Some(what) = differs {
        bail!(
            "{} and {} hold different {what}: eval compares two copies of one model",
            input.bundle.display(),
            input.reference.display()
        );
    }
    let tokens = specter_convert::pack::read_calibration_tokens(
        &input.text,
        tested.tokenizer.as_ref(),
        input.tokens,
    )?;
    let eval_opts = specter_run::eval::EvalOptions {
        context: input.context,
        score_from: input.score_from,
    };
    let report = with_session_model!(tested, |t| with_session_model!(reference, |r| {
        specter_run::eval::eval(t, r, &tokens, &eval_opts)
    }))?;
    if input.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!(
            "{}",
            specter_run::eval::render_text(
                &report,
                &input.bundle.display().to_string(),
                &input.reference.display().to_string()
            )
        );
    }
    Ok(())
}

pub fn demo(
    arch: String,
    dir: Option<PathBuf>,
    max_new_tokens: usize,
    depth: usize,
    backend: BackendArg,
) -> Result<()> {
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
    let opts = specter_run::demo::DemoOptions {
        architecture: arch,
        max_new_tokens,
        depth,
        backend: crate::args::resolve_backend(backend),
        cuda: cuda_options_from_env()?,
        ..Default::default()
    };
    println!(
        "Specter demo: {} (random weights, so the tokens mean nothing; the mechanics are real)",
        opts.architecture
    );
    specter_run::demo::run(&work_dir, &opts, &mut |line| println!("{line}"))?;
    println!("done. Next: convert a real checkpoint with `specter-pack convert HF_DIR -o model.specter`.");
    Ok(())
}

pub fn doctor(json: bool, device: usize, no_gpu: bool, work_dir: PathBuf) -> Result<()> {
    let opts = specter_run::doctor::DoctorOptions {
        device,
        gpu: !no_gpu,
        work_dir,
        ..Default::default()
    };
    let report = specter_run::doctor::diagnose(&opts);
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", specter_run::doctor::render_text(&report));
    }
    Ok(())
}

pub fn profile(args: ProfileArgs) -> Result<()> {
    let backend = crate::args::resolve_backend(args.backend);
    let mut opts = SessionOptions::new(backend);
    opts.cuda = cuda_options_from_env()?;
    args.hybrid.apply(&mut opts.cuda)?;
    // The host path is measured as candidates beside the sweeps, not within them.
    let host = opts
        .cuda
        .host_experts
        .take()
        .map(|threads| opts.cuda.host_experts_config(threads));
    if let Some(n) = args.resident_experts {
        if backend != BackendKind::Cuda {
            bail!(
                "--resident-experts needs --backend cuda when profiling (real copies are measured)"
            );
        }
        opts.offload = Some((n, slot_policy(args.policy)));
    } else if host.is_some() {
        bail!("--host-experts auto needs --resident-experts when profiling (the host path computes offloaded experts)");
    }
    let mut report = {
        let session = Session::open_with(&args.bundle, &opts)?;
        let mut report = specter_run::profile::sweep(
            &session,
            &args.prompt_ids,
            args.new_tokens,
            &args.depths,
            args.repeats,
            Sampling::greedy(),
        )?;
        if let (Some(h), Some(depth)) = (host, report.best_draft_depth()) {
            let ms = specter_run::profile::measure_with_host(
                &session,
                &args.prompt_ids,
                args.new_tokens,
                Some(depth),
                h,
                args.repeats,
                Sampling::greedy(),
            )?;
            report.record_host_draft(h.threads, depth, ms);
        }
        report
    };
    if let Some((resident, policy)) = opts.offload {
        // Plain decoding with the draft's memory as slots: what auto depth falls back to.
        let bundle = specter_format::Bundle::open(&args.bundle)?;
        let experts = specter::arch::ArchConfig::from_config_json(bundle.hyperparameters_json())?
            .moe
            .num_experts;
        let slots = match args.plain_experts {
            Some(n) => n,
            None => (resident + specter_run::profile::draft_slot_equivalent(&bundle)?).min(experts),
        };
        drop(bundle);
        let mut plain_opts = opts.clone();
        plain_opts.with_draft = false;
        plain_opts.offload = Some((slots, policy));
        let session = Session::open_with(&args.bundle, &plain_opts)?;
        let tpot_ms = specter_run::profile::measure_plain(
            &session,
            &args.prompt_ids,
            args.new_tokens,
            args.repeats,
            Sampling::greedy(),
        )?;
        report.plain = Some(specter::depth_profile::PlainCandidate { slots, tpot_ms });
        if let Some(h) = host {
            let ms = specter_run::profile::measure_with_host(
                &session,
                &args.prompt_ids,
                args.new_tokens,
                None,
                h,
                args.repeats,
                Sampling::greedy(),
            )?;
            report.record_host_plain(h.threads, ms);
        }
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
    if let Some(h) = &report.host {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |t| format!("{t:.3} ms"));
        println!(
            "with the host path ({} threads): plain {}, draft at depth {} {}",
            h.threads,
            ms(h.plain_tpot_ms),
            h.depth,
            ms(h.draft_tpot_ms)
        );
    }
    let slots = report.plain.as_ref().map_or(0, |p| p.slots);
    let threads = report.host.as_ref().map_or(0, |h| h.threads);
    let best = match report.choice() {
        Candidate::Draft => format!(
            "best depth {} ({})",
            report.best_depth, report.key.residency
        ),
        Candidate::Plain => {
            format!("best: plain decoding without the draft at {slots} slots per layer")
        }
        Candidate::Hybrid => format!(
            "best: hybrid, plain decoding without the draft at {slots} slots per layer, part of \
             the misses on {threads} host threads"
        ),
        Candidate::SpecterHybrid => format!(
            "best: specter-hybrid, the draft from depth {} ({}), part of the misses on {threads} \
             host threads",
            report.best_depth, report.key.residency
        ),
    };
    println!("{best}, written to {}", args.output.display());
    Ok(())
}
