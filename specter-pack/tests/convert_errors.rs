//! `specter-pack convert` on bad input: each case fails with a non-zero exit and an error that
//! names the file or tensor and says what is wrong, without a panic, and leaves nothing behind in
//! the output directory (no bundle, no temporary file). Problems that can be known from the
//! checkpoint's headers are found before anything is written.

mod common;

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use common::{assert_clean_failure, assert_untouched, mark_untouched, pack, Model, Run};
use half::f16;
use safetensors::Dtype;
use specter::arch::Proj;

/// A checkpoint directory and an empty output directory in one temporary directory.
struct Case {
    _work: tempfile::TempDir,
    src: PathBuf,
    out_dir: PathBuf,
}

impl Case {
    fn new() -> Case {
        let work = tempfile::tempdir().unwrap();
        let src = work.path().join("hf");
        let out_dir = work.path().join("out");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir(&out_dir).unwrap();
        Case {
            _work: work,
            src,
            out_dir,
        }
    }

    fn output(&self) -> PathBuf {
        self.out_dir.join("model.specter")
    }

    fn convert(&self, extra: &[&str]) -> Run {
        let mut args = vec![
            "convert".to_string(),
            self.src.display().to_string(),
            "-o".to_string(),
            self.output().display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        pack(&args)
    }

    /// Converting fails with an error mentioning `needles` and leaves the output directory empty.
    fn assert_fails(&self, extra: &[&str], needles: &[&str]) -> Run {
        let run = self.convert(extra);
        assert_clean_failure(&run, needles);
        assert!(!self.output().exists());
        assert!(
            common::entries(&self.out_dir).is_empty(),
            "left behind: {:?}",
            common::entries(&self.out_dir)
        );
        run
    }

    /// As [`Case::assert_fails`], and the output directory was not even written to: the problem
    /// was found before the bundle was started.
    fn assert_fails_before_writing(&self, needles: &[&str]) -> Run {
        let mark = mark_untouched(&self.out_dir);
        let run = self.assert_fails(&[], needles);
        assert_untouched(&self.out_dir, mark);
        run
    }
}

fn shard(dir: &Path) -> String {
    common::only_shard(dir).display().to_string()
}

#[test]
fn a_good_checkpoint_converts() {
    // The baseline every failure below differs from by one thing.
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 1);
    let run = case.convert(&[]);
    assert!(run.ok(), "{run:?}");
    assert_eq!(common::entries(&case.out_dir), vec!["model.specter"]);
}

#[test]
fn missing_config_json() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 2);
    std::fs::remove_file(case.src.join("config.json")).unwrap();
    case.assert_fails_before_writing(&["config.json", &case.src.display().to_string()]);
}

#[test]
fn missing_checkpoint_directory() {
    let case = Case::new();
    std::fs::remove_dir(&case.src).unwrap();
    case.assert_fails_before_writing(&[&case.src.display().to_string()]);
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let case = Case::new();
    let model = Model::fixture("mixtral");
    model.write(&case.src, 3);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(case.src.join("config.json")).unwrap())
            .unwrap();
    config["model_type"] = "gpt2".into();
    std::fs::write(case.src.join("config.json"), config.to_string()).unwrap();
    let mut needles = vec!["\"gpt2\"", "config.json"];
    needles.extend(specter::arch::SUPPORTED_MODEL_TYPES);
    case.assert_fails_before_writing(&needles);
}

#[test]
fn a_missing_tensor_is_named() {
    let case = Case::new();
    let model = Model::fixture("qwen2_moe");
    let dropped = model.expert_tensor(Proj::Up).name.clone();
    let specs: Vec<_> = model
        .specs
        .iter()
        .filter(|s| s.name != dropped)
        .cloned()
        .collect();
    model.write_specs(&case.src, &specs, 4, u64::MAX);
    case.assert_fails_before_writing(&["missing tensor", &dropped]);
}

#[test]
fn a_missing_shared_tensor_is_named() {
    let case = Case::new();
    let model = Model::fixture("deepseek_v2");
    let dropped = "model.layers.1.self_attn.kv_a_layernorm.weight";
    let specs: Vec<_> = model
        .specs
        .iter()
        .filter(|s| s.name != dropped)
        .cloned()
        .collect();
    assert_eq!(specs.len() + 1, model.specs.len());
    model.write_specs(&case.src, &specs, 5, u64::MAX);
    case.assert_fails_before_writing(&["missing tensor", dropped]);
}

#[test]
fn a_wrong_shape_is_named_with_both_shapes() {
    let case = Case::new();
    let model = Model::fixture("olmoe");
    let mut specs = model.specs.clone();
    let target = specs
        .iter_mut()
        .find(|s| s.name == "model.layers.1.self_attn.o_proj.weight")
        .unwrap();
    let expected = target.shape.clone();
    target.shape = vec![expected[0], expected[1] + 8];
    let wrong = target.shape.clone();
    model.write_specs(&case.src, &specs, 6, u64::MAX);
    case.assert_fails_before_writing(&[
        "model.layers.1.self_attn.o_proj.weight",
        &format!("{wrong:?}"),
        &format!("expected {expected:?}"),
    ]);
}

#[test]
fn a_truncated_safetensors_file() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 7);
    let path = common::only_shard(&case.src);
    let len = std::fs::metadata(&path).unwrap().len();
    // Cut in the tensor data, then inside the JSON header, then inside the length prefix.
    for cut in [len / 2, 200, 5] {
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(cut).unwrap();
        drop(file);
        let run = case.assert_fails_before_writing(&[&shard(&case.src), "safetensors"]);
        assert!(
            run.stderr.contains("not a valid safetensors file"),
            "{run:?}"
        );
    }
}

#[test]
fn a_corrupt_safetensors_header() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 8);
    let path = common::only_shard(&case.src);
    let original = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;

    // A header length far beyond the file.
    let mut bytes = original.clone();
    bytes[..8].copy_from_slice(&(u64::MAX / 3).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    case.assert_fails_before_writing(&[&shard(&case.src), "not a valid safetensors file"]);

    // Garbage in place of the JSON header, its length intact.
    let mut bytes = original.clone();
    for (i, b) in bytes[8..8 + header_len].iter_mut().enumerate() {
        *b = b"}{\x00garbage"[i % 10];
    }
    std::fs::write(&path, &bytes).unwrap();
    case.assert_fails_before_writing(&[&shard(&case.src), "not a valid safetensors file"]);

    // Valid JSON whose offsets run past the data.
    let text = String::from_utf8(original[8..8 + header_len].to_vec()).unwrap();
    let mut header: serde_json::Value = serde_json::from_str(&text).unwrap();
    let name = "model.norm.weight";
    header[name]["data_offsets"][1] = serde_json::json!(original.len() * 2);
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(header_len.max(json.len()), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    bytes.extend_from_slice(&original[8 + header_len..]);
    std::fs::write(&path, &bytes).unwrap();
    case.assert_fails_before_writing(&[&shard(&case.src), "not a valid safetensors file"]);
}

#[test]
fn an_output_directory_that_does_not_exist() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 9);
    let missing = case.out_dir.join("no").join("such");
    let output = missing.join("model.specter");
    let run = pack(&[
        "convert".as_ref(),
        case.src.as_os_str(),
        "-o".as_ref(),
        output.as_os_str(),
    ]);
    assert_clean_failure(&run, &[&output.display().to_string(), "does not exist"]);
    assert!(!case.out_dir.join("no").exists());
    assert!(common::entries(&case.out_dir).is_empty());
}

#[test]
fn an_output_path_that_is_a_directory() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 10);
    let mark = mark_untouched(&case.out_dir);
    let run = pack(&[
        "convert".as_ref(),
        case.src.as_os_str(),
        "-o".as_ref(),
        case.out_dir.as_os_str(),
    ]);
    assert_clean_failure(
        &run,
        &[&case.out_dir.display().to_string(), "is a directory"],
    );
    assert!(case.out_dir.is_dir());
    assert!(common::entries(&case.out_dir).is_empty());
    assert_untouched(&case.out_dir, mark);
}

/// Rewrites the checkpoint in F32 with `value` at element `index` of tensor `name`.
fn put_f32(src: &Path, name: &str, index: usize, value: f32) {
    common::restore_as(src, common::Storage::F32, 11);
    let path = common::only_shard(src);
    let mut tensors = common::read_safetensors(&path);
    let t = tensors.get_mut(name).unwrap();
    assert_eq!(t.dtype, Dtype::F32);
    t.bytes[4 * index..4 * index + 4].copy_from_slice(&value.to_le_bytes());
    common::write_safetensors(&path, &tensors);
}

#[test]
fn a_value_beyond_f16_range_in_an_f32_checkpoint_names_the_tensor() {
    let case = Case::new();
    let model = Model::fixture("qwen2_moe");
    model.write(&case.src, 12);
    // A routed expert of the last layer: found while the bundle is half written, so this also
    // proves the partial temporary file is removed.
    let name = model.expert_tensor(Proj::Down).name.clone();
    put_f32(&case.src, &name, 77, 70000.0);
    let run = case.assert_fails(&[], &[&name, "element 77", "70000", "outside f16's range"]);
    assert!(run.stderr.contains("error"), "{run:?}");

    // A shared tensor, and a value that is not a number at all.
    let case = Case::new();
    model.write(&case.src, 13);
    put_f32(&case.src, "model.embed_tokens.weight", 3, -1.0e9);
    case.assert_fails(&[], &["model.embed_tokens.weight", "outside f16's range"]);
    let case = Case::new();
    model.write(&case.src, 14);
    put_f32(&case.src, "model.norm.weight", 5, f32::NAN);
    case.assert_fails(
        &[],
        &["model.norm.weight", "element 5", "not a finite number"],
    );
}

#[test]
fn a_non_finite_value_in_an_f16_checkpoint_names_the_tensor() {
    let case = Case::new();
    let model = Model::fixture("mixtral");
    model.write(&case.src, 15);
    let name = model.expert_tensor(Proj::Gate).name.clone();
    let path = common::only_shard(&case.src);
    let mut tensors = common::read_safetensors(&path);
    let t = tensors.get_mut(&name).unwrap();
    t.bytes[2 * 9..2 * 10].copy_from_slice(&f16::INFINITY.to_le_bytes());
    common::write_safetensors(&path, &tensors);
    case.assert_fails(&[], &[&name, "element 9", "not a finite number"]);
}

#[test]
fn expert_widths_the_marlin_tiling_cannot_take_are_refused_before_writing() {
    let case = Case::new();
    let model = Model::fixture_with("qwen2_moe", |c| c["moe_intermediate_size"] = 96.into());
    let down = model.expert_tensor(Proj::Down);
    assert_eq!(down.shape, vec![128, 96]);
    model.write(&case.src, 16);
    // The down projection's input features (96) are not a whole number of 128-wide groups.
    let run = case.assert_fails_before_writing(&["down_proj", "k=96", "multiple of 128"]);
    assert!(run.stderr.contains("Marlin"), "{run:?}");
}

#[test]
fn zero_threads_are_refused() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 17);
    let mark = mark_untouched(&case.out_dir);
    case.assert_fails(&["--threads", "0"], &["--threads", "at least 1"]);
    assert_untouched(&case.out_dir, mark);
}

#[test]
fn impossible_precisions_are_refused_before_writing() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 19);
    let mark = mark_untouched(&case.out_dir);
    for (args, needles) in [
        (
            &["--target", "int6"][..],
            &["--target int6", "fp16, int8 or int4"][..],
        ),
        (&["--draft-bits", "5"], &["--draft-bits 5", "4, 3 or 2"]),
        (&["--draft-bits", "8"], &["--draft-bits 8", "4, 3 or 2"]),
        (
            &["--target", "int4", "--draft-bits", "4"],
            &["--draft-bits 4", "--target int4", "smaller than its target"],
        ),
    ] {
        case.assert_fails(args, needles);
    }
    assert_untouched(&case.out_dir, mark);
}

#[test]
fn quantized_targets_convert_verify_and_inspect() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 20);
    for (args, target, draft) in [
        (&["--target", "int8"][..], "INT8", "INT4"),
        (&["--target", "int4"], "INT4", "INT3"),
        (&["--target", "int8", "--draft-bits", "2"], "INT8", "INT2"),
    ] {
        let run = case.convert(args);
        assert!(run.ok(), "{run:?}");
        assert!(
            run.stdout
                .contains(&format!("{target} target, {}-bit draft", &draft[3..])),
            "{run:?}"
        );
        let path = case.output();
        let run = pack(&["verify".as_ref(), path.as_os_str()]);
        assert!(
            run.ok() && run.stdout.contains(&format!("{target} target")),
            "{run:?}"
        );
        let run = pack(&["inspect".as_ref(), path.as_os_str()]);
        assert!(run.ok(), "{run:?}");
        assert!(
            run.stdout.contains(&format!("target       {target} rtn")),
            "{run:?}"
        );
        assert!(
            run.stdout.contains(&format!("draft        {draft} rtn")),
            "{run:?}"
        );
    }
}

#[test]
fn calibration_without_gptq_is_refused_before_writing() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 18);
    let mark = mark_untouched(&case.out_dir);
    case.assert_fails(
        &["--quant", "rtn", "--calib", "calib.txt"],
        &["--calib", "--quant gptq"],
    );
    assert_untouched(&case.out_dir, mark);
}

#[test]
fn an_unreadable_shard_named_in_the_index() {
    let case = Case::new();
    let model = Model::fixture("mixtral");
    model.write_specs(&case.src, &model.specs, 19, 256 << 10);
    let shards = common::shard_paths(&case.src);
    assert!(shards.len() > 2);
    std::fs::remove_file(&shards[1]).unwrap();
    let name = shards[1]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    case.assert_fails_before_writing(&[&name, "model.safetensors.index.json"]);
}

#[test]
fn trailing_garbage_after_a_safetensors_header_keeps_the_error_on_that_file() {
    // Bytes appended to a shard: safetensors requires the data to be exactly covered.
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 20);
    let path = common::only_shard(&case.src);
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    file.seek(SeekFrom::End(0)).unwrap();
    file.write_all(&[0xab; 10]).unwrap();
    drop(file);
    case.assert_fails_before_writing(&[&shard(&case.src), "not a valid safetensors file"]);
}

#[test]
fn an_output_path_naming_an_input_file_is_refused_and_the_input_kept() {
    let case = Case::new();
    let model = Model::fixture("mixtral");
    model.write_specs(&case.src, &model.specs, 21, 256 << 10);
    let before: Vec<(String, Vec<u8>)> = common::entries(&case.src)
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(case.src.join(&n)).unwrap();
            (n, bytes)
        })
        .collect();
    let shard = common::shard_paths(&case.src)[1].clone();
    for output in [
        shard.clone(),
        case.src.join("config.json"),
        case.src.join("model.safetensors.index.json"),
        // A new shard would be read by the next conversion of a checkpoint without an index.
        case.src.join("model.safetensors"),
        // Reached through another spelling of the directory.
        case.src.join("..").join("hf").join("tokenizer.json"),
    ] {
        let run = pack(&[
            "convert".as_ref(),
            case.src.as_os_str(),
            "-o".as_ref(),
            output.as_os_str(),
        ]);
        assert_clean_failure(
            &run,
            &[
                &output.display().to_string(),
                "would replace the checkpoint's own",
            ],
        );
        let after: Vec<(String, Vec<u8>)> = common::entries(&case.src)
            .into_iter()
            .map(|n| {
                let bytes = std::fs::read(case.src.join(&n)).unwrap();
                (n, bytes)
            })
            .collect();
        assert!(after == before, "the checkpoint changed");
    }
    // Any other name in the checkpoint directory is a valid output.
    let output = case.src.join("model.specter");
    let run = pack(&[
        "convert".as_ref(),
        case.src.as_os_str(),
        "-o".as_ref(),
        output.as_os_str(),
    ]);
    assert!(run.ok(), "{run:?}");
}

#[test]
fn a_tokenizer_that_does_not_load_is_refused_before_writing() {
    let case = Case::new();
    Model::fixture("mixtral").write(&case.src, 22);
    let path = case.src.join("tokenizer.json");
    let bytes = std::fs::read(&path).unwrap();
    // Cut short: no longer JSON.
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    case.assert_fails_before_writing(&[&path.display().to_string(), "tokenizer"]);
    // Valid JSON, but not a tokenizer.
    std::fs::write(&path, r#"{"model": {"type": "NoSuchModel"}}"#).unwrap();
    case.assert_fails_before_writing(&[&path.display().to_string(), "tokenizer"]);
}

#[test]
fn a_tensor_of_an_integer_dtype_is_named() {
    let case = Case::new();
    let model = Model::fixture("qwen2_moe");
    model.write(&case.src, 23);
    let name = model.expert_tensor(Proj::Gate).name.clone();
    let path = common::only_shard(&case.src);
    let mut tensors = common::read_safetensors(&path);
    let t = tensors.get_mut(&name).unwrap();
    // The right shape, stored as 32-bit integers (as packed quantized weights are).
    t.dtype = Dtype::I32;
    t.bytes = t.bytes.iter().flat_map(|&b| [b, b]).collect();
    common::write_safetensors(&path, &tensors);
    case.assert_fails(&[], &[&name, "I32", "F16, BF16 or F32"]);
}
