//! `specter-pack inspect BUNDLE --tensors | head` must end quietly when the reader goes away, not
//! panic in println!.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

#[test]
fn inspect_into_a_closed_pipe_does_not_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bundle = dir.path().join("model.specter");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepseek_v2");
    let status = Command::new(env!("CARGO_BIN_EXE_specter-pack"))
        .arg("convert")
        .arg(&fixture)
        .arg("-o")
        .arg(&bundle)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run convert");
    assert!(status.success());

    let mut child = Command::new(env!("CARGO_BIN_EXE_specter-pack"))
        .args(["inspect", "--tensors"])
        .arg(&bundle)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run inspect");
    // Close the reading end at once: inspect's first line meets a closed pipe.
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("stderr");
    child.wait().expect("wait");
    assert!(
        !stderr.contains("panicked"),
        "inspect panicked on a closed pipe:\n{stderr}"
    );
}
