//! `specter-pack verify` and `inspect` on damaged bundles: each kind of damage gives a non-zero
//! exit and a message that names what is damaged, without a panic. The bundle is converted once
//! from a checkpoint made by transformers (tests/fixtures/deepseek_v2).

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::damage;
use common::{assert_clean_failure, pack, Run};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter_format::HEADER_LEN;

struct Converted {
    dir: tempfile::TempDir,
    bytes: Vec<u8>,
}

fn converted() -> &'static Converted {
    static ONCE: OnceLock<Converted> = OnceLock::new();
    ONCE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepseek_v2");
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("good.specter");
        let run = pack(&[
            "convert".as_ref(),
            src.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
        ]);
        assert!(run.ok(), "{run:?}");
        let bytes = std::fs::read(&out).unwrap();
        Converted { dir, bytes }
    })
}

/// Writes `bytes` as a new file named `name` next to the good bundle.
fn damaged(name: &str, bytes: &[u8]) -> PathBuf {
    let path = converted().dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn verify(path: &Path) -> Run {
    pack(&["verify".as_ref(), path.as_os_str()])
}

fn inspect(path: &Path) -> Run {
    pack(&["inspect".as_ref(), path.as_os_str()])
}

/// Both `verify` and `inspect` refuse the file with an error naming it and mentioning `needles`.
fn assert_refused(path: &Path, needles: &[&str]) {
    let mut all = vec![path.to_str().unwrap()];
    all.extend(needles);
    for run in [
        verify(path),
        inspect(path),
        pack(&["inspect".as_ref(), path.as_os_str(), "--json".as_ref()]),
    ] {
        assert_clean_failure(&run, &all);
        assert!(run.stdout.is_empty(), "{run:?}");
    }
}

/// The sections `verify` reports as mismatched.
fn reported_sections(run: &Run) -> Vec<String> {
    run.stdout
        .lines()
        .filter_map(|l| {
            let rest = l.split(": section ").nth(1)?;
            rest.contains("checksum mismatch")
                .then(|| rest.split(' ').next().unwrap().to_string())
        })
        .collect()
}

#[test]
fn the_good_bundle_verifies_and_inspects() {
    let path = converted().dir.path().join("good.specter");
    let run = verify(&path);
    assert!(run.ok(), "{run:?}");
    assert!(reported_sections(&run).is_empty());
    let run = inspect(&path);
    assert!(run.ok(), "{run:?}");
    assert!(run.stdout.contains("architecture deepseek_v2"), "{run:?}");
    assert!(run.stdout.contains("target       FP16 experts"), "{run:?}");
    assert!(run.stdout.contains("draft        INT4 rtn"), "{run:?}");
    let bundle = specter_format::Bundle::open(&path).unwrap();
    let manifest = bundle.to_manifest().unwrap();
    for section in &manifest.sections {
        assert!(
            run.stdout.contains(&format!("  {} ", section.name)),
            "{}: {run:?}",
            section.name
        );
    }
    assert!(
        run.stdout.contains(&format!(
            "{} tensors, {} target expert blobs",
            manifest.tensors.len(),
            manifest.experts.len()
        )),
        "{run:?}"
    );
    // --tensors lists every tensor with its dtype and shape.
    let run = pack(&["inspect".as_ref(), path.as_os_str(), "--tensors".as_ref()]);
    assert!(run.ok(), "{run:?}");
    for t in &manifest.tensors {
        let line = run
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(t.name.as_str()))
            .unwrap_or_else(|| panic!("{} not listed: {run:?}", t.name));
        assert!(line.contains(t.dtype.name()), "{line}");
        assert!(line.contains(&format!("{:?}", t.shape)), "{line}");
    }
}

#[test]
fn a_flipped_bit_in_each_section_is_named_by_verify_and_nothing_else_is() {
    let good = &converted().bytes;
    let manifest = damage::manifest(good);
    assert!(manifest.sections.len() >= 7, "{:?}", manifest.sections);
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for section in &manifest.sections {
        let at = section.offset + rng.random_range(0..section.length);
        let bytes = damage::flip(good, at, rng.random_range(0..8));
        let path = damaged(&format!("flip-{}.specter", section.name), &bytes);
        let run = verify(&path);
        assert_eq!(run.code, Some(1), "{}: {run:?}", section.name);
        assert_eq!(
            reported_sections(&run),
            vec![section.name.clone()],
            "byte {at}: {run:?}"
        );
        assert!(run.stdout.contains("FAILED: 1 of"), "{run:?}");
        assert!(!run.stdout.contains("manifest checksum"), "{run:?}");
        assert!(!run.stderr.contains("panicked"), "{run:?}");
    }
}

#[test]
fn a_flipped_bit_in_the_manifest_or_header_is_refused() {
    let good = &converted().bytes;
    let header = specter_format::Header::decode(good).unwrap();
    let at = header.manifest_offset + header.manifest_len / 3;
    let path = damaged("flip-manifest.specter", &damage::flip(good, at, 5));
    assert_refused(&path, &["manifest checksum mismatch"]);
    for at in [40u64, 300, HEADER_LEN as u64 - 1] {
        let path = damaged("flip-header.specter", &damage::flip(good, at, 2));
        assert_refused(&path, &["header checksum mismatch"]);
    }
}

#[test]
fn a_truncated_file_is_refused() {
    let good = &converted().bytes;
    for len in [good.len() - 1, good.len() / 2, HEADER_LEN + 7, 100, 0] {
        let path = damaged("cut.specter", &damage::truncated(good, len));
        let needle = if len >= HEADER_LEN {
            "truncated"
        } else {
            "bundle"
        };
        assert_refused(&path, &[needle]);
    }
}

#[test]
fn a_wrong_magic_is_refused() {
    let path = damaged("magic.specter", &damage::wrong_magic(&converted().bytes));
    assert_refused(&path, &["not a Specter bundle", "SPECTER"]);
    // A file that is not a bundle at all.
    let json =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepseek_v2/config.json");
    assert_refused(&json, &["not a Specter bundle"]);
}

#[test]
fn a_newer_major_version_is_refused() {
    let path = damaged("v3.specter", &damage::newer_major(&converted().bytes));
    assert_refused(
        &path,
        &["version 3.x", "newer than this build supports (2.x)"],
    );
}

#[test]
fn a_precision_that_does_not_match_the_sections_is_refused() {
    // The bundle holds FP16 experts and 4-bit drafts; its manifest is edited to say otherwise.
    let good = &converted().bytes;
    for (target_bits, draft_bits, needles) in [
        (8, 4, &["expert precision", "experts.1", "8-bit"][..]),
        (16, 2, &["expert precision", "draft.1", "2-bit"][..]),
        (4, 4, &["expert precision", "no smaller"][..]),
    ] {
        let mut m = damage::manifest(good);
        m.precision.target_bits = target_bits;
        m.precision.draft_bits = draft_bits;
        let path = damaged(
            &format!("precision-{target_bits}-{draft_bits}.specter"),
            &damage::with_manifest(good, &m),
        );
        assert_refused(&path, needles);
    }
}

#[test]
fn manifest_ranges_outside_the_file_are_refused() {
    let good = &converted().bytes;
    let path = damaged(
        "section-out.specter",
        &damage::section_outside_file(good, "draft.1"),
    );
    assert_refused(&path, &["draft.1", "lies outside"]);
    let tensor = "model.layers.2.mlp.experts.3.up_proj.weight";
    let path = damaged(
        "tensor-out.specter",
        &damage::tensor_outside_file(good, tensor),
    );
    assert_refused(&path, &[tensor, "lies outside"]);
}

#[test]
fn a_directory_or_missing_file_is_refused() {
    let dir = converted().dir.path();
    assert_refused(dir, &["not a regular file"]);
    let missing = dir.join("missing.specter");
    assert_refused(&missing, &["No such file"]);
}
