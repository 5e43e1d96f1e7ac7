//! The CPU reference's ops against direct formulas on random inputs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn random(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Mat {
    Mat {
        rows,
        cols,
        data: (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect(),
    }
}

fn weight(rng: &mut ChaCha8Rng, out: usize, inp: usize) -> CpuWeight {
    let data: Vec<f16> = (0..out * inp)
        .map(|_| f16::from_f32(rng.random_range(-0.5f32..0.5)))
        .collect();
    Cpu.weight_f16("w", &[out, inp], &data).unwrap()
}

/// An INT4 weight of `[out, inp]` (RTN-quantized random values, Marlin-packed).
fn weight_int4(rng: &mut ChaCha8Rng, out: usize, inp: usize) -> CpuWeight {
    let w: Vec<f32> = (0..out * inp)
        .map(|_| rng.random_range(-0.5f32..0.5))
        .collect();
    let q = crate::quant::rtn("w", &w, out, inp, crate::quant::Bits::FOUR).unwrap();
    let m = crate::quant::marlin_pack(&q).unwrap();
    Cpu.weight_int4("w", inp, out, &m.qweight, &m.scales)
        .unwrap()
}

#[test]
fn int4_products_round_their_inputs_to_f16() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (hidden, inter) = (256, 128);
    let mut x = random(&mut rng, 3, hidden);
    // Values f16 cannot hold: the rounding must show.
    x.data.iter_mut().for_each(|v| *v *= 1.0 + 1e-4);
    let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|&a| f16::from_f32(a).to_f32()).collect() };
    let mlp = GatedMlp::<Cpu> {
        gate_up: weight_int4(&mut rng, 2 * inter, hidden),
        down: weight_int4(&mut rng, hidden, inter),
    };
    assert!(mlp.gate_up.f16_input && mlp.down.f16_input);
    // The same values as an FP16-path weight (no input rounding).
    let plain = |w: &CpuWeight| CpuWeight {
        f16_input: false,
        ..w.clone()
    };
    let (gu, down) = (plain(&mlp.gate_up), plain(&mlp.down));

    let got = Cpu.linear(&x, &mlp.gate_up, None).unwrap();
    let rounded = Mat {
        data: round(&x.data),
        ..x.clone()
    };
    assert_eq!(got, Cpu.linear(&rounded, &gu, None).unwrap());
    assert_ne!(got, Cpu.linear(&x, &gu, None).unwrap());

    // Gated MLP: x rounded before gate/up, h rounded before down.
    let h = Cpu::silu_mul(&got.data, x.rows, inter);
    let want = matmul_t(&round(&h), x.rows, inter, &down.data, hidden, None);
    assert_eq!(Cpu.gated_mlp(&x, &mlp).unwrap().data, want);
    let routing = Routing {
        top_k: 1,
        ids: vec![0; x.rows],
        weights: vec![1.0; x.rows],
    };
    let moe = Cpu
        .moe_experts(&x, &routing, std::slice::from_ref(&mlp))
        .unwrap();
    assert_eq!(moe.data, want);
}

#[test]
fn linear_rows_do_not_depend_on_batch() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // Large enough to take the threaded path for the batch.
    let x = random(&mut rng, 9, 300);
    let w = weight(&mut rng, 257, 300);
    let all = Cpu.linear(&x, &w, None).unwrap();
    for r in 0..x.rows {
        let one = Cpu.linear(
            &Cpu.head_rows(
                &Mat {
                    rows: 1,
                    cols: 300,
                    data: x.row(r).to_vec(),
                },
                1,
            )
            .unwrap(),
            &w,
            None,
        );
        assert_eq!(one.unwrap().data, all.row(r), "row {r}");
    }
    // And it is a matrix product.
    let expect: f64 = (0..300)
        .map(|k| x.data[300 + k] as f64 * w.data[5 * 300 + k] as f64)
        .sum();
    assert!((all.data[257 + 5] as f64 - expect).abs() < 1e-4);
}

#[test]
fn sliding_window_equals_attention_over_the_window_only() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (heads, kv_heads, d, len) = (4, 2, 8, 12);
    let q = random(&mut rng, 1, heads * d);
    let k = random(&mut rng, len, kv_heads * d);
    let v = random(&mut rng, len, kv_heads * d);
    let spec = AttentionSpec {
        heads,
        kv_heads,
        qk_dim: d,
        v_dim: d,
        scale: 0.3,
        start: len - 1,
        window: Some(5),
    };
    let windowed = Cpu.attention(&q, &k, &v, len, spec).unwrap();
    // The last 5 keys alone, as a fresh sequence whose query sits at its end.
    let tail = |m: &Mat| Mat {
        rows: 5,
        cols: m.cols,
        data: m.data[(len - 5) * m.cols..].to_vec(),
    };
    let plain = AttentionSpec {
        start: 4,
        window: None,
        ..spec
    };
    let expected = Cpu.attention(&q, &tail(&k), &tail(&v), 5, plain).unwrap();
    assert_eq!(windowed, expected);
    let full = Cpu
        .attention(
            &q,
            &k,
            &v,
            len,
            AttentionSpec {
                window: None,
                ..spec
            },
        )
        .unwrap();
    assert_ne!(windowed, full);
}

#[test]
fn softmax_topk_renormalizes_and_scales() {
    let logits = Mat {
        rows: 1,
        cols: 4,
        data: vec![0.5, 2.0, -1.0, 1.0],
    };
    let e: Vec<f32> = logits.data.iter().map(|x| (x - 2.0f32).exp()).collect();
    let total: f32 = e.iter().sum();
    let r = Cpu
        .route(
            &logits,
            RouteSpec::SoftmaxTopK {
                top_k: 2,
                renormalize: false,
                scale: 2.0,
            },
        )
        .unwrap();
    assert_eq!(r.ids, vec![1, 3]);
    assert!((r.weights[0] - 2.0 * e[1] / total).abs() < 1e-6);
    assert!((r.weights[1] - 2.0 * e[3] / total).abs() < 1e-6);
    let r = Cpu
        .route(
            &logits,
            RouteSpec::SoftmaxTopK {
                top_k: 2,
                renormalize: true,
                scale: 1.0,
            },
        )
        .unwrap();
    assert!((r.weights[0] + r.weights[1] - 1.0).abs() < 1e-6);
    assert!((r.weights[0] / r.weights[1] - e[1] / e[3]).abs() < 1e-5);
}

#[test]
fn sparsemixer_masks_far_logits() {
    // Top: 3.0. With eps 0.01, logits more than 2% (relative) below it are masked: only 2.99
    // stays, so the first weight is softmax over {3.0, 2.99}.
    let logits = Mat {
        rows: 1,
        cols: 4,
        data: vec![2.99, 3.0, 1.0, -2.0],
    };
    let r = Cpu
        .route(&logits, RouteSpec::SparseMixer { jitter_eps: 0.01 })
        .unwrap();
    assert_eq!(r.ids, vec![1, 0]);
    let w1 = 1.0 / (1.0 + (2.99f32 - 3.0).exp());
    assert!((r.weights[0] - w1).abs() < 1e-6, "{:?}", r.weights);
    // Second pick: 2.99 among the rest; 1.0 and -2.0 are far below it, 3.0 is excluded.
    assert!((r.weights[1] - 1.0).abs() < 1e-6, "{:?}", r.weights);
    // With a huge eps nothing is masked: plain softmax over the remaining logits.
    let r = Cpu
        .route(&logits, RouteSpec::SparseMixer { jitter_eps: 100.0 })
        .unwrap();
    let e: Vec<f32> = logits.data.iter().map(|x| x.exp()).collect();
    assert!((r.weights[0] - e[1] / e.iter().sum::<f32>()).abs() < 1e-6);
    assert!((r.weights[1] - e[0] / (e[0] + e[2] + e[3])).abs() < 1e-6);
}

#[test]
fn rope_styles_rotate_the_right_pairs() {
    let x = Mat {
        rows: 1,
        cols: 4,
        data: vec![1.0, 2.0, 3.0, 4.0],
    };
    let inv = [1.0f32, 0.0];
    let spec = |style| RopeSpec {
        heads: 1,
        head_stride: 4,
        offset: 0,
        rot_dim: 4,
        style,
    };
    let (c, s) = (1.0f32.cos(), 1.0f32.sin());
    let mut half = x.clone();
    Cpu.rope(&mut half, spec(RopeStyle::Half), &inv, &[1], &[1.0])
        .unwrap();
    // Pairs (0, 2) rotate by 1 rad, (1, 3) by 0.
    let want = [1.0 * c - 3.0 * s, 2.0, 3.0 * c + 1.0 * s, 4.0];
    half.data
        .iter()
        .zip(want)
        .for_each(|(a, b)| assert!((a - b).abs() < 1e-6));
    let mut inter = x.clone();
    Cpu.rope(&mut inter, spec(RopeStyle::Interleaved), &inv, &[1], &[2.0])
        .unwrap();
    // Pairs (0, 1) rotate by 1 rad, (2, 3) by 0; everything scaled by 2.
    let want = [2.0 * (c - 2.0 * s), 2.0 * (s + 2.0 * c), 6.0, 8.0];
    inter
        .data
        .iter()
        .zip(want)
        .for_each(|(a, b)| assert!((a - b).abs() < 1e-5));
}

#[test]
fn argmax_is_the_greedy_choice_of_the_decode_loop() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut m = random(&mut rng, 6, 37);
    // Row 1: NaN first; row 2: a tie; row 3: only -inf and NaN; row 4: zeros of both signs.
    m.data[37] = f32::NAN;
    m.data[2 * 37 + 5] = 9.0;
    m.data[2 * 37 + 30] = 9.0;
    for (i, v) in m.data[3 * 37..4 * 37].iter_mut().enumerate() {
        *v = if i % 2 == 0 {
            f32::NEG_INFINITY
        } else {
            f32::NAN
        };
    }
    for (i, v) in m.data[4 * 37..5 * 37].iter_mut().enumerate() {
        *v = match i % 4 {
            1 => -0.0,
            3 => 0.0,
            _ => -2.0,
        };
    }
    let want: Vec<u32> = m.data.chunks(37).map(crate::decode::argmax_scan).collect();
    assert_eq!(Cpu.argmax(&m).unwrap(), want);
    assert_ne!(want[1], 0, "NaN never wins");
    assert_eq!(want[2..5], [5, 0, 1]);
}
