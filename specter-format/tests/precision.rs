//! The manifest's precision: checked against every expert and draft tensor at open, and read
//! from format 1.x bundles (which had none) as an FP16 target with a 4-bit draft.

mod common;

use specter_format::{Bundle, FormatError, ManifestV1, Precision, QuantInfo};

fn fixture_bytes(seed: u64) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.specter");
    common::write_fixture(&path, seed);
    std::fs::read(&path).unwrap()
}

fn with_precision(bytes: &[u8], precision: Precision) -> FormatError {
    let mut manifest = Bundle::from_slice(bytes).unwrap().to_manifest().unwrap();
    manifest.precision = precision;
    let edited = common::with_manifest(bytes, &manifest);
    let err = Bundle::from_bytes(edited)
        .err()
        .expect("the edited bundle opened");
    assert!(matches!(err, FormatError::Precision(_)), "{err}");
    err
}

#[test]
fn a_written_bundle_records_its_precision() {
    let bundle = Bundle::from_bytes(fixture_bytes(40)).unwrap();
    let p = bundle.to_manifest().unwrap().precision;
    assert_eq!(p, Precision::default());
    assert_eq!((p.target_bits, p.draft_bits, p.group_size), (16, 4, 128));
    assert_eq!(p.target_name(), "fp16");
}

#[test]
fn a_precision_that_does_not_match_the_sections_is_refused() {
    let bytes = fixture_bytes(41);
    let with = |target_bits, draft_bits| Precision {
        target_bits,
        draft_bits,
        ..Precision::default()
    };
    // FP16 expert tensors under an 8-bit target.
    let msg = with_precision(&bytes, with(8, 4)).to_string();
    assert!(msg.contains("experts.") && msg.contains("8-bit"), "{msg}");
    // Marlin (u32) draft codes under a 3-bit draft, which the row layout stores as bytes.
    let msg = with_precision(&bytes, with(16, 3)).to_string();
    assert!(msg.contains("draft.") && msg.contains("u32"), "{msg}");
    // Widths the format does not define, and a draft no smaller than its target.
    let msg = with_precision(&bytes, with(16, 5)).to_string();
    assert!(msg.contains("5 bits"), "{msg}");
    let msg = with_precision(&bytes, with(12, 4)).to_string();
    assert!(msg.contains("12 bits"), "{msg}");
    let msg = with_precision(&bytes, with(4, 4)).to_string();
    assert!(msg.contains("no smaller"), "{msg}");
    let msg = with_precision(
        &bytes,
        Precision {
            group_size: 64,
            ..Precision::default()
        },
    )
    .to_string();
    assert!(msg.contains("64 inputs"), "{msg}");
}

#[test]
fn a_draft_matrix_whose_shapes_disagree_is_refused() {
    let bytes = fixture_bytes(42);
    let mut manifest = Bundle::from_slice(&bytes).unwrap().to_manifest().unwrap();
    let scales = manifest
        .tensors
        .iter_mut()
        .find(|t| t.name.ends_with("gate_up.scales"))
        .unwrap();
    // Same byte length, other shape: only the precision check can object.
    scales.shape.swap(0, 1);
    let name = scales.name.clone();
    let err = Bundle::from_bytes(common::with_manifest(&bytes, &manifest))
        .err()
        .unwrap();
    let msg = err.to_string();
    assert!(
        matches!(err, FormatError::Precision(_)) && msg.contains(name.trim_end_matches(".scales")),
        "{msg}"
    );
}

#[test]
fn a_format_1_bundle_opens_as_an_fp16_target_with_a_4_bit_draft() {
    let bytes = fixture_bytes(43);
    let current = Bundle::from_slice(&bytes).unwrap().to_manifest().unwrap();
    let old = ManifestV1 {
        architecture: current.architecture.clone(),
        hyperparameters_json: current.hyperparameters_json.clone(),
        sections: current.sections.clone(),
        tensors: current.tensors.clone(),
        experts: current.experts.clone(),
        provenance: current.provenance.clone(),
    };
    let encoded = rkyv::to_bytes::<rkyv::rancor::Error>(&old).unwrap();
    let mut v1 = common::with_manifest_bytes(&bytes, &encoded);
    common::edit_header(&mut v1, |h| h.major = 1);
    let bundle = Bundle::from_bytes(v1.clone()).unwrap();
    assert_eq!(bundle.header().major, 1);
    assert_eq!(bundle.to_manifest().unwrap(), current);
    assert!(bundle.verify().is_ok());
    // A current manifest behind a 1.x header is not a 1.x manifest.
    let mut mislabeled = bytes;
    common::edit_header(&mut mislabeled, |h| h.major = 1);
    let err = Bundle::from_bytes(mislabeled).err().unwrap();
    assert!(
        matches!(err, FormatError::ManifestInvalid(_)) && err.to_string().contains("1.x"),
        "{err}"
    );
    let _ = QuantInfo::unquantized();
}

/// A quantized target's codes are bytes in the row layout at 8 and 4 bits; Marlin tiles (u32
/// words) are the 4-bit draft's alone. A bundle whose INT4 target is Marlin-tiled (as written
/// before the row layout) is refused at open, naming the tensor; the same matrices as rows open.
#[test]
fn an_int4_target_opens_in_the_row_layout_only() {
    use specter_format::{BundleWriter, DType, Precision, SectionKind};
    let dir = tempfile::tempdir().unwrap();
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(44);
    let (hidden, inter) = (128u64, 128u64);
    let write = |marlin: bool, rng: &mut rand_chacha::ChaCha8Rng| {
        let path = dir.path().join(if marlin {
            "marlin.specter"
        } else {
            "rows.specter"
        });
        let mut w = BundleWriter::create(&path).unwrap();
        w.begin_section("experts.0", SectionKind::Experts { layer: 0 })
            .unwrap();
        w.begin_expert(0, 0).unwrap();
        // gate/up: hidden inputs, 2 inter outputs; down: inter inputs, hidden outputs.
        for (part, k, n) in [("gate_up", hidden, 2 * inter), ("down", inter, hidden)] {
            let name = |kind: &str| format!("target.layers.0.experts.0.{part}.{kind}");
            let (dtype, q_shape, s_shape) = if marlin {
                (DType::U32, [k / 16, 2 * n], [k / 128, n])
            } else {
                (DType::U8, [n, k / 2], [n, k / 128])
            };
            let q = common::random_bytes(rng, (k * n / 2) as usize);
            w.write_tensor(&name("qweight"), dtype, &q_shape, &q)
                .unwrap();
            let s = vec![0x3Cu8; (2 * n * k / 128) as usize];
            w.write_tensor(&name("scales"), DType::F16, &s_shape, &s)
                .unwrap();
        }
        w.end_expert().unwrap();
        w.end_section().unwrap();
        w.set_precision(Precision {
            target_bits: 4,
            draft_bits: 3,
            ..Precision::default()
        });
        let written = w.finish("test", "{}", common::random_provenance(rng));
        (path, written)
    };
    let (rows, written) = write(false, &mut rng);
    written.unwrap();
    Bundle::open(&rows).unwrap();
    let (marlin, written) = write(true, &mut rng);
    // Refused when written or when opened, never read as a target.
    let err = match written {
        Err(e) => e,
        Ok(_) => Bundle::open(&marlin)
            .err()
            .expect("a Marlin INT4 target opened"),
    };
    let msg = err.to_string();
    assert!(
        msg.contains("precision does not match")
            && msg.contains("gate_up.qweight")
            && msg.contains("u32"),
        "{msg}"
    );
}
