//! End to end over the reader: every fixture, read through `Checkpoint`, runs on the CPU
//! reference and reproduces the goldens transformers recorded.

use std::path::Path;

use specter::arch::{ArchConfig, MoeModel};
use specter::backend::cpu::Cpu;
use specter::checkpoint::Checkpoint;
use specter::model::{LanguageModel, NoHook, Variant};

const FIXTURES: &[&str] = &[
    "deepseek_v2",
    "deepseek_v2_qlora",
    "qwen2_moe",
    "phimoe",
    "mixtral",
    "olmoe",
    "qwen3_moe",
];

fn ids(v: &serde_json::Value) -> Vec<Vec<u32>> {
    v.as_array()
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

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn fixtures_read_through_the_checkpoint_reproduce_their_goldens() {
    for name in FIXTURES {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        let ck = Checkpoint::open(&dir).unwrap();
        let cfg = ArchConfig::from_config_json(ck.config_json()).unwrap();
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let model = MoeModel::load(cfg, &ck, Cpu).unwrap();
        let vocab = model.info().vocab_size;
        let prompts = ids(&golden["prompts"]);
        let greedy = ids(&golden["greedy"]);

        // Teacher-forced logits of the first prompt's full sequence against transformers'.
        let bytes = std::fs::read(dir.join("logits.f32")).unwrap();
        let reference: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let seq: Vec<u32> = prompts[0].iter().chain(&greedy[0]).copied().collect();
        let mut kv = model.new_kv(seq.len()).unwrap();
        let logits = model
            .forward(Variant::Target, &seq, &mut kv, &mut NoHook)
            .unwrap();
        assert_eq!(logits.len(), reference.len(), "{name}");
        let max_diff = logits
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{name}: max logit difference {max_diff}");
        assert!(max_diff < 5e-4, "{name}: logits differ by up to {max_diff}");

        // Greedy decoding with the cache, token by token.
        for (prompt, want) in prompts.iter().zip(&greedy) {
            let mut kv = model.new_kv(prompt.len() + want.len()).unwrap();
            let mut last = model
                .forward(Variant::Target, prompt, &mut kv, &mut NoHook)
                .unwrap();
            let mut got = Vec::new();
            for _ in 0..want.len() {
                let row = &last[last.len() - vocab..];
                let next = argmax(row);
                got.push(next);
                last = model
                    .forward(Variant::Target, &[next], &mut kv, &mut NoHook)
                    .unwrap();
            }
            assert_eq!(&got, want, "{name}");
        }
    }
}
