//! Every op of the CUDA backend against the CPU reference, on fresh random inputs (never zeros),
//! in the manner of a backend-ops test: the same calls through the [`Backend`] trait on both, the
//! relative error ‖gpu − cpu‖ / ‖cpu‖ printed per case and bounded, and batch invariance checked
//! bit for bit (a batch of rows equals the rows one at a time).
//!
//! One test per op family, so one family runs alone (`cuda_ops -- --ignored attention`) and a
//! failure in one hides nothing in the others; within a family every case runs, and the test
//! fails at the end listing each failed case. They need an NVIDIA GPU (see tests/common/gpu.rs):
//! `scripts/gpu-check.sh run ops` runs them with `--ignored`.

mod common;

use common::ops::*;

use rand::Rng;
use specter::arch::RopeStyle;
use specter::backend::cpu::Cpu;
use specter::backend::cuda::{CudaBackend, CudaOptions};
use specter::backend::{AttentionSpec, Backend, GatedMlp, RopeSpec, RouteSpec, Routing};

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn linear() {
    let mut p = Family::new("linear", 7);
    // Widths that take the vector path (multiples of 8) and the scalar one.
    for &(rows, k, n) in &[
        (1, 2048, 1408),
        (5, 128, 96),
        (17, 136, 40),
        (3, 100, 33),
        (9, 2048, 4096),
        // Decode and window rows through each row grouping of linear_f16 (all up to 2, pairs up
        // to 4, then fours), odd feature counts (a warp with one feature), and more rows than
        // one group.
        (1, 2048, 577),
        (2, 512, 4096),
        (4, 136, 41),
        (13, 2048, 7),
        // More work blocks than fit on the device at once: blocks loop over them.
        (1, 256, 9001),
        (3, 264, 8200),
    ] {
        let (xc, xg, xv) = p.act(rows, k);
        let (wc, wg) = p.weight("w", &[n, k], 0.05);
        let (bc, bg) = p.weight("b", &[n], 0.5);
        let yg = p.gpu.linear(&xg, &wg, None);
        p.check(
            &format!("linear {rows}x{k} -> {n}"),
            yg,
            &Cpu.linear(&xc, &wc, None).unwrap(),
        );
        let yg = p.gpu.linear(&xg, &wg, Some(&bg));
        let Some(all) = p.check(
            &format!("linear+bias {rows}x{k} -> {n}"),
            yg,
            &Cpu.linear(&xc, &wc, Some(&bc)).unwrap(),
        ) else {
            continue;
        };
        // Batch invariance: each row alone gives the same bits as inside the batch.
        for r in 0..rows {
            let alone = p
                .gpu
                .upload(1, k, &xv[r * k..(r + 1) * k])
                .and_then(|row| p.gpu.head_rows(&row, 1))
                .and_then(|one| p.gpu.linear(&one, &wg, Some(&bg)))
                .and_then(|y| p.gpu.to_host(&y));
            p.same_bits(
                &format!("linear {rows}x{k} -> {n}: row {r} alone"),
                alone,
                &all[r * n..(r + 1) * n],
            );
        }
    }
    p.finish();
}

/// A prompt pass's products of many rows (tensor cores, kernels/gemm_f16.cu). On activations
/// that f16 holds exactly, only the order of the f32 sums differs from the CPU's; on any other,
/// the kernel's one rounding of the activation to f16 adds about 2^-12 relative.
#[cfg(feature = "prompt-tensor-cores")]
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn prompt_products() {
    use half::f16;
    const ROUNDED_TOLERANCE: f64 = 1e-3;
    let mut p = Family::new("prompt products", 11);
    p.gpu.prompt_pass(true);
    // DeepSeek-V2-Lite's dense widths at prompt lengths, partial tiles in rows and features,
    // and the fewest rows that take tensor cores.
    for &(rows, k, n) in &[
        (32, 2048, 1408),
        (200, 2048, 3072),
        (512, 512, 4096),
        (77, 128, 100),
        (64, 1408, 2048),
        (300, 2048, 577),
        (1024, 2048, 2048),
    ] {
        let v: Vec<f32> = p
            .values(rows * k, 1.0)
            .into_iter()
            .map(|x| f16::from_f32(x).to_f32())
            .collect();
        let xc = Cpu.upload(rows, k, &v).unwrap();
        let xg = p.gpu.upload(rows, k, &v).expect("GPU upload");
        let (wc, wg) = p.weight("w", &[n, k], 0.05);
        let (bc, bg) = p.weight("b", &[n], 0.5);
        let yg = p.gpu.linear(&xg, &wg, Some(&bg));
        p.check(
            &format!("prompt linear+bias {rows}x{k} -> {n}"),
            yg,
            &Cpu.linear(&xc, &wc, Some(&bc)).unwrap(),
        );
        // Activations f16 does not hold: the rounding's error alone.
        let (xc, xg, _) = p.act(rows, k);
        let gpu = p.gpu.linear(&xg, &wg, None).and_then(|y| p.gpu.to_host(&y));
        let cpu = Cpu.to_host(&Cpu.linear(&xc, &wc, None).unwrap()).unwrap();
        let case = format!("prompt linear {rows}x{k} -> {n}, f32 activations");
        p.compare_within(&case, gpu, &cpu, ROUNDED_TOLERANCE);
    }
    // Gated MLPs (a dense layer's, the shared experts'): the input and the activation between
    // the products each rounded to f16 once.
    for &(rows, hidden, inter) in &[(200, 2048, 1408), (64, 256, 96), (40, 2048, 2816)] {
        let (xc, xg, _) = p.act(rows, hidden);
        let (cpu_mlp, gpu_mlp) = random_experts(&mut p, hidden, inter, 1);
        let case = format!("prompt gated_mlp {rows}x{hidden} inter {inter}");
        let want = Cpu
            .to_host(&Cpu.gated_mlp(&xc, &cpu_mlp[0]).unwrap())
            .unwrap();
        let got = p
            .gpu
            .gated_mlp(&xg, &gpu_mlp[0])
            .and_then(|y| p.gpu.to_host(&y));
        p.compare_within(&case, got, &want, 2.0 * ROUNDED_TOLERANCE);
    }
    p.gpu.prompt_pass(false);
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn norms() {
    let mut p = Family::new("norms", 11);
    let (xc, xg, _) = p.act(6, 192);
    let (wc, wg) = p.weight("norm", &[192], 1.0);
    let (bc, bg) = p.weight("bias", &[192], 1.0);
    let got = p.gpu.rms_norm(&xg, &wg, 1e-6, 192);
    p.check(
        "rms_norm 6x192",
        got,
        &Cpu.rms_norm(&xc, &wc, 1e-6, 192).unwrap(),
    );
    // Vector path of one row (decode), a width past the register cache, and a scalar width.
    for &(rows, width, group) in &[
        (1, 2048, 2048),
        (2, 8192, 8192),
        (3, 8192, 2048),
        (3, 102, 102),
    ] {
        let (xc, xg, _) = p.act(rows, width);
        let (wc, wg) = p.weight("norm", &[group], 1.0);
        let got = p.gpu.rms_norm(&xg, &wg, 1e-6, group);
        p.check(
            &format!("rms_norm {rows}x{width} per group of {group}"),
            got,
            &Cpu.rms_norm(&xc, &wc, 1e-6, group).unwrap(),
        );
    }
    let (wc2, wg2) = p.weight("norm32", &[32], 1.0);
    let got = p.gpu.rms_norm(&xg, &wg2, 1e-6, 32);
    p.check(
        "rms_norm 6x192 per group of 32",
        got,
        &Cpu.rms_norm(&xc, &wc2, 1e-6, 32).unwrap(),
    );
    let got = p.gpu.layer_norm(&xg, &wg, &bg, 1e-5);
    p.check(
        "layer_norm 6x192",
        got,
        &Cpu.layer_norm(&xc, &wc, &bc, 1e-5).unwrap(),
    );
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn embedding() {
    let mut p = Family::new("embedding", 13);
    let (tc, tg) = p.weight("embed", &[300, 64], 1.0);
    let ids = [5u32, 299, 0, 17, 17];
    let got = p.gpu.embedding(&tg, &ids);
    p.check("embedding", got, &Cpu.embedding(&tc, &ids).unwrap());
    let refused = p.gpu.embedding(&tg, &[300]).is_err();
    p.expect("embedding of an out-of-range id", refused, || {
        "id 300 of a 300-row table was accepted".to_string()
    });
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn split_add_clamp() {
    let mut p = Family::new("split_add_clamp", 17);
    let (xc, xg, _) = p.act(4, 100);
    // Three pieces: one launch; five pieces: one launch of four and one of one.
    for widths in [&[60, 7, 33][..], &[5, 20, 3, 40, 32]] {
        let pc = Cpu.split_cols(&xc, widths).unwrap();
        match p.gpu.split_cols(&xg, widths) {
            Ok(pg) => {
                p.expect(
                    &format!("split_cols {widths:?}: piece count"),
                    pg.len() == pc.len(),
                    || format!("{} pieces, want {}", pg.len(), pc.len()),
                );
                for (i, (g, c)) in pg.into_iter().zip(&pc).enumerate() {
                    p.check(&format!("split_cols {widths:?}: piece {i}"), Ok(g), c);
                }
            }
            Err(err) => {
                p.checks += 1;
                p.fail(
                    &format!("split_cols {widths:?}"),
                    format!("GPU error: {err}"),
                );
            }
        }
    }
    let (mut ac, mut ag, _) = p.act(4, 100);
    Cpu.add_assign(&mut ac, &xc).unwrap();
    let result = p.gpu.add_assign(&mut ag, &xg);
    p.check_in_place("add_assign", result, &ag, &ac);
    let (gc, gg, _) = p.act(4, 1);
    Cpu.add_sigmoid_gated(&mut ac, &xc, &gc).unwrap();
    let result = p.gpu.add_sigmoid_gated(&mut ag, &xg, &gg);
    p.check_in_place("add_sigmoid_gated", result, &ag, &ac);
    Cpu.clamp(&mut ac, 0.3).unwrap();
    let result = p.gpu.clamp(&mut ag, 0.3);
    p.check_in_place("clamp", result, &ag, &ac);
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rope() {
    let mut p = Family::new("rope", 19);
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        let (mut rc, mut rg, _) = p.act(3, 4 * 48);
        let spec = RopeSpec {
            heads: 4,
            head_stride: 48,
            offset: 16,
            rot_dim: 32,
            style,
        };
        let inv: Vec<f32> = (0..16)
            .map(|i| 10000f32.powf(-(2.0 * i as f32) / 32.0))
            .collect();
        let pos = [7usize, 8, 4000];
        let scales = [1.0f32, 1.0, 1.3];
        Cpu.rope(&mut rc, spec, &inv, &pos, &scales).unwrap();
        let result = p.gpu.rope(&mut rg, spec, &inv, &pos, &scales);
        p.check_in_place(&format!("rope {style:?}"), result, &rg, &rc);
    }
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn mla_expand_kv() {
    let mut p = Family::new("mla_expand_kv", 23);
    for &(rows, heads, nope, rope, v_dim, label) in &[
        (9, 4, 32, 16, 32, ""),
        (2, 16, 128, 64, 128, " (DeepSeek-V2-Lite widths)"),
    ] {
        let (kvc, kvg, _) = p.act(rows, heads * (nope + v_dim));
        let (pec, peg, _) = p.act(rows, rope);
        let (kc, vc) = Cpu.mla_expand_kv(&kvc, &pec, heads, nope, v_dim).unwrap();
        match p.gpu.mla_expand_kv(&kvg, &peg, heads, nope, v_dim) {
            Ok((kg, vg)) => {
                p.check(&format!("mla_expand_kv keys{label}"), Ok(kg), &kc);
                p.check(&format!("mla_expand_kv values{label}"), Ok(vg), &vc);
            }
            Err(err) => {
                p.checks += 1;
                p.fail(
                    &format!("mla_expand_kv{label}"),
                    format!("GPU error: {err}"),
                );
            }
        }
    }
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn attention() {
    let mut p = Family::new("attention", 29);
    // The plain backend combines chunks through global memory, not in clusters.
    let global = common::gpu::backend_with(&CudaOptions {
        plain: true,
        ..CudaOptions::default()
    });
    // GQA with a window, MHA, and MLA-like widths; prefill rows and a decode row.
    for &(heads, kv_heads, qk, vd, window, len, rows) in &[
        (4, 2, 32, 32, None, 40, 7),
        (8, 8, 64, 64, Some(16), 50, 1),
        (16, 16, 192, 128, None, 144, 17),
        // MLA decode; key counts at and just past a whole number of 32-key chunks in every
        // split; long contexts (chunks of 576 keys); chunks of more keys than fit the kernel's
        // shared-memory scores (global scratch); widths off the 16-byte path; values wider
        // than one 128-channel tile.
        (16, 16, 192, 128, None, 60, 1),
        (16, 16, 192, 128, None, 256, 1),
        (16, 16, 192, 128, None, 257, 2),
        (2, 1, 64, 64, None, 4500, 5),
        (2, 1, 64, 64, None, 33000, 2),
        (4, 4, 30, 18, Some(7), 23, 5),
        (2, 2, 64, 160, None, 33, 3),
        // More (row, head) pairs than the backend's counters: the chunks are combined by a
        // second launch, and the last row alone (combined in the same launch) has its bits.
        (64, 8, 16, 16, None, 200, 129),
    ] {
        let spec = attention_spec((heads, kv_heads, qk, vd), len - rows, window);
        let [(qc, qg, qv), (kc, kg, kv), (vc, vg, vv)] = attention_inputs(&mut p, &spec, rows, len);
        let case = format!("attention h{heads}/{kv_heads} qk{qk} v{vd} len{len} rows{rows}");
        let got = p.gpu.attention(&qg, &kg, &vg, len, spec);
        let Some(all) = p.check(
            &case,
            got,
            &Cpu.attention(&qc, &kc, &vc, len, spec).unwrap(),
        ) else {
            continue;
        };
        // The chunks combined through global memory (where the default combines them in a
        // cluster's shared memory: sm_90 and newer) give the same bits.
        let plain = (|| {
            let q = global.upload(rows, heads * qk, &qv)?;
            let k = global.upload(len + 3, kv_heads * qk, &kv)?;
            let v = global.upload(len + 3, kv_heads * vd, &vv)?;
            global.to_host(&global.attention(&q, &k, &v, len, spec)?)
        })();
        p.same_bits(&format!("{case}: combined in global memory"), plain, &all);
        // The last row alone (decode) equals the last row of the batch, bitwise.
        let last_spec = AttentionSpec {
            start: len - 1,
            ..spec
        };
        let alone = p
            .gpu
            .upload(1, heads * qk, &qv[(rows - 1) * heads * qk..])
            .and_then(|last| p.gpu.attention(&last, &kg, &vg, len, last_spec))
            .and_then(|o| p.gpu.to_host(&o));
        p.same_bits(
            &format!("{case}: last row alone"),
            alone,
            &all[(rows - 1) * heads * vd..],
        );
    }
    p.finish();
}

/// Attention of (heads, kv heads, qk width, v width) from position `start`, scaled by
/// 1 / sqrt(qk).
fn attention_spec(
    (heads, kv_heads, qk_dim, v_dim): (usize, usize, usize, usize),
    start: usize,
    window: Option<usize>,
) -> AttentionSpec {
    AttentionSpec {
        heads,
        kv_heads,
        qk_dim,
        v_dim,
        scale: 1.0 / (qk_dim as f32).sqrt(),
        start,
        window,
    }
}

/// Random q (`rows` rows) and k, v (`len` keys and 3 more) for `spec`, on both backends.
fn attention_inputs(
    p: &mut Family,
    spec: &AttentionSpec,
    rows: usize,
    len: usize,
) -> [(CpuAct, GpuAct, Vec<f32>); 3] {
    [
        p.act(rows, spec.heads * spec.qk_dim),
        p.act(len + 3, spec.kv_heads * spec.qk_dim),
        p.act(len + 3, spec.kv_heads * spec.v_dim),
    ]
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn host_routing_and_argmax() {
    let mut p = Family::new("host_routing_and_argmax", 31);
    // Routing brought to the host: by the device's routing kernels (so that a layer routed for
    // the host has the bits of one routed on the device alone; tests/cuda_placement.rs), against
    // the CPU reference: the same experts, weights within rounding; and past the kernels' top-k
    // limit (MAX_TOP_K, 16), the CPU reference's own routing, bit for bit.
    let (lc, lg, _) = p.act(5, 64);
    for (top_k, exact) in [(6, false), (48, true)] {
        let spec = RouteSpec::SoftmaxTopK {
            top_k,
            renormalize: true,
            scale: 1.0,
        };
        let case = format!("route top{top_k} of 64");
        let want = Cpu.route(&lc, spec).unwrap();
        match p.gpu.route(&lg, spec) {
            Ok(got) => {
                let rel = got
                    .weights
                    .iter()
                    .zip(&want.weights)
                    .map(|(g, w)| ((g - w) / w).abs())
                    .fold(0.0f32, f32::max);
                let same = got.ids == want.ids
                    && got.top_k == want.top_k
                    && if exact { got == want } else { rel <= 1e-6 };
                p.expect(&case, same, || {
                    format!("GPU routing {got:?} (weights' worst relative error {rel:.2e}), CPU routing {want:?}")
                });
            }
            Err(err) => {
                p.checks += 1;
                p.fail(&case, format!("GPU error: {err}"));
            }
        }
    }
    // Greedy choice: the index decode::argmax_scan takes on the host, on random rows and on rows
    // made of ties, signed zeros, infinities and NaN; one row and many (past the 64 rows one
    // launch takes), vocabularies whose rows are and are not 16-byte multiples, chunk edges.
    for (rows, cols) in [
        (1, 102_400),
        (3, 102_400),
        (17, 32_000),
        (70, 4_097),
        (5, 4_096),
        (9, 1_001),
        (4, 3),
    ] {
        let mut data = p.values(rows * cols, 4.0);
        for r in 0..rows {
            let row = &mut data[r * cols..(r + 1) * cols];
            let at = |i: usize| (i * 7919 + r * 104_729) % cols;
            match r % 7 {
                // A tie of the maximum: the first index must win, across chunks.
                1 => {
                    let (a, b) = (at(1).min(at(2)), at(1).max(at(2)));
                    row[a] = 100.0;
                    row[b] = 100.0;
                }
                // NaN first and elsewhere: never chosen.
                2 => {
                    row[0] = f32::NAN;
                    row[at(3)] = f32::NAN;
                }
                // Every value -inf or NaN: index 0.
                3 => row.iter_mut().enumerate().for_each(|(i, v)| {
                    *v = if i % 3 == 0 {
                        f32::NAN
                    } else {
                        f32::NEG_INFINITY
                    }
                }),
                // Zeros of both signs as the maximum: the first of them, whatever its sign.
                4 => row.iter_mut().enumerate().for_each(|(i, v)| {
                    *v = if i % 5 == 4 {
                        0.0
                    } else if i % 5 == 2 {
                        -0.0
                    } else {
                        -1.0
                    }
                }),
                // +inf twice.
                5 => {
                    row[at(5)] = f32::INFINITY;
                    row[at(6)] = f32::INFINITY;
                }
                _ => {}
            }
        }
        let want: Vec<u32> = data
            .chunks(cols)
            .map(specter::decode::argmax_scan)
            .collect();
        let case = format!("argmax {rows}x{cols}");
        let got = p
            .gpu
            .upload(rows, cols, &data)
            .and_then(|g| p.gpu.argmax(&g));
        match got {
            Ok(got) => p.expect(&case, got == want, || format!("GPU {got:?}, host {want:?}")),
            Err(err) => {
                p.checks += 1;
                p.fail(&case, format!("GPU error: {err}"));
            }
        }
        let cpu = Cpu
            .upload(rows, cols, &data)
            .and_then(|c| Cpu.argmax(&c))
            .unwrap();
        p.expect(&format!("{case} (CPU backend)"), cpu == want, || {
            format!("CPU backend {cpu:?}, host {want:?}")
        });
    }
    p.finish();
}

/// Expert FFN shapes: (hidden, inter, experts, rows, top_k).
const EXPERT_SHAPES: [(usize, usize, usize, usize, usize); 9] = [
    (128, 128, 8, 5, 2),
    (2048, 1408, 8, 17, 6),
    (96, 40, 4, 3, 2),
    // Decode (one row) and a 4-row window through the narrow row groups.
    (256, 176, 16, 1, 6),
    (512, 88, 8, 4, 3),
    // More rows than the fused routing + work-list launch takes: two launches.
    (64, 32, 8, 70, 2),
    // Decode at DeepSeek-V2-Lite's expert widths, and at widths that are not multiples of 8 (the
    // scalar paths; a last output block of 4 features).
    (2048, 1408, 8, 1, 6),
    (100, 36, 6, 1, 2),
    // One row of seven experts of twelve.
    (64, 48, 12, 1, 7),
];

/// `experts` random FP16 gated MLPs, the same on both backends.
fn random_experts(
    p: &mut Family,
    hidden: usize,
    inter: usize,
    experts: usize,
) -> (Vec<GatedMlp<Cpu>>, Vec<GatedMlp<CudaBackend>>) {
    let mut cpu_experts = Vec::new();
    let mut gpu_experts = Vec::new();
    for e in 0..experts {
        let (guc, gug) = p.weight(&format!("e{e}.gate_up"), &[2 * inter, hidden], 0.05);
        let (dc, dg) = p.weight(&format!("e{e}.down"), &[hidden, inter], 0.05);
        cpu_experts.push(GatedMlp {
            gate_up: guc,
            down: dc,
        });
        gpu_experts.push(GatedMlp {
            gate_up: gug,
            down: dg,
        });
    }
    (cpu_experts, gpu_experts)
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gated_mlp() {
    let mut p = Family::new("gated_mlp", 37);
    for &(hidden, inter, _, rows, _) in &EXPERT_SHAPES {
        let (xc, xg, xv) = p.act(rows, hidden);
        let (cpu_mlp, gpu_mlp) = random_experts(&mut p, hidden, inter, 1);
        let case = format!("gated_mlp {rows}x{hidden} inter {inter}");
        let got = p.gpu.gated_mlp(&xg, &gpu_mlp[0]);
        let Some(all) = p.check(&case, got, &Cpu.gated_mlp(&xc, &cpu_mlp[0]).unwrap()) else {
            continue;
        };
        // The last row alone gives the same bits as inside the batch.
        let alone = p
            .gpu
            .upload(1, hidden, &xv[(rows - 1) * hidden..])
            .and_then(|last| p.gpu.gated_mlp(&last, &gpu_mlp[0]))
            .and_then(|y| p.gpu.to_host(&y));
        p.same_bits(
            &format!("{case}: last row alone"),
            alone,
            &all[(rows - 1) * hidden..],
        );
    }
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn moe_experts_host_routing() {
    let mut p = Family::new("moe_experts_host_routing", 41);
    for &(hidden, inter, experts, rows, top_k) in &EXPERT_SHAPES {
        let (xc, xg, _) = p.act(rows, hidden);
        let (cpu_experts, gpu_experts) = random_experts(&mut p, hidden, inter, experts);
        // Uneven rows per expert: expert 0 is hit by every row, the others at random.
        let mut ids = Vec::new();
        let mut weights = Vec::new();
        for _ in 0..rows {
            let mut chosen = vec![0u32];
            while chosen.len() < top_k {
                let e = p.rng.random_range(1..experts as u32);
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            ids.extend(&chosen);
            weights.extend((0..top_k).map(|_| p.rng.random_range(0.05f32..1.0)));
        }
        let routing = Routing {
            top_k,
            ids,
            weights,
        };
        let case = format!("moe_experts {rows}x{hidden} inter {inter} top{top_k}");
        let got = p.gpu.moe_experts(&xg, &routing, &gpu_experts);
        let Some(all) = p.check(
            &case,
            got,
            &Cpu.moe_experts(&xc, &routing, &cpu_experts).unwrap(),
        ) else {
            continue;
        };
        // Row 0 alone gives the same bits as inside the batch.
        let r0 = Routing {
            top_k,
            ids: routing.ids[..top_k].to_vec(),
            weights: routing.weights[..top_k].to_vec(),
        };
        let alone = p
            .gpu
            .head_rows(&xg, 1)
            .and_then(|x0| p.gpu.moe_experts(&x0, &r0, &gpu_experts))
            .and_then(|y| p.gpu.to_host(&y));
        p.same_bits(&format!("{case}: row 0 alone"), alone, &all[..hidden]);
    }
    p.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn moe_experts_device_routing() {
    let mut p = Family::new("moe_experts_device_routing", 43);
    for &(hidden, inter, experts, rows, top_k) in &EXPERT_SHAPES {
        let (xc, xg, _) = p.act(rows, hidden);
        let (cpu_experts, gpu_experts) = random_experts(&mut p, hidden, inter, experts);
        // Routing, work list and experts all on the device (no host round trip).
        let mut specs: Vec<(String, RouteSpec)> = [(true, 1.0f32), (false, 2.5)]
            .into_iter()
            .map(|(renormalize, scale)| {
                (
                    format!("top{top_k} renorm {renormalize}"),
                    RouteSpec::SoftmaxTopK {
                        top_k,
                        renormalize,
                        scale,
                    },
                )
            })
            .collect();
        if top_k == 2 {
            specs.push((
                "sparse mixer".into(),
                RouteSpec::SparseMixer { jitter_eps: 0.01 },
            ));
        }
        for (label, spec) in specs {
            let case = format!("routed_moe on device {rows}x{hidden} {label}");
            let (lc, lg, _) = p.act(rows, experts);
            let rc = Cpu.route(&lc, spec).unwrap();
            let oc = Cpu.moe_experts(&xc, &rc, &cpu_experts).unwrap();
            // Routing counted on the device as MoE layer 1 of 2 (the draft's prefetch counts).
            let routed = p.gpu.enable_route_counts(2, experts).and_then(|()| {
                p.gpu
                    .routed_moe(&xg, &lg, spec, &gpu_experts, false, Some(1))
            });
            let (og, host) = match routed {
                Ok(routed) => routed,
                Err(err) => {
                    p.checks += 1;
                    p.fail(&case, format!("GPU error: {err}"));
                    continue;
                }
            };
            p.expect(
                &format!("{case}: routing stays on the device"),
                host.is_none(),
                || "the device path returned host routing".to_string(),
            );
            let mut want = vec![0u32; 2 * experts];
            for &e in &rc.ids {
                want[experts + e as usize] += 1;
            }
            match p.gpu.route_counts() {
                Ok(counts) => p.expect(&format!("{case}: routing counts"), counts == want, || {
                    format!("device counts {counts:?}, want {want:?}")
                }),
                Err(err) => {
                    p.checks += 1;
                    p.fail(
                        &format!("{case}: routing counts"),
                        format!("GPU error: {err}"),
                    );
                }
            }
            let og = p.check(&case, Ok(og), &oc);
            // The shared experts' output added in the combine: the same bits as the unfused
            // ops.
            let (sc, sg, _) = p.act(rows, hidden);
            let fcase = format!("routed_moe_plus {rows}x{hidden} {label}");
            let fc = Cpu
                .routed_moe_plus(&xc, &lc, spec, &cpu_experts, None, &sc)
                .unwrap();
            let fused = p
                .gpu
                .routed_moe_plus(&xg, &lg, spec, &gpu_experts, None, &sg);
            let got = p.check(&fcase, fused, &fc);
            let plain = p
                .gpu
                .routed_moe(&xg, &lg, spec, &gpu_experts, false, None)
                .and_then(|(mut o, _)| {
                    p.gpu.add_assign(&mut o, &sg)?;
                    p.gpu.to_host(&o)
                });
            if let (Some(got), Some(_)) = (got, og) {
                p.same_bits(&format!("{fcase} = routed_moe + add"), plain, &got);
            }
            // Shared experts (twice the experts' width) run in the routed experts' launches: the
            // CPU's separate ops, and bit for bit the GPU's own (their gated MLP, then the
            // combine's add).
            let (cpu_shared, gpu_shared) = random_experts(&mut p, hidden, 2 * inter, 1);
            let scase = format!("routed_moe_shared {rows}x{hidden} {label}");
            let want = Cpu
                .routed_moe_shared(&xc, &lc, spec, &cpu_experts, None, &cpu_shared[0])
                .unwrap();
            let fused = p
                .gpu
                .routed_moe_shared(&xg, &lg, spec, &gpu_experts, None, &gpu_shared[0]);
            let got = p.check(&scase, fused, &want);
            let separate = p
                .gpu
                .gated_mlp(&xg, &gpu_shared[0])
                .and_then(|s| {
                    p.gpu
                        .routed_moe_plus(&xg, &lg, spec, &gpu_experts, None, &s)
                })
                .and_then(|o| p.gpu.to_host(&o));
            if let Some(got) = got {
                p.same_bits(
                    &format!("{scase} = gated_mlp + routed_moe_plus"),
                    separate,
                    &got,
                );
            }
        }
    }
    p.finish();
}

/// A prompt pass's routed FP16 experts on tensor cores (kernels/gemm_f16.cu), with host routing
/// and on the device with shared experts, against the CPU: each item's input and gate/up
/// activation are rounded to f16 once, about 2^-12 relative each.
#[cfg(feature = "prompt-tensor-cores")]
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn prompt_experts() {
    const ROUNDED_TOLERANCE: f64 = 2e-3;
    let mut p = Family::new("prompt experts", 47);
    p.gpu.prompt_pass(true);
    // DeepSeek-V2-Lite's widths at prompt lengths (groups of several row tiles, and of none),
    // a small shape, and a width the tensor cores do not take (the gemv kernels run).
    for &(hidden, inter, experts, rows, top_k) in &[
        (2048, 1408, 64, 512, 6),
        (2048, 1408, 64, 40, 6),
        (256, 128, 8, 300, 2),
        (128, 100, 6, 64, 2),
    ] {
        let (xc, xg, _) = p.act(rows, hidden);
        let (cpu_experts, gpu_experts) = random_experts(&mut p, hidden, inter, experts);
        let spec = RouteSpec::SoftmaxTopK {
            top_k,
            renormalize: true,
            scale: 1.0,
        };
        let (lc, lg, _) = p.act(rows, experts);
        let rc = Cpu.route(&lc, spec).unwrap();
        let mut cases: Vec<(String, specter::Result<Vec<f32>>, Vec<f32>)> = Vec::new();
        let want = Cpu.moe_experts(&xc, &rc, &cpu_experts).unwrap();
        let got = p
            .gpu
            .moe_experts(&xg, &rc, &gpu_experts)
            .and_then(|y| p.gpu.to_host(&y));
        cases.push((
            format!("prompt moe_experts {rows}x{hidden} inter {inter} top{top_k}"),
            got,
            Cpu.to_host(&want).unwrap(),
        ));
        let (cpu_shared, gpu_shared) = random_experts(&mut p, hidden, 2 * inter, 1);
        let want = Cpu
            .routed_moe_shared(&xc, &lc, spec, &cpu_experts, None, &cpu_shared[0])
            .unwrap();
        let got = p
            .gpu
            .routed_moe_shared(&xg, &lg, spec, &gpu_experts, None, &gpu_shared[0])
            .and_then(|y| p.gpu.to_host(&y));
        cases.push((
            format!("prompt routed_moe_shared {rows}x{hidden} inter {inter} top{top_k}"),
            got,
            Cpu.to_host(&want).unwrap(),
        ));
        for (case, got, want) in cases {
            p.compare_within(&case, got, &want, ROUNDED_TOLERANCE);
        }
    }
    p.gpu.prompt_pass(false);
    p.finish();
}

/// A prompt pass's causal attention on tensor cores (kernels/attention_prompt.cu) against the
/// CPU: queries, keys, values and softmax weights rounded to f16, scores and sums in f32.
#[cfg(feature = "prompt-tensor-cores")]
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn prompt_attention() {
    const ROUNDED_TOLERANCE: f64 = 3e-3;
    let mut p = Family::new("prompt attention", 53);
    p.gpu.prompt_pass(true);
    // MLA's widths (a prompt from position 0, several row and key tiles), GQA at 128 with a
    // prompt after cached positions, a window, partial tiles, one head of several; a width
    // with no tensor-core form (attention.cu runs).
    for &(heads, kv_heads, qk, vd, window, start, rows) in &[
        (16, 16, 192, 128, None, 0, 300),
        (4, 2, 128, 128, None, 37, 200),
        (2, 2, 64, 64, Some(48), 0, 100),
        (3, 1, 128, 128, None, 5, 33),
        (2, 2, 32, 32, None, 0, 64),
    ] {
        let len = start + rows;
        let spec = attention_spec((heads, kv_heads, qk, vd), start, window);
        let [(qc, qg, _), (kc, kg, _), (vc, vg, _)] = attention_inputs(&mut p, &spec, rows, len);
        let case =
            format!("prompt attention h{heads}/{kv_heads} qk{qk} v{vd} from {start} rows{rows}");
        let want = Cpu
            .to_host(&Cpu.attention(&qc, &kc, &vc, len, spec).unwrap())
            .unwrap();
        let got = p
            .gpu
            .attention(&qg, &kg, &vg, len, spec)
            .and_then(|y| p.gpu.to_host(&y));
        p.compare_within(&case, got, &want, ROUNDED_TOLERANCE);
    }
    p.gpu.prompt_pass(false);
    p.finish();
}
