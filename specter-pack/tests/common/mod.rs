//! Helpers of the command-line tests: running the binary, building random-weight checkpoints in
//! every storage dtype, and checking that a failed run left nothing behind.
#![allow(dead_code)]

pub mod cli;
pub mod damage;
// The root crate's std-only helper, shared by every crate's tests.
#[path = "../../../tests/common/files.rs"]
pub mod files;

// Each test binary uses a different subset.
#[allow(unused_imports)]
pub use cli::{assert_clean_failure, assert_no_repeated_clause, run, Run};
#[allow(unused_imports)]
pub use files::entries;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, SafeTensors};
use specter::arch::{self, ArchConfig, TensorSpec};

/// Runs `specter-pack` with `args`.
pub fn pack<S: AsRef<OsStr>>(args: &[S]) -> Run {
    run(env!("CARGO_BIN_EXE_specter-pack"), args)
}

/// Sets `dir`'s modification time far in the past, so that [`assert_untouched`] can tell whether
/// anything was created in it (or created and removed again) since.
pub fn mark_untouched(dir: &Path) -> SystemTime {
    let past = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    std::fs::File::open(dir)
        .unwrap()
        .set_modified(past)
        .unwrap();
    assert_eq!(std::fs::metadata(dir).unwrap().modified().unwrap(), past);
    past
}

/// No entry of `dir` was created or removed since [`mark_untouched`] returned `mark`.
pub fn assert_untouched(dir: &Path, mark: SystemTime) {
    assert_eq!(
        std::fs::metadata(dir).unwrap().modified().unwrap(),
        mark,
        "{} was written to (a file created or removed), though the error is known before writing",
        dir.display()
    );
}

/// A tiny checkpoint's config and tensor map.
pub struct Model {
    pub config_json: String,
    pub cfg: ArchConfig,
    pub specs: Vec<TensorSpec>,
}

impl Model {
    /// The tiny config of `fixture` (see `specter_convert::synth::fixture_config`), edited by
    /// `edit`.
    pub fn fixture_with(fixture: &str, edit: impl FnOnce(&mut serde_json::Value)) -> Model {
        let text = specter_convert::synth::fixture_config(fixture).unwrap();
        let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(&mut value);
        let config_json = serde_json::to_string_pretty(&value).unwrap();
        let cfg = ArchConfig::from_config_json(&config_json).unwrap();
        let specs = arch::expected_tensors(&cfg);
        Model {
            config_json,
            cfg,
            specs,
        }
    }

    pub fn fixture(fixture: &str) -> Model {
        Model::fixture_with(fixture, |_| {})
    }

    /// Writes the checkpoint (FP16 values, random by `seed`) with `specs` in place of the full map.
    pub fn write_specs(&self, dir: &Path, specs: &[TensorSpec], seed: u64, shard_bytes: u64) {
        specter_convert::synth::write_checkpoint(
            dir,
            &self.config_json,
            specs,
            seed,
            shard_bytes,
            0.05,
        )
        .unwrap();
    }

    pub fn write(&self, dir: &Path, seed: u64) {
        self.write_specs(dir, &self.specs, seed, u64::MAX);
    }

    /// The first routed-expert tensor of the last MoE layer with projection `proj`.
    pub fn expert_tensor(&self, proj: arch::Proj) -> &TensorSpec {
        self.specs
            .iter()
            .rev()
            .find(|s| matches!(s.role, arch::TensorRole::RoutedExpert { proj: p, .. } if p == proj))
            .unwrap()
    }
}

/// The safetensors files of a checkpoint directory.
pub fn shard_paths(dir: &Path) -> Vec<PathBuf> {
    entries(dir)
        .into_iter()
        .filter(|n| n.ends_with(".safetensors"))
        .map(|n| dir.join(n))
        .collect()
}

/// One tensor of a safetensors file, as raw little-endian bytes.
pub struct RawTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Every tensor of a safetensors file, in name order.
pub fn read_safetensors(path: &Path) -> BTreeMap<String, RawTensor> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                RawTensor {
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: view.data().to_vec(),
                },
            )
        })
        .collect()
}

/// Writes `tensors` as one safetensors file.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, RawTensor>) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, t)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// How a checkpoint stores its floating-point tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F16,
    Bf16,
    F32,
}

/// Rewrites every shard of the FP16 checkpoint in `dir` in `storage`, with values that are not
/// all exactly representable in f16 (so the conversion's rounding is exercised), and returns every
/// tensor's expected FP16 conversion: `f16::from_f32` of the stored value, which is round to
/// nearest even, the rounding IEEE conversions use.
pub fn restore_as(dir: &Path, storage: Storage, seed: u64) -> BTreeMap<String, Vec<f16>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut expected = BTreeMap::new();
    for path in shard_paths(dir) {
        let mut tensors = read_safetensors(&path);
        for (name, t) in tensors.iter_mut() {
            assert_eq!(t.dtype, Dtype::F16, "synth writes FP16");
            let values: Vec<f32> = t
                .bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            let halves: Vec<f16> = match storage {
                Storage::F16 => values.iter().map(|&v| f16::from_f32(v)).collect(),
                Storage::Bf16 => {
                    // Scaled by a random factor, so the bf16 values fall between f16 steps in the
                    // normal range and are rounded again in the subnormal one.
                    let stored: Vec<bf16> = values
                        .iter()
                        .map(|&v| bf16::from_f32(v * rng.random_range(0.5f32..1.5)))
                        .collect();
                    t.dtype = Dtype::BF16;
                    t.bytes = stored.iter().flat_map(|v| v.to_le_bytes()).collect();
                    stored.iter().map(|v| f16::from_f32(v.to_f32())).collect()
                }
                Storage::F32 => {
                    let stored: Vec<f32> = values
                        .iter()
                        .map(|&v| v * rng.random_range(0.5f32..1.5))
                        .collect();
                    t.dtype = Dtype::F32;
                    t.bytes = stored.iter().flat_map(|v| v.to_le_bytes()).collect();
                    stored.iter().map(|&v| f16::from_f32(v)).collect()
                }
            };
            expected.insert(name.clone(), halves);
        }
        if storage != Storage::F16 {
            write_safetensors(&path, &tensors);
        }
    }
    expected
}

/// The first safetensors file of a checkpoint directory.
pub fn only_shard(dir: &Path) -> PathBuf {
    let shards = shard_paths(dir);
    assert_eq!(shards.len(), 1, "{shards:?}");
    shards[0].clone()
}
