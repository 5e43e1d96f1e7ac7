//! A small random bundle used by the integration tests, with everything written into it kept for
//! comparison.
#![allow(dead_code)]

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter_format::{
    BundleWriter, DType, Provenance, QuantInfo, QuantStat, SectionKind, SourceFile,
};

pub struct WrittenTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

pub struct WrittenExpert {
    pub layer: u32,
    pub expert: u32,
    /// The blob's tensors, in the order written.
    pub tensors: Vec<String>,
}

pub struct WrittenSection {
    pub name: String,
    pub kind: SectionKind,
}

pub struct Fixture {
    pub tensors: Vec<WrittenTensor>,
    pub experts: Vec<WrittenExpert>,
    pub sections: Vec<WrittenSection>,
    pub raw: Vec<(String, SectionKind, Vec<u8>)>,
    pub provenance: Provenance,
    pub architecture: String,
    pub hyperparameters_json: String,
    pub file_len: u64,
}

pub fn random_bytes(rng: &mut ChaCha8Rng, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    rng.fill(&mut bytes[..]);
    bytes
}

fn random_tensor(
    rng: &mut ChaCha8Rng,
    name: String,
    dtype: DType,
    shape: Vec<u64>,
) -> WrittenTensor {
    let len = shape.iter().product::<u64>() as usize * dtype.size();
    let mut bytes = random_bytes(rng, len);
    if dtype == DType::F16 {
        // Finite halves, so the values read back compare as numbers too.
        for v in bytes.chunks_exact_mut(2) {
            let h = half::f16::from_f32(rng.random_range(-4.0f32..4.0));
            v.copy_from_slice(&h.to_le_bytes());
        }
    }
    WrittenTensor {
        name,
        dtype,
        shape,
        bytes,
    }
}

pub fn random_provenance(rng: &mut ChaCha8Rng) -> Provenance {
    let mut sha = [0u8; 32];
    rng.fill(&mut sha);
    Provenance {
        tool: "specter-pack".into(),
        tool_version: format!("0.1.{}", rng.random_range(0..100)),
        sources: vec![SourceFile {
            name: "model.safetensors".into(),
            length: rng.random_range(1..1u64 << 40),
            sha256: sha,
        }],
        quant: QuantInfo {
            method: "gptq".into(),
            bits: 4,
            group_size: 128,
            symmetric: true,
            damp: rng.random_range(0.001..0.1),
            act_order: false,
            calibration: "self-generated 64 tokens".into(),
            calib_tokens: rng.random_range(1..10_000),
            stats: vec![QuantStat {
                tensor: "draft.layers.1.experts.0.gate_up".into(),
                rel_err_rtn: rng.random_range(0.0..0.2),
                rel_err_gptq: rng.random_range(0.0..0.2),
                calib_tokens: rng.random_range(0..1000),
                fallback: "none".into(),
            }],
        },
        notes: vec![format!("seed note {}", rng.random::<u32>())],
    }
}

/// Writes a bundle with a section of every kind: shared f16/f32 tensors, FP16 expert blobs for two
/// MoE layers, INT4 draft tensors (u32 + f16), and raw tokenizer/config/other sections. Shapes are
/// random and often not multiples of 64 bytes, so alignment padding is exercised.
pub fn write_fixture(path: &Path, seed: u64) -> Fixture {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let hidden = rng.random_range(8..40u64);
    let inter = rng.random_range(4..24u64);
    let mut writer = BundleWriter::create(path).unwrap();
    let mut tensors = Vec::new();
    let mut experts = Vec::new();
    let mut sections = Vec::new();
    let mut raw = Vec::new();

    let write = |writer: &mut BundleWriter, t: WrittenTensor, tensors: &mut Vec<WrittenTensor>| {
        writer
            .write_tensor(&t.name, t.dtype, &t.shape, &t.bytes)
            .unwrap();
        tensors.push(t);
    };

    writer.begin_section("shared", SectionKind::Shared).unwrap();
    sections.push(WrittenSection {
        name: "shared".into(),
        kind: SectionKind::Shared,
    });
    let vocab = rng.random_range(10..50u64);
    let t = random_tensor(
        &mut rng,
        "model.embed_tokens.weight".into(),
        DType::F16,
        vec![vocab, hidden],
    );
    write(&mut writer, t, &mut tensors);
    let t = random_tensor(
        &mut rng,
        "model.norm.weight".into(),
        DType::F32,
        vec![hidden],
    );
    write(&mut writer, t, &mut tensors);
    let t = random_tensor(
        &mut rng,
        "model.layers.0.self_attn.q_proj.weight".into(),
        DType::F16,
        vec![hidden, hidden],
    );
    write(&mut writer, t, &mut tensors);
    writer.end_section().unwrap();

    for layer in 1..3u32 {
        let name = format!("experts.{layer}");
        writer
            .begin_section(&name, SectionKind::Experts { layer })
            .unwrap();
        sections.push(WrittenSection {
            name,
            kind: SectionKind::Experts { layer },
        });
        for expert in 0..rng.random_range(2..5u32) {
            writer.begin_expert(layer, expert).unwrap();
            let mut names = Vec::new();
            for (proj, shape) in [
                ("gate_proj", vec![inter, hidden]),
                ("up_proj", vec![inter, hidden]),
                ("down_proj", vec![hidden, inter]),
            ] {
                let name = format!("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight");
                names.push(name.clone());
                let t = random_tensor(&mut rng, name, DType::F16, shape);
                write(&mut writer, t, &mut tensors);
            }
            writer.end_expert().unwrap();
            experts.push(WrittenExpert {
                layer,
                expert,
                tensors: names,
            });
        }
        writer.end_section().unwrap();

        let name = format!("draft.{layer}");
        writer
            .begin_section(&name, SectionKind::Draft { layer })
            .unwrap();
        sections.push(WrittenSection {
            name,
            kind: SectionKind::Draft { layer },
        });
        for expert in 0..2u32 {
            let base = format!("draft.layers.{layer}.experts.{expert}");
            let t = random_tensor(
                &mut rng,
                format!("{base}.gate_up.qweight"),
                DType::U32,
                // Marlin-tiled 4-bit codes of 128 inputs: [128 / 16, 2 * outputs].
                vec![128 / 16, 2 * (2 * inter)],
            );
            write(&mut writer, t, &mut tensors);
            let t = random_tensor(
                &mut rng,
                format!("{base}.gate_up.scales"),
                DType::F16,
                vec![1, 2 * inter],
            );
            write(&mut writer, t, &mut tensors);
        }
        writer.end_section().unwrap();
    }

    for (name, kind) in [
        ("tokenizer.json", SectionKind::Tokenizer),
        ("config.json", SectionKind::Config),
        ("notes.bin", SectionKind::Other),
    ] {
        let len = rng.random_range(1..9000);
        let bytes = random_bytes(&mut rng, len);
        writer.begin_section(name, kind.clone()).unwrap();
        // Streamed in two pieces: raw sections may be written piecewise.
        let (a, b) = bytes.split_at(len / 3);
        writer.write_raw(a).unwrap();
        writer.write_raw(b).unwrap();
        writer.end_section().unwrap();
        sections.push(WrittenSection {
            name: name.into(),
            kind: kind.clone(),
        });
        raw.push((name.to_string(), kind, bytes));
    }

    let provenance = random_provenance(&mut rng);
    let architecture = "deepseek_v2".to_string();
    let hyperparameters_json =
        format!("{{\"hidden_size\":{hidden},\"moe_intermediate_size\":{inter}}}");
    let file_len = writer
        .finish(&architecture, &hyperparameters_json, provenance.clone())
        .unwrap();
    Fixture {
        tensors,
        experts,
        sections,
        raw,
        provenance,
        architecture,
        hyperparameters_json,
        file_len,
    }
}

/// Replaces a bundle's manifest with `manifest` (placed where the old one was) and writes a
/// consistent header for it, so that only the checks on the manifest's contents can object.
pub fn with_manifest(bundle_bytes: &[u8], manifest: &specter_format::Manifest) -> Vec<u8> {
    let encoded = rkyv::to_bytes::<rkyv::rancor::Error>(manifest).unwrap();
    with_manifest_bytes(bundle_bytes, &encoded)
}

/// As [`with_manifest`], with the manifest already encoded (for example a format 1.x one).
pub fn with_manifest_bytes(bundle_bytes: &[u8], encoded: &[u8]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let old = specter_format::Header::decode(bundle_bytes).unwrap();
    let mut bytes = bundle_bytes[..old.manifest_offset as usize].to_vec();
    bytes.extend_from_slice(encoded);
    let header = specter_format::Header::new(
        bytes.len() as u64,
        old.manifest_offset,
        encoded.len() as u64,
        Sha256::digest(encoded).into(),
    );
    bytes[..specter_format::HEADER_LEN].copy_from_slice(&header.encode());
    bytes
}

/// Rewrites the header of `bytes` after `edit`, with a correct header checksum.
pub fn edit_header(bytes: &mut [u8], edit: impl FnOnce(&mut specter_format::Header)) {
    let mut header = specter_format::Header::decode(bytes).unwrap();
    edit(&mut header);
    bytes[..specter_format::HEADER_LEN].copy_from_slice(&header.encode());
}
