//! Host expert kernel bandwidth against the host's read bandwidth, on DeepSeek-V2-Lite's routed
//! expert shape (hidden 2048, inter 1408: 17.3 MB of FP16 weights per expert).
//!
//!     cargo run --release --example bench_host_experts -- [THREADS,...] [ROWS,...] [f16,int8,int4]
//!
//! Cycles through 64 experts (1.1 GB, past the last-level cache), so each call reads its weights
//! from memory; reports the median of 7 timed passes over the 64 experts, as GB/s of weights read
//! and as a share of `doctor`'s host read bandwidth with the same threads. Two ways: one call per
//! expert, and one call per 6 experts (a layer's host share, as the runtime batches them). The
//! same for 8- and 4-bit experts in the row layout (8.7 and 4.4 MB each, an INT8 or INT4
//! target's).

use std::time::Instant;

use half::f16;
use specter::host_experts::{bandwidth, ExpertJob, ExpertWeights, HostExperts, KernelPath};

const HIDDEN: usize = 2048;
const INTER: usize = 1408;
const EXPERTS: usize = 64;
/// Experts per batched call.
const BATCH: usize = 6;

fn list(arg: Option<String>, default: &[usize]) -> Vec<usize> {
    arg.map(|a| a.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| default.to_vec())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = list(args.next(), &[cores]);
    let rows_list = list(args.next(), &[1, 4, 16]);
    let precisions: Vec<String> = args.next().map_or_else(
        || vec!["f16".into(), "int8".into(), "int4".into()],
        |a| a.split(',').map(String::from).collect(),
    );
    let mut seed = 0x1234_5678_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05
    };
    let gate_up: Vec<Vec<f16>> = (0..EXPERTS)
        .map(|_| {
            (0..2 * INTER * HIDDEN)
                .map(|_| f16::from_f32(next()))
                .collect()
        })
        .collect();
    let down: Vec<Vec<f16>> = (0..EXPERTS)
        .map(|_| (0..HIDDEN * INTER).map(|_| f16::from_f32(next())).collect())
        .collect();
    let mut byte = || (next() * 5120.0) as i32 as u8;
    // 8-bit experts' codes; a 4-bit expert reads the first half of each (two codes a byte).
    let codes: Vec<(Vec<u8>, Vec<u8>)> = (0..EXPERTS)
        .map(|_| {
            (
                (0..2 * INTER * HIDDEN).map(|_| byte()).collect(),
                (0..HIDDEN * INTER).map(|_| byte()).collect(),
            )
        })
        .collect();
    let (gate_up_scales, down_scales) = (
        vec![f16::from_f32(1e-3); 2 * INTER * HIDDEN / 128],
        vec![f16::from_f32(1e-3); HIDDEN * INTER / 128],
    );
    println!(
        "host expert kernel, {HIDDEN}x{INTER} experts, path {}",
        KernelPath::detect().name()
    );
    println!("| precision | threads | rows | experts per call | host read GB/s | kernel GB/s | share | ms per expert |");
    println!("|---|---|---|---|---|---|---|---|");
    for &t in &threads {
        let read = bandwidth::measure(t, 2 << 30, 5);
        let kernel = HostExperts::new(t, None)?;
        for (precision, &rows) in precisions
            .iter()
            .flat_map(|p| rows_list.iter().map(move |r| (p.as_str(), r)))
        {
            let code_bits = match precision {
                "int8" => Some(8),
                "int4" => Some(4),
                "f16" => None,
                other => anyhow::bail!("unknown precision {other} (f16, int8 or int4)"),
            };
            let expert_bytes = match code_bits {
                Some(bits) => {
                    3 * INTER * HIDDEN * bits / 8 + gate_up_scales.len() * 2 + down_scales.len() * 2
                }
                None => 3 * INTER * HIDDEN * 2,
            };
            let x: Vec<f32> = (0..rows * HIDDEN)
                .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
                .collect();
            let weights = vec![0.5f32; rows];
            let expert = |e: usize| {
                if let Some(bits) = code_bits {
                    let (gate_up, down) = (&codes[e].0, &codes[e].1);
                    let (gate_up, down) = (
                        (&gate_up[..gate_up.len() * bits / 8], &gate_up_scales[..]),
                        (&down[..down.len() * bits / 8], &down_scales[..]),
                    );
                    return if bits == 8 {
                        ExpertWeights::int8(gate_up, down, HIDDEN, INTER)
                    } else {
                        ExpertWeights::int4(gate_up, down, HIDDEN, INTER)
                    };
                }
                ExpertWeights::f16(
                    &gate_up[e][..INTER * HIDDEN],
                    &gate_up[e][INTER * HIDDEN..],
                    &down[e],
                    HIDDEN,
                    INTER,
                )
            };
            for per_call in [1, BATCH] {
                let mut outs = vec![vec![0.0f32; rows * HIDDEN]; per_call];
                let mut run = || -> anyhow::Result<f64> {
                    let start = Instant::now();
                    for first in (0..EXPERTS).step_by(per_call) {
                        let jobs: Vec<ExpertJob> = (first..(first + per_call).min(EXPERTS))
                            .map(|e| ExpertJob {
                                weights: expert(e),
                                x: &x,
                                row_weights: &weights,
                            })
                            .collect();
                        let mut out_refs: Vec<&mut [f32]> = outs
                            .iter_mut()
                            .take(jobs.len())
                            .map(|o| o.as_mut_slice())
                            .collect();
                        kernel.experts(&jobs, &mut out_refs)?;
                    }
                    Ok(start.elapsed().as_secs_f64())
                };
                run()?;
                let mut times: Vec<f64> = (0..7).map(|_| run()).collect::<anyhow::Result<_>>()?;
                times.sort_by(f64::total_cmp);
                let median = times[times.len() / 2];
                let gbps = (EXPERTS * expert_bytes) as f64 / median / 1e9;
                println!(
                    "| {precision} | {t} | {rows} | {per_call} | {:.1} | {gbps:.1} | {:.0}% | {:.3} |",
                    read.bytes_per_s / 1e9,
                    100.0 * gbps * 1e9 / read.bytes_per_s,
                    median * 1e3 / EXPERTS as f64
                );
            }
        }
    }
    Ok(())
}
