//! The sha256 the writer records for each section (computed off the writing thread, from the file
//! read back) is that of exactly the bytes the section holds, whatever its size and shape.

mod common;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};
use specter_format::{Bundle, BundleWriter, DType, SectionKind, PAGE, TENSOR_ALIGN};

/// Appends zeros to `bytes` until its length is a multiple of `align`: sections start on a page,
/// so alignment inside a section is alignment of its length so far.
fn pad(bytes: &mut Vec<u8>, align: u64) {
    while !(bytes.len() as u64).is_multiple_of(align) {
        bytes.push(0);
    }
}

/// Writes sections of odd sizes (empty, one byte, around a page, around the read-back chunk, and
/// random) of every content shape: raw bytes streamed in pieces, unaligned tensors, expert blobs.
/// Returns each section's name and the bytes it must hold.
fn write_odd_sections(writer: &mut BundleWriter, rng: &mut ChaCha8Rng) -> Vec<(String, Vec<u8>)> {
    let mut expected = Vec::new();
    let raw_sizes = [
        0usize,
        1,
        63,
        4095,
        4096,
        4097,
        (8 << 20) + 4097,
        rng.random_range(1..300_000),
    ];
    for (i, size) in raw_sizes.into_iter().enumerate() {
        let name = format!("raw.{i}");
        let bytes = common::random_bytes(rng, size);
        writer.begin_section(&name, SectionKind::Other).unwrap();
        // Streamed in random pieces, as a caller copying a large file would.
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let n = rng.random_range(1..=rest.len().min(1 << 21));
            writer.write_raw(&rest[..n]).unwrap();
            rest = &rest[n..];
        }
        writer.end_section().unwrap();
        expected.push((name, bytes));
    }

    let mut shared = Vec::new();
    writer.begin_section("shared", SectionKind::Shared).unwrap();
    for t in 0..rng.random_range(3..9) {
        let len = rng.random_range(1..5000usize);
        let bytes = common::random_bytes(rng, len);
        pad(&mut shared, TENSOR_ALIGN);
        shared.extend_from_slice(&bytes);
        writer
            .write_tensor(&format!("shared.{t}"), DType::U8, &[len as u64], &bytes)
            .unwrap();
    }
    writer.end_section().unwrap();
    expected.push(("shared".into(), shared));

    for layer in 0..2u32 {
        let name = format!("experts.{layer}");
        let mut section = Vec::new();
        writer
            .begin_section(&name, SectionKind::Experts { layer })
            .unwrap();
        for e in 0..rng.random_range(1..5u32) {
            writer.begin_expert(layer, e).unwrap();
            pad(&mut section, PAGE);
            for proj in ["gate", "up", "down"] {
                let rows = rng.random_range(1..40u64);
                let cols = rng.random_range(1..40u64);
                let bytes = common::random_bytes(rng, (rows * cols * 2) as usize);
                pad(&mut section, TENSOR_ALIGN);
                section.extend_from_slice(&bytes);
                writer
                    .write_tensor(
                        &format!("l{layer}.e{e}.{proj}"),
                        DType::F16,
                        &[rows, cols],
                        &bytes,
                    )
                    .unwrap();
            }
            writer.end_expert().unwrap();
        }
        writer.end_section().unwrap();
        expected.push((name, section));
    }
    expected
}

#[test]
fn section_hashes_are_sha256_of_exactly_the_section_bytes() {
    for seed in [11u64, 12] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("odd.specter");
        let mut writer = BundleWriter::create(&path).unwrap();
        let expected = write_odd_sections(&mut writer, &mut rng);
        let provenance = common::random_provenance(&mut rng);
        writer.finish("odd", "{}", provenance).unwrap();

        let bundle = Bundle::open(&path).unwrap();
        let manifest = bundle.to_manifest().unwrap();
        assert_eq!(manifest.sections.len(), expected.len());
        for (i, (entry, (name, bytes))) in manifest.sections.iter().zip(&expected).enumerate() {
            assert_eq!(&entry.name, name);
            assert_eq!(entry.length, bytes.len() as u64, "section {name}");
            assert_eq!(bundle.section_bytes(i), &bytes[..], "section {name}");
            let independent: [u8; 32] = Sha256::digest(bytes).into();
            assert_eq!(entry.sha256, independent, "section {name} (seed {seed})");
        }
        let report = bundle.verify();
        assert!(report.is_ok(), "{:?}", report.bad_sections());
    }
}

#[test]
fn writing_inside_a_one_thread_pool_does_not_wait_on_queued_hashes() {
    // The only worker is the one writing, so no queued hashing job can run before `finish`:
    // `finish` must hash them itself rather than wait for them.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("one-thread.specter");
    pool.install(|| {
        common::write_fixture(&path, 21);
    });
    let bundle = Bundle::open(&path).unwrap();
    assert!(bundle.verify().is_ok());

    // Dropping an unfinished writer with queued hashes neither hangs nor leaves the temp file.
    let unfinished = dir.path().join("unfinished.specter");
    pool.install(|| {
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        let mut writer = BundleWriter::create(&unfinished).unwrap();
        write_odd_sections(&mut writer, &mut rng);
        drop(writer);
    });
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["one-thread.specter".to_string()]);
}
