//! `specter-pack convert` of every architecture, from checkpoints stored as one FP16 file, as FP16
//! shards with an index, in BF16 and in F32: every tensor of the bundle is recomputed independently
//! from the source files and compared byte for byte, the expert blobs' layout is checked, the INT4
//! draft is unpacked and compared with round-to-nearest of the source weights, and the bundle then
//! passes `verify` and `inspect --json`.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{pack, restore_as, Model, Storage};
use half::f16;
use specter::arch::{self, Proj, TensorRole};
use specter_convert::quant::{self, QuantMatrix, GROUP_SIZE};
use specter_format::{Bundle, DType, PAGE};

/// Shards small enough that every tiny checkpoint needs several.
const SMALL_SHARDS: u64 = 256 << 10;

fn round_trip(fixture: &str, storage: Storage, sharded: bool, seed: u64) {
    let model = Model::fixture(fixture);
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("hf");
    let shard_bytes = if sharded { SMALL_SHARDS } else { u64::MAX };
    model.write_specs(&src, &model.specs, seed, shard_bytes);
    if sharded {
        assert!(src.join("model.safetensors.index.json").is_file());
        assert!(common::shard_paths(&src).len() > 1);
    }
    let expected = restore_as(&src, storage, seed ^ 0x5eed);
    assert_eq!(expected.len(), model.specs.len());

    let out_dir = work.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = out_dir.join("model.specter");
    let run = pack(&[
        "convert".as_ref(),
        src.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
        "--threads".as_ref(),
        "2".as_ref(),
    ]);
    assert!(run.ok(), "{fixture} {storage:?}: {run:?}");
    assert!(
        run.stdout.contains(model.cfg.model_type.as_str()),
        "{run:?}"
    );
    // The temporary file was renamed into place: the bundle is all the output directory holds.
    assert_eq!(common::entries(&out_dir), vec!["model.specter".to_string()]);

    let bundle = Bundle::open(&out).unwrap();
    check_tensors(&bundle, &model, &expected);
    check_expert_blobs(&bundle, &model);
    check_draft(&bundle, &model, &expected);
    assert_eq!(
        bundle.config_bytes().unwrap(),
        std::fs::read(src.join("config.json")).unwrap()
    );
    assert_eq!(
        bundle.tokenizer_bytes().unwrap(),
        std::fs::read(src.join("tokenizer.json")).unwrap()
    );
    check_sources(&bundle, &src);

    let verify = pack(&["verify".as_ref(), out.as_os_str()]);
    assert!(verify.ok(), "{verify:?}");
    assert!(verify.stdout.contains("ok"), "{verify:?}");
    let inspect = pack(&["inspect".as_ref(), out.as_os_str(), "--json".as_ref()]);
    assert!(inspect.ok(), "{inspect:?}");
    let json: serde_json::Value = serde_json::from_str(&inspect.stdout).unwrap();
    assert_eq!(json["architecture"], model.cfg.model_type.as_str());
    assert_eq!(
        json["tensors"].as_array().unwrap().len(),
        bundle.tensor_names().count()
    );
    assert_eq!(json["provenance"]["quant"]["method"], "rtn");
}

/// Every tensor the architecture expects is in the bundle as the FP16 conversion of its source,
/// byte for byte; the bundle holds nothing else but the draft's tensors.
fn check_tensors(bundle: &Bundle, model: &Model, expected: &BTreeMap<String, Vec<f16>>) {
    for spec in &model.specs {
        let t = bundle
            .tensor(&spec.name)
            .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        assert_eq!(t.dtype, DType::F16, "{}", spec.name);
        assert_eq!(t.shape, spec.shape, "{}", spec.name);
        let want: Vec<u8> = expected[&spec.name]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(t.bytes == want.as_slice(), "{}: bytes differ", spec.name);
    }
    let draft_tensors = bundle
        .tensor_names()
        .filter(|n| n.starts_with("draft."))
        .count();
    let experts = model
        .specs
        .iter()
        .filter(|s| matches!(s.role, TensorRole::RoutedExpert { .. }))
        .count()
        / 3;
    // gate_up and down, each a qweight and a scales tensor.
    assert_eq!(draft_tensors, 4 * experts);
    assert_eq!(
        bundle.tensor_names().count(),
        model.specs.len() + draft_tensors
    );
}

/// Each routed expert's blob is one page-aligned range in its layer's Experts section holding
/// exactly gate, up and down, in that order, back to back.
fn check_expert_blobs(bundle: &Bundle, model: &Model) {
    let manifest = bundle.to_manifest().unwrap();
    let mut by_expert: BTreeMap<(usize, usize), [Option<&str>; 3]> = BTreeMap::new();
    for spec in &model.specs {
        if let TensorRole::RoutedExpert {
            layer,
            expert,
            proj,
        } = spec.role
        {
            let slot = match proj {
                Proj::Gate => 0,
                Proj::Up => 1,
                Proj::Down => 2,
            };
            by_expert.entry((layer, expert)).or_default()[slot] = Some(&spec.name);
        }
    }
    assert!(!by_expert.is_empty());
    assert_eq!(manifest.experts.len(), by_expert.len());
    for ((layer, expert), names) in by_expert {
        let entry = manifest
            .experts
            .iter()
            .find(|e| e.layer as usize == layer && e.expert as usize == expert)
            .unwrap_or_else(|| panic!("no blob for layer {layer} expert {expert}"));
        assert_eq!(entry.offset % PAGE, 0);
        let section = &manifest.sections[entry.section as usize];
        assert_eq!(
            section.kind,
            specter_format::SectionKind::Experts {
                layer: layer as u32
            }
        );
        let mut cursor = entry.offset;
        for name in names.iter().map(|n| n.unwrap()) {
            let t = manifest.tensors.iter().find(|t| t.name == name).unwrap();
            assert_eq!(t.offset, cursor, "{name} does not follow the previous part");
            cursor += t.length;
        }
        assert_eq!(
            cursor,
            entry.offset + entry.length,
            "layer {layer} expert {expert}"
        );
        // The blob as served is the three tensors' bytes concatenated.
        let blob = bundle.expert_blob(layer as u32, expert as u32).unwrap();
        let joined: Vec<u8> = names
            .iter()
            .flat_map(|n| bundle.tensor(n.unwrap()).unwrap().bytes.to_vec())
            .collect();
        assert!(blob == joined.as_slice());
    }
}

/// Each draft expert, unpacked from its Marlin tiling, holds exactly the codes and scales that
/// round-to-nearest gives for the source weights (gate and up fused along the output features).
fn check_draft(bundle: &Bundle, model: &Model, expected: &BTreeMap<String, Vec<f16>>) {
    let (hidden, inter) = model.cfg.expert_dims();
    let weights = |name: &str| -> Vec<f32> { expected[name].iter().map(|v| v.to_f32()).collect() };
    let mut checked = 0;
    for spec in &model.specs {
        let TensorRole::RoutedExpert {
            layer,
            expert,
            proj: Proj::Gate,
        } = spec.role
        else {
            continue;
        };
        let name_of = |p: Proj| {
            model
                .specs
                .iter()
                .find(|s| {
                    s.role
                        == TensorRole::RoutedExpert {
                            layer,
                            expert,
                            proj: p,
                        }
                })
                .unwrap()
                .name
                .clone()
        };
        let (gate, up, down) = (spec.name.clone(), name_of(Proj::Up), name_of(Proj::Down));
        let qg = quant::rtn(&gate, &weights(&gate), inter, hidden, quant::Bits::FOUR).unwrap();
        let qu = quant::rtn(&up, &weights(&up), inter, hidden, quant::Bits::FOUR).unwrap();
        let want_gate_up = QuantMatrix::concat_n(&qg, &qu).unwrap();
        let want_down =
            quant::rtn(&down, &weights(&down), hidden, inter, quant::Bits::FOUR).unwrap();
        for (part, k, n, want) in [
            ("gate_up", hidden, 2 * inter, &want_gate_up),
            ("down", inter, hidden, &want_down),
        ] {
            let qweight = bundle
                .tensor(&arch::draft_tensor_name(layer, expert, part, "qweight"))
                .unwrap();
            let scales = bundle
                .tensor(&arch::draft_tensor_name(layer, expert, part, "scales"))
                .unwrap();
            assert_eq!(qweight.shape, vec![k / 16, n * 2]);
            assert_eq!(scales.shape, vec![k / GROUP_SIZE, n]);
            let got =
                quant::marlin_unpack(k, n, qweight.as_u32().unwrap(), scales.as_f16().unwrap())
                    .unwrap();
            assert!(
                got.q == want.q,
                "layer {layer} expert {expert} {part}: INT4 codes differ"
            );
            assert!(
                got.scales == want.scales,
                "layer {layer} expert {expert} {part}: scales differ"
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
}

/// The provenance lists every source file with its length and sha256.
fn check_sources(bundle: &Bundle, src: &Path) {
    let manifest = bundle.to_manifest().unwrap();
    let listed: BTreeMap<&str, (u64, [u8; 32])> = manifest
        .provenance
        .sources
        .iter()
        .map(|s| (s.name.as_str(), (s.length, s.sha256)))
        .collect();
    let on_disk = common::entries(src);
    assert_eq!(listed.len(), on_disk.len(), "{listed:?} vs {on_disk:?}");
    for name in on_disk {
        let bytes = std::fs::read(src.join(&name)).unwrap();
        let digest: [u8; 32] = <sha2::Sha256 as sha2::Digest>::digest(&bytes).into();
        assert_eq!(
            listed[name.as_str()],
            (bytes.len() as u64, digest),
            "{name}"
        );
    }
}

#[test]
fn every_architecture_from_one_fp16_file() {
    for (i, fixture) in specter_convert::synth::FIXTURE_CONFIGS.iter().enumerate() {
        round_trip(fixture, Storage::F16, false, 100 + i as u64);
    }
}

#[test]
fn every_architecture_from_fp16_shards_with_an_index() {
    for (i, fixture) in specter_convert::synth::FIXTURE_CONFIGS.iter().enumerate() {
        round_trip(fixture, Storage::F16, true, 200 + i as u64);
    }
}

#[test]
fn every_architecture_from_bf16() {
    for (i, fixture) in specter_convert::synth::FIXTURE_CONFIGS.iter().enumerate() {
        // Alternate single files and shards: both paths of the reader meet the conversion.
        round_trip(fixture, Storage::Bf16, i % 2 == 1, 300 + i as u64);
    }
}

#[test]
fn every_architecture_from_f32() {
    for (i, fixture) in specter_convert::synth::FIXTURE_CONFIGS.iter().enumerate() {
        round_trip(fixture, Storage::F32, i % 2 == 0, 400 + i as u64);
    }
}

/// Rewrites the per-expert checkpoint in `dir` the way transformers 5 stores experts: per MoE
/// layer one `experts.gate_up_proj` `[E, 2I, H]` (each expert's gate rows, then its up rows) and
/// one `experts.down_proj` `[E, H, I]`, under the `mlp` module name.
fn fuse_experts(dir: &Path, model: &Model) {
    let path = common::only_shard(dir);
    let mut tensors = common::read_safetensors(&path);
    let mut fused: BTreeMap<usize, Vec<[Vec<u8>; 3]>> = BTreeMap::new();
    let mut prefixes: BTreeMap<usize, String> = BTreeMap::new();
    for spec in &model.specs {
        if let TensorRole::RoutedExpert {
            layer,
            expert,
            proj,
        } = spec.role
        {
            let t = tensors.remove(&spec.name).unwrap();
            let slots = fused.entry(layer).or_default();
            if slots.len() <= expert {
                slots.resize(expert + 1, Default::default());
            }
            let slot = match proj {
                Proj::Gate => 0,
                Proj::Up => 1,
                Proj::Down => 2,
            };
            slots[expert][slot] = t.bytes;
            let block = spec.name.split(".experts.").next().unwrap();
            prefixes.insert(layer, block.replace(".block_sparse_moe", ".mlp"));
        }
    }
    let (hidden, inter) = model.cfg.expert_dims();
    for (layer, experts) in fused {
        let n = experts.len();
        let gate_up: Vec<u8> = experts
            .iter()
            .flat_map(|[g, u, _]| g.iter().chain(u).copied())
            .collect();
        let down: Vec<u8> = experts.iter().flat_map(|[_, _, d]| d.clone()).collect();
        let prefix = &prefixes[&layer];
        for (name, shape, bytes) in [
            ("gate_up_proj", vec![n, 2 * inter, hidden], gate_up),
            ("down_proj", vec![n, hidden, inter], down),
        ] {
            tensors.insert(
                format!("{prefix}.experts.{name}"),
                common::RawTensor {
                    dtype: safetensors::Dtype::F16,
                    shape,
                    bytes,
                },
            );
        }
    }
    // The rest of a Mixtral-style block moves to the `mlp` name too (router included).
    let tensors = tensors
        .into_iter()
        .map(|(name, t)| (name.replace(".block_sparse_moe.", ".mlp."), t))
        .collect();
    common::write_safetensors(&path, &tensors);
}

#[test]
fn fused_expert_storage_converts_to_the_same_tensors_as_per_expert_storage() {
    for (i, fixture) in ["qwen2_moe", "mixtral", "deepseek_v2"].iter().enumerate() {
        let model = Model::fixture(fixture);
        let work = tempfile::tempdir().unwrap();
        let mut bundles = Vec::new();
        for fused in [false, true] {
            let src = work.path().join(format!("hf-{fused}"));
            model.write(&src, 500 + i as u64);
            if fused {
                fuse_experts(&src, &model);
                let names = common::read_safetensors(&common::only_shard(&src));
                assert!(names.keys().any(|n| n.ends_with(".experts.gate_up_proj")));
                assert!(!names.keys().any(|n| n.contains(".experts.0.")));
            }
            let out = work.path().join(format!("{fused}.specter"));
            let run = pack(&[
                "convert".as_ref(),
                src.as_os_str(),
                "-o".as_ref(),
                out.as_os_str(),
            ]);
            assert!(run.ok(), "{fixture} fused={fused}: {run:?}");
            bundles.push(Bundle::open(&out).unwrap());
        }
        let names: Vec<&str> = bundles[0].tensor_names().collect();
        assert_eq!(names, bundles[1].tensor_names().collect::<Vec<_>>());
        for name in names {
            let (a, b) = (
                bundles[0].tensor(name).unwrap(),
                bundles[1].tensor(name).unwrap(),
            );
            assert_eq!(a.shape, b.shape, "{fixture}: {name}");
            assert!(a.bytes == b.bytes, "{fixture}: {name} differs");
        }
    }
}
