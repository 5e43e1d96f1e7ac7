//! The grouped W4A16 expert kernels (kernels/moe_int4.cu) against a CPU f64 reference built from
//! the project's own quantizer and Marlin packer, and their batch invariance.
//!
//! Needs an NVIDIA GPU, so ignored by default (see tests/common/gpu.rs); `scripts/gpu-check.sh run
//! int4` runs these with `--ignored`.

mod common;

use cudarc::driver::DevicePtr;
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use specter::backend::cuda::experts::{ExpertGroup, MoeLaunch};
use specter::backend::cuda::{CudaDevice, CudaSlice, CudaStream, MoeInt4Kernels};
use specter::quant::{marlin_dequantize_out_in, marlin_pack, rtn, Bits, QuantMatrix};
use specter::Error;
use std::sync::Arc;

/// Largest accepted ‖gpu - ref‖ / ‖ref‖ per item and stage (f32 tensor-core accumulation against
/// f64; the reference rounds activations to f16 as the kernels do, so that rounding is no error).
const TOLERANCE: f64 = 1e-5;

/// `v` rounded to f16 (to nearest even) and back: the W4A16 kernels' activation operand.
fn f16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| f16::from_f32(x).to_f32()).collect()
}

/// The raw device address of a buffer (all work here runs on one stream, so no event tracking is
/// needed beyond stream order).
fn addr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

/// One expert: device copies of its Marlin weights and the dequantized HF-orientation matrices.
struct Expert {
    gate_up_q: CudaSlice<u32>,
    gate_up_s: CudaSlice<f16>,
    down_q: CudaSlice<u32>,
    down_s: CudaSlice<f16>,
    /// `[2 inter][hidden]`: gate rows then up rows.
    gate_up_ref: Vec<f32>,
    /// `[hidden][inter]`.
    down_ref: Vec<f32>,
}

/// Random weights `[n][k]` with a per-row magnitude, so groups get different scales.
fn random_weight(rng: &mut ChaCha8Rng, n: usize, k: usize) -> Vec<f32> {
    let mut w = Vec::with_capacity(n * k);
    for _ in 0..n {
        let row_scale: f32 = rng.random_range(0.01..0.1);
        w.extend((0..k).map(|_| row_scale * rng.random_range(-1.0f32..1.0)));
    }
    w
}

fn make_expert(
    rng: &mut ChaCha8Rng,
    stream: &Arc<CudaStream>,
    hidden: usize,
    inter: usize,
) -> Expert {
    let gate = rtn(
        "gate",
        &random_weight(rng, inter, hidden),
        inter,
        hidden,
        Bits::FOUR,
    )
    .unwrap();
    let up = rtn(
        "up",
        &random_weight(rng, inter, hidden),
        inter,
        hidden,
        Bits::FOUR,
    )
    .unwrap();
    let gate_up = marlin_pack(&QuantMatrix::concat_n(&gate, &up).unwrap()).unwrap();
    let down = marlin_pack(
        &rtn(
            "down",
            &random_weight(rng, hidden, inter),
            hidden,
            inter,
            Bits::FOUR,
        )
        .unwrap(),
    )
    .unwrap();
    assert!(gate_up.qweight.iter().any(|&w| w != 0x8888_8888));
    Expert {
        gate_up_ref: marlin_dequantize_out_in(hidden, 2 * inter, &gate_up.qweight, &gate_up.scales)
            .unwrap(),
        down_ref: marlin_dequantize_out_in(inter, hidden, &down.qweight, &down.scales).unwrap(),
        gate_up_q: stream.clone_htod(&gate_up.qweight).unwrap(),
        gate_up_s: stream.clone_htod(&gate_up.scales).unwrap(),
        down_q: stream.clone_htod(&down.qweight).unwrap(),
        down_s: stream.clone_htod(&down.scales).unwrap(),
    }
}

struct Setup {
    device: CudaDevice,
    kernels: MoeInt4Kernels,
    hidden: usize,
    inter: usize,
    x: Vec<f32>,
    x_dev: CudaSlice<f32>,
    experts: Vec<Expert>,
}

impl Setup {
    fn new(
        device: CudaDevice,
        hidden: usize,
        inter: usize,
        rows: usize,
        experts: usize,
        seed: u64,
    ) -> Self {
        let kernels = MoeInt4Kernels::new(&device).expect("load the INT4 MoE kernels");
        let stream = device.stream().clone();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let experts = (0..experts)
            .map(|_| make_expert(&mut rng, &stream, hidden, inter))
            .collect();
        let x: Vec<f32> = (0..rows * hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let x_dev = stream.clone_htod(&x).unwrap();
        Setup {
            device,
            kernels,
            hidden,
            inter,
            x,
            x_dev,
            experts,
        }
    }

    /// Runs gate/up and down over `routing` (per group: expert index, then (row, weight) items)
    /// and returns (h, out) as item-major f32, after checking every element was written.
    fn run(&self, routing: &[(usize, Vec<(u32, f32)>)]) -> (Vec<f32>, Vec<f32>) {
        let stream = self.device.stream();
        let (hidden, inter) = (self.hidden, self.inter);
        let mut groups = Vec::new();
        let (mut item_row, mut item_weight) = (Vec::new(), Vec::new());
        for (e, items) in routing {
            let ex = &self.experts[*e];
            groups.push(ExpertGroup {
                gate_up: addr(&ex.gate_up_q, stream),
                gate_up_scales: addr(&ex.gate_up_s, stream),
                down: addr(&ex.down_q, stream),
                down_scales: addr(&ex.down_s, stream),
                first: item_row.len() as u32,
                count: items.len() as u32,
            });
            for &(row, w) in items {
                item_row.push(row);
                item_weight.push(w);
            }
        }
        let items = item_row.len();
        let groups_dev = stream
            .clone_htod(bytemuck::cast_slice::<_, u8>(&groups))
            .unwrap();
        let rows_dev = stream.clone_htod(&item_row).unwrap();
        let weights_dev = stream.clone_htod(&item_weight).unwrap();
        // NaN everywhere first: any element the kernels skip stays NaN and fails the check below.
        let h_dev = stream.clone_htod(&vec![f32::NAN; items * inter]).unwrap();
        let out_dev = stream.clone_htod(&vec![f32::NAN; items * hidden]).unwrap();
        let launch = MoeLaunch {
            x: addr(&self.x_dev, stream),
            hidden,
            inter,
            groups: addr(&groups_dev, stream),
            num_groups: groups.len(),
            max_count: routing.iter().map(|(_, i)| i.len()).max().unwrap_or(0),
            item_row: addr(&rows_dev, stream),
            item_weight: addr(&weights_dev, stream),
            items,
            h: addr(&h_dev, stream),
            out: addr(&out_dev, stream),
        };
        self.kernels.launch(stream, &launch).expect("launch");
        self.device.synchronize().expect("kernels ran");
        let h = stream.clone_dtoh(&h_dev).unwrap();
        let out = stream.clone_dtoh(&out_dev).unwrap();
        assert!(
            h.iter().all(|v| v.is_finite()),
            "an h element was not written"
        );
        assert!(
            out.iter().all(|v| v.is_finite()),
            "an out element was not written"
        );
        (h, out)
    }

    /// Checks every item against the f64 reference: h from x, and out from the kernel's own h (so
    /// each stage's error is measured alone), each input rounded to f16 first as the kernels do.
    /// Returns each item's relative error of each stage.
    fn check(
        &self,
        routing: &[(usize, Vec<(u32, f32)>)],
        h: &[f32],
        out: &[f32],
    ) -> Vec<(f64, f64)> {
        let (hidden, inter) = (self.hidden, self.inter);
        let items: Vec<(usize, u32, f32)> = routing
            .iter()
            .flat_map(|(e, items)| items.iter().map(move |&(r, w)| (*e, r, w)))
            .collect();
        let errors: Vec<(f64, f64)> = items
            .par_iter()
            .enumerate()
            .map(|(i, &(e, row, weight))| {
                let ex = &self.experts[e];
                let x = &f16_round(&self.x[row as usize * hidden..][..hidden]);
                let dot = |w: &[f32], v: &[f32]| -> f64 {
                    w.iter()
                        .zip(v)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum()
                };
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for j in 0..inter {
                    let a = dot(&ex.gate_up_ref[j * hidden..][..hidden], x);
                    let b = dot(&ex.gate_up_ref[(inter + j) * hidden..][..hidden], x);
                    let want = a / (1.0 + (-a).exp()) * b;
                    num += (f64::from(h[i * inter + j]) - want).powi(2);
                    den += want * want;
                }
                let h_err = (num / den).sqrt();
                let hi = &f16_round(&h[i * inter..][..inter]);
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for c in 0..hidden {
                    let want = f64::from(weight) * dot(&ex.down_ref[c * inter..][..inter], hi);
                    num += (f64::from(out[i * hidden + c]) - want).powi(2);
                    den += want * want;
                }
                (h_err, (num / den).sqrt())
            })
            .collect();
        errors
    }

    /// Runs `routing`, checks it against the reference, prints the worst error of each stage per
    /// group size and asserts the tolerance. Returns (h, out).
    fn run_checked(
        &self,
        what: &str,
        routing: &[(usize, Vec<(u32, f32)>)],
    ) -> (Vec<f32>, Vec<f32>) {
        let (h, out) = self.run(routing);
        let errors = self.check(routing, &h, &out);
        let mut sizes: Vec<usize> = routing.iter().map(|(_, i)| i.len()).collect();
        sizes.sort_unstable();
        sizes.dedup();
        for size in sizes {
            let (mut worst_h, mut worst_out, mut first) = (0.0f64, 0.0f64, 0);
            for (_, items) in routing {
                if items.len() == size {
                    for e in &errors[first..first + size] {
                        worst_h = worst_h.max(e.0);
                        worst_out = worst_out.max(e.1);
                    }
                }
                first += items.len();
            }
            if size > 0 {
                println!(
                    "hidden={} inter={} {what}: m={size}: worst relative error gate/up {worst_h:.3e}, down {worst_out:.3e}",
                    self.hidden, self.inter
                );
            }
            assert!(
                worst_h < TOLERANCE,
                "{what} m={size}: gate/up relative error {worst_h:.3e}"
            );
            assert!(
                worst_out < TOLERANCE,
                "{what} m={size}: down relative error {worst_out:.3e}"
            );
        }
        (h, out)
    }
}

/// Per group: `counts[g]` distinct rows out of `rows`, with random positive routing weights.
fn route(rng: &mut ChaCha8Rng, rows: usize, counts: &[usize]) -> Vec<(usize, Vec<(u32, f32)>)> {
    counts
        .iter()
        .enumerate()
        .map(|(e, &count)| {
            let mut all: Vec<u32> = (0..rows as u32).collect();
            for i in 0..count {
                let j = rng.random_range(i..all.len());
                all.swap(i, j);
            }
            let items = all[..count]
                .iter()
                .map(|&r| (r, rng.random_range(0.05f32..1.0)))
                .collect();
            (e, items)
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn check_shape(hidden: usize, inter: usize, seed: u64) {
    let device = common::gpu::device();
    // Uneven groups: one item, two chunks (17: 16 on two mma item tiles, then 1), an odd count, an
    // empty group, one full n8 tile, one full 16-item chunk, and a five.
    let counts = [1, 17, 3, 0, 8, 16, 5];
    let rows = 24;
    let setup = Setup::new(device, hidden, inter, rows, counts.len(), seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let routing = route(&mut rng, rows, &counts);
    let (h, out) = setup.run_checked("mixed launch", &routing);
    // Sanity: the outputs are not trivially zero.
    assert!(h.iter().any(|&v| v != 0.0) && out.iter().any(|&v| v != 0.0));

    // Batch invariance 1: each group's items in reverse order land in other chunk slots and
    // chunks, yet every item gives the same bits.
    let reversed: Vec<_> = routing
        .iter()
        .map(|(e, items)| (*e, items.iter().rev().copied().collect::<Vec<_>>()))
        .collect();
    let (h_rev, out_rev) = setup.run(&reversed);
    let mut first = 0;
    for (_, items) in &routing {
        let n = items.len();
        for i in 0..n {
            let (a, b) = (first + i, first + n - 1 - i);
            assert_eq!(
                bits(&h[a * inter..][..inter]),
                bits(&h_rev[b * inter..][..inter]),
                "h of item {a} reordered"
            );
            assert_eq!(
                bits(&out[a * hidden..][..hidden]),
                bits(&out_rev[b * hidden..][..hidden]),
                "out of item {a} reordered"
            );
        }
        first += n;
    }

    // Batch invariance 2: an item launched alone (the 8-item kernel variant, one n8 tile) equals
    // its output inside the big launch (the 16-item variant): the lone item, the last item of
    // the 17 (second chunk), items of the second n8 tile of a 16-item chunk, one of the odd group
    // of 3, the last of the 8, and both ends of the 16.
    let mut first = 0;
    let mut starts = Vec::new();
    for (_, items) in &routing {
        starts.push(first);
        first += items.len();
    }
    for (g, i) in [
        (0usize, 0usize),
        (1, 16),
        (1, 9),
        (2, 1),
        (4, 7),
        (5, 0),
        (5, 15),
    ] {
        let (e, items) = &routing[g];
        let alone = [(*e, vec![items[i]])];
        let (h1, out1) = setup.run(&alone);
        let a = starts[g] + i;
        assert_eq!(
            bits(&h1),
            bits(&h[a * inter..][..inter]),
            "h of group {g} item {i} alone"
        );
        assert_eq!(
            bits(&out1),
            bits(&out[a * hidden..][..hidden]),
            "out of group {g} item {i} alone"
        );
    }

    // Each group size on its own launch (so m <= 8 runs the 8-item variant): two groups of m
    // items, the first being the first m items of the 17-item group above, which must keep their
    // bits; errors are checked per size.
    let (e17, items17) = &routing[1];
    for m in [1usize, 3, 8, 16, 17] {
        let mut single = route(&mut rng, rows, &[m, m]);
        single[0] = (*e17, items17[..m].to_vec());
        single[1].0 = 4;
        let (hm, outm) = setup.run_checked(&format!("launch of m={m}"), &single);
        let a = starts[1];
        assert_eq!(
            bits(&hm[..m * inter]),
            bits(&h[a * inter..][..m * inter]),
            "h of the first {m} items of the 17-item group on their own"
        );
        assert_eq!(
            bits(&outm[..m * hidden]),
            bits(&out[a * hidden..][..m * hidden]),
            "out of the first {m} items of the 17-item group on their own"
        );
    }
    println!("hidden={hidden} inter={inter}: batch invariance holds (reordered, alone, per size)");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn int4_moe_small_shape() {
    check_shape(256, 128, 41);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn int4_moe_deepseek_v2_lite_shape() {
    check_shape(2048, 1408, 42);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn int4_moe_rejects_bad_shapes_before_launching() {
    let device = common::gpu::device();
    let kernels = MoeInt4Kernels::new(&device).expect("load the INT4 MoE kernels");
    let launch = MoeLaunch {
        x: 1,
        hidden: 2048,
        inter: 1400,
        groups: 1,
        num_groups: 1,
        max_count: 1,
        item_row: 1,
        item_weight: 1,
        items: 1,
        h: 1,
        out: 1,
    };
    match kernels.launch(device.stream(), &launch) {
        Err(Error::Backend(msg)) => assert!(msg.contains("inter=1400"), "{msg}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
}
