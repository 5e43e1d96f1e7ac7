//! The grouped row-layout expert kernels (kernels/moe_rows.cu) at 8, 4, 3 and 2 bits against a CPU
//! f64 reference built from the project's own quantizer and row packer, their batch invariance,
//! and their weight read rate at DeepSeek-V2-Lite's widths.
//!
//! Needs an NVIDIA GPU, so ignored by default (see tests/common/gpu.rs); `scripts/gpu-check.sh run
//! int4` runs these with `--ignored`.

mod common;
#[path = "common/moe_harness.rs"]
mod moe_harness;

use cudarc::driver::sys;
use half::f16;
use moe_harness::{
    addr, assert_refused, random_weight, unlaunched, Family, Packed, Routing, Setup,
};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use specter::backend::cuda::experts::{ExpertGroup, MoeLaunch};
use specter::backend::cuda::{CudaDevice, CudaStream, MoeRowsKernels};
use specter::quant::{rows_dequantize_out_in, rows_pack, rtn, Bits};

/// The row-layout widths.
const WIDTHS: [u32; 4] = [8, 4, 3, 2];

/// The row-layout kernels at one width.
struct Rows {
    kernels: MoeRowsKernels,
    bits: Bits,
}

impl Family for Rows {
    type Code = u8;

    fn make_expert(&self, rng: &mut ChaCha8Rng, hidden: usize, inter: usize) -> Packed<u8> {
        let bits = self.bits;
        // Gate rows then up rows, quantized as one [2 inter][hidden] matrix (scales are per row,
        // so this equals quantizing each on its own).
        let mut gate_up = random_weight(rng, inter, hidden);
        gate_up.extend(random_weight(rng, inter, hidden));
        let gate_up =
            rows_pack(&rtn("gate_up", &gate_up, 2 * inter, hidden, bits).unwrap()).unwrap();
        let down = random_weight(rng, hidden, inter);
        let down = rows_pack(&rtn("down", &down, hidden, inter, bits).unwrap()).unwrap();
        assert!(gate_up.qweight.iter().any(|&b| b != gate_up.qweight[0]));
        Packed {
            gate_up_ref: rows_dequantize_out_in(
                hidden,
                2 * inter,
                bits,
                &gate_up.qweight,
                &gate_up.scales,
            )
            .unwrap(),
            down_ref: rows_dequantize_out_in(inter, hidden, bits, &down.qweight, &down.scales)
                .unwrap(),
            gate_up: (gate_up.qweight, gate_up.scales),
            down: (down.qweight, down.scales),
        }
    }

    fn launch(&self, stream: &CudaStream, launch: &MoeLaunch) -> specter::Result<()> {
        self.kernels.launch(stream, launch, self.bits)
    }

    fn label(&self) -> String {
        format!("{}-bit ", self.bits)
    }
}

/// The checks of one width at one shape.
fn check_shape(hidden: usize, inter: usize, seed: u64, width: u32) {
    let bits = Bits::new(width).unwrap();
    let device = common::gpu::device();
    let kernels = MoeRowsKernels::new(&device).expect("load the row-layout MoE kernels");
    let rows = 24;
    let setup = Setup::new(
        device,
        Rows { kernels, bits },
        (hidden, inter),
        rows,
        8,
        seed + u64::from(width),
    );
    // Uneven groups: one item (the one-item kernel when alone), 17 (two chunks of eight and one),
    // three (the 4-item code), none, a full chunk of eight, two, and five.
    let counts = [1, 17, 3, 0, 8, 2, 5];
    // Alone, the one-item kernels; in the mixed launch, the general kernels (eight items a chunk):
    // the lone item, the last of the 17 (third chunk), one of the second chunk, one of the three,
    // the last of the eight and of the five.
    let alone = [(0usize, 0usize), (1, 16), (1, 9), (2, 1), (4, 7), (6, 4)];
    // Each size alone fills chunks of m items, at most eight.
    let sizes = [1usize, 2, 3, 8, 17];
    let mixed = setup.batch_invariance(seed, &counts, &alone, &sizes);

    // A decode step: one-item groups of six experts (the one-item kernels), each item the first
    // of its group in the mixed launch.
    let decode: Routing = [0usize, 1, 2, 4, 5, 6]
        .iter()
        .map(|&g| (mixed.routing[g].0, vec![mixed.routing[g].1[0]]))
        .collect();
    let one = setup.run_checked("one-item groups", &decode);
    for (d, &g) in [0usize, 1, 2, 4, 5, 6].iter().enumerate() {
        let what = format!("one-item group {d}");
        setup.same_bits((&one, d), (&mixed.outputs, mixed.first[g]), 1, &what);
    }
    println!(
        "{width}-bit hidden={hidden} inter={inter}: batch invariance holds (reordered, alone, per \
         size, one-item groups)"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rows_moe_small_shape() {
    // 384 inputs: fewer 16-input chunks (24) than lanes at 8 bits, 12 runs at 4, 3 and 2 bits.
    for width in WIDTHS {
        check_shape(384, 256, 51, width);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rows_moe_deepseek_v2_lite_shape() {
    for width in WIDTHS {
        check_shape(2048, 1408, 52, width);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn rows_moe_rejects_bad_shapes_before_launching() {
    let device = common::gpu::device();
    let kernels = MoeRowsKernels::new(&device).expect("load the row-layout MoE kernels");
    let stream = device.stream();
    // Every width the row layout has; each refuses before anything reaches the device (a launch
    // with these placeholder pointers would fault and end the process's context).
    for bits in WIDTHS.map(|b| Bits::new(b).unwrap()) {
        let launch = unlaunched(256, 1400);
        assert_refused(kernels.launch(stream, &launch, bits), "inter=1400", "shape");
        let mut launch = unlaunched(256, 1408);
        launch.hidden = 2000;
        assert_refused(
            kernels.launch(stream, &launch, bits),
            "hidden=2000",
            "shape",
        );
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
