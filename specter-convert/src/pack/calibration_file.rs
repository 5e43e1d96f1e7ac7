//! Calibration sequences from a file: token ids, or text through the checkpoint's tokenizer. GPTQ
//! calibration reads them, and so does `specter-run probe` for its teacher-forced sequence.

use std::path::Path;

use crate::{Error, Result};

/// Reads a calibration sequence from `path`: either token ids (a file holding only integers
/// separated by whitespace and/or commas) or text, tokenized with `tokenizer` (special tokens
/// such as BOS added as its post-processor says). At most `max_tokens` tokens are kept.
pub fn read_calibration_tokens(
    path: &Path,
    tokenizer: Option<&tokenizers::Tokenizer>,
    max_tokens: usize,
) -> Result<Vec<u32>> {
    if max_tokens == 0 {
        return Err(Error::Request(
            "the calibration token limit must be at least 1".into(),
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(path.display(), e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::Request(format!(
            "{}: not UTF-8 text (byte {}): give text or token ids",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    if text.trim().is_empty() {
        return Err(Error::Request(format!(
            "{}: the calibration file is empty",
            path.display()
        )));
    }
    let mut ids = match parse_token_ids(&text) {
        Some(parsed) => parsed.map_err(|e| Error::Request(format!("{}: {e}", path.display())))?,
        None => {
            let tokenizer = tokenizer.ok_or_else(|| {
                Error::Request(format!(
                    "{}: holds text, and there is no tokenizer to encode it: give token ids \
                     (integers separated by spaces or commas) instead",
                    path.display()
                ))
            })?;
            tokenizer
                .encode(text.as_str(), true)
                .map_err(|e| Error::Request(format!("{}: cannot tokenize: {e}", path.display())))?
                .get_ids()
                .to_vec()
        }
    };
    ids.truncate(max_tokens);
    Ok(ids)
}

/// `Some` when `text` consists only of integers separated by whitespace and/or commas (then the
/// ids, or which one is not a valid u32 id); `None` when it is text.
pub fn parse_token_ids(text: &str) -> Option<std::result::Result<Vec<u32>, String>> {
    let fields: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|f| !f.is_empty())
        .collect();
    let integer_like = |f: &&str| {
        let digits = f.strip_prefix(['-', '+']).unwrap_or(f);
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
    };
    if fields.is_empty() || !fields.iter().all(integer_like) {
        return None;
    }
    Some(
        fields
            .iter()
            .enumerate()
            .map(|(i, f)| {
                f.parse::<u32>()
                    .map_err(|_| format!("token id {f:?} (number {}) is not a valid id", i + 1))
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_id_files_are_told_from_text() {
        assert_eq!(
            parse_token_ids("1, 2,3\n 40\t5,\n"),
            Some(Ok(vec![1, 2, 3, 40, 5]))
        );
        assert_eq!(parse_token_ids("hello 1 2"), None);
        assert_eq!(parse_token_ids(" \n"), None);
        let err = parse_token_ids("3 -1 4").and_then(|r| r.err());
        assert!(err.is_some_and(|e| e.contains("\"-1\"") && e.contains("number 2")));
        assert!(parse_token_ids("99999999999").is_some_and(|r| r.is_err()));
    }
}
