//! Random-weight checkpoints written by `synth` and read back by `checkpoint`.

// The root crate's test helpers: fixtures, found from the repository root.
#[path = "../../tests/common/mod.rs"]
mod common;

use common::files::entries;
use specter::arch::{expected_tensors, ArchConfig, Proj, TensorRole, TensorSpec};
use specter::weights::WeightStore;
use specter_convert::checkpoint::Checkpoint;
use specter_convert::synth::{
    fixture_config, preset_config, preset_config_layers, write_checkpoint, FIXTURE_CONFIGS, PRESETS,
};

fn specs_for(config: &str) -> Vec<TensorSpec> {
    expected_tensors(&ArchConfig::from_config_json(config).unwrap())
}

#[test]
fn every_fixture_config_round_trips_through_the_reader() {
    for name in FIXTURE_CONFIGS {
        let config = fixture_config(name).unwrap();
        let specs = specs_for(&config);
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path(), &config, &specs, 5, 1 << 30, 0.1).unwrap();
        assert_eq!(
            entries(dir.path()),
            ["config.json", "model.safetensors", "tokenizer.json"]
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.config_json(), config);
        let mut want: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        want.sort();
        assert_eq!(ck.tensor_names(), want, "{name}");
        for s in &specs {
            let t = ck.f16(&s.name).unwrap();
            assert_eq!(t.shape, s.shape, "{name} {}", s.name);
        }
    }
}

/// The Rust fixture configs describe the same models as the committed (Python-made) fixtures.
#[test]
fn fixture_configs_match_the_committed_fixtures() {
    let root = common::repo_root().join("tests/fixtures");
    for name in FIXTURE_CONFIGS {
        let committed = std::fs::read_to_string(root.join(name).join("config.json")).unwrap();
        let ours = ArchConfig::from_config_json(&fixture_config(name).unwrap()).unwrap();
        let theirs = ArchConfig::from_config_json(&committed).unwrap();
        assert_eq!(ours, theirs, "{name}");
    }
}

#[test]
fn values_have_the_requested_spread_and_norms_sit_near_one() {
    let config = fixture_config("qwen3_moe").unwrap();
    let specs = specs_for(&config);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &config, &specs, 9, 1 << 30, 0.2).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let stats = |name: &str| {
        let t = ck.f16(name).unwrap();
        let v: Vec<f64> = t.data.iter().map(|x| x.to_f32() as f64).collect();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        (mean, var.sqrt())
    };
    let (mean, std) = stats("model.embed_tokens.weight");
    assert!(
        mean.abs() < 0.01 && (std - 0.2).abs() < 0.01,
        "{mean} {std}"
    );
    let (mean, std) = stats("model.layers.1.mlp.experts.5.down_proj.weight");
    assert!(
        mean.abs() < 0.01 && (std - 0.2).abs() < 0.01,
        "{mean} {std}"
    );
    let (mean, std) = stats("model.layers.0.input_layernorm.weight");
    assert!(
        (mean - 1.0).abs() < 0.1 && std > 0.1 && std < 0.3,
        "{mean} {std}"
    );
    // Different tensors are different draws.
    let a = ck
        .f16("model.layers.0.mlp.experts.0.gate_proj.weight")
        .unwrap();
    let b = ck
        .f16("model.layers.0.mlp.experts.0.up_proj.weight")
        .unwrap();
    assert_ne!(a.data, b.data);
}

#[test]
fn sharding_changes_files_not_values() {
    let config = fixture_config("mixtral").unwrap();
    let specs = specs_for(&config);
    let one = tempfile::tempdir().unwrap();
    let many = tempfile::tempdir().unwrap();
    write_checkpoint(one.path(), &config, &specs, 42, 1 << 30, 0.1).unwrap();
    write_checkpoint(many.path(), &config, &specs, 42, 300_000, 0.1).unwrap();
    let files = entries(many.path());
    let shards: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .collect();
    assert!(shards.len() > 3, "{files:?}");
    let n = shards.len();
    assert_eq!(shards[0], &format!("model-00001-of-{n:05}.safetensors"));
    assert!(files.contains(&"model.safetensors.index.json".to_string()));
    for shard in &shards {
        let len = std::fs::metadata(many.path().join(shard)).unwrap().len();
        // Only a tensor larger than the limit may overflow it (none is here: the largest is 128 KiB).
        assert!(len < 300_000 + 4096, "{shard}: {len}");
    }
    let a = Checkpoint::open(one.path()).unwrap();
    let b = Checkpoint::open(many.path()).unwrap();
    assert_eq!(a.tensor_names(), b.tensor_names());
    for name in a.tensor_names() {
        assert_eq!(
            a.f16(&name).unwrap().data,
            b.f16(&name).unwrap().data,
            "{name}"
        );
    }
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(many.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let total: u64 = specs
        .iter()
        .map(|s| 2 * s.shape.iter().product::<usize>() as u64)
        .sum();
    assert_eq!(index["metadata"]["total_size"], total);

    // Rewriting the sharded directory as one file leaves no stale shards or index behind.
    write_checkpoint(many.path(), &config, &specs, 42, 1 << 30, 0.1).unwrap();
    assert_eq!(
        entries(many.path()),
        ["config.json", "model.safetensors", "tokenizer.json"]
    );
}

#[test]
fn seeds_decide_the_values() {
    let config = fixture_config("olmoe").unwrap();
    let specs = specs_for(&config);
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    write_checkpoint(dirs[0].path(), &config, &specs, 1, 1 << 30, 0.1).unwrap();
    write_checkpoint(dirs[1].path(), &config, &specs, 1, 1 << 30, 0.1).unwrap();
    write_checkpoint(dirs[2].path(), &config, &specs, 2, 1 << 30, 0.1).unwrap();
    let read = |i: usize| std::fs::read(dirs[i].path().join("model.safetensors")).unwrap();
    assert_eq!(read(0), read(1));
    assert_ne!(read(0), read(2));
}

#[test]
fn tokenizer_is_byte_level_and_fits_the_vocabulary() {
    for (config, vocab) in [
        (fixture_config("phimoe").unwrap(), 512usize),
        (preset_config("qwen1.5-moe-a2.7b").unwrap(), 151936),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let specs = vec![TensorSpec {
            name: "model.norm.weight".into(),
            shape: vec![64],
            role: TensorRole::Shared,
        }];
        write_checkpoint(dir.path(), &config, &specs, 3, 1 << 20, 0.1).unwrap();
        let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        let text = "Mixture of experts: déjà vu, 12 + 30 = 42!\n\ttabs";
        let enc = tok.encode(text, false).unwrap();
        assert_eq!(enc.get_ids().len(), text.len(), "one token per byte");
        assert!(enc.get_ids().iter().all(|&id| (id as usize) < vocab));
        assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);
        let cfg: serde_json::Value = serde_json::from_str(&config).unwrap();
        for key in ["bos_token_id", "eos_token_id"] {
            let id = cfg[key].as_u64().unwrap() as u32;
            let token = tok.id_to_token(id).unwrap();
            assert!(token.starts_with('<'), "{key} {id} is {token}");
            assert!(!enc.get_ids().contains(&id));
        }
    }
}

#[test]
fn bad_requests_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let config = fixture_config("mixtral").unwrap();
    let spec = |name: &str, shape: Vec<usize>| TensorSpec {
        name: name.into(),
        shape,
        role: TensorRole::RoutedExpert {
            layer: 0,
            expert: 0,
            proj: Proj::Gate,
        },
    };
    let cases: Vec<(Vec<TensorSpec>, &str, u64, f32, &str)> = vec![
        (
            vec![spec("a", vec![4]), spec("a", vec![4])],
            config.as_str(),
            1 << 20,
            0.1,
            "twice",
        ),
        (
            vec![spec("a", vec![4, 0])],
            config.as_str(),
            1 << 20,
            0.1,
            "empty",
        ),
        (vec![], config.as_str(), 1 << 20, 0.1, "no tensors"),
        (
            vec![spec("a", vec![4])],
            config.as_str(),
            0,
            0.1,
            "shard_bytes",
        ),
        (
            vec![spec("a", vec![4])],
            config.as_str(),
            1 << 20,
            f32::NAN,
            "std",
        ),
        (vec![spec("a", vec![4])], "{", 1 << 20, 0.1, "JSON"),
        (
            vec![spec("a", vec![4])],
            r#"{"vocab_size": 100}"#,
            1 << 20,
            0.1,
            "vocab_size 100",
        ),
        (
            vec![spec("a", vec![4])],
            r#"{"vocab_size": 300, "eos_token_id": 300}"#,
            1 << 20,
            0.1,
            "300",
        ),
    ];
    for (specs, config, shard, std, needle) in cases {
        let err = write_checkpoint(dir.path(), config, &specs, 1, shard, std)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let err = preset_config("gpt-5").unwrap_err().to_string();
    assert!(
        err.contains("gpt-5") && err.contains("deepseek-v2-lite"),
        "{err}"
    );
    assert!(preset_config_layers("phi-3.5-moe", Some(0)).is_err());
    assert!(fixture_config("llama")
        .unwrap_err()
        .to_string()
        .contains("llama"));
}

/// The presets carry the benchmark models' shapes (docs: protocol.md's shape table).
#[test]
fn presets_have_the_published_shapes() {
    let expert_bytes = |cfg: &ArchConfig| {
        let (h, i) = cfg.expert_dims();
        3 * h * i * 2
    };
    for name in PRESETS {
        let cfg = ArchConfig::from_config_json(&preset_config(name).unwrap()).unwrap();
        let specs = expected_tensors(&cfg);
        let routed: usize = specs
            .iter()
            .filter(|s| matches!(s.role, TensorRole::RoutedExpert { .. }))
            .count();
        let info = cfg.model_info();
        let total_bytes: usize = specs
            .iter()
            .map(|s| 2 * s.shape.iter().product::<usize>())
            .sum();
        match *name {
            "deepseek-v2-lite" => {
                assert_eq!((info.num_layers, info.num_experts, info.top_k), (27, 64, 6));
                assert_eq!(info.moe_layers, (1..27).collect::<Vec<_>>());
                assert_eq!(info.vocab_size, 102400);
                assert_eq!(expert_bytes(&cfg), 3 * 2048 * 1408 * 2);
                assert_eq!(routed, 26 * 64 * 3);
                // 15.7 B parameters.
                assert!(
                    (31_000_000_000..32_000_000_000).contains(&total_bytes),
                    "{total_bytes}"
                );
            }
            "qwen1.5-moe-a2.7b" => {
                assert_eq!((info.num_layers, info.num_experts, info.top_k), (24, 60, 4));
                assert_eq!(info.vocab_size, 151936);
                assert_eq!(expert_bytes(&cfg), 3 * 2048 * 1408 * 2);
                assert_eq!(routed, 24 * 60 * 3);
                // 14.3 B parameters.
                assert!(
                    (28_000_000_000..29_000_000_000).contains(&total_bytes),
                    "{total_bytes}"
                );
            }
            "phi-3.5-moe" => {
                assert_eq!((info.num_layers, info.num_experts, info.top_k), (32, 16, 2));
                assert_eq!(info.vocab_size, 32064);
                assert_eq!(expert_bytes(&cfg), 3 * 4096 * 6400 * 2);
                // 41.9 B parameters.
                assert!(
                    (83_000_000_000..84_500_000_000).contains(&total_bytes),
                    "{total_bytes}"
                );
            }
            other => panic!("untested preset {other}"),
        }
        let shallow =
            ArchConfig::from_config_json(&preset_config_layers(name, Some(4)).unwrap()).unwrap();
        assert_eq!(shallow.model_info().num_layers, 4);
        assert_eq!(shallow.hidden_size, cfg.hidden_size);
    }
}
