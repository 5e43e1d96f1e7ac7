//! `specter-run generate`: the arguments as a [`GenerationRequest`], text streamed as tokens
//! commit, then the report as JSON or as one summary line.

use std::io::Write;

use anyhow::Result;
use specter::backend::cuda::{HostPath, LoadIo};
use specter::generate::{
    generate as run_request, Committed, GenerationHooks, GenerationReport, GenerationRequest,
    Prompt, Residency,
};

use crate::args::{cuda_options_from_env, slot_policy, GenerateArgs};

pub fn generate(args: GenerateArgs) -> Result<()> {
    let mut cuda = cuda_options_from_env()?;
    cuda.load_io = LoadIo::parse(&args.load_io)?;
    if args.pinned_staging {
        cuda.host_path = HostPath::PinnedStaging;
    }
    args.hybrid.apply(&mut cuda)?;
    let prompt = match (args.prompt, args.prompt_ids) {
        (Some(text), _) => Prompt::Text(text),
        (None, Some(ids)) => Prompt::Ids(ids),
        (None, None) => anyhow::bail!("give a prompt with --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let residency = match (args.resident_experts, args.vram_budget) {
        (Some(n), _) => Residency::Experts(n),
        (None, Some(gb)) => Residency::VramBudgetGb(gb),
        (None, None) => Residency::All,
    };
    let request = GenerationRequest {
        max_new_tokens: args.max_new_tokens,
        mode: args.mode.into(),
        depth: args.depth,
        auto_depth: args.auto_depth,
        profile: args.profile,
        backend: args.backend.into(),
        residency,
        policy: slot_policy(args.policy),
        sampling: args.sampling.sampling(),
        stop_at_eos: !args.ignore_eos,
        verify: args.verify.into(),
        cuda,
        copy_bandwidth: args.bandwidth_gbps * 1e9,
        wait_registration: args.wait_registration,
        ..GenerationRequest::new(args.bundle, prompt)
    };

    // Stream text as tokens commit: decode everything so far and print what is new, so that
    // multi-token characters come out whole. Text ending in U+FFFD may be a character whose
    // remaining bytes are still to come (its decoding then changes), so it is held back.
    let stream = !args.json;
    let mut printed = String::new();
    let mut on_note = |line: &str| eprintln!("{line}");
    let mut on_tokens = |committed: &Committed<'_>| {
        if stream {
            if let Some(text) = committed.text() {
                if !text.ends_with(char::REPLACEMENT_CHARACTER) {
                    print_new(&text, &mut printed);
                }
            }
        }
        true
    };
    let report = run_request(
        &request,
        GenerationHooks {
            on_note: Some(&mut on_note),
            on_tokens: Some(&mut on_tokens),
        },
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    match &report.text {
        // Whatever was held back at the end.
        Some(text) => {
            print_new(text, &mut printed);
            println!();
        }
        None => println!(
            "{}",
            report
                .tokens
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
    eprintln!("{}", summary(&report));
    Ok(())
}

/// Prints the part of `text` after what was printed already, when `text` extends it.
fn print_new(text: &str, printed: &mut String) {
    if let Some(new) = text.strip_prefix(printed.as_str()) {
        let mut stdout = std::io::stdout();
        let _ = write!(stdout, "{new}");
        let _ = stdout.flush();
        *printed = text.to_string();
    }
}

/// One bracketed line: tokens, TTFT, TPOT, and acceptance and expert-cache figures where they
/// apply.
fn summary(report: &GenerationReport) -> String {
    let s = &report.stats.decode;
    let mut line = format!(
        "[{} tokens, TTFT {:.1} ms, TPOT {:.2} ms",
        s.generated_tokens, s.ttft_ms, s.tpot_ms
    );
    if matches!(report.mode.as_str(), "specter" | "specmoeoff") {
        line += &format!(
            ", acceptance {:.1}% ({} of {} drafted), {:.2} accepted per round",
            100.0 * s.acceptance_rate,
            s.accepted,
            s.drafted,
            s.mean_accepted_per_round
        );
    }
    if let Some(o) = &report.stats.cache {
        line += &format!(
            ", experts: {} hits / {} misses, {} prefetched ({} used), {:.1} MB moved",
            o.hits,
            o.misses,
            o.prefetched,
            o.prefetched_used,
            o.bytes_moved as f64 / 1e6
        );
    }
    line + "]"
}
