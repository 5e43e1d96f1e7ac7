//! The host expert kernel: the same bits on the AVX2 and the portable path, for every
//! architecture's routed-expert shapes (fixture and full size) and 1 to 32 rows, and the value of
//! the expert FFN (checked in f64), for FP16, 8- and 4-bit experts. Bit equality with the GPU's
//! kernels is in tests/cuda_host_experts.rs.

mod common;

use common::rows8::RowsExpert;
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::host_experts::{ExpertJob, ExpertWeights, HostExperts, KernelPath};

fn random_expert(rng: &mut ChaCha8Rng, hidden: usize, inter: usize) -> (Vec<f16>, Vec<f16>) {
    let scale = 1.0 / (hidden as f32).sqrt();
    let gate_up = (0..2 * inter * hidden)
        .map(|_| f16::from_f32(rng.random_range(-2.0..2.0f32) * scale))
        .collect();
    let down = (0..hidden * inter)
        .map(|_| f16::from_f32(rng.random_range(-2.0..2.0f32) / (inter as f32).sqrt()))
        .collect();
    (gate_up, down)
}

/// `rows` random input rows of `width` in -3..3 and their combine weights in `min_weight`..1.
fn random_rows(
    rng: &mut ChaCha8Rng,
    rows: usize,
    width: usize,
    min_weight: f32,
) -> (Vec<f32>, Vec<f32>) {
    let x = (0..rows * width)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let weights = (0..rows)
        .map(|_| rng.random_range(min_weight..1.0))
        .collect();
    (x, weights)
}

fn run(kernel: &HostExperts, w: &ExpertWeights<'_>, x: &[f32], weights: &[f32]) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.len()];
    kernel.expert(w, x, weights, &mut out).expect("expert");
    out
}

/// (hidden, inter) of each architecture's routed experts: fixtures (128 wide) and real sizes.
const SHAPES: [(usize, usize); 8] = [
    (128, 48),
    (128, 64),
    (128, 36),
    (2048, 1408), // DeepSeek-V2-Lite, Qwen1.5-MoE
    (2048, 1024), // OLMoE
    (2048, 768),  // Qwen3-30B-A3B
    (4096, 6400), // Phi-3.5-MoE
    (100, 52),    // lengths that are not multiples of 8 or 64
];

#[test]
fn avx2_and_portable_paths_give_the_same_bits() {
    if KernelPath::detect() != KernelPath::Avx2 {
        eprintln!("no AVX2/FMA/F16C here: only the portable path exists, nothing to compare");
        return;
    }
    let fast = HostExperts::new(2, Some(KernelPath::Avx2)).expect("avx2");
    let portable = HostExperts::new(2, Some(KernelPath::Portable)).expect("portable");
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for (hidden, inter) in SHAPES {
        let (gate_up, down) = random_expert(&mut rng, hidden, inter);
        let w = ExpertWeights::f16(
            &gate_up[..inter * hidden],
            &gate_up[inter * hidden..],
            &down,
            hidden,
            inter,
        );
        // Big shapes at a few row counts (the portable path is slow), small ones at all.
        let row_counts: Vec<usize> = if hidden * inter > 1 << 20 {
            vec![1, 3, 9]
        } else {
            (1..=32).collect()
        };
        for rows in row_counts {
            let x: Vec<f32> = (0..rows * hidden)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let weights: Vec<f32> = (0..rows).map(|_| rng.random_range(0.0..1.0)).collect();
            let a = run(&fast, &w, &x, &weights);
            let b = run(&portable, &w, &x, &weights);
            let differ = a
                .iter()
                .zip(&b)
                .filter(|(p, q)| p.to_bits() != q.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "{hidden}x{inter}, {rows} rows: {differ} outputs differ"
            );
        }
    }
}

#[test]
fn the_expert_ffn_matches_an_f64_reference() {
    let kernel = HostExperts::new(2, None).expect("kernel");
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for (hidden, inter) in [(128, 48), (256, 104), (100, 52)] {
        let (gate_up, down) = random_expert(&mut rng, hidden, inter);
        let w = ExpertWeights::f16(
            &gate_up[..inter * hidden],
            &gate_up[inter * hidden..],
            &down,
            hidden,
            inter,
        );
        let rows = 5;
        let (x, weights) = random_rows(&mut rng, rows, hidden, 0.1);
        let got = run(&kernel, &w, &x, &weights);
        let (mut err, mut norm) = (0.0f64, 0.0f64);
        for r in 0..rows {
            let xr = &x[r * hidden..(r + 1) * hidden];
            let dot = |row: &[f16], v: &[f64]| -> f64 {
                row.iter().zip(v).map(|(a, b)| a.to_f64() * b).sum()
            };
            let xv: Vec<f64> = xr.iter().map(|&v| v as f64).collect();
            let h: Vec<f64> = (0..inter)
                .map(|j| {
                    let g = dot(&gate_up[j * hidden..(j + 1) * hidden], &xv);
                    let u = dot(
                        &gate_up[(inter + j) * hidden..(inter + j + 1) * hidden],
                        &xv,
                    );
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for c in 0..hidden {
                let want = weights[r] as f64 * dot(&down[c * inter..(c + 1) * inter], &h);
                let have = got[r * hidden + c] as f64;
                err += (have - want).powi(2);
                norm += want.powi(2);
            }
        }
        let rel = (err / norm).sqrt();
        eprintln!("{hidden}x{inter}: relative error {rel:.2e}");
        assert!(rel < 1e-5, "{hidden}x{inter}: relative error {rel:.2e}");
    }
}

#[test]
fn bad_settings_and_shapes_are_refused() {
    assert!(HostExperts::new(0, None).is_err());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let err = HostExperts::new(cores + 1, None)
        .err()
        .expect("too many threads");
    assert!(err.to_string().contains("host threads"), "{err}");
    let kernel = HostExperts::new(1, None).expect("kernel");
    let gate_up = vec![f16::ZERO; 2 * 8 * 16];
    let down = vec![f16::ZERO; 16 * 8];
    let w = ExpertWeights::f16(&gate_up[1..128], &gate_up[128..], &down, 16, 8);
    let mut out = vec![0.0; 16];
    assert!(kernel.expert(&w, &[0.0; 16], &[1.0], &mut out).is_err());
    let w = ExpertWeights::f16(&gate_up[..128], &gate_up[128..], &down, 16, 8);
    assert!(kernel.expert(&w, &[0.0; 15], &[1.0], &mut out).is_err());
    assert!(kernel.expert(&w, &[0.5; 16], &[1.0], &mut out).is_ok());
}

/// Random experts of one shape with `rows[e]` random input rows and combine weights each.
struct Batch {
    experts: Vec<(Vec<f16>, Vec<f16>)>,
    xs: Vec<Vec<f32>>,
    ws: Vec<Vec<f32>>,
    hidden: usize,
    inter: usize,
}

impl Batch {
    fn random(rng: &mut ChaCha8Rng, hidden: usize, inter: usize, rows: &[usize]) -> Self {
        let experts = rows
            .iter()
            .map(|_| random_expert(rng, hidden, inter))
            .collect();
        let xs = rows
            .iter()
            .map(|&r| {
                (0..r * hidden)
                    .map(|_| rng.random_range(-3.0..3.0))
                    .collect()
            })
            .collect();
        let ws = rows
            .iter()
            .map(|&r| (0..r).map(|_| rng.random_range(0.0..1.0)).collect())
            .collect();
        Batch {
            experts,
            xs,
            ws,
            hidden,
            inter,
        }
    }

    fn weights(&self, e: usize) -> ExpertWeights<'_> {
        let (hidden, inter) = (self.hidden, self.inter);
        ExpertWeights::f16(
            &self.experts[e].0[..inter * hidden],
            &self.experts[e].0[inter * hidden..],
            &self.experts[e].1,
            hidden,
            inter,
        )
    }

    fn job(&self, e: usize) -> ExpertJob<'_> {
        ExpertJob {
            weights: self.weights(e),
            x: &self.xs[e],
            row_weights: &self.ws[e],
        }
    }
}

#[test]
fn a_batch_of_experts_gives_each_experts_own_output() {
    // A layer's host share runs as one call; each output must be the bits of its expert alone,
    // whatever else shares the call (including experts with no rows).
    let kernel = HostExperts::new(2, None).expect("kernel");
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (hidden, inter) = (128, 48);
    let rows = [3usize, 0, 1, 5];
    let batch = Batch::random(&mut rng, hidden, inter, &rows);
    let (xs, ws) = (&batch.xs, &batch.ws);
    let weights = |e: usize| batch.weights(e);
    let jobs: Vec<ExpertJob> = (0..4).map(|e| batch.job(e)).collect();
    let mut outs: Vec<Vec<f32>> = rows.iter().map(|&r| vec![f32::NAN; r * hidden]).collect();
    let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    kernel.experts(&jobs, &mut refs).expect("batch");
    for e in 0..4 {
        let alone = run(&kernel, &weights(e), &xs[e], &ws[e]);
        let same = alone
            .iter()
            .zip(&outs[e])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "expert {e} differs in the batch");
    }
    // Mismatched lengths are refused, not guessed at.
    let mut short = vec![0.0f32; 1];
    assert!(kernel
        .experts(&jobs[..1], &mut [short.as_mut_slice()])
        .is_err());
    assert!(kernel
        .experts(&jobs[..2], &mut [short.as_mut_slice()])
        .is_err());
}

#[test]
fn split_experts_get_the_activations_the_whole_kernel_reduces() {
    // A split expert's gate and up run on the host and its down elsewhere: the activations the
    // host hands over must be the ones its whole-expert computation feeds to down, so that down
    // applied to them (in the same lane order) gives the whole expert's bits.
    use specter::host_experts::{activation, lanes};
    let kernel = HostExperts::new(2, None).expect("kernel");
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for (hidden, inter) in [(128, 48), (2048, 1408), (100, 52)] {
        let rows = [2usize, 1, 3];
        let batch = Batch::random(&mut rng, hidden, inter, &rows);
        let (xs, ws) = (&batch.xs, &batch.ws);
        let weights = |e: usize| batch.weights(e);
        let job = |e: usize| batch.job(e);
        // Expert 0 whole; experts 1 and 2 split.
        let mut out = vec![f32::NAN; rows[0] * hidden];
        let mut h1 = vec![f32::NAN; rows[1] * inter];
        let mut h2 = vec![f32::NAN; rows[2] * inter];
        kernel
            .experts_and_gate_ups(
                &[job(0)],
                &mut [out.as_mut_slice()],
                &[job(1), job(2)],
                &mut [h1.as_mut_slice(), h2.as_mut_slice()],
            )
            .expect("split call");
        let alone = run(&kernel, &weights(0), &xs[0], &ws[0]);
        assert!(
            alone
                .iter()
                .zip(&out)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "({hidden}, {inter}): the whole expert changed beside split ones"
        );
        for (e, h) in [(1, &h1), (2, &h2)] {
            let w = weights(e);
            let whole = run(&kernel, &w, &xs[e], &ws[e]);
            let (gate_up, down) = &batch.experts[e];
            let (gate, up) = gate_up.split_at(inter * hidden);
            for r in 0..rows[e] {
                let x = &xs[e][r * hidden..(r + 1) * hidden];
                let hr = &h[r * inter..(r + 1) * inter];
                for (j, h_j) in hr.iter().enumerate() {
                    let g = lanes::dot(&gate[j * hidden..(j + 1) * hidden], x);
                    let u = lanes::dot(&up[j * hidden..(j + 1) * hidden], x);
                    let want = activation::silu(g) * u;
                    assert_eq!(h_j.to_bits(), want.to_bits(), "expert {e} row {r} h[{j}]");
                }
                for c in 0..hidden {
                    let v = ws[e][r] * lanes::dot(&down[c * inter..(c + 1) * inter], hr);
                    assert_eq!(
                        v.to_bits(),
                        whole[r * hidden + c].to_bits(),
                        "({hidden}, {inter}) expert {e} row {r} output {c}: down of the handed-over activations"
                    );
                }
            }
        }
        // Mismatched activation lengths are refused.
        let mut short = vec![0.0f32; 1];
        assert!(kernel
            .experts_and_gate_ups(&[], &mut [], &[job(1)], &mut [short.as_mut_slice()])
            .is_err());
    }
}

/// (hidden, inter) of 8- and 4-bit experts: both multiples of 128 (the row layout's groups);
/// 384 and 1408 are odd numbers of groups (a 4-bit row ends in half an octet of lanes).
const ROWS_SHAPES: [(usize, usize); 4] = [(128, 128), (256, 384), (2048, 1408), (2048, 768)];

/// Experts of `bits` in the row layout: the same bits on the AVX2 and the portable path, a row's
/// bits whatever rows share its call, the expert FFN against f64, and bad shapes refused.
fn row_layout_experts_follow_their_definition(bits: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let portable = HostExperts::new(2, Some(KernelPath::Portable)).expect("portable");
    let fast = (KernelPath::detect() == KernelPath::Avx2)
        .then(|| HostExperts::new(2, Some(KernelPath::Avx2)).expect("avx2"));
    if fast.is_none() {
        eprintln!("no AVX2/FMA/F16C here: only the portable path is checked");
    }
    let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (hidden, inter) in ROWS_SHAPES {
        let e = RowsExpert::random(&mut rng, bits, hidden, inter);
        let w = e.weights();
        let rows = 3;
        let (x, ws) = random_rows(&mut rng, rows, hidden, 0.05);
        let out = run(&portable, &w, &x, &ws);
        if let Some(fast) = &fast {
            let f = run(fast, &w, &x, &ws);
            assert_eq!(
                bits_of(&f),
                bits_of(&out),
                "{bits}-bit ({hidden}, {inter}): AVX2 and portable differ"
            );
        }
        // A row's bits do not depend on the rows beside it.
        let alone = run(&portable, &w, &x[hidden..2 * hidden], &ws[1..2]);
        assert_eq!(
            bits_of(&alone),
            bits_of(&out[hidden..2 * hidden]),
            "{bits}-bit ({hidden}, {inter}): row 1 alone differs from row 1 of 3"
        );
        for r in 0..rows {
            let want = e.reference(&x[r * hidden..(r + 1) * hidden], ws[r]);
            let got = &out[r * hidden..(r + 1) * hidden];
            let err: f64 = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (*g as f64 - w).powi(2))
                .sum();
            let norm: f64 = want.iter().map(|w| w * w).sum();
            let rel = (err / norm).sqrt();
            assert!(
                rel < 1e-4,
                "{bits}-bit ({hidden}, {inter}) row {r}: relative error {rel:.2e}"
            );
            if r == 0 {
                eprintln!("{bits}-bit ({hidden}, {inter}): relative error against f64 {rel:.2e}");
            }
        }
    }
    // Shapes off the 128-input groups, and tensors of the wrong length, are refused.
    let e = RowsExpert::random(&mut rng, bits, 128, 128);
    let (codes, scales) = (|n: usize| n * bits / 8, |n: usize| n / 128);
    let bad = e.weights_of(
        (
            &e.gate_up[..codes(2 * 64 * 128)],
            &e.gate_up_scales[..scales(2 * 64 * 128)],
        ),
        (
            &e.down[..codes(64 * 128)],
            &e.down_scales[..scales(64 * 128)],
        ),
        128,
        64,
    );
    let mut out = vec![0.0; 128];
    let err = portable
        .expert(&bad, &[0.5; 128], &[1.0], &mut out)
        .unwrap_err();
    assert!(err.to_string().contains("multiples of 128"), "{err}");
    let gate_up = (&e.gate_up[..], &e.gate_up_scales[..]);
    let down = (&e.down[..], &e.down_scales[..]);
    for short in [
        e.weights_of((&e.gate_up[1..], &e.gate_up_scales), down, 128, 128),
        e.weights_of((&e.gate_up, &e.gate_up_scales[1..]), down, 128, 128),
        e.weights_of(
            gate_up,
            (&e.down[..codes(128 * 127)], &e.down_scales),
            128,
            128,
        ),
        e.weights_of(gate_up, (&e.down, &e.down_scales[..127]), 128, 128),
    ] {
        let err = portable
            .expert(&short, &[0.5; 128], &[1.0], &mut out)
            .unwrap_err();
        assert!(err.to_string().contains("expected"), "{err}");
    }
}

#[test]
fn int8_experts_give_the_same_bits_on_every_path_and_the_expert_ffn() {
    row_layout_experts_follow_their_definition(8, 83);
}

#[test]
fn int4_experts_give_the_same_bits_on_every_path_and_the_expert_ffn() {
    row_layout_experts_follow_their_definition(4, 89);
}

#[test]
fn experts_of_every_encoding_share_a_call() {
    // FP16, 8- and 4-bit experts in one call, whole and split: each output the bits of its
    // expert alone (each stages its own activations, 4-bit ones padded to whole octets).
    let kernel = HostExperts::new(2, None).expect("kernel");
    let mut rng = ChaCha8Rng::seed_from_u64(97);
    let (hidden, inter) = (256, 384);
    let f16_expert = Batch::random(&mut rng, hidden, inter, &[2]);
    let int8 = RowsExpert::random(&mut rng, 8, hidden, inter);
    let int4 = RowsExpert::random(&mut rng, 4, hidden, inter);
    let weights = [f16_expert.weights(0), int8.weights(), int4.weights()];
    let inputs: Vec<(Vec<f32>, Vec<f32>)> = [2, 1, 3]
        .iter()
        .map(|&rows| random_rows(&mut rng, rows, hidden, 0.05))
        .collect();
    let jobs: Vec<ExpertJob> = weights
        .iter()
        .zip(&inputs)
        .map(|(w, (x, ws))| ExpertJob {
            weights: *w,
            x,
            row_weights: ws,
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = inputs
        .iter()
        .map(|(x, _)| vec![f32::NAN; x.len()])
        .collect();
    let mut h = vec![f32::NAN; 3 * inter];
    let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    kernel
        .experts_and_gate_ups(&jobs, &mut refs, &jobs[2..], &mut [h.as_mut_slice()])
        .expect("mixed call");
    for (e, (w, (x, ws))) in weights.iter().zip(&inputs).enumerate() {
        let alone = run(&kernel, w, x, ws);
        assert!(
            alone
                .iter()
                .zip(&outs[e])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "expert {e} differs in the mixed call"
        );
    }
    // The split 4-bit expert's activations are the contract's, and the ones its down product
    // reads: staged again, 4-bit down of them is the whole expert's output.
    use specter::host_experts::{activation, rows4};
    let (x, ws) = &inputs[2];
    let whole = run(&kernel, &int4.weights(), x, ws);
    let dot = |(codes, scales): (&[u8], &[f16]), f: usize, staged: &[f32], k: usize| {
        let (bytes, groups) = (k / 2, k / 128);
        let mut v = [0.0];
        rows4::dots(
            KernelPath::Portable,
            &[&codes[f * bytes..(f + 1) * bytes]],
            &[&scales[f * groups..(f + 1) * groups]],
            staged,
            &mut v,
        );
        v[0]
    };
    let staged = |v: &[f32]| {
        let mut s = vec![0.0; rows4::staged_len(v.len())];
        rows4::stage(v, &mut s);
        s
    };
    let (gate_up, down) = (
        (&int4.gate_up[..], &int4.gate_up_scales[..]),
        (&int4.down[..], &int4.down_scales[..]),
    );
    for r in 0..ws.len() {
        let (xs, hr) = (
            staged(&x[r * hidden..(r + 1) * hidden]),
            &h[r * inter..(r + 1) * inter],
        );
        for (j, h_j) in hr.iter().enumerate() {
            let (g, u) = (
                dot(gate_up, j, &xs, hidden),
                dot(gate_up, inter + j, &xs, hidden),
            );
            let want = activation::silu(g) * u;
            assert_eq!(h_j.to_bits(), want.to_bits(), "row {r} h[{j}]");
        }
        let hs = staged(hr);
        for c in 0..hidden {
            let v = ws[r] * dot(down, c, &hs, inter);
            assert_eq!(
                v.to_bits(),
                whole[r * hidden + c].to_bits(),
                "row {r} output {c}: down of the handed-over activations"
            );
        }
    }
}
