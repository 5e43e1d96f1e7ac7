//! The checkpoint files a chat front end needs besides tokenizer.json: `tokenizer_config.json`
//! (the chat template and the special tokens it names), `generation_config.json` (end tokens and
//! sampling defaults) and `chat_template.jinja` (where newer checkpoints keep the template).
//! They are stored verbatim as sections named after the file, so `specter-run serve` renders chat
//! messages with the checkpoint's own template.

use std::path::Path;

use specter_format::Bundle;

use crate::{Error, Result};

/// Section (and source file) holding the tokenizer's configuration and chat template.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// Section (and source file) holding the generation defaults.
pub const GENERATION_CONFIG: &str = "generation_config.json";
/// Section (and source file) holding a chat template kept outside tokenizer_config.json.
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";

/// Every chat file, in the order they are written.
pub const CHAT_FILES: [&str; 3] = [TOKENIZER_CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE];

/// Reads the chat files `dir` has, checking that the JSON ones parse (a broken one would only
/// surface when the first chat request arrives).
pub(crate) fn read_chat_files(dir: &Path) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let mut found = Vec::new();
    for name in CHAT_FILES {
        let path = dir.join(name);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        };
        if name.ends_with(".json") {
            serde_json::from_slice::<serde_json::Value>(&bytes)
                .map_err(|e| Error::Model(format!("{}: invalid JSON: {e}", path.display())))?;
        } else if std::str::from_utf8(&bytes).is_err() {
            return Err(Error::Model(format!("{}: not UTF-8 text", path.display())));
        }
        found.push((name, bytes));
    }
    Ok(found)
}

/// The stored bytes of chat file `name` (one of [`CHAT_FILES`]), if the bundle has it.
pub fn chat_file<'a>(bundle: &'a Bundle, name: &str) -> Option<&'a [u8]> {
    bundle
        .find_section_named(name)
        .map(|index| bundle.section_bytes(index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn present_files_are_read_and_broken_json_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read_chat_files(dir.path()).unwrap().is_empty());
        std::fs::write(
            dir.path().join(TOKENIZER_CONFIG),
            b"{\"chat_template\": \"x\"}",
        )
        .unwrap();
        std::fs::write(dir.path().join(CHAT_TEMPLATE), b"{{ messages }}").unwrap();
        let found = read_chat_files(dir.path()).unwrap();
        let names: Vec<&str> = found.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, [TOKENIZER_CONFIG, CHAT_TEMPLATE]);
        std::fs::write(dir.path().join(GENERATION_CONFIG), b"{ broken").unwrap();
        let err = read_chat_files(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(GENERATION_CONFIG) && err.contains("invalid JSON"),
            "{err}"
        );
    }
}
