//! The host expert kernel against the GPU's routed-expert kernels: the same bits for every
//! architecture's expert shapes and 1 to 32 rows, FP16, 8- and 4-bit, so an expert computed on
//! the host in place of the GPU changes no token.

mod common;

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::backend::cuda::CudaBackend;
use specter::backend::{Backend, GatedMlp, Routing};
use specter::host_experts::{ExpertWeights, HostExperts};
use specter::quant::Bits;

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

/// An expert's f64 output for one input row and its combine weight.
type RowValue<'a> = dyn Fn(&[f32], f32) -> Vec<f64> + 'a;

/// The host kernel's output against the GPU's for `expert` (`w` on the host) at 1 to 32 rows of
/// random inputs: every output's bits. `value`, when given, is the f64 value of one row (input,
/// combine weight), checked against the GPU's first row of each call. Returns what differed.
fn compare_with_gpu(
    gpu: &CudaBackend,
    host: &HostExperts,
    expert: &GatedMlp<CudaBackend>,
    w: &ExpertWeights<'_>,
    rng: &mut ChaCha8Rng,
    value: Option<&RowValue>,
) -> Vec<String> {
    let (hidden, inter) = (w.hidden, w.inter);
    let (mut failures, mut worst) = (Vec::new(), 0.0f64);
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
            .moe_experts(&xg, &routing, std::slice::from_ref(expert))
            .and_then(|y| gpu.to_host(&y))
            .expect("gpu experts");
        let mut out = vec![f32::NAN; rows * hidden];
        host.expert(w, &x, &weights, &mut out).expect("host expert");
        // The GPU's combine adds the one item to 0.0.
        let differ = out
            .iter()
            .zip(&y)
            .filter(|(h, g)| (0.0f32 + **h).to_bits() != g.to_bits())
            .count();
        if differ > 0 {
            failures.push(format!(
                "{hidden}x{inter}, {rows} rows: {differ} of {} outputs differ (relative error {:.2e})",
                out.len(),
                relative_error(&out, y.iter().map(|&g| g as f64))
            ));
        }
        // The value, on each call's first row (an f64 reference is slow at full width).
        if let Some(value) = value {
            worst = worst.max(relative_error(
                &y[..hidden],
                value(&x[..hidden], weights[0]),
            ));
        }
    }
    if value.is_some() {
        eprintln!("{hidden}x{inter}: GPU against f64, worst relative error {worst:.2e}");
        if worst > 1e-4 {
            failures.push(format!(
                "{hidden}x{inter}: GPU relative error {worst:.2e} against f64"
            ));
        }
    }
    eprintln!("{hidden}x{inter}: rows 1..=32 checked");
    failures
}

/// `||got - want|| / ||want||`.
fn relative_error(got: &[f32], want: impl IntoIterator<Item = f64>) -> f64 {
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        err += (*g as f64 - w).powi(2);
        norm += w * w;
    }
    (err / norm).sqrt()
}

/// Runs `check` (which returns what differed) on the GPU backend and a host kernel of every
/// core, for each shape, from one random stream seeded `seed`; fails with everything found.
fn each_shape(
    seed: u64,
    shapes: &[(usize, usize)],
    what: &str,
    mut check: impl FnMut(&CudaBackend, &HostExperts, &mut ChaCha8Rng, usize, usize) -> Vec<String>,
) {
    let gpu = common::gpu::backend();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let host = HostExperts::new(threads, None).expect("host kernel");
    eprintln!("host path: {}, {threads} threads", host.path().name());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut failures = Vec::new();
    for &(hidden, inter) in shapes {
        failures.extend(check(&gpu, &host, &mut rng, hidden, inter));
    }
    assert!(
        failures.is_empty(),
        "host and GPU {what} differ:\n{}",
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn host_expert_kernel_has_the_gpu_kernels_bits() {
    each_shape(61, &SHAPES, "experts", |gpu, host, rng, hidden, inter| {
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
        let (gate, up) = gate_up.split_at(inter * hidden);
        let w = ExpertWeights::f16(gate, up, &down, hidden, inter);
        compare_with_gpu(gpu, host, &expert, &w, rng, None)
    });
}

/// (hidden, inter) of 8- and 4-bit experts (multiples of 128): the same architectures' shapes.
const ROWS_SHAPES: [(usize, usize); 6] = [
    (2048, 1408),
    (2048, 1024),
    (2048, 768),
    (4096, 6400),
    (128, 128),
    (256, 384),
];

/// Random `bits`-bit experts of every shape in [`ROWS_SHAPES`] on the host and on the GPU (its
/// `moe_rows_gate_up_<bits>` and `moe_rows_down_<bits>` kernels, and at one row their one-item
/// `_1` forms), compared bit for bit and against f64.
fn row_layout_experts_against_the_gpu(seed: u64, bits: Bits) {
    let what = format!("{bits}-bit experts");
    each_shape(
        seed,
        &ROWS_SHAPES,
        &what,
        |gpu, host, rng, hidden, inter| {
            let e = common::rows8::RowsExpert::random(rng, bits.get() as usize, hidden, inter);
            let (gu, gus, d, ds) = (&e.gate_up, &e.gate_up_scales, &e.down, &e.down_scales);
            let expert = GatedMlp {
                gate_up: gpu
                    .weight_rows("gate_up", bits, hidden, 2 * inter, gu, gus)
                    .expect("upload"),
                down: gpu
                    .weight_rows("down", bits, inter, hidden, d, ds)
                    .expect("upload"),
            };
            let value = |x: &[f32], weight: f32| e.reference(x, weight);
            compare_with_gpu(gpu, host, &expert, &e.weights(), rng, Some(&value))
        },
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn host_int8_expert_kernel_has_the_gpu_row_kernels_bits() {
    row_layout_experts_against_the_gpu(67, Bits::EIGHT);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn host_int4_expert_kernel_has_the_gpu_row_kernels_bits() {
    row_layout_experts_against_the_gpu(71, Bits::FOUR);
}
