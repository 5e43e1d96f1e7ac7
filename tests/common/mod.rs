//! Shared helpers of the golden tests: fixture loading and comparison.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;
use specter::arch::{ArchConfig, MoeModel};
use specter::backend::cpu::Cpu;
use specter::checkpoint::Checkpoint;

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

    /// The fixture's checkpoint, through the crate's Hugging Face reader.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint::open(&self.dir).unwrap()
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
