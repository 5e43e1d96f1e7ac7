//! `specter-run generate --verify full|manifest|none`: what each mode checks, shown on bundles
//! damaged where only that mode looks.

#[path = "../../specter-pack/tests/common/cli.rs"]
mod cli;
#[path = "../../specter-pack/tests/common/damage.rs"]
mod damage;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cli::{assert_clean_failure, Run};
use specter_convert::pack::{convert, ConvertOptions, Silent};
use specter_format::{Bundle, SectionKind};

struct Converted {
    dir: tempfile::TempDir,
    bundle: PathBuf,
}

/// The qwen2_moe fixture converted once per test binary.
fn converted() -> &'static Converted {
    static ONCE: OnceLock<Converted> = OnceLock::new();
    ONCE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2_moe");
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("qwen2_moe.specter");
        convert(&src, &bundle, &ConvertOptions::default(), &Silent).unwrap();
        Converted { dir, bundle }
    })
}

/// Writes `bytes` as a bundle called `name` next to the converted one.
fn write_bundle(name: &str, bytes: &[u8]) -> PathBuf {
    let path = converted().dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn generate(bundle: &Path, verify: &str) -> Run {
    cli::run(
        env!("CARGO_BIN_EXE_specter-run"),
        &[
            "generate",
            &bundle.display().to_string(),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--mode",
            "target",
            "--verify",
            verify,
        ],
    )
}

/// Generated token ids (the binary prints them comma-separated when it has no text to stream:
/// here it has a tokenizer, so it streams text; any non-empty stdout line means tokens came out).
fn produced_output(run: &Run) -> bool {
    !run.stdout.trim().is_empty()
}

/// The bundle with one bit of the first Experts section's middle byte flipped, written as `name`
/// (each test its own file: tests run in parallel), and that section's name. The low bit of a
/// byte of FP16 weights: the model still loads and runs.
fn with_flipped_expert_byte(name: &str) -> (PathBuf, String) {
    let bytes = std::fs::read(&converted().bundle).unwrap();
    let bundle = Bundle::from_slice(&bytes).unwrap();
    let manifest = bundle.to_manifest().unwrap();
    let section = manifest
        .sections
        .iter()
        .find(|s| matches!(s.kind, SectionKind::Experts { .. }))
        .unwrap();
    let at = section.offset + section.length / 2;
    let path = write_bundle(name, &damage::flip(&bytes, at, 0));
    (path, section.name.clone())
}

#[test]
fn full_refuses_a_flipped_expert_byte_naming_the_section_and_generates_nothing() {
    let (path, section) = with_flipped_expert_byte("flipped-expert.specter");
    let run = generate(&path, "full");
    assert_clean_failure(
        &run,
        &["flipped-expert.specter", "checksum mismatch", &section],
    );
    assert!(!produced_output(&run), "tokens were printed: {run:?}");
}

#[test]
fn manifest_and_none_do_not_hash_sections_so_a_flipped_expert_byte_goes_unnoticed() {
    // Documented behaviour: without --verify full no section is hashed, so a flip inside the
    // FP16 experts is only a slightly different weight, and generation succeeds.
    let (path, _) = with_flipped_expert_byte("flipped-expert-unverified.specter");
    for mode in ["manifest", "none"] {
        let run = generate(&path, mode);
        assert!(run.ok(), "{mode}: {run:?}");
        assert!(produced_output(&run), "{mode}: {run:?}");
    }
}

#[test]
fn full_and_manifest_generate_the_same_tokens_on_a_good_bundle() {
    let bundle = &converted().bundle;
    let full = generate(bundle, "full");
    let manifest = generate(bundle, "manifest");
    assert!(full.ok() && manifest.ok(), "{full:?}\n{manifest:?}");
    assert_eq!(full.stdout, manifest.stdout);
}

#[test]
fn none_skips_the_header_checksum_but_never_the_manifest_structure() {
    let bytes = std::fs::read(&converted().bundle).unwrap();
    // A reserved header byte changed: only the header checksum notices.
    let mut reserved = bytes.clone();
    reserved[100] ^= 0x01;
    let path = write_bundle("reserved-byte.specter", &reserved);
    assert_clean_failure(&generate(&path, "manifest"), &["header checksum mismatch"]);
    assert_clean_failure(&generate(&path, "full"), &["header checksum mismatch"]);
    let run = generate(&path, "none");
    assert!(run.ok() && produced_output(&run), "{run:?}");

    // A section placed outside the file (with consistent checksums): refused in every mode,
    // because reading through such a manifest would leave the mapping.
    let shared = Bundle::from_slice(&bytes)
        .unwrap()
        .to_manifest()
        .unwrap()
        .sections[0]
        .name
        .clone();
    let path = write_bundle(
        "outside.specter",
        &damage::section_outside_file(&bytes, &shared),
    );
    for mode in ["none", "manifest", "full"] {
        assert_clean_failure(&generate(&path, mode), &["lies outside"]);
    }
}

#[test]
fn an_unknown_verify_value_is_a_usage_error() {
    let run = generate(&converted().bundle, "sometimes");
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr
            .contains("invalid value 'sometimes' for '--verify")
            && run.stderr.contains("full")
            && run.stderr.contains("manifest"),
        "{run:?}"
    );
}
