//! Shipping and unshipping: the round trip is byte-identical, and every kind of damage to a
//! shipped file (truncation anywhere, a flipped bit in a chunk, the header or the trailer, a lost
//! chunk) is refused with an error naming where, leaving no output behind.

mod common;

use std::path::{Path, PathBuf};

use common::write_fixture;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter_format::ship::{
    self, NoProgress, ShipOptions, UnshipOptions, CHUNK_HEADER_LEN, MIN_CHUNK_SIZE,
    SHIP_HEADER_LEN, TRAILER_LEN,
};
use specter_format::{Bundle, BundleWriter, FormatError, SectionKind};

struct Case {
    dir: tempfile::TempDir,
    bundle: PathBuf,
    shipped: PathBuf,
}

impl Case {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Names in the directory, sorted.
    fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Unships `bytes` (written as a damaged copy) and returns the error, checking that nothing
    /// but the damaged copy was added to the directory.
    fn unship_err(&self, bytes: &[u8]) -> FormatError {
        let damaged = self.path("damaged.specter.zst");
        std::fs::write(&damaged, bytes).unwrap();
        let before = self.entries();
        let out = self.path("out.specter");
        let err = ship::unship(&damaged, &out, &UnshipOptions::default(), &NoProgress)
            .expect_err("damaged shipped file was accepted");
        assert_eq!(self.entries(), before, "unship left a file behind: {err}");
        std::fs::remove_file(&damaged).unwrap();
        err
    }
}

/// The fixture bundle of every section kind, shipped with the smallest chunks.
fn shipped_fixture(seed: u64, shuffle: bool) -> Case {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("fixture.specter");
    write_fixture(&bundle, seed);
    let shipped = dir.path().join("fixture.specter.zst");
    let opts = ShipOptions {
        chunk_size: MIN_CHUNK_SIZE,
        shuffle,
        ..Default::default()
    };
    ship::ship(&bundle, &shipped, &opts, &NoProgress).unwrap();
    Case {
        dir,
        bundle,
        shipped,
    }
}

/// A bundle whose FP16 section spans several chunks, so that chunks also split sections.
fn write_large_bundle(path: &Path, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut writer = BundleWriter::create(path).unwrap();
    writer.begin_section("shared", SectionKind::Shared).unwrap();
    // Normal-ish FP16 weights: few distinct high bytes, as in real models.
    let weights: Vec<u8> = (0..600_001)
        .flat_map(|_| {
            let v: f32 = (rng.random::<f32>() - 0.5) * 0.04;
            half::f16::from_f32(v).to_le_bytes()
        })
        .collect();
    writer
        .write_tensor("w", specter_format::DType::F16, &[600_001], &weights)
        .unwrap();
    writer.end_section().unwrap();
    writer.begin_section("blob", SectionKind::Other).unwrap();
    let raw: Vec<u8> = (0..200_003).map(|_| rng.random::<u8>()).collect();
    writer.write_raw(&raw).unwrap();
    writer.end_section().unwrap();
    writer
        .finish("test", "{}", common::random_provenance(&mut rng))
        .unwrap();
}

/// Where each chunk record starts in a shipped file, and where the trailer starts.
fn chunk_offsets(bytes: &[u8]) -> (Vec<u64>, u64) {
    let count = u64::from_le_bytes(bytes[40..48].try_into().unwrap());
    let mut at = SHIP_HEADER_LEN as u64;
    let mut offsets = Vec::new();
    for _ in 0..count {
        offsets.push(at);
        let compressed_len = u64::from_le_bytes(
            bytes[at as usize + 32..at as usize + 40]
                .try_into()
                .unwrap(),
        );
        at += CHUNK_HEADER_LEN as u64 + compressed_len;
    }
    assert_eq!(at as usize + TRAILER_LEN, bytes.len());
    (offsets, at)
}

fn assert_round_trip(case: &Case) {
    let out = case.path("rebuilt.specter");
    let report = ship::unship(&case.shipped, &out, &UnshipOptions::default(), &NoProgress).unwrap();
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(&case.bundle).unwrap()
    );
    assert_eq!(
        report.sections_verified,
        Bundle::open(&out).unwrap().section_count()
    );
    std::fs::remove_file(&out).unwrap();
}

#[test]
fn round_trip_is_byte_identical_with_and_without_shuffle() {
    for (seed, shuffle) in [(1, true), (2, false), (3, true)] {
        let case = shipped_fixture(seed, shuffle);
        assert_round_trip(&case);
    }
}

#[test]
fn chunks_split_large_sections_and_fp16_sections_are_shuffled() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("large.specter");
    write_large_bundle(&bundle, 5);
    let mut ratios = Vec::new();
    for shuffle in [false, true] {
        let shipped = dir.path().join(format!("large-{shuffle}.specter.zst"));
        // Chunks much larger than zstd's 128 KiB blocks, so that each plane of a shuffled chunk
        // gets blocks (and entropy tables) of its own: that is where shuffling pays.
        let opts = ShipOptions {
            chunk_size: 1 << 20,
            shuffle,
            ..Default::default()
        };
        let report = ship::ship(&bundle, &shipped, &opts, &NoProgress).unwrap();
        let kind = |name: &str| report.kinds.iter().find(|k| k.kind == name).unwrap();
        let shared = kind("shared");
        // 1 200 002 bytes of FP16 (and padding) in 1 MiB chunks.
        assert_eq!(shared.chunks, 2, "{report:?}");
        assert_eq!(shared.shuffled, if shuffle { 2 } else { 0 });
        // Raw bytes are never shuffled.
        assert_eq!(kind("other").shuffled, 0);
        assert_eq!(
            report.kinds.iter().map(|k| k.bytes).sum::<u64>(),
            report.original_len
        );
        assert_eq!(
            report.shipped_len,
            std::fs::metadata(&shipped).unwrap().len()
        );
        ratios.push(shared.ratio());
        let case = Case {
            dir: tempfile::tempdir().unwrap(),
            bundle: bundle.clone(),
            shipped,
        };
        assert_round_trip(&case);
    }
    // The sign-and-exponent plane compresses far better on its own.
    assert!(
        ratios[1] > ratios[0] * 1.05,
        "shuffled {} vs plain {}",
        ratios[1],
        ratios[0]
    );
}

#[test]
fn truncation_anywhere_is_detected_and_named() {
    let case = shipped_fixture(7, true);
    let bytes = std::fs::read(&case.shipped).unwrap();
    let (chunks, trailer) = chunk_offsets(&bytes);
    assert!(chunks.len() >= 4, "{} chunks", chunks.len());
    let cases: Vec<(u64, &str)> = vec![
        (0, "inside its 128-byte header"),
        (5, "inside its 128-byte header"),
        (SHIP_HEADER_LEN as u64 - 1, "inside its 128-byte header"),
        (SHIP_HEADER_LEN as u64, "where chunk 0 of"),
        (chunks[0] + 50, "inside the header of chunk 0"),
        (
            chunks[0] + CHUNK_HEADER_LEN as u64 + 1,
            "inside the payload of chunk 0",
        ),
        (chunks[2], "where chunk 2 of"),
        (chunks[3] - 1, "inside the payload of chunk 2"),
        (trailer, "where the trailer should start"),
        (trailer + 40, "inside the trailer"),
        (bytes.len() as u64 - 1, "inside the trailer"),
    ];
    for (len, needle) in cases {
        let err = case.unship_err(&bytes[..len as usize]);
        let message = err.to_string();
        assert!(
            matches!(err.root(), FormatError::ShippedTruncated { at, .. } if *at == len),
            "cut at {len}: {message}"
        );
        assert!(message.contains(needle), "cut at {len}: {message}");
        assert!(message.contains("damaged.specter.zst"), "{message}");
    }
}

#[test]
fn a_flipped_bit_in_a_chunk_payload_names_that_chunk() {
    let case = shipped_fixture(8, true);
    let bytes = std::fs::read(&case.shipped).unwrap();
    let (chunks, trailer) = chunk_offsets(&bytes);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (index, &start) in chunks.iter().enumerate() {
        let end = chunks.get(index + 1).copied().unwrap_or(trailer);
        let payload = start + CHUNK_HEADER_LEN as u64;
        let at = rng.random_range(payload..end) as usize;
        let mut damaged = bytes.clone();
        damaged[at] ^= 1 << rng.random_range(0..8);
        let err = case.unship_err(&damaged);
        match err.root() {
            FormatError::ChunkCorrupt {
                index: i, offset, ..
            } => {
                assert_eq!((*i, *offset), (index as u64, start), "{err}");
            }
            other => panic!("flip at {at}: {other}"),
        }
        let message = err.to_string();
        assert!(
            message.contains(&format!("chunk {index} of {}", chunks.len()))
                && message.contains(&format!("at byte {start}")),
            "{message}"
        );
    }
}

#[test]
fn a_flipped_bit_in_a_chunk_header_names_that_chunk() {
    let case = shipped_fixture(9, true);
    let bytes = std::fs::read(&case.shipped).unwrap();
    let (chunks, _) = chunk_offsets(&bytes);
    // Every field of chunk 1's header: magic, flags, index, offset, lengths, both hashes.
    for byte in [0usize, 4, 8, 16, 24, 32, 40, 71, 72, 103] {
        let mut damaged = bytes.clone();
        damaged[chunks[1] as usize + byte] ^= 0x10;
        let err = case.unship_err(&damaged);
        assert!(
            matches!(err.root(), FormatError::ChunkCorrupt { index: 1, .. }),
            "byte {byte} of chunk 1's header: {err}"
        );
    }
}

#[test]
fn a_flipped_bit_in_the_header_or_trailer_is_detected() {
    let case = shipped_fixture(10, false);
    let bytes = std::fs::read(&case.shipped).unwrap();
    let (_, trailer) = chunk_offsets(&bytes);
    for byte in [10usize, 24, 40, 60, 100, 127] {
        let mut damaged = bytes.clone();
        damaged[byte] ^= 0x01;
        let err = case.unship_err(&damaged);
        assert!(
            matches!(err.root(), FormatError::ShippedHeaderCorrupt(_)),
            "header byte {byte}: {err}"
        );
    }
    let mut damaged = bytes.clone();
    damaged[0] ^= 0x01;
    assert!(matches!(
        case.unship_err(&damaged).root(),
        FormatError::NotShipped { .. }
    ));
    for byte in [0usize, 8, 20, 30, 50, 90] {
        let mut damaged = bytes.clone();
        damaged[trailer as usize + byte] ^= 0x01;
        let err = case.unship_err(&damaged);
        assert!(
            matches!(err.root(), FormatError::ShippedTrailer { .. }),
            "trailer byte {byte}: {err}"
        );
    }
    let mut appended = bytes.clone();
    appended.extend_from_slice(b"junk");
    let err = case.unship_err(&appended);
    assert!(err.to_string().contains("4 bytes follow it"), "{err}");
}

#[test]
fn a_missing_or_repeated_chunk_is_detected() {
    let case = shipped_fixture(11, true);
    let bytes = std::fs::read(&case.shipped).unwrap();
    let (chunks, _) = chunk_offsets(&bytes);
    let (a, b) = (chunks[1] as usize, chunks[2] as usize);
    // Chunk 1 dropped: chunk 2 is found where chunk 1 should be.
    let mut dropped = bytes[..a].to_vec();
    dropped.extend_from_slice(&bytes[b..]);
    let err = case.unship_err(&dropped);
    assert!(
        matches!(err.root(), FormatError::ChunkCorrupt { index: 1, .. })
            && err
                .to_string()
                .contains("missing, repeated or out of order"),
        "{err}"
    );
    // Chunk 1 repeated.
    let mut repeated = bytes[..b].to_vec();
    repeated.extend_from_slice(&bytes[a..b]);
    repeated.extend_from_slice(&bytes[b..]);
    let err = case.unship_err(&repeated);
    assert!(
        matches!(err.root(), FormatError::ChunkCorrupt { index: 2, .. }),
        "{err}"
    );
}

#[test]
fn a_corrupt_bundle_is_refused_by_ship_or_caught_by_unship() {
    let case = shipped_fixture(12, true);
    let bytes = std::fs::read(&case.bundle).unwrap();
    let bundle = Bundle::open(&case.bundle).unwrap();
    let index = bundle.find_section_named("experts.1").unwrap_or(1);
    let name = bundle.to_manifest().unwrap().sections[index].name.clone();
    let at = bundle.to_manifest().unwrap().sections[index].offset as usize + 3;
    drop(bundle);
    let mut damaged = bytes.clone();
    damaged[at] ^= 0x40;
    let corrupt = case.path("corrupt.specter");
    std::fs::write(&corrupt, &damaged).unwrap();

    // Verified before shipping (the default): refused, naming the section, nothing written.
    let out = case.path("corrupt.specter.zst");
    let err = ship::ship(&corrupt, &out, &ShipOptions::default(), &NoProgress).unwrap_err();
    assert!(
        matches!(err.root(), FormatError::SectionChecksum { names } if names.len() == 1 && names[0] == name),
        "{err}"
    );
    assert!(!out.exists());

    // Shipped without verifying: every chunk matches its own checksums, and unship's final
    // verification names the section, leaving nothing behind.
    let opts = ShipOptions {
        verify: false,
        ..Default::default()
    };
    ship::ship(&corrupt, &out, &opts, &NoProgress).unwrap();
    let shipped = std::fs::read(&out).unwrap();
    let err = case.unship_err(&shipped);
    match err.root() {
        FormatError::UnshippedInvalid(inner) => assert!(
            matches!(&**inner, FormatError::SectionChecksum { names } if names.len() == 1 && names[0] == name),
            "{err}"
        ),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains(&name), "{err}");
}

#[test]
fn outputs_are_not_replaced_without_force_and_never_the_input() {
    let case = shipped_fixture(13, true);
    let existing = case.path("existing.specter");
    std::fs::write(&existing, b"keep me").unwrap();
    let err = ship::unship(
        &case.shipped,
        &existing,
        &UnshipOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(err, FormatError::OutputExists { .. }), "{err}");
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me");
    let err = ship::ship(
        &case.bundle,
        &existing,
        &ShipOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(err, FormatError::OutputExists { .. }), "{err}");
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me");

    ship::unship(
        &case.shipped,
        &existing,
        &UnshipOptions { force: true },
        &NoProgress,
    )
    .unwrap();
    assert_eq!(
        std::fs::read(&existing).unwrap(),
        std::fs::read(&case.bundle).unwrap()
    );

    let force = ShipOptions {
        force: true,
        ..Default::default()
    };
    let err = ship::ship(&case.bundle, &case.bundle, &force, &NoProgress).unwrap_err();
    assert!(matches!(err, FormatError::OutputIsInput { .. }), "{err}");
    let err = ship::unship(
        &case.shipped,
        &case.shipped,
        &UnshipOptions { force: true },
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(err, FormatError::OutputIsInput { .. }), "{err}");
}

#[test]
fn bad_options_and_foreign_inputs_are_refused() {
    let case = shipped_fixture(14, true);
    let out = case.path("x.specter.zst");
    for opts in [
        ShipOptions {
            chunk_size: MIN_CHUNK_SIZE - 1,
            ..Default::default()
        },
        ShipOptions {
            level: 1000,
            ..Default::default()
        },
    ] {
        let err = ship::ship(&case.bundle, &out, &opts, &NoProgress).unwrap_err();
        assert!(matches!(err, FormatError::InvalidOption(_)), "{err}");
    }
    // A bundle is not a shipped file.
    let err = case.unship_err(&std::fs::read(&case.bundle).unwrap());
    assert!(
        matches!(err.root(), FormatError::NotShipped { .. }),
        "{err}"
    );
    assert!(!out.exists());
}
