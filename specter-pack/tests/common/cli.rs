//! Running a binary of the workspace and checking how it failed.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::process::Command;

/// Exit status and output of one run of a binary.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

pub fn run<S: AsRef<OsStr>>(program: &str, args: &[S]) -> Run {
    let out = Command::new(program)
        .args(args)
        // Backtraces would show up as panics do; a clean error needs neither.
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .expect("the binary runs");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A failed run: non-zero exit (not a signal), no panic, and an `error:` line on stderr that
/// contains every one of `needles`.
pub fn assert_clean_failure(run: &Run, needles: &[&str]) {
    assert!(
        matches!(run.code, Some(c) if c != 0),
        "expected a non-zero exit: {run:?}"
    );
    for text in [&run.stdout, &run.stderr] {
        assert!(
            !text.contains("panicked") && !text.contains("RUST_BACKTRACE"),
            "the failure panicked: {run:?}"
        );
    }
    let error = run
        .stderr
        .lines()
        .find(|l| l.starts_with("error"))
        .unwrap_or_else(|| panic!("no error line on stderr: {run:?}"));
    for needle in needles {
        assert!(
            error.contains(needle),
            "the error does not mention {needle:?}: {run:?}"
        );
    }
    assert_no_repeated_clause(error);
}

/// An error message says each thing once: no clause of some length appears twice (as happens when
/// an error's text already includes its cause and the cause is printed again).
pub fn assert_no_repeated_clause(message: &str) {
    let clauses: Vec<&str> = message
        .split([':', ';'])
        .map(str::trim)
        .filter(|c| c.len() >= 16)
        .collect();
    for (i, c) in clauses.iter().enumerate() {
        assert!(
            !clauses[i + 1..].contains(c),
            "the message repeats {c:?}: {message}"
        );
    }
}
