//! Times the forward passes a decode loop is made of, all experts resident, on a bundle:
//! the target's one-row decode step, the draft's one-row step, and verification windows of
//! several rows (the target over a drafted window, the KV cropped back after each).
//!
//!     cargo run --release --example bench_step -- BUNDLE [--backend cuda|cpu] [--steps N]
//!         [--window R]... [--windows-only] [--no-overlap] [--serial LABEL[@BLOCKS],...]
//!         [--plain] [--skip-launches LABEL[@BLOCKS],...] [--json OUT]
//!
//! Each figure is the median wall time of `--steps` passes (after as many untimed ones), each
//! pass's greedy choices back on the host as the greedy decode loop receives them
//! (`LanguageModel::forward_greedy`: on the GPU, one id a row instead of its logits). A 16-token prompt is prefilled
//! first; the one-row steps then run at positions 16, 17, ...; a window always starts at the
//! same position, so every pass sees the same cache length. `--no-overlap` launches each kernel
//! only after the one before it has finished, `--serial LABEL[@BLOCKS],...` the named launches
//! alone, and `--plain` runs every op in its plain form (`CudaOptions::plain`).
//! `--windows-only` times the verification windows alone (for a profiler's view of them). The
//! chained figures time greedy steps run back to back (`LanguageModel::forward_greedy_chain`):
//! the time between two choices reaching the host.
//!
//! `--skip-launches` (a measurement, not a run: the outputs are meaningless) leaves the named
//! kernels' launches out of every pass (`MeasureOptions::skip`; the labels are
//! `specter::backend::cuda::LAUNCH_LABELS`), so the step time saved is what those kernels cost
//! inside a recorded pass. Skipping a kernel that feeds the routing changes which experts a
//! window reads, so only one-row steps measure it cleanly. Built with the `measure` feature:
//! `cargo build --release --features measure --example bench_step`.

use std::time::Instant;

use specter::backend::cuda::{LaunchMatch, MeasureOptions, LAUNCH_LABELS};
use specter::model::{KvCache, LanguageModel, NoHook, Variant};
use specter::session::{BackendKind, Session, SessionOptions};
use specter::with_session_model;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A count given to `flag`, with the flag named when it is not one.
fn count(v: &str, flag: &str) -> anyhow::Result<usize> {
    v.parse()
        .map_err(|_| anyhow::anyhow!("{flag}: {v:?} is not a number"))
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut bundle = None;
    let mut backend = BackendKind::Cuda;
    let mut steps = 64usize;
    let mut windows = Vec::new();
    let mut json = None;
    let mut overlap = true;
    let mut windows_only = false;
    let mut plain = false;
    let mut skip = Vec::new();
    let mut serial = Vec::new();
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))
        };
        match a.as_str() {
            "--backend" => {
                backend = match value("--backend")?.as_str() {
                    "cuda" => BackendKind::Cuda,
                    "cpu" => BackendKind::Cpu,
                    other => anyhow::bail!("--backend: unknown backend {other} (cuda or cpu)"),
                }
            }
            "--steps" => steps = count(&value("--steps")?, "--steps")?,
            "--window" => windows.push(count(&value("--window")?, "--window")?),
            "--json" => json = Some(value("--json")?),
            "--no-overlap" => overlap = false,
            "--windows-only" => windows_only = true,
            "--plain" => plain = true,
            "--skip-launches" => {
                skip = LaunchMatch::parse_list(&value("--skip-launches")?)
                    .map_err(|e| anyhow::anyhow!("--skip-launches: {e}"))?
            }
            "--serial" => {
                serial = LaunchMatch::parse_list(&value("--serial")?)
                    .map_err(|e| anyhow::anyhow!("--serial: {e}"))?
            }
            _ if bundle.is_none() && !a.starts_with('-') => bundle = Some(a),
            _ => anyhow::bail!("unknown argument {a}"),
        }
    }
    let bundle = bundle.ok_or_else(|| anyhow::anyhow!("usage: bench_step BUNDLE [options]"))?;
    anyhow::ensure!(steps > 0, "--steps must be at least 1");
    if windows.is_empty() {
        windows.push(17);
    }
    let mut opts = SessionOptions::new(backend);
    anyhow::ensure!(
        (skip.is_empty() && serial.is_empty() && overlap) || backend == BackendKind::Cuda,
        "--skip-launches, --serial and --no-overlap need --backend cuda"
    );
    if !overlap {
        // Every launch starts once the kernel before it has finished.
        serial = LAUNCH_LABELS
            .iter()
            .map(|l| LaunchMatch {
                kernel: l.to_string(),
                blocks: None,
            })
            .collect();
    }
    opts.cuda.plain = plain;
    opts.measure = MeasureOptions { skip, serial };
    let session = Session::open_with(std::path::Path::new(&bundle), &opts)?;
    let prompt: Vec<u32> = (5..21).collect();
    let report = with_session_model!(session, |m| time_passes(
        m,
        &prompt,
        steps,
        &windows,
        windows_only
    ))?;
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// The figures of one model: step and window medians in ms, by name.
fn time_passes<M: LanguageModel>(
    m: &M,
    prompt: &[u32],
    steps: usize,
    windows: &[usize],
    windows_only: bool,
) -> anyhow::Result<serde_json::Value> {
    let vocab = m.info().vocab_size as u32;
    let token = |i: usize| (7 + 31 * i as u32) % vocab;
    let mut out = serde_json::Map::new();
    let singles: &[(&str, Variant)] = if windows_only {
        &[]
    } else {
        &[
            ("target_step_ms", Variant::Target),
            ("draft_step_ms", Variant::Draft),
        ]
    };
    for &(name, variant) in singles {
        let mut kv = m.new_kv(prompt.len() + 2 * steps + 1)?;
        m.forward(variant, prompt, &mut kv, &mut NoHook)?;
        let mut times = Vec::with_capacity(steps);
        for i in 0..2 * steps {
            let t = Instant::now();
            m.forward_greedy(variant, &[token(i)], &mut kv, &mut NoHook)?;
            if i >= steps {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let ms = median(times);
        println!("{name:>24} {ms:9.4} ms");
        out.insert(name.into(), ms.into());
    }
    // Chained greedy steps (as a greedy decode loop runs them): the time between choices
    // reaching the host, median of the last `steps` of a chain of 2 * steps.
    let chains: &[(&str, Variant)] = if windows_only {
        &[]
    } else {
        &[
            ("target_chain_step_ms", Variant::Target),
            ("draft_chain_step_ms", Variant::Draft),
        ]
    };
    for &(name, variant) in chains {
        let mut kv = m.new_kv(prompt.len() + 2 * steps + 1)?;
        m.forward_greedy(variant, prompt, &mut kv, &mut NoHook)?;
        let mut arrivals = Vec::with_capacity(2 * steps);
        let mut accept = |_: u32| {
            arrivals.push(Instant::now());
            true
        };
        m.forward_greedy_chain(
            variant,
            token(0),
            &mut kv,
            &mut NoHook,
            2 * steps,
            &mut accept,
        )?;
        let times = arrivals[steps - 1..]
            .windows(2)
            .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3)
            .collect();
        let ms = median(times);
        println!("{name:>24} {ms:9.4} ms");
        out.insert(name.into(), ms.into());
    }
    for &rows in windows {
        anyhow::ensure!(rows > 0, "--window must be at least 1");
        let mut kv = m.new_kv(prompt.len() + rows)?;
        m.forward(Variant::Target, prompt, &mut kv, &mut NoHook)?;
        let window: Vec<u32> = (0..rows).map(token).collect();
        let mut times = Vec::with_capacity(steps);
        for i in 0..2 * steps {
            let t = Instant::now();
            m.forward_greedy(Variant::Target, &window, &mut kv, &mut NoHook)?;
            kv.truncate(prompt.len());
            if i >= steps {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let ms = median(times);
        let name = format!("verify_{rows}_rows_ms");
        println!("{name:>24} {ms:9.4} ms");
        out.insert(name, ms.into());
    }
    Ok(serde_json::Value::Object(out))
}
