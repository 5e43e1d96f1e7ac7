//! CUDA device opening, the embedded kernel table and the PTX cache.
//!
//! On a machine without the NVIDIA driver these check that every entry point fails with a clear
//! error instead of panicking; `gpu_copies_and_kernels` runs real copies and kernels on a GPU
//! (ignored elsewhere, see tests/common/gpu.rs).

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};
use specter::backend::cuda::{
    cache_key, compile_source, driver_library_present, kernel_source, nvrtc_library_present,
    CudaDevice, LaunchConfig, PtxCache, PushKernelArg, KERNELS, NO_DRIVER_MESSAGE,
};
use specter::Error;
use std::path::Path;

mod common;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn open_without_a_driver_is_a_clear_error() {
    if driver_library_present() {
        // With a driver, an ordinal far beyond any machine must be refused by name, not panic.
        match CudaDevice::open(4096) {
            Err(Error::Backend(msg)) => assert!(
                msg.contains("4096") || msg.contains("no GPU") || msg.contains("cuInit"),
                "unexpected message: {msg}"
            ),
            other => panic!("opening device 4096 should fail, got {other:?}"),
        }
        return;
    }
    match CudaDevice::open(0) {
        Err(Error::Backend(msg)) => assert_eq!(msg, NO_DRIVER_MESSAGE),
        other => panic!("expected Error::Backend({NO_DRIVER_MESSAGE:?}), got {other:?}"),
    }
    // The outcome is remembered, and the other entry points report the same.
    for result in [
        CudaDevice::device_count().map(|_| ()),
        CudaDevice::driver_version().map(|_| ()),
    ] {
        match result {
            Err(Error::Backend(msg)) => assert!(
                msg.contains("libcuda.so.1") && msg.contains("--backend cpu"),
                "{msg}"
            ),
            other => panic!("expected a backend error, got {other:?}"),
        }
    }
}

/// `text` of kernels/`file` as build.rs embeds it: each `#include "NAME.cuh"` line replaced by
/// kernels/NAME.cuh between `#line` directives.
fn spliced(kernels: &Path, file: &str, text: &str) -> String {
    let mut out = String::new();
    for (index, line) in text.split_inclusive('\n').enumerate() {
        let header = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'));
        match header {
            Some(header) => {
                let body = std::fs::read_to_string(kernels.join(header))
                    .unwrap_or_else(|err| panic!("{file} includes {header}: {err}"));
                out.push_str(&format!("#line 1 \"{header}\"\n{body}"));
                if !body.ends_with('\n') {
                    out.push('\n');
                }
                out.push_str(&format!("#line {} \"{file}\"\n", index + 2));
            }
            None => out.push_str(line),
        }
    }
    out
}

/// Whether `source` defines the kernel entry point `entry`.
fn defines_kernel(source: &str, entry: &str) -> bool {
    let name = format!(" {entry}(");
    source
        .lines()
        .any(|line| line.contains("__global__") && line.contains(&name))
}

#[test]
fn embedded_kernels_match_their_sources() {
    assert!(!KERNELS.is_empty(), "build.rs embedded no kernels");
    let kernels = common::repo_root().join("kernels");
    for k in KERNELS {
        let file = format!("{}.cu", k.name);
        let on_disk = std::fs::read_to_string(kernels.join(&file))
            .expect("embedded kernel has a source file");
        // The constants shared with the host come first (build.rs writes them from
        // src/backend/cuda/runtime/kernel_defines.rs), then the file from its first line.
        let start = format!("#line 1 \"{file}\"\n");
        let (defines, text) = k
            .source
            .split_once(&start)
            .unwrap_or_else(|| panic!("kernels/{file}: no {start:?} after the shared constants"));
        assert!(
            defines
                .lines()
                .all(|l| l.starts_with("// The constants shared") || l.starts_with("#define ")),
            "kernels/{file}: more than the shared constants before its text: {defines:?}"
        );
        assert_eq!(
            text,
            spliced(&kernels, &file, &on_disk),
            "kernels/{file} embedded text differs from the file with its headers spliced in",
        );
        assert!(
            !on_disk.contains("struct ExpertGroup {"),
            "kernels/{file} defines ExpertGroup itself; it belongs in kernels/common.cuh"
        );
        assert_eq!(
            k.sha256,
            hex(&Sha256::digest(k.source.as_bytes())),
            "hash of kernels/{}.cu",
            k.name
        );
        assert_eq!(k.ptx.is_some(), k.ptx_arch.is_some());
    }
    // The shared header reaches the files that use it, so its bytes are part of their hash.
    let common = std::fs::read_to_string(kernels.join("common.cuh")).expect("kernels/common.cuh");
    for name in ["ops", "routing", "gemv_f16", "attention", "moe_int4"] {
        let kernel = kernel_source(name).expect("kernel embedded");
        assert!(
            kernel.source.contains(&common),
            "kernels/{name}.cu is embedded without kernels/common.cuh"
        );
    }
    let routing_h =
        std::fs::read_to_string(kernels.join("routing.cuh")).expect("kernels/routing.cuh");
    for name in ["routing", "gemv_f16"] {
        let kernel = kernel_source(name).expect("kernel embedded");
        assert!(
            kernel.source.contains(&routing_h),
            "kernels/{name}.cu is embedded without kernels/routing.cuh"
        );
    }
    // The routing kernels live in their own file, loaded as their own module.
    let ops = kernel_source("ops").expect("ops kernels embedded");
    let routing = kernel_source("routing").expect("routing kernels embedded");
    for entry in [
        "route_softmax_topk",
        "route_sparse_mixer",
        "count_routes",
        "moe_plan",
        "route_plan",
    ] {
        assert!(
            defines_kernel(routing.source, entry) && !defines_kernel(ops.source, entry),
            "{entry} belongs to kernels/routing.cu only"
        );
    }
    let util = kernel_source("util").expect("util kernels embedded");
    for entry in ["fill_f16", "axpy_f16", "byte_checksum"] {
        assert!(
            util.source
                .contains(&format!("extern \"C\" __global__ void {entry}(")),
            "{entry} missing"
        );
        if let Some(ptx) = util.ptx {
            assert!(
                ptx.contains(&format!(".entry {entry}(")),
                "{entry} missing from the PTX"
            );
        }
    }
    match kernel_source("no_such_kernel") {
        Err(Error::Backend(msg)) => assert!(
            msg.contains("no_such_kernel") && msg.contains("util"),
            "{msg}"
        ),
        other => panic!("expected an error naming the kernel, got {other:?}"),
    }
}

#[test]
fn ptx_cache_keys_and_round_trip() {
    let util = kernel_source("util").expect("util kernels embedded");
    let key = cache_key(util, "sm_90", (13, 0));
    assert!(
        key.starts_with("util-") && key.contains(&util.sha256[..16]) && key.ends_with(".ptx"),
        "{key}"
    );
    assert_ne!(
        key,
        cache_key(util, "sm_80", (13, 0)),
        "architecture must be part of the key"
    );
    assert_ne!(
        key,
        cache_key(util, "sm_90", (12, 8)),
        "NVRTC version must be part of the key"
    );

    let dir = tempfile::tempdir().expect("temp dir");
    let cache = PtxCache::new(dir.path().join("nested").join("ptx"));
    assert_eq!(cache.get(&key), None);
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let body: String = (0..rng.random_range(10..40))
        .map(|_| {
            format!(
                "\tmov.u32 %r{}, {};\n",
                rng.random_range(0..64),
                rng.next_u32()
            )
        })
        .collect();
    let ptx = format!(
        ".version 8.8\n.target sm_90\n.address_size 64\n.visible .entry k()\n{{\n{body}}}\n"
    );
    cache.put(&key, &ptx).expect("cache write");
    assert_eq!(cache.get(&key).as_deref(), Some(ptx.as_str()));
    // A damaged entry (cut short) is ignored, so the kernel is compiled again.
    let cut = &ptx[..ptx.len() / 2];
    std::fs::write(dir.path().join("nested").join("ptx").join(&key), cut).expect("overwrite");
    assert_eq!(cache.get(&key), None);
}

#[test]
fn nvrtc_absence_is_a_clear_error() {
    if nvrtc_library_present() {
        return; // covered by the GPU test below and by `doctor`
    }
    let util = kernel_source("util").expect("util kernels embedded");
    match compile_source(util, "sm_90", None) {
        Err(Error::Backend(msg)) => assert!(msg.contains("NVRTC not found"), "{msg}"),
        other => panic!("expected an NVRTC error, got {other:?}"),
    }
}

/// Copies random bytes through a registered range and a pinned buffer and runs the util kernels.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_copies_and_kernels() {
    let device = common::gpu::device();
    let stream = device.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let len = 3 * 1024 * 1024 + rng.random_range(1..4096);
    let mut bytes = vec![0u8; len];
    rng.fill_bytes(&mut bytes);

    let registered = device.register_read_only(&bytes).expect("register");
    let mut dst = stream.alloc_zeros::<u8>(len).expect("alloc");
    let split = len / 3;
    registered
        .copy_to_device(0..split, &mut dst.slice_mut(0..split), &stream)
        .expect("copy 1");
    registered
        .copy_to_device(split..len, &mut dst.slice_mut(split..len), &stream)
        .expect("copy 2");
    assert!(
        registered
            .copy_to_device(0..len + 1, &mut dst, &stream)
            .is_err(),
        "out-of-range copy accepted"
    );
    drop(registered);
    assert_eq!(stream.clone_dtoh(&dst).expect("read back"), bytes);

    let mut pinned = device.alloc_pinned(len).expect("pinned");
    rng.fill_bytes(pinned.as_mut_slice().expect("pinned bytes"));
    pinned
        .copy_to_device(0..len, &mut dst, &stream)
        .expect("pinned copy");
    pinned.wait().expect("wait");
    assert_eq!(
        stream.clone_dtoh(&dst).expect("read back"),
        pinned.as_slice()
    );

    // fill_f16 writes the value everywhere; axpy_f16 then adds a * x.
    let n = 10_000 + rng.random_range(0..1000usize);
    let value: f32 = rng.random_range(-3.0..3.0);
    let mut y = stream.alloc_zeros::<half::f16>(n).expect("alloc y");
    let fill = device.function("util", "fill_f16").expect("fill_f16");
    let n_arg = n as u64;
    let cfg = LaunchConfig {
        grid_dim: (8, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut y).arg(&value).arg(&n_arg);
    // SAFETY: fill_f16(half* y, float value, unsigned long long n) with y of n elements.
    unsafe { launch.launch(cfg) }.expect("launch fill");
    let filled = stream.clone_dtoh(&y).expect("read y");
    let want = half::f16::from_f32(value);
    assert!(
        filled.iter().all(|v| *v == want),
        "fill_f16 left other values"
    );
}
