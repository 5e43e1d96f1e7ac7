//! The README's embedded default, end to end: `specter-run demo` synthesizes, converts, verifies
//! and decodes speculatively, and checks its output against target-only decoding.

use std::process::Command;

fn demo(arch: &str) -> (bool, String, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_specter-run"))
        .args(["demo", "--arch", arch, "--max-new-tokens", "16", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run specter-run demo");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn demo_runs_every_step_and_is_lossless() {
    for arch in ["deepseek_v2", "mixtral"] {
        let (ok, stdout, stderr) = demo(arch);
        assert!(
            ok,
            "{arch}: demo failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        for step in [
            "1. synthesized",
            "2. converted",
            "3. verified",
            "4. backend: ",
            "acceptance",
            "expert cache",
        ] {
            assert!(
                stdout.contains(step),
                "{arch}: missing step {step:?} in\n{stdout}"
            );
        }
        assert!(
            stdout.contains("lossless check: speculative tokens equal target-only tokens"),
            "{arch}: {stdout}"
        );
    }
}

#[test]
fn demo_refuses_an_unknown_architecture() {
    let (ok, stdout, stderr) = demo("gpt2");
    assert!(!ok, "demo accepted gpt2: {stdout}");
    assert!(
        stderr.contains("gpt2") && stderr.contains("deepseek_v2"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
