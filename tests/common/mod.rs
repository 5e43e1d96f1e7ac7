//! Shared helpers of the golden tests: fixture loading and comparison; `files`: what a test finds
//! on disk; `gpu`: how the GPU tests open the GPU; `ops`: the GPU op tests' harness; `rows8`:
//! random 8- and 4-bit row-layout experts.
#![allow(dead_code)]

pub mod files;
pub mod gpu;
pub mod ops;
pub mod rows8;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use specter::arch::{draft_tensor_name, expert_tensor_name, ArchConfig, MoeModel, Proj};
use specter::backend::cpu::Cpu;
use specter::decode::{generate, GenerateOutput, Mode};
use specter::model::{LanguageModel, ModelInfo, NoHook};
use specter::offload::{
    ComputeModel, InitialResidency, OffloadSimulator, Policy, ResidencyConfig, SimulatorConfig,
};
use specter::weights::WeightStore;
use specter_convert::checkpoint::Checkpoint;
use specter_convert::pack::{convert, ConvertOptions, Silent};
use specter_format::Bundle;

/// The repository root: where the tests were built, or `$SPECTER_ROOT` when the test binaries
/// were carried to another machine (the GPU checks run that way). The other crates' tests include
/// these helpers too, so the root is the first directory up from the crate that holds the
/// fixtures.
pub fn repo_root() -> PathBuf {
    match std::env::var_os("SPECTER_ROOT") {
        Some(root) if !root.is_empty() => PathBuf::from(root),
        _ => {
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
            manifest
                .ancestors()
                .find(|dir| dir.join("tests/fixtures").is_dir())
                .unwrap_or(manifest)
                .to_path_buf()
        }
    }
}

pub struct Fixture {
    pub name: String,
    pub dir: PathBuf,
    pub cfg: ArchConfig,
    pub golden: Value,
}

impl Fixture {
    pub fn load(name: &str) -> Fixture {
        let dir = repo_root().join("tests/fixtures").join(name);
        let cfg_text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let cfg = ArchConfig::from_config_json(&cfg_text).unwrap();
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        Fixture {
            name: name.to_string(),
            dir,
            cfg,
            golden,
        }
    }

    /// The fixture's checkpoint, through the crate's Hugging Face reader.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint::open(&self.dir).unwrap()
    }

    /// The fixture converted by the real pipeline (default options: RTN INT4 draft, Marlin
    /// tiled) into a bundle in a fresh temporary directory, opened. The directory lasts as long
    /// as the returned guard.
    pub fn bundle(&self) -> (tempfile::TempDir, Bundle) {
        self.bundle_with(&ConvertOptions::default())
    }

    /// As [`Self::bundle`], converted with `opts` (another target precision or draft width).
    pub fn bundle_with(&self, opts: &ConvertOptions) -> (tempfile::TempDir, Bundle) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("model.specter");
        convert(&self.dir, &path, opts, &Silent).expect("convert");
        let bundle = Bundle::open(&path).expect("open bundle");
        (dir, bundle)
    }

    pub fn model(&self) -> MoeModel<Cpu> {
        MoeModel::load(self.cfg.clone(), &self.checkpoint(), Cpu).unwrap()
    }

    fn u32_lists(&self, key: &str) -> Vec<Vec<u32>> {
        self.golden[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                p.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect()
    }

    pub fn prompts(&self) -> Vec<Vec<u32>> {
        self.u32_lists("prompts")
    }

    pub fn greedy(&self) -> Vec<Vec<u32>> {
        self.u32_lists("greedy")
    }

    pub fn top2_gap(&self) -> Vec<Vec<f64>> {
        self.golden["top2_gap"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                p.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_f64().unwrap())
                    .collect()
            })
            .collect()
    }

    /// The reference logits of prompt `logits_prompt` followed by its greedy continuation.
    pub fn logits(&self) -> (usize, Vec<usize>, Vec<f32>) {
        let bytes = std::fs::read(self.dir.join("logits.f32")).unwrap();
        let data: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let shape: Vec<usize> = self.golden["logits_shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let prompt = self.golden["logits_prompt"].as_u64().unwrap() as usize;
        assert_eq!(shape.iter().product::<usize>(), data.len());
        (prompt, shape, data)
    }
}

/// The committed fixtures under tests/fixtures: one for each tiny config synth writes.
pub const FIXTURES: &[&str] = specter_convert::synth::FIXTURE_CONFIGS;

/// Greedy decoding options in `mode`: `max_new_tokens` tokens, drafts of `depth`, no stop at EOS.
pub fn greedy_options(
    mode: specter::decode::Mode,
    max_new_tokens: usize,
    depth: usize,
) -> specter::decode::GenerateOptions {
    specter::decode::GenerateOptions {
        mode,
        max_new_tokens,
        depth,
        sampling: specter::decode::Sampling::greedy(),
        stop_at_eos: false,
    }
}

/// Target-only greedy decoding of `max_new_tokens` after `prompt`: the tokens speculative and
/// offloaded decoding must reproduce.
pub fn target_only<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    max_new_tokens: usize,
) -> GenerateOutput {
    generate(
        model,
        prompt,
        &greedy_options(Mode::Target, max_new_tokens, 1),
        &mut NoHook,
        &mut |_| {},
    )
    .expect("target")
}

/// The fixture tests' offload simulator: `slots` per MoE layer under `policy`, the first experts
/// resident, copies at the default bandwidth and fixed compute times.
pub fn fixture_simulator(info: &ModelInfo, slots: usize, policy: Policy) -> OffloadSimulator {
    OffloadSimulator::new(SimulatorConfig {
        residency: ResidencyConfig::for_model(info, slots, policy),
        initial: InitialResidency::FirstExperts,
        bandwidth_bytes_per_s: specter::generate::DEFAULT_COPY_BANDWIDTH,
        latency_s: 10e-6,
        compute: ComputeModel {
            draft_step_s: 2e-3,
            target_pass_s: 6e-3,
            target_row_s: 0.1e-3,
        },
    })
    .expect("simulator")
}

/// `n` token ids drawn uniformly from a vocabulary of `vocab`.
pub fn random_tokens(rng: &mut ChaCha8Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A fixture's store with some routed experts replaced (FP16, `experts`) and INT4 draft tensors
/// added (`qweights`, `scales`): the tests build stores whose draft equals its target exactly (see
/// [`grid_quantize`]) or is degraded on purpose.
pub struct GridStore {
    pub base: Checkpoint,
    pub experts: std::collections::HashMap<String, Vec<half::f16>>,
    pub qweights: std::collections::HashMap<String, Vec<u32>>,
    pub scales: std::collections::HashMap<String, Vec<half::f16>>,
}

impl specter::weights::WeightStore for GridStore {
    fn contains(&self, name: &str) -> bool {
        self.base.contains(name)
            || self.qweights.contains_key(name)
            || self.scales.contains_key(name)
    }
    fn f16(&self, name: &str) -> specter::Result<specter::weights::Tensor<'_, half::f16>> {
        if let Some(s) = self.scales.get(name) {
            return Ok(specter::weights::Tensor {
                shape: vec![s.len()],
                data: s.as_slice().into(),
            });
        }
        match self.experts.get(name) {
            Some(w) => Ok(specter::weights::Tensor {
                shape: self.base.f16(name)?.shape,
                data: w.as_slice().into(),
            }),
            None => self.base.f16(name),
        }
    }
    fn u32(&self, name: &str) -> specter::Result<specter::weights::Tensor<'_, u32>> {
        let q = self
            .qweights
            .get(name)
            .ok_or_else(|| specter::Error::Model(format!("missing {name}")))?;
        Ok(specter::weights::Tensor {
            shape: vec![q.len()],
            data: q.as_slice().into(),
        })
    }
}

/// What the draft experts of a [`GridStore`] hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DraftExperts {
    /// The target's experts exactly (both on one INT4 grid).
    Exact,
    /// Expert e's draft holds expert e + 1's weights (mod the expert count).
    Shifted,
    /// Weights drawn from noise of the fixture's spread, quantized onto the grid.
    Noise(u64),
}

impl GridStore {
    pub fn new(fx: &Fixture, draft: DraftExperts) -> GridStore {
        let base = fx.checkpoint();
        let (hidden, inter) = fx.cfg.expert_dims();
        let num_experts = fx.cfg.moe.num_experts;
        let mut noise = ChaCha8Rng::seed_from_u64(match draft {
            DraftExperts::Noise(seed) => seed,
            _ => 0,
        });
        let mut noise_like = |len: usize| -> Vec<f32> {
            // Uniform with the fixture weights' spread (standard deviation 0.15).
            let half_width = 0.15 * 3f32.sqrt();
            (0..len)
                .map(|_| noise.random_range(-half_width..half_width))
                .collect()
        };
        let f32s = |name: &str| -> Vec<f32> {
            base.f16(name)
                .unwrap()
                .data
                .iter()
                .map(|v| v.to_f32())
                .collect()
        };
        let mut experts = HashMap::new();
        let mut qweights = HashMap::new();
        let mut scales = HashMap::new();
        for l in fx.cfg.moe_layers() {
            for e in 0..num_experts {
                let [gate, up, down] = [Proj::Gate, Proj::Up, Proj::Down]
                    .map(|p| expert_tensor_name(&fx.cfg, l, e, p));
                let mut gate_up = f32s(&gate);
                gate_up.extend(f32s(&up));
                let down_w = f32s(&down);
                let (gate_up_packed, gate_up_grid) =
                    grid_quantize(&gate, &gate_up, 2 * inter, hidden);
                let (down_packed, down_grid) = grid_quantize(&down, &down_w, hidden, inter);
                experts.insert(gate.clone(), gate_up_grid[..inter * hidden].to_vec());
                experts.insert(up.clone(), gate_up_grid[inter * hidden..].to_vec());
                experts.insert(down.clone(), down_grid);

                let (draft_expert, gate_up_packed, down_packed) = match draft {
                    DraftExperts::Exact => (e, gate_up_packed, down_packed),
                    DraftExperts::Shifted => (
                        (e + num_experts - 1) % num_experts,
                        gate_up_packed,
                        down_packed,
                    ),
                    DraftExperts::Noise(_) => (
                        e,
                        grid_quantize(&gate, &noise_like(gate_up.len()), 2 * inter, hidden).0,
                        grid_quantize(&down, &noise_like(down_w.len()), hidden, inter).0,
                    ),
                };
                for (part, packed) in [("gate_up", gate_up_packed), ("down", down_packed)] {
                    qweights.insert(
                        draft_tensor_name(l, draft_expert, part, "qweight"),
                        packed.qweight,
                    );
                    scales.insert(
                        draft_tensor_name(l, draft_expert, part, "scales"),
                        packed.scales,
                    );
                }
            }
        }
        GridStore {
            base,
            experts,
            qweights,
            scales,
        }
    }
}

/// Quantizes `w` (`[n][k]`) to codes with scale `2^-(5 + (col + group) % 3)`: every grid value is
/// exact in f16, so FP16 experts set to the grid and the dequantized INT4 draft are the same
/// numbers. Returns the packed matrix and the grid values in `[n][k]`.
pub fn grid_quantize(
    name: &str,
    w: &[f32],
    n: usize,
    k: usize,
) -> (specter::quant::MarlinWeight, Vec<half::f16>) {
    use half::f16;
    let group = specter::quant::GROUP_SIZE;
    let scale = |g: usize, col: usize| f16::from_f32((2.0f32).powi(-(5 + ((col + g) % 3) as i32)));
    let scales: Vec<f16> = (0..k / group)
        .flat_map(|g| (0..n).map(move |c| scale(g, c)))
        .collect();
    let mut codes = vec![0u8; k * n];
    let mut grid = vec![f16::ZERO; n * k];
    for col in 0..n {
        for kk in 0..k {
            let s = scale(kk / group, col).to_f32();
            let code = ((w[col * k + kk] / s).round() + 8.0).clamp(0.0, 15.0);
            codes[kk * n + col] = code as u8;
            let value = f16::from_f32((code - 8.0) * s);
            assert_eq!(
                value.to_f32(),
                (code - 8.0) * s,
                "grid value not exact in f16"
            );
            grid[col * k + kk] = value;
        }
    }
    let m = specter::quant::QuantMatrix::new(name, k, n, specter::quant::Bits::FOUR, codes, scales)
        .unwrap();
    (specter::quant::marlin_pack(&m).unwrap(), grid)
}
