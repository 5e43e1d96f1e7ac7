//! Shared helpers of the golden tests: fixture loading and comparison.
#![allow(dead_code)]

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::f16;
use serde_json::Value;
use specter::arch::{ArchConfig, MoeModel};
use specter::backend::cpu::Cpu;
use specter::weights::{Tensor, WeightStore};
use specter::{Error, Result};

/// An in-memory store over a fixture's `model.safetensors` (FP16 tensors).
pub struct SafetensorsStore {
    tensors: HashMap<String, (Vec<usize>, Vec<f16>)>,
}

impl SafetensorsStore {
    pub fn open(path: &Path) -> SafetensorsStore {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::F16, "{name}");
            let data: Vec<f16> = view
                .data()
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect();
            tensors.insert(name.to_string(), (view.shape().to_vec(), data));
        }
        SafetensorsStore { tensors }
    }
}

impl WeightStore for SafetensorsStore {
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    fn f16(&self, name: &str) -> Result<Tensor<'_, f16>> {
        let (shape, data) = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::Model(format!("missing tensor {name}")))?;
        Ok(Tensor {
            shape: shape.clone(),
            data: Cow::Borrowed(data),
        })
    }
    fn u32(&self, name: &str) -> Result<Tensor<'_, u32>> {
        Err(Error::Model(format!("no u32 tensor {name}")))
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
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
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

    pub fn model(&self) -> MoeModel<Cpu> {
        let store = SafetensorsStore::open(&self.dir.join("model.safetensors"));
        MoeModel::load(self.cfg.clone(), &store, Cpu).unwrap()
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

pub const FIXTURES: &[&str] = &[
    "deepseek_v2",
    "deepseek_v2_qlora",
    "qwen2_moe",
    "phimoe",
    "mixtral",
    "olmoe",
    "qwen3_moe",
];

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
