//! Rules of the source tree that keep it easy to change: no Rust file over 1,000 lines, no
//! `SPECTER_*` environment variable read by a library (the binaries map them onto options), and
//! no import cycle between the files of a crate's `src/` (the root crate's, specter-convert's and
//! specter-run's).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 1000;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') && name != "fixtures" {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_rust_file_is_over_a_thousand_lines() {
    let mut files = Vec::new();
    for dir in [
        "src",
        "tests",
        "examples",
        "specter-format",
        "specter-convert",
        "specter-pack",
        "specter-run",
    ] {
        rust_files(&root().join(dir), &mut files);
    }
    assert!(files.len() > 50, "found only {} Rust files", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).ok()?.lines().count();
            (lines > MAX_LINES).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:?}");
}

/// The files of the library whose root is `lib`: the root and, for each `mod name;` it declares,
/// `name.rs` or the folder `name/` beside it. (specter-run's library shares `src/` with its
/// binary, whose files may read the environment.)
fn library_files(lib: &Path, out: &mut Vec<PathBuf>) {
    let text = std::fs::read_to_string(lib).expect("read the library root");
    let dir = lib.parent().expect("the root's folder");
    out.push(lib.to_path_buf());
    for line in text.lines() {
        let line = line.trim();
        let Some(name) = line
            .strip_prefix("pub mod ")
            .or_else(|| line.strip_prefix("mod "))
            .and_then(|rest| rest.strip_suffix(';'))
        else {
            continue;
        };
        let file = dir.join(format!("{name}.rs"));
        if file.is_file() {
            out.push(file);
        } else {
            assert!(
                dir.join(name).is_dir(),
                "no file for `mod {name};` in {}",
                lib.display()
            );
            rust_files(&dir.join(name), out);
        }
    }
}

#[test]
fn libraries_read_no_specter_environment_variables() {
    let mut files = Vec::new();
    for dir in ["src", "specter-format/src", "specter-convert/src"] {
        rust_files(&root().join(dir), &mut files);
    }
    let before = files.len();
    library_files(&root().join("specter-run/src/lib.rs"), &mut files);
    assert!(
        files.len() > before + 5,
        "found only {} files of specter-run's library",
        files.len() - before
    );
    let needle = ["env::var", "(\"SPECTER_"].concat();
    let needle_os = ["env::var_os", "(\"SPECTER_"].concat();
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| {
            std::fs::read_to_string(f)
                .is_ok_and(|text| text.contains(&needle) || text.contains(&needle_os))
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        offenders.is_empty(),
        "library files reading SPECTER_* variables (map them in the binaries instead): {offenders:?}"
    );
}

/// Module path (`backend::cuda::moe`) of each file under `src`.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(src).expect("under src").with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            (parts.join("::"), f)
        })
        .collect()
}

/// The longest module that a `crate::`/`super::`/`self::` path written in `module` names.
fn resolve(module: &str, path: &[&str], known: &BTreeMap<String, PathBuf>) -> Option<String> {
    let mut base: Vec<&str> = if module.is_empty() {
        Vec::new()
    } else {
        module.split("::").collect()
    };
    let mut rest = path;
    match *rest.first()? {
        "crate" => base.clear(),
        "self" => {}
        "super" => {
            base.pop();
        }
        _ => return None,
    }
    rest = &rest[1..];
    while rest.first() == Some(&"super") {
        base.pop();
        rest = &rest[1..];
    }
    (0..=rest.len()).rev().find_map(|n| {
        let candidate: Vec<&str> = base.iter().chain(&rest[..n]).copied().collect();
        let name = candidate.join("::");
        known.contains_key(&name).then_some(name)
    })
}

/// Paths a file names, `use` groups expanded (`use super::{a, b::c}` gives `super::a`,
/// `super::b::c`); test modules are left out.
fn named_paths(text: &str) -> Vec<Vec<String>> {
    let text = text.split("#[cfg(test)]").next().unwrap_or(text);
    let mut out = Vec::new();
    let bytes: Vec<char> = text.chars().collect();
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut i = 0;
    while i < bytes.len() {
        let starts = ["crate::", "super::", "self::"]
            .iter()
            .any(|p| text_at(&bytes, i).starts_with(p))
            && (i == 0 || !is_ident(bytes[i - 1]));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < bytes.len() && (is_ident(bytes[j]) || bytes[j] == ':') {
            j += 1;
        }
        let prefix: String = bytes[i..j].iter().collect();
        let prefix: Vec<String> = prefix
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if j < bytes.len() && bytes[j] == '{' {
            let close = (j..bytes.len())
                .find(|&k| bytes[k] == '}')
                .unwrap_or(bytes.len());
            let group: String = bytes[j + 1..close].iter().collect();
            for item in group.split(',') {
                let item = item.split_whitespace().next().unwrap_or("");
                if item.is_empty() {
                    continue;
                }
                let mut full = prefix.clone();
                full.extend(item.split("::").map(str::to_string));
                out.push(full);
            }
            i = close;
        } else {
            out.push(prefix);
            i = j;
        }
    }
    out
}

fn text_at(chars: &[char], at: usize) -> String {
    chars[at..chars.len().min(at + 8)].iter().collect()
}

/// The import cycles between the files under `src` (one crate's, or a library's and its binary's,
/// whose module names differ), and how many imports between them were found.
fn import_cycles(src: &Path) -> (usize, Vec<String>) {
    let known = modules(src);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, file) in &known {
        let text = std::fs::read_to_string(file).expect("read");
        let targets = edges.entry(module.clone()).or_default();
        for path in named_paths(&text) {
            let path: Vec<&str> = path.iter().map(String::as_str).collect();
            if let Some(target) = resolve(module, &path, &known) {
                // A file naming its own ancestors (a parent module's re-exports) is no cycle.
                let ancestor = target.is_empty() || module.starts_with(&format!("{target}::"));
                if target != *module && !ancestor {
                    targets.insert(target);
                }
            }
        }
    }
    // A cycle exists when some module reaches itself.
    let mut cycles = Vec::new();
    for start in edges.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((at, trail)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    cycles.push(trail.join(" -> ") + " -> " + start);
                } else if seen.insert(next.clone()) {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    (edges.values().map(BTreeSet::len).sum(), cycles)
}

#[test]
fn files_of_each_crate_import_each_other_without_cycles() {
    // Each crate's files import each other more often than this; fewer means the parser broke.
    for (dir, floor) in [
        ("src", 50),
        ("specter-convert/src", 3),
        ("specter-run/src", 6),
    ] {
        let (imports, cycles) = import_cycles(&root().join(dir));
        assert!(
            imports > floor,
            "the import graph of {dir} looks empty: the parser found {imports} imports"
        );
        assert!(
            cycles.is_empty(),
            "import cycles between files of {dir}: {cycles:#?}"
        );
    }
}
