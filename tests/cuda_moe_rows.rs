//! The grouped row-layout expert kernels (kernels/moe_rows.cu) at 8, 3 and 2 bits against a CPU
//! f64 reference built from the project's own quantizer and row packer, their batch invariance,
//! and their weight read rate at DeepSeek-V2-Lite's widths.
//!
//! Needs an NVIDIA GPU, so ignored by default (see tests/common/gpu.rs); `scripts/gpu-check.sh run
//! int4` runs these with `--ignored`.

mod common;

use cudarc::driver::{sys, DevicePtr};
use half::f16;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use specter::backend::cuda::experts::{ExpertGroup, MoeLaunch};
use specter::backend::cuda::{CudaDevice, CudaSlice, CudaStream, MoeRowsKernels};
use specter::quant::{rows_dequantize_out_in, rows_pack, rtn, Bits};
use specter::Error;
use std::sync::Arc;

/// Largest accepted ‖gpu - ref‖ / ‖ref‖ per item and stage (f32 accumulation against f64; the
/// reference rounds activations to f16 as the kernels do, so that rounding is no error).
const TOLERANCE: f64 = 1e-5;

/// The row-layout widths.
const WIDTHS: [u32; 3] = [8, 3, 2];

/// `v` rounded to f16 (to nearest even) and back: the kernels' activation operand.
fn f16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| f16::from_f32(x).to_f32()).collect()
}

/// The raw device address of a buffer (all work here runs on one stream).
fn addr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

/// One expert: device copies of its row-layout codes and scales, and the dequantized
/// Hugging Face-orientation matrices.
struct Expert {
    gate_up_q: CudaSlice<u8>,
    gate_up_s: CudaSlice<f16>,
    down_q: CudaSlice<u8>,
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
    bits: Bits,
) -> Expert {
    // Gate rows then up rows, quantized as one [2 inter][hidden] matrix (scales are per row, so
    // this equals quantizing each on its own).
    let mut gate_up = random_weight(rng, inter, hidden);
    gate_up.extend(random_weight(rng, inter, hidden));
    let gate_up = rows_pack(&rtn("gate_up", &gate_up, 2 * inter, hidden, bits).unwrap()).unwrap();
    let down = random_weight(rng, hidden, inter);
    let down = rows_pack(&rtn("down", &down, hidden, inter, bits).unwrap()).unwrap();
    assert!(gate_up.qweight.iter().any(|&b| b != gate_up.qweight[0]));
    Expert {
        gate_up_ref: rows_dequantize_out_in(
            hidden,
            2 * inter,
            bits,
            &gate_up.qweight,
            &gate_up.scales,
        )
        .unwrap(),
        down_ref: rows_dequantize_out_in(inter, hidden, bits, &down.qweight, &down.scales).unwrap(),
        gate_up_q: stream.clone_htod(&gate_up.qweight).unwrap(),
        gate_up_s: stream.clone_htod(&gate_up.scales).unwrap(),
        down_q: stream.clone_htod(&down.qweight).unwrap(),
        down_s: stream.clone_htod(&down.scales).unwrap(),
    }
}

/// Per group: expert index, then (row, weight) items.
type Routing = Vec<(usize, Vec<(u32, f32)>)>;

struct Setup {
    device: CudaDevice,
    kernels: MoeRowsKernels,
    bits: Bits,
    hidden: usize,
    inter: usize,
    x: Vec<f32>,
    x_dev: CudaSlice<f32>,
    experts: Vec<Expert>,
}

impl Setup {
    fn new(device: CudaDevice, shape: (usize, usize), bits: Bits, rows: usize, seed: u64) -> Self {
        let (hidden, inter) = shape;
        let kernels = MoeRowsKernels::new(&device).expect("load the row-layout MoE kernels");
        let stream = device.stream().clone();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let experts = (0..8)
            .map(|_| make_expert(&mut rng, &stream, hidden, inter, bits))
            .collect();
        let x: Vec<f32> = (0..rows * hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let x_dev = stream.clone_htod(&x).unwrap();
        Setup {
            device,
            kernels,
            bits,
            hidden,
            inter,
            x,
            x_dev,
            experts,
        }
    }

    /// Runs gate/up and down over `routing` and returns (h, out) as item-major f32, after
    /// checking every element was written.
    fn run(&self, routing: &Routing) -> (Vec<f32>, Vec<f32>) {
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
        self.kernels
            .launch(stream, &launch, self.bits)
            .expect("launch");
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

    /// Each item's relative error of each stage against the f64 reference: h from x, and out
    /// from the kernel's own h (so each stage's error is measured alone), each input rounded to
    /// f16 first as the kernels do.
    fn check(&self, routing: &Routing, h: &[f32], out: &[f32]) -> Vec<(f64, f64)> {
        let (hidden, inter) = (self.hidden, self.inter);
        let items: Vec<(usize, u32, f32)> = routing
            .iter()
            .flat_map(|(e, items)| items.iter().map(move |&(r, w)| (*e, r, w)))
            .collect();
        let dot = |w: &[f32], v: &[f32]| -> f64 {
            w.iter()
                .zip(v)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum()
        };
        items
            .par_iter()
            .enumerate()
            .map(|(i, &(e, row, weight))| {
                let ex = &self.experts[e];
                let x = &f16_round(&self.x[row as usize * hidden..][..hidden]);
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
            .collect()
    }

    /// Runs `routing`, checks it against the reference, prints the worst error of each stage per
    /// group size and asserts the tolerance. Returns (h, out).
    fn run_checked(&self, what: &str, routing: &Routing) -> (Vec<f32>, Vec<f32>) {
        let (h, out) = self.run(routing);
        let errors = self.check(routing, &h, &out);
        let mut sizes: Vec<usize> = routing.iter().map(|(_, i)| i.len()).collect();
        sizes.sort_unstable();
        sizes.dedup();
        for size in sizes.into_iter().filter(|&s| s > 0) {
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
            println!(
                "{}-bit hidden={} inter={} {what}: m={size}: worst relative error gate/up \
                 {worst_h:.3e}, down {worst_out:.3e}",
                self.bits, self.hidden, self.inter
            );
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
fn route(rng: &mut ChaCha8Rng, rows: usize, counts: &[usize]) -> Routing {
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

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The index of each group's first item.
fn starts(routing: &Routing) -> Vec<usize> {
    let mut first = 0;
    routing
        .iter()
        .map(|(_, items)| {
            let s = first;
            first += items.len();
            s
        })
        .collect()
}

fn check_shape(hidden: usize, inter: usize, seed: u64) {
    for width in WIDTHS {
        let bits = Bits::new(width).unwrap();
        let device = common::gpu::device();
        // Uneven groups: one item (the one-item kernel when alone), 17 (two chunks of eight and
        // one), three (the 4-item code), none, a full chunk of eight, two, and five.
        let counts = [1, 17, 3, 0, 8, 2, 5];
        let rows = 24;
        let setup = Setup::new(device, (hidden, inter), bits, rows, seed + u64::from(width));
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
        let routing = route(&mut rng, rows, &counts);
        let (h, out) = setup.run_checked("mixed launch", &routing);
        assert!(h.iter().any(|&v| v != 0.0) && out.iter().any(|&v| v != 0.0));
        let first = starts(&routing);

        // Batch invariance 1: each group's items in reverse order land in other chunk slots and
        // chunks, yet every item gives the same bits.
        let reversed: Routing = routing
            .iter()
            .map(|(e, items)| (*e, items.iter().rev().copied().collect()))
            .collect();
        let (h_rev, out_rev) = setup.run(&reversed);
        for (g, (_, items)) in routing.iter().enumerate() {
            let n = items.len();
            for i in 0..n {
                let (a, b) = (first[g] + i, first[g] + n - 1 - i);
                assert_eq!(
                    bits_of(&h[a * inter..][..inter]),
                    bits_of(&h_rev[b * inter..][..inter]),
                    "{width}-bit h of item {a} reordered"
                );
                assert_eq!(
                    bits_of(&out[a * hidden..][..hidden]),
                    bits_of(&out_rev[b * hidden..][..hidden]),
                    "{width}-bit out of item {a} reordered"
                );
            }
        }

        // Batch invariance 2: an item alone in its launch (the one-item kernels) equals its
        // output inside the big launch (the general kernels, eight items a chunk): the lone
        // item, the last of the 17 (third chunk), one of the second chunk, one of the three, the
        // last of the eight and of the five.
        for (g, i) in [(0usize, 0usize), (1, 16), (1, 9), (2, 1), (4, 7), (6, 4)] {
            let (e, items) = &routing[g];
            let (h1, out1) = setup.run(&vec![(*e, vec![items[i]])]);
            let a = first[g] + i;
            assert_eq!(
                bits_of(&h1),
                bits_of(&h[a * inter..][..inter]),
                "{width}-bit h of group {g} item {i} alone"
            );
            assert_eq!(
                bits_of(&out1),
                bits_of(&out[a * hidden..][..hidden]),
                "{width}-bit out of group {g} item {i} alone"
            );
        }

        // Each group size on its own launch (so chunks hold m items, at most eight): two groups
        // of m items, the first being the first m items of the 17-item group above, which must
        // keep their bits; errors are checked per size.
        let (e17, items17) = &routing[1];
        for m in [1usize, 2, 3, 8, 17] {
            let mut single = route(&mut rng, rows, &[m, m]);
            single[0] = (*e17, items17[..m].to_vec());
            single[1].0 = 4;
            let (hm, outm) = setup.run_checked(&format!("launch of m={m}"), &single);
            let a = first[1];
            assert_eq!(
                bits_of(&hm[..m * inter]),
                bits_of(&h[a * inter..][..m * inter]),
                "{width}-bit h of the first {m} items of the 17-item group on their own"
            );
            assert_eq!(
                bits_of(&outm[..m * hidden]),
                bits_of(&out[a * hidden..][..m * hidden]),
                "{width}-bit out of the first {m} items of the 17-item group on their own"
            );
        }

        // A decode step: one-item groups of six experts (the one-item kernels), each item the
        // first of its group in the mixed launch.
        let decode: Routing = [0usize, 1, 2, 4, 5, 6]
            .iter()
            .map(|&g| (routing[g].0, vec![routing[g].1[0]]))
            .collect();
        let (hd, outd) = setup.run_checked("one-item groups", &decode);
        for (d, &g) in [0usize, 1, 2, 4, 5, 6].iter().enumerate() {
            let a = first[g];
            assert_eq!(
                bits_of(&hd[d * inter..][..inter]),
                bits_of(&h[a * inter..][..inter]),
                "{width}-bit h of one-item group {d}"
            );
            assert_eq!(
                bits_of(&outd[d * hidden..][..hidden]),
                bits_of(&out[a * hidden..][..hidden]),
                "{width}-bit out of one-item group {d}"
            );
        }
        println!(
            "{width}-bit hidden={hidden} inter={inter}: batch invariance holds (reordered, alone, \
             per size, one-item groups)"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rows_moe_small_shape() {
    // 384 inputs: fewer 16-input chunks (24) than lanes at 8 bits, 12 runs at 3 and 2 bits.
    check_shape(384, 256, 51);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rows_moe_deepseek_v2_lite_shape() {
    check_shape(2048, 1408, 52);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rows_moe_rejects_bad_shapes_before_launching() {
    let device = common::gpu::device();
    let kernels = MoeRowsKernels::new(&device).expect("load the row-layout MoE kernels");
    let mut launch = MoeLaunch {
        x: 256,
        hidden: 2048,
        inter: 1400,
        groups: 256,
        num_groups: 1,
        max_count: 1,
        item_row: 256,
        item_weight: 256,
        items: 1,
        h: 256,
        out: 256,
    };
    match kernels.launch(device.stream(), &launch, Bits::EIGHT) {
        Err(Error::Backend(msg)) => assert!(msg.contains("inter=1400"), "{msg}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
    launch.inter = 1408;
    match kernels.launch(device.stream(), &launch, Bits::FOUR) {
        Err(Error::Backend(msg)) => assert!(msg.contains("Marlin"), "{msg}"),
        other => panic!("expected a width error, got {other:?}"),
    }
}

/// Random codes and scales of `experts` experts of one matrix shape: any bytes are valid codes.
fn random_rows(seed: u64, experts: usize, n: usize, k: usize, bits: Bits) -> (Vec<u8>, Vec<f16>) {
    let bytes = n * k * bits.get() as usize / 8;
    let mut q = vec![0u8; experts * bytes];
    q.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        ChaCha8Rng::seed_from_u64(seed ^ ((i as u64) << 20)).fill_bytes(c);
    });
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let s = (0..experts * n * (k / 128))
        .map(|_| f16::from_f32(rng.random_range(0.001f32..0.01)))
        .collect();
    (q, s)
}

/// Launches of `f` timed back to back per run.
const QUEUED: usize = 10;

/// Median milliseconds one launch of `f()` takes on the GPU, over 15 runs after 3: each run queues
/// QUEUED launches back to back behind `busy()` (work that keeps the GPU going while the host
/// queues them, and leaves other data in L2), so neither the host's launch latency nor its cost
/// per launch counts.
fn time_ms(device: &CudaDevice, mut busy: impl FnMut(), mut f: impl FnMut()) -> f64 {
    let stream = device.stream();
    let event = || {
        device
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let (start, end) = (event(), event());
    for _ in 0..3 {
        f();
    }
    let mut times: Vec<f32> = (0..15)
        .map(|_| {
            busy();
            start.record(stream).unwrap();
            for _ in 0..QUEUED {
                f();
            }
            end.record(stream).unwrap();
            start.elapsed_ms(&end).unwrap() / QUEUED as f32
        })
        .collect();
    times.sort_by(f32::total_cmp);
    f64::from(times[times.len() / 2])
}

/// How fast the kernels read their weights at DeepSeek-V2-Lite's widths, one item a group:
/// 64 experts a launch (steady state; more bytes than L2 holds) and 6 (a decode step's launch,
/// small enough that its start and end count; consecutive launches take ten disjoint sets of
/// six, so none finds its weights in L2).
/// Prints the GPU time per launch and the rates beside the device-to-device copy's read rate;
/// asserts only that it ran.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rows_moe_read_rate_deepseek_v2_lite() {
    const EXPERTS: usize = 64;
    let (hidden, inter) = (2048usize, 1408usize);
    let device = common::gpu::device();
    let kernels = MoeRowsKernels::new(&device).expect("load the row-layout MoE kernels");
    let stream = device.stream().clone();
    // A 1 GiB copy: the read rate it reaches, and the work the timed launches queue behind.
    let copy_bytes = 1usize << 30;
    let src = stream.alloc_zeros::<u8>(copy_bytes).unwrap();
    let dst = std::cell::RefCell::new(stream.alloc_zeros::<u8>(copy_bytes).unwrap());
    let copy = || stream.memcpy_dtod(&src, &mut *dst.borrow_mut()).unwrap();
    let copy_ms = time_ms(&device, || {}, copy);
    println!(
        "{}: device-to-device copy reads {:.0} GB/s",
        device.name(),
        copy_bytes as f64 / (copy_ms * 1e-3) / 1e9
    );
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let x: Vec<f32> = (0..EXPERTS * hidden)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let x_dev = stream.clone_htod(&x).unwrap();
    let item_row: Vec<u32> = (0..EXPERTS as u32).collect();
    let rows_dev = stream.clone_htod(&item_row).unwrap();
    let weights_dev = stream.clone_htod(&vec![0.5f32; EXPERTS]).unwrap();
    let h_dev = stream.alloc_zeros::<f32>(EXPERTS * inter).unwrap();
    let out_dev = stream.alloc_zeros::<f32>(EXPERTS * hidden).unwrap();
    for width in WIDTHS {
        let bits = Bits::new(width).unwrap();
        let (gq, gs) = random_rows(1, EXPERTS, 2 * inter, hidden, bits);
        let (dq, ds) = random_rows(2, EXPERTS, hidden, inter, bits);
        let (gq, gs) = (
            stream.clone_htod(&gq).unwrap(),
            stream.clone_htod(&gs).unwrap(),
        );
        let (dq, ds) = (
            stream.clone_htod(&dq).unwrap(),
            stream.clone_htod(&ds).unwrap(),
        );
        let gate_up_bytes = 2 * inter * (hidden * width as usize / 8 + 2 * hidden / 128);
        let down_bytes = hidden * (inter * width as usize / 8 + 2 * inter / 128);
        let groups: Vec<ExpertGroup> = (0..EXPERTS)
            .map(|e| ExpertGroup {
                gate_up: addr(&gq, &stream) + (e * 2 * inter * hidden * width as usize / 8) as u64,
                gate_up_scales: addr(&gs, &stream) + (e * 2 * inter * hidden / 128 * 2) as u64,
                down: addr(&dq, &stream) + (e * hidden * inter * width as usize / 8) as u64,
                down_scales: addr(&ds, &stream) + (e * hidden * inter / 128 * 2) as u64,
                first: e as u32,
                count: 1,
            })
            .collect();
        let groups_dev = stream
            .clone_htod(bytemuck::cast_slice::<_, u8>(&groups))
            .unwrap();
        let launch_of = |first: usize, n: usize| MoeLaunch {
            x: addr(&x_dev, &stream),
            hidden,
            inter,
            groups: addr(&groups_dev, &stream)
                + (first * std::mem::size_of::<ExpertGroup>()) as u64,
            num_groups: n,
            max_count: 1,
            item_row: addr(&rows_dev, &stream),
            item_weight: addr(&weights_dev, &stream),
            items: EXPERTS,
            h: addr(&h_dev, &stream),
            out: addr(&out_dev, &stream),
        };
        for n in [EXPERTS, 6] {
            // Consecutive launches take the next n experts (64 / 6 = 10 disjoint sets of six).
            let mut turn = 0usize;
            let next = || {
                let first = if n == EXPERTS {
                    0
                } else {
                    (turn % (EXPERTS / n)) * n
                };
                turn += 1;
                launch_of(first, n)
            };
            let next = std::cell::RefCell::new(next);
            let gu = time_ms(&device, copy, || {
                let l = next.borrow_mut()();
                kernels.launch_gate_up(&stream, &l, bits).unwrap()
            });
            let dn = time_ms(&device, copy, || {
                let l = next.borrow_mut()();
                kernels.launch_down(&stream, &l, bits).unwrap()
            });
            let both = time_ms(&device, copy, || {
                let l = next.borrow_mut()();
                kernels.launch(&stream, &l, bits).unwrap()
            });
            let rate = |bytes: usize, ms: f64| (n * bytes) as f64 / (ms * 1e-3) / 1e9;
            println!(
                "{width}-bit, {n} experts x 1 item: gate/up {:.1} us {:.0} GB/s, down {:.1} us \
                 {:.0} GB/s, both {:.1} us {:.0} GB/s",
                gu * 1e3,
                rate(gate_up_bytes, gu),
                dn * 1e3,
                rate(down_bytes, dn),
                both * 1e3,
                rate(gate_up_bytes + down_bytes, both)
            );
        }
    }
    device.synchronize().unwrap();
    let out = stream.clone_dtoh(&out_dev).unwrap();
    assert!(out.iter().all(|v| v.is_finite()));
}
