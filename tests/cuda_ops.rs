//! Every op of the CUDA backend against the CPU reference, on fresh random inputs (never zeros),
//! in the manner of a backend-ops test: the same calls through the [`Backend`] trait on both, the
//! relative error ‖gpu − cpu‖ / ‖cpu‖ printed per op and bounded, and batch invariance checked
//! bit for bit (a batch of rows equals the rows one at a time).
//!
//! These need a CUDA GPU, so they are ignored here; `scripts/gpu-check.sh` runs them on the
//! GPU machine with `--ignored`.

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::arch::RopeStyle;
use specter::backend::cpu::Cpu;
use specter::backend::cuda::CudaBackend;
use specter::backend::{AttentionSpec, Backend, GatedMlp, RopeSpec, RouteSpec, Routing};

/// f32 arithmetic in a different order than the CPU: far below this.
const TOLERANCE: f64 = 2e-5;

fn rel_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    assert_eq!(gpu.len(), cpu.len(), "lengths differ");
    assert!(gpu.iter().all(|v| v.is_finite()), "non-finite GPU output");
    let num: f64 = gpu
        .iter()
        .zip(cpu)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = cpu.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

struct Pair {
    gpu: CudaBackend,
    rng: ChaCha8Rng,
    report: Vec<(String, f64)>,
}

impl Pair {
    fn new(seed: u64) -> Pair {
        Pair {
            gpu: CudaBackend::open(0).expect("a CUDA GPU (this test runs on the GPU machine)"),
            rng: ChaCha8Rng::seed_from_u64(seed),
            report: Vec::new(),
        }
    }

    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| self.rng.random_range(-scale..scale))
            .collect()
    }

    fn act(
        &mut self,
        rows: usize,
        cols: usize,
    ) -> (
        <Cpu as Backend>::Act,
        <CudaBackend as Backend>::Act,
        Vec<f32>,
    ) {
        let v = self.values(rows * cols, 1.0);
        (
            Cpu.upload(rows, cols, &v).unwrap(),
            self.gpu.upload(rows, cols, &v).unwrap(),
            v,
        )
    }

    fn weight(
        &mut self,
        name: &str,
        shape: &[usize],
        scale: f32,
    ) -> (<Cpu as Backend>::Weight, <CudaBackend as Backend>::Weight) {
        let n: usize = shape.iter().product();
        let v: Vec<f16> = self
            .values(n, scale)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        (
            Cpu.weight_f16(name, shape, &v).unwrap(),
            self.gpu.weight_f16(name, shape, &v).unwrap(),
        )
    }

    fn check(
        &mut self,
        op: &str,
        gpu: &<CudaBackend as Backend>::Act,
        cpu: &<Cpu as Backend>::Act,
    ) {
        let g = self.gpu.to_host(gpu).unwrap();
        let c = Cpu.to_host(cpu).unwrap();
        let e = rel_err(&g, &c);
        eprintln!("{op:<44} rel err {e:.2e}");
        self.report.push((op.to_string(), e));
        assert!(
            e < TOLERANCE,
            "{op}: relative error {e:e} exceeds {TOLERANCE:e}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-check.sh on the GPU machine"]
fn every_op_matches_the_cpu_reference() {
    let mut p = Pair::new(7);
    // Widths that take the vector path (multiples of 8) and the scalar one.
    for &(rows, k, n) in &[
        (1, 2048, 1408),
        (5, 128, 96),
        (17, 136, 40),
        (3, 100, 33),
        (9, 2048, 4096),
        // Decode and window rows through each row-group width of linear_f16 (1, 2, 4, 8), odd
        // feature counts (a warp with one feature), and more rows than one group.
        (1, 2048, 577),
        (2, 512, 4096),
        (4, 136, 41),
        (13, 2048, 7),
    ] {
        let (xc, xg, _) = p.act(rows, k);
        let (wc, wg) = p.weight("w", &[n, k], 0.05);
        let (bc, bg) = p.weight("b", &[n], 0.5);
        let yc = Cpu.linear(&xc, &wc, None).unwrap();
        let yg = p.gpu.linear(&xg, &wg, None).unwrap();
        p.check(&format!("linear {rows}x{k} -> {n}"), &yg, &yc);
        let yc = Cpu.linear(&xc, &wc, Some(&bc)).unwrap();
        let yg = p.gpu.linear(&xg, &wg, Some(&bg)).unwrap();
        p.check(&format!("linear+bias {rows}x{k} -> {n}"), &yg, &yc);
        // Batch invariance: each row alone gives the same bits as inside the batch.
        let all = p.gpu.to_host(&yg).unwrap();
        for r in 0..rows {
            let one = p
                .gpu
                .head_rows(
                    &p.gpu
                        .upload(1, k, &Cpu.to_host(&xc).unwrap()[r * k..(r + 1) * k])
                        .unwrap(),
                    1,
                )
                .unwrap();
            let y1 = p
                .gpu
                .to_host(&p.gpu.linear(&one, &wg, Some(&bg)).unwrap())
                .unwrap();
            assert!(
                y1.iter()
                    .zip(&all[r * n..(r + 1) * n])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "linear {rows}x{k}: row {r} alone differs from the batch"
            );
        }
    }

    let (xc, xg, _) = p.act(6, 192);
    let (wc, wg) = p.weight("norm", &[192], 1.0);
    let (bc, bg) = p.weight("bias", &[192], 1.0);
    p.check(
        "rms_norm 6x192",
        &p.gpu.rms_norm(&xg, &wg, 1e-6, 192).unwrap(),
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
        p.check(
            &format!("rms_norm {rows}x{width} per group of {group}"),
            &p.gpu.rms_norm(&xg, &wg, 1e-6, group).unwrap(),
            &Cpu.rms_norm(&xc, &wc, 1e-6, group).unwrap(),
        );
    }
    let (wc2, wg2) = p.weight("norm32", &[32], 1.0);
    p.check(
        "rms_norm 6x192 per group of 32",
        &p.gpu.rms_norm(&xg, &wg2, 1e-6, 32).unwrap(),
        &Cpu.rms_norm(&xc, &wc2, 1e-6, 32).unwrap(),
    );
    p.check(
        "layer_norm 6x192",
        &p.gpu.layer_norm(&xg, &wg, &bg, 1e-5).unwrap(),
        &Cpu.layer_norm(&xc, &wc, &bc, 1e-5).unwrap(),
    );

    let (tc, tg) = p.weight("embed", &[300, 64], 1.0);
    let ids = [5u32, 299, 0, 17, 17];
    p.check(
        "embedding",
        &p.gpu.embedding(&tg, &ids).unwrap(),
        &Cpu.embedding(&tc, &ids).unwrap(),
    );
    assert!(
        p.gpu.embedding(&tg, &[300]).is_err(),
        "an out-of-range id must be refused"
    );

    let (xc, xg, _) = p.act(4, 100);
    let pc = Cpu.split_cols(&xc, &[60, 7, 33]).unwrap();
    let pg = p.gpu.split_cols(&xg, &[60, 7, 33]).unwrap();
    for (i, (g, c)) in pg.iter().zip(&pc).enumerate() {
        p.check(&format!("split_cols piece {i}"), g, c);
    }
    // Five pieces: one launch of four and one of one.
    let pc = Cpu.split_cols(&xc, &[5, 20, 3, 40, 32]).unwrap();
    let pg = p.gpu.split_cols(&xg, &[5, 20, 3, 40, 32]).unwrap();
    for (i, (g, c)) in pg.iter().zip(&pc).enumerate() {
        p.check(&format!("split_cols of five, piece {i}"), g, c);
    }
    let (mut ac, mut ag, _) = p.act(4, 100);
    Cpu.add_assign(&mut ac, &xc).unwrap();
    p.gpu.add_assign(&mut ag, &xg).unwrap();
    p.check("add_assign", &ag, &ac);
    let (gc, gg, _) = p.act(4, 1);
    Cpu.add_sigmoid_gated(&mut ac, &xc, &gc).unwrap();
    p.gpu.add_sigmoid_gated(&mut ag, &xg, &gg).unwrap();
    p.check("add_sigmoid_gated", &ag, &ac);
    Cpu.clamp(&mut ac, 0.3).unwrap();
    p.gpu.clamp(&mut ag, 0.3).unwrap();
    p.check("clamp", &ag, &ac);

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
        p.gpu.rope(&mut rg, spec, &inv, &pos, &scales).unwrap();
        p.check(&format!("rope {style:?}"), &rg, &rc);
    }

    let (kvc, kvg, _) = p.act(9, 4 * (32 + 32));
    let (pec, peg, _) = p.act(9, 16);
    let (kc, vc) = Cpu.mla_expand_kv(&kvc, &pec, 4, 32, 32).unwrap();
    let (kg, vg) = p.gpu.mla_expand_kv(&kvg, &peg, 4, 32, 32).unwrap();
    p.check("mla_expand_kv keys", &kg, &kc);
    p.check("mla_expand_kv values", &vg, &vc);
    let (kvc, kvg, _) = p.act(2, 16 * (128 + 128));
    let (pec, peg, _) = p.act(2, 64);
    let (kc, vc) = Cpu.mla_expand_kv(&kvc, &pec, 16, 128, 128).unwrap();
    let (kg, vg) = p.gpu.mla_expand_kv(&kvg, &peg, 16, 128, 128).unwrap();
    p.check("mla_expand_kv keys (DeepSeek-V2-Lite widths)", &kg, &kc);
    p.check("mla_expand_kv values (DeepSeek-V2-Lite widths)", &vg, &vc);

    // Attention: GQA with a window, MHA, and MLA-like widths; prefill rows and a decode row.
    for &(heads, kv_heads, qk, vd, window, len, rows) in &[
        (4, 2, 32, 32, None, 40, 7),
        (8, 8, 64, 64, Some(16), 50, 1),
        (16, 16, 192, 128, None, 144, 17),
        // MLA decode; more keys than fit the kernel's shared-memory scores (global scratch);
        // widths off the 16-byte path; values wider than one 128-channel tile.
        (16, 16, 192, 128, None, 60, 1),
        (2, 1, 64, 64, None, 4500, 5),
        (4, 4, 30, 18, Some(7), 23, 5),
        (2, 2, 64, 160, None, 33, 3),
    ] {
        let (qc, qg, qv) = p.act(rows, heads * qk);
        let (kc, kg, _) = p.act(len + 3, kv_heads * qk);
        let (vc, vg, _) = p.act(len + 3, kv_heads * vd);
        let spec = AttentionSpec {
            heads,
            kv_heads,
            qk_dim: qk,
            v_dim: vd,
            scale: 1.0 / (qk as f32).sqrt(),
            start: len - rows,
            window,
        };
        let oc = Cpu.attention(&qc, &kc, &vc, len, spec).unwrap();
        let og = p.gpu.attention(&qg, &kg, &vg, len, spec).unwrap();
        p.check(
            &format!("attention h{heads}/{kv_heads} qk{qk} v{vd} len{len} rows{rows}"),
            &og,
            &oc,
        );
        // The last row alone (decode) equals the last row of the batch, bitwise.
        let all = p.gpu.to_host(&og).unwrap();
        let last = p
            .gpu
            .upload(1, heads * qk, &qv[(rows - 1) * heads * qk..])
            .unwrap();
        let one = p
            .gpu
            .to_host(
                &p.gpu
                    .attention(
                        &last,
                        &kg,
                        &vg,
                        len,
                        AttentionSpec {
                            start: len - 1,
                            ..spec
                        },
                    )
                    .unwrap(),
            )
            .unwrap();
        assert!(
            one.iter()
                .zip(&all[(rows - 1) * heads * vd..])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "attention: the last row alone differs from the batch"
        );
    }

    // Routing (host code shared with the CPU) and argmax.
    let (lc, lg, _) = p.act(5, 64);
    let spec = RouteSpec::SoftmaxTopK {
        top_k: 6,
        renormalize: true,
        scale: 1.0,
    };
    assert_eq!(
        p.gpu.route(&lg, spec).unwrap(),
        Cpu.route(&lc, spec).unwrap()
    );
    let (lc, lg, _) = p.act(3, 102_400);
    assert_eq!(
        p.gpu.argmax(&lg).unwrap(),
        Cpu.argmax(&lc).unwrap(),
        "argmax"
    );

    // Dense gated MLP and routed experts (FP16), with uneven rows per expert.
    for &(hidden, inter, experts, rows, top_k) in &[
        (128, 128, 8, 5, 2),
        (2048, 1408, 8, 17, 6),
        (96, 40, 4, 3, 2),
        // Decode (one row) and a 4-row window through the narrow row groups.
        (256, 176, 16, 1, 6),
        (512, 88, 8, 4, 3),
        // More rows than the fused routing + work-list launch takes: two launches.
        (64, 32, 8, 70, 2),
    ] {
        let (xc, xg, _) = p.act(rows, hidden);
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
        p.check(
            &format!("gated_mlp {rows}x{hidden} inter {inter}"),
            &p.gpu.gated_mlp(&xg, &gpu_experts[0]).unwrap(),
            &Cpu.gated_mlp(&xc, &cpu_experts[0]).unwrap(),
        );
        // The last row alone gives the same bits as inside the batch.
        let all = p
            .gpu
            .to_host(&p.gpu.gated_mlp(&xg, &gpu_experts[0]).unwrap())
            .unwrap();
        let last = p
            .gpu
            .upload(
                1,
                hidden,
                &p.gpu.to_host(&xg).unwrap()[(rows - 1) * hidden..],
            )
            .unwrap();
        let one = p
            .gpu
            .to_host(&p.gpu.gated_mlp(&last, &gpu_experts[0]).unwrap())
            .unwrap();
        assert!(
            one.iter()
                .zip(&all[(rows - 1) * hidden..])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "gated_mlp: the last row alone differs from the batch"
        );
        let mut ids = Vec::new();
        let mut weights = Vec::new();
        for r in 0..rows {
            // Expert 0 is hit by every row, the others at random.
            let mut chosen = vec![0u32];
            while chosen.len() < top_k {
                let e = p.rng.random_range(1..experts as u32);
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            let _ = r;
            ids.extend(&chosen);
            weights.extend((0..top_k).map(|_| p.rng.random_range(0.05f32..1.0)));
        }
        let routing = Routing {
            top_k,
            ids,
            weights,
        };
        let oc = Cpu.moe_experts(&xc, &routing, &cpu_experts).unwrap();
        let og = p.gpu.moe_experts(&xg, &routing, &gpu_experts).unwrap();
        p.check(
            &format!("moe_experts {rows}x{hidden} inter {inter} top{top_k}"),
            &og,
            &oc,
        );
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
            let (lc, lg, _) = p.act(rows, experts);
            let rc = Cpu.route(&lc, spec).unwrap();
            let oc = Cpu.moe_experts(&xc, &rc, &cpu_experts).unwrap();
            // Routing counted on the device as MoE layer 1 of 2 (the draft's prefetch counts).
            p.gpu.enable_route_counts(2, experts).unwrap();
            let (og, host) = p
                .gpu
                .routed_moe(&xg, &lg, spec, &gpu_experts, false, Some(1))
                .unwrap();
            let counts = p.gpu.route_counts().unwrap();
            let mut want = vec![0u32; 2 * experts];
            for &e in &rc.ids {
                want[experts + e as usize] += 1;
            }
            assert_eq!(counts, want, "routing counts on the device ({label})");
            assert!(
                host.is_none(),
                "the device path keeps the routing on the device"
            );
            p.check(
                &format!("routed_moe on device {rows}x{hidden} {label}"),
                &og,
                &oc,
            );
        }
        // Row 0 alone gives the same bits as inside the batch.
        let all = p.gpu.to_host(&og).unwrap();
        let x0 = p.gpu.head_rows(&xg, 1).unwrap();
        let r0 = Routing {
            top_k,
            ids: routing.ids[..top_k].to_vec(),
            weights: routing.weights[..top_k].to_vec(),
        };
        let one = p
            .gpu
            .to_host(&p.gpu.moe_experts(&x0, &r0, &gpu_experts).unwrap())
            .unwrap();
        assert!(
            one.iter()
                .zip(&all[..hidden])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "moe_experts: row 0 alone differs from the batch"
        );
    }

    let worst = p.report.iter().map(|(_, e)| *e).fold(0.0, f64::max);
    eprintln!(
        "{} op checks, worst relative error {worst:.2e}",
        p.report.len()
    );
}
