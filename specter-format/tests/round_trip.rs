//! Writing a bundle and reading it back gives the same bytes, the promised alignments, and a
//! clean verify.

mod common;

use common::write_fixture;
use specter_format::{Bundle, DType, FormatError, SectionKind, PAGE, TENSOR_ALIGN};

#[test]
fn every_tensor_section_and_expert_reads_back() {
    for seed in [1u64, 2, 3] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.specter");
        let fixture = write_fixture(&path, seed);
        let bundle = Bundle::open(&path).unwrap();

        assert_eq!(bundle.file_len(), fixture.file_len);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), fixture.file_len);
        assert_eq!(bundle.architecture(), fixture.architecture);
        assert_eq!(bundle.hyperparameters_json(), fixture.hyperparameters_json);
        let owned = bundle.to_manifest().unwrap();
        assert_eq!(owned.provenance, fixture.provenance);
        assert_eq!(owned.tensors.len(), fixture.tensors.len());

        // Tensors: same bytes, dtype and shape, 64-byte aligned in the file and in memory.
        let base = bundle.as_bytes().as_ptr() as usize;
        for written in &fixture.tensors {
            let view = bundle.tensor(&written.name).unwrap();
            assert_eq!(view.name, written.name);
            assert_eq!(view.dtype, written.dtype);
            let shape: Vec<u64> = view.shape.iter().map(|&d| d as u64).collect();
            assert_eq!(shape, written.shape);
            assert_eq!(view.bytes, &written.bytes[..], "{}", written.name);
            let offset = view.bytes.as_ptr() as usize - base;
            assert_eq!(offset as u64 % TENSOR_ALIGN, 0, "{}", written.name);
            match written.dtype {
                DType::F16 => {
                    let values = view.as_f16().unwrap();
                    assert_eq!(values.len(), view.numel());
                    let first = half::f16::from_le_bytes([written.bytes[0], written.bytes[1]]);
                    assert_eq!(values[0], first);
                    assert!(matches!(
                        view.as_u32(),
                        Err(FormatError::DTypeMismatch { .. })
                    ));
                }
                DType::U32 => {
                    let values = view.as_u32().unwrap();
                    assert_eq!(values.len(), view.numel());
                    let last = u32::from_le_bytes(
                        written.bytes[written.bytes.len() - 4..].try_into().unwrap(),
                    );
                    assert_eq!(*values.last().unwrap(), last);
                }
                DType::F32 => assert_eq!(view.as_f32().unwrap().len(), view.numel()),
                other => panic!("fixture wrote an unexpected dtype {other:?}"),
            }
        }
        let names: Vec<&str> = bundle.tensor_names().collect();
        let written: Vec<&str> = fixture.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, written);
        assert!(matches!(
            bundle.tensor("model.layers.99.nothing"),
            Err(FormatError::UnknownTensor(name)) if name == "model.layers.99.nothing"
        ));

        // Expert blobs: page-aligned, starting with their first tensor, holding the tensors back to
        // back (only 64-byte alignment padding between them) and ending with the last.
        for expert in &fixture.experts {
            let blob = bundle.expert_blob(expert.layer, expert.expert).unwrap();
            let blob_offset = (blob.as_ptr() as usize - base) as u64;
            assert_eq!(blob_offset % PAGE, 0);
            let mut cursor = blob_offset;
            for name in &expert.tensors {
                let view = bundle.tensor(name).unwrap();
                let offset = (view.bytes.as_ptr() as usize - base) as u64;
                assert_eq!(offset, cursor.next_multiple_of(TENSOR_ALIGN), "{name}");
                let within = (offset - blob_offset) as usize;
                assert_eq!(&blob[within..within + view.bytes.len()], view.bytes);
                cursor = offset + view.bytes.len() as u64;
            }
            assert_eq!(cursor, blob_offset + blob.len() as u64);
        }
        assert!(matches!(
            bundle.expert_blob(1, 1000),
            Err(FormatError::UnknownExpert {
                layer: 1,
                expert: 1000
            })
        ));

        // Sections: page-aligned, in the order written, with the right kinds; raw ones byte-exact.
        assert_eq!(bundle.section_count(), fixture.sections.len());
        for (i, section) in fixture.sections.iter().enumerate() {
            assert_eq!(bundle.section_kind(i), section.kind);
            assert_eq!(bundle.find_section_named(&section.name), Some(i));
            let offset = (bundle.section_bytes(i).as_ptr() as usize - base) as u64;
            assert_eq!(offset % PAGE, 0);
        }
        for (name, kind, bytes) in &fixture.raw {
            let i = bundle.find_section_named(name).unwrap();
            assert_eq!(bundle.section_bytes(i), &bytes[..]);
            assert_eq!(bundle.section_by_kind(kind), Some(&bytes[..]));
        }
        assert_eq!(bundle.tokenizer_bytes(), Some(&fixture.raw[0].2[..]));
        assert_eq!(bundle.config_bytes(), Some(&fixture.raw[1].2[..]));
        assert_eq!(
            bundle.find_section(&SectionKind::Experts { layer: 7 }),
            None
        );

        let report = bundle.verify();
        assert!(report.is_ok(), "{report:?}");
        assert!(report.bad_sections().is_empty());
        assert_eq!(report.sections.len(), fixture.sections.len());
        let section_bytes: u64 = report.sections.iter().map(|s| s.length).sum();
        assert_eq!(report.bytes, section_bytes + bundle.header().manifest_len);
        report.into_result().unwrap();

        // The in-memory reader sees the same bundle.
        let in_memory = Bundle::from_bytes(std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(in_memory.as_bytes(), bundle.as_bytes());
        assert!(in_memory.verify().is_ok());
    }
}

#[test]
fn verify_reports_progress_up_to_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.specter");
    write_fixture(&path, 11);
    let bundle = Bundle::open(&path).unwrap();
    let max_seen = std::sync::atomic::AtomicU64::new(0);
    let report = bundle.verify_with_progress(&|done| {
        max_seen.fetch_max(done, std::sync::atomic::Ordering::Relaxed);
    });
    assert!(report.is_ok());
    assert_eq!(max_seen.into_inner(), report.bytes);
}

#[test]
fn bundle_is_send_and_sync() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Bundle>();
}

/// Opening maps the file and reads only the header and the manifest: a bundle whose sections are
/// a sparse multi-gigabyte hole opens in far less time than reading it would take.
#[test]
fn open_does_not_read_section_bytes() {
    use specter_format::{BundleWriter, DType, SectionKind};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.specter");
    let mut writer = BundleWriter::create(&path).unwrap();
    writer.begin_section("shared", SectionKind::Shared).unwrap();
    let small: Vec<u8> = (0..256u32).map(|i| (i * 7 + 3) as u8).collect();
    writer
        .write_tensor("small", DType::U8, &[256], &small)
        .unwrap();
    writer.end_section().unwrap();
    writer
        .finish(
            "test",
            "{}",
            common::random_provenance(&mut rand::SeedableRng::seed_from_u64(5)),
        )
        .unwrap();

    // Rebuild the file with an 8 GiB sparse section in front of the manifest: only the header and
    // manifest pages are real data.
    let fixture = std::fs::read(&path).unwrap();
    let bundle = Bundle::from_bytes(fixture).unwrap();
    let mut manifest = bundle.to_manifest().unwrap();
    let hole: u64 = 8 << 30;
    manifest.sections.push(specter_format::SectionEntry {
        name: "hole".into(),
        kind: SectionKind::Other,
        offset: 2 * PAGE,
        length: hole,
        sha256: [0; 32],
    });
    let manifest_bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&manifest).unwrap();
    let manifest_offset = 2 * PAGE + hole;
    let file_len = manifest_offset + manifest_bytes.len() as u64;
    let header = specter_format::Header::new(
        file_len,
        manifest_offset,
        manifest_bytes.len() as u64,
        sha2::Digest::finalize(sha2::Digest::chain_update(
            sha2::Sha256::default(),
            &manifest_bytes,
        ))
        .into(),
    );
    let sparse = dir.path().join("sparse8g.specter");
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::File::create(&sparse).unwrap();
        f.write_all(&header.encode()).unwrap();
        f.write_all(&bundle.as_bytes()[PAGE as usize..2 * PAGE as usize])
            .unwrap();
        f.seek(SeekFrom::Start(manifest_offset)).unwrap();
        f.write_all(&manifest_bytes).unwrap();
    }
    let start = std::time::Instant::now();
    let opened = Bundle::open(&sparse).unwrap();
    let elapsed = start.elapsed();
    assert_eq!(opened.file_len(), file_len);
    assert_eq!(opened.tensor("small").unwrap().bytes, &small[..]);
    assert_eq!(opened.section_bytes(1).len() as u64, hole);
    // Reading 8 GiB (even of holes) takes seconds; open must not come near that.
    assert!(elapsed.as_millis() < 500, "open took {elapsed:?}");
}
