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
