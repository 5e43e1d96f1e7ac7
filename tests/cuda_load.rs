//! The batched load path on the GPU: every way of reading the bundle (`read`, `mmap`, `direct`)
//! gives exactly the weights of the unbatched per-tensor upload, checked by greedy tokens of the
//! target and of the INT4 draft on every fixture model.
//!
//! Needs an NVIDIA GPU, so ignored by default (see tests/common/gpu.rs); `scripts/gpu-check.sh run
//! fixtures` runs it there with `--ignored`.

mod common;

use std::sync::Arc;

use common::{Fixture, FIXTURES};
use specter::arch::MoeModel;
use specter::backend::cuda::{CudaBackend, CudaOptions, LoadIo};
use specter::decode::{generate, GenerateOptions, Mode, Sampling};
use specter::model::NoHook;

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_every_load_io_gives_the_per_tensor_weights() {
    let device = Arc::new(common::gpu::device());
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let (_dir, bundle) = fixture.bundle();
        let tokens = |io: LoadIo| {
            let mut backend =
                CudaBackend::with_device(device.clone(), None, &CudaOptions::default())
                    .expect("backend");
            backend.set_load_io(io);
            let model = MoeModel::load(fixture.cfg.clone(), &bundle, backend).expect("load");
            let report = model.backend().load_report().unwrap();
            assert_eq!(report.is_some(), io != LoadIo::PerTensor, "{name} {io:?}");
            let mut out = Vec::new();
            for mode in [Mode::Target, Mode::Draft] {
                for prompt in fixture.prompts().iter().take(2) {
                    let opts = GenerateOptions {
                        mode,
                        max_new_tokens: 8,
                        depth: 1,
                        sampling: Sampling::greedy(),
                        stop_at_eos: false,
                    };
                    let g = generate(&model, prompt, &opts, &mut NoHook, &mut |_| {});
                    out.push(g.expect("generate").tokens);
                }
            }
            out
        };
        let want = tokens(LoadIo::PerTensor);
        for io in [LoadIo::Read, LoadIo::Mmap, LoadIo::Direct] {
            assert_eq!(tokens(io), want, "{name}: {io:?} loads other weights");
        }
        eprintln!("{name}: read, mmap and direct loads equal the per-tensor upload");
    }
}
