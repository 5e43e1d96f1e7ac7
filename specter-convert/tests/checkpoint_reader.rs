//! The checkpoint reader over the committed fixtures and over hand-built (sharded, fused, broken)
//! checkpoints.

// The root crate's test helpers: fixtures, found from the repository root.
#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use sha2::{Digest, Sha256};
use specter::weights::WeightStore;
use specter_convert::checkpoint::Checkpoint;

use common::FIXTURES;

fn fixture(name: &str) -> PathBuf {
    common::repo_root().join("tests/fixtures").join(name)
}

/// A tensor to write: dtype, shape, little-endian bytes.
type Raw = (Dtype, Vec<usize>, Vec<u8>);

fn write_safetensors(path: &Path, tensors: &BTreeMap<String, Raw>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn f16_bytes(v: &[f16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Every tensor of a checkpoint as FP16 raw entries.
fn all_tensors(ck: &Checkpoint) -> BTreeMap<String, Raw> {
    ck.tensor_names()
        .into_iter()
        .map(|n| {
            let t = ck.f16(&n).unwrap();
            (n, (Dtype::F16, t.shape.clone(), f16_bytes(&t.data)))
        })
        .collect()
}

fn dir_with_config(model_type: &str, hidden: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        format!("{{\"model_type\": \"{model_type}\", \"hidden_size\": {hidden}}}"),
    )
    .unwrap();
    dir
}

fn f16_err(ck: &Checkpoint, name: &str) -> String {
    match ck.f16(name) {
        Ok(_) => panic!("reading {name} should fail"),
        Err(e) => e.to_string(),
    }
}

fn random_f16(rng: &mut ChaCha8Rng, n: usize) -> Vec<f16> {
    (0..n)
        .map(|_| f16::from_f32(rng.random_range(-2.0f32..2.0)))
        .collect()
}

#[test]
fn every_fixture_opens_and_reads() {
    for name in FIXTURES {
        let dir = fixture(name);
        let ck = Checkpoint::open(&dir).unwrap();
        let config: serde_json::Value = serde_json::from_str(ck.config_json()).unwrap();
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        assert_eq!(config["model_type"], golden["model_type"], "{name}");
        assert!(ck.tokenizer_json().is_some(), "{name}: tokenizer.json");
        let vocab = config["vocab_size"].as_u64().unwrap() as usize;
        let hidden = config["hidden_size"].as_u64().unwrap() as usize;
        assert_eq!(
            ck.shape("model.embed_tokens.weight").unwrap(),
            vec![vocab, hidden],
            "{name}"
        );
        assert_eq!(
            ck.shape("lm_head.weight").unwrap(),
            vec![vocab, hidden],
            "{name}"
        );
        for t in ck.tensor_names() {
            let tensor = ck.f16(&t).unwrap();
            assert_eq!(
                tensor.data.len(),
                tensor.shape.iter().product::<usize>(),
                "{name} {t}"
            );
            assert!(
                tensor.data.iter().any(|v| v.to_f32() != 0.0),
                "{name} {t} is all zeros"
            );
        }
        let files = ck.source_files().unwrap();
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            ["config.json", "tokenizer.json", "model.safetensors"],
            "{name}"
        );
        for f in &files {
            let bytes = std::fs::read(dir.join(&f.name)).unwrap();
            assert_eq!(f.length, bytes.len() as u64);
            assert_eq!(
                f.sha256,
                <[u8; 32]>::from(Sha256::digest(&bytes)),
                "{name} {}",
                f.name
            );
        }
    }
}

#[test]
fn fixtures_hold_per_expert_names() {
    let ck = Checkpoint::open(&fixture("mixtral")).unwrap();
    assert!(ck.contains("model.layers.1.block_sparse_moe.experts.7.w3.weight"));
    assert!(ck.contains("model.layers.0.block_sparse_moe.gate.weight"));
    let ck = Checkpoint::open(&fixture("qwen2_moe")).unwrap();
    assert_eq!(
        ck.shape("model.layers.0.mlp.experts.3.down_proj.weight")
            .unwrap(),
        vec![128, 128]
    );
    assert!(ck.contains("model.layers.0.mlp.shared_expert_gate.weight"));
}

#[test]
fn missing_config_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn no_weights_is_an_error() {
    let dir = dir_with_config("mixtral", 128);
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("safetensors"), "{err}");
}

/// Splits the mixtral fixture into three shards with an index; every tensor must read the same.
#[test]
fn sharded_with_index_reads_like_single_file() {
    let single = Checkpoint::open(&fixture("mixtral")).unwrap();
    let tensors = all_tensors(&single);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("mixtral").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let mut shards: Vec<BTreeMap<String, Raw>> = vec![BTreeMap::new(); 3];
    let mut weight_map = serde_json::Map::new();
    for (i, (name, raw)) in tensors.iter().enumerate() {
        let shard = i % 3;
        shards[shard].insert(name.clone(), raw.clone());
        weight_map.insert(
            name.clone(),
            format!("model-0000{}-of-00003.safetensors", shard + 1).into(),
        );
    }
    for (i, shard) in shards.iter().enumerate() {
        write_safetensors(
            &dir.path()
                .join(format!("model-0000{}-of-00003.safetensors", i + 1)),
            shard,
        );
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let sharded = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(sharded.tensor_names(), single.tensor_names());
    assert!(sharded.tokenizer_json().is_none());
    for name in single.tensor_names() {
        assert_eq!(
            sharded.f16(&name).unwrap().data,
            single.f16(&name).unwrap().data,
            "{name}"
        );
    }
    let files: Vec<String> = sharded
        .source_files()
        .unwrap()
        .into_iter()
        .map(|f| f.name)
        .collect();
    assert_eq!(
        files,
        [
            "config.json",
            "model.safetensors.index.json",
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors"
        ]
    );

    // A shard the index names but the directory lacks.
    std::fs::remove_file(dir.path().join("model-00002-of-00003.safetensors")).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model-00002-of-00003.safetensors"), "{err}");
}

#[test]
fn index_naming_a_tensor_its_shard_lacks_is_an_error() {
    let dir = dir_with_config("mixtral", 128);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut t = BTreeMap::new();
    t.insert(
        "a".to_string(),
        (Dtype::F16, vec![4], f16_bytes(&random_f16(&mut rng, 4))),
    );
    write_safetensors(&dir.path().join("model-00001-of-00001.safetensors"), &t);
    let index = serde_json::json!({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains(" b ") && err.contains("model-00001-of-00001.safetensors"),
        "{err}"
    );
}

#[test]
fn duplicate_tensor_across_shards_is_an_error() {
    let dir = dir_with_config("mixtral", 128);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let mut t = BTreeMap::new();
    t.insert(
        "x".to_string(),
        (Dtype::F16, vec![4], f16_bytes(&random_f16(&mut rng, 4))),
    );
    write_safetensors(&dir.path().join("a.safetensors"), &t);
    write_safetensors(&dir.path().join("b.safetensors"), &t);
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("a.safetensors") && err.contains("b.safetensors"),
        "{err}"
    );
}

#[test]
fn truncated_and_corrupt_files_are_named() {
    let bytes = std::fs::read(fixture("olmoe").join("model.safetensors")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("olmoe").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let path = dir.path().join("model.safetensors");

    // Truncated data section.
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");

    // Shorter than the 8-byte length prefix.
    std::fs::write(&path, &bytes[..5]).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");

    // Header length pointing past the end of the file.
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");

    // Garbage inside the JSON header.
    let mut corrupt = bytes.clone();
    for b in &mut corrupt[8..40] {
        *b = b'#';
    }
    std::fs::write(&path, &corrupt).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");

    // Empty file.
    std::fs::write(&path, b"").unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn invalid_config_json_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn bf16_and_f32_convert_and_out_of_range_values_fail() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let values: Vec<f32> = (0..257)
        .map(|_| rng.random_range(-60000.0f32..60000.0))
        .collect();
    let dir = dir_with_config("mixtral", 128);
    let mut t = BTreeMap::new();
    t.insert(
        "as_f32".to_string(),
        (
            Dtype::F32,
            vec![257],
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    );
    t.insert(
        "as_bf16".to_string(),
        (
            Dtype::BF16,
            vec![257],
            values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
    );
    let mut too_big = values.clone();
    too_big[100] = 70000.0;
    t.insert(
        "too_big".to_string(),
        (
            Dtype::F32,
            vec![257],
            too_big.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    );
    let mut nan = values.clone();
    nan[3] = f32::NAN;
    t.insert(
        "has_nan".to_string(),
        (
            Dtype::BF16,
            vec![257],
            nan.iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
    );
    let mut inf16 = random_f16(&mut rng, 16);
    inf16[9] = f16::INFINITY;
    t.insert(
        "has_inf".to_string(),
        (Dtype::F16, vec![16], f16_bytes(&inf16)),
    );
    t.insert("ints".to_string(), (Dtype::I64, vec![2], vec![1u8; 16]));
    write_safetensors(&dir.path().join("model.safetensors"), &t);
    let ck = Checkpoint::open(dir.path()).unwrap();

    let f = ck.f16("as_f32").unwrap();
    for (got, want) in f.data.iter().zip(&values) {
        assert_eq!(*got, f16::from_f32(*want));
    }
    let b = ck.f16("as_bf16").unwrap();
    for (got, want) in b.data.iter().zip(&values) {
        assert_eq!(*got, f16::from_f32(bf16::from_f32(*want).to_f32()));
    }
    for (name, needle) in [
        ("too_big", "70000"),
        ("has_nan", "NaN"),
        ("has_inf", "inf"),
        ("ints", "I64"),
    ] {
        let err = f16_err(&ck, name);
        assert!(err.contains(name) && err.contains(needle), "{err}");
    }
    let err = f16_err(&ck, "absent");
    assert!(err.contains("absent"), "{err}");
    assert!(ck.u32("as_f32").is_err());
}

#[test]
fn u32_reads_u32_and_i32() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let words: Vec<u32> = (0..64).map(|_| rng.random()).collect();
    let dir = dir_with_config("mixtral", 128);
    let mut t = BTreeMap::new();
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    t.insert(
        "packed_u".to_string(),
        (Dtype::U32, vec![8, 8], bytes.clone()),
    );
    t.insert("packed_i".to_string(), (Dtype::I32, vec![64], bytes));
    // A 1-byte tensor first so the next tensor's data is misaligned in the file.
    t.insert("a_pad".to_string(), (Dtype::U8, vec![1], vec![5]));
    write_safetensors(&dir.path().join("model.safetensors"), &t);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let u = ck.u32("packed_u").unwrap();
    assert_eq!(u.shape, vec![8, 8]);
    assert_eq!(&u.data[..], &words[..]);
    assert_eq!(&ck.u32("packed_i").unwrap().data[..], &words[..]);
}

/// Writes `src` with its per-expert tensors fused the way transformers 5 holds them in memory and
/// checks that the reader presents exactly the same per-expert tensors.
fn fused_layout_matches(fixture_name: &str) {
    let src = Checkpoint::open(&fixture(fixture_name)).unwrap();
    let config: serde_json::Value = serde_json::from_str(src.config_json()).unwrap();
    let model_type = config["model_type"].as_str().unwrap();
    let (block, gate, up, down) = match model_type {
        "mixtral" | "phimoe" => ("block_sparse_moe", "w1", "w3", "w2"),
        _ => ("mlp", "gate_proj", "up_proj", "down_proj"),
    };
    let tensors = all_tensors(&src);
    let mut fused: BTreeMap<String, Raw> = BTreeMap::new();
    // Group expert tensors by layer prefix.
    let mut experts: BTreeMap<String, BTreeMap<usize, ()>> = BTreeMap::new();
    let marker = format!(".{block}.experts.");
    for name in tensors.keys() {
        if let Some(pos) = name.find(&marker) {
            let prefix = name[..pos].to_string();
            let rest = &name[pos + marker.len()..];
            let e: usize = rest.split('.').next().unwrap().parse().unwrap();
            experts.entry(prefix).or_default().insert(e, ());
        }
    }
    assert!(!experts.is_empty(), "{fixture_name}: no experts found");
    let v5_block = |prefix: &str| format!("{prefix}.mlp.experts");
    for (prefix, es) in &experts {
        let n = es.len();
        let mut gate_up = Vec::new();
        let mut downs = Vec::new();
        let (mut inter, mut hidden) = (0, 0);
        for e in 0..n {
            let g = &tensors[&format!("{prefix}.{block}.experts.{e}.{gate}.weight")];
            let u = &tensors[&format!("{prefix}.{block}.experts.{e}.{up}.weight")];
            let d = &tensors[&format!("{prefix}.{block}.experts.{e}.{down}.weight")];
            inter = g.1[0];
            hidden = g.1[1];
            gate_up.extend_from_slice(&g.2);
            gate_up.extend_from_slice(&u.2);
            downs.extend_from_slice(&d.2);
        }
        fused.insert(
            format!("{}.gate_up_proj", v5_block(prefix)),
            (Dtype::F16, vec![n, 2 * inter, hidden], gate_up),
        );
        fused.insert(
            format!("{}.down_proj", v5_block(prefix)),
            (Dtype::F16, vec![n, hidden, inter], downs),
        );
    }
    for (name, raw) in &tensors {
        if name.contains(&marker) {
            continue;
        }
        // transformers 5's in-memory names for the rest of the MoE block.
        let v5 = match model_type {
            "mixtral" => name.replace(".block_sparse_moe.", ".mlp."),
            "phimoe" => name
                .replace(".block_sparse_moe.gate.", ".mlp.router.")
                .replace(".block_sparse_moe.", ".mlp."),
            _ => name.clone(),
        };
        fused.insert(v5, raw.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture(fixture_name).join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &fused);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.tensor_names(), src.tensor_names(), "{fixture_name}");
    for name in src.tensor_names() {
        let (a, b) = (ck.f16(&name).unwrap(), src.f16(&name).unwrap());
        assert_eq!(a.shape, b.shape, "{fixture_name} {name}");
        assert_eq!(a.data, b.data, "{fixture_name} {name}");
    }
}

#[test]
fn fused_and_per_expert_layouts_read_identically() {
    for name in [
        "mixtral",
        "phimoe",
        "qwen2_moe",
        "deepseek_v2",
        "olmoe",
        "qwen3_moe",
    ] {
        fused_layout_matches(name);
    }
}

#[test]
fn fused_tensor_with_wrong_orientation_is_rejected() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let dir = dir_with_config("qwen2_moe", 128);
    let mut t = BTreeMap::new();
    // [E, H, 2I] instead of [E, 2I, H] with H = 128, I = 256.
    t.insert(
        "model.layers.0.mlp.experts.gate_up_proj".to_string(),
        (
            Dtype::F16,
            vec![2, 128, 512],
            f16_bytes(&random_f16(&mut rng, 2 * 128 * 512)),
        ),
    );
    write_safetensors(&dir.path().join("model.safetensors"), &t);
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("gate_up_proj") && err.contains("hidden_size"),
        "{err}"
    );
}
