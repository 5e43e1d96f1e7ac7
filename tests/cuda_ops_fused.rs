//! The CUDA backend's fused ops (src/backend/cuda/ops/fused.rs) against the CPU reference, and bit
//! for bit against the GPU's own unfused sequence of the ops each replaces, in the manner of
//! tests/cuda_ops.rs, whose harness (tests/common/ops.rs) they share. They need an NVIDIA GPU:
//! `scripts/gpu-check.sh run ops` runs them with `--ignored`.

mod common;

use common::ops::*;
use specter::arch::RopeStyle;
use specter::backend::cpu::Cpu;
use specter::backend::cuda::{CudaBackend, CudaOptions, LaunchMatch, MeasureOptions};
use specter::backend::{
    add_rms_norm_linear_ops, mla_kv_append_ops, Backend, MlaAppend, MlaShape, RopeSpec,
};

/// The fused ops (src/backend/cuda/ops/fused.rs) against the CPU reference, and bit for bit against
/// the GPU's own unfused sequence of the ops each replaces.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn fused() {
    let mut p = Family::new("fused", 31);
    // Residual add + RMSNorm: DeepSeek's width, a width past the kernel's register cache, and a
    // width that is not a multiple of 4.
    for &(rows, cols) in &[(1usize, 2048usize), (17, 2048), (3, 5000), (2, 1030)] {
        let (mut xc, mut xg, xv) = p.act(rows, cols);
        let (yc, yg, _) = p.act(rows, cols);
        let (wc, wg) = p.weight("w", &[cols], 1.0);
        let nc = Cpu.add_rms_norm(&mut xc, &yc, &wc, 1e-6).unwrap();
        let case = format!("add_rms_norm {rows}x{cols}");
        let fused = p.gpu.add_rms_norm(&mut xg, &yg, &wg, 1e-6);
        let got = p.check(&format!("{case} norm"), fused, &nc);
        {
            let view = p.gpu.head_rows(&xg, p.gpu.shape(&xg).0);
            p.check(&format!("{case} sum"), view, &xc)
        };
        let mut xs = p.gpu.upload(rows, cols, &xv).unwrap();
        let plain = p
            .gpu
            .add_assign(&mut xs, &yg)
            .and_then(|()| p.gpu.rms_norm(&xs, &wg, 1e-6, cols))
            .and_then(|n| p.gpu.to_host(&n));
        if let Some(got) = got {
            p.same_bits(&format!("{case} = add + rms_norm"), plain, &got);
        }
    }
    // Two projections of one input.
    for &(rows, k, na, nb) in &[
        (1usize, 2048usize, 3072usize, 576usize),
        (17, 2048, 3072, 576),
        (3, 96, 13, 7),
        (1, 256, 6000, 2001),
    ] {
        let (xc, xg, _) = p.act(rows, k);
        let (ac, ag) = p.weight("a", &[na, k], 0.05);
        let (bc, bg) = p.weight("b", &[nb, k], 0.05);
        let (yac, ybc) = Cpu.linear_pair(&xc, &ac, &bc).unwrap();
        let case = format!("linear_pair {rows}x{k} -> {na}, {nb}");
        match p.gpu.linear_pair(&xg, &ag, &bg) {
            Ok((ya, yb)) => {
                let ga = p.check(&format!("{case} a"), Ok(ya), &yac);
                let gb = p.check(&format!("{case} b"), Ok(yb), &ybc);
                let plain_a = p.gpu.linear(&xg, &ag, None).and_then(|y| p.gpu.to_host(&y));
                let plain_b = p.gpu.linear(&xg, &bg, None).and_then(|y| p.gpu.to_host(&y));
                if let (Some(ga), Some(gb)) = (ga, gb) {
                    p.same_bits(&format!("{case} a = linear"), plain_a, &ga);
                    p.same_bits(&format!("{case} b = linear"), plain_b, &gb);
                }
            }
            Err(err) => {
                p.checks += 1;
                p.fail(&case, format!("GPU error: {err}"));
            }
        }
    }
    // MLA's latent step and cache append, at DeepSeek-V2-Lite's widths and at small ones.
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        for &(rows, heads, nope, rope, v_dim, rank) in &[
            (1usize, 16usize, 128usize, 64usize, 128usize, 512usize),
            (5, 4, 32, 16, 32, 96),
        ] {
            let label = format!("{rows} rows, {heads} heads, {style:?}");
            let half = rope / 2;
            let inv: Vec<f32> = (0..half)
                .map(|i| 10000f32.powf(-(2.0 * i as f32) / rope as f32))
                .collect();
            let pos: Vec<usize> = (0..rows).map(|r| 40 + r).collect();
            let scales = vec![1.0f32; rows];
            let k_spec = RopeSpec {
                heads: 1,
                head_stride: rope,
                offset: 0,
                rot_dim: rope,
                style,
            };
            let (cc, cg, _) = p.act(rows, rank + rope);
            let (nc, ng) = p.weight("kv_a_norm", &[rank], 1.0);
            let (lc, pc) = Cpu
                .mla_latent(&cc, &nc, 1e-6, rank, k_spec, &inv, &pos, &scales)
                .unwrap();
            let (lg, pg) = match p
                .gpu
                .mla_latent(&cg, &ng, 1e-6, rank, k_spec, &inv, &pos, &scales)
            {
                Ok(v) => v,
                Err(err) => {
                    p.checks += 1;
                    p.fail(&format!("mla_latent {label}"), format!("GPU error: {err}"));
                    continue;
                }
            };
            let gl = {
                let view = p.gpu.head_rows(&lg, p.gpu.shape(&lg).0);
                p.check(&format!("mla_latent {label} latent"), view, &lc)
            };
            let gp = {
                let view = p.gpu.head_rows(&pg, p.gpu.shape(&pg).0);
                p.check(&format!("mla_latent {label} k_pe"), view, &pc)
            };
            let mut parts = p.gpu.split_cols(&cg, &[rank, rope]).unwrap().into_iter();
            let (l0, mut p0) = (parts.next().unwrap(), parts.next().unwrap());
            let plain_l = p
                .gpu
                .rms_norm(&l0, &ng, 1e-6, rank)
                .and_then(|n| p.gpu.to_host(&n));
            let plain_p = p
                .gpu
                .rope(&mut p0, k_spec, &inv, &pos, &scales)
                .and_then(|()| p.gpu.to_host(&p0));
            if let (Some(gl), Some(gp)) = (gl, gp) {
                p.same_bits(
                    &format!("mla_latent {label} latent = split + rms_norm"),
                    plain_l,
                    &gl,
                );
                p.same_bits(
                    &format!("mla_latent {label} k_pe = split + rope"),
                    plain_p,
                    &gp,
                );
            }

            let mla = MlaShape { heads, nope, v_dim };
            let q_spec = RopeSpec {
                heads,
                head_stride: nope + rope,
                offset: nope,
                rot_dim: rope,
                style,
            };
            let (kvc, kvg, _) = p.act(rows, heads * (nope + v_dim));
            let (mut qc, mut qg, qv) = p.act(rows, heads * (nope + rope));
            let cap = 40 + rows + 3;
            let (mut kc, mut kg, kv0) = p.act(cap, heads * (nope + rope));
            let (mut vc, mut vg, vv0) = p.act(cap, heads * v_dim);
            Cpu.mla_expand_append(
                &kvc, &pc, mla, &mut kc, &mut vc, 40, &mut qc, q_spec, &inv, &pos, &scales,
            )
            .unwrap();
            let r = p.gpu.mla_expand_append(
                &kvg, &pg, mla, &mut kg, &mut vg, 40, &mut qg, q_spec, &inv, &pos, &scales,
            );
            p.check_in_place(&format!("mla_expand_append {label} keys"), r, &kg, &kc);
            {
                let view = p.gpu.head_rows(&vg, p.gpu.shape(&vg).0);
                p.check(&format!("mla_expand_append {label} values"), view, &vc)
            };
            let gq = {
                let view = p.gpu.head_rows(&qg, p.gpu.shape(&qg).0);
                p.check(&format!("mla_expand_append {label} query"), view, &qc)
            };
            let mut ks = p.gpu.upload(cap, heads * (nope + rope), &kv0).unwrap();
            let mut vs = p.gpu.upload(cap, heads * v_dim, &vv0).unwrap();
            let mut qs = p.gpu.upload(rows, heads * (nope + rope), &qv).unwrap();
            let plain = p
                .gpu
                .mla_expand_kv(&kvg, &pg, heads, nope, v_dim)
                .and_then(|(nk, nv)| {
                    p.gpu.write_rows(&mut ks, 40, &nk)?;
                    p.gpu.write_rows(&mut vs, 40, &nv)?;
                    p.gpu.rope(&mut qs, q_spec, &inv, &pos, &scales)
                });
            let plain_k = plain.and_then(|()| p.gpu.to_host(&ks));
            let fused_k = p.gpu.to_host(&kg).unwrap();
            p.same_bits(
                &format!("mla_expand_append {label} keys = expand + write_rows"),
                plain_k,
                &fused_k,
            );
            if let Some(gq) = gq {
                p.same_bits(
                    &format!("mla_expand_append {label} query = rope"),
                    p.gpu.to_host(&qs),
                    &gq,
                );
            }
        }
    }
    p.finish();
}

/// MLA from the compressed projection to the caches (`mla_kv_append`): for one row the CUDA
/// backend runs it as one launch (`mla_kv_append_1`), checked against the CPU reference and bit
/// for bit against the GPU's three ops (`mla_latent`, `linear`, `mla_expand_append`); a backend
/// that skips that launch must then leave the new cache row unwritten, which shows the fused
/// launch ran. Several rows, and ranks the kernel does not take, run the three ops.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn mla_kv_append() {
    let mut p = Family::new("mla_kv_append", 37);
    let skip = skipping("mla_kv_append");
    const START: usize = 40;
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        // DeepSeek-V2-Lite's widths; a key/value boundary inside a warp's pair of features and a
        // last warp with one feature (5 heads of 19 + 17); rank 96 and 1024 and 3 rows, which
        // the fused kernel does not take.
        for &(rows, heads, nope, rope, v_dim, rank) in &[
            (1usize, 16usize, 128usize, 64usize, 128usize, 512usize),
            (1, 5, 19, 8, 17, 264),
            (1, 4, 32, 16, 32, 96),
            (1, 2, 16, 8, 16, 1024),
            (3, 4, 32, 16, 32, 256),
        ] {
            let fused = rows == 1 && rank % 8 == 0 && (256..=512).contains(&rank);
            let label = format!("{rows}x{heads}x({nope}+{rope}, {v_dim}) rank {rank}, {style:?}");
            let half = rope / 2;
            let inv: Vec<f32> = (0..half)
                .map(|i| 10000f32.powf(-(2.0 * i as f32) / rope as f32))
                .collect();
            let pos: Vec<usize> = (0..rows).map(|r| START + r).collect();
            let scales = vec![1.0f32; rows];
            let k_rope = RopeSpec {
                heads: 1,
                head_stride: rope,
                offset: 0,
                rot_dim: rope,
                style,
            };
            let q_rope = RopeSpec {
                heads,
                head_stride: nope + rope,
                offset: nope,
                rot_dim: rope,
                style,
            };
            let mla = MlaShape { heads, nope, v_dim };
            let (cc, cg, cv) = p.act(rows, rank + rope);
            let (nc, ng, ns) = weight_on_both(&mut p, &skip, "kv_a_norm", &[rank], 1.0);
            let kv_b = [heads * (nope + v_dim), rank];
            let (bc, bg, bs) = weight_on_both(&mut p, &skip, "kv_b", &kv_b, 0.05);
            let (mut qc, mut qg, qv) = p.act(rows, heads * (nope + rope));
            let cap = START + rows + 3;
            let (mut kc, mut kg, kv0) = p.act(cap, heads * (nope + rope));
            let (mut vc, mut vg, vv0) = p.act(cap, heads * v_dim);
            let cpu_step = MlaAppend {
                norm: &nc,
                eps: 1e-6,
                rank,
                k_rope,
                kv_b: &bc,
                shape: mla,
                start: START,
                q_rope,
                inv_freq: &inv,
                positions: &pos,
                scales: &scales,
            };
            Cpu.mla_kv_append(&cc, &cpu_step, &mut kc, &mut vc, &mut qc)
                .unwrap();
            let gpu_step = with_weights(&cpu_step, &ng, &bg);
            let skip_step = with_weights(&cpu_step, &ns, &bs);
            let r = p
                .gpu
                .mla_kv_append(&cg, &gpu_step, &mut kg, &mut vg, &mut qg);
            p.check_in_place(&format!("{label} keys"), r, &kg, &kc);
            let gv = {
                let view = p.gpu.head_rows(&vg, cap);
                p.check(&format!("{label} values"), view, &vc)
            };
            let gq = {
                let view = p.gpu.head_rows(&qg, rows);
                p.check(&format!("{label} query"), view, &qc)
            };
            // The GPU's three ops on the same inputs.
            let mut ks = p.gpu.upload(cap, heads * (nope + rope), &kv0).unwrap();
            let mut vs = p.gpu.upload(cap, heads * v_dim, &vv0).unwrap();
            let mut qs = p.gpu.upload(rows, heads * (nope + rope), &qv).unwrap();
            let plain = mla_kv_append_ops(&p.gpu, &cg, &gpu_step, &mut ks, &mut vs, &mut qs);
            let fused_k = p.gpu.to_host(&kg).unwrap();
            p.same_bits(
                &format!("{label} keys = three ops"),
                plain.and_then(|()| p.gpu.to_host(&ks)),
                &fused_k,
            );
            if let (Some(gv), Some(gq)) = (gv, gq) {
                p.same_bits(
                    &format!("{label} values = three ops"),
                    p.gpu.to_host(&vs),
                    &gv,
                );
                p.same_bits(
                    &format!("{label} query = three ops"),
                    p.gpu.to_host(&qs),
                    &gq,
                );
            }
            // The backend that skips the fused launch: the new row keeps its old keys where the
            // fused kernel is the one that writes them.
            let upload = |rows, cols, v: &[f32]| skip.upload(rows, cols, v).unwrap();
            let cs = upload(rows, rank + rope, &cv);
            let mut k2 = upload(cap, heads * (nope + rope), &kv0);
            let mut v2 = upload(cap, heads * v_dim, &vv0);
            let mut q2 = upload(rows, heads * (nope + rope), &qv);
            let skipped = skip
                .mla_kv_append(&cs, &skip_step, &mut k2, &mut v2, &mut q2)
                .and_then(|()| skip.to_host(&k2))
                .map(|k| k == kv0);
            expect_fused_ran(&mut p, &label, fused, skipped, "mla_kv_append", "the keys");
        }
    }
    p.finish();
}

/// The residual add, the norm after it and the products of the normed row
/// (`add_rms_norm_linear`): for one row the CUDA backend runs it as one launch
/// (`add_norm_linear_1`), checked against the CPU reference and bit for bit against the GPU's
/// ops (`add_rms_norm`, then `linear` or `linear_pair`); a backend that skips that launch must
/// then not hold the sum in `x`, which shows the fused launch ran. Several rows, and widths the
/// kernel does not take, run the ops.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn add_rms_norm_linear() {
    let mut p = Family::new("add_rms_norm_linear", 41);
    let skip = skipping("add_rms_norm_linear");
    // DeepSeek-V2-Lite's query and compressed projections and its router; the widest row the
    // kernel takes, with a last warp of one feature in each product; a row shorter than the
    // block's pieces; then a row too wide, one not a multiple of 8, one too short and 3 rows,
    // which run the ops.
    for &(rows, cols, na, nb) in &[
        (1usize, 2048usize, 3072usize, Some(576usize)),
        (1, 2048, 64, None),
        (1, 4096, 61, Some(13)),
        (1, 264, 7, None),
        (1, 4104, 16, Some(8)),
        (1, 1028, 9, None),
        (1, 248, 16, None),
        (3, 2048, 64, Some(32)),
    ] {
        let fused = rows == 1 && cols % 8 == 0 && (256..=4096).contains(&cols);
        let label = format!("{rows}x{cols} -> {na}, {nb:?}");
        let (mut xc, mut xg, xv) = p.act(rows, cols);
        let (yc, yg, yv) = p.act(rows, cols);
        let (nc, ng, ns) = weight_on_both(&mut p, &skip, "norm", &[cols], 1.0);
        let (ac, ag, as_) = weight_on_both(&mut p, &skip, "a", &[na, cols], 0.05);
        let b = nb.map(|nb| weight_on_both(&mut p, &skip, "b", &[nb, cols], 0.05));
        let (bc, bg, bs) = match &b {
            Some((c, g, s)) => (Some(c), Some(g), Some(s)),
            None => (None, None, None),
        };
        let cpu = Cpu
            .add_rms_norm_linear(&mut xc, &yc, &nc, 1e-6, &ac, bc)
            .unwrap();
        let gpu = match p.gpu.add_rms_norm_linear(&mut xg, &yg, &ng, 1e-6, &ag, bg) {
            Ok(n) => n,
            Err(err) => {
                p.checks += 1;
                p.fail(&label, format!("GPU error: {err}"));
                continue;
            }
        };
        let gx = p.check(&format!("{label} sum"), Ok(xg), &xc);
        let gh = p.check(&format!("{label} norm"), Ok(gpu.h), &cpu.h);
        let ga = p.check(&format!("{label} a"), Ok(gpu.a), &cpu.a);
        let gb = match (gpu.b, &cpu.b) {
            (Some(g), Some(c)) => p.check(&format!("{label} b"), Ok(g), c),
            (None, None) => None,
            _ => {
                p.checks += 1;
                p.fail(
                    &label,
                    "the GPU and the CPU disagree on a second product".into(),
                );
                None
            }
        };
        // The GPU's ops on the same inputs.
        let mut xs = p.gpu.upload(rows, cols, &xv).unwrap();
        match add_rms_norm_linear_ops(&p.gpu, &mut xs, &yg, &ng, 1e-6, &ag, bg) {
            Ok(plain) => {
                let pairs = [
                    ("sum", Some(xs), gx),
                    ("norm", Some(plain.h), gh),
                    ("a", Some(plain.a), ga),
                    ("b", plain.b, gb),
                ];
                for (what, plain, fused) in pairs {
                    if let (Some(plain), Some(fused)) = (plain, fused) {
                        let case = format!("{label} {what} = ops");
                        p.same_bits(&case, p.gpu.to_host(&plain), &fused);
                    }
                }
            }
            Err(err) => {
                p.checks += 1;
                p.fail(&format!("{label} ops"), format!("GPU error: {err}"));
            }
        }
        // The backend that skips the fused launch: `x` then does not hold the sum where the
        // fused kernel is the one that writes it.
        let sum: Vec<f32> = xv.iter().zip(&yv).map(|(x, y)| x + y).collect();
        let mut x2 = skip.upload(rows, cols, &xv).unwrap();
        let y2 = skip.upload(rows, cols, &yv).unwrap();
        let skipped = skip
            .add_rms_norm_linear(&mut x2, &y2, &ns, 1e-6, &as_, bs)
            .and_then(|_| skip.to_host(&x2))
            .map(|x| x != sum);
        expect_fused_ran(
            &mut p,
            &label,
            fused,
            skipped,
            "add_rms_norm_linear",
            "the sum",
        );
    }
    p.finish();
}

/// The case that shows whether a fused launch ran: `skipped` is whether a backend that leaves out
/// `kernel`'s launches left `what` untouched (or its error), which it must exactly when the op
/// takes the fused path (`fused`).
fn expect_fused_ran(
    p: &mut Family,
    label: &str,
    fused: bool,
    skipped: specter::Result<bool>,
    kernel: &str,
    what: &str,
) {
    let untouched = matches!(skipped, Ok(true));
    p.expect(
        &format!("{label} fused launch ran: {fused}"),
        untouched == fused,
        || match &skipped {
            Ok(_) if fused => format!("skipping {kernel} left {what} written"),
            Ok(_) => format!("skipping {kernel} changed a path that does not use it"),
            Err(err) => format!("GPU error: {err}"),
        },
    );
}

/// A second CUDA backend that leaves out every launch labelled `kernel`.
fn skipping(kernel: &str) -> CudaBackend {
    CudaBackend::with_device(
        std::sync::Arc::new(common::gpu::device()),
        None,
        &CudaOptions::default(),
    )
    .expect("a second CUDA backend")
    .measuring(MeasureOptions {
        skip: vec![LaunchMatch {
            kernel: kernel.into(),
            blocks: None,
        }],
        serial: Vec::new(),
    })
}

/// [`Family::weight`] with the same values also on `other`.
fn weight_on_both(
    p: &mut Family,
    other: &CudaBackend,
    name: &str,
    shape: &[usize],
    scale: f32,
) -> (CpuWeight, GpuWeight, GpuWeight) {
    let n: usize = shape.iter().product();
    let v: Vec<half::f16> = p
        .values(n, scale)
        .into_iter()
        .map(half::f16::from_f32)
        .collect();
    (
        Cpu.weight_f16(name, shape, &v).unwrap(),
        p.gpu.weight_f16(name, shape, &v).expect("GPU weight"),
        other.weight_f16(name, shape, &v).expect("GPU weight"),
    )
}

/// `step` with another backend's norm and kv_b weights.
fn with_weights<'a, W, V>(step: &MlaAppend<'a, V>, norm: &'a W, kv_b: &'a W) -> MlaAppend<'a, W> {
    MlaAppend {
        norm,
        eps: step.eps,
        rank: step.rank,
        k_rope: step.k_rope,
        kv_b,
        shape: step.shape,
        start: step.start,
        q_rope: step.q_rope,
        inv_freq: step.inv_freq,
        positions: step.positions,
        scales: step.scales,
    }
}
