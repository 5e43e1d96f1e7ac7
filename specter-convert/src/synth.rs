//! Random-weight Hugging Face checkpoints: the benchmark models of the real shapes (no hub is
//! reachable, and random weights are what the measurements use) and tiny fixtures for tests.
//!
//! [`write_checkpoint`] streams one tensor at a time into FP16 safetensors shards, so a 31 GB model
//! never needs more memory than one bounded batch of one tensor. Values depend only on the seed and
//! the tensor's name (and position within it), not on sharding or thread count.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use half::f16;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::{json, Value};
use specter::arch::TensorSpec;

use crate::{Error, Result};

/// Elements generated per parallel work item: one RNG stream each.
const CHUNK: usize = 1 << 16;
/// Elements held in memory at once while streaming a tensor (64 MiB of f16).
const BATCH: usize = 1 << 25;

fn invalid(msg: impl Into<String>) -> Error {
    Error::Model(msg.into())
}

/// Writes a random-weight checkpoint into `dir` (created if needed): `config.json` (verbatim),
/// `tokenizer.json` (byte-level, fitting the config's `vocab_size`) and the tensors as FP16
/// safetensors, split into shards of at most `shard_bytes` of tensor data (a larger tensor gets a
/// shard of its own). One shard is written as `model.safetensors`; several as
/// `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`.
///
/// Matrices and biases are uniform with standard deviation `std` and mean 0 (the distribution
/// `torch.nn.Linear` initializes with); normalization weights (names containing `norm`) are
/// `1 + noise` of that spread so that they scale like trained ones.
pub fn write_checkpoint(
    dir: &Path,
    config_json: &str,
    tensors: &[TensorSpec],
    seed: u64,
    shard_bytes: u64,
    std: f32,
) -> Result<()> {
    if !std.is_finite() || std < 0.0 {
        return Err(invalid(format!(
            "synth: std must be finite and >= 0, got {std}"
        )));
    }
    if shard_bytes == 0 {
        return Err(invalid("synth: shard_bytes must be positive"));
    }
    if tensors.is_empty() {
        return Err(invalid("synth: no tensors to write"));
    }
    let config: Value = serde_json::from_str(config_json)
        .map_err(|e| invalid(format!("synth: config.json is not valid JSON: {e}")))?;
    let mut seen = std::collections::HashSet::new();
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(invalid(format!("synth: tensor {} listed twice", t.name)));
        }
        let bytes = t
            .shape
            .iter()
            .try_fold(2u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| {
                invalid(format!(
                    "synth: tensor {} shape {:?} overflows",
                    t.name, t.shape
                ))
            })?;
        if bytes == 0 {
            return Err(invalid(format!(
                "synth: tensor {} has an empty shape {:?}",
                t.name, t.shape
            )));
        }
        sizes.push(bytes);
    }
    let tokenizer = byte_level_tokenizer_json(&config)?;

    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    write_file(&dir.join("config.json"), config_json.as_bytes())?;
    write_file(&dir.join("tokenizer.json"), tokenizer.as_bytes())?;

    // Consecutive tensors fill a shard until the next one would overflow it.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut filled = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        let current = shards.len() - 1;
        if !shards[current].is_empty() && filled + size > shard_bytes {
            shards.push(Vec::new());
            filled = 0;
        }
        let current = shards.len() - 1;
        shards[current].push(i);
        filled += size;
    }
    let n = shards.len();
    let names: Vec<String> = if n == 1 {
        vec!["model.safetensors".to_string()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    };
    // A checkpoint of a different shard count may already be there; its leftovers would be read.
    remove_stale(dir, &names)?;

    let levels = Levels::new(std);
    let mut weight_map = serde_json::Map::new();
    for (members, file_name) in shards.iter().zip(&names) {
        write_shard(
            &dir.join(file_name),
            members.iter().map(|&i| &tensors[i]),
            seed,
            &levels,
        )?;
        for &i in members {
            weight_map.insert(tensors[i].name.clone(), Value::from(file_name.as_str()));
        }
    }
    if n > 1 {
        let total: u64 = sizes.iter().sum();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| invalid(format!("synth: serializing the index: {e}")))?;
        write_file(&dir.join(crate::checkpoint::INDEX_FILE), text.as_bytes())?;
    }
    Ok(())
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

fn remove_stale(dir: &Path, keep: &[String]) -> Result<()> {
    let listing =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    for item in listing {
        let item = item.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        let name = item.file_name().to_string_lossy().into_owned();
        let stale_shard = name.ends_with(".safetensors") && !keep.contains(&name);
        let stale_index = name == crate::checkpoint::INDEX_FILE && keep.len() == 1;
        if stale_shard || stale_index {
            std::fs::remove_file(item.path())
                .map_err(|e| Error::io(format!("removing {}", item.path().display()), e))?;
        }
    }
    Ok(())
}

/// Writes one safetensors file: the JSON header (offsets in listing order, padded to 8 bytes),
/// then each tensor's data, generated batch by batch.
fn write_shard<'a>(
    path: &Path,
    members: impl Iterator<Item = &'a TensorSpec> + Clone,
    seed: u64,
    levels: &Levels,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for t in members.clone() {
        let len = 2 * t.shape.iter().map(|&d| d as u64).product::<u64>();
        header.insert(
            t.name.clone(),
            json!({"dtype": "F16", "shape": t.shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut header_bytes = serde_json::to_vec(&Value::Object(header))
        .map_err(|e| invalid(format!("synth: serializing a header: {e}")))?;
    while !header_bytes.len().is_multiple_of(8) {
        header_bytes.push(b' ');
    }
    let io_err = |e| Error::io(format!("writing {}", path.display()), e);
    let file = File::create(path).map_err(io_err)?;
    let mut out = BufWriter::with_capacity(1 << 22, file);
    out.write_all(&(header_bytes.len() as u64).to_le_bytes())
        .map_err(io_err)?;
    out.write_all(&header_bytes).map_err(io_err)?;
    let mut batch: Vec<f16> = Vec::new();
    let mut bytes: Vec<u8> = Vec::new();
    for t in members {
        let numel: usize = t.shape.iter().product();
        let kind = ValueKind::of(&t.name);
        let stream = seed ^ fnv1a(t.name.as_bytes());
        let mut start = 0;
        while start < numel {
            let len = BATCH.min(numel - start);
            batch.resize(len, f16::ZERO);
            fill_batch(&mut batch, start, stream, levels.table(kind));
            out.write_all(as_le_bytes(&batch, &mut bytes))
                .map_err(io_err)?;
            start += len;
        }
    }
    out.flush().map_err(io_err)?;
    Ok(())
}

/// The little-endian bytes of `values` (a view on little-endian hosts, else converted into `buf`).
fn as_le_bytes<'a>(values: &'a [f16], buf: &'a mut Vec<u8>) -> &'a [u8] {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice(values)
    } else {
        buf.clear();
        buf.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        buf
    }
}

#[derive(Clone, Copy)]
enum ValueKind {
    /// Centered on zero: matrices, embeddings, biases.
    Centered,
    /// Centered on one: normalization scales.
    NormScale,
}

impl ValueKind {
    fn of(name: &str) -> Self {
        let last = name.rsplit('.').nth(1).unwrap_or("");
        if last.contains("norm") && name.ends_with(".weight") {
            ValueKind::NormScale
        } else {
            ValueKind::Centered
        }
    }
}

/// The values a tensor's elements are drawn from: 65536 evenly spaced quantiles of the uniform
/// distribution, already in f16, so that each element costs 16 random bits and a table lookup
/// (finer than f16's own spacing over most of the range).
struct Levels {
    centered: Vec<f16>,
    norm_scale: Vec<f16>,
}

impl Levels {
    fn new(std: f32) -> Self {
        // Uniform on [-a, a] has standard deviation a / sqrt(3).
        let half_width = std * 3f32.sqrt();
        let table = |center: f32| -> Vec<f16> {
            (0..1u32 << 16)
                .map(|k| {
                    let u = (2 * k + 1) as f32 / 65536.0 - 1.0;
                    f16::from_f32(center + half_width * u)
                })
                .collect()
        };
        Levels {
            centered: table(0.0),
            norm_scale: table(1.0),
        }
    }

    fn table(&self, kind: ValueKind) -> &[f16] {
        match kind {
            ValueKind::Centered => &self.centered,
            ValueKind::NormScale => &self.norm_scale,
        }
    }
}

/// Fills `batch` (elements `first..first + batch.len()` of a tensor) in parallel; each CHUNK of
/// the tensor has its own RNG stream, so values do not depend on batching or threads.
fn fill_batch(batch: &mut [f16], first: usize, stream: u64, table: &[f16]) {
    debug_assert!(first.is_multiple_of(CHUNK) && BATCH.is_multiple_of(CHUNK));
    debug_assert_eq!(table.len(), 1 << 16);
    batch
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let chunk_index = (first / CHUNK + i) as u64;
            let mut rng = ChaCha8Rng::seed_from_u64(stream);
            rng.set_stream(chunk_index);
            for group in chunk.chunks_mut(4) {
                let bits = rng.next_u64();
                for (j, v) in group.iter_mut().enumerate() {
                    *v = table[((bits >> (16 * j)) & 0xffff) as usize];
                }
            }
        });
}

/// FNV-1a, to derive a tensor's RNG stream from its name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// GPT-2's byte-to-character table: printable bytes map to themselves, the rest to code points from
/// 256 up, so every byte has a visible, distinct character.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b as u32, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        // Both ranges are valid scalar values (below the surrogates).
        *slot = char::from_u32(code).unwrap_or('\u{fffd}');
    }
    table
}

/// Special token ids the config names (`bos_token_id`, `eos_token_id` (one or a list), `pad_token_id`).
fn special_ids(config: &Value) -> BTreeMap<u64, &'static str> {
    let mut out = BTreeMap::new();
    let mut add = |v: Option<&Value>, name: &'static str| match v {
        Some(Value::Number(n)) => {
            if let Some(id) = n.as_u64() {
                out.entry(id).or_insert(name);
            }
        }
        Some(Value::Array(a)) => {
            for id in a.iter().filter_map(|x| x.as_u64()) {
                out.entry(id).or_insert(name);
            }
        }
        _ => {}
    };
    add(config.get("bos_token_id"), "<s>");
    add(config.get("eos_token_id"), "</s>");
    add(config.get("pad_token_id"), "<pad>");
    out
}

/// A byte-level BPE tokenizer (no merges: every byte is a token) as `tokenizer.json` text. Special
/// tokens sit at the ids config.json gives them; the 256 byte tokens fill the lowest free ids.
fn byte_level_tokenizer_json(config: &Value) -> Result<String> {
    let vocab_size = config
        .get("vocab_size")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| invalid("synth: config.json has no integer vocab_size"))?;
    let specials = special_ids(config);
    let mut seen_names = std::collections::HashSet::new();
    let mut added = Vec::new();
    let mut vocab = serde_json::Map::new();
    for (&id, &base) in &specials {
        if id >= vocab_size {
            return Err(invalid(format!(
                "synth: special token id {id} is outside vocab_size {vocab_size}"
            )));
        }
        // Several roles may share a name (eos given as a list); keep contents distinct.
        let content = if seen_names.insert(base) {
            base.to_string()
        } else {
            format!("<|special_{id}|>")
        };
        vocab.insert(content.clone(), json!(id));
        added.push(
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let needed = 256 + specials.len() as u64;
    if vocab_size < needed {
        return Err(invalid(format!(
            "synth: vocab_size {vocab_size} cannot hold 256 byte tokens and {} special tokens",
            specials.len()
        )));
    }
    let mut id = 0u64;
    for ch in byte_chars() {
        while specials.contains_key(&id) {
            id += 1;
        }
        vocab.insert(ch.to_string(), json!(id));
        id += 1;
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": []
        }
    });
    serde_json::to_string(&tokenizer)
        .map_err(|e| invalid(format!("synth: serializing tokenizer.json: {e}")))
}

/// Names of the built-in presets: the benchmark models' real hyper-parameters.
pub const PRESETS: &[&str] = &["deepseek-v2-lite", "qwen1.5-moe-a2.7b", "phi-3.5-moe"];

/// config.json text of a benchmark model (see [`PRESETS`]), as published with the model.
pub fn preset_config(name: &str) -> Result<String> {
    preset_config_layers(name, None)
}

/// [`preset_config`] with `num_hidden_layers` replaced by `layers` when given (a shallower model of
/// the real widths).
pub fn preset_config_layers(name: &str, layers: Option<usize>) -> Result<String> {
    let mut config = match name {
        "deepseek-v2-lite" => json!({
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": 102400,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_shared_experts": 2,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "scoring_func": "softmax",
            "norm_topk_prob": false,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": null,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707
            },
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": 100000,
            "eos_token_id": 100001,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        "qwen1.5-moe-a2.7b" => json!({
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "norm_topk_prob": false,
            "decoder_sparse_step": 1,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "max_window_layers": 21,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "use_sliding_window": false,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        "phi-3.5-moe" => {
            // 64 rotary frequencies (head_dim 128). The published model's LongRoPE factors are
            // fitted numbers; these smooth ramps of similar range stand in for them (random
            // weights make the exact values immaterial; prompts here stay far below 4096 tokens,
            // where only short_factor applies).
            let short: Vec<f64> = (0..64)
                .map(|i| round4(1.0 + 1.5 * (i as f64 / 63.0).powi(2)))
                .collect();
            let long: Vec<f64> = (0..64)
                .map(|i| round4(1.0 + 63.0 * (i as f64 / 63.0).powi(3)))
                .collect();
            json!({
                "architectures": ["PhiMoEForCausalLM"],
                "model_type": "phimoe",
                "vocab_size": 32064,
                "hidden_size": 4096,
                "intermediate_size": 6400,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "num_local_experts": 16,
                "num_experts_per_tok": 2,
                "hidden_act": "silu",
                "max_position_embeddings": 131072,
                "original_max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "rope_scaling": {
                    "type": "longrope",
                    "short_factor": short,
                    "long_factor": long,
                    "short_mscale": 1.243163121016122,
                    "long_mscale": 1.243163121016122,
                    "original_max_position_embeddings": 4096
                },
                "sliding_window": 131072,
                "attention_bias": true,
                "lm_head_bias": true,
                "attention_dropout": 0.0,
                "hidden_dropout": 0.0,
                "router_jitter_noise": 0.01,
                "input_jitter_noise": 0.01,
                "router_aux_loss_coef": 0.0,
                "bos_token_id": 1,
                "eos_token_id": 32000,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "use_cache": true
            })
        }
        other => {
            return Err(invalid(format!(
                "unknown preset {other:?}; presets: {}",
                PRESETS.join(", ")
            )))
        }
    };
    if let Some(layers) = layers {
        if layers == 0 {
            return Err(invalid("preset layer count must be at least 1"));
        }
        config["num_hidden_layers"] = json!(layers);
    }
    to_text(&config)
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn to_text(config: &Value) -> Result<String> {
    serde_json::to_string_pretty(config)
        .map_err(|e| invalid(format!("serializing config.json: {e}")))
}

/// Names accepted by [`fixture_config`]: the six `model_type`s plus `deepseek_v2_qlora`.
pub const FIXTURE_CONFIGS: &[&str] = &[
    "deepseek_v2",
    "deepseek_v2_qlora",
    "qwen2_moe",
    "phimoe",
    "mixtral",
    "olmoe",
    "qwen3_moe",
];

/// A tiny config.json for an architecture, with the hyper-parameters of the committed fixture of
/// the same name (tests/fixtures/make_golden.py): hidden 128, 2-3 layers, 4-8 experts of width 128,
/// vocabulary 512. Every width the INT4 draft tiles is a multiple of 128.
pub fn fixture_config(model_type: &str) -> Result<String> {
    let common = json!({
        "vocab_size": 512,
        "hidden_size": 128,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
    });
    let default_rope = |theta: f64| json!({"rope_type": "default", "rope_theta": theta});
    let specific = match model_type {
        "deepseek_v2" | "deepseek_v2_qlora" => {
            let qlora = model_type == "deepseek_v2_qlora";
            json!({
                "architectures": ["DeepseekV2ForCausalLM"],
                "model_type": "deepseek_v2",
                "max_position_embeddings": 163840,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "intermediate_size": 256,
                "moe_intermediate_size": 128,
                "n_routed_experts": 8,
                "n_shared_experts": 2,
                "num_experts_per_tok": if qlora { 2 } else { 3 },
                "norm_topk_prob": qlora,
                "q_lora_rank": if qlora { json!(96) } else { Value::Null },
                "first_k_dense_replace": 1,
                "kv_lora_rank": 64,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16,
                "v_head_dim": 32,
                "routed_scaling_factor": 1.5,
                "topk_method": "greedy",
                "n_group": 1,
                "topk_group": 1,
                "rms_norm_eps": 1e-6,
                "attention_bias": false,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 40.0,
                    "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 0.707,
                    "mscale_all_dim": 0.707
                }
            })
        }
        "qwen2_moe" => json!({
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 256,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": false,
            "qkv_bias": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
            "rms_norm_eps": 1e-6,
            "rope_parameters": default_rope(1_000_000.0)
        }),
        "phimoe" => {
            let short: Vec<f64> = (0..16).map(|i| round4(1.0 + 0.05 * i as f64)).collect();
            let long: Vec<f64> = (0..16).map(|i| round4(1.0 + 0.5 * i as f64)).collect();
            json!({
                "architectures": ["PhimoeForCausalLM"],
                "model_type": "phimoe",
                "max_position_embeddings": 131072,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "attention_bias": true,
                "lm_head_bias": true,
                "router_jitter_noise": 0.01,
                "input_jitter_noise": 0.01,
                "rms_norm_eps": 1e-5,
                "sliding_window": null,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": short,
                    "long_factor": long,
                    "short_mscale": 1.243163121016122,
                    "long_mscale": 1.243163121016122,
                    "original_max_position_embeddings": 4096
                }
            })
        }
        "mixtral" => json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-5,
            "sliding_window": null,
            "rope_parameters": default_rope(1_000_000.0)
        }),
        "olmoe" => json!({
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": false,
            "clip_qkv": null,
            "rms_norm_eps": 1e-5,
            "rope_parameters": default_rope(10_000.0)
        }),
        "qwen3_moe" => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
            "rms_norm_eps": 1e-6,
            "rope_parameters": default_rope(1_000_000.0)
        }),
        other => {
            return Err(invalid(format!(
                "no fixture config for {other:?}; known: {}",
                FIXTURE_CONFIGS.join(", ")
            )))
        }
    };
    let mut config = common;
    if let (Some(base), Value::Object(extra)) = (config.as_object_mut(), specific) {
        base.extend(extra);
    }
    to_text(&config)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streaming a tensor in batches must give the values of generating it whole.
    #[test]
    fn values_do_not_depend_on_batching() {
        let stream = fnv1a(b"model.layers.0.mlp.experts.0.gate_proj.weight") ^ 77;
        let mut whole = vec![f16::ZERO; 3 * CHUNK + 123];
        let levels = Levels::new(0.1);
        let table = levels.table(ValueKind::Centered);
        fill_batch(&mut whole, 0, stream, table);
        let (head, tail) = whole.split_at(2 * CHUNK);
        let mut first = vec![f16::ZERO; head.len()];
        let mut second = vec![f16::ZERO; tail.len()];
        fill_batch(&mut first, 0, stream, table);
        fill_batch(&mut second, 2 * CHUNK, stream, table);
        assert_eq!(first, head);
        assert_eq!(second, tail);
        // Chunks are distinct streams, not copies of one another.
        assert_ne!(&whole[..CHUNK], &whole[CHUNK..2 * CHUNK]);
    }

    #[test]
    fn norm_weights_are_recognized_by_name() {
        for name in [
            "model.norm.weight",
            "model.layers.3.input_layernorm.weight",
            "model.layers.3.self_attn.kv_a_layernorm.weight",
            "model.layers.3.self_attn.q_norm.weight",
        ] {
            assert!(
                matches!(ValueKind::of(name), ValueKind::NormScale),
                "{name}"
            );
        }
        for name in [
            "model.layers.3.input_layernorm.bias",
            "model.layers.3.mlp.gate.weight",
            "model.embed_tokens.weight",
        ] {
            assert!(matches!(ValueKind::of(name), ValueKind::Centered), "{name}");
        }
    }
}
