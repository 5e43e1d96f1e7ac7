//! The host expert kernel against the GPU's routed-expert kernels: the same bits for every
//! architecture's expert shapes and 1 to 32 rows, so an expert computed on the host in place of
//! the GPU changes no token.

mod common;

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::backend::{Backend, GatedMlp, Routing};
use specter::host_experts::{ExpertWeights, HostExperts};

/// (hidden, inter) of each architecture's routed experts: DeepSeek-V2-Lite and Qwen1.5-MoE,
/// OLMoE, Qwen3-MoE, Mixtral, Phi-3.5-MoE, and the fixtures' small ones.
const SHAPES: [(usize, usize); 8] = [
    (2048, 1408),
    (2048, 1024),
    (2048, 768),
    (4096, 14336),
    (4096, 6400),
    (128, 48),
    (128, 64),
    (100, 52),
];

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn host_expert_kernel_has_the_gpu_kernels_bits() {
    let gpu = common::gpu::backend();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let host = HostExperts::new(threads, None).expect("host kernel");
    eprintln!("host path: {}, {threads} threads", host.path().name());
    let mut rng = ChaCha8Rng::seed_from_u64(61);
    let mut failures = Vec::new();
    for (hidden, inter) in SHAPES {
        let gate_up: Vec<f16> = (0..2 * inter * hidden)
            .map(|_| f16::from_f32(rng.random_range(-2.0..2.0f32) / (hidden as f32).sqrt()))
            .collect();
        let down: Vec<f16> = (0..hidden * inter)
            .map(|_| f16::from_f32(rng.random_range(-2.0..2.0f32) / (inter as f32).sqrt()))
            .collect();
        let expert = GatedMlp {
            gate_up: gpu
                .weight_f16("gate_up", &[2 * inter, hidden], &gate_up)
                .expect("upload"),
            down: gpu
                .weight_f16("down", &[hidden, inter], &down)
                .expect("upload"),
        };
        let w = ExpertWeights {
            gate: &gate_up[..inter * hidden],
            up: &gate_up[inter * hidden..],
            down: &down,
            hidden,
            inter,
        };
        for rows in 1..=32usize {
            let x: Vec<f32> = (0..rows * hidden)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let weights: Vec<f32> = (0..rows).map(|_| rng.random_range(0.05..1.0)).collect();
            let routing = Routing {
                top_k: 1,
                ids: vec![0; rows],
                weights: weights.clone(),
            };
            let xg = gpu.upload(rows, hidden, &x).expect("upload");
            let y = gpu
                .moe_experts(&xg, &routing, std::slice::from_ref(&expert))
                .and_then(|y| gpu.to_host(&y))
                .expect("gpu experts");
            let mut out = vec![f32::NAN; rows * hidden];
            host.expert(&w, &x, &weights, &mut out)
                .expect("host expert");
            // The GPU's combine adds the one item to 0.0.
            let differ = out
                .iter()
                .zip(&y)
                .filter(|(h, g)| (0.0f32 + **h).to_bits() != g.to_bits())
                .count();
            if differ > 0 {
                let (mut err, mut norm) = (0.0f64, 0.0f64);
                for (h, g) in out.iter().zip(&y) {
                    err += (*h as f64 - *g as f64).powi(2);
                    norm += (*g as f64).powi(2);
                }
                failures.push(format!(
                    "{hidden}x{inter}, {rows} rows: {differ} of {} outputs differ (relative error {:.2e})",
                    out.len(),
                    (err / norm).sqrt()
                ));
            }
        }
        eprintln!("{hidden}x{inter}: rows 1..=32 checked");
    }
    assert!(
        failures.is_empty(),
        "host and GPU experts differ:\n{}",
        failures.join("\n")
    );
}
