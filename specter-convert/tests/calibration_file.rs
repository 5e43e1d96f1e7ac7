//! Reading a calibration file (GPTQ calibration and the probe read them): token-id files, text
//! files through a tokenizer, and the errors for files that are neither.

// The root crate's test helpers: fixtures, found from the repository root.
#[path = "../../tests/common/mod.rs"]
mod common;

use common::Fixture;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::Error;
use specter_convert::pack::read_calibration_tokens;
use tokenizers::Tokenizer;

fn fixture_tokenizer() -> Tokenizer {
    Tokenizer::from_file(Fixture::load("qwen2_moe").dir.join("tokenizer.json")).unwrap()
}

fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn token_id_files_are_read_as_ids_with_any_separators() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_9101);
    let ids: Vec<u32> = (0..50).map(|_| rng.random_range(0..100_000)).collect();
    let mut text = String::new();
    for (i, id) in ids.iter().enumerate() {
        text.push_str(&id.to_string());
        text.push_str([", ", "\n", ",", " \t", "\r\n"][i % 5]);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "ids.txt", text.as_bytes());
    // No tokenizer needed for ids, and the limit keeps a prefix.
    assert_eq!(read_calibration_tokens(&path, None, 1000).unwrap(), ids);
    assert_eq!(read_calibration_tokens(&path, None, 7).unwrap(), ids[..7]);
}

#[test]
fn text_files_are_tokenized_like_a_prompt() {
    let tokenizer = fixture_tokenizer();
    let text = "The quick brown fox jumps over the lazy dog, twice.\nThen it rests.";
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "calib.txt", text.as_bytes());
    let want = tokenizer.encode(text, true).unwrap().get_ids().to_vec();
    assert!(want.len() > 4);
    assert_eq!(
        read_calibration_tokens(&path, Some(&tokenizer), 10_000).unwrap(),
        want
    );
    assert_eq!(
        read_calibration_tokens(&path, Some(&tokenizer), 3).unwrap(),
        want[..3]
    );
}

#[test]
fn unusable_files_are_refused_with_the_reason() {
    let tokenizer = fixture_tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let request = |path: &std::path::Path, tok: Option<&Tokenizer>, needle: &str| {
        let err = read_calibration_tokens(path, tok, 100).unwrap_err();
        let shown = err.to_string();
        assert!(
            shown.contains(needle) && shown.contains(&path.display().to_string()),
            "{shown}"
        );
        err
    };

    let text = write(&dir, "text.txt", b"some words 12 and numbers");
    let err = request(&text, None, "no tokenizer");
    assert!(matches!(err, Error::Request(_)));

    let empty = write(&dir, "empty.txt", b" \n\t ");
    request(&empty, Some(&tokenizer), "empty");

    let negative = write(&dir, "neg.txt", b"5 7 -3 9");
    request(&negative, Some(&tokenizer), "\"-3\"");

    let huge = write(&dir, "huge.txt", b"1,2,4294967296");
    request(&huge, None, "number 3");

    let binary = write(&dir, "bin.dat", &[0x31, 0x20, 0xff, 0xfe, 0x00]);
    request(&binary, Some(&tokenizer), "UTF-8");

    let missing = dir.path().join("absent.txt");
    let err = request(&missing, None, "absent.txt");
    assert!(matches!(err, Error::Io(_)));

    let ids = write(&dir, "ids.txt", b"1 2 3");
    assert!(matches!(
        read_calibration_tokens(&ids, None, 0),
        Err(Error::Request(_))
    ));
}
