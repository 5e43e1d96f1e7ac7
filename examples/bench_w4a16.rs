//! Times the grouped W4A16 expert kernels (kernels/moe_int4.cu) on DeepSeek-V2-Lite shapes and
//! compares their weight read rate with the device-to-device copy ceiling.
//!
//! `cargo run --release --example bench_w4a16 [-- EXPERTS]` on a GPU machine. Each timed launch
//! covers EXPERTS (default 64, one whole layer) distinct experts with m rows each, gate/up
//! (K=2048, N=2816) then down (K=1408, N=2048); launches rotate among three copies of the weights
//! so no launch finds the previous one's weights in L2. Reported rates count the INT4 weights and
//! scales read (activations are a few KB per item and not counted). All three timings go through
//! `MoeInt4Kernels::launch` / `launch_gate_up` / `launch_down`, so they time the kernel variant
//! the runtime gets for that m (the `chunk` column: items per block chunk, 8 or 16).

use std::error::Error;
use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, DevicePtr};
use half::f16;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use specter::backend::cuda::experts::{ExpertGroup, MoeLaunch};
use specter::backend::cuda::{CudaDevice, CudaSlice, CudaStream, MoeInt4Kernels};
use specter::quant::marlin_dequantize_out_in;

const HIDDEN: usize = 2048;
const INTER: usize = 1408;
const SETS: usize = 3;
const WARMUP: usize = 3;
const REPEATS: usize = 30;
const ROWS: [usize; 4] = [1, 4, 8, 16];
/// Rows per expert whose outputs are checked against the CPU reference.
const CHECK_M: usize = 4;
/// Experts of that launch checked (the reference is f64 on the host).
const CHECK_EXPERTS: usize = 4;

type Res<T> = Result<T, Box<dyn Error>>;

fn addr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

/// One weight matrix (Marlin qweight and scales) for every expert of a layer, back to back.
struct Matrix {
    k: usize,
    n: usize,
    qweight: Vec<u32>,
    scales: Vec<f16>,
}

impl Matrix {
    /// Random codes (every nibble value is a valid code) and scales for `experts` experts.
    fn random(rng: &mut ChaCha8Rng, experts: usize, k: usize, n: usize) -> Self {
        let mut qweight = vec![0u32; experts * k / 16 * 2 * n];
        rng.fill_bytes(bytemuck::cast_slice_mut(&mut qweight));
        let scales = (0..experts * k / 128 * n)
            .map(|_| f16::from_f32(rng.random_range(0.002f32..0.02)))
            .collect();
        Matrix {
            k,
            n,
            qweight,
            scales,
        }
    }
    fn words(&self) -> usize {
        self.k / 16 * 2 * self.n
    }
    fn scale_count(&self) -> usize {
        self.k / 128 * self.n
    }
    /// Bytes of one expert's qweight and scales.
    fn expert_bytes(&self) -> usize {
        4 * self.words() + 2 * self.scale_count()
    }
    /// Expert `e`'s matrix dequantized, HF orientation `[n][k]`.
    fn dequantized(&self, e: usize) -> Vec<f32> {
        let q = &self.qweight[e * self.words()..][..self.words()];
        let s = &self.scales[e * self.scale_count()..][..self.scale_count()];
        marlin_dequantize_out_in(self.k, self.n, q, s).expect("valid Marlin matrix")
    }
}

/// Device copy of both matrices of every expert.
struct DeviceSet {
    gate_up_q: CudaSlice<u32>,
    gate_up_s: CudaSlice<f16>,
    down_q: CudaSlice<u32>,
    down_s: CudaSlice<f16>,
}

/// `v` rounded to f16 (to nearest even) and back: the kernels compute with f16 activations
/// (W4A16), so the reference takes the same inputs.
fn f16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&a| f16::from_f32(a).to_f32()).collect()
}

fn median_ms(mut v: Vec<f32>) -> f64 {
    v.sort_by(f32::total_cmp);
    f64::from(v[v.len() / 2])
}

fn timing_event(device: &CudaDevice) -> Res<CudaEvent> {
    Ok(device
        .context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Median milliseconds of `f(rep)` over REPEATS runs after WARMUP runs, timed with events.
///
/// Each timed run is queued behind an untimed one, so the stream is already busy when the start
/// event is recorded and the host's launch latency does not count.
fn time_ms(device: &CudaDevice, mut f: impl FnMut(usize) -> Res<()>) -> Res<f64> {
    let stream = device.stream();
    let (start, end) = (timing_event(device)?, timing_event(device)?);
    for rep in 0..WARMUP {
        f(rep)?;
    }
    let mut times = Vec::with_capacity(REPEATS);
    for rep in 0..REPEATS {
        f(2 * rep)?;
        start.record(stream)?;
        f(2 * rep + 1)?;
        end.record(stream)?;
        times.push(start.elapsed_ms(&end)?);
    }
    Ok(median_ms(times))
}

/// Device-to-device copy of 1 GiB: returns the read rate in GB/s (bytes read per second; the
/// copy also writes as many).
fn copy_ceiling(device: &CudaDevice) -> Res<f64> {
    const BYTES: usize = 1 << 30;
    let stream = device.stream();
    let src = stream.alloc_zeros::<u8>(BYTES)?;
    let mut dst = stream.alloc_zeros::<u8>(BYTES)?;
    let ms = time_ms(device, |_| Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
    Ok(BYTES as f64 / (ms * 1e-3) / 1e9)
}

fn main() -> Res<()> {
    let experts: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 64,
    };
    let device = CudaDevice::open(0)?;
    let kernels = MoeInt4Kernels::new(&device)?;
    let stream = device.stream().clone();
    println!(
        "{} (sm_{}{}), {experts} experts x m rows, hidden {HIDDEN}, inter {INTER}, median of {REPEATS}",
        device.name(),
        device.compute_capability().0,
        device.compute_capability().1
    );

    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let gate_up = Matrix::random(&mut rng, experts, HIDDEN, 2 * INTER);
    let down = Matrix::random(&mut rng, experts, INTER, HIDDEN);
    // The same bytes at SETS different addresses: what matters is that consecutive launches read
    // different memory.
    let sets: Vec<DeviceSet> = (0..SETS)
        .map(|_| -> Res<DeviceSet> {
            Ok(DeviceSet {
                gate_up_q: stream.clone_htod(&gate_up.qweight)?,
                gate_up_s: stream.clone_htod(&gate_up.scales)?,
                down_q: stream.clone_htod(&down.qweight)?,
                down_s: stream.clone_htod(&down.scales)?,
            })
        })
        .collect::<Res<_>>()?;
    let gate_up_bytes = experts * gate_up.expert_bytes();
    let down_bytes = experts * down.expert_bytes();

    let ceiling = copy_ceiling(&device)?;
    println!(
        "device-to-device copy of 1 GiB: {:.0} GB/s read + written; read ceiling (half) {ceiling:.0} GB/s",
        2.0 * ceiling
    );
    println!(
        "weights per launch: gate/up {:.1} MB, down {:.1} MB",
        gate_up_bytes as f64 / 1e6,
        down_bytes as f64 / 1e6
    );
    println!();
    println!(
        "{:>3} {:>6} {:>5} | {:>9} {:>8} {:>6} | {:>9} {:>8} {:>6} | {:>9} {:>8} {:>6}",
        "m",
        "items",
        "chunk",
        "both us",
        "GB/s",
        "%ceil",
        "gate_up",
        "GB/s",
        "%ceil",
        "down us",
        "GB/s",
        "%ceil"
    );

    for &m in &ROWS {
        let items = experts * m;
        let x: Vec<f32> = (0..m * HIDDEN)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let x_dev = stream.clone_htod(&x)?;
        let item_row: Vec<u32> = (0..items).map(|i| (i % m) as u32).collect();
        let item_weight: Vec<f32> = (0..items).map(|_| rng.random_range(0.05f32..1.0)).collect();
        let rows_dev = stream.clone_htod(&item_row)?;
        let weights_dev = stream.clone_htod(&item_weight)?;
        let h_dev = stream.alloc_zeros::<f32>(items * INTER)?;
        let out_dev = stream.alloc_zeros::<f32>(items * HIDDEN)?;
        let mut group_bufs = Vec::new();
        for set in &sets {
            let groups: Vec<ExpertGroup> = (0..experts)
                .map(|e| ExpertGroup {
                    gate_up: addr(&set.gate_up_q, &stream) + (4 * e * gate_up.words()) as u64,
                    gate_up_scales: addr(&set.gate_up_s, &stream)
                        + (2 * e * gate_up.scale_count()) as u64,
                    down: addr(&set.down_q, &stream) + (4 * e * down.words()) as u64,
                    down_scales: addr(&set.down_s, &stream) + (2 * e * down.scale_count()) as u64,
                    first: (e * m) as u32,
                    count: m as u32,
                })
                .collect();
            group_bufs.push(stream.clone_htod(bytemuck::cast_slice::<_, u8>(&groups))?);
        }
        let launches: Vec<MoeLaunch> = group_bufs
            .iter()
            .map(|g| MoeLaunch {
                x: addr(&x_dev, &stream),
                hidden: HIDDEN,
                inter: INTER,
                groups: addr(g, &stream),
                num_groups: experts,
                max_count: m,
                item_row: addr(&rows_dev, &stream),
                item_weight: addr(&weights_dev, &stream),
                items,
                h: addr(&h_dev, &stream),
                out: addr(&out_dev, &stream),
            })
            .collect();

        let both = time_ms(&device, |rep| {
            Ok(kernels.launch(&stream, &launches[rep % SETS])?)
        })?;
        let gu = time_ms(&device, |rep| {
            Ok(kernels.launch_gate_up(&stream, &launches[rep % SETS])?)
        })?;
        let dn = time_ms(&device, |rep| {
            Ok(kernels.launch_down(&stream, &launches[rep % SETS])?)
        })?;
        let rate = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
        let (r_both, r_gu, r_dn) = (
            rate(gate_up_bytes + down_bytes, both),
            rate(gate_up_bytes, gu),
            rate(down_bytes, dn),
        );
        println!(
            "{m:>3} {items:>6} {:>5} | {:>9.1} {r_both:>8.0} {:>5.1}% | {:>9.1} {r_gu:>8.0} {:>5.1}% | {:>9.1} {r_dn:>8.0} {:>5.1}%",
            MoeInt4Kernels::chunk_items(m),
            both * 1e3,
            100.0 * r_both / ceiling,
            gu * 1e3,
            100.0 * r_gu / ceiling,
            dn * 1e3,
            100.0 * r_dn / ceiling,
        );

        if m == CHECK_M {
            // Run once more from a known set and compare the first experts' items with f64 (inputs
            // of each stage rounded to f16 as in the kernels; down from the kernel's own h).
            kernels.launch(&stream, &launches[0])?;
            device.synchronize()?;
            let h = stream.clone_dtoh(&h_dev)?;
            let out = stream.clone_dtoh(&out_dev)?;
            let (mut h_num, mut h_den, mut o_num, mut o_den) = (0.0, 0.0, 0.0, 0.0);
            for e in 0..CHECK_EXPERTS.min(experts) {
                let wgu = gate_up.dequantized(e);
                let wd = down.dequantized(e);
                let sums: Vec<(f64, f64, f64, f64)> = (e * m..(e + 1) * m)
                    .into_par_iter()
                    .map(|i| {
                        let xr = &f16_round(&x[item_row[i] as usize * HIDDEN..][..HIDDEN]);
                        let dot = |w: &[f32], v: &[f32]| -> f64 {
                            w.iter()
                                .zip(v)
                                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                                .sum()
                        };
                        let (mut hn, mut hd, mut on, mut od) = (0.0, 0.0, 0.0, 0.0);
                        for j in 0..INTER {
                            let a = dot(&wgu[j * HIDDEN..][..HIDDEN], xr);
                            let b = dot(&wgu[(INTER + j) * HIDDEN..][..HIDDEN], xr);
                            let want = a / (1.0 + (-a).exp()) * b;
                            hn += (f64::from(h[i * INTER + j]) - want).powi(2);
                            hd += want * want;
                        }
                        let hi = &f16_round(&h[i * INTER..][..INTER]);
                        for c in 0..HIDDEN {
                            let want =
                                f64::from(item_weight[i]) * dot(&wd[c * INTER..][..INTER], hi);
                            on += (f64::from(out[i * HIDDEN + c]) - want).powi(2);
                            od += want * want;
                        }
                        (hn, hd, on, od)
                    })
                    .collect();
                for (hn, hd, on, od) in sums {
                    h_num += hn;
                    h_den += hd;
                    o_num += on;
                    o_den += od;
                }
            }
            println!(
                "    m={m}: relative error vs f64 reference ({} experts): gate/up {:.2e}, down {:.2e}",
                CHECK_EXPERTS.min(experts),
                (h_num / h_den).sqrt(),
                (o_num / o_den).sqrt()
            );
        }
    }
    Ok(())
}
