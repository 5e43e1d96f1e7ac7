//! `specter-pack ship` and `unship` from the command line: the round trip, the per-kind report,
//! and clean failures (non-zero exit, a message naming what is wrong, no output left behind).

mod common;

use std::path::{Path, PathBuf};

use common::{assert_clean_failure, entries, pack};
use specter_convert::pack::{convert, ConvertOptions, Silent};

/// The qwen2_moe fixture converted into a bundle in a fresh directory.
fn converted() -> (tempfile::TempDir, PathBuf) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen2_moe");
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("model.specter");
    convert(&src, &bundle, &ConvertOptions::default(), &Silent).unwrap();
    (dir, bundle)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn ship_and_unship_round_trip_and_report_each_kind() {
    let (dir, bundle) = converted();
    let shipped = dir.path().join("model.specter.zst");
    let run = pack(&["ship", &s(&bundle), "-o", &s(&shipped)]);
    assert!(run.ok(), "{run:?}");
    for kind in [
        "header",
        "shared",
        "experts",
        "draft",
        "tokenizer",
        "config",
        "manifest",
    ] {
        assert!(
            run.stdout.lines().any(|l| l.trim_start().starts_with(kind)),
            "no {kind} row: {run:?}"
        );
    }
    let rebuilt = dir.path().join("rebuilt.specter");
    let run = pack(&["unship", &s(&shipped), "-o", &s(&rebuilt)]);
    assert!(run.ok(), "{run:?}");
    assert_eq!(
        std::fs::read(&rebuilt).unwrap(),
        std::fs::read(&bundle).unwrap()
    );

    // --json: the same figures, machine-readable; shuffled chunks only without --no-shuffle.
    for (flag, shuffled) in [(None, true), (Some("--no-shuffle"), false)] {
        let mut args = vec!["ship", "--json", "--force"];
        args.extend(flag);
        let (b, o) = (s(&bundle), s(&shipped));
        args.extend([b.as_str(), "-o", o.as_str()]);
        let run = pack(&args);
        assert!(run.ok(), "{run:?}");
        let record: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
        let kinds = record["kinds"].as_array().unwrap();
        let experts = kinds.iter().find(|k| k["kind"] == "experts").unwrap();
        assert_eq!(
            experts["shuffled_chunks"].as_u64().unwrap() > 0,
            shuffled,
            "{record}"
        );
        let total: u64 = kinds.iter().map(|k| k["bytes"].as_u64().unwrap()).sum();
        assert_eq!(total, std::fs::metadata(&bundle).unwrap().len());
    }
}

#[test]
fn unship_failures_exit_non_zero_and_leave_nothing() {
    let (dir, bundle) = converted();
    let shipped = dir.path().join("model.specter.zst");
    assert!(pack(&["ship", &s(&bundle), "-o", &s(&shipped)]).ok());
    let bytes = std::fs::read(&shipped).unwrap();
    let cut = dir.path().join("cut.specter.zst");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let out = dir.path().join("out.specter");
    let before = entries(dir.path());
    let run = pack(&["unship", &s(&cut), "-o", &s(&out)]);
    assert_clean_failure(
        &run,
        &["cut.specter.zst", "truncated", "copy the file again"],
    );
    assert_eq!(entries(dir.path()), before);

    // A flipped byte in the middle of the file: the chunk holding it is named.
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x20;
    std::fs::write(&cut, &flipped).unwrap();
    let run = pack(&["unship", &s(&cut), "-o", &s(&out)]);
    assert_clean_failure(&run, &["cut.specter.zst", "chunk", "is corrupt"]);
    assert_eq!(entries(dir.path()), before);

    // An existing output is kept unless --force.
    let run = pack(&["unship", &s(&shipped), "-o", &s(&bundle)]);
    assert_clean_failure(&run, &["already exists", "--force"]);
    let run = pack(&["ship", &s(&bundle), "-o", &s(&shipped)]);
    assert_clean_failure(&run, &["already exists", "--force"]);
    let run = pack(&["ship", &s(&bundle), "-o", &s(&shipped), "--chunk-mib", "0"]);
    assert_clean_failure(&run, &["chunk size"]);
    assert_eq!(entries(dir.path()), before);
}
