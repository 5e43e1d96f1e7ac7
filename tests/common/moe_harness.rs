//! The harness of the grouped expert kernels' tests (tests/cuda_moe_rows.rs,
//! tests/cuda_moe_int4.rs): random experts, one launch over a routing with every output checked
//! written, the CPU f64 reference, and the batch-invariance checks. A [`Family`] is what differs:
//! the weights' packing and the launch call.
//!
//! Those two files include it by path rather than through `common`, whose other includers (the
//! other crates' tests) lack cudarc, rayon and bytemuck.

use cudarc::driver::{DevicePtr, DeviceRepr};
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use specter::backend::cuda::experts::{ExpertGroup, MoeLaunch};
use specter::backend::cuda::{CudaDevice, CudaSlice, CudaStream};
use specter::Error;
use std::sync::Arc;

/// Largest accepted ‖gpu - ref‖ / ‖ref‖ per item and stage (f32 accumulation, on tensor cores
/// for INT4, against f64; the reference rounds activations to f16 as the kernels do, so that
/// rounding is no error).
pub const TOLERANCE: f64 = 1e-5;

/// Per group: expert index, then (row, weight) items.
pub type Routing = Vec<(usize, Vec<(u32, f32)>)>;

/// `v` rounded to f16 (to nearest even) and back: the kernels' activation operand.
fn f16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| f16::from_f32(x).to_f32()).collect()
}

/// The raw device address of a buffer (all work here runs on one stream).
pub fn addr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

/// Random weights `[n][k]` with a per-row magnitude, so groups get different scales.
pub fn random_weight(rng: &mut ChaCha8Rng, n: usize, k: usize) -> Vec<f32> {
    let mut w = Vec::with_capacity(n * k);
    for _ in 0..n {
        let row_scale: f32 = rng.random_range(0.01..0.1);
        w.extend((0..k).map(|_| row_scale * rng.random_range(-1.0f32..1.0)));
    }
    w
}

/// One expert packed on the host: gate/up `[2 inter][hidden]` (gate rows then up rows) and down
/// `[hidden][inter]`, each as (codes, scales), and their dequantized Hugging Face-orientation
/// forms.
pub struct Packed<Q> {
    pub gate_up: (Vec<Q>, Vec<f16>),
    pub down: (Vec<Q>, Vec<f16>),
    pub gate_up_ref: Vec<f32>,
    pub down_ref: Vec<f32>,
}

/// One expert: device copies of its packed codes (words of `Q`) and scales, and the dequantized
/// matrices.
struct Expert<Q> {
    gate_up_q: CudaSlice<Q>,
    gate_up_s: CudaSlice<f16>,
    down_q: CudaSlice<Q>,
    down_s: CudaSlice<f16>,
    gate_up_ref: Vec<f32>,
    down_ref: Vec<f32>,
}

impl<Q: DeviceRepr> Expert<Q> {
    fn upload(stream: &Arc<CudaStream>, p: Packed<Q>) -> Self {
        Expert {
            gate_up_q: stream.clone_htod(&p.gate_up.0).unwrap(),
            gate_up_s: stream.clone_htod(&p.gate_up.1).unwrap(),
            down_q: stream.clone_htod(&p.down.0).unwrap(),
            down_s: stream.clone_htod(&p.down.1).unwrap(),
            gate_up_ref: p.gate_up_ref,
            down_ref: p.down_ref,
        }
    }
}

/// One family of grouped expert kernels under test (`Sync`: the reference runs on threads).
pub trait Family: Sync {
    /// The word of its packed codes.
    type Code: DeviceRepr + Sync;
    /// A random expert of `hidden` inputs and `inter` intermediate width.
    fn make_expert(&self, rng: &mut ChaCha8Rng, hidden: usize, inter: usize) -> Packed<Self::Code>;
    /// Issues gate/up then down.
    fn launch(&self, stream: &CudaStream, launch: &MoeLaunch) -> specter::Result<()>;
    /// What the printed lines and failure messages start with.
    fn label(&self) -> String;
}

/// h `[items][inter]` and out `[items][hidden]` of one launch.
pub struct Outputs {
    pub h: Vec<f32>,
    pub out: Vec<f32>,
}

/// The mixed launch the batch-invariance checks compare other launches with.
#[allow(dead_code)] // Read by the row-layout tests alone.
pub struct Mixed {
    pub routing: Routing,
    pub outputs: Outputs,
    /// The index of each group's first item.
    pub first: Vec<usize>,
}

/// One family's kernels at one shape, with its random experts and input rows.
pub struct Setup<F: Family> {
    device: CudaDevice,
    family: F,
    label: String,
    hidden: usize,
    inter: usize,
    rows: usize,
    x: Vec<f32>,
    x_dev: CudaSlice<f32>,
    experts: Vec<Expert<F::Code>>,
}

impl<F: Family> Setup<F> {
    /// `experts` random experts of `shape` (hidden, inter), then `rows` random input rows, all
    /// drawn from `seed`.
    pub fn new(
        device: CudaDevice,
        family: F,
        shape: (usize, usize),
        rows: usize,
        experts: usize,
        seed: u64,
    ) -> Self {
        let (hidden, inter) = shape;
        let stream = device.stream().clone();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let experts = (0..experts)
            .map(|_| Expert::upload(&stream, family.make_expert(&mut rng, hidden, inter)))
            .collect();
        let x: Vec<f32> = (0..rows * hidden)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let x_dev = stream.clone_htod(&x).unwrap();
        Setup {
            device,
            label: family.label(),
            family,
            hidden,
            inter,
            rows,
            x,
            x_dev,
            experts,
        }
    }

    /// Runs gate/up and down over `routing` and returns (h, out) as item-major f32, after
    /// checking every element was written.
    pub fn run(&self, routing: &Routing) -> Outputs {
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
        self.family.launch(stream, &launch).expect("launch");
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
        Outputs { h, out }
    }

    /// Each item's relative error of each stage against the f64 reference: h from x, and out
    /// from the kernel's own h (so each stage's error is measured alone), each input rounded to
    /// f16 first as the kernels do.
    fn check(&self, routing: &Routing, got: &Outputs) -> Vec<(f64, f64)> {
        let (hidden, inter) = (self.hidden, self.inter);
        let (h, out) = (&got.h, &got.out);
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
    /// group size and asserts the tolerance.
    pub fn run_checked(&self, what: &str, routing: &Routing) -> Outputs {
        let got = self.run(routing);
        let errors = self.check(routing, &got);
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
                "{}hidden={} inter={} {what}: m={size}: worst relative error gate/up \
                 {worst_h:.3e}, down {worst_out:.3e}",
                self.label, self.hidden, self.inter
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
        got
    }

    /// Asserts that `n` items from item `a` of `one` have the bits of `n` from item `b` of
    /// `other`, in h and in out; `what` ends the failure messages.
    pub fn same_bits(
        &self,
        (one, a): (&Outputs, usize),
        (other, b): (&Outputs, usize),
        n: usize,
        what: &str,
    ) {
        let (hidden, inter) = (self.hidden, self.inter);
        assert_eq!(
            bits_of(&one.h[a * inter..][..n * inter]),
            bits_of(&other.h[b * inter..][..n * inter]),
            "{}h of {what}",
            self.label
        );
        assert_eq!(
            bits_of(&one.out[a * hidden..][..n * hidden]),
            bits_of(&other.out[b * hidden..][..n * hidden]),
            "{}out of {what}",
            self.label
        );
    }

    /// The mixed launch of groups of `counts` items (`counts[1]` is 17), checked against the
    /// reference, and its batch invariance: every item gives the same bits with its group's
    /// items reversed, alone in a launch (the `alone` (group, item) pairs), and, for each of
    /// `sizes`, as one of the first m items of the 17-item group launched on their own.
    pub fn batch_invariance(
        &self,
        seed: u64,
        counts: &[usize],
        alone: &[(usize, usize)],
        sizes: &[usize],
    ) -> Mixed {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
        let routing = route(&mut rng, self.rows, counts);
        let mixed = self.run_checked("mixed launch", &routing);
        assert!(mixed.h.iter().any(|&v| v != 0.0) && mixed.out.iter().any(|&v| v != 0.0));
        let first = starts(&routing);

        // Reversed, each group's items land in other chunk slots and chunks.
        let reversed: Routing = routing
            .iter()
            .map(|(e, items)| (*e, items.iter().rev().copied().collect()))
            .collect();
        let rev = self.run(&reversed);
        for (g, (_, items)) in routing.iter().enumerate() {
            let n = items.len();
            for i in 0..n {
                let (a, b) = (first[g] + i, first[g] + n - 1 - i);
                self.same_bits((&mixed, a), (&rev, b), 1, &format!("item {a} reordered"));
            }
        }

        for &(g, i) in alone {
            let (e, items) = &routing[g];
            let one = self.run(&vec![(*e, vec![items[i]])]);
            let what = format!("group {g} item {i} alone");
            self.same_bits((&one, 0), (&mixed, first[g] + i), 1, &what);
        }

        // Two groups of m items, the first being the 17-item group's first m; errors are
        // checked per size.
        let (e17, items17) = &routing[1];
        for &m in sizes {
            let mut single = route(&mut rng, self.rows, &[m, m]);
            single[0] = (*e17, items17[..m].to_vec());
            single[1].0 = 4;
            let got = self.run_checked(&format!("launch of m={m}"), &single);
            let what = format!("the first {m} items of the 17-item group on their own");
            self.same_bits((&got, 0), (&mixed, first[1]), m, &what);
        }
        Mixed {
            routing,
            outputs: mixed,
            first,
        }
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

/// A one-item launch at `inter` with every pointer `ptr`, for the checks that reject a shape
/// before the kernels touch memory.
pub fn unlaunched(ptr: u64, inter: usize) -> MoeLaunch {
    MoeLaunch {
        x: ptr,
        hidden: 2048,
        inter,
        groups: ptr,
        num_groups: 1,
        max_count: 1,
        item_row: ptr,
        item_weight: ptr,
        items: 1,
        h: ptr,
        out: ptr,
    }
}

/// Asserts `result` is the backend's refusal, with a message that names `needle`; `what` names the
/// error expected.
pub fn assert_refused(result: specter::Result<()>, needle: &str, what: &str) {
    match result {
        Err(Error::Backend(msg)) => assert!(msg.contains(needle), "{msg}"),
        other => panic!("expected a {what} error, got {other:?}"),
    }
}
