//! How fast a chain of dependent one-row matrix products can stream its weights, and what each
//! streaming design (examples/bench_stream.cu) loses at a kernel boundary: the ceiling the decode
//! step's matrix kernels are measured against.
//!
//!     cargo run --release --example bench_stream [-- LAYERS]
//!
//! A layer is DeepSeek-V2-Lite's one-row decode products in their step order: MLA's q with
//! kv_a (one 3648 x 2048 matrix here), kv_b (4096 x 512), o_proj (2048 x 2048), the router
//! (64 x 2048), the shared experts' gate/up (5632 x 2048), six routed experts' gate/up (16896 x
//! 2048), their down (12288 x 1408) and the shared down (2048 x 2816): 166 MB of FP16 weights,
//! each layer its own copy (LAYERS, default 27), so no launch finds its weights in L2. Each
//! product reads the previous one's output as its input (launched with programmatic dependent
//! launch, recorded as a CUDA graph), as in the decode step. For each design the table gives the
//! median time of the whole chain (20 replays) and its read rate, then the same for chains of
//! one matrix shape (LAYERS launches), per launch. Each design runs with the next kernel allowed
//! to launch as a kernel starts (as the backend's kernels do) and, marked "late", only after its
//! own wait. The last rows read each layer's 166 MB as one launch: the rate with no boundary at
//! all. `STREAM_CARVEOUT=1` asks every kernel for the largest shared-memory carveout (one split
//! between L1 and shared memory for all of them).

use std::error::Error;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use specter::backend::cuda::args::{DevPtr, KernelArgs, Params};
use specter::backend::cuda::launch_overlapping;

type Res<T> = Result<T, Box<dyn Error>>;

/// The kernels, after the backend's shared header.
const SOURCE: &str = concat!(
    include_str!("../kernels/common.cuh"),
    include_str!("bench_stream.cu")
);
const REPLAYS: usize = 20;
/// (name, rows, inputs) of one layer's products, in step order.
const SHAPES: [(&str, usize, usize); 8] = [
    ("q+kv_a", 3648, 2048),
    ("kv_b", 4096, 512),
    ("o_proj", 2048, 2048),
    ("router", 64, 2048),
    ("shared gate/up", 5632, 2048),
    ("routed gate/up", 16896, 2048),
    ("routed down", 12288, 1408),
    ("shared down", 2048, 2816),
];
/// Rows a `read_bulk` stage holds (BULK_ROWS in the kernel).
const BULK_ROWS: usize = 8;

#[derive(Clone, Copy)]
enum Kind {
    Ldg,
    LdgPrefetch,
    /// Ring stages, blocks per multiprocessor.
    Bulk(usize, usize),
}

/// A streaming kernel, and whether it lets the next kernel launch only after its own wait.
#[derive(Clone, Copy)]
struct Design(Kind, bool);

impl Design {
    fn name(self) -> String {
        let kind = match self.0 {
            Kind::Ldg => "ldg".into(),
            Kind::LdgPrefetch => "ldg+prefetch".into(),
            Kind::Bulk(s, b) => format!("bulk {s} stages x{b}"),
        };
        if self.1 {
            format!("{kind}, late")
        } else {
            kind
        }
    }
}

struct Kernels {
    ldg: CudaFunction,
    ldg_pf: CudaFunction,
    bulk: CudaFunction,
    sms: usize,
}

fn ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

/// The arguments of the three kernels of examples/bench_stream.cu: (const __half* w, int k, int n,
/// const float* x, float* y, int stages, int late).
#[derive(Clone, Copy)]
struct StreamArgs {
    w: DevPtr,
    k: i32,
    n: i32,
    x: DevPtr,
    y: DevPtr,
    stages: i32,
    late: i32,
}

impl Params for StreamArgs {
    fn push_params(&mut self, out: &mut Vec<*mut std::ffi::c_void>) {
        self.w.push_params(out);
        self.k.push_params(out);
        self.n.push_params(out);
        self.x.push_params(out);
        self.y.push_params(out);
        self.stages.push_params(out);
        self.late.push_params(out);
    }
    fn push_ptx(out: &mut Vec<&'static str>) {
        out.extend([".u64", ".u32", ".u32", ".u64", ".u64", ".u32", ".u32"]);
    }
    fn push_names(_field: &'static str, out: &mut Vec<&'static str>) {
        out.extend(["w", "k", "n", "x", "y", "stages", "late"]);
    }
}

impl KernelArgs for StreamArgs {
    const KERNELS: &'static [&'static str] = &["read_ldg", "read_ldg_pf", "read_bulk"];
}

/// One product y = w . x launched with programmatic stream serialisation.
fn launch(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    design: Design,
    w: u64,
    (rows, inputs): (usize, usize),
    x: u64,
    y: u64,
) -> Res<()> {
    let (f, grid, block, smem, stages) = match design.0 {
        Kind::Ldg => (&k.ldg, rows.div_ceil(8), 128, 0, 0),
        Kind::LdgPrefetch => (&k.ldg_pf, rows.div_ceil(8), 128, 0, 0),
        Kind::Bulk(stages, per_sm) => (
            &k.bulk,
            (rows / BULK_ROWS).min(k.sms * per_sm),
            288,
            stages * BULK_ROWS * inputs * 2,
            stages,
        ),
    };
    let args = StreamArgs {
        w: DevPtr(w),
        k: inputs as i32,
        n: rows as i32,
        x: DevPtr(x),
        y: DevPtr(y),
        stages: stages as i32,
        late: design.1 as i32,
    };
    // SAFETY: StreamArgs are the three kernels' arguments, and they wait in `spx_grid_wait`
    // before touching x or y; w holds rows x inputs halves, x at least `inputs` floats and y at
    // least `rows` (both activation buffers hold the widest layer); the bulk kernel was allowed
    // the largest ring's shared memory at load.
    unsafe { launch_overlapping(stream, f, (grid as u32, 1, 1), block, smem as u32, args) }
        .map_err(|e| {
            format!(
                "launch of {} ({rows} x {inputs}) failed: {e}",
                design.name()
            )
        })?;
    Ok(())
}

/// Median milliseconds of one replay of the chain `each` records.
fn time_chain(stream: &Arc<CudaStream>, each: &mut dyn FnMut() -> Res<()>) -> Res<f64> {
    stream.begin_capture(sys::CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let recorded = each();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0))?;
    recorded?;
    let graph = graph.ok_or("the capture recorded nothing")?;
    graph.upload()?;
    for _ in 0..3 {
        graph.launch()?;
    }
    stream.synchronize()?;
    let mut times = Vec::with_capacity(REPLAYS);
    for _ in 0..REPLAYS {
        let start = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        graph.launch()?;
        let end = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        times.push(start.elapsed_ms(&end)? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[REPLAYS / 2])
}

fn main() -> Res<()> {
    let layers: usize = match std::env::args().nth(1) {
        Some(v) => v
            .parse()
            .map_err(|_| format!("LAYERS: {v:?} is not a number"))?,
        None => 27,
    };
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let major =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    if major < 9 {
        return Err(
            format!("sm_{major}{minor}: bulk copies and dependent launch need sm_90").into(),
        );
    }
    let sms =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
    let include =
        std::env::var("CUDA_INCLUDE").unwrap_or_else(|_| "/usr/local/cuda/include".into());
    let opts = CompileOptions {
        include_paths: if std::path::Path::new(&include).is_dir() {
            vec![include.clone()]
        } else {
            Vec::new()
        },
        options: vec![
            format!("--gpu-architecture=sm_{major}{minor}"),
            "--std=c++17".into(),
        ],
        name: Some("bench_stream.cu".into()),
        ..Default::default()
    };
    let module = ctx.load_module(compile_ptx_with_opts(SOURCE, opts)?)?;
    let k = Kernels {
        ldg: module.load_function("read_ldg")?,
        ldg_pf: module.load_function("read_ldg_pf")?,
        bulk: module.load_function("read_bulk")?,
        sms,
    };
    k.bulk.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        200 * 1024,
    )?;
    // One shared-memory carveout for every kernel: a multiprocessor changes its split between
    // L1 and shared memory only when idle, which would keep consecutive kernels apart.
    if std::env::var_os("STREAM_CARVEOUT").is_some() {
        for f in [&k.ldg, &k.ldg_pf, &k.bulk] {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )?;
        }
    }

    // Weights: every layer's matrices, filled with a byte pattern (the values do not matter to
    // the read rate, and plain allocations are not compressed).
    let mut weights: Vec<Vec<CudaSlice<u8>>> = Vec::with_capacity(layers);
    for _ in 0..layers {
        let mut layer = Vec::new();
        for (_, rows, inputs) in SHAPES {
            let buf = stream.alloc_zeros::<u8>(rows * inputs * 2)?;
            let p = ptr(&buf, &stream);
            // SAFETY: p addresses `rows * inputs * 2` bytes of `buf`, alive here.
            unsafe { sys::cuMemsetD8Async(p, 0x2b, rows * inputs * 2, stream.cu_stream()) }
                .result()?;
            layer.push(buf);
        }
        weights.push(layer);
    }
    let widest = SHAPES
        .iter()
        .map(|s| s.1.max(s.2))
        .max()
        .unwrap_or(1)
        .max(1 << 16);
    let acts = [
        stream.alloc_zeros::<f32>(widest)?,
        stream.alloc_zeros::<f32>(widest)?,
    ];
    stream.synchronize()?;
    let layer_bytes: usize = SHAPES.iter().map(|s| s.1 * s.2 * 2).sum();
    let wp: Vec<Vec<u64>> = weights
        .iter()
        .map(|l| l.iter().map(|b| ptr(b, &stream)).collect())
        .collect();
    let xp = [ptr(&acts[0], &stream), ptr(&acts[1], &stream)];

    let designs = [
        Design(Kind::Ldg, false),
        Design(Kind::Ldg, true),
        Design(Kind::LdgPrefetch, false),
        Design(Kind::LdgPrefetch, true),
        Design(Kind::Bulk(2, 1), false),
        Design(Kind::Bulk(2, 1), true),
        Design(Kind::Bulk(3, 1), true),
        Design(Kind::Bulk(4, 1), true),
        Design(Kind::Bulk(2, 2), false),
        Design(Kind::Bulk(2, 2), true),
        Design(Kind::Bulk(3, 2), true),
    ];
    println!(
        "{layers} layers of {:.1} MB; {sms} multiprocessors; median of {REPLAYS} replays",
        layer_bytes as f64 / 1e6
    );
    print!("| design | chain ms | TB/s | us a layer |");
    for (name, _, _) in SHAPES {
        print!(" {name} us |");
    }
    println!();
    print!("|---|---|---|---|");
    for _ in SHAPES {
        print!("---|");
    }
    println!();
    for design in designs {
        // Every layer's products of the shapes `picked` (indices into SHAPES), in that order, each
        // reading the previous one's output; timed as one recorded chain.
        let time_shapes = |picked: &[usize]| -> Res<f64> {
            time_chain(&stream, &mut || {
                let mut flip = 0;
                for layer in &wp {
                    for &i in picked {
                        let (_, rows, inputs) = SHAPES[i];
                        let (x, y) = (xp[flip], xp[1 - flip]);
                        launch(&stream, &k, design, layer[i], (rows, inputs), x, y)?;
                        flip = 1 - flip;
                    }
                }
                Ok(())
            })
        };
        let all: Vec<usize> = (0..SHAPES.len()).collect();
        let ms = time_shapes(&all)?;
        print!(
            "| {} | {ms:.3} | {:.2} | {:.1} |",
            design.name(),
            (layer_bytes * layers) as f64 / (ms * 1e-3) / 1e12,
            ms * 1e3 / layers as f64
        );
        for i in all {
            let ms = time_shapes(&[i])?;
            print!(" {:.2} |", ms * 1e3 / layers as f64);
        }
        println!();
    }

    // No boundary: each layer's bytes as one matrix of 2048-wide rows, one launch a layer.
    let whole_rows = layer_bytes / (2048 * 2) / BULK_ROWS * BULK_ROWS;
    let mut whole = Vec::with_capacity(layers);
    for _ in 0..layers {
        let buf = stream.alloc_zeros::<u8>(whole_rows * 2048 * 2)?;
        let p = ptr(&buf, &stream);
        // SAFETY: p addresses the whole of `buf`, alive here.
        unsafe { sys::cuMemsetD8Async(p, 0x2b, whole_rows * 2048 * 2, stream.cu_stream()) }
            .result()?;
        whole.push(buf);
    }
    let whole_ptrs: Vec<u64> = whole.iter().map(|b| ptr(b, &stream)).collect();
    for design in [
        Design(Kind::Ldg, false),
        Design(Kind::Bulk(3, 1), true),
        Design(Kind::Bulk(4, 1), true),
    ] {
        let mut chain = || -> Res<()> {
            let mut flip = 0;
            for &w in &whole_ptrs {
                launch(
                    &stream,
                    &k,
                    design,
                    w,
                    (whole_rows, 2048),
                    xp[flip],
                    xp[1 - flip],
                )?;
                flip = 1 - flip;
            }
            Ok(())
        };
        let ms = time_chain(&stream, &mut chain)?;
        println!(
            "one launch a layer ({:.1} MB), {}: {ms:.3} ms, {:.2} TB/s, {:.1} us a layer",
            (whole_rows * 4096) as f64 / 1e6,
            design.name(),
            (whole_rows * 4096 * layers) as f64 / (ms * 1e-3) / 1e12,
            ms * 1e3 / layers as f64
        );
    }
    Ok(())
}
