//! Every kind of damage is caught by the check responsible for it, with an error that names it.

mod common;

use common::{edit_header, with_manifest, write_fixture};
use specter_format::{Bundle, FormatError, HEADER_LEN};

fn fixture_bytes(seed: u64) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fixture.specter");
    write_fixture(&path, seed);
    std::fs::read(&path).unwrap()
}

fn open_err(bytes: Vec<u8>) -> FormatError {
    match Bundle::from_bytes(bytes) {
        Ok(_) => panic!("a damaged bundle opened"),
        Err(e) => e,
    }
}

#[test]
fn a_flipped_bit_in_any_section_is_named_by_verify() {
    let bytes = fixture_bytes(21);
    let clean = Bundle::from_bytes(bytes.clone()).unwrap();
    let manifest = clean.to_manifest().unwrap();
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(99);
    for (i, section) in manifest.sections.iter().enumerate() {
        let mut damaged = bytes.clone();
        let at = section.offset + rand::Rng::random_range(&mut rng, 0..section.length);
        damaged[at as usize] ^= 1 << rand::Rng::random_range(&mut rng, 0..8);
        // Opening checks only the header and manifest: the damage is found by verify.
        let bundle = Bundle::from_bytes(damaged).unwrap();
        let report = bundle.verify();
        assert!(!report.is_ok());
        assert!(report.manifest_ok);
        let bad: Vec<&str> = report
            .bad_sections()
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(
            bad,
            vec![section.name.as_str()],
            "flipped byte {at} of section {i}"
        );
        let err = report.into_result().unwrap_err();
        assert!(
            matches!(&err, FormatError::SectionChecksum { names } if names.len() == 1 && names[0] == section.name),
            "{err}"
        );
        let message = err.to_string();
        assert!(
            message.contains(&section.name) && message.contains("corrupt"),
            "{message}"
        );
    }
}

#[test]
fn a_truncated_file_is_refused_at_every_length() {
    let bytes = fixture_bytes(22);
    let full = bytes.len();
    for len in [full - 1, full - 100, full / 2, HEADER_LEN + 1, HEADER_LEN] {
        let err = open_err(bytes[..len].to_vec());
        assert!(
            matches!(err, FormatError::Truncated { expected, actual } if expected == full as u64 && actual == len as u64),
            "{len}: {err}"
        );
        assert!(err.to_string().contains("truncated"), "{err}");
    }
    // Shorter than the header page: still a truncation, not a panic.
    let err = open_err(bytes[..HEADER_LEN - 1].to_vec());
    assert!(matches!(err, FormatError::Truncated { .. }), "{err}");
    // Bytes appended are refused too.
    let mut longer = bytes.clone();
    longer.extend_from_slice(&[7; 10]);
    let err = open_err(longer);
    assert!(matches!(err, FormatError::LengthMismatch { .. }), "{err}");
}

#[test]
fn a_truncated_file_on_disk_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.specter");
    write_fixture(&path, 23);
    let len = std::fs::metadata(&path).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(len - 3000).unwrap();
    drop(file);
    let err = Bundle::open(&path).err().unwrap();
    assert!(matches!(err.root(), FormatError::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("cut.specter"), "{err}");
    // Cut inside the header page, and cut to nothing.
    for cut in [100, 0] {
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(cut).unwrap();
        drop(file);
        let err = Bundle::open(&path).err().unwrap();
        assert!(
            matches!(
                err.root(),
                FormatError::Truncated { .. } | FormatError::BadMagic { .. }
            ),
            "{cut}: {err}"
        );
        assert!(err.to_string().contains("cut.specter"), "{err}");
    }
    let err = Bundle::open(&dir.path().join("missing.specter"))
        .err()
        .unwrap();
    assert!(
        matches!(err, FormatError::Io(_)) && err.to_string().contains("missing.specter"),
        "{err}"
    );
    let err = Bundle::open(dir.path()).err().unwrap();
    assert!(
        matches!(err, FormatError::Io(_)) && err.to_string().contains("not a regular file"),
        "{err}"
    );
}

#[test]
fn wrong_magic_is_refused() {
    let mut bytes = fixture_bytes(24);
    bytes[..8].copy_from_slice(b"PK\x03\x04zip!");
    let err = open_err(bytes);
    assert!(matches!(err, FormatError::BadMagic { .. }), "{err}");
    assert!(err.to_string().contains("not a Specter bundle"), "{err}");
    let err = open_err(b"{\"not\": \"a bundle\"}".to_vec());
    assert!(matches!(err, FormatError::BadMagic { .. }), "{err}");
}

#[test]
fn a_newer_major_is_refused_and_a_newer_minor_accepted() {
    let bytes = fixture_bytes(25);
    let mut newer_major = bytes.clone();
    edit_header(&mut newer_major, |h| {
        h.major = specter_format::FORMAT_MAJOR + 1
    });
    let err = open_err(newer_major.clone());
    assert!(
        matches!(err, FormatError::NewerMajor { found, supported }
            if found == specter_format::FORMAT_MAJOR + 1 && supported == specter_format::FORMAT_MAJOR),
        "{err}"
    );
    assert!(err.to_string().contains("upgrade"), "{err}");
    // A newer major is refused even if its header checksum means nothing to this reader.
    newer_major[HEADER_LEN - 1] ^= 0xff;
    assert!(matches!(
        open_err(newer_major),
        FormatError::NewerMajor { .. }
    ));

    let mut newer_minor = bytes.clone();
    edit_header(&mut newer_minor, |h| {
        h.minor = specter_format::FORMAT_MINOR + 3;
        h.flags = 1 << 40;
    });
    let bundle = Bundle::from_bytes(newer_minor).unwrap();
    assert_eq!(bundle.header().minor, specter_format::FORMAT_MINOR + 3);
    assert!(bundle.verify().is_ok());

    let mut zero_major = bytes;
    edit_header(&mut zero_major, |h| h.major = 0);
    assert!(matches!(
        open_err(zero_major),
        FormatError::InvalidMajor { found: 0 }
    ));
}

#[test]
fn a_damaged_header_fails_its_checksum() {
    let bytes = fixture_bytes(26);
    for at in [20usize, 30, 47, 60, 200, HEADER_LEN - 40] {
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x04;
        let err = open_err(damaged);
        assert!(
            matches!(err, FormatError::HeaderChecksum),
            "byte {at}: {err}"
        );
    }
}

#[test]
fn a_manifest_checksum_mismatch_is_refused() {
    let bytes = fixture_bytes(27);
    let header = specter_format::Header::decode(&bytes).unwrap();
    let mut damaged = bytes.clone();
    let at = header.manifest_offset as usize + header.manifest_len as usize / 2;
    damaged[at] ^= 0x80;
    let err = open_err(damaged);
    assert!(matches!(err, FormatError::ManifestChecksum { .. }), "{err}");
    assert!(
        err.to_string().contains("manifest checksum mismatch"),
        "{err}"
    );

    // With the checksum fixed up, garbage in the manifest is caught by validation instead.
    let mut garbage = bytes;
    let range =
        header.manifest_offset as usize..(header.manifest_offset + header.manifest_len) as usize;
    for (i, b) in garbage[range.clone()].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31) ^ 0xa5;
    }
    let sha = sha2::Digest::finalize(sha2::Digest::chain_update(
        sha2::Sha256::default(),
        &garbage[range],
    ))
    .into();
    edit_header(&mut garbage, |h| h.manifest_sha256 = sha);
    let err = open_err(garbage);
    assert!(matches!(err, FormatError::ManifestInvalid(_)), "{err}");
}

#[test]
fn ranges_pointing_outside_the_file_or_section_are_refused() {
    let bytes = fixture_bytes(28);
    let manifest = Bundle::from_bytes(bytes.clone())
        .unwrap()
        .to_manifest()
        .unwrap();
    let file_len = bytes.len() as u64;

    // A section that runs past the end of the file.
    let mut m = manifest.clone();
    m.sections[1].length = file_len * 4;
    let err = open_err(with_manifest(&bytes, &m));
    assert!(
        matches!(&err, FormatError::RangeOutOfFile { what, .. } if what.contains(&manifest.sections[1].name)),
        "{err}"
    );
    // An offset so large that offset + length overflows.
    let mut m = manifest.clone();
    m.sections[0].offset = u64::MAX - 4095;
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::RangeOutOfFile { .. }
    ));
    // A section off its page boundary.
    let mut m = manifest.clone();
    m.sections[2].offset += 64;
    m.sections[2].length -= 64;
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::Misaligned { .. }
    ));
    // Two sections covering the same bytes.
    let mut m = manifest.clone();
    m.sections[0].length = m.sections[1].offset - m.sections[0].offset + 1;
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::Overlap { .. }
    ));
    // A tensor outside its section (but inside the file).
    let mut m = manifest.clone();
    let t = m.tensors.iter().position(|t| t.section == 0).unwrap();
    m.tensors[t].offset = m.sections[1].offset;
    let err = open_err(with_manifest(&bytes, &m));
    assert!(
        matches!(&err, FormatError::RangeOutOfSection { what, .. } if what.contains(&manifest.tensors[t].name)),
        "{err}"
    );
    // A tensor pointing at a section that does not exist.
    let mut m = manifest.clone();
    m.tensors[0].section = 1000;
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::BadSectionIndex { index: 1000, .. }
    ));
    // An expert blob off its page, and one claimed by a section of another kind.
    let mut m = manifest.clone();
    m.experts[0].offset += 64;
    m.experts[0].length -= 64;
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::Misaligned { .. }
    ));
    let mut m = manifest.clone();
    m.experts[0].section = 0;
    m.experts[0].offset = m.sections[0].offset;
    m.experts[0].length = 64;
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::ExpertSection { .. }
    ));
    // The header's manifest range outside the file.
    let mut b = bytes.clone();
    edit_header(&mut b, |h| h.manifest_len = file_len);
    assert!(
        matches!(open_err(b), FormatError::RangeOutOfFile { what, .. } if what == "the manifest")
    );

    // Untouched, the same manifest opens: the errors above come from the edits alone.
    Bundle::from_bytes(with_manifest(&bytes, &manifest)).unwrap();
}

#[test]
fn tensor_length_and_shape_mismatches_are_refused() {
    let bytes = fixture_bytes(29);
    let manifest = Bundle::from_bytes(bytes.clone())
        .unwrap()
        .to_manifest()
        .unwrap();

    let mut m = manifest.clone();
    m.tensors[0].shape[0] += 1;
    let err = open_err(with_manifest(&bytes, &m));
    assert!(
        matches!(&err, FormatError::TensorLength { name, .. } if *name == manifest.tensors[0].name),
        "{err}"
    );
    assert!(err.to_string().contains(&manifest.tensors[0].name), "{err}");

    let mut m = manifest.clone();
    m.tensors[1].length -= 4;
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::TensorLength { .. }
    ));

    let mut m = manifest.clone();
    m.tensors[0].shape = vec![u64::MAX, 3];
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::ShapeOverflow { .. }
    ));

    let mut m = manifest.clone();
    m.tensors[1].name = m.tensors[0].name.clone();
    assert!(matches!(
        open_err(with_manifest(&bytes, &m)),
        FormatError::DuplicateTensor(_)
    ));

    // The writer refuses a mismatch before writing anything.
    let dir = tempfile::tempdir().unwrap();
    let mut writer = specter_format::BundleWriter::create(&dir.path().join("w.specter")).unwrap();
    writer
        .begin_section("s", specter_format::SectionKind::Shared)
        .unwrap();
    let err = writer
        .write_tensor("w", specter_format::DType::F16, &[3, 5], &[1u8; 31])
        .unwrap_err();
    assert!(
        matches!(
            err,
            FormatError::TensorLength {
                expected: 30,
                actual: 31,
                ..
            }
        ),
        "{err}"
    );
    writer
        .write_tensor("w", specter_format::DType::F16, &[3, 5], &[1u8; 30])
        .unwrap();
    let err = writer
        .write_tensor("w", specter_format::DType::F16, &[1], &[1u8; 2])
        .unwrap_err();
    assert!(
        matches!(err, FormatError::DuplicateTensor(ref n) if n == "w"),
        "{err}"
    );
}
