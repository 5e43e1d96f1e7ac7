//! A bundle appears under its name complete or not at all, and bad output paths are clear errors.

mod common;
// The root crate's std-only helper, shared by every crate's tests.
#[path = "../../tests/common/files.rs"]
mod files;

use files::entries;
use specter_format::{BundleWriter, DType, FormatError, SectionKind};

#[test]
fn an_unfinished_writer_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.specter");
    let mut writer = BundleWriter::create(&path).unwrap();
    writer.begin_section("shared", SectionKind::Shared).unwrap();
    let bytes: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    writer
        .write_tensor("t", DType::U8, &[8192], &bytes)
        .unwrap();
    // While writing, only the hidden temp file exists.
    let during = entries(dir.path());
    assert_eq!(during.len(), 1);
    assert!(during[0].starts_with(".model.specter.tmp-"), "{during:?}");
    assert!(!path.exists());
    drop(writer);
    assert!(entries(dir.path()).is_empty());
}

#[test]
fn a_failed_finish_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.specter");
    let mut writer = BundleWriter::create(&path).unwrap();
    writer.begin_section("shared", SectionKind::Shared).unwrap();
    // Finishing with a section still open is refused, and the writer cleans up.
    let err = writer
        .finish(
            "x",
            "{}",
            common::random_provenance(&mut rand::SeedableRng::seed_from_u64(1)),
        )
        .unwrap_err();
    assert!(matches!(err, FormatError::WriterMisuse(_)), "{err}");
    assert!(entries(dir.path()).is_empty());
}

#[test]
fn finish_replaces_an_existing_file_and_leaves_no_temp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.specter");
    std::fs::write(&path, b"an older file").unwrap();
    common::write_fixture(&path, 3);
    assert_eq!(entries(dir.path()), vec!["model.specter".to_string()]);
    specter_format::Bundle::open(&path).unwrap();
}

#[test]
fn unwritable_output_paths_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir").join("model.specter");
    let err = BundleWriter::create(&missing).err().unwrap();
    assert!(matches!(err, FormatError::BadOutputPath { .. }), "{err}");
    assert!(err.to_string().contains("does not exist"), "{err}");

    let err = BundleWriter::create(dir.path()).err().unwrap();
    assert!(matches!(err, FormatError::BadOutputPath { .. }), "{err}");
    assert!(err.to_string().contains("is a directory"), "{err}");
    assert!(entries(dir.path()).is_empty());
}

#[test]
fn writer_calls_out_of_order_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = BundleWriter::create(&dir.path().join("m.specter")).unwrap();
    let data = [9u8; 12];
    assert!(matches!(
        writer.write_tensor("a", DType::U8, &[12], &data),
        Err(FormatError::WriterMisuse(_))
    ));
    assert!(matches!(
        writer.begin_expert(0, 0),
        Err(FormatError::WriterMisuse(_))
    ));
    assert!(matches!(
        writer.end_section(),
        Err(FormatError::WriterMisuse(_))
    ));
    writer.begin_section("shared", SectionKind::Shared).unwrap();
    assert!(matches!(
        writer.begin_section("x", SectionKind::Other),
        Err(FormatError::WriterMisuse(_))
    ));
    // Experts only inside their layer's Experts section; raw bytes only in raw sections.
    assert!(matches!(
        writer.begin_expert(0, 0),
        Err(FormatError::WriterMisuse(_))
    ));
    assert!(matches!(
        writer.write_raw(&data),
        Err(FormatError::WriterMisuse(_))
    ));
    writer.end_section().unwrap();
    assert!(matches!(
        writer.begin_section("shared", SectionKind::Other),
        Err(FormatError::DuplicateSection(_))
    ));
    writer
        .begin_section("experts.3", SectionKind::Experts { layer: 3 })
        .unwrap();
    assert!(matches!(
        writer.begin_expert(4, 0),
        Err(FormatError::WriterMisuse(_))
    ));
    writer.begin_expert(3, 0).unwrap();
    assert!(matches!(
        writer.end_section(),
        Err(FormatError::WriterMisuse(_))
    ));
    writer.write_tensor("e", DType::U8, &[12], &data).unwrap();
    writer.end_expert().unwrap();
    assert!(matches!(
        writer.begin_expert(3, 0),
        Err(FormatError::DuplicateExpert {
            layer: 3,
            expert: 0
        })
    ));
    writer.begin_expert(3, 1).unwrap();
    assert!(matches!(
        writer.end_expert(),
        Err(FormatError::WriterMisuse(_))
    ));
}
